"""Weight formats: int8 against float32 (documented tolerances), batch invariance, speculation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.linear import (
    DEFAULT_DRAFT_MODEL_QUANTIZATION,
    DEFAULT_DRAFT_QUANTIZATION,
    DEFAULT_TARGET_QUANTIZATION,
    AmxInt8Linear,
    Avx2Int8Linear,
    Int4Linear,
    Int8Linear,
    OneDnnInt8Linear,
    PanelLinear,
    VnniInt8Linear,
    float32_linear,
    gate_up_product,
    int8_linear,
    linear_kernel,
    resolve_quantization,
)
from specdec.models import kernels, smoothing
from specdec.models.loader import load_decoder

needs_vnni = pytest.mark.skipif(kernels.int8_vnni() is None, reason="no AVX-512 VNNI on this CPU (or no compiler)")
needs_avx2_kernel = pytest.mark.skipif(kernels.int8_avx2() is None, reason="no AVX2 on this CPU (or no compiler)")
needs_int4 = pytest.mark.skipif(kernels.int4_vnni() is None, reason="no AVX-512 VNNI on this CPU (or no compiler)")
needs_amx = pytest.mark.skipif(not kernels.int8_amx(), reason="no AMX-INT8 on this CPU (or not allowed)")
SPECDEC_INT8_KERNELS = [pytest.param(AmxInt8Linear, marks=needs_amx), pytest.param(VnniInt8Linear, marks=needs_vnni),
                        pytest.param(Avx2Int8Linear, marks=needs_avx2_kernel)]

# Tiny random models have flat logits and no outliers to protect: int8 weights + per-row int8
# activations give ~4% relative L2 error on their logits (the real 1.5B is judged by NLL in
# `specdec bench quantization`). One int8 linear layer on Gaussian data: ~1%.
INT8_LOGITS_REL_ERROR = 0.06
INT8_LINEAR_REL_ERROR = 0.015


def logits(decoder, ids: list[int]) -> torch.Tensor:
    cache = decoder.new_kv_cache(1, 64)
    slot = cache.allocate()
    return decoder.forward(ForwardBatch.build([SequenceInput(slot, ids, num_logits=len(ids))], [0]), cache).logits


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama", "tiny_mistral"])
def test_int8_logits_close_to_float32(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    int8 = load_decoder(model_dir, quantization="int8")
    assert isinstance(int8.layers[0].gate_up, Int8Linear) and isinstance(int8.lm_head, Int8Linear)
    reference, quantized = logits(load_decoder(model_dir), ids), logits(int8, ids)
    assert ((quantized - reference).norm() / reference.norm()).item() < INT8_LOGITS_REL_ERROR
    assert (quantized.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.85


# oneDNN's kernel only where it sums exactly (VNNI): without it, its 16-bit intermediate sums saturate (2.8% error
# here on a Zen 3 host), and specdec's AVX2 kernel runs instead
@pytest.mark.parametrize("kernel", [pytest.param(OneDnnInt8Linear, marks=needs_vnni), *SPECDEC_INT8_KERNELS])
def test_int8_linear_rows_are_batch_invariant_and_accurate(kernel):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 160, generator=g) * 0.05, torch.randn(96, generator=g)
    linear = kernel(weight, bias)
    # rows of very different magnitude: a per-tensor activation scale would crush the small ones
    x = torch.randn(7, 160, generator=g) * torch.tensor([1e-3, 1.0, 50.0, 0.2, 3.0, 1e2, 7.0])[:, None]
    together = linear(x)
    for i in range(7):
        alone = linear(x[i : i + 1])
        assert torch.equal(alone[0], together[i])  # exact int32 sums: bitwise, not just close
        reference = x[i] @ weight.T + bias
        assert ((alone[0] - reference).norm() / reference.norm()).item() < INT8_LINEAR_REL_ERROR
    for rows in (2, 3, 5):
        assert torch.equal(linear(x[:rows]), together[:rows])


def exact_int8_linear(linear: Int8Linear, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What every int8 kernel must compute, bit for bit: the integer sums exact (in float64, where they fit), then
    sum · s_w · s_x + b in float32, in that order."""
    quantized = torch.round(weight.float() / linear.scale[:, None])
    row_scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127
    sums = (torch.round(x / row_scale).double() @ quantized.double().T).float()
    y = sums * linear.scale * row_scale
    return y if linear.bias is None else y + linear.bias


