"""Trainer/inference numerics mismatch, with the batch-invariant mode and router replay off and on.

For the default tiny Qwen3-MoE and a larger MoE (random init, fixed seed, no downloads):
1. serve: waves of static batches (sizes 1..32) of prompts of mixed lengths, left-padded prefill
   then incremental decode through a DynamicCache; rows that finish leave the batch (so the
   batch shrinks), temperature-1 sampling; records each sampled token's logprob and the routes;
2. train: recompute those logprobs with full-sequence forwards over batches of a different
   composition (shuffled, right-padded), replaying the recorded routes when the mode is on;
3. print max/mean |d logprob|, the share of tokens with any difference, the share of tokens whose
   experts differ in at least one layer, and the slowdowns (decode tokens/s, trainer time).
This uses its own decode loop over the HF model rather than serving.TorchEngine (an async,
tokenizer-driven service), calling the same kernels API the engine calls.

Slowdowns are same-process ratios: off and on alternate for ``--rounds`` rounds on one model and
the median of the per-round ratios is reported, so load from other processes cancels out.
On CPU, ``slowdown`` and ``trainer_slowdown`` divide process CPU time (one intra-op thread: the
work itself, not the time spent descheduled). On CUDA they divide wall time, read after
``torch.cuda.synchronize()`` (the host's CPU time says nothing about the GPU's work there).
``slowdown_wall`` always divides wall time. Token counts are equal in both modes.

``--device cuda`` puts the model and every input on the GPU (the batch-invariant ops then run
the Triton kernels); tokens are sampled on the CPU from the device's probabilities, with a
seeded CPU generator, so sampling is deterministic and the same code on both devices.

    .venv/bin/python bench/numerics.py [--rounds 3]   # ~6 minutes on 2 shared cores
    python bench/numerics.py --device cuda            # on a GPU machine
    .venv/bin/python bench/numerics.py --dtype bfloat16   # weights in bfloat16
The last line is one JSON object (default model at top level, the larger one under "larger",
the device under "device").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.batch_invariant import disable_batch_invariant, enable_batch_invariant  # noqa: E402
from kernels.bi_ops import token_logprobs  # noqa: E402
from kernels.moe_replay import capture_routes, replay_routes, stack_routes  # noqa: E402
from trainer.precision import cast_parameters  # noqa: E402

WAVES = (1, 32, 4, 11, 2, 17)  # serving batch sizes, one static batch each


class Seconds(NamedTuple):
    wall: float
    cpu: float

    @staticmethod
    def now(device: torch.device) -> Seconds:
        """Wall and process CPU time, once the device's queued work has finished."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return Seconds(time.perf_counter(), time.process_time())

    def __sub__(self, other: tuple[float, ...]) -> Seconds:  # type: ignore[override]
        return Seconds(self.wall - other[0], self.cpu - other[1])

    def __add__(self, other: tuple[float, ...]) -> Seconds:  # type: ignore[override]
        return Seconds(self.wall + other[0], self.cpu + other[1])


def tiny_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
        max_position_embeddings=512,
    )


def larger_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
        max_position_embeddings=512,
    )


@dataclass
class Rollout:
    """One served sequence: tokens, prompt length, per-token logprobs and routes (T-1, L, K)."""

    tokens: list[int]
    prompt_len: int
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)


def serve_wave(model: torch.nn.Module, prompts: list[list[int]], new_tokens: list[int],
               gen: torch.Generator) -> list[Rollout]:
    """Left-padded prefill then decode; finished rows leave the batch and the cache."""
    rows = [Rollout(list(p), len(p)) for p in prompts]
    longest, device = max(len(p) for p in prompts), model.device
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):], mask[b, longest - len(p):] = torch.tensor(p), 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, live = DynamicCache(config=model.config), list(range(len(prompts)))
    with torch.no_grad(), capture_routes(model) as recorder:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                    past_key_values=cache, use_cache=True)
        while True:
            step = recorder.pop_step()  # (B, T, L, K), valid (B, T)
            for i, b in enumerate(live):
                rows[b].routes.append(step.routes[i][step.valid[i]])
            logits = out.logits[:, -1]
            probs = torch.softmax(logits.float().cpu(), -1)  # sampled on the CPU: gen is there
            sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
            tok = sampled.to(device)
            lp = token_logprobs(logits, tok).tolist()
            keep = []
            for i, b in enumerate(live):
                rows[b].tokens.append(int(sampled[i]))
                rows[b].logprobs.append(lp[i])
                if len(rows[b].logprobs) < new_tokens[b]:
                    keep.append(i)
            if not keep:
                break
            if len(keep) < len(live):
                cache.batch_select_indices(torch.tensor(keep, device=device))
                mask, pos, tok = mask[keep], pos[keep], tok[keep]
                live = [live[i] for i in keep]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                        past_key_values=cache, use_cache=True)
    for r in rows:
        r.routes = [torch.cat(r.routes)]
    return rows


