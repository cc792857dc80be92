"""The online trainer at world size 1 and N: samples/s and memory per rank, one JSON line.

One process (the plain trainer, no process group) is the baseline; then the same steps on N
ranks under `trainer.distributed.launch` (FSDP2; gloo on CPU, NCCL on GPUs). Experiences are
synthetic but shaped like served ones: random prompt and completion tokens, the base model's
own logprobs of them as the behavior, its MoE routes captured for replay. Every rank reports
the bytes of what it holds of the weights, gradients and AdamW state (what sharding divides),
its peak RSS (mostly the Python and torch runtime on a small model), and on CUDA its peak
allocated memory.

On a 2-core CPU the point is memory per rank and correctness, not speed: two ranks share the
two cores that one process had, and pay the all-gathers and reduce-scatters on top.

    .venv/bin/python bench/train_sharded.py [--nproc 2] [--hidden 512]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def synthetic_experiences(model_dir: Path, count: int, *, prompt: int, completion: int,
                          seed: int = 0) -> list[Any]:
    """Experiences with the base model's own behavior logprobs and routes."""
    import torch
    from transformers import AutoModelForCausalLM

    from ingest.events import (
        ExperienceReady,
        PackedArray,
        SamplingParams,
        experience_id_for,
        utcnow,
    )
    from kernels.moe_replay import capture_routes

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    out = []
    for i in range(count):
        ids = torch.randint(3, vocab, (1, prompt + completion), generator=gen)
        with torch.no_grad(), capture_routes(model) as rec:
            logits = model(input_ids=ids[:, :-1]).logits[0].float()  # (T-1, V)
        picked = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        event_id = f"evt-{uuid.uuid4().hex}"
        out.append(ExperienceReady(
            experience_id=experience_id_for(event_id), generation_id=f"gen-{uuid.uuid4().hex}",
            feedback_event_ids=[event_id], feedback_kind="accept" if i % 2 else "reject",
            reward=1.0 if i % 2 else -1.0, model_version=0, model_sha256="0" * 64,
            prompt_token_ids=PackedArray.pack(ids[0, :prompt].numpy(), "int32"),
            completion_token_ids=PackedArray.pack(ids[0, prompt:].numpy(), "int32"),
            logprobs=PackedArray.pack(picked[prompt - 1:].numpy(), "float32"),
            routed_experts=PackedArray.pack(rec.sequences()[0].numpy(), "int16"),
            sampling=SamplingParams(temperature=1.0, max_tokens=completion),
            finish_reason="length", generated_at=utcnow()))
    return out


