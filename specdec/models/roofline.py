"""What a forward over k new tokens cannot beat on this machine.

roofline(k) = max(bytes read / read bandwidth, multiply-accumulates / MAC rate), with the bytes
(weights in their stored format + the KV cache read by attention) and MACs counted from the
model, and both ceilings measured here (`CeilingMeter`) rather than taken from a spec sheet.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from specdec.models.decoder import Decoder
from specdec.models.linear import (
    Int4Linear,
    Int8Linear,
    Linear,
    OneDnnInt8Linear,
    PanelLinear,
    can_run_int8,
    float32_linear,
    int8_linear,
)

BANDWIDTH_BUFFER_BYTES = 512 * 2**20  # 16× this machine's L3: every read comes from memory
GEMM_ROWS = (512, 64)  # rows of the GEMMs that measure the MAC rates


@dataclass(frozen=True)
class Ceilings:
    """Measured: bytes/s read from memory and multiply-accumulates/s for fp32 and int8 GEMMs."""

    read_bytes_per_s: float
    fp32_macs_per_s: float
    int8_macs_per_s: float | None
    readers: dict[str, float]  # bytes/s of each reader tried; the fastest sets the ceiling

    def to_json(self) -> dict:
        return asdict(self)

    def best(self, other: "Ceilings") -> "Ceilings":
        """Each ceiling at the higher of two measurements (what the machine has shown it can do)."""
        readers = {name: max(v, other.readers.get(name, 0.0)) for name, v in self.readers.items()}
        int8 = max(self.int8_macs_per_s or 0.0, other.int8_macs_per_s or 0.0) or None
        return Ceilings(max(readers.values()), max(self.fp32_macs_per_s, other.fp32_macs_per_s), int8, readers)


@dataclass(frozen=True)
class ForwardWork:
    """Bytes and MACs of one forward over k new tokens after `context` cached ones."""

    weight_bytes: int
    linear_macs_per_token: int
    int8: bool
    kv_bytes_per_position: int  # K and V of every layer, read once per forward
    attention_macs_per_position: int  # q·k and p·v of every layer, per (query, key) pair

    @classmethod
    def of(cls, decoder: Decoder) -> "ForwardWork":
        c = decoder.config
        linears: list[Linear] = [decoder.lm_head]
        for layer in decoder.layers:
            linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
        element = torch.tensor([], dtype=decoder.dtype).element_size()
        return cls(
            weight_bytes=sum(lin.weight_bytes for lin in linears),
            linear_macs_per_token=sum(lin.in_features * lin.out_features for lin in linears),
            int8=isinstance(decoder.lm_head, (Int8Linear, Int4Linear)),  # int4 multiplies on the int8 units
            kv_bytes_per_position=2 * c.num_layers * c.num_kv_heads * c.head_dim * element,
            attention_macs_per_position=2 * c.num_layers * c.num_heads * c.head_dim,
        )

    def roofline_ms(self, k: int, context: int, ceilings: Ceilings) -> float:
        keys = context + k
        read = self.weight_bytes + self.kv_bytes_per_position * keys
        linear_rate = ceilings.int8_macs_per_s if self.int8 and ceilings.int8_macs_per_s else ceilings.fp32_macs_per_s
        compute = k * self.linear_macs_per_token / linear_rate
        compute += k * keys * self.attention_macs_per_position / ceilings.fp32_macs_per_s
        return 1000 * max(read / ceilings.read_bytes_per_s, compute)


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class CeilingMeter:
    """Measures the machine's ceilings from buffers allocated once and held for the meter's life (~2.6 GiB).

    Holding them matters on this VM: its kernel hands freed pages back to the host (free page reporting), and
    forwards timed in the seconds after 1.5–3 GiB is freed ran 1.4–3.7× slower (measured), so a measurement
    that allocated and freed its buffers would slow the very forwards it is measured beside.
    Read bandwidth = the fastest of several readers streaming a buffer far larger than the caches (a reduction,
    and the fp32 and int8 matrix-vector kernels the model itself may use); MAC rates = large GEMMs through the
    same kernels, of 512 and of 64 rows (the fastest counting)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self._row = torch.randn(1, 4096, generator=g)
        flat = torch.randn(BANDWIDTH_BUFFER_BYTES // 4, generator=g)
        matrix = flat.view(-1, self._row.shape[1])
        onednn = torch.ops.mkldnn._reorder_linear_weight(matrix)
        # name -> one pass over a 512 MiB buffer; the sum and specdec's kernels also make the quick probe
        self._readers: dict[str, Callable[[], object]] = {
            "fp32 sum": flat.sum,
            "fp32 GEMV (oneDNN)": lambda: torch.ops.mkldnn._linear_pointwise(self._row, onednn, None, "none", [], ""),
        }
        self._probes = [flat.sum]
        if float32_linear() is PanelLinear:
            self._readers["fp32 GEMV (PanelLinear)"] = functools.partial(PanelLinear(matrix), self._row)
            self._probes.append(self._readers["fp32 GEMV (PanelLinear)"])
        square = torch.randn(4096, 4096, generator=g)
        # GEMMs of 512 and of 64 rows: specdec's int8 kernel runs faster at 16–64 rows than at 512, whose activations
        # and sums outgrow L2 (Zen 5 host, weights in cache: 771–836 G MAC/s against 500–758), and a ceiling is what
        # the machine has shown it can do
        self._row_blocks = [torch.randn(rows, 4096, generator=g) for rows in GEMM_ROWS]
        square_packed = torch.ops.mkldnn._reorder_linear_weight(square)
        # (MACs, one GEMM) of each kernel and row count; a ceiling is the fastest of its format's
        self._fp32_gemms: list[tuple[int, Callable[[], object]]] = [
            (2048**3, lambda: square[:2048, :2048] @ square[2048:, 2048:])
        ]
        for rows in self._row_blocks:
            onednn_gemm = functools.partial(torch.ops.mkldnn._linear_pointwise, rows, square_packed, None, "none", [], "")
            self._fp32_gemms.append((rows.shape[0] * 4096 * 4096, onednn_gemm))
        self._int8_gemms: list[tuple[int, Callable[[], object]]] = []
        if can_run_int8("cpu"):
            # oneDNN's kernel and specdec's (where it runs): each ceiling at the faster of the two
            weights = torch.randint(-127, 128, (BANDWIDTH_BUFFER_BYTES // 4096, 4096), generator=g, dtype=torch.int8)
            scales = torch.full((weights.shape[0],), 1e-3)
            for kernel in {OneDnnInt8Linear, int8_linear()}:
                self._readers[f"int8 GEMV ({kernel.__name__})"] = functools.partial(kernel.from_quantized(weights, scales), self._row)
                packed = kernel(square)
                for rows in self._row_blocks:
                    self._int8_gemms.append((rows.shape[0] * 4096 * 4096, functools.partial(packed, rows)))
            self._probes.append(self._readers[f"int8 GEMV ({int8_linear().__name__})"])

    def read_bandwidth(self) -> float:
        """bytes/s at this moment: one timed pass by each of the sum and specdec's matrix-vector kernels, the fastest
        counting; ~50 ms, cheap enough to take beside every timed forward."""
        best = 0.0
        for read in self._probes:
            start = time.perf_counter()
            read()
            best = max(best, BANDWIDTH_BUFFER_BYTES / (time.perf_counter() - start))
        return best

    def measure(self, repeats: int = 5) -> Ceilings:
        """Every reader's and GEMM's median over `repeats` timed calls; takes ~5 s here."""
        readers = {name: BANDWIDTH_BUFFER_BYTES / _median_seconds(read, repeats) for name, read in self._readers.items()}
        fp32_rate = max(macs / _median_seconds(gemm, repeats) for macs, gemm in self._fp32_gemms)
        int8_rate = max((macs / _median_seconds(gemm, repeats) for macs, gemm in self._int8_gemms), default=None)
        return Ceilings(max(readers.values()), fp32_rate, int8_rate, readers)