def serve(model: torch.nn.Module, seed: int) -> tuple[list[Rollout], Seconds]:
    """All waves; returns the rollouts and the time they took (prefill, decode, sampling)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    vocab, rollouts, start = model.config.vocab_size, [], Seconds.now(model.device)
    for size in WAVES:
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 24))] for _ in range(size)]
        rollouts += serve_wave(model, prompts, [rng.randint(8, 24) for _ in range(size)], gen)
    return rollouts, Seconds.now(model.device) - start


def train(model: torch.nn.Module, rollouts: list[Rollout], replay: bool,
          seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], Seconds]:
    """Full-sequence forwards over shuffled batches of 16; per rollout: logprobs (n,) and the
    experts used (T-1, L, K), both on the CPU. Returns those and the forward time."""
    order = list(range(len(rollouts)))
    random.Random(seed + 1).shuffle(order)
    logprobs: list[torch.Tensor] = [torch.empty(0)] * len(rollouts)
    used: list[torch.Tensor] = [torch.empty(0)] * len(rollouts)
    elapsed = Seconds(0.0, 0.0)
    for chunk in (order[i:i + 16] for i in range(0, len(order), 16)):
        batch = [rollouts[i] for i in chunk]
        length = max(len(r.tokens) for r in batch)
        ids = torch.zeros(len(batch), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(batch):
            ids[b, :len(r.tokens)], mask[b, :len(r.tokens)] = torch.tensor(r.tokens), 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        routes = stack_routes([r.routes[0] for r in batch], length)  # moved to the device per layer
        start = Seconds.now(model.device)
        with torch.no_grad(), capture_routes(model) as recorder:
            if replay:
                with replay_routes(model, routes):
                    logits = model(input_ids=ids, attention_mask=mask).logits
            else:
                logits = model(input_ids=ids, attention_mask=mask).logits
            lp = token_logprobs(logits[:, :-1], ids[:, 1:])  # (B, T-1)
        elapsed = elapsed + (Seconds.now(model.device) - start)
        lp = lp.cpu()
        seen = recorder.steps[0].routes
        for b, (i, r) in enumerate(zip(chunk, batch, strict=True)):
            n = len(r.tokens)
            logprobs[i] = lp[b, r.prompt_len - 1:n - 1]
            used[i] = seen[b, :n - 1]
    return logprobs, used, elapsed


def compare(model: torch.nn.Module, on: bool,
            seed: int) -> tuple[dict[str, float], int, Seconds, Seconds]:
    """Serve then train in one mode: mismatch figures, served tokens, serve and trainer time."""
    (enable_batch_invariant if on else disable_batch_invariant)(model)
    rollouts, serve_s = serve(model, seed)
    trained, used, train_s = train(model, rollouts, replay=on, seed=seed)
    served = torch.cat([torch.tensor(r.logprobs) for r in rollouts])
    delta = (served - torch.cat(trained)).abs()
    # Experts per fed token (prompt and completion) in serving vs those the trainer used.
    differs = [
        (r.routes[0].long() != u.long()).flatten(1).any(1)
        for r, u in zip(rollouts, used, strict=True)
    ]
    figures = {
        "max_abs_dlogprob": float(delta.max()),
        "mean_abs_dlogprob": float(delta.mean()),
        "tokens_differing": float((delta > 0).float().mean()),
        "expert_disagreement": float(torch.cat(differs).float().mean()),
    }
    return figures, len(served), serve_s, train_s


def run(name: str, config: Qwen3MoeConfig, rounds: int, device: torch.device,
        seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, object]:
    torch.manual_seed(seed)
    # same weights on every device; buffers as a checkpoint loaded in `dtype` keeps them
    model = cast_parameters(Qwen3MoeForCausalLM(config).eval().to(device), dtype)
    compare(model, on=False, seed=seed + 100)  # warm-up (allocator, kernels)
    if device.type == "cuda":
        compare(model, on=True, seed=seed + 100)  # Triton compiles its kernels on first use
    clock = "wall" if device.type == "cuda" else "cpu"  # what slowdowns divide (module doc)
    ratios: dict[str, list[float]] = {"cpu": [], "wall": [], "trainer": []}
    for _ in range(rounds):  # off and on alternate: both see the same load from other processes
        off, tokens, off_serve, off_train = compare(model, on=False, seed=seed)
        on, _, on_serve, on_train = compare(model, on=True, seed=seed)
        ratios["cpu"].append(on_serve.cpu / off_serve.cpu)
        ratios["wall"].append(on_serve.wall / off_serve.wall)
        ratios["trainer"].append(getattr(on_train, clock) / getattr(off_train, clock))
    on["slowdown"] = statistics.median(ratios[clock])  # decode tokens/s, off over on
    on["slowdown_wall"] = statistics.median(ratios["wall"])
    on["trainer_slowdown"] = statistics.median(ratios["trainer"])
    print(f"{name}: decode {tokens / off_serve.wall:.0f} -> {tokens / on_serve.wall:.0f} tok/s "
          f"(last round), slowdown per round ({clock}) "
          + " ".join(f"{r:.2f}" for r in ratios[clock])
          + f"; trainer forward {off_train.wall:.2f} -> {on_train.wall:.2f} s (off -> on)")
    for mode, figures in (("off", off), ("on", on)):
        print(f"  {mode:3s} " + "  ".join(f"{k}={v:.3g}" for k, v in figures.items()))
    return {"off": off, "on": on}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="off/on rounds per model (median)")
    parser.add_argument("--only", choices=("default", "larger", "engines"),
                        help="run one part only")
    parser.add_argument("--no-engines", dest="engines", action="store_false",
                        help="skip vLLM vs the torch engine (bench/numerics_engines.py)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the model runs (cuda: the Triton kernels)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the weights' dtype (serving and the trainer's forward)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(1)  # 2 shared cores: OpenMP spinning across busy cores costs 10-100x
    else:
        print(f"device: {torch.cuda.get_device_name(device)}")
    result: dict[str, object] = {}
    if args.only in (None, "default"):
        result = run("default", tiny_config(), args.rounds, device, dtype=dtype)
    if args.only in (None, "larger"):
        result["larger"] = run("larger", larger_config(), args.rounds, device, dtype=dtype)
    if args.engines and args.only in (None, "engines") and device.type == "cpu" \
            and importlib.util.find_spec("vllm") is not None:
        from bench.numerics_engines import run_engines

        result["engines"] = run_engines()
    print(json.dumps({"bench": "numerics", **result, "device": args.device,
                      "dtype": args.dtype}))


if __name__ == "__main__":
    main()
