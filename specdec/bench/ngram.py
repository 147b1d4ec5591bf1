"""ngram: drafting from the context — n-gram prompt lookup and suffix decoding — vs plain decoding,
and vs transformers' prompt lookup decoding.

One run per dataset measures, each in its own subprocess and on the same prompts: specdec plain,
specdec ngram at each (γ, n-gram sizes), specdec suffix at each γ, transformers plain and its
`prompt_lookup_num_tokens`. Edit tasks (`edit`: code or text to modify and return) stop at EOS as a
user's request would; the completion set (`code`) decodes a fixed number of tokens.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from specdec.bench.cost_curve import FORMATS
from specdec.bench.report import environment_line, median_spread, publish, same_greedy_tokens
from specdec.bench.workers import WorkerSpec, add_run_arguments, run_workers
from specdec.models.zoo import DEFAULT_MODEL


def _sizes(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench ngram", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--datasets", nargs="+", default=["edit", "code"])
    parser.add_argument("--gammas", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--ngram-sizes", nargs="+", default=["2-5"], help="prompt_lookup_min-max, e.g. 1-4")
    parser.add_argument("--suffix-gammas", type=int, nargs="+", default=[16])
    parser.add_argument("--format", default="int8", choices=list(FORMATS), help="the target's weight format")
    parser.add_argument("--hf-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    parser.add_argument("--hf-repeat", type=int, default=1, help="passes for the (slow, float32) transformers peers")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers peers")
    parser.add_argument("--edit-max-tokens", type=int, default=256, help="max_tokens of the edit tasks (stop at EOS)")
    add_run_arguments(parser, "ngram")
    parser.set_defaults(num_prompts=8, max_tokens=128)
    args = parser.parse_args(argv)

    specs = []
    for dataset in args.datasets:
        stops = dataset == "edit"
        common = dict(model=args.model, dataset=dataset, num_prompts=args.num_prompts, threads=args.threads,
                      max_tokens=args.edit_max_tokens if stops else args.max_tokens, ignore_eos=not stops)
        quantization = FORMATS[args.format]
        specs.append(WorkerSpec("specdec", **common, repeat=args.repeat, quantization=quantization))
        for gamma in args.gammas:
            for sizes in args.ngram_sizes:
                low, high = _sizes(sizes)
                config = {"method": "ngram", "num_speculative_tokens": gamma, "prompt_lookup_min": low,
                          "prompt_lookup_max": high, "adaptive": False}
                specs.append(WorkerSpec("specdec", **common, repeat=args.repeat, quantization=quantization,
                                        speculative_config=config))
        for gamma in args.suffix_gammas:
            specs.append(WorkerSpec("specdec", **common, repeat=args.repeat, quantization=quantization,
                                    speculative_config={"method": "suffix", "num_speculative_tokens": gamma,
                                                        "adaptive": False}))
        if not args.no_transformers:
            specs += [
                WorkerSpec("transformers", **common, repeat=args.hf_repeat),
                WorkerSpec("transformers", **common, repeat=args.hf_repeat,
                           prompt_lookup_num_tokens=args.hf_lookup_tokens),
            ]
    results = run_workers("ngram", specs)
    publish("ngram", results, report(results, args, argv), args.out, args.update)
    return 0


def _per_request(values: list[float], num_prompts: int) -> list[float]:
    """The last pass's values (every pass decodes the same tokens)."""
    return values[-num_prompts:]


def report(results: list[dict[str, Any]], args: argparse.Namespace, argv: Sequence[str]) -> str:
    lines = [
        f"## Drafting from the context: n-gram prompt lookup and suffix decoding, {args.model}",
        "",
        f"Command: `specdec bench ngram {' '.join(argv)}`  ",
        f"Greedy, batch 1, {args.threads} threads, each configuration in its own subprocess, target weights "
        f"{args.format} (transformers: float32). `edit`: {args.num_prompts} chat requests to modify and return code "
        f"or text, stopping at EOS or {args.edit_max_tokens} tokens; `code`: completion and chat "
        f"prompts, {args.max_tokens} tokens each (EOS ignored). tok/s = new tokens / wall time over all prompts, "
        f"median (min–max) of {args.repeat} passes (transformers: {args.hf_repeat}); speedups are ratios of medians "
        f"to the same engine's plain decoding in the same run. Mean accepted length counts steps with a draft; "
        f"forwards per token counts every step. Suffix decoding keeps earlier requests' outputs (that is the "
        f"method): passes 2 and later re-run the same prompts and copy the first pass's answers, so its medians, "
        f"acceptance and accepted length there measure a cache hit; its first pass, cold but for the warm-up "
        f"request, is the fair number, and the first-pass column gives it for every row. {environment_line()}",
    ]
    for dataset in args.datasets:
        rows = [r for r in results if r["spec"]["dataset"] == dataset]
        plain = {engine: next((r for r in rows if r["spec"]["engine"] == engine and not r["spec"].get("speculative_config")
                               and not r["spec"].get("prompt_lookup_num_tokens")), None)
                 for engine in ("specdec", "transformers")}
        reference = plain["specdec"]
        eos = set(reference["eos_token_ids"]) if reference else set()
        lines += [
            "", f"### `{dataset}`", "",
            "| configuration | tok/s | speedup vs its plain | first pass tok/s (÷ its plain's) | acceptance rate "
            "| mean accepted length | steps with a draft | target forwards per token | same tokens as specdec plain |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            med, low, high = median_spread(r["tok_per_s"])
            own = plain[r["spec"]["engine"]]
            row = [r["label"], f"{med:.2f} ({low:.2f}–{high:.2f})",
                   f"{med / median_spread(own['tok_per_s'])[0]:.2f}×" if own else "—",
                   f"{r['tok_per_s'][0]:.2f} ({r['tok_per_s'][0] / own['tok_per_s'][0]:.2f}×)" if own else "—"]
            s = r.get("speculative")
            if s and s["num_spec_steps"]:
                forwards = sum(_per_request(r["target_forwards"], len(r["tokens"])))
                row += [f"{s['draft_acceptance_rate']:.2f}", f"{s['mean_acceptance_length']:.2f}",
                        f"{s['num_spec_steps'] / sum(r['target_forwards']):.0%}"]
                row.append(f"{forwards / sum(len(t) for t in r['tokens']):.2f}")
            else:
                row += ["—", "—", "—", "1.00" if r["spec"]["engine"] == "specdec" else "—"]
            row.append("—" if r is reference or reference is None else same_greedy_tokens(r["tokens"], reference["tokens"], eos))
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
