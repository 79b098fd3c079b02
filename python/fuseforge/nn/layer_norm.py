from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor, nn

from fuseforge.ops.layer_norm import layer_norm


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, a drop-in for ``torch.nn.LayerNorm`` whose normalized_shape is one
    dim (parameters ``weight`` and ``bias``, initialised to ones and zeros, so its state dicts load
    unchanged).

    ``forward(x, residual=None, out_dtype=None)`` returns ``norm(x)``, or with a residual
    ``(norm(x + residual), x + residual)`` from one kernel (a pre-norm block's add and the next norm).
    out_dtype: see fuseforge.ops.layer_norm.layer_norm.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        normalized_shape = tuple(int(n) for n in normalized_shape)
        if len(normalized_shape) != 1:
            raise ValueError(f"fuseforge.nn.LayerNorm normalizes over the last dim only: normalized_shape must have "
                             f"one entry, got {normalized_shape}")
        self.normalized_shape = normalized_shape
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.zeros(normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None):
        if x.shape[-1:] != self.normalized_shape:
            raise ValueError(f"fuseforge.nn.LayerNorm: x's last dim must be {self.normalized_shape[0]}, got shape "
                             f"{tuple(x.shape)}")
        return layer_norm(x, self.weight, self.bias, self.eps, residual, out_dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
