"""The engine: admit requests, then step — propose, verify in one target forward, commit.

Plain decoding is the same step with an empty draft, so speculation on and off share every
line but the proposer. Sequences of uneven length (prompt chunks, verify blocks) share one
forward; every sequence's tokens are appended through the same stop rules.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

import torch

from specdec.config import EngineConfig, SamplingParams
from specdec.engine.adaptive import FixedGamma, GammaController
from specdec.engine.sequence import Sequence, SequenceStatus
from specdec.engine.stopping import StopRules, append_tokens, finish, start_detokenizer
from specdec.kv_cache import KVCache
from specdec.metrics import SpecStats
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.decoder import Decoder
from specdec.sampling import make_generator, processed_probs, token_logprobs
from specdec.spec.proposers.base import Proposer
from specdec.spec.verifier import Verified, greedy_match, rejection_sample


class Engine:
    def __init__(
        self,
        model: Decoder,
        tokenizer: Any | None,
        eos_token_ids: set[int],
        config: EngineConfig,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 0,
        controller: GammaController | None = None,
    ) -> None:
        self.model = model
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.controller: GammaController = controller or FixedGamma()  # γ per sequence per step, ≤ the maximum
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
            seq.spec_stats = SpecStats() if self.proposer is not None else None
            seq.logprobs = [] if params.logprobs is not None else None
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
        """Propose → one target forward over every running sequence → verify → commit or roll back.

        Each sequence feeds its pending tokens: a chunk of its prompt (chunked prefill), or its
        last sampled token. A sequence whose pending tokens reach its end also feeds a draft,
        so speculation starts at the first generated token and the prompt's last chunk is
        verified together with it. With no proposer (or γ = 0) the draft is empty and this is
        plain decoding. Returns the sequences that received tokens.
        """
        self._admit()
        if not self.running:
            return []
        running, pending = self._schedule()
        completing = [s for s, tokens in zip(running, pending) if self.cache.length(s.slot) + len(tokens) == s.num_tokens]
        start = time.perf_counter()
        # a speculative step feeds its pending tokens and the draft in one forward; it drafts only where that
        # stays within the rows the model computes exactly as one-token steps (a long last prompt chunk runs
        # plain, as it would without speculation), so greedy output is identical with and without drafts; the
        # drafts share what the step's token budget leaves
        spare = (self.config.max_num_batched_tokens - sum(map(len, pending))) // max(1, len(completing))
        room = {s: min(spare, self.model.row_invariant_tokens - len(tokens)) for s, tokens in zip(running, pending)}
        drafts = self._propose(completing, room)
        draft_time = time.perf_counter() - start

        inputs = []
        for seq, tokens in zip(running, pending):
            draft_tokens = drafts[seq][0] if seq in drafts else []
            inputs.append(SequenceInput(seq.slot, [*tokens, *draft_tokens], num_logits=1 + len(draft_tokens)))
        start = time.perf_counter()
        batch = ForwardBatch.build(inputs, [self.cache.length(s.slot) for s in running])
        logits = self.model.forward(batch, self.cache).logits.split([i.num_logits for i in inputs])

        ready = []
        completing_set = set(completing)
        for seq, seq_logits in zip(running, logits):
            seq.num_forwards += 1
            if seq not in completing_set:
                continue  # prompt still prefilling
            draft_tokens, q, draft_work = drafts.get(seq, ([], None, (0, 0)))
            verified = _verify(seq, seq_logits, draft_tokens, q)
            kept = append_tokens(seq, verified.tokens[0], self.rules)
            if seq.logprobs is not None:  # row j of the verify logits is the distribution token j was drawn from
                seq.logprobs += token_logprobs(seq_logits[:kept], verified.tokens[0][:kept], seq.params.logprobs)
            if seq.spec_stats is not None:
                self.controller.observe(seq, len(draft_tokens), verified.num_accepted[0])
                seq.spec_stats.record(len(draft_tokens), min(verified.num_accepted[0], kept), *draft_work)
            ready.append(seq)
        verify_time = time.perf_counter() - start
        if len(completing) == len(running):  # decode steps only: a prompt chunk's cost is not the choice's
            self.controller.step_timed(completing, (draft_time + verify_time) * 1000)

        for seq in ready:
            if seq in drafts and seq.spec_stats is not None:
                seq.spec_stats.draft_time_s += draft_time
                seq.spec_stats.verify_time_s += verify_time
            if seq.is_finished:
                self._release(seq)
            elif self.cache.length(seq.slot) > seq.num_tokens - 1:
                self.cache.truncate(seq.slot, seq.num_tokens - 1)  # drop rejected drafts
        if self.proposer is not None:
            self.proposer.observe([s for s in ready if not s.is_finished])
        return ready

    def _schedule(self) -> tuple[list[Sequence], list[list[int]]]:
        """This step's sequences and the tokens each feeds, within the token budget: every decoding sequence
        its sampled token, then prompt chunks in arrival order with what is left (a prompt may wait a step)."""
        budget = self.config.max_num_batched_tokens
        decoding = {s for s in self.running if s.num_tokens - self.cache.length(s.slot) == 1}
        budget -= len(decoding)
        chunks = {}
        for seq in self.running:
            if seq in decoding:
                chunks[seq] = 1
            elif budget > 0:
                unfed = seq.num_tokens - self.cache.length(seq.slot)
                chunks[seq] = min(budget, self.config.max_prefill_chunk, unfed)
                budget -= chunks[seq]
        running = [s for s in self.running if s in chunks]
        return running, [s.pending_token_ids(self.cache.length(s.slot), chunks[s]) for s in running]

    def _propose(
        self, seqs: list[Sequence], room: dict[Sequence, int]
    ) -> dict[Sequence, tuple[list[int], torch.Tensor | None, tuple[int, int]]]:
        """Each sequence's draft tokens, q (None for deterministic drafts) and the draft-model work it took
        (forwards, tokens fed); the controller picks γ and trims the draft. None without a proposer."""
        if self.proposer is None or not seqs:
            return {}
        gammas = [self.controller.choose(s, min(self._gamma(s), max(0, room[s])), len(seqs)) for s in seqs]
        if not any(gammas):
            return {}
        draft = self.proposer.propose(seqs, gammas)
        drafts = {}
        for i, seq in enumerate(seqs):
            n = self.controller.trim(seq, min(draft.num_tokens[i], gammas[i]))
            work = (0, 0) if draft.num_tokens_fed is None else (draft.num_tokens[i], draft.num_tokens_fed[i])
            if n > 0 or work[0]:
                drafts[seq] = (draft.tokens[i, :n].tolist(), None if draft.q is None else draft.q[i, :n], work)
        return drafts

    def _gamma(self, seq: Sequence) -> int:
        """γ for this step, never past max_tokens (the bonus token counts) or max_model_len."""
        room = min(
            self.config.max_model_len - seq.num_tokens,
            seq.params.max_tokens - len(seq.output_token_ids) - 1,
        )
        return max(0, min(self.num_speculative_tokens, room))

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
        if self.proposer is not None:
            self.proposer.release(seq)
            self.controller.release(seq)
        if seq in self.running:
            self.running.remove(seq)


def _verify(seq: Sequence, logits: torch.Tensor, draft_tokens: list[int], q: torch.Tensor | None) -> Verified:
    """One sequence's γ + 1 target logits rows against its γ draft tokens (γ may be 0)."""
    tokens = torch.tensor([draft_tokens], dtype=torch.long)
    if seq.params.greedy:
        return greedy_match(logits.argmax(dim=-1)[None], tokens, [len(draft_tokens)])
    p = processed_probs(logits, [seq.params] * logits.shape[0])[None]
    return rejection_sample(p, tokens, [len(draft_tokens)], None if q is None else q[None], [seq.generator])
