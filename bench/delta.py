"""Release size and sync time: Flywheel's sparse delta against XOR + zstd-1 and full zstd.

A realistic RL release: a 126M-parameter Qwen3 (random init, fixed seed, no downloads); the
trainer keeps fp32 master weights and AdamW state and serves bf16. Three settings: one step at
lr 1e-6, ten steps at lr 1e-6, one step at lr 1e-5, each on random-token LM batches. For each:
the share of bf16 elements that changed; size and ratio against raw bf16 of (a) a full
snapshot (byte planes, zstd), (b) XOR + zstd-1 per tensor (what slime/verl/NeMo-RL ship),
(c) Flywheel's delta; encode and decode+apply throughput in GB/s of model bytes (Flywheel's
apply includes every verification: shard sha256, base and result xxh3 per tensor); bit
exactness by whole-model sha256; and the modeled sync time: compressed bytes over a 10 Gbit/s
link plus decode+apply of the model at the measured speed, printed for both schemes and kept
in the JSON as `sync_s_flywheel` / `sync_s_xor_zstd1`. Timings are the best of `--runs` runs
(2 shared cores are noisy). Flywheel decodes on 2 threads (`apply_delta`'s default).

    .venv/bin/python bench/delta.py        # ~3-5 minutes on 2 shared cores
    .venv/bin/python bench/delta.py --settings lr1e-5_steps1 --runs 1   # one setting, to iterate
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from transformers import Qwen3Config, Qwen3ForCausalLM

from kernels.delta import apply_delta, encode_delta, encode_snapshot
from kernels.delta.streams import tensor_bits
from kernels.weights import state_dict_sha256

LINK_BYTES_PER_S = 10e9 / 8
SETTINGS = (("lr1e-6_steps1", 1e-6, 1), ("lr1e-6_steps10", 1e-6, 10), ("lr1e-5_steps1", 1e-5, 1))
Weights = dict[str, torch.Tensor]


def model_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64,
        tie_word_embeddings=False, max_position_embeddings=512)


def served(model: torch.nn.Module) -> Weights:
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


def rl_release(lr: float, steps: int) -> tuple[Weights, Weights, int]:
    """(served bf16 before, after `steps` AdamW steps on fp32 masters, parameter count)."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(model_config()).float()
    before = served(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (4, 128))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return before, served(model), sum(p.numel() for p in model.parameters())


def best_of(runs: int, setup: Callable[[], Weights], work: Callable[[Weights], object]) -> float:
    """Fastest of `runs` timings of `work`, each on a fresh `setup()` (not timed)."""
    best = float("inf")
    for _ in range(runs):
        state = setup()
        start = time.perf_counter()
        work(state)
        best = min(best, time.perf_counter() - start)
    return best


def xor_zstd1(base: Weights, target: Weights) -> dict[str, bytes]:
    cctx = zstandard.ZstdCompressor(level=1)
    return {k: cctx.compress((tensor_bits(base[k]) ^ tensor_bits(target[k])).tobytes())
            for k in base}


def xor_apply(live: Weights, blobs: dict[str, bytes]) -> None:
    dctx = zstandard.ZstdDecompressor()
    for name, blob in blobs.items():
        bits = tensor_bits(live[name])
        np.bitwise_xor(bits, np.frombuffer(dctx.decompress(blob), bits.dtype), out=bits)


@dataclass
class Row:
    name: str
    changed_frac: float
    ratio_zstd_full: float
    ratio_xor_zstd1: float
    ratio_flywheel: float
    encode_gbps: float
    decode_apply_gbps: float
    xor_decode_apply_gbps: float
    exact: bool
    sync_s_xor_zstd1: float
    sync_s_flywheel: float


