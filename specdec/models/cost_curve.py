"""The measured cost of a forward over k new tokens, v(k), kept per machine for the engine.

Speculation pays only where verifying γ+1 tokens costs little more than one; how much more is
a property of the machine, the model and its weight format, so it is measured (once, tens of
seconds) and cached under `$SPECDEC_CACHE/cost/<machine>/`, where the adaptive controller reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.models import kernels
from specdec.models.batch import ForwardBatch, SequenceInput
from specdec.models.decoder import Decoder

# up to 32: verification; 64 and 256: catch-up and prefill (a draft model's prefill of the prompt is
# priced from them: per token it costs far more than the slope of the small-k end suggests)
DEFAULT_KS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 256)
CURVE_VERSION = 37  # in the cache file's name: curves measured over other ks or with older kernels are measured again
DEFAULT_CONTEXTS = (128, 1024)


@dataclass(frozen=True)
class CostCurve:
    """Median ms per forward: `ms[context][k]` (keys as measured), with (min, max) spreads and, where kept, every
    round's time (`samples[context][k][round]`)."""

    ms: dict[int, dict[int, float]]
    spread: dict[int, dict[int, tuple[float, float]]]
    samples: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    _rising: dict[int, dict[int, float]] = field(init=False, repr=False, compare=False)  # `ms`, made monotone

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rising", {c: monotone(row) for c, row in self.ms.items()})

    @property
    def contexts(self) -> list[int]:
        return sorted(self.ms)

    def forward_ms(self, k: int, context: int) -> float:
        """Interpolated linearly in k and in context (clamped to the measured contexts). A forward over more
        tokens never costs less: each measured point is lowered to the smallest one at a larger k (`monotone`)."""
        if k < 1:
            raise ValueError(f"a forward has at least one new token, got k={k}")
        contexts = self.contexts
        context = min(max(context, contexts[0]), contexts[-1])
        upper = next(c for c in contexts if c >= context)
        lower = max((c for c in contexts if c <= context), default=upper)
        at_lower, at_upper = _interpolate(self._rising[lower], k), _interpolate(self._rising[upper], k)
        if upper == lower:
            return at_lower
        return at_lower + (at_upper - at_lower) * (context - lower) / (upper - lower)

    def relative(self, k: int, context: int) -> float:
        """v(k) = cost(k) / cost(1) at that context."""
        return self.forward_ms(k, context) / self.forward_ms(1, context)

    def to_json(self) -> dict:
        return {"ms": self.ms, "spread": self.spread, "samples": self.samples}

    @classmethod
    def from_json(cls, data: dict) -> "CostCurve":
        return cls(
            ms={int(c): {int(k): float(v) for k, v in row.items()} for c, row in data["ms"].items()},
            spread={int(c): {int(k): tuple(v) for k, v in row.items()} for c, row in data["spread"].items()},
            samples={int(c): {int(k): list(v) for k, v in row.items()} for c, row in data.get("samples", {}).items()},
        )


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
def measure_cost_curve(
    model: Decoder,
    ks: tuple[int, ...] = DEFAULT_KS,
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    repeats: int = 5,
    after_round: Callable[[], object] | None = None,
    after_forward: Callable[[int, int], object] | None = None,
) -> CostCurve:
    """Time forwards over k new tokens (logits at every row, as verification needs) after a cached
    context. Each round sweeps every (context, k) in turn, so that machine noise (memory bandwidth
    here drifts by tens of percent over minutes) spreads over the whole curve, not one point.
    `after_round` runs after each measured round and `after_forward(context, k)` after each timed forward of one,
    outside the timing (the bench measures the machine's ceilings there, so each time has ceilings taken beside it)."""
    g = torch.Generator().manual_seed(0)
    cache = model.new_kv_cache(len(contexts), max(contexts) + max(ks))
    slots = {}
    for context in contexts:
        slots[context] = slot = cache.allocate()
        prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
        for start in range(0, context, 512):
            chunk = prompt[start : start + 512]
            model.forward(ForwardBatch.build([SequenceInput(slot, chunk, num_logits=1)], [start]), cache)
    times: dict[int, dict[int, list[float]]] = {c: {k: [] for k in ks} for c in contexts}
    for round_ in range(repeats + 1):  # round 0 warms up each shape
        for context in contexts:
            for k in ks:
                tokens = torch.randint(0, model.config.vocab_size, (k,), generator=g).tolist()
                batch = ForwardBatch.build([SequenceInput(slots[context], tokens, num_logits=k)], [context])
                start = time.perf_counter()
                model.forward(batch, cache)
                elapsed = (time.perf_counter() - start) * 1000
                cache.truncate(slots[context], context)
                if round_:
                    times[context][k].append(elapsed)
                    if after_forward is not None:
                        after_forward(context, k)
        if round_ and after_round is not None:
            after_round()
    ms = {c: {k: statistics.median(t) for k, t in row.items()} for c, row in times.items()}
    spread = {c: {k: (min(t), max(t)) for k, t in row.items()} for c, row in times.items()}
    return CostCurve(ms, spread, times)


def machine_fingerprint(device: torch.device | str = "cpu") -> str:
    """What the curve depends on besides the model: CPU, threads, torch build and kernels' instruction sets, and the
    GPU if it runs on one."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")), cpu)
    isas = "+".join(isa.name for isa in kernels.runnable_isas())
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


def cached_cost_curve(model: Decoder, cache_dir: Path, refresh: bool = False) -> CostCurve:
    """The curve for this model and format (`model.name`) on this machine: read from the cache, or
    measured once."""
    path = cost_curve_path(cache_dir, model.name, model.device)
    if path.exists() and not refresh:
        return CostCurve.from_json(json.loads(path.read_text()))
    curve = measure_cost_curve(model)
    save_cost_curve(path, curve)
    return curve
