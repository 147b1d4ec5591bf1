"""Suffix decoding (Oliaro et al. 2024, arXiv:2411.04975; vLLM `method: "suffix"`).

Two counted suffix trees, bounded in depth: one per sequence over its prompt and output, and one
shared by the proposer over the outputs of the sequences it served (the active ones and up to
`max_cached_requests` finished ones, least recently finished evicted first). A step matches every
suffix of the sequence's last `max_depth` tokens in both trees; from each matched node it follows
the most frequent continuation while its estimated probability (product of child count ÷ the
node's continued count) stays ≥ `min_token_prob`, for at most `match length × max_spec_factor`
tokens; the path with the highest summed probability is the draft (deterministic, q = None). With
`tree`, the draft is a token tree of the most probable continuations below the best match instead
(best first, at most γ nodes), verified in one forward like Medusa's.
The shared tree belongs to the proposer, so to one engine: requests share it only there.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from specdec.engine.sequence import Sequence
from specdec.spec.proposers.base import Draft
from specdec.spec.tree import ROOT, TokenTree


class _Node:
    __slots__ = ("token", "depth", "count", "continued", "children", "best")

    def __init__(self, token: int, depth: int) -> None:
        self.token, self.depth = token, depth
        self.count = 0  # occurrences of the path from the root to here
        self.continued = 0  # of those, how many a token follows (sum of the children's counts)
        self.children: dict[int, _Node] = {}
        self.best: _Node | None = None  # the child with the highest count


class SuffixTree:
    """Every substring of at most max_depth tokens of the sequences added to it, with counts.

    Sequences grow one token at a time (`extend`): each token extends the open suffixes of its
    sequence, so adding a token costs O(max_depth). `remove` takes a finished sequence's counts
    back out.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(-1, 0)
        self._open: dict[object, list[_Node]] = {}  # per sequence: nodes of its suffixes still growing
        self.num_nodes = 0

    def extend(self, key: object, tokens: Seq[int]) -> None:
        open_nodes = self._open.get(key, [])
        for token in tokens:
            open_nodes.append(self.root)  # a suffix starts at this token
            grown = []
            for node in open_nodes:  # each open suffix grows by this token
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node(token, node.depth + 1)
                    self.num_nodes += 1
                child.count += 1
                node.continued += 1
                if node.best is None or child.count > node.best.count:
                    node.best = child
                if child.depth < self.max_depth:
                    grown.append(child)
            open_nodes = grown
        self._open[key] = open_nodes

    def close(self, key: object) -> None:
        """The sequence will not grow any more."""
        self._open.pop(key, None)

    def remove(self, key: object, tokens: Seq[int]) -> None:
        """Take back every substring count that `extend(key, tokens)` added."""
        self.close(key)
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                node = self._decrement(node, token)

    def match(self, pattern: Seq[int]) -> list[_Node]:
        """Nodes of pattern's suffixes of length 1, 2, … as far as they occur (a suffix that does
        not occur has no longer suffix that does)."""
        nodes = []
        for length in range(1, min(len(pattern), self.max_depth) + 1):
            node: _Node | None = self.root
            for token in pattern[len(pattern) - length :]:
                node = node.children.get(token)
                if node is None:
                    return nodes
            nodes.append(node)
        return nodes

    def _decrement(self, node: _Node, token: int) -> _Node:
        child = node.children[token]
        child.count -= 1
        node.continued -= 1
        if child.count == 0:
            del node.children[token]  # its subtree goes with it: its counts fall to 0 below it too
            self.num_nodes -= 1
        if node.best is child:
            node.best = max(node.children.values(), key=lambda c: c.count, default=None)
        return child


@dataclass(frozen=True)
class SuffixSpeculation:
    tokens: list[int]
    score: float  # sum of the tokens' estimated probabilities: expected accepted tokens
    parents: tuple[int, ...] | None = None  # a tree's (tokens[j] under tokens[parents[j]]); None: a chain


