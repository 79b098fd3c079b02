"""The plain-eager fast path the ops share.

torch.library's autograd wrapper of a custom op costs the host tens of microseconds a forward +
backward (argument re-binding, Python redispatches), as long as a small kernel: a training step
would be paced by the host. In plain eager mode an op therefore calls an autograd.Function with
the same setup_context and backward as its registered autograd; traced calls (torch.compile, fake
tensors, functorch transforms, Python modes) keep the registered autograd.
"""
from __future__ import annotations

import torch


def plain_eager(*tensors) -> bool:
    """Plain tensors (or None), outside torch.compile, functorch transforms and Python modes: the case
    where an op may skip its custom op's generic autograd wrapper."""
    return (not torch.compiler.is_compiling() and all(t is None or type(t) is torch.Tensor for t in tensors)
            and torch._C._functorch.maybe_current_level() is None
            and not torch._C._is_torch_function_mode_enabled() and torch._C._len_torch_dispatch_stack() == 0)


def eager_autograd(op, setup_context, backward) -> type:
    """The autograd.Function an op calls in plain eager mode: `op` below autograd, then the op's
    registered setup_context and backward."""

    class EagerFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            with torch._C._AutoDispatchBelowAutograd():
                output = op(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    return EagerFunction
