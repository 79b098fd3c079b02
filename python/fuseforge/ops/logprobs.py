"""linear_logprobs: per-token log-probabilities of targets under a linear head, without the logits; and
sequence_chunked_loss, sequence-level losses on the same row kernels with their gradients in the forward."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from fuseforge.ops._eager import functorch_active, once_differentiable, plain_eager
from fuseforge.ops.linear_cross_entropy import linear_cross_entropy, per_token_loss_and_entropy

_ops = torch.ops.fuseforge


def linear_logprobs(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                    temperature: float = 1.0, ignore_index: int = -100, softcap: Optional[float] = None,
                    return_entropy: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """``log_softmax((x @ weight.T + bias) / temperature)[..., target]`` per token, differentiable in x,
    weight and bias, without the (tokens x vocab) logits: the building block of policy-gradient losses
    (GRPO, PPO, RLOO) and of preference losses that sum a sequence's log-probabilities.

    It is ``-linear_cross_entropy(x / temperature, weight, target, bias / temperature,
    reduction="none")``: the fused loss's kernels (a chunked log-sum-exp on the GPU, float32
    arithmetic) with every token's gradient weighted by its own upstream gradient. With 16-bit inputs
    and a temperature other than 1, ``x / temperature`` is rounded to the input dtype once (about
    the rounding of eager 16-bit ``logits / temperature``; the log-probabilities are then within the
    dtype's epsilon, not float32's). ``softcap`` caps
    the logits first (``softcap * tanh(z / softcap)``, Gemma 2's final logits); it cannot be combined
    with a temperature other than 1 (the cap would apply to the tempered logits).

    Args:
        x: (..., H) float32, float16 or bfloat16 (float64 on the CPU).
        weight: (V, H), x's dtype.  bias: (V,) or None.
        target: (...) int64 or int32 token ids in [0, V), or ``ignore_index`` (log-probability 0, no
            gradient).
        temperature: a positive number; the logits are divided by it (sampling's temperature).
        return_entropy: also return each token's entropy ``-sum_j p_j log p_j`` of the same (tempered,
            capped) distribution, differentiable too (an entropy bonus or regulariser). It comes from
            the same pass over the logits (one more running sum beside the log-sum-exp); the backward
            takes the entropy's gradient in the same recomputation, and costs nothing more when the
            entropy gets none. Ignored tokens (``ignore_index``: prompt, padding) have entropy 0 and no
            gradient, as their log-probability; to get the entropy at a position without a target,
            give it any valid id there.
    Returns: float32 (float64 for float64 inputs) log-probabilities, target's shape; with
    ``return_entropy`` the tuple (log-probabilities, entropies), both of that shape and dtype.
    """
    temperature = float(temperature)
    if not temperature > 0.0:
        raise ValueError(f"temperature must be a positive number, got {temperature}")
    if softcap is not None and temperature != 1.0:
        raise ValueError("softcap and a temperature other than 1 cannot be combined: the cap would apply to the "
                         "tempered logits")
    if temperature != 1.0:
        x = x / temperature
        bias = bias / temperature if bias is not None else None
    if return_entropy:
        nll, entropy = per_token_loss_and_entropy(x, weight, target, bias, ignore_index=ignore_index, softcap=softcap)
        return -nll, entropy
    return -linear_cross_entropy(x, weight, target, bias, ignore_index=ignore_index, reduction="none",
                                 softcap=softcap)


# ---------------------------------------------------------------------------------------------------
# Sequence-level losses with their gradients in the forward

# Logit bytes a chunk of whole sequences holds (at least one sequence group a chunk): two 2 x 1024-token
# pairs at V = 128256 or 151936 in bf16.
CHUNK_LOGIT_BYTES = 1280 << 20
_CHUNKED_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
# Devices that take the chunked path. The CPU keeps the per-token path: its fused row kernels beat the
# rows ops' ATen passes there (DPO at 4096 tokens x 256 x 8000 on 2 cores: 534 against 836 ms).
CHUNKED_DEVICES = ("cuda",)


def sequence_loss_chunkable(hiddens: Sequence[Tensor], weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether sequence_chunked_loss serves these inputs: plain eager tensors (not traced: the chunk loop
    takes each chunk's loss gradient with autograd.grad) on a device of CHUNKED_DEVICES, a gradient
    wanted, bf16 / float32 / float64 (float16 logit gradients of probabilities ~1/V times a per-pair
    weight would underflow)."""
    tensors = (*hiddens, weight, bias)
    if not torch.is_grad_enabled() or weight.device.type not in CHUNKED_DEVICES or not plain_eager(*tensors):
        return False
    if functorch_active():  # its forward computes the gradients itself
        return False
    if weight.dtype not in _CHUNKED_DTYPES or any(h.dtype != weight.dtype for h in hiddens):
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def sequence_chunked_loss(hiddens: Sequence[Tensor], ids: Sequence[Tensor], weight: Tensor, bias: Optional[Tensor],
                          loss_of_logprobs: Callable[[list, int, int], Tensor], *, ignore_index: int = -100) -> Tensor:
    """A loss that sums over groups of sequences (pairs, completions), with its gradients computed in the
    forward: three matrix products instead of the per-token path's four.

    hiddens[k]: (B, T_k, H) the hidden states of stream k (chosen, rejected, ...), ids[k]: (B, T_k) their
    targets (ignore_index: no log-probability). Chunks of whole groups b0:b1 (as many as
    CHUNK_LOGIT_BYTES of logits hold): logits = x @ W^T in the input dtype (cuBLAS), per-row log-sum-exp
    and target log-probability (linear_cross_entropy_rows_stats), then loss_of_logprobs([(b1 - b0, T_k)
    log-probabilities of each stream], b0, b1), the chunk's term of the loss, and its gradient by each
    log-probability (autograd on those few values), which weights the logit gradients, formed in place
    (linear_cross_entropy_rows_grad_); grad_x rows = dz @ W, grad_W (+)= dz^T x (cuBLAS, one rounding to
    the input dtype a chunk), grad_b (+)= sum dz in float32. The loss is the sum of the chunks' terms.

    Not twice differentiable, and one backward only (its gradients are handed over, scaled in place).
    """
    return _SequenceChunkedLoss.apply(loss_of_logprobs, int(ignore_index), weight, bias,
                                      *[t for pair in zip(hiddens, ids) for t in pair])


class _SequenceChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss_of_logprobs, ignore_index, weight, bias, *streams):
        hiddens, ids = streams[0::2], streams[1::2]
        groups = hiddens[0].shape[0]
        vocab, hidden = weight.shape
        lengths = [h.shape[1] for h in hiddens]
        for k, (h, t) in enumerate(zip(hiddens, ids)):
            if h.dim() != 3 or h.shape[0] != groups or h.shape[2] != hidden or t.shape != h.shape[:2]:
                raise ValueError(f"stream {k}: hidden states must have shape (B, T, {hidden}) with B = {groups} and "
                                 f"ids shape (B, T); got {tuple(h.shape)} and {tuple(t.shape)}")
        want_x = [h.requires_grad for h in hiddens]
        want_w = weight.requires_grad
        want_b = bias is not None and bias.requires_grad
        row_bytes = max(1, sum(lengths) * vocab * weight.element_size())
        per_chunk = max(1, CHUNK_LOGIT_BYTES // row_bytes)
        stats_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_x = [torch.empty(h.shape, dtype=h.dtype, device=h.device) if w else None for h, w in zip(hiddens, want_x)]
        grad_w = torch.zeros_like(weight) if want_w and groups == 0 else None
        grad_b = torch.zeros(vocab, dtype=stats_dtype, device=weight.device) if want_b else None
        total = torch.zeros((), dtype=stats_dtype, device=weight.device)
        for b0 in range(0, groups, per_chunk):
            b1 = min(groups, b0 + per_chunk)
            n = b1 - b0
            sizes = [n * length for length in lengths]  # each stream's rows in the chunk
            x_rows = torch.cat([h[b0:b1].reshape(-1, hidden) for h in hiddens])
            t_rows = torch.cat([t[b0:b1].reshape(-1) for t in ids])
            logits = torch.mm(x_rows, weight.t())
            stats = _ops.linear_cross_entropy_rows_stats(logits, x_rows, weight, t_rows, bias, ignore_index, 0.0)
            with torch.enable_grad():
                leaves = [lp.view(n, length).detach().requires_grad_()
                          for lp, length in zip((-stats[1]).split(sizes), lengths)]
                term = loss_of_logprobs(leaves, b0, b1)
                grads = torch.autograd.grad(term, leaves, allow_unused=True)
            total += term.detach().to(stats_dtype)
            # d term / d logits = g (onehot - p): the rows' weights of (p - onehot) are -g.
            row_scale = torch.cat([-(g if g is not None else torch.zeros_like(lp)).reshape(-1).to(stats_dtype)
                                   for g, lp in zip(grads, leaves)])
            _ops.linear_cross_entropy_rows_grad_(logits, stats, t_rows, bias, row_scale, ignore_index, 0.0)
            if any(want_x):
                gx_rows = torch.mm(logits, weight).split(sizes)
                for gx, part, length in zip(grad_x, gx_rows, lengths):
                    if gx is not None:
                        gx[b0:b1] = part.view(n, length, hidden)
            if want_w:
                if grad_w is None:
                    grad_w = torch.mm(logits.t(), x_rows)
                else:
                    grad_w.addmm_(logits.t(), x_rows)  # cuBLAS beta = 1: one rounding a chunk
            if want_b:
                grad_b += logits.sum(0, dtype=stats_dtype)
            del logits
        ctx.stash = (grad_x, grad_w, grad_b.to(weight.dtype) if want_b else None)
        return total

    @staticmethod
    @once_differentiable("ops.logprobs.sequence_chunked_loss")
    def backward(ctx, grad_loss):
        if ctx.stash is None:
            raise RuntimeError("a chunked sequence loss (fuseforge.nn's preference losses) computes its gradients in "
                               "its forward and hands them to the first backward: a second backward through the same "
                               "graph is not supported; compute the loss again")
        grad_x, grad_w, grad_b = ctx.stash
        ctx.stash = None
        one = torch.ones((), dtype=torch.float32, device=grad_loss.device)
        empty = grad_loss.new_empty(0)
        # In place, skipped on the device when grad_loss is 1 (no pass over grad_W, no host sync).
        tensors = [g for g in (*grad_x, grad_w, grad_b) if g is not None]
        for g in tensors:
            _ops.linear_cross_entropy_scale_grads_(g, empty, empty, grad_loss, one)
        return (None, None, grad_w, grad_b) + tuple(v for gx in grad_x for v in (gx, None))
