"""The linear-kernel layer: a weight prepared once at load, applied many times.

`DenseLinear` is plain `F.linear` (any device and dtype). float32 CPU weights are packed once:
`PanelLinear` (specdec's kernel, where the CPU has AVX-512 or AVX2 with FMA) streams them in panels at about
what a plain sum over memory reads, for 1 to 16 rows, with each row's result independent of the others;
elsewhere `PrepackedLinear` reorders them into oneDNN's blocked layout (rows up to ~8 cost little
more than one, where the stock kernel costs 2–3× more for 2–3 rows than for one).
`Int8Linear` stores int8 weights (one scale per output channel) and quantizes activations per
row, so sums are exact int32 and a row's result never depends on the other rows of the forward
(batch invariance, tested bitwise); specdec's own AVX-512 VNNI kernel computes it where the CPU
has one, its AVX2 kernel on other x86 CPUs (where oneDNN's int16 intermediate sums saturate),
oneDNN's elsewhere. `Int4Linear` stores 4-bit weights in groups of 128 with the same per-row int8 activations
(a draft model's format; specdec's AVX-512 VNNI kernel). Measurements behind the choices: BENCHMARKS.md (cost_curve,
draft_model).
`linear_kernel` chooses once, when the model loads; nothing is decided per call.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from specdec.config import AUTO_QUANTIZATION, QUANTIZATION_METHODS
from specdec.models import kernels

# The formats "auto" picks on a CPU with oneDNN's int8 kernels, from end-to-end measurements
# (BENCHMARKS.md: formats and draft_model sections): int8 makes plain decoding 3–4× faster than
# float32 at 0–0.3% more NLL (its activations smoothed: models/smoothing.py), and the fastest speculative
# configuration is an int8 target with an int4 draft model (int8 where specdec's int4 kernel does not run): its
# forwards take ~0.65 of an int8 draft's and its accepted runs are 3–8% shorter. Draft layers (EAGLE, MTP, Medusa)
# stay int8 (not measured in int4). Elsewhere (CUDA, non-float32 dtypes) "auto" keeps the float weights.
DEFAULT_TARGET_QUANTIZATION = "int8"
DEFAULT_DRAFT_MODEL_QUANTIZATION = "int4"
DEFAULT_DRAFT_QUANTIZATION = "int8"


# Every kernel exposes in_features, out_features and weight_bytes (what a forward reads), for the roofline, and `entry`:
# its C++ entry for the decoder's layer loop (kernels/kernel_entry.h: capsule, operands, out features), or None where
# its kernel has none.
NativeEntry = tuple[object, list[torch.Tensor], int]


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as the [rows, in] a specdec kernel takes: the decoder's 2-D inputs as they are (a reshape and a view back
    cost ~2.5 µs a call, and a forward makes 113). The kernels pad in-features to their packing, so an input a few
    features short would run as if padded: it is refused here."""
    if x.shape[-1] != in_features:
        raise ValueError(f"linear layer of {in_features} in-features got an input of {x.shape[-1]}")
    return x if x.dim() == 2 else x.reshape(-1, in_features)


def _operands(*tensors: torch.Tensor, bias: torch.Tensor | None) -> list[torch.Tensor]:
    """A specdec kernel's operands for its C++ entry: the bias last, where there is one."""
    return [*tensors] if bias is None else [*tensors, bias]


