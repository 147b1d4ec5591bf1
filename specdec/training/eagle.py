"""Training an EAGLE draft layer on a frozen target (EAGLE-1's recipe, on a CPU budget).

The corpus and the target's final hidden states come from the Medusa pipeline's shards (training/
data.py; a directory of them is shared between methods). For each chunk the layer reads row t =
(embedding of token t + 1, f_t + uniform noise) and is trained, causally over the chunk, towards the
target's next feature f_{t+1}: smooth-L1 on the feature, plus `token_weight` × the soft cross-entropy
between its LM-head distribution and the target's, both through the frozen LM head over a reduced
vocabulary (the corpus's most frequent tokens). The noise (EAGLE's ±0.1) makes the layer robust to
its own feature errors, which it reads back when drafting deeper.

The layer starts as "the feature passes through": the FC copies f_t and the residual branches' output
matrices are zero, so training starts from a layer that already predicts sensibly.
A run resumes after its last finished epoch (training/run.py); the layer goes to the directory in `EagleLayer`'s checkpoint layout, with `training.json`: the settings, the loss per epoch
and the top-1 / top-5 agreement of the draft's next token with the target's on held-out chunks.
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

from specdec.models.decoder import Decoder
from specdec.models.eagle import EagleConfig, EagleLayer
from specdec.training.data import CorpusConfig
from specdec.training.run import TrainingRun, distillation_data


@dataclass(frozen=True)
class EagleTrainingConfig:
    intermediate_size: int | None = None  # the layer's MLP width; None = the target's (~50M parameters for the 1.5B)
    vocab_size: int = 32_768  # the draft's output vocabulary: the corpus's most frequent tokens; 0 = all
    epochs: int = 4
    batch_chunks: int = 1  # corpus chunks (up to 512 positions each) per optimizer step
    learning_rate: float = 5e-4
    # the token loss's weight beside the feature regression: EAGLE's 0.1 gave held-out top-1 0.34 on the 1.5B after
    # 2 epochs, 1.0 gave 0.42 after 4 (BENCHMARKS.md, eagle)
    token_weight: float = 1.0
    noise: float = 0.1  # uniform noise on the input features, ± this
    held_out: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1 (or None: the target's), got {self.intermediate_size}")
        if self.epochs < 1 or self.batch_chunks < 1:
            raise ValueError("epochs and batch_chunks must be >= 1")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0 (0: the whole vocabulary), got {self.vocab_size}")
        if not 0 <= self.held_out < 1 or self.learning_rate <= 0 or self.token_weight < 0 or self.noise < 0:
            raise ValueError("held_out must be in [0, 1), learning_rate > 0, token_weight and noise >= 0")


def new_layer(target: Decoder, config: EagleTrainingConfig, vocab: torch.Tensor | None, base_model: str) -> EagleLayer:
    """A fresh layer that passes the feature through (module docstring)."""
    layer = EagleLayer(EagleConfig.for_target(target.config, config.intermediate_size, base_model), vocab)
    h = target.config.hidden_size
    with torch.no_grad():
        layer.fc.weight.zero_()
        layer.fc.weight[:, h:].copy_(torch.eye(h))
        layer.fc.bias.zero_()
        layer.o_proj.weight.zero_()
        layer.down_proj.weight.zero_()
    return layer


class _Chunks:
    """Training examples: per shard, inputs (token t + 1, f_t) and targets f_{t+1}, t = 0 … n − 2."""

    def __init__(self, shards: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.shards = [s for s in shards if len(s[0]) >= 2]

    def __len__(self) -> int:
        return len(self.shards)

    def positions(self) -> int:
        return sum(len(t) - 1 for t, _ in self.shards)

    def batch(self, indices: list[int], embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded [B, T, H] embeddings, input features, target features, and the valid-row mask [B, T]."""
        length = max(len(self.shards[i][0]) - 1 for i in indices)
        h = embed.shape[1]
        embeds, features, targets = (torch.zeros(len(indices), length, h) for _ in range(3))
        valid = torch.zeros(len(indices), length, dtype=torch.bool)
        for b, i in enumerate(indices):
            token_ids, hidden = self.shards[i]
            n = len(token_ids) - 1
            embeds[b, :n] = embed[token_ids[1:]]
            features[b, :n] = hidden[:-1]
            targets[b, :n] = hidden[1:]
            valid[b, :n] = True
        return embeds, features, targets, valid


