"""Fixtures of the integration tests that more than one module uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import skilled_model


@pytest.fixture(scope="session")
def learning_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mid-trained until it solves its two tasks some of the time: groups with a signal, so
    every GRPO step changes the weights and every policy version is a real delta."""
    return skilled_model(model_dir, tmp_path_factory.mktemp("fleet"), steps=80)
