"""linear_logprobs and the post-training losses on it (GRPO, DPO-family, CPO, ORPO, KTO), against float64
references that materialise the logits."""
import math

import pytest
import torch

import fuseforge
from fuseforge import linear_logprobs
from fuseforge.nn import (CPOLoss, GRPOLoss, KTOLoss, ORPOLoss, PreferenceLoss, cpo_loss, grpo_loss, kto_kl, kto_loss,
                          orpo_loss, preference_loss)
from fuseforge.nn import posttraining as posttraining_module
from fuseforge.ops import logprobs as logprobs_module
from harness import (TOL, assert_compiles, assert_double_backward_raises, assert_rel_close, device_dtypes, devices,
                     generator, randn, rel_err, run_opcheck)

ops = torch.ops.fuseforge

# (tokens shape, hidden, vocab): one token, a batch of completions, an odd vocabulary past a chunk.
SHAPES = [((1,), 8, 5), ((3, 7), 16, 33), ((2, 5), 24, 1031)]


def reference_logprobs(x, w, target, bias=None, temperature=1.0, ignore_index=-100):
    logits = x.double() @ w.double().T
    if bias is not None:
        logits = logits + bias.double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    keep = target != ignore_index
    picked = logp.gather(-1, torch.where(keep, target, 0).long().unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, picked, torch.zeros_like(picked))


def make(shape, hidden, vocab, dtype, device, requires_grad=False):
    x = randn(*shape, hidden, dtype=dtype, device=device, requires_grad=requires_grad)
    w = randn(vocab, hidden, dtype=dtype, device=device, scale=0.5, requires_grad=requires_grad)
    target = torch.randint(0, vocab, shape, generator=generator(device), device=device)
    return x, w, target


