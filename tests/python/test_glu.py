"""glu: act(gate) * up (SwiGLU / GeGLU), separate and fused forms, forward and backward, CPU and CUDA."""
import pytest
import torch
import torch.nn.functional as F

from fuseforge.nn.glu import GLU, GatedMLP
from fuseforge.ops.glu import ACTIVATIONS, glu
from harness import (TOL, assert_compiles, assert_double_backward_raises, assert_rel_close, device_dtypes, devices,
                     poison_allocations, randn, rel_err, requires_cuda, run_opcheck)

ops = torch.ops.fuseforge

EAGER_ACT = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}
FORMS = ["separate", "fused"]
SHAPES = [(0, 8), (3, 0), (0, 2, 16), (1,), (7,), (3, 7), (17, 33), (4, 8, 64), (2, 3, 130), (5, 5003)]


def reference(gate, up, activation):
    """act(gate) * up as eager PyTorch writes it (float64 when given float64); up None: gate is [gate | up]."""
    if up is None:
        gate, up = gate.chunk(2, -1)
    return EAGER_ACT[activation](gate) * up


def make(shape, dtype, device, form, requires_grad=False):
    """gate (..., I) and up, or the fused (..., 2I) gate and None. gate spans the activations' bends and tails."""
    if form == "fused":
        return randn(*shape[:-1], 2 * shape[-1], dtype=dtype, device=device, scale=2.0,
                     requires_grad=requires_grad), None
    return (randn(*shape, dtype=dtype, device=device, scale=2.0, requires_grad=requires_grad),
            randn(*shape, dtype=dtype, device=device, requires_grad=requires_grad))


def as64(t):
    return None if t is None else t.detach().double().requires_grad_()


def bound(dtype, eager, ref, base=None):
    """The dtype's tolerance, or twice eager PyTorch's error at that dtype (a tensor of a few elements
    makes the relative error one element's: gelu's erf and tanh forms cancel for gate << 0)."""
    return max(base if base is not None else TOL[dtype], 2 * rel_err(eager, ref))


def grads_tol(dtype):
    return TOL[dtype] if dtype != torch.float16 else 4e-3


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_float64(device, dtype, activation, form, shape):
    gate, up = make(shape, dtype, device, form)
    poison_allocations(gate)
    out = glu(gate, up, activation)
    assert out.shape == shape and out.dtype == dtype and out.device == gate.device
    ref = reference(as64(gate), as64(up), activation)
    assert_rel_close(out, ref, bound(dtype, reference(gate, up, activation), ref))


def check_gradients(gate, up, activation, grad_out):
    """glu's output and gradients against float64, each within twice eager's error at the dtype."""
    dtype = gate.dtype
    inputs = (gate,) if up is None else (gate, up)
    poison_allocations(gate, gate)
    out = glu(gate, up, activation)
    grads = torch.autograd.grad(out, inputs, grad_out)
    inputs64 = tuple(as64(t) for t in inputs)
    ref = reference(inputs64[0], inputs64[1] if up is not None else None, activation)
    ref_grads = torch.autograd.grad(ref, inputs64, grad_out.double())
    eager = reference(gate, up, activation)
    eager_grads = torch.autograd.grad(eager, inputs, grad_out)
    assert_rel_close(out, ref, bound(dtype, eager, ref), "output")
    for got, want, low, name in zip(grads, ref_grads, eager_grads, ("grad_gate", "grad_up")):
        assert got.shape == want.shape and got.dtype == dtype
        assert_rel_close(got, want, bound(dtype, low, want, grads_tol(dtype)), name)
    return grads


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(0, 8), (5, 0), (0, 3, 16), (9,), (3, 7), (17, 33), (4, 8, 64), (3, 5003)],
                         ids=str)
