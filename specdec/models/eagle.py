"""EAGLE's draft network (Li et al. 2024, arXiv:2401.15077): one decoder layer over the target's features.

At position t the draft reads f_t, the target's final hidden state there (its LM head turns it into
token t + 1), and the embedding of token t + 1: x_t = FC(concat(embed(token t + 1), f_t)), then one
Llama-style decoder layer (no input norm, as EAGLE-1's first layer) gives f̂_{t+1}, a guess of the
target's next feature; the target's own LM head on f̂_{t+1} gives the draft's distribution of token
t + 2. Deeper drafts feed f̂ back in place of f (feature-level autoregression). The embedding and the
LM head are the target's, frozen; the LM head may be cut to a reduced vocabulary (`vocab`: the most
frequent token ids of the training corpus), whose cost otherwise dominates a draft step on a CPU.

`EagleLayer` is the trainable module; `EagleDrafter` runs it with the engine's kernels and KV cache
(a one-layer `Decoder` fed `inputs_embeds`). Checkpoint: a directory with `config.json` (Hugging
Face keys, as the official EAGLE checkpoints have) and `model.safetensors` with the official names
(`fc.weight`, `layers.0.self_attn.q_proj.weight`, …, `layers.0.post_attention_layernorm.weight`);
an official EAGLE-1/2 checkpoint (`pytorch_model.bin` or `model.safetensors`) loads for a Llama or
Qwen2 target: which biases and norms exist is read from the weights' names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.models import zoo
from specdec.kv_cache import KVCache
from specdec.models.batch import ForwardBatch, ForwardOutput
from specdec.models.decoder import Decoder, DecoderConfig, LayerWeights, apply_rope
from specdec.models.linear import Linear, LinearKernel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ORIGINAL_WEIGHTS_FILE = "pytorch_model.bin"
PREFIX = "layers.0."


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    fc_bias: bool = True  # EAGLE-1's FC has a bias
    attention_bias: bool = False  # q/k/v biases (Qwen2-style draft layers have them)
    input_norm: bool = False  # EAGLE-1's layer reads the FC output unnormalized
    base_model: str = ""  # the target it was trained on (a check, not a path)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"an EAGLE layer needs {name} >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def for_target(cls, target: DecoderConfig, intermediate_size: int | None = None, base_model: str = "") -> "EagleConfig":
        """The target's attention shape; the MLP as wide as the target's unless `intermediate_size` says."""
        return cls(target.hidden_size, intermediate_size or target.intermediate_size, target.num_heads, target.num_kv_heads,
                   target.head_dim, target.rms_norm_eps, base_model=base_model)

    def to_hf(self) -> dict:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
                "num_hidden_layers": 1, "bias": self.fc_bias, "base_model": self.base_model}


class DraftBlock(torch.nn.Module):
    """The one Llama-style decoder layer an EAGLE draft runs, its attention reading `attention_width` inputs; what
    feeds it at each draft step (`step_inputs`) is the variant's. `unrolled` runs it causally over whole sequences
    (training, reference)."""

    def __init__(self, config: EagleConfig, attention_width: int) -> None:
        super().__init__()
        self.config = c = config
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = torch.nn.Linear(attention_width, q, bias=c.attention_bias)
        self.k_proj = torch.nn.Linear(attention_width, kv, bias=c.attention_bias)
        self.v_proj = torch.nn.Linear(attention_width, kv, bias=c.attention_bias)
        self.o_proj = torch.nn.Linear(q, h, bias=False)
        self.gate_proj = torch.nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(c.intermediate_size, h, bias=False)
        self.post_norm = torch.nn.Parameter(torch.ones(h))

    def step_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, the attention's input) of rows reading token embeddings and `hidden` (step 0: the
        target's features; later steps: the layer's own outputs)."""
        raise NotImplementedError

    def unrolled(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 steps: int) -> list[torch.Tensor]:
        """EAGLE-3's training-time test: the layer drafting `steps` deep on its own outputs, every row at once.

        Step s's row t sits at position t + s and reads token t + s + 1's embedding (`embeds` shifted by s) with step
        s − 1's output at row t (step 0: the target's features at t); it attends to step 0's rows ≤ t (real features)
        and to row t of steps 1 … s, exactly what a depth-(s + 1) draft after position t sees. cos/sin cover
        positions 0 … T + steps − 2. Returns each step's output [B, T, H] (before any final norm)."""
        c = self.config
        t = embeds.shape[1]
        outputs, keys, values = [], [], []
        hidden = features
        for step in range(steps):
            shifted = embeds if step == 0 else F.pad(embeds[:, step:], (0, 0, 0, step))
            x, h = self.step_inputs(shifted, hidden, step)
            q, k, v = self.attention_inputs(h, cos[step : step + t], sin[step : step + t])
            keys.append(k)
            values.append(v)
            if step == 0:
                attention = F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
            else:
                scale = c.head_dim**-0.5
                prefix = (q @ keys[0].transpose(-1, -2)) * scale
                prefix = prefix.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
                own = torch.stack([(q * key).sum(-1) * scale for key in keys[1:]], dim=-1)  # [B, heads, T, step]
                weights = torch.cat((prefix, own), dim=-1).softmax(-1)
                attention = weights[..., :t] @ values[0]
                attention = attention + sum(weights[..., t + u, None] * value for u, value in enumerate(values[1:]))
            hidden = self.block_output(x, attention)
            outputs.append(hidden)
        return outputs

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [B, heads, T, head_dim] of the attention's input h [B, T, ·] (k, v repeated over each group)."""
        c = self.config
        b, t, _ = h.shape
        group = c.num_heads // c.num_kv_heads
        q = apply_rope(self.q_proj(h).view(b, t, c.num_heads, c.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(self.k_proj(h).view(b, t, c.num_kv_heads, c.head_dim), cos, sin).transpose(1, 2)
        v = self.v_proj(h).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def block_output(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The residual stream x [B, T, H] after the attention's output [B, heads, T, head_dim] and the MLP."""
        c = self.config
        b, t, _ = x.shape
        x = x + self.o_proj(attention.transpose(1, 2).reshape(b, t, -1))
        h = F.rms_norm(x, (c.hidden_size,), self.post_norm, c.rms_norm_eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def block_parameters(self, prefix: str) -> dict[str, torch.nn.Parameter]:
        """The decoder layer's parameters under the official names, below `prefix`."""
        names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                 "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                 "down_proj": "mlp.down_proj"}
        params = {}
        for attr, name in names.items():
            module = getattr(self, attr)
            params[prefix + name + ".weight"] = module.weight
            if module.bias is not None:
                params[prefix + name + ".bias"] = module.bias
        params[prefix + "post_attention_layernorm.weight"] = self.post_norm
        return params


class EagleLayer(DraftBlock):
    """EAGLE-1/2's draft: FC(concat(embedding, feature)) into the decoder layer (module docstring)."""

    def __init__(self, config: EagleConfig, vocab: torch.Tensor | None = None) -> None:
        h = config.hidden_size
        super().__init__(config, h)
        self.fc = torch.nn.Linear(2 * h, h, bias=config.fc_bias)
        self.input_norm = torch.nn.Parameter(torch.ones(h)) if config.input_norm else None
        self.register_buffer("vocab", None if vocab is None else vocab.long(), persistent=False)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """embeds, features [B, T, H] (token t + 1's embedding and f_t at row t); cos/sin [T, head_dim] → f̂ [B, T, H]."""
        return self.unrolled(embeds, features, cos, sin, 1)[0]

    def step_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        c = self.config
        return x, x if self.input_norm is None else F.rms_norm(x, (c.hidden_size,), self.input_norm, c.rms_norm_eps)

    # --- checkpoint: the official EAGLE names ---------------------------------------------------------------
    def official_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters under the official EAGLE checkpoint's names."""
        params = {"fc.weight": self.fc.weight, **({"fc.bias": self.fc.bias} if self.fc.bias is not None else {})}
        params.update(self.block_parameters(PREFIX))
        if self.input_norm is not None:
            params[PREFIX + "input_layernorm.weight"] = self.input_norm
        return params

    def save(self, directory: Path) -> None:
        save_checkpoint(directory, self.official_parameters(), {} if self.vocab is None else {"vocab": self.vocab},
                        self.config.to_hf())

    @classmethod
    def load(cls, directory: Path) -> "EagleLayer":
        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file():
            raise ValueError(f"{directory} holds no EAGLE draft layer ({CONFIG_FILE} missing)")
        raw = json.loads((directory / CONFIG_FILE).read_text())
        tensors = read_weights(directory)
        if "midlayer.self_attn.q_proj.weight" in tensors:
            raise ValueError(f"{directory} holds an EAGLE-3 layer: use method 'eagle3'")
        if "fc.weight" not in tensors or PREFIX + "self_attn.q_proj.weight" not in tensors:
            raise ValueError(f"{directory}: not an EAGLE-1/2 draft layer (no fc.weight / {PREFIX}self_attn.q_proj.weight)")
        config = EagleConfig(
            **block_shape(raw), fc_bias="fc.bias" in tensors, attention_bias=PREFIX + "self_attn.q_proj.bias" in tensors,
            input_norm=PREFIX + "input_layernorm.weight" in tensors, base_model=raw.get("base_model", ""))
        layer = cls(config, tensors.get("vocab"))
        load_parameters(directory, layer.official_parameters(), tensors)
        return layer


def save_checkpoint(directory: Path, parameters: dict[str, torch.Tensor], extra: dict[str, torch.Tensor],
                    config: dict) -> None:
    """`model.safetensors` with the parameters under their names and the extra tensors, and `config.json`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in {**parameters, **extra}.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def block_shape(raw: dict) -> dict:
    """A draft layer's attention and MLP shape from its Hugging Face config."""
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    return {"hidden_size": hidden, "intermediate_size": raw["intermediate_size"], "num_heads": heads,
            "num_kv_heads": raw.get("num_key_value_heads") or heads, "head_dim": raw.get("head_dim") or hidden // heads,
            "rms_norm_eps": raw.get("rms_norm_eps", 1e-6)}


def load_parameters(directory: Path, parameters: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
    """Copy each named tensor of a checkpoint into its parameter; a missing or misshapen one is refused."""
    with torch.no_grad():
        for name, parameter in parameters.items():
            if name not in tensors:
                raise ValueError(f"{directory}: {name} is missing")
            if tensors[name].shape != parameter.shape:
                raise ValueError(f"{directory}: {name} is {tuple(tensors[name].shape)}, expected {tuple(parameter.shape)}")
            parameter.copy_(tensors[name].float())


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (directory / WEIGHTS_FILE).is_file():
        return load_file(str(directory / WEIGHTS_FILE))
    if (directory / ORIGINAL_WEIGHTS_FILE).is_file():
        return torch.load(directory / ORIGINAL_WEIGHTS_FILE, map_location="cpu", weights_only=True)
    raise ValueError(f"{directory} holds no EAGLE weights ({WEIGHTS_FILE} or {ORIGINAL_WEIGHTS_FILE})")


class EagleDrafter:
    """The draft layer in the engine's kernels: a one-layer `Decoder` (its own KV cache, tree masks, measured cost
    curve) that takes the FC's output as its input embeddings and ends at the (reduced) LM head, unnormalized."""

    feature_layers: tuple[int, ...] = ()  # it reads the target's final hidden states

    def __init__(self, layer: EagleLayer, target: Decoder, project: Linear, kernel: LinearKernel, weight_format: str) -> None:
        c = layer.config
        if c.hidden_size != target.config.hidden_size:
            raise ValueError(f"the EAGLE layer reads hidden size {c.hidden_size}, the target has {target.config.hidden_size}: "
                             "it was trained for another model")
        self.vocab = layer.vocab
        self.embed = target.embed
        linear = kernel_of(target, kernel)
        h = c.hidden_size
        # FC(concat(e, f)) = W_e·e + W_f·f + b as two products: an int8 kernel quantizes each row with one scale, and
        # token embeddings are ~100× smaller than the target's features
        self.fc_embed = linear(layer.fc.weight[:, :h], layer.fc.bias)
        self.fc_feature = linear(layer.fc.weight[:, h:])
        weights = block_weights(layer, linear, layer.input_norm, slice(None))
        name = f"eagle-{h}x{c.intermediate_size}-v{project.out_features}-{weight_format}"
        self.decoder = one_layer_decoder(target, c, weights, None, project, name)

    def forward(self, batch: ForwardBatch, cache: KVCache, token_ids: torch.Tensor, features: torch.Tensor) -> ForwardOutput:
        """Rows reading token ids [T] (token t + 1) with features [T, H] (the target's f_t, or the layer's own f̂)."""
        embeds = F.embedding(token_ids.to(self.embed.device), self.embed)
        inputs = self.fc_embed(embeds) + self.fc_feature(features.to(embeds.dtype))
        return self.decoder.forward(batch, cache, inputs)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows of the draft's logits → token ids (the reduced vocabulary's, where it has one)."""
        return indices if self.vocab is None else self.vocab[indices]


def kernel_of(target: Decoder, kernel: LinearKernel) -> Callable[..., Linear]:
    """A draft layer's weights (and bias) → the kernel, on the target's device and in its dtype."""
    def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        weight = weight.detach().to(target.device, target.dtype).contiguous()
        return kernel(weight, None if bias is None else bias.detach().to(target.device, target.dtype))
    return linear


def block_weights(block: DraftBlock, linear, input_norm: torch.Tensor | None, columns: slice) -> LayerWeights:
    """The block as a Decoder layer, its q/k/v reading `columns` of their input (EAGLE-3: the hidden half)."""
    qkv_bias = None
    if block.config.attention_bias:
        qkv_bias = torch.cat([block.q_proj.bias, block.k_proj.bias, block.v_proj.bias])
    qkv = torch.cat([block.q_proj.weight, block.k_proj.weight, block.v_proj.weight])[:, columns]
    return LayerWeights(
        input_norm=None if input_norm is None else input_norm.detach(),
        qkv=linear(qkv, qkv_bias),
        o=linear(block.o_proj.weight),
        post_norm=block.post_norm.detach(),
        gate_up=linear(torch.cat([block.gate_proj.weight, block.up_proj.weight])),
        down=linear(block.down_proj.weight),
    )


def one_layer_decoder(target: Decoder, c: EagleConfig, weights: LayerWeights, final_norm: torch.Tensor | None,
                      head: Linear, name: str) -> Decoder:
    """A Decoder of the one draft layer, sharing the target's embedding and rotary embedding."""
    dtype, device = target.dtype, target.device
    weights = dataclasses.replace(
        weights, input_norm=None if weights.input_norm is None else weights.input_norm.to(device, dtype),
        post_norm=weights.post_norm.to(device, dtype))
    config = dataclasses.replace(
        target.config, vocab_size=head.out_features, intermediate_size=c.intermediate_size, num_layers=1,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        attention_bias=c.attention_bias, mlp_bias=False, tie_word_embeddings=False)
    norm = None if final_norm is None else final_norm.detach().to(device, dtype)
    return Decoder(config, target.embed, [weights], norm, head, target.inv_freq, target.attention_scaling, name=name)


def default_eagle_dir(model: str) -> Path:
    """Where `specdec train-heads --method eagle --model M` puts M's draft layer by default, and where it is looked
    for when `speculative_config` names none: `$SPECDEC_CACHE/heads/eagle/<M's name>`."""
    return zoo.cache_dir() / "heads" / "eagle" / Path(model).name
