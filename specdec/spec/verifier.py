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

A deterministic chain at temperature > 0 (and a plain step: γ = 0) is verified by coupling instead
(`sample_match`): at each position the target draws its own token y_i ~ p_i from a uniform fixed by the
request's seed and the position, and the draft is accepted while x_i = y_i; the first y_i ≠ x_i is
emitted. x_i is accepted with probability p_i(x_i), and a rejection emits p_i without x_i renormalised:
the chain rule's distribution exactly (q one-hot), with the randomness tied to positions, so a seeded
request's text is the same whatever γ each step drafted or whether a lookup found anything (γ schedules
then compare on identical texts).

Trees (spec/tree.py; SpecInfer, Miao et al. 2024): at the current node, its children are tried in
order against a residual that starts as p there: accept child x with probability
min(1, r(x) / q(x)); on rejection r ← norm(max(0, r − q)) and try the next child; accepted, move
to the child (a fresh p); all rejected, emit a token from r and stop. Lossless when a node's
children are i.i.d. draws from q (or deterministic candidates: q one-hot at each, so a rejected
candidate is removed from r). Medusa's typical acceptance is lossy and opt-in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import math

import torch

from specdec.sampling import draw, draw_at
from specdec.spec.tree import ROOT, TokenTree


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
            emitted.append(draw(_residual(p[row, i], None if q is None else q[row, i], x), g))
            break
        else:
            emitted.append(draw(p[row, gamma], g))  # all accepted: bonus token from p
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


def sample_match(
    p: torch.Tensor, draft_tokens: torch.Tensor, num_draft: Sequence[int], uniforms: Sequence[Sequence[float]]
) -> Verified:
    """Deterministic drafts at temperature > 0 (module docstring): p [B, γ_max + 1, V]; uniforms[row][i] ∈ [0, 1)
    is the draw of the row's i-th verified position (γ + 1 of them). Greedy matching with each argmax replaced by
    a sample."""
    num_accepted, tokens = [], []
    for row, gamma in enumerate(num_draft):
        emitted: list[int] = []
        for i in range(gamma + 1):
            emitted.append(draw_at(p[row, i], uniforms[row][i]))
            if i == gamma or emitted[-1] != int(draft_tokens[row, i]):
                break
        num_accepted.append(len(emitted) - 1)
        tokens.append(emitted)
    return Verified(num_accepted, tokens)


@dataclass(frozen=True)
class TreeVerified:
    """The accepted nodes (depth 1 first) and the tokens to append: theirs, then one bonus or replacement token."""

    path: list[int]
    tokens: list[int]


# how a tree of deterministic candidates is verified at temperature > 0: (tree, node tokens, p [1 + n, V], generator)
TreeAcceptance = Callable[[TokenTree, Sequence[int], torch.Tensor, torch.Generator | None], TreeVerified]


def tree_greedy_match(tree: TokenTree, node_tokens: Sequence[int], target_argmax: Sequence[int]) -> TreeVerified:
    """Temperature 0: the deepest node whose whole path holds argmax p at every step (rows: 0 = the root, 1 + j =
    node j; the first in node order among equals: siblings may repeat a token), then argmax p after it.
    Token-identical to plain greedy decoding."""
    best = _deepest_passing(tree, lambda node, parent: int(node_tokens[node]) == int(target_argmax[1 + parent]))
    path = tree.path_to(best)
    return TreeVerified(path, [int(node_tokens[c]) for c in path] + [int(target_argmax[1 + best])])


def tree_rejection_sample(
    tree: TokenTree,
    node_tokens: Sequence[int],
    p: torch.Tensor,
    generator: torch.Generator | None,
    q: torch.Tensor | None = None,
) -> TreeVerified:
    """p [1 + n, V]: the target's distribution after the root and after each node; q [1 + n, V]: the draft's
    distribution that each node's children were drawn from (i.i.d.), or None for deterministic candidates."""
    path, node = [], ROOT
    while True:
        residual = p[1 + node]
        q_node = None if q is None else q[1 + node]
        for child in tree.children(node):
            x = int(node_tokens[child])
            q_x = 1.0 if q_node is None else float(q_node[x])
            if float(torch.rand((), generator=generator)) * q_x < float(residual[x]):
                path.append(child)
                node = child
                break
            residual = _residual(residual, q_node, x)
        else:
            return TreeVerified(path, [int(node_tokens[c]) for c in path] + [draw(residual, generator)])


def tree_typical_accept(
    tree: TokenTree,
    node_tokens: Sequence[int],
    p: torch.Tensor,
    generator: torch.Generator | None,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
) -> TreeVerified:
    """Medusa's typical acceptance (lossy): node j's token x passes if p_parent(x) > min(ε, δ·exp(−H(p_parent)))
    (ε = posterior_threshold, δ = posterior_alpha) and its parent passed; the deepest passing node wins (the
    first in node order among equals), then one token is drawn from p after it. At temperature 0 (p one-hot)
    only argmax tokens pass: greedy decoding."""
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    threshold = [min(posterior_threshold, posterior_alpha * math.exp(-float(h))) for h in entropy]
    best = _deepest_passing(tree, lambda node, parent: float(p[1 + parent, int(node_tokens[node])]) > threshold[1 + parent])
    path = tree.path_to(best)
    return TreeVerified(path, [int(node_tokens[c]) for c in path] + [draw(p[1 + best], generator)])


def _deepest_passing(tree: TokenTree, passes: Callable[[int, int], bool]) -> int:
    """The deepest node whose every node from depth 1 down passes `passes(node, parent)` (the first in node order
    among equals), or ROOT if no depth-1 node passes."""
    passed = [False] * tree.num_nodes
    best = ROOT
    for node, parent in enumerate(tree.parents):  # parents come first: their verdicts are known
        if (parent == ROOT or passed[parent]) and passes(node, parent):
            passed[node] = True
            if best == ROOT or tree.depths[node] > tree.depths[best]:
                best = node
    return best


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


