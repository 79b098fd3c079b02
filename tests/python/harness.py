"""The one test harness every op's tests use.

- devices(): "cpu" and, where a GPU and a CUDA build exist, "cuda" (otherwise that case is skipped
  with the reason).
- randn(): fresh random inputs every call (a moving seed, never zeros; FUSEFORGE_TEST_SEED moves its
  start, so a run can draw other inputs than the default 1234's).
- rel_err() / assert_rel_close(): ||out - ref|| / ||ref|| against a float64 reference, with
  per-dtype tolerances in TOL.
- poison_allocations(): fills the CUDA caching allocator's free blocks with NaN bytes, so an output
  element a kernel forgot to write fails the comparison.
- run_opcheck(), assert_compiles(): torch.library.opcheck and torch.compile(fullgraph=True).
- assert_double_backward_raises(): an op whose backward is not differentiable refuses a gradient of
  its gradient with its own error, rather than counting those terms as zero.
"""
from __future__ import annotations

import itertools
import os
from typing import Callable, Iterable, Sequence

import pytest
import torch

import fuseforge

HAS_CUDA = torch.cuda.is_available() and fuseforge.cuda_built()
CUDA_SKIP_REASON = ("no CUDA GPU on this machine" if not torch.cuda.is_available()
                    else "fuseforge was built without CUDA")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=CUDA_SKIP_REASON)


def _dev_knobs_built() -> bool:
    try:
        from fuseforge._build_info import DEV_KNOBS
    except ImportError:  # built before the flag was recorded
        return False
    return bool(DEV_KNOBS)


# Tests that force a kernel path or a tile choice through a development knob (csrc/common/env.h): the
# knobs exist only in a developer build (FUSEFORGE_DEV=1 at build time; scripts/gpu_check.sh builds one).
DEV_KNOBS = _dev_knobs_built()
requires_dev_knobs = pytest.mark.skipif(
    not DEV_KNOBS, reason="sets a development knob: needs a developer build (FUSEFORGE_DEV=1 at build time)")

# Relative norm error a result may have against float64, by dtype.
TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 8e-3}

_seed = itertools.count(int(os.environ.get("FUSEFORGE_TEST_SEED", "1234")))


def devices() -> list:
    return ["cpu", pytest.param("cuda", marks=requires_cuda)]


def device_dtypes(cpu_dtypes: Sequence[torch.dtype] = (torch.float32, torch.float64, torch.bfloat16),
                  cuda_dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16)) -> list:
    """(device, dtype) pairs for parametrize, the CUDA ones skipped without a GPU."""
    pairs = [pytest.param("cpu", d, id=f"cpu-{str(d)[6:]}") for d in cpu_dtypes]
    pairs += [pytest.param("cuda", d, id=f"cuda-{str(d)[6:]}", marks=requires_cuda) for d in cuda_dtypes]
    return pairs


