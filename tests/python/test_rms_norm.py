"""rms_norm: RMSNorm (Llama, Gemma) with an optional fused residual add, forward and backward, CPU and CUDA."""
import pytest
import torch

from fuseforge.nn.rms_norm import RMSNorm
from fuseforge.ops.rms_norm import rms_norm
from harness import (TOL, assert_compiles, assert_double_backward_raises, assert_rel_close, device_dtypes, devices,
                     end_rows, poison_allocations, randn, rel_err, requires_cuda, requires_dev_knobs, run_opcheck,
                     sum_over_row_chunks)

ops = torch.ops.fuseforge

# (name, weight_offset, weight dtype: None = no weight, "x" = x's dtype, or a dtype)
WEIGHTS = [("noweight", 0.0, None), ("llama", 0.0, "x"), ("gemma", 1.0, "x"), ("llama_fp32w", 0.0, torch.float32)]
# 16384: the largest row the CUDA rows kernels hold for 16-bit types; float32 takes the two-pass kernel.
HIDDEN = [1, 7, 128, 2048, 5000, 16384]


def leading_shape(hidden):
    return (2, 3) if hidden <= 5000 else (3,)


def make(shape, dtype, device, weight_case, with_residual, requires_grad=False):
    _, offset, wdtype = weight_case
    x = randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)
    res = randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad) if with_residual else None
    w = None
    if wdtype is not None:
        # Gemma's weights sit near 0 ((1 + w) near 1), Llama's near 1.
        w = randn(shape[-1], dtype=dtype if wdtype == "x" else wdtype, device=device, scale=0.3)
        w = (w + (0.0 if offset else 1.0)).detach().requires_grad_(requires_grad)
    return x, w, res, offset


def eps_for(hidden):
    # One element a row: 1 - xhat^2 = eps / (h^2 + eps) cancels in any precision at a small eps.
    return 0.25 if hidden == 1 else 1e-6


def eager(x, weight, eps, residual=None, weight_offset=0.0, out_dtype=None):
    """The computation as eager PyTorch writes it (Hugging Face's, in float32; float64 for float64)."""
    h = x + residual if residual is not None else x
    stat = torch.float64 if x.dtype == torch.float64 else torch.float32
    hf = h.to(stat)
    out = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * (weight_offset + weight.to(stat))
    return out.to(out_dtype or x.dtype), h


def reference(h, weight, eps, weight_offset):
    """float64 from h (rounded to x's dtype, as the op rounds it)."""
    h64 = h.double()
    out = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    return out * (weight_offset + weight.double()) if weight is not None else out