def grad_tol(dtype):
    return {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("shape,hidden,vocab", SHAPES, ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_logprobs_and_gradients_match_float64(device, dtype, shape, hidden, vocab, temperature, with_bias):
    x, w, target = make(shape, hidden, vocab, dtype, device, requires_grad=True)
    bias = randn(vocab, dtype=dtype, device=device, requires_grad=True) if with_bias else None
    if len(shape) == 2:
        target[0, -1] = -100  # an ignored token: log-probability 0, no gradient
    out = linear_logprobs(x, w, target, bias, temperature=temperature)
    ref = reference_logprobs(x, w, target, bias, temperature)
    assert out.shape == target.shape and out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # 16-bit inputs' logits are rounded relative to the logits, not to a picked log-probability (which
    # may be near 0, and a (1,) case has only one): the bound scales with the larger of the two.
    logit_scale = (x.double() @ w.double().T).abs().max().item() / temperature
    assert (out.double() - ref).abs().max().item() <= max(TOL[dtype], 1e-6) * max(ref.abs().max().item(), logit_scale)
    if len(shape) == 2:
        assert out[0, -1].item() == 0.0
    # A weighted sum: every token's gradient has its own weight (reduction "none" underneath).
    weights = randn(*shape, dtype=torch.float64, device=device)
    leaves = [t for t in (x, w, bias) if t is not None]
    grads = torch.autograd.grad((out.double() * weights).sum(), leaves)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_() if bias is not None else None
    refs = torch.autograd.grad((reference_logprobs(x64, w64, target, b64, temperature) * weights).sum(),
                               [t for t in (x64, w64, b64) if t is not None])
    for g, r in zip(grads, refs):
        assert rel_err(g, r) <= grad_tol(dtype)


def test_gradcheck_float64_cpu():
    x, w, target = make((2, 3), 6, 11, torch.float64, "cpu", requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: linear_logprobs(x, w, target, temperature=0.8), (x, w))


@pytest.mark.parametrize("device", devices())
def test_compiles_fullgraph(device):
    x, w, target = make((2, 5), 16, 40, torch.float32, device)
    assert_compiles(lambda x, w, t: linear_logprobs(x, w, t, temperature=0.5), x, w, target, device=device)


def test_bad_arguments_raise_clear_errors():
    x, w, target = make((2, 3), 8, 10, torch.float32, "cpu")
    with pytest.raises(ValueError, match="temperature must be a positive number, got 0.0"):
        linear_logprobs(x, w, target, temperature=0.0)
    with pytest.raises(ValueError, match="softcap and a temperature other than 1 cannot be combined"):
        linear_logprobs(x, w, target, temperature=0.5, softcap=30.0)
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        grpo_loss(logp, torch.zeros(2), torch.ones(2, 3), loss_type="ppo")
    with pytest.raises(ValueError, match=r"advantages must have shape \(B,\) = \(2,\)"):
        grpo_loss(logp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="beta != 0 needs ref_logprobs"):
        grpo_loss(logp, torch.zeros(2), torch.ones(2, 3), beta=0.1)
    with pytest.raises(ValueError, match=r"logprobs and mask must both have shape \(B, T\)"):
        grpo_loss(logp, torch.zeros(2), torch.ones(2, 4))


def reference_grpo(logp, adv, mask, old, ref, beta, eps_low, eps_high, loss_type, num_items=None, max_len=None):
    """TRL's GRPOTrainer loss, written out in float64."""
    ratio = torch.exp(logp - old)
    per_token = -torch.minimum(ratio * adv[:, None], torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv[:, None])
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / (mask.sum().clamp(min=1) if num_items is None else num_items)
    return (per_token * mask).sum() / (logp.shape[0] * (logp.shape[1] if max_len is None else max_len))


def completions(batch, length, hidden, vocab, dtype, device, temperature=1.0, clip=(0.2, 0.28)):
    hidden_states = randn(batch, length, hidden, dtype=dtype, device=device, requires_grad=True)
    w = randn(vocab, hidden, dtype=dtype, device=device, scale=0.5, requires_grad=True)
    ids = torch.randint(0, vocab, (batch, length), generator=generator(device), device=device)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator(device), device=device)
    mask = (torch.arange(length, device=device)[None] < lengths[:, None]).to(torch.int64)
    adv = randn(batch, dtype=torch.float32, device=device)
    with torch.no_grad():
        logp = reference_logprobs(hidden_states.double(), w.double(), ids, temperature=temperature).float()
    # Log-ratios on both sides of the clip range, none within 0.05 of its ends: a low-precision
    # log-prob that crossed an end would switch that token's gradient on or off.
    log_ratio = 0.3 * randn(batch, length, device=device)
    for end in (math.log(1 - clip[0]), math.log(1 + clip[1])):
        near = (log_ratio - end).abs() < 0.05
        log_ratio = torch.where(near, end + 0.05 * torch.sign(log_ratio - end + 1e-12), log_ratio)
    old = logp - log_ratio
    ref = logp + 0.2 * randn(batch, length, device=device)
    return hidden_states, w, ids, mask, adv, old, ref


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float64)))
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_and_gradients_match_float64(device, dtype, loss_type, beta):
    h, w, ids, mask, adv, old, ref = completions(4, 9, 16, 37, dtype, device, temperature=0.9)
    loss_fn = GRPOLoss(beta=beta, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type, temperature=0.9,
                       max_completion_length=12)
    loss = loss_fn(h, w, ids, mask, adv, old_logprobs=old, ref_logprobs=ref)
    gh, gw = torch.autograd.grad(loss, (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp64 = reference_logprobs(h64, w64, ids, temperature=0.9)
    ref_loss = reference_grpo(logp64, adv.double(), mask.double(), old.double(), ref.double(), beta, 0.2, 0.28,
                              loss_type, max_len=12)
    rh, rw = torch.autograd.grad(ref_loss, (h64, w64))
    tol = max(TOL[dtype], 1e-6)
    assert abs(loss.item() - ref_loss.item()) <= tol * max(1.0, abs(ref_loss.item()))
    assert rel_err(gh, rh) <= grad_tol(dtype) and rel_err(gw, rw) <= grad_tol(dtype)


def test_grpo_without_old_logprobs_is_the_advantage_weighted_logprob_gradient():
    """One update per generation (old = the current log-probabilities, detached): every ratio is 1, so
    the loss is -mean(A) and its gradient -A * grad(logp) per token, normalised."""
    h, w, ids, mask, adv, _, _ = completions(3, 6, 8, 19, torch.float64, "cpu")
    loss = GRPOLoss(loss_type="bnpo")(h, w, ids, mask, adv)
    logp = reference_logprobs(h, w, ids)
    expected = -(adv.double()[:, None] * logp * mask).sum() / mask.sum()
    g, r = torch.autograd.grad(loss, w)[0], torch.autograd.grad(expected, w)[0]
    assert rel_err(g, r) <= 1e-10
    assert abs(loss.item() + (adv.double()[:, None] * mask).sum().item() / mask.sum().item()) <= 1e-12


def test_accumulated_micro_batches_give_the_full_batch_gradient():
    """bnpo with num_items_in_batch = the whole batch's completion tokens: two micro-batches'
    gradients add up to one step on the whole batch."""
    h, w, ids, mask, adv, old, ref = completions(6, 7, 12, 29, torch.float64, "cpu")
    loss_fn = GRPOLoss(beta=0.04, loss_type="bnpo")
    full = loss_fn(h, w, ids, mask, adv, old_logprobs=old, ref_logprobs=ref)
    g_full = torch.autograd.grad(full, w)[0]
    total = mask.sum().item()
    g_acc = torch.zeros_like(w)
    for part in (slice(0, 2), slice(2, 6)):  # uneven micro-batches
        loss = loss_fn(h[part], w, ids[part], mask[part], adv[part], old_logprobs=old[part], ref_logprobs=ref[part],
                       num_items_in_batch=total)
        g_acc += torch.autograd.grad(loss, w)[0]
    assert rel_err(g_acc, g_full) <= 1e-12


def test_exports():
    assert fuseforge.linear_logprobs is linear_logprobs
    assert "GRPOLoss" in fuseforge.nn.__all__ and "linear_logprobs" in fuseforge.__all__
    assert "PreferenceLoss" in fuseforge.nn.__all__
    for name in ("CPOLoss", "ORPOLoss", "KTOLoss", "cpo_loss", "orpo_loss", "kto_loss", "kto_kl"):
        assert name in fuseforge.nn.__all__ and hasattr(fuseforge.nn, name)


def reference_preference(lp_c, m_c, lp_r, m_r, ref_c, ref_r, loss_type, beta, ls, gamma):
    """TRL's DPO / CPO-SimPO losses per pair, written out in float64."""
    mean = loss_type in ("ipo", "simpo")
    c = (lp_c * m_c).sum(-1) / (m_c.sum(-1) if mean else 1)
    r = (lp_r * m_r).sum(-1) / (m_r.sum(-1) if mean else 1)
    z = c - r - gamma / beta if loss_type == "simpo" else (c - ref_c) - (r - ref_r)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * z)
    return -(1 - ls) * torch.log(torch.sigmoid(beta * z)) - ls * torch.log(torch.sigmoid(-beta * z))


def preference_batch(pairs, len_c, len_r, hidden, vocab, dtype, device):
    def answers(length):
        h = randn(pairs, length, hidden, dtype=dtype, device=device, requires_grad=True)
        ids = torch.randint(0, vocab, (pairs, length), generator=generator(device), device=device)
        lengths = torch.randint(1, length + 1, (pairs,), generator=generator(device), device=device)
        return h, ids, (torch.arange(length, device=device)[None] < lengths[:, None]).to(torch.int64)
    w = randn(vocab, hidden, dtype=dtype, device=device, scale=0.5, requires_grad=True)
    return answers(len_c), answers(len_r), w


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float64)))
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "simpo"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_preference_losses_and_gradients_match_float64(device, dtype, loss_type, reduction):
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(5, 8, 6, 16, 41, dtype, device)
    mean = loss_type in ("ipo", "simpo")
    with torch.no_grad():  # a reference model near the policy
        ref_c = (reference_logprobs(hc, w, ic) * mc).sum(-1) / (mc.sum(-1) if mean else 1)
        ref_r = (reference_logprobs(hr, w, ir) * mr).sum(-1) / (mr.sum(-1) if mean else 1)
        ref_c = (ref_c + 0.5 * randn(5, dtype=torch.float64, device=device)).to(torch.float32)
        ref_r = (ref_r + 0.5 * randn(5, dtype=torch.float64, device=device)).to(torch.float32)
    refs = {} if loss_type == "simpo" else {"ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    loss_fn = PreferenceLoss(loss_type=loss_type, beta=0.5, label_smoothing=0.1, gamma=0.3, reduction=reduction)
    loss = loss_fn(hc, hr, w, ic, ir, mc, mr, **refs)
    weights = randn(max(loss.numel(), 1), dtype=torch.float64, device=device).reshape(loss.shape)
    grads = torch.autograd.grad((loss.double() * weights).sum(), (hc, hr, w))
    leaves64 = [t.detach().double().requires_grad_() for t in (hc, hr, w)]
    hc64, hr64, w64 = leaves64
    per_pair = reference_preference(reference_logprobs(hc64, w64, ic), mc.double(), reference_logprobs(hr64, w64, ir),
                                    mr.double(), ref_c.double(), ref_r.double(), loss_type, 0.5, 0.1, 0.3)
    ref_loss = per_pair if reduction == "none" else per_pair.mean()
    ref_grads = torch.autograd.grad((ref_loss * weights).sum(), leaves64)
    assert loss.shape == ref_loss.shape
    # float32 log-probabilities summed over an answer's tokens, then squared (IPO) or through a
    # hinge: a few float32 ulps of the pair's margin, which exceeds 1e-6 of the loss on some draws.
    assert rel_err(loss, ref_loss) <= max(TOL[dtype], 4e-6)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= grad_tol(dtype)


@pytest.mark.parametrize("one_pair_chunks", [False, True], ids=["chunk", "pair-chunks"])
def test_preference_micro_batches_give_the_full_batch_gradient(one_pair_chunks, monkeypatch):
    """num_items_in_batch normalises by the whole batch, also on the chunked path with several chunks
    inside a micro-batch."""
    if one_pair_chunks:
        monkeypatch.setattr(logprobs_module, "CHUNKED_DEVICES", ("cpu", "cuda"))
        monkeypatch.setattr(logprobs_module, "CHUNK_LOGIT_BYTES", 1)
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(6, 7, 5, 12, 23, torch.float64, "cpu")
    ref_c, ref_r = randn(6, dtype=torch.float64) - 20, randn(6, dtype=torch.float64) - 20
    loss_fn = PreferenceLoss(loss_type="sigmoid", beta=0.2)
    g_full = torch.autograd.grad(loss_fn(hc, hr, w, ic, ir, mc, mr, ref_c, ref_r), w)[0]
    g_acc = torch.zeros_like(w)
    for part in (slice(0, 2), slice(2, 6)):
        loss = loss_fn(hc[part], hr[part], w, ic[part], ir[part], mc[part], mr[part], ref_c[part], ref_r[part],
                       num_items_in_batch=6)
        g_acc += torch.autograd.grad(loss, w)[0]
    assert rel_err(g_acc, g_full) <= 1e-12


def test_preference_bad_arguments_raise_clear_errors():
    lp, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        preference_loss(lp, m, lp, m, loss_type="kto")
    with pytest.raises(ValueError, match="reduction must be one of"):
        preference_loss(lp, m, lp, m, loss_type="simpo", reduction="avg")
    with pytest.raises(ValueError, match="'sigmoid' needs ref_chosen_logps and ref_rejected_logps"):
        preference_loss(lp, m, lp, m)
    with pytest.raises(ValueError, match="the same number of pairs, got 2 and 3"):
        preference_loss(lp, m, torch.zeros(3, 3), torch.ones(3, 3), loss_type="simpo")
    with pytest.raises(ValueError, match=r"rejected_logprobs and rejected_mask must both have shape \(B, T\)"):
        preference_loss(lp, m, lp, torch.ones(2, 4), loss_type="simpo")


def reference_nll(h, w, ids, mask):
    """TRL's NLL term: the mean cross-entropy over the chosen answers' tokens, from float64 logits."""
    logits = h.double() @ w.double().T
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum"), mask.sum()


def reference_reference_free(method, lp_c, m_c, lp_r, m_r, beta, ls, gamma):
    """TRL's ORPO and CPO pair terms per pair, written out in float64 (ORPO's log(1 - p) as TRL writes it)."""
    mean = method in ("orpo", "cpo-ipo", "cpo-simpo")
    c = (lp_c * m_c).sum(-1) / (m_c.sum(-1) if mean else 1)
    r = (lp_r * m_r).sum(-1) / (m_r.sum(-1) if mean else 1)
    if method == "orpo":
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        return -beta * torch.log(torch.sigmoid(log_odds))
    z = c - r
    if method == "cpo-ipo":
        return (z - 1 / (2 * beta)) ** 2
    if method == "cpo-hinge":
        return torch.relu(1 - beta * z)
    if method == "cpo-simpo":
        z = z - gamma / beta
    return -(1 - ls) * torch.log(torch.sigmoid(beta * z)) - ls * torch.log(torch.sigmoid(-beta * z))


def reference_free_module(method, beta, alpha, reduction):
    if method == "orpo":
        return ORPOLoss(beta=beta, reduction=reduction)
    return CPOLoss(loss_type=method.split("-")[1], beta=beta, alpha=alpha, label_smoothing=0.1, gamma=0.3,
                   reduction=reduction)


REFERENCE_FREE = ["orpo", "cpo-sigmoid", "cpo-hinge", "cpo-ipo", "cpo-simpo"]


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float64)))
@pytest.mark.parametrize("method", REFERENCE_FREE)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cpo_orpo_losses_and_gradients_match_float64(device, dtype, method, reduction):
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(5, 8, 6, 16, 41, dtype, device)
    alpha = 1.0 if method == "orpo" else 0.7
    loss = reference_free_module(method, 0.5, alpha, reduction)(hc, hr, w, ic, ir, mc, mr)
    weights = randn(max(loss.numel(), 1), dtype=torch.float64, device=device).reshape(loss.shape)
    grads = torch.autograd.grad((loss.double() * weights).sum(), (hc, hr, w))
    leaves64 = [t.detach().double().requires_grad_() for t in (hc, hr, w)]
    hc64, hr64, w64 = leaves64
    pair = reference_reference_free(method, reference_logprobs(hc64, w64, ic), mc.double(),
                                    reference_logprobs(hr64, w64, ir), mr.double(), 0.5, 0.1, 0.3)
    if reduction == "none":  # each pair's own chosen tokens' summed NLL
        nll = torch.stack([reference_nll(hc64[i:i + 1], w64, ic[i:i + 1], mc[i:i + 1])[0] for i in range(5)])
        ref_loss = pair + alpha * nll
    else:
        nll, tokens = reference_nll(hc64, w64, ic, mc)
        ref_loss = (pair.mean() + alpha * nll / tokens if reduction == "mean" else pair.sum() + alpha * nll)
    ref_grads = torch.autograd.grad((ref_loss * weights).sum(), leaves64)
    assert loss.shape == ref_loss.shape
    assert rel_err(loss, ref_loss) <= max(TOL[dtype], 1e-6)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= grad_tol(dtype)


