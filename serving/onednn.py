"""oneDNN copies of the lean decode step's weights (`serving/decode.py`), where they pay."""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import torch
import torch.nn.functional as F

from serving.config import SMALL_MODEL_PARAMS

log = logging.getLogger(__name__)

# Whether the lean step's GEMMs use oneDNN copies of the weights (`OneDnnWeights.for_model`).
OneDnnMode = Literal["auto", "on", "off"]


class OneDnnWeights:
    """Copies of the lean step's weight matrices in oneDNN's layout (`Tensor.to_mkldnn`), for
    float32 models on a CPU with oneDNN. torch's float32 GEMMs go to its BLAS (MKL). On an AMD
    EPYC host `F.linear` on such copies ran the experts' products 1.6-1.8x faster, from one row
    to hundreds; on an Intel Xeon host, where MKL is at home, 0.7-1.1x (bench/onednn.py), so
    by default the engine measures which is faster before it uses them (`for_model`). A copy
    is made on first use and kept until `clear`, which whoever writes the model's weights
    calls (`LeanDecoder.weights_changed`); it costs the weights' size again in memory,
    and ~0.2 s per GB to make."""

    # "auto" takes the copies when they run the probe this much faster: the hosts measured
    # sit at 1.6-1.8x (AMD EPYC) and 0.7-1.1x (Intel Xeon), well clear of run-to-run noise
    PAYS_FROM = 1.25

    def __init__(self) -> None:
        self._copies: dict[int, Any] = {}  # id of a parameter -> its copy (per expert if 3-D)

    @classmethod
    def for_model(cls, model: Any, mode: OneDnnMode = "auto") -> OneDnnWeights | None:
        """Copies for `model`, or None: `mode` "off", not a float32 model on a CPU with
        oneDNN, or ("auto") a small model (serving.config.SMALL_MODEL_PARAMS), whose GEMMs are
        so small that converting each input to oneDNN's layout and back costs more than they
        gain (the default model, engine alone: c=32 4,900-5,500 tok/s with copies, 7,500-8,500
        without), or one whose experts' GEMMs this host's BLAS runs about as fast (`_probe`)."""
        weight = model.lm_head.weight
        if (mode == "off" or weight.device.type != "cpu" or weight.dtype != torch.float32
                or not torch.backends.mkldnn.is_available()):
            return None
        if mode == "on":
            return cls()
        if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS:
            return None
        experts = next((layer.mlp.experts for layer in model.model.layers
                        if hasattr(layer.mlp, "experts")), None)
        if experts is None:
            return None
        speedup = cls._probe(experts)
        log.info("oneDNN copies run the experts' GEMMs %.2fx as fast as torch's BLAS: %s",
                 speedup, "using them" if speedup >= cls.PAYS_FROM else "not using them")
        return cls() if speedup >= cls.PAYS_FROM else None

    @staticmethod
    def _probe(experts: Any, rows: int = 8, runs: int = 3) -> float:
        """BLAS time / oneDNN time, best of `runs`, of one layer's expert GEMMs at `rows`
        tokens per expert (a 32-row decode step's share with 8 experts, top 2)."""
        probe = OneDnnWeights()
        gate_ups, downs = experts.gate_up_proj.detach(), experts.down_proj.detach()
        x = torch.randn(rows, gate_ups.shape[2])
        y = torch.randn(rows, downs.shape[2])

        def blas() -> None:
            for gate_up, down in zip(gate_ups, downs, strict=True):
                F.linear(x, gate_up)
                F.linear(y, down)

        def onednn() -> None:
            for gate_up, down in zip(probe.experts(gate_ups), probe.experts(downs),
                                     strict=True):
                probe.apply(gate_up, x)
                probe.apply(down, y)

        def best(fn: Any) -> float:
            fn()  # copies made, kernels picked
            times = []
            for _ in range(runs):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            return min(times)

        with torch.inference_mode():
            return best(blas) / best(onednn)

    def clear(self) -> None:
        self._copies.clear()

    def linear(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`F.linear(x, weight)` for a 2-D weight, on its copy."""
        copy = self._copies.get(id(weight))
        if copy is None:
            copy = self._copies[id(weight)] = weight.detach().to_mkldnn()
        return self.apply(copy, x)

    def experts(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """Each expert's matrix of a 3-D (E, out, in) weight, as copies."""
        copies = self._copies.get(id(weight))
        if copies is None:
            copies = self._copies[id(weight)] = [w.to_mkldnn() for w in weight.detach()]
        return copies

    @staticmethod
    def apply(copy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.contiguous().to_mkldnn(), copy).to_dense()
