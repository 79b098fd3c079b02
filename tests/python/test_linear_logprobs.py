"""linear_logprobs(..., return_entropy=True): per-token log-probabilities and entropies, values and
gradients, against a float64 reference that materialises the logits; the entropy outputs and inputs
of linear_cross_entropy_fwd / _bwd (opcheck, errors); gradcheck and torch.compile."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fuseforge  # noqa: F401  (loads the extension)
from fuseforge import linear_logprobs
from harness import (assert_compiles_like_eager, assert_rel_close, device_dtypes, devices, end_rows, generator,
                     poison_allocations, randn, rel_err, requires_cuda, run_opcheck, sum_over_row_chunks)

ops = torch.ops.fuseforge
IGNORE = -100
# Log-probabilities and entropies are float32 arithmetic on the (exactly representable) products of the
# inputs, whatever their dtype.
VALUE_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}
# Gradients: the logit gradients are rounded to the input dtype before the two gradient GEMMs, whose
# outputs are rounded again.
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1.6e-2}

# (tokens shape, hidden, vocab): one token; odd vocabularies (the stream kernel's scalar path); V % 4 == 0
# (its vector path) with several 1024-column steps a thread (the running max moves).
SHAPES = [((1,), 8, 5), ((3, 7), 16, 33), ((2, 5), 24, 1031), ((4, 9), 32, 5000)]
OPTIONS = [{}, {"temperature": 0.7}, {"softcap": 3.0}]


def reference(x, w, target, bias=None, *, temperature=1.0, softcap=None, ignore_index=IGNORE):
    """float64 (log-probabilities, entropies) from the materialised logits; 0 for ignored tokens."""
    z = x.double() @ w.double().T
    if bias is not None:
        z = z + bias.double()
    z = z / temperature
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z, dim=-1)
    keep = target != ignore_index
    picked = logp.gather(-1, torch.where(keep, target, 0).long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(keep, picked, torch.zeros_like(picked)), torch.where(keep, entropy, torch.zeros_like(entropy))


def make(shape, hidden, vocab, dtype, device, *, bias=False, w_scale=0.5):
    x = randn(*shape, hidden, dtype=dtype, device=device, requires_grad=True)
    w = randn(vocab, hidden, dtype=dtype, device=device, scale=w_scale, requires_grad=True)
    b = randn(vocab, dtype=dtype, device=device, requires_grad=True) if bias else None
    target = torch.randint(0, vocab, shape, generator=generator(device), device=device)
    if target.numel() > 1:
        target.view(-1)[::4] = IGNORE  # ignored tokens: entropy 0, no gradient
    return x, w, b, target


def leaves64(*ts):
    return [None if t is None else t.detach().cpu().double().requires_grad_() for t in ts]


def check(x, w, b, target, *, value_tol=None, grad_tol=None, use_logprobs=True, use_entropy=True, **options):
    """Values and the gradients of sum(a * logprobs) + sum(c * entropies) (random per-token a, c; a term
    left out when not used, so that output gets no gradient) against float64; returns the entropies."""
    dtype, device = x.dtype, x.device
    poison_allocations(x, w)
    logp, ent = linear_logprobs(x, w, target, b, return_entropy=True, **options)
    sd = torch.float64 if dtype == torch.float64 else torch.float32
    assert logp.shape == ent.shape == target.shape and logp.dtype == ent.dtype == sd
    x64, w64, b64 = leaves64(x, w, b)
    ref_logp, ref_ent = reference(x64, w64, target.cpu(), b64, **options)
    value_tol = value_tol or VALUE_TOL[dtype]
    if options.get("temperature", 1.0) != 1.0 and dtype in (torch.float16, torch.bfloat16):
        # x / T and b / T are rounded to the input dtype once (as eager's 16-bit logits / T are).
        value_tol = max(value_tol, torch.finfo(dtype).eps)
    assert_rel_close(logp, ref_logp, value_tol, "logprobs")
    assert_rel_close(ent, ref_ent, value_tol, "entropy")
    ignored = target == IGNORE
    assert (logp[ignored] == 0).all() and (ent[ignored] == 0).all()
    a = randn(*target.shape, dtype=sd, device=device)
    c = randn(*target.shape, dtype=sd, device=device)
    loss = sum(term for term, used in (((a * logp).sum(), use_logprobs), ((c * ent).sum(), use_entropy)) if used)
    ref = sum(term for term, used in (((a.cpu() * ref_logp).sum(), use_logprobs), ((c.cpu() * ref_ent).sum(),
                                                                                     use_entropy)) if used)
    leaves = [t for t in (x, w, b) if t is not None]
    grads = torch.autograd.grad(loss, leaves)
    refs = torch.autograd.grad(ref, [t for t in (x64, w64, b64) if t is not None])
    for name, got, want in zip(("grad_x", "grad_weight", "grad_bias"), grads, refs):
        assert got.dtype == dtype and got.shape == want.shape
        assert_rel_close(got, want, grad_tol or GRAD_TOL[dtype], name)
    return ent


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float64)))
@pytest.mark.parametrize("shape,hidden,vocab", SHAPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "temperature", "softcap"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_logprobs_entropy_and_gradients_match_float64(device, dtype, shape, hidden, vocab, options, bias):
    x, w, b, target = make(shape, hidden, vocab, dtype, device, bias=bias)
    check(x, w, b, target, **options)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32,),
                                                       cuda_dtypes=(torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("which", ["entropy-only", "logprobs-only"])
def test_one_output_gets_a_gradient(device, dtype, which):
    """Only the entropy gets a gradient (the log-probabilities' is None), or only the log-probabilities."""
    x, w, b, target = make((5, 6), 16, 301, dtype, device, bias=True)
    check(x, w, b, target, use_logprobs=which == "logprobs-only", use_entropy=which == "entropy-only",
          temperature=0.8)


class _RecordBackwardArgs(TorchDispatchMode):
    """The entropy arguments of each linear_cross_entropy_bwd call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is ops.linear_cross_entropy_bwd.default:
            bound = dict(zip([a.name for a in func._schema.arguments], args), **kwargs)
            self.calls.append((bound.get("entropy"), bound.get("grad_entropy")))
        return func(*args, **kwargs)


@pytest.mark.parametrize("device", devices())
def test_no_entropy_gradient_is_the_plain_backward(device):
    """The entropy's gradient None: the backward runs without the entropy (the per-token kernel
    without the entropy's arithmetic), with the gradients of return_entropy=False (bit for bit on the
    CPU, whose log-sum-exp does not depend on the entropy's sums)."""
    x, w, b, target = make((4, 7), 16, 97, torch.float32, device, bias=True)
    g = randn(4, 7, device=device)
    logp, _ = linear_logprobs(x, w, target, b, return_entropy=True, temperature=0.9)
    with _RecordBackwardArgs() as rec:
        grads = torch.autograd.grad((g * logp).sum(), (x, w, b))
    assert rec.calls == [(None, None)]
    plain = torch.autograd.grad((g * linear_logprobs(x, w, target, b, temperature=0.9)).sum(), (x, w, b))
    for got, want in zip(grads, plain):
        assert torch.equal(got, want) if device == "cpu" else rel_err(got, want) <= 1e-6
    _, ent = linear_logprobs(x, w, target, b, return_entropy=True, temperature=0.9)
    with _RecordBackwardArgs() as rec:
        torch.autograd.grad(ent.sum(), (x,))
    ((entropy, grad_entropy),) = rec.calls
    assert entropy is not None and grad_entropy is not None


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32,),
                                                       cuda_dtypes=(torch.float32, torch.bfloat16)))
