"""layer_norm: LayerNorm with an optional fused residual add, forward and backward, CPU and CUDA (rms_norm's
kernels, centered)."""
import pytest
import torch

from fuseforge.nn.layer_norm import LayerNorm
from fuseforge.ops.layer_norm import layer_norm
from harness import (TOL, assert_compiles, assert_double_backward_raises, assert_rel_close, device_dtypes, devices,
                     end_rows, poison_allocations, randn, rel_err, requires_cuda, run_opcheck, sum_over_row_chunks)

ops = torch.ops.fuseforge

# (name, weight dtype, bias dtype): None = absent, "x" = x's dtype, or a dtype.
PARAMS = [("none", None, None), ("affine", "x", "x"), ("weight_only", "x", None), ("fp32_params", torch.float32,
                                                                                   torch.float32)]
# 16384: the largest row the CUDA rows kernels hold for 16-bit types; float32 takes the two-pass kernel.
HIDDEN = [1, 7, 128, 2048, 5000, 16384]
EPS = 1e-5


def leading_shape(hidden):
    return (2, 3) if hidden <= 5000 else (3,)


def make(shape, dtype, device, params, with_residual, requires_grad=False, offset=2.0):
    """x and the residual with a mean far from 0 (offset), where a one-pass variance would cancel."""
    _, wdtype, bdtype = params
    x = (randn(*shape, dtype=dtype, device=device) + offset).detach().requires_grad_(requires_grad)
    res = randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad) if with_residual else None
    w = b = None
    if wdtype is not None:
        w = (randn(shape[-1], dtype=dtype if wdtype == "x" else wdtype, device=device, scale=0.3) + 1.0)
        w = w.detach().requires_grad_(requires_grad)
    if bdtype is not None:
        b = randn(shape[-1], dtype=dtype if bdtype == "x" else bdtype, device=device, requires_grad=requires_grad)
    return x, w, b, res


def reference(h, weight, bias, eps=EPS):
    """float64 from h (rounded to x's dtype, as the op rounds it)."""
    return torch.nn.functional.layer_norm(h.double(), h.shape[-1:], None if weight is None else weight.double(),
                                          None if bias is None else bias.double(), eps)


