"""linear_cross_entropy: loss and gradients against a float64 reference (logits materialised in
float64 from the same low-precision inputs), every reduction, options, strategies, errors, opcheck,
gradcheck and torch.compile."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fuseforge  # noqa: F401  (loads the extension)
from fuseforge.nn.linear_cross_entropy import LinearCrossEntropyLoss
from fuseforge.ops.linear_cross_entropy import linear_cross_entropy
from harness import (assert_compiles_like_eager, assert_double_backward_raises, assert_rel_close, device_dtypes,
                     devices, end_rows, generator, poison_allocations, randn, rel_err, requires_cuda,
                     requires_dev_knobs, run_opcheck, sum_over_row_chunks)


ops = torch.ops.fuseforge
IGNORE = -100
# The loss is a float32 reduction of float32 logits: tight even for bf16/fp16 inputs.
LOSS_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}
# Except bf16 on the GPU's reduced losses (mean/sum): there the logits are cuBLAS's bf16 output, as
# in eager PyTorch and torch.compile, with the target logit (and, for label smoothing, the sum of the
# logits) formed exactly; the rest of their rounding reaches the loss. 1e-4, or 3x the error that
# rounding this draw's logits to bf16 gives the float64 loss, whichever is larger: with logits of
# std ~2 over 87 tokens that rounding alone passes 1e-4 in ~5% of draws (1.9e-4 at most in 3000).
BF16_LOGITS_LOSS_TOL = 1e-4
# Gradients go through one rounding of the logit gradients to the input dtype and bf16/fp16 outputs.
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 8e-3}


def make_inputs(n_shape, hidden, vocab, dtype, device, *, bias=False, ignore_every=7, x_scale=0.5,
                w_scale=0.02, peaky=False, target_dtype=torch.int64):
    n = math.prod(n_shape)
    w = randn(vocab, hidden, dtype=torch.float32, device=device, scale=w_scale)
    target = torch.randint(0, vocab, (n,), generator=generator(device), device=device)
    x = randn(n, hidden, dtype=torch.float32, device=device, scale=x_scale)
    if peaky:  # x leans towards its target's row: the model predicts the target with high probability
        wt = w[target]
        x = 0.1 * x + 14.0 * wt / wt.square().sum(1, keepdim=True)
    if ignore_every:
        target[::ignore_every] = IGNORE
    b = randn(vocab, dtype=torch.float32, device=device, scale=0.1) if bias else None
    x = x.reshape(*n_shape, hidden).to(dtype).requires_grad_()
    w = w.to(dtype).requires_grad_()
    if b is not None:
        b = b.to(dtype).requires_grad_()
    return x, w, target.reshape(n_shape).to(target_dtype), b


def reference(x, w, target, b=None, *, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
              ignore_index=IGNORE, lowp_logits=None):
    """float64 loss of the (already rounded) inputs; differentiable in x, w, b (float64 leaves).
    lowp_logits: a dtype that x @ W.T is rounded to (before bias and softcap) for the logsumexp, as the
    bf16 cluster path reads cuBLAS's bf16 logits; the target logit and the sum of the logits stay
    exact, as that path forms them (the sum from the rounded logits under softcap)."""
    def finish(z):
        if b is not None:
            z = z + b
        return softcap * torch.tanh(z / softcap) if softcap else z
    mm = x.flatten(0, -2) @ w.T
    logits = finish(mm)
    rounded = logits if lowp_logits is None else finish(mm.to(lowp_logits).double())
    t = target.flatten().long()
    valid = t != ignore_index
    tc = torch.where(valid, t, torch.zeros_like(t))
    lse = torch.logsumexp(rounded, 1)
    loss = lse - (1 - label_smoothing) * logits.gather(1, tc[:, None])[:, 0]
    if label_smoothing:
        loss = loss - label_smoothing / logits.shape[1] * (rounded if softcap else logits).sum(1)
    loss = (loss + z_loss * lse * lse) * valid
    if reduction == "none":
        return loss.reshape(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp_min(1)


def bf16_logits_loss_tol(ref, x64, w64, t, b64, **kw) -> float:
    """BF16_LOGITS_LOSS_TOL, or 3x how far rounding this draw's x @ W.T to bf16 moves the float64 loss
    `ref` (reference() of the same arguments), whichever is larger."""
    rounded = reference(x64, w64, t, b64, lowp_logits=torch.bfloat16, **kw).detach()
    return max(BF16_LOGITS_LOSS_TOL, 3 * rel_err(rounded, ref.detach()))


def leaves64(*ts):
    return [None if t is None else t.detach().cpu().double().requires_grad_() for t in ts]


def check_against_reference(x, w, t, b, *, grad_out=None, loss_tol=None, grad_tol=None, **kw):
    dtype = x.dtype
    poison_allocations(x, w)
    loss = linear_cross_entropy(x, w, t, b, **{k: v for k, v in kw.items()})
    bf16_logits = x.is_cuda and dtype == torch.bfloat16 and kw.get("reduction", "mean") != "none" \
        and not kw.get("low_memory", False)
    kw.pop("low_memory", None)
    x64, w64, b64 = leaves64(x, w, b)
    ref = reference(x64, w64, t.cpu(), b64, **kw)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = loss_tol or (bf16_logits_loss_tol(ref, x64, w64, t.cpu(), b64, **kw) if bf16_logits else LOSS_TOL[dtype])
    assert_rel_close(loss, ref, tol, "loss")
    g = grad_out if grad_out is not None else torch.ones_like(loss)
    params = [p for p in (x, w, b) if p is not None]
    grads = torch.autograd.grad(loss, params, g)
    refs = torch.autograd.grad(ref, [p for p in (x64, w64, b64) if p is not None], g.cpu().double())
    errs = []
    for name, got, want in zip(("grad_x", "grad_weight", "grad_bias"), grads, refs):
        assert got.dtype == dtype and got.shape == want.shape
        errs.append(assert_rel_close(got, want, grad_tol or GRAD_TOL[dtype], name))
    return errs


SHAPES = [((4, 37), 64, 1000), ((53,), 48, 999)]  # V % 4 == 0 (cluster kernel) and odd V (stream kernel)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float64, torch.bfloat16)))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", SHAPES, ids=["v1000", "v999"])
def test_matches_reference(device, dtype, reduction, shape):
    n_shape, hidden, vocab = shape
    x, w, t, b = make_inputs(n_shape, hidden, vocab, dtype, device)
    grad_out = None
    if reduction == "none":  # non-uniform per-token gradients
        grad_out = randn(*n_shape, device=device)
    check_against_reference(x, w, t, b, reduction=reduction, grad_out=grad_out)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32,),
                                                       cuda_dtypes=(torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("options", [dict(label_smoothing=0.1), dict(z_loss=1e-3), dict(softcap=2.0),
                                     dict(label_smoothing=0.2, z_loss=1e-2, softcap=3.0, bias=True)],
                         ids=["smoothing", "zloss", "softcap", "all+bias"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_options(device, dtype, options, reduction):
    options = dict(options)
    bias = options.pop("bias", False)
    x, w, t, b = make_inputs((3, 29), 32, 500, dtype, device, bias=bias, x_scale=2.0, w_scale=0.2)
    grad_out = randn(3, 29, device=device) if reduction == "none" else None
    check_against_reference(x, w, t, b, reduction=reduction, grad_out=grad_out, **options)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32,),
                                                       cuda_dtypes=(torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("low_memory", [False, True])
def test_peaky_distribution(device, dtype, low_memory):
    """Targets predicted with probability ~0.99: the loss is small and bf16-rounded logits would lose
    it; fuseforge's float32 logits keep the loss within 1e-5 and the gradients within the dtype's
    tolerance of float64."""
    x, w, t, b = make_inputs((257,), 128, 3000, dtype, device, peaky=True)
    with torch.no_grad():
        loss_rows = reference(*leaves64(x, w), t.cpu(), reduction="none")
        valid = t.cpu() != IGNORE
        p_target = torch.exp(-loss_rows[valid]).median().item()
    assert p_target > 0.9, f"inputs are not peaky: median target probability {p_target}"
    # Logits of magnitude ~14 carry ~5e-6 absolute float32 GEMM error: fp32 gradients land near 3e-5
    # (CUDA), 7e-5 (CPU, AVX-512 GEMMs) to 1.1e-4 (CPU, AVX2 GEMMs; eager's own x @ W.T gradients show
    # the same error there).
    grad_tol = max(GRAD_TOL[dtype], 2e-4 if device == "cpu" else 1e-4)
    errs = check_against_reference(x, w, t, b, low_memory=low_memory, loss_tol=1e-4, grad_tol=grad_tol)
    if dtype == torch.bfloat16:  # what materialised bf16 logits (eager) lose, for the record
        eager = F.cross_entropy((x.detach() @ w.detach().T).float(), t, ignore_index=IGNORE)
        print(f"peaky {dtype}: fuseforge grad errs {errs}; eager bf16-logits loss err "
              f"{rel_err(eager, reference(*leaves64(x, w), t.cpu())):.2e}")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("low_memory", [False, True])
def test_all_ignored(device, reduction, low_memory):
    x, w, t, b = make_inputs((2, 9), 16, 64, torch.float32, device, bias=True)
    t.fill_(IGNORE)
    loss = linear_cross_entropy(x, w, t, b, reduction=reduction, low_memory=low_memory)
    assert torch.isfinite(loss).all() and (loss == 0).all()
    grads = torch.autograd.grad(loss.sum(), (x, w, b))
    for g in grads:
        assert torch.isfinite(g).all() and (g == 0).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty(device, reduction):
    x, w, t, _ = make_inputs((0,), 16, 40, torch.float32, device)
    loss = linear_cross_entropy(x, w, t, reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    gx, gw = torch.autograd.grad(loss.sum(), (x, w), allow_unused=True)
    assert gw is not None and (gw == 0).all() and gx.shape == x.shape


@pytest.mark.parametrize("device", devices())
def test_noncontiguous_int32_and_module(device):
    x, w, t, b = make_inputs((6, 11), 24, 130, torch.float32, device, bias=True, target_dtype=torch.int32)
    xt = x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # non-contiguous view
    assert not xt.is_contiguous()
    wt = w.detach().t().contiguous().t().requires_grad_()  # non-contiguous weight
    check_against_reference(xt, wt, t, b)
    loss_fn = LinearCrossEntropyLoss(label_smoothing=0.1)
    ref = F.cross_entropy(F.linear(x, w, b).flatten(0, 1), t.flatten().long(), label_smoothing=0.1)
    assert_rel_close(loss_fn(x, w, t, b), ref, 1e-5, "module loss")


@pytest.mark.parametrize("device", devices())
def test_grad_output_scaling(device):
    """The forward precomputes the gradients of the loss; the backward scales them by grad_output."""
    x, w, t, _ = make_inputs((40,), 32, 300, torch.float32, device)
    for g in (1.0, 2.5, 0.0):
        check_against_reference(x, w, t, None, grad_out=torch.tensor(g, device=device))
    # only one input requires grad
    x2 = x.detach().requires_grad_(False)
    loss = linear_cross_entropy(x2, w, t)
    (gw,) = torch.autograd.grad(loss, (w,))
    x64, w64 = leaves64(x2, w)
    (gw_ref,) = torch.autograd.grad(reference(x64, w64, t.cpu()), (w64,))
    assert_rel_close(gw, gw_ref, 1e-5, "grad_weight only")


@pytest.mark.parametrize("device", devices())
def test_repeated_backward(device):
    """retain_graph: the first backward hands over the forward's gradients, later ones recompute."""
    x, w, t, _ = make_inputs((30,), 16, 70, torch.float32, device)
    loss = linear_cross_entropy(x, w, t)
    g1 = torch.autograd.grad(loss, (x, w), torch.tensor(2.0, device=device), retain_graph=True)
    g2 = torch.autograd.grad(loss, (x, w), torch.tensor(2.0, device=device))
    for a, b in zip(g1, g2):
        assert_rel_close(a, b, 1e-5, "repeated backward")


