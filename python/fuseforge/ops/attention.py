"""attention: FlashAttention-style scaled dot-product attention, forward and backward, on padded
(B, H, S, D) batches and on packed variable-length batches (``attention_varlen``)."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from fuseforge.ops._eager import eager_autograd, once_differentiable

_ops = torch.ops.fuseforge

Window = Optional[Sequence[Optional[int]]]


def _resolve_scale(scale: Optional[float], head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def _resolve_window(window: Window) -> Tuple[int, int]:
    """(left, right) with -1 (or None) for an unbounded side; None: no window."""
    if window is None:
        return -1, -1
    if len(window) != 2:
        raise ValueError(f"window must be a pair (left, right), got {window!r}")
    left, right = (-1 if w is None else int(w) for w in window)
    return left, right


def _resolve_softcap(softcap: Optional[float]) -> float:
    return 0.0 if softcap is None else float(softcap)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
              window: Window = None, softcap: Optional[float] = None, return_lse: bool = False,
              deterministic: bool = False):
    """``softmax(z [mask]) @ v`` with ``z = scale * q @ k^T``, without an S x S matrix in memory.

    SDPA's layout: q (B, Hq, Sq, D), k and v (B, Hk, Sk, D); any strides with a contiguous last dim
    (``(B, S, H, D)`` tensors passed as ``.transpose(1, 2)`` run without a copy). Hk must divide Hq
    (grouped-query / multi-query attention). ``scale`` defaults to ``1 / sqrt(D)``.

    Masks are aligned to the bottom right when Sq != Sk, as FlashAttention-2 does: with
    ``off = Sk - Sq``, ``causal`` lets query i see key j when ``j <= i + off``, and
    ``window=(left, right)`` when ``i + off - left <= j <= i + off + right`` (``-1`` or ``None``: no
    bound on that side; with ``causal`` the right bound is 0). A sliding window of W tokens
    including the query itself (Mistral's ``sliding_window=W``) is ``causal=True, window=(W - 1, 0)``.
    ``softcap=c`` replaces the scores by ``c * tanh(z / c)`` (Gemma 2's attention logit softcapping;
    on CUDA tanh is the GPU's ``tanh.approx.f32``, ~2^-11 relative, as in FlashAttention).
    A row that sees no key gives zeros (and an LSE of -inf).

    CUDA: float16 and bfloat16, head dims that are multiples of 8 up to 128 (the kernels are built
    for 64 and 128; a head dim of 96 runs the 128 kernel at 128's cost) and 256 (Gemma 2; its
    backward needs an H100/H200 and the default sm_90a build). CPU: float32 and float64 (float16/bfloat16 are
    computed in float32). Returns the output (strides of q), and with ``return_lse`` also the
    float32 (float64 for float64 inputs) log-sum-exp (B, Hq, Sq) of the scores (not
    differentiable). Differentiable in q, k and v; ``deterministic=True`` makes the backward avoid
    floating-point atomics.
    """
    scale_f = _resolve_scale(scale, q.shape[-1])
    left, right = _resolve_window(window)
    cap = _resolve_softcap(softcap)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _AttentionFn.apply(q, k, v, bool(causal), scale_f, left, right, cap, bool(deterministic))
    else:
        out, lse = _ops.attention_fwd(q, k, v, bool(causal), scale_f, left, right, cap)
    return (out, lse) if return_lse else out


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, scale: Optional[float] = None,
                     window: Window = None, softcap: Optional[float] = None, return_lse: bool = False,
                     deterministic: bool = False):
    """Attention on a packed batch of variable-length sequences (FlashAttention's varlen layout).

    q (total_q, Hq, D), k and v (total_k, Hk, D): the sequences one after another, no padding.
    ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 (B + 1,) cumulative lengths on q's device (sequence b
    is rows ``cu[b]:cu[b + 1]``, ``cu[0] = 0``, ``cu[B]`` = total). ``max_seqlen_q`` /
    ``max_seqlen_k``: Python ints at least every sequence's length (they size the grid). The op never
    reads cu_seqlens on the host, so it never synchronizes; the caller derives the max lengths once
    per batch, where the batch is built (``cu_seqlens_from_lengths`` / ``cu_seqlens_from_position_ids``
    return them). On CUDA, cu_seqlens that are not increasing, do not start at 0 and end at the total,
    or hold a sequence longer than the max lengths stop the kernel with a device-side assert naming the
    problem; on the CPU they raise.

    Each sequence attends only within itself; ``causal``, ``window`` and ``softcap`` as in
    :func:`attention`, per sequence (bottom-right aligned when its q and k lengths differ). Returns
    the output (total_q, Hq, D) and with ``return_lse`` the float32 LSE (Hq, total_q).
    """
    scale_f = _resolve_scale(scale, q.shape[-1])
    left, right = _resolve_window(window)
    cap = _resolve_softcap(softcap)
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _AttentionVarlenFn.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, bool(causal),
                                            scale_f, left, right, cap, bool(deterministic))
    else:
        out, lse = _ops.attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, bool(causal),
                                             scale_f, left, right, cap)
    return (out, lse) if return_lse else out


def cu_seqlens_from_lengths(lengths, device=None) -> Tuple[Tensor, int]:
    """(cu_seqlens int32 (B + 1,), max length) from a list (or CPU tensor) of sequence lengths."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1).cpu()
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    if lengths.numel():
        cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    max_len = int(lengths.max()) if lengths.numel() else 0
    return cu.to(device) if device is not None else cu, max_len


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tuple[Tensor, int]:
    """(cu_seqlens, max length) of a packed row whose ``position_ids`` restart at 0 at each document
    (Hugging Face's ``DataCollatorWithFlattening``); (1, total) or (total,). Reads the positions on
    the host once (one synchronization, where the batch is built)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    total = pos.numel()
    if total and (starts.numel() == 0 or int(starts[0]) != 0):
        raise ValueError("position_ids must start at 0 (each document's first token has position 0)")
    bounds = torch.cat([starts, torch.tensor([total], device=pos.device)]).to(torch.int32)
    max_len = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
    return bounds, max_len


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.register_fake("fuseforge::attention_fwd")
def _attention_fwd_fake(q, k, v, causal, scale, window_left=-1, window_right=-1, softcap=0.0):
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=_lse_dtype(q))
    return out, lse


@torch.library.register_fake("fuseforge::attention_bwd")
def _attention_bwd_fake(grad_out, q, k, v, out, lse, causal, scale, deterministic, window_left=-1, window_right=-1,
                        softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("fuseforge::attention_varlen_fwd")
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                               window_left=-1, window_right=-1, softcap=0.0):
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))
    return out, lse


@torch.library.register_fake("fuseforge::attention_varlen_bwd")
def _attention_varlen_bwd_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, scale, deterministic, window_left=-1, window_right=-1, softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# The ops' autograd (torch.ops.fuseforge.attention_fwd called directly, opcheck), and that of the
# Functions attention() and attention_varlen() call, whose inputs end with `deterministic`, a
# backward-only flag the ops do not take.
def _fwd_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, *rest = inputs
    left, right, softcap, deterministic = (list(rest) + [-1, -1, 0.0, False][len(rest):])
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (causal, scale, deterministic, left, right, softcap)
    ctx.num_inputs = len(inputs)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zeros for lse's gradient, which is never used


@once_differentiable("attention")
def _fwd_backward(ctx, grad_out, _grad_lse):
    if grad_out is None:  # undefined output gradient (gradcheck's check_undefined_grad passes one)
        return (None,) * ctx.num_inputs
    q, k, v, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v = _ops.attention_bwd(grad_out, q, k, v, out, lse, *ctx.args)
    return (grad_q, grad_k, grad_v) + (None,) * (ctx.num_inputs - 3)


def _varlen_fwd_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, *rest = inputs
    left, right, softcap, deterministic = (list(rest) + [-1, -1, 0.0, False][len(rest):])
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, causal, scale, deterministic, left, right, softcap)
    ctx.num_inputs = len(inputs)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


@once_differentiable("attention_varlen")
def _varlen_fwd_backward(ctx, grad_out, _grad_lse):
    if grad_out is None:  # undefined output gradient (gradcheck's check_undefined_grad passes one)
        return (None,) * ctx.num_inputs
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    grad_q, grad_k, grad_v = _ops.attention_varlen_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return (grad_q, grad_k, grad_v) + (None,) * (ctx.num_inputs - 3)


torch.library.register_autograd("fuseforge::attention_fwd", _fwd_backward, setup_context=_fwd_setup_context)
torch.library.register_autograd("fuseforge::attention_varlen_fwd", _varlen_fwd_backward,
                                setup_context=_varlen_fwd_setup_context)

# Called in every mode, torch.compile included (the op's own autograd would drop `deterministic`).
_AttentionFn = eager_autograd(lambda *inputs: _ops.attention_fwd(*inputs[:8]), _fwd_setup_context, _fwd_backward,
                              below_autograd=False)
_AttentionVarlenFn = eager_autograd(lambda *inputs: _ops.attention_varlen_fwd(*inputs[:12]),
                                    _varlen_fwd_setup_context, _varlen_fwd_backward, below_autograd=False)
