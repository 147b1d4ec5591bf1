"""The pure verifier against exact distributions, with its power shown on broken variants."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.metrics import SpecStats, alpha_from_mean_length, expected_length
from specdec.spec import verifier
from specdec.sampling import position_uniform
from specdec.spec.verifier import Verified, greedy_match, rejection_sample, sample_match

V, N = 8, 20_000
# A p-value below this would be a real mismatch: the chance that a correct verifier fails one
# of the checks below is 1e-4 each (and the seeds are fixed, so the suite is deterministic).
P_MIN = 1e-4


def synthetic(gamma: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sharp, clearly different p [γ+1, V] and q [γ, V]: per-position, context-free."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(gamma + 1, V, generator=g), -1)
    q = torch.softmax(3 * torch.randn(gamma, V, generator=g), -1)
    return p, q


def run_chain(verify, p, q, deterministic: bool, seed: int = 2) -> list[list[int]]:
    """N independent steps (one batched call) drafting from q, or proposing argmax q as a fixed guess."""
    gamma = q.shape[0]
    g = torch.Generator().manual_seed(seed)
    if deterministic:
        drafts = q.argmax(-1).expand(N, gamma)
    else:
        drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g) for i in range(gamma)], 1)
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(N)]
    result = verify(p.expand(N, -1, -1), drafts, [gamma] * N, None if deterministic else q.expand(N, -1, -1), generators)
    return result.tokens


def pvalue(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=V).double()
    expected = probs.double() / probs.double().sum() * len(samples)
    keep = expected >= 5  # chi-square needs enough expected counts: pool the rare cells
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if expected[-1] == 0:
        if observed[-1] > 0:
            return 0.0
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def token_pvalues(tokens: list[list[int]], p: torch.Tensor) -> tuple[float, float]:
    """First emitted token vs p_1; second (when the step emitted ≥ 2) vs p_2 (p is context-free)."""
    first = [t[0] for t in tokens]
    second = [t[1] for t in tokens if len(t) > 1]
    return pvalue(first, p[0]), pvalue(second, p[1])


def always_accept(p, drafts, num_draft, q, generators) -> Verified:
    """Broken on purpose: skips the acceptance test."""
    tokens = [drafts[r, :n].tolist() + [int(torch.multinomial(p[r, n], 1, generator=generators[r]))] for r, n in enumerate(num_draft)]
    return Verified([n for n in num_draft], tokens)


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-q", "one-hot-q"])
def test_rejection_sampling_emits_exactly_p(gamma, deterministic):
    p, q = synthetic(gamma, seed=gamma)
    first, second = token_pvalues(run_chain(rejection_sample, p, q, deterministic), p)
    assert first > P_MIN and second > P_MIN


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-q", "one-hot-q"])
def test_power_always_accepting_is_caught(deterministic):
    p, q = synthetic(2, seed=5)
    first, _ = token_pvalues(run_chain(always_accept, p, q, deterministic), p)
    assert first < 1e-12


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-q", "one-hot-q"])
def test_power_resampling_from_p_instead_of_the_residual_is_caught(deterministic, monkeypatch):
    p, q = synthetic(2, seed=6)
    monkeypatch.setattr(verifier, "_residual", lambda p_i, q_i, x: p_i)
    first, _ = token_pvalues(run_chain(rejection_sample, p, q, deterministic), p)
    assert first < 1e-12


def coupled(p, drafts, num_draft, q, generators, seed: int = 7, same_uniform: bool = False) -> Verified:
    """sample_match in run_chain's shape: row r draws position j from position_uniform(seed + r, j)."""
    assert q is None
    uniforms = [[position_uniform(seed * 1_000_003 + r, 0 if same_uniform else j) for j in range(n + 1)]
                for r, n in enumerate(num_draft)]
    return sample_match(p, drafts, num_draft, uniforms)


@pytest.mark.parametrize("gamma", [1, 3])
def test_coupled_verification_emits_exactly_p(gamma):
    p, q = synthetic(gamma, seed=10 + gamma)
    tokens = run_chain(coupled, p, q, deterministic=True)
    first, second = token_pvalues(tokens, p)
    assert first > P_MIN and second > P_MIN
    accepted = sum(len(t) > 1 for t in tokens) / N  # the first draft (argmax q) accepted with probability p(x)
    p_x = float(p[0, q[0].argmax()])
    assert abs(accepted - p_x) < 4 * (p_x * (1 - p_x) / N) ** 0.5