def test_errors():
    x, w, t, b = make_inputs((4,), 8, 10, torch.float32, "cpu", bias=True)
    with pytest.raises(RuntimeError, match="target must have shape"):
        linear_cross_entropy(x, w, t[:3])
    with pytest.raises(RuntimeError, match="weight must have shape"):
        linear_cross_entropy(x, w[:, :5], t)
    with pytest.raises(RuntimeError, match="weight must have the dtype of x"):
        linear_cross_entropy(x, w.double(), t)
    with pytest.raises(RuntimeError, match="bias must have shape"):
        linear_cross_entropy(x, w, t, b[:3])
    with pytest.raises(RuntimeError, match="target must be an int64 or int32"):
        linear_cross_entropy(x, w, t.float())
    with pytest.raises(RuntimeError, match="x must be float32"):
        linear_cross_entropy(x.int(), w, t)
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(x, w, t, label_smoothing=1.0)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(x, w, t, softcap=-1.0)
    # the op itself checks too (the Python layer is not the only guard)
    with pytest.raises(RuntimeError, match="label_smoothing must be in"):
        ops.linear_cross_entropy_fwd(x, w, t, None, IGNORE, "mean", -0.1, 0.0, 0.0, False, False, False, False)
    with pytest.raises(RuntimeError, match="reduction must be"):
        ops.linear_cross_entropy_fwd(x, w, t, None, IGNORE, "avg", 0.0, 0.0, 0.0, False, False, False, False)
    bad = t.clone()
    bad[1] = 10
    with pytest.raises(RuntimeError, match=r"target must hold class indices in \[0, 10\)"):
        linear_cross_entropy(x, w, bad)


