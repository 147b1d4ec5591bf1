"""Training multi-token prediction modules on a frozen target (DeepSeek-V3's sequential MTP, on a CPU).

The corpus and the target's final hidden states are the shared shards (training/data.py). Per chunk,
module k's row p reads token p + k and h_{k−1}(p) (h_0: the target's feature plus EAGLE's uniform
noise), with module k's attention (models/mtp.py), and is trained towards the target's distribution
of token p + k + 1 (its LM head on its feature at p + k): soft cross-entropy over a reduced vocabulary
(the corpus's most frequent tokens), through the frozen LM-head rows. The modules train together,
the gradient of module k flowing into the ones before (DeepSeek), each module's loss weighing 1/K.

Each module starts as "the hidden state passes through" (input projection = identity on the hidden
half, the residual branches' output matrices zero). Resumable after a finished epoch (training/run.py);
the modules go to the directory in `MtpModules`' layout with `training.json` (settings, loss per epoch,
per module the held-out top-1 / top-5 agreement with the target's own next token).
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
from specdec.models.mtp import MtpConfig, MtpModules
from specdec.training.data import CorpusConfig
from specdec.training.run import Shard, TrainingRun, distillation_data


@dataclass(frozen=True)
class MtpTrainingConfig:
    num_modules: int = 2  # draft depth: module k guesses the k-th token
    intermediate_size: int | None = 2048  # each module's MLP width (None: the target's); EAGLE's measured choice
    vocab_size: int = 32_768  # the output vocabulary: the corpus's most frequent tokens; 0 = all
    epochs: int = 4
    batch_chunks: int = 1
    learning_rate: float = 5e-4
    noise: float = 0.1  # uniform noise on the target's features, ± this
    held_out: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_modules < 1 or self.epochs < 1 or self.batch_chunks < 1:
            raise ValueError("num_modules, epochs and batch_chunks must be >= 1")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1 (or None: the target's), got {self.intermediate_size}")
        if self.vocab_size < 0 or not 0 <= self.held_out < 1 or self.learning_rate <= 0 or self.noise < 0:
            raise ValueError("vocab_size >= 0, held_out in [0, 1), learning_rate > 0 and noise >= 0 are needed")


def new_modules(target: Decoder, config: MtpTrainingConfig, vocab: torch.Tensor | None, base_model: str) -> MtpModules:
    """Fresh modules that pass the hidden state through (module docstring)."""
    t = target.config
    modules = MtpModules(MtpConfig(t.hidden_size, config.intermediate_size or t.intermediate_size, t.num_heads,
                                   t.num_kv_heads, t.head_dim, t.rms_norm_eps, fc_bias=False, base_model=base_model,
                                   num_modules=config.num_modules), vocab)
    h = t.hidden_size
    with torch.no_grad():
        for module in modules.layers:
            module.input_proj.weight.zero_()
            module.input_proj.weight[:, :h].copy_(torch.eye(h))
            module.o_proj.weight.zero_()
            module.down_proj.weight.zero_()
    return modules


def _batch(shards: list[Shard], indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, T], features [B, T, H] and lengths [B]."""
    length = max(len(shards[i][0]) for i in indices)
    tokens = torch.zeros(len(indices), length, dtype=torch.long)
    features = torch.zeros(len(indices), length, shards[indices[0]][1].shape[1])
    for b, i in enumerate(indices):
        token_ids, hidden = shards[i]
        tokens[b, : len(token_ids)], features[b, : len(token_ids)] = token_ids, hidden
    return tokens, features, torch.tensor([len(shards[i][0]) for i in indices])


