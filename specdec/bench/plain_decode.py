"""plain_decode: greedy tokens/s of specdec vs transformers `generate`, same model, prompts, threads.

Each engine runs in its own subprocess (`--worker`), one prompt at a time, with a fixed
number of new tokens (EOS ignored) and `--repeat` passes; the parent prints a table of
medians and spreads, saves JSON, and can rewrite its section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specdec.bench.dataset import load_prompts, render
from specdec.bench.report import median_spread, update_section

DEFAULT_MODELS = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench plain_decode", description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--dataset", default="code")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["specdec", "transformers"], choices=sorted(WORKERS))
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--update", type=Path, default=None, help="rewrite this file's plain_decode section")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)))
        return 0

    results = []
    for model in args.models:
        for engine in args.engines:
            print(f"[plain_decode] {engine} on {model} ...", file=sys.stderr, flush=True)
            results.append(_run_worker(engine, model, args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plain_decode.json").write_text(json.dumps(results, indent=1))
    table = _table(results, args)
    print(table)
    if args.update:
        update_section(args.update, "plain_decode", table)
    return 0


def _run_worker(engine: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "specdec.bench.plain_decode", "--worker", engine, "--model", model,
        "--dataset", args.dataset, "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
        "--threads", str(args.threads), "--repeat", str(args.repeat),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} worker failed on {model}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    return [render(p, tokenizer) for p in load_prompts(args.dataset)[: args.num_prompts]]


def _timed_passes(args: argparse.Namespace, generate: Callable[[list[int]], list[int]], prompts: list[list[int]]) -> dict:
    generate(prompts[0][:8])  # warm-up
    passes, tokens = [], []
    for _ in range(args.repeat):
        start, count = time.perf_counter(), 0
        tokens = []
        for ids in prompts:
            out = generate(ids)
            tokens.append(out)
            count += len(out)
        passes.append(count / (time.perf_counter() - start))
    return {"tok_per_s": passes, "tokens": tokens}


def _specdec_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from specdec import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    ttft, tpot = [], []

    def generate(ids: list[int]) -> list[int]:
        [out] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        ttft.append(out.metrics.ttft_s)
        tpot.append(out.metrics.tpot_s)
        return out.outputs[0].token_ids

    result = _timed_passes(args, generate, _prompts(args, llm.get_tokenizer()))
    return {
        "engine": "specdec", "model": args.model, **result, "ttft_s": ttft[1:], "tpot_s": tpot[1:],
        "eos_token_ids": sorted(llm.engine.rules.eos_token_ids),
    }


def _transformers_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.set_num_threads(args.threads)
    from specdec.models.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(
        max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )

    def generate(ids: list[int]) -> list[int]:
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
        return out[0, len(ids):].tolist()

    result = _timed_passes(args, generate, _prompts(args, tokenizer))
    return {"engine": "transformers", "model": args.model, "version": _version("transformers"), **result}


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


WORKERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "specdec": _specdec_worker,
    "transformers": _transformers_worker,
}


def _agreement(a: list[list[int]], b: list[list[int]], eos: set[int]) -> str:
    """How many prompts give the same greedy tokens, compared up to the first EOS."""
    def cut(tokens: list[int]) -> list[int]:
        for i, t in enumerate(tokens):
            if t in eos:
                return tokens[:i]
        return tokens
    same = sum(cut(x) == cut(y) for x, y in zip(a, b))
    return f"{same}/{len(a)}"


def _table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    import torch

    command = "specdec bench plain_decode " + " ".join(
        shlex.quote(a) for a in ["--models", *args.models, "--repeat", str(args.repeat), "--max-tokens", str(args.max_tokens)]
    )
    lines = [
        "## Plain decoding: specdec vs transformers",
        "",
        f"Command: `{command}`  ",
        f"Greedy, {args.num_prompts} prompts of the `{args.dataset}` set (completion and chat), {args.max_tokens} new tokens each "
        f"(EOS ignored), batch 1, float32, {args.threads} threads, each engine in its own subprocess; "
        f"tok/s = new tokens / wall time of all prompts, median (min–max) over {args.repeat} passes. "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| model | engine | tok/s | specdec ÷ transformers | TTFT s (median) | TPOT ms (median) | same greedy tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["model"], r["engine"]): r for r in results}
    for r in results:
        med, low, high = median_spread(r["tok_per_s"])
        peer = by_key.get((r["model"], "transformers"))
        ratio = "—"
        if r["engine"] == "specdec" and peer:
            ratio = f"{med / median_spread(peer['tok_per_s'])[0]:.2f}×"
        ttft = f"{median_spread(r['ttft_s'])[0]:.3f}" if r.get("ttft_s") else "—"
        tpot = f"{median_spread(r['tpot_s'])[0] * 1000:.0f}" if r.get("tpot_s") else "—"
        same = "—"
        if r["engine"] == "specdec" and peer:
            same = _agreement(r["tokens"], peer["tokens"], set(r["eos_token_ids"]))
        lines.append(f"| {r['model']} | {r['engine']} | {med:.2f} ({low:.2f}–{high:.2f}) | {ratio} | {ttft} | {tpot} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
