"""Activation smoothing for int8 models (SmoothQuant: Xiao et al., 2023).

A few input channels of a product carry activations tens of times larger than the rest, and a row's int8 scale is set
by its largest value, so those channels cost every other channel its precision. Dividing activation channel j by s_j
and multiplying weight column j by s_j leaves the product unchanged in exact arithmetic and moves the outliers into the
weights, whose int8 scales are per output channel. The division is folded into whatever produces the activations (an
RMSNorm's weight; the up projection's rows for the down projection's input), so a forward does no extra work:

    s_j = max|X_j|^α / max_n |W_nj|^(1−α),   α = SMOOTHING_ALPHA,

max|X_j| over a calibration text shipped beside this module (`calibration_text.txt`: not the quality bench's held text),
measured once per checkpoint with its float32 weights and cached. The loader measures them on specdec's float32
kernels, whose sums are the same bits on every AVX2 and AVX-512 host; PyTorch's products (MKL) sum in an order that
depends on the CPU, and those last bits alone moved the 1.5B's int8 NLL by up to 0.5% (BENCHMARKS.md, forty-sixth
session). So an int8 model is the same on every such host. Two products are left as they are. The attention
output projection reads the value projection's outputs per KV head, which GQA shares between query heads, so one scale
would have to serve a whole group. The output layer reads the final norm's output, the hidden state that Medusa, EAGLE
and MTP heads draft from: it stays the float32 model's. Each had the smallest share of int8's NLL penalty
(BENCHMARKS.md).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specdec.models.decoder import Decoder, LayerWeights, hidden_states
from specdec.models.linear import DenseLinear, Linear, LinearKernel, gate_up_product

# From a grid of 0.2–0.6 over the 1.5B and the 0.5B, NLL on the held text and on another: every α from 0.2 to 0.5 kept
# int8's penalty within +0.53% on both texts (none: up to +1.12%), and which of them is lowest moves with one-ulp
# changes in the weights (BENCHMARKS.md, thirty-ninth session)
SMOOTHING_ALPHA = 0.4
CALIBRATION_TOKENS = 1024
CALIBRATION_VERSION = 2  # change with the text, the statistics or how they are gathered
_CHUNK = 512
_SMOOTHED = ("qkv", "gate_up", "down")  # each layer's products whose inputs are smoothed


def smoothing_scales(activation_amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [in] for a product with weight [out, in] whose inputs reach `activation_amax` [in] per channel."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"smoothing alpha must be in [0, 1], got {alpha}")
    weight_amax = weight.abs().amax(dim=0).float().clamp(min=1e-5)
    return activation_amax.float().clamp(min=1e-5).pow(alpha) / weight_amax.pow(1 - alpha)


class _InputRange:
    """A float32 product that records max |x| per input channel over every row it sees."""

    applies_swiglu = False

    def __init__(self, linear: Linear) -> None:
        self.linear = linear
        self.amax = torch.zeros(linear.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.amax = torch.maximum(self.amax, x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float().cpu())
        return self.linear(x)


def activation_ranges(decoder: Decoder, ids: list[int]) -> dict[str, torch.Tensor]:
    """max |x| per input channel of every smoothed product ("layers.<i>.<product>") over a forward of `ids`, for a
    float32 decoder (products that do not apply SwiGLU themselves)."""
    products = {f"layers.{i}.{name}": (layer, name) for i, layer in enumerate(decoder.layers) for name in _SMOOTHED}
    recorders = {key: _InputRange(getattr(owner, name)) for key, (owner, name) in products.items()}
    for key, (owner, name) in products.items():
        setattr(owner, name, recorders[key])
    # the C++ layer loop calls the products' kernels it was built with, past the recorders: the Python loop sees them
    layer_stack, decoder.layer_stack = decoder.layer_stack, None
    try:
        hidden_states(decoder, ids, _CHUNK)
    finally:
        decoder.layer_stack = layer_stack
        for key, (owner, name) in products.items():
            setattr(owner, name, recorders[key].linear)
    return {key: recorder.amax for key, recorder in recorders.items()}


def calibration_ids(tokenizer: Any | None, vocab_size: int) -> list[int]:
    """The calibration text's first `CALIBRATION_TOKENS` tokens; its UTF-8 bytes where the checkpoint has no tokenizer.
    Ids past the vocabulary (test models smaller than their tokenizer) wrap around."""
    text = (resources.files("specdec.models") / "calibration_text.txt").read_text()
    ids = tokenizer.encode(text) if tokenizer is not None else list(text.encode())
    return [i % vocab_size for i in ids[:CALIBRATION_TOKENS]]


def cached_activation_ranges(model_dir: Path, ids: list[int], cache_dir: Path,
                             float32_decoder: Callable[[], Decoder]) -> dict[str, torch.Tensor]:
    """`activation_ranges` of the checkpoint in `model_dir` over `ids`, kept in `cache_dir` under its files (path,
    sizes, times), the ids and `CALIBRATION_VERSION`: measured once (~13 s for the 1.5B) on `float32_decoder()`,
    built only then."""
    files = sorted(model_dir.resolve().glob("*.safetensors"))
    key = hashlib.sha256(repr((CALIBRATION_VERSION, ids, [(str(f), f.stat().st_size, f.stat().st_mtime_ns)
                                                           for f in files])).encode()).hexdigest()[:16]
    path = cache_dir / "calibration" / f"{model_dir.name}-{key}.safetensors"
    if path.exists():
        return load_file(path)
    ranges = activation_ranges(float32_decoder(), ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".tmp{os.getpid()}")
    save_file(ranges, partial)
    partial.replace(path)  # a concurrent loader reads the whole file or measures again
    return ranges


def smoothed_layer(layer: LayerWeights, ranges: dict[str, torch.Tensor], index: int, linear: LinearKernel,
                   alpha: float = SMOOTHING_ALPHA) -> LayerWeights:
    """Layer `index` of a model, its float32 weights in `layer` (`DenseLinear` products), with every product built by
    `linear` (an int8 kernel) from smoothed weights and the inverse scales folded into the norms and the up
    projection: the same function in exact arithmetic."""
    s_qkv = smoothing_scales(ranges[f"layers.{index}.qkv"], layer.qkv.weight, alpha)
    s_gate_up = smoothing_scales(ranges[f"layers.{index}.gate_up"], layer.gate_up.weight, alpha)
    s_down = smoothing_scales(ranges[f"layers.{index}.down"], layer.down.weight, alpha)
    gate_up_weight = layer.gate_up.weight * s_gate_up.to(layer.gate_up.weight)
    gate_up, gate_up_bias = _with_up_rows_divided(layer.gate_up, gate_up_weight, s_down)
    return LayerWeights(
        input_norm=layer.input_norm / s_qkv.to(layer.input_norm),
        qkv=linear(layer.qkv.weight * s_qkv.to(layer.qkv.weight), layer.qkv.bias),
        o=linear(layer.o.weight, layer.o.bias),
        post_norm=layer.post_norm / s_gate_up.to(layer.post_norm),
        gate_up=gate_up_product(linear, gate_up, gate_up_bias),
        down=linear(layer.down.weight * s_down.to(layer.down.weight), layer.down.bias),
    )


def _with_up_rows_divided(gate_up: DenseLinear, weight: torch.Tensor,
                          divisor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`weight` (the fused gate/up weight, a copy) and the bias with the up projection's output channels divided by
    `divisor`, in place: SwiGLU's silu(gate) · up then divides the down projection's input channels by it."""
    half = gate_up.out_features // 2
    weight[half:] /= divisor.to(weight)[:, None]
    if gate_up.bias is None:
        return weight, None
    bias = gate_up.bias.clone()
    bias[half:] /= divisor.to(bias)
    return weight, bias