def h_of(x, residual):
    return (x + residual if residual is not None else x).detach()


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p[0])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_forward_matches_float64(device, dtype, hidden, params, with_residual):
    shape = leading_shape(hidden) + (hidden,)
    x, w, b, res = make(shape, dtype, device, params, with_residual)
    poison_allocations(x, x, x)
    got = layer_norm(x, w, b, EPS, res)
    out, h = got if with_residual else (got, None)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    ref = reference(h_of(x, res), w, b)
    if hidden == 1 and b is None:  # a row of one element normalises to exactly 0
        assert torch.count_nonzero(out) == 0
    else:
        assert_rel_close(out, ref, TOL[dtype], "out")
    if with_residual:
        assert torch.equal(h, x + res), "residual_out must be the eager add, bit for bit"
    out_fwd, h_fwd, mean, rstd = ops.layer_norm_fwd(x, w, b, res, EPS)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    assert mean.shape == rstd.shape == (x.numel() // hidden,) and mean.dtype == rstd.dtype == stat
    h64 = h_of(x, res).double().reshape(-1, hidden)
    assert_rel_close(mean, h64.mean(-1), 1e-6 if dtype != torch.float64 else 1e-12, "mean")
    assert torch.equal(out, out_fwd), "the forward without statistics must match the training forward"
    if with_residual:
        assert torch.equal(h, h_fwd)


def check_gradients(shape, dtype, device, params, with_residual, out_dtype=None):
    x, w, b, res = make(shape, dtype, device, params, with_residual, requires_grad=True)
    out_dtype = out_dtype or dtype
    grad_out = randn(*shape, dtype=out_dtype, device=device)
    grad_h = randn(*shape, dtype=dtype, device=device) if with_residual else None
    leaves = [t for t in (x, res, w, b) if t is not None]
    poison_allocations(x, x, x)
    got = layer_norm(x, w, b, EPS, res, out_dtype)
    outs, grads_in = ((got[0], got[1]), (grad_out, grad_h)) if with_residual else ((got,), (grad_out,))
    grads = torch.autograd.grad(outs, leaves, grads_in)

    h64 = h_of(x, res).double().requires_grad_()
    w64 = w.detach().double().requires_grad_() if w is not None else None
    b64 = b.detach().double().requires_grad_() if b is not None else None
    ref = reference(h64, w64, b64)
    ref_outs, ref_in = ((ref,), (grad_out.double(),))
    if with_residual:
        ref_outs, ref_in = (ref, h64), (grad_out.double(), grad_h.double())
    ref_leaves = [h64] + [t for t in (w64, b64) if t is not None]
    ref_grads = torch.autograd.grad(ref_outs, ref_leaves, ref_in)
    want = [ref_grads[0]] * (2 if with_residual else 1) + list(ref_grads[1:])

    # Eager PyTorch at this dtype bounds what can be asked for (it rounds the same inputs).
    xe, re_, we, be = (t.detach().requires_grad_() if t is not None else None for t in (x, res, w, b))
    he = xe + re_ if re_ is not None else xe
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    eo = torch.nn.functional.layer_norm(he.to(stat), shape[-1:], None if we is None else we.to(stat),
                                        None if be is None else be.to(stat), EPS).to(out_dtype)
    e_outs = (eo, he) if with_residual else (eo,)
    e_grads = torch.autograd.grad(e_outs, [t for t in (xe, re_, we, be) if t is not None], grads_in)
    names = (["grad_x"] + (["grad_residual"] if with_residual else []) + (["grad_weight"] if w is not None else [])
             + (["grad_bias"] if b is not None else []))
    for name, g, r, e, leaf in zip(names, grads, want, e_grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        tol = max(TOL[g.dtype] if g.dtype != torch.float16 else 4e-3, 2 * rel_err(e, r))
        if name in ("grad_weight", "grad_bias"):  # float32 sums over rows, which can cancel
            terms = grad_out.double().abs() * (reference(h64.detach(), None, None).abs() if name == "grad_weight"
                                              else 1.0)
            condition = (terms.reshape(-1, shape[-1]).sum(0).norm() / r.norm()).item()
            tol = max(tol, 1e-5, 4 * torch.finfo(torch.float32).eps * condition)
        if shape[-1] == 1 and name in ("grad_x", "grad_residual", "grad_weight"):
            continue  # one element a row: zero in exact arithmetic, rounding noise in both
        assert_rel_close(g, r, tol, name)


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p[0])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_gradients_match_float64(device, dtype, hidden, params, with_residual):
    check_gradients(leading_shape(hidden) + (hidden,), dtype, device, params, with_residual)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.bfloat16, torch.float64),
                                                       cuda_dtypes=(torch.float16, torch.bfloat16)))
@pytest.mark.parametrize("params", [("x_weight_fp32_bias", "x", torch.float32),
                                    ("fp32_weight_x_bias", torch.float32, "x")], ids=lambda p: p[0])
@pytest.mark.parametrize("hidden", [128, 2048, 16384])
def test_gradients_with_weight_and_bias_of_different_dtypes(device, dtype, params, hidden):
    """Each parameter's gradient in its own dtype, the two summed in one launch on the GPU."""
    check_gradients(leading_shape(hidden) + (hidden,), dtype, device, params, True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_x_with_16bit_out(device, out_dtype):
    """An fp32 residual stream and fp32 parameters, the norm's output in bf16/fp16 (autocast)."""
    x, w, b, res = make((4, 5, 256), torch.float32, device, PARAMS[1], True)
    out, h = layer_norm(x, w, b, EPS, res, out_dtype)
    assert out.dtype == out_dtype and h.dtype == torch.float32
    assert_rel_close(out, reference(h_of(x, res), w, b), TOL[out_dtype], "out")
    check_gradients((4, 5, 256), torch.float32, device, PARAMS[1], True, out_dtype=out_dtype)


@pytest.mark.parametrize("shape", [(1027, 96), (3001, 1024), (70, 1025)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_cpu_many_rows(shape, with_residual):
    """Rows over several threads' tasks and the parameters' row blocks, in batches of four with a
    partial last batch (1025 columns: one row at a time), against float64."""
    check_gradients(shape, torch.bfloat16, "cpu", PARAMS[1], with_residual)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(20000, 128), (4099, 64), (3000, 2048), (257, 8192), (40, 40000), (33, 4100)],
                         ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_cuda_many_rows_and_long_rows(dtype, shape, with_residual):
    """Rows past one wave of the backward's blocks: each block's later row groups (staged one trip
    ahead in the 16-bit backward)."""
    check_gradients(shape, dtype, "cuda", PARAMS[1], with_residual)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("hidden", [1024, 2048, 4096])
def test_cuda_residual_form_row_shapes(dtype, hidden):
    """The residual form's forward has row shapes of its own (two vectors a thread at 256-512 vectors a
    row): out, mean and rstd against float64 at the widths that take them and their neighbours."""
    x, w, b, res = make((37, hidden), dtype, "cuda", PARAMS[1], True)
    poison_allocations(x, x, x)
    out, h, mean, rstd = ops.layer_norm_fwd(x, w, b, res, EPS)
    assert torch.equal(h, x + res), "residual_out must be the eager add, bit for bit"
    assert_rel_close(out, reference(h_of(x, res), w, b), TOL[dtype], "out")
    h64 = h_of(x, res).double()
    assert_rel_close(mean, h64.mean(-1), 1e-6, "mean")
    assert_rel_close(rstd, 1 / torch.sqrt(h64.var(-1, unbiased=False) + EPS), 1e-5, "rstd")
    assert torch.equal(layer_norm(x, w, b, EPS, res)[0], out), "the forward without statistics must match"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 16), (4, 0)], ids=str)
