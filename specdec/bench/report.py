"""Summaries and BENCHMARKS.md sections that a benchmark rewrites in place."""

from __future__ import annotations

import re
import statistics
from pathlib import Path


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def update_section(path: Path, name: str, body: str) -> None:
    """Replace the `<!-- bench:NAME -->` section of a Markdown file, or append it."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def environment_line() -> str:
    import platform
    import time

    import torch

    cpu = platform.processor() or platform.machine()
    return f"torch {torch.__version__}, {cpu}, {torch.get_num_threads()} threads available, {time.strftime('%Y-%m-%d')}."


def same_greedy_tokens(a: list[list[int]], b: list[list[int]], eos: set[int]) -> str:
    """How many prompts give the same greedy tokens in two runs, compared up to the first EOS
    (engines that ignore EOS differently may diverge after it)."""

    def until_eos(tokens: list[int]) -> list[int]:
        return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)

    same = sum(until_eos(x) == until_eos(y) for x, y in zip(a, b))
    return f"{same}/{len(a)}"