@requires_cuda
def test_out_of_range_target_cuda_is_nan():
    """No host sync on CUDA: an out-of-range target makes that token's loss (and so the mean) NaN."""
    x, w, t, _ = make_inputs((16,), 8, 12, torch.float32, "cuda")
    t[3] = 12
    loss = linear_cross_entropy(x, w, t, reduction="none")
    assert torch.isnan(loss[3]) and torch.isfinite(loss[torch.arange(16, device="cuda") != 3]).all()
    assert torch.isnan(linear_cross_entropy(x, w, t))


@requires_cuda
def test_device_mismatch_cuda():
    x, w, t, _ = make_inputs((4,), 8, 10, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match="target must be on the device of x"):
        linear_cross_entropy(x, w, t.cpu())


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    x, w, t, b = make_inputs((3, 5), 16, 40, torch.float32, device, bias=True)
    for red in ("mean", "none"):
        args = (x, w, t, b, IGNORE, red, 0.1, 1e-3, 0.0, False, True, True, True)
        run_opcheck(ops.linear_cross_entropy_fwd, args)
    lse = ops.linear_cross_entropy_fwd(x, w, t, b, IGNORE, "none", 0.0, 0.0, 0.0, False, False, False, False)[1]
    run_opcheck(ops.linear_cross_entropy_bwd,
                (randn(3, 5, device=device), x.detach(), w.detach(), t, b.detach(), lse, IGNORE, "none", 0.0, 0.0,
                 0.0, False, True, True, True))
    gx, gw, gb = (randn(3, 5, 16, device=device), randn(40, 16, device=device), randn(40, device=device))
    run_opcheck(ops.linear_cross_entropy_scale_grads_,
                (gx, gw, gb, torch.tensor(2.0, device=device), torch.tensor(0.5, device=device)))


