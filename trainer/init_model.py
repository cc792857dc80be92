"""Build the default model locally: a tiny Qwen3-MoE (or the same shape in another Hugging Face
family, `FLYWHEEL_MODEL__FAMILY`) and a byte-level BPE tokenizer.

Nothing is downloaded. The tokenizer is trained on Python source that ships with the
interpreter (the standard library) plus a little chat text, with ChatML special tokens, the
tool-call tags as added tokens and Qwen3-Coder's tool-aware chat template; the model is the
family's transformers class (`Qwen3MoeForCausalLM` by default) with random weights (seeded),
saved in Hugging Face format so any HF-compatible tool (and vLLM) can load it.

    flywheel init-model --data-dir data      # writes data/models/base
    flywheel init-model --family llama --out /tmp/llama
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from trainer.config import TinyModelSettings

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The tool-call tags as whole tokens (added, not special: they decode as text), as Qwen's
# tokenizers hold `<tool_call>`: a call of the default template is ~40% fewer tokens
# (docs/serving.md), and the model learns 8 tokens where it would learn 60 byte pieces.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
               "</parameter>", "<tool_response>", "</tool_response>", "<tools>", "</tools>"]
# Qwen3-Coder's chat template (ChatML; calls and tool results in its XML format), with the
# tools listed one line each, `<function=NAME>(text_param, number?: integer (what it is))
# description</function>` (a string parameter needs no type; one with more to it than a type
# and a description, an enum or a nested object, comes as its JSON Schema), and no
# instructions after the list (the calls in the conversation show the format): Qwen3-Coder's
# own listing and instructions cost this small vocabulary ~15 tokens a parameter on every
# prompt (docs/serving.md). A call carries each argument as raw text
# between tags, never JSON-escaped, so code in a call reads as code:
#
#   <tool_call>
#   <function=write_file>
#   <parameter=path>
#   solution.py
#   </parameter>
#   <parameter=content>
#   def f(x):
#       return x
#   </parameter>
#   </function>
#   </tool_call>
#
# Non-string arguments (numbers, booleans, objects, ...) are JSON (Qwen's own template writes
# Python's `True` for a boolean, which no parser reads back). Tool results are user turns holding
# <tool_response> blocks. Without tools the template renders plain ChatML.
CHAT_TEMPLATE = (
    "{%- if not tools is defined or tools is none %}{%- set tools = [] %}{%- endif %}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system_message = messages[0].content %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if system_message is defined %}{{- '<|im_start|>system\\n' + system_message }}"
    "{%- elif tools | length > 0 %}{{- '<|im_start|>system' }}{%- endif %}"
    "{%- if tools | length > 0 %}{{- '\\n<tools>' }}"
    "{%- for tool in tools %}{%- if tool.function is defined %}"
    "{%- set tool = tool.function %}{%- endif %}"
    "{{- '\\n<function=' ~ tool.name ~ '>(' }}"
    "{%- if tool.parameters is defined and tool.parameters is mapping"
    " and tool.parameters.properties is defined and tool.parameters.properties is mapping %}"
    "{%- set required = tool.parameters.required if tool.parameters.required is defined"
    " else [] %}"
    "{%- for name, fields in tool.parameters.properties | items %}"
    "{{- (', ' if not loop.first else '') ~ name ~ ('' if name in required else '?') }}"
    "{%- if fields is mapping and fields.type is string and fields.keys()"
    " | reject('in', ['type', 'title', 'description']) | list | length == 0 %}"
    "{%- if fields.type != 'string' %}{{- ': ' ~ fields.type }}{%- endif %}"
    "{%- if fields.description is defined %}"
    "{{- ' (' ~ (fields.description | trim) ~ ')' }}{%- endif %}"
    "{%- else %}{{- ': ' ~ (fields | tojson) }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- ')' }}"
    "{%- if tool.description is defined and tool.description %}"
    "{{- ' ' ~ (tool.description | trim) }}{%- endif %}"
    "{{- '</function>' }}{%- endfor %}"
    "{{- '\\n</tools>' }}"
    "{%- endif %}"
    "{%- if system_message is defined or tools | length > 0 %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined"
    " and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content is string and message.content | trim | length > 0 %}"
    "{{- '\\n' + message.content | trim + '\\n' }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n<function=' + call.name + '>\\n' }}"
    "{%- if call.arguments is defined %}"
    "{%- for name, value in call.arguments | items %}"
    "{{- '<parameter=' + name + '>\\n' }}"
    "{%- if value is string %}{{- value }}{%- else %}{{- value | tojson | safe }}{%- endif %}"
    "{{- '\\n</parameter>\\n' }}{%- endfor %}{%- endif %}"
    "{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user\\n' }}"
    "{%- endif %}"
    "{{- '<tool_response>\\n' + message.content + '\\n</tool_response>\\n' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
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
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None,
                                   unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(cfg: TinyModelSettings, tokenizer):  # -> transformers.PretrainedConfig
    """The Hugging Face config of `cfg.family` at `cfg`'s shape. The embeddings are tied where
    the family's small checkpoints tie them (Qwen3), untied elsewhere, so both kinds are built."""
    import transformers

    shape = {"vocab_size": len(tokenizer), "hidden_size": cfg.hidden_size,
             "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
             "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
             "max_position_embeddings": cfg.max_position_embeddings,
             "tie_word_embeddings": cfg.family in ("qwen3_moe", "qwen3"),
             "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
             "bos_token_id": None}
    dense: dict[str, object] = {  # a dense MLP as wide as the MoE's active experts
        "intermediate_size": cfg.moe_intermediate_size * cfg.experts_per_token}
    experts: dict[str, object] = {"num_experts_per_tok": cfg.experts_per_token,
                                  "intermediate_size": cfg.moe_intermediate_size}
    family: dict[str, tuple[str, dict[str, object]]] = {
        "qwen3_moe": ("Qwen3MoeConfig", {  # its intermediate_size: the dense layers' (none)
            **dense, "num_experts_per_tok": cfg.experts_per_token,
            "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
        "qwen3": ("Qwen3Config", dense),
        "llama": ("LlamaConfig", dense),
        "mistral": ("MistralConfig", {**dense, "sliding_window": None}),
        "olmoe": ("OlmoeConfig", {**experts, "num_experts": cfg.num_experts}),
        "mixtral": ("MixtralConfig", {**experts, "num_local_experts": cfg.num_experts}),
    }
    name, extra = family[cfg.family]
    config = getattr(transformers, name)(**shape, **extra)
    config.head_dim = cfg.head_dim  # set after: not every family's __init__ takes it
    return config


def build_model(cfg: TinyModelSettings, tokenizer):  # -> a transformers causal LM
    import torch
    from transformers import AutoModelForCausalLM

    from kernels.weights import SERVED_DTYPES

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(model_config(cfg, tokenizer))
    return model.to(SERVED_DTYPES[cfg.dtype]).eval()  # drawn in float32, then rounded


def init_model(cfg: TinyModelSettings, out_dir: Path, *, overwrite: bool = False) -> Path:
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