def measure(name: str, base: Weights, target: Weights, runs: int = 3) -> Row:
    raw = sum(t.nbytes for t in base.values())
    changed = sum(int(np.count_nonzero(tensor_bits(base[k]) != tensor_bits(target[k])))
                  for k in base)
    base_sha = state_dict_sha256(base)  # the trainer knows it: the served version's hash
    snapshot = encode_snapshot(target, version=1).manifest.nbytes
    xor = xor_zstd1(base, target)
    xor_bytes = sum(len(b) for b in xor.values())

    def copy() -> Weights:
        return {k: v.clone() for k, v in base.items()}

    xor_s = best_of(runs, copy, lambda live: xor_apply(live, xor))
    t0 = time.perf_counter()
    release = encode_delta(base, target, base_version=0, target_version=1, base_sha256=base_sha)
    encode_s = time.perf_counter() - t0
    manifest, read = release.manifest, release.shards.__getitem__
    apply_s = best_of(runs, copy, lambda live: apply_delta(live, manifest, read))
    live = copy()
    apply_delta(live, manifest, read)
    xor_live = copy()
    xor_apply(xor_live, xor)
    exact = state_dict_sha256(live) == manifest.target.sha256 == state_dict_sha256(xor_live)
    return Row(
        name=name, changed_frac=changed / (raw // 2), ratio_zstd_full=raw / snapshot,
        ratio_xor_zstd1=raw / xor_bytes, ratio_flywheel=raw / manifest.nbytes,
        encode_gbps=raw / encode_s / 1e9, decode_apply_gbps=raw / apply_s / 1e9,
        xor_decode_apply_gbps=raw / xor_s / 1e9, exact=exact,
        sync_s_xor_zstd1=xor_bytes / LINK_BYTES_PER_S + xor_s,
        sync_s_flywheel=manifest.nbytes / LINK_BYTES_PER_S + apply_s)


def print_table(rows: list[Row], params: int) -> None:
    print(f"Qwen3 {params / 1e6:.0f}M params, bf16 served ({params * 2 / 1e6:.0f} MB raw)")
    head = (f"{'setting':<16}{'changed':>9}{'zstd':>7}{'xor+z1':>8}{'flywheel':>9}{'vs xor':>8}"
            f"{'enc GB/s':>10}{'apply GB/s':>11}{'xor GB/s':>10}{'exact':>7}"
            f"{'sync xor s':>11}{'sync fw s':>10}")
    print(head)
    for r in rows:
        print(f"{r.name:<16}{r.changed_frac:>9.4f}{r.ratio_zstd_full:>7.2f}"
              f"{r.ratio_xor_zstd1:>8.1f}{r.ratio_flywheel:>9.1f}"
              f"{r.ratio_flywheel / r.ratio_xor_zstd1:>7.2f}x{r.encode_gbps:>10.2f}"
              f"{r.decode_apply_gbps:>11.2f}{r.xor_decode_apply_gbps:>10.2f}{r.exact!s:>7}"
              f"{r.sync_s_xor_zstd1:>11.3f}{r.sync_s_flywheel:>10.3f}")
    print("ratios are against raw bf16; sync = bytes over 10 Gbit/s + decode+apply")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(n for n, _, _ in SETTINGS),
                        help="comma-separated subset of " + ", ".join(n for n, _, _ in SETTINGS))
    parser.add_argument("--runs", type=int, default=3, help="timed runs per measurement (best)")
    args = parser.parse_args()
    wanted = args.settings.split(",")
    if unknown := set(wanted) - {n for n, _, _ in SETTINGS}:
        parser.error(f"unknown settings {sorted(unknown)}")
    torch.set_num_threads(2)
    rows, params = [], 0
    for name, lr, steps in SETTINGS:
        if name in wanted:
            base, target, params = rl_release(lr, steps)
            rows.append(measure(name, base, target, runs=max(1, args.runs)))
    print_table(rows, params)
    for r in rows:
        print(f"modeled sync {r.name}: flywheel {r.sync_s_flywheel:.3f} s, XOR+zstd-1 "
              f"{r.sync_s_xor_zstd1:.3f} s ({r.sync_s_xor_zstd1 / r.sync_s_flywheel:.2f}x)")
    settings = [{k: round(v, 6) if isinstance(v, float) else v for k, v in vars(r).items()}
                for r in rows]
    print(json.dumps({"bench": "delta", "params": params, "settings": settings}))


if __name__ == "__main__":
    main()
