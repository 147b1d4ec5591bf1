"""EAGLE-3's draft layer (Li et al. 2025, arXiv:2503.01840): fused target layers, its own head.

What differs from EAGLE-1/2 (models/eagle.py):
- At a real position t the draft reads the outputs of three target layers (low, mid, high) side by
  side [3H], fused by `fc` (3H → H) into g_t; deeper drafts read the layer's own output instead.
- The decoder layer attends over concat(input_layernorm(embed(token t + 1)), hidden_norm(g_t)) [2H]
  (q/k/v take 2H inputs) while its residual stream is g_t.
- No feature target: the output goes through the layer's own `norm` and `lm_head` over a draft
  vocabulary, and is trained on tokens only (with the training-time test). `d2t` maps a draft id to
  its target id (target = draft + d2t[draft]), `t2d` marks the target ids the draft can propose.

The layers are named as the official checkpoints do: `eagle_aux_hidden_state_layer_ids` (i: the input
of target layer i, i.e. the output of layer i − 1; default (2, L/2, L − 3), vLLM's and SGLang's for
Llama-style targets). Checkpoint: `config.json` (`LlamaForCausalLMEagle3`, `draft_vocab_size`,
`eagle_config`) and `model.safetensors` with `fc.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`: an official EAGLE-3
directory for a Llama or Qwen2 target loads (`pytorch_model.bin` too).

In the engine (`Eagle3Drafter`) the layer is a one-layer `Decoder` whose residual input is g (or the
layer's own output), with the embedding's half of q/k/v added as `qkv_offset`; its final norm and
LM head are the layer's, and each row hands on its output before that norm.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.kv_cache import KVCache
from specdec.models import zoo
from specdec.models.batch import ForwardBatch, ForwardOutput
from specdec.models.decoder import Decoder, DecoderConfig
from specdec.models.eagle import (
    CONFIG_FILE,
    DraftBlock,
    EagleConfig,
    block_shape,
    block_weights,
    kernel_of,
    load_parameters,
    one_layer_decoder,
    read_weights,
    save_checkpoint,
)
from specdec.models.linear import LinearKernel

PREFIX = "midlayer."


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The official default `eagle_aux_hidden_state_layer_ids` (2, L // 2, L − 3), kept within a small model's
    layers 1 … L − 1."""
    return tuple(min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


@dataclass(frozen=True)
class Eagle3Config(EagleConfig):
    fc_bias: bool = False  # EAGLE-3's fc has none
    draft_vocab_size: int = 0  # rows of its LM head
    vocab_size: int = 0  # the target's
    # eagle_aux_hidden_state_layer_ids: the inputs of these target layers; () = the default for the target's depth
    # (official checkpoints leave it to the serving engine)
    aux_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"an EAGLE-3 layer needs 0 < draft_vocab_size <= vocab_size, got {self.draft_vocab_size} "
                             f"and {self.vocab_size}")
        if self.aux_layers and (len(self.aux_layers) != 3 or min(self.aux_layers) < 1):
            raise ValueError(f"EAGLE-3 fuses three target layers (ids >= 1), got {self.aux_layers!r}")

    @classmethod
    def for_target(cls, target: DecoderConfig, intermediate_size: int | None = None, base_model: str = "",
                   draft_vocab_size: int | None = None, aux_layers: tuple[int, ...] | None = None) -> "Eagle3Config":
        return cls(target.hidden_size, intermediate_size or target.intermediate_size, target.num_heads,
                   target.num_kv_heads, target.head_dim, target.rms_norm_eps, fc_bias=False, base_model=base_model,
                   draft_vocab_size=draft_vocab_size or target.vocab_size, vocab_size=target.vocab_size,
                   aux_layers=aux_layers or default_aux_layers(target.num_layers))

    def to_hf(self) -> dict:
        return {**super().to_hf(), "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": self.draft_vocab_size,
                "vocab_size": self.vocab_size,
                **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}} if self.aux_layers else {})}


