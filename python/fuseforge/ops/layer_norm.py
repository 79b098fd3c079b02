"""layer_norm: LayerNorm over the last dim with an optional fused residual add, forward and backward
(rms_norm's kernels, centered)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from fuseforge.ops._eager import eager_autograd, once_differentiable, plain_eager
from fuseforge.ops.rms_norm import _stat_dtype  # the same kernels' statistics

_ops = torch.ops.fuseforge


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5,
               residual: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None):
    """LayerNorm over the last dim of x, optionally after adding a residual, in one pass over memory.

    ``h = x + residual`` (rounded to x's dtype, as the unfused add) or ``h = x``;
    ``out = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias`` (the biased variance, as
    ``torch.nn.functional.layer_norm``), the statistics and the arithmetic in float32 (float64 for
    float64 inputs), rounded once to ``out_dtype``. weight / bias None: no scale / no shift.

    x is float32, float16 or bfloat16 (float64 on the CPU), any shape (non-contiguous inputs are
    copied once); residual has x's shape and dtype; weight and bias ``(x.shape[-1],)`` in x's dtype or
    float32. out_dtype defaults to x's dtype; a float32 x may ask for bfloat16 or float16.

    Returns ``out``, or ``(out, h)`` when residual is given (h is the next residual stream).
    Differentiable in x, residual, weight and bias; their gradients are reduced in float32,
    deterministically.
    """
    args = (x, weight, bias, residual, float(eps), out_dtype)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad) or (residual is not None and residual.requires_grad))
    if not needs_grad:
        out, residual_out = _ops.layer_norm(*args)
    elif plain_eager(x, weight, bias, residual):
        out, residual_out, _, _ = _EagerFunction.apply(*args)
    else:
        out, residual_out, _, _ = _ops.layer_norm_fwd(*args)
    return out if residual is None else (out, residual_out)


@torch.library.register_fake("fuseforge::layer_norm_fwd")
def _layer_norm_fwd_fake(x, weight, bias, residual, eps, out_dtype=None):
    rows = math.prod(x.shape[:-1])
    out = x.new_empty(x.shape, dtype=out_dtype if out_dtype is not None else x.dtype)
    residual_out = x.new_empty(x.shape) if residual is not None else x.new_empty((0,))
    stat = x.new_empty((rows,), dtype=_stat_dtype(x.dtype))
    return out, residual_out, stat, torch.empty_like(stat)


@torch.library.register_fake("fuseforge::layer_norm")
def _layer_norm_fake(x, weight, bias, residual, eps, out_dtype=None):
    return _layer_norm_fwd_fake(x, weight, bias, residual, eps, out_dtype)[:2]


@torch.library.register_fake("fuseforge::layer_norm_bwd")
def _layer_norm_bwd_fake(grad_out, grad_residual_out, h, weight, mean, rstd, need_grad_weight, grad_bias_dtype):
    cols = h.shape[-1]
    grad_weight = (h.new_empty((0,)) if weight is None
                   else weight.new_empty((cols,) if need_grad_weight else (0,)))
    grad_bias = (h.new_empty((0,), dtype=_stat_dtype(h.dtype)) if grad_bias_dtype is None
                 else h.new_empty((cols,), dtype=grad_bias_dtype))
    return h.new_empty(h.shape), grad_weight, grad_bias


def _fwd_setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, out_dtype = inputs
    _, residual_out, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.has_residual = residual is not None
    if not ctx.has_residual:
        ctx.mark_non_differentiable(residual_out)  # an empty placeholder
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(residual_out if ctx.has_residual else x, mean, rstd, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype


@once_differentiable("layer_norm")
def _fwd_backward(ctx, grad_out, grad_residual_out, _grad_mean, _grad_rstd):
    need_x, need_weight, need_bias, need_residual = ctx.needs_input_grad[:4]
    if not ctx.has_residual:
        grad_residual_out = None
    if grad_out is None:
        # Only residual_out's gradient reaches here: it passes to x and residual unchanged.
        grad_input = grad_residual_out
        return (grad_input if need_x else None, None, None, grad_input if need_residual else None, None, None)
    h, mean, rstd, weight = ctx.saved_tensors
    need_weight = need_weight and weight is not None
    need_bias = need_bias and ctx.bias_dtype is not None
    # grad_bias comes in the bias's dtype (no cast here: a launch less).
    grad_input, grad_weight, grad_bias = _ops.layer_norm_bwd(grad_out, grad_residual_out, h, weight, mean, rstd,
                                                             need_weight, ctx.bias_dtype if need_bias else None)
    return (grad_input if need_x else None, grad_weight if need_weight else None,
            grad_bias if need_bias else None, grad_input if need_residual else None, None, None)


torch.library.register_autograd("fuseforge::layer_norm_fwd", _fwd_backward, setup_context=_fwd_setup_context)


_EagerFunction = eager_autograd(_ops.layer_norm_fwd, _fwd_setup_context, _fwd_backward)
