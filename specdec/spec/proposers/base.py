"""The proposer protocol: what every speculation method offers the engine.

The engine chooses γ per sequence per step and passes it in; a proposer may return fewer
tokens. Deterministic proposers return q = None, which alone selects the verification path
for one-hot drafts. The engine never asks which method a proposer implements.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.engine.sequence import Sequence
from specdec.models.decoder import Decoder
from specdec.spec.tree import TokenTree


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [B, γ_max] long; row i is valid up to num_tokens[i]
    num_tokens: list[int]  # γ_i proposed for each sequence
    q: torch.Tensor | None  # [B, γ_max, V] processed draft distributions; None = deterministic
    # a draft model's work per sequence: one forward per proposed token, taking in this many tokens in all (its
    # first forward catches up on what it has not seen); None = no model ran
    num_tokens_fed: list[int] | None = None
    # the draft forwards per sequence where they are not one per proposed token (a tree drafts a level per forward)
    num_forwards: list[int] | None = None
    # per sequence, a token tree whose node j holds tokens[i, j] (then num_tokens[i] is its node count), or None
    # for a chain; tree drafts are deterministic candidates (q = None)
    trees: list[TokenTree | None] | None = None
    # per sequence, the proposer's own class of its draft's evidence (an n-gram's match length): the adaptive
    # controller learns acceptance per class (engine/adaptive.py); None where the proposer has none
    strata: list[int] | None = None

    def __post_init__(self) -> None:
        if self.trees is not None and self.q is not None:
            raise ValueError("tree drafts are deterministic candidates: q must be None")

    @classmethod
    def empty(cls, batch: int) -> "Draft":
        return cls(torch.zeros(batch, 0, dtype=torch.long), [0] * batch, None)

    @classmethod
    def deterministic(
        cls, drafts: Seq[Seq[int]], trees: list[TokenTree | None] | None = None, strata: list[int] | None = None
    ) -> "Draft":
        """One token list per sequence (any lengths, empty = no draft), q = None."""
        tokens = torch.zeros(len(drafts), max((len(d) for d in drafts), default=0), dtype=torch.long)
        for i, draft in enumerate(drafts):
            tokens[i, : len(draft)] = torch.tensor(draft, dtype=torch.long)
        return cls(tokens, [len(d) for d in drafts], None, trees=trees, strata=strata)


class Proposer(Protocol):
    needs_hidden_states: bool  # whether observe() is given the target's hidden states (Medusa, EAGLE, MTP)
    # which: () = the final ones (after the last norm); else the outputs of these layers, concatenated (EAGLE-3)
    feature_layers: tuple[int, ...]
    # the draft's own model, whose measured cost curve prices drafting; None where drafting costs next to nothing
    model: Decoder | None
    # whether drafts come with `Draft.strata` (then, drafting being free, the controller asks for γ_max each step
    # and chooses how much to verify from the stratum's acceptance)
    stratified: bool

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> Draft:
        """Up to num_tokens[i] draft tokens continuing each sequence's committed tokens."""

    def observe(self, seqs: Seq[Sequence], hidden: Seq[torch.Tensor] | None = None) -> None:
        """Called after verification appended the accepted tokens: roll back what was rejected. Where the
        proposer needs them, `hidden[i]` holds the target's final hidden states [k, hidden_size] of the tokens
        seqs[i] fed and kept since the last call (its prompt chunks or pending tokens, then the accepted drafts):
        the last one's LM-head output gave the token the next step starts from (`feature_layers` says which
        hidden states)."""

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: drop its state."""
