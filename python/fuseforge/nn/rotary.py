from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from fuseforge.ops.rotary import rotary


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of q and k, with cos/sin computed inside the kernel.

    ``dim`` is the number of rotated dims R of each head (the head dim, or less for partial rotary);
    ``inv_freq`` defaults to ``1 / base ** (arange(0, dim, 2) / dim)`` in float32, as Hugging Face's
    default rope, and may be given (a scaled rope's frequencies) as a tensor of dim / 2 elements.

    Before (Hugging Face)::

        cos, sin = self.rotary_emb(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)

    After::

        rope = fuseforge.nn.RotaryEmbedding(head_dim, base=config.rope_theta)
        q, k = rope(q, k, position_ids)
    """

    def __init__(self, dim: int, base: float = 10000.0, attention_scaling: float = 1.0, interleaved: bool = False,
                 inv_freq: Optional[Tensor] = None, device=None):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"dim (the rotated dims of a head) must be even and positive, got {dim}")
        if inv_freq is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
        elif inv_freq.shape != (dim // 2,):
            raise ValueError(f"inv_freq must have shape ({dim // 2},) for dim {dim}, got {tuple(inv_freq.shape)}")
        self.dim = dim
        self.base = float(base)
        self.attention_scaling = float(attention_scaling)
        self.interleaved = bool(interleaved)
        self.register_buffer("inv_freq", inv_freq.to(device=device, dtype=torch.float32), persistent=False)

    def forward(self, q: Tensor, k: Tensor, position_ids: Tensor,
                out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
        return rotary(q, k, self.inv_freq, position_ids, self.attention_scaling, self.interleaved, out_dtype)

    def extra_repr(self) -> str:
        return (f"{self.dim}, base={self.base}, attention_scaling={self.attention_scaling}, "
                f"interleaved={self.interleaved}")
