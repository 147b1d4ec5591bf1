"""Multi-token prediction modules (DeepSeek-V3, arXiv:2412.19437 §2.2; Gloeckle et al. 2024) for drafting.

Module k (k = 1 … K) at position p reads the previous module's output there, h_{k−1}(p) (h_0: the
target's final hidden state), and the embedding of token p + k:
    x = input_proj(concat(hidden_layernorm(h_{k−1}(p)), token_layernorm(embed(token p + k))))
    h_k(p) = final_layernorm(decoder_layer_k(x))
and the target's LM head on h_k(p) gives token p + k + 1 (the concatenation in MiMo's order; DeepSeek's
`eh_proj` reads the embedding first). After committed tokens 0 … N − 1, every module drafts at
position N − 2, the last whose target feature exists: module 1 reads token N − 1 and guesses d_1 =
token N; module k reads d_{k−1} with module k − 1's output and guesses token N + k − 1. Deeper than K, module K
repeats (spec/proposers/mtp.py).

Attention. Module k's row p reads token p + k, committed for p ≤ N − 1 − k: its KV cache holds those
real rows, and its draft row at N − 2 attends to them and itself, skipping the k − 2 rows between
(whose tokens are drafts: k ≥ 3). Training masks the same rows (row p sees rows ≤ p − max(0, k − 2) − 1
and itself), so a module drafts with the context it was trained on. (DeepSeek trains with plain causal
attention over teacher-forced tokens, which drafting at depth ≥ 3 cannot reproduce; it drafts with one
module.)

Checkpoint: the native MTP layout of Qwen2-style checkpoints that ship such modules (MiMo):
`model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj, input_layernorm, self_attn.*,
post_attention_layernorm, mlp.*, final_layernorm}` in `model.safetensors`, with `config.json`
(`num_nextn_predict_layers`, the attention and MLP shapes); a target directory whose own weights hold
`model.mtp_layers.*` drafts with them (MiMo also zeroes the embedding read at position 0; not done here).
Modules trained here add `vocab` (a reduced output vocabulary).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.kv_cache import KVCache
from specdec.models import zoo
from specdec.models.batch import ForwardBatch, ForwardOutput
from specdec.models.decoder import Decoder
from specdec.models.eagle import (
    CONFIG_FILE,
    DraftBlock,
    EagleConfig,
    block_shape,
    block_weights,
    kernel_of,
    load_parameters,
    one_layer_decoder,
    save_checkpoint,
)
from specdec.models.linear import Linear, LinearKernel

PREFIX = "model.mtp_layers."


@dataclass(frozen=True)
class MtpConfig(EagleConfig):
    num_modules: int = 1  # num_nextn_predict_layers

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.num_modules, int) or self.num_modules < 1:
            raise ValueError(f"MTP needs num_modules >= 1, got {self.num_modules!r}")

    def to_hf(self) -> dict:
        return {**super().to_hf(), "architectures": ["MTPModules"], "num_nextn_predict_layers": self.num_modules}


def skipped_rows(module: int) -> int:
    """Rows right before its own that module k's row does not see (their tokens are still drafts): max(0, k − 2)."""
    return max(0, module - 2)


class MtpModule(DraftBlock):
    """One MTP module, trainable; `forward` runs whole sequences with module k's attention (module docstring)."""

    def __init__(self, config: MtpConfig) -> None:
        h = config.hidden_size
        super().__init__(config, h)
        self.input_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.hidden_norm = torch.nn.Parameter(torch.ones(h))
        self.token_norm = torch.nn.Parameter(torch.ones(h))
        self.input_norm = torch.nn.Parameter(torch.ones(h))
        self.final_norm = torch.nn.Parameter(torch.ones(h))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                module: int) -> torch.Tensor:
        """embeds [B, T, H] (row p: token p + k), hidden [B, T, H] (h_{k−1}(p)) → h_k [B, T, H], as module k."""
        x = self.input_proj(torch.cat((self._norm(hidden, self.hidden_norm), self._norm(embeds, self.token_norm)), -1))
        q, k, v = self.attention_inputs(self._norm(x, self.input_norm), cos, sin)
        rows = torch.arange(embeds.shape[1])
        seen = (rows[None, :] < rows[:, None] - skipped_rows(module)) | (rows[None, :] == rows[:, None])
        attention = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        return self._norm(self.block_output(x, attention), self.final_norm)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.config.hidden_size,), weight, self.config.rms_norm_eps)

    def official_parameters(self, prefix: str) -> dict[str, torch.nn.Parameter]:
        return {**self.block_parameters(prefix), prefix + "input_proj.weight": self.input_proj.weight,
                prefix + "hidden_layernorm.weight": self.hidden_norm, prefix + "token_layernorm.weight": self.token_norm,
                prefix + "input_layernorm.weight": self.input_norm, prefix + "final_layernorm.weight": self.final_norm}


