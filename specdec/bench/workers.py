"""One engine configuration measured in its own subprocess, so memory stays bounded and engines
never share a process. The parent calls `run_worker(WorkerSpec)`; the child prints one JSON line.

Each worker decodes the prompts one at a time (batch 1), greedy, `max_tokens` new tokens (EOS
ignored unless `ignore_eos` is off), `repeat` passes after a warm-up, and reports tok/s per pass
plus what the engine measured about itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdec.bench.dataset import load_prompts, render


@dataclass(frozen=True)
class WorkerSpec:
    engine: str  # "specdec" | "transformers" | "runner" (the cost_curve bench's measurements)
    model: str
    dataset: str = "code"
    num_prompts: int = 6
    max_tokens: int = 64
    threads: int = 2
    repeat: int = 3
    quantization: str | None = None  # specdec: the target's weight format
    speculative_config: dict | None = None  # specdec
    assistant_model: str | None = None  # transformers assisted generation
    assistant_schedule: str | None = None  # "constant" | "heuristic" | None (transformers' default: constant 20, confidence 0.4)
    num_assistant_tokens: int | None = None
    prompt_lookup_num_tokens: int | None = None  # transformers prompt lookup decoding
    ignore_eos: bool = True  # False: stop at EOS, as a user would (edit tasks that end)
    measure_costs: bool = False  # specdec: forward time for k new tokens, target and draft

    @property
    def label(self) -> str:
        if self.speculative_config:
            config = self.speculative_config
            if config["method"] != "draft_model":
                options = "".join(f", {k.removeprefix('suffix_decoding_')}={v}" for k, v in config.items()
                                  if k not in ("method", "num_speculative_tokens", "adaptive"))
                return f"specdec {config['method']} γ={config.get('num_speculative_tokens')}{options}" + (
                    f" [{self.quantization}]" if self.quantization else "")
            formats = f" [{self.quantization or 'fp32'} + {config.get('quantization') or 'fp32'} draft]" if self.quantization or config.get("quantization") else ""
            return f"specdec {config['method']} γ={config['num_speculative_tokens']}{formats}"
        if self.prompt_lookup_num_tokens:
            return f"transformers prompt lookup ({self.prompt_lookup_num_tokens} tokens)"
        if self.assistant_model:
            schedule = self.assistant_schedule or "defaults: 20, confidence 0.4"
            gamma = f" γ={self.num_assistant_tokens}" if self.num_assistant_tokens else ""
            return f"transformers assisted ({schedule}{gamma})"
        return f"{self.engine} plain" + (f" [{self.quantization}]" if self.quantization else "")


def add_run_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """The options every benchmark shares: prompts, length, threads, repeats, where results go."""
    parser.add_argument("--dataset", default="code")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--update", type=Path, default=None, help=f"rewrite this Markdown file's {name} section")


def run_workers(name: str, specs: list[WorkerSpec]) -> list[dict[str, Any]]:
    results = []
    for spec in specs:
        print(f"[{name}] {spec.label} on {spec.model} ...", file=sys.stderr, flush=True)
        results.append(run_worker(spec))
    return results


def run_worker(spec: WorkerSpec) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "specdec.bench.workers", json.dumps(asdict(spec))], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker {spec.label} on {spec.model} failed:\n{done.stderr[-4000:]}")
    return {"spec": asdict(spec), "label": spec.label, **json.loads(done.stdout.strip().splitlines()[-1])}


def _timed_passes(spec: WorkerSpec, generate: Callable[[list[int]], list[int]], prompts: list[list[int]],
                  after_request: Callable[[], object] | None = None) -> dict:
    """tok/s of each pass over the prompts, and each request's (tokens, seconds); `after_request` runs after each
    request, outside the timing."""
    generate(prompts[0][:8])  # warm-up
    passes: list[float] = []
    requests: list[tuple[int, float]] = []
    tokens: list[list[int]] = []
    for _ in range(spec.repeat):
        elapsed, count, tokens = 0.0, 0, []
        for ids in prompts:
            start = time.perf_counter()
            out = generate(ids)
            seconds = time.perf_counter() - start
            elapsed += seconds
            requests.append((len(out), seconds))
            tokens.append(out)
            count += len(out)
            if after_request is not None:
                after_request()
        passes.append(count / elapsed)
    return {"tok_per_s": passes, "tokens": tokens, "requests": requests}


def _specdec(spec: WorkerSpec) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec.threads)
    from specdec import LLM
    from specdec.metrics import SpecStats

    llm = LLM(spec.model, speculative_config=spec.speculative_config, quantization=spec.quantization, max_num_seqs=1)
    prompts = dataset_prompts(spec, llm.get_tokenizer())
    result, ttft, tpot, stats, forwards = specdec_passes(llm, spec, prompts)
    spec_summary = None
    if spec.speculative_config:
        total = SpecStats()
        for s in stats[1:]:  # all timed passes, not the warm-up
            total = total.merged(SpecStats.from_summary(s))
        spec_summary = total.summary()
    costs = _forward_costs(llm, prompts) if spec.measure_costs else None
    return {
        **result, "ttft_s": ttft[1:], "tpot_s": tpot[1:], "speculative": spec_summary, "costs": costs,
        "target_forwards": forwards[1:],
        "eos_token_ids": sorted(llm.engine.rules.eos_token_ids),
    }


def dataset_prompts(spec: WorkerSpec, tokenizer: Any) -> list[list[int]]:
    return [render(p, tokenizer) for p in load_prompts(spec.dataset)[: spec.num_prompts]]


def specdec_passes(
    llm: Any, spec: WorkerSpec, prompts: list[list[int]], after_request: Callable[[], object] | None = None
) -> tuple[dict, list[float], list[float], list[dict], list[int]]:
    """Timed greedy passes over the dataset; also TTFT, TPOT, speculation stats and target forwards per request.
    `after_request` runs after each request, outside the timing."""
    from specdec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
    ttft, tpot, stats, forwards = [], [], [], []

    def generate(ids: list[int]) -> list[int]:
        [out] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        ttft.append(out.metrics.ttft_s)
        tpot.append(out.metrics.tpot_s)
        stats.append(out.metrics.speculative_decoding)
        forwards.append(out.metrics.num_target_forwards)
        return out.outputs[0].token_ids

    return _timed_passes(spec, generate, prompts, after_request), ttft, tpot, stats, forwards


def _forward_costs(llm: Any, prompts: list[list[int]], ks: tuple[int, ...] = (1, 2, 3, 4, 5, 7, 9)) -> dict:
    """Median ms of one forward over k new tokens after a prompt-sized context, target and draft."""
    from specdec.models.cost_curve import measure_cost_curves

    context = max(len(p) for p in prompts)
    proposer = llm.engine.proposer
    drafts = [] if proposer is None or proposer.model is None else [proposer.model]
    curves = measure_cost_curves([llm.engine.model, *drafts], ks, (context,), prefill_ks=())
    target, *draft = (curve.ms[context] for curve in curves)
    return {"context_tokens": context, "target_ms": target, "draft_ms": draft[0] if draft else None}


def _transformers(spec: WorkerSpec) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from specdec.models.loader import eos_token_ids, resolve_model_dir

    torch.set_num_threads(spec.threads)
    model_dir = resolve_model_dir(spec.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    options: dict[str, Any] = {}
    if spec.assistant_model:
        assistant = AutoModelForCausalLM.from_pretrained(resolve_model_dir(spec.assistant_model), dtype=torch.float32).eval()
        options["assistant_model"] = assistant
        if spec.assistant_schedule:
            assistant.generation_config.num_assistant_tokens_schedule = spec.assistant_schedule
        if spec.num_assistant_tokens:
            assistant.generation_config.num_assistant_tokens = spec.num_assistant_tokens
    if spec.prompt_lookup_num_tokens:
        options["prompt_lookup_num_tokens"] = spec.prompt_lookup_num_tokens
    config = GenerationConfig(
        max_new_tokens=spec.max_tokens, min_new_tokens=spec.max_tokens if spec.ignore_eos else None, do_sample=False,
        eos_token_id=sorted(eos_token_ids(model_dir, tokenizer)), pad_token_id=tokenizer.eos_token_id,
    )

    def generate(ids: list[int]) -> list[int]:
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, **options)
        return out[0, len(ids):].tolist()

    prompts = dataset_prompts(spec, tokenizer)
    from importlib.metadata import version

    return {**_timed_passes(spec, generate, prompts), "version": version("transformers")}


def _runner(spec: WorkerSpec) -> dict[str, Any]:
    from specdec.bench.cost_curve import runner_worker

    return runner_worker(spec)


_ENGINES: dict[str, Callable[[WorkerSpec], dict[str, Any]]] = {
    "specdec": _specdec, "transformers": _transformers, "runner": _runner,
}

if __name__ == "__main__":
    worker_spec = WorkerSpec(**json.loads(sys.argv[1]))
    print(json.dumps(_ENGINES[worker_spec.engine](worker_spec)))
