"""Choosing γ each step from measurements, so that speculation never makes decoding slower.

Per sequence, a step that drafts γ tokens commits on average
    E[tokens](γ) = 1 + Σ_{j=1..γ} Π_{i≤j} a_i
where a_i = P(draft i is accepted | drafts 1..i−1 were), estimated online per position (not the
i.i.d. α of the papers: acceptance moves along the draft). The step costs
    E[ms](γ) = drafting (the draft model's forwards, priced by its measured cost curve; free for
               n-gram and suffix lookup) + verify_ms(γ + 1, context) (the target's measured curve).
The controller picks γ ∈ {0, …, γ_max} maximising E[tokens] / E[ms]; γ = 0 is a plain step. In a
batch, a sequence pays its share of forwards over every decoding sequence's tokens (`StepCosts`); what
the curves miss is learned from the measured time of decode steps: the machine now against when its
curves were measured, from each step's own target forward (it drifts; the seconds after a model loads
run up to 2–3× slow; memory here runs at ~35 or ~60 GB/s for minutes, which moves a forward over few
tokens, not one over many: `CostCurve.forward_ms`), and what a step costs beyond that, for plain and for
speculative steps apart (sampling and verifying each row, the draft's own work). Once
the proposer has drafted, the drafting is paid for, and the draft is trimmed to the prefix k that
maximises E[tokens](k) − R · verify_ms(k + 1), R being the rate the choice promised.

Estimates are discounted Beta posteriors (recent steps weigh most). A new sequence starts from the
engine's prior: the final estimates of the sequences before it, the latest weighing most (the first
one from 0.75), worth one observation and one more per finished sequence, up to `max_prior_weight`.

Speculating is also how acceptance is learned, so where the estimate's mean says "plain" (or says
"speculate", but a draft model must first catch up on tokens it has not seen: the prompt, or the
tokens of plain steps) and the sequence's evidence is thin (under `min_evidence` verifications of
the first position), the controller weighs what trying is worth over the posterior of the acceptance
level α: the rest of the request (at most `horizon` tokens) gains max(0, s(α)) per token, s(α) being
the time per token the best γ saves at α, less the catch-up, less the steps still needed to learn
at min(0, s(α)) each. It tries when that is positive. So a new request or one early rejection keeps
speculating where it may pay, and a long prompt's catch-up is paid when the request is long enough
to win it back at the acceptance it probably has. With enough evidence it acts on the mean: the
catch-up is paid only if the rest of the request, at the speculative rate, wins it back. (Counting
what a try teaches the requests to come as well made a fresh engine pay a long prompt's catch-up in
every request of a low-acceptance workload: 0.86× plain on 500-token prompts at T = 1.5.)

A lookup proposer (n-gram, suffix) classes each draft by its own evidence for it (`Draft.strata`: the
n-gram's match length, suffix decoding's expected accepted tokens): a 5-token match of an edit's source
is accepted ~90% of the time, a 2-token coincidence at T = 1.5 under half. Lookups cost nothing, so
with `stratified` the controller asks for γ_max every step and `trim` chooses how much to verify from
the acceptance of that stratum (a Beta posterior per stratum, shrunk towards what the engine learned of
the stratum in finished requests, else towards the sequence's pooled estimate), at the rate the pooled
choice promised: plain decoding's where it said γ = 0.

While γ = 0 nothing is observed, so the controller also probes with γ = 1 once the plain steps
of all sequences have earned it: probing spends at most `probe_budget` of the plain time, whatever a
probe costs (for a draft model, its catch-up over every token it skipped: on a CPU about what 50 plain steps earn, so a
draft model that stopped comes back after a few requests, not within one). An accepted probe halves
the weight of the older evidence, so a return of acceptance (the text turns to copying again) is
confirmed in a few steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from specdec.engine.sequence import Sequence
from specdec.models.cost_curve import CostCurve


class GammaController(Protocol):
    def choose(self, seq: Sequence, gamma_max: int, batch_size: int = 1) -> int:
        """γ for this step's draft, 0 ≤ γ ≤ gamma_max; `batch_size` sequences decode in this step's forward."""

    def trim(self, seq: Sequence, num_drafted: int, sizes: Seq[int] | None = None, stratum: int | None = None) -> int:
        """How many of the drafted tokens to verify; for a tree drafted `num_drafted` deep, how deep, `sizes[d]`
        being its node count down to depth d; `stratum`: the draft's class (`Draft.strata`), if it has one."""

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The step verified num_drafted tokens (0: a plain step) and accepted num_accepted."""

    def release(self, seq: Sequence) -> None:
        """The sequence is done."""

    def step_timed(self, seqs: Seq[Sequence], measured_ms: float, forward_ms: float) -> None:
        """A step in which every sequence decoded (no prompt chunk) took `measured_ms` to draft and verify, of
        which the target's forward took `forward_ms`."""


