"""sweep: the evaluation a team runs before turning speculation on.

Sweeps method × γ × temperature × dataset (× target and draft weight formats), with transformers'
plain, assisted and prompt-lookup generation as peers in the same run. Each engine setup runs in
its own subprocess; each cell (setup × dataset × temperature) is cached under OUT/cells, so an
interrupted sweep resumes. Writes OUT/results.json, OUT/report.md and PNG plots, and with
--update rewrites its section of BENCHMARKS.md. A speedup is a distribution: the report gives it
per dataset and temperature, with acceptance, tails, the time split and the analytical predictions.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdec.bench.analysis import cell_row, with_speedups
from specdec.bench.cells import EngineSetup, Workload, cell_path
from specdec.bench.dataset import DATASETS, load_prompts
from specdec.bench.quality import QUALITY_DATASET
from specdec.bench.report import publish
from specdec.models.zoo import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

METHODS = ("none", "draft_model", "ngram", "suffix", "medusa", "eagle", "eagle3", "mtp")
SCHEDULES = ("fixed", "adaptive", "heuristic")
FORMATS = {"auto": "auto", "fp32": None, "int8": "int8", "int4": "int4"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec bench sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--draft", nargs="+", default=[DEFAULT_DRAFT_MODEL], help="draft models for draft_model")
    p.add_argument("--methods", nargs="+", default=["none", "draft_model", "ngram"], choices=METHODS)
    p.add_argument("--gammas", type=int, nargs="+", default=[0, 2, 4, 8], help="γ values; 0 is plain decoding")
    p.add_argument("--schedules", nargs="+", default=["fixed", "adaptive"], choices=SCHEDULES,
                   help="how γ is chosen: fixed (each γ of --gammas), adaptive (the engine's controller, γ up to the "
                        "largest of --gammas), heuristic (HF's +2/−1 schedule from that γ)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--datasets", nargs="+", default=list(DATASETS))
    p.add_argument("--dataset", action="append", default=[], help="also a user's JSONL prompt file (repeatable)")
    p.add_argument("--formats", nargs="+", default=["auto"], choices=list(FORMATS), help="target weight formats")
    p.add_argument("--draft-formats", nargs="+", default=["auto"], choices=list(FORMATS))
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds per prompt at temperature > 0 (the sampled text, and with it acceptance, varies)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-peers", action="store_true", help="skip transformers' plain / assisted / prompt lookup")
    p.add_argument("--peer-temperatures", type=float, nargs="+", default=[0.0],
                   help="temperatures the (float32, ~8× slower) transformers peers run at; default 0 keeps the "
                        "default sweep under an hour here")
    p.add_argument("--hf-lookup-tokens", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    p.add_argument("--spec-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra speculative_config entry for every specdec speculative setup, e.g. "
                        "draft_confidence_threshold=0.4 (VALUE read as JSON where it parses; repeatable)")
    p.add_argument("--medusa-heads", default=None,
                   help="Medusa heads directory (default: the heads `specdec train-heads` wrote for --model)")
    p.add_argument("--medusa-trees", nargs="+", default=["default", "chain"],
                   help="medusa's token trees: default (the engine's, cut to γ levels), chain (γ first candidates) "
                        "or a JSON list of choice paths")
    p.add_argument("--acceptance-methods", nargs="+", default=["rejection_sampler"],
                   choices=["rejection_sampler", "typical_acceptance_sampler"], help="medusa's verification at T > 0")
    p.add_argument("--eagle-layer", default=None,
                   help="EAGLE draft layer directory (default: the layer `specdec train-heads` wrote for --model)")
    p.add_argument("--eagle3-layer", default=None,
                   help="EAGLE-3 draft layer directory (default: the layer `specdec train-heads` wrote for --model)")
    p.add_argument("--mtp-modules", default=None,
                   help="MTP modules directory (default: the target's own, else those `specdec train-heads` wrote)")
    p.add_argument("--dynamic-trees", nargs="+", default=["1"], metavar="TOPK[:NODES]",
                   help="eagle's, eagle3's and draft_model's drafts: 1 = a chain, k = EAGLE-2's dynamic tree expanding k "
                        "candidates per depth, k:n = with n nodes (default: the engine's)")
    p.add_argument("--prompt-lookup", type=int, nargs=2, default=[2, 5], metavar=("MIN", "MAX"),
                   help="ngram's prompt_lookup_min and _max (the engine's default, vLLM's, is 5 and 5)")
    p.add_argument("--quality", action="store_true",
                   help="also run the code tasks with unit tests (greedy, --quality-max-tokens) and report pass rates")
    p.add_argument("--quality-max-tokens", type=int, default=256)
    p.add_argument("--quick", action="store_true",
                   help="tiny random models built on the spot, 2 prompts × 8 tokens, γ 0 and 2: seconds, for CI")
    p.add_argument("--out", type=Path, default=Path("bench-results/sweep"))
    p.add_argument("--plot-dir", type=Path, default=None, help="where the PNGs go (default: OUT)")
    p.add_argument("--update", type=Path, default=None, help="rewrite this Markdown file's section (see --section)")
    p.add_argument("--section", default="sweep", help="the <!-- bench:NAME --> section --update rewrites")
    p.add_argument("--no-cell-table", action="store_true", help="leave the every-cell table out of the Markdown")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    if args.quick:
        from specdec.bench.tiny import tiny_pair

        target, draft = tiny_pair(Path(tempfile.gettempdir()) / "specdec-bench-tiny")
        args.model, args.draft = str(target), [str(draft)]
        args.num_prompts, args.max_tokens, args.gammas = 2, 8, [0, 2]
        args.methods = ["none", "draft_model", "ngram", "suffix"]
        args.schedules = list(SCHEDULES)
    datasets = [*args.datasets, *args.dataset]
    for name in datasets:
        load_prompts(name)  # a bad name or file fails here, before anything runs
    def workloads(temperatures: list[float]) -> list[Workload]:
        chosen = [Workload(d, t, args.num_prompts, args.max_tokens, args.repeat, args.seeds if t > 0 else 1)
                  for d in datasets for t in temperatures]
        if args.quality:
            chosen.append(Workload(QUALITY_DATASET, 0.0, len(load_prompts(QUALITY_DATASET)), args.quality_max_tokens, 1))
        return chosen

    plan = [(setup, workloads(args.peer_temperatures if setup.engine == "transformers" else args.temperatures))
            for setup in engine_setups(args)]
    cells = run_sweep(plan, args.out / "cells")
    rows = with_speedups([cell_row(c) for c in cells])
    from specdec.bench.plots import draw_all
    from specdec.bench.sweep_report import sweep_report

    plots = draw_all(rows, args.plot_dir or args.out)
    table = sweep_report(rows, args, argv, plots)
    (args.out / "report.md").write_text(table + "\n")
    publish(args.section, [{"cell": c, "row": asdict(r)} for c, r in zip(cells, rows)], table, args.out, args.update)
    return 0


def engine_setups(args: argparse.Namespace) -> list[EngineSetup]:
    setups = []
    for fmt in args.formats:
        quantization = FORMATS[fmt]
        common = dict(engine="specdec", model=args.model, quantization=quantization, threads=args.threads)
        if "none" in args.methods or 0 in args.gammas:
            setups.append(EngineSetup(**common))
        gammas = [g for g in args.gammas if g > 0]
        schedules = [(g, "fixed") for g in gammas if "fixed" in args.schedules]
        schedules += [(max(gammas), s) for s in ("adaptive", "heuristic") if s in args.schedules and gammas]
        options = _spec_options(args.spec_option)
        for method in (m for m in args.methods if m != "none"):
            for gamma, schedule in schedules:
                config = {"method": method, "num_speculative_tokens": gamma, "adaptive": schedule == "adaptive",
                          **options}
                heuristic = schedule == "heuristic"
                if method == "draft_model":
                    for draft in args.draft:
                        for draft_fmt, tree in itertools.product(args.draft_formats, args.dynamic_trees):
                            setups.append(EngineSetup(**common, heuristic_schedule=heuristic, speculative_config={
                                **config, **_dynamic_tree(tree), "model": draft, "quantization": FORMATS[draft_fmt]}))
                elif method == "medusa":
                    for tree in args.medusa_trees:
                        for acceptance in args.acceptance_methods:
                            medusa = {**config, "speculative_token_tree": _medusa_tree(tree, gamma)}
                            if args.medusa_heads:
                                medusa["model"] = args.medusa_heads
                            if acceptance != "rejection_sampler":
                                medusa["acceptance_method"] = acceptance
                            setups.append(EngineSetup(**common, heuristic_schedule=heuristic, speculative_config=medusa))
                elif method in ("eagle", "eagle3"):
                    layer = args.eagle_layer if method == "eagle" else args.eagle3_layer
                    for tree in args.dynamic_trees:
                        eagle = {**config, **_dynamic_tree(tree), **({"model": layer} if layer else {})}
                        setups.append(EngineSetup(**common, heuristic_schedule=heuristic, speculative_config=eagle))
                elif method == "mtp":
                    mtp = {**config, **({"model": args.mtp_modules} if args.mtp_modules else {})}
                    setups.append(EngineSetup(**common, heuristic_schedule=heuristic, speculative_config=mtp))
                elif method == "ngram":
                    low, high = args.prompt_lookup
                    setups.append(EngineSetup(**common, heuristic_schedule=heuristic, speculative_config={
                        **config, "prompt_lookup_min": low, "prompt_lookup_max": high}))
                else:
                    setups.append(EngineSetup(**common, heuristic_schedule=heuristic, speculative_config=config))
    if not args.no_peers and importlib.util.find_spec("transformers") is None:
        print("[sweep] transformers is not installed: the peers are skipped", file=sys.stderr)
    elif not args.no_peers:
        peer = dict(engine="transformers", model=args.model, quantization=None, threads=args.threads)
        setups.append(EngineSetup(**peer))
        if "draft_model" in args.methods:
            setups += [EngineSetup(**peer, assistant_model=draft) for draft in args.draft]
        if "ngram" in args.methods:
            setups.append(EngineSetup(**peer, prompt_lookup_num_tokens=args.hf_lookup_tokens))
    return setups


def _dynamic_tree(name: str) -> dict[str, int]:
    """TOPK[:NODES] as speculative_config entries (none for a chain, the engine's default)."""
    top_k, _, nodes = name.partition(":")
    if int(top_k) == 1:
        return {}
    return {"speculative_eagle_topk": int(top_k), **({"speculative_num_draft_tokens": int(nodes)} if nodes else {})}


def _medusa_tree(name: str, gamma: int) -> list[list[int]]:
    """A tree argument as choice paths, `gamma` levels deep at most."""
    from specdec.config import DEFAULT_MEDUSA_TREE

    if name == "chain":
        return [[0] * depth for depth in range(1, gamma + 1)]
    paths = DEFAULT_MEDUSA_TREE if name == "default" else json.loads(name)
    return [list(c) for c in paths if len(c) <= gamma]


def _spec_options(items: list[str]) -> dict[str, Any]:
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--spec-option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def run_sweep(plan: list[tuple[EngineSetup, list[Workload]]], cells_dir: Path) -> list[dict[str, Any]]:
    """Every cell's result, running (one subprocess per setup) only the cells without a cached one."""
    from tqdm import tqdm

    cells_dir.mkdir(parents=True, exist_ok=True)
    total = sum(len(workloads) for _, workloads in plan)
    cached = sum(cell_path(cells_dir, s, w).exists() for s, workloads in plan for w in workloads)
    with tqdm(total=total, initial=cached, desc="sweep cells", unit="cell") as bar:
        for setup, workloads in plan:
            missing = [w for w in workloads if not cell_path(cells_dir, setup, w).exists()]
            if not missing:
                continue
            bar.set_postfix_str(setup.label)
            job = {"setup": asdict(setup), "workloads": [asdict(w) for w in missing], "cells_dir": str(cells_dir)}
            with tempfile.TemporaryFile("w+") as log, subprocess.Popen(
                [sys.executable, "-m", "specdec.bench.cells", json.dumps(job)], stdout=subprocess.PIPE, stderr=log, text=True
            ) as worker:
                for _ in worker.stdout:  # one line per finished cell
                    bar.update(1)
                worker.wait()
                log.seek(0)
                if worker.returncode != 0:
                    raise RuntimeError(f"worker {setup.label} failed (finished cells are kept; rerun to resume):\n"
                                       f"{log.read()[-4000:]}")
    return [json.loads(cell_path(cells_dir, s, w).read_text()) for s, workloads in plan for w in workloads]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