def test_simpo_is_cpo_without_its_nll_term():
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(4, 6, 7, 8, 19, torch.float64, "cpu")
    lp_c, lp_r = reference_logprobs(hc, w, ic), reference_logprobs(hr, w, ir)
    simpo = preference_loss(lp_c, mc, lp_r, mr, loss_type="simpo", beta=0.4, gamma=0.2, label_smoothing=0.05)
    cpo = cpo_loss(lp_c, mc, lp_r, mr, loss_type="simpo", beta=0.4, gamma=0.2, label_smoothing=0.05, alpha=0.0)
    assert rel_err(cpo, simpo) <= 1e-15
    with_nll = cpo_loss(lp_c, mc, lp_r, mr, loss_type="simpo", beta=0.4, gamma=0.2, label_smoothing=0.05, alpha=2.0)
    nll = -(lp_c * mc).sum() / mc.sum()
    assert rel_err(with_nll, simpo + 2.0 * nll) <= 1e-14


@pytest.mark.parametrize("method", REFERENCE_FREE)
def test_cpo_orpo_micro_batches_give_the_full_batch_gradient(method):
    """num_items_in_batch (pairs) and num_chosen_tokens (the NLL's tokens) of the whole batch: uneven
    micro-batches' gradients add up to the full batch's, both terms normalised as one batch."""
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(6, 7, 5, 12, 23, torch.float64, "cpu")
    loss_fn = reference_free_module(method, 0.3, 0.6, "mean")
    g_full = torch.autograd.grad(loss_fn(hc, hr, w, ic, ir, mc, mr), w)[0]
    g_acc = torch.zeros_like(w)
    for part in (slice(0, 1), slice(1, 6)):
        loss = loss_fn(hc[part], hr[part], w, ic[part], ir[part], mc[part], mr[part], num_items_in_batch=6,
                       num_chosen_tokens=mc.sum().item())
        g_acc += torch.autograd.grad(loss, w)[0]
    assert rel_err(g_acc, g_full) <= 1e-12


