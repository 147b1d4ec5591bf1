"""The γ controller: synthetic acceptance and cost curves (no models), then end to end on tiny models
(greedy identity and the sampled distribution with adaptive γ and the draft's confidence stop)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import NUM_SAMPLES, chi_square_pvalue, exact_first_two, sampled_first_two
from specdec import LLM, SamplingParams
from specdec.engine.adaptive import AcceptanceEstimate, AdaptiveGamma, HeuristicSchedule, StepCosts, expected_tokens
from specdec.engine.sequence import Sequence
from specdec.models.cost_curve import CostCurve


def curve_by_context(ms_of_k_and_context) -> CostCurve:
    """A measured-looking curve at contexts 128 and 1024, ms(k, context) with no spread."""
    ks = (1, 2, 3, 4, 6, 8, 12, 16, 32)
    rows = {c: {k: float(ms_of_k_and_context(k, c)) for k in ks} for c in (128, 1024)}
    return CostCurve(rows, {c: {k: (v, v) for k, v in row.items()} for c, row in rows.items()})


def curve(ms_of_k) -> CostCurve:
    return curve_by_context(lambda k, context: ms_of_k(k))


FLAT = curve(lambda k: 10.0)  # verification free up to 32 tokens: the GPU picture
STEEP = curve(lambda k: 10.0 * k)  # every verified token costs a full step: compute-bound
# close to this machine's int8 1.5B target and int8 0.5B draft at ~128 tokens of context (smoothed)
INT8_TARGET = curve(lambda k: 36 + 3 * k)
INT8_DRAFT = curve(lambda k: 19.5 + 0.65 * k)


def sequence(length: int = 100, max_tokens: int = 100_000) -> Sequence:
    return Sequence("r", 0, [1] * length, SamplingParams(max_tokens=max_tokens), torch.Generator())


def run(controller, accept, steps: int, gamma_max: int = 8, seed: int = 0, seq: Sequence | None = None,
        timed=None) -> list[int]:
    """Drive the controller as the engine does: choose, draft γ (all offered), trim, (`timed(seq, γ)`: time the step,)
    verify with position i accepted with probability accept(i) given the ones before; returns the γ verified per step."""
    rng = random.Random(seed)
    own = seq is None
    seq = seq or sequence()
    chosen = []
    for _ in range(steps):
        gamma = controller.trim(seq, controller.choose(seq, gamma_max))
        if timed is not None:
            timed(seq, gamma)
        accepted = 0
        while accepted < gamma and rng.random() < accept(accepted):
            accepted += 1
        controller.observe(seq, gamma, accepted)
        seq.output_token_ids.extend([1] * (accepted + 1))
        chosen.append(gamma)
    if own:
        controller.release(seq)  # the engine learns from finished sequences
    return chosen


def speed_over_plain(costs: StepCosts, accept, seed: int = 0, steps: int = 300, gamma: int | None = None) -> float:
    """Tokens per modeled ms of the adaptive controller (or a fixed γ) ÷ plain decoding's, with the draft
    model's catch-up after plain steps priced in."""
    rng = random.Random(seed)
    controller = AdaptiveGamma(costs)
    seq = sequence()
    tokens, ms, unseen = 0, 0.0, 1
    for _ in range(steps):
        g = gamma if gamma is not None else controller.trim(seq, controller.choose(seq, 8))
        accepted = 0
        while accepted < g and rng.random() < accept(accepted):
            accepted += 1
        controller.observe(seq, g, accepted)
        ms += costs.draft_ms(g, 128, unseen) + costs.verify_ms(g + 1, 128)
        unseen = 1 if g else unseen + 1
        tokens += accepted + 1
    return tokens / ms * costs.verify_ms(1, 128)


def test_high_acceptance_and_flat_verification_draft_the_most():
    chosen = run(AdaptiveGamma(StepCosts(FLAT)), lambda i: 0.95, 60)
    assert chosen[-20:] == [8] * 20


