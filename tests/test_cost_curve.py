"""The cost curve and roofline: pure interpolation, per-machine cache, work accounting."""

from __future__ import annotations

import pytest

from specdec import LLM
from specdec.models import cost_curve as cost_module
from specdec.models.cost_curve import CostCurve, cost_curve_path
from specdec.models.loader import load_decoder
from specdec.models.roofline import Ceilings, ForwardWork


def curve() -> CostCurve:
    ms = {128: {1: 10.0, 2: 11.0, 4: 14.0, 8: 30.0}, 1024: {1: 20.0, 2: 22.0, 4: 28.0, 8: 60.0}}
    return CostCurve(ms, {c: {k: (v, v) for k, v in row.items()} for c, row in ms.items()})


def test_interpolation_in_k_and_context():
    c = curve()
    assert c.forward_ms(2, 128) == 11.0
    assert c.forward_ms(3, 128) == pytest.approx(12.5)
    assert c.forward_ms(12, 128) == pytest.approx(30.0 + 16 / 4 * 4)  # last slope extended
    assert c.forward_ms(1, 576) == pytest.approx(15.0)  # halfway between contexts
    assert c.forward_ms(1, 50) == 10.0 and c.forward_ms(1, 4096) == 20.0  # clamped
    assert c.relative(4, 128) == pytest.approx(1.4)
    with pytest.raises(ValueError):
        c.forward_ms(0, 128)
    assert CostCurve.from_json(c.to_json()) == c


def test_prefill_is_priced_by_the_one_logit_points():
    """A forward with logits at its last row only (a draft's catch-up) follows the one-logit points measured at large
    k, from k = 1 (where every row's logit is the one) on; never above the every-row curve; where a context was
    measured without them, the every-row curve."""
    ms = {128: {1: 10.0, 8: 20.0, 64: 200.0, 256: 800.0}, 1024: {1: 20.0, 8: 60.0, 64: 300.0, 256: 1000.0}}
    prefill = {128: {64: 150.0, 256: 600.0}}
    c = CostCurve(ms, {ctx: {k: (v, v) for k, v in row.items()} for ctx, row in ms.items()}, prefill=prefill)
    assert c.prefill_ms(1, 128) == 10.0 and c.prefill_ms(64, 128) == 150.0 and c.prefill_ms(256, 128) == 600.0
    assert c.prefill_ms(160, 128) == pytest.approx(375.0)
    assert c.prefill_ms(512, 128) == pytest.approx(600.0 + 450.0 / 192 * 256)  # last slope extended
    assert c.prefill_ms(32, 128) == pytest.approx(10.0 + 140.0 * 31 / 63)
    assert c.prefill_ms(8, 128) == 20.0  # the line from k = 1 (25.6) lies above the every-row curve, which caps it
    assert c.prefill_ms(64, 1024) == c.forward_ms(64, 1024) == 300.0  # no one-logit points there
    assert c.prefill_ms(64, 576) == pytest.approx((150.0 + 300.0) / 2)
    with pytest.raises(ValueError):
        c.prefill_ms(0, 128)
    assert CostCurve.from_json(c.to_json()) == c
    assert CostCurve(ms, c.spread).prefill_ms(64, 128) == 200.0


def test_a_point_above_the_ones_after_it_is_lowered_to_them():
    """Noise only slows a forward: a k = 1 median above the larger k's (measured: the 0.5B's 27.7 ms against 17.9–19.3)
    is lowered to the smallest cost after it, and a dip (k = 4 below k = 3) lowers k = 3; the curve never falls."""
    ms = {128: {1: 27.7, 2: 19.3, 3: 18.6, 4: 17.9, 6: 19.3, 8: 18.5, 12: 21.2}}
    c = CostCurve(ms, {128: {k: (v, v) for k, v in ms[128].items()}})
    assert [c.forward_ms(k, 128) for k in (1, 2, 3, 4, 6, 8, 12)] == [17.9, 17.9, 17.9, 17.9, 18.5, 18.5, 21.2]
    assert c.ms == ms  # the measured medians are kept as measured