def test_gradients_match_float64(device, dtype, activation, form, shape):
    gate, up = make(shape, dtype, device, form, requires_grad=True)
    check_gradients(gate, up, activation, randn(*shape, dtype=dtype, device=device))


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("lead,cols", [((37,), 64), ((2, 9), 33), ((3, 5), 24)], ids=str)
def test_strided_views_of_a_fused_projection(device, dtype, activation, lead, cols):
    """gate = t[..., :I] and up = t[..., I:] of one (..., 2I) tensor, read in place (row stride 2I):
    the same values as the fused form, gradients into t as autograd's slices route them."""
    t = randn(*lead, 2 * cols, dtype=dtype, device=device, scale=2.0, requires_grad=True)
    grad_out = randn(*lead, cols, dtype=dtype, device=device)
    gate, up = t[..., :cols], t[..., cols:]
    out = glu(gate, up, activation)
    (grad_t,) = torch.autograd.grad(out, t, grad_out)
    t64 = as64(t)
    ref = reference(t64[..., :cols], t64[..., cols:], activation)
    (ref_grad,) = torch.autograd.grad(ref, t64, grad_out.double())
    eager = reference(gate, up, activation)
    (eager_grad,) = torch.autograd.grad(eager, t, grad_out)
    assert_rel_close(out, ref, bound(dtype, eager, ref), "output")
    assert_rel_close(grad_t, ref_grad, bound(dtype, eager_grad, ref_grad, grads_tol(dtype)), "grad of t")
    # The fused form computes the same elements with the same arithmetic.
    fused_out = glu(t, None, activation)
    assert torch.equal(out, fused_out)
    (fused_grad,) = torch.autograd.grad(fused_out, t, grad_out)
    assert torch.equal(grad_t, fused_grad)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32,)))
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_non_contiguous_inputs(device, dtype, activation):
    """Rows that one stride cannot address (transposed leading dims), a strided last dim, a fused
    tensor with padded rows, a pointer off the 16-byte grid (the scalar path), a transposed grad_out."""
    rows, cols = 12, 40
    wide = randn(rows, 2 * cols + 8, dtype=dtype, device=device, scale=2.0)
    cases = {
        "transposed": (randn(3, 4, cols, dtype=dtype, device=device).transpose(0, 1),
                       randn(4, 3, cols, dtype=dtype, device=device)),
        "strided_last_dim": (randn(rows, 2 * cols, dtype=dtype, device=device)[:, ::2],
                             randn(rows, cols, dtype=dtype, device=device)),
        "misaligned": (wide[:, 1:1 + cols], wide[:, 1 + cols:1 + 2 * cols]),
        "padded_fused": (wide[:, :2 * cols], None),
    }
    for name, (gate, up) in cases.items():
        gate = gate.detach().requires_grad_()
        up = None if up is None else up.detach().requires_grad_()
        out_shape = gate.shape if up is not None else (*gate.shape[:-1], gate.shape[-1] // 2)
        grad_out = randn(*reversed(out_shape), dtype=dtype, device=device).permute(
            *reversed(range(len(out_shape))))
        check_gradients(gate, up, activation, grad_out)


def ulp(v, dtype):
    """The spacing of dtype's values at |v| (its subnormal spacing below the smallest normal)."""
    info = torch.finfo(dtype)
    mag = v.abs().double().clamp_min(info.tiny)
    return info.eps * torch.exp2(torch.floor(torch.log2(mag)))


def assert_matches_per_element(ours, theirs, exact, theirs_fp32, gate, dtype, what):
    """|ours - PyTorch's| within one unit of the output dtype's rounding, plus the float32 arithmetic's
    own error (twice PyTorch's float32 error at the element, and a few float32 ulps scaled by how
    gelu_tanh and its derivative amplify tanh's rounding: ~|z|^3). In 16-bit dtypes, also at most
    0.1% of the elements that float32 pins may differ at all: a fast tanh (tanh.approx, 2^-11)
    changes several percent of them."""
    z = gate.detach().double().abs().cpu()
    ours, theirs = ours.detach().double().cpu(), theirs.detach().double().cpu()
    err32 = (theirs_fp32.detach().double().cpu() - exact.detach().cpu()).abs()
    eps32 = torch.finfo(torch.float32).eps
    arithmetic = 2 * err32 + 4 * eps32 * (1 + z ** 3)
    tol = ulp(theirs, dtype) + arithmetic
    diff = (ours - theirs).abs()
    worst = int(torch.argmax(diff - tol))
    assert (diff <= tol).all(), (f"{what}: at gate={gate.flatten()[worst].item()} ours {ours[worst].item()} "
                                 f"PyTorch {theirs[worst].item()} (allowed {tol[worst].item():.3e})")
    if dtype != torch.float32:
        # Counted where float32 pins the rounded value (not in gelu's far negative tail, where 1 + tanh
        # cancels and PyTorch's CPU tanh and libm's differ in the last float32 bit).
        settled = arithmetic < ulp(theirs, dtype) / 4
        assert settled.double().mean() > 0.5
        mismatched = (ours != theirs)[settled].double().mean().item()
        assert mismatched <= 1e-3, f"{what}: {mismatched:.2%} of the elements differ from PyTorch's"


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float16, torch.bfloat16)))
def test_gelu_tanh_matches_pytorch_per_element(device, dtype):
    """GeGLU's gelu_tanh (Gemma's gelu_pytorch_tanh) equals F.gelu(x, approximate="tanh") element by
    element, forward and backward, up to the output's rounding: with up = 1 and grad_out = 1 the
    outputs are gelu_tanh(gate) and its derivative, each rounded once as PyTorch rounds them."""
    gate = torch.cat([randn(1 << 16, device=device, scale=3.0),
                      torch.linspace(-12, 12, 8193, device=device)]).to(dtype)
    ones = torch.ones_like(gate)

    def gelu_tanh_and_derivative(x):
        x = x.detach().requires_grad_()
        val = F.gelu(x, approximate="tanh")
        return val.detach(), torch.autograd.grad(val, x, torch.ones_like(x))[0]

    exact_out, exact_grad = gelu_tanh_and_derivative(gate.double())
    out32, grad32 = gelu_tanh_and_derivative(gate.float())  # PyTorch's own float32 arithmetic

    ours_gate = gate.clone().requires_grad_()
    ours_out = glu(ours_gate, ones, "gelu_tanh")
    (ours_grad,) = torch.autograd.grad(ours_out, ours_gate, ones)
    torch_gate = gate.clone().requires_grad_()
    torch_out = F.gelu(torch_gate, approximate="tanh")
    (torch_grad,) = torch.autograd.grad(torch_out, torch_gate, ones)
    assert_matches_per_element(ours_out, torch_out, exact_out, out32, gate, dtype, "forward")
    assert_matches_per_element(ours_grad, torch_grad, exact_grad, grad32, gate, dtype, "backward")


