"""The float32 kernels built for AVX2 compute bitwise what their AVX-512 builds compute (simd.h: one sixteen-lane
vector on either, reductions by one tree, tiles that change only the registers), so a model gives the same tokens on
an AVX2-only CPU as on an AVX-512 one. Runs where the CPU has both; SPECDEC_MAX_CPU_ISA runs the AVX2 builds alone
on such a CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import prefill_chain_tree_logits
from specdec.models import kernels
from specdec.models.linear import PanelLinear
from specdec.models.loader import load_decoder, load_tokenizer
from specdec.models.smoothing import activation_ranges, calibration_ids

needs_both = pytest.mark.skipif(
    kernels.runnable_isas() != kernels.FLOAT32_ISAS
    or any(build(isa) is None for build in (kernels.fp32_linear, kernels.row_attention, kernels.norm_swiglu)
           for isa in kernels.FLOAT32_ISAS),
    reason="needs a CPU with AVX-512 (which has AVX2 too) and a compiler",
)


def _both(build):
    return build(kernels.AVX512), build(kernels.AVX2)


@needs_both
@settings(max_examples=25, deadline=None)
@given(rows=st.sampled_from([1, 2, 3, 5, 6, 7, 12, 24, 25, 70]), out_features=st.integers(1, 130),
       in_features=st.sampled_from([1, 7, 16, 513, 1300]), seed=st.integers(0, 2**16))
def test_linear(rows, out_features, in_features, seed):
    g = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    wide, narrow = _both(kernels.fp32_linear)
    expected = wide.linear(x, wide.pack(weight), bias, out_features)
    assert torch.equal(narrow.linear(x, narrow.pack(weight), bias, out_features), expected)


@needs_both
@pytest.mark.parametrize("features", [1, 17, 1536, 2100])
def test_norms_and_swiglu_down_to_the_smallest_floats(features):
    g = torch.Generator().manual_seed(features)
    # gates out to ±100: exp(−|g|) underflows through the subnormals to zero
    x = torch.randn(9, features, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    delta, weight = torch.randn(9, features, generator=g), torch.randn(features, generator=g)
    gate_up = torch.randn(9, 2 * features, generator=g) * torch.linspace(0.1, 40, 9)[:, None]
    wide, narrow = _both(kernels.norm_swiglu)
    assert torch.equal(narrow.rms_norm(x, weight, 1e-6), wide.rms_norm(x, weight, 1e-6))
    for a, b in zip(narrow.add_rms_norm(x, delta, weight, 1e-6), wide.add_rms_norm(x, delta, weight, 1e-6)):
        assert torch.equal(a, b)
    assert torch.equal(narrow.swiglu(gate_up), wide.swiglu(gate_up))


@needs_both
@settings(max_examples=25, deadline=None)
@given(shape=st.sampled_from([(12, 2, 128), (14, 2, 64), (6, 3, 136), (2, 1, 20)]), cached=st.integers(0, 200),
       n=st.integers(1, 17), tree=st.booleans(), sharpness=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16))
def test_attention(shape, cached, n, tree, sharpness, seed):
    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(seed)
    # sharp scores: most softmax numerators underflow to subnormals or zero
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g) * sharpness
    angles = torch.rand(n, dim // 2, generator=g) * 50
    cos, sin = torch.cat((angles, angles), dim=1).cos(), torch.cat((angles, angles), dim=1).sin()
    keys = torch.randn(kv_heads, cached + n, dim, generator=g)
    values = torch.randn(kv_heads, cached + n, dim, generator=g)
    paths = []
    for i in range(n if tree else 0):
        parent = int(torch.randint(-1, i, (1,), generator=g))
        paths.append((paths[parent] if parent >= 0 else []) + [i])
    outputs = []
    for kernel in _both(kernels.row_attention):
        k, v = keys.clone(), values.clone()
        outputs.append((kernel.attend(qkv, cos, sin, k, v, cached, paths, 1 / math.sqrt(dim)), k, v))
    for narrow, wide in zip(outputs[1], outputs[0]):
        assert torch.equal(narrow, wide)


@needs_both
def test_decoder_forwards_are_bitwise_alike(tiny_qwen):
    """A prefill, a chain verification and a tree through the tiny decoder with every float32 kernel's AVX-512 build
    and then its AVX2 build (the packed weights are the same for both)."""
    decoder = load_decoder(tiny_qwen)
    linears = [getattr(layer, name) for layer in decoder.layers for name in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(linear, PanelLinear) for linear in linears + [decoder.lm_head])
    logits = [prefill_chain_tree_logits(with_kernels_for(decoder, isa)) for isa in kernels.FLOAT32_ISAS]
    for wide, narrow in zip(*logits):
        assert torch.equal(wide, narrow)


def with_kernels_for(decoder, isa: kernels.Isa):
    """`decoder` (packed float32) with every float32 kernel, and the C++ layer loop over them, built for `isa`."""
    for linear in [getattr(layer, name) for layer in decoder.layers for name in ("qkv", "o", "gate_up", "down")]:
        linear.kernel = kernels.fp32_linear(isa)
    decoder.lm_head.kernel = kernels.fp32_linear(isa)
    decoder.row_attention, decoder.norm_swiglu = kernels.row_attention(isa), kernels.norm_swiglu(isa)
    decoder.layer_stack = decoder._layer_stack()  # its entries are the kernels' it was built with
    return decoder


@needs_both
def test_int8_calibration_is_bitwise_alike(tiny_qwen):
    """The activation ranges that int8 smooths by (models/smoothing.py), measured on the float32 kernels' AVX-512
    build and on their AVX2 build: the same bits, so the int8 model is the same on either host."""
    decoder = load_decoder(tiny_qwen)
    ids = calibration_ids(load_tokenizer(tiny_qwen), decoder.config.vocab_size)
    wide, narrow = (activation_ranges(with_kernels_for(decoder, isa), ids) for isa in kernels.FLOAT32_ISAS)
    assert wide.keys() == narrow.keys() and all(torch.equal(wide[key], narrow[key]) for key in wide)
    assert all(ranges.min() > 0 for ranges in wide.values())


def test_the_environment_caps_the_instruction_sets(monkeypatch):
    monkeypatch.setenv(kernels.MAX_ISA_VARIABLE, "AVX2")
    assert kernels.runnable_isas() == tuple(isa for isa in (kernels.AVX2,) if set(isa.cpu_flags) <= kernels.cpu_flags())
    monkeypatch.setenv(kernels.MAX_ISA_VARIABLE, "avx512")
    assert kernels.runnable_isas() == tuple(isa for isa in kernels.FLOAT32_ISAS if set(isa.cpu_flags) <= kernels.cpu_flags())
    monkeypatch.setenv(kernels.MAX_ISA_VARIABLE, "sse9")
    with pytest.raises(ValueError, match="SPECDEC_MAX_CPU_ISA='sse9': expected one of avx512, avx2"):
        kernels.runnable_isas()