def reference_kto(lp, m, desirable, ref, kl, beta, wd, wu):
    """TRL's KTOTrainer losses, chosen (desirable) then rejected, written out in float64; returned in
    the batch's order."""
    r = (lp * m).sum(-1) - ref
    chosen = wd * (1 - torch.sigmoid(beta * (r - kl)))
    rejected = wu * (1 - torch.sigmoid(beta * (kl - r)))
    return torch.where(desirable, chosen, rejected)


def kto_batch(batch, length, hidden, vocab, dtype, device):
    h = randn(batch, length, hidden, dtype=dtype, device=device, requires_grad=True)
    w = randn(vocab, hidden, dtype=dtype, device=device, scale=0.5, requires_grad=True)
    ids = torch.randint(0, vocab, (batch, length), generator=generator(device), device=device)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator(device), device=device)
    mask = (torch.arange(length, device=device)[None] < lengths[:, None]).to(torch.int64)
    desirable = torch.arange(batch, device=device) % 3 != 1  # both kinds, unevenly
    with torch.no_grad():  # a reference model near the policy
        ref = (reference_logprobs(h, w, ids) * mask).sum(-1) + 2.0 * randn(batch, dtype=torch.float64, device=device)
    return h, w, ids, mask, desirable, ref.float()


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float64)))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_kl", [False, True], ids=["kl0", "kl"])
def test_kto_loss_and_gradients_match_float64(device, dtype, reduction, with_kl):
    h, w, ids, mask, desirable, ref = kto_batch(7, 8, 16, 37, dtype, device)
    # The reference point from mismatched completions (ids shifted by one completion), under no_grad.
    kl = None
    if with_kl:
        with torch.no_grad():
            policy_kl = (linear_logprobs(h, w, ids.roll(1, 0)) * mask.roll(1, 0)).sum(-1)
        kl = kto_kl(policy_kl, policy_kl - 1.5 - randn(7, device=device))
        assert kl.item() > 0 and not kl.requires_grad
    loss = KTOLoss(beta=0.3, desirable_weight=1.3, undesirable_weight=0.8, reduction=reduction)(
        h, w, ids, mask, desirable, ref, kl=kl)
    weights = randn(max(loss.numel(), 1), dtype=torch.float64, device=device).reshape(loss.shape)
    grads = torch.autograd.grad((loss.double() * weights).sum(), (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    per = reference_kto(reference_logprobs(h64, w64, ids), mask.double(), desirable, ref.double(),
                        0.0 if kl is None else kl.double(), 0.3, 1.3, 0.8)
    ref_loss = {"none": per, "sum": per.sum(), "mean": per.mean()}[reduction]
    ref_grads = torch.autograd.grad((ref_loss * weights).sum(), (h64, w64))
    assert loss.shape == ref_loss.shape
    assert rel_err(loss, ref_loss) <= max(TOL[dtype], 1e-6)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= grad_tol(dtype)


def test_kto_kl_is_the_clamped_detached_mean():
    p = randn(6, dtype=torch.float64, requires_grad=True)
    r = p.detach() - 0.25 + 0.1 * randn(6, dtype=torch.float64)
    kl = kto_kl(p, r)
    assert not kl.requires_grad and abs(kl.item() - (p - r).mean().item()) <= 1e-15
    assert kto_kl(p, p.detach() + 1.0).item() == 0.0  # a negative estimate is clamped to 0


def test_kto_micro_batches_give_the_full_batch_gradient():
    h, w, ids, mask, desirable, ref = kto_batch(6, 7, 12, 23, torch.float64, "cpu")
    loss_fn = KTOLoss(beta=0.2, desirable_weight=1.5)
    g_full = torch.autograd.grad(loss_fn(h, w, ids, mask, desirable, ref, kl=0.4), w)[0]
    g_acc = torch.zeros_like(w)
    for part in (slice(0, 4), slice(4, 6)):
        loss = loss_fn(h[part], w, ids[part], mask[part], desirable[part], ref[part], kl=0.4, num_items_in_batch=6)
        g_acc += torch.autograd.grad(loss, w)[0]
    assert rel_err(g_acc, g_full) <= 1e-12


@pytest.mark.parametrize("device", devices())
def test_reference_free_and_kto_losses_compile_fullgraph(device):
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(3, 5, 4, 16, 40, torch.float32, device)
    for module in (ORPOLoss(beta=0.2), CPOLoss(loss_type="simpo", alpha=0.5)):
        assert_compiles(lambda *a, m=module: m(*a), hc, hr, w, ic, ir, mc, mr, device=device)
    desirable = torch.tensor([True, False, True], device=device)
    ref = randn(3, device=device)
    assert_compiles(lambda h, w, i, m, d, r: KTOLoss(beta=0.2)(h, w, i, m, d, r, kl=torch.tensor(0.1, device=device)),
                    hc, w, ic, mc, desirable, ref, device=device)


def test_cpo_orpo_kto_bad_arguments_raise_clear_errors():
    lp, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"loss_type must be one of \('sigmoid', 'hinge', 'ipo', 'simpo'\)"):
        cpo_loss(lp, m, lp, m, loss_type="orpo")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        CPOLoss(loss_type="dpo")
    with pytest.raises(ValueError, match="reduction must be one of"):
        orpo_loss(lp, m, lp, m, reduction="avg")
    with pytest.raises(ValueError, match="reduction must be one of"):
        ORPOLoss(reduction="batchmean")
    with pytest.raises(ValueError, match="reduction must be one of"):
        KTOLoss(reduction="avg")
    with pytest.raises(ValueError, match="the same number of pairs, got 2 and 3"):
        orpo_loss(lp, m, torch.zeros(3, 3), torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"chosen_logprobs and chosen_mask must both have shape \(B, T\)"):
        cpo_loss(lp, torch.ones(2, 4), lp, m)
    desirable, ref = torch.tensor([True, False]), torch.zeros(2)
    with pytest.raises(ValueError, match=r"desirable must be a bool tensor of shape \(B,\) = \(2,\)"):
        kto_loss(lp, m, torch.tensor([1, 0]), ref)
    with pytest.raises(ValueError, match=r"desirable must be a bool tensor of shape \(B,\) = \(2,\)"):
        kto_loss(lp, m, torch.tensor([True]), ref)
    with pytest.raises(ValueError, match=r"ref_logps must have shape \(B,\) = \(2,\), got \(2, 3\)"):
        kto_loss(lp, m, desirable, lp)
    with pytest.raises(ValueError, match=r"logprobs and mask must both have shape \(B, T\)"):
        kto_loss(lp, torch.ones(2, 2), desirable, ref)
    with pytest.raises(ValueError, match=r"kl must be a scalar .*got shape \(2,\)"):
        kto_loss(lp, m, desirable, ref, kl=torch.zeros(2))
    with pytest.raises(ValueError, match=r"policy_kl_logps and ref_kl_logps must both have shape \(B,\)"):
        kto_kl(torch.zeros(3), torch.zeros(2))


# ---- the chunked path: reduced sequence losses with their gradients in the forward --------------
@pytest.fixture
def chunked_on_cpu(monkeypatch):
    """The chunked path on the CPU too (CUDA's by default), so its logic is tested everywhere."""
    monkeypatch.setattr(logprobs_module, "CHUNKED_DEVICES", ("cpu", "cuda"))


def chunked_cases(dtype, device, with_bias):
    """(name, module, arguments after the hidden states and head, ...) for every module on the chunked
    path: 5 pairs (answers of 8 and 6 tokens) / 7 completions, prompt tokens ignored."""
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(5, 8, 6, 16, 41, dtype, device)
    ic[:, 0] = -100  # a prompt token; every chosen answer keeps a token (ORPO's log odds need one)
    mc[:, 0] = 0
    mc[:, 1] = 1
    b = randn(41, dtype=dtype, device=device, scale=0.3, requires_grad=True) if with_bias else None
    ref_c, ref_r = randn(5, device=device) - 20, randn(5, device=device) - 20
    h, _, ids, mask, desirable, ref = kto_batch(7, 8, 16, 41, dtype, device)
    pair_args = (hc, hr, w, ic, ir, mc, mr)
    return b, [
        ("dpo", PreferenceLoss("sigmoid", beta=0.5, label_smoothing=0.1), pair_args, dict(
            ref_chosen_logps=ref_c, ref_rejected_logps=ref_r, bias=b)),
        ("ipo-sum", PreferenceLoss("ipo", beta=0.5, reduction="sum"), pair_args, dict(
            ref_chosen_logps=ref_c, ref_rejected_logps=ref_r, bias=b)),
        ("cpo", CPOLoss("sigmoid", beta=0.5, alpha=0.7), pair_args, dict(bias=b)),
        ("orpo", ORPOLoss(beta=0.3, reduction="sum"), pair_args, dict(bias=b)),
        ("kto", KTOLoss(beta=0.3, desirable_weight=1.3), (h, w, ids, mask, desirable, ref), dict(kl=0.2, bias=b)),
    ]


def leaves_of(args, b):
    return [t for t in (*args, b) if isinstance(t, torch.Tensor) and t.requires_grad]


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float64)))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_chunked_path_matches_the_per_token_path_and_float64(device, dtype, with_bias, monkeypatch, chunked_on_cpu):
    """Chunks of 2 groups (CHUNK_LOGIT_BYTES cut down: 3 chunks): the loss and every gradient against the
    per-token path's on float64 copies of the inputs, itself checked against float64 references above."""
    if dtype == torch.float16:
        pytest.skip("float16 takes the per-token path")
    b, cases = chunked_cases(dtype, device, with_bias)
    for name, module, args, kwargs in cases:
        rows = sum(t.shape[1] for t in args if isinstance(t, torch.Tensor) and t.dim() == 3)
        monkeypatch.setattr(logprobs_module, "CHUNK_LOGIT_BYTES", 2 * rows * 41 * torch.finfo(dtype).bits // 8)
        leaves = leaves_of(args, b)
        loss = module(*args, **kwargs)
        assert type(loss.grad_fn).__name__ == "_SequenceChunkedLossBackward", name
        grads = torch.autograd.grad(loss, leaves)
        # (on the CPU: float64 has no CUDA path)
        leaves64 = {id(t): t.detach().cpu().double().requires_grad_() for t in leaves}
        args64 = [leaves64.get(id(t), t.cpu() if isinstance(t, torch.Tensor) else t) for t in args]
        kwargs64 = {k: leaves64.get(id(v), v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        with monkeypatch.context() as m:
            m.setattr(posttraining_module, "sequence_loss_chunkable", lambda *a: False)
            ref_loss = module(*args64, **kwargs64)
        assert type(ref_loss.grad_fn).__name__ != "_SequenceChunkedLossBackward"
        ref_grads = torch.autograd.grad(ref_loss, [leaves64[id(t)] for t in leaves])
        # bf16: the chunk's logits are bf16 (the target's exact), one rounding of the other logits
        loss_tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: torch.finfo(dtype).eps / 2}[dtype]
        assert rel_err(loss, ref_loss) <= loss_tol, name
        for g, r in zip(grads, ref_grads):
            assert g.dtype == dtype
            assert rel_err(g, r) <= grad_tol(dtype), name


def test_chunked_path_scales_by_grad_output_and_refuses_a_second_backward(chunked_on_cpu):
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(3, 5, 4, 8, 17, torch.float64, "cpu")
    ref_c, ref_r = randn(3, dtype=torch.float64), randn(3, dtype=torch.float64)
    loss_fn = PreferenceLoss(beta=0.3)
    g1 = torch.autograd.grad(loss_fn(hc, hr, w, ic, ir, mc, mr, ref_c, ref_r), w)[0]
    loss = loss_fn(hc, hr, w, ic, ir, mc, mr, ref_c, ref_r)
    g3 = torch.autograd.grad(3.0 * loss, w, retain_graph=True)[0]
    assert rel_err(g3, 3.0 * g1) <= 1e-14
    with pytest.raises(RuntimeError, match="a second backward through the same graph is not supported"):
        torch.autograd.grad(loss, w)


def test_chunked_path_refuses_a_double_backward(chunked_on_cpu):
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(3, 5, 4, 8, 17, torch.float64, "cpu")
    ref_c, ref_r = randn(3, dtype=torch.float64), randn(3, dtype=torch.float64)
    loss_fn = PreferenceLoss(beta=0.3)
    assert type(loss_fn(hc, hr, w, ic, ir, mc, mr, ref_c, ref_r).grad_fn).__name__ == "_SequenceChunkedLossBackward"
    assert_double_backward_raises(lambda w_: loss_fn(hc, hr, w_, ic, ir, mc, mr, ref_c, ref_r), w,
                                  op_name="ops.logprobs.sequence_chunked_loss", functorch=False)
    # Under functorch (whose transforms the chunked path's gradients-in-forward cannot serve) the loss
    # takes the per-token path: the same gradient, and a grad of it refused by that path's op.
    def loss_of(w_):
        return loss_fn(hc, hr, w_, ic, ir, mc, mr, ref_c, ref_r)
    (plain,) = torch.autograd.grad(loss_of(w), w)
    assert_rel_close(torch.func.grad(loss_of)(w), plain, 1e-10, "torch.func.grad")
    with pytest.raises(RuntimeError, match="fuseforge.linear_cross_entropy: double backward is not supported"):
        torch.func.grad(lambda w_: (torch.func.grad(loss_of)(w_) ** 2).sum())(w)


def test_the_cpu_keeps_the_per_token_path():
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(3, 5, 4, 8, 17, torch.float32, "cpu")
    loss = PreferenceLoss("simpo")(hc, hr, w, ic, ir, mc, mr)
    assert type(loss.grad_fn).__name__ != "_SequenceChunkedLossBackward"


def test_chunked_path_is_not_taken_without_gradients_or_for_none(chunked_on_cpu):
    (hc, ic, mc), (hr, ir, mr), w = preference_batch(3, 5, 4, 8, 17, torch.float32, "cpu")
    loss = PreferenceLoss("simpo", reduction="none")(hc, hr, w, ic, ir, mc, mr)
    assert type(loss.grad_fn).__name__ != "_SequenceChunkedLossBackward"
    with torch.no_grad():
        loss = PreferenceLoss("simpo")(hc, hr, w, ic, ir, mc, mr)
    assert loss.grad_fn is None


# ---- the rows ops under it ----------------------------------------------------------------------
def rows_inputs(rows, hidden, vocab, dtype, device, with_bias=True):
    x = randn(rows, hidden, dtype=dtype, device=device)
    w = randn(vocab, hidden, dtype=dtype, device=device, scale=0.3)
    b = randn(vocab, dtype=dtype, device=device, scale=0.3) if with_bias else None
    t = torch.randint(0, vocab, (rows,), generator=generator(device), device=device)
    t[::3] = -100
    return x, w, b, t


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.float64)))
@pytest.mark.parametrize("vocab", [40, 43], ids=["vector", "scalar"])
@pytest.mark.parametrize("softcap", [0.0, 2.0], ids=["nocap", "softcap"])
def test_rows_ops_match_float64(device, dtype, vocab, softcap):
    """rows_stats (lse, -log p(target), the exact target logit) and rows_grad_ (the logit gradients in
    place) on logits x @ W^T in the input dtype, against float64 on the same rounded logits (the
    target's logit exact)."""
    x, w, b, t = rows_inputs(9, 24, vocab, dtype, device)
    logits = x @ w.T
    stats = ops.linear_cross_entropy_rows_stats(logits, x, w, t, b, -100, softcap)
    keep = (t != -100).cpu()
    zt = (x.double() @ w.double().T).gather(1, t.clamp_min(0)[:, None])[:, 0].cpu()
    z = logits.double().cpu().scatter(1, t.clamp_min(0)[:, None].cpu(), zt[:, None]) + b.double().cpu()
    zc = softcap * torch.tanh(z / softcap) if softcap else z
    lse = torch.logsumexp(zc, 1)
    nll = lse - zc.gather(1, t.clamp_min(0)[:, None].cpu())[:, 0]
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for got, want in zip(stats, (lse, nll, zt)):
        assert rel_err(got[keep], want[keep]) <= tol and (got[~keep] == 0).all()
    scale = randn(9, dtype=stats.dtype, device=device)
    ops.linear_cross_entropy_rows_grad_(logits, stats, t, b, scale, -100, softcap)
    p = torch.softmax(zc, 1)
    onehot = torch.nn.functional.one_hot(t.clamp_min(0).cpu(), vocab).double()
    dz = (p - onehot) * scale.double().cpu()[:, None]
    if softcap:
        dz = dz * (1 - torch.tanh(z / softcap) ** 2)
    dz[~keep] = 0
    # 16-bit: one rounding to the dtype; float32: a few ulps of exp, tanh and the softcap's product.
    tol = {torch.float64: 1e-12, torch.float32: 4 * torch.finfo(torch.float32).eps}.get(dtype, torch.finfo(dtype).eps)
    assert rel_err(logits, dz) <= tol
    assert (logits[~keep.to(device)] == 0).all()