@pytest.mark.parametrize("device", devices())
def test_double_backward_raises(device):
    gate, up = make((3, 16), torch.float32, device, "separate", requires_grad=True)
    assert_double_backward_raises(lambda g, u: glu(g, u, "gelu_tanh"), gate, up, op_name="glu")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64_cpu(activation):
    gate, up = make((3, 11), torch.float64, "cpu", "separate", requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: glu(g, u, activation), (gate, up))
    (fused, _) = make((2, 3, 7), torch.float64, "cpu", "fused", requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: glu(t, None, activation), (fused,))
    # Only up needs a gradient (a frozen gate projection).
    assert torch.autograd.gradcheck(lambda u: glu(gate.detach(), u, activation), (up,))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    for form in FORMS:
        gate, up = make((5, 24), torch.float32, device, form, requires_grad=True)
        grad_out = randn(5, 24, device=device)
        for activation in ("silu", "gelu_tanh"):
            run_opcheck(ops.glu_fwd, (gate, up, activation))
            run_opcheck(ops.glu_bwd, (grad_out, gate.detach(), None if up is None else up.detach(), activation))


@pytest.mark.parametrize("device", devices())
def test_fused_backward_returns_one_gradient(device):
    """With up None the gradient is one (..., 2I) tensor [grad_gate | grad_up] (no concatenation) and
    grad_up is empty; it equals the separate form's two gradients side by side."""
    gate_up = randn(6, 40, device=device)
    grad_out = randn(6, 20, device=device)
    grad_fused, grad_up = ops.glu_bwd(grad_out, gate_up, None, "silu")
    assert grad_fused.shape == (6, 40) and grad_fused.is_contiguous() and grad_up.numel() == 0
    grad_gate, grad_up = ops.glu_bwd(grad_out, gate_up[:, :20], gate_up[:, 20:], "silu")
    assert torch.equal(grad_fused, torch.cat([grad_gate, grad_up], -1))