class Eagle3Layer(DraftBlock):
    """The trainable EAGLE-3 layer (module docstring). `vocab`: the draft vocabulary's target ids, ascending."""

    def __init__(self, config: Eagle3Config, vocab: torch.Tensor | None = None) -> None:
        h = config.hidden_size
        super().__init__(config, 2 * h)
        self.fc = torch.nn.Linear(3 * h, h, bias=False)
        self.input_norm = torch.nn.Parameter(torch.ones(h))  # on the token embedding
        self.hidden_norm = torch.nn.Parameter(torch.ones(h))
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.lm_head = torch.nn.Linear(h, config.draft_vocab_size, bias=False)
        if vocab is None:
            vocab = torch.arange(config.draft_vocab_size)
        if len(vocab) != config.draft_vocab_size:
            raise ValueError(f"a draft vocabulary of {len(vocab)} ids for draft_vocab_size {config.draft_vocab_size}")
        self.register_buffer("vocab", vocab.long(), persistent=False)

    def step_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        x = self.fc(hidden) if step == 0 else hidden
        normed = (F.rms_norm(embeds, (c.hidden_size,), self.input_norm, c.rms_norm_eps),
                  F.rms_norm(x, (c.hidden_size,), self.hidden_norm, c.rms_norm_eps))
        return x, torch.cat(normed, dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's logits over its vocabulary from the layer's outputs."""
        c = self.config
        return self.lm_head(F.rms_norm(hidden, (c.hidden_size,), self.norm, c.rms_norm_eps))

    def official_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {"fc.weight": self.fc.weight, **self.block_parameters(PREFIX),
                PREFIX + "input_layernorm.weight": self.input_norm, PREFIX + "hidden_norm.weight": self.hidden_norm,
                "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight}

    def token_maps(self) -> dict[str, torch.Tensor]:
        """d2t (draft id → target id − draft id) and t2d (target id → whether the draft has it), as checkpoints hold."""
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[self.vocab] = True
        return {"d2t": self.vocab - torch.arange(len(self.vocab)), "t2d": t2d}

    def save(self, directory: Path) -> None:
        save_checkpoint(directory, self.official_parameters(), self.token_maps(), self.config.to_hf())

    @classmethod
    def load(cls, directory: Path) -> "Eagle3Layer":
        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file():
            raise ValueError(f"{directory} holds no EAGLE-3 draft layer ({CONFIG_FILE} missing)")
        raw = json.loads((directory / CONFIG_FILE).read_text())
        tensors = read_weights(directory)
        if PREFIX + "self_attn.q_proj.weight" not in tensors or "fc.weight" not in tensors:
            raise ValueError(f"{directory}: not an EAGLE-3 draft layer (no fc.weight / {PREFIX}self_attn.q_proj.weight)")
        draft_vocab = raw.get("draft_vocab_size") or raw["vocab_size"]
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        config = Eagle3Config(
            **block_shape(raw), fc_bias=False, attention_bias=PREFIX + "self_attn.q_proj.bias" in tensors,
            base_model=raw.get("base_model", ""), draft_vocab_size=draft_vocab, vocab_size=raw["vocab_size"],
            aux_layers=tuple(aux or ()))
        d2t = tensors.get("d2t")
        vocab = None if d2t is None else torch.arange(len(d2t)) + d2t.long()
        layer = cls(config, vocab)
        load_parameters(directory, layer.official_parameters(), tensors)
        return layer


class Eagle3Drafter:
    """The EAGLE-3 layer in the engine's kernels (module docstring); the same interface as `EagleDrafter`."""

    def __init__(self, layer: Eagle3Layer, target: Decoder, kernel: LinearKernel, weight_format: str) -> None:
        c = layer.config
        if c.hidden_size != target.config.hidden_size or c.vocab_size != target.config.vocab_size:
            raise ValueError(f"the EAGLE-3 layer reads hidden size {c.hidden_size} and vocabulary {c.vocab_size}, the "
                             f"target has {target.config.hidden_size} and {target.config.vocab_size}: it was trained "
                             "for another model")
        aux = c.aux_layers or default_aux_layers(target.config.num_layers)
        if max(aux) >= target.config.num_layers:
            raise ValueError(f"the EAGLE-3 layer reads the inputs of target layers {aux}, the target has "
                             f"{target.config.num_layers}")
        self.feature_layers = tuple(i - 1 for i in aux)  # the engine's index: the output of the layer before
        self.vocab = layer.vocab.to(target.device)
        self.embed = target.embed
        self.eps = c.rms_norm_eps
        linear = kernel_of(target, kernel)
        h = c.hidden_size
        self.fc = linear(layer.fc.weight)
        qkv = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
        self.qkv_embed = linear(qkv[:, :h])  # the embedding's half of q/k/v, added as the first layer's offset
        self.embed_norm = layer.input_norm.detach().to(target.device, target.dtype)
        weights = block_weights(layer, linear, layer.hidden_norm, slice(h, 2 * h))
        name = f"eagle3-{h}x{c.intermediate_size}-v{c.draft_vocab_size}-{weight_format}"
        self.decoder = one_layer_decoder(target, c, weights, layer.norm, linear(layer.lm_head.weight), name)

    def forward(self, batch: ForwardBatch, cache: KVCache, token_ids: torch.Tensor, features: torch.Tensor) -> ForwardOutput:
        """Rows reading token ids [T] (token t + 1) with the target's fused layers [T, 3H] or the layer's own outputs
        [T, H]; the output's `hidden` is the layer's output before its norm (what a deeper draft reads)."""
        embeds = F.embedding(token_ids.to(self.embed.device), self.embed)
        features = features.to(embeds.dtype)
        x = self.fc(features) if features.shape[-1] != embeds.shape[-1] else features
        offset = self.qkv_embed(F.rms_norm(embeds, (embeds.shape[-1],), self.embed_norm, self.eps))
        out = self.decoder.forward(dataclasses.replace(batch, hidden_layers=(0,)), cache, x, qkv_offset=offset)
        return dataclasses.replace(out, hidden=out.layer_hidden[0])

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows of the draft's logits → target token ids."""
        return self.vocab[indices.to(self.vocab.device)].to(indices.device)


def default_eagle3_dir(model: str) -> Path:
    """Where `specdec train-heads --method eagle3 --model M` puts M's layer, and where it is looked for by default."""
    return zoo.cache_dir() / "heads" / "eagle3" / Path(model).name
