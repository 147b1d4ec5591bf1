"""Logits → the distribution actually sampled from, and drawing from it.

`processed_probs` applies each row's SamplingParams (temperature → top-k → top-p → min-p);
a greedy row becomes a one-hot at its argmax, so verification treats greedy and sampled
rows alike. Each row draws with its own request's randomness, so a seeded request gives
the same tokens whatever else is in the batch: a token the target samples itself (a plain
step, or verifying a deterministic draft) from the uniform of its position
(`position_uniform`), so also whatever γ or lookup drafted it; a draft model's tokens and
their rejection sampling from the request's generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdec.config import SamplingParams


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension, as `torch.argmax` gives it (the first index of the maximum, a NaN above
    everything). CPU float32 rows take NumPy's vectorized argmax: PyTorch's took ~96 µs per row of a 151,936-token
    vocabulary against NumPy's ~8.5 µs (Zen 5 host), and a greedy speculative step takes one per drafted token and one
    per verified row."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    return torch.as_tensor(np.asarray(logits.detach().numpy().argmax(axis=-1)), dtype=torch.long)  # 0-dim for one row


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] float logits → [rows, vocab] probabilities, one SamplingParams per row."""
    if logits.shape[0] != len(params):
        raise ValueError(f"{logits.shape[0]} logit rows but {len(params)} sampling params")
    logits = logits.float()
    probs = torch.empty_like(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = torch.tensor(greedy)
        probs[rows] = 0.0
        probs[rows, greedy_tokens(logits[rows])] = 1.0
    if sampled:
        rows = torch.tensor(sampled)
        chosen = [params[i] for i in sampled]
        temperature = torch.tensor([p.temperature for p in chosen], dtype=torch.float32)
        row_probs = torch.softmax(logits[rows] / temperature[:, None], dim=-1)
        if any(p.filters_vocabulary for p in chosen):
            row_probs = _filter(row_probs, chosen)
        probs[rows] = row_probs
    return probs


def _filter(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab).expand_as(sorted_probs)
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
    sorted_probs = sorted_probs.masked_fill(rank >= top_k[:, None], 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill((mass_before >= top_p[:, None]) & (rank > 0), 0.0)  # top_p may round to 0
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    # min-p: drop tokens below min_p × the most likely token's probability
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    sorted_probs = sorted_probs.masked_fill(sorted_probs < min_p[:, None] * sorted_probs[:, :1], 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], num_top: int) -> list[dict[int, float]]:
    """Per row: the chosen token's log-probability under the unprocessed logits (as vLLM reports them),
    and the `num_top` most likely tokens' (the chosen token first)."""
    logprobs = logits.float().log_softmax(dim=-1)
    top = logprobs.topk(num_top, dim=-1) if num_top else None
    rows = []
    for i, token in enumerate(tokens):
        row = {token: float(logprobs[i, token])}
        if top is not None:
            for value, index in zip(top.values[i].tolist(), top.indices[i].tolist()):
                row.setdefault(index, value)
        rows.append(row)
    return rows


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row, drawn with that row's generator."""
    if probs.shape[0] != len(generators):
        raise ValueError(f"{probs.shape[0]} rows but {len(generators)} generators")
    return torch.tensor([draw(row, g) for row, g in zip(probs, generators)], dtype=torch.long)


DRAW_BLOCK = 1024


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Index i with probability probs[i] / Σ probs (probs [V] ≥ 0, not all 0), from the generator's next uniform."""
    return draw_at(probs, float(torch.rand((), generator=generator, dtype=torch.float64)))


def draw_at(probs: torch.Tensor, uniform: float) -> int:
    """The index where `uniform` ∈ [0, 1) falls in probs' CDF (inverse CDF in float64: a cumulative sum over block
    sums, then one inside the chosen block), so i with probability probs[i] / Σ probs for a uniform draw. ~0.04 ms
    for 152k tokens where torch.multinomial takes ~2.3 ms (it was ~7% of a decoding step)."""
    n = probs.shape[0]
    full = n - n % DRAW_BLOCK
    sums = probs[:full].view(-1, DRAW_BLOCK).sum(1, dtype=torch.float64)
    if full < n:
        sums = torch.cat([sums, probs[full:].sum(dtype=torch.float64)[None]])
    cdf = sums.cumsum(0)
    target = uniform * cdf[-1]
    # right=True: the first cumulative sum above the target, so zero-probability entries are never chosen
    block = min(int(torch.searchsorted(cdf, target, right=True)), len(cdf) - 1)
    start = block * DRAW_BLOCK
    within = probs[start : start + DRAW_BLOCK].double().cumsum(0)
    if block:
        within += cdf[block - 1]
    index = int(torch.searchsorted(within, target, right=True))
    if index == len(within):  # the block's own sum rounded a hair above its cumulative sum: its last nonzero entry
        index = int(torch.nonzero(probs[start : start + DRAW_BLOCK])[-1])
    return start + index


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) fixed by (seed, position), independent across both (splitmix64's finalizer, whose
    outputs for consecutive inputs pass BigCrush): the draw of a sequence's token at `position`, whichever step
    samples it."""
    return (_splitmix64(_splitmix64(seed & _MASK64) + position) >> 11) / float(1 << 53)


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