def train_eagle(llm: Any, out: Path, corpus: CorpusConfig, config: EagleTrainingConfig, data: Path | None = None) -> dict:
    """An EAGLE layer for `llm`'s target, written to `out` (corpus shards in `data`, default out/data); returns the
    training report."""
    target = llm.engine.model
    shards = distillation_data(llm, data or out / "data", corpus, config.vocab_size, config.held_out)
    train, evaluation = _Chunks(shards.train), _Chunks(shards.held_out)
    if len(train) == 0:
        raise ValueError("the corpus has no training chunks: give more corpus_tokens")
    projection, embed = shards.projection, target.embed.float()

    torch.manual_seed(config.seed)
    layer = new_layer(target, config, shards.vocab, Path(llm.config.model).name)
    steps = math.ceil(len(train) / config.batch_chunks) * config.epochs
    report = {"settings": asdict(config), "corpus": asdict(corpus), "train_positions": train.positions(),
              "held_out_positions": evaluation.positions(), "epochs": []}
    run = TrainingRun(out, layer, report, config.learning_rate, steps, warmup_steps=steps // 20)
    checked = evaluation if len(evaluation) else train
    if run.first_epoch == 0:
        run.report["before"] = evaluate(layer, target, projection, embed, checked)
    for epoch in range(run.first_epoch, config.epochs):
        start = time.perf_counter()
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(config.seed + epoch)).tolist()
        batches = [order[i : i + config.batch_chunks] for i in range(0, len(order), config.batch_chunks)]
        noise = torch.Generator().manual_seed(config.seed + 1000 + epoch)
        totals = {"loss": 0.0, "feature": 0.0, "token": 0.0}
        bar = tqdm(batches, desc=f"eagle layer, epoch {epoch + 1}/{config.epochs}", unit="batch")
        for step, indices in enumerate(bar):
            embeds, features, targets, valid = train.batch(indices, embed)
            features = features + (torch.rand(features.shape, generator=noise) * 2 - 1) * config.noise
            feature_loss, token_loss = _losses(layer, target, projection, embeds, features, targets, valid)
            loss = feature_loss + config.token_weight * token_loss
            run.step(loss, max_grad_norm=1.0)
            for name, value in (("loss", loss), ("feature", feature_loss), ("token", token_loss)):
                totals[name] += float(value.detach())
            if step % 10 == 0:
                bar.set_postfix(loss=f"{totals['loss'] / (step + 1):.3f}", token=f"{totals['token'] / (step + 1):.3f}")
        run.end_epoch(epoch, {**{k: v / len(batches) for k, v in totals.items()}, "seconds": time.perf_counter() - start})
    report = run.report
    report["after"] = evaluate(layer, target, projection, embed, checked)
    layer.save(out)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _losses(layer: EagleLayer, target: Decoder, projection: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
            targets: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = target.rope(torch.arange(embeds.shape[1]))
    predicted = layer(embeds, features, cos.float(), sin.float())[valid]
    wanted = targets[valid]
    feature_loss = F.smooth_l1_loss(predicted, wanted)
    with torch.no_grad():
        teacher = (wanted @ projection.T).softmax(-1)
    token_loss = F.cross_entropy(predicted @ projection.T, teacher)
    return feature_loss, token_loss


@torch.no_grad()
def evaluate(layer: EagleLayer, target: Decoder, projection: torch.Tensor, embed: torch.Tensor, chunks: _Chunks,
             batch_chunks: int = 4) -> dict:
    """The draft's next token (from the target's true features) against the target's: top-1 / top-5 agreement over
    the draft's vocabulary, and the two losses."""
    top1 = top5 = count = 0
    feature = token = 0.0
    for start in range(0, len(chunks), batch_chunks):
        indices = list(range(start, min(len(chunks), start + batch_chunks)))
        embeds, features, targets, valid = chunks.batch(indices, embed)
        cos, sin = target.rope(torch.arange(embeds.shape[1]))
        predicted = layer(embeds, features, cos.float(), sin.float())[valid]
        wanted = targets[valid]
        teacher_logits, logits = wanted @ projection.T, predicted @ projection.T
        best = teacher_logits.argmax(-1)
        top = logits.topk(5, dim=-1).indices
        top1 += int((top[:, 0] == best).sum())
        top5 += int((top == best[:, None]).any(-1).sum())
        n = len(best)
        feature += float(F.smooth_l1_loss(predicted, wanted)) * n
        token += float(F.cross_entropy(logits, teacher_logits.softmax(-1))) * n
        count += n
    count = max(count, 1)
    return {"top1": top1 / count, "top5": top5 / count, "feature_loss": feature / count, "token_loss": token / count,
            "positions": count}
