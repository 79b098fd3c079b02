"""attention: FlashAttention-style scaled dot-product attention, forward and backward."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

_ops = torch.ops.fuseforge


def _resolve_scale(scale: Optional[float], head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
              return_lse: bool = False, deterministic: bool = False):
    """``softmax(scale * q @ k^T [causal mask]) @ v`` without an S x S matrix in memory.

    SDPA's layout: q (B, Hq, Sq, D), k and v (B, Hk, Sk, D); any strides with a contiguous last dim
    (``(B, S, H, D)`` tensors passed as ``.transpose(1, 2)`` run without a copy). Hk must divide Hq
    (grouped-query / multi-query attention). ``scale`` defaults to ``1 / sqrt(D)``. ``causal`` aligns
    the mask to the bottom right when Sq != Sk (query i sees key j when j <= i + Sk - Sq), as
    FlashAttention-2 does; a row that sees no key gives zeros (and an LSE of -inf).

    CUDA: float16 and bfloat16, head dims 64 and 128. CPU: float32 and float64 (float16/bfloat16 are
    computed in float32). Returns the output (strides of q), and with ``return_lse`` also the
    float32 (float64 for float64 inputs) log-sum-exp (B, Hq, Sq) of the scaled scores (not differentiable). Differentiable in q,
    k and v; ``deterministic=True`` makes the backward avoid floating-point atomics.
    """
    scale_f = _resolve_scale(scale, q.shape[-1])
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _AttentionFn.apply(q, k, v, bool(causal), scale_f, bool(deterministic))
    else:
        out, lse = _ops.attention_fwd(q, k, v, bool(causal), scale_f)
    return (out, lse) if return_lse else out


class _AttentionFn(torch.autograd.Function):
    """Carries `deterministic` (a backward-only flag) to the backward; the forward is the custom op,
    so torch.compile sees attention_fwd / attention_bwd (both with fake kernels)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, deterministic):
        out, lse = _ops.attention_fwd(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.deterministic = causal, scale, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = _ops.attention_bwd(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale,
                                                    ctx.deterministic)
        return grad_q, grad_k, grad_v, None, None, None


@torch.library.register_fake("fuseforge::attention_fwd")
def _attention_fwd_fake(q, k, v, causal, scale):
    out = torch.empty_like(q)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=lse_dtype)
    return out, lse


@torch.library.register_fake("fuseforge::attention_bwd")
def _attention_bwd_fake(grad_out, q, k, v, out, lse, causal, scale, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# The op itself is differentiable too (torch.ops.fuseforge.attention_fwd called directly, opcheck).
def _fwd_setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v = _ops.attention_bwd(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale, False)
    return grad_q, grad_k, grad_v, None, None


torch.library.register_autograd("fuseforge::attention_fwd", _fwd_backward, setup_context=_fwd_setup_context)
