"""The linear-kernel layer: a weight prepared once at load, applied many times.

`DenseLinear` is plain `F.linear`. `PrepackedLinear` reorders a float32 CPU weight once into
oneDNN's blocked layout: on this 2-core AVX2 machine it is faster at one token and nearly flat
in the number of tokens, where the stock kernel costs 2–3× more for 2–3 rows than for one —
see BENCHMARKS.md (draft_model section) for the measured curves.
`make_linear` chooses once, when the model loads; nothing is decided per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PrepackedLinear:
    """float32 on CPU through oneDNN with the weight reordered once (x: [rows, in])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = bias
        self._out_features = weight.shape[0]

    @property
    def out_features(self) -> int:
        return self._out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


Linear = DenseLinear | PrepackedLinear


def can_prepack(dtype: torch.dtype, device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool) -> Linear:
    return PrepackedLinear(weight, bias) if prepack else DenseLinear(weight, bias)
