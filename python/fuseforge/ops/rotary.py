"""rotary: rotary position embeddings of q and k, with cos/sin computed in the kernel."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fuseforge.ops._eager import eager_autograd, plain_eager

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
    return _rotate(q, k, inv_freq, position_ids, float(attention_scaling), bool(interleaved), False, out_dtype)


def _rotate(*args):
    """The op on rotary's arguments: below autograd when no gradient is wanted, through _EagerFunction in
    plain eager mode (functorch's transforms included), else through the registered autograd."""
    q, k, inv_freq, position_ids = args[:4]
    if plain_eager(q, k, inv_freq, position_ids):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return _EagerFunction.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return _ops.rotary(*args)
    return _ops.rotary(*args)


@torch.library.register_fake("fuseforge::rotary")
def _rotary_fake(q, k, inv_freq, position_ids, attention_scaling, interleaved, inverse, out_dtype=None):
    dtype = q.dtype if out_dtype is None else out_dtype
    batch, heads_q, seq, head_dim = q.shape
    heads_k = k.shape[1]
    q_out = q.new_empty((batch, seq, heads_q, head_dim), dtype=dtype).transpose(1, 2)
    k_out = k.new_empty((batch, seq, heads_k, head_dim), dtype=dtype).transpose(1, 2)
    return q_out, k_out


def _setup_context(ctx, inputs, output):
    q, k, inv_freq, position_ids, attention_scaling, interleaved, inverse, _out_dtype = inputs
    ctx.save_for_backward(inv_freq, position_ids)
    # A gradient that reaches only one of q_out and k_out is not filled with zeros for the other.
    ctx.set_materialize_grads(False)
    ctx.attention_scaling = attention_scaling
    ctx.interleaved = interleaved
    ctx.inverse = inverse
    ctx.input_dtype = q.dtype
    ctx.q_shape = q.shape
    ctx.k_shape = k.shape


def _backward(ctx, grad_q, grad_k):
    """The rotation is orthogonal up to attention_scaling: its transpose (the gradient) is the same
    op with the angle negated."""
    if grad_q is None and grad_k is None:
        return None, None, None, None, None, None, None, None
    inv_freq, position_ids = ctx.saved_tensors
    if grad_q is None:
        grad_q = grad_k.new_zeros(ctx.q_shape)
    if grad_k is None:
        grad_k = grad_q.new_zeros(ctx.k_shape)
    need_q, need_k = ctx.needs_input_grad[:2]
    args = (grad_q, grad_k, inv_freq, position_ids, ctx.attention_scaling, ctx.interleaved, not ctx.inverse,
            ctx.input_dtype)
    dq, dk = _rotate(*args)  # differentiable: a double backward rotates back again
    return dq if need_q else None, dk if need_k else None, None, None, None, None, None, None


torch.library.register_autograd("fuseforge::rotary", _backward, setup_context=_setup_context)


_EagerFunction = eager_autograd(_ops.rotary, _setup_context, _backward)
