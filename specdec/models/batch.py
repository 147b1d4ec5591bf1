"""The explicit input of one model forward: no global context is read inside the model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's part of a forward.

    `token_ids` are new tokens, written into KV slot `slot` after what it already holds.
    `positions` are their RoPE positions (default: consecutive after the cached tokens;
    a tree gives each node its depth). `mask` is an optional bool [n, cached + n] saying
    which cached-or-new tokens each new token may attend to (default: causal).
    `num_logits` asks for logits at the last that many tokens only (None: all of them).
    """

    slot: int
    token_ids: Sequence[int]
    positions: Sequence[int] | None = None
    mask: torch.Tensor | None = None
    num_logits: int | None = None


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] all sequences' new tokens, concatenated
    positions: torch.Tensor  # [T]
    slots: list[int]
    cache_lens: list[int]  # tokens already cached per sequence
    num_new: list[int]
    masks: list[torch.Tensor | None]
    logits_rows: torch.Tensor | None  # rows of T to compute logits for, sequence by sequence; None = all
    hidden_layers: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def build(
        cls,
        inputs: Sequence[SequenceInput],
        cache_lens: Sequence[int],
        *,
        hidden_layers: Sequence[int] = (),
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        if not inputs:
            raise ValueError("a forward needs at least one sequence")
        ids, positions, masks, num_new, rows = [], [], [], [], []
        for seq, cached in zip(inputs, cache_lens, strict=True):
            n = len(seq.token_ids)
            if n == 0:
                raise ValueError(f"sequence in slot {seq.slot} has no new tokens")
            pos = list(seq.positions) if seq.positions is not None else list(range(cached, cached + n))
            if len(pos) != n:
                raise ValueError(f"slot {seq.slot}: {n} tokens but {len(pos)} positions")
            if seq.mask is not None and tuple(seq.mask.shape) != (n, cached + n):
                raise ValueError(f"slot {seq.slot}: mask must be [{n}, {cached + n}], got {tuple(seq.mask.shape)}")
            if seq.num_logits is not None and not 0 < seq.num_logits <= n:
                raise ValueError(f"slot {seq.slot}: num_logits must be in [1, {n}], got {seq.num_logits}")
            start = len(ids)
            rows.extend(range(start + n - (seq.num_logits or n), start + n))
            ids.extend(seq.token_ids)
            positions.extend(pos)
            masks.append(seq.mask)
            num_new.append(n)
        every_row = len(rows) == len(ids)
        return cls(
            token_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slots=[s.slot for s in inputs],
            cache_lens=list(cache_lens),
            num_new=num_new,
            masks=masks,
            logits_rows=None if every_row else torch.tensor(rows, dtype=torch.long, device=device),
            hidden_layers=tuple(hidden_layers),
        )


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, vocab] float32, R = len(logits_rows) or T
    hidden: torch.Tensor  # [T, hidden] final hidden state (after the last norm)
    layer_hidden: dict[int, torch.Tensor]  # requested intermediate layers' outputs, [T, hidden]
