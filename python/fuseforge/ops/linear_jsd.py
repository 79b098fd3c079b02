"""linear_jsd / linear_kl_div: distillation between a student's and a teacher's linear heads without
either's (tokens x vocab) logits."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from fuseforge.ops._eager import eager_autograd, once_differentiable, plain_eager
from fuseforge.ops.linear_cross_entropy import REDUCTIONS, _is_eager  # and linear_cross_entropy_scale_grads_'s fake

_ops = torch.ops.fuseforge


def linear_jsd(student_x: Tensor, student_weight: Tensor, teacher_x: Tensor, teacher_weight: Tensor,
               target: Optional[Tensor] = None, *, beta: float = 0.5, temperature: float = 1.0,
               ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """Generalised Jensen-Shannon divergence between the teacher's and the student's token
    distributions, fused with both linear heads.

    With P = softmax(teacher_x @ teacher_weight.T / temperature) (the teacher) and
    Q = softmax(student_x @ student_weight.T / temperature) (the student), per token:

    - 0 < beta < 1: ``beta * KL(P || M) + (1 - beta) * KL(Q || M)``, M = beta * P + (1 - beta) * Q;
    - beta = 0: the forward KL(P || Q) = sum P (log P - log Q);
    - beta = 1: the reverse KL(Q || P) = sum Q (log Q - log P).

    This is Liger-Kernel's convention (``LigerFusedLinearJSD`` / ``LigerJSD``): its generalised JSD is
    0 at beta = 0 and 1, which are taken as the two KL divergences instead. No temperature**2 factor.

    Args:
        student_x: (..., Hs) float32, float16 or bfloat16 (float64 on the CPU); any strides.
        student_weight: (V, Hs).  teacher_x: (..., Ht), the leading dims of student_x.
        teacher_weight: (V, Ht). Hs and Ht may differ; every input has student_x's dtype.
        target: None, or (...) int64/int32 (the leading dims of student_x): tokens equal to
            ``ignore_index`` have no loss and no gradient; any other value is not read (like
            Liger-Kernel's shift_labels).
        reduction: "mean" (over the tokens not skipped; every token when target is None; 0 when all
            are skipped), "sum", or "none" (the leading dims of student_x).

    Returns the loss in float32 (float64 for float64 inputs).

    Gradients flow to student_x and student_weight only: the teacher's inputs are detached (a teacher
    that requires grad gets none from this loss, as in Liger-Kernel). With reduction "mean"/"sum" the
    forward computes the gradients too and the backward only scales them by grad_output; with
    "none" (or a repeated backward) the backward recomputes both heads' logits. Not twice
    differentiable.

    Memory: on the GPU, row chunks of both heads' float32 logits (256 MiB for 16-bit inputs, 768 MiB
    for float32 ones) and, for 16-bit inputs with gradients, a super-chunk of logit gradients in the
    input dtype (512 MiB: 2088 rows at V = 128256); 32 MiB of logits a head on the CPU. The student's
    weight gradient accumulates over super-chunks in cuBLAS (float32 inside, one rounding to
    bf16/fp16 a super-chunk) for at most 16 of them, else in a float32 (V, Hs) buffer.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not (math.isfinite(float(temperature)) and float(temperature) > 0.0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    # The teacher is a constant of this loss: detached, so no graph through it is kept or walked.
    teacher_x, teacher_weight = teacher_x.detach(), teacher_weight.detach()
    needs_grad = torch.is_grad_enabled() and (student_x.requires_grad or student_weight.requires_grad)
    args = (student_x, student_weight, teacher_x, teacher_weight, target, float(beta), float(temperature),
            int(ignore_index), reduction, needs_grad and student_x.requires_grad,
            needs_grad and student_weight.requires_grad)
    if plain_eager(student_x, student_weight, teacher_x, teacher_weight, target):
        if needs_grad:
            return _EagerFunction.apply(*args)[0]
        with torch._C._AutoDispatchBelowAutograd():
            return _ops.linear_jsd_fwd(*args)[0]
    return _ops.linear_jsd_fwd(*args)[0]


def linear_kl_div(student_x: Tensor, student_weight: Tensor, teacher_x: Tensor, teacher_weight: Tensor,
                  target: Optional[Tensor] = None, *, reverse: bool = False, temperature: float = 1.0,
                  ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """KL divergence between the teacher's P and the student's Q, fused with both linear heads:
    KL(P || Q) (forward, the default), or KL(Q || P) with ``reverse=True``. ``linear_jsd`` with beta 0
    or 1; the same arguments, gradients and memory."""
    return linear_jsd(student_x, student_weight, teacher_x, teacher_weight, target, beta=1.0 if reverse else 0.0,
                      temperature=temperature, ignore_index=ignore_index, reduction=reduction)


def _loss_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.register_fake("fuseforge::linear_jsd_fwd")
def _fwd_fake(student_x, student_weight, teacher_x, teacher_weight, target, beta, temperature, ignore_index,
              reduction, grad_x, grad_weight):
    loss = student_x.new_empty(student_x.shape[:-1] if reduction == "none" else (), dtype=_loss_dtype(student_x))
    pre = reduction != "none"
    gx = student_x.new_empty(student_x.shape if pre and grad_x else (0,))
    gw = student_x.new_empty(student_weight.shape if pre and grad_weight else (0,))
    return loss, gx, gw, student_x.new_empty((), dtype=torch.float32)


@torch.library.register_fake("fuseforge::linear_jsd_bwd")
def _bwd_fake(grad_loss, student_x, student_weight, teacher_x, teacher_weight, target, beta, temperature,
              ignore_index, reduction, grad_x, grad_weight):
    return (student_x.new_empty(student_x.shape if grad_x else (0,)),
            student_x.new_empty(student_weight.shape if grad_weight else (0,)))


def _setup_context(ctx, inputs, output):
    (student_x, student_weight, teacher_x, teacher_weight, target, beta, temperature, ignore_index, reduction,
     grad_x, grad_weight) = inputs
    _, gx, gw, grad_scale = output
    ctx.mark_non_differentiable(gx, gw, grad_scale)
    # No zero-filled gradients for the non-differentiable outputs (a V x H one would double the peak).
    ctx.set_materialize_grads(False)
    ctx.requested = (grad_x, grad_weight)
    ctx.precomputed = reduction != "none" and (grad_x or grad_weight)
    ctx.settings = (beta, temperature, ignore_index, reduction)
    ctx.stash = None
    inputs_to_save = (student_x, student_weight, teacher_x, teacher_weight, target)
    if ctx.precomputed and _is_eager(gx, gw):
        # Eager: the first backward hands these gradients over (scaled in place) and drops them; a
        # repeated backward (retain_graph, gradcheck) recomputes from the saved inputs.
        ctx.stash = (gx, gw, grad_scale)
        ctx.save_for_backward(*inputs_to_save)
    elif ctx.precomputed:
        ctx.save_for_backward(*inputs_to_save, gx, gw, grad_scale)
    else:
        ctx.save_for_backward(*inputs_to_save)


@once_differentiable("linear_jsd")
def _backward(ctx, grad_loss, *_unused):
    if grad_loss is None:  # the loss got no gradient
        return (None,) * 11
    want_x, want_w = ctx.requested
    need_x, need_w = ctx.needs_input_grad[0] and want_x, ctx.needs_input_grad[1] and want_w
    saved = ctx.saved_tensors
    student_x, student_weight, teacher_x, teacher_weight, target = saved[:5]
    if ctx.stash is not None and _is_eager(grad_loss):
        gx, gw, grad_scale = ctx.stash
        ctx.stash = None
        # In place, and not at all when grad_loss * grad_scale == 1 (decided on the device: no sync).
        _ops.linear_cross_entropy_scale_grads_(gx, gw, gx.new_empty(0), grad_loss, grad_scale)
    elif ctx.precomputed and len(saved) == 8:
        # Traced: a plain product, which the compiler fuses (a forward output mutated in the backward
        # would not partition).
        gx, gw, grad_scale = saved[5:]
        s = grad_loss.reshape(()).float() * grad_scale.float()
        gx, gw = gx * s, gw * s
    else:
        beta, temperature, ignore_index, reduction = ctx.settings
        gx, gw = _ops.linear_jsd_bwd(grad_loss, student_x, student_weight, teacher_x, teacher_weight, target, beta,
                                     temperature, ignore_index, reduction, need_x, need_w)
    return (gx if need_x else None, gw if need_w else None) + (None,) * 9


torch.library.register_autograd("fuseforge::linear_jsd_fwd", _backward, setup_context=_setup_context)

_EagerFunction = eager_autograd(_ops.linear_jsd_fwd, _setup_context, _backward)
