"""add_mul_act: act(x + alpha * y + bias), forward and backward, CPU and CUDA."""
import pytest
import torch
import torch.nn.functional as F

import fuseforge
from fuseforge.ops.add_mul_act import ACTIVATIONS, add_mul_act, add_mul_act_
from harness import (HAS_CUDA, TOL, assert_compiles, assert_double_backward_raises, assert_rel_close, device_dtypes,
                     devices, poison_allocations, randn, rel_err, requires_cuda, run_opcheck)

ops = torch.ops.fuseforge

SHAPES = [(0,), (3, 0), (0, 7), (1,), (7,), (3, 5), (17, 33), (4, 8, 64), (2, 3, 130), (65, 24)]


def reference(x, y, bias, alpha, activation):
    """float64 reference."""
    z = x.double() + alpha * y.double()
    if bias is not None:
        z = z + bias.double()
    return {"identity": lambda t: t, "relu": F.relu, "gelu": F.gelu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
            "sigmoid": torch.sigmoid}[activation](z)


def make(shape, dtype, device, with_bias=True, requires_grad=False):
    x = randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)
    y = randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad)
    cols = shape[-1] if len(shape) else 1
    b = randn(cols, dtype=dtype, device=device, requires_grad=requires_grad) if with_bias and len(shape) else None
    return x, y, b


def grads_tol(dtype):
    return TOL[dtype] if dtype != torch.float16 else 4e-3


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_forward_matches_float64(device, dtype, activation, shape, with_bias):
    x, y, b = make(shape, dtype, device, with_bias)
    poison_allocations(x, x)
    out = add_mul_act(x, y, b, 0.7, activation)
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    ref = reference(x, y, b, 0.7, activation)
    # A tensor of one or a few elements makes the relative error one element's, and that is
    # ill-conditioned: z = x + 0.7 y + b can cancel (gelu(z) ~ z / 2 near 0 keeps z's relative
    # rounding error), and gelu's erf form cancels for z << 0 (eager float32 gelu(-5) is 0.17 off).
    # The bound: the dtype's, or twice the largest of eager's error at this dtype, the error of the
    # exact activation of z rounded once to the dtype, and the worst case of forming z in any order
    # (an fma or two roundings, each within eps (|x| + |0.7 y| + |b|), the activations' slopes below
    # 1.2): where z cancels to a few small values, that worst case exceeds eager's own error.
    z64 = x.double() + 0.7 * y.double() + (b.double() if b is not None else 0)
    terms = x.double().abs() + 0.7 * y.double().abs() + (b.double().abs() if b is not None else 0)
    forming = 1.2 * torch.finfo(dtype).eps * terms.norm().item() / max(ref.norm().item(), 1e-300)
    inherent = max(rel_err(_act(_z_at_dtype(x, y, b, 0.7), activation), ref),
                   rel_err(_act(z64.to(dtype).double(), activation), ref), forming)
    assert_rel_close(out, ref, max(TOL[dtype], 2 * inherent))


def _z_at_dtype(x, y, bias, alpha):
    z = x + alpha * y
    return z + bias if bias is not None else z


def _act(z, activation):
    return {"identity": lambda t: t, "relu": F.relu, "gelu": F.gelu,
            "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
            "sigmoid": torch.sigmoid}[activation](z)


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(0, 8), (5, 0), (9,), (17, 33), (4, 8, 64), (2, 3, 130)], ids=str)
@pytest.mark.parametrize("alpha", [1.0, -0.35])
def test_gradients_match_float64(device, dtype, activation, shape, alpha):
    check_gradients(shape, dtype, device, activation, alpha)


@requires_cuda
@pytest.mark.parametrize("dtype,activation", [(torch.bfloat16, "relu"), (torch.bfloat16, "gelu"),
                                              (torch.float32, "gelu"), (torch.float32, "silu")], ids=str)
