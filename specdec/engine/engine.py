"""The engine step: admit requests, run one forward over every running sequence, sample, stop.

Each sequence feeds either the next chunk of its prompt (chunked prefill) or its last
sampled token; sequences of uneven length share one forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

import torch

from specdec.config import EngineConfig, SamplingParams
from specdec.engine.sequence import Sequence, SequenceStatus
from specdec.engine.stopping import StopRules, append_tokens, finish, start_detokenizer
from specdec.kv_cache import KVCache
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.decoder import Decoder
from specdec.sampling import make_generator, processed_probs, sample


class Engine:
    def __init__(self, model: Decoder, tokenizer: Any | None, eos_token_ids: set[int], config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.cache: KVCache = model.new_kv_cache(config.max_num_seqs, config.max_model_len)
        self.rules = StopRules(tokenizer, frozenset(eos_token_ids), config.max_model_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seed_source = make_generator(config.seed)

    # --- requests ------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> list[Sequence]:
        """Validate and queue a request (n sequences). Raises ValueError and changes nothing on bad input."""
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt) >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens, which leaves no room to generate within "
                f"max_model_len={self.config.max_model_len}"
            )
        if params.stop and self.rules.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (the engine was built with skip_tokenizer_init)")
        if any(s.request_id == request_id for s in [*self.waiting, *self.running]):
            raise ValueError(f"request id {request_id!r} is already in use")
        sequences = []
        for index in range(params.n):
            if params.seed is not None:
                seed = params.seed + index
            else:
                seed = int(torch.randint(2**62, (1,), generator=self._seed_source))
            seq = Sequence(request_id, index, prompt, params, make_generator(seed))
            start_detokenizer(seq)
            sequences.append(seq)
        self.waiting.extend(sequences)
        return sequences

    def abort(self, request_id: str) -> list[Sequence]:
        aborted = [s for s in [*self.waiting, *self.running] if s.request_id == request_id]
        for seq in aborted:
            finish(seq, "abort")
            self._release(seq)
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        return aborted

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step --------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One forward over all running sequences; returns those that changed."""
        self._admit()
        if not self.running:
            return []
        running = list(self.running)
        inputs = [
            SequenceInput(s.slot, s.pending_token_ids(self.cache.length(s.slot), self.config.max_prefill_chunk))
            for s in running
        ]
        batch = ForwardBatch.build(inputs, [self.cache.length(s.slot) for s in running], last_logits_only=True)
        output = self.model.forward(batch, self.cache)
        ready = []
        for row, seq in enumerate(running):
            seq.num_forwards += 1
            if self.cache.length(seq.slot) == seq.num_tokens:  # prompt fully cached: sample next
                ready.append(row)
        if ready:
            chosen = [running[r] for r in ready]
            probs = processed_probs(output.logits[ready], [s.params for s in chosen])
            tokens = sample(probs, [s.generator for s in chosen]).tolist()
            for seq, token in zip(chosen, tokens):
                append_tokens(seq, [token], self.rules)
                if seq.is_finished:
                    self._release(seq)
        return [running[r] for r in ready]

    def _admit(self) -> None:
        while self.waiting and self.cache.can_allocate() and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
