"""cuda: the CUDA path at the embedded pair's real shapes, on a GPU (run on a lent one; CI has none).

The GGUF weights don't travel to a lent GPU, so the models here have the embedded pair's configs with
random weights: a forward's cost depends on shapes, not values. In one process: the GPU's ceilings (a
device-to-device copy, a large matrix product in the model's dtype), the cost of a forward over k new
tokens against roofline(k) with per-token (row-exact) attention and with one causal kernel per
sequence, and plain vs speculative greedy decoding where the draft is the target itself (same weights:
every draft should be accepted, and the tokens should equal plain decoding's; a shortfall shows rows
that round differently with the number of tokens in the forward) and where it is the 0.5B shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.models import zoo
from specdec.models.cost_curve import measure_cost_curves
from specdec.models.roofline import Ceilings, ForwardWork

KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTEXTS = (128, 1024)


def _median_ms(fn, device: str, repeats: int = 10) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def measure_device_ceilings(dtype: torch.dtype, device: str, copy_bytes: int = 4 * 2**30, side: int = 8192) -> Ceilings:
    """Bandwidth: bytes read + written by a device-to-device copy; MAC rate: a side³ product in `dtype` on
    random data (kept in the `fp32_macs_per_s` field: the rate of the model's float format)."""
    src = torch.randn(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * copy_bytes / (_median_ms(lambda: dst.copy_(src), device) / 1000)
    del src, dst
    a = torch.randn(side, side, device=device, dtype=dtype)
    b = torch.randn(side, side, device=device, dtype=dtype)
    macs = side**3 / (_median_ms(lambda: a @ b, device) / 1000)
    return Ceilings(bandwidth, macs, None, {"device copy": bandwidth})


def random_checkpoint(config_path: Path, directory: Path, dtype: torch.dtype, device: str) -> Path:
    """The config's architecture with random weights (normal, std 0.02), saved as a checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path.parent)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    generation_config = config_path.parent / "generation_config.json"
    if generation_config.exists():
        (directory / generation_config.name).write_text(generation_config.read_text())
    return directory


def _decode(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from specdec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    outputs, rates = [], []
    for prompt in prompts:
        start = time.perf_counter()
        [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - start))
        outputs.append(out)
    spec = [o.metrics.speculative_decoding for o in outputs if o.metrics.speculative_decoding]
    return {
        "tok_s": statistics.median(rates),
        "tok_s_range": (min(rates), max(rates)),
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "acceptance": None if not spec else sum(s["num_accepted_tokens"] for s in spec) / max(1, sum(s["num_draft_tokens"] for s in spec)),
    }


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench cuda", description=__doc__)
    parser.add_argument("--target-config", type=Path, default=zoo.cache_dir() / "hf" / "qwen2.5-coder-1.5b" / "config.json")
    parser.add_argument("--draft-config", type=Path, default=zoo.cache_dir() / "hf" / "qwen2.5-coder-0.5b" / "config.json")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench-results/cuda.json"))
    parser.add_argument("--device", default="cuda", help="cpu only to check this bench itself on tiny configs")
    parser.add_argument("--ks", type=int, nargs="+", default=list(KS))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("specdec bench cuda needs a CUDA device")
    from specdec import LLM
    from specdec.models.loader import parse_dtype

    dtype = parse_dtype(args.dtype)
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result: dict[str, Any] = {"device": name, "torch": torch.__version__, "dtype": args.dtype}
    small = {} if args.device == "cuda" else {"copy_bytes": 2**26, "side": 512}
    ceilings = measure_device_ceilings(dtype, args.device, **small)
    result["ceilings"] = ceilings.to_json()
    print(f"{result['device']}: copy {ceilings.read_bytes_per_s / 1e12:.2f} TB/s, {args.dtype} product "
          f"{2 * ceilings.fp32_macs_per_s / 1e12:.0f} TFLOP/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = random_checkpoint(args.target_config, Path(tmp) / "target", dtype, args.device)
        draft_dir = random_checkpoint(args.draft_config, Path(tmp) / "draft", dtype, args.device)
        common = dict(dtype=args.dtype, device=args.device, quantization=None, skip_tokenizer_init=True, max_num_seqs=1)
        plain = LLM(str(target_dir), **common)
        model = plain.engine.model
        work = ForwardWork.of(model)
        result["curves"] = {}
        ks, row_invariant_tokens = tuple(args.ks), model.row_invariant_tokens
        for attention, limit in (("per-token", row_invariant_tokens), ("one kernel", 0)):
            model.row_invariant_tokens = limit
            [curve] = measure_cost_curves([model], ks=ks, contexts=CONTEXTS, prefill_ks=())
            result["curves"][attention] = {
                c: {k: {"ms": curve.ms[c][k], "spread": curve.spread[c][k], "roofline_ms": work.roofline_ms(k, c, ceilings)}
                    for k in ks} for c in CONTEXTS
            }
            for c in CONTEXTS:
                row = " ".join(f"{k}:{curve.ms[c][k]:.1f}" for k in ks)
                print(f"cost {attention:10s} ctx {c:5d} ms  {row}", flush=True)
        model.row_invariant_tokens = row_invariant_tokens
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (100, 300, 500)]
        runs = {"plain": _decode(plain, prompts, args.max_tokens)}
        del plain
        for name, draft in (("draft = target", target_dir), ("draft = 0.5B shape", draft_dir)):
            spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.gamma,
                    "quantization": None, "adaptive": False}
            llm = LLM(str(target_dir), speculative_config=spec, **common)
            runs[name] = _decode(llm, prompts, args.max_tokens)
            del llm
        plain_tokens = runs["plain"]["tokens"]
        for name, run in runs.items():
            same = sum(a == b for a, b in zip(run["tokens"], plain_tokens))
            run["identical_to_plain"] = f"{same}/{len(prompts)}"
            print(f"decode {name:20s} {run['tok_s']:.1f} tok/s ({run['tok_s_range'][0]:.1f}–{run['tok_s_range'][1]:.1f}) "
                  f"acceptance {run['acceptance']} identical {run['identical_to_plain']}", flush=True)
            del run["tokens"]
        result["decode"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0
