"""Training an EAGLE draft layer on a frozen target (EAGLE-1's losses, EAGLE-3's training-time test, on a CPU).

The corpus and the target's final hidden states come from the Medusa pipeline's shards (training/
data.py; a directory of them is shared between methods). For each chunk the layer reads row t =
(embedding of token t + 1, f_t + uniform noise) and is trained, causally over the chunk, towards the
target's next feature f_{t+1}: smooth-L1 on the feature, plus `token_weight` × the soft cross-entropy
between its LM-head distribution and the target's, both through the frozen LM head over a reduced
vocabulary (the corpus's most frequent tokens). Drafting deeper, the layer reads its own outputs: the
training-time test (`unroll_steps`) feeds them back as drafting does (EAGLE-3), each further step's
losses weighing 0.8× the one before. Without it, trained on true features and EAGLE's ±0.1 noise only,
the 1.5B's layer accepted 0.40 of depth-1 drafts but 0.02 at depth 2 (BENCHMARKS.md, eagle).

EAGLE-3 (`eagle3`, models/eagle3.py): the inputs are three target layers' outputs (written into the shards
beside the final hidden states), the layer's own head is trained with the token loss only (no feature
target), starting from the target's final norm and LM-head rows.

The layer starts as "the feature passes through": the FC copies f_t and the residual branches' output
matrices are zero. A run resumes after its last finished epoch (training/run.py); the layer goes to the
directory in `EagleLayer`'s checkpoint layout, with `training.json`: the settings, the loss per epoch
and, per draft depth, the top-1 / top-5 agreement of the draft's token with the target's on held-out
chunks.
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
from specdec.models.eagle import DraftBlock, EagleConfig, EagleLayer
from specdec.models.eagle3 import Eagle3Config, Eagle3Layer, default_aux_layers
from specdec.training.data import CorpusConfig
from specdec.training.run import TrainingRun, distillation_data

STEP_DECAY = 0.8  # an unrolled step's loss weight falls by this per step (EAGLE-3)


@dataclass(frozen=True)
class EagleTrainingConfig:
    # the layer's MLP width; None = the target's (8960 for the 1.5B: ~50M parameters). On the 1.5B with this corpus
    # 2048 matched it (held-out top-1 0.38 / 0.28 at depths 1 / 2 both) at half the draft cost and 2.3× faster training
    intermediate_size: int | None = 2048
    vocab_size: int = 32_768  # the draft's output vocabulary: the corpus's most frequent tokens; 0 = all
    epochs: int = 4
    batch_chunks: int = 1  # corpus chunks (up to 512 positions each) per optimizer step
    learning_rate: float = 5e-4
    # the token loss's weight beside the feature regression: EAGLE's 0.1 gave held-out top-1 0.34 on the 1.5B after
    # 2 epochs, 1.0 gave 0.42 after 4 (BENCHMARKS.md, eagle)
    token_weight: float = 1.0
    noise: float = 0.1  # uniform noise on the input features, ± this
    # the training-time test's depth: the layer also learns from its own outputs fed back, 1 + this many steps deep
    unroll_steps: int = 2
    held_out: float = 0.05
    seed: int = 0
    # EAGLE-3 (models/eagle3.py): read three target layers fused, own norm + head over the reduced vocabulary (from
    # the target's), trained on tokens only
    eagle3: bool = False

    def __post_init__(self) -> None:
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1 (or None: the target's), got {self.intermediate_size}")
        if self.epochs < 1 or self.batch_chunks < 1 or self.unroll_steps < 1:
            raise ValueError("epochs, batch_chunks and unroll_steps must be >= 1")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0 (0: the whole vocabulary), got {self.vocab_size}")
        if not 0 <= self.held_out < 1 or self.learning_rate <= 0 or self.token_weight < 0 or self.noise < 0:
            raise ValueError("held_out must be in [0, 1), learning_rate > 0, token_weight and noise >= 0")


def new_layer(target: Decoder, config: EagleTrainingConfig, vocab: torch.Tensor | None, base_model: str,
              projection: torch.Tensor) -> DraftBlock:
    """A fresh layer that passes the feature through (module docstring); EAGLE-3's passes the highest fused layer
    through and starts from the target's final norm and LM-head rows (an early exit at that layer)."""
    h = target.config.hidden_size
    if config.eagle3:
        layer = Eagle3Layer(Eagle3Config.for_target(target.config, config.intermediate_size, base_model,
                                                    draft_vocab_size=len(projection)), vocab)
    else:
        layer = EagleLayer(EagleConfig.for_target(target.config, config.intermediate_size, base_model), vocab)
    with torch.no_grad():
        layer.fc.weight.zero_()
        layer.fc.weight[:, -h:].copy_(torch.eye(h))
        if layer.fc.bias is not None:
            layer.fc.bias.zero_()
        layer.o_proj.weight.zero_()
        layer.down_proj.weight.zero_()
        if config.eagle3:
            final_norm = target.final_norm
            layer.norm.copy_(torch.ones(h) if final_norm is None else final_norm.float())
            layer.lm_head.weight.copy_(projection)
    return layer