@pytest.mark.parametrize("costs, accept", [
    (StepCosts(INT8_TARGET, INT8_DRAFT), 0.1),  # low acceptance
    (StepCosts(STEEP), 0.9),  # verification as costly as decoding, even at high acceptance
    (StepCosts(FLAT, FLAT), 0.9),  # a draft as costly as the target
], ids=["low-acceptance", "steep-verification", "costly-draft"])
def test_speculation_turns_itself_off_where_it_loses(costs, accept):
    chosen = run(AdaptiveGamma(costs), lambda i: accept, 300)
    assert chosen[-200:].count(0) >= 0.5 * 200  # plain steps, and probes (one token) within their budget
    assert max(chosen[-200:]) <= 1
    for seed in range(3):
        assert speed_over_plain(costs, lambda i: accept, seed) >= 0.97
        assert speed_over_plain(costs, lambda i: accept, seed, gamma=2) < 0.97  # where fixed γ loses


@pytest.mark.parametrize("accept", [0.6, 0.8, 0.95])
def test_adaptive_is_near_the_best_fixed_gamma(accept):
    """Mean over seeds, against the fixed γ with the best mean: the learning from a 0.5 prior included."""
    costs = StepCosts(INT8_TARGET, curve(lambda k: 4.0 + 0.1 * k))  # a cheap draft: c ≈ 0.1
    best = max(sum(speed_over_plain(costs, lambda i: accept, seed, gamma=g) for seed in range(4)) for g in range(9))
    assert sum(speed_over_plain(costs, lambda i: accept, seed) for seed in range(4)) >= 0.95 * best


def test_choice_is_the_argmax_of_expected_tokens_per_time():
    costs = StepCosts(INT8_TARGET, curve(lambda k: 5.0 + k))  # a cheap draft: c ≈ 0.15
    controller = AdaptiveGamma(costs)
    seq = sequence()
    for _ in range(200):
        controller.observe(seq, 8, 8)  # long history of full acceptance: rates → ~1, then partial
    for _ in range(30):
        controller.observe(seq, 8, 3)
    rates = controller._rates(controller._state(seq), 8)
    tokens = expected_tokens(rates)
    ratios = [tokens[g] / (costs.draft_ms(g, seq.num_tokens, 1) + costs.verify_ms(g + 1, seq.num_tokens)) for g in range(9)]
    best = max(range(9), key=ratios.__getitem__)
    assert 0 < best < 8  # in between: the curve and the rates disagree at the ends
    assert controller.choose(seq, 8) == best


def test_batch_size_prices_verification():
    """Verification that is free for one sequence (flat to 8 tokens) is compute-bound for a batch of 16: the
    same evidence speculates alone and decodes plain in the batch."""
    costs = StepCosts(curve(lambda k: 40.0 if k <= 8 else 5.0 * k))
    controller = AdaptiveGamma(costs)
    seq = sequence()
    for _ in range(30):
        controller.observe(seq, 6, 5)
    assert controller.choose(seq, 6, batch_size=1) >= 4
    assert controller.choose(seq, 6, batch_size=16) == 0
    assert costs.verify_ms(3, 128, batch_size=16) == pytest.approx(5.0 * 48 / 16)


def test_catch_up_is_priced_after_what_the_draft_holds():
    """A draft forward's cost curve is indexed by the context cached before it: catching up on a 500-token prompt
    costs a forward over 500 tokens after none, not after 500 (its later forwards run after the whole sequence)."""
    draft = curve_by_context(lambda k, context: 20.0 + k * (1 + context / 1024))
    costs = StepCosts(INT8_TARGET, draft)
    assert costs.draft_ms(1, 500, 500) == pytest.approx(draft.forward_ms(500, 0))
    assert costs.draft_ms(1, 500, 500) < draft.forward_ms(500, 500)
    assert costs.draft_ms(3, 1000, 100) == pytest.approx(draft.forward_ms(100, 900) + 2 * draft.forward_ms(1, 1000))


