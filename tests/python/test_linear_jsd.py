"""linear_jsd / linear_kl_div: loss and student gradients against a float64 reference (both heads'
logits materialised in float64 from the same low-precision inputs), every beta family (forward KL,
JSD, reverse KL), temperature, skipped tokens, reductions, odd shapes, errors, opcheck, gradcheck
and torch.compile."""
from __future__ import annotations

import math

import pytest
import torch

import fuseforge
from fuseforge.nn import LinearJSD
from fuseforge.ops.linear_jsd import linear_jsd, linear_kl_div
from harness import (assert_compiles_like_eager, assert_double_backward_raises, assert_rel_close, device_dtypes,
                     devices, end_rows, generator, poison_allocations, randn, rel_err, requires_cuda,
                     requires_dev_knobs, run_opcheck, sum_over_row_chunks)

ops = torch.ops.fuseforge
IGNORE = -100
# Losses are float32 reductions of float32 logits (cuBLAS/ATen accumulate 16-bit products in float32).
LOSS_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-5, torch.bfloat16: 5e-5}
# Gradients: one rounding of the logit gradients to the input dtype, and 16-bit outputs.
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 8e-3}
BETAS = [0.0, 0.3, 0.5, 1.0]
BETA_IDS = ["fwd-kl", "jsd0.3", "jsd0.5", "rev-kl"]


def make_inputs(n_shape, hs, ht, vocab, dtype, device, *, ignore_every=7, x_scale=1.0, w_scale=0.3,
                target=True, target_dtype=torch.int64):
    """Student (x_s, W_s) and teacher (x_t, W_t) heads with logits of std ~ sqrt(H) x_scale w_scale,
    and a target whose every ignore_every-th token is skipped (None when target=False)."""
    n = math.prod(n_shape)
    sx = randn(*n_shape, hs, device=device, scale=x_scale).to(dtype).requires_grad_()
    sw = randn(vocab, hs, device=device, scale=w_scale).to(dtype).requires_grad_()
    tx = randn(*n_shape, ht, device=device, scale=x_scale).to(dtype)
    tw = randn(vocab, ht, device=device, scale=w_scale).to(dtype)
    t = None
    if target:
        t = torch.randint(0, vocab, (n,), generator=generator(device), device=device)
        if ignore_every:
            t[::ignore_every] = IGNORE
        t = t.reshape(n_shape).to(target_dtype)
    return sx, sw, tx, tw, t


def reference(sx, sw, tx, tw, target, *, beta=0.5, temperature=1.0, ignore_index=IGNORE, reduction="mean"):
    """float64 loss, differentiable in the student's (float64) leaves; the teacher is a constant."""
    s = (sx.flatten(0, -2) @ sw.T) / temperature
    t = (tx.detach().flatten(0, -2) @ tw.detach().T) / temperature
    lq, lp = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    q, p = lq.exp(), lp.exp()
    if beta == 0.0:
        per = (p * (lp - lq)).sum(-1)
    elif beta == 1.0:
        per = (q * (lq - lp)).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lp + math.log(beta), lq + math.log1p(-beta)]), 0)
        per = beta * (p * (lp - lm)).sum(-1) + (1 - beta) * (q * (lq - lm)).sum(-1)
    if target is None:
        valid = torch.ones_like(per, dtype=torch.bool)
    else:
        valid = target.flatten() != ignore_index
    per = per * valid
    if reduction == "none":
        return per.reshape(sx.shape[:-1])
    if reduction == "sum":
        return per.sum()
    return per.sum() / valid.sum().clamp_min(1)


def leaves64(*ts):
    return [None if t is None else t.detach().cpu().double().requires_grad_() for t in ts]


