from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from fuseforge.ops.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, a drop-in for Hugging Face's LlamaRMSNorm (weight_offset=0, weight
    initialised to ones) and GemmaRMSNorm (weight_offset=1, ``(1 + weight) * x``, weight initialised
    to zeros); the parameter is ``weight`` as theirs, so their state dicts load unchanged.

    ``forward(x, residual=None, out_dtype=None)`` returns ``norm(x)``, or with a residual
    ``(norm(x + residual), x + residual)`` from one kernel: the decoder layer's add and norm fused::

        hidden, residual = post_attention_layernorm(attn_out, residual)

    out_dtype: see fuseforge.ops.rms_norm.rms_norm (a float32 x may give bfloat16 or float16).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0,
                 elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight_offset = float(weight_offset)
        if elementwise_affine:
            init = torch.zeros if self.weight_offset == 1.0 else torch.ones
            self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @property
    def variance_epsilon(self) -> float:  # LlamaRMSNorm's name for eps
        return self.eps

    def forward(self, x: Tensor, residual: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None):
        return rms_norm(x, self.weight, self.eps, residual, self.weight_offset, out_dtype)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, weight_offset={self.weight_offset}, "
                f"elementwise_affine={self.weight is not None}")
