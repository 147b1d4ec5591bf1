"""C++ kernels, compiled on first use with `torch.utils.cpp_extension` (torch caches the build under
`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions). Where a kernel can't run (another CPU) or
can't build (no compiler), its loader returns None with a warning and callers keep PyTorch's kernels."""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

INT8_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
INT8_AVX2_FLAGS = ("avx2",)


@dataclass(frozen=True)
class Isa:
    """An instruction set the float32 kernels (fp32_linear, row_attention, norm_swiglu) are built for: simd.h gives
    them the same sixteen-lane vector on each, so every build computes the same bits."""

    name: str
    cpu_flags: tuple[str, ...]  # as /proc/cpuinfo names them


AVX512 = Isa("avx512", ("avx512f",))
AVX2 = Isa("avx2", ("avx2", "fma"))
FLOAT32_ISAS = (AVX512, AVX2)  # the fastest first
# caps the instruction sets specdec's kernels use ("avx2": an AVX2-only CPU's kernels on a wider one), as
# ONEDNN_MAX_CPU_ISA caps oneDNN's and ATEN_CPU_CAPABILITY PyTorch's
MAX_ISA_VARIABLE = "SPECDEC_MAX_CPU_ISA"


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    line = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def runnable_isas() -> tuple[Isa, ...]:
    """The instruction sets of FLOAT32_ISAS this CPU runs, the fastest first, none above $SPECDEC_MAX_CPU_ISA."""
    flags = cpu_flags()
    isas = tuple(isa for isa in FLOAT32_ISAS if set(isa.cpu_flags) <= flags)
    cap = os.environ.get(MAX_ISA_VARIABLE, "").strip().lower()
    if not cap:
        return isas
    names = [isa.name for isa in FLOAT32_ISAS]
    if cap not in names:
        raise ValueError(f"{MAX_ISA_VARIABLE}={cap!r}: expected one of {', '.join(names)}")
    return tuple(isa for isa in isas if names.index(isa.name) >= names.index(cap))


def _build(name: str, source: str, flags: tuple[str, ...], extra_cflags: tuple[str, ...] = ()) -> ModuleType | None:
    """Compile `source` for the instruction sets `flags` (as /proc/cpuinfo names them), checked first: code built
    for them must not even load on a CPU without them."""
    if not set(flags) <= cpu_flags():
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=name,
            sources=[str(Path(__file__).with_name(source))],
            extra_cflags=["-O3", "-fopenmp", *(f"-m{flag.replace('_', '')}" for flag in flags), *extra_cflags],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # no compiler, headers or linker: PyTorch's kernels still work
        warnings.warn(f"specdec: the kernel {name} did not build ({error}); PyTorch's kernels run instead")
        return None


@functools.cache
def int8_vnni() -> ModuleType | None:
    """The AVX-512 VNNI int8 linear kernel (int8_linear.cpp), or None (also where $SPECDEC_MAX_CPU_ISA is below
    AVX-512). Built without contracting its epilogue into fused multiply-adds: it must round as the other int8
    kernels do."""
    if AVX512 not in runnable_isas():
        return None
    return _build("specdec_int8_vnni", "int8_linear.cpp", INT8_VNNI_FLAGS, ("-ffp-contract=off",))


def int8_amx() -> bool:
    """Whether the VNNI kernel's AMX path runs here: the CPU has AMX-INT8, Linux lets the process use its tiles, and
    no $SPECDEC_MAX_CPU_ISA caps the kernels (AMX is above every cap it names, as ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI
    keeps oneDNN off AMX)."""
    module = int8_vnni()
    return module is not None and module.amx_usable and not os.environ.get(MAX_ISA_VARIABLE, "").strip()


@functools.cache
def int4_vnni() -> ModuleType | None:
    """The AVX-512 VNNI int4 linear kernel (int4_linear.cpp), or None (also where $SPECDEC_MAX_CPU_ISA is below
    AVX-512). Built without contracting its epilogue into fused multiply-adds, as the int8 kernels."""
    if AVX512 not in runnable_isas():
        return None
    return _build("specdec_int4_vnni", "int4_linear.cpp", INT8_VNNI_FLAGS, ("-ffp-contract=off",))


@functools.cache
def int8_avx2() -> ModuleType | None:
    """The AVX2 int8 linear kernel (int8_linear_avx2.cpp) for CPUs without VNNI, or None. Built without contracting
    its epilogue into fused multiply-adds: it must round as the other int8 kernels do."""
    return _build("specdec_int8_avx2", "int8_linear_avx2.cpp", INT8_AVX2_FLAGS, ("-ffp-contract=off",))


def _float32_kernel(name: str, source: str, isa: Isa | None, extra_cflags: tuple[str, ...] = ()) -> ModuleType | None:
    """`source` built for `isa`, or (None) for the fastest of FLOAT32_ISAS that this CPU runs and that builds."""
    for candidate in (isa,) if isa is not None else runnable_isas():
        module = _build(f"{name}_{candidate.name}", source, candidate.cpu_flags, extra_cflags)
        if module is not None:
            return module
    return None


@functools.cache
def fp32_linear(isa: Isa | None = None) -> ModuleType | None:
    """The float32 linear kernel (fp32_linear.cpp) for `isa` (default: the fastest this CPU runs), or None."""
    return _float32_kernel("specdec_fp32_linear", "fp32_linear.cpp", isa)


@functools.cache
def row_attention(isa: Isa | None = None) -> ModuleType | None:
    """The RoPE, KV write and attention of a step's few new tokens, each row on its own (row_attention.cpp), for
    `isa` (default: the fastest this CPU runs), or None. Built without contracting a · b + c into fused multiply-adds
    where the source doesn't ask for them: its RoPE must round as PyTorch's elementwise ops do."""
    return _float32_kernel("specdec_row_attention", "row_attention.cpp", isa, ("-ffp-contract=off",))


@functools.cache
def norm_swiglu(isa: Isa | None = None) -> ModuleType | None:
    """The RMSNorm (with the residual add) and SwiGLU of a layer's rows (norm_swiglu.cpp) for `isa` (default: the
    fastest this CPU runs), or None."""
    return _float32_kernel("specdec_norm_swiglu", "norm_swiglu.cpp", isa)


@functools.cache
def layer_loop() -> ModuleType | None:
    """A decoder's layers in one call over the other kernels' C++ entries (layer_loop.cpp), or None. It computes
    nothing itself, so it needs no instruction set of its own."""
    return _build("specdec_layer_loop", "layer_loop.cpp", ())


def build_all() -> dict[str, bool]:
    """Builds the kernels (torch caches the builds); which ones run here (False: not for this CPU, or no compiler)."""
    built = {"int8 VNNI": int8_vnni(), "int8 AVX2": int8_avx2(), "int4 VNNI": int4_vnni(), "layer loop": layer_loop()}
    for isa in runnable_isas():
        built |= {f"fp32 linear {isa.name}": fp32_linear(isa), f"row attention {isa.name}": row_attention(isa),
                  f"norm/SwiGLU {isa.name}": norm_swiglu(isa)}
    return {name: module is not None for name, module in built.items()}