def speculate(node: _Node, max_tokens: int, min_token_prob: float) -> SuffixSpeculation:
    """The most frequent continuation below node while its estimated probability ≥ min_token_prob."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < max_tokens and node.best is not None:
        prob *= node.best.count / node.continued
        if prob < min_token_prob:
            break
        node = node.best
        tokens.append(node.token)
        score += prob
    return SuffixSpeculation(tokens, score)


def speculate_tree(node: _Node, max_tokens: int, min_token_prob: float) -> SuffixSpeculation:
    """The `max_tokens` most probable continuations below node as a token tree (SuffixDecoding's tree speculation):
    best first by estimated probability (the product of count ÷ continued along the path), each ≥ min_token_prob.
    Nodes come out parents first, siblings most probable first."""
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    order = itertools.count()  # ties: the earlier-found path first
    frontier = [(-child.count / node.continued, next(order), ROOT, child) for child in node.children.values()]
    heapq.heapify(frontier)
    while frontier and len(tokens) < max_tokens:
        negative, _, parent, child = heapq.heappop(frontier)
        prob = -negative
        if prob < min_token_prob:
            break
        tokens.append(child.token)
        parents.append(parent)
        score += prob
        index = len(tokens) - 1
        for grandchild in child.children.values():
            heapq.heappush(frontier, (-prob * grandchild.count / child.continued, next(order), index, grandchild))
    return SuffixSpeculation(tokens, score, tuple(parents))


def best_speculation(
    trees: Seq[SuffixTree], pattern: Seq[int], max_tokens: int, max_spec_factor: float, min_token_prob: float,
    as_tree: bool = False,
) -> SuffixSpeculation:
    best = SuffixSpeculation([], 0.0)
    for tree in trees:
        for length, node in enumerate(tree.match(pattern), start=1):
            limit = min(max_tokens, int(length * max_spec_factor + 1e-9))
            found = speculate_tree(node, limit, min_token_prob) if as_tree else speculate(node, limit, min_token_prob)
            if found.score > best.score:
                best = found
    return best


# a draft's stratum: its expected accepted tokens by the trees' counts (`score`), whole tokens up to this; the score
# predicts acceptance (measured on the 1.5B: drafts scored < 2 had their first token accepted 0-30% of the time, ≥ 3
# 50-80%), though it over-promises in absolute terms
MAX_SCORE_STRATUM = 4


class SuffixProposer:
    needs_hidden_states = False
    model = None  # a lookup, next to free beside a target forward
    stratified = True
    feature_layers = ()

    def __init__(
        self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float, tree: bool = False
    ) -> None:
        self.tree = tree  # draft token trees (up to γ nodes) instead of one path
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._local: dict[Sequence, SuffixTree] = {}  # prompt + output of each active sequence
        self._seen: dict[Sequence, int] = {}  # tokens of each active sequence already in the trees
        self._keys: dict[Sequence, int] = {}  # its key in the shared tree
        self._serial = itertools.count()
        # outputs of the sequences served, shared across requests; None when max_cached_requests is 0
        self.shared = SuffixTree(max_depth) if max_cached_requests > 0 else None
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # finished outputs in the shared tree, oldest first

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> Draft:
        drafts, token_trees, strata = [], [], []
        for seq, n in zip(seqs, num_tokens):
            local = self._catch_up(seq)
            trees = [local] if self.shared is None else [local, self.shared]
            pattern = seq.token_ids_from(max(0, seq.num_tokens - self.max_depth))
            found = SuffixSpeculation([], 0.0)
            if n > 0:
                found = best_speculation(trees, pattern, n, self.max_spec_factor, self.min_token_prob, self.tree)
            drafts.append(found.tokens)
            strata.append(min(int(found.score), MAX_SCORE_STRATUM))
            token_trees.append(TokenTree(found.parents) if found.parents else None)
        return Draft.deterministic(drafts, token_trees if self.tree else None, strata)

    def observe(self, seqs: Seq[Sequence], hidden: Seq[torch.Tensor] | None = None) -> None:
        for seq in seqs:
            self._catch_up(seq)

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's own tree; its output stays in the shared tree as a cached request."""
        if seq not in self._local:
            return
        self._catch_up(seq)
        del self._local[seq], self._seen[seq]
        key = self._keys.pop(seq)
        if self.shared is None:
            return
        self.shared.close(key)
        self.cached[key] = list(seq.output_token_ids)
        while len(self.cached) > self.max_cached_requests:
            old_key, old_tokens = self.cached.popitem(last=False)
            self.shared.remove(old_key, old_tokens)

    def _catch_up(self, seq: Sequence) -> SuffixTree:
        local = self._local.get(seq)
        if local is None:
            local = self._local[seq] = SuffixTree(self.max_depth)
            self._seen[seq] = 0
            self._keys[seq] = next(self._serial)
        seen = self._seen[seq]
        if seen < seq.num_tokens:
            new = seq.token_ids_from(seen)
            local.extend(seq, new)
            if self.shared is not None:
                prompt = len(seq.prompt_token_ids)
                self.shared.extend(self._keys[seq], new[max(0, prompt - seen) :])  # outputs only
            self._seen[seq] = seq.num_tokens
        return local