def h_of(x, residual):
    return (x + residual if residual is not None else x).detach()


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("weight_case", WEIGHTS, ids=lambda w: w[0])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_forward_matches_float64(device, dtype, hidden, weight_case, with_residual):
    shape = leading_shape(hidden) + (hidden,)
    x, w, res, offset = make(shape, dtype, device, weight_case, with_residual)
    eps = eps_for(hidden)
    poison_allocations(x, x, x)
    got = rms_norm(x, w, eps, res, offset)
    out, h = got if with_residual else (got, None)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert_rel_close(out, reference(h_of(x, res), w, eps, offset), TOL[dtype], "out")
    if with_residual:
        assert torch.equal(h, x + res), "residual_out must be the eager add, bit for bit"
    out_fwd, h_fwd, rstd = ops.rms_norm_fwd(x, w, res, eps, offset)
    assert rstd.shape == (x.numel() // hidden,)
    assert rstd.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # rms_norm (called above: nothing requires grad) skips only the rstd store.
    assert torch.equal(out, out_fwd), "the forward without rstd must match the training forward"
    if with_residual:
        assert torch.equal(h, h_fwd)


@pytest.mark.parametrize("device", devices())
def test_forward_without_grad_stores_no_rstd(device, monkeypatch):
    """rms_norm takes the rstd-free op exactly when no gradient is wanted."""
    called = []
    op = ops.rms_norm
    monkeypatch.setattr(torch.ops.fuseforge, "rms_norm", lambda *a, **k: called.append(1) or op(*a, **k))
    x, w, res, _ = make((3, 40), torch.float32, device, ("llama", 0.0, "x"), True, requires_grad=True)
    with torch.no_grad():
        rms_norm(x, w, 1e-6, res)
    rms_norm(x.detach(), w.detach(), 1e-6, res.detach())
    assert len(called) == 2
    out, h = rms_norm(x, w, 1e-6, res)
    assert len(called) == 2 and out.grad_fn is not None and h.grad_fn is not None


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("weight_case", WEIGHTS, ids=lambda w: w[0])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_gradients_match_float64(device, dtype, hidden, weight_case, with_residual):
    check_gradients(leading_shape(hidden) + (hidden,), dtype, device, weight_case, with_residual)


def check_gradients(shape, dtype, device, weight_case, with_residual, out_dtype=None, eps=None):
    x, w, res, offset = make(shape, dtype, device, weight_case, with_residual, requires_grad=True)
    eps = eps_for(shape[-1]) if eps is None else eps
    out_dtype = out_dtype or dtype
    grad_out = randn(*shape, dtype=out_dtype, device=device)
    grad_h = randn(*shape, dtype=dtype, device=device) if with_residual else None
    leaves = [t for t in (x, res, w) if t is not None]
    poison_allocations(x, x, x)
    got = rms_norm(x, w, eps, res, offset, out_dtype)
    outs, grads_in = ((got[0], got[1]), (grad_out, grad_h)) if with_residual else ((got,), (grad_out,))
    grads = torch.autograd.grad(outs, leaves, grads_in)

    # float64 gradients with respect to h (rounded as the op rounds it): x's and residual's both.
    h64 = h_of(x, res).double().requires_grad_()
    w64 = w.detach().double().requires_grad_() if w is not None else None
    ref = reference(h64, w64, eps, offset)
    ref_outs, ref_in = ((ref,), (grad_out.double(),))
    if with_residual:  # h itself is an output: its gradient adds to x's and the residual's
        ref_outs, ref_in = (ref, h64), (grad_out.double(), grad_h.double())
    ref_grads = torch.autograd.grad(ref_outs, [h64] + ([w64] if w is not None else []), ref_in)
    want = [ref_grads[0]] * (2 if with_residual else 1) + list(ref_grads[1:])

    # Eager PyTorch's error at this dtype bounds what can be asked for (it rounds the same inputs).
    xe, re_, we = (t.detach().requires_grad_() if t is not None else None for t in (x, res, w))
    eo, eh = eager(xe, we, eps, re_, offset, out_dtype)
    e_outs = (eo, eh) if with_residual else (eo,)
    e_leaves = [t for t in (xe, re_, we) if t is not None]
    e_grads = torch.autograd.grad(e_outs, e_leaves, grads_in)
    names = ["grad_x"] + (["grad_residual"] if with_residual else []) + (["grad_weight"] if w is not None else [])
    for name, g, r, e, leaf in zip(names, grads, want, e_grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        tol = max(TOL[g.dtype] if g.dtype != torch.float16 else 4e-3, 2 * rel_err(e, r))
        if name == "grad_weight":  # a sum over rows of g * xhat, each rounded input exact in the reference
            # A float32 sum is good to ~eps32 of its terms' magnitudes, which cancellation can make
            # large against the sum itself (hidden 1 sums six terms: up to 6e-5 off over 400 draws,
            # each within 1.4 eps32 x the condition number).
            xhat = reference(h64.detach(), None, eps, 0.0)
            magnitude = (grad_out.double().abs() * xhat.abs()).reshape(-1, shape[-1]).sum(0)
            condition = (magnitude.norm() / r.norm()).item()
            tol = max(tol, 1e-5, 4 * torch.finfo(torch.float32).eps * condition)
        assert_rel_close(g, r, tol, name)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_float32_x_with_16bit_out(device, out_dtype, with_residual):
    """The autocast recipe: an fp32 residual stream and fp32 weight, the norm's output in bf16/fp16."""
    weight_case = ("llama", 0.0, "x")
    x, w, res, offset = make((4, 5, 256), torch.float32, device, weight_case, with_residual)
    got = rms_norm(x, w, 1e-6, res, offset, out_dtype)
    out = got[0] if with_residual else got
    assert out.dtype == out_dtype
    if with_residual:
        assert got[1].dtype == torch.float32
    assert_rel_close(out, reference(h_of(x, res), w, 1e-6, offset), TOL[out_dtype], "out")
    check_gradients((4, 5, 256), torch.float32, device, weight_case, with_residual, out_dtype=out_dtype)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.bfloat16,)))
