"""gamma_trace: the γ the adaptive controller verifies at each step, over one generation that
copies text and then writes freely.

The prompt asks the model to repeat a paragraph word for word, then to continue the story on its
own: while it copies, drafts are accepted and γ rises; once it writes freely, acceptance falls and
the controller drops γ, down to plain steps where drafting no longer pays. One run per method,
greedy, in this process; writes the PNG and a JSON of the per-step trace.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.models.zoo import DEFAULT_MODEL

PARAGRAPH = (
    "The harbour wakes before the town does. Gulls argue over the first boats, ropes creak against the "
    "bollards, and the smell of diesel and salt drifts up the narrow streets where the bakers are already "
    "at work. By seven the fish market is loud with prices, and by nine it is empty again, washed down "
    "with buckets of cold sea water."
)
PROMPT = (f"{PARAGRAPH}\n\nRepeat the paragraph above exactly, then continue the story with three more sentences "
          f"of your own about what happens at noon.")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec bench gamma_trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--methods", nargs="+", default=["draft_model", "ngram"], choices=["draft_model", "ngram", "suffix"])
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="γ_max")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("bench-results/gamma_trace"))
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default OUT/gamma_trace.png)")
    return p


def trace(llm: Any, prompt: str, max_tokens: int) -> tuple[list[dict[str, int]], str]:
    """Per engine step of a single greedy request: output position, γ verified, drafts accepted; and the text."""
    from specdec import SamplingParams

    steps, before, text = [], {"tokens": 0, "drafted": 0, "accepted": 0}, ""
    for out in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)):
        text = out.outputs[0].text
        spec = out.metrics.speculative_decoding
        now = {"tokens": len(out.outputs[0].token_ids), "drafted": spec["num_draft_tokens"],
               "accepted": spec["num_accepted_tokens"]}
        if now["tokens"] == before["tokens"]:
            continue  # a prefill chunk
        steps.append({"position": before["tokens"], "gamma": now["drafted"] - before["drafted"],
                      "accepted": now["accepted"] - before["accepted"]})
        before = now
    return steps, text


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    from specdec import LLM

    results = {}
    for method in args.methods:
        llm = LLM(args.model, max_num_seqs=1, speculative_config={
            "method": method, "num_speculative_tokens": args.num_speculative_tokens,
            **({"prompt_lookup_min": 2, "prompt_lookup_max": 5} if method == "ngram" else {})})
        prompt = llm.apply_chat_template([{"role": "user", "content": PROMPT}])
        steps, text = trace(llm, prompt, args.max_tokens)
        copied = _copied_prefix(text)
        results[method] = {"steps": steps, "text": text,
                           "copy_end_token": len(llm.get_tokenizer().encode(text[:copied])) if copied else None}
        print(f"[gamma_trace] {method}: {len(steps)} steps, γ per step {[s['gamma'] for s in steps]}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gamma_trace.json").write_text(json.dumps(results, indent=1))
    plot = args.plot or args.out / "gamma_trace.png"
    draw(results, plot)
    print(f"[gamma_trace] wrote {plot}")
    return 0


def draw(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.6 * len(results)), sharex=True, squeeze=False)
    for ax, (method, result) in zip(axes[:, 0], results.items()):
        steps = result["steps"]
        copied = result["copy_end_token"]
        x = [s["position"] for s in steps]
        ax.step(x, [s["gamma"] for s in steps], where="post", label="γ verified")
        ax.scatter(x, [s["accepted"] for s in steps], s=8, color="tab:green", label="accepted", zorder=3)
        if copied is not None:
            ax.axvline(copied, color="grey", linestyle="--", linewidth=1)
            ax.text(copied, ax.get_ylim()[1] * 0.9, " copy ends", color="grey", fontsize=8)
        ax.set_ylabel(method)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("output token")
    fig.suptitle("adaptive γ per step: copying a paragraph, then writing freely (greedy)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _copied_prefix(text: str) -> int:
    """How many characters of the output reproduce the paragraph (0 if the model did not copy it)."""
    return next((i for i, (a, b) in enumerate(zip(text, PARAGRAPH)) if a != b), min(len(text), len(PARAGRAPH)))
