"""cost_curve: what a forward over k new tokens costs, against what this machine allows.

For each model × weight format, in its own subprocess: the machine's ceilings (read bandwidth,
fp32 and int8 MAC rates) measured in the same process, the cost of a forward over k new tokens
at two context lengths against roofline(k) = max(bytes / bandwidth, MACs / MAC rate), plain
greedy decoding tok/s and its share of the k=1 roofline, prefill of a 1k-token prompt (TTFT),
and quality against float32: mean NLL on a held text shipped with the bench and greedy agreement
with float32 on the code prompts. transformers' float32 `generate` runs in the same run as the
yardstick. Each measured curve is also written to the per-machine cache the engine reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from specdec.bench.report import environment_line, median_spread, publish, update_section
from specdec.bench.workers import WorkerSpec, add_run_arguments, dataset_prompts, run_workers, specdec_passes
from specdec.models.cost_curve import DEFAULT_CONTEXTS, DEFAULT_KS

DEFAULT_MODELS = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
FORMATS = {"fp32": None, "int8": "int8", "int4": "int4"}


def held_text() -> str:
    return (resources.files("specdec.bench") / "datasets" / "held_text.txt").read_text()


def runner_worker(spec: WorkerSpec) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec.threads)
    from specdec import LLM
    from specdec.models.cost_curve import cost_curve_path, measure_cost_curves, save_cost_curve
    from specdec.models.roofline import CeilingMeter, Ceilings, ForwardWork
    from specdec.models.zoo import cache_dir

    llm = LLM(spec.model, quantization=spec.quantization, max_num_seqs=1)
    model = llm.engine.model
    work = ForwardWork.of(model)
    # The machine drifts (read bandwidth by up to 2× within seconds): ceilings are measured before and after the
    # curve and the decode passes and after every round of the curve, and the read bandwidth is probed right after
    # every timed forward, all by one meter that holds its buffers until the worker ends (freeing them would slow
    # the next seconds' forwards). Two ratios follow: against each ceiling at its best over the run (what the
    # machine has shown it can do), and each forward against the bandwidth probed beside it and its round's MAC
    # rates (median over rounds), which a slow stretch does not inflate.
    meter = CeilingMeter()
    before = meter.measure()
    by_round: list[Ceilings] = []
    probed: dict[int, dict[int, list[float]]] = {c: {k: [] for k in DEFAULT_KS} for c in DEFAULT_CONTEXTS}
    [curve] = measure_cost_curves([model], after_round=lambda: by_round.append(meter.measure(repeats=3)),
                                  after_forward=lambda c, k: probed[c][k].append(meter.read_bandwidth()))
    save_cost_curve(cost_curve_path(cache_dir(), model.name, model.device), curve)  # what the engine reads
    # read bandwidth before the decode passes and right after each request: request i runs between probes i and i + 1
    request_probes = [meter.read_bandwidth()]
    prompts = dataset_prompts(spec, llm.get_tokenizer())
    passes, ttft, tpot, _, _ = specdec_passes(llm, spec, prompts,
                                              after_request=lambda: request_probes.append(meter.read_bandwidth()))
    after = meter.measure()
    # each decode step timed alone with a probe right after it, as the curve's forwards are: a request's seconds
    # span memory of changing speed, which neither probe around it sees
    paired_steps = _paired_decode_steps(llm, spec, prompts, meter)
    step_probe_shares = [work.roofline_ms(1, cached, dataclasses.replace(after, read_bytes_per_s=bandwidth)) / ms
                         for ms, cached, bandwidth in paired_steps]
    # each request's tok/s against the roofline at the faster of the probes around it (one probe is a 50 ms moment
    # of a request's seconds: against the probe after it alone, requests ran at 73–184% of the roofline)
    request_rooflines_ms = [
        work.roofline_ms(1, 128, dataclasses.replace(after, read_bytes_per_s=max(before, behind)))
        for before, behind in zip(request_probes, request_probes[1:])
    ]
    decode_shares = [tokens / seconds * ms / 1000 for (tokens, seconds), ms in zip(passes["requests"], request_rooflines_ms)]
    # the decode steps alone (1 / TPOT): roofline(1) models one step, not the request's prefill
    step_shares = [ms / 1000 / tpot for tpot, ms in zip(tpot[1:], request_rooflines_ms) if tpot]
    ceilings = functools.reduce(Ceilings.best, by_round, before.best(after))
    roofline = {c: {k: work.roofline_ms(k, c, ceilings) for k in curve.ms[c]} for c in curve.ms}
    paired_ratio = {
        c: {
            k: statistics.median(
                t / work.roofline_ms(k, c, dataclasses.replace(cr, read_bytes_per_s=bandwidth))
                for t, cr, bandwidth in zip(times, by_round, probed[c][k])
            )
            for k, times in row.items()
        }
        for c, row in curve.samples.items()
    }
    ids = llm.get_tokenizer().encode(held_text())[: llm.config.max_model_len - 1]
    return {
        **passes, "ttft_s": ttft[1:], "tpot_s": tpot[1:],
        "ceilings": ceilings.to_json(), "ceilings_before": before.to_json(), "ceilings_after": after.to_json(),
        "ceilings_by_round": [c.to_json() for c in by_round], "work": work.__dict__, "curve": curve.to_json(),
        "roofline_ms": roofline, "paired_ratio": paired_ratio, "probed_bytes_per_s": probed,
        "decode_roofline_after_ms": work.roofline_ms(1, 128, after), "decode_paired_shares": decode_shares,
        "decode_step_paired_shares": step_shares, "decode_steps_probed": paired_steps,
        "decode_step_probe_shares": step_probe_shares,
        "request_probes_bytes_per_s": request_probes, "prefill": _prefill(llm, ids),
        "nll": _mean_nll(model, ids),
    }


def _paired_decode_steps(llm: Any, spec: WorkerSpec, prompts: list[list[int]], meter: Any) -> list[tuple[float, int, float]]:
    """Every greedy decode step of `prompts` (one request at a time, through the engine's own step), timed alone and
    followed by a read-bandwidth probe: (ms, tokens cached before it, bytes/s)."""
    from specdec import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=True)
    steps = []
    for i, ids in enumerate(prompts):
        [seq] = engine.add_request(f"paired-decode-{i}", ids, params)
        while not seq.output_token_ids:  # the prompt's prefill and the first token: not decode steps
            engine.step()
        while not seq.is_finished:
            cached = engine.cache.length(seq.slot)
            start = time.perf_counter()
            engine.step()
            ms = 1000 * (time.perf_counter() - start)
            steps.append((ms, cached, meter.read_bandwidth()))
    return steps


def _prefill(llm: Any, ids: list[int], repeats: int = 3) -> dict[str, Any]:
    """TTFT of a ~1k-token prompt through the engine (chunked prefill), median of `repeats`."""
    from specdec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = [llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].metrics.ttft_s for _ in range(repeats)]
    return {"prompt_tokens": len(ids), "ttft_s": times, "tok_per_s": len(ids) / statistics.median(times)}


def _mean_nll(model: Any, ids: list[int]) -> float:
    import torch

    from specdec.models.batch import ForwardBatch, SequenceInput

    cache = model.new_kv_cache(1, len(ids))
    slot = cache.allocate()
    total = 0.0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, 512):
            chunk = ids[start : min(start + 512, len(ids) - 1)]
            logits = model.forward(ForwardBatch.build([SequenceInput(slot, chunk)], [start]), cache).logits
            targets = torch.tensor(ids[start + 1 : start + 1 + len(chunk)])
            total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
    return total / (len(ids) - 1)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="specdec bench cost_curve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--formats", nargs="+", default=["fp32", "int8"], choices=list(FORMATS))
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: OUT/cost_curve.png)")
    add_run_arguments(parser, "cost_curve")
    parser.set_defaults(max_tokens=128, repeat=2)
    args = parser.parse_args(argv)
    common = dict(dataset=args.dataset, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                  threads=args.threads, repeat=args.repeat)
    specs = []
    for model in args.models:
        specs += [WorkerSpec("runner", model, **common, quantization=FORMATS[f]) for f in args.formats]
        if not args.no_transformers:
            specs.append(WorkerSpec("transformers", model, **{**common, "max_tokens": 64}))
    results = run_workers("cost_curve", specs)
    plot = args.plot or args.out / "cost_curve.png"
    _plot(results, plot)
    publish("cost_curve", results, curve_table(results, argv, plot), args.out, args.update)
    formats = formats_table(results, args)
    print(formats)
    if args.update is not None:
        update_section(args.update, "formats", formats)
    return 0


def _fmt(r: dict[str, Any]) -> str:
    return r["spec"]["quantization"] or "fp32"


def curve_table(results: list[dict[str, Any]], argv: Sequence[str], plot: Path) -> str:
    runs = [r for r in results if r["spec"]["engine"] == "runner"]
    lines = [
        "## Cost curve: a forward over k new tokens against the roofline",
        "",
        f"Command: `specdec bench cost_curve {' '.join(argv)}`  ",
        "ms per forward over k new tokens (logits at every row, as verification needs) after a cached context, "
        "median of 5 rounds that each sweep every (context, k) in turn; in brackets the ratio to roofline(k) = max(bytes read / "
        "bandwidth, MACs / MAC rate), bytes = weights in their format + the KV cache, MACs = linear layers at the "
        "format's rate + attention at the fp32 rate; both ceilings measured in the same worker before and after "
        "the curve and the decode passes and after each round of the curve (bandwidth = the fastest of: fp32 sum, "
        "oneDNN's and specdec's fp32 and int8 matrix-vector products where they run, over 512 MiB; MAC rates: the "
        "fastest GEMM of 512 or 64 rows × 4096 × 4096 of each format's kernels, fp32 also a 2048³ matmul). Two "
        "ratios: against each ceiling at its best over the run · median over rounds of "
        "each forward's time against the read bandwidth probed right after it (one pass of a sum and of specdec's "
        "fp32 and int8 matrix-vector kernels over 512 MiB, the fastest) and the MAC rates measured after its round "
        f"(the machine's memory bandwidth drifts by up to 2× within seconds). Plot: `{plot.name}` (best ceilings). "
        f"{environment_line()}",
        "",
        "| model | format | read GB/s: best (before, rounds min–max, after) | probed beside the forwards: median (min–max) | fastest reader | fp32 G MAC/s: best (rounds) | int8 G MAC/s: best (rounds) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        c, before, after, rounds = r["ceilings"], r["ceilings_before"], r["ceilings_after"], r["ceilings_by_round"]
        reader = max(c["readers"], key=c["readers"].get)
        lines.append(f"| {r['spec']['model']} | {_fmt(r)} | {c['read_bytes_per_s'] / 1e9:.1f} "
                     f"({before['read_bytes_per_s'] / 1e9:.1f}, {_range(rounds, 'read_bytes_per_s', '.1f')}, "
                     f"{after['read_bytes_per_s'] / 1e9:.1f}) | {_probed(r)} | {reader} | {c['fp32_macs_per_s'] / 1e9:.0f} "
                     f"({_range(rounds, 'fp32_macs_per_s', '.0f')}) | " + (
                         f"{c['int8_macs_per_s'] / 1e9:.0f} ({_range(rounds, 'int8_macs_per_s', '.0f')})" if c["int8_macs_per_s"] else "—") + " |")
    ks = [k for k in DEFAULT_KS]
    lines += ["", "| model | format | context | " + " | ".join(f"k={k}" for k in ks) + " |",
              "|---|---|---|" + "---|" * len(ks)]
    for r in runs:
        for context in sorted(r["curve"]["ms"], key=int):
            row, roof, paired = r["curve"]["ms"][context], r["roofline_ms"][context], r["paired_ratio"][context]
            cells = [f"{row[str(k)]:.0f} ({row[str(k)] / roof[str(k)]:.2f} · {paired[str(k)]:.2f})" if str(k) in row else "—"
                     for k in ks]
            lines.append(f"| {r['spec']['model']} | {_fmt(r)} | {context} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _probed(result: dict[str, Any]) -> str:
    values = [v / 1e9 for row in result["probed_bytes_per_s"].values() for times in row.values() for v in times]
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def _range(ceilings: list[dict[str, Any]], key: str, spec: str) -> str:
    values = [c[key] / 1e9 for c in ceilings]
    return f"{min(values):{spec}}–{max(values):{spec}}"


def formats_table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "## Weight formats: speed, prefill, quality",
        "",
        f"From the same run as the cost curve. Plain greedy decoding, {args.num_prompts} prompts of the "
        f"`{args.dataset}` set, {args.max_tokens} new tokens each (transformers: 64), batch 1, median (min–max) of "
        f"{args.repeat} passes. Roofline tok/s = 1000 / roofline(k=1) at context 128, with the best ceilings of the "
        "run; % of roofline against them · against the ceilings measured right after the decode passes · each "
        "request's tok/s against the roofline at the faster of the read bandwidths probed right before and right after "
        "it, median (min–max) over requests · the same for each request's decode steps alone (1 / TPOT: without its "
        "prefill, which roofline(1) does not model) · each decode step timed alone against the roofline at the read "
        "bandwidth probed right after it, as the curve's forwards, median (quartiles) over the steps of one more pass "
        "(a request's seconds span memory of changing speed, which the probes around it miss). Prefill: a "
        "1,016-token prompt (the held text) through the engine's 512-token chunks, TTFT median of 3. NLL: mean "
        "next-token negative log-likelihood (nats) over the held text (`bench/datasets/held_text.txt`, written for "
        f"the project); agreement: prompts whose {args.max_tokens} greedy tokens equal float32's exactly, and the "
        "mean share of tokens before the first difference.",
        "",
        "| model | format | tok/s | ÷ transformers fp32 | roofline tok/s | % of roofline | prefill tok/s | TTFT 1k s | NLL | NLL vs fp32 | agreement with fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["spec"]["model"], r["spec"]["engine"], r["spec"]["quantization"]): r for r in results}
    for r in results:
        model = r["spec"]["model"]
        med, low, high = median_spread(r["tok_per_s"])
        if r["spec"]["engine"] != "runner":
            lines.append(f"| {model} | transformers fp32 | {med:.2f} ({low:.2f}–{high:.2f}) |" + " — |" * 8)
            continue
        peer = by_key.get((model, "transformers", None))
        ratio = f"{med / median_spread(peer['tok_per_s'])[0]:.2f}×" if peer else "—"
        roof_tps = 1000 / r["roofline_ms"]["128"]["1"]
        ref = by_key.get((model, "runner", None))
        nll_delta, agree = "—", "—"
        if ref is not None and ref is not r:
            nll_delta = f"{100 * (r['nll'] / ref['nll'] - 1):+.2f}%"
            agree = _agreement(r["tokens"], ref["tokens"])
        lines.append(
            f"| {model} | {_fmt(r)} | {med:.2f} ({low:.2f}–{high:.2f}) | {ratio} | {roof_tps:.1f} | "
            f"{100 * med / roof_tps:.0f}% · {100 * med * r['decode_roofline_after_ms'] / 1000:.0f}% · "
            f"{_percent_spread(r['decode_paired_shares'])} · {_percent_spread(r['decode_step_paired_shares'])} · "
            f"{_percent_quartiles(r['decode_step_probe_shares'])} | "
            f"{r['prefill']['tok_per_s']:.0f} | "
            f"{statistics.median(r['prefill']['ttft_s']):.2f} | {r['nll']:.4f} | {nll_delta} | {agree} |"
        )
    return "\n".join(lines)


def _percent_spread(shares: list[float]) -> str:
    if not shares:
        return "—"
    return f"{100 * statistics.median(shares):.0f}% ({100 * min(shares):.0f}–{100 * max(shares):.0f}%)"


def _percent_quartiles(shares: list[float]) -> str:
    if not shares:
        return "—"
    q1, median, q3 = statistics.quantiles(shares, n=4) if len(shares) > 1 else shares * 3
    return f"{100 * median:.0f}% ({100 * q1:.0f}–{100 * q3:.0f}%)"


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(tokens, reference))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) / len(b) for a, b in zip(tokens, reference)]
    return f"{same}/{len(reference)} identical, {100 * statistics.mean(prefix):.0f}% of tokens"


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results if r["spec"]["engine"] == "runner"]
    models = sorted({r["spec"]["model"] for r in runs})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in (r for r in runs if r["spec"]["model"] == model):
            for context, style in zip(sorted(r["curve"]["ms"], key=int), ("-", "--")):
                ks = sorted(int(k) for k in r["curve"]["ms"][context])
                line, = ax.plot(ks, [r["curve"]["ms"][context][str(k)] for k in ks], style, marker="o",
                                label=f"{_fmt(r)} ctx {context}")
                ax.plot(ks, [r["roofline_ms"][context][str(k)] for k in ks], ":", color=line.get_color(),
                        label=f"roofline {_fmt(r)} ctx {context}")
        ax.set(title=model, xlabel="k new tokens in one forward", ylabel="ms per forward", xscale="log", yscale="log")
        ax.set_xticks(list(DEFAULT_KS), [str(k) for k in DEFAULT_KS])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
