"""Tiny random models with a byte-level tokenizer: for `specdec bench --quick` and the tests.

A target and a near copy of it (its matrices plus Gaussian noise) make a draft that agrees with
the target often, not always, so every speculation path runs in seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 260  # 256 byte tokens + specials
EOS_ID = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> Any:
    """A byte-level BPE tokenizer without merges: every byte is a token, ids 0..255."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(path: Path, model_type: str = "qwen2", seed: int = 0, **overrides: Any) -> Path:
    """A random 2-layer checkpoint (HF directory with the byte tokenizer) of a Llama-family type."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
        "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, num_key_value_heads=1, rope_theta=500.0)),
        "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=None)),
    }
    config_cls, model_cls, extra = classes[model_type]
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=EOS_ID, bos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # larger weights than the default init: peaked, varied next-token distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def perturbed_copy(source: Path, target: Path, noise: float, seed: int = 0) -> Path:
    """The same model with Gaussian noise on its matrices: a draft that agrees with it often, not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(noise * torch.randn(p.shape, generator=g))
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def tiny_pair(directory: Path) -> tuple[Path, Path]:
    """(target, draft) under directory, built on first use; long enough a context for the bench prompts."""
    target, draft = directory / "tiny-target", directory / "tiny-draft"
    if not (target / "config.json").exists():
        build_tiny_model(target, max_position_embeddings=4096)  # byte tokens: a 600-token prompt is ~3k bytes
    if not (draft / "config.json").exists():
        perturbed_copy(target, draft, noise=0.08)
    return target, draft
