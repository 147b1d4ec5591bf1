"""Prompt sets shipped as package data (`datasets/*.jsonl`: one {"id", "kind", "prompt"} per line)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def load_prompts(name: str) -> list[dict[str, Any]]:
    source = resources.files("specdec.bench") / "datasets" / f"{name}.jsonl"
    if not source.is_file():
        raise ValueError(f"no bench dataset {name!r}")
    return [json.loads(line) for line in source.read_text().splitlines() if line.strip()]


def render(prompt: dict[str, Any], tokenizer: Any) -> list[int]:
    """Token ids for a prompt: chat prompts go through the model's chat template."""
    if prompt["kind"] == "chat":
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt["prompt"])
