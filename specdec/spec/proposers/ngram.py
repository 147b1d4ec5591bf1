"""N-gram prompt lookup (Saxena 2023; vLLM `method: "ngram"`).

The draft is what followed the latest earlier occurrence of the sequence's longest suffix of
`prompt_lookup_max` down to `prompt_lookup_min` tokens, in prompt + output. Each sequence keeps an
index from n-gram to the end of its latest occurrence that has a continuation, updated once per
committed token (never rebuilt), so a step costs a few dictionary lookups. No match: no draft,
and the engine runs a plain step. The draft is deterministic (q = None).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specdec.engine.sequence import Sequence
from specdec.spec.proposers.base import Draft


class NgramIndex:
    """A token sequence and, for every n in [min_n, max_n], its n-grams → end of their latest
    occurrence that a token follows (the sequence's own suffix is indexed once it is followed)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._latest_end: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Seq[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # n-grams ending here now have `token` after them
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._latest_end[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def longest_match(self) -> tuple[int, int]:
        """(n, end): the longest suffix of n tokens that occurred before (min_n ≤ n ≤ max_n) and where its latest
        earlier occurrence ends; (0, 0) where none did."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self._latest_end.get(tuple(self.tokens[length - n :]))
            if end is not None:
                return n, end
        return 0, 0

    def propose(self, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens after the latest earlier occurrence of the longest matching suffix."""
        return self.propose_with_match(num_tokens)[0]

    def propose_with_match(self, num_tokens: int) -> tuple[list[int], int]:
        """`propose`'s tokens and the length of the match they follow (0: none)."""
        n, end = self.longest_match()
        return (continuation(self.tokens, end, num_tokens) if n and num_tokens > 0 else []), n


def continuation(tokens: Seq[int], start: int, num_tokens: int) -> list[int]:
    """tokens[start:] extended periodically: a match that overlaps the suffix (a repeating span)
    keeps repeating with its period, as the copy would if the sequence went on."""
    out: list[int] = []
    length = len(tokens)
    for i in range(num_tokens):
        j = start + i
        out.append(tokens[j] if j < length else out[j - length])
    return out


class NgramProposer:
    needs_hidden_states = False
    model = None  # a lookup, next to free beside a target forward
    stratified = True  # a draft's stratum is its match length: 5 matched tokens predict acceptance better than 2
    feature_layers = ()

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[Sequence, NgramIndex] = {}

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> Draft:
        found = [self._index(seq).propose_with_match(n) for seq, n in zip(seqs, num_tokens)]
        return Draft.deterministic([tokens for tokens, _ in found], strata=[length for _, length in found])

    def observe(self, seqs: Seq[Sequence], hidden: Seq[torch.Tensor] | None = None) -> None:
        for seq in seqs:
            self._index(seq)

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)

    def _index(self, seq: Sequence) -> NgramIndex:
        """The sequence's index, caught up with its committed tokens (drafts are never committed)."""
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self.min_n, self.max_n)
        if len(index.tokens) < seq.num_tokens:
            index.extend(seq.token_ids_from(len(index.tokens)))
        return index

