"""Summaries and BENCHMARKS.md sections that a benchmark rewrites in place."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def publish(name: str, results: list[dict], table: str, out: Path, update: Path | None) -> None:
    """Save the raw results as JSON, print the table, and rewrite its BENCHMARKS.md section if asked."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    print(table)
    if update is not None:
        update_section(update, name, table)


def update_section(path: Path, name: str, body: str) -> None:
    """Replace the `<!-- bench:NAME -->` section of a Markdown file, or append it."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def environment_line() -> str:
    import os
    import platform
    import time

    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        cpu = names[0] if names else cpu
    isa = torch.backends.cpu.get_cpu_capability()
    return (f"torch {torch.__version__}, {cpu} ({os.cpu_count()} cores, torch kernels: {isa}), "
            f"{torch.get_num_threads()} threads available, {time.strftime('%Y-%m-%d')}.")


def same_greedy_tokens(a: list[list[int]], b: list[list[int]], eos: set[int]) -> str:
    """How many prompts give the same greedy tokens in two runs, compared up to the first EOS in
    either (an engine that suppresses EOS to reach a fixed length continues differently after it)."""

    def first_eos(tokens: list[int]) -> int:
        return next((i for i, t in enumerate(tokens) if t in eos), len(tokens))

    same = 0
    for x, y in zip(a, b):
        k = min(first_eos(x), first_eos(y))
        same += x[:k] == y[:k]
    return f"{same}/{len(a)}"
