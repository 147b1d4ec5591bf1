"""Medusa (Cai et al. 2024; vLLM `method: "medusa"`): a token tree from the heads' top candidates.

After each step the engine hands over the target's final hidden state of the last token it kept;
head k's top candidates fill depth k + 1 of a static tree (`speculative_token_tree`: node
(i_1, …, i_d) holds the i_d-th candidate of head d − 1 under the node (i_1, …, i_{d−1})). The
candidates are deterministic (q = None): verification is lossless tree rejection sampling, or
Medusa's typical acceptance where asked for. A step drafts a tree as deep as the engine's γ, at
most one level per head.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specdec.engine.sequence import Sequence
from specdec.models.medusa import MedusaHeads
from specdec.spec.proposers.base import Draft
from specdec.spec.tree import TokenTree

class MedusaProposer:
    needs_hidden_states = True
    stratified = False
    feature_layers = ()
    model = None  # the heads cost a few small products beside a target forward

    def __init__(self, heads: MedusaHeads, project, tree: TokenTree) -> None:
        """`project`: the heads' hidden states [N, H] → logits over `heads.vocab` (all tokens where None)."""
        if tree.max_depth > heads.config.num_heads:
            raise ValueError(f"the token tree is {tree.max_depth} deep, the Medusa heads predict {heads.config.num_heads}")
        self.heads = heads.eval()
        self.project = project
        self.tree = tree
        self._width = max(tree.ranks) + 1  # candidates needed per head
        self._hidden: dict[Sequence, torch.Tensor] = {}

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> Draft:
        rows = [i for i, seq in enumerate(seqs) if num_tokens[i] > 0 and seq in self._hidden]
        if not rows:
            return Draft.empty(len(seqs))
        depth = min(self.tree.max_depth, max(num_tokens[i] for i in rows))
        with torch.inference_mode():
            states = self.heads(torch.stack([self._hidden[seqs[i]] for i in rows]), depth)
            logits = self.project(states.reshape(-1, states.shape[-1])).view(len(rows), depth, -1)
            candidates = logits.topk(self._width, dim=-1).indices  # [rows, depth, width]
            if self.heads.vocab is not None:
                candidates = self.heads.vocab[candidates]
            candidates = candidates.tolist()  # one copy to the host, then plain indexing per tree node
        trees: list[TokenTree | None] = [None] * len(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        for r, i in enumerate(rows):
            tree, _ = self.tree.pruned(min(depth, num_tokens[i]))
            trees[i] = tree
            drafts[i] = [candidates[r][d - 1][rank] for d, rank in zip(tree.depths, tree.ranks)]
        draft = Draft.deterministic(drafts)
        return Draft(draft.tokens, draft.num_tokens, None, trees=trees)

    def observe(self, seqs: Seq[Sequence], hidden: Seq[torch.Tensor] | None = None) -> None:
        if hidden is None:
            raise ValueError("Medusa drafts from the target's hidden states: the engine must hand them over")
        for seq, states in zip(seqs, hidden):
            self._hidden[seq] = states[-1]

    def release(self, seq: Sequence) -> None:
        self._hidden.pop(seq, None)
