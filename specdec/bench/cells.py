"""Sweep cells: one engine setup × one workload, measured in a worker subprocess and cached on disk.

A worker loads one setup (specdec with a speculation config, or a transformers peer) once, runs
each of its workloads (dataset × temperature) that has no result yet, and writes each result to
`cells/<key>.json` as soon as it has it, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdec.bench.dataset import load_prompts, render
from specdec.bench.quality import passes_tests


# speculative options a setup's label shows
LABELLED_OPTIONS = ("draft_confidence_threshold", "acceptance_method", "suffix_decoding_speculate_tree")


@dataclass(frozen=True)
class EngineSetup:
    """What a worker loads: specdec (target format, speculation) or a transformers peer."""

    engine: str  # "specdec" | "transformers"
    model: str
    quantization: str | None = "auto"  # specdec: the target's weight format
    speculative_config: dict | None = None  # specdec
    heuristic_schedule: bool = False  # specdec: γ from HF's +2/−1 schedule (engine/adaptive.HeuristicSchedule)
    assistant_model: str | None = None  # transformers assisted generation (its defaults: 20 tokens, confidence 0.4)
    prompt_lookup_num_tokens: int | None = None  # transformers prompt lookup decoding
    threads: int = 2

    @property
    def method(self) -> str:
        if self.speculative_config:
            return self.speculative_config["method"]
        if self.assistant_model:
            return "assisted"
        if self.prompt_lookup_num_tokens:
            return "prompt_lookup"
        return "none"

    @property
    def gamma(self) -> int:
        if self.speculative_config:
            return self.speculative_config["num_speculative_tokens"]
        return self.prompt_lookup_num_tokens or 0  # assisted: a schedule, not one γ

    @property
    def schedule(self) -> str:
        """How γ is chosen: "fixed", "adaptive", "heuristic"; "" without a specdec speculative config."""
        if not self.speculative_config:
            return ""
        if self.heuristic_schedule:
            return "heuristic"
        return "adaptive" if self.speculative_config.get("adaptive", True) else "fixed"

    @property
    def label(self) -> str:
        if self.engine == "transformers":
            return {"none": "transformers plain", "assisted": "transformers assisted (its defaults)",
                    "prompt_lookup": f"transformers prompt lookup ({self.prompt_lookup_num_tokens})"}[self.method]
        formats = f" [{self.quantization or 'fp32'}]" if self.quantization != "auto" else ""
        config = self.speculative_config or {}
        draft = ""
        if config.get("model"):
            fmt = config.get("quantization", "auto")
            draft = f" ({Path(config['model']).name}" + (f", {fmt or 'fp32'}" if fmt != "auto" else "") + ")"
        gamma = {"fixed": f" γ={self.gamma}", "adaptive": f" adaptive γ≤{self.gamma}",
                 "heuristic": f" heuristic γ≤{self.gamma}", "": ""}[self.schedule]
        extra = "".join(f", {k}={v}" for k, v in config.items() if k in LABELLED_OPTIONS)
        tree = config.get("speculative_token_tree")
        if tree:
            chain = all(list(c) == [0] * len(c) for c in tree)
            extra = (" chain" if chain else f" tree ({len(tree)} nodes)") + extra
        if config.get("speculative_eagle_topk", 1) > 1:  # a dynamic tree
            extra = f" tree (top-{config['speculative_eagle_topk']}, {config.get('speculative_num_draft_tokens', 'default')} nodes)" + extra
        return f"specdec {self.method}{draft}{gamma}{extra}{formats}"


@dataclass(frozen=True)
class Workload:
    dataset: str  # a shipped set or a .jsonl path
    temperature: float
    num_prompts: int
    max_tokens: int
    repeat: int
    # sampled text differs with the seed, and with it a cell's acceptance: more seeds per prompt (at T > 0)
    # average that out; seed = prompt index + 1000 × seed number
    seeds: int = 1


def cell_key(setup: EngineSetup, workload: Workload) -> str:
    work = asdict(workload)
    if work["seeds"] == 1:
        del work["seeds"]  # the key cells had before seeds existed
    text = json.dumps([asdict(setup), work], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cell_path(cells_dir: Path, setup: EngineSetup, workload: Workload) -> Path:
    return cells_dir / f"{cell_key(setup, workload)}.json"


def run_worker(setup: EngineSetup, workloads: list[Workload], cells_dir: Path) -> None:
    """In this process: load the setup once, then measure each workload and write its cell file."""
    import torch

    torch.set_num_threads(setup.threads)
    engine = _SpecdecEngine(setup) if setup.engine == "specdec" else _TransformersEngine(setup)
    for workload in workloads:
        prompts = load_prompts(workload.dataset)[: workload.num_prompts]
        ids = [render(p, engine.tokenizer) for p in prompts]
        engine.generate(ids[0][:8], workload, seed=0)  # warm-up
        engine.start_workload()
        passes, requests = [], []
        for _ in range(workload.repeat):
            start, count, requests = time.perf_counter(), 0, []
            for index, prompt_ids in enumerate(ids):
                for number in range(workload.seeds):
                    record = engine.generate(prompt_ids, workload, seed=index + 1000 * number)
                    requests.append({"prompt_id": prompts[index]["id"], "prompt_tokens": len(prompt_ids), **record})
                    count += len(record["tokens"])
            passes.append({"tok_per_s": count / (time.perf_counter() - start), "requests": requests})
        by_id = {p["id"]: p for p in prompts}
        for request in requests:
            prompt = by_id[request["prompt_id"]]
            if "tests" in prompt:  # the quality set: does the completion's code pass the task's tests?
                text = engine.tokenizer.decode(request["tokens"], skip_special_tokens=True)
                request["passed"] = passes_tests(text, prompt["tests"])
        result = {"setup": asdict(setup), "workload": asdict(workload), "label": setup.label, "passes": passes,
                  **engine.describe(ids, workload)}
        path = cell_path(cells_dir, setup, workload)
        path.write_text(json.dumps(result))
        print(path.name, flush=True)  # progress for the parent


class _SpecdecEngine:
    def __init__(self, setup: EngineSetup) -> None:
        from specdec import LLM

        self.llm = LLM(setup.model, speculative_config=setup.speculative_config, quantization=setup.quantization,
                       max_num_seqs=1)
        self.tokenizer = self.llm.get_tokenizer()
        self.setup = setup

    def start_workload(self) -> None:
        """Each cell's timed requests start from a fresh γ controller, as on a fresh engine: what a controller
        learns from the (truncated, unrepresentative) warm-up prompt or from the cells run before in this
        worker does not carry into the cell."""
        from specdec.engine.adaptive import AdaptiveGamma, HeuristicSchedule

        engine = self.llm.engine
        if self.setup.heuristic_schedule:
            engine.controller = HeuristicSchedule(self.setup.gamma)
        elif isinstance(engine.controller, AdaptiveGamma):
            engine.controller = AdaptiveGamma(engine.controller.costs, stratified=engine.controller.stratified)

    def generate(self, ids: list[int], workload: Workload, seed: int) -> dict[str, Any]:
        from specdec import SamplingParams

        params = SamplingParams(temperature=workload.temperature, max_tokens=workload.max_tokens, ignore_eos=True,
                                seed=seed)
        [out] = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        m = out.metrics
        return {"tokens": out.outputs[0].token_ids, "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "e2e_s": m.e2e_s,
                "target_forwards": m.num_target_forwards, "speculative": m.speculative_decoding}

    def describe(self, ids: list[list[int]], workload: Workload) -> dict[str, Any]:
        """The target's (and draft model's) cost curve at this workload's mean context (cached per
        machine): what the analytical model, and the cost-model judge of γ schedules, need."""
        from specdec.models.cost_curve import cached_cost_curves
        from specdec.models.zoo import cache_dir

        proposer = self.llm.engine.proposer
        drafts = [] if proposer is None or proposer.model is None else [proposer.model]
        # a draft model's curve with the target's measured beside it, as the controller reads them (the target's
        # alone, measured by an earlier setup, once priced a cell's verification at 30.7 ms and its drafts at a
        # curve measured with a 46.6 ms one)
        curve, *draft_curves = cached_cost_curves([self.llm.engine.model, *drafts], cache_dir())
        context = int(statistics.mean(len(p) for p in ids) + workload.max_tokens / 2)
        # up to 33 rows: a tree verifies more nodes than its depth γ
        rows = max(self.setup.gamma + 1, 33)
        cost = {"context": context, "target_ms_k1": curve.forward_ms(1, context),
                "v": {k: curve.relative(k, context) for k in range(1, rows + 1)}}
        if draft_curves:
            [draft] = draft_curves
            cost["draft_ms_k1"] = draft.forward_ms(1, context)
            # what each token beyond the first adds to a draft forward: its catch-ups feed many at once, the bulk of
            # them its prefill of the prompt (logits at the last token only)
            prompt = max(2, round(statistics.mean(len(p) for p in ids)))
            cost["draft_ms_per_extra_token"] = (draft.prefill_ms(prompt, 0) - draft.forward_ms(1, 0)) / (prompt - 1)
        return {"engine_format": self.llm.config.quantization or self.llm.config.dtype,
                "eos_token_ids": sorted(self.llm.engine.rules.eos_token_ids), "cost": cost}


class _TransformersEngine:
    def __init__(self, setup: EngineSetup) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from specdec.models.loader import eos_token_ids, resolve_model_dir

        model_dir = resolve_model_dir(setup.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = sorted(eos_token_ids(model_dir, self.tokenizer))
        self.options: dict[str, Any] = {}
        if setup.assistant_model:
            self.options["assistant_model"] = AutoModelForCausalLM.from_pretrained(
                resolve_model_dir(setup.assistant_model), dtype=torch.float32).eval()
        if setup.prompt_lookup_num_tokens:
            self.options["prompt_lookup_num_tokens"] = setup.prompt_lookup_num_tokens

    def start_workload(self) -> None:
        pass

    def generate(self, ids: list[int], workload: Workload, seed: int) -> dict[str, Any]:
        import torch
        from transformers import GenerationConfig

        sampling = {"do_sample": True, "temperature": workload.temperature, "top_k": 0, "top_p": 1.0} \
            if workload.temperature > 0 else {"do_sample": False}
        config = GenerationConfig(
            max_new_tokens=workload.max_tokens, min_new_tokens=workload.max_tokens, eos_token_id=self.eos,
            pad_token_id=self.tokenizer.eos_token_id, **sampling,
        )
        torch.manual_seed(seed)
        input_ids = torch.tensor([ids])
        streamer = _TokenTimes()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                                      streamer=streamer, **self.options)
        end = time.perf_counter()
        tokens = out[0, len(ids):].tolist()
        first = streamer.times[1] if len(streamer.times) > 1 else end  # times[0]: the prompt
        return {"tokens": tokens, "ttft_s": first - start, "e2e_s": end - start,
                "tpot_s": (end - first) / (len(tokens) - 1) if len(tokens) > 1 else None,
                "target_forwards": None, "speculative": None}

    def describe(self, ids: list[list[int]], workload: Workload) -> dict[str, Any]:
        from importlib.metadata import version

        return {"engine_format": "float32", "version": version("transformers"), "eos_token_ids": self.eos}


class _TokenTimes:
    """A transformers streamer that only notes when each put() arrives (the prompt first, then tokens)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    run_worker(EngineSetup(**job["setup"]), [Workload(**w) for w in job["workloads"]], Path(job["cells_dir"]))