def test_catch_up_is_priced_with_logits_at_the_last_token_only():
    """The catch-up computes one logit per sequence: its tokens are priced by the draft's one-logit points (the 0.5B's
    output layer is ~28% of its multiply-adds per row), its steps in step with the sequence by the every-row curve."""
    every_row = curve_by_context(lambda k, context: 10.0 + k * (1 + context / 1024))
    rows = {c: row | {k: 10.0 + k * 0.75 * (1 + c / 1024) for k in (64, 256)} for c, row in every_row.ms.items()}
    prefill = {c: {k: 10.0 + k * 0.5 * (1 + c / 1024) for k in (64, 256)} for c in rows}
    draft = CostCurve(rows, {c: {k: (v, v) for k, v in row.items()} for c, row in rows.items()}, prefill=prefill)
    costs = StepCosts(INT8_TARGET, draft)
    assert costs.draft_ms(1, 500, 500) == pytest.approx(draft.prefill_ms(500, 0))
    assert draft.prefill_ms(500, 0) == pytest.approx(10.0 + 500 * 0.5 * 1.125)
    assert costs.draft_ms(1, 500, 500) < draft.forward_ms(500, 0)
    assert costs.draft_ms(2, 500, 1) == pytest.approx(draft.forward_ms(1, 499) + draft.forward_ms(1, 500))  # in step
    # four sequences: their four logits priced by the every-row curve, the 4 × 99 tokens beyond by the one-logit one
    batch = costs.draft_ms(1, 500, 100, batch_size=4) * 4
    assert batch == pytest.approx(draft.forward_ms(4, 400) + draft.prefill_ms(400, 400) - draft.prefill_ms(4, 400))


def test_measured_step_times_correct_the_cost_curves():
    """Speculative steps that take 1.6× what the curves say (overheads they miss) turn a modeled ~1.2× gain
    into a loss: the controller learns the ratio from the engine's step times and decodes plain."""
    costs = StepCosts(INT8_TARGET, curve(lambda k: 4.0 + 0.1 * k))
    controller = AdaptiveGamma(costs, probe_budget=0.0)
    seq = sequence()
    rng = random.Random(0)
    for _ in range(80):
        gamma = controller.trim(seq, controller.choose(seq, 8))
        state = controller._state(seq)  # the forward as its curve says, the rest of a speculative step slower
        controller.step_timed([seq], state.modeled_ms * (1.6 if gamma else 1.0), state.modeled_forward_ms)
        accepted = int(gamma > 0 and rng.random() < 0.6)  # the first draft 60%, the rest never: ~1.3× by the curves
        controller.observe(seq, gamma, accepted)
        seq.output_token_ids.extend([1] * (accepted + 1))
    assert 1.3 < controller.speculation_overhead <= 1.6 and controller.plain_calibration == 1.0
    assert controller.choose(seq, 8) == 0  # (it stops learning the ratio once it stops speculating)
    fresh = AdaptiveGamma(costs, probe_budget=0.0)
    fresh._states[seq] = controller._states[seq]
    assert fresh.choose(seq, 8) > 0  # the same evidence, uncalibrated: speculate
    # a machine 1.3× slower than when its curves were measured slows plain and speculative steps alike: what
    # plain steps measure carries over to speculation, and the choice stays
    drifted = AdaptiveGamma(costs, probe_budget=0.0)
    drifted._states[seq] = controller._states[seq]
    for _ in range(40):
        drifted.choose(seq, 0)
        state = drifted._state(seq)
        drifted.step_timed([seq], state.modeled_ms * 1.3, state.modeled_forward_ms * 1.3)
    assert drifted.plain_calibration == pytest.approx(1.3, rel=0.02) and drifted.speculation_overhead == 1.0
    assert drifted.choose(seq, 8) == fresh.choose(seq, 8) > 0


def test_a_slow_machine_while_speculating_is_not_speculation_overhead():
    """The seconds after a model loads run everything ~2× slow (measured: a fresh engine's first 3 s). Steps that
    speculate through such a stretch are slow because the machine is, which their own target forward shows: the
    controller charges it to the machine, not to speculation, and keeps speculating once the machine recovers
    (charging it to speculation kept a fresh engine plain for 103 of its first request's 130 steps)."""
    costs = StepCosts(INT8_TARGET, curve(lambda k: 4.0 + 0.1 * k))
    controller = AdaptiveGamma(costs, probe_budget=0.0)
    seq = sequence()
    rng = random.Random(0)
    chosen = []
    for step in range(120):
        gamma = controller.trim(seq, controller.choose(seq, 8))
        chosen.append(gamma)
        state = controller._state(seq)
        slow = 2.0 if step < 30 else 1.0  # the machine: everything, the draft's forwards and the target's
        controller.step_timed([seq], state.modeled_ms * slow * 1.05, state.modeled_forward_ms * slow)
        accepted = 0
        while accepted < gamma and rng.random() < 0.8:  # each position 80%
            accepted += 1
        controller.observe(seq, gamma, accepted)
        seq.output_token_ids.extend([1] * (accepted + 1))
    assert min(chosen) > 0  # it never stopped speculating
    assert controller.speculation_overhead == pytest.approx(1.05, rel=0.02)
    assert controller.machine == pytest.approx(1.0, rel=0.01)