def two_bound_curve(machine: float) -> CostCurve:
    """A curve made by the physics `BoundLines` assumes: the weight stream (30 ms at machine 1, + 1 ms a token) or the
    arithmetic (5 ms a token), whichever is longer; memory `machine` times slower lengthens the stream alone."""
    ks = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
    ms = {c: {k: max(30.0 * machine + c / 128 + (k - 1), 5.0 * k) for k in ks} for c in (128, 1024)}
    return CostCurve(ms, {c: {k: (v, v) for k, v in row.items()} for c, row in ms.items()})


def test_a_curve_moves_with_the_memory_as_its_bounds_say():
    """Priced on a machine whose one-token forwards run `machine` × slower or faster, the curve measured in fast memory
    gives the one measured in slow memory and back: a point that waits on the stream moves by the stream's change, one
    that waits on the arithmetic stays, one in between goes to the longer of the two. Scaling every point by the
    one-token ratio (what the controller did before) misses all but the first."""
    fast, slow = two_bound_curve(1.0), two_bound_curve(1.6)
    for context in (128, 1024):
        ratio = slow.forward_ms(1, context) / fast.forward_ms(1, context)
        for k in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64):
            assert fast.forward_ms(k, context, ratio) == pytest.approx(slow.forward_ms(k, context))
            assert slow.forward_ms(k, context, 1 / ratio) == pytest.approx(fast.forward_ms(k, context))
            assert fast.forward_ms(k, context, 1.0) == fast.ms[context][k]  # as measured
        assert fast.forward_ms(16, context) * ratio > 1.4 * slow.forward_ms(16, context)  # scaled: overpriced
        assert fast.forward_ms(64, context) * ratio > 1.4 * slow.forward_ms(64, context)
    lines = fast._lines[128]
    assert (lines.first, lines.per_token, lines.compute_per_token) == pytest.approx((31.0, 1.0, 5.0))
    # one-logit points move alike (a catch-up of many tokens waits on the arithmetic)
    prefill, ratio = CostCurve(fast.ms, fast.spread, prefill={128: {64: 250.0}}), 49.0 / 31.0
    assert prefill.prefill_ms(64, 128, ratio) == pytest.approx(250.0)
    assert prefill.prefill_ms(1, 128, ratio) == pytest.approx(slow.forward_ms(1, 128))


def test_rounds_the_memory_split_are_brought_to_one_machine_state():
    """Memory that turned slow (1.6×) within a measurement, after three rounds for small k but after one for larger k:
    the plain medians mix the phases across k (fast to k = 4, slow beyond). Each sample brought to the fastest machine
    state of the measurement, as the one-token forward timed beside it says, gives the fast phase's curve."""
    fast, slow = two_bound_curve(1.0), two_bound_curve(1.6)
    samples, one_token, ms = {}, {}, {}
    for c, row in fast.ms.items():
        states = {k: [1.0] * (3 if k <= 4 else 1) + [1.6] * (2 if k <= 4 else 4) for k in row}
        phase = {1.0: fast, 1.6: slow}
        samples[c] = {k: [phase[m].ms[c][k] for m in states[k]] for k in row}
        one_token[c] = {k: [phase[m].ms[c][1] for m in states[k]] for k in row}
        ms[c] = {k: sorted(times)[2] for k, times in samples[c].items()}
    spread = {c: {k: (min(t), max(t)) for k, t in row.items()} for c, row in samples.items()}
    mixed = CostCurve(ms, spread, samples)
    steady = CostCurve(ms, spread, samples, one_token=one_token)
    for c in ms:
        assert mixed.forward_ms(4, c) == fast.ms[c][4] and mixed.forward_ms(6, c) == slow.ms[c][6]
        for k in ms[c]:
            assert steady.forward_ms(k, c) == pytest.approx(fast.ms[c][k], rel=0.005)
    assert steady.ms == ms and CostCurve.from_json(steady.to_json()) == steady


def counted_measurements(monkeypatch) -> list[list[str]]:
    """The names of the models each measurement of curves takes in (kept short: small ks and contexts)."""
    calls = []
    real = cost_module.measure_cost_curves

    def counting(models, *args, **kwargs):
        calls.append([model.name for model in models])
        return real(models, ks=(1, 2, 4), contexts=(16, 32), repeats=1, prefill_ks=(8,))

    monkeypatch.setattr(cost_module, "measure_cost_curves", counting)
    return calls