def test_bf16_x_with_fp32_weight(device, dtype):
    """The autocast recipe's other half: fp32 master weights beside 16-bit activations; grad_weight is fp32."""
    check_gradients((6, 384), dtype, device, ("llama_fp32w", 0.0, torch.float32), True)
    check_gradients((6, 384), dtype, device, ("gemma_fp32w", 1.0, torch.float32), False)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(20000, 128), (4099, 64), (3000, 2048), (257, 8192), (40, 40000), (33, 4100)],
                         ids=str)
def test_cuda_many_rows_and_long_rows(dtype, shape):
    """Blocks that take many grid-stride trips, narrow rows several to a warp, a partly filled last
    trip, rows too long for registers (two-pass, vectorized), and a two-pass row of a width that is
    not a multiple of a vector (4100 fp32 is; 4100 bf16 is not)."""
    check_gradients(shape, dtype, "cuda", ("gemma", 1.0, "x"), True)


@pytest.mark.parametrize("shape", [(1027, 96), (3001, 1024), (70, 1025)], ids=str)
def test_cpu_many_rows(shape):
    """Rows over several threads' tasks and the weight gradient's row blocks, in batches of four with
    a partial last batch (and 1025 columns: one row at a time), against float64; the same bits with
    one thread as with two."""
    check_gradients(shape, torch.bfloat16, "cpu", ("gemma", 1.0, "x"), True)
    x, w, res, offset = make(shape, torch.bfloat16, "cpu", ("llama", 0.0, torch.float32), True, requires_grad=True)
    grads = (randn(*shape, dtype=torch.bfloat16), randn(*shape, dtype=torch.bfloat16))
    prev, runs = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, h = rms_norm(x, w, residual=res, weight_offset=offset)
            runs.append((out, h, *torch.autograd.grad((out, h), (x, w, res), grads)))
    finally:
        torch.set_num_threads(prev)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def check_forward(shape, dtype, device, weight_case, with_residual, out_dtype=None):
    """out (and h) against float64, from both forwards (rms_norm without rstd, rms_norm_fwd with it),
    into poisoned allocations."""
    x, w, res, offset = make(shape, dtype, device, weight_case, with_residual)
    eps = eps_for(shape[-1])
    want = reference(h_of(x, res), w, eps, offset)
    poison_allocations(x, x, x)
    got = rms_norm(x, w, eps, res, offset, out_dtype)
    out = got[0] if with_residual else got
    assert_rel_close(out, want, TOL[out_dtype or dtype], "out")
    poison_allocations(x, x, x)
    out_fwd, h_fwd, rstd = ops.rms_norm_fwd(x, w, res, eps, offset, out_dtype)
    assert torch.equal(out, out_fwd), "the forward without rstd must match the training forward"
    h64 = h_of(x, res).double()
    assert_rel_close(rstd, torch.rsqrt(h64.pow(2).mean(-1) + eps).reshape(-1), 1e-6, "rstd")
    if with_residual:
        assert torch.equal(got[1], x + res) and torch.equal(h_fwd, x + res)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("weight_case", WEIGHTS, ids=lambda w: w[0])
def test_cuda_reread_rows(dtype, weight_case):
    """Rows of 1025-4096 vectors (the reread kernel's two shapes: 16-bit 8200-32768 elements,
    float32 4100-16384), without a residual, the last vector column partly filled at 20000 / 12000 /
    6000; with the residual the same widths take the rows or two-pass kernels."""
    widths = [32768, 20000, 16384, 12000] if dtype != torch.float32 else [16384, 12000, 8192, 6000]
    for cols in widths:
        check_forward((37, cols), dtype, "cuda", weight_case, False)
        check_gradients((37, cols), dtype, "cuda", weight_case, False)
    check_forward((5, widths[1]), dtype, "cuda", weight_case, True)
    check_gradients((5, widths[1]), dtype, "cuda", weight_case, True)
    if dtype == torch.float32:
        check_forward((9, 12000), dtype, "cuda", weight_case, False, out_dtype=torch.bfloat16)
        check_gradients((9, 12000), dtype, "cuda", weight_case, False, out_dtype=torch.bfloat16)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("weight_case", WEIGHTS, ids=lambda w: w[0])