def test_peaky_distribution(device, dtype):
    """A confident model (target probability ~0.99): the entropy is small and formed as log S - A / S,
    two non-negative terms, so it keeps its relative accuracy."""
    x, w, _, target = make((97,), 64, 2000, torch.float32, device, w_scale=0.05)
    with torch.no_grad():
        t = torch.where(target == IGNORE, 0, target)
        wt = w[t]
        x.copy_(0.1 * x + 14.0 * wt / wt.square().sum(1, keepdim=True))
    x, w = (x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_())
    ent = check(x, w, None, target, value_tol=1e-4, grad_tol=max(GRAD_TOL[dtype], 2e-4))
    assert ent[target != IGNORE].median() < 0.2, "inputs are not peaky"


@pytest.mark.parametrize("device", devices())
def test_ignored_rows_with_huge_logits_and_all_ignored(device):
    """Ignored rows get no arithmetic: logits that overflow exp() there give no NaN; with every token
    ignored, every output and gradient is 0."""
    x, w, _, target = make((20,), 16, 50, torch.float32, device)
    with torch.no_grad():
        x[::4] *= 1e4  # the ignored rows (make() ignores every 4th token)
    check(x, w, None, target)
    target.fill_(IGNORE)
    logp, ent = linear_logprobs(x, w, target, return_entropy=True)
    assert (logp == 0).all() and (ent == 0).all()
    for grad in torch.autograd.grad(logp.sum() + ent.sum(), (x, w)):
        assert (grad == 0).all()


