"""int4 weights (a draft's format): the kernel against its definition, batch invariance, the decoder (its verify
blocks and greedy speculation with an int4 draft: test_quantization.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.models import kernels
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.decoder import Decoder
from specdec.models.linear import DenseLinear, Int4Linear, linear_kernel
from specdec.models.loader import load_decoder
from specdec.models.roofline import ForwardWork

needs_int4 = pytest.mark.skipif(kernels.int4_vnni() is None, reason="no AVX-512 VNNI on this CPU (or no compiler)")
pytestmark = needs_int4

# A tiny random model's logits through int8 activations alone (as test_quantization's int8 bound)
INT8_ACTIVATIONS_REL_ERROR = 0.06


def int4_reference(linear: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """Its definition in float64: s_x · xq · ((q − z) · s)ᵀ + b, xq = round(x / s_x) per row."""
    row_scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    y = (torch.round(x / row_scale).double() @ linear.dequantized().double().T) * row_scale.double()
    return y if linear.bias is None else y + linear.bias.double()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13])
@pytest.mark.parametrize("out_features, in_features", [(64, 128), (200, 300), (8, 896), (130, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_kernel_computes_its_definition_and_each_row_alone(rows, out_features, in_features, with_bias):
    """Each group's sums are exact int32 and the groups are added in float32: the result is the definition to float32
    rounding, and a row's bits do not depend on the rows beside it (tiles of up to 6 rows)."""
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    bias = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, in_features, generator=g) * 3
    linear = Int4Linear(weight, bias)
    together = linear(x)
    reference = int4_reference(linear, x)
    assert together.shape == (rows, out_features) and together.dtype == torch.float32
    tolerance = 1e-5 * (reference.abs().max().item() + 1)
    assert (together.double() - reference).abs().max().item() < tolerance
    for r in range(rows):
        assert torch.equal(linear(x[r : r + 1]), together[r : r + 1])


def test_int4_weights_are_rounded_per_group_of_128():
    """Every weight within half a step of its group's grid; zero (the padding) exact."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(70, 200, generator=g) * torch.logspace(-2, 0, 200)  # groups of different ranges
    linear = Int4Linear(weight)
    step = linear.scale.transpose(1, 2).reshape(-1, 2).repeat_interleave(128, dim=1)[:70, :200]
    assert ((linear.dequantized() - weight).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert linear.weight_bytes == 128 * 256 // 2 + 2 * 4 * 128 * 2  # 2 panels × 256 in-features, scales and offsets
    assert Int4Linear(torch.zeros(64, 128)).dequantized().abs().max().item() == 0


@pytest.mark.parametrize("rows", [1, 8])
def test_int4_kernel_is_exact_when_threads_take_from_each_others_shares(rows, oversubscribed_threads):
    g = torch.Generator().manual_seed(5)
    linear = Int4Linear(torch.randn(4096, 192, generator=g) * 0.05)
    x = torch.randn(rows, 192, generator=g)
    expected = linear(x)
    assert (expected.double() - int4_reference(linear, x)).abs().max().item() < 1e-4
    for _ in range(30):
        assert torch.equal(linear(x), expected)


@pytest.mark.parametrize("features", [127, 129])
def test_int4_kernel_refuses_an_input_of_other_in_features(features):
    linear = Int4Linear(torch.randn(8, 128))
    with pytest.raises(ValueError, match="128 in-features got an input of"):
        linear(torch.randn(2, features))


def test_int4_needs_the_vnni_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "int4_vnni", lambda: None)
    with pytest.raises(ValueError, match="int4 weights need specdec's AVX-512 VNNI kernel"):
        linear_kernel(torch.float32, "cpu", "int4")
    with pytest.raises(ValueError, match="int4 weights need"):
        Int4Linear(torch.randn(8, 128))


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama"])
def test_int4_decoder_is_the_model_of_its_4_bit_weights(fixture, request):
    """The int4 decoder (loader, packing, C++ layer loop) computes the model whose weights are its dequantized ones, to
    the error of the activations' int8 rounding; against the float32 model its logits carry the 4-bit weights' error,
    which tiny random models amplify (~10% a product here gives ~45% on their flat logits; the real models are
    judged by acceptance and NLL in BENCHMARKS.md)."""
    model_dir = request.getfixturevalue(fixture)
    ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    int4 = load_decoder(model_dir, quantization="int4")
    assert isinstance(int4.layers[0].gate_up, Int4Linear) and isinstance(int4.lm_head, Int4Linear)
    assert int4.layer_stack is not None  # decoding steps run the layers in the C++ loop
    assert ForwardWork.of(int4).int8  # its products are priced at the int8 multiply-add rate

    def dense(linear: Int4Linear) -> DenseLinear:
        return DenseLinear(linear.dequantized(), linear.bias)

    dequantized = Decoder(int4.config, int4.embed, [
        dataclasses.replace(layer, **{name: dense(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")})
        for layer in int4.layers], int4.final_norm, dense(int4.lm_head), int4.inv_freq, int4.attention_scaling)

    def logits(decoder):
        cache = decoder.new_kv_cache(1, 64)
        slot = cache.allocate()
        return decoder.forward(ForwardBatch.build([SequenceInput(slot, ids, num_logits=len(ids))], [0]), cache).logits

    quantized = logits(int4)
    for reference, bound in ((logits(dequantized), INT8_ACTIVATIONS_REL_ERROR), (logits(load_decoder(model_dir)), 0.6)):
        assert ((quantized - reference).norm() / reference.norm()).item() < bound