@pytest.mark.parametrize("device", devices())
def test_double_backward_raises(device):
    x, w, t, b = make_inputs((2, 3), 16, 40, torch.float32, device, bias=True)
    assert_double_backward_raises(lambda x_, w_, b_: linear_cross_entropy(x_, w_, t, b_, z_loss=0.01), x, w, b,
                                  op_name="linear_cross_entropy")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_float64_cpu(reduction):
    x, w, t, b = make_inputs((2, 3), 5, 7, torch.float64, "cpu", bias=True, ignore_every=4, x_scale=1.0,
                             w_scale=1.0)

    def fn(x_, w_, b_):
        return linear_cross_entropy(x_, w_, t, b_, reduction=reduction, label_smoothing=0.1, z_loss=0.01,
                                    softcap=3.0)

    assert torch.autograd.gradcheck(fn, (x, w, b))


@pytest.mark.parametrize("device", devices())
def test_compile_fullgraph(device):
    x, w, t, b = make_inputs((2, 13), 16, 96, torch.float32, device, bias=True)

    def fn(x_, w_, b_):
        a = linear_cross_entropy(x_, w_, t, b_, label_smoothing=0.1)
        c = linear_cross_entropy(x_, w_, t, b_, reduction="none", z_loss=1e-3)
        return a + (c * torch.linspace(0, 1, c.numel(), device=c.device).view_as(c)).sum()

    assert_compiles_like_eager(fn, x, w, b, device=device)