@pytest.mark.parametrize("device", devices())
def test_empty(device):
    x, w, _, target = make((0,), 8, 30, torch.float32, device)
    logp, ent = linear_logprobs(x, w, target, return_entropy=True)
    assert logp.shape == ent.shape == (0,)
    gx, gw = torch.autograd.grad(logp.sum() + ent.sum(), (x, w))
    assert gx.shape == x.shape and (gw == 0).all()


@pytest.mark.parametrize("device", devices())
def test_low_memory_op(device):
    """The op's low-memory strategy (on CUDA: running statistics over 8192-column tiles in the forward,
    4096-column chunks in the backward) computes the entropy and its gradient too (the CPU has one
    strategy)."""
    x, w, b, target = make((37,), 32, 20000, torch.float32, device, bias=True, w_scale=0.2)
    out = ops.linear_cross_entropy_fwd(x, w, target, b, IGNORE, "none", 0.0, 0.0, 0.0, True, True, True, True, True)
    nll, ent = out[0], out[6]
    x64, w64, b64 = leaves64(x, w, b)
    ref_logp, ref_ent = reference(x64, w64, target.cpu(), b64)
    assert_rel_close(-nll, ref_logp, 1e-5, "logprobs")
    assert_rel_close(ent, ref_ent, 1e-5, "entropy")
    a, c = randn(37, device=device), randn(37, device=device)
    grads = torch.autograd.grad((a * nll).sum() + (c * ent).sum(), (x, w, b))
    refs = torch.autograd.grad((-a.cpu() * ref_logp).sum() + (c.cpu() * ref_ent).sum(), (x64, w64, b64))
    for name, got, want in zip(("grad_x", "grad_weight", "grad_bias"), grads, refs):
        assert_rel_close(got, want, 1e-5, name)


def test_gradcheck_float64_cpu():
    x, w, b, target = make((2, 3), 6, 11, torch.float64, "cpu", bias=True)
    assert (target == IGNORE).any()
    for options in ({"temperature": 0.8}, {"softcap": 2.0}):
        assert torch.autograd.gradcheck(
            lambda x_, w_, b_: linear_logprobs(x_, w_, target, b_, return_entropy=True, **options), (x, w, b))
    # the entropy alone (the log-probabilities get no gradient)
    assert torch.autograd.gradcheck(
        lambda x_, w_: linear_logprobs(x_, w_, target, return_entropy=True)[1], (x, w))


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    x, w, b, target = make((3, 5), 16, 40, torch.float32, device, bias=True)
    for low_memory in (False, True):
        run_opcheck(ops.linear_cross_entropy_fwd,
                    (x, w, target, b, IGNORE, "none", 0.0, 0.0, 2.5, low_memory, True, True, True, True))
    out = ops.linear_cross_entropy_fwd(x, w, target, b, IGNORE, "none", 0.0, 0.0, 0.0, False, False, False, False,
                                       True)
    lse, ent = out[1], out[6]
    run_opcheck(ops.linear_cross_entropy_bwd,
                (randn(3, 5, device=device), x.detach(), w.detach(), target, b.detach(), lse, IGNORE, "none", 0.0, 0.0,
                 0.0, False, True, True, True, ent, randn(3, 5, device=device)))