class MtpModules(torch.nn.Module):
    """K sequential modules and the output vocabulary their logits cover (None: the target's)."""

    def __init__(self, config: MtpConfig, vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList(MtpModule(config) for _ in range(config.num_modules))
        self.register_buffer("vocab", None if vocab is None else vocab.long(), persistent=False)

    def official_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {name: p for k, module in enumerate(self.layers)
                for name, p in module.official_parameters(f"{PREFIX}{k}.").items()}

    def save(self, directory: Path) -> None:
        save_checkpoint(directory, self.official_parameters(), {} if self.vocab is None else {"vocab": self.vocab},
                        self.config.to_hf())

    @classmethod
    def load(cls, directory: Path) -> "MtpModules":
        """Modules trained here, or a checkpoint's native ones (its safetensors files holding `model.mtp_layers.*`)."""
        from safetensors import safe_open

        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file():
            raise ValueError(f"{directory} holds no MTP modules ({CONFIG_FILE} missing)")
        tensors = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                tensors |= {name: f.get_tensor(name) for name in f.keys() if name.startswith(PREFIX) or name == "vocab"}
        if not any(name.startswith(PREFIX) for name in tensors):
            raise ValueError(f"{directory}: no MTP modules ({PREFIX}* weights)")
        raw = json.loads((directory / CONFIG_FILE).read_text())
        count = 1 + max(int(name[len(PREFIX):].split(".")[0]) for name in tensors if name.startswith(PREFIX))
        config = MtpConfig(**block_shape(raw), fc_bias=False, attention_bias=f"{PREFIX}0.self_attn.q_proj.bias" in tensors,
                           base_model=raw.get("base_model", ""), num_modules=count)
        modules = cls(config, tensors.get("vocab"))
        load_parameters(directory, modules.official_parameters(), tensors)
        return modules


class MtpDrafter:
    """The modules in the engine's kernels: one one-layer `Decoder` each (own KV cache, measured cost curve), fed the
    input projection's output, ending at the final norm and the target's (reduced) LM head."""

    def __init__(self, modules: MtpModules, target: Decoder, project: Linear, kernel: LinearKernel, weight_format: str) -> None:
        c = modules.config
        if c.hidden_size != target.config.hidden_size:
            raise ValueError(f"the MTP modules read hidden size {c.hidden_size}, the target has "
                             f"{target.config.hidden_size}: they were trained for another model")
        self.vocab = modules.vocab
        self.embed = target.embed
        self.eps = c.rms_norm_eps
        linear = kernel_of(target, kernel)
        h = c.hidden_size
        self.hidden_proj, self.token_proj, self.hidden_norms, self.token_norms, self.decoders = [], [], [], [], []
        name = f"mtp-{h}x{c.intermediate_size}-v{project.out_features}-{weight_format}"
        for module in modules.layers:
            self.hidden_proj.append(linear(module.input_proj.weight[:, :h]))
            self.token_proj.append(linear(module.input_proj.weight[:, h:]))
            self.hidden_norms.append(module.hidden_norm.detach().to(target.device, target.dtype))
            self.token_norms.append(module.token_norm.detach().to(target.device, target.dtype))
            weights = block_weights(module, linear, module.input_norm, slice(None))
            self.decoders.append(one_layer_decoder(target, c, weights, module.final_norm, project, name))

    @property
    def num_modules(self) -> int:
        return len(self.decoders)

    def forward(self, module: int, batch: ForwardBatch, cache: KVCache, token_ids: torch.Tensor,
                hidden: torch.Tensor) -> ForwardOutput:
        """Module `module` (1-based) over rows reading token ids [T] (token p + k) with h_{k−1} [T, H]; the output's
        `hidden` is h_k (after the final norm: what module k + 1 reads)."""
        k = module - 1
        embeds = F.embedding(token_ids.to(self.embed.device), self.embed)
        hidden = hidden.to(embeds.dtype)
        x = (self.hidden_proj[k](F.rms_norm(hidden, (hidden.shape[-1],), self.hidden_norms[k], self.eps))
             + self.token_proj[k](F.rms_norm(embeds, (embeds.shape[-1],), self.token_norms[k], self.eps)))
        return self.decoders[k].forward(batch, cache, x)

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        return indices if self.vocab is None else self.vocab[indices]


def default_mtp_dir(model: str) -> Path:
    """Where `specdec train-heads --method mtp --model M` puts M's modules, and where they are looked for by default
    (after the target's own checkpoint)."""
    return zoo.cache_dir() / "heads" / "mtp" / Path(model).name


def has_native_mtp(directory: Path) -> bool:
    """Whether a checkpoint directory's weights hold MTP modules."""
    from safetensors import safe_open

    for path in Path(directory).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            if any(name.startswith(PREFIX) for name in f.keys()):
                return True
    return False