def check_against_reference(sx, sw, tx, tw, t, *, grad_out=None, loss_tol=None, grad_tol=None, **kw):
    dtype = sx.dtype
    # NaN in freed blocks of the sizes of the outputs and of the chunk buffers (logits, dz).
    logits = sx[..., 0].numel() * sw.shape[0]
    poison_allocations(sx, sw, 4 * logits, sx.element_size() * logits)
    loss = linear_jsd(sx, sw, tx, tw, t, **kw)
    sx64, sw64, tx64, tw64 = leaves64(sx, sw, tx, tw)
    ref = reference(sx64, sw64, tx64, tw64, None if t is None else t.cpu(), **kw)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_rel_close(loss, ref, loss_tol or LOSS_TOL[dtype], "loss")
    g = grad_out if grad_out is not None else torch.ones_like(loss)
    grads = torch.autograd.grad(loss, (sx, sw), g)
    refs = torch.autograd.grad(ref, (sx64, sw64), g.cpu().double())
    errs = []
    for name, got, want in zip(("grad_x", "grad_weight"), grads, refs):
        assert got.dtype == dtype and got.shape == want.shape
        errs.append(assert_rel_close(got, want, grad_tol or GRAD_TOL[dtype], name))
    return errs


# V % 4 == 0 (the CUDA kernel's vector path) and odd V, H (its scalar path; the CPU kernel's tails).
SHAPES = [((4, 37), 64, 48, 1000), ((53,), 37, 72, 999)]


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("beta", BETAS, ids=BETA_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", SHAPES, ids=["v1000", "v999"])
def test_matches_reference(device, dtype, beta, reduction, shape):
    n_shape, hs, ht, vocab = shape
    sx, sw, tx, tw, t = make_inputs(n_shape, hs, ht, vocab, dtype, device)
    grad_out = randn(*n_shape, device=device) if reduction == "none" else None  # non-uniform per-token weights
    check_against_reference(sx, sw, tx, tw, t, beta=beta, reduction=reduction, grad_out=grad_out)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float64),
                                                       cuda_dtypes=(torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("beta", BETAS, ids=BETA_IDS)
@pytest.mark.parametrize("temperature", [0.5, 3.0])
def test_temperature(device, dtype, beta, temperature):
    sx, sw, tx, tw, t = make_inputs((3, 29), 32, 40, 500, dtype, device)
    check_against_reference(sx, sw, tx, tw, t, beta=beta, temperature=temperature)
    check_against_reference(sx, sw, tx, tw, t, beta=beta, temperature=temperature, reduction="none",
                            grad_out=randn(3, 29, device=device))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_target_means_over_every_token(device, reduction):
    sx, sw, tx, tw, _ = make_inputs((5, 9), 24, 24, 130, torch.float32, device, target=False)
    grad_out = randn(5, 9, device=device) if reduction == "none" else None
    check_against_reference(sx, sw, tx, tw, None, beta=0.4, reduction=reduction, grad_out=grad_out)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32,),
                                                       cuda_dtypes=(torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("beta", BETAS, ids=BETA_IDS)
def test_student_close_to_teacher(device, dtype, beta):
    """A student near its teacher (the end of distillation): divergences ~1e-3, formed from log
    probabilities that differ by a few percent, still within the tolerances of float64."""
    sx, sw, _, _, t = make_inputs((67,), 48, 48, 700, dtype, device)
    tx = sx.detach().clone()
    tw = (sw.detach().float() + randn(*sw.shape, device=device, scale=0.01)).to(dtype)
    with torch.no_grad():
        ref = reference(*leaves64(sx, sw, tx, tw), t.cpu(), beta=beta)
    assert 1e-5 < ref.item() < 1e-2, f"not a close pair: divergence {ref.item()}"
    # The loss is a sum of terms P (log P - log Q) whose log-ratio is ~1e-2 of the logits: float32
    # logits' rounding is ~1e-7 of them, so ~1e-5 of the loss.
    loss_tol = 1e-4 if dtype != torch.float64 else None
    check_against_reference(sx, sw, tx, tw, t, beta=beta, loss_tol=loss_tol,
                            grad_tol=max(GRAD_TOL[dtype], 1e-4))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("beta", BETAS, ids=BETA_IDS)
def test_extreme_logits(device, beta):
    """Logits of +-100s: most probabilities underflow to 0 in float32 (P log P must stay 0, and log M
    must not be log 0), and the peaks differ between teacher and student. The loss keeps float32
    accuracy; the gradients of a nearly one-hot student vanish (~1e-5 here), and float32 bounds how
    well they can be formed: they must be at least as accurate as eager PyTorch's float32 autograd
    through the materialised logits (the JSD's are 4-500x more accurate, the KLs' alike)."""
    sx, sw, tx, tw, t = make_inputs((31,), 32, 32, 300, torch.float32, device, x_scale=3.0, w_scale=3.0)
    loss = linear_jsd(sx, sw, tx, tw, t, beta=beta, reduction="none")
    assert torch.isfinite(loss).all()
    sx32, sw32 = sx.detach().clone().requires_grad_(), sw.detach().clone().requires_grad_()
    eager = reference(sx32, sw32, tx, tw, t, beta=beta)
    eager_grads = torch.autograd.grad(eager, (sx32, sw32))
    sx64, sw64, tx64, tw64 = leaves64(sx, sw, tx, tw)
    ref = reference(sx64, sw64, tx64, tw64, t.cpu(), beta=beta)
    refs = torch.autograd.grad(ref, (sx64, sw64))
    loss = linear_jsd(sx, sw, tx, tw, t, beta=beta)
    assert_rel_close(loss, ref, LOSS_TOL[torch.float32], "loss")
    for name, got, e, r in zip(("grad_x", "grad_weight"), torch.autograd.grad(loss, (sx, sw)), eager_grads, refs):
        assert_rel_close(got, r, max(1e-4, rel_err(e, r)), name)


def test_linear_kl_div_is_linear_jsd_at_beta_0_and_1():
    sx, sw, tx, tw, t = make_inputs((3, 11), 16, 24, 97, torch.float32, "cpu")
    for reverse, beta in ((False, 0.0), (True, 1.0)):
        a = linear_kl_div(sx, sw, tx, tw, t, reverse=reverse, temperature=2.0, reduction="none")
        b = linear_jsd(sx, sw, tx, tw, t, beta=beta, temperature=2.0, reduction="none")
        assert torch.equal(a, b)
    fwd = linear_kl_div(sx, sw, tx, tw, t)
    rev = linear_kl_div(sx, sw, tx, tw, t, reverse=True)
    assert not torch.allclose(fwd, rev)  # two different divergences
    assert fuseforge.linear_kl_div is linear_kl_div and fuseforge.linear_jsd is linear_jsd


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_skipped(device, reduction):
    sx, sw, tx, tw, t = make_inputs((2, 9), 16, 16, 64, torch.float32, device)
    t.fill_(IGNORE)
    loss = linear_jsd(sx, sw, tx, tw, t, reduction=reduction)
    assert torch.isfinite(loss).all() and (loss == 0).all()
    for g in torch.autograd.grad(loss.sum(), (sx, sw)):
        assert torch.isfinite(g).all() and (g == 0).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty(device, reduction):
    sx, sw, tx, tw, t = make_inputs((0,), 16, 8, 40, torch.float32, device)
    loss = linear_jsd(sx, sw, tx, tw, t, reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ()) and (loss == 0).all()
    gx, gw = torch.autograd.grad(loss.sum(), (sx, sw), allow_unused=True)
    assert gw is not None and (gw == 0).all() and gx is not None and gx.shape == sx.shape


@pytest.mark.parametrize("device", devices())
def test_noncontiguous_int32_and_module(device):
    sx, sw, tx, tw, t = make_inputs((6, 11), 24, 20, 130, torch.float32, device, target_dtype=torch.int32)
    sxt = sx.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # non-contiguous view
    swt = sw.detach().t().contiguous().t().requires_grad_()
    txt = tx.transpose(0, 1).contiguous().transpose(0, 1)
    assert not (sxt.is_contiguous() or swt.is_contiguous() or txt.is_contiguous())
    check_against_reference(sxt, swt, txt, tw, t, beta=0.7)
    loss_fn = LinearJSD(beta=0.7, temperature=1.5)
    ref = reference(*leaves64(sx, sw, tx, tw), t.cpu(), beta=0.7, temperature=1.5)
    assert_rel_close(loss_fn(sx, sw, tx, tw, t), ref, 1e-5, "module loss")
    assert "beta=0.7" in repr(loss_fn)


@pytest.mark.parametrize("device", devices())
def test_grad_output_scaling(device):
    """The forward precomputes the gradients of the loss; the backward scales them by grad_output."""
    sx, sw, tx, tw, t = make_inputs((40,), 32, 16, 300, torch.float32, device)
    for g in (1.0, 2.5, 0.0):
        check_against_reference(sx, sw, tx, tw, t, grad_out=torch.tensor(g, device=device))
    sx2 = sx.detach()  # only the weight requires grad
    loss = linear_jsd(sx2, sw, tx, tw, t)
    (gw,) = torch.autograd.grad(loss, (sw,))
    sx64, sw64, tx64, tw64 = leaves64(sx2, sw, tx, tw)
    (gw_ref,) = torch.autograd.grad(reference(sx64, sw64, tx64, tw64, t.cpu()), (sw64,))
    assert_rel_close(gw, gw_ref, 2e-5, "grad_weight only")


@pytest.mark.parametrize("device", devices())
def test_repeated_backward(device):
    """retain_graph: the first backward hands over the forward's gradients, later ones recompute."""
    sx, sw, tx, tw, t = make_inputs((30,), 16, 16, 70, torch.float32, device)
    loss = linear_jsd(sx, sw, tx, tw, t, beta=0.2)
    g1 = torch.autograd.grad(loss, (sx, sw), torch.tensor(2.0, device=device), retain_graph=True)
    g2 = torch.autograd.grad(loss, (sx, sw), torch.tensor(2.0, device=device))
    for a, b in zip(g1, g2):
        assert_rel_close(a, b, 1e-5, "repeated backward")


@pytest.mark.parametrize("device", devices())
def test_teacher_gets_no_gradient(device):
    """Teacher inputs that require grad are detached: no gradient reaches them, and the student's
    gradients are those of the teacher as a constant."""
    sx, sw, tx, tw, t = make_inputs((12,), 16, 24, 50, torch.float32, device)
    tx.requires_grad_()
    tw.requires_grad_()
    loss = linear_jsd(sx, sw, tx * 1.0, tw, t, beta=0.5)  # tx * 1.0: a teacher with a graph behind it
    assert loss.requires_grad
    loss.backward()
    assert tx.grad is None and tw.grad is None
    sx64, sw64, tx64, tw64 = leaves64(sx, sw, tx, tw)
    ref_gx, ref_gw = torch.autograd.grad(reference(sx64, sw64, tx64, tw64, t.cpu()), (sx64, sw64))
    assert_rel_close(sx.grad, ref_gx, 2e-5, "grad_x")
    assert_rel_close(sw.grad, ref_gw, 2e-5, "grad_weight")
    # A loss whose only differentiable inputs are the teacher's has no graph at all.
    assert not linear_jsd(sx.detach(), sw.detach(), tx, tw, t).requires_grad


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32,),
                                                       cuda_dtypes=(torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("beta", [0.0, 0.6, 1.0], ids=["fwd-kl", "jsd", "rev-kl"])
def test_micro_batch_accumulation(device, dtype, beta):
    """Two halves of a batch with reduction="sum" give the whole batch's loss and gradients."""
    sx, sw, tx, tw, t = make_inputs((2, 23), 32, 40, 257, dtype, device)
    whole = linear_jsd(sx, sw, tx, tw, t, beta=beta, reduction="sum")
    g_whole = torch.autograd.grad(whole, (sx, sw))
    halves, gx_parts, gw_sum = [], [], 0
    for i in range(2):
        xi = sx[i].detach().requires_grad_()
        li = linear_jsd(xi, sw, tx[i], tw, t[i], beta=beta, reduction="sum")
        gxi, gwi = torch.autograd.grad(li, (xi, sw))
        halves.append(li)
        gx_parts.append(gxi)
        gw_sum = gw_sum + gwi.double()
    tol = 1e-5 if dtype == torch.float32 else GRAD_TOL[dtype]
    assert_rel_close(halves[0] + halves[1], whole, 1e-5, "loss")
    assert_rel_close(torch.stack(gx_parts), g_whole[0], tol, "grad_x")
    assert_rel_close(gw_sum, g_whole[1], tol, "grad_weight")


def test_errors():
    sx, sw, tx, tw, t = make_inputs((4,), 8, 6, 10, torch.float32, "cpu")
    with pytest.raises(ValueError, match="reduction"):
        linear_jsd(sx, sw, tx, tw, t, reduction="avg")
    with pytest.raises(ValueError, match="beta must be in"):
        linear_jsd(sx, sw, tx, tw, t, beta=1.5)
    with pytest.raises(ValueError, match="temperature must be"):
        linear_jsd(sx, sw, tx, tw, t, temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be"):
        linear_kl_div(sx, sw, tx, tw, t, temperature=float("inf"))
    with pytest.raises(ValueError, match="beta must be in"):
        LinearJSD(beta=-0.1)
    with pytest.raises(RuntimeError, match="target must have shape"):
        linear_jsd(sx, sw, tx, tw, t[:3])
    with pytest.raises(RuntimeError, match="target must be an int64 or int32"):
        linear_jsd(sx, sw, tx, tw, t.float())
    with pytest.raises(RuntimeError, match="student_weight must have shape"):
        linear_jsd(sx, sw[:, :5], tx, tw, t)
    with pytest.raises(RuntimeError, match="teacher_weight must have shape"):
        linear_jsd(sx, sw, tx, tw[:, :5], t)
    with pytest.raises(RuntimeError, match="teacher_weight must have the vocabulary of student_weight"):
        linear_jsd(sx, sw, tx, tw[:7], t)
    with pytest.raises(RuntimeError, match="teacher_x must have shape"):
        linear_jsd(sx, sw, tx[:3], tw, t)
    with pytest.raises(RuntimeError, match="teacher_x must have the dtype of student_x"):
        linear_jsd(sx, sw, tx.double(), tw, t)
    with pytest.raises(RuntimeError, match="student_weight must have the dtype of student_x"):
        linear_jsd(sx, sw.double(), tx, tw, t)
    with pytest.raises(RuntimeError, match="student_x must be float32"):
        linear_jsd(sx.detach().int(), sw, tx, tw, t)
    with pytest.raises(RuntimeError, match="student_weight must have at least one row"):
        linear_jsd(sx, sw[:0], tx, tw[:0], t)
    # the op itself checks too (the Python layer is not the only guard)
    with pytest.raises(RuntimeError, match="beta must be in"):
        ops.linear_jsd_fwd(sx, sw, tx, tw, t, -0.5, 1.0, IGNORE, "mean", False, False)
    with pytest.raises(RuntimeError, match="temperature must be"):
        ops.linear_jsd_fwd(sx, sw, tx, tw, t, 0.5, -1.0, IGNORE, "mean", False, False)
    with pytest.raises(RuntimeError, match="reduction must be"):
        ops.linear_jsd_fwd(sx, sw, tx, tw, t, 0.5, 1.0, IGNORE, "avg", False, False)
    with pytest.raises(RuntimeError, match="grad_loss must have the loss's shape"):
        ops.linear_jsd_bwd(torch.ones(3), sx, sw, tx, tw, t, 0.5, 1.0, IGNORE, "none", True, True)
    with pytest.raises(RuntimeError, match="grad_loss must be a scalar"):
        ops.linear_jsd_bwd(torch.ones(4), sx, sw, tx, tw, t, 0.5, 1.0, IGNORE, "mean", True, True)


@requires_cuda
def test_device_mismatch_cuda():
    sx, sw, tx, tw, t = make_inputs((4,), 8, 8, 10, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match="target must be on the device of student_x"):
        linear_jsd(sx, sw, tx, tw, t.cpu())
    with pytest.raises(RuntimeError, match="teacher_weight must be on the device of student_x"):
        linear_jsd(sx, sw, tx, tw.cpu(), t)
    with pytest.raises(RuntimeError, match="student_x must be float32, float16 or bfloat16"):
        linear_jsd(sx.double(), sw.double(), tx.double(), tw.double(), t)


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    sx, sw, tx, tw, t = make_inputs((3, 5), 16, 12, 40, torch.float32, device)
    for red, beta, target in (("mean", 0.5, t), ("sum", 0.0, None), ("none", 1.0, t)):
        run_opcheck(ops.linear_jsd_fwd, (sx, sw, tx, tw, target, beta, 1.5, IGNORE, red, True, True))
    run_opcheck(ops.linear_jsd_bwd, (randn(3, 5, device=device), sx.detach(), sw.detach(), tx, tw, t, 0.3, 2.0,
                                     IGNORE, "none", True, True))
    run_opcheck(ops.linear_jsd_bwd, (torch.tensor(0.5, device=device), sx.detach(), sw.detach(), tx, tw, None, 0.3,
                                     1.0, IGNORE, "mean", True, False))


@pytest.mark.parametrize("device", devices())
def test_double_backward_raises(device):
    sx, sw, tx, tw, t = make_inputs((2, 3), 16, 8, 40, torch.float32, device)
    assert_double_backward_raises(lambda x_, w_: linear_jsd(x_, w_, tx, tw, t, beta=0.5), sx, sw, op_name="linear_jsd")


@pytest.mark.parametrize("beta", BETAS, ids=BETA_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_float64_cpu(beta, reduction):
    sx, sw, tx, tw, t = make_inputs((2, 3), 5, 4, 7, torch.float64, "cpu", ignore_every=4)

    def fn(x_, w_):
        return linear_jsd(x_, w_, tx, tw, t, beta=beta, temperature=1.7, reduction=reduction)

    assert torch.autograd.gradcheck(fn, (sx, sw))


@pytest.mark.parametrize("device", devices())
def test_compile_fullgraph(device):
    sx, sw, tx, tw, t = make_inputs((2, 13), 16, 20, 96, torch.float32, device)

    def fn(x_, w_):
        a = linear_jsd(x_, w_, tx, tw, t, beta=0.5, temperature=2.0)
        c = linear_kl_div(x_, w_, tx, tw, t, reverse=True, reduction="none")
        d = linear_kl_div(x_, w_, tx, tw, None, reduction="sum")
        return a + (c * torch.linspace(0, 1, c.numel(), device=c.device).view_as(c)).sum() + 0.5 * d

    assert_compiles_like_eager(fn, sx, sw, device=device)


# ---- CPU: the chunked path and its row kernel (linear_jsd_cpu_kernel.h) -------------------------
CPU_CHUNK_ENV = "FUSEFORGE_JSD_CPU_CHUNK_ROWS"


@pytest.mark.parametrize("rows", [31, 32, 33, 97])
@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0], ids=["fwd-kl", "jsd", "rev-kl"])
@requires_dev_knobs
def test_cpu_chunk_boundaries(rows, reduction, beta, monkeypatch):
    """Rows just below, at and above multiples of the chunk (32 rows here): every chunk's logits, row
    losses, per-row gradient weights and grad_x rows land at the right offsets, and the weight
    gradient sums every chunk once."""
    monkeypatch.setenv(CPU_CHUNK_ENV, "32")
    sx, sw, tx, tw, t = make_inputs((rows,), 40, 24, 301, torch.float32, "cpu", ignore_every=5)
    grad_out = randn(rows) if reduction == "none" else None
    check_against_reference(sx, sw, tx, tw, t, beta=beta, reduction=reduction, grad_out=grad_out, temperature=1.3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@requires_dev_knobs
def test_cpu_half_dtypes_chunks(dtype, monkeypatch):
    """bf16/fp16 inputs: converted chunk by chunk to float32 (two chunks here), float32 math."""
    monkeypatch.setenv(CPU_CHUNK_ENV, "32")
    sx, sw, tx, tw, t = make_inputs((3, 19), 32, 16, 203, dtype, "cpu")
    check_against_reference(sx, sw, tx, tw, t, beta=0.4)
    check_against_reference(sx, sw, tx, tw, t, beta=0.4, reduction="none", grad_out=randn(3, 19))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0], ids=["fwd-kl", "jsd", "rev-kl"])