def test_empty(device, shape):
    x, w, b, res = make(shape, torch.float32, device, PARAMS[1], True, requires_grad=True)
    out, h = layer_norm(x, w, b, EPS, res)
    assert out.shape == x.shape and h.shape == x.shape
    gx, gr, gw, gb = torch.autograd.grad((out, h), (x, res, w, b), (torch.ones_like(out), torch.ones_like(h)))
    assert gx.shape == x.shape and gr.shape == x.shape and gw.shape == w.shape and gb.shape == b.shape
    assert torch.count_nonzero(gw) == 0 and torch.count_nonzero(gb) == 0


@pytest.mark.parametrize("device", devices())
def test_non_contiguous_inputs(device):
    x = (randn(70, 12, device=device).t()[:, 3:67:2] + 1.5)  # transposed, strided columns
    res = randn(12, 70, device=device)[:, 3:67:2]
    w = randn(64, device=device)[::2]
    b = randn(64, device=device)[1::2]
    grad_out = randn(32, 12, device=device).t()
    for t in (x, res, w, b):
        t.requires_grad_()
    out, h = layer_norm(x, w, b, EPS, res)
    grads = torch.autograd.grad(out, (x, res, w, b), grad_out)
    h64, w64, b64 = ((x + res).detach().double().requires_grad_(), w.detach().double().requires_grad_(),
                     b.detach().double().requires_grad_())
    ref = reference(h64, w64, b64)
    rh, rw, rb = torch.autograd.grad(ref, (h64, w64, b64), grad_out.double())
    assert_rel_close(out, ref, 2 * TOL[torch.float32], "out")
    for got, want, what in zip(grads, (rh, rh, rw, rb), ("grad_x", "grad_residual", "grad_weight", "grad_bias")):
        assert_rel_close(got, want, 4 * TOL[torch.float32], what)


@pytest.mark.parametrize("device", devices())
def test_double_backward_raises(device):
    x, w, b, res = make((4, 16), torch.float32, device, PARAMS[1], True, requires_grad=True)
    assert_double_backward_raises(lambda x, w, b, r: layer_norm(x, w, b, EPS, r), x, w, b, res, op_name="layer_norm")


def test_gradcheck_float64_cpu():
    x, w, b, res = make((4, 11), torch.float64, "cpu", PARAMS[1], True, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b, r: layer_norm(x, w, b, EPS, r), (x, w, b, res))
    assert torch.autograd.gradcheck(lambda x, w: layer_norm(x, w, None, EPS), (x, w))
    x = randn(3, 2, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: layer_norm(x, None, None, EPS), (x,))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    for params in PARAMS:
        for with_residual in (False, True):
            x, w, b, res = make((5, 24), torch.bfloat16, device, params, with_residual)
            run_opcheck(ops.layer_norm_fwd, (x, w, b, res, EPS))
            run_opcheck(ops.layer_norm, (x, w, b, res, EPS))
            xg, wg, bg, rg = make((5, 24), torch.bfloat16, device, params, with_residual, requires_grad=True)
            run_opcheck(ops.layer_norm_fwd, (xg, wg, bg, rg, EPS))
            _, h, mean, rstd = ops.layer_norm_fwd(x, w, b, res, EPS)
            h = h if with_residual else x
            grad_res = randn(5, 24, dtype=torch.bfloat16, device=device) if with_residual else None
            for need_weight, grad_bias_dtype in ((True, torch.bfloat16), (True, torch.float32), (False, None),
                                                 (False, torch.bfloat16)):
                run_opcheck(ops.layer_norm_bwd, (randn(5, 24, dtype=torch.bfloat16, device=device), grad_res, h, w,
                                                 mean, rstd, need_weight, grad_bias_dtype))
    x32 = randn(4, 16, device=device)
    run_opcheck(ops.layer_norm_fwd, (x32, randn(16, device=device), randn(16, device=device), None, EPS),
                {"out_dtype": torch.bfloat16})