def _held_bytes(trainer: Any) -> int:
    """Bytes of this rank's share of the weights, gradients and optimizer state."""
    import torch

    def local(t: torch.Tensor) -> torch.Tensor:
        to_local = getattr(t, "to_local", None)  # a DTensor holds its shard
        return to_local() if to_local is not None else t

    total = 0
    for p in trainer.model.parameters():
        total += local(p).nbytes + (local(p.grad).nbytes if p.grad is not None else 0)
    for state in trainer.optimizer.state.values():
        total += sum(local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return total


def run_rank(model_dir: str, batches: list[list[Any]], root: str, threads: int,
             device: str) -> dict[str, float]:
    """One rank (or the one process): a warm-up step, then the timed steps."""
    import torch

    from trainer.distributed import World, join_world, leave_world
    from trainer.online.config import OnlineTrainerSettings
    from trainer.online.trainer import OnlineTrainer

    world = join_world(timeout_s=600, cpu=device == "cpu")
    if not world.sharded:  # the one-process baseline, on the same device as the ranks
        world = World(device=torch.device(device))
    try:
        cfg = OnlineTrainerSettings(lr=1e-4, threads=threads)
        trainer = OnlineTrainer.restore(cfg, Path(model_dir), Path(root) / f"w{world.size}",
                                        world=world)
        if world.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(world.device)
        seconds = 0.0
        if world.leader:
            trainer.step(batches[0])
            started = time.perf_counter()
            for batch in batches[1:]:
                trainer.step(batch)
            if world.device.type == "cuda":
                torch.cuda.synchronize(world.device)
            seconds = time.perf_counter() - started
            trainer.finish()
        else:
            trainer.follow()
        samples = sum(len(b) for b in batches[1:])
        report = {"rank": world.rank, "seconds": seconds, "samples": samples,
                  "held_mb": _held_bytes(trainer) / 2**20,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if world.device.type == "cuda":
            report["cuda_peak_mb"] = torch.cuda.max_memory_allocated(world.device) / 2**20
        return report
    finally:
        leave_world(world)


def _one_process(*args: Any) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:  # a process of its own: its peak RSS is the trainer's alone
        return pool.apply(run_rank, args)


def _summary(reports: list[dict[str, float]]) -> dict[str, Any]:
    leader = next(r for r in reports if r["rank"] == 0)
    keys = ("held_mb", "peak_rss_mb", "cuda_peak_mb")
    return {"samples_per_s": round(leader["samples"] / leader["seconds"], 2),
            **{f"{k}_per_rank": [round(r[k], 1) for r in sorted(reports, key=lambda r: r["rank"])]
               for k in keys if k in leader}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per rank (NCCL), the baseline on a GPU too")
    parser.add_argument("--model-dir", type=Path, help="default: the default model, built")
    parser.add_argument("--hidden", type=int, help="build a wider model of the same family")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="timed, after one warm-up")
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--completion-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from trainer.config import TinyModelSettings
    from trainer.distributed import launch
    from trainer.init_model import init_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            overrides = {k: v for k, v in (("hidden_size", args.hidden),
                                           ("moe_intermediate_size", args.hidden),
                                           ("num_layers", args.layers)) if v is not None}
            model_dir = init_model(TinyModelSettings(**overrides), Path(tmp) / "model")
        experiences = synthetic_experiences(model_dir, args.batch * (args.steps + 1),
                                            prompt=args.prompt_tokens,
                                            completion=args.completion_tokens)
        batches = [experiences[i:i + args.batch]
                   for i in range(0, len(experiences), args.batch)]
        cores = os.cpu_count() or 1  # the one process gets them all, each rank its share
        one = _summary([_one_process(str(model_dir), batches, tmp, cores, args.device)])
        ranks = launch(args.nproc, run_rank, str(model_dir), batches, tmp,
                       max(1, cores // args.nproc), args.device, max_restarts=0)
        sharded = _summary(list(ranks.values()))
        params = sum(p.numel() for p in _count_model(model_dir).parameters())
    print(f"one process: {one}", file=sys.stderr)
    print(f"{args.nproc} rank(s), FSDP2: {sharded}", file=sys.stderr)
    print(json.dumps({
        "bench": "train_sharded", "device": args.device, "params": params,
        "nproc": args.nproc, "batch": args.batch,
        "tokens_per_sample": args.prompt_tokens + args.completion_tokens,
        "samples_per_s_single": one["samples_per_s"],
        "samples_per_s_sharded": sharded["samples_per_s"],
        "ratio_samples_per_s": round(sharded["samples_per_s"] / one["samples_per_s"], 3),
        "held_mb_single": one["held_mb_per_rank"][0],
        "held_mb_per_rank_sharded": sharded["held_mb_per_rank"],
        "ratio_held_per_rank": round(max(sharded["held_mb_per_rank"])
                                     / one["held_mb_per_rank"][0], 3),
        "peak_rss_mb_single": one["peak_rss_mb_per_rank"][0],
        "peak_rss_mb_per_rank_sharded": sharded["peak_rss_mb_per_rank"],
        **({"cuda_peak_mb_single": one["cuda_peak_mb_per_rank"][0],
            "cuda_peak_mb_per_rank_sharded": sharded["cuda_peak_mb_per_rank"]}
           if "cuda_peak_mb_per_rank" in one else {})}), flush=True)
    return 0


def _count_model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


if __name__ == "__main__":
    sys.exit(main())