class FixedGamma:
    """γ = num_speculative_tokens at every step (vLLM's behaviour; `"adaptive": false`)."""

    def choose(self, seq: Sequence, gamma_max: int, batch_size: int = 1) -> int:
        return gamma_max

    def trim(self, seq: Sequence, num_drafted: int, sizes: Seq[int] | None = None, stratum: int | None = None) -> int:
        return num_drafted

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def step_timed(self, seqs: Seq[Sequence], measured_ms: float, forward_ms: float) -> None:
        pass


class HeuristicSchedule:
    """HF transformers' `num_assistant_tokens_schedule="heuristic"`, for comparison: +2 after a step
    that accepted every draft, −1 (not below 1) otherwise, starting at `start` and kept across
    requests as HF keeps it on the assistant's generation config."""

    def __init__(self, start: int) -> None:
        self.gamma = start

    def choose(self, seq: Sequence, gamma_max: int, batch_size: int = 1) -> int:
        return min(self.gamma, gamma_max)

    def trim(self, seq: Sequence, num_drafted: int, sizes: Seq[int] | None = None, stratum: int | None = None) -> int:
        return num_drafted

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.gamma = self.gamma + 2 if num_accepted == num_drafted else max(1, self.gamma - 1)

    def release(self, seq: Sequence) -> None:
        pass

    def step_timed(self, seqs: Seq[Sequence], measured_ms: float, forward_ms: float) -> None:
        pass


@dataclass(frozen=True)
class StepCosts:
    """What a step costs on this machine: the target's measured forward cost, and the draft model's
    (None where drafting costs next to nothing: n-gram and suffix lookups take well under 1 ms).

    In a batch of B decoding sequences a sequence pays its share of forwards that take in B times its own
    tokens (as if every sequence drafted alike): where one sequence's verification is nearly free, a batch's
    may already be compute-bound."""

    target: CostCurve
    draft: CostCurve | None = None

    def verify_ms(self, num_tokens: int, context: int, batch_size: int = 1, machine: float = 1.0) -> float:
        """`machine`: one-token forwards take `machine` times their measured time now (`CostCurve.forward_ms`)."""
        return self.target.forward_ms(num_tokens * batch_size, context, machine) / batch_size

    def draft_ms(self, gamma: int, context: int, unseen: int, batch_size: int = 1, machine: float = 1.0) -> float:
        """γ draft forwards at a sequence of `context` tokens, the first over the `unseen` tokens the draft has to
        catch up on (after the `context − unseen` it holds: a curve's context is what is cached before the forward).
        The catch-up computes logits at each sequence's last token only, so the tokens beyond those rows are priced
        by the draft's one-logit curve (`CostCurve.prefill_ms`)."""
        if self.draft is None or gamma == 0:
            return 0.0
        draft, held = self.draft, max(0, context - unseen)
        first = draft.forward_ms(batch_size, held, machine)
        if unseen > 1:  # a catch-up (in step, the usual case, it adds nothing: spare the controller's every step)
            first += draft.prefill_ms(unseen * batch_size, held, machine) - draft.prefill_ms(batch_size, held, machine)
        return (first + (gamma - 1) * draft.forward_ms(batch_size, context, machine)) / batch_size


