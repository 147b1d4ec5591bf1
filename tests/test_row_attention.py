"""specdec's attention kernel for a step's new tokens (kernels/row_attention.cpp), each build this CPU runs: RoPE and
the cache write bitwise PyTorch's, attention accurate against a float64 reference, and each row bitwise the one-token
step that sees the same keys (batch invariance)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import prefill_chain_tree_logits
from specdec.models import kernels
from specdec.models.decoder import apply_rope
from specdec.models.loader import load_decoder

pytestmark = pytest.mark.skipif(kernels.row_attention() is None,
                                reason="no AVX-512 or AVX2 on this CPU (or no compiler)")
ISAS = pytest.mark.parametrize("isa", [pytest.param(isa, id=isa.name) for isa in kernels.runnable_isas()])


def _problem(heads: int, kv_heads: int, dim: int, cached: int, n: int, seed: int):
    """A layer's fused projections for n new tokens, their RoPE tables, and a slot's cache holding `cached` tokens."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.rand(n, dim // 2, generator=g) * 50
    cos, sin = torch.cat((angles, angles), dim=1).cos(), torch.cat((angles, angles), dim=1).sin()
    room = cached + n + 5
    keys = torch.randn(kv_heads, room, dim, generator=g)
    values = torch.randn(kv_heads, room, dim, generator=g)
    return qkv, cos, sin, keys, values


def _split(qkv, cos, sin, heads: int, kv_heads: int, dim: int):
    """What the PyTorch path computes: rotated q and k, and v."""
    qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(-1, heads + kv_heads, dim), cos, sin)
    return qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)


def _reference(q, keys, values, positions: list[int]) -> torch.Tensor:
    kv_heads, dim = keys.shape[0], keys.shape[2]
    query = q.double().reshape(kv_heads, -1, dim)
    k, v = keys[:, positions].double(), values[:, positions].double()
    return F.scaled_dot_product_attention(query[None], k[None], v[None])[0].reshape(-1)


@st.composite
def trees(draw, n: int) -> list[list[int]]:
    """A random token tree over n new tokens in topological order: each node's path (ancestors, then itself)."""
    paths: list[list[int]] = []
    for i in range(n):
        parent = draw(st.integers(-1, i - 1))
        paths.append((paths[parent] if parent >= 0 else []) + [i])
    return paths


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(12, 2, 128), (14, 2, 64), (4, 2, 4), (2, 1, 20), (6, 3, 136)]),
    cached=st.integers(0, 600),
    n=st.integers(1, 20),
    tree=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
@ISAS
def test_rows_match_a_float64_reference_and_their_own_step_bitwise(isa, shape, cached, n, tree, seed, data):
    paths = data.draw(trees(n)) if tree else []
    _check_rows(isa, shape, cached, n, paths, seed)


@ISAS
@pytest.mark.parametrize("cached", [60, 130, 240, 250, 255, 256, 270])
def test_a_deep_tree_path_across_blocks_of_values(isa, cached):
    """Tree rows fold their values in runs: the cache, then their gathered path; here the runs cross the kernel's
    blocks of 256 values at several offsets."""
    n = 24
    chain = [list(range(i + 1)) for i in range(16)]  # one deep path, then side branches off it
    branches = [chain[2 * i] + [16 + i] for i in range(n - 16)]
    _check_rows(isa, (12, 2, 128), cached, n, chain + branches, seed=cached)


@ISAS
@pytest.mark.parametrize(("cached", "n"), [(0, 33), (0, 100), (37, 70), (300, 65)])
def test_a_prefill_chunk_in_many_items_is_each_rows_own_step(isa, cached, n):
    """A chunk of more rows than an item takes: its items share the transposition of the key blocks all their rows
    see, the chunk's own tokens before the item included, and every row is still bitwise its one-token step."""
    _check_rows(isa, (12, 2, 128), cached, n, [], seed=n)
    _check_rows(isa, (6, 3, 136), cached, n, [], seed=n + 1)  # masked dimensions: no transposed blocks


def _check_rows(isa: kernels.Isa, shape, cached: int, n: int, paths: list[list[int]], seed: int) -> None:
    heads, kv_heads, dim = shape
    qkv, cos, sin, keys, values = _problem(heads, kv_heads, dim, cached, n, seed)
    cached_keys, cached_values = keys[:, :cached].clone(), values[:, :cached].clone()
    kernel = kernels.row_attention(isa)
    scale = 1 / math.sqrt(dim)
    out = kernel.attend(qkv, cos, sin, keys, values, cached, paths, scale)
    assert out.shape == (n, heads * dim)
    # the new tokens' keys and values are written as the PyTorch path writes them, bitwise; the cache is kept
    q, k, v = _split(qkv, cos, sin, heads, kv_heads, dim)
    assert torch.equal(keys[:, cached : cached + n], k.transpose(0, 1))
    assert torch.equal(values[:, cached : cached + n], v.transpose(0, 1))
    assert torch.equal(keys[:, :cached], cached_keys) and torch.equal(values[:, :cached], cached_values)
    for i in range(n):
        path = paths[i] if paths else list(range(i + 1))
        positions = list(range(cached)) + [cached + p for p in path]
        torch.testing.assert_close(out[i].double(), _reference(q[i], keys, values, positions), atol=2e-6, rtol=1e-5)
        # the one-token step of the same token: its path laid out after the cache, attending alone
        step_keys, step_values = keys[:, positions].clone(), values[:, positions].clone()
        step = kernel.attend(qkv[i : i + 1], cos[i : i + 1], sin[i : i + 1], step_keys, step_values,
                             len(positions) - 1, [], scale)
        assert torch.equal(step[0], out[i])


@ISAS
def test_bad_inputs_are_refused(isa):
    qkv, cos, sin, keys, values = _problem(4, 2, 16, 3, 2, 0)
    kernel = kernels.row_attention(isa)
    with pytest.raises(RuntimeError, match="outside the new tokens"):
        kernel.attend(qkv, cos, sin, keys, values, 3, [[0], [0, 2]], 0.25)
    with pytest.raises(RuntimeError, match="one path per row"):
        kernel.attend(qkv, cos, sin, keys, values, 3, [[0]], 0.25)
    with pytest.raises(RuntimeError, match="past the cache"):
        kernel.attend(qkv, cos, sin, keys[:, :4], values[:, :4], 3, [], 0.25)


@pytest.mark.parametrize("fixture", ["tiny_qwen", "tiny_llama"])
def test_decoder_with_the_kernel_agrees_with_pytorch_attention(fixture, request):
    """The same forwards (prefill, chain verification, a tree) with the kernel and with PyTorch's per-row calls."""
    decoder = load_decoder(request.getfixturevalue(fixture))
    assert decoder.row_attention is not None
    logits = {}
    for name, attention in (("kernel", decoder.row_attention), ("pytorch", None)):
        decoder.row_attention = attention
        logits[name] = prefill_chain_tree_logits(decoder)
    for kernel_logits, pytorch_logits in zip(logits["kernel"], logits["pytorch"]):
        torch.testing.assert_close(kernel_logits, pytorch_logits, atol=1e-4, rtol=1e-4)