@pytest.mark.parametrize("device", devices())
def test_compiles_fullgraph(device):
    t = randn(8, 64, device=device, requires_grad=True)
    up = randn(8, 32, device=device, requires_grad=True)

    def fn(t, up):
        return glu(t[:, :32], up, "silu").sum() + glu(t, None, "gelu_tanh").square().sum()

    got = assert_compiles(fn, t, up, device=device)
    want = fn(t, up)
    assert_rel_close(got, want, 1e-5)
    for a, w in zip(torch.autograd.grad(got, (t, up)), torch.autograd.grad(want, (t, up))):
        assert_rel_close(a, w, 1e-5)


@pytest.mark.parametrize("device", devices())
def test_glu_module(device):
    m = GLU("gelu_tanh")
    gate, up = make((3, 24), torch.float32, device, "separate")
    assert torch.equal(m(gate, up), glu(gate, up, "gelu_tanh"))
    fused, _ = make((3, 24), torch.float32, device, "fused")
    assert torch.equal(m(fused), glu(fused, None, "gelu_tanh"))
    assert "gelu_tanh" in repr(m)
    with pytest.raises(ValueError, match="activation must be one of"):
        GLU("relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        GatedMLP(8, 16, "swish")


HF_ACT = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_mlp_equals_llama_mlp(device, activation):
    """GatedMLP loads LlamaMLP's state_dict as is and computes the same output and gradients."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, hidden_act=HF_ACT[activation],
                                      mlp_bias=False)
    torch.manual_seed(0)
    ref = LlamaMLP(config).to(device)
    ours = GatedMLP(64, 176, activation, device=device)
    ours.load_state_dict(ref.state_dict())
    x = randn(2, 5, 64, device=device)
    out, want = ours(x), ref(x)
    assert_rel_close(out, want, 1e-5)
    grad_out = randn(*out.shape, device=device)
    out.backward(grad_out)
    want.backward(grad_out)
    for name, p in ours.named_parameters():
        assert_rel_close(p.grad, ref.get_parameter(name).grad, 1e-5, name)


def test_gated_mlp_dtype_and_bias():
    m = GatedMLP(16, 40, "silu", bias=True, dtype=torch.float64)
    assert m.gate_proj.weight.dtype == torch.float64 and m.down_proj.bias is not None
    names = {f"{p}.{w}" for p in ("gate_proj", "up_proj", "down_proj") for w in ("weight", "bias")}
    assert set(m.state_dict()) == names
    x = randn(3, 16, dtype=torch.float64)
    ref = m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
    assert_rel_close(m(x), ref, TOL[torch.float64])


@pytest.mark.parametrize("device", devices())
def test_bad_inputs_raise_clear_errors(device):
    gate, up = make((4, 8), torch.float32, device, "separate")
    with pytest.raises(RuntimeError, match=r"up must have the shape of gate"):
        glu(gate, up[:, :4])
    with pytest.raises(RuntimeError, match=r"gate without up must be the fused projection .* even last dim"):
        glu(randn(4, 7, device=device))
    with pytest.raises(RuntimeError, match=r"activation must be one of silu, gelu_tanh, gelu; got 'relu'"):
        glu(gate, up, "relu")
    with pytest.raises(RuntimeError, match=r"activation must be one of silu, gelu_tanh, gelu; got 'swish'"):
        glu(gate, up, "swish")
    with pytest.raises(RuntimeError, match=r"up must have the dtype of gate"):
        glu(gate, up.double())
    with pytest.raises(RuntimeError, match=r"gate must be float32, float16 or bfloat16"):
        glu(gate.int(), up.int())
    with pytest.raises(RuntimeError, match=r"gate must have at least one dimension"):
        glu(gate[0, 0], up[0, 0])
    with pytest.raises(RuntimeError, match=r"grad_out must have the output's shape \[4, 8\]"):
        ops.glu_bwd(randn(4, 3, device=device), gate, up, "silu")
    with pytest.raises(RuntimeError, match=r"grad_out must have the output's shape \[4, 4\]"):
        ops.glu_bwd(randn(4, 8, device=device), gate, None, "silu")
    with pytest.raises(RuntimeError, match=r"grad_out must have the dtype of gate"):
        ops.glu_bwd(randn(4, 8, device=device).half(), gate, up, "silu")


@requires_cuda
def test_mixed_devices_raise():
    gate, up = make((4, 8), torch.float32, "cuda", "separate")
    with pytest.raises(RuntimeError, match=r"up must be on the device of gate"):
        glu(gate, up.cpu())
    with pytest.raises(RuntimeError, match=r"grad_out must be on the device of gate"):
        ops.glu_bwd(torch.ones(4, 8), gate, up, "silu")
    with pytest.raises(RuntimeError, match=r"float64 only on the CPU"):
        glu(gate.double(), up.double())


@requires_cuda
def test_fused_backward_allocates_only_the_gradient():
    """The backward of the fused form allocates its one (rows, 2I) gradient and nothing else."""
    gate_up = randn(2048, 2 * 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    out = glu(gate_up)
    grad_out = torch.randn_like(out)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (grad,) = torch.autograd.grad(out, gate_up, grad_out)
    extra = torch.cuda.max_memory_allocated() - base
    assert grad.shape == gate_up.shape
    assert extra <= 1.05 * gate_up.numel() * gate_up.element_size(), f"backward peak {extra} bytes"


@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(33, 64), (7, 13), (3, 2, 1000)], ids=str)
def test_cuda_small_for_sanitizer(activation, form, shape):
    """Every CUDA kernel (vector and scalar paths, forward and backward, both forms) on small shapes."""
    gate, up = make(shape, torch.bfloat16, "cuda", form, requires_grad=True)
    out = glu(gate, up, activation)
    grads = torch.autograd.grad(out, (gate,) if up is None else (gate, up), torch.randn_like(out))
    torch.cuda.synchronize()
    assert all(torch.isfinite(g.float()).all() for g in grads)


@requires_cuda
@pytest.mark.slow
def test_more_than_2_to_31_elements():
    """int64 offsets: (rows, 2I) fused bf16 with rows * 2I > 2^31 (about 4.3 GB); rows at both ends checked."""
    cols = 8192
    rows = 2**31 // (2 * cols) + 64
    gate_up = torch.randn(rows, 2 * cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = glu(gate_up, None, "silu")
    (grad,) = torch.autograd.grad(out, gate_up, out)
    for sl in (slice(0, 4), slice(rows - 4, rows)):
        ref = reference(gate_up[sl].double(), None, "silu")
        assert_rel_close(out[sl], ref, TOL[torch.bfloat16], "out")
        g64 = gate_up[sl].detach().double().requires_grad_()
        (ref_grad,) = torch.autograd.grad(reference(g64, None, "silu"), g64, out[sl].double())
        assert_rel_close(grad[sl], ref_grad, TOL[torch.bfloat16], "grad")