@pytest.mark.parametrize("shape", [(4099, 72), (1000, 520), (3, 8200), (20000, 16)], ids=str)
def test_gradients_many_trips_match_float64(dtype, activation, shape):
    """The backward's one-wave grid: blocks that loop over many interleaved row trips, a partial last
    trip, several blocks across a row, rows narrower than a block. (float32 relu is left out: at this
    size a pre-activation within rounding of 0 flips its float64 mask now and then.)"""
    check_gradients(shape, dtype, "cuda", activation, -0.35)


@requires_cuda
def test_backward_allocates_only_the_gradients():
    """No zero gradient is materialised for the saved pre-activation (a full-size tensor): the
    backward's peak is grad_x, grad_y and the small bias partials."""
    x, y, b = make((4096, 4096), torch.bfloat16, "cuda", requires_grad=True)
    out = add_mul_act(x, y, b, 0.5, "gelu")
    g = torch.randn_like(out)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(out, (x, y, b), g)
    extra = torch.cuda.max_memory_allocated() - base
    tensor_bytes = out.numel() * out.element_size()
    assert extra < 2.5 * tensor_bytes, f"backward peak {extra / tensor_bytes:.2f} tensors (expected ~2.1)"
    assert grads[1].data_ptr() != grads[0].data_ptr()


def check_gradients(shape, dtype, device, activation, alpha):
    x, y, b = make(shape, dtype, device, requires_grad=True)
    grad_out = randn(*shape, dtype=dtype, device=device)
    poison_allocations(x, x, x)
    out = add_mul_act(x, y, b, alpha, activation)
    gx, gy, gb = torch.autograd.grad(out, (x, y, b), grad_out)

    x64, y64, b64 = (t.detach().double().requires_grad_() for t in (x, y, b))
    ref = reference(x64, y64, b64, alpha, activation)
    rx, ry, rb = torch.autograd.grad(ref, (x64, y64, b64), grad_out.double())
    assert_rel_close(out, ref, TOL[dtype], "output")
    assert_rel_close(gx, rx, grads_tol(dtype), "grad_x")
    assert_rel_close(gy, ry, grads_tol(dtype), "grad_y")
    assert_rel_close(gb, rb, grads_tol(dtype), "grad_bias")
    assert gb.dtype == b.dtype and gb.shape == b.shape


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_partial_requires_grad(device, activation):
    """Only y and the bias need gradients (a frozen base layer): grad_y still right."""
    x, _, _ = make((6, 40), torch.float32, device)
    _, y, b = make((6, 40), torch.float32, device, requires_grad=True)
    out = add_mul_act(x, y, b, 0.5, activation)
    gy, gb = torch.autograd.grad(out.sum(), (y, b))
    y64, b64 = y.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ry, rb = torch.autograd.grad(reference(x, y64, b64, 0.5, activation).sum(), (y64, b64))
    assert_rel_close(gy, ry, TOL[torch.float32], "grad_y")
    assert_rel_close(gb, rb, TOL[torch.float32], "grad_bias")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_non_contiguous_inputs(device, activation):
    base_x = randn(12, 70, device=device)
    x = base_x[:, 3:67:2]                      # strided columns
    y = randn(32, 12, device=device).t()       # transposed
    b = randn(64, device=device)[::2]          # strided bias
    grad_out = randn(32, 12, device=device).t()
    for t in (x, y, b):
        t.requires_grad_()
    out = add_mul_act(x, y, b, 1.3, activation)
    gx, gy, gb = torch.autograd.grad(out, (x, y, b), grad_out)
    x64, y64, b64 = (t.detach().double().requires_grad_() for t in (x, y, b))
    ref = reference(x64, y64, b64, 1.3, activation)
    rx, ry, rb = torch.autograd.grad(ref, (x64, y64, b64), grad_out.double())
    for got, want, what in ((out, ref, "out"), (gx, rx, "grad_x"), (gy, ry, "grad_y"), (gb, rb, "grad_bias")):
        assert_rel_close(got, want, TOL[torch.float32], what)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32,)))
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_inplace_matches_out_of_place(device, dtype, activation):
    x, y, b = make((19, 48), dtype, device)
    expected = add_mul_act(x, y, b, 0.25, activation)
    x_in = x.clone()
    assert add_mul_act_(x_in, y, b, 0.25, activation) is x_in
    assert torch.equal(x_in, expected)
    # Non-contiguous x is written back through its strides.
    xt = x.t().contiguous().t()
    add_mul_act_(xt, y, b, 0.25, activation)
    assert torch.equal(xt, expected)