@pytest.mark.parametrize("device", devices())
def test_compile_fullgraph(device):
    x, w, b, target = make((2, 13), 16, 96, torch.float32, device, bias=True)
    a, c = randn(2, 13, device=device), randn(2, 13, device=device)

    def fn(x_, w_, b_):
        logp, ent = linear_logprobs(x_, w_, target, b_, temperature=0.7, return_entropy=True)
        return (a * logp).sum() + (c * ent).sum()

    assert_compiles_like_eager(fn, x, w, b, device=device)


def test_errors():
    x, w, b, target = make((2, 3), 8, 10, torch.float32, "cpu", bias=True)
    with pytest.raises(ValueError, match="softcap and a temperature other than 1 cannot be combined"):
        linear_logprobs(x, w, target, temperature=0.5, softcap=30.0, return_entropy=True)
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        linear_logprobs(x, w, target, temperature=-1.0, return_entropy=True)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    with pytest.raises(RuntimeError, match="entropy is a per-token output: it needs reduction 'none'"):
        ops.linear_cross_entropy_fwd(xd, wd, target, None, IGNORE, "mean", 0.0, 0.0, 0.0, False, False, False, False,
                                     True)
    out = ops.linear_cross_entropy_fwd(xd, wd, target, bd, IGNORE, "none", 0.0, 0.0, 0.0, False, False, False, False,
                                       True)
    lse, ent = out[1], out[6]
    g = randn(2, 3)

    def bwd(entropy, grad_entropy, reduction="none", grad_loss=g):
        return ops.linear_cross_entropy_bwd(grad_loss, xd, wd, target, bd, lse, IGNORE, reduction, 0.0, 0.0, 0.0,
                                            False, True, True, True, entropy, grad_entropy)

    with pytest.raises(RuntimeError, match="grad_entropy needs entropy"):
        bwd(None, g)
    with pytest.raises(RuntimeError, match=r"grad_entropy must have the entropy's shape \[2, 3\]"):
        bwd(ent, g.flatten())
    with pytest.raises(RuntimeError, match=r"entropy must be the Float tensor of shape \[2, 3\]"):
        bwd(ent.double(), g)
    with pytest.raises(RuntimeError, match=r"entropy must be the Float tensor of shape \[2, 3\]"):
        bwd(ent.flatten(), g)
    with pytest.raises(RuntimeError, match="grad_entropy needs reduction 'none'"):
        bwd(ent, g, reduction="sum", grad_loss=torch.tensor(1.0))


# ---- CUDA only ----------------------------------------------------------------------------------
@requires_cuda
def test_out_of_range_target_cuda_is_nan():
    """No host sync on CUDA: an out-of-range target makes that token's log-probability and entropy
    NaN, the others stay exact."""
    x, w, _, target = make((16,), 8, 12, torch.float32, "cuda")
    target[3] = 12
    logp, ent = linear_logprobs(x, w, target, return_entropy=True)
    others = torch.arange(16, device="cuda") != 3
    assert torch.isnan(logp[3]) and torch.isnan(ent[3])
    _, ref_ent = reference(x, w, torch.where(others, target, IGNORE))
    assert rel_err(ent[others], ref_ent[others]) <= 1e-5


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [2048, 2047], ids=["vector", "scalar"])
def test_per_token_gradients_at_the_rounding_floor_cuda(dtype, vocab):
    """Per-token weights: each row's target entry of dz, its largest, is kept to float32 (the rounding's
    residual added back), so the gradients carry about the error of rounding the exact float64 ones to
    the dtype once (rounding that entry too would make it ~1.45x). Flat distributions (logits ~0.6) as
    in policy-gradient losses; 64 distinct targets over 600 rows (a target's rows summed in a fixed
    order: two backwards agree bitwise)."""
    g = generator("cuda")
    x = randn(600, 256, dtype=dtype, device="cuda", requires_grad=True)
    w = randn(vocab, 256, dtype=dtype, device="cuda", scale=0.04, requires_grad=True)
    b = randn(vocab, dtype=dtype, device="cuda", scale=0.1, requires_grad=True)
    target = torch.randint(0, 64, (600,), generator=g, device="cuda")
    target[::9] = IGNORE
    a = randn(600, device="cuda")
    logp = linear_logprobs(x, w, target, b)
    grads = torch.autograd.grad((a * logp).sum(), (x, w, b), retain_graph=True)
    again = torch.autograd.grad((a * logp).sum(), (x, w, b))
    x64, w64, b64 = leaves64(x, w, b)
    ref_logp, _ = reference(x64, w64, target.cpu(), b64)
    refs = torch.autograd.grad((a.cpu().double() * ref_logp).sum(), (x64, w64, b64))
    for name, got, twice, want in zip(("grad_x", "grad_weight", "grad_bias"), grads, again, refs):
        assert torch.equal(got, twice), name
        floor = rel_err(want.to(dtype), want)
        assert rel_err(got.cpu(), want) <= 1.2 * floor, (name, rel_err(got.cpu(), want), floor)


