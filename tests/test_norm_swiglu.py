"""specdec's RMSNorm and SwiGLU kernel (kernels/norm_swiglu.cpp), each build this CPU runs (AVX-512, AVX2): within a
few float32 ulps of PyTorch's ops, every row bitwise the same alone or with other rows, and the decoder's forwards the
same with it as with PyTorch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.models import kernels
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.loader import load_decoder

pytestmark = pytest.mark.skipif(kernels.norm_swiglu() is None, reason="no AVX-512 or AVX2 on this CPU (or no compiler)")
ISAS = pytest.mark.parametrize("isa", [pytest.param(isa, id=isa.name) for isa in kernels.runnable_isas()])

EPS = 1e-6
ROWS = st.sampled_from([1, 2, 3, 7, 16, 65, 130])  # past 64 rows the norms split over threads
# whole and partial vectors of 16 lanes; SwiGLU splits rows into pieces of 1024 columns (2100: two and a partial)
FEATURES = st.sampled_from([1, 5, 16, 17, 100, 1536, 2100])


def _rows(rows: int, features: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, features, generator=g) * scale * torch.logspace(-3, 3, rows)[:, None]


def _assert_rows_bitwise(fn, *inputs: torch.Tensor) -> None:
    together = fn(*inputs)
    for i in range(inputs[0].shape[0]):
        alone = fn(*(x[i : i + 1] for x in inputs))
        for a, t in zip(alone if isinstance(alone, tuple) else (alone,), together if isinstance(together, tuple) else (together,)):
            assert torch.equal(a[0], t[i]), i


@settings(max_examples=30, deadline=None)
@given(rows=ROWS, features=FEATURES, seed=st.integers(0, 2**16))
@ISAS
def test_rms_norm_and_its_residual_add_match_pytorch(isa, rows, features, seed):
    kernel = kernels.norm_swiglu(isa)
    x, delta = _rows(rows, features, seed), _rows(rows, features, seed + 1)
    weight = torch.randn(features, generator=torch.Generator().manual_seed(seed + 2))
    # the sum of squares is added in another order than PyTorch's: a few ulps of the output
    torch.testing.assert_close(kernel.rms_norm(x, weight, EPS), F.rms_norm(x, (features,), weight, EPS),
                               rtol=2e-6, atol=1e-6)
    total, normed = kernel.add_rms_norm(x, delta, weight, EPS)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, F.rms_norm(x + delta, (features,), weight, EPS), rtol=2e-6, atol=1e-6)
    _assert_rows_bitwise(lambda a: kernel.rms_norm(a, weight, EPS), x)
    _assert_rows_bitwise(lambda a, b: kernel.add_rms_norm(a, b, weight, EPS), x, delta)
    assert torch.equal(kernel.rms_norm(x[None], weight, EPS)[0], kernel.rms_norm(x, weight, EPS))  # leading dims kept


@settings(max_examples=30, deadline=None)
@given(rows=ROWS, inner=FEATURES, seed=st.integers(0, 2**16))
@ISAS
def test_swiglu_matches_pytorch(isa, rows, inner, seed):
    kernel = kernels.norm_swiglu(isa)
    gate_up = _rows(rows, 2 * inner, seed, scale=2.0)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernel.swiglu(gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-30)
    _assert_rows_bitwise(kernel.swiglu, gate_up)


@ISAS
def test_swiglu_at_the_extremes(isa):
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, 3e38, -3e38])
    up = torch.full_like(gate, 0.75)
    expected = F.silu(gate.double()) * up.double()
    got = kernels.norm_swiglu(isa).swiglu(torch.cat((gate, up))[None])[0]
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-37)


@ISAS
def test_bad_inputs_are_refused(isa):
    kernel = kernels.norm_swiglu(isa)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), EPS)
    with pytest.raises(RuntimeError, match="weight of 4"):
        kernel.rms_norm(torch.ones(2, 4), torch.ones(5), EPS)
    with pytest.raises(RuntimeError, match="differ in shape"):
        kernel.add_rms_norm(torch.ones(2, 4), torch.ones(1, 4), torch.ones(4), EPS)
    with pytest.raises(RuntimeError, match="halves"):
        kernel.swiglu(torch.ones(2, 5))


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama"])
def test_decoder_with_the_kernel_agrees_with_pytorch_ops(fixture, request):
    """A prefill and a verification forward with the kernel and with PyTorch's norm and SwiGLU ops."""
    decoder = load_decoder(request.getfixturevalue(fixture))
    assert decoder.norm_swiglu is not None
    outputs = {}
    for name, kernel in (("kernel", decoder.norm_swiglu), ("pytorch", None)):
        decoder.norm_swiglu = kernel
        cache = decoder.new_kv_cache(1, 64)
        slot = cache.allocate()
        prefill = decoder.forward(ForwardBatch.build([SequenceInput(slot, list(range(3, 20)))], [0]), cache)
        chain = decoder.forward(ForwardBatch.build([SequenceInput(slot, [7, 8, 9, 10, 11])], [17]), cache)
        outputs[name] = (prefill.logits, prefill.hidden, chain.logits, chain.hidden)
    for with_kernel, with_pytorch in zip(outputs["kernel"], outputs["pytorch"]):
        torch.testing.assert_close(with_kernel, with_pytorch, atol=1e-4, rtol=1e-4)