@pytest.mark.parametrize("device", devices())
def test_double_backward_raises(device):
    x, y, b = make((4, 16), torch.float32, device, requires_grad=True)
    assert_double_backward_raises(lambda x, y, b: add_mul_act(x, y, b, 0.6, "gelu"), x, y, b, op_name="add_mul_act")


def test_gradcheck_float64_cpu():
    for activation in ACTIVATIONS:
        x, y, b = make((4, 11), torch.float64, "cpu", requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, y, b: add_mul_act(x, y, b, 0.6, activation), (x, y, b))
        assert torch.autograd.gradcheck(lambda x, y: add_mul_act(x, y, None, 1.0, activation), (x, y))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    for activation in ("relu", "gelu"):
        x, y, b = make((5, 24), torch.float32, device)
        run_opcheck(ops.add_mul_act, (x, y, b, 0.5, activation))
        run_opcheck(ops.add_mul_act, (x, y, None, 1.0, activation))
        xg, yg, bg = make((5, 24), torch.float32, device, requires_grad=True)
        run_opcheck(ops.add_mul_act_fwd, (xg, yg, bg, 0.5, activation))
        _, saved = ops.add_mul_act_fwd(x, y, b, 0.5, activation)
        run_opcheck(ops.add_mul_act_bwd, (randn(5, 24, device=device), saved, 0.5, activation, True, True))
        run_opcheck(ops.add_mul_act_bwd, (randn(5, 24, device=device), saved, 1.0, activation, False, False))
        run_opcheck(ops.add_mul_act_, (x.clone(), y, b, 0.5, activation))


@pytest.mark.parametrize("device", devices())
def test_compiles_fullgraph(device):
    x, y, b = make((8, 32), torch.float32, device, requires_grad=True)

    def fn(x, y, b):
        return add_mul_act(x, y, b, 0.5, "gelu").sum() + add_mul_act(x, y, b, 2.0, "relu").square().sum()

    got = assert_compiles(fn, x, y, b, device=device)
    want = fn(x, y, b)
    assert_rel_close(got, want, 1e-5)
    g_got = torch.autograd.grad(got, (x, y, b))
    g_want = torch.autograd.grad(want, (x, y, b))
    for a, w in zip(g_got, g_want):
        assert_rel_close(a, w, 1e-5)


@pytest.mark.parametrize("device", devices())
def test_module(device):
    m = fuseforge.nn.AddMulActivation(24, "silu", alpha=0.5).to(device)
    torch.nn.init.normal_(m.bias)
    x, y, _ = make((3, 24), torch.float32, device)
    out = m(x, y)
    assert_rel_close(out, reference(x, y, m.bias, 0.5, "silu"), TOL[torch.float32])
    out.sum().backward()
    assert m.bias.grad is not None and m.bias.grad.shape == (24,)
    assert "silu" in repr(m)
    with pytest.raises(ValueError, match="activation"):
        fuseforge.nn.AddMulActivation(4, "tanh")


