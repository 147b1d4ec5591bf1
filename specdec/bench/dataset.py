"""Prompt sets: shipped as package data (`datasets/NAME.jsonl`), or a user's own JSONL file.

One {"id", "kind", "prompt"} per line; `kind` is "chat" (through the model's chat template) or
"completion" (raw text), "chat" when absent; `id` defaults to the line number. Rows may carry
"tests" (the quality set, `code_tests`: Python asserts the completion's code must pass).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

# code completion, chat/instruction, edit/rewrite (copy-heavy), long-context QA/summaries, creative (high entropy)
DATASETS = ("code", "chat", "edit", "long_context", "creative")


def load_prompts(name: str) -> list[dict[str, Any]]:
    """A shipped set by name, or a path to a .jsonl file."""
    if name.endswith(".jsonl"):
        source = Path(name)
        if not source.is_file():
            raise ValueError(f"no prompt file {name!r}")
        text = source.read_text()
    else:
        shipped = resources.files("specdec.bench") / "datasets" / f"{name}.jsonl"
        if not shipped.is_file():
            raise ValueError(f"no bench dataset {name!r}; shipped: {', '.join(DATASETS)}, or a path to a .jsonl file")
        text = shipped.read_text()
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} line {number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{name} line {number}: needs a non-empty string 'prompt'")
        kind = row.get("kind", "chat")
        if kind not in ("chat", "completion"):
            raise ValueError(f"{name} line {number}: kind must be 'chat' or 'completion', got {kind!r}")
        prompts.append({"id": str(row.get("id", number)), "kind": kind, "prompt": row["prompt"],
                        **({"tests": row["tests"]} if "tests" in row else {})})
    if not prompts:
        raise ValueError(f"{name} holds no prompts")
    return prompts


def dataset_label(name: str) -> str:
    """A short name for reports: the set's name, or a user file's stem."""
    return Path(name).stem if name.endswith(".jsonl") else name


def render(prompt: dict[str, Any], tokenizer: Any) -> list[int]:
    """Token ids for a prompt: chat prompts go through the model's chat template."""
    if prompt["kind"] == "chat":
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt["prompt"])