def test_the_machine_is_read_through_the_curves_bounds():
    """Memory 1.6× slower than when the curves were measured (this machine switches between ~35 and ~60 GB/s): the
    controller reads it off the target forwards of plain and speculative steps through the curve's two bounds, then
    prices each verification as the slow machine runs it (a verification that waits on the arithmetic costs the same;
    scaled by 1.6 it would cost 1.6×), so it drafts at least as deep as on the fast machine. A forward that waits on the
    arithmetic alone says nothing of the memory and leaves the estimate."""
    ks = (1, 2, 3, 4, 6, 8, 12, 16, 32)
    fast = curve(lambda k: max(30.0 + (k - 1), 5.0 * k))
    slow = curve(lambda k: max(48.0 + (k - 1), 5.0 * k))
    costs = StepCosts(fast, curve(lambda k: 4.0 + 0.1 * k))
    controller = AdaptiveGamma(costs, probe_budget=0.0)

    def on_the_slow_machine(seq: Sequence, gamma: int) -> None:
        truth = slow.forward_ms(gamma + 1, seq.num_tokens)
        unseen = controller._state(seq).modeled_step[2]
        controller.step_timed([seq], truth + costs.draft_ms(gamma, seq.num_tokens, unseen, machine=1.6), truth)

    seq = sequence()
    run(controller, lambda i: 0.8, 120, seq=seq, timed=on_the_slow_machine)
    state = controller._state(seq)
    assert controller.machine == pytest.approx(1.6, rel=0.02)
    assert controller.plain_overhead == pytest.approx(1.0, rel=0.02)
    assert controller.speculation_overhead == pytest.approx(1.0, rel=0.02)
    for k in ks:
        assert controller._verify_ms(state, k - 1) == pytest.approx(slow.forward_ms(k, seq.num_tokens), rel=0.03)
    assert controller._verify_ms(state, 11) < 0.7 * 1.6 * fast.forward_ms(12, seq.num_tokens)  # scaling: 96 ms
    calm = AdaptiveGamma(costs, probe_budget=0.0)
    calm._states[seq] = controller._states[seq]
    assert controller.choose(seq, 8) >= calm.choose(seq, 8) > 0
    # a forward over 32 tokens waits on the arithmetic: its time, whatever it is, leaves the machine as it was
    state.modeled_step, machine = (0, 31, 1), controller.machine
    controller.step_timed([seq], 400.0, 400.0)
    assert controller.machine == machine


def test_a_forward_that_waits_on_arithmetic_does_not_move_the_machine_factor():
    """Four sequences verifying 5 tokens each: a forward over 20 tokens of 4 caches, which waits on the arithmetic as
    measured, took 1.3× the curve's 20-token forward. With the factor at 2.2 (a slow stretch before), the modeled
    forward would rise with it, yet its excess is the batch's, not the memory's (measured: such steps drove the factor to
    2.1–2.6 in fast memory, pricing plain steps double). The factor stays; the excess goes to speculation's overhead."""
    target = curve(lambda k: max(30.0 + (k - 1), 4.0 * k))
    controller = AdaptiveGamma(StepCosts(target), probe_budget=0.0)
    controller.machine = 2.2
    seqs = [sequence() for _ in range(4)]
    for _ in range(60):
        for seq in seqs:
            controller.choose(seq, 4, batch_size=4)
            state = controller._state(seq)
            state.drafted, state.modeled_step = 4, (4, 4, 1)
            state.modeled_ms = state.modeled_forward_ms = target.forward_ms(20, seq.num_tokens) / 4
        controller.step_timed(seqs, 1.3 * target.forward_ms(20, 100), 1.3 * target.forward_ms(20, 100))
    assert controller.machine == 2.2
    assert controller.speculation_overhead > 1.15


