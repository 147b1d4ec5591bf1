"""Quality check for lossy methods: code tasks with unit tests written for the project; a completion
passes if the first code block of its text, with the task's tests appended, runs without error."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

QUALITY_DATASET = "code_tests"  # rows carry "tests": Python asserts against the requested function
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The first fenced code block, or the whole text when there is none (a plain completion)."""
    match = _CODE_BLOCK.search(text)
    return match.group(1) if match else text


def passes_tests(text: str, tests: str, timeout_s: float = 10.0) -> bool:
    """Run the completion's code and the tests in a fresh, isolated interpreter."""
    with tempfile.TemporaryDirectory() as directory:
        script = Path(directory) / "candidate.py"
        script.write_text(extract_code(text) + "\n\n" + tests + "\n")
        try:
            done = subprocess.run([sys.executable, "-I", str(script)], cwd=directory, capture_output=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
