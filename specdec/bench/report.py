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