def test_cpu_vector_tails(beta):
    """Every tail length of an AVX-512 float32 vector (16 lanes; the AVX2 and float64 widths divide
    it) and vocabularies below one vector: run once per ISA build (ATEN_CPU_CAPABILITY)."""
    for vocab in list(range(1, 5)) + list(range(33, 49)):
        sx, sw, tx, tw, t = make_inputs((6,), 16, 8, vocab, torch.float32, "cpu", ignore_every=4)
        check_against_reference(sx, sw, tx, tw, t, beta=beta, reduction="none", grad_out=randn(6))


def test_cpu_nan_teacher_makes_rows_nan():
    """A NaN in the teacher's head reaches every token that is not skipped (as materialised logits
    would), and none that is."""
    for col in (0, 5, 36):
        sx, sw, tx, tw, t = make_inputs((9,), 16, 16, 37, torch.float32, "cpu", ignore_every=4)
        tw[col] = float("nan")
        loss = linear_jsd(sx, sw, tx, tw, t, reduction="none")
        valid = t != IGNORE
        assert torch.isnan(loss[valid]).all() and (loss[~valid] == 0).all(), (col, loss)


# ---- CUDA: chunk plans, large vocabularies, a peer ----------------------------------------------
CUDA_CHUNK_ENV = "FUSEFORGE_JSD_CHUNK_ROWS"
CUDA_SUPER_ENV = "FUSEFORGE_JSD_SUPER_ROWS"