def _shaped_like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A kernel's [rows, out] back in x's leading shape."""
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


class DenseLinear:
    entry: NativeEntry | None = None
    applies_swiglu = False  # see Int8Linear.swiglu

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.weight_bytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PrepackedLinear:
    """float32 on CPU through oneDNN with the weight reordered once (x: [rows, in])."""

    entry: NativeEntry | None = None
    applies_swiglu = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.weight_bytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PanelLinear:
    """float32 on CPU through specdec's kernel (kernels/fp32_linear.cpp, built for `isa`: AVX-512 or AVX2, by default
    the fastest this CPU runs; the same bits on either), the weight packed once into panels of 16 output channels
    (x: [rows, in]). Every output is one chain of fused multiply-adds in input order, whatever
    the rows and tiling, so a row's result is bitwise the same alone or with others (batch invariance, tested). For
    1–16 rows it reads the weights 1.1–1.4× faster than oneDNN's prepacked kernel, up to about what a plain sum
    over the same memory reads; for prefill chunks it is ~10% slower than oneDNN. Its AVX2 build, with the AVX2
    attention and norm kernels, made the 1.5B's float32 forwards at 1–16 rows 1.7–2.3× faster than oneDNN's AVX2
    kernel with PyTorch's ops (an emulated AVX2 host; BENCHMARKS.md)."""

    applies_swiglu = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: kernels.Isa | None = None) -> None:
        self.kernel = kernels.fp32_linear(isa)
        if self.kernel is None:
            raise ValueError(f"specdec's float32 kernel does not run on this CPU for {isa or 'any instruction set'}")
        self.packed = self.kernel.pack(weight.float())
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.weight_bytes = weight.numel() * 4

    @property
    def entry(self) -> NativeEntry:
        return self.kernel.linear_entry, _operands(self.packed, bias=self.bias), self.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.linear(_rows(x, self.in_features), self.packed, self.bias, self.out_features)
        return _shaped_like(y, x)


