"""Choosing γ each step from measurements, so that speculation never makes decoding slower.

Per sequence, a step that drafts γ tokens commits on average
    E[tokens](γ) = 1 + Σ_{j=1..γ} Π_{i≤j} a_i
where a_i = P(draft i is accepted | drafts 1..i−1 were), estimated online per position (not the
i.i.d. α of the papers: acceptance moves along the draft). The step costs
    E[ms](γ) = drafting (the draft model's forwards, priced by its measured cost curve; free for
               n-gram and suffix lookup) + verify_ms(γ + 1, context) (the target's measured curve).
The controller picks γ ∈ {0, …, γ_max} maximising E[tokens] / E[ms]; γ = 0 is a plain step. Once
the proposer has drafted, the drafting is paid for, and the draft is trimmed to the prefix k that
maximises E[tokens](k) − R · verify_ms(k + 1), R being the rate the choice promised.

A draft model must first catch up on the tokens it has not seen (the prompt, or the tokens of plain
steps): that one-off cost is paid only if the rest of the request, at the speculative rate, wins it
back.

Estimates are discounted Beta posteriors (recent steps weigh most). A new sequence starts from the
engine's prior: the final estimates of the sequences before it, the latest weighing most; the first
one from an optimistic 0.75, so that a fresh engine tries speculating and learns. While γ = 0
nothing is observed, so the controller probes with γ = 1 once the plain steps of all sequences have
earned it: probing spends at most `probe_budget` of the plain time, whatever a probe costs (for a
draft model, its catch-up over every token it skipped: on a CPU about what 50 plain steps earn, so a
draft model that stopped comes back after a few requests, not within one). An accepted probe halves
the weight of the older evidence, so a return of acceptance (the text turns to copying again) is
confirmed in a few steps.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

from specdec.engine.sequence import Sequence
from specdec.models.cost_curve import CostCurve


class GammaController(Protocol):
    def choose(self, seq: Sequence, gamma_max: int) -> int:
        """γ for this step's draft, 0 ≤ γ ≤ gamma_max."""

    def trim(self, seq: Sequence, num_drafted: int) -> int:
        """How many of the drafted tokens to verify."""

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The step verified num_drafted tokens (0: a plain step) and accepted num_accepted."""

    def release(self, seq: Sequence) -> None:
        """The sequence is done."""


class FixedGamma:
    """γ = num_speculative_tokens at every step (vLLM's behaviour; `"adaptive": false`)."""

    def choose(self, seq: Sequence, gamma_max: int) -> int:
        return gamma_max

    def trim(self, seq: Sequence, num_drafted: int) -> int:
        return num_drafted

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class HeuristicSchedule:
    """HF transformers' `num_assistant_tokens_schedule="heuristic"`, for comparison: +2 after a step
    that accepted every draft, −1 (not below 1) otherwise, starting at `start` and kept across
    requests as HF keeps it on the assistant's generation config."""

    def __init__(self, start: int) -> None:
        self.gamma = start

    def choose(self, seq: Sequence, gamma_max: int) -> int:
        return min(self.gamma, gamma_max)

    def trim(self, seq: Sequence, num_drafted: int) -> int:
        return num_drafted

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.gamma = self.gamma + 2 if num_accepted == num_drafted else max(1, self.gamma - 1)

    def release(self, seq: Sequence) -> None:
        pass


@dataclass(frozen=True)
class StepCosts:
    """What a step costs on this machine: the target's measured forward cost, and the draft model's
    (None where drafting costs next to nothing: n-gram and suffix lookups take well under 1 ms)."""

    target: CostCurve
    draft: CostCurve | None = None

    def verify_ms(self, num_tokens: int, context: int) -> float:
        return self.target.forward_ms(num_tokens, context)

    def draft_ms(self, gamma: int, context: int, unseen: int) -> float:
        """γ draft forwards, the first over the `unseen` tokens the draft has to catch up on."""
        if self.draft is None or gamma == 0:
            return 0.0
        return self.draft.forward_ms(unseen, context) + (gamma - 1) * self.draft.forward_ms(1, context)


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

    def rates(self, depth: int, prior: float) -> list[float]:
        """a_1..a_depth."""
        rates, mean = [], prior
        for i in range(depth):
            hits = self.accepted[i] if i < len(self.accepted) else 0.0
            trials = self.verified[i] if i < len(self.verified) else 0.0
            mean = (hits + self.prior_weight * mean) / (trials + self.prior_weight)
            rates.append(mean)
        return rates


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
    probing: bool = False  # this step is a probe
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
    ) -> None:
        self.costs = costs
        self.decay = decay
        self.probe_budget = probe_budget
        # where a new sequence's first-position estimate starts: the finished sequences' final estimates,
        # each weighing `request_weight` against the ones before it
        self.prior = prior_acceptance
        self.request_weight = request_weight
        self.probe_credit_ms = 0.0  # probe_budget × the time of every plain step so far, less the probes' cost
        self._states: dict[Sequence, _SequenceState] = {}

    def choose(self, seq: Sequence, gamma_max: int) -> int:
        state = self._state(seq)
        state.probing, state.rate = False, 0.0
        if gamma_max == 0:
            return 0
        context = seq.num_tokens
        # kept for `trim`, which runs on the same step with the same estimates
        state.expected = tokens = expected_tokens(self._rates(state, gamma_max))
        state.verify_ms = [self.costs.verify_ms(g + 1, context) for g in range(gamma_max + 1)]
        # steady state: the draft model in step with the sequence (its catch-up is a one-off, priced below)
        per_draft = self.costs.draft_ms(1, context, 1)
        times = [g * per_draft + verify for g, verify in enumerate(state.verify_ms)]
        ratios = [t / ms for t, ms in zip(tokens, times)]
        best = max(range(gamma_max + 1), key=ratios.__getitem__)
        catch_up = self.costs.draft_ms(1, context, state.unseen) - self.costs.draft_ms(1, context, 1)
        if best > 0 and catch_up > 0:
            # worth it only if the rest of the request, at the speculative rate, wins back the catch-up
            remaining = seq.params.max_tokens - len(seq.output_token_ids)
            if remaining * (times[0] - 1 / ratios[best]) < catch_up:
                best = 0
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

    def trim(self, seq: Sequence, num_drafted: int) -> int:
        state = self._state(seq)
        if num_drafted == 0:
            return 0
        gains = [state.expected[k] - state.rate * state.verify_ms[k] for k in range(num_drafted + 1)]
        return max(range(num_drafted + 1), key=gains.__getitem__)

    def observe(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        state = self._state(seq)
        if num_drafted == 0:
            self.probe_credit_ms += self.probe_budget * self.costs.verify_ms(1, seq.num_tokens)
            state.unseen += 1
            return
        if state.probing and num_accepted == num_drafted:
            # acceptance where the estimate expected little: the evidence it rests on may be stale (the text
            # changed), so it weighs half from here
            state.estimate.forget(0.5)
        state.unseen = 1
        state.estimate.observe(num_drafted, num_accepted)

    def release(self, seq: Sequence) -> None:
        state = self._states.pop(seq, None)
        if state is None or not any(state.estimate.verified):
            return  # nothing learned
        [final] = self._rates(state, 1)
        self.prior = (1 - self.request_weight) * self.prior + self.request_weight * final

    def _state(self, seq: Sequence) -> _SequenceState:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _SequenceState(AcceptanceEstimate(self.decay), unseen=seq.num_tokens)
        return state

    def _rates(self, state: _SequenceState, depth: int) -> list[float]:
        return state.estimate.rates(depth, self.prior)