# ---- CPU: the chunked path with its fused row kernel (linear_cross_entropy_cpu_kernel.h) ---------
ALL_OPTIONS = dict(label_smoothing=0.15, z_loss=2e-3, softcap=4.0)
CPU_CHUNK_ENV = "FUSEFORGE_LCE_CPU_CHUNK_ROWS"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("vocab", [1, 3, 17, 1000])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", [{}, ALL_OPTIONS], ids=["plain", "all-options"])
def test_cpu_odd_vocab(dtype, vocab, reduction, options):
    """Vocab sizes below, at and between vector widths (tails of the row kernel's loops)."""
    x, w, t, b = make_inputs((5, 7), 24, vocab, dtype, "cpu", bias=bool(options), ignore_every=4, x_scale=2.0,
                             w_scale=0.3)
    grad_out = randn(5, 7, dtype=dtype) if reduction == "none" else torch.tensor(1.7, dtype=dtype)
    check_against_reference(x, w, t, b, reduction=reduction, grad_out=grad_out, **options)


@pytest.mark.parametrize("rows", [63, 64, 65, 128, 129])
@pytest.mark.parametrize("reduction", ["sum", "none"])
@requires_dev_knobs
def test_cpu_chunk_boundaries(rows, reduction, monkeypatch):
    """Rows just below, at and above multiples of the chunk (64 rows here): every chunk's logits,
    statistics, per-row gradient weights and grad_x rows land at the right offsets, and the weight
    gradient sums every chunk once."""
    monkeypatch.setenv(CPU_CHUNK_ENV, "64")
    x, w, t, b = make_inputs((rows,), 40, 301, torch.float32, "cpu", bias=True, ignore_every=5, x_scale=2.0,
                             w_scale=0.2)
    grad_out = randn(rows) if reduction == "none" else None
    check_against_reference(x, w, t, b, reduction=reduction, grad_out=grad_out, **ALL_OPTIONS)


