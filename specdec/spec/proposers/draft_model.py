"""Independent draft model (Leviathan et al. 2022; Chen et al. 2023).

The draft keeps its own KV slot per sequence. Each step it first catches up on the tokens it
has not seen (the prompt, then the last accepted token and the bonus), then samples γ tokens
autoregressively from q, its processed distribution under the request's SamplingParams.
After verification it rolls back to the longest prefix that the sequence still agrees with.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from specdec.engine.sequence import Sequence
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.decoder import Decoder
from specdec.sampling import processed_probs, sample
from specdec.spec.proposers.base import Draft


class DraftModelProposer:
    needs_hidden_states = False

    def __init__(self, model: Decoder, max_num_seqs: int, max_model_len: int) -> None:
        self.model = model
        self.cache = model.new_kv_cache(max_num_seqs, max_model_len)
        self._slots: dict[Sequence, int] = {}

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> Draft:
        gamma_max = max(num_tokens, default=0)
        if gamma_max == 0:
            return Draft.empty(len(seqs))
        tokens = torch.zeros(len(seqs), gamma_max, dtype=torch.long)
        active = [i for i, n in enumerate(num_tokens) if n > 0]
        # q is only read when verifying sampled rows; greedy rows verify by argmax match
        sampled = any(not seqs[i].params.greedy for i in active)
        q = torch.zeros(len(seqs), gamma_max, self.model.config.vocab_size) if sampled else None
        feed = {i: self._unseen_tokens(seqs[i]) for i in active}
        for step in range(gamma_max):
            rows = [i for i in active if num_tokens[i] > step]
            inputs = [SequenceInput(self._slots[seqs[i]], feed[i], num_logits=1) for i in rows]
            batch = ForwardBatch.build(inputs, [self.cache.length(s.slot) for s in inputs])
            logits = self.model.forward(batch, self.cache).logits
            probs = processed_probs(logits, [seqs[i].params for i in rows])
            drawn = sample(probs, [seqs[i].generator for i in rows]).tolist()
            for k, i in enumerate(rows):
                tokens[i, step], feed[i] = drawn[k], [drawn[k]]
                if q is not None:
                    q[i, step] = probs[k]
        return Draft(tokens, list(num_tokens), q)

    def observe(self, seqs: Seq[Sequence]) -> None:
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
