"""Medusa heads (Cai et al. 2024): K light heads on the target's last hidden state.

Head k (0-based) reads the final hidden state h_t of the token at position t (the one whose LM-head
output is token t + 1) and predicts token t + k + 2, through L residual blocks h ← h + SiLU(W h + b)
and then the target's own LM head, frozen and shared by every head. The LM head may be cut to a
reduced output vocabulary (`vocab`: the most frequent token ids of the training corpus), which cuts
the cost of the heads' output layer from 151,936 rows to that many.

Checkpoint: a directory with `config.json` (`MedusaConfig`) and `medusa_heads.safetensors`, keys
`{k}.{l}.linear.weight` / `.bias` as in the original Medusa code's `ResBlock`s (`medusa_lm_head`),
and `vocab` where the vocabulary is reduced. An original Medusa checkpoint loads where it fits: its
residual blocks (its per-head output layers are dropped: here the heads share the target's).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdec.models import zoo
from specdec.models.decoder import Decoder

WEIGHTS_FILE = "medusa_heads.safetensors"
CONFIG_FILE = "config.json"
ORIGINAL_WEIGHTS_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    hidden_size: int
    num_layers: int = 1
    base_model: str = ""  # the target the heads were trained on (a check, not a path)

    def __post_init__(self) -> None:
        for name in ("num_heads", "hidden_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Medusa heads need {name} >= 1, got {value!r}")


class MedusaHeads(torch.nn.Module):
    """The heads' residual blocks (trainable) over an output projection that is not theirs: `project` maps
    their hidden states to logits (training: the frozen float LM-head rows; inference: the target's kernel)."""

    def __init__(self, config: MedusaConfig, vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        k, layers, h = config.num_heads, config.num_layers, config.hidden_size
        # zero blocks start every head as the identity: its first guess is the target's own next token
        self.weight = torch.nn.Parameter(torch.zeros(k, layers, h, h))
        self.bias = torch.nn.Parameter(torch.zeros(k, layers, h))
        self.register_buffer("vocab", None if vocab is None else vocab.long(), persistent=False)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[N, H] final hidden states → [N, K, H]: each head's state before the output projection."""
        heads = self.config.num_heads if num_heads is None else num_heads
        x = hidden[:, None, :].expand(-1, heads, -1)
        for layer in range(self.config.num_layers):
            w, b = self.weight[:heads, layer], self.bias[:heads, layer]
            x = x + F.silu(torch.einsum("nkh,kgh->nkg", x, w) + b)
        return x

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for k in range(self.config.num_heads):
            for layer in range(self.config.num_layers):
                tensors[f"{k}.{layer}.linear.weight"] = self.weight[k, layer].detach().contiguous()
                tensors[f"{k}.{layer}.linear.bias"] = self.bias[k, layer].detach().contiguous()
        if self.vocab is not None:
            tensors["vocab"] = self.vocab.contiguous()
        save_file(tensors, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "MedusaHeads":
        """specdec's layout, or the original Medusa code's (`medusa_num_heads` / `medusa_num_layers` in its config)."""
        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file():
            raise ValueError(f"{directory} holds no Medusa heads ({CONFIG_FILE} missing)")
        raw = json.loads((directory / CONFIG_FILE).read_text())
        tensors = _read_weights(directory)
        if "medusa_num_heads" in raw:  # the original layout: ResBlocks, then each head's own output layer
            first = tensors["0.0.linear.weight"]
            config = MedusaConfig(raw["medusa_num_heads"], first.shape[0], raw.get("medusa_num_layers", 1),
                                  raw.get("base_model_name_or_path", ""))
        else:
            config = MedusaConfig(**raw)
        heads = cls(config, tensors.get("vocab"))
        with torch.no_grad():
            for k in range(config.num_heads):
                for layer in range(config.num_layers):
                    heads.weight[k, layer] = tensors[f"{k}.{layer}.linear.weight"]
                    heads.bias[k, layer] = tensors[f"{k}.{layer}.linear.bias"]
        return heads


def default_heads_dir(model: str) -> Path:
    """Where `specdec train-heads --method medusa --model M` puts M's heads by default, and where they are looked
    for when `speculative_config` names no heads: `$SPECDEC_CACHE/heads/medusa/<M's name>`."""
    return zoo.cache_dir() / "heads" / "medusa" / Path(model).name


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / WEIGHTS_FILE).is_file():
        return load_file(str(directory / WEIGHTS_FILE))
    for name in ORIGINAL_WEIGHTS_FILES:
        path = directory / name
        if path.is_file():
            return load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(f"{directory} holds no Medusa weights ({WEIGHTS_FILE} missing)")


def output_embedding(target: Decoder, model_dir: Path) -> torch.Tensor:
    """The target's LM-head weight [vocab, hidden] in float32: the input embedding where tied, else read from the
    checkpoint (the loaded LM head may be int8)."""
    if target.config.tie_word_embeddings:
        return target.embed.float()
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if "lm_head.weight" in f.keys():
                return f.get_tensor("lm_head.weight").float()
    raise ValueError(f"{model_dir}: no lm_head.weight for the Medusa heads' output layer")