def test_power_one_uniform_for_every_position_is_caught():
    """The uniforms must be independent across positions: reusing one correlates the second token with the first."""
    p, q = synthetic(2, seed=12)
    p[1] = p[0]  # the same p twice: with one uniform, an accepted first draft forces the second token
    _, second = token_pvalues(run_chain(lambda *a: coupled(*a, same_uniform=True), p, q, deterministic=True), p)
    assert second < 1e-12


def test_position_uniforms_are_uniform_and_independent():
    from scipy.stats import kstest

    grid = torch.tensor([[position_uniform(seed, position) for position in range(100)] for seed in range(200)],
                        dtype=torch.float64)
    assert kstest(grid.flatten().numpy(), "uniform").pvalue > P_MIN
    for a, b in [(grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])]:  # neighbouring positions, neighbouring seeds
        correlation = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(correlation)) < 4 / grid[:, 1:].numel() ** 0.5


def test_acceptance_rate_is_sum_of_min_p_q():
    """Leviathan's α = Σ_x min(p(x), q(x)) for the first position."""
    p, q = synthetic(1, seed=9)
    result = rejection_sample(p.expand(N, -1, -1), torch.multinomial(q[0], N, replacement=True, generator=torch.Generator().manual_seed(3))[:, None],
                              [1] * N, q.expand(N, -1, -1), [torch.Generator().manual_seed(i) for i in range(N)])
    alpha = torch.minimum(p[0], q[0]).sum().item()
    observed = sum(result.num_accepted) / N
    assert abs(observed - alpha) < 4 * (alpha * (1 - alpha) / N) ** 0.5


def test_padded_rows_use_their_own_gamma_and_empty_drafts_sample_p():
    p = torch.zeros(2, 4, V)
    p[:, :, 5] = 1.0  # every position certain of token 5
    drafts = torch.tensor([[5, 5, 5], [5, 0, 0]])
    out = rejection_sample(p, drafts, [3, 1], None, [None, None])
    assert out.num_accepted == [3, 1] and out.tokens == [[5, 5, 5, 5], [5, 5]]
    out = rejection_sample(p, drafts[:, :0], [0, 0], None, [None, None])
    assert out.tokens == [[5], [5]] and out.num_accepted == [0, 0]


def test_greedy_match():
    best = torch.tensor([[4, 7, 1, 9], [4, 7, 1, 9], [3, 3, 3, 3]])
    drafts = torch.tensor([[4, 7, 1], [4, 2, 1], [3, 0, 0]])
    out = greedy_match(best, drafts, [3, 3, 1])
    assert out.num_accepted == [3, 1, 1]
    assert out.tokens == [[4, 7, 1, 9], [4, 7], [3, 3]]


def test_expected_length_and_alpha_are_inverse():
    assert expected_length(0.5, 3) == pytest.approx(1.875)  # (1 − 0.5⁴) / 0.5
    assert expected_length(1.0, 4) == 5 and expected_length(0.0, 4) == 1
    for alpha in (0.1, 0.55, 0.9):
        for gamma in (1, 4, 8):
            assert alpha_from_mean_length(expected_length(alpha, gamma), gamma) == pytest.approx(alpha, abs=1e-9)


def test_spec_stats_summary():
    stats = SpecStats()
    stats.record(4, 4)
    stats.record(4, 1)
    stats.record(2, 0)
    s = stats.summary()
    assert s["num_spec_steps"] == 3 and s["num_draft_tokens"] == 10 and s["num_accepted_tokens"] == 5
    assert s["draft_acceptance_rate"] == 0.5
    assert s["mean_acceptance_length"] == pytest.approx(1 + 5 / 3)
    assert s["acceptance_histogram"] == [2, 1, 1, 1]
    assert s["draft_histogram"] == [3, 3, 2, 2]
    assert s["per_position_acceptance"] == [2 / 3, 1 / 3, 1 / 2, 1 / 2]
    merged = SpecStats.from_summary(s).merged(SpecStats.from_summary(s))
    assert merged.summary()["per_position_acceptance"] == s["per_position_acceptance"]
    assert expected_length(s["alpha"], 10 / 3) == pytest.approx(s["mean_acceptance_length"])
