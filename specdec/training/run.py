"""What every draft-head training run shares: the distillation data, and a resumable optimizer state.

`distillation_data` splits the corpus shards (training/data.py) into training and held-out chunks and
picks the reduced output vocabulary with its frozen LM-head rows. `TrainingRun` owns the AdamW
optimizer and its cosine schedule (with a linear warm-up where asked), and `train_state.pt` in the
output directory: a run with the same settings and corpus resumes after its last finished epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.models.loader import resolve_model_dir
from specdec.models.medusa import output_embedding
from specdec.training.data import CorpusConfig, frequent_tokens, load_aux, load_shards, write_shards

STATE_FILE = "train_state.pt"
Shard = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DistillationData:
    train: list[Shard]
    held_out: list[Shard]  # the corpus's last chunks (empty when it has one chunk)
    vocab: torch.Tensor | None  # the reduced output vocabulary (ascending ids), None = all tokens
    projection: torch.Tensor  # the frozen LM-head rows of `vocab` [V', H], float32
    train_aux: list[torch.Tensor]  # per training shard, the asked layers' outputs side by side (none asked: empty)
    held_out_aux: list[torch.Tensor]


def distillation_data(llm: Any, directory: Path, corpus: CorpusConfig, vocab_size: int, held_out: float,
                      layers: tuple[int, ...] = ()) -> DistillationData:
    """The target's hidden states over the corpus (computed into `directory` once), split, with the vocabulary; with
    `layers`, those layers' outputs too (EAGLE-3)."""
    target = llm.engine.model
    paths = write_shards(llm, directory, corpus, layers)
    shards = load_shards(paths)
    aux = load_aux(paths) if layers else []
    split = len(shards) - (max(1, round(len(shards) * held_out)) if held_out and len(shards) > 1 else 0)
    train = shards[:split]
    vocab = frequent_tokens(train, vocab_size) if 0 < vocab_size < target.config.vocab_size else None
    weight = output_embedding(target, resolve_model_dir(llm.config.model))
    return DistillationData(train, shards[split:], vocab, weight if vocab is None else weight[vocab], aux[:split],
                            aux[split:])


class TrainingRun:
    """AdamW with a cosine schedule over `total_steps` (after `warmup_steps` of linear warm-up), resumable from
    `out/train_state.pt`. `report` starts with the settings and the corpus; `first_epoch` is where to go on."""

    def __init__(self, out: Path, module: torch.nn.Module, report: dict, learning_rate: float, total_steps: int,
                 warmup_steps: int = 0) -> None:
        self.out, self.module, self.report = out, module, report
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=learning_rate, weight_decay=0.0)
        warmup = max(1, warmup_steps)

        def factor(step: int) -> float:
            return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total_steps))))

        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.first_epoch = 0
        path = out / STATE_FILE
        if path.exists():
            state = torch.load(path, weights_only=False)
            if "module" in state and state["settings"] == report["settings"] and state["corpus"] == report["corpus"]:
                module.load_state_dict(state["module"])
                self.optimizer.load_state_dict(state["optimizer"])
                self.schedule.load_state_dict(state["schedule"])
                self.first_epoch, self.report = state["epoch"], state["report"]

    def step(self, loss: torch.Tensor, max_grad_norm: float | None = None) -> None:
        self.optimizer.zero_grad()
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_grad_norm)
        self.optimizer.step()
        self.schedule.step()

    def end_epoch(self, epoch: int, summary: dict) -> None:
        """Record the epoch and save the state to resume from."""
        self.report["epochs"].append(summary)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"settings": self.report["settings"], "corpus": self.report["corpus"], "module": self.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(), "epoch": epoch + 1,
                    "report": self.report}, self.out / STATE_FILE)
