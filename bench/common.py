"""What several benches share: the common start of the bootstrap's benches."""

from __future__ import annotations

import tempfile
from pathlib import Path

from trainer.bootstrap.config import BootstrapSettings
from trainer.bootstrap.midtrain import MidTrainedStart, midtrained_start
from trainer.config import TinyModelSettings


def bench_start(cfg: BootstrapSettings, model: TinyModelSettings, model_dir: Path | None, *,
                steps: int | None = None) -> MidTrainedStart:
    """The benches' common start: `cfg.torch_threads`, the model in `model_dir` (or one built
    from `model` in a temp dir), then `midtrained_start`."""
    import torch

    from trainer.init_model import init_model

    torch.set_num_threads(cfg.torch_threads)
    model_dir = model_dir or init_model(model, Path(tempfile.mkdtemp()) / "base")
    return midtrained_start(cfg, model_dir, steps=steps)