def assert_exact_alone_and_together(linear: Int8Linear, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The rows together give the exact integer sums' result, and each row alone its row of it; returns them."""
    together = linear(x)
    assert torch.equal(together, exact_int8_linear(linear, weight, x))
    for i in range(x.shape[0]):
        assert torch.equal(linear(x[i : i + 1])[0], together[i])
    return together


@pytest.mark.parametrize("kernel", SPECDEC_INT8_KERNELS)
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    out_features=st.integers(1, 200),
    in_features=st.integers(1, 300),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_specdec_int8_kernels_are_exact(kernel, rows, out_features, in_features, with_bias, seed):
    """Any shape (channels past a panel, features not a multiple of the packing), any row count: specdec's kernels
    give the exact integer sums' result bit for bit (oneDNN's does too where the CPU has VNNI; without it, its
    16-bit intermediate sums saturate: measured up to 0.6 off on a Zen 3 host, so it is not the reference), and each
    row alone equals that row in the batch."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    bias = torch.randn(out_features, generator=g) if with_bias else None
    magnitudes = 10.0 ** torch.randint(-4, 3, (rows, 1), generator=g)
    x = torch.randn(rows, in_features, generator=g) * magnitudes
    x[torch.randint(0, rows, (1,), generator=g)] = 0.0  # an all-zero row
    assert_exact_alone_and_together(kernel(weight, bias), weight, x)


@needs_amx
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    out_features=st.integers(1, 200),
    blocks=st.integers(1, 5),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_amx_tiles_give_the_exact_sums(rows, out_features, blocks, with_bias, seed):
    """In-features a multiple of 64 (what the AMX path takes; others fall back to VNNI): 1–16 rows in one tile, more
    in tiles of 16 padded with zero rows; the exact integer sums' result, each row alone as in the batch, and the
    VNNI path's bits from the same packed panels."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, 64 * blocks, generator=g) * 0.05
    bias = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, 64 * blocks, generator=g) * 10.0 ** torch.randint(-4, 3, (rows, 1), generator=g)
    linear = AmxInt8Linear(weight, bias)
    together = assert_exact_alone_and_together(linear, weight, x)
    assert torch.equal(together, linear.kernel.linear(x, linear.packed, linear.scale, linear.bias, out_features))


