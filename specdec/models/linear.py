"""The linear-kernel layer: a weight prepared once at load, applied many times.

Only dense float weights for now; packed/quantized kernels plug in here behind the
same call, chosen once when the model loads (never per call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
