"""From measured cells to the numbers a report shows: speedups, acceptance, tails, and the two
analytical predictions of the speedup beside the measured one.

  seeds'      (1 − α^(γ+1)) / ((1 − α)(γc + 1))       — verifying γ + 1 tokens costs one step
  cost-aware  tokens / Σ steps (v(k) + drafted · c)  — with the measured cost curve v(k) = cost(k) / cost(1);
              E[L] / (γc + v(γ+1)) when every step drafts γ tokens, and it counts the plain steps of
              proposers that draft only where they find something (n-gram, suffix)

c is the measured drafting time per drafted token over the target's one-token forward; α is the
per-token acceptance that gives the measured mean accepted length (metrics.alpha_from_mean_length).
efficiency = measured speedup ÷ cost-aware prediction: what the engine loses beyond its cost curve.

modeled speedup: the run's own step counts priced by the measured cost curves — every step's target
forward over its γ + 1 tokens, every draft-model forward at the draft's one-token cost plus its
catch-up tokens (prompt prefill, skipped tokens) at its cost per token of a mean prompt's prefill — against one
target forward per token for plain decoding. It judges γ schedules without the wall clock's noise
(±50% here under load); the wall-clock speedup confirms it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from specdec.bench.cells import EngineSetup
from specdec.metrics import SpecStats, expected_length
from specdec.models.cost_curve import monotone


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of the values; None if there are none."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    position = (len(data) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return data[low] + (data[high] - data[low]) * (position - low)


def seeds_speedup(alpha: float, gamma: float, c: float) -> float:
    return expected_length(alpha, gamma) / (gamma * c + 1)


def cost_aware_speedup(tokens: int, forwards: int, spec_steps: int, drafted: int, c: float, v: dict[int, float],
                       verified: int | None = None) -> float:
    """Plain decoding's cost (one forward per token) over the speculative run's: its plain steps,
    plus each speculative step's forward over its verified drafts + 1 tokens (a tree's nodes; default the
    drafts) and its drafting."""
    gamma = drafted / spec_steps if spec_steps else 0.0
    rows = (drafted if verified is None else verified) / spec_steps if spec_steps else 0.0
    cost = (forwards - spec_steps) + spec_steps * (_interpolate(v, rows + 1) + gamma * c)
    return tokens / cost if cost else float("nan")


def _interpolate(v: dict[int, float], k: float) -> float:
    ks = sorted(v)
    k = min(max(k, ks[0]), ks[-1])
    low = max(x for x in ks if x <= k)
    high = min(x for x in ks if x >= k)
    return v[low] if high == low else v[low] + (v[high] - v[low]) * (k - low) / (high - low)


def modeled_speedup(tokens: int, verified_histogram: list[int], draft_forwards: int, draft_tokens_fed: int,
                    cost: dict[str, Any]) -> float:
    """Plain decoding's modeled time (one forward per token) ÷ this run's: Σ_k steps(k) · v(k + 1) over the steps
    that verified k draft tokens (a chain's γ, a tree's nodes), plus
    the draft model's forwards at draft_ms(1) and the extra tokens of its catch-ups (its prefill of each
    prompt, its catch-up after plain steps) at the draft curve's cost per extra token, all ÷ target_ms(1)."""
    v = monotone({int(k): x for k, x in cost["v"].items()})  # as the controller reads the curve
    draft_ms = draft_forwards * cost.get("draft_ms_k1", 0.0)
    draft_ms += (draft_tokens_fed - draft_forwards) * cost.get("draft_ms_per_extra_token", 0.0)
    units = sum(n * _interpolate(v, k + 1) for k, n in enumerate(verified_histogram))
    units += draft_ms / cost["target_ms_k1"]
    return tokens / units if units else float("nan")


