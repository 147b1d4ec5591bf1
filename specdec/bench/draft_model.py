"""draft_model: speculative decoding with a draft model vs plain decoding, and vs transformers.

One run measures, each in its own subprocess and on the same prompts: specdec plain, specdec
with the draft at every γ, transformers plain and its assisted generation (default heuristic
schedule and a constant γ). It also measures the forward cost curve (target for k new tokens,
draft for one) to compare the measured speedup with two predictions:
  seeds'      (1 − α^(γ+1)) / ((1 − α)(γc + 1))   — assumes verifying γ + 1 tokens costs one step
  cost-aware  E[L] / (γc + v(γ+1))                 — with the measured v(k) = cost(k) / cost(1)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from specdec.bench.report import environment_line, median_spread, publish, same_greedy_tokens
from specdec.bench.cost_curve import FORMATS
from specdec.bench.workers import WorkerSpec, add_run_arguments, run_workers
from specdec.metrics import expected_length
from specdec.models.zoo import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench draft_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--draft", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--target-formats", nargs="+", default=["fp32"], choices=list(FORMATS))
    parser.add_argument("--draft-formats", nargs="+", default=["fp32"], choices=list(FORMATS))
    parser.add_argument("--hf-gamma", type=int, default=4, help="γ of transformers' constant schedule")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers peers")
    add_run_arguments(parser, "draft_model")
    args = parser.parse_args(argv)

    common = dict(model=args.target, dataset=args.dataset, num_prompts=args.num_prompts,
                  max_tokens=args.max_tokens, threads=args.threads, repeat=args.repeat)
    specs = []
    for target_format in args.target_formats:
        quantization = FORMATS[target_format]
        specs.append(WorkerSpec("specdec", **common, quantization=quantization))
        for draft_format in args.draft_formats:
            for i, gamma in enumerate(args.gammas):
                config = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": gamma,
                          "quantization": FORMATS[draft_format], "adaptive": False}
                specs.append(WorkerSpec("specdec", **common, quantization=quantization, speculative_config=config,
                                        measure_costs=i == 0))
    if not args.no_transformers:
        specs += [
            WorkerSpec("transformers", **common),
            WorkerSpec("transformers", **common, assistant_model=args.draft),
            WorkerSpec("transformers", **common, assistant_model=args.draft, assistant_schedule="constant",
                       num_assistant_tokens=args.hf_gamma),
        ]
    results = run_workers("draft_model", specs)
    publish("draft_model", results, report(results, args, argv), args.out, args.update)
    return 0


def predicted_speedups(alpha: float, mean_length: float, gamma: int, c: float, v: float) -> tuple[float, float]:
    """(seeds' formula, cost-aware formula) for one γ."""
    seeds = expected_length(alpha, gamma) / (gamma * c + 1)
    cost_aware = mean_length / (gamma * c + v)
    return seeds, cost_aware


def _formats(r: dict[str, Any]) -> tuple[str, str | None]:
    """(target format, draft format or None for plain)."""
    config = r["spec"].get("speculative_config")
    return r["spec"].get("quantization") or "fp32", None if not config else (config.get("quantization") or "fp32")


def report(results: list[dict[str, Any]], args: argparse.Namespace, argv: Sequence[str]) -> str:
    mine = [r for r in results if r["spec"]["engine"] == "specdec"]
    plains = {_formats(r)[0]: r for r in mine if not r["spec"].get("speculative_config")}
    best_plain = max(median_spread(r["tok_per_s"])[0] for r in plains.values())
    hf_plain = next((r for r in results if r["label"] == "transformers plain"), None)
    eos = set(next(iter(plains.values()))["eos_token_ids"])
    lines = [
        f"## Draft-model speculation: {args.target} with draft {args.draft}",
        "",
        f"Command: `specdec bench draft_model {' '.join(argv)}`  ",
        f"Greedy, {args.num_prompts} prompts of the `{args.dataset}` set (completion and chat), {args.max_tokens} new tokens "
        f"each (EOS ignored), batch 1, {args.threads} threads, each configuration in its own subprocess; "
        f"tok/s = new tokens / wall time over all prompts, median (min–max) of {args.repeat} passes; speedups are "
        f"ratios of medians to specdec plain decoding of the same target format from the same run. {environment_line()}",
        "",
    ]
    costs_by_pair: dict[tuple[str, str | None], tuple[dict[int, float], float]] = {}
    for r in mine:
        costs = r.get("costs")
        if not costs:
            continue
        target_ms = {int(k): v for k, v in costs["target_ms"].items()}
        c = costs["draft_ms"]["1"] / target_ms[1]
        costs_by_pair[_formats(r)] = (target_ms, c)
        target, draft = _formats(r)
        curve = ", ".join(f"k={k}: {ms:.0f}" for k, ms in sorted(target_ms.items()))
        lines += [
            f"Measured forward cost, {target} target + {draft} draft (ms, median of 5, context {costs['context_tokens']} "
            f"tokens): target {curve}; draft k=1: {costs['draft_ms']['1']:.0f}; c = {c:.3f}, "
            + ", ".join(f"v({k}) = {target_ms[k] / target_ms[1]:.2f}" for k in sorted(target_ms) if k > 1) + ".",
            "",
        ]
    lines += [
        "| configuration | tok/s | speedup vs plain | acceptance rate | α | mean accepted length | predicted (seeds') | predicted (cost-aware) | measured ÷ cost-aware | same tokens as plain of its format |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    reference = plains.get("fp32", next(iter(plains.values())))
    for r in results:
        med, low, high = median_spread(r["tok_per_s"])
        target, draft = _formats(r) if r in mine else ("fp32", None)
        own_plain = plains.get(target) if r in mine else hf_plain
        base = median_spread(own_plain["tok_per_s"])[0] if own_plain else med
        row = [r["label"], f"{med:.2f} ({low:.2f}–{high:.2f})", f"{med / base:.2f}×"]
        s = r.get("speculative")
        pair = costs_by_pair.get((target, draft))
        if s:
            gamma = r["spec"]["speculative_config"]["num_speculative_tokens"]
            row += [f"{s['draft_acceptance_rate']:.2f}", f"{s['alpha']:.2f}", f"{s['mean_acceptance_length']:.2f}"]
            if pair and gamma + 1 in pair[0]:
                target_ms, c = pair
                seeds, aware = predicted_speedups(s["alpha"], s["mean_acceptance_length"], gamma, c,
                                                  target_ms[gamma + 1] / target_ms[1])
                row += [f"{seeds:.2f}×", f"{aware:.2f}×", f"{(med / base) / aware:.2f}"]
            else:
                row += ["—", "—", "—"]
        else:
            row += ["—"] * 6
        # greedy identity is a promise within a format: speculation against plain decoding of the same target
        # format (specdec), transformers' runs against specdec's float32 plain
        same_as = own_plain if r in mine else reference
        row.append("—" if r is same_as or same_as is None else same_greedy_tokens(r["tokens"], same_as["tokens"], eos))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Best per format combination (γ chosen in hindsight) against the best plain decoding of any format "
              f"({best_plain:.2f} tok/s):", ""]
    combos: dict[tuple[str, str], dict[str, Any]] = {}
    for r in mine:
        target, draft = _formats(r)
        if draft is not None:
            best = combos.get((target, draft))
            if best is None or median_spread(r["tok_per_s"])[0] > median_spread(best["tok_per_s"])[0]:
                combos[(target, draft)] = r
    for (target, draft), r in combos.items():
        med = median_spread(r["tok_per_s"])[0]
        gamma = r["spec"]["speculative_config"]["num_speculative_tokens"]
        lines.append(f"- {target} target + {draft} draft: best γ={gamma}, {med:.2f} tok/s = {med / best_plain:.2f}× the best plain")
    if hf_plain:
        hf_tps = median_spread(hf_plain["tok_per_s"])[0]
        assisted = [r for r in results if r["spec"].get("assistant_model")]
        lines += ["", "transformers' own speedups over its plain `generate` (same run): " + ", ".join(
            f"{r['label']} {median_spread(r['tok_per_s'])[0] / hf_tps:.2f}×" for r in assisted) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