@pytest.mark.parametrize("rows", [127, 129])
def test_cpu_default_chunk_boundaries(rows):
    """The default chunk plan at a large vocabulary (a few hundred rows a chunk at most): a second,
    ragged chunk."""
    x, w, t, b = make_inputs((rows,), 8, 70001, torch.float32, "cpu", bias=True, x_scale=2.0, w_scale=1.0)
    # grad_x rows are float32 GEMM sums over 70001 logit gradients: ~1.2e-5 from their rounding alone.
    tol = 4e-5
    check_against_reference(x, w, t, b, reduction="none", grad_out=randn(rows), label_smoothing=0.1, grad_tol=tol)
    check_against_reference(x, w, t, b, grad_tol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@requires_dev_knobs
def test_cpu_half_dtypes_all_options(dtype, reduction, monkeypatch):
    """bf16/fp16 inputs: converted chunk by chunk to float32 (two chunks here), float32 math."""
    monkeypatch.setenv(CPU_CHUNK_ENV, "32")
    x, w, t, b = make_inputs((3, 19), 32, 203, dtype, "cpu", bias=True, x_scale=2.0, w_scale=0.2)
    grad_out = randn(3, 19) if reduction == "none" else None
    check_against_reference(x, w, t, b, reduction=reduction, grad_out=grad_out, **ALL_OPTIONS)


@pytest.mark.parametrize("low_memory", [False, True])
def test_cpu_ignored_rows_with_huge_logits(low_memory):
    """An ignored row whose logits overflow exp() (lse saved as 0) gives no NaN in the recomputing
    backward: ignored rows get no arithmetic at all."""
    x, w, t, b = make_inputs((20,), 16, 50, torch.float32, "cpu", ignore_every=3)
    with torch.no_grad():
        x[::3] *= 1e4  # logits ~1e3 on the ignored rows
    check_against_reference(x, w, t, b, reduction="none", grad_out=randn(20), low_memory=low_memory)
    check_against_reference(x, w, t, b, low_memory=low_memory)


@pytest.mark.parametrize("bias", [False, True], ids=["max-only-pass", "bias-pass"])
def test_cpu_nan_logit_makes_row_nan(bias):
    """One NaN logit in every row (a NaN weight row), in the first vector, the middle, or the tail:
    the row kernel's max pass may drop a NaN, but the exp sum over the same logits does not, so every
    row that is not ignored has a NaN loss and NaN gradients, as in eager PyTorch."""
    for col in (0, 5, 20, 36):
        x, w, t, b = make_inputs((9,), 16, 37, torch.float32, "cpu", bias=bias, ignore_every=4)
        with torch.no_grad():
            w[col] = float("nan")
        loss = linear_cross_entropy(x, w, t, b, reduction="none")
        valid = t != IGNORE
        assert torch.isnan(loss[valid]).all() and (loss[~valid] == 0).all(), (col, loss)
        (gx,) = torch.autograd.grad(linear_cross_entropy(x, w, t, b), (x,))
        assert torch.isnan(gx).all(), col


@requires_dev_knobs
def test_cpu_out_of_range_target_names_position(monkeypatch):
    x, w, t, _ = make_inputs((9,), 8, 10, torch.float32, "cpu", ignore_every=0)
    for bad_value in (-1, 10):
        bad = t.clone()
        bad[5] = bad_value
        with pytest.raises(RuntimeError, match=rf"\[0, 10\).*\({bad_value} at flattened position 5\)"):
            linear_cross_entropy(x, w, bad, reduction="none")
    monkeypatch.setenv(CPU_CHUNK_ENV, "0")
    with pytest.raises(RuntimeError, match=f"{CPU_CHUNK_ENV}: expected a positive integer"):
        linear_cross_entropy(x, w, t)


def test_cpu_vector_tails():
    """Every tail length of an AVX-512 float32 vector (16 lanes; the AVX2 and float64 widths divide
    it), with every option: run once per ISA build (ATEN_CPU_CAPABILITY=default|avx2|avx512)."""
    for vocab in range(33, 49):
        x, w, t, b = make_inputs((6,), 16, vocab, torch.float32, "cpu", bias=True, ignore_every=0, x_scale=2.0,
                                 w_scale=0.3)
        check_against_reference(x, w, t, b, reduction="none", grad_out=randn(6), **ALL_OPTIONS)


# ---- CUDA: chunk plans that small shapes do not reach -------------------------------------------
@requires_cuda
@pytest.mark.parametrize("rows,vocab,low_memory", [
    (20000, 256, False),   # 3 super-chunks: grad_W accumulated in bf16 by cuBLAS (3 roundings)
    (41000, 256, False),   # 6 super-chunks > 4: float32 V x H accumulator
    (4500, 9000, True),    # low-memory: pass 1 3 x 2 tiles, pass 2 4 row blocks x 3 chunks, last ones ragged
], ids=["bf16-passes", "fp32-acc", "lowmem-tiles"])
def test_chunk_plans_cuda(rows, vocab, low_memory):
    x, w, t, b = make_inputs((rows,), 64, vocab, torch.bfloat16, "cuda", bias=True, w_scale=0.1)
    check_against_reference(x, w, t, b, low_memory=low_memory, label_smoothing=0.05)
    check_against_reference(x, w, t, b, low_memory=low_memory, reduction="none",
                            grad_out=randn(rows, device="cuda"))


@requires_cuda
@pytest.mark.parametrize("vocab", [32000, 128256, 256000])
def test_large_vocab_cluster_sizes_cuda(vocab):
    """Each register-tile size of the cluster kernel (and the streaming kernel's tiles at 256000)."""
    x, w, t, _ = make_inputs((67,), 64, vocab, torch.bfloat16, "cuda")
    check_against_reference(x, w, t, None)
    check_against_reference(x, w, t, None, low_memory=True)


@requires_cuda
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "bias": True}],
                         ids=["plain", "options"])
def test_loss_only_bf16_cuda(reduction, options):
    """No gradient wanted (evaluation): for mean/sum bf16 logits and the cluster kernel without dz;
    the loss keeps the exact target logit (and exact sum of logits for label smoothing). Per-token
    losses ("none") keep float32 logits: the tighter tolerance."""
    options = dict(options)
    bias = options.pop("bias", False)
    x, w, t, b = make_inputs((3, 700), 64, 3000, torch.bfloat16, "cuda", bias=bias, x_scale=2.0, w_scale=0.2)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, b, reduction=reduction, **options)
    x64, w64, b64 = leaves64(x, w, b)
    ref = reference(x64, w64, t.cpu(), b64, reduction=reduction, **options)
    tol = LOSS_TOL[torch.bfloat16] if reduction == "none" else bf16_logits_loss_tol(ref, x64, w64, t.cpu(), b64,
                                                                                   reduction=reduction, **options)
    assert_rel_close(loss, ref.detach(), tol, "loss")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-logits", "bf16-in-place"])
