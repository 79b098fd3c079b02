"""Autograd helpers the ops share: the plain-eager fast path, and backwards that refuse a double
backward.

torch.library's autograd wrapper of a custom op costs the host tens of microseconds a forward +
backward (argument re-binding, Python redispatches), as long as a small kernel: a training step
would be paced by the host. In plain eager mode an op therefore calls an autograd.Function with
the same setup_context and backward as its registered autograd; traced calls (torch.compile, fake
tensors, functorch transforms, Python modes) keep the registered autograd.
"""
from __future__ import annotations

import functools

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


def once_differentiable(op_name: str):
    """Decorates an op's backward that is not itself differentiable (its kernels have no backward), so
    a gradient of its gradient (``create_graph=True``, then backward through the result) raises a
    clear error instead of silently counting the op's second-order terms as zero. Without grad mode
    (every first-order backward) it calls the backward and nothing more."""

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled():
                return backward(ctx, *grads)
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            single = not isinstance(outputs, tuple)
            outputs = (outputs,) if single else outputs
            if not any(isinstance(o, torch.Tensor) for o in outputs):
                return outputs[0] if single else outputs
            # Aliases whose own backward raises (as torch.autograd.function's once_differentiable builds
            # them), with the saved inputs that require grad as further inputs of that node: a gradient
            # taken towards those inputs then runs it, where a detached alias alone would be pruned
            # from the graph and read as a zero.
            saved = [t for t in ctx.saved_tensors if isinstance(t, torch.Tensor) and t.requires_grad]
            error = torch._C._functions.DelayedError(
                f"fuseforge.{op_name}: double backward is not supported (its backward is not differentiable); "
                "a gradient of its gradient would be wrong", len(outputs) + len(saved))
            aliases = error(*[o.detach().requires_grad_() if isinstance(o, torch.Tensor) else o for o in outputs],
                            *saved)
            aliases = aliases if isinstance(aliases, tuple) else (aliases,)
            return aliases[0] if single else tuple(aliases[:len(outputs)])

        return wrapper

    return decorate
