"""Lossless verification of drafted tokens (pure functions over tensors).

Notation (Leviathan et al. 2022; Chen et al. 2023), used across specdec:
  p  — the target model's processed distribution (temperature, top-k, top-p, min-p applied),
       at each of the γ + 1 verified positions;
  q  — the draft's processed distribution at each of its γ proposals; None for deterministic
       proposers (n-gram, suffix, greedy drafts), which act as a one-hot q at the proposed token;
  γ  — num_speculative_tokens, the number of drafted tokens of a step (may differ per sequence);
  α  — the acceptance rate: the probability that one drafted token is accepted.

Chain rule, per drafted token x_i in order: accept with probability min(1, p_i(x_i) / q_i(x_i)).
At the first rejection, emit a token from the residual norm(max(0, p_i − q_i)) and stop. If all
γ are accepted, emit a bonus token from p_γ+1. Each step therefore emits between 1 and γ + 1
tokens, distributed exactly as sampling them one by one from p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verified:
    """Per row: how many drafted tokens were accepted, and the tokens to append
    (the accepted drafts followed by one bonus or replacement token)."""

    num_accepted: list[int]
    tokens: list[list[int]]


def rejection_sample(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: Sequence[int],
    q: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> Verified:
    """p [B, γ_max + 1, V]; draft_tokens [B, γ_max] (rows padded past their γ); q [B, γ_max, V] or None."""
    num_accepted, tokens = [], []
    for row, gamma in enumerate(num_draft):
        g = generators[row]
        emitted: list[int] = []
        for i in range(gamma):
            x = int(draft_tokens[row, i])
            p_x = float(p[row, i, x])
            q_x = 1.0 if q is None else float(q[row, i, x])
            u = float(torch.rand((), generator=g))
            if u * q_x < p_x:  # u < p(x)/q(x), accepted with probability min(1, p/q)
                emitted.append(x)
                continue
            emitted.append(_draw(_residual(p[row, i], None if q is None else q[row, i], x), g))
            break
        else:
            emitted.append(_draw(p[row, gamma], g))  # all accepted: bonus token from p
        num_accepted.append(len(emitted) - 1)
        tokens.append(emitted)
    return Verified(num_accepted, tokens)


def greedy_match(target_argmax: torch.Tensor, draft_tokens: torch.Tensor, num_draft: Sequence[int]) -> Verified:
    """Temperature 0: accept while the draft equals argmax p; the first mismatch is replaced by argmax p.

    target_argmax [B, γ_max + 1]; the result is token-identical to plain greedy decoding.
    """
    num_accepted, tokens = [], []
    for row, gamma in enumerate(num_draft):
        best = target_argmax[row, : gamma + 1].tolist()
        drafted = draft_tokens[row, :gamma].tolist()
        n = 0
        while n < gamma and drafted[n] == best[n]:
            n += 1
        num_accepted.append(n)
        tokens.append(best[: n + 1])
    return Verified(num_accepted, tokens)


def _residual(p_i: torch.Tensor, q_i: torch.Tensor | None, x: int) -> torch.Tensor:
    """norm(max(0, p − q)); with a one-hot q at x that is p without x, renormalised."""
    if q_i is None:
        residual = p_i.clone()
        residual[x] = 0.0
    else:
        residual = (p_i - q_i).clamp_min_(0.0)
    total = residual.sum()
    # Only reachable by rounding when p ≈ q (then rejection has probability ~0): fall back to p.
    return residual / total if total > 0 else p_i


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
