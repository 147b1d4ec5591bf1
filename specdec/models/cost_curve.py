"""The measured cost of a forward over k new tokens, v(k), kept per machine for the engine.

Speculation pays only where verifying γ+1 tokens costs little more than one; how much more is
a property of the machine, the model and its weight format, so it is measured (once, tens of
seconds) and cached under `$SPECDEC_CACHE/cost/<machine>/`, where the adaptive controller reads it.
A target's and its draft model's curves are measured together: the controller weighs one against the
other, and this machine's memory runs at ~35 or ~60 GB/s for minutes at a time, so two curves measured
apart can put the draft at 0.48 of a target forward instead of ~0.26 (it then never speculated).

The same drift moves a curve's points unevenly: slower memory lengthens the weight stream, which a forward over a
few tokens waits on, not the arithmetic of one over many. So a curve is priced on a machine running `machine` times
its one-token forward as measured by a two-line model (`BoundLines`), not by scaling every point; and each timed
forward is followed by a one-token forward, which says how fast the machine ran for it, so that the rounds of a
measurement that the memory split are brought to one machine state before their median is taken.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.kv_cache import KVCache
from specdec.models import kernels
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.decoder import Decoder

# up to 32: verification; 64 and 256: catch-up and prefill (per token they cost far more than the slope of the
# small-k end suggests)
DEFAULT_KS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 256)
# where a forward is also timed with logits at its last row only, as a draft model's catch-up computes them: the
# 0.5B's output layer is ~28% of its multiply-adds per row, so its int4 catch-up on a 534-token prompt, priced from
# the every-row curve, came to 1090 ms against 711–817 measured (724 from these points)
PREFILL_KS = (64, 256)
CURVE_VERSION = 50  # in the cache file's name: curves measured over other ks or with older kernels are measured again
DEFAULT_CONTEXTS = (128, 1024)


@dataclass(frozen=True)
class CostCurve:
    """Median ms per forward: `ms[context][k]` (keys as measured, logits at every row), with (min, max) spreads and,
    where kept, every round's time (`samples[context][k][round]`); `session` names the measurement, shared by curves
    measured together; `prefill[context][k]`: the median with logits at the last row only, where measured;
    `one_token[context][k][round]`: a one-token forward timed right after each sample, where measured.

    Prices come from the medians, monotone, and where `one_token` was measured from the medians of the samples each
    brought to the fastest machine state of the measurement (`steady_medians`)."""

    ms: dict[int, dict[int, float]]
    spread: dict[int, dict[int, tuple[float, float]]]
    samples: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    session: str = ""
    prefill: dict[int, dict[int, float]] = field(default_factory=dict)
    one_token: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    _rising: dict[int, dict[int, float]] = field(init=False, repr=False, compare=False)  # steady medians, monotone
    _prefill_rising: dict[int, dict[int, float]] = field(init=False, repr=False, compare=False)
    _lines: dict[int, "BoundLines"] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rising = {c: monotone(steady_medians(row, self.samples.get(c, {}), self.one_token.get(c, {})))
                  for c, row in self.ms.items()}
        object.__setattr__(self, "_rising", rising)
        object.__setattr__(self, "_lines", {c: BoundLines.fit(row) for c, row in rising.items()})
        # at k = 1 the one logit is every row's (the sweep's smallest k stands in where 1 was not measured)
        object.__setattr__(self, "_prefill_rising", {c: monotone({1: rising[c][min(rising[c])], **row})
                                                     for c, row in self.prefill.items() if c in rising})

    @property
    def contexts(self) -> list[int]:
        return sorted(self.ms)

    def forward_ms(self, k: int, context: int, machine: float = 1.0) -> float:
        """Interpolated linearly in k and in context (clamped to the measured contexts). A forward over more
        tokens never costs less: each measured point is lowered to the smallest one at a larger k (`monotone`).
        `machine`: a one-token forward now takes `machine` times its measured time; the point moves as its
        `BoundLines` say."""
        _checked(k)
        return self._across_contexts(
            context, lambda c: _interpolate(self._rising[c], k) * self._lines[c].drift(k, machine))

    def prefill_ms(self, k: int, context: int, machine: float = 1.0) -> float:
        """A forward over k new tokens with logits at the last one only (a draft model catching up on a prompt or on
        skipped tokens): the measured one-logit points and k = 1, interpolated as `forward_ms`, never above it;
        `forward_ms` at a context measured without them."""

        def at(c: int) -> float:
            every_row = _interpolate(self._rising[c], _checked(k))
            if c in self._prefill_rising:
                every_row = min(every_row, _interpolate(self._prefill_rising[c], k))
            return every_row * self._lines[c].drift(k, machine)

        return self._across_contexts(context, at)

    def _across_contexts(self, context: int, at: Callable[[int], float]) -> float:
        """`at` a measured context, interpolated linearly between the two around `context` (clamped to them)."""
        contexts = self.contexts
        context = min(max(context, contexts[0]), contexts[-1])
        upper = next(c for c in contexts if c >= context)
        lower = max((c for c in contexts if c <= context), default=upper)
        at_lower = at(lower)
        if upper == lower:
            return at_lower
        return at_lower + (at(upper) - at_lower) * (context - lower) / (upper - lower)

    def relative(self, k: int, context: int) -> float:
        """v(k) = cost(k) / cost(1) at that context."""
        return self.forward_ms(k, context) / self.forward_ms(1, context)

    def to_json(self) -> dict:
        return {"ms": self.ms, "spread": self.spread, "samples": self.samples, "session": self.session,
                "prefill": self.prefill, "one_token": self.one_token}

    @classmethod
    def from_json(cls, data: dict) -> "CostCurve":
        return cls(
            ms={int(c): {int(k): float(v) for k, v in row.items()} for c, row in data["ms"].items()},
            spread={int(c): {int(k): tuple(v) for k, v in row.items()} for c, row in data["spread"].items()},
            samples={int(c): {int(k): list(v) for k, v in row.items()} for c, row in data.get("samples", {}).items()},
            session=data.get("session", ""),
            prefill={int(c): {int(k): float(v) for k, v in row.items()} for c, row in data.get("prefill", {}).items()},
            one_token={int(c): {int(k): list(v) for k, v in row.items()} for c, row in data.get("one_token", {}).items()},
        )


STREAM_MARGIN = 1.3  # a point this far above `BoundLines`' compute line is taken to wait on the stream


@dataclass(frozen=True)
class BoundLines:
    """A curve's two bounds at one context, fitted to its points: a forward over k tokens waits on the weight stream,
    `stream(k) = first + per_token · (k − 1)` (the one-token forward and what each more token adds while the stream
    hides most of the arithmetic), or on the arithmetic, `compute(k) = compute_per_token · k` (the cheapest ms per
    token of the points at k ≥ 32, where every machine state here computes). On a machine whose one-token forward
    takes `machine` × `first`, memory is what changed: the stream bound moves by (machine − 1) · `first`, the
    compute bound stays, and a point moves as the larger of the two.
    Measured on the 1.5B (the cost-curve bench's forwards, each with its read bandwidth probed beside it, split at
    45 GB/s, context 128): priced from the points measured in the other phase, k = 2–32, this is off by 5.2% on
    average, scaling every point by the one-token ratio by 23% (int8 k = 12, fast to slow memory: 61 ms measured, 66
    against 94; float32 k = 12, 185 ms: 200 against 294)."""

    first: float
    per_token: float
    compute_per_token: float

    @classmethod
    def fit(cls, row: dict[int, float], first: float | None = None) -> "BoundLines":
        """`first`: the one-token forward's time, where known better than the row's first point."""
        ks = sorted(row)
        first = row[ks[0]] if first is None else first  # the smallest k stands in for k = 1
        large = [k for k in ks if k >= 32] or ks[-1:]
        compute_per_token = min(row[k] / k for k in large)
        # the points well above the compute line wait on the stream: its slope through the first point, least squares
        streaming = [k for k in ks[1:] if row[k] > STREAM_MARGIN * compute_per_token * k]
        if not streaming:
            return cls(first, 0.0, compute_per_token)
        slope = sum((row[k] - first) * (k - 1) for k in streaming) / sum((k - 1) ** 2 for k in streaming)
        return cls(first, max(0.0, slope), compute_per_token)

    def drift(self, k: int, machine: float) -> float:
        """A forward over k tokens now ÷ as measured."""
        if machine == 1.0:
            return 1.0
        stream, compute = self.first + self.per_token * (k - 1), self.compute_per_token * k
        return max(stream + (machine - 1.0) * self.first, compute) / max(stream, compute)


def steady_medians(
    medians: dict[int, float], samples: dict[int, list[float]], one_token: dict[int, list[float]]
) -> dict[int, float]:
    """Each k's median over its samples, each sample first brought to the fastest machine state of the measurement
    (the 10th percentile of its one-token forwards, so that one stray fast forward does not set it): a sample whose
    one-token forward took `machine` × that ran on a machine `machine` times slower, and is divided by the drift its
    point has there (`BoundLines`). The medians as they are where a point lacks one-token forwards.
    Measured: this machine's memory switched within one measurement of the int8 1.5B (one-token forwards of 32–35 ms
    in three rounds, 54–60 ms in two), and the plain medians mixed the phases across k (context 1024: k = 1 35.4 ms,
    fast; k = 8 66.3, slow). The default pair measured three times a minute apart (int8 1.5B, int4 0.5B): by the plain
    medians the target's k = 1 took 31.0, 51.2 and 30.8 ms at context 128 and 33.6, 51.9 and 53.0 at 1024, the draft's
    k = 1 ÷ the target's varied by 25% and 12% between runs, each v(k) = t(k) ÷ t(1), k = 2–16, by 26% on average (at
    most 64%); steady, 30.3, 30.5, 30.0 and 30.5, 29.6, 33.6 ms, 1.3% and 1.2%, 10% (at most 21%). Brought to the
    median state instead, the draft's ratio varied by 36% and 30%."""
    beside_all = sorted(t for k in medians for t in one_token.get(k, []))
    if not beside_all:
        return medians
    reference, steady = beside_all[(len(beside_all) - 1) // 10], dict(medians)
    for _ in range(4):  # the bounds fitted to the mixed medians, then again to the steadier ones
        lines = BoundLines.fit(monotone(steady), first=reference)
        for k, times in samples.items():
            beside = one_token.get(k, [])
            if times and len(beside) == len(times):
                steady[k] = statistics.median(t / lines.drift(k, one / reference) for t, one in zip(times, beside))
    return steady


def _checked(k: int) -> int:
    if k < 1:
        raise ValueError(f"a forward has at least one new token, got k={k}")
    return k


def _interpolate(row: dict[int, float], k: int) -> float:
    ks = sorted(row)
    if k in row:
        return row[k]
    if k > ks[-1]:  # beyond the sweep: extend the last segment's slope
        a, b = ks[-2], ks[-1]
        return row[b] + (row[b] - row[a]) * (k - b) / (b - a)
    b = next(x for x in ks if x > k)
    a = max(x for x in ks if x < k)
    return row[a] + (row[b] - row[a]) * (k - a) / (b - a)


def monotone(row: dict[int, float]) -> dict[int, float]:
    """Each value lowered to the smallest one at a larger key (the running minimum from the largest key down), so the
    curve never falls with k (medians dip by a few percent, e.g. k = 4 below k = 3, and a controller would chase the
    dip). Lowered, not raised: noise here only slows a forward, so a point above the ones after it is the one to
    distrust. Raising to the running maximum once priced every draft step of the 0.5B at its k = 1 median of 27.7 ms
    (13.0 in the run before, 17.9–19.3 at k = 2–8 in the same run), and the controller never speculated."""
    out, low = {}, float("inf")
    for k in sorted(row, reverse=True):
        low = min(low, row[k])
        out[k] = low
    return dict(sorted(out.items()))


@torch.inference_mode()
def measure_cost_curves(
    models: Sequence[Decoder],
    ks: tuple[int, ...] = DEFAULT_KS,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    repeats: int = 5,
    after_round: Callable[[], object] | None = None,
    after_forward: Callable[[int, int], object] | None = None,
    prefill_ks: tuple[int, ...] = PREFILL_KS,
) -> list[CostCurve]:
    """Each model's curve: forwards over k new tokens (logits at every row, as verification needs) after a cached
    context, timed, each followed by a timed one-token forward (`CostCurve.one_token`); at `prefill_ks` also with
    logits at the last row only (`CostCurve.prefill`). Each round sweeps
    every (context, k) in turn, each point over every model in turn, so that machine noise (memory bandwidth here
    drifts by tens of percent over minutes) spreads over the whole curve, not one point, and over the models alike,
    whose ratio the adaptive controller weighs.
    `after_round` runs after each measured round and `after_forward(context, k)` after each timed forward,
    outside the timing (the bench measures the machine's ceilings there, so each time has ceilings taken beside it)."""
    g = torch.Generator().manual_seed(0)
    caches, slots = [], []
    for model in models:
        caches.append(cache := model.new_kv_cache(len(contexts), max(contexts) + max(ks + prefill_ks)))
        slots.append(model_slots := {})
        for context in contexts:
            model_slots[context] = slot = cache.allocate()
            prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
            for start in range(0, context, 512):
                chunk = prompt[start : start + 512]
                model.forward(ForwardBatch.build([SequenceInput(slot, chunk, num_logits=1)], [start]), cache)
    times = [{c: {k: [] for k in ks} for c in contexts} for _ in models]
    one_token = [{c: {k: [] for k in ks} for c in contexts} for _ in models]
    prefill_times = [{c: {k: [] for k in prefill_ks} for c in contexts} for _ in models]

    def timed(model: Decoder, cache: KVCache, slot: int, context: int, k: int, num_logits: int) -> float:
        tokens = torch.randint(0, model.config.vocab_size, (k,), generator=g).tolist()
        batch = ForwardBatch.build([SequenceInput(slot, tokens, num_logits=num_logits)], [context])
        start = time.perf_counter()
        model.forward(batch, cache)
        elapsed = (time.perf_counter() - start) * 1000
        cache.truncate(slot, context)
        return elapsed

    for round_ in range(repeats + 1):  # round 0 warms up each shape
        for context in contexts:
            for k in ks:
                for model, cache, model_slots, model_times, model_one in zip(models, caches, slots, times, one_token):
                    elapsed = timed(model, cache, model_slots[context], context, k, k)
                    if round_ and after_forward is not None:
                        after_forward(context, k)
                    beside = timed(model, cache, model_slots[context], context, 1, 1)  # how fast the machine ran
                    if round_:
                        model_times[context][k].append(elapsed)
                        model_one[context][k].append(beside)
            for k in prefill_ks:
                for model, cache, model_slots, model_times in zip(models, caches, slots, prefill_times):
                    elapsed = timed(model, cache, model_slots[context], context, k, 1)
                    if round_:
                        model_times[context][k].append(elapsed)
        if round_ and after_round is not None:
            after_round()
    session = uuid.uuid4().hex
    return [
        CostCurve(
            {c: {k: statistics.median(t) for k, t in row.items()} for c, row in model_times.items()},
            {c: {k: (min(t), max(t)) for k, t in row.items()} for c, row in model_times.items()},
            model_times,
            session,
            {c: {k: statistics.median(t) for k, t in row.items()} for c, row in model_prefill.items()},
            model_one,
        )
        for model_times, model_prefill, model_one in zip(times, prefill_times, one_token)
    ]


def machine_fingerprint(device: torch.device | str = "cpu") -> str:
    """What the curve depends on besides the model: CPU, threads, torch build and kernels' instruction sets, and the
    GPU if it runs on one."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")), cpu)
    isas = "+".join(["amx"] * kernels.int8_amx() + [isa.name for isa in kernels.runnable_isas()])
    parts = (cpu, os.cpu_count(), torch.get_num_threads(), torch.__version__, torch.backends.cpu.get_cpu_capability(), isas)
    key = "|".join(map(str, parts))
    if torch.device(device).type == "cuda":
        key += f"|{torch.cuda.get_device_name(device)}|{torch.version.cuda}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def cost_curve_path(cache_dir: Path, model_key: str, device: torch.device | str = "cpu") -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model_key)
    return cache_dir / "cost" / machine_fingerprint(device) / f"{safe}.v{CURVE_VERSION}.json"


def save_cost_curve(path: Path, curve: CostCurve) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(curve.to_json()))
    tmp.replace(path)


def cached_cost_curves(models: Sequence[Decoder], cache_dir: Path, refresh: bool = False) -> list[CostCurve]:
    """The curve of each model and format (`model.name`) on this machine: read from the cache if they were measured
    together, else measured together once (a target and its draft model: the controller weighs their ratio)."""
    paths = [cost_curve_path(cache_dir, model.name, model.device) for model in models]
    if not refresh and all(path.exists() for path in paths):
        curves = [CostCurve.from_json(json.loads(path.read_text())) for path in paths]
        if len({curve.session for curve in curves}) == 1:
            return curves
    unique = dict(zip(paths, models))  # a model drafting for itself is measured once
    measured = dict(zip(unique, measure_cost_curves(list(unique.values()))))
    for path, curve in measured.items():
        save_cost_curve(path, curve)
    return [measured[path] for path in paths]