@requires_cuda
@requires_dev_knobs
@pytest.mark.parametrize("chunk,super_rows,dtype", [
    ("64", "128", torch.bfloat16), ("40", "100", torch.bfloat16), ("8", "8", torch.bfloat16),
    ("64", "64", torch.float32)], ids=["bf16-2-passes", "bf16-odd-super", "bf16-fp32-acc", "fp32-in-place"])
def test_chunk_plans_cuda(chunk, super_rows, dtype, monkeypatch):
    """Sub-chunks of logits inside super-chunks of dz: grad_W accumulated by cuBLAS (2 and 3 roundings
    to bf16; 100 rows round down to 80, two sub-chunks of 40), in a float32 buffer (24 super-chunks >
    16), and float32's dz written over the student's logits."""
    monkeypatch.setenv(CUDA_CHUNK_ENV, chunk)
    monkeypatch.setenv(CUDA_SUPER_ENV, super_rows)
    sx, sw, tx, tw, t = make_inputs((190,), 64, 48, 1004, dtype, "cuda")
    for beta in (0.0, 0.5, 1.0):
        check_against_reference(sx, sw, tx, tw, t, beta=beta)
        check_against_reference(sx, sw, tx, tw, t, beta=beta, reduction="none", grad_out=randn(190, device="cuda"))