def test_cuda_narrow_rows(dtype, weight_case):
    """16-bit rows of 128 without a residual (the narrow kernel: 8 rows a block, two a thread): a
    block's last rows missing (1, 7, 9, 13 rows), many blocks, a (B, S, H, D) q/k-norm input."""
    for shape in [(1, 128), (7, 128), (9, 128), (13, 128), (3001, 128), (2, 33, 4, 128)]:
        check_forward(shape, dtype, "cuda", weight_case, False)
        check_gradients(shape, dtype, "cuda", weight_case, False)


@requires_cuda
@requires_dev_knobs
@pytest.mark.parametrize("kernel", ["rows", "reread", "two_pass"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(7, 128), (5, 1000), (3, 2048), (4, 8192), (2, 20000)], ids=str)
def test_cuda_forced_forward_kernel(kernel, dtype, shape, monkeypatch):
    """Each forward kernel on rows another would take (FUSEFORGE_RMS_NORM_FORWARD: the reread kernel
    where the row has no residual and at most 4096 vectors, the rows kernels where one holds it),
    plain and with the residual."""
    monkeypatch.setenv("FUSEFORGE_RMS_NORM_FORWARD", kernel)
    for weight_case, with_residual in ((("gemma", 1.0, "x"), False), (("llama_fp32w", 0.0, torch.float32), True)):
        check_forward(shape, dtype, "cuda", weight_case, with_residual)
        check_gradients(shape, dtype, "cuda", weight_case, with_residual)


@pytest.mark.parametrize("device", devices())
def test_unused_outputs_get_no_gradient(device):
    """Only residual_out reaches the loss: x's and residual's gradient is its gradient, the weight's
    none; only out: residual_out's gradient counts as zero."""
    x, w, res, _ = make((3, 40), torch.float32, device, ("llama", 0.0, "x"), True, requires_grad=True)
    out, h = rms_norm(x, w, 1e-6, res)
    g = randn(3, 40, device=device)
    gx, gr, gw = torch.autograd.grad(h, (x, res, w), g, allow_unused=True)
    assert torch.equal(gx, g) and torch.equal(gr, g) and gw is None
    out, h = rms_norm(x, w, 1e-6, res)
    gx, gr = torch.autograd.grad(out, (x, res), g)
    gx2 = torch.autograd.grad(rms_norm(x + res, w, 1e-6), x, g)[0]
    assert_rel_close(gx, gx2, 1e-6) and torch.equal(gx, gr)


@pytest.mark.parametrize("device", devices())
def test_weight_gradient_only_when_needed(device):
    x, w, _, _ = make((5, 64), torch.float32, device, ("llama", 0.0, "x"), False)
    x.requires_grad_()
    out = rms_norm(x, w)  # w does not require grad
    assert torch.autograd.grad(out.sum(), x)[0].shape == x.shape
    _, rstd = ops.rms_norm_fwd(x, w, None, 1e-6, 0.0)[1:]
    gi, gw = ops.rms_norm_bwd(torch.ones_like(x), None, x.detach(), w, rstd, 0.0, False)
    assert gw.numel() == 0 and gi.shape == x.shape


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("hidden", [1024, 2048, 4096, 8192])
def test_cuda_residual_form_row_shapes(dtype, hidden):
    """The residual form's forward may hold a row at shapes of its own (residual_takes_two_vectors):
    out, h and rstd against float64 at every width of 128-2048 vectors a row."""
    x, w, res, offset = make((37, hidden), dtype, "cuda", WEIGHTS[1], True)
    poison_allocations(x, x, x)
    out, h, rstd = ops.rms_norm_fwd(x, w, res, 1e-6, offset)
    assert torch.equal(h, x + res), "residual_out must be the eager add, bit for bit"
    assert_rel_close(out, reference(h_of(x, res), w, 1e-6, offset), TOL[dtype], "out")
    h64 = h_of(x, res).double()
    assert_rel_close(rstd, torch.rsqrt(h64.pow(2).mean(-1) + 1e-6), 1e-5, "rstd")
    assert torch.equal(rms_norm(x, w, 1e-6, res)[0], out), "the forward without rstd must match"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 16), (4, 0)], ids=str)
