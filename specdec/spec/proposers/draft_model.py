"""Independent draft model (Leviathan et al. 2022; Chen et al. 2023).

The draft keeps its own KV slot per sequence. Each step it first catches up on the tokens it
has not seen (the prompt, then the last accepted token and the bonus), then samples γ tokens
autoregressively from q, its processed distribution under the request's SamplingParams.
After verification it rolls back to the longest prefix that the sequence still agrees with.

A row stops drafting after a token the draft itself gives less than `confidence_threshold`
(HF's `assistant_confidence_threshold`): past an unlikely token, further drafts are mostly
rejected, and each costs a draft forward.

With `top_k` > 1 the draft proposes EAGLE-2-style dynamic token trees instead (SGLang's standalone
speculation, with the same knobs): per depth its top_k most confident candidates are expanded in one
draft forward, and its `num_draft_tokens` most confident candidates are verified.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specdec.engine.sequence import Sequence
from specdec.kv_cache import KVCache
from specdec.models.batch import ForwardBatch, ForwardOutput, SequenceInput
from specdec.models.decoder import Decoder
from specdec.sampling import greedy_tokens, processed_probs, sample
from specdec.spec.draft_tree import DraftTreeSearch
from specdec.spec.proposers.base import Draft
from specdec.spec.proposers.tree_growth import grow_trees, tree_draft


class DraftModelProposer:
    needs_hidden_states = False
    stratified = False
    feature_layers = ()

    def __init__(self, model: Decoder, max_num_seqs: int, max_model_len: int, confidence_threshold: float = 0.0,
                 top_k: int = 1, num_draft_tokens: int = 8) -> None:
        self.model = model
        self.confidence_threshold = confidence_threshold
        self.top_k, self.num_draft_tokens = top_k, num_draft_tokens
        # a tree's drafting writes top_k rows per depth (at most 64) behind the sequence
        self.cache = model.new_kv_cache(max_num_seqs, max_model_len + (64 * top_k if top_k > 1 else 0))
        self._slots: dict[Sequence, int] = {}

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> Draft:
        gamma_max = max(num_tokens, default=0)
        if gamma_max == 0:
            return Draft.empty(len(seqs))
        if self.top_k > 1:
            return self._propose_trees(seqs, num_tokens)
        tokens = torch.zeros(len(seqs), gamma_max, dtype=torch.long)
        active = [i for i, n in enumerate(num_tokens) if n > 0]
        # q is only read when verifying sampled rows; greedy rows verify by argmax match
        sampled = any(not seqs[i].params.greedy for i in active)
        q = torch.zeros(len(seqs), gamma_max, self.model.config.vocab_size) if sampled else None
        feed = {i: self._unseen_tokens(seqs[i]) for i in active}
        catch_up = {i: len(feed[i]) for i in active}  # the first forward feeds every token the draft has not seen
        drafted = [0] * len(seqs)
        stopped: set[int] = set()  # rows whose last draft was unlikely under the draft itself
        for step in range(gamma_max):
            rows = [i for i in active if num_tokens[i] > step and i not in stopped]
            if not rows:
                break
            inputs = [SequenceInput(self._slots[seqs[i]], feed[i], num_logits=1) for i in rows]
            batch = ForwardBatch.build(inputs, [self.cache.length(s.slot) for s in inputs])
            logits = self.model.forward(batch, self.cache).logits
            if sampled:
                probs = processed_probs(logits, [seqs[i].params for i in rows])
                drawn = sample(probs, [seqs[i].generator for i in rows])
            else:  # every row greedy: its argmax, without a one-hot q to draw from (~0.2 ms a step)
                probs, drawn = None, greedy_tokens(logits)
            unsure = [False] * len(rows)
            if self.confidence_threshold > 0:
                confidence = _confidence(logits, probs, drawn, [seqs[i].params for i in rows])
                unsure = (confidence < self.confidence_threshold).tolist()
            for k, (i, token) in enumerate(zip(rows, drawn.tolist())):
                tokens[i, step], feed[i] = token, [token]
                # the unlikely token is still verified (it is drawn, and one more verified row costs little);
                # the row drafts no further
                drafted[i] = step + 1
                if unsure[k]:
                    stopped.add(i)
                if q is not None:
                    q[i, step] = probs[k]
        fed = [catch_up[i] + n - 1 if n else 0 for i, n in enumerate(drafted)]  # one forward per drafted token
        return Draft(tokens, drafted, q, num_tokens_fed=fed)

    def _propose_trees(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> Draft:
        """Dynamic token trees (spec/draft_tree.py) as deep as each γ: the draft's top_k most confident candidates
        expanded per depth, its num_draft_tokens most confident verified; deterministic candidates (q = None)."""
        rows = [i for i, n in enumerate(num_tokens) if n > 0]
        feed = [self._unseen_tokens(seqs[i]) for i in rows]
        slots = [self._slots[seqs[i]] for i in rows]
        inputs = [SequenceInput(slot, tokens, num_logits=1) for slot, tokens in zip(slots, feed)]
        out = self.model.forward(ForwardBatch.build(inputs, [self.cache.length(s) for s in slots]), self.cache)
        last_rows = torch.tensor([len(tokens) for tokens in feed]).cumsum(0) - 1
        searches = [DraftTreeSearch(self.top_k, num_tokens[i], self.num_draft_tokens) for i in rows]
        forwards = grow_trees(self._forward, self.cache, slots, searches, out.logits, out.hidden[last_rows], lambda ids: ids)
        return tree_draft(len(seqs), rows, searches, forwards, [len(tokens) for tokens in feed], chain=False)

    def _forward(self, batch: ForwardBatch, cache: KVCache, token_ids: torch.Tensor, parents: torch.Tensor) -> ForwardOutput:
        return self.model.forward(batch, cache)  # a draft model reads tokens only

    def observe(self, seqs: Seq[Sequence], hidden: Seq[torch.Tensor] | None = None) -> None:
        for seq in seqs:
            slot = self._slots.get(seq)
            if slot is not None:
                # Entries past the committed tokens (all but the last) are rejected drafts.
                self.cache.truncate(slot, min(self.cache.length(slot), seq.num_tokens - 1))

    def release(self, seq: Sequence) -> None:
        slot = self._slots.pop(seq, None)
        if slot is not None:
            self.cache.free(slot)

    def _unseen_tokens(self, seq: Sequence) -> list[int]:
        if seq not in self._slots:
            self._slots[seq] = self.cache.allocate()
        return seq.token_ids_from(self.cache.length(self._slots[seq]))


def _confidence(logits: torch.Tensor, probs: torch.Tensor | None, drawn: torch.Tensor, params: Seq) -> torch.Tensor:
    """The draft's probability of each drawn token: under q where sampled; under the unscaled softmax
    for greedy rows, whose q is one-hot (`probs` None: every row greedy)."""
    confidence = torch.empty(len(params)) if probs is None else probs.gather(-1, drawn[:, None])[:, 0]
    greedy = [k for k, p in enumerate(params) if p.greedy]
    if greedy:
        rows = torch.tensor(greedy)
        confidence[rows] = logits[rows].float().softmax(-1).gather(-1, drawn[rows, None])[:, 0]
    return confidence