@pytest.mark.parametrize("kernel", SPECDEC_INT8_KERNELS)
@pytest.mark.parametrize("rows", [4, 6])
@pytest.mark.parametrize("in_features", [1, 5, 9, 13, 16, 30, 1540])
def test_specdec_int8_kernels_are_exact_for_four_and_six_rows_over_any_count_of_k_steps(kernel, rows, in_features):
    """Four rows (on a Zen 4 host the VNNI kernel loads their weights 3 k-steps ahead, in groups of 4 k-steps, the
    last 1–3 steps apart) and six (there fetching their activations 8 k-steps ahead, past the last step at a panel's
    end): k-step counts of 1, 2, 3, 4, 8 and 385 give the exact integer sums' result."""
    g = torch.Generator().manual_seed(in_features)
    weight, bias = torch.randn(200, in_features, generator=g) * 0.05, torch.randn(200, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    linear = kernel(weight, bias)
    assert torch.equal(linear(x), exact_int8_linear(linear, weight, x))


@pytest.mark.parametrize("kernel", SPECDEC_INT8_KERNELS)
@pytest.mark.parametrize("rows", [1, 8, 9, 15, 64])
def test_specdec_int8_kernels_on_huge_pages_are_exact(kernel, rows):
    """A model-sized matrix (3 MiB of int8 weights) is packed on 2 MiB pages and computes as on small ones; 8, 9, 15
    and 64 rows take (in the VNNI kernel) two, two, three and more tiles that share the weights in chunks of K, each
    count prefetching the next chunk its own way, and 8 rows still read their activations as the instructions' memory
    operand, 9 from a register."""
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(2048, 1536, generator=g) * 0.05, torch.randn(2048, generator=g)
    x = torch.randn(rows, 1536, generator=g)
    linear = kernel(weight, bias)
    assert linear.packed.data_ptr() % 2**21 == 0
    assert torch.equal(linear(x), exact_int8_linear(linear, weight, x))


SWIGLU_INT8_KERNELS = [pytest.param(AmxInt8Linear, marks=needs_amx), pytest.param(VnniInt8Linear, marks=needs_vnni)]


@pytest.mark.parametrize("kernel", SWIGLU_INT8_KERNELS)
@pytest.mark.parametrize("in_features", [192, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gate_up_products_that_apply_swiglu_give_the_products_bits_through_swiglu(kernel, in_features, with_bias):
    """`Int8Linear.swiglu`: silu(gate) · up from the kernel's epilogue is bitwise the plain product's [gate; up]
    outputs through the SwiGLU kernel, for rows in one tile and in several (the AMX path where K is a multiple of 64,
    else the VNNI one), with and without a bias; its C++ entry asks for half the product's channels."""
    g = torch.Generator().manual_seed(in_features)
    weight = torch.randn(2 * 96, in_features, generator=g) * 0.05
    bias = torch.randn(2 * 96, generator=g) if with_bias else None
    plain, fused = kernel(weight, bias), kernel.swiglu(weight, bias)
    assert fused.applies_swiglu and not plain.applies_swiglu
    assert (fused.out_features, fused.output_features, fused.weight_bytes) == (192, 96, plain.weight_bytes)
    swiglu = kernels.norm_swiglu().swiglu
    for rows in (1, 3, 8, 16, 17, 40):
        x = torch.randn(rows, in_features, generator=g)
        assert torch.equal(fused(x), swiglu(plain(x))), rows
    assert fused.entry[2] == 96


@pytest.mark.parametrize("kernel", [pytest.param(Avx2Int8Linear, marks=needs_avx2_kernel),
                                    pytest.param(OneDnnInt8Linear, marks=needs_vnni)])
def test_kernels_without_a_swiglu_epilogue_keep_the_plain_gate_up_product(kernel):
    weight = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="cannot apply SwiGLU"):
        kernel.swiglu(weight)
    product = gate_up_product(kernel, weight, None)
    assert not product.applies_swiglu and product.output_features == 256


@pytest.mark.parametrize("kernel", SWIGLU_INT8_KERNELS)
def test_a_gate_up_product_of_other_sizes_stays_plain(kernel):
    """SwiGLU takes whole 64-channel panels of 32 gate and 32 up channels: 2 × 48 rows do not make them."""
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="cannot apply SwiGLU"):
        kernel.swiglu(weight)
    assert not gate_up_product(kernel, weight, None).applies_swiglu


def test_an_int8_decoders_gate_up_applies_swiglu_where_its_kernel_offers_it(tiny_qwen, monkeypatch):
    """The loader builds each layer's gate/up product by `gate_up_product`; the decoder then skips the SwiGLU kernel,
    and its logits are bitwise those of the same decoder with plain gate/up products."""
    fused = load_decoder(tiny_qwen, quantization="int8")
    assert all(layer.gate_up.applies_swiglu == int8_linear().fuses_swiglu for layer in fused.layers)
    monkeypatch.setattr(smoothing, "gate_up_product", lambda kernel, weight, bias: kernel(weight, bias))
    plain = load_decoder(tiny_qwen, quantization="int8")
    assert not any(layer.gate_up.applies_swiglu for layer in plain.layers)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(logits(fused, ids), logits(plain, ids))


@pytest.mark.parametrize("kernel", SPECDEC_INT8_KERNELS)
@pytest.mark.parametrize("rows", [1, 8])
def test_specdec_int8_kernels_are_exact_when_threads_take_from_each_others_shares(kernel, rows, oversubscribed_threads):
    """More intra-op threads than cores: the OS time-slices them, so their shares of the panels finish unevenly and
    a thread that is done takes panels from the back of another's share. Every output is still computed, exactly."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(4096, 192, generator=g) * 0.05  # 192: a multiple of 64, as the AMX path takes
    x = torch.randn(rows, 192, generator=g)
    linear = kernel(weight)
    expected = exact_int8_linear(linear, weight, x)
    for _ in range(30):
        assert torch.equal(linear(x), expected)


@needs_vnni
def test_onednn_int8_is_exact_where_the_cpu_has_vnni():
    g = torch.Generator().manual_seed(4)
    weight, x = torch.randn(96, 300, generator=g) * 0.05, torch.randn(5, 300, generator=g) * 30
    linear = OneDnnInt8Linear(weight)
    assert torch.equal(linear(x), exact_int8_linear(linear, weight, x))


@pytest.mark.parametrize("kernel", [*SPECDEC_INT8_KERNELS, pytest.param(PanelLinear, marks=pytest.mark.skipif(
    kernels.fp32_linear() is None, reason="no specdec float32 kernel on this CPU"))])
@pytest.mark.parametrize("features", [127, 129, 64])
def test_specdec_kernels_refuse_an_input_of_other_in_features(kernel, features):
    """The kernels pad in-features to their packing (127 would fit 128's): a wrong width is an error, not a guess."""
    linear = kernel(torch.randn(8, 128))
    with pytest.raises(ValueError, match="128 in-features got an input of"):
        linear(torch.randn(2, features))
    assert linear(torch.randn(2, 128)).shape == (2, 8)


def test_int8_kernel_is_chosen_once_per_process():
    chosen = linear_kernel(torch.float32, "cpu", "int8")
    expected = (AmxInt8Linear if kernels.int8_amx() else VnniInt8Linear if kernels.int8_vnni()
                else Avx2Int8Linear if kernels.int8_avx2() else OneDnnInt8Linear)
    assert chosen is expected


@needs_amx
def test_a_cpu_isa_cap_keeps_the_int8_kernel_off_amx(monkeypatch):
    """AMX is above every instruction set $SPECDEC_MAX_CPU_ISA names: with a cap the VNNI path runs."""
    monkeypatch.setenv(kernels.MAX_ISA_VARIABLE, "avx512")
    assert not kernels.int8_amx() and linear_kernel(torch.float32, "cpu", "int8") is VnniInt8Linear


@pytest.mark.parametrize("quantization", ["int8", pytest.param("int4", marks=needs_int4)])
def test_quantized_decoder_block_matches_single_steps(quantization, tiny_qwen):
    """A verify block's rows are bitwise the logits of one-token steps (integer sums are exact and each
    token's attention runs alone over its own prefix)."""
    decoder = load_decoder(tiny_qwen, quantization=quantization)
    ids = torch.randint(0, 256, (18,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = decoder.new_kv_cache(2, 64)
    a, b = cache.allocate(), cache.allocate()
    for slot in (a, b):
        decoder.forward(ForwardBatch.build([SequenceInput(slot, ids[:10])], [0]), cache)
    block = decoder.forward(ForwardBatch.build([SequenceInput(a, ids[10:], num_logits=8)], [10]), cache).logits
    singles = [
        decoder.forward(ForwardBatch.build([SequenceInput(b, [t])], [10 + i]), cache).logits
        for i, t in enumerate(ids[10:])
    ]
    assert torch.equal(block, torch.cat(singles))
    assert torch.equal(cache.keys[:, a, :, :18], cache.keys[:, b, :, :18])


@pytest.mark.parametrize("gamma", [2, 5])
@pytest.mark.parametrize("draft_format, draft_linear", [("int8", Int8Linear),
                                                        pytest.param("int4", Int4Linear, marks=needs_int4)])
def test_int8_greedy_speculation_is_token_identical_to_plain(gamma, draft_format, draft_linear, tiny_qwen,
                                                              tiny_qwen_draft):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # the last prompt is longer than the rows a forward computes row-invariantly: its prefill runs plain
    prompts = ["def add(a, b):", "x", "The quick brown fox jumps over the lazy dog. " * 3]
    plain = LLM(str(tiny_qwen), quantization="int8", max_model_len=256, max_num_seqs=3)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = {"method": "draft_model", "model": str(tiny_qwen_draft), "num_speculative_tokens": gamma,
            "quantization": draft_format, "adaptive": False}
    llm = LLM(str(tiny_qwen), quantization="int8", speculative_config=spec, max_model_len=256, max_num_seqs=3)
    assert isinstance(llm.engine.proposer.model.lm_head, draft_linear)
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    accepted = sum(o.metrics.speculative_decoding["num_accepted_tokens"] for o in outputs)
    assert 0 < accepted


def test_formats_are_chosen_per_role(tiny_qwen, tiny_qwen_draft):
    spec = {"method": "draft_model", "model": str(tiny_qwen_draft), "num_speculative_tokens": 2, "quantization": "int8",
            "adaptive": False}
    llm = LLM(str(tiny_qwen), quantization=None, speculative_config=spec, max_model_len=64)
    assert isinstance(llm.engine.model.lm_head, float32_linear()) and llm.config.quantization is None
    assert isinstance(llm.engine.proposer.model.lm_head, Int8Linear)


def test_auto_formats_are_the_measured_defaults(tiny_qwen, tiny_qwen_draft):
    spec = {"method": "draft_model", "model": str(tiny_qwen_draft), "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(str(tiny_qwen), speculative_config=spec, max_model_len=64)  # "auto" for both roles
    assert llm.config.quantization == DEFAULT_TARGET_QUANTIZATION == "int8"
    assert isinstance(llm.engine.model.lm_head, Int8Linear)
    # a draft model: int4 where specdec's int4 kernel runs, else int8; draft layers (EAGLE, MTP): int8
    assert DEFAULT_DRAFT_MODEL_QUANTIZATION == "int4" and DEFAULT_DRAFT_QUANTIZATION == "int8"
    draft_format = Int4Linear if kernels.int4_vnni() is not None else Int8Linear
    assert isinstance(llm.engine.proposer.model.lm_head, draft_format)
    # where int8 cannot run, "auto" keeps the float weights instead of failing
    assert resolve_quantization("auto", DEFAULT_TARGET_QUANTIZATION, torch.bfloat16, "cpu") is None
    assert resolve_quantization("auto", DEFAULT_TARGET_QUANTIZATION, torch.float32, "meta") is None
    assert resolve_quantization(None, DEFAULT_TARGET_QUANTIZATION, torch.float32, "cpu") is None


def test_an_int4_default_is_int8_where_the_int4_kernel_does_not_run(monkeypatch):
    monkeypatch.setattr(kernels, "int4_vnni", lambda: None)
    assert resolve_quantization("auto", DEFAULT_DRAFT_MODEL_QUANTIZATION, torch.float32, "cpu") == "int8"
    assert resolve_quantization("int4", DEFAULT_DRAFT_MODEL_QUANTIZATION, torch.float32, "cpu") == "int4"  # asked for


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"quantization": "fp8"}, "quantization must be None, 'auto' or one of"),
        ({"quantization": "int8", "dtype": "bfloat16"}, "computes in float32"),
        ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int3"}}, "draft quantization"),
    ],
)
def test_bad_quantization_is_refused(kwargs, message, tiny_qwen):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen), **kwargs)


def test_int8_needs_a_cpu():
    with pytest.raises(ValueError, match="int8 quantization needs a CPU"):
        linear_kernel(torch.float32, "meta", "int8")
