"""EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv:2406.16858), as a pure search over draft scores.

A candidate's score is its path's cumulative draft log-probability (the draft's confidence, which
tracks its acceptance rate). Expansion: the root's top-k children form depth 1; at each further depth
the k best-scoring candidates of the deepest level are expanded, each by its own top-k children (the
draft runs once per depth on those k). Reranking: the `num_nodes` best-scoring candidates of every
level make the tree. A child never outscores its parent (log-probabilities are ≤ 0) and ties go to
the shallower candidate, so the chosen set holds every chosen node's ancestors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.spec.tree import ROOT, TokenTree


@dataclass(frozen=True)
class Candidate:
    parent: int  # ROOT or the parent candidate's index
    token: int
    rank: int  # its place among its parent's children, by draft probability
    score: float  # cumulative log-probability of its path
    depth: int


class DraftTreeSearch:
    def __init__(self, top_k: int, max_depth: int, num_nodes: int) -> None:
        if top_k < 1 or max_depth < 1 or num_nodes < 1:
            raise ValueError(f"a draft tree needs top_k, depth and node count >= 1, got {top_k}, {max_depth}, {num_nodes}")
        self.top_k, self.max_depth, self.num_nodes = top_k, max_depth, num_nodes
        self.candidates: list[Candidate] = []
        self._deepest: list[int] = []  # the candidates of the deepest level so far

    def add_children(self, parent: int, tokens: Sequence[int], logprobs: Sequence[float]) -> None:
        """`parent`'s (ROOT or a candidate from `frontier`) top children, most probable first, and their log-probs."""
        base = 0.0 if parent == ROOT else self.candidates[parent].score
        depth = 1 if parent == ROOT else self.candidates[parent].depth + 1
        if self._deepest and self.candidates[self._deepest[0]].depth != depth:
            self._deepest = []
        for rank, (token, logprob) in enumerate(zip(tokens[: self.top_k], logprobs[: self.top_k])):
            self._deepest.append(len(self.candidates))
            self.candidates.append(Candidate(parent, int(token), rank, base + float(logprob), depth))

    def frontier(self) -> list[int]:
        """The candidates to expand next: the deepest level's `top_k` best, none once the tree is `max_depth` deep."""
        if not self._deepest or self.candidates[self._deepest[0]].depth >= self.max_depth:
            return []
        return sorted(self._deepest, key=lambda i: (-self.candidates[i].score, i))[: self.top_k]

    def best(self) -> list[int]:
        """The `num_nodes` best-scoring candidates (ties: shallower, then earlier)."""
        order = sorted(range(len(self.candidates)), key=lambda i: (-self.candidates[i].score, self.candidates[i].depth, i))
        return order[: self.num_nodes]

    def tree(self) -> tuple[TokenTree, list[int]]:
        """The chosen candidates as a token tree (depth-first, most probable child first) and its node tokens."""
        chosen = self.best()
        paths = {i: self._rank_path(i) for i in chosen}
        tree = TokenTree.from_choices(paths.values())
        tokens_by_path = {paths[i]: self.candidates[i].token for i in chosen}
        return tree, [tokens_by_path[path] for path in sorted(paths.values())]

    def _rank_path(self, index: int) -> tuple[int, ...]:
        path = []
        while index != ROOT:
            path.append(self.candidates[index].rank)
            index = self.candidates[index].parent
        return tuple(reversed(path))