@pytest.mark.parametrize("general", [False, True], ids=["plain", "bias-smoothing"])
@requires_dev_knobs
def test_persistent_cluster_kernel_matches_one_cluster_a_row(dtype, general, monkeypatch):
    """The persistent cluster kernel (clusters loop over rows, prefetching the next row, ignored rows
    skipped) gives bit-identical results to one cluster a row (FUSEFORGE_LCE_PERSISTENT=0), in its
    plain form (no bias, label smoothing, z-loss or softcap) and its general one."""
    x, w, t, b = make_inputs((1500,), 64, 3000, dtype, "cuda", bias=general)
    t[::5] = IGNORE  # runs of ignored and valid rows in every cluster's sequence
    label_smoothing = 0.1 if general else 0.0
    params = (x, w) if b is None else (x, w, b)
    results = []
    for persistent in ("1", "0"):
        monkeypatch.setenv("FUSEFORGE_LCE_PERSISTENT", persistent)
        loss = linear_cross_entropy(x, w, t, b, label_smoothing=label_smoothing)
        results.append((loss, *torch.autograd.grad(loss, params)))
    for got, want, name in zip(results[0], results[1], ("loss", "grad_x", "grad_weight", "grad_bias")):
        assert torch.equal(got, want), f"{name} differs between the persistent and one-a-row launches"
    check_against_reference(x, w, t, b, label_smoothing=label_smoothing)


# ---- small tests every kernel runs in, for compute-sanitizer (memcheck, racecheck) --------------
@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("vocab,low_memory", [(200, False), (203, False), (1100, True)],
                         ids=["cluster", "stream", "lowmem"])
def test_sanitize_kernels(vocab, low_memory):
    # 72 rows: more than the GPU's resident clusters, so the persistent cluster kernel loops.
    x, w, t, b = make_inputs((8, 9), 32, vocab, torch.bfloat16, "cuda", bias=True)
    check_against_reference(x, w, t, b, low_memory=low_memory, label_smoothing=0.1, softcap=5.0,
                            grad_out=torch.tensor(1.5, device="cuda"))
    check_against_reference(x, w, t, b, low_memory=low_memory, reduction="none", grad_out=randn(8, 9, device="cuda"))


@requires_cuda
@pytest.mark.slow
def test_more_than_2_to_31_elements():
    """int64 offsets: x of 2^31 + 2^17 bf16 elements (about 4.3 GB); per-token losses and x's gradient
    at both ends against float64, the weight's gradient (a sum over every row) against float64 in chunks."""
    hidden, vocab = 2048, 1024
    rows = (2**31 + 2**17) // hidden
    x, w, t, _ = make_inputs((rows,), hidden, vocab, torch.bfloat16, "cuda")
    g = randn(rows, device="cuda")
    loss = linear_cross_entropy(x, w, t, reduction="none")
    grad_x, grad_w = torch.autograd.grad(loss, (x, w), g)
    w64 = w.detach().double().requires_grad_()
    for sl in end_rows(rows):
        x64 = x[sl].detach().double().requires_grad_()
        ref = reference(x64, w64, t[sl], reduction="none")
        assert_rel_close(loss[sl], ref, LOSS_TOL[torch.bfloat16], "loss")
        (ref_grad_x,) = torch.autograd.grad(ref, x64, g[sl].double())
        assert_rel_close(grad_x[sl], ref_grad_x, GRAD_TOL[torch.bfloat16], "grad_x")
    ref_grad_w = sum_over_row_chunks(lambda sl: torch.autograd.grad(
        reference(x[sl].detach().double(), w64, t[sl], reduction="none"), w64, g[sl].double())[0], rows)
    assert_rel_close(grad_w, ref_grad_w, GRAD_TOL[torch.bfloat16], "grad_weight")
