"""The engine: admit requests, then step — propose, verify in one target forward, commit.

Plain decoding is the same step with an empty draft, so speculation on and off share every
line but the proposer. Sequences of uneven length (prompt chunks, verify blocks) share one
forward; every sequence's tokens are appended through the same stop rules.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
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
from specdec.sampling import greedy_tokens, make_generator, processed_probs, token_logprobs
from specdec.spec.proposers.base import Proposer
from specdec.spec.tree import TokenTree
from specdec.spec.verifier import (
    TreeAcceptance,
    TreeVerified,
    greedy_match,
    rejection_sample,
    sample_match,
    tree_greedy_match,
    tree_rejection_sample,
)


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
        tree_acceptance: TreeAcceptance = tree_rejection_sample,
    ) -> None:
        self.model = model
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.controller: GammaController = controller or FixedGamma()  # γ per sequence per step, ≤ the maximum
        self.tree_acceptance = tree_acceptance  # how tree drafts are verified at temperature > 0
        self.config = config
        self.cache: KVCache = model.new_kv_cache(config.max_num_seqs, config.max_model_len)
        self.rules = StopRules(tokenizer, frozenset(eos_token_ids), config.max_model_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._seed_source = make_generator(config.seed)
        # hidden states of the prompt chunks fed before a sequence's last one, for proposers that read them all
        self._prefill_hidden: dict[Sequence, list[torch.Tensor]] = {}

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

        start = time.perf_counter()
        inputs = [_forward_input(s, self.cache.length(s.slot), tokens, drafts.get(s)) for s, tokens in zip(running, pending)]
        layers = () if self.proposer is None else self.proposer.feature_layers
        batch = ForwardBatch.build(inputs, [self.cache.length(s.slot) for s in running], hidden_layers=layers)
        forward_start = time.perf_counter()
        output = self.model.forward(batch, self.cache)
        forward_time = time.perf_counter() - forward_start
        logits = output.logits.split([i.num_logits for i in inputs])
        # what a proposer reads of the target: its final hidden states, or those layers' outputs side by side
        features = torch.cat([output.layer_hidden[i] for i in layers], dim=-1) if layers else output.hidden

        ready, hidden = [], []
        completing_set = set(completing)
        row = 0  # where each sequence's rows start in the forward
        for seq, seq_logits, tokens, fed in zip(running, logits, pending, inputs):
            seq.num_forwards += 1
            first_row, row = row, row + len(fed.token_ids)
            if seq not in completing_set:  # prompt still prefilling
                if self.proposer is not None and self.proposer.needs_hidden_states:
                    self._prefill_hidden.setdefault(seq, []).append(features[first_row:row])
                continue
            draft = drafts.get(seq, NO_DRAFT)
            cached = self.cache.length(seq.slot) - len(fed.token_ids)
            verified = _verify(seq, seq_logits, draft, self.tree_acceptance)
            if draft.tree is not None:  # the accepted path becomes a chain after the root
                root_end = cached + len(tokens)
                self.cache.compact(seq.slot, root_end, [root_end + node for node in verified.path])
            kept = append_tokens(seq, verified.tokens, self.rules)
            if seq.logprobs is not None:  # the row of each token's parent is the distribution it was drawn from
                rows = [0, *(1 + node for node in verified.path)][:kept]
                seq.logprobs += token_logprobs(seq_logits[rows], verified.tokens[:kept], seq.params.logprobs)
            if seq.spec_stats is not None:
                self.controller.observe(seq, draft.depth, len(verified.path))
                seq.spec_stats.record(draft.depth, min(len(verified.path), kept), *draft.work, len(draft.tokens))
            if self.proposer is not None and self.proposer.needs_hidden_states:
                kept_rows = features[[*range(first_row, first_row + len(tokens)),
                                           *(first_row + len(tokens) + node for node in verified.path)]]
                earlier = self._prefill_hidden.pop(seq, None)  # only a prompt's last chunk has any
                hidden.append(kept_rows if earlier is None else torch.cat([*earlier, kept_rows]))
            ready.append(seq)
        verify_time = time.perf_counter() - start
        # decode steps only (each sequence fed its one sampled token): a prompt chunk's cost is not the choice's
        if len(completing) == len(running) and all(len(tokens) == 1 for tokens in pending):
            self.controller.step_timed(completing, (draft_time + verify_time) * 1000, forward_time * 1000)

        for seq in ready:
            if seq in drafts and seq.spec_stats is not None:
                seq.spec_stats.draft_time_s += draft_time
                seq.spec_stats.verify_time_s += verify_time
            if seq.is_finished:
                self._release(seq)
            elif self.cache.length(seq.slot) > seq.num_tokens - 1:
                self.cache.truncate(seq.slot, seq.num_tokens - 1)  # drop rejected drafts
        if self.proposer is not None:
            alive = [i for i, s in enumerate(ready) if not s.is_finished]
            self.proposer.observe([ready[i] for i in alive], [hidden[i] for i in alive] if hidden else None)
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

    def _propose(self, seqs: list[Sequence], room: dict[Sequence, int]) -> dict[Sequence, StepDraft]:
        """Each sequence's draft for this step; the controller picks γ (a tree's depth) and trims the draft.
        Empty without a proposer."""
        if self.proposer is None or not seqs:
            return {}
        gammas = [self.controller.choose(s, min(self._gamma(s), max(0, room[s])), len(seqs)) for s in seqs]
        if not any(gammas):
            return {}
        draft = self.proposer.propose(seqs, gammas)
        drafts = {}
        for i, seq in enumerate(seqs):
            tokens = draft.tokens[i, : draft.num_tokens[i]].tolist()
            tree = None if draft.trees is None else draft.trees[i]
            stratum = None if draft.strata is None else draft.strata[i]
            q = None
            if tree is None:
                n = self.controller.trim(seq, min(len(tokens), gammas[i]), stratum=stratum)
                tokens, q = tokens[:n], None if draft.q is None else draft.q[i, :n]
            else:
                # the deepest levels whose expected tokens are worth their rows; a tree's rows must fit the room too
                sizes = tree.sizes()
                depth = max(d for d in range(min(tree.max_depth, gammas[i]) + 1) if sizes[d] <= room[seq])
                tree, kept = tree.pruned(self.controller.trim(seq, depth, sizes[: depth + 1], stratum))
                tokens = [tokens[node] for node in kept]
            work = (0, 0)
            if draft.num_tokens_fed is not None:
                forwards = draft.num_tokens[i] if draft.num_forwards is None else draft.num_forwards[i]
                work = (forwards, draft.num_tokens_fed[i])
            if tokens or work[0]:
                drafts[seq] = StepDraft(tokens, q, work, tree if tokens else None)
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
        self._prefill_hidden.pop(seq, None)
        if seq.slot is not None:
            self.cache.free(seq.slot)
            seq.slot = None
        if self.proposer is not None:
            self.proposer.release(seq)
            self.controller.release(seq)
        if seq in self.running:
            self.running.remove(seq)


@dataclass(frozen=True)
class StepDraft:
    """One sequence's draft in a step: a chain of tokens (q: the draft's distributions, None = deterministic), or
    the nodes of a token tree; `work`: the draft model's forwards and the tokens they took in."""

    tokens: list[int]
    q: torch.Tensor | None = None
    work: tuple[int, int] = (0, 0)
    tree: TokenTree | None = None

    @property
    def depth(self) -> int:
        """How many tokens a step can accept at most."""
        return len(self.tokens) if self.tree is None else self.tree.max_depth


