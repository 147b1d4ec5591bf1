"""plain_decode: greedy tokens/s of specdec vs transformers `generate`, same model, prompts, threads.

Each engine runs in its own subprocess, one prompt at a time, a fixed number of new tokens
(EOS ignored), `--repeat` passes; prints medians and spreads, saves JSON, and can rewrite its
section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from specdec.bench.report import environment_line, median_spread, publish, same_greedy_tokens
from specdec.bench.workers import WorkerSpec, add_run_arguments, run_workers

DEFAULT_MODELS = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench plain_decode", description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    add_run_arguments(parser, "plain_decode")
    args = parser.parse_args(argv)
    specs = [
        WorkerSpec(engine, model, args.dataset, args.num_prompts, args.max_tokens, args.threads, args.repeat)
        for model in args.models
        for engine in ("specdec", "transformers")
    ]
    results = run_workers("plain_decode", specs)
    publish("plain_decode", results, _table(results, args, argv), args.out, args.update)
    return 0


def _table(results: list[dict[str, Any]], args: argparse.Namespace, argv: Sequence[str]) -> str:
    lines = [
        "## Plain decoding: specdec vs transformers",
        "",
        f"Command: `specdec bench plain_decode {' '.join(argv)}`  ",
        f"Greedy, {args.num_prompts} prompts of the `{args.dataset}` set (completion and chat), {args.max_tokens} new "
        f"tokens each (EOS ignored), batch 1, float32, {args.threads} threads, each engine in its own subprocess; "
        f"tok/s = new tokens / wall time over all prompts, median (min–max) of {args.repeat} passes. {environment_line()}",
        "",
        "| model | engine | tok/s | specdec ÷ transformers | TTFT s | TPOT ms | same greedy tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["spec"]["model"], r["spec"]["engine"]): r for r in results}
    for r in results:
        model, engine = r["spec"]["model"], r["spec"]["engine"]
        med, low, high = median_spread(r["tok_per_s"])
        peer = by_key.get((model, "transformers"))
        mine = engine == "specdec" and peer is not None
        ratio = f"{med / median_spread(peer['tok_per_s'])[0]:.2f}×" if mine else "—"
        ttft = f"{median_spread(r['ttft_s'])[0]:.3f}" if r.get("ttft_s") else "—"
        tpot = f"{median_spread(r['tpot_s'])[0] * 1000:.0f}" if r.get("tpot_s") else "—"
        same = same_greedy_tokens(r["tokens"], peer["tokens"], set(r["eos_token_ids"])) if mine else "—"
        lines.append(f"| {model} | {engine} | {med:.2f} ({low:.2f}–{high:.2f}) | {ratio} | {ttft} | {tpot} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