def _module_rows(modules: MtpModules, target: Decoder, embed: torch.Tensor, tokens: torch.Tensor,
                 features: torch.Tensor, lengths: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per module k, its valid outputs h_k(p) and the target features f(p + k) whose distribution they aim at."""
    t = tokens.shape[1]
    cos, sin = target.rope(torch.arange(t))
    rows, hidden = [], features
    positions = torch.arange(t)[None]
    for k, module in enumerate(modules.layers, start=1):
        embeds = F.pad(embed[tokens[:, k:]], (0, 0, 0, k))  # row p: token p + k
        hidden = module(embeds, hidden, cos.float(), sin.float(), k)
        valid = positions < (lengths[:, None] - k)  # token p + k + 1's distribution exists: p + k ≤ n − 1
        wanted = F.pad(features[:, k:], (0, 0, 0, k))
        rows.append((hidden[valid], wanted[valid]))
    return rows


def train_mtp(llm: Any, out: Path, corpus: CorpusConfig, config: MtpTrainingConfig, data: Path | None = None) -> dict:
    """MTP modules for `llm`'s target, written to `out` (corpus shards in `data`, default out/data); returns the
    training report."""
    target = llm.engine.model
    shards = distillation_data(llm, data or out / "data", corpus, config.vocab_size, config.held_out)
    train = [s for s in shards.train if len(s[0]) > config.num_modules]
    held = [s for s in shards.held_out if len(s[0]) > config.num_modules] or train
    if not train:
        raise ValueError("the corpus has no training chunks: give more corpus_tokens")
    projection, embed = shards.projection, target.embed.float()
    torch.manual_seed(config.seed)
    modules = new_modules(target, config, shards.vocab, Path(llm.config.model).name)
    steps = math.ceil(len(train) / config.batch_chunks) * config.epochs
    report = {"settings": asdict(config), "corpus": asdict(corpus), "epochs": []}
    run = TrainingRun(out, modules, report, config.learning_rate, steps, warmup_steps=steps // 20)
    if run.first_epoch == 0:
        run.report["before"] = evaluate(modules, target, projection, embed, held)
    for epoch in range(run.first_epoch, config.epochs):
        start = time.perf_counter()
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(config.seed + epoch)).tolist()
        noise = torch.Generator().manual_seed(config.seed + 1000 + epoch)
        total = 0.0
        batches = [order[i : i + config.batch_chunks] for i in range(0, len(order), config.batch_chunks)]
        bar = tqdm(batches, desc=f"mtp modules, epoch {epoch + 1}/{config.epochs}", unit="batch")
        for step, indices in enumerate(bar):
            tokens, features, lengths = _batch(train, indices)
            noisy = features + (torch.rand(features.shape, generator=noise) * 2 - 1) * config.noise
            rows = _module_rows(modules, target, embed, tokens, noisy, lengths)
            loss = sum(_soft_cross_entropy(predicted, wanted, projection) for predicted, wanted in rows) / len(rows)
            run.step(loss, max_grad_norm=1.0)
            total += float(loss.detach())
            if step % 10 == 0:
                bar.set_postfix(loss=f"{total / (step + 1):.3f}")
        run.end_epoch(epoch, {"loss": total / len(batches), "seconds": time.perf_counter() - start})
    report = run.report
    report["after"] = evaluate(modules, target, projection, embed, held)
    modules.save(out)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _soft_cross_entropy(predicted: torch.Tensor, wanted: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        teacher = (wanted @ projection.T).softmax(-1)
    return F.cross_entropy(predicted @ projection.T, teacher)


@torch.no_grad()
def evaluate(modules: MtpModules, target: Decoder, projection: torch.Tensor, embed: torch.Tensor, shards: list[Shard],
             batch_chunks: int = 4) -> dict:
    """Per module: how often the target's own top token is the module's top-1 / among its top-5 (over the reduced
    vocabulary), and the loss, on the features the target computed (not the modules' own drafts)."""
    k = modules.config.num_modules
    top1, top5, loss, count = (torch.zeros(k) for _ in range(4))
    for start in range(0, len(shards), batch_chunks):
        tokens, features, lengths = _batch(shards, list(range(start, min(len(shards), start + batch_chunks))))
        for m, (predicted, wanted) in enumerate(_module_rows(modules, target, embed, tokens, features, lengths)):
            teacher, logits = wanted @ projection.T, predicted @ projection.T
            best = teacher.argmax(-1)
            top = logits.topk(5, dim=-1).indices
            top1[m] += (top[:, 0] == best).sum()
            top5[m] += (top == best[:, None]).any(-1).sum()
            loss[m] += float(F.cross_entropy(logits, teacher.softmax(-1))) * len(best)
            count[m] += len(best)
    count = count.clamp(min=1)
    return {"top1": (top1 / count).tolist(), "top5": (top5 / count).tolist(), "loss": (loss / count).tolist(),
            "positions": int(count[0])}