def test_llm_measures_once_then_reads_the_machine_cache(tiny_qwen, monkeypatch):
    calls = counted_measurements(monkeypatch)
    llm = LLM(str(tiny_qwen), quantization=None, max_model_len=128)
    first = llm.cost_curve()
    assert sorted(first.ms) == [16, 32] and sorted(first.ms[16]) == [1, 2, 4]
    assert all(v > 0 for row in first.ms.values() for v in row.values())
    assert sorted(first.prefill) == [16, 32] and all(list(row) == [8] and row[8] > 0 for row in first.prefill.values())
    # a one-token forward timed beside each sample
    beside = {c: {k: len(t) for k, t in row.items()} for c, row in first.one_token.items()}
    assert beside == {c: {1: 1, 2: 1, 4: 1} for c in (16, 32)}
    assert all(t > 0 for row in first.one_token.values() for times in row.values() for t in times)
    again = LLM(str(tiny_qwen), quantization=None, max_model_len=128).cost_curve()
    assert again == first and len(calls) == 1
    int8 = LLM(str(tiny_qwen), max_model_len=128, quantization="int8").cost_curve()  # another format: measured
    assert len(calls) == 2 and int8 != first
    llm.cost_curve(refresh=True)
    assert len(calls) == 3


def test_a_target_and_its_draft_are_measured_together(tiny_qwen, tmp_path, monkeypatch):
    """Curves measured apart (the memory may have run at another speed) are measured again together, then read; the
    target's curve measured again alone (the cost-curve bench does) makes the pair's be measured again."""
    calls = counted_measurements(monkeypatch)
    target, draft = load_decoder(tiny_qwen), load_decoder(tiny_qwen, quantization="int8")
    [alone] = cost_module.cached_cost_curves([target], tmp_path)
    cost_module.cached_cost_curves([draft], tmp_path)
    assert calls == [[target.name], [draft.name]]
    pair = cost_module.cached_cost_curves([target, draft], tmp_path)
    assert calls[2:] == [[target.name, draft.name]]
    assert pair[0].session == pair[1].session != alone.session and pair[0] != pair[1]
    assert cost_module.cached_cost_curves([target, draft], tmp_path) == pair and len(calls) == 3
    assert cost_module.cached_cost_curves([draft], tmp_path) == [pair[1]] and len(calls) == 3
    cost_module.cached_cost_curves([target], tmp_path, refresh=True)
    cost_module.cached_cost_curves([target, draft], tmp_path)
    assert len(calls) == 5 and calls[4] == [target.name, draft.name]
    # a model drafting for itself is measured once
    assert len({c.session for c in cost_module.cached_cost_curves([draft, draft], tmp_path, refresh=True)}) == 1
    assert calls[5] == [draft.name]


def test_work_accounting_and_roofline(tiny_qwen):
    f32, int8 = ForwardWork.of(load_decoder(tiny_qwen)), ForwardWork.of(load_decoder(tiny_qwen, quantization="int8"))
    assert f32.linear_macs_per_token == int8.linear_macs_per_token
    assert not f32.int8 and int8.int8
    # int8 stores one byte per weight plus a float scale per output channel
    assert f32.weight_bytes / 4 < int8.weight_bytes < f32.weight_bytes / 3
    ceilings = Ceilings(read_bytes_per_s=1e9, fp32_macs_per_s=1e9, int8_macs_per_s=4e9, readers={})
    read_bound = 1000 * (f32.weight_bytes + 10 * f32.kv_bytes_per_position) / 1e9
    compute = 1000 * 9 * (f32.linear_macs_per_token + 10 * f32.attention_macs_per_position) / 1e9
    assert f32.roofline_ms(1, 9, ceilings) == pytest.approx(max(read_bound, 1000 * (f32.linear_macs_per_token + 10 * f32.attention_macs_per_position) / 1e9))
    assert f32.roofline_ms(9, 1, ceilings) == pytest.approx(max(read_bound, compute))
    assert int8.roofline_ms(64, 0, ceilings) < f32.roofline_ms(64, 0, ceilings)


def test_cache_path_is_per_machine_and_model(tmp_path):
    a, b = cost_curve_path(tmp_path, "m-int8"), cost_curve_path(tmp_path, "m/float32")
    assert a.parent == b.parent and a != b and a.parent.parent == tmp_path / "cost"
