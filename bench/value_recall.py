"""Copying or recalling? Where a model's first call on the held-out tasks puts its value.

A held-out task (`add_17`) is solved by copying its value from its name into the body
(`x + 17`). A model can instead write a value it was rewarded for or shown on another task of
the same template: the product split's (the demo's developers' tasks, the online trainer's
only reward) or the train split's (the bootstrap's demonstrations). For each held-out task of
a template, this measures, in one forward pass per row, the probability at `--temperature`
of writing the demonstration's first call with the task's own value (`correct`), and summed
over the same call carrying each product task's value of that template (`product_values`) and
each train task's (`train_values`); averaged over the held-out tasks, per template and in all.

Run it on the demo's version 0 and its newest release to see what the live loop taught:

    .venv/bin/python bench/value_recall.py --model-dir D/bootstrap/model \\
        --weights D/live/releases/head.safetensors [--temperature 0.7]

Ends with one JSON line: {"bench": "value_recall", "temperature": ..., "held_out_tasks": ...,
"versions": {"<name>": {"correct": ..., "product_values": ..., "train_values": ...}, ...}}
(the model directory's own weights are named "base").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulate.demonstrations import first_call  # noqa: E402
from simulate.harness import ChatTokens  # noqa: E402
from simulate.tasks import BuiltinTasksConfig, Task, TaskSource, build_task_source  # noqa: E402
from trainer.policy import Policy, Rows  # noqa: E402

KINDS = ("correct", "product_values", "train_values")


def recall_rows(chat: ChatTokens, source: TaskSource) -> tuple[Rows, list[tuple[str, str]]]:
    """Per held-out task of a template: its own first call, then the same opening with the
    call of each product and train task of its template's body; (template, kind) per row."""
    siblings: dict[str, dict[str, list[Task]]] = defaultdict(lambda: defaultdict(list))
    for split, kind in (("product", "product_values"), ("train", "train_values")):
        for task in source.split(split):
            if task.family is not None:
                siblings[task.family][kind].append(task)
    sequences, masks, meta = [], [], []
    for task in source.split("held_out"):
        if task.family is None:
            continue
        variants = [("correct", task)] + [
            (kind, task.model_copy(update={"canonical_solution": other.canonical_solution}))
            for kind in KINDS[1:] for other in siblings[task.family][kind]]
        for kind, variant in variants:
            ids, mask = first_call(chat, variant)
            sequences.append(ids)
            masks.append(mask)
            meta.append((task.family, kind))
    return Rows(sequences, masks), meta


def summarize(probs: list[float], meta: list[tuple[str, str]]) -> dict[str, dict[str, float]]:
    """Each template's and "all" held-out tasks' mean `correct` and mean summed sibling mass."""
    sums: dict[tuple[str, str], float] = defaultdict(float)
    tasks: dict[str, int] = defaultdict(int)
    for (family, kind), p in zip(meta, probs, strict=True):
        for key in (family, "all"):
            sums[(key, kind)] += p
            tasks[key] += kind == "correct"
    return {key: {kind: round(sums[(key, kind)] / n, 4) for kind in KINDS}
            for key, n in sorted(tasks.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--weights", type=Path, nargs="*", default=[],
                        help="safetensors files of the same model (releases, candidates)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    policy = Policy.load(args.model_dir, lr=1e-4)
    rows, meta = recall_rows(ChatTokens(policy.tokenizer), build_task_source(BuiltinTasksConfig()))
    versions: dict[str, dict[str, float]] = {}
    for name, path in [("base", None), *((str(p), p) for p in args.weights)]:
        if path is not None:
            policy.load_weights(load_file(str(path)))
        table = summarize(policy.written_probability(rows, args.temperature), meta)
        print(f"== {name}")
        for key, row in table.items():
            print(f"  {key:24s} " + "  ".join(f"{kind} {row[kind]:.3f}" for kind in KINDS))
        versions[name] = table["all"]
    print(json.dumps({"bench": "value_recall", "temperature": args.temperature,
                      "held_out_tasks": sum(kind == "correct" for _, kind in meta),
                      "versions": versions}))


if __name__ == "__main__":
    main()