def test_empty(device, shape):
    x, w, res, _ = make(shape, torch.float32, device, ("llama", 0.0, "x"), True, requires_grad=True)
    with torch.no_grad():
        out, h = rms_norm(x, w, 1e-6, res)
    assert out.shape == x.shape and h.shape == x.shape
    out, h = rms_norm(x, w, 1e-6, res)
    assert out.shape == x.shape and h.shape == x.shape
    gx, gr, gw = torch.autograd.grad((out, h), (x, res, w), (torch.ones_like(out), torch.ones_like(h)))
    assert gx.shape == x.shape and gr.shape == x.shape and gw.shape == w.shape
    assert torch.count_nonzero(gw) == 0


@pytest.mark.parametrize("device", devices())
def test_non_contiguous_inputs(device):
    x = randn(70, 12, device=device).t()[:, 3:67:2]   # transposed, strided columns
    res = randn(12, 70, device=device)[:, 3:67:2]      # strided columns
    w = randn(64, device=device)[::2]                  # strided weight
    grad_out = randn(32, 12, device=device).t()
    for t in (x, res, w):
        t.requires_grad_()
    out, h = rms_norm(x, w, 1e-6, res)
    gx, gr, gw = torch.autograd.grad(out, (x, res, w), grad_out)
    h64 = (x + res).detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = reference(h64, w64, 1e-6, 0.0)
    rh, rw = torch.autograd.grad(ref, (h64, w64), grad_out.double())
    for got, want, what in ((out, ref, "out"), (gx, rh, "grad_x"), (gr, rh, "grad_residual"), (gw, rw, "grad_weight")):
        assert_rel_close(got, want, 2 * TOL[torch.float32], what)


@pytest.mark.parametrize("device", devices())
def test_double_backward_raises(device):
    x, w, res, _ = make((4, 16), torch.float32, device, ("llama", 0.0, "x"), True, requires_grad=True)
    assert_double_backward_raises(lambda x, w, r: rms_norm(x, w, 1e-5, r), x, w, res, op_name="rms_norm")


def test_gradcheck_float64_cpu():
    for offset in (0.0, 1.0):
        x, w, res, _ = make((4, 11), torch.float64, "cpu", ("llama", offset, "x"), True, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, w, r: rms_norm(x, w, 1e-5, r, offset), (x, w, res))
        assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5, None, offset), (x, w))
    x = randn(3, 2, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: rms_norm(x, None, 1e-5), (x,))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    for wdtype in ("x", torch.float32, None):
        for with_residual in (False, True):
            x, w, res, _ = make((5, 24), torch.bfloat16, device, ("w", 1.0, wdtype), with_residual)
            run_opcheck(ops.rms_norm_fwd, (x, w, res, 1e-6, 1.0))
            xg, wg, rg, _ = make((5, 24), torch.bfloat16, device, ("w", 1.0, wdtype), with_residual,
                                 requires_grad=True)
            run_opcheck(ops.rms_norm_fwd, (xg, wg, rg, 1e-6, 1.0))
            _, h, rstd = ops.rms_norm_fwd(x, w, res, 1e-6, 1.0)
            h = h if with_residual else x
            grad_res = randn(5, 24, dtype=torch.bfloat16, device=device) if with_residual else None
            run_opcheck(ops.rms_norm_bwd, (randn(5, 24, dtype=torch.bfloat16, device=device), grad_res, h, w, rstd,
                                           1.0, True))
            run_opcheck(ops.rms_norm_bwd, (randn(5, 24, dtype=torch.bfloat16, device=device), None, h, w, rstd,
                                           1.0, False))
            run_opcheck(ops.rms_norm, (x, w, res, 1e-6, 1.0))
    x32 = randn(4, 16, device=device)
    run_opcheck(ops.rms_norm_fwd, (x32, randn(16, device=device), None, 1e-6, 0.0), {"out_dtype": torch.bfloat16})
    run_opcheck(ops.rms_norm, (x32, randn(16, device=device), None, 1e-6, 0.0), {"out_dtype": torch.bfloat16})


