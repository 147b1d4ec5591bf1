"""The sweep's Markdown: a speedup matrix per temperature, then every cell with its metrics."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from specdec.bench.analysis import CellRow
from specdec.bench.dataset import dataset_label
from specdec.bench.report import environment_line


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def sweep_report(rows: list[CellRow], args: argparse.Namespace, argv: Sequence[str], plots: list[Path]) -> str:
    datasets = list(dict.fromkeys(r.dataset for r in rows))
    temperatures = sorted({r.temperature for r in rows})
    labels = list(dict.fromkeys(r.label for r in rows))
    lines = [
        f"## Sweep: method × γ × temperature × dataset, {Path(args.model).name}",
        "",
        f"Command: `specdec bench sweep {' '.join(argv)}`  ",
        f"{args.num_prompts} prompts per dataset × {args.max_tokens} new tokens (EOS ignored), batch 1, "
        f"{args.threads} threads, seeded sampling per prompt ({args.seeds} seed(s) per prompt at T > 0), "
        f"{args.repeat} timed pass(es) after a warm-up; each engine "
        f"setup in its own subprocess; transformers peers in float32. Speedup = tok/s ÷ the same engine's plain "
        f"decoding on the same dataset and temperature; ngram with prompt_lookup_min/max = "
        f"{args.prompt_lookup[0]}/{args.prompt_lookup[1]}. {environment_line()}",
    ]
    for temperature in temperatures:
        lines += ["", f"### Speedup over plain decoding, temperature {temperature:g}", "",
                  "| setup | " + " | ".join(dataset_label(d) for d in datasets) + " |",
                  "|---|" + "---|" * len(datasets)]
        for label in labels:
            cells = {r.dataset: r for r in rows if r.label == label and r.temperature == temperature}
            if cells:
                lines.append(f"| {label} | " + " | ".join(
                    _fmt(cells[d].speedup, ".2f", "×") if d in cells else "—" for d in datasets) + " |")
    lines += schedule_section(rows)
    if not args.no_cell_table:
        lines += [
            "", "### Every cell", "",
            "α: per-token acceptance giving the measured mean accepted length; c: drafting time per drafted token ÷ the "
            "target's one-token forward; predictions: seeds' (1 − α^(γ+1)) / ((1 − α)(γc + 1)) and cost-aware (target "
            "forwards and drafted tokens × the measured cost curve); efficiency = measured ÷ cost-aware; time split in ms "
            "per generated token; TTFT/TPOT percentiles over requests.",
            "",
            "| dataset | T | setup | tok/s | speedup | acceptance | mean accepted length | α | per-position acceptance "
            "| c | predicted seeds' | predicted cost-aware | efficiency | forwards/token | draft / verify / other ms "
            "| TTFT p50/p95/p99 s | TPOT p50/p95/p99 ms | tests passed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            med, low, high = r.tok_per_s
            split = " / ".join(f"{r.time_split_s[k] * 1000:.0f}" for k in ("draft", "verify", "other")) if r.time_split_s else "—"
            positions = " ".join(f"{p:.2f}" for p in r.per_position) if r.per_position else "—"
            ttft = "/".join(_fmt(r.ttft_s.get(q), ".2f") for q in ("p50", "p95", "p99"))
            tpot = "/".join(_fmt(None if r.tpot_s.get(q) is None else r.tpot_s[q] * 1000, ".0f") for q in ("p50", "p95", "p99"))
            lines.append(" | ".join([
                f"| {dataset_label(r.dataset)}", f"{r.temperature:g}", r.label, f"{med:.2f} ({low:.2f}–{high:.2f})",
                _fmt(r.speedup, ".2f", "×"), _fmt(r.acceptance_rate), _fmt(r.mean_accepted_length), _fmt(r.alpha),
                positions, _fmt(r.c, ".3f"), _fmt(r.predicted_seeds, ".2f", "×"), _fmt(r.predicted_cost_aware, ".2f", "×"),
                _fmt(r.efficiency), _fmt(r.forwards_per_token), split, ttft, tpot, _fmt(r.tests_passed, ".0%"),
            ]) + " |")
    if plots:
        lines += ["", "Plots: " + ", ".join(f"`{p.name}`" for p in plots) + f" (in `{plots[0].parent}`)."]
    return "\n".join(lines)


def schedule_section(rows: list[CellRow]) -> list[str]:
    """Adaptive γ against plain, the best fixed γ in hindsight and HF's heuristic, per method × dataset ×
    temperature: modeled speedups (step counts × the measured cost curves), wall-clock ones beside them."""
    adaptive = [r for r in rows if r.schedule == "adaptive"]
    if not adaptive:
        return []
    lines = ["", "### γ schedules: adaptive vs plain, best fixed γ and HF's heuristic", "",
             "Modeled speedup over plain decoding (step counts × measured cost curves; wall-clock speedup in "
             "brackets). Best fixed γ is chosen per cell in hindsight, by modeled speedup.", "",
             "| adaptive setup | dataset | T | adaptive | best fixed γ | heuristic | adaptive ÷ plain | adaptive ÷ best fixed "
             "| adaptive ÷ heuristic | γ steps (0, 1, 2, …) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    worst_plain, worst_fixed, wins = [], [], 0
    for a in adaptive:
        same = [r for r in rows if (r.method, r.dataset, r.temperature) == (a.method, a.dataset, a.temperature)]
        fixed = [r for r in same if r.schedule == "fixed" and r.modeled_speedup is not None]
        best = max(fixed, key=lambda r: r.modeled_speedup, default=None)
        heuristic = next((r for r in same if r.schedule == "heuristic"), None)
        # γ = 0 (plain) is one of the fixed choices
        best_value = max(1.0, best.modeled_speedup) if best else 1.0
        best_text = f"γ={best.gamma} {_both(best)}" if best and best.modeled_speedup >= 1.0 else "plain 1.00×"
        worst_plain.append(a.modeled_speedup)
        worst_fixed.append(a.modeled_speedup / best_value)
        if heuristic is not None and a.modeled_speedup > heuristic.modeled_speedup:
            wins += 1
        lines.append(" | ".join([
            f"| {a.label.removeprefix('specdec ')}", dataset_label(a.dataset), f"{a.temperature:g}", _both(a), best_text,
            _both(heuristic) if heuristic else "—", _fmt(a.modeled_speedup), _fmt(a.modeled_speedup / best_value),
            _fmt(a.modeled_speedup / heuristic.modeled_speedup) if heuristic else "—",
            " ".join(str(n) for n in a.gamma_histogram),
        ]) + " |")
    heuristics = sum(1 for a in adaptive for r in rows if r.schedule == "heuristic"
                     and (r.method, r.dataset, r.temperature) == (a.method, a.dataset, a.temperature))
    lines += ["", f"Over {len(adaptive)} cells: adaptive ÷ plain ≥ {min(worst_plain):.3f}, adaptive ÷ best fixed γ ≥ "
              f"{min(worst_fixed):.3f}" + (f", adaptive beats the heuristic in {wins} of {heuristics}." if heuristics else ".")]
    return lines


def _both(row: CellRow) -> str:
    wall = f" ({row.speedup:.2f}×)" if row.speedup is not None else ""
    return f"{_fmt(row.modeled_speedup, '.2f', '×')}{wall}"
