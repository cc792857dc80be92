"""The lean decode step's GEMMs: torch's float32 `F.linear` (its BLAS) against the same products
on oneDNN copies of the weights (`serving.onednn.OneDnnWeights`), in one process.

Shapes are the ~124M serving model's experts (`TinyModelSettings.large()`: 6 layers x 8 experts,
gate/up 768 -> 2048, down 1024 -> 768), every expert's pair of matrices once per pass, for
1 to 256 tokens per expert: a decode step of 32 rows puts ~8 on each, a prefill hundreds. A
pass touches ~450 MB of weights, more than the caches hold, as a decode step does. Best of
`--runs`, on torch's default threads (what the engine uses for a model this size).

    .venv/bin/python bench/onednn.py      # ~30 s
The last line is one JSON object: {"bench": "onednn", "ms": {"blas": {m: ..}, "onednn": {..}},
"ratio": {m: blas / onednn}}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.onednn import OneDnnWeights  # noqa: E402


def best_ms(fn: Callable[[], object], runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", default="1,8,32,256", help="tokens per expert")
    args = parser.parse_args()
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch build has no oneDNN")
    torch.manual_seed(0)
    layers, experts, hidden, inner = 6, 8, 768, 1024
    weights = [w for _ in range(layers * experts)
               for w in (torch.randn(2 * inner, hidden), torch.randn(hidden, inner))]
    onednn = OneDnnWeights()  # its copies are made in the untimed first pass
    result: dict[str, dict[str, dict[int, float]] | dict[int, float] | str] = {
        "bench": "onednn", "ms": {"blas": {}, "onednn": {}}, "ratio": {}}
    with torch.inference_mode():
        for m in (int(t) for t in args.tokens.split(",")):
            xs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights[:2]}
            pairs = [(w, xs[w.shape[1]]) for w in weights]
            blas = best_ms(lambda p=pairs: [F.linear(x, w) for w, x in p], args.runs)
            ours = best_ms(lambda p=pairs: [onednn.linear(w, x) for w, x in p], args.runs)
            result["ms"]["blas"][m], result["ms"]["onednn"][m] = round(blas, 2), round(ours, 2)
            result["ratio"][m] = round(blas / ours, 2)
            print(f"{m:4d} tokens per expert: BLAS {blas:7.2f} ms, oneDNN {ours:7.2f} ms "
                  f"per pass ({blas / ours:.2f}x)", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