NO_DRAFT = StepDraft([])


def _forward_input(seq: Sequence, cached: int, pending: list[int], draft: StepDraft | None) -> SequenceInput:
    """The sequence's part of the forward: its pending tokens, then the draft. A tree's nodes take their depth below
    the root (the last pending token) as positions and see only their ancestors."""
    if draft is None:
        return SequenceInput(seq.slot, pending, num_logits=1)
    if draft.tree is None:
        return SequenceInput(seq.slot, [*pending, *draft.tokens], num_logits=1 + len(draft.tokens))
    root_position = cached + len(pending) - 1
    positions = [*range(cached, root_position), *draft.tree.positions(root_position).tolist()]
    mask = draft.tree.attention_mask(root_position, len(pending) - 1)
    return SequenceInput(seq.slot, [*pending, *draft.tokens], positions, mask, num_logits=1 + len(draft.tokens))


def _verify(seq: Sequence, logits: torch.Tensor, draft: StepDraft, tree_acceptance: TreeAcceptance) -> TreeVerified:
    """One sequence's target logits (after its last pending token, then after each draft token) against its draft
    (maybe empty); a chain's accepted path is its first tokens."""
    if draft.tree is not None:
        if seq.params.greedy:
            return tree_greedy_match(draft.tree, draft.tokens, greedy_tokens(logits).tolist())
        p = processed_probs(logits, [seq.params] * logits.shape[0])
        return tree_acceptance(draft.tree, draft.tokens, p, seq.generator)
    tokens = torch.tensor([draft.tokens], dtype=torch.long)
    if seq.params.greedy:
        verified = greedy_match(greedy_tokens(logits)[None], tokens, [len(draft.tokens)])
    else:
        p = processed_probs(logits, [seq.params] * logits.shape[0])[None]
        if draft.q is None:  # a plain step or a deterministic draft: the target draws each position's own token
            uniforms = [seq.uniform(seq.num_tokens + i) for i in range(len(draft.tokens) + 1)]
            verified = sample_match(p, tokens, [len(draft.tokens)], [uniforms])
        else:
            verified = rejection_sample(p, tokens, [len(draft.tokens)], draft.q[None], [seq.generator])
    return TreeVerified(list(range(verified.num_accepted[0])), verified.tokens[0])