@pytest.mark.parametrize("device", devices())
def test_compiles_fullgraph(device):
    x, w, b, res = make((8, 32), torch.float32, device, PARAMS[1], True, requires_grad=True)

    def fn(x, w, b, res):
        out, h = layer_norm(x, w, b, EPS, res)
        return out.square().sum() + h.sum() + layer_norm(x, w, b, 1e-6, None, torch.bfloat16).float().sum()

    got = assert_compiles(fn, x, w, b, res, device=device)
    want = fn(x, w, b, res)
    assert_rel_close(got, want, 1e-5)
    for g1, g2 in zip(torch.autograd.grad(got, (x, w, b, res)), torch.autograd.grad(want, (x, w, b, res))):
        assert_rel_close(g1, g2, 1e-5)
    with torch.no_grad():  # the statistics-free op
        assert_rel_close(assert_compiles(fn, x, w, b, res, device=device), want, 1e-5)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.bfloat16),
                                                       cuda_dtypes=(torch.float32, torch.bfloat16)))
def test_module_is_a_drop_in_for_torch_layer_norm(device, dtype):
    x = randn(2, 7, 96, dtype=dtype, device=device) + 1.0
    for bias in (True, False):
        theirs = torch.nn.LayerNorm(96, eps=1e-5, bias=bias, device=device, dtype=dtype)
        with torch.no_grad():
            theirs.weight.copy_(randn(96, dtype=dtype, device=device, scale=0.3) + 1.0)
            if bias:
                theirs.bias.copy_(randn(96, dtype=dtype, device=device))
        ours = LayerNorm(96, eps=1e-5, bias=bias, device=device, dtype=dtype)
        assert torch.count_nonzero(ours.weight) == 96 and (not bias or torch.count_nonzero(ours.bias) == 0)
        ours.load_state_dict(theirs.state_dict())
        assert_rel_close(ours(x), theirs(x), 2 * TOL[dtype], f"bias={bias}")
        out, h = ours(x, residual=x)
        assert_rel_close(out, theirs(x + x), 2 * TOL[dtype], f"bias={bias}, with a residual")
    plain = LayerNorm(8, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None and "elementwise_affine=False" in repr(plain)
    with pytest.raises(ValueError, match="last dim only"):
        LayerNorm((4, 8))
    with pytest.raises(ValueError, match="last dim must be 8"):
        LayerNorm(8)(torch.randn(2, 4))


@pytest.mark.parametrize("device", devices())
def test_bad_inputs_raise_clear_errors(device):
    x, w, b, res = make((4, 8), torch.float32, device, PARAMS[1], True)
    with pytest.raises(RuntimeError, match=r"bias must have shape \(8,\)"):
        layer_norm(x, w, b[:5])
    with pytest.raises(RuntimeError, match=r"bias must have the dtype of x \(Float\) or float32"):
        layer_norm(x, w, b.half())
    with pytest.raises(RuntimeError, match=r"weight must have shape \(8,\)"):
        layer_norm(x.clone().requires_grad_(), w[:5], b)
    with pytest.raises(RuntimeError, match=r"residual must have the shape of x"):
        layer_norm(x, w, b, EPS, res[:2])
    with pytest.raises(RuntimeError, match=r"out_dtype must be the dtype of x"):
        layer_norm(x.bfloat16(), None, None, out_dtype=torch.float32)
    _, _, mean, rstd = ops.layer_norm_fwd(x, w, b, None, EPS)
    with pytest.raises(RuntimeError, match=r"mean must be the forward's \(4,\)"):
        ops.layer_norm_bwd(x, None, x, w, mean[:3], rstd, True, torch.float32)
    with pytest.raises(RuntimeError, match=r"rstd must be the forward's \(4,\)"):
        ops.layer_norm_bwd(x, None, x, w, mean, rstd.double(), True, torch.float32)
    with pytest.raises(RuntimeError, match=r"grad_bias_dtype \(the bias's dtype\) must be the dtype of h \(Float\) "
                                           r"or float32, got Half"):
        ops.layer_norm_bwd(x, None, x, w, mean, rstd, True, torch.float16)


@requires_cuda
def test_wrong_device_raises():
    x, w, b, _ = make((4, 8), torch.float32, "cuda", PARAMS[1], False)
    with pytest.raises(RuntimeError, match=r"bias must be on the device of x"):
        layer_norm(x, w, b.cpu())
    with pytest.raises(RuntimeError, match=r"float64 only on the CPU"):
        layer_norm(x.double(), None, None)


@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("shape", [(33, 128), (5, 7), (3, 2048), (2, 20000), (9, 24), (600, 2048), (9000, 16)],
                         ids=str)
def test_cuda_small_for_sanitizer(shape):
    """Every LayerNorm CUDA kernel (rows kernels narrow and wide, two-pass vectorized and scalar,
    forward, backward, the weight and bias gradients' column sums) on small shapes; the last two
    take more rows than one wave of backward blocks (the 16-bit backward's staged row groups)."""
    # Parameters of x's dtype and float32 ones: the rows kernels' preloaded parameters and not.
    for dtype, pdtype in ((torch.bfloat16, torch.float32), (torch.bfloat16, "x"), (torch.float32, "x")):
        x, w, b, res = make(shape, dtype, "cuda", ("p", pdtype, pdtype), True, requires_grad=True)
        with torch.no_grad():
            layer_norm(x, w, b, EPS, res)
            layer_norm(x, w, b, EPS)
        out, h = layer_norm(x, w, b, EPS, res)
        gx, gw, gb = torch.autograd.grad((out, h), (x, w, b), (torch.randn_like(out), torch.randn_like(h)))
        torch.cuda.synchronize()
        assert all(torch.isfinite(t.float()).all() for t in (gx, gw, gb))


@requires_cuda
def test_parameter_grads_are_deterministic():
    x, w, b, _ = make((1000, 4096), torch.bfloat16, "cuda", PARAMS[3], False, requires_grad=True)
    g = randn(1000, 4096, dtype=torch.bfloat16, device="cuda")
    first = torch.autograd.grad(layer_norm(x, w, b), (w, b), g)
    for _ in range(3):
        again = torch.autograd.grad(layer_norm(x, w, b), (w, b), g)
        assert all(torch.equal(a, c) for a, c in zip(first, again))


@requires_cuda
@pytest.mark.slow
def test_more_than_2_to_31_elements():
    """int64 indexing, forward and backward with a residual, weight and bias: 2^31 + 2^20 bf16 elements
    (about 4.3 GB a tensor); rows at both ends and the whole weight and bias gradients checked."""
    cols = 4096
    rows = (2**31 + 2**20) // cols
    x, w, b, res = make((rows, cols), torch.bfloat16, "cuda", PARAMS[1], True, requires_grad=True)
    g = randn(rows, cols, dtype=torch.bfloat16, device="cuda")
    out, h = layer_norm(x, w, b, EPS, res)
    grad_x, grad_res, grad_w, grad_b = torch.autograd.grad(out, (x, res, w, b), g)
    for sl in end_rows(rows):
        h64 = h_of(x[sl], res[sl]).double().requires_grad_()
        ref = reference(h64, w.detach(), b.detach())
        assert_rel_close(out[sl], ref, TOL[torch.bfloat16], "out")
        (ref_grad_h,) = torch.autograd.grad(ref, h64, g[sl].double())
        assert_rel_close(grad_x[sl], ref_grad_h, TOL[torch.bfloat16], "grad_x")
        assert_rel_close(grad_res[sl], ref_grad_h, TOL[torch.bfloat16], "grad_residual")
    xhat = lambda sl: reference(h[sl].detach(), None, None)  # noqa: E731
    ref_grad_w = sum_over_row_chunks(lambda sl: (g[sl].double() * xhat(sl)).sum(0), rows)
    assert_rel_close(grad_w, ref_grad_w, TOL[torch.bfloat16], "grad_weight")
    assert_rel_close(grad_b, sum_over_row_chunks(lambda sl: g[sl].sum(0, dtype=torch.float64), rows),
                     TOL[torch.bfloat16], "grad_bias")
