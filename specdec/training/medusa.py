"""Training Medusa heads by self-distillation (Medusa-2's recipe, on a CPU budget).

The target reads the corpus once (training/data.py); then head k learns, from the target's final
hidden state h_t alone, the target's own distribution of token t + k + 2, which the target gave at
position t + k + 1: soft cross-entropy against softmax(LM head · h_{t+k+1}), through the frozen LM
head shared by all heads. Over a reduced vocabulary (the corpus's most frequent tokens) both sides
are softmaxes over those tokens only, which cuts the output layer, the bulk of the cost, ~5×.

A run resumes from `train_state.pt` in its directory (saved after every epoch); the heads go to
the directory in `MedusaHeads`' checkpoint layout, with `training.json`: the settings, the loss per
epoch and each head's top-1 / top-5 agreement with the target on held-out chunks.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.models.medusa import MedusaConfig, MedusaHeads
from specdec.training.data import CorpusConfig
from specdec.training.run import TrainingRun, distillation_data


@dataclass(frozen=True)
class MedusaTrainingConfig:
    num_heads: int = 4
    num_layers: int = 1
    vocab_size: int = 32_768  # the heads' output vocabulary: the corpus's most frequent tokens; 0 = all
    epochs: int = 2
    batch_size: int = 128
    learning_rate: float = 1e-3
    held_out: float = 0.05  # the corpus's last chunks, kept out of training for the accuracy report
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("num_heads, num_layers, epochs and batch_size must be >= 1")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0 (0: the whole vocabulary), got {self.vocab_size}")
        if not 0 <= self.held_out < 1 or self.learning_rate <= 0:
            raise ValueError("held_out must be in [0, 1) and learning_rate > 0")


class _Positions:
    """Every (shard) position t that has all K targets t + 1 … t + K in its chunk, as rows of one hidden tensor."""

    def __init__(self, shards: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int) -> None:
        self.hidden = torch.cat([h for _, h in shards]) if shards else torch.zeros(0, 0)
        starts, offset = [], 0
        for token_ids, _ in shards:
            n = len(token_ids)
            starts.append(torch.arange(offset, offset + max(0, n - num_heads)))
            offset += n
        self.rows = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.long)
        self.num_heads = num_heads

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h_t [B, H] and the teachers' hidden states h_{t+k+1} [B, K, H]."""
        offsets = torch.arange(1, self.num_heads + 1)
        return self.hidden[rows], self.hidden[rows[:, None] + offsets]


def train_medusa(llm: Any, out: Path, corpus: CorpusConfig, config: MedusaTrainingConfig, data: Path | None = None) -> dict:
    """Heads for `llm`'s target, written to `out` (corpus shards in `data`, default out/data); returns the training
    report."""
    target = llm.engine.model
    shards = distillation_data(llm, data or out / "data", corpus, config.vocab_size, config.held_out)
    train, evaluation = _Positions(shards.train, config.num_heads), _Positions(shards.held_out, config.num_heads)
    if len(train.rows) == 0:
        raise ValueError("the corpus has no training positions: give more corpus_tokens")
    projection = shards.projection

    torch.manual_seed(config.seed)
    heads = MedusaHeads(MedusaConfig(config.num_heads, target.config.hidden_size, config.num_layers,
                                     base_model=Path(llm.config.model).name), shards.vocab)
    steps_per_epoch = math.ceil(len(train.rows) / config.batch_size)
    report = {"settings": asdict(config), "corpus": asdict(corpus), "train_positions": len(train.rows),
              "held_out_positions": len(evaluation.rows), "epochs": []}
    run = TrainingRun(out, heads, report, config.learning_rate, steps_per_epoch * config.epochs)
    checked = evaluation if len(evaluation.rows) else train
    if run.first_epoch == 0:
        run.report["before"] = evaluate(heads, projection, checked)
    for epoch in range(run.first_epoch, config.epochs):
        start = time.perf_counter()
        order = train.rows[torch.randperm(len(train.rows), generator=torch.Generator().manual_seed(config.seed + epoch))]
        total = 0.0
        bar = tqdm(order.split(config.batch_size), desc=f"medusa heads, epoch {epoch + 1}/{config.epochs}", unit="batch")
        for step, rows in enumerate(bar):
            loss = _loss(heads, projection, *train.batch(rows))
            run.step(loss)
            total += float(loss.detach())
            if step % 20 == 0:
                bar.set_postfix(loss=f"{total / (step + 1):.3f}")
        run.end_epoch(epoch, {"train_loss": total / steps_per_epoch, "seconds": time.perf_counter() - start})
    report = run.report
    report["after"] = evaluate(heads, projection, checked)
    heads.save(out)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _loss(heads: MedusaHeads, projection: torch.Tensor, hidden: torch.Tensor, teachers: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        target_probs = (teachers @ projection.T).softmax(-1)  # [B, K, V']
    logits = heads(hidden) @ projection.T
    return F.cross_entropy(logits.flatten(0, 1), target_probs.flatten(0, 1))


@torch.no_grad()
def evaluate(heads: MedusaHeads, projection: torch.Tensor, positions: _Positions, batch_size: int = 256) -> dict:
    """Per head: soft cross-entropy against the target, and how often the target's top token (over the heads'
    vocabulary) is the head's top-1 / among its top-5."""
    k = heads.config.num_heads
    loss, top1, top5, count = torch.zeros(k), torch.zeros(k), torch.zeros(k), 0
    for rows in positions.rows.split(batch_size):
        hidden, teachers = positions.batch(rows)
        teacher_logits = teachers @ projection.T
        logits = heads(hidden) @ projection.T
        loss += -(teacher_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).sum(0)
        best = teacher_logits.argmax(-1)  # [B, K]
        top = logits.topk(5, dim=-1).indices
        top1 += (top[..., 0] == best).sum(0)
        top5 += (top == best[..., None]).any(-1).sum(0)
        count += len(rows)
    count = max(count, 1)
    return {"loss": (loss / count).tolist(), "top1": (top1 / count).tolist(), "top5": (top5 / count).tolist(),
            "positions": count}