@dataclass
class AcceptanceEstimate:
    """Discounted Beta posterior of a_i per draft position: every observation first multiplies the old
    counts by `decay`. Each position's evidence is shrunk towards the estimate of the position before
    it (the first position's towards the engine's prior), so a position not yet verified follows the
    ones this sequence has shown."""

    decay: float
    prior_weight: float = 1.0
    accepted: list[float] = field(default_factory=list)
    verified: list[float] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if len(self.accepted) < num_drafted:
            grow = num_drafted - len(self.accepted)
            self.accepted += [0.0] * grow
            self.verified += [0.0] * grow
        self.forget(self.decay)
        # positions up to the first rejection were verified; those before it were accepted
        for i in range(min(num_accepted + 1, num_drafted)):
            self.verified[i] += 1.0
            self.accepted[i] += 1.0 if i < num_accepted else 0.0

    def forget(self, factor: float) -> None:
        self.accepted = [x * factor for x in self.accepted]
        self.verified = [x * factor for x in self.verified]

    def evidence(self) -> float:
        """How many (discounted) verifications of the first position the estimate rests on."""
        return self.verified[0] if self.verified else 0.0

    def first_position_posterior(self, prior: float) -> tuple[float, float]:
        """Beta(a, b) of a_1: its evidence plus the prior's pseudo-counts."""
        hits = self.accepted[0] if self.accepted else 0.0
        trials = self.verified[0] if self.verified else 0.0
        return hits + self.prior_weight * prior, trials - hits + self.prior_weight * (1 - prior)

    def rates(self, depth: int, prior: float) -> list[float]:
        """a_1..a_depth."""
        rates, mean = [], prior
        for i in range(depth):
            hits = self.accepted[i] if i < len(self.accepted) else 0.0
            trials = self.verified[i] if i < len(self.verified) else 0.0
            mean = (hits + self.prior_weight * mean) / (trials + self.prior_weight)
            rates.append(mean)
        return rates


ALPHA_GRID = tuple((i + 0.5) / 20 for i in range(20))  # where the posterior of α is weighed


def beta_weights(a: float, b: float, grid: Seq[float] = ALPHA_GRID) -> list[float]:
    """A Beta(a, b) density on the grid, normalised to sum to 1."""
    logs = [(a - 1) * math.log(x) + (b - 1) * math.log1p(-x) for x in grid]
    top = max(logs)
    weights = [math.exp(v - top) for v in logs]
    total = sum(weights)
    return [w / total for w in weights]


MACHINE_STEP = 0.01  # of the machine factor, to take the modeled forward's slope in it
MIN_STREAM_SHARE = 0.5  # of a forward's modeled time that must move with the memory for it to tell the machine factor


def _clamped(ratio: float) -> float:
    """A measured ÷ modeled time, within what a real drift or overhead can be (one stalled step must not swing
    the estimates)."""
    return min(3.0, max(0.5, ratio))


def expected_tokens(rates: Seq[float]) -> list[float]:
    """E[tokens](γ) for γ = 0..len(rates): one target token plus each draft that survives."""
    totals, survive = [1.0], 1.0
    for a in rates:
        survive *= a
        totals.append(totals[-1] + survive)
    return totals


@dataclass
class _SequenceState:
    estimate: AcceptanceEstimate
    unseen: int  # tokens the draft model has not been fed: the prompt at first, then the bonus token at least
    rate: float = 0.0  # tokens per ms that this step's choice promised
    batch_size: int = 1  # sequences decoding in this step's forward
    context: int = 0
    drafted: int = 0  # γ asked of the proposer this step
    modeled_ms: float = 0.0  # this sequence's share of the step, by the cost curves alone (uncalibrated)
    modeled_forward_ms: float = 0.0  # of which the target's forward
    modeled_step: tuple[int, int, int] = (0, 0, 1)  # what that prices: tokens drafted, verified, unseen by the draft
    probing: bool = False  # this step is a probe
    may_probe: bool = False  # a stratified step whose pooled choice was plain: `trim` may keep one token as a probe
    probe_cost: float = 0.0  # what that probe would cost beyond a plain step
    strata: dict[int, AcceptanceEstimate] = field(default_factory=dict)  # per stratum of the lookup's drafts
    stratum: int | None = None  # this step's draft's
    expected: list[float] = field(default_factory=list)  # this step's E[tokens](γ), γ = 0..γ_max
    verify_ms: list[float] = field(default_factory=list)  # this step's verify cost of γ + 1 tokens


