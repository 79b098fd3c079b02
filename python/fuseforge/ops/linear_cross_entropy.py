"""linear_cross_entropy: cross_entropy(x @ weight.T + bias, target) without the N x V logits."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fuseforge.ops._eager import eager_autograd, functorch_active, once_differentiable, plain_eager

_ops = torch.ops.fuseforge

REDUCTIONS = ("mean", "sum", "none")
_NUM_INPUTS = 14  # linear_cross_entropy_fwd's arguments: its backward returns one gradient (or None) each


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None, low_memory: bool = False) -> Tensor:
    """Cross-entropy of the linear head ``x @ weight.T + bias`` against ``target``, fused.

    Same result as ``F.cross_entropy(F.linear(x, weight, bias).flatten(0, -2).float(), target.flatten(),
    ignore_index=..., reduction=..., label_smoothing=...)`` plus ``z_loss * lse**2`` per token (PaLM's
    z-loss) and, with ``softcap``, logits ``softcap * tanh(logits / softcap)`` (Gemma 2).

    Args:
        x: (..., H) float32, float16 or bfloat16 (float64 on the CPU); any strides.
        weight: (V, H), x's dtype.  bias: (V,) or None.
        target: (...) int64 or int32 class indices in [0, V), or ``ignore_index`` (no loss, no gradient).
        reduction: "mean" (over targets that are not ignored; 0 when all are ignored), "sum" or "none"
            (shape of target).  label_smoothing: in [0, 1).
        low_memory: the strategy that recomputes the logits (4 matrix products instead of 3) and
            keeps only small tiles: on the GPU, peak memory is the gradients plus a float32
            accumulator of a quarter of grad_x's rows (at least 1024 rows) and a logit tile of those
            rows x 4096 columns (48 MiB at N = 8192, H = 4096); grad_weight takes at most 4
            roundings to x's dtype, as on the default strategy. The loss pass before it takes a
            float32 logits tile of at most 64 MiB (2048 x 8192), freed before the gradients exist.

    Returns the loss in float32 (float64 for float64 inputs): a 0-dim tensor, or target's shape for
    reduction="none".

    Memory: the logits never exist whole. The default strategy works on row chunks; its workspace is
    at most max(768 MiB, 1536 V bytes) and does not grow with the number of tokens: a 512-row float32
    logits chunk (256 rows for V > 196608) plus the logit gradients of a super-chunk of rows in x's
    dtype; for bf16 inputs on the GPU's gradient path (reduction mean/sum, V <= 262144, V % 4 == 0)
    cuBLAS writes bf16 logits straight into the super-chunk's gradient rows, which become the
    gradients in place (3072 rows at V = 128256); a bf16 loss-only forward (no gradient wanted,
    reduction mean/sum) stages 1024 bf16 rows. The weight gradient accumulates across
    super-chunks inside cuBLAS (float32 arithmetic, one rounding to bf16/fp16 a super-chunk), at most
    4 roundings per element; beyond 4 super-chunks a float32 V x H accumulator (4 V H bytes, constant
    in N) is used instead. Logits are accumulated in float32 by cuBLAS and stored in float32, or in
    bf16 on those bf16 paths; every row's target logit (and, with label smoothing, the sum of its
    logits) is formed exactly in float32, so on those paths the loss carries only the other logits'
    bf16 rounding: 1e-7 relative on the benchmark's inputs, also on a confident model, at most 1e-4
    in the tests.

    Gradients: with reduction "mean"/"sum" and a gradient required, the forward computes the gradients
    too (one pass over the logits); the backward only multiplies them by grad_output (skipped when it
    is 1). With reduction "none" (or a repeated backward through the same graph) the backward
    recomputes the logits and weights every token by its own grad_output; on the GPU with 16-bit
    inputs it keeps each row's target entry of the logit gradient in float32 (its rounding added
    back) and accumulates grad_weight in float32 (4 V H bytes), so the gradients carry about one
    rounding to the dtype. Not twice differentiable.

    Out-of-range targets: the CPU raises; on CUDA (no host sync) that token's loss and its gradient
    row are NaN, so a mean or sum loss is NaN.
    """
    return _fused(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, low_memory,
                  entropy=False)[0]


def per_token_loss_and_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                               ignore_index: int = -100, softcap: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """``linear_cross_entropy(..., reduction="none")`` and each token's entropy ``-sum_j p_j log p_j`` of its
    (capped) logits' distribution, from the same pass over the logits; both differentiable. Ignored
    tokens have entropy 0 and no gradient. The building block of ``linear_logprobs(...,
    return_entropy=True)``."""
    out = _fused(x, weight, target, bias, ignore_index, "none", 0.0, 0.0, softcap, False, entropy=True)
    return out[0], out[6]


def _fused(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, low_memory, *,
           entropy: bool) -> tuple:
    """The checked arguments through linear_cross_entropy_fwd (its outputs), with autograd."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    args = (x, weight, target, bias, int(ignore_index), reduction, float(label_smoothing), float(z_loss),
            float(softcap) if softcap is not None else 0.0, bool(low_memory),
            needs_grad and x.requires_grad, needs_grad and weight.requires_grad,
            needs_grad and bias is not None and bias.requires_grad, bool(entropy))
    if plain_eager(x, weight, target, bias):
        if needs_grad:
            return _EagerFunction.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return _ops.linear_cross_entropy_fwd(*args)
    return _ops.linear_cross_entropy_fwd(*args)


