"""Build the default model locally: a tiny Qwen3-MoE and a byte-level BPE tokenizer.

Nothing is downloaded. The tokenizer is trained on Python source that ships with the
interpreter (the standard library) plus a little chat text, with ChatML special tokens and a
ChatML chat template; the model is `Qwen3MoeForCausalLM` with random weights (seeded), saved
in Hugging Face format so any HF-compatible tool (and vLLM) can load it.

    flywheel init-model --data-dir data      # writes data/models/base
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from trainer.config import TinyMoeSettings

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A fixed, sorted slice of the standard library: same corpus on every machine with 3.11.
_STDLIB_MODULES = ["abc", "argparse", "bisect", "calendar", "collections/__init__", "csv",
                   "dataclasses", "difflib", "enum", "fractions", "functools", "heapq",
                   "json/__init__", "json/decoder", "json/encoder", "operator", "pprint",
                   "queue", "random", "shlex", "statistics", "string", "textwrap", "typing"]
_CHAT_LINES = [
    "Write a function that returns the sum of a list.",
    "Here is a Python function that does that:",
    "Complete the code below. Return only code.",
    "The tests pass. Thank you!",
    "def solve(x):\n    return x\n",
]


def training_corpus(max_chars: int = 2_000_000) -> Iterator[str]:
    """Python source from the stdlib plus a few chat lines, deterministic."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for name in _STDLIB_MODULES:
        path = root / f"{name}.py"
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= max_chars:
            break
    for _ in range(50):
        yield from _CHAT_LINES


def build_tokenizer(vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None,
                                   unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(cfg: TinyMoeSettings, tokenizer):  # -> Qwen3MoeForCausalLM
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size * cfg.experts_per_token,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
        moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None)
    config.head_dim = cfg.head_dim
    torch.manual_seed(cfg.seed)
    model = Qwen3MoeForCausalLM(config)
    return model.float().eval()


def init_model(cfg: TinyMoeSettings, out_dir: Path, *, overwrite: bool = False) -> Path:
    """Build tokenizer + model and save both under `out_dir` (HF format). Returns `out_dir`."""
    if (out_dir / "config.json").exists() and not overwrite:
        return out_dir
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(cfg.vocab_size)
    model = build_model(cfg, tokenizer)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    (out_dir / "flywheel.json").write_text(json.dumps(
        {"built_by": "flywheel init-model", "settings": cfg.model_dump()}, indent=2))
    return out_dir
