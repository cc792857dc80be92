"""Model configuration owned by `trainer` (composed into `app.settings.Settings`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

# The Hugging Face families `flywheel init-model` builds (trainer/init_model.py): the default
# Qwen3-MoE, three dense families and two more MoE families, all served, trained and released
# by the same code (tests/trainer/test_families.py runs every path on each).
ModelFamily = Literal["qwen3_moe", "qwen3", "llama", "mistral", "olmoe", "mixtral"]
MOE_FAMILIES: tuple[ModelFamily, ...] = ("qwen3_moe", "olmoe", "mixtral")


class TinyModelSettings(BaseModel):
    """The tiny model `flywheel init-model` builds: the default Qwen3-MoE, or the same shape in
    another family (`family`; a dense family's MLP is as wide as the MoE's active experts).

    Any local Hugging Face causal-LM directory can replace it (`FLYWHEEL_MODEL_DIR`).
    """

    family: ModelFamily = "qwen3_moe"
    # the dtype the checkpoint is saved in, and so served and shipped in; the trainers keep
    # float32 master weights either way (trainer/precision.py)
    dtype: Literal["float32", "bfloat16"] = "float32"
    vocab_size: int = Field(default=2048, ge=512)
    hidden_size: int = Field(default=128, ge=32)
    num_layers: int = Field(default=4, ge=1)
    num_heads: int = Field(default=4, ge=1)
    num_kv_heads: int = Field(default=2, ge=1)
    head_dim: int = Field(default=32, ge=8)
    num_experts: int = Field(default=8, ge=8)
    experts_per_token: int = Field(default=2, ge=2)
    moe_intermediate_size: int = Field(default=128, ge=8)
    max_position_embeddings: int = Field(default=2048, ge=128)
    seed: int = 0

    @classmethod
    def large(cls, family: ModelFamily = "qwen3_moe") -> TinyModelSettings:
        """The family at ~100M parameters, where compute rather than per-op overhead sets the
        speed (`flywheel init-model --large`, bench/serving.py): a MoE 768 wide in 6 layers of
        8 experts (~124M, ~38M active per token), a dense family 768 wide in 12 layers with a
        3072-wide MLP (~107M, GPT-2 small's shape)."""
        if family in MOE_FAMILIES:
            return cls(family=family, hidden_size=768, num_layers=6, num_heads=12,
                       num_kv_heads=4, head_dim=64, moe_intermediate_size=1024)
        return cls(family=family, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                   head_dim=64, moe_intermediate_size=1536)  # x experts_per_token (2): 3072

    @model_validator(mode="after")
    def _check_shapes(self) -> TinyModelSettings:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("model.num_heads must be a multiple of model.num_kv_heads")
        if self.experts_per_token > self.num_experts:
            raise ValueError("model.experts_per_token cannot exceed model.num_experts")
        return self