@pytest.mark.parametrize("device", devices())
def test_bad_inputs_raise_clear_errors(device):
    x, y, b = make((4, 8), torch.float32, device)
    with pytest.raises(RuntimeError, match=r"y must have the shape of x"):
        add_mul_act(x, y[:, :4], b)
    with pytest.raises(RuntimeError, match=r"bias must have shape \(8,\)"):
        add_mul_act(x, y, b[:5])
    with pytest.raises(RuntimeError, match=r"bias must have shape"):
        add_mul_act(x, y, b.reshape(2, 4))
    with pytest.raises(RuntimeError, match=r"x must be float32, float16 or bfloat16"):
        add_mul_act(x.int(), y.int(), None)
    with pytest.raises(RuntimeError, match=r"y must have the dtype of x"):
        add_mul_act(x, y.double(), None)
    with pytest.raises(RuntimeError, match=r"bias must have the dtype of x"):
        add_mul_act(x, y, b.half())
    with pytest.raises(RuntimeError, match=r"activation must be one of .* got 'tanh'"):
        add_mul_act(x, y, b, 1.0, "tanh")
    with pytest.raises(RuntimeError, match=r"bias needs x with at least one dimension"):
        add_mul_act(x[0, 0], y[0, 0], b[:1])
    with pytest.raises(RuntimeError, match=r"saved must be the uint8 bit mask"):
        ops.add_mul_act_bwd(x, torch.zeros(3, dtype=torch.uint8, device=device), 1.0, "relu", False, False)


@requires_cuda
def test_mixed_devices_raise():
    x, y, b = make((4, 8), torch.float32, "cuda")
    with pytest.raises(RuntimeError, match=r"y must be on the device of x"):
        add_mul_act(x, y.cpu(), b)
    with pytest.raises(RuntimeError, match=r"bias must be on the device of x"):
        add_mul_act(x, y, b.cpu())
    with pytest.raises(RuntimeError, match=r"float64 only on the CPU"):
        add_mul_act(x.double(), y.double(), None)


@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("shape", [(33, 64), (7, 13), (3, 1000)], ids=str)
def test_cuda_small_for_sanitizer(activation, shape):
    """Every CUDA kernel (vector and scalar paths, forward, backward, bias reduction) on small shapes."""
    x, y, b = make(shape, torch.bfloat16, "cuda", requires_grad=True)
    out = add_mul_act(x, y, b, 0.5, activation)
    gx, gy, gb = torch.autograd.grad(out, (x, y, b), torch.randn_like(out))
    torch.cuda.synchronize()
    assert torch.isfinite(gb.float()).all()


@requires_cuda
def test_bias_grad_is_deterministic():
    x, y, b = make((4096, 520), torch.float32, "cuda", requires_grad=True)
    g = randn(4096, 520, device="cuda")
    first = torch.autograd.grad(add_mul_act(x, y, b, 1.0, "gelu"), b, g)[0]
    for _ in range(3):
        again = torch.autograd.grad(add_mul_act(x, y, b, 1.0, "gelu"), b, g)[0]
        assert torch.equal(first, again)


@requires_cuda
@pytest.mark.slow
def test_more_than_2_to_31_elements():
    """int64 indexing: 2^31 + 2^20 bf16 elements (about 4.3 GB a tensor); rows at both ends checked."""
    cols = 4096
    rows = (2**31 + 2**20) // cols
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x.requires_grad_()
    out = add_mul_act(x, y, b, 0.5, "relu")
    gx, gb = torch.autograd.grad(out, (x, b), out)
    for sl in (slice(0, 4), slice(rows - 4, rows)):
        ref = reference(x[sl], y[sl], b, 0.5, "relu")
        assert_rel_close(out[sl], ref, TOL[torch.bfloat16], "out")
        assert_rel_close(gx[sl], out[sl].double() * (ref > 0), TOL[torch.bfloat16], "grad_x")
    # grad_bias = sum over rows of out * mask = column sums of relu(z) * relu(z)
    ref_gb = (out.float() * (out.float() > 0)).sum(0, dtype=torch.float64)
    assert_rel_close(gb, ref_gb, TOL[torch.bfloat16], "grad_bias")