def test_a_lookup_that_finds_nothing_is_timed_as_a_plain_step():
    """An n-gram or suffix lookup asked for γ tokens that finds no match runs a plain step: its time calibrates
    plain steps, not speculation (which a plain step's time against a γ + 1 token verify would make look cheap)."""
    costs = StepCosts(INT8_TARGET)
    controller = AdaptiveGamma(costs, probe_budget=0.0)
    seq = sequence()
    for _ in range(20):
        assert controller.choose(seq, 8) > 0  # the prior says speculate
        assert controller.trim(seq, 0) == 0
        controller.step_timed([seq], costs.verify_ms(1, seq.num_tokens) * 1.3, costs.verify_ms(1, seq.num_tokens) * 1.3)
        controller.observe(seq, 0, 0)
        seq.output_token_ids.append(1)
    assert controller.speculation_overhead == 1.0
    assert controller.plain_calibration == pytest.approx(1.3, rel=0.05)


def test_prompt_steps_are_not_timed(tiny_qwen):
    """The step that feeds a prompt's last chunk samples a token too, but its time is the prompt's: only steps
    where every sequence fed its one sampled token calibrate the controller."""
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    timed = []
    llm.engine.controller.step_timed = lambda seqs, ms, forward_ms: timed.append(len(seqs))
    [out] = llm.generate("a prompt of a few tokens", SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert out.metrics.num_target_forwards >= 2 and timed == [1] * (out.metrics.num_target_forwards - 1)


def test_acceptance_per_position_not_iid():
    """Position 1 nearly always accepted, position 2 nearly never: γ = 1, where an i.i.d. α of ~0.5 would
    suggest more or nothing."""
    accept = lambda i: 0.97 if i == 0 else 0.03  # noqa: E731
    chosen = run(AdaptiveGamma(StepCosts(INT8_TARGET)), accept, 200)
    assert max(chosen[-50:]) <= 2
    best = max(speed_over_plain(StepCosts(INT8_TARGET), accept, gamma=g) for g in range(9))
    assert speed_over_plain(StepCosts(INT8_TARGET), accept) >= 0.95 * best


def test_trim_cuts_a_free_draft_where_acceptance_falls():
    controller = AdaptiveGamma(StepCosts(INT8_TARGET))
    seq = sequence()
    for _ in range(50):
        controller.observe(seq, 8, 2)  # positions 1–2 accepted, 3 rejected, every time
    assert controller.choose(seq, 8) == 2
    controller.choose(seq, 16)
    assert controller.trim(seq, 16) == 2


@pytest.mark.parametrize("draft", [None, INT8_DRAFT], ids=["lookup", "draft-model"])
def test_probes_cost_little_and_find_acceptance_again(draft):
    """Copy (α ≈ 1) → free writing (α = 0) → copy: the controller drops to plain steps and probes within its
    budget. Probes are cheap for a lookup proposer, which comes back to speculating; a draft model's
    probe must first catch up on every token it skipped, which here costs about what the budget earns."""
    costs = StepCosts(INT8_TARGET, draft)
    controller = AdaptiveGamma(costs)
    seq = sequence()
    copy = run(controller, lambda i: 0.98, 100, seq=seq, seed=1)
    free = run(controller, lambda i: 0.0, 400, seq=seq, seed=2)
    back = run(controller, lambda i: 0.98, 200, seq=seq, seed=3)
    assert sum(copy[-50:]) / 50 >= 4
    assert free[-300:].count(0) >= 0.7 * 300  # a lookup probe costs ~1/10 step: the budget allows many
    assert speed_over_plain(costs, lambda i: 0.0, steps=400) >= 0.97
    if draft is None:
        assert sum(back[-50:]) / 50 >= 4  # found again


def test_a_new_sequence_starts_from_what_the_engine_learned():
    controller = AdaptiveGamma(StepCosts(INT8_TARGET, INT8_DRAFT), probe_budget=0.0)  # no probes: the prior alone
    assert controller.choose(sequence(), 8) > 0  # nothing learned: an optimistic prior tries speculation
    run(controller, lambda i: 0.99, 100)
    assert controller.choose(sequence(), 8) > 0
    assert controller.choose(sequence(max_tokens=3), 8) == 0  # too short to win back the draft's prefill
    for seed in range(2):  # each finished request weighs half in the prior
        run(controller, lambda i: 0.05, 100, seed=seed)
    # the engine learned that this draft is rejected: a 64-token request does not try it (a much longer one
    # would: at what the prior leaves possible, its tokens could win back a try)
    assert controller.choose(sequence(max_tokens=64), 8) == 0


def test_thin_evidence_is_worth_trying():
    """What trying is worth over the posterior of α, not at its mean: one early rejection doesn't switch a
    fresh engine off, and a long prompt's catch-up is paid where the request may win it back."""
    costs = StepCosts(INT8_TARGET, INT8_DRAFT)
    controller = AdaptiveGamma(costs, probe_budget=0.0)
    seq = sequence(max_tokens=64)
    controller.choose(seq, 8)
    controller.observe(seq, 1, 0)  # the first draft is rejected: the mean falls to 0.375
    assert controller._rates(controller._state(seq), 1)[0] == pytest.approx(0.375)
    assert controller.choose(seq, 8) > 0
    # 500 tokens to catch up on, 64 to generate: at the prior's mean (0.75) the rest would not win it back
    long_prompt = sequence(length=500, max_tokens=64)
    state = controller._state(long_prompt)
    catch_up = costs.draft_ms(1, 500, 500) - costs.draft_ms(1, 500, 1)
    mean_saving = [64 * (costs.verify_ms(1, 500) - (g * costs.draft_ms(1, 500, 1) + costs.verify_ms(g + 1, 500))
                         / t) for g, t in enumerate(expected_tokens([0.75] * 8)) if g]
    assert max(mean_saving) < catch_up
    assert controller.choose(long_prompt, 8) == 0 and state.unseen == 500  # not even at what α may be
    longer = sequence(length=500, max_tokens=256)
    assert controller.choose(longer, 8) > 0  # long enough to win it back at what α may be
    for _ in range(4):
        controller.observe(longer, 2, 0)  # rejected: evidence enough to act on its mean
    assert controller.choose(longer, 8) == 0


def run_strata(controller, strata, steps: int, seed: int = 0) -> tuple[list[int], float]:
    """Lookups whose stratum (drawn from `strata`: stratum → (weight, acceptance per position)) predicts
    acceptance, through choose → trim → observe; returns the γ verified per step and tokens per modeled ms ÷
    plain decoding's."""
    rng = random.Random(seed)
    seq = sequence()
    costs = controller.costs if isinstance(controller, AdaptiveGamma) else StepCosts(INT8_TARGET)
    chosen, tokens, ms = [], 0, 0.0
    for _ in range(steps):
        stratum = rng.choices(list(strata), [w for w, _ in strata.values()])[0]
        accept = strata[stratum][1]
        gamma = controller.trim(seq, controller.choose(seq, 8), stratum=stratum)
        accepted = 0
        while accepted < gamma and rng.random() < accept:
            accepted += 1
        controller.observe(seq, gamma, accepted)
        seq.output_token_ids.extend([1] * (accepted + 1))
        chosen.append(gamma)
        tokens += accepted + 1
        ms += costs.verify_ms(gamma + 1, 128)
    controller.release(seq)
    return chosen, tokens / ms * costs.verify_ms(1, 128)


class FixedLookup:
    """γ fixed, for `run_strata`."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def choose(self, seq, gamma_max, batch_size=1):
        return self.gamma

    def trim(self, seq, num_drafted, sizes=None, stratum=None):
        return num_drafted

    def observe(self, seq, num_drafted, num_accepted):
        pass

    def release(self, seq):
        pass


def test_strata_choose_how_much_of_a_lookup_to_verify():
    """A 5-token match copies (α 0.95), a 2-token coincidence does not (α 0.2), 30/70 of the lookups: pooled
    acceptance says plain decoding (or little) where the stratum says verify 8. Stratified, the controller
    verifies long matches deep and skips short ones, and beats every fixed γ and the unstratified controller."""
    strata = {5: (0.3, 0.95), 2: (0.7, 0.2)}
    costs = StepCosts(INT8_TARGET)
    controller = AdaptiveGamma(costs, stratified=True)
    chosen, speed = run_strata(controller, strata, 400)
    assert controller.stratum_priors[5] > 0.8 > 0.3 > controller.stratum_priors[2]
    seq = sequence()
    assert controller.choose(seq, 8) == 8  # a lookup costs nothing: draft the most, then trim by stratum
    assert controller.trim(seq, 8, stratum=5) >= 6 and controller.trim(seq, 8, stratum=2) <= 1
    pooled = run_strata(AdaptiveGamma(costs), strata, 400)[1]
    fixed = max(run_strata(FixedLookup(g), strata, 400)[1] for g in range(9))
    assert speed > 1.1 * max(pooled, fixed)
    assert min(run_strata(AdaptiveGamma(costs, stratified=True), {2: (1.0, 0.05)}, 400, seed)[1]
               for seed in range(3)) >= 0.97  # one stratum, rejected: plain steps and a few probes
    with pytest.raises(ValueError, match="lookups"):
        AdaptiveGamma(StepCosts(INT8_TARGET, INT8_DRAFT), stratified=True)


def test_estimate_discounts_old_evidence():
    estimate = AcceptanceEstimate(decay=0.5, prior_weight=1.0)
    for _ in range(20):
        estimate.observe(2, 2)
    estimate.observe(2, 0)  # rejected at position 1: position 2 was not verified
    assert estimate.verified[1] == pytest.approx(sum(0.5**k for k in range(1, 21)))
    a1, a2 = estimate.rates(2, 0.5)
    assert 0.4 < a1 < 0.6  # one recent rejection weighs as much as all the older acceptances together
    assert a2 == pytest.approx((estimate.accepted[1] + a1) / (estimate.verified[1] + 1))  # shrunk towards a1
    assert AcceptanceEstimate(0.9).rates(3, 0.3) == [0.3, 0.3, 0.3]  # no evidence: the prior


def test_heuristic_schedule_is_hfs():
    schedule = HeuristicSchedule(4)
    seq = sequence()
    steps = []
    for drafted, accepted in [(4, 4), (6, 2), (5, 0), (4, 0), (3, 0), (2, 0), (1, 1)]:
        steps.append(schedule.choose(seq, 64))
        schedule.observe(seq, drafted, accepted)
    assert steps == [4, 6, 5, 4, 3, 2, 1]
    assert schedule.choose(seq, 64) == 3 and schedule.choose(seq, 2) == 2


# --- end to end on tiny models --------------------------------------------------------------------

def cheap_speculation(llm: LLM) -> AdaptiveGamma:
    """A controller priced so speculation pays on tiny models (whose draft costs as much as the target), without
    step-time calibration (whose choices would follow this machine's timing)."""
    proposer = llm.engine.proposer
    draft = curve(lambda k: 1.0) if proposer.model is not None else None
    return AdaptiveGamma(StepCosts(FLAT, draft), calibration_weight=0.0, stratified=proposer.stratified)


@pytest.mark.parametrize("config", [
    {"method": "draft_model", "num_speculative_tokens": 6},
    {"method": "draft_model", "num_speculative_tokens": 6, "draft_confidence_threshold": 0.02},
    {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "suffix", "num_speculative_tokens": 8},
], ids=["draft", "draft-confidence", "ngram", "suffix"])
@pytest.mark.parametrize("priced", ["measured", "cheap"])
def test_greedy_identity_with_adaptive_gamma(config, priced, tiny_qwen, tiny_qwen_draft):
    prompts = ["abc abc abc abc", "def add(a, b):\n    return a + b\n\ndef add(a, b):", "x"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    if config["method"] == "draft_model":
        config = {**config, "model": str(tiny_qwen_draft), "quantization": None}
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, max_num_seqs=3, speculative_config=config)
    if priced == "cheap":
        llm.engine.controller = cheap_speculation(llm)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    histogram = [sum(col) for col in zip(*[_padded(o.metrics.speculative_decoding["gamma_histogram"], 9) for o in outputs])]
    assert sum(histogram) == sum(o.metrics.num_target_forwards for o in outputs)  # every step is counted once
    if priced == "cheap":
        assert sum(n > 0 for n in histogram[1:]) >= 2  # the controller really varied γ
    assert not llm.engine.running and llm.engine.cache.num_free_slots == llm.engine.cache.num_slots


def _padded(values: list[int], width: int) -> list[int]:
    return values + [0] * (width - len(values))


def test_confidence_threshold_stops_drafting(tiny_qwen, tiny_qwen_draft):
    base = {"method": "draft_model", "model": str(tiny_qwen_draft), "quantization": None, "num_speculative_tokens": 6,
            "adaptive": False}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    drafted = {}
    for threshold in (0.0, 0.999):
        llm = LLM(str(tiny_qwen), quantization=None, max_model_len=256, speculative_config={
            **base, "draft_confidence_threshold": threshold})
        [out] = llm.generate("hello world", params, use_tqdm=False)
        s = out.metrics.speculative_decoding
        drafted[threshold] = s["num_draft_tokens"] / s["num_spec_steps"]
        assert s["num_draft_forwards"] >= s["num_draft_tokens"]
    assert drafted[0.0] == pytest.approx(6, abs=0.5)
    assert drafted[0.999] < 2  # a random tiny draft is never that sure: one token per step


@pytest.mark.parametrize("config", [
    {"method": "draft_model", "num_speculative_tokens": 3, "draft_confidence_threshold": 0.35},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
], ids=["draft-confidence", "ngram"])
def test_adaptive_gamma_keeps_the_distribution(config, small_vocab_pair):
    """Temperature 1, 20k samples of the first two tokens against the exact P(t1, t2), with γ chosen
    and trimmed by the controller (priced so that it speculates) and the draft's confidence stop."""
    target, draft = small_vocab_pair
    if config["method"] == "draft_model":
        config = {**config, "model": str(draft), "quantization": None}
    params = SamplingParams(n=NUM_SAMPLES, temperature=1.0, max_tokens=4, seed=7, ignore_eos=True)
    prompt = [12, 4, 8, 12, 4, 8, 12, 4]
    counts, stats = sampled_first_two(target, config, params, prompt, controller=cheap_speculation)
    assert 0.05 < stats["draft_acceptance_rate"] < 0.95
    assert len([n for n in stats["gamma_histogram"] if n]) >= 2
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, params)) > 1e-4