@pytest.mark.parametrize("device", devices())
def test_compiles_fullgraph(device):
    x, w, res, _ = make((8, 32), torch.float32, device, ("gemma", 1.0, "x"), True, requires_grad=True)

    def fn(x, w, res):
        out, h = rms_norm(x, w, 1e-6, res, 1.0)
        return out.square().sum() + h.sum() + rms_norm(x, w, 1e-5, None, 1.0, torch.bfloat16).float().sum()

    got = assert_compiles(fn, x, w, res, device=device)
    want = fn(x, w, res)
    assert_rel_close(got, want, 1e-5)
    for a, b in zip(torch.autograd.grad(got, (x, w, res)), torch.autograd.grad(want, (x, w, res))):
        assert_rel_close(a, b, 1e-5)
    with torch.no_grad():  # the rstd-free op
        assert_rel_close(assert_compiles(fn, x, w, res, device=device), want, 1e-5)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.bfloat16),
                                                       cuda_dtypes=(torch.float32, torch.bfloat16)))
def test_module_matches_transformers(device, dtype):
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    modeling_gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    x = randn(2, 7, 96, dtype=dtype, device=device)
    for theirs_cls, offset in ((modeling_llama.LlamaRMSNorm, 0.0), (modeling_gemma.GemmaRMSNorm, 1.0)):
        theirs = theirs_cls(96, eps=1e-5).to(device=device, dtype=dtype)
        with torch.no_grad():
            theirs.weight.copy_(randn(96, dtype=dtype, device=device, scale=0.3) + (1.0 - offset))
        ours = RMSNorm(96, eps=1e-5, weight_offset=offset, device=device, dtype=dtype)
        assert torch.count_nonzero(ours.weight) == (0 if offset else 96)  # Gemma's zeros, Llama's ones
        ours.load_state_dict(theirs.state_dict())
        want = theirs(x)
        # Llama rounds the normalized x to bf16 before the weight; ours rounds once: within two roundings.
        assert_rel_close(ours(x), want, 2 * TOL[dtype], theirs_cls.__name__)
        out, h = ours(x, residual=x)
        assert_rel_close(out, theirs(x + x), 2 * TOL[dtype], theirs_cls.__name__ + " with a residual")
    assert "weight_offset=1.0" in repr(ours) and ours.variance_epsilon == 1e-5
    assert RMSNorm(8, elementwise_affine=False).weight is None


@pytest.mark.parametrize("device", devices())
def test_bad_inputs_raise_clear_errors(device):
    x, w, res, _ = make((4, 8), torch.float32, device, ("llama", 0.0, "x"), True)
    with pytest.raises(RuntimeError, match=r"weight must have shape \(8,\)"):
        rms_norm(x, w[:5])
    with pytest.raises(RuntimeError, match=r"weight must have shape \(8,\)"):  # the training forward
        rms_norm(x.clone().requires_grad_(), w[:5])
    with pytest.raises(RuntimeError, match=r"weight must have shape"):
        rms_norm(x, w.reshape(2, 4))
    with pytest.raises(RuntimeError, match=r"weight must have the dtype of x \(Float\) or float32"):
        rms_norm(x, w.half())
    with pytest.raises(RuntimeError, match=r"residual must have the dtype of x"):
        rms_norm(x, w, 1e-6, res.bfloat16())
    with pytest.raises(RuntimeError, match=r"residual must have the shape of x"):
        rms_norm(x, w, 1e-6, res[:2])
    with pytest.raises(RuntimeError, match=r"out_dtype must be the dtype of x"):
        rms_norm(x.bfloat16(), w.bfloat16(), out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"out_dtype must be the dtype of x"):
        rms_norm(x, w, out_dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"x must be float32, float16 or bfloat16"):
        rms_norm(x.int(), None)
    with pytest.raises(RuntimeError, match=r"x must have at least one dimension"):
        rms_norm(x[0, 0], None)
    _, _, rstd = ops.rms_norm_fwd(x, w, None, 1e-6, 0.0)
    with pytest.raises(RuntimeError, match=r"rstd must be the forward's \(4,\)"):
        ops.rms_norm_bwd(x, None, x, w, rstd[:3], 0.0, True)
    with pytest.raises(RuntimeError, match=r"grad_out must have the forward's out dtype"):
        ops.rms_norm_bwd(x, None, x.bfloat16(), None, rstd, 0.0, False)
    with pytest.raises(RuntimeError, match=r"grad_residual_out must have the dtype of h"):
        ops.rms_norm_bwd(x, x.half(), x, w, rstd, 0.0, True)


