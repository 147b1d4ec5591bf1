"""Self-distillation data for draft heads: what the target computes on a corpus, cached on disk.

The corpus is text on every machine with Python: the standard library's own source files (code,
docstrings, comments), in a seeded order, plus continuations the target itself generates for
chat-style requests about them (its own way of writing, which is what heads must predict). The
target reads it in chunks; each chunk's shard holds its token ids and the target's final hidden
states (bfloat16). Shards that exist are kept, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import random
import sysconfig
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdec.models.decoder import Decoder, hidden_states


@dataclass(frozen=True)
class CorpusConfig:
    corpus_tokens: int = 60_000  # tokens of standard-library source the target reads
    generated_tokens: int = 4_096  # tokens the target writes itself, about that source
    chunk_tokens: int = 512  # one forward (and one shard) each
    seed: int = 0

    def __post_init__(self) -> None:
        if self.corpus_tokens < 0 or self.generated_tokens < 0:
            raise ValueError("corpus_tokens and generated_tokens must be >= 0")
        if self.corpus_tokens + self.generated_tokens == 0:
            raise ValueError("the training corpus is empty: give corpus_tokens or generated_tokens")
        if self.chunk_tokens < 16:
            raise ValueError(f"chunk_tokens must be >= 16, got {self.chunk_tokens}")


def source_files(seed: int) -> list[Path]:
    """The standard library's .py files, in an order fixed by `seed`."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    files = [f for f in files if "site-packages" not in f.parts and "test" not in f.parts]
    random.Random(seed).shuffle(files)
    return files


def source_chunks(tokenizer: Any, config: CorpusConfig) -> Iterator[list[int]]:
    """Chunks of tokenized source, each from one file, `corpus_tokens` in all."""
    left = config.corpus_tokens
    for path in source_files(config.seed):
        if left <= 0:
            return
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text)["input_ids"]
        for start in range(0, len(ids), config.chunk_tokens):
            chunk = ids[start : start + config.chunk_tokens][:left]
            if len(chunk) >= 16:
                left -= len(chunk)
                yield chunk
            if left <= 0:
                return


def generation_requests(tokenizer: Any, config: CorpusConfig, count: int) -> list[str]:
    """Chat-style requests about standard-library snippets (the files after the ones the corpus starts with)."""
    asks = ("Explain what this code does.", "Write a short docstring for this code.", "Suggest one improvement to this code.",
            "Write a unit test for this code.")
    requests = []
    for i, path in enumerate(reversed(source_files(config.seed))):
        if len(requests) == count:
            break
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        if len(lines) < 8:
            continue
        snippet = "\n".join(lines[len(lines) // 3 : len(lines) // 3 + 12])
        content = f"{asks[i % len(asks)]}\n\n```python\n{snippet}\n```"
        if getattr(tokenizer, "chat_template", None):
            content = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                    tokenize=False)
        requests.append(content)
    return requests


def write_shards(llm: Any, directory: Path, config: CorpusConfig, layers: tuple[int, ...] = ()) -> list[Path]:
    """Shards of (token ids, hidden states) under `directory`: the corpus chunks, then the generated texts (request and
    continuation, whose hidden states cover both); with `layers`, also those layers' outputs ("aux", for EAGLE-3).
    Existing shards are kept where they hold what is asked."""
    directory.mkdir(parents=True, exist_ok=True)
    model, tokenizer = llm.engine.model, llm.get_tokenizer()
    chunks = list(source_chunks(tokenizer, config))
    if config.generated_tokens:
        chunks += _generated(llm, tokenizer, directory, config)
    paths = []
    for index, chunk in enumerate(tqdm(chunks, desc="target hidden states", unit="chunk")):
        path = directory / f"shard_{index:05d}.safetensors"
        if not path.exists() or (layers and _shard_layers(path) != layers):
            hidden, aux = hidden_states(model, chunk, config.chunk_tokens, layers)
            tensors = {"token_ids": torch.tensor(chunk), "hidden": hidden.to(torch.bfloat16).contiguous()}
            if aux is not None:
                tensors |= {"aux": aux.to(torch.bfloat16).contiguous(), "aux_layers": torch.tensor(layers)}
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            tmp.rename(path)
        paths.append(path)
    return paths


def _shard_layers(path: Path) -> tuple[int, ...]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as shard:
        return tuple(shard.get_tensor("aux_layers").tolist()) if "aux_layers" in shard.keys() else ()


def _generated(llm: Any, tokenizer: Any, directory: Path, config: CorpusConfig) -> list[list[int]]:
    """The target's own continuations (temperature 0.7, 256 tokens each), kept in `generated.pt` once written."""
    from specdec.config import SamplingParams

    path = directory / "generated.pt"
    if path.exists():
        return torch.load(path)
    per_request = 256
    requests = [llm.encode_prompt(text)[1] for text in generation_requests(tokenizer, config, -(-config.generated_tokens // per_request))]
    params = SamplingParams(temperature=0.7, max_tokens=per_request, seed=config.seed)
    outputs = llm.generate([{"prompt_token_ids": r} for r in requests], params)
    texts = [r + list(o.outputs[0].token_ids) for r, o in zip(requests, outputs)]
    torch.save(texts, path)
    return texts


def load_shards(paths: list[Path]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids [n], hidden states [n, H] float32) per shard."""
    shards = []
    for path in paths:
        tensors = load_file(str(path))
        shards.append((tensors["token_ids"], tensors["hidden"].float()))
    return shards


def load_aux(paths: list[Path]) -> list[torch.Tensor]:
    """Each shard's layer outputs [n, layers · H] float32 (shards written with `layers`)."""
    return [load_file(str(path))["aux"].float() for path in paths]


def frequent_tokens(shards: list[tuple[torch.Tensor, torch.Tensor]], size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the corpus, ascending (a reduced output vocabulary for heads)."""
    counts = Counter()
    for token_ids, _ in shards:
        counts.update(token_ids.tolist())
    return torch.tensor(sorted(token for token, _ in counts.most_common(size)))
