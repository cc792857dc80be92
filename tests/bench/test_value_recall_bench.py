"""bench/value_recall.py: each held-out task's own call and its siblings' values are distinct
calls, so their probabilities sum to at most 1, and the JSON line carries each version's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "value_recall.py"


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_value_recall", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_held_out_task_s_calls_are_distinct(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from simulate.harness import ChatTokens
    from simulate.tasks import BuiltinTasksConfig, build_task_source

    source = build_task_source(BuiltinTasksConfig())
    rows, meta = load_bench().recall_rows(ChatTokens(AutoTokenizer.from_pretrained(model_dir)),
                                          source)
    starts = [i for i, (_, kind) in enumerate(meta) if kind == "correct"]
    assert len(starts) == len(source.split("held_out")) == 50
    for start, end in zip(starts, [*starts[1:], len(meta)], strict=True):
        calls = {tuple(t for t, m in zip(rows.sequences[i], rows.masks[i], strict=True) if m)
                 for i in range(start, end)}
        assert len(calls) == end - start > 1  # the task's own call and its siblings' differ
        assert [kind for _, kind in meta[start:end]].count("correct") == 1


def test_the_json_line_has_each_version(model_dir: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.release.weights import load_model, save_weights

    module = load_bench()
    weights = tmp_path / "release.safetensors"  # a release's weights, as the pipeline saves them
    save_weights(load_model(model_dir).state_dict(), weights)
    module.main(["--model-dir", str(model_dir), "--weights", str(weights), "--threads", "1"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["bench"] == "value_recall" and line["held_out_tasks"] == 50
    assert set(line["versions"]) == {"base", str(weights)}
    for figures in line["versions"].values():
        assert 0.0 <= sum(figures.values()) <= 1.0  # disjoint calls
    # the same weights, loaded from their file, give the same figures
    assert line["versions"]["base"] == line["versions"][str(weights)]
