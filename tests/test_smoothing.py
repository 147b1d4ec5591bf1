"""Activation smoothing for int8 (models/smoothing.py): the same function in exact arithmetic, less int8 error where
activations have outlier channels, statistics measured once per checkpoint."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from specdec.bench.tiny import build_tiny_model
from specdec.models import loader, smoothing
from specdec.models.decoder import Decoder
from specdec.models.linear import DenseLinear, LinearKernel, int8_linear
from specdec.models.loader import load_decoder, load_tokenizer
from specdec.models.smoothing import (
    SMOOTHING_ALPHA,
    activation_ranges,
    cached_activation_ranges,
    calibration_ids,
    smoothed_layer,
    smoothing_scales,
)

from test_quantization import logits


def test_smoothing_scales_follow_the_formula():
    amax = torch.tensor([1.0, 16.0, 0.0])
    weight = torch.tensor([[0.5, -2.0, 1.0], [-4.0, 1.0, 0.0]])  # column maxima 4, 2, 1
    expected = torch.tensor([1.0 / 4**0.5, 16**0.5 / 2**0.5, 1e-5**0.5 / 1.0])
    torch.testing.assert_close(smoothing_scales(amax, weight, 0.5), expected)
    torch.testing.assert_close(smoothing_scales(amax, weight, 1.0), amax.clamp(min=1e-5))
    with pytest.raises(ValueError, match="alpha"):
        smoothing_scales(amax, weight, 1.5)


def smoothed_decoder(dense: Decoder, ranges: dict[str, torch.Tensor], linear: LinearKernel,
                     alpha: float = SMOOTHING_ALPHA) -> Decoder:
    """`dense` (a float32 decoder of `DenseLinear` products) with every layer smoothed, its output layer by `linear`."""
    layers = [smoothed_layer(layer, ranges, i, linear, alpha) for i, layer in enumerate(dense.layers)]
    return Decoder(dense.config, dense.embed, layers, dense.final_norm, linear(dense.lm_head.weight, None),
                   dense.inv_freq, dense.attention_scaling, "smoothed")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    """A tiny Llama with biases in its MLP, so smoothing the down projection's inputs scales the up projection's bias."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-mlp-bias"), "llama", seed=5, mlp_bias=True,
                            attention_bias=True)


@pytest.mark.parametrize("fixture", ["tiny_qwen", "biased_llama"])
def test_smoothing_preserves_the_function_in_float32(fixture, request):
    """With float32 products, the scales folded into the norms and the up projection cancel those in the weights."""
    dense = load_decoder(request.getfixturevalue(fixture), prepack=False)
    generator = torch.Generator().manual_seed(0)
    ranges = {key: torch.rand(len(amax), generator=generator) * 50 + 0.01
              for key, amax in activation_ranges(dense, list(range(40))).items()}
    smoothed = smoothed_decoder(dense, ranges, DenseLinear, alpha=0.5)
    assert not torch.equal(smoothed.layers[0].gate_up.weight, dense.layers[0].gate_up.weight)
    ids = list(range(3, 60, 3))
    assert relative_error(logits(smoothed, ids), logits(dense, ids)) < 1e-5


def test_activation_ranges_are_each_products_largest_input(tiny_qwen):
    dense = load_decoder(tiny_qwen, prepack=False)
    seen = []

    class Recording(DenseLinear):
        def __call__(self, x):
            seen.append(x.reshape(-1, x.shape[-1]).abs().amax(0))
            return super().__call__(x)

    original = dense.layers[1].down
    record = dense.layers[1].down = Recording(original.weight, original.bias)
    ranges = activation_ranges(dense, list(range(20)) * 40)  # two chunks
    torch.testing.assert_close(ranges["layers.1.down"], torch.stack(seen).amax(0))
    assert dense.layers[1].down is record  # the decoder's products are put back
    assert set(ranges) == {f"layers.{i}.{p}" for i in range(2) for p in ("qkv", "gate_up", "down")}


def test_activation_ranges_see_the_inputs_of_products_the_layer_loop_would_call(tiny_qwen):
    """A packed float32 model runs its layers in one C++ call over its products' kernels; the ranges are measured
    through the Python loop, which calls the recorders, and the C++ one is put back."""
    packed = load_decoder(tiny_qwen)
    if packed.layer_stack is None:
        pytest.skip("the C++ layer loop does not run here")
    layer_stack, ids = packed.layer_stack, list(range(20)) * 40
    ranges = activation_ranges(packed, ids)
    assert packed.layer_stack is layer_stack
    for key, expected in activation_ranges(load_decoder(tiny_qwen, prepack=False), ids).items():
        torch.testing.assert_close(ranges[key], expected, rtol=1e-4, atol=0)


