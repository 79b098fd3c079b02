"""rms_norm: RMSNorm (Llama's and Gemma's) with an optional fused residual add, forward and backward."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from fuseforge.ops._eager import eager_autograd, once_differentiable, plain_eager

_ops = torch.ops.fuseforge


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, residual: Optional[Tensor] = None,
             weight_offset: float = 0.0, out_dtype: Optional[torch.dtype] = None):
    """RMSNorm over the last dim of x, optionally after adding a residual, in one pass over memory.

    ``h = x + residual`` (rounded to x's dtype, as the unfused add) or ``h = x``;
    ``out = h / sqrt(mean(h^2, -1) + eps) * (weight_offset + weight)``, the statistics and the scale
    in float32 (float64 for float64 inputs) and rounded once to ``out_dtype``. weight_offset 0 is
    Llama's ``weight * x``, 1 Gemma's ``(1 + weight) * x``; weight None: no scale.

    x is float32, float16 or bfloat16 (float64 on the CPU), any shape (non-contiguous inputs are
    copied once); residual has x's shape and dtype; weight ``(x.shape[-1],)`` in x's dtype or
    float32. out_dtype defaults to x's dtype; a float32 x may ask for bfloat16 or float16 (the
    autocast recipe: an fp32 residual stream feeding a 16-bit matmul).

    Returns ``out``, or ``(out, h)`` when residual is given (h is the next residual stream).
    Differentiable in x, residual and weight; grad_weight is reduced in float32, deterministically.
    """
    args = (x, weight, residual, float(eps), float(weight_offset), out_dtype)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad)
        or (residual is not None and residual.requires_grad))
    if not needs_grad:
        # No rstd stored: on Qwen3's q/k norm (128-wide rows) it cost 4% of the forward.
        out, residual_out = _ops.rms_norm(*args)
    elif plain_eager(x, weight, residual):
        out, residual_out, _ = _EagerFunction.apply(*args)
    else:
        out, residual_out, _ = _ops.rms_norm_fwd(*args)
    return out if residual is None else (out, residual_out)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("fuseforge::rms_norm_fwd")
def _rms_norm_fwd_fake(x, weight, residual, eps, weight_offset, out_dtype=None):
    rows = math.prod(x.shape[:-1])
    out = x.new_empty(x.shape, dtype=out_dtype if out_dtype is not None else x.dtype)
    residual_out = x.new_empty(x.shape) if residual is not None else x.new_empty((0,))
    return out, residual_out, x.new_empty((rows,), dtype=_stat_dtype(x.dtype))


@torch.library.register_fake("fuseforge::rms_norm")
def _rms_norm_fake(x, weight, residual, eps, weight_offset, out_dtype=None):
    return _rms_norm_fwd_fake(x, weight, residual, eps, weight_offset, out_dtype)[:2]


@torch.library.register_fake("fuseforge::rms_norm_bwd")
def _rms_norm_bwd_fake(grad_out, grad_residual_out, h, weight, rstd, weight_offset, need_grad_weight):
    grad_input = h.new_empty(h.shape)
    if weight is None:
        return grad_input, h.new_empty((0,))
    return grad_input, weight.new_empty((h.shape[-1],) if need_grad_weight else (0,))


def _fwd_setup_context(ctx, inputs, output):
    x, weight, residual, eps, weight_offset, out_dtype = inputs
    _, residual_out, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.has_residual = residual is not None
    if not ctx.has_residual:
        ctx.mark_non_differentiable(residual_out)  # an empty placeholder
    # A None gradient stays None (no zero tensor of x's size is filled for an unused output).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(residual_out if ctx.has_residual else x, rstd, weight)
    ctx.weight_offset = weight_offset


@once_differentiable("rms_norm")
def _fwd_backward(ctx, grad_out, grad_residual_out, _grad_rstd):
    need_x, need_weight, need_residual = ctx.needs_input_grad[:3]
    if not ctx.has_residual:
        grad_residual_out = None
    if grad_out is None:
        # Only residual_out's gradient reaches here: it passes to x and residual unchanged.
        grad_input = grad_residual_out
        return (grad_input if need_x else None, None, grad_input if need_residual else None, None, None, None)
    h, rstd, weight = ctx.saved_tensors
    need_weight = need_weight and weight is not None
    grad_input, grad_weight = _ops.rms_norm_bwd(grad_out, grad_residual_out, h, weight, rstd, ctx.weight_offset,
                                                need_weight)
    return (grad_input if need_x else None, grad_weight if need_weight else None,
            grad_input if need_residual else None, None, None, None)


torch.library.register_autograd("fuseforge::rms_norm_fwd", _fwd_backward, setup_context=_fwd_setup_context)


# The generic wrapper's per-call Python work is as long as the kernel at a q/k-norm's size.
_EagerFunction = eager_autograd(_ops.rms_norm_fwd, _fwd_setup_context, _fwd_backward)
