"""Flywheel's half of a hot-swap, run inside vLLM's worker processes (`worker_extension_cls`).

vLLM keeps its weights in its own fused layout (q/k/v in one projection, experts stacked);
Flywheel's releases are bit-exact deltas of the Hugging Face state dict the trainer holds
(`model.state_dict()` names, the tied LM head as its own entry). So each worker keeps the
served version's weights in that layout in host memory, the *mirror* (on a GPU host: host RAM,
never GPU memory; built once, from the model directory vLLM loaded). A swap is two calls:

1. `flywheel_prepare(store_config, target, sha256)`, between two engine steps, generation not
   paused: plan the release chain from the mirror's version, read it from the artifact store
   and decode and verify it against the mirror (`serving.hot_swap.prepare_commit`, the code the
   torch engine uses). Nothing is written; a failed check raises and the worker keeps serving.
2. `flywheel_commit()`, with generation paused: write the verified bit patterns into the
   mirror, hand only the tensors the release changed (and their siblings, see
   `changed_names`) to vLLM's own in-place reload (`Worker.reload_weights`: it maps Hugging
   Face names onto its layout, re-runs each reloaded layer's weight processing, and copies the
   result into the parameters' existing storage), and return the mirror's sha256, computed
   here, which the engine compares with the release's.

The tensors go to vLLM under the names and in the layout of the checkpoint it loaded, which
need not be the model's: transformers 5 fuses a MoE's experts on load (one (E, 2I, H)
`experts.gate_up_proj` from E per-expert `gate_proj`/`up_proj` in the file; Mixtral's from
`block_sparse_moe.experts.N.w1`/`w3`), and vLLM's Mixtral loader knows only the file's names.
`CheckpointLayout` applies transformers' own inverse of its load-time conversion, the one
`save_pretrained` writes with.

Nothing crosses the engine's IPC but the store's config, a version number and hashes. vLLM
imports this module in its workers by qualified name; it must not import vLLM itself.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kernels.delta.chain import ChainStep, plan_chain
from kernels.delta.store import ArtifactStore, artifact_store_adapter, build_artifact_store
from kernels.weights import state_dict_sha256
from serving.hot_swap import Commit, Weights, prepare_commit


class CheckpointLayout:
    """The trainer's view of a checkpoint (`state_dict`: `model.state_dict()` of the Hugging
    Face model, each tensor its own storage, tied weights as copies, as releases name them),
    and the way back to the checkpoint's own names and layout (`to_checkpoint`)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
        self.state_dict: Weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
        # the structure and its load-time conversions are all `to_checkpoint` needs: no data
        self._model = model.to_empty(device="meta")

    def to_checkpoint(self, weights: Weights) -> Weights:
        """`weights` (the model's names, whole fused tensors) under the checkpoint's names."""
        from transformers.core_model_loading import revert_weight_conversion

        return dict(revert_weight_conversion(self._model, dict(weights)))


def changed_names(store: ArtifactStore, steps: list[ChainStep], mirror: Weights) -> list[str]:
    """Tensors to hand to vLLM for a chain of releases: those some step rewrites (every one of
    a snapshot; else base and target hashes differ), with their siblings (the other tensors of
    the same module). vLLM fuses sibling tensors into one layer (q/k/v, an MoE block's
    experts) and re-processes a layer only from all of its weights."""
    changed: set[str] = set()
    for step in steps:
        manifest = store.read_manifest(step.release.version, step.release.kind)
        changed.update(t.name for t in manifest.tensors
                       if manifest.kind == "snapshot" or t.base_xxh3 != t.target_xxh3)
    modules = {name.rpartition(".")[0] for name in changed}
    names = {n for n in mirror if n in changed or n.rpartition(".")[0] in modules}
    if any(is_expert(n) for n in names):  # see FlywheelWorkerExtension._repack_cpu_experts
        names.update(n for n in mirror if is_expert(n))
    return sorted(names)


def is_expert(name: str) -> bool:
    return ".experts." in name


class FlywheelWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    _fw_layout: CheckpointLayout | None = None  # its state_dict: the mirror
    _fw_version: int = 0
    _fw_pending: tuple[int, Commit, list[str]] | None = None  # target, commit, names

    def flywheel_init(self, model_dir: str, version: int) -> str:
        """Build the mirror from the checkpoint vLLM loaded; returns its sha256."""
        self._fw_layout = CheckpointLayout(Path(model_dir))
        self._fw_version = version
        self._fw_pending = None
        return state_dict_sha256(self._fw_layout.state_dict)

    def flywheel_prepare(self, store_config: dict[str, Any], target: int, sha256: str
                         ) -> dict[str, Any]:
        """Verify the way from the mirror's version to `target` without writing anything."""
        if self._fw_layout is None:
            raise RuntimeError("flywheel_init was not called in this worker")
        mirror = self._fw_layout.state_dict
        store = build_artifact_store(artifact_store_adapter.validate_python(store_config))
        steps = plan_chain(self._fw_version, target, store.releases())
        commit = prepare_commit(store, mirror, steps, sha256)
        names = changed_names(store, steps, mirror)
        self._fw_pending = (target, commit, names)
        return {"steps": len(steps)}

    def flywheel_commit(self) -> dict[str, Any]:
        """Commit the prepared release into the mirror and load what changed into vLLM."""
        layout = self._fw_layout
        if self._fw_pending is None or layout is None:
            raise RuntimeError("flywheel_commit without a prepared release")
        target, commit, names = self._fw_pending
        self._fw_pending = None
        started = time.perf_counter()
        mirror = layout.state_dict
        commit(mirror)
        # vLLM's `Worker.reload_weights`, on the worker class this extends
        changed = layout.to_checkpoint({n: mirror[n] for n in names})
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=list(changed.items()), is_checkpoint_format=True)
        self._refresh_tied_head()
        if any(is_expert(n) for n in names):
            self._repack_cpu_experts()
        copy_s = time.perf_counter() - started
        self._fw_version = target
        return {"sha256": state_dict_sha256(mirror), "copy_s": copy_s}

    def _refresh_tied_head(self) -> None:
        """vLLM re-processes each reloaded layer (on CPU: re-packs its GEMM weights) but not an
        LM head tied to the embeddings, which would keep computing with its packed copy of the
        old ones: process it again through its (public) weight-processing hook."""
        config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        head = getattr(self.model_runner.model, "lm_head", None)  # type: ignore[attr-defined]
        method = getattr(head, "quant_method", None)
        if getattr(config, "tie_word_embeddings", False) and method is not None:
            method.process_weights_after_loading(head)

    def _repack_cpu_experts(self) -> None:
        """On CPU, vLLM 0.32 packs each MoE layer's experts into its grouped-GEMM layout on the
        first load only: a reload copies the new weights, unpacked, into the packed storage
        and skips the packing (`_setup_kernel` calls `fused_experts.process_weights_after_
        loading` when no kernel exists yet). Pack them again, every MoE layer (a swap that
        touches experts reloads them all, `changed_names`). No-op on other platforms."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        # vLLM internals (0.32 has no public repack): tests/test_library_seams.py reads them
        for module in self.model_runner.model.modules():  # type: ignore[attr-defined]
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(module)