def _stats_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.register_fake("fuseforge::linear_cross_entropy_fwd")
def _fwd_fake(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, low_memory,
              grad_x, grad_weight, grad_bias, entropy=False):
    sd = _stats_dtype(x)
    loss = x.new_empty(target.shape if reduction == "none" else (), dtype=sd)
    rows = target.numel()
    lse = x.new_empty((2, rows), dtype=sd)  # per-row lse and nll
    pre = reduction != "none" and (grad_x or grad_weight or (grad_bias and bias is not None))
    gx = x.new_empty(x.shape if pre and grad_x else (0,))
    gw = x.new_empty(weight.shape if pre and grad_weight else (0,))
    gb = x.new_empty(bias.shape if pre and grad_bias and bias is not None else (0,))
    ent = x.new_empty(target.shape if entropy else (0,), dtype=sd)
    return loss, lse, gx, gw, gb, x.new_empty((), dtype=torch.float32), ent


@torch.library.register_fake("fuseforge::linear_cross_entropy_bwd")
def _bwd_fake(grad_loss, x, weight, target, bias, lse, ignore_index, reduction, label_smoothing, z_loss, softcap,
              low_memory, grad_x, grad_weight, grad_bias, entropy=None, grad_entropy=None):
    return (x.new_empty(x.shape if grad_x else (0,)),
            x.new_empty(weight.shape if grad_weight else (0,)),
            x.new_empty(bias.shape if grad_bias and bias is not None else (0,)))


@torch.library.register_fake("fuseforge::linear_cross_entropy_rows_stats")
def _rows_stats_fake(logits, x, weight, target, bias, ignore_index, softcap):
    return logits.new_empty((3, logits.shape[0]), dtype=_stats_dtype(logits))


@torch.library.register_fake("fuseforge::linear_cross_entropy_rows_grad_")
def _rows_grad_fake(logits, stats, target, bias, row_scale, ignore_index, softcap):
    return None


@torch.library.register_fake("fuseforge::linear_cross_entropy_scale_grads_")
def _scale_fake(grad_x, grad_weight, grad_bias, grad_loss, grad_scale):
    return None


def _is_eager(*tensors) -> bool:
    """Plain tensors, not traced (torch.compile, functionalization, fake tensors) nor under functorch's
    transforms (whose vmap cannot batch the in-place scaling of the gradients computed in the forward)."""
    return all(type(t) is torch.Tensor for t in tensors) and not functorch_active()