def test_power_the_adaptive_distribution_test_catches_a_lossy_verifier(small_vocab_pair, monkeypatch):
    """The setup above (adaptive γ, trim, confidence stop) with a verifier that accepts every draft: caught."""
    import specdec.engine.engine as engine_module
    from specdec.spec.verifier import Verified

    def always_accept(p, drafts, num_draft, q, generators):
        return Verified(list(num_draft), [drafts[r, :n].tolist() + [int(torch.multinomial(p[r, n], 1, generator=generators[r]))]
                                          for r, n in enumerate(num_draft)])

    monkeypatch.setattr(engine_module, "rejection_sample", always_accept)
    target, draft = small_vocab_pair
    config = {"method": "draft_model", "num_speculative_tokens": 3, "draft_confidence_threshold": 0.35,
              "model": str(draft), "quantization": None}
    params = SamplingParams(n=NUM_SAMPLES, temperature=1.0, max_tokens=4, seed=7, ignore_eos=True)
    prompt = [12, 4, 8, 12, 4, 8, 12, 4]
    counts, _ = sampled_first_two(target, config, params, prompt, controller=cheap_speculation)
    assert chi_square_pvalue(counts, exact_first_two(target, prompt, params)) < 1e-12


@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive must be"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "draft_confidence_threshold": 1.0}, "draft_confidence_threshold"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "draft_confidence_threshold": -0.1}, "draft_confidence_threshold"),
])
def test_bad_adaptive_config(config, message, tiny_qwen):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_qwen), speculative_config=config)
