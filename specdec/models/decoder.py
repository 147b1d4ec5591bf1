"""One native decoder for the Llama family (Llama, Qwen2, Mistral), driven by its config.

Pre-norm blocks of RMSNorm → GQA attention with RoPE (optional q/k/v bias) → RMSNorm →
SwiGLU MLP; tied or untied output embedding. q/k/v and gate/up are fused into one
matrix each so a layer makes four matrix products. The forward takes an explicit
`ForwardBatch` of uneven sequences, each with its own KV slot and optional mask.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.kv_cache import KVCache
from specdec.models import kernels
from specdec.models.batch import ForwardBatch, ForwardOutput, SequenceInput
from specdec.models.linear import Linear

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
ROW_INVARIANT_TOKENS = 64


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, hf: Any) -> "DecoderConfig":
        if hf.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {hf.model_type!r} is not supported by the native decoder "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"only SwiGLU (silu) MLPs are supported, got {hf.hidden_act!r}")
        num_heads = hf.num_attention_heads
        return cls(
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=hf.rms_norm_eps,
            # Qwen2 always has q/k/v bias; Llama and Mistral say so in the config.
            attention_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=hf.max_position_embeddings,
        )


@dataclass
class LayerWeights:
    input_norm: torch.Tensor | None  # None: the layer reads its input unnormalized (EAGLE-1's draft layer)
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def rope_inverse_frequencies(hf_config: Any) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling for the config's RoPE type, as transformers defines them."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")


class Decoder:
    def __init__(
        self,
        config: DecoderConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor | None,
        lm_head: Linear,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        name: str = "decoder",
    ) -> None:
        self.name = name  # the checkpoint and weight format: what a measured cost curve is kept under
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.inv_freq = inv_freq.float()
        self.attention_scaling = attention_scaling
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos and sin of positions 0 … L − 1
        self.dtype = embed.dtype
        self.device = embed.device
        # a sequence feeding at most this many causal tokens in a forward gets each token's row exactly as if
        # it were fed alone (the engine keeps speculative steps within it)
        self.row_invariant_tokens = ROW_INVARIANT_TOKENS
        # those rows' RoPE, KV write and attention: specdec's kernel (AVX-512 or AVX2), one call per layer, where it
        # runs; else PyTorch ops and an attention call per row
        cpu_float32 = self.device.type == "cpu" and self.dtype == torch.float32
        self.row_attention = kernels.row_attention() if cpu_float32 else None
        # RMSNorm (after the residual add) and SwiGLU: specdec's kernel (AVX-512 or AVX2) where it runs, else PyTorch
        # ops
        self.norm_swiglu = kernels.norm_swiglu() if cpu_float32 else None
        # the layers of a forward whose rows all take the row attention kernel, in one C++ call over the same kernels
        # (bitwise the Python loop's), where every product has a C++ entry; else the Python loop
        self.layer_stack = self._layer_stack()

    def _layer_stack(self) -> Any | None:
        loop = kernels.layer_loop() if self.row_attention is not None and self.norm_swiglu is not None else None
        entries = [[linear.entry for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)] for layer in self.layers]
        if loop is None or any(entry is None for row in entries for entry in row):
            return None
        layers = [(layer.input_norm, qkv, o, layer.post_norm, gate_up, down, layer.gate_up.applies_swiglu)
                  for layer, (qkv, o, gate_up, down) in zip(self.layers, entries)]
        return loop.LayerStack(layers, self.final_norm, self.config.rms_norm_eps, self._attention_scale(),
                               self.row_attention.attend_entry, self.norm_swiglu.rms_norm_entry,
                               self.norm_swiglu.add_rms_norm_entry, self.norm_swiglu.swiglu_entry)

    def _attention_scale(self) -> float:
        return 1.0 / self.config.head_dim**0.5  # as PyTorch's attention

    def new_kv_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_slots, max_len, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, inputs_embeds: torch.Tensor | None = None,
                qkv_offset: torch.Tensor | None = None) -> ForwardOutput:
        """`inputs_embeds` [T, hidden], where given, replaces the token embeddings (a draft layer's fused inputs);
        `qkv_offset` [T, q + 2 kv] is added to the first layer's q/k/v projections (EAGLE-3's layer attends over
        concat(norm(embedding), norm(hidden)) with the hidden as its residual: the embedding's share of the product).
        Where every sequence's rows attend each as its own step (decoding, verification, trees), the layers run in one
        C++ call (`layer_stack`, kernels/layer_loop.cpp) over the kernels the Python loop below calls, bitwise alike:
        each product evicts the caches, and ~200 Python steps a forward each began cold (measured: BENCHMARKS.md)."""
        for slot, n in zip(batch.slots, batch.num_new):
            cache.check_room(slot, n)
        x = F.embedding(batch.token_ids.to(self.device), self.embed) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rope(batch.positions)
        masks = [self._row_masks(m, cached, n) for m, cached, n in zip(batch.masks, batch.cache_lens, batch.num_new)]
        if self.layer_stack is not None and qkv_offset is None and all(map(self._by_row, masks)):
            sequences = [(n, cached, mask or [], cache.layer_views(slot))
                         for slot, cached, n, mask in zip(batch.slots, batch.cache_lens, batch.num_new, masks)]
            hidden_layers = sorted({i for i in batch.hidden_layers if 0 <= i < len(self.layers)})  # as the loop meets them
            hidden, hidden_states = self.layer_stack.forward(x, cos, sin, sequences, hidden_layers)
            return self._finish(batch, cache, hidden, dict(zip(hidden_layers, hidden_states)))
        layer_hidden: dict[int, torch.Tensor] = {}
        # each sequence's per-layer KV views for the row attention kernel, looked up once per forward
        slot_views = [cache.layer_views(slot) for slot in batch.slots] if self.row_attention is not None else []
        # a layer's MLP output joins the residual stream in the next norm's kernel call (28 fewer ops in the 1.5B's
        # forward); `mlp` is that output until then, None once added
        mlp: torch.Tensor | None = None
        with self._attention_backends():
            for index, layer in enumerate(self.layers):
                x, h = self._residual_norm(x, mlp, layer.input_norm)
                qkv = layer.qkv(h) if index or qkv_offset is None else layer.qkv(h) + qkv_offset
                attention = self._attention(qkv, cos, sin, index, batch, masks, cache, slot_views)
                x, h = self._add_rms_norm(x, layer.o(attention), layer.post_norm)
                gate_up = layer.gate_up(h)
                mlp = layer.down(gate_up if layer.gate_up.applies_swiglu else self._swiglu(gate_up))
                if index in batch.hidden_layers:
                    x, mlp = x + mlp, None
                    layer_hidden[index] = x
        return self._finish(batch, cache, self._residual_norm(x, mlp, self.final_norm)[1], layer_hidden)

    def _finish(self, batch: ForwardBatch, cache: KVCache, hidden: torch.Tensor,
                layer_hidden: dict[int, torch.Tensor]) -> ForwardOutput:
        """The forward's output from the final norm's `hidden`, the sequences' new tokens kept in the cache."""
        for slot, n in zip(batch.slots, batch.num_new):
            cache.advance(slot, n)
        rows = hidden if batch.logits_rows is None else hidden[batch.logits_rows.to(self.device)]
        # logits go to the CPU, where sampling and verification run with per-request generators
        logits = self.lm_head(rows).float().cpu()
        return ForwardOutput(logits=logits, hidden=hidden, layer_hidden=layer_hidden)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.norm_swiglu is not None:
            return self.norm_swiglu.rms_norm(x, weight, self.config.rms_norm_eps)
        return _rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its RMSNorm)."""
        if self.norm_swiglu is not None:
            return self.norm_swiglu.add_rms_norm(x, delta, weight, self.config.rms_norm_eps)
        x = x + delta
        return x, _rms_norm(x, weight, self.config.rms_norm_eps)

    def _residual_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                       weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its RMSNorm) with delta and the norm each optional (None: nothing to add, or no norm)."""
        if weight is None:
            x = x if delta is None else x + delta
            return x, x
        if delta is None:
            return x, self._rms_norm(x, weight)
        return self._add_rms_norm(x, delta, weight)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up of the fused gate/up projection's output."""
        if self.norm_swiglu is not None:
            return self.norm_swiglu.swiglu(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def _by_row(mask: list[list[int]] | torch.Tensor | None) -> bool:
        """Whether a sequence's rows each attend as their own one-token step (`_row_masks`' None and lists); else (its
        additive mask) in one attention call."""
        return not isinstance(mask, torch.Tensor)

    def _attention_backends(self) -> contextlib.AbstractContextManager:
        """On CUDA, PyTorch's attention without its cuDNN backend: cuDNN builds a plan for every new key length,
        and decoding meets a new length every step (measured on an H200: the first pass over new lengths ran
        ~4× slower than a repeat of the same lengths)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] for position ids [T] (for `apply_rope`): rows of a table of every position up to
        the largest seen (doubled as needed, from 1024), so a decoding step gathers two rows where computing them took
        eight small ops (~0.14 ms a forward, measured in the 1.5B's). The positions' largest is read where they are (the
        batch's on the CPU: no device sync)."""
        end = int(positions.max()) + 1 if len(positions) else 0
        if self._rope_table is None or len(self._rope_table[0]) < end:
            size = max(1024, 1 << max(end - 1, 0).bit_length())
            self._rope_table = self._rope_values(torch.arange(size, device=self.device))
        cos, sin = self._rope_table
        index = positions.to(self.device)
        return cos[index], sin[index]

    def _rope_values(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(self.dtype), (emb.sin() * self.attention_scaling).to(self.dtype)

    def _row_masks(self, mask: torch.Tensor | None, cached: int, n: int) -> list[list[int]] | torch.Tensor | None:
        """How `_attention` treats a sequence's rows: None (causal rows: within `row_invariant_tokens`, or any number
        where `row_attention` runs, prefill chunks too); for a tree within `row_invariant_tokens` (each row sees every
        cached token, itself, and earlier new tokens only), one entry per row: [] where the row sees exactly its own
        prefix, else the indices of the new tokens it sees (a node's ancestors, then itself); for any other mask, or
        a prefill chunk without `row_attention`, one attention call's additive mask (`_additive_mask`)."""
        if mask is None:
            by_row = n <= self.row_invariant_tokens or self.row_attention is not None
            return None if by_row else self._additive_mask(_causal(cached, n, self.device))
        mask = mask.to(self.device)
        new = mask[:, cached:]
        tree_like = bool(mask[:, :cached].all()) and bool(new.diagonal().all()) and not new.triu(diagonal=1).any()
        if n > self.row_invariant_tokens or not tree_like:
            return self._additive_mask(mask)
        seen = [row.nonzero().flatten().tolist() for row in new]
        return [[] if len(s) == i + 1 else s for i, s in enumerate(seen)]

    def _additive_mask(self, seen: torch.Tensor) -> torch.Tensor:
        """seen [n, L] bool → one attention call's mask [group · n, L] (queries are laid out [kv_head, group · n]):
        0 where a row sees a key, −inf elsewhere, in the model's dtype. That is what PyTorch's attention makes of a bool
        mask in every call; made once a forward instead, a prefill chunk's layers skip it (bitwise the same outputs;
        CPU, a 512-token chunk after 512: 13.2 ms a layer against 15.7 with the bool mask made per layer)."""
        additive = torch.zeros(seen.shape, dtype=self.dtype, device=self.device).masked_fill_(~seen, float("-inf"))
        return additive.repeat(self.config.num_heads // self.config.num_kv_heads, 1)

    def _attention(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        masks: list[list[list[int]] | torch.Tensor | None],
        cache: KVCache,
        slot_views: list[list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> torch.Tensor:
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        group = c.num_heads // c.num_kv_heads
        outputs, start = [], 0
        for index, (slot, cached, n, mask) in enumerate(zip(batch.slots, batch.cache_lens, batch.num_new, masks)):
            end = start + n
            # Decode/verify sizes: each token attends alone to exactly the keys a one-token step would see, in the
            # order that step would have them, so its result is bitwise the step's, whatever else shares the forward
            # (batch invariance: with exact int8 sums this makes plain and speculative greedy decoding
            # token-identical). A tree node off the first branch sees the cache, then its ancestors and itself.
            # Prefill chunks too, where the row kernel runs (a block of rows shares each key block it reads); else they
            # take one attention call (a call per row would re-read the KV cache).
            by_row = self._by_row(mask)
            if by_row and self.row_attention is not None:
                keys, values = slot_views[index][layer]  # the kernel writes the new tokens' K and V
                scale = self._attention_scale()
                # one sequence (plain decoding, verification) takes the tensors whole: no slicing per layer
                whole = end == len(qkv) and not start
                rows = (qkv, cos, sin) if whole else (qkv[start:end], cos[start:end], sin[start:end])
                outputs.append(self.row_attention.attend(*rows, keys, values, cached, mask or [], scale))
                start = end
                continue
            # q and k heads side by side get their rotation in one pass
            rows = qkv[start:end]
            qk = apply_rope(rows[:, : q_size + kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim),
                            cos[start:end], sin[start:end])
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = rows[:, q_size + kv_size :].view(n, c.num_kv_heads, c.head_dim)
            cache.write(layer, slot, cached, k.transpose(0, 1), v.transpose(0, 1))
            keys, values = cache.view(layer, slot, cached + n)
            if by_row:
                outputs.append(self._sdpa_rows(q, k, v, mask or [[]] * n, keys, values, cache, layer, slot, cached))
            else:
                # GQA without repeating K/V: the `group` query heads sharing a KV head become extra query rows.
                queries = q.view(n, c.num_kv_heads, group, c.head_dim).permute(1, 2, 0, 3)
                out = F.scaled_dot_product_attention(
                    queries.reshape(1, c.num_kv_heads, group * n, c.head_dim), keys[None], values[None], attn_mask=mask
                )
                outputs.append(out.view(c.num_kv_heads, group, n, c.head_dim).permute(2, 0, 1, 3).reshape(n, -1))
            start = end
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _sdpa_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paths: list[list[int]],
                   keys: torch.Tensor, values: torch.Tensor, cache: KVCache, layer: int, slot: int, cached: int) -> torch.Tensor:
        """Attention of rows that must each be their own one-token step, by a PyTorch call per row (4-D inputs: its
        fused CPU kernel), where `row_attention` doesn't run; `paths` as `_row_masks` gives them. A tree node's path is
        copied to follow the cache before its call, and the new tokens' own layout is written back after."""
        c = self.config
        n, group = len(paths), c.num_heads // c.num_kv_heads
        rows: list[torch.Tensor | None] = [None] * n
        for i in sorted(range(n), key=lambda i: bool(paths[i])):  # rows that see their own prefix first
            length = i + 1
            if paths[i]:
                path = paths[i]
                cache.write(layer, slot, cached, k[path].transpose(0, 1), v[path].transpose(0, 1))
                length = len(path)
            # token i's query heads are contiguous in q: [1, kv_heads, group, head_dim] without a copy
            rows[i] = F.scaled_dot_product_attention(
                q[i].view(1, c.num_kv_heads, group, c.head_dim),
                keys[None, :, : cached + length], values[None, :, : cached + length],
            )
        if any(paths):
            cache.write(layer, slot, cached, k.transpose(0, 1), v.transpose(0, 1))
        return torch.cat(rows).view(n, -1)  # [n, kv_heads · group · head_dim]


def hidden_states(model: Decoder, token_ids: list[int], chunk_tokens: int,
                  layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's final hidden states [n, H] of a token sequence (one KV slot, fed `chunk_tokens` at a time), and
    where `layers` are given, those layers' outputs side by side [n, len(layers) · H]."""
    cache = model.new_kv_cache(1, len(token_ids))
    slot = cache.allocate()
    parts, aux = [], []
    for start in range(0, len(token_ids), chunk_tokens):
        inputs = [SequenceInput(slot, token_ids[start : start + chunk_tokens], num_logits=1)]
        out = model.forward(ForwardBatch.build(inputs, [start], hidden_layers=layers), cache)
        parts.append(out.hidden)
        if layers:
            aux.append(torch.cat([out.layer_hidden[i] for i in layers], dim=-1))
    return torch.cat(parts), torch.cat(aux) if layers else None


def _causal(cached: int, n: int, device: torch.device) -> torch.Tensor:
    """[n, cached + n] bool: new token i sees the cached tokens and new tokens 0..i."""
    return torch.ones(n, cached + n, dtype=torch.bool, device=device).tril(diagonal=cached)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op: the same float32 formula
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, head_dim] rotated by `Decoder.rope`'s cos and sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