@requires_cuda
@pytest.mark.parametrize("vocab", [32000, 128256, 256000])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0], ids=["fwd-kl", "jsd", "rev-kl"])
def test_large_vocab_cuda(vocab, beta):
    sx, sw, tx, tw, t = make_inputs((37,), 64, 96, vocab, torch.bfloat16, "cuda", w_scale=0.2)
    check_against_reference(sx, sw, tx, tw, t, beta=beta, temperature=2.0)


@requires_cuda
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0], ids=["fwd-kl", "jsd", "rev-kl"])
def test_matches_liger_cuda(beta):
    """Liger-Kernel's LigerFusedLinearJSD on the same inputs (its mean over non-ignored tokens):
    the same convention, so the same numbers."""
    liger = pytest.importorskip("liger_kernel.ops.fused_linear_jsd")
    sx, sw, tx, tw, t = make_inputs((300,), 128, 96, 4000, torch.bfloat16, "cuda", w_scale=0.1)
    ours = linear_jsd(sx, sw, tx, tw, t, beta=beta, temperature=2.0)
    g_ours = torch.autograd.grad(ours, (sx, sw))
    theirs = liger.LigerFusedLinearJSDFunction.apply(sx, sw, tx, tw, t, beta, IGNORE, 2.0)
    g_theirs = torch.autograd.grad(theirs, (sx, sw))
    sx64, sw64, tx64, tw64 = leaves64(sx, sw, tx, tw)
    ref = reference(sx64, sw64, tx64, tw64, t.cpu(), beta=beta, temperature=2.0)
    g_ref = torch.autograd.grad(ref, (sx64, sw64))
    assert_rel_close(ours, ref, LOSS_TOL[torch.bfloat16], "fuseforge loss")
    assert_rel_close(theirs.float(), ref, 1e-3, "Liger-Kernel loss")
    # Liger-Kernel accumulates grad_weight in bf16 over many small chunks: a looser bound for it.
    for name, a, b, r in zip(("grad_x", "grad_weight"), g_ours, g_theirs, g_ref):
        assert_rel_close(a, r, GRAD_TOL[torch.bfloat16], f"fuseforge {name}")
        assert_rel_close(b, r, 3e-2, f"Liger-Kernel {name}")