@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("vocab,low_memory", [(200, False), (203, False), (9000, True)],
                         ids=["stream-vec", "stream-scalar", "lowmem"])
def test_sanitize_entropy_kernels(vocab, low_memory):
    x, w, b, target = make((8, 9), 32, vocab, torch.bfloat16, "cuda", bias=True, w_scale=0.2)
    out = ops.linear_cross_entropy_fwd(x, w, target, b, IGNORE, "none", 0.0, 0.0, 5.0, low_memory, True, True, True,
                                       True)
    nll, ent = out[0], out[6]
    x64, w64, b64 = leaves64(x, w, b)
    ref_logp, ref_ent = reference(x64, w64, target.cpu(), b64, softcap=5.0)
    assert_rel_close(ent, ref_ent, 1e-5, "entropy")
    a, c = randn(8, 9, device="cuda"), randn(8, 9, device="cuda")
    grads = torch.autograd.grad((a * nll).sum() + (c * ent).sum(), (x, w, b))
    refs = torch.autograd.grad((-a.cpu() * ref_logp).sum() + (c.cpu() * ref_ent).sum(), (x64, w64, b64))
    for name, got, want in zip(("grad_x", "grad_weight", "grad_bias"), grads, refs):
        assert_rel_close(got, want, GRAD_TOL[torch.bfloat16], name)


@requires_cuda
@pytest.mark.slow
def test_more_than_2_to_31_elements():
    """int64 offsets: x of 2^31 + 2^17 bf16 elements (about 4.3 GB); log-probabilities, entropies and x's
    gradient at both ends against float64, the weight's gradient (a sum over every row) against float64
    in chunks. The loss: sum(a * logprobs) + sum(c * entropies) for random per-token a, c."""
    hidden, vocab = 2048, 1024
    rows = (2**31 + 2**17) // hidden
    x, w, _, target = make((rows,), hidden, vocab, torch.bfloat16, "cuda", w_scale=0.02)
    a, c = randn(rows, device="cuda"), randn(rows, device="cuda")
    logp, ent = linear_logprobs(x, w, target, return_entropy=True)
    grad_x, grad_w = torch.autograd.grad((a * logp).sum() + (c * ent).sum(), (x, w))
    w64 = w.detach().double().requires_grad_()

    def objective(sl, x64):
        ref_logp, ref_ent = reference(x64, w64, target[sl])
        return ref_logp, ref_ent, (a[sl].double() * ref_logp).sum() + (c[sl].double() * ref_ent).sum()

    for sl in end_rows(rows):
        x64 = x[sl].detach().double().requires_grad_()
        ref_logp, ref_ent, ref = objective(sl, x64)
        assert_rel_close(logp[sl], ref_logp, VALUE_TOL[torch.bfloat16], "logprobs")
        assert_rel_close(ent[sl], ref_ent, VALUE_TOL[torch.bfloat16], "entropy")
        (ref_grad_x,) = torch.autograd.grad(ref, x64)
        assert_rel_close(grad_x[sl], ref_grad_x, GRAD_TOL[torch.bfloat16], "grad_x")
    ref_grad_w = sum_over_row_chunks(lambda sl: torch.autograd.grad(
        objective(sl, x[sl].detach().double())[2], w64)[0], rows)
    assert_rel_close(grad_w, ref_grad_w, GRAD_TOL[torch.bfloat16], "grad_weight")