@dataclass
class CellRow:
    label: str
    engine: str
    method: str
    gamma: int
    dataset: str
    temperature: float
    tok_per_s: tuple[float, float, float]  # median, min, max over passes
    speedup: float | None = None  # ÷ plain decoding of the same engine, same dataset and temperature
    ttft_s: dict[str, float | None] = field(default_factory=dict)  # p50/p95/p99 over requests and passes
    tpot_s: dict[str, float | None] = field(default_factory=dict)
    forwards_per_token: float | None = None
    tests_passed: float | None = None  # the quality set: share of completions whose code passes its tests
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    alpha: float | None = None
    per_position: list[float] = field(default_factory=list)  # P(position i accepted | drafted), per position
    time_split_s: dict[str, float] = field(default_factory=dict)  # draft / verify / other, per token
    c: float | None = None
    predicted_seeds: float | None = None
    predicted_cost_aware: float | None = None
    efficiency: float | None = None
    schedule: str = ""  # how γ was chosen: fixed / adaptive / heuristic ("" for plain and peers)
    gamma_histogram: list[int] = field(default_factory=list)  # steps per verified γ (0: plain steps)
    modeled_speedup: float | None = None  # step counts × measured cost curves, ÷ plain (1.0 for plain itself)


def cell_row(cell: dict[str, Any]) -> CellRow:
    setup, workload = cell["setup"], cell["workload"]
    speeds = [p["tok_per_s"] for p in cell["passes"]]
    requests = [r for p in cell["passes"] for r in p["requests"]]
    engine_setup = EngineSetup(**setup)
    gamma = engine_setup.gamma
    row = CellRow(
        label=cell["label"], engine=setup["engine"], method=engine_setup.method, gamma=gamma,
        schedule=engine_setup.schedule,
        dataset=workload["dataset"], temperature=workload["temperature"],
        tok_per_s=(statistics.median(speeds), min(speeds), max(speeds)),
        ttft_s=_tails([r["ttft_s"] for r in requests]), tpot_s=_tails([r["tpot_s"] for r in requests]),
    )
    tokens = sum(len(r["tokens"]) for r in requests)
    checked = [r["passed"] for r in cell["passes"][-1]["requests"] if "passed" in r]
    row.tests_passed = sum(checked) / len(checked) if checked else None
    if requests and requests[0]["target_forwards"] is not None:
        forwards = sum(r["target_forwards"] for r in requests)
        row.forwards_per_token = forwards / tokens
    if setup["engine"] == "specdec" and not engine_setup.speculative_config:
        row.modeled_speedup = 1.0
    stats = [r["speculative"] for r in requests if r["speculative"]]
    if not stats:
        return row
    total = SpecStats()
    for s in stats:
        total = total.merged(SpecStats.from_summary(s))
    summary = total.summary()
    row.gamma_histogram = summary["gamma_histogram"]
    if row.gamma_histogram:
        # verify forwards priced by the draft tokens they took in (a tree's nodes; cells from before trees: γ)
        verified = summary.get("verified_histogram") or row.gamma_histogram
        row.modeled_speedup = modeled_speedup(tokens, verified, total.num_draft_forwards,
                                              total.num_draft_tokens_fed, cell["cost"])
    if not total.num_spec_steps:
        return row
    row.acceptance_rate = summary["draft_acceptance_rate"]
    row.mean_accepted_length = summary["mean_acceptance_length"]
    row.alpha = summary["alpha"]
    row.per_position = summary["per_position_acceptance"]
    wall = sum(r["e2e_s"] for r in requests)
    row.time_split_s = {"draft": total.draft_time_s / tokens, "verify": total.verify_time_s / tokens,
                        "other": max(0.0, wall - total.draft_time_s - total.verify_time_s) / tokens}
    cost = cell["cost"]
    row.c = total.draft_time_s / total.num_draft_tokens / (cost["target_ms_k1"] / 1000)
    v = {int(k): x for k, x in cost["v"].items()}
    row.predicted_seeds = seeds_speedup(row.alpha, gamma, row.c)
    verified = sum(k * n for k, n in enumerate(total.verified_histogram)) or None  # (cells from before trees: None)
    row.predicted_cost_aware = cost_aware_speedup(tokens, forwards, total.num_spec_steps, total.num_draft_tokens, row.c, v,
                                                  verified)
    return row


def _tails(values: list[float | None]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 95, 99)}


def with_speedups(rows: list[CellRow]) -> list[CellRow]:
    """Fill speedup (÷ the same engine's plain row for the dataset and temperature) and efficiency."""
    plain = {(r.engine, r.dataset, r.temperature): r for r in rows if r.method == "none"}
    for r in rows:
        base = plain.get((r.engine, r.dataset, r.temperature))
        if base is not None:
            r.speedup = r.tok_per_s[0] / base.tok_per_s[0]
            if r.predicted_cost_aware:
                r.efficiency = r.speedup / r.predicted_cost_aware
    return rows