# ---- small tests every kernel runs in, for compute-sanitizer (memcheck, racecheck) --------------
@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("vocab", [200, 203], ids=["vector", "scalar"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sanitize_kernels(vocab, dtype):
    sx, sw, tx, tw, t = make_inputs((8, 9), 32, 24, vocab, dtype, "cuda")
    for beta in (0.0, 0.5, 1.0):
        check_against_reference(sx, sw, tx, tw, t, beta=beta, grad_out=torch.tensor(1.5, device="cuda"))
        check_against_reference(sx, sw, tx, tw, t, beta=beta, reduction="none", grad_out=randn(8, 9, device="cuda"))


@requires_cuda
@pytest.mark.slow
def test_more_than_2_to_31_elements():
    """int64 offsets: the student's x of 2^31 + 2^17 bf16 elements (about 4.3 GB), JSD at beta 0.5;
    per-token losses and the student's x gradient at both ends against float64, its weight's gradient
    (a sum over every row) against float64 in chunks."""
    hs, ht, vocab = 2048, 1024, 1024
    rows = (2**31 + 2**17) // hs
    sx, sw, tx, tw, t = make_inputs((rows,), hs, ht, vocab, torch.bfloat16, "cuda", x_scale=0.5, w_scale=0.05)
    g = randn(rows, device="cuda")
    loss = linear_jsd(sx, sw, tx, tw, t, beta=0.5, reduction="none")
    grad_x, grad_w = torch.autograd.grad(loss, (sx, sw), g)
    sw64, tw64 = sw.detach().double().requires_grad_(), tw.double()

    def per_token(sl, x64):
        return reference(x64, sw64, tx[sl].double(), tw64, t[sl], beta=0.5, reduction="none")

    for sl in end_rows(rows):
        x64 = sx[sl].detach().double().requires_grad_()
        ref = per_token(sl, x64)
        assert_rel_close(loss[sl], ref, LOSS_TOL[torch.bfloat16], "loss")
        (ref_grad_x,) = torch.autograd.grad(ref, x64, g[sl].double())
        assert_rel_close(grad_x[sl], ref_grad_x, GRAD_TOL[torch.bfloat16], "grad_x")
    ref_grad_w = sum_over_row_chunks(lambda sl: torch.autograd.grad(
        per_token(sl, sx[sl].detach().double()), sw64, g[sl].double())[0], rows)
    assert_rel_close(grad_w, ref_grad_w, GRAD_TOL[torch.bfloat16], "grad_weight")
