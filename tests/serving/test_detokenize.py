"""Incremental detokenization (serving/detokenize.py): the streamed deltas add up to the text
decoded at once, and a tracker that only gives the whole text decodes once at the end."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from serving.detokenize import TextTracker


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_deltas_and_the_whole_text_match_one_decode(tokenizer) -> None:
    rng = random.Random(0)
    texts = ["def f(x):\n    return x + 1\n", "héllo wörld — ünïcode ✓ 漢字", "a" * 40]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids += [rng.randrange(len(tokenizer)) for _ in range(20)]  # partial characters too
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        streamed, whole = TextTracker(tokenizer), TextTracker(tokenizer, incremental=False)
        deltas = "".join(streamed.push(t) for t in ids) + streamed.finish()
        assert [whole.push(t) for t in ids] == [""] * len(ids)  # nothing decoded on the way
        assert whole.finish() == expected == whole.text
        assert deltas == expected == streamed.text


def test_stop_strings_are_watched_token_by_token_either_way(tokenizer) -> None:
    ids = tokenizer.encode("print(1)\nEND\nprint(2)", add_special_tokens=False)
    for incremental in (True, False):
        tracker = TextTracker(tokenizer, ["END"], incremental=incremental)
        for t in ids:
            tracker.push(t)
            if tracker.stopped:
                break
        assert tracker.stopped and tracker.text == "print(1)\n"