class AdaptiveGamma:
    """The cost-model controller (module docstring): `"adaptive": true`, the default."""

    def __init__(
        self,
        costs: StepCosts,
        prior_acceptance: float = 0.75,
        decay: float = 0.9,
        request_weight: float = 0.5,
        probe_budget: float = 0.02,
        horizon: int = 512,
        min_evidence: float = 3.0,
        max_prior_weight: float = 4.0,
        calibration_weight: float = 0.1,
        stratified: bool = False,
    ) -> None:
        if stratified and costs.draft is not None:
            raise ValueError("stratified drafting is for lookups, whose drafts cost nothing")
        self.costs = costs
        self.stratified = stratified
        self.stratum_priors: dict[int, float] = {}  # a_1 per stratum, learned from finished sequences like `prior`
        self.decay = decay
        self.probe_budget = probe_budget
        self.horizon = horizon
        self.min_evidence = min_evidence
        self.calibration_weight = calibration_weight
        # where a new sequence's first-position estimate starts: the finished sequences' final estimates,
        # each weighing `request_weight` against the ones before it
        self.prior = prior_acceptance
        self.request_weight = request_weight
        # how many observations the prior weighs in a new sequence: one, and one more per finished sequence, up
        # to `max_prior_weight` (requests differ: a new one must still be able to move away from the prior)
        self.prior_weight = 1.0
        self.max_prior_weight = max_prior_weight
        self.probe_credit_ms = 0.0  # probe_budget × the time of every plain step so far, less the probes' cost
        # what the cost curves miss, from the measured time of decode steps: the machine now against when the
        # curves were measured (a one-token forward's time ÷ its measured time, read off each step's target forward
        # through the curve's `BoundLines`), and beyond that what plain steps cost over their forward (sampling, the
        # engine), and speculative steps over a plain step's ratio (a batched forward's per-sequence work, sampling
        # and verifying each row)
        self.machine = self.plain_overhead = self.speculation_overhead = 1.0
        self._states: dict[Sequence, _SequenceState] = {}

    def choose(self, seq: Sequence, gamma_max: int, batch_size: int = 1) -> int:
        state = self._state(seq)
        state.probing, state.rate, state.batch_size, state.context = False, 0.0, batch_size, seq.num_tokens
        state.may_probe, state.stratum = False, None
        state.drafted = self._choose(state, seq, gamma_max)
        self._model_step(state, state.drafted)
        return state.drafted

    def _choose(self, state: _SequenceState, seq: Sequence, gamma_max: int) -> int:
        if gamma_max == 0:
            return 0
        context, batch_size, machine = seq.num_tokens, state.batch_size, self.machine
        speculative = self.plain_overhead * self.speculation_overhead
        # kept for `trim`, which runs on the same step with the same estimates
        state.expected = tokens = expected_tokens(self._rates(state, gamma_max))
        state.verify_ms = [self._verify_ms(state, g) for g in range(gamma_max + 1)]
        # steady state: the draft model in step with the sequence (its catch-up is a one-off, priced below)
        per_draft = self.costs.draft_ms(1, context, 1, batch_size, machine) * speculative
        times = [g * per_draft + verify for g, verify in enumerate(state.verify_ms)]
        ratios = [t / ms for t, ms in zip(tokens, times)]
        best = max(range(gamma_max + 1), key=ratios.__getitem__)
        catch_up = self.costs.draft_ms(1, context, state.unseen, batch_size, machine) * speculative - per_draft
        remaining = min(self.horizon, seq.params.max_tokens - len(seq.output_token_ids))
        if state.estimate.evidence() < self.min_evidence and (best == 0 or catch_up > 0):
            if self._worth_trying(state, per_draft, state.verify_ms, remaining, catch_up):
                if best == 0:  # exploring: the draft is verified whole (rate 0 keeps it from the trim)
                    return max(range(1, gamma_max + 1), key=ratios.__getitem__)
            else:
                best = 0
        elif best > 0 and catch_up > 0 and remaining * (times[0] - 1 / ratios[best]) < catch_up:
            best = 0  # the rest of the request, at the speculative rate, would not win the catch-up back
        if self.stratified:  # the draft's stratum decides in `trim`, priced at the pooled choice's rate
            state.rate, state.may_probe, state.probe_cost = ratios[best], best == 0, times[1] - times[0]
            return gamma_max
        if best == 0:
            # what a one-token probe costs beyond a plain step if its draft is rejected (priced at the worst:
            # an estimate shrunk towards the prior overstates acceptance exactly where probes are wasted)
            probe_cost = times[1] + catch_up - times[0]
            if self.probe_credit_ms >= probe_cost:
                self.probe_credit_ms -= probe_cost
                state.probing = True  # rate 0: trim keeps the probe
                return 1
        state.rate = ratios[best]
        return best

    def trim(self, seq: Sequence, num_drafted: int, sizes: Seq[int] | None = None, stratum: int | None = None) -> int:
        state = self._state(seq)
        if num_drafted == 0:
            if self.costs.draft is None:  # a lookup that found nothing: the step is a plain one, and timed as one
                state.drafted = 0
                self._model_step(state, 0)
            return 0
        if sizes is None:  # a chain: k tokens down to depth k, priced when γ was chosen
            sizes, verify_ms = range(num_drafted + 1), state.verify_ms
        else:
            verify_ms = [self._verify_ms(state, sizes[k]) for k in range(num_drafted + 1)]
        expected = state.expected
        if self.stratified and stratum is not None:
            state.stratum = stratum
            expected = expected_tokens(self._stratum_rates(state, stratum, num_drafted))
        gains = [expected[k] - state.rate * verify_ms[k] for k in range(num_drafted + 1)]
        kept = max(range(num_drafted + 1), key=gains.__getitem__)
        if kept == 0 and state.may_probe and self.probe_credit_ms >= state.probe_cost:
            self.probe_credit_ms -= state.probe_cost
            state.probing, kept = True, 1
        if kept == 0 and self.costs.draft is None:  # a free draft trimmed away: a plain step, timed as one
            state.drafted = 0
        self._model_step(state, num_drafted, sizes[kept])
        return kept

    @property
    def plain_calibration(self) -> float:
        """A plain step's time ÷ its modeled time: the machine now, and what the curves miss of a plain step."""
        return self.machine * self.plain_overhead

    def step_timed(self, seqs: Seq[Sequence], measured_ms: float, forward_ms: float) -> None:
        states = [self._states[s] for s in seqs if s in self._states]
        if not states or len(states) < len(seqs):
            return
        if sum(s.modeled_ms for s in states) <= 0 or sum(s.modeled_forward_ms for s in states) <= 0:
            return
        # the machine's speed from this step's own forward: a machine running slow slows plain and speculative
        # steps alike, and a slow stretch while the controller speculates must not read as speculation's cost
        # (it kept a fresh engine plain for most of its first request: 103 of 130 steps). The modeled forward rises
        # with the machine in pieces (`BoundLines`): one Newton step from the current estimate, taken only from a
        # forward that waits mostly on the weight stream as measured. One that waits on arithmetic tells nothing of the
        # memory, and what it takes beyond its curve (a batch's forward over 4 × 5 tokens of 4 sequences, not one)
        # read as memory drove the factor to 2.1–2.6 in fast memory, pricing plain steps double
        now = machine = self.machine
        at_now = self._modeled_forward(states, now)
        as_measured = sum(s.modeled_forward_ms for s in states)
        moves = self._modeled_forward(states, 1.0 + MACHINE_STEP) - as_measured
        if moves > MIN_STREAM_SHARE * MACHINE_STEP * as_measured:  # streaming: the forward tells the factor
            slope = (self._modeled_forward(states, now + MACHINE_STEP) - at_now) / MACHINE_STEP
            if slope > 0:
                machine = _clamped(now + (forward_ms - at_now) / slope)
        self.machine += self.calibration_weight * (machine - self.machine)
        forward_at_machine = at_now if machine == now else self._modeled_forward(states, machine)
        beyond_machine = _clamped(measured_ms / (forward_at_machine + self._modeled_drafts(states, machine)))
        if any(s.drafted for s in states):
            overhead = beyond_machine / self.plain_overhead
            self.speculation_overhead += self.calibration_weight * (overhead - self.speculation_overhead)
        else:
            self.plain_overhead += self.calibration_weight * (beyond_machine - self.plain_overhead)

    def _verify_ms(self, state: _SequenceState, num_drafted: int) -> float:
        """The step's verify forward over `num_drafted` draft tokens and the pending one, calibrated."""
        overhead = self.plain_overhead * (self.speculation_overhead if num_drafted else 1.0)
        return self.costs.verify_ms(num_drafted + 1, state.context, state.batch_size, self.machine) * overhead

    def _model_step(self, state: _SequenceState, drafted: int, verified: int | None = None) -> None:
        """This sequence's share of the step by the cost curves: drafting `drafted` (catch-up included), then
        verifying `verified` of them in the target's forward."""
        state.modeled_step = (drafted, drafted if verified is None else verified, state.unseen)
        state.modeled_forward_ms = self._modeled_forward([state], 1.0)
        state.modeled_ms = state.modeled_forward_ms + self._modeled_drafts([state], 1.0)

    def _modeled_forward(self, states: Seq[_SequenceState], machine: float) -> float:
        """The target's forward of the modeled steps of `states` on a machine running at `machine` (ms)."""
        return sum(self.costs.verify_ms(s.modeled_step[1] + 1, s.context, s.batch_size, machine) for s in states)

    def _modeled_drafts(self, states: Seq[_SequenceState], machine: float) -> float:
        """Their drafting (catch-ups included) on that machine (ms)."""
        return sum(self.costs.draft_ms(s.modeled_step[0], s.context, s.modeled_step[2], s.batch_size, machine)
                   for s in states)

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        state = self._state(seq)
        if num_drafted == 0:
            self.probe_credit_ms += self.probe_budget * self.costs.verify_ms(1, seq.num_tokens, state.batch_size)
            state.unseen += 1
            return
        if state.probing and num_accepted == num_drafted:
            # acceptance where the estimate expected little: the evidence it rests on may be stale (the text
            # changed), so it weighs half from here
            state.estimate.forget(0.5)
        state.unseen = 1
        state.estimate.observe(num_drafted, num_accepted)
        if state.stratum is not None:
            stratum = state.strata.get(state.stratum)
            if stratum is None:
                stratum = state.strata[state.stratum] = AcceptanceEstimate(self.decay, self.prior_weight)
            stratum.observe(num_drafted, num_accepted)

    def release(self, seq: Sequence) -> None:
        state = self._states.pop(seq, None)
        if state is None or not any(state.estimate.verified):
            return  # nothing learned
        [final] = self._rates(state, 1)
        self.prior = (1 - self.request_weight) * self.prior + self.request_weight * final
        self.prior_weight = min(self.max_prior_weight, self.prior_weight + 1)
        for stratum in state.strata:
            [final] = self._stratum_rates(state, stratum, 1)
            before = self.stratum_priors.get(stratum, final)
            self.stratum_priors[stratum] = (1 - self.request_weight) * before + self.request_weight * final

    def _worth_trying(
        self, state: _SequenceState, per_draft: float, verify_ms: list[float], remaining: int, catch_up: float
    ) -> bool:
        """Whether speculating now is worth its catch-up and its learning, over the posterior of α."""
        weights = beta_weights(*state.estimate.first_position_posterior(self.prior))
        # the steps until the evidence is enough to act on, a token each where α is low
        learning = min(remaining, math.ceil(self.min_evidence - state.estimate.evidence()))
        value = -catch_up
        for alpha, weight in zip(ALPHA_GRID, weights):
            saved = _ms_saved_per_token(alpha, per_draft, verify_ms)
            value += weight * ((remaining - learning) * max(0.0, saved) + learning * min(0.0, saved))
        return value > 0

    def _state(self, seq: Sequence) -> _SequenceState:
        state = self._states.get(seq)
        if state is None:
            estimate = AcceptanceEstimate(self.decay, self.prior_weight)
            state = self._states[seq] = _SequenceState(estimate, unseen=seq.num_tokens)
        return state

    def _rates(self, state: _SequenceState, depth: int) -> list[float]:
        return state.estimate.rates(depth, self.prior)

    def _stratum_rates(self, state: _SequenceState, stratum: int, depth: int) -> list[float]:
        """a_1..a_depth of the stratum's drafts: its evidence, shrunk towards what finished sequences showed of
        the stratum, or (a stratum the engine has not seen finish) towards this sequence's pooled a_1."""
        prior = self.stratum_priors.get(stratum)
        if prior is None:
            [prior] = self._rates(state, 1)
        estimate = state.strata.get(stratum) or AcceptanceEstimate(self.decay, self.prior_weight)
        return estimate.rates(depth, prior)


def _ms_saved_per_token(alpha: float, per_draft: float, verify_ms: list[float]) -> float:
    """Plain decoding's ms per token less the best γ's at an i.i.d. acceptance α (negative: speculation loses)."""
    tokens = expected_tokens([alpha] * (len(verify_ms) - 1))
    best = min((g * per_draft + verify_ms[g]) / tokens[g] for g in range(1, len(verify_ms)))
    return verify_ms[0] - best
