"""specdec's float32 kernel (kernels/fp32_linear.cpp), each build this CPU runs (AVX-512, AVX2): accurate against a
float64 reference, every row bitwise the same alone or with other rows (one chain of fused multiply-adds per output,
whatever the tiling), and close to oneDNN's and PyTorch's kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.models import kernels
from specdec.models.linear import PanelLinear, PrepackedLinear

pytestmark = pytest.mark.skipif(kernels.fp32_linear() is None, reason="no AVX-512 or AVX2 on this CPU (or no compiler)")
ISAS = pytest.mark.parametrize("isa", [pytest.param(isa, id=isa.name) for isa in kernels.runnable_isas()])

# AVX-512: rows 1–4 (Zen 4: 1–6; Intel: 1–5) take one tile over four panels (fewer at the last channels), the rest
# up to 24 one tile over one panel (Intel: 6–12 over two); more rows take several tiles over chunks of 512 inputs (the
# partial sums kept in the output between chunks). AVX2: 1–3 rows over two panels, 4–6 over one, more in tiles of 6
# rows over one panel, by chunks.
ROWS = st.sampled_from([1, 2, 4, 5, 6, 7, 8, 12, 16, 24, 25, 31, 64])


def assert_accurate_and_row_invariant(
    linear: PanelLinear, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    together = linear(x)
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # float32 sums of `in_features` products: error bound ~ in_features · eps · Σ|x_k w_k|
    bound = weight.shape[1] * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T) + 1e-6
    assert ((together.double() - reference).abs() <= bound).all()
    for i in range(x.shape[0]):
        assert torch.equal(linear(x[i : i + 1])[0], together[i]), i
    assert torch.equal(linear(x[None])[0], together)  # leading dimensions are kept


@settings(max_examples=40, deadline=None)
@given(rows=ROWS, out_features=st.integers(1, 200), in_features=st.sampled_from([1, 3, 16, 100, 511, 512, 513, 1300]),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
@ISAS
def test_rows_are_accurate_and_bitwise_alone_or_together(isa, rows, out_features, in_features, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, in_features, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    assert_accurate_and_row_invariant(PanelLinear(weight, bias, isa), x, weight, bias)


@ISAS
@pytest.mark.parametrize("in_features", [1, 3, 8, 9, 100, 1300])
def test_six_rows_are_accurate_and_bitwise_alone_over_any_count_of_inputs(isa, in_features):
    """Six rows (on a Zen 4 host one tile over four panels that fetches its inputs 8 steps ahead, past the last one at
    the end of each panel group), over fewer inputs than that and more, and channels that end in a partial group."""
    g = torch.Generator().manual_seed(in_features)
    weight, bias = torch.randn(200, in_features, generator=g), torch.randn(200, generator=g)
    x = torch.randn(6, in_features, generator=g) * torch.logspace(-2, 2, 6)[:, None]
    assert_accurate_and_row_invariant(PanelLinear(weight, bias, isa), x, weight, bias)


@ISAS
@pytest.mark.parametrize("rows", range(1, 17))
def test_each_row_count_of_verification_is_accurate_and_bitwise_alone(isa, rows):
    """Every row count a verification forward brings (1–16), over channels that end in a partial panel and an odd
    panel (40 channels: two panels and a half), so each host's tiles for it run, the last group's too."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(40, 300, generator=g), torch.randn(40, generator=g)
    x = torch.randn(rows, 300, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    assert_accurate_and_row_invariant(PanelLinear(weight, bias, isa), x, weight, bias)


@ISAS
@pytest.mark.parametrize("rows", [1, 2, 6, 16, 17, 24])
def test_strided_inputs_give_the_bits_of_contiguous_ones(isa, rows):
    """One-tile calls lay the inputs out k-major themselves (masked permutes up to 16 rows on AVX-512, a loop past
    that): rows with a stride, inputs with a stride or a transposed view give the bits of the contiguous copy."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(40, 100, generator=g), torch.randn(40, generator=g)
    linear = PanelLinear(weight, bias, isa)
    wide = torch.randn(rows, 300, generator=g)
    for x in (wide[:, 7:107], wide[:, ::3][:, :100], torch.randn(100, rows, generator=g).t()):
        assert torch.equal(linear(x), linear(x.contiguous()))
    assert_accurate_and_row_invariant(linear, wide[:, 7:107], weight, bias)


@ISAS
@pytest.mark.parametrize("rows", [1, 8])
def test_rows_are_exact_when_threads_take_from_each_others_shares(isa, rows, oversubscribed_threads):
    """More intra-op threads than cores: their shares of the panels finish unevenly and a thread that is done takes
    panels from the back of another's share; every output is still computed, bitwise as with the default threads."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(4096, 160, generator=g)
    x = torch.randn(rows, 160, generator=g)
    linear = PanelLinear(weight, isa=isa)
    with torch.inference_mode():
        torch.set_num_threads(1)
        expected = linear(x)
        torch.set_num_threads(oversubscribed_threads)
        for _ in range(30):
            assert torch.equal(linear(x), expected)


@ISAS
def test_agrees_with_onednn_on_a_model_sized_matrix(isa):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(1000, 1536, generator=g) * 0.03, torch.randn(1000, generator=g)
    x = torch.randn(16, 1536, generator=g)
    linear = PanelLinear(weight, bias, isa)
    assert linear.packed.data_ptr() % 2**21 == 0  # 6 MB of weights: packed on 2 MiB pages
    torch.testing.assert_close(linear(x), PrepackedLinear(weight, bias)(x), atol=2e-5, rtol=1e-5)


def test_bad_shapes_are_refused():
    linear = PanelLinear(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="features"):
        linear.kernel.linear(torch.randn(2, 31), linear.packed, None, 8)
    with pytest.raises(RuntimeError, match="outputs"):
        linear.kernel.linear(torch.randn(2, 32), linear.packed, None, 40)
    assert linear(torch.randn(0, 32)).shape == (0, 8)
