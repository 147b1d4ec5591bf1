"""Processed distributions (temperature/top-k/top-p/min-p), seeded drawing, parameter validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specdec.config import EngineConfig, SamplingParams
from specdec.sampling import DRAW_BLOCK, draw, greedy_tokens, make_generator, processed_probs, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def probs_of(**kw) -> torch.Tensor:
    return processed_probs(LOGITS, [SamplingParams(**kw)])[0]


def test_greedy_is_one_hot_at_argmax():
    p = probs_of(temperature=0)
    assert p.tolist() == [1.0, 0, 0, 0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 300), values=st.lists(
    st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")]), min_size=1, max_size=40),
    seed=st.integers(0, 2**16), strided=st.booleans())
def test_greedy_tokens_are_torch_argmax(rows, vocab, values, seed, strided):
    """Ties (the first index), ±inf and NaN (above everything) as torch.argmax, for 2-D, strided and 1-D logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 2 * vocab if strided else vocab, generator=g).round()  # rounded: many ties
    logits = logits[:, ::2] if strided else logits
    spots = torch.randint(0, vocab, (len(values),), generator=g)
    logits[torch.randint(0, rows, (len(values),), generator=g), spots] = torch.tensor(values)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits[0]), logits[0].argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits.double()), logits.double().argmax(dim=-1))


def test_temperature_matches_softmax():
    torch.testing.assert_close(probs_of(temperature=0.5), torch.softmax(LOGITS[0] / 0.5, -1))
    torch.testing.assert_close(probs_of(temperature=1.0), torch.softmax(LOGITS[0], -1))


def test_top_k_keeps_k_most_likely_renormalised():
    p = probs_of(top_k=2)
    full = torch.softmax(LOGITS[0], -1)
    torch.testing.assert_close(p[:2], full[:2] / full[:2].sum())
    assert p[2:].sum() == 0


def test_top_p_keeps_smallest_prefix_reaching_mass():
    full = torch.softmax(LOGITS[0], -1)  # ≈ [.56, .21, .12, .08, .03, .004]
    cut = float(full[:2].sum()) - 1e-4  # needs exactly two tokens
    p = probs_of(top_p=cut)
    assert (p > 0).sum() == 2
    p = probs_of(top_p=float(full[:2].sum()) + 1e-4)  # needs a third
    assert (p > 0).sum() == 3
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))


def test_a_tiny_top_p_keeps_the_likeliest_token():
    """top_p = 5e-324 (found by schemathesis through the server) rounds to 0 in float32: still one token."""
    assert probs_of(top_p=5e-324).tolist() == [1.0, 0, 0, 0, 0, 0]


def test_a_top_k_beyond_the_vocabulary_keeps_everything():
    torch.testing.assert_close(probs_of(top_k=10**26), probs_of())  # also found through the server


def test_min_p_drops_tokens_below_fraction_of_the_best():
    full = torch.softmax(LOGITS[0], -1)
    p = probs_of(min_p=0.3)
    keep = full >= 0.3 * full[0]
    assert torch.equal(p > 0, keep)
    torch.testing.assert_close(p[keep], full[keep] / full[keep].sum())


def test_rows_use_their_own_params():
    logits = LOGITS.repeat(3, 1)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(temperature=2.0)]
    p = processed_probs(logits, params)
    assert p[0].argmax() == 0 and p[0].max() == 1
    assert p[1][0] == 1
    torch.testing.assert_close(p[2], torch.softmax(LOGITS[0] / 2, -1))


def test_sampling_matches_distribution_chi_square():
    probs = probs_of(temperature=0.8, top_k=4)
    n = 20_000
    rows = probs.expand(n, -1).contiguous()
    draws = sample(rows, [make_generator(7)] * n)
    counts = torch.bincount(draws, minlength=6)[:4].double()
    expected = probs[:4].double() / probs[:4].double().sum() * n
    assert torch.bincount(draws, minlength=6)[4:].sum() == 0  # filtered tokens never drawn
    # 3 degrees of freedom; p < 1e-3 would be a real mismatch at this sample size.
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


def test_draw_across_blocks_matches_the_distribution():
    """Mass at block edges, the first and last entries, an empty block, the short last block."""
    vocab = 3 * DRAW_BLOCK + 77
    support = [0, 5, DRAW_BLOCK - 1, DRAW_BLOCK, DRAW_BLOCK + 1, 3 * DRAW_BLOCK, 3 * DRAW_BLOCK + 40, vocab - 1]  # block 2 empty
    probs = torch.zeros(vocab)
    probs[support] = torch.tensor([0.05, 0.2, 0.1, 0.15, 0.02, 0.18, 0.1, 0.2])
    g = make_generator(3)
    n = 40_000
    draws = torch.tensor([draw(probs, g) for _ in range(n)])
    counts = torch.bincount(draws, minlength=vocab)
    assert counts[probs == 0].sum() == 0
    expected = probs[support].double() / probs.double().sum() * n
    assert chisquare(counts[support].double().numpy(), expected.numpy()).pvalue > 1e-3
    for only in (0, DRAW_BLOCK - 1, vocab - 1):
        one_hot = torch.zeros(vocab)
        one_hot[only] = 1.0
        assert {draw(one_hot, g) for _ in range(20)} == {only}


def test_seeded_generators_reproduce_and_differ_by_seed():
    probs = torch.softmax(torch.randn(1, 50), -1)
    a = [int(sample(probs, [g])[0]) for g in [make_generator(3)] for _ in range(20)]
    b = [int(sample(probs, [g])[0]) for g in [make_generator(3)] for _ in range(20)]
    c = [int(sample(probs, [g])[0]) for g in [make_generator(4)] for _ in range(20)]
    assert a == b and a != c


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(min_p=1.2), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="x"), "seed"),
        (dict(seed=2**64), "seed"),
    ],
)
def test_invalid_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)


@pytest.mark.parametrize("kwargs", [dict(max_model_len=1), dict(max_num_seqs=0), dict(model="")])
def test_invalid_engine_config(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**{"model": "m", **kwargs})
