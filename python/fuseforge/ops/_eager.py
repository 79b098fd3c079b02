"""Autograd helpers the ops share: the plain-eager fast path, and backwards that refuse a double
backward.

torch.library's autograd wrapper of a custom op costs the host tens of microseconds a forward +
backward (argument re-binding, Python redispatches), as long as a small kernel: a training step
would be paced by the host. In plain eager mode an op therefore calls an autograd.Function with
the same setup_context and backward as its registered autograd (so functorch's transforms work
too); traced calls (torch.compile, fake tensors, Python modes) keep the registered autograd.
"""
from __future__ import annotations

import contextlib
import functools

import torch


def plain_eager(*tensors) -> bool:
    """Plain tensors (or None), outside torch.compile and Python modes: the case where an op may skip
    its custom op's generic autograd wrapper. functorch transforms (torch.func.grad, vmap) take this
    path too: the generic wrapper does not support them."""
    return (not torch.compiler.is_compiling() and all(t is None or type(t) is torch.Tensor for t in tensors)
            and not torch._C._is_torch_function_mode_enabled() and torch._C._len_torch_dispatch_stack() == 0)


def functorch_active() -> bool:
    """Inside a functorch transform (torch.func.grad, vmap, jacrev, ...)."""
    return torch._C._are_functorch_transforms_active()


def eager_autograd(op, setup_context, backward, below_autograd: bool = True) -> "EagerAutograd":
    """The autograd.Function an op calls in plain eager mode: `op` (below autograd, unless a traced
    caller needs the Function: torch.compile does not trace that guard), then the op's registered
    setup_context and backward."""
    below = torch._C._AutoDispatchBelowAutograd if below_autograd else contextlib.nullcontext

    class EagerFunction(torch.autograd.Function):
        # setup_context inside forward: a Function with its own setup_context binds apply's arguments
        # to forward's signature on every call (inspect.signature: +23 us a forward + backward).
        @staticmethod
        def forward(ctx, *inputs):
            with below():
                output = op(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    class TransformableFunction(torch.autograd.Function):
        # functorch's transforms (torch.func.grad, vmap, jacrev) need forward and setup_context apart.
        generate_vmap_rule = True  # vmap runs forward batched (the op's batching fallback)

        @staticmethod
        def forward(*inputs):
            with below():
                return op(*inputs)

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, inputs, output)

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    return EagerAutograd(EagerFunction, TransformableFunction)


class EagerAutograd:
    """`apply` runs the fast Function, or under functorch's transforms the transformable one."""

    def __init__(self, fast: type, transformable: type):
        self.fast, self.transformable = fast, transformable

    def apply(self, *inputs):
        if not torch.compiler.is_compiling() and functorch_active():
            return self.transformable.apply(*inputs)
        return self.fast.apply(*inputs)


def once_differentiable(op_name: str):
    """Decorates an op's backward that is not itself differentiable (its kernels have no backward), so
    a gradient of its gradient (``create_graph=True``, then backward through the result) raises a
    clear error instead of silently counting the op's second-order terms as zero. Without grad mode
    (every first-order backward) it calls the backward and nothing more."""

    message = (f"fuseforge.{op_name}: double backward is not supported (its backward is not differentiable); "
               "a gradient of its gradient would be wrong")

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if not torch.is_grad_enabled():
                return backward(ctx, *grads)
            if functorch_active():
                # functorch's grad runs every backward with grad mode on: only a transform that
                # differentiates twice (grad of grad, jacrev of jacrev, hessian) needs this backward's graph.
                if _functorch_differentiations() > 1:
                    raise RuntimeError(message)
                with torch.no_grad():
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
            error = torch._C._functions.DelayedError(message, len(outputs) + len(saved))
            aliases = error(*[o.detach().requires_grad_() if isinstance(o, torch.Tensor) else o for o in outputs],
                            *saved)
            aliases = aliases if isinstance(aliases, tuple) else (aliases,)
            return aliases[0] if single else tuple(aliases[:len(outputs)])

        return wrapper

    return decorate


def _functorch_differentiations() -> int:
    """How many of the active functorch transforms differentiate (grad / vjp / jacrev, jvp / jacfwd)."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    return sum(i.key() in (TransformType.Grad, TransformType.Jvp) for i in retrieve_all_functorch_interpreters())