class Int8Linear:
    """int8 weights with per-output-channel scales; activations quantized to int8 per row.

    y[i, n] = s_x[i] · s_w[n] · Σ_k round(x[i, k] / s_x[i]) · W8[n, k] + b[n], the sum exact in int32, so a
    row's result never depends on the other rows. Symmetric scales: s = max|·| / 127. Three kernels compute
    it, bitwise alike (tested against the exact sums): `AmxInt8Linear`, `VnniInt8Linear` or `Avx2Int8Linear` where
    one runs, else `OneDnnInt8Linear`; `int8_linear` picks one per process.
    """

    entry: NativeEntry | None = None  # oneDNN's kernel has no C++ entry
    fuses_swiglu = False  # whether `swiglu` builds a gate/up product here
    applies_swiglu = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.float()
        scale = (weight.abs().amax(dim=1) / 127).clamp_(min=torch.finfo(torch.float32).tiny)
        self._init(weight.div(scale[:, None]).round_().to(torch.int8), scale, bias)

    @classmethod
    def from_quantized(cls, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """From int8 weights [out, in] and their per-output-channel float scales."""
        linear = cls.__new__(cls)
        linear._init(quantized, scale, bias)
        return linear

    @classmethod
    def swiglu(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """A layer's gate/up product (weight [2I, K]: the gate's rows, then the up's) whose call returns silu(gate) · up
        [.., I] from its kernel's epilogue, bitwise the product's outputs through the SwiGLU kernel (norm_swiglu.cpp):
        the rows packed so that each 64-channel panel holds 32 gate channels, then the same channels' up. Where the
        kernel offers it (`fuses_swiglu`) and I is a multiple of 32."""
        if not cls.can_apply_swiglu(weight.shape[0]):
            raise ValueError(f"{cls.__name__} cannot apply SwiGLU to a gate/up product of {weight.shape[0]} rows")
        inner = weight.shape[0] // 2
        # panel p: gate rows 32p … 32p + 31, then up rows I + 32p …
        order = torch.arange(2 * inner).view(2, inner // 32, 32).transpose(0, 1).reshape(-1)
        linear = cls.__new__(cls)
        linear.applies_swiglu = True
        Int8Linear.__init__(linear, weight[order], None if bias is None else bias[order])
        return linear

    @classmethod
    def can_apply_swiglu(cls, rows: int) -> bool:
        """Whether `swiglu` builds a gate/up product of `rows` [gate; up] rows: whole panels of 32 + 32 channels."""
        return cls.fuses_swiglu and rows % 64 == 0

    @property
    def output_features(self) -> int:
        """A call's outputs per row: out_features, or I of a gate/up product that applies SwiGLU."""
        return self.out_features // 2 if self.applies_swiglu else self.out_features

    def _init(self, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.scale = scale.float().contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features, self.in_features = quantized.shape
        self.weight_bytes = quantized.numel() + 4 * scale.numel()
        self._pack(quantized)

    def _pack(self, quantized: torch.Tensor) -> None:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class OneDnnInt8Linear(Int8Linear):
    """oneDNN's int8 GEMM (weights packed once); the activations quantized by PyTorch ops. Exact only with VNNI:
    without it oneDNN sums u8 · s8 pairs in int16 with saturation (measured up to 0.6 off, 2.8% relative error, on
    a Zen 3 host) and runs 3–4× slower than `Avx2Int8Linear`, so it is the fallback where no specdec kernel builds."""

    def _pack(self, quantized: torch.Tensor) -> None:
        self.packed = torch.ops.onednn.qlinear_prepack(quantized, None)
        self.zero_points = torch.zeros(quantized.shape[0], dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        row_scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny).div_(127)
        # uint8 with zero point 128: oneDNN's fast path (int8 activations take a reference kernel)
        quantized = torch.round(x / row_scale).add_(128).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(
            quantized, 1.0, 128, self.packed, self.scale, self.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        ).mul_(row_scale)
        return y if self.bias is None else y.add_(self.bias)


class PackedInt8Linear(Int8Linear):
    """specdec's int8 kernels: the weights packed once by the kernel's module (`kernel_module`), each product one call
    of its `linear` (or, from the layer loop, its C++ entry)."""

    kernel_module: Callable[[], ModuleType | None]

    def _pack(self, quantized: torch.Tensor) -> None:
        self.kernel = self.kernel_module()
        self.packed = self.kernel.pack(quantized)
        self.linear, self.linear_entry = ((self.kernel.linear_swiglu, self.kernel.linear_swiglu_entry)
                                          if self.applies_swiglu else (self.kernel.linear, self.kernel.linear_entry))

    @property
    def entry(self) -> NativeEntry:
        return self.linear_entry, _operands(self.packed, self.scale, bias=self.bias), self.output_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(_rows(x, self.in_features), self.packed, self.scale, self.bias, self.output_features)
        return _shaped_like(y, x)


class VnniInt8Linear(PackedInt8Linear):
    """specdec's AVX-512 VNNI kernel (kernels/int8_linear.cpp): one call quantizes the rows, streams the weights
    once for all of them (up to 6 rows in one tile; more in tiles of ≤ 6 that share each panel in L1-sized chunks,
    the memory stream overlapping the arithmetic) and applies the scales and bias. For the 1 to 16 rows of decoding
    and verification it is 1.1–1.3× oneDNN's kernel; up to 12 rows cost within ~1.2× of one row, which runs at about
    what reading the weights costs (BENCHMARKS.md)."""

    kernel_module = staticmethod(kernels.int8_vnni)
    fuses_swiglu = True


class AmxInt8Linear(VnniInt8Linear):
    """The VNNI kernel's packed panels multiplied by Intel's AMX tiles (Sapphire Rapids and later; in-features a
    multiple of 64, else the VNNI path): up to 16 rows in one tile multiply, so verifying 16 tokens costs about what
    reading the weights costs. Over the 1.5B's products on an AMX host: 53–59 ms at 1–16 rows against the VNNI path's
    54–81 (BENCHMARKS.md)."""

    def _pack(self, quantized: torch.Tensor) -> None:
        super()._pack(quantized)
        self.linear, self.linear_entry = (
            (self.kernel.linear_amx_swiglu, self.kernel.linear_amx_swiglu_entry) if self.applies_swiglu
            else (self.kernel.linear_amx, self.kernel.linear_amx_entry))


class Avx2Int8Linear(PackedInt8Linear):
    """specdec's AVX2 kernel (kernels/int8_linear_avx2.cpp) for CPUs without VNNI: one call quantizes the rows, streams
    the weights once for up to 6 rows (more share each panel from L1) and applies the scales and bias, bitwise as the
    other int8 kernels."""

    kernel_module = staticmethod(kernels.int8_avx2)


INT4_NEEDS_VNNI = "int4 weights need specdec's AVX-512 VNNI kernel, which does not run (or build) on this CPU; use 'int8'"


class Int4Linear:
    """int4 weights, asymmetric in groups of 128 in-features (a scale s and zero point z per output channel and group,
    q ∈ 0…15 rounded to nearest), with activations quantized to int8 per row:
    y[i, n] = s_x[i] · Σ_g s[n, g] · Σ_{k∈g} xq[i, k] · (q[n, k] − z[n, g]) + b[n], each group's sum exact in int32 and
    the groups added in order in float32, so a row's result never depends on the other rows. Half the bytes of int8:
    a draft's format (a 4-bit 0.5B's forward costs ~0.65 of an int8 one's, its accepted runs 3–8% shorter, so the
    1.5B decodes faster with it; as a target the 1.5B would lose 1.7% NLL, over the 1% int8 keeps; BENCHMARKS.md,
    forty-seventh session). specdec's AVX-512 VNNI kernel (kernels/int4_linear.cpp) computes it; no other kernel
    does."""

    group = 128
    panel = 64
    applies_swiglu = False
    fuses_swiglu = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.kernel = kernels.int4_vnni()
        if self.kernel is None:
            raise ValueError(INT4_NEEDS_VNNI)
        self.out_features, self.in_features = weight.shape
        n = -(-self.out_features // self.panel) * self.panel
        k = -(-self.in_features // self.group) * self.group
        groups = F.pad(weight.float(), (0, k - self.in_features, 0, n - self.out_features)).view(n, k // self.group, self.group)
        # the range spans 0, so that zero (the padding) is exact
        low, high = groups.amin(-1).clamp_(max=0), groups.amax(-1).clamp_(min=0)
        scale = (high - low).div_(15).clamp_(min=torch.finfo(torch.float32).tiny)
        zero = low.div(scale).neg_().round_().clamp_(0, 15)
        quantized = groups.div(scale[..., None]).round_().add_(zero[..., None]).clamp_(0, 15).to(torch.uint8)
        # [N / 64, 64, K / 8, (low, high), 4] → bytes [N / 64, K / 8, 64, 4]: k-block j's in-features 8j … 8j + 3 in
        # the low nibbles, 8j + 4 … 8j + 7 in the high ones
        nibbles = quantized.view(n // self.panel, self.panel, k // 8, 2, 4)
        self.packed = self.kernel.pack((nibbles[:, :, :, 0] | nibbles[:, :, :, 1] << 4).permute(0, 2, 1, 3))
        by_panel = (n // self.panel, self.panel, k // self.group)  # → [N / 64, K / 128, 64]
        self.scale = scale.view(by_panel).transpose(1, 2).contiguous()
        self.offset = (scale * zero).view(by_panel).transpose(1, 2).contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.weight_bytes = self.packed.numel() + 4 * (self.scale.numel() + self.offset.numel())

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] the kernel multiplies by: (q − z) · s."""
        panels, blocks = self.packed.shape[:2]
        nibbles = torch.stack([self.packed & 15, self.packed >> 4], dim=2).permute(0, 3, 1, 2, 4)  # [P, 64, K/8, 2, 4]
        q = nibbles.reshape(panels * self.panel, blocks * 8 // self.group, self.group).float()
        scale, offset = (t.transpose(1, 2).reshape(panels * self.panel, -1, 1) for t in (self.scale, self.offset))
        return (q * scale - offset).reshape(panels * self.panel, -1)[: self.out_features, : self.in_features]

    @property
    def entry(self) -> NativeEntry:
        return self.kernel.linear_entry, _operands(self.packed, self.scale, self.offset, bias=self.bias), self.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.linear(_rows(x, self.in_features), self.packed, self.scale, self.offset, self.bias,
                               self.out_features)
        return _shaped_like(y, x)


def int8_linear() -> type[Int8Linear]:
    """The int8 kernel for this process: specdec's AMX kernel where the CPU and OS let it run, its VNNI kernel where
    the CPU has AVX-512 VNNI, else its AVX2 kernel, where they build; oneDNN's elsewhere."""
    if kernels.int8_amx():
        return AmxInt8Linear
    if kernels.int8_vnni() is not None:
        return VnniInt8Linear
    return Avx2Int8Linear if kernels.int8_avx2() is not None else OneDnnInt8Linear


def float32_linear() -> type[PanelLinear] | type[PrepackedLinear]:
    """The packed float32 CPU kernel for this process: specdec's where the CPU has AVX-512 or AVX2 and it builds, else
    oneDNN's."""
    return PanelLinear if kernels.fp32_linear() is not None else PrepackedLinear


Linear = DenseLinear | PrepackedLinear | PanelLinear | Int8Linear | Int4Linear
LinearKernel = Callable[[torch.Tensor, torch.Tensor | None], Linear]


def gate_up_product(kernel: LinearKernel, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A layer's gate/up product ([gate; up] rows) by `kernel`: one that applies SwiGLU in its epilogue where the
    kernel offers it (`Int8Linear.swiglu`), else the plain product for the SwiGLU kernel to follow. At 16 rows a
    forward's outputs, written and read back, cost ~5 ms of the 1.5B's int8 products (their epilogue writing to a
    buffer in L1 instead: 62.6 against 57.6 ms), and the gate/up halves are most of them; fused, its forwards took
    0.95–0.98 of the time at k = 8–16 and 0.98–1.01 at k = 1–4, bitwise equal (BENCHMARKS.md, forty-first session)."""
    if isinstance(kernel, type) and issubclass(kernel, Int8Linear) and kernel.can_apply_swiglu(weight.shape[0]):
        return kernel.swiglu(weight, bias)
    return kernel(weight, bias)


def can_prepack(dtype: torch.dtype, device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def can_run_int8(device: torch.device | str) -> bool:
    return (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.onednn, "qlinear_prepack")
    )


def resolve_quantization(quantization: str | None, default: str, dtype: torch.dtype, device: str) -> str | None:
    """"auto" → `default` where int8 runs (float32 on a CPU with oneDNN; an int4 default also needs specdec's int4
    kernel, else int8), else None; others unchanged."""
    if quantization != AUTO_QUANTIZATION:
        return quantization
    if not (can_run_int8(device) and dtype == torch.float32):
        return None
    return "int8" if default == "int4" and kernels.int4_vnni() is None else default


def linear_kernel(
    dtype: torch.dtype, device: torch.device | str, quantization: str | None = None, prepack: bool | None = None
) -> LinearKernel:
    """The kernel every linear layer of a model will use, chosen once from its format.

    quantization None keeps the weights in `dtype` (float32 CPU weights packed once for `float32_linear`'s kernel,
    unless `prepack=False`); "int8" stores int8 weights and computes in float32 (CPU only); "int4" stores 4-bit
    weights (`Int4Linear`: CPUs with AVX-512 VNNI).
    """
    if quantization is None:
        return float32_linear() if (can_prepack(dtype, device) if prepack is None else prepack) else DenseLinear
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_METHODS)} or None")
    if not can_run_int8(device):
        raise ValueError(f"{quantization} quantization needs a CPU with oneDNN's int8 kernels; device {device!r} has none")
    if dtype != torch.float32:
        raise ValueError(f"{quantization} quantization computes in float32; got dtype {dtype}")
    if quantization == "int4":
        if kernels.int4_vnni() is None:
            raise ValueError(INT4_NEEDS_VNNI)
        return Int4Linear
    return int8_linear()