@pytest.mark.parametrize("device", devices())
def test_rows_ops_opcheck(device):
    x, w, b, t = rows_inputs(6, 8, 12, torch.float32, device)
    logits = x @ w.T
    run_opcheck(ops.linear_cross_entropy_rows_stats, (logits, x, w, t, b, -100, 0.0))
    stats = ops.linear_cross_entropy_rows_stats(logits, x, w, t, b, -100, 0.0)
    run_opcheck(ops.linear_cross_entropy_rows_grad_, (logits, stats, t, b, randn(6, device=device), -100, 0.0))


def test_rows_ops_errors():
    x, w, b, t = rows_inputs(6, 8, 12, torch.float32, "cpu")
    logits = x @ w.T
    with pytest.raises(RuntimeError, match=r"logits must have shape \(6, 12\)"):
        ops.linear_cross_entropy_rows_stats(logits[:5], x, w, t, b, -100, 0.0)
    with pytest.raises(RuntimeError, match="logits must have the dtype of x"):
        ops.linear_cross_entropy_rows_stats(logits.double(), x, w, t, b, -100, 0.0)
    with pytest.raises(RuntimeError, match="logits must be contiguous"):
        ops.linear_cross_entropy_rows_stats(logits.t().contiguous().t(), x, w, t, b, -100, 0.0)
    with pytest.raises(RuntimeError, match="target must hold class indices in"):
        ops.linear_cross_entropy_rows_stats(logits, x, w, torch.full_like(t, 12), b, -100, 0.0)
    stats = ops.linear_cross_entropy_rows_stats(logits, x, w, t, b, -100, 0.0)
    scale = randn(6)
    with pytest.raises(RuntimeError, match=r"stats must be the \(3, 6\)"):
        ops.linear_cross_entropy_rows_grad_(logits, stats[:2], t, b, scale, -100, 0.0)
    with pytest.raises(RuntimeError, match=r"row_scale must be a \(6,\) Float tensor"):
        ops.linear_cross_entropy_rows_grad_(logits, stats, t, b, scale.double(), -100, 0.0)
    with pytest.raises(RuntimeError, match=r"target must be an int64 or int32 tensor of shape \(6,\)"):
        ops.linear_cross_entropy_rows_grad_(logits, stats, t[:5], b, scale, -100, 0.0)
    with pytest.raises(RuntimeError, match=r"bias must be a \(12,\) Float tensor"):
        ops.linear_cross_entropy_rows_grad_(logits, stats, t, b[:5], scale, -100, 0.0)
    with pytest.raises(RuntimeError, match="softcap must be a positive finite number"):
        ops.linear_cross_entropy_rows_grad_(logits, stats, t, b, scale, -100, -1.0)


@pytest.mark.parametrize("device", devices())
def test_rows_ops_empty(device):
    x, w, b, t = rows_inputs(0, 8, 12, torch.float32, device)
    logits = x @ w.T
    stats = ops.linear_cross_entropy_rows_stats(logits, x, w, t, b, -100, 0.0)
    assert stats.shape == (3, 0)
    ops.linear_cross_entropy_rows_grad_(logits, stats, t, b, randn(0, device=device), -100, 0.0)
