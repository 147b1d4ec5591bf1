"""C++ kernels, compiled on first use with `torch.utils.cpp_extension` (torch caches the build under
`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions). Where a kernel can't run (another CPU) or
can't build (no compiler), its loader returns None with a warning and callers keep PyTorch's kernels."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from types import ModuleType

INT8_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
INT8_AVX2_FLAGS = ("avx2",)
ROW_ATTENTION_FLAGS = ("avx512f",)
FP32_FLAGS = ("avx512f",)
NORM_SWIGLU_FLAGS = ("avx512f",)


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    line = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


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
    """The AVX-512 VNNI int8 linear kernel (int8_linear.cpp), or None. Built without contracting its epilogue into
    fused multiply-adds: it must round as the other int8 kernels do."""
    return _build("specdec_int8_vnni", "int8_linear.cpp", INT8_VNNI_FLAGS, ("-ffp-contract=off",))


@functools.cache
def int8_avx2() -> ModuleType | None:
    """The AVX2 int8 linear kernel (int8_linear_avx2.cpp) for CPUs without VNNI, or None. Built without contracting
    its epilogue into fused multiply-adds: it must round as the other int8 kernels do."""
    return _build("specdec_int8_avx2", "int8_linear_avx2.cpp", INT8_AVX2_FLAGS, ("-ffp-contract=off",))


@functools.cache
def fp32_avx512() -> ModuleType | None:
    """The AVX-512 float32 linear kernel (fp32_linear.cpp), or None."""
    return _build("specdec_fp32_avx512", "fp32_linear.cpp", FP32_FLAGS)


@functools.cache
def row_attention() -> ModuleType | None:
    """The AVX-512 RoPE, KV write and attention of a step's few new tokens, each row on its own (row_attention.cpp),
    or None. Built without contracting a · b + c into fused multiply-adds where the source doesn't ask for them: its
    RoPE must round as PyTorch's elementwise ops do."""
    return _build("specdec_row_attention", "row_attention.cpp", ROW_ATTENTION_FLAGS, ("-ffp-contract=off",))


@functools.cache
def norm_swiglu() -> ModuleType | None:
    """The AVX-512 RMSNorm (with the residual add) and SwiGLU of a layer's rows (norm_swiglu.cpp), or None."""
    return _build("specdec_norm_swiglu", "norm_swiglu.cpp", NORM_SWIGLU_FLAGS)