@requires_cuda
def test_wrong_device_raises():
    x, w, res, _ = make((4, 8), torch.float32, "cuda", ("llama", 0.0, "x"), True)
    with pytest.raises(RuntimeError, match=r"weight must be on the device of x"):
        rms_norm(x, w.cpu())
    with pytest.raises(RuntimeError, match=r"residual must be on the device of x"):
        rms_norm(x, w, 1e-6, res.cpu())
    with pytest.raises(RuntimeError, match=r"float64 only on the CPU"):
        rms_norm(x.double(), None)


@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("shape", [(33, 128), (5, 7), (3, 2048), (2, 20000), (3, 16384), (9, 24)], ids=str)
def test_cuda_small_for_sanitizer(shape):
    """Every CUDA kernel (the narrow kernel, rows kernels narrow and wide, two-pass vectorized and
    scalar, forward, backward, the weight gradient's column sum) on small shapes."""
    # A 16-bit weight of x's dtype and float32 ones: the rows kernels' preloaded weights and not.
    for dtype, wdtype in ((torch.bfloat16, torch.float32), (torch.bfloat16, "x"), (torch.float32, "x")):
        x, w, res, _ = make(shape, dtype, "cuda", ("w", 0.0, wdtype), True, requires_grad=True)
        with torch.no_grad():  # the forward without rstd
            rms_norm(x, w, 1e-6, res)
            rms_norm(x, w, 1e-6)
        out, h = rms_norm(x, w, 1e-6, res)
        gx, gw = torch.autograd.grad((out, h), (x, w), (torch.randn_like(out), torch.randn_like(h)))
        torch.cuda.synchronize()
        assert torch.isfinite(gw.float()).all() and torch.isfinite(gx.float()).all()


@requires_cuda
@pytest.mark.parametrize("shape", [(4096, 128), (1000, 4096), (50, 40000)], ids=str)
def test_weight_grad_is_deterministic(shape):
    x, w, _, _ = make(shape, torch.bfloat16, "cuda", ("llama", 0.0, torch.float32), False, requires_grad=True)
    g = randn(*shape, dtype=torch.bfloat16, device="cuda")
    first = torch.autograd.grad(rms_norm(x, w), w, g)[0]
    for _ in range(3):
        assert torch.equal(first, torch.autograd.grad(rms_norm(x, w), w, g)[0])


@requires_cuda
@pytest.mark.slow
def test_more_than_2_to_31_elements():
    """int64 indexing, forward and backward: 2^31 + 2^20 bf16 elements (about 4.3 GB a tensor); rows at
    both ends and the whole weight gradient checked."""
    cols = 4096
    rows = (2**31 + 2**20) // cols
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(cols, device="cuda", dtype=torch.bfloat16) * 0.3 + 1.0).requires_grad_()
    g = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    out = rms_norm(x, w)
    grad_x, grad_w = torch.autograd.grad(out, (x, w), g)
    for sl in end_rows(rows):
        h64 = x[sl].detach().double().requires_grad_()
        ref = reference(h64, w.detach(), 1e-6, 0.0)
        assert_rel_close(out[sl], ref, TOL[torch.bfloat16], "out")
        (ref_grad_x,) = torch.autograd.grad(ref, h64, g[sl].double())
        assert_rel_close(grad_x[sl], ref_grad_x, TOL[torch.bfloat16], "grad_x")
    xhat = lambda sl: reference(x[sl].detach(), None, 1e-6, 0.0)  # noqa: E731
    ref_grad_w = sum_over_row_chunks(lambda sl: (g[sl].double() * xhat(sl)).sum(0), rows)
    assert_rel_close(grad_w, ref_grad_w, TOL[torch.bfloat16], "grad_weight")
