"""EAGLE (Li et al. 2024; vLLM / SGLang `method: "eagle"` and `"eagle3"`): drafting in the target's feature space.

The engine hands over the target's hidden states of every token it keeps (prompt chunks included):
its final ones for EAGLE-1/2, the outputs of three of its layers for EAGLE-3 (models/eagle3.py). Each step the draft layer first catches up on the features it has not read (f_t with
token t + 1, one row each: the last row's output f̂ gives depth 1), then drafts deeper by feeding its
own f̂ back. With `top_k` = 1 that is a chain (vLLM's EAGLE); with `top_k` > 1 it is EAGLE-2's
dynamic tree: per depth the `top_k` most confident candidates are expanded in one draft forward
(each row attends to the draft's cache and its own ancestors), and the `num_draft_tokens` most
confident candidates of all depths are verified. Candidates are deterministic (q = None): the tree
verifier's multi-candidate rejection sampling keeps every temperature lossless.

The draft's KV cache holds the positions it read with the target's real features; what a step's
drafting wrote after them is dropped when it ends.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specdec.engine.sequence import Sequence
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.eagle import EagleDrafter
from specdec.models.eagle3 import Eagle3Drafter
from specdec.spec.draft_tree import DraftTreeSearch
from specdec.spec.proposers.base import Draft
from specdec.spec.proposers.tree_growth import grow_trees, tree_draft


class EagleProposer:
    needs_hidden_states = True
    stratified = False

    def __init__(self, drafter: EagleDrafter | Eagle3Drafter, max_num_seqs: int, max_model_len: int, top_k: int = 1,
                 num_draft_tokens: int = 8) -> None:
        self.drafter = drafter
        self.feature_layers = drafter.feature_layers  # the target layers whose outputs the draft reads
        self.model = drafter.decoder  # its measured cost curve prices drafting
        self.top_k = top_k
        self.num_draft_tokens = num_draft_tokens
        # room for a step's drafting behind the real positions: top_k rows per depth, at most 64 depths
        self.cache = self.model.new_kv_cache(max_num_seqs, max_model_len + 64 * top_k)
        self._slots: dict[Sequence, int] = {}
        self._unread: dict[Sequence, list[torch.Tensor]] = {}  # target features the draft has not read yet

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> Draft:
        rows = [i for i, seq in enumerate(seqs)
                if num_tokens[i] > 0 and self._unread.get(seq) and self._caught_up_to(seq) == seq.num_tokens - 1]
        if not rows:
            return Draft.empty(len(seqs))
        slots = [self._slots[seqs[i]] for i in rows]
        # catch-up: every unread feature f_t with token t + 1; the last row's output starts the draft
        inputs, token_ids, features, fed = [], [], [], []
        for i, slot in zip(rows, slots):
            seq = seqs[i]
            tokens = seq.token_ids_from(self.cache.length(slot) + 1)
            inputs.append(SequenceInput(slot, tokens, num_logits=1))
            token_ids += tokens
            features += self._unread.pop(seq)
            fed.append(len(tokens))
        batch = ForwardBatch.build(inputs, [self.cache.length(s) for s in slots])
        out = self.drafter.forward(batch, self.cache, torch.tensor(token_ids), torch.cat(features))
        searches = [DraftTreeSearch(self.top_k, num_tokens[i], self._num_nodes(num_tokens[i])) for i in rows]
        last_rows = torch.tensor(fed).cumsum(0) - 1
        forwards = grow_trees(self.drafter.forward, self.cache, slots, searches, out.logits, out.hidden[last_rows],
                              self.drafter.token_ids)
        return tree_draft(len(seqs), rows, searches, forwards, fed, chain=self.top_k == 1)

    def _num_nodes(self, depth: int) -> int:
        return depth if self.top_k == 1 else self.num_draft_tokens

    def observe(self, seqs: Seq[Sequence], hidden: Seq[torch.Tensor] | None = None) -> None:
        if hidden is None:
            raise ValueError("EAGLE drafts from the target's hidden states: the engine must hand them over")
        for seq, states in zip(seqs, hidden):
            if seq not in self._slots:
                self._slots[seq] = self.cache.allocate()
            self._unread.setdefault(seq, []).append(states.to(self.model.dtype))

    def release(self, seq: Sequence) -> None:
        self._unread.pop(seq, None)
        slot = self._slots.pop(seq, None)
        if slot is not None:
            self.cache.free(slot)

    def _caught_up_to(self, seq: Sequence) -> int:
        """How many positions' features the draft has (read or unread): it can draft once it has every committed
        token's but the last (whose feature the next verify forward computes)."""
        if seq not in self._slots:
            return 0
        return self.cache.length(self._slots[seq]) + sum(len(f) for f in self._unread.get(seq, []))