def _setup_context(ctx, inputs, output):
    (x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, low_memory,
     grad_x, grad_weight, grad_bias, entropy) = inputs
    _, lse, gx, gw, gb, grad_scale, ent = output
    ctx.mark_non_differentiable(lse, gx, gw, gb, grad_scale)
    if not entropy:
        ctx.mark_non_differentiable(ent)
    # No zero-filled gradients for the non-differentiable outputs (a V x H one would double the peak).
    ctx.set_materialize_grads(False)
    ctx.has_bias = bias is not None
    ctx.requested = (grad_x, grad_weight, grad_bias and bias is not None)
    ctx.precomputed = reduction != "none" and any(ctx.requested)
    ctx.settings = (ignore_index, reduction, label_smoothing, z_loss, softcap, low_memory)
    ctx.stash = None
    if ctx.precomputed and _is_eager(gx, gw, gb):
        # Eager: the first backward hands these gradients over (scaled in place) and drops them, so
        # autograd can take them as .grad without a copy; a repeated backward (retain_graph,
        # gradcheck) recomputes from the saved inputs.
        ctx.stash = (gx, gw, gb, grad_scale)
        ctx.save_for_backward(x, weight, target, bias, lse)
    elif ctx.precomputed:
        ctx.save_for_backward(x, weight, target, bias, lse, gx, gw, gb, grad_scale)
    else:
        # The entropy (per-token losses only) for its gradient: dH/dz = -p (log p + H).
        ctx.save_for_backward(x, weight, target, bias, lse, ent if entropy else None)



@once_differentiable("linear_cross_entropy")
def _backward(ctx, grad_loss, _lse, _gx, _gw, _gb, _grad_scale, grad_entropy):
    if grad_loss is None and grad_entropy is None:  # neither the loss nor the entropy got a gradient
        return (None,) * _NUM_INPUTS
    want_x, want_w, want_b = ctx.requested
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = ctx.has_bias and ctx.needs_input_grad[3]
    saved = ctx.saved_tensors
    x, weight, target, bias, lse = saved[:5]
    if ctx.stash is not None and _is_eager(grad_loss):
        gx, gw, gb, grad_scale = ctx.stash
        ctx.stash = None
        # In place, and not at all when grad_loss * grad_scale == 1 (decided on the device: no sync,
        # no pass over the weight gradient).
        _ops.linear_cross_entropy_scale_grads_(gx, gw, gb, grad_loss, grad_scale)
    elif ctx.precomputed and len(saved) == 9:
        # Traced: a plain product, which the compiler fuses (a forward output mutated in the
        # backward would not partition).
        gx, gw, gb, grad_scale = saved[5:]
        s = grad_loss.reshape(()).float() * grad_scale.float()
        gx, gw, gb = gx * s, gw * s, gb * s
    else:
        ignore_index, reduction, label_smoothing, z_loss, softcap, low_memory = ctx.settings
        # Without an entropy gradient the entropy is not passed: the plain per-token backward.
        entropy = saved[5] if grad_entropy is not None else None
        if grad_loss is None:  # only the entropy got a gradient
            grad_loss = torch.zeros_like(grad_entropy)
        gx, gw, gb = _ops.linear_cross_entropy_bwd(
            grad_loss, x, weight, target, bias, lse, ignore_index, reduction, label_smoothing, z_loss, softcap,
            low_memory, need_x and want_x, need_w and want_w, need_b and want_b, entropy, grad_entropy)
    return (gx if need_x and want_x else None, gw if need_w and want_w else None, None,
            gb if need_b and want_b else None) + (None,) * (_NUM_INPUTS - 4)


torch.library.register_autograd("fuseforge::linear_cross_entropy_fwd", _backward, setup_context=_setup_context)


# The generic wrapper's per-call Python work: ~30 us a forward+backward on the CPU, 3% of the demo's
# 1024 x 128 x 256 loss.
_EagerFunction = eager_autograd(_ops.linear_cross_entropy_fwd, _setup_context, _backward)