def generator(device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(next(_seed))
    return g


def randn(*shape, dtype=torch.float32, device="cpu", scale: float = 1.0, requires_grad: bool = False):
    t = torch.randn(*shape, generator=generator(device), device=device, dtype=torch.float32) * scale
    return t.to(dtype).requires_grad_(requires_grad)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has a NaN/inf; absolute when ref is zero."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out64, ref64 = out.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    if out64.numel() == 0:
        return 0.0
    if not torch.isfinite(out64).all():
        return float("inf")
    den = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / den if den > 0 else num


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output") -> float:
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
    return err


def end_rows(rows: int, n: int = 4) -> tuple:
    """The first and the last n rows: where a test of a tensor too large for a whole reference checks
    rows against one."""
    return slice(0, n), slice(rows - n, rows)


def sum_over_row_chunks(term: Callable[[slice], torch.Tensor], rows: int, chunk: int = 8192) -> torch.Tensor:
    """term(s) summed in float64 over consecutive slices s of `chunk` rows: a reference for a sum over
    every row (a weight's gradient) of a tensor too large to upcast whole."""
    return sum(term(slice(r0, min(rows, r0 + chunk))).double() for r0 in range(0, rows, chunk))


def poison_allocations(*like: torch.Tensor | Iterable[int]) -> None:
    """Hands the CUDA caching allocator blocks full of 0xFF bytes (NaN in every float type) of the
    sizes of `like` (tensors, or shapes in bytes), so the next allocations of those sizes start
    poisoned."""
    if not torch.cuda.is_available():
        return
    blocks = []
    for t in like:
        nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else int(t)
        blocks.append(torch.full((max(nbytes, 1),), 0xFF, dtype=torch.uint8, device="cuda"))
    del blocks


def run_opcheck(op, args: tuple, kwargs: dict | None = None) -> None:
    torch.library.opcheck(op, args, kwargs or {})


def assert_compiles(fn: Callable, *args, device: str = "cpu"):
    """torch.compile(fullgraph=True) of fn must trace with no graph break and match eager."""
    torch._dynamo.reset()
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    return compiled(*args)


def assert_compiles_like_eager(fn: Callable, *leaves: torch.Tensor, device: str = "cpu", tol: float = 1e-5) -> None:
    """assert_compiles for a scalar-valued fn of leaves, then its value and its gradients with respect
    to the leaves against eager's."""
    out = assert_compiles(fn, *leaves, device=device)
    grads = torch.autograd.grad(out, leaves)
    eager = fn(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    assert_rel_close(out, eager, tol, "compiled loss")
    for g, e in zip(grads, eager_grads):
        assert_rel_close(g, e, tol, "compiled grad")


def assert_double_backward_raises(fn: Callable, *leaves: torch.Tensor, op_name: str, functorch: bool = True) -> None:
    """fn(*leaves) (a tensor, or a tuple whose first element is differentiated): its gradients taken
    with create_graph=True match those taken without (to the dtype's TOL: a GPU backward may add in
    another order), and backpropagating through them raises "fuseforge.<op_name>: double backward is
    not supported"; with `functorch`, torch.func.grad (and vmap of it) gives the same gradients and its
    grad raises the same."""
    def first(out):
        return out[0] if isinstance(out, tuple) else out
    weights = torch.randn(first(fn(*leaves)).shape, dtype=torch.float64, generator=generator("cpu"))
    def loss():
        out = first(fn(*leaves))
        return (out.double() * weights.to(out.device)).sum()
    plain = torch.autograd.grad(loss(), leaves)
    grads = torch.autograd.grad(loss(), leaves, create_graph=True)
    for g, p in zip(grads, plain):
        assert_rel_close(g.detach(), p, TOL[p.dtype], "first-order gradient with create_graph=True")
    second = sum((g.double() ** 2).sum() for g in grads)
    with pytest.raises(RuntimeError, match=f"fuseforge.{op_name}: double backward is not supported"):
        second.backward()
    if not functorch:
        return
    # The same through functorch: torch.func.grad gives the same gradients, a grad of it raises.
    def loss_of(*args):
        out = first(fn(*args))
        return (out.double() * weights.to(out.device)).sum()
    argnums = tuple(range(len(leaves)))
    func_grads = torch.func.grad(loss_of, argnums=argnums)(*leaves)
    for g, p in zip(func_grads, plain):
        assert_rel_close(g, p, TOL[p.dtype], "torch.func.grad")
    # vmap of it over two copies of the inputs: each sample's gradients are the plain ones.
    per_sample = torch.func.vmap(torch.func.grad(loss_of, argnums=argnums))(*[torch.stack([t, t]) for t in leaves])
    for g, p in zip(per_sample, plain):
        for sample in g:
            assert_rel_close(sample, p, TOL[p.dtype], "torch.func.vmap(torch.func.grad)")
    def grad_norm(*args):
        return sum((g.double() ** 2).sum() for g in torch.func.grad(loss_of, argnums=argnums)(*args))
    with pytest.raises(RuntimeError, match=f"fuseforge.{op_name}: double backward is not supported"):
        torch.func.grad(grad_norm)(*leaves)