def with_outlier_channels(dense, factor: float = 40.0):
    """`dense` with its norms' first four channels `factor` times larger and the products reading them `factor` times
    smaller: the same float32 function, with the input outliers real models have."""
    for layer in dense.layers:
        for norm, product in ((layer.input_norm, layer.qkv), (layer.post_norm, layer.gate_up)):
            norm[:4] *= factor
            product.weight[:, :4] /= factor
    return dense


def test_smoothing_cuts_the_int8_error_that_outlier_channels_cause(tiny_qwen):
    dense = with_outlier_channels(load_decoder(tiny_qwen, prepack=False))
    ranges = activation_ranges(dense, calibration_ids(load_tokenizer(tiny_qwen), dense.config.vocab_size))
    # α = 1 with unit ranges makes every scale 1: the weights quantized as they are
    unsmoothed = smoothed_decoder(dense, {k: torch.ones_like(v) for k, v in ranges.items()}, int8_linear(), alpha=1.0)
    smoothed = smoothed_decoder(dense, ranges, int8_linear())
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    reference = logits(dense, ids)
    plain_error = relative_error(logits(unsmoothed, ids), reference)
    smoothed_error = relative_error(logits(smoothed, ids), reference)
    assert smoothed_error < 0.5 * plain_error, (smoothed_error, plain_error)


def test_activation_ranges_are_measured_once_per_checkpoint(tiny_qwen, tmp_path):
    dense = load_decoder(tiny_qwen, prepack=False)
    ids = calibration_ids(load_tokenizer(tiny_qwen), dense.config.vocab_size)
    assert 0 < len(ids) <= smoothing.CALIBRATION_TOKENS and max(ids) < dense.config.vocab_size
    built = []

    def float32_decoder():
        built.append(1)
        return dense

    first = cached_activation_ranges(tiny_qwen, ids, tmp_path, float32_decoder)
    again = cached_activation_ranges(tiny_qwen, ids, tmp_path, float32_decoder)
    assert len(built) == 1 and all(torch.equal(again[k], first[k]) for k in first)
    assert set(again) == set(activation_ranges(dense, ids))
    cached_activation_ranges(tiny_qwen, ids[:-1], tmp_path, float32_decoder)  # other ids: measured
    weights = next(tiny_qwen.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    try:
        cached_activation_ranges(tiny_qwen, ids, tmp_path, float32_decoder)  # the checkpoint changed: measured
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert len(built) == 3


def test_int8_loads_smoothed_with_the_layer_norms_scaled_and_the_output_hidden_state_as_it_is(tiny_qwen):
    """int8 loads each layer smoothed by its float32 activations over the calibration text. The final norm's output
    (`ForwardOutput.hidden`) is what Medusa, EAGLE and MTP draft from: it stays unscaled, so heads trained on the
    float32 model read the same features."""
    dense, int8 = load_decoder(tiny_qwen, prepack=False), load_decoder(tiny_qwen, quantization="int8")
    # measured on the float32 model as it loads (specdec's kernel: the same bits on every host)
    calibration = calibration_ids(load_tokenizer(tiny_qwen), dense.config.vocab_size)
    ranges = activation_ranges(load_decoder(tiny_qwen), calibration)
    ids = list(range(5, 200, 7))
    assert torch.equal(logits(int8, ids), logits(smoothed_decoder(dense, ranges, int8_linear()), ids))
    assert not torch.equal(int8.layers[0].input_norm, dense.layers[0].input_norm)
    assert not torch.equal(int8.layers[0].post_norm, dense.layers[0].post_norm)
    assert torch.equal(int8.final_norm, dense.final_norm) and torch.equal(int8.embed, dense.embed)


def test_int8_calibrates_on_the_float32_models_own_kernel(tiny_qwen, monkeypatch):
    """The ranges are measured on the products a float32 load packs (specdec's kernel where it runs: its sums are the
    same bits on every host, PyTorch's depend on the CPU)."""
    kernels_seen = []

    def measured(model_dir, ids, cache_dir, float32_decoder):
        decoder = float32_decoder()
        kernels_seen.append({type(getattr(layer, name)) for layer in decoder.layers
                             for name in ("qkv", "o", "gate_up", "down")})
        return activation_ranges(decoder, ids)

    monkeypatch.setattr(loader, "cached_activation_ranges", measured)
    load_decoder(tiny_qwen, quantization="int8")
    assert kernels_seen == [{type(load_decoder(tiny_qwen).layers[0].qkv)}]


def test_int8_calibrates_on_the_texts_bytes_where_the_checkpoint_has_no_tokenizer(tiny_qwen, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for file in tiny_qwen.iterdir():
        if file.name == "config.json" or file.suffix == ".safetensors":
            shutil.copy(file, bare / file.name)
    int8 = load_decoder(bare, quantization="int8")
    dense = load_decoder(bare, prepack=False)
    ranges = activation_ranges(load_decoder(bare), calibration_ids(None, dense.config.vocab_size))
    ids = list(range(5, 200, 7))
    assert torch.equal(logits(int8, ids), logits(smoothed_decoder(dense, ranges, int8_linear()), ids))
