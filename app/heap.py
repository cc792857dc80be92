"""`settle_heap`: exempt what a long-running process built at start-up from the cyclic garbage
collector's full passes."""

from __future__ import annotations

import gc


def settle_heap() -> None:
    """Move every object alive now to the permanent generation (`gc.freeze()`), after a
    collection; objects made later are collected as before.

    A serving process holds about half a million long-lived objects after start-up (torch,
    transformers, the tokenizer, the app), which every full (generation 2) collection walks:
    under webhook traffic those ran every second or so and stopped the event loop 135-260 ms
    each, which was the feedback endpoints' p99. The join's members spend about a sixth less
    CPU per event with it (`bench/feedback.py`, `bench/join_member.py`; docs/benchmarks.md).
    Called by the API's lifespan once its services are up, and by `flywheel join`."""
    gc.collect()
    gc.freeze()
