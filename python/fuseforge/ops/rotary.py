"""rotary: rotary position embeddings of q and k, with cos/sin computed in the kernel."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_ops = torch.ops.fuseforge


def rotary(q: Tensor, k: Tensor, inv_freq: Tensor, position_ids: Tensor, attention_scaling: float = 1.0,
           interleaved: bool = False, out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """Returns ``(q_out, k_out)``: Hugging Face's ``LlamaRotaryEmbedding.forward`` followed by
    ``apply_rotary_pos_emb``, in one pass over q and k.

    q is (B, Hq, S, D) and k (B, Hk, S, D), one dtype (float32, float16, bfloat16; float64 on the
    CPU), any strides (the projections' ``view(B, S, H, D).transpose(1, 2)`` is read in place).
    position_ids is (B, S) or (1, S), int64 or int32; positions may restart inside a row (packed
    sequences). inv_freq is the (R / 2,) float32 buffer of the rotary embedding, R <= D: the first R
    dims of each head rotate and dims R..D-1 pass through (partial rotary).

    For each position and frequency i, angle = float32(position) * inv_freq[i] (one float32
    multiply, as Hugging Face computes it); cos and sin of that angle are multiplied by
    ``attention_scaling``. ``interleaved=False`` rotates the pairs (x[i], x[i + R/2]) (Llama's
    rotate_half), ``True`` the pairs (x[2i], x[2i + 1]). Arithmetic in float32 (float64 for float64
    inputs), one rounding to ``out_dtype`` (default: q's dtype; under autocast a caller asks for the
    attention's dtype directly).

    The outputs live in (B, S, H, D) memory and are returned as (B, H, S, D) views. Differentiable in
    q and k; the backward is the same op rotating the other way, and nothing but inv_freq and
    position_ids is saved.
    """
    return _ops.rotary(q, k, inv_freq, position_ids, float(attention_scaling), bool(interleaved), False, out_dtype)


@torch.library.register_fake("fuseforge::rotary")
def _rotary_fake(q, k, inv_freq, position_ids, attention_scaling, interleaved, inverse, out_dtype=None):
    dtype = q.dtype if out_dtype is None else out_dtype
    batch, heads_q, seq, head_dim = q.shape
    heads_k = k.shape[1]
    q_out = q.new_empty((batch, seq, heads_q, head_dim), dtype=dtype).transpose(1, 2)
    k_out = k.new_empty((batch, seq, heads_k, head_dim), dtype=dtype).transpose(1, 2)
    return q_out, k_out


# The autograd is registered in C++ (csrc/rotary/rotary_autograd.cpp): the Python path would cost
# more host time than the kernels take.