def aux_layers(target: Decoder) -> tuple[int, ...]:
    """The target layers whose outputs EAGLE-3 fuses (the engine's index: a layer's output)."""
    return tuple(i - 1 for i in default_aux_layers(target.config.num_layers))


class _Chunks:
    """Training examples: per shard, inputs (token t + 1, the target's features at t: its final hidden state, or the
    fused layers' outputs) and targets f_{t+1} (final hidden states), t = 0 … n − 2."""

    def __init__(self, shards: list[tuple[torch.Tensor, torch.Tensor]], inputs: list[torch.Tensor] | None = None) -> None:
        inputs = inputs or [hidden for _, hidden in shards]
        self.shards = [(tokens, hidden, x) for (tokens, hidden), x in zip(shards, inputs) if len(tokens) >= 2]

    def __len__(self) -> int:
        return len(self.shards)

    def positions(self) -> int:
        return sum(len(t) - 1 for t, _, _ in self.shards)

    def batch(self, indices: list[int], embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded [B, T, ·] embeddings, input features, target features, and the valid-row mask [B, T]."""
        length = max(len(self.shards[i][0]) - 1 for i in indices)
        h, width = embed.shape[1], self.shards[indices[0]][2].shape[1]
        embeds, targets = (torch.zeros(len(indices), length, h) for _ in range(2))
        features = torch.zeros(len(indices), length, width)
        valid = torch.zeros(len(indices), length, dtype=torch.bool)
        for b, i in enumerate(indices):
            token_ids, hidden, inputs = self.shards[i]
            n = len(token_ids) - 1
            embeds[b, :n] = embed[token_ids[1:]]
            features[b, :n] = inputs[:-1]
            targets[b, :n] = hidden[1:]
            valid[b, :n] = True
        return embeds, features, targets, valid


def train_eagle(llm: Any, out: Path, corpus: CorpusConfig, config: EagleTrainingConfig, data: Path | None = None) -> dict:
    """An EAGLE layer for `llm`'s target, written to `out` (corpus shards in `data`, default out/data); returns the
    training report."""
    target = llm.engine.model
    layers = aux_layers(target) if config.eagle3 else ()
    shards = distillation_data(llm, data or out / "data", corpus, config.vocab_size, config.held_out, layers)
    train, evaluation = _Chunks(shards.train, shards.train_aux), _Chunks(shards.held_out, shards.held_out_aux)
    if len(train) == 0:
        raise ValueError("the corpus has no training chunks: give more corpus_tokens")
    projection, embed = shards.projection, target.embed.float()

    torch.manual_seed(config.seed)
    layer = new_layer(target, config, shards.vocab, Path(llm.config.model).name, projection)
    steps = math.ceil(len(train) / config.batch_chunks) * config.epochs
    report = {"settings": asdict(config), "corpus": asdict(corpus), "train_positions": train.positions(),
              "held_out_positions": evaluation.positions(), "epochs": []}
    run = TrainingRun(out, layer, report, config.learning_rate, steps, warmup_steps=steps // 20)
    checked = evaluation if len(evaluation) else train
    if run.first_epoch == 0:
        run.report["before"] = evaluate(layer, target, projection, embed, checked, config.unroll_steps)
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
            feature_loss, token_loss = _losses(layer, target, projection, embeds, features, targets, valid,
                                               config.unroll_steps)
            loss = feature_loss + config.token_weight * token_loss
            run.step(loss, max_grad_norm=1.0)
            for name, value in (("loss", loss), ("feature", feature_loss), ("token", token_loss)):
                totals[name] += float(value.detach())
            if step % 10 == 0:
                bar.set_postfix(loss=f"{totals['loss'] / (step + 1):.3f}", token=f"{totals['token'] / (step + 1):.3f}")
        run.end_epoch(epoch, {**{k: v / len(batches) for k, v in totals.items()}, "seconds": time.perf_counter() - start})
    report = run.report
    report["after"] = evaluate(layer, target, projection, embed, checked, config.unroll_steps)
    layer.save(out)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _step_rows(layer: DraftBlock, target: Decoder, embeds: torch.Tensor, features: torch.Tensor, targets: torch.Tensor,
               valid: torch.Tensor, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per unrolled step, the layer's valid outputs and the target features they guess (step s's row t: f_{t+s+1})."""
    length = embeds.shape[1]
    cos, sin = target.rope(torch.arange(length + steps - 1))
    outputs = layer.unrolled(embeds, features, cos.float(), sin.float(), steps)
    rows = []
    for step, predicted in enumerate(outputs):
        kept = F.pad(valid[:, step:], (0, step))  # row t is valid while f_{t+step+1} exists
        wanted = F.pad(targets[:, step:], (0, 0, 0, step))
        rows.append((predicted[kept], wanted[kept]))
    return rows


def _draft_logits(layer: DraftBlock, predicted: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """The draft's logits over the reduced vocabulary: EAGLE-3's own head, or the target's head on the guessed feature."""
    return layer.logits(predicted) if isinstance(layer, Eagle3Layer) else predicted @ projection.T


def _losses(layer: DraftBlock, target: Decoder, projection: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
            targets: torch.Tensor, valid: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature and token losses, step s weighing STEP_DECAY^s (EAGLE-3's 0.8); EAGLE-3 has no feature target."""
    feature_loss = token_loss = torch.zeros(())
    for step, (predicted, wanted) in enumerate(_step_rows(layer, target, embeds, features, targets, valid, steps)):
        weight = STEP_DECAY**step
        if not isinstance(layer, Eagle3Layer):
            feature_loss = feature_loss + weight * F.smooth_l1_loss(predicted, wanted)
        with torch.no_grad():
            teacher = (wanted @ projection.T).softmax(-1)
        token_loss = token_loss + weight * F.cross_entropy(_draft_logits(layer, predicted, projection), teacher)
    return feature_loss, token_loss


@torch.no_grad()
def evaluate(layer: DraftBlock, target: Decoder, projection: torch.Tensor, embed: torch.Tensor, chunks: _Chunks,
             steps: int, batch_chunks: int = 4) -> dict:
    """Per draft depth (depth 1 from the target's features, deeper from the layer's own): how often the target's own
    top token is the draft's top-1 / among its top-5 over the draft's vocabulary, and the two losses."""
    top1, top5, feature, token, count = (torch.zeros(steps) for _ in range(5))
    for start in range(0, len(chunks), batch_chunks):
        indices = list(range(start, min(len(chunks), start + batch_chunks)))
        embeds, features, targets, valid = chunks.batch(indices, embed)
        for step, (predicted, wanted) in enumerate(_step_rows(layer, target, embeds, features, targets, valid, steps)):
            teacher_logits, logits = wanted @ projection.T, _draft_logits(layer, predicted, projection)
            best = teacher_logits.argmax(-1)
            top = logits.topk(5, dim=-1).indices
            top1[step] += (top[:, 0] == best).sum()
            top5[step] += (top == best[:, None]).any(-1).sum()
            n = len(best)
            if not isinstance(layer, Eagle3Layer):  # EAGLE-3's outputs are not features
                feature[step] += float(F.smooth_l1_loss(predicted, wanted)) * n
            token[step] += float(F.cross_entropy(logits, teacher_logits.softmax(-1))) * n
            count[step] += n
    count = count.clamp(min=1)
    return {"top1": (top1 / count).tolist(), "top5": (top5 / count).tolist(), "feature_loss": (feature / count).tolist(),
            "token_loss": (token / count).tolist(), "positions": int(count[0])}
