"""Post-training losses on the policy's last hidden states and output head (the logits never whole in
fuseforge): GRPO, DPO and distillation JSD against Liger-Kernel's chunked losses, eager PyTorch
(logits materialised) and torch.compile of the eager code.

Cases "<loss>/NxHxV/bf16": N tokens (completions of 1024 tokens; N / 1024 sequences), hidden H,
vocabulary V, bf16 hidden states and weights (x = randn * 0.5, weight = randn * 0.02). Every impl of
a case computes the same loss:

  grpo: TRL's GRPO loss, loss_type "bnpo", beta 0.04 (the k3 KL to precomputed reference
        log-probabilities), epsilon_low = epsilon_high = 0.2, temperature 1; precomputed old
        log-probabilities (the policy's + 0.1 randn, so some ratios clip); advantages randn (one a
        completion); each completion's last 0 to 511 tokens are padding. fuseforge:
        fuseforge.nn.GRPOLoss; liger: LigerFusedLinearGRPOLoss(loss_type="bnpo", beta=0.04,
        use_ref_model=True) given ref_per_token_logps and old_per_token_logps.
  dpo:  DPO's sigmoid loss, beta 0.1, sequence log-probabilities summed over answer tokens, a
        reference model (its own hidden states and output head) run under no_grad inside the timed
        call; N / 2048 pairs of 1024-token answers (chosen, then rejected), each answer's first 256
        tokens the prompt and its last 0 to 511 padding (both ignored). fuseforge:
        linear_logprobs of the reference, then fuseforge.nn.PreferenceLoss("sigmoid");
        liger: LigerFusedLinearDPOLoss(loss_type="sigmoid", use_ref_model=True,
        average_log_prob=False, compute_nll_loss=False) on the concatenated chosen + rejected inputs.
  jsd:  Liger's generalized JSD of student and teacher distributions, beta 0.5, temperature 1, mean
        over the tokens whose target is not ignored (every 7th ignored): beta KL(P_teacher || M) +
        (1 - beta) KL(P_student || M), M = beta P_teacher + (1 - beta) P_student. The teacher's hidden
        size equals the student's; its head is the student's plus noise and gets no gradient.
        fuseforge: fuseforge.linear_jsd; liger: LigerFusedLinearJSD(jsd_beta=0.5).
Pass fwdbwd: the loss and the gradients of the policy's (student's) hidden states and output head
(outputs: peak_extra_mib includes them; the reference / teacher tensors are inputs). TFLOPs counts
the matrix products: 6NHV for grpo, 8NHV for dpo and jsd (the reference / teacher forward adds 2NHV).
rel_err = max(||grad_x - ref||, ||grad_w - ref||) / ||ref|| against a float64 reference computed in
row chunks from the same bf16 inputs (grad_x_rel_err, grad_w_rel_err and loss_rel_err beside it),
on the N = 8192 cases. Peers run with their defaults (Liger accumulates the weight gradient in bf16).

--device cpu: CPU_CASES (float32, 64-token completions) for fuseforge, eager and torch.compile (left
out where inductor cannot build here), with the errors against float64 on every case.
"""
import gc
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

import harness  # noqa: E402
from harness import Bench  # noqa: E402
from bench_linear_cross_entropy import _cpu_compile_reason  # noqa: E402

import fuseforge  # noqa: E402
from fuseforge import linear_logprobs  # noqa: E402
from fuseforge.nn import GRPOLoss, PreferenceLoss  # noqa: E402

try:
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss, LigerFusedLinearGRPOLoss
    from liger_kernel.transformers import LigerFusedLinearJSD
except ImportError:  # not installed: left out
    LigerFusedLinearDPOLoss = LigerFusedLinearGRPOLoss = LigerFusedLinearJSD = None

IGNORE = -100
H = 4096
VOCABS = (128256, 151936)
TOKENS = (8192, 16384, 32768)
ACCURACY_TOKENS = 8192  # the cases whose rows carry the errors against float64
LOSSES = ("grpo", "dpo", "jsd")
CASES = [f"{loss}/{n}x{H}x{v}/bf16" for loss in LOSSES for n in TOKENS for v in VOCABS]
CPU_CASES = [f"{loss}/512x64x1000/fp32" for loss in LOSSES]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

GRPO = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="bnpo", temperature=1.0)
DPO_BETA = 0.1
JSD = dict(beta=0.5, temperature=1.0)


# ---------------------------------------------------------------------------------------------------
# The losses written out on materialised logits (eager, compile, and in float64 the reference)

def token_logprobs(x, w, ids, temperature=1.0):
    """log_softmax((x @ w.T) / temperature) at ids, float32 logits (0 where ids is ignored)."""
    logits = (x @ w.T).float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return logp * (ids != IGNORE)


def grpo_from_logprobs(logp, mask, adv, old, ref):
    """TRL's per-token GRPO loss (bnpo normalisation) from the policy's log-probabilities."""
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - GRPO["epsilon_low"], 1 + GRPO["epsilon_high"])
    per_token = -torch.minimum(ratio * adv[:, None], clipped * adv[:, None])
    per_token = per_token + GRPO["beta"] * (torch.exp(ref - logp) - (ref - logp) - 1)
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


def dpo_from_sequences(seq, ref_seq):
    """DPO's sigmoid loss from (2P,) sequence log-probabilities, chosen first."""
    p = seq.shape[0] // 2
    z = (seq[:p] - ref_seq[:p]) - (seq[p:] - ref_seq[p:])
    return -F.logsigmoid(DPO_BETA * z).mean()


def jsd_rows(student_logits, teacher_logits):
    """Liger's generalized JSD of each row (float32 or float64 logits, divided by the temperature)."""
    beta = JSD["beta"]
    ls, lt = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    log_m = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
    return beta * (lt.exp() * (lt - log_m)).sum(-1) + (1 - beta) * (ls.exp() * (ls - log_m)).sum(-1)


def eager_grpo(x, w, ids, mask, adv, old, ref):
    return grpo_from_logprobs(token_logprobs(x, w, ids, GRPO["temperature"]), mask, adv, old, ref)


def eager_dpo(x, w, ids, ref_x, ref_w):
    with torch.no_grad():
        ref_seq = token_logprobs(ref_x, ref_w, ids).sum(-1)
    return dpo_from_sequences(token_logprobs(x, w, ids).sum(-1), ref_seq)


def eager_jsd(sx, sw, tx, tw, target):
    with torch.no_grad():
        teacher = (tx @ tw.T).float() / JSD["temperature"]
    rows = jsd_rows((sx @ sw.T).float() / JSD["temperature"], teacher)
    keep = target != IGNORE
    return (rows * keep).sum() / keep.sum().clamp_min(1)


EAGER = {"grpo": eager_grpo, "dpo": eager_dpo, "jsd": eager_jsd}
COMPILED = {name: torch.compile(fn, dynamic=False) for name, fn in EAGER.items()}


# ---------------------------------------------------------------------------------------------------
# fuseforge and Liger on the same arguments

_grpo_loss = GRPOLoss(**GRPO)
_dpo_loss = PreferenceLoss("sigmoid", beta=DPO_BETA)


def fuseforge_grpo(x, w, ids, mask, adv, old, ref):
    return _grpo_loss(x, w, ids, mask, adv, old_logprobs=old, ref_logprobs=ref)


def fuseforge_dpo(x, w, ids, ref_x, ref_w):
    mask = ids != IGNORE
    with torch.no_grad():
        ref_seq = (linear_logprobs(ref_x, ref_w, ids, ignore_index=IGNORE) * mask).sum(-1)
    p = x.shape[0] // 2
    return _dpo_loss(x[:p], x[p:], w, ids[:p], ids[p:], mask[:p], mask[p:], ref_seq[:p], ref_seq[p:])


def fuseforge_jsd(sx, sw, tx, tw, target):
    return fuseforge.linear_jsd(sx, sw, tx, tw, target, ignore_index=IGNORE, reduction="mean", **JSD)


def liger_impls(loss):
    if loss == "grpo" and LigerFusedLinearGRPOLoss is not None:
        m = LigerFusedLinearGRPOLoss(beta=GRPO["beta"], epsilon_low=GRPO["epsilon_low"],
                                     epsilon_high=GRPO["epsilon_high"], loss_type=GRPO["loss_type"],
                                     temperature=GRPO["temperature"], use_ref_model=True)
        return lambda x, w, ids, mask, adv, old, ref: m(x, w, ids, mask, adv, ref_per_token_logps=ref,
                                                        old_per_token_logps=old)[0]
    if loss == "dpo" and LigerFusedLinearDPOLoss is not None:
        m = LigerFusedLinearDPOLoss(ignore_index=IGNORE, beta=DPO_BETA, loss_type="sigmoid", use_ref_model=True,
                                    average_log_prob=False, compute_nll_loss=False)
        return lambda x, w, ids, ref_x, ref_w: m(w, x, ids, ref_input=ref_x, ref_weight=ref_w)[0]
    if loss == "jsd" and LigerFusedLinearJSD is not None:
        m = LigerFusedLinearJSD(jsd_beta=JSD["beta"], ignore_index=IGNORE, temperature=JSD["temperature"])
        return lambda sx, sw, tx, tw, target: m(sx, sw, tx, tw, target)
    return None


def impls_for(loss):
    fuse = {"grpo": fuseforge_grpo, "dpo": fuseforge_dpo, "jsd": fuseforge_jsd}[loss]
    impls = {"fuseforge": fuse, "eager": EAGER[loss]}
    if harness.bench_device() == "cpu":
        reason = _cpu_compile_reason()
        if reason is None:
            impls["compile"] = COMPILED[loss]
        else:
            harness.log(f"    compile left out: torch.compile cannot build on this CPU machine ({reason})")
        return impls
    impls["compile"] = COMPILED[loss]
    liger = liger_impls(loss)
    if liger is not None:
        impls["liger"] = liger
    return impls


# ---------------------------------------------------------------------------------------------------
# Inputs

def make_inputs(loss, n, h, v, seq, device, dtype, seed=0):
    """(x, w, other args): the arguments of every impl of the case, x and w the differentiated ones."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    b = n // seq
    w = randn(v, h, scale=0.02)
    pad = torch.randint(0, seq // 2, (b,), device=device, generator=g)
    tail = torch.arange(seq, device=device)[None] >= (seq - pad)[:, None]  # each sequence's padding
    if loss == "jsd":
        x, tx = randn(n, h, scale=0.5), randn(n, h, scale=0.5)
        tw = (w.float() + 0.01 * torch.randn(v, h, device=device, generator=g)).to(dtype)
        target = torch.randint(0, v, (n,), device=device, generator=g)
        target[::7] = IGNORE
        return x, w, (tx, tw, target)
    x = randn(b, seq, h, scale=0.5)
    ids = torch.randint(0, v, (b, seq), device=device, generator=g)
    if loss == "grpo":
        mask = (~tail).to(torch.int64)
        adv = torch.randn(b, device=device, generator=g)
        with torch.no_grad():
            logp = linear_logprobs(x, w, ids)
        old = logp + 0.1 * torch.randn(b, seq, device=device, generator=g)
        ref = logp + 0.1 * torch.randn(b, seq, device=device, generator=g)
        return x, w, (ids, mask, adv, old, ref)
    ids[:, :seq // 4] = IGNORE  # the prompt
    ids[tail] = IGNORE
    ref_x = randn(b, seq, h, scale=0.5)
    ref_w = (w.float() + 0.002 * torch.randn(v, h, device=device, generator=g)).to(dtype)
    return x, w, (ids, ref_x, ref_w)


# ---------------------------------------------------------------------------------------------------
# float64 references, in row chunks (the float64 logits of a whole case would not fit)

def fp64_logprobs(x, w, ids, chunk):
    """float64 log-probabilities of ids (0 where ignored) and each row's log-sum-exp; x (N, H), ids (N,)."""
    wd = w.double()
    logp = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    lse = torch.empty_like(logp)
    for r0 in range(0, x.shape[0], chunk):
        z = x[r0:r0 + chunk].double() @ wd.T
        lse[r0:r0 + chunk] = torch.logsumexp(z, 1)
        logp[r0:r0 + chunk] = z.gather(1, ids[r0:r0 + chunk].clamp_min(0)[:, None])[:, 0] - lse[r0:r0 + chunk]
        del z
    return logp * (ids != IGNORE), lse


def fp64_token_loss(x, w, ids, loss_of_logprobs, chunk):
    """Loss, grad_x, grad_w in float64 of a loss of the per-token log-probabilities of ids under x @ w.T:
    the loss's gradient g by each log-probability first, then dL/dlogits = g (onehot - softmax) a chunk."""
    shape = ids.shape
    xf, idf = x.reshape(-1, x.shape[-1]), ids.reshape(-1)
    logp, lse = fp64_logprobs(xf, w, idf, chunk)
    logp = logp.view(shape).requires_grad_()
    loss = loss_of_logprobs(logp)
    g = torch.autograd.grad(loss, logp)[0].reshape(-1) * (idf != IGNORE)
    wd = w.double()
    gx = torch.empty(xf.shape, dtype=torch.float64, device=x.device)
    gw = torch.zeros_like(wd)
    for r0 in range(0, xf.shape[0], chunk):
        xc = xf[r0:r0 + chunk].double()
        dz = (xc @ wd.T).sub_(lse[r0:r0 + chunk, None]).exp_().mul_(-g[r0:r0 + chunk, None])
        dz.scatter_add_(1, idf[r0:r0 + chunk].clamp_min(0)[:, None], g[r0:r0 + chunk, None])
        gx[r0:r0 + chunk] = dz @ wd
        gw.addmm_(dz.T, xc)
        del dz, xc
    return loss.detach(), gx.view(x.shape), gw


def fp64_reference(loss, x, w, args, chunk):
    if loss == "grpo":
        ids, mask, adv, old, ref = args
        return fp64_token_loss(x, w, ids, lambda logp: grpo_from_logprobs(
            logp, mask.double(), adv.double(), old.double(), ref.double()), chunk)
    if loss == "dpo":
        ids, ref_x, ref_w = args
        ref_seq = fp64_logprobs(ref_x.reshape(-1, ref_x.shape[-1]), ref_w, ids.reshape(-1), chunk)[0]
        ref_seq = ref_seq.view(ids.shape).sum(-1)
        return fp64_token_loss(x, w, ids, lambda logp: dpo_from_sequences(logp.sum(-1), ref_seq), chunk)
    tx, tw, target = args
    keep = target != IGNORE
    count = keep.sum().clamp_min(1).double()
    wd, twd = w.double().requires_grad_(), tw.double()
    gx = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    gw = torch.zeros_like(wd)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for r0 in range(0, x.shape[0], chunk):
        xc = x[r0:r0 + chunk].double().requires_grad_()
        rows = jsd_rows(xc @ wd.T / JSD["temperature"], tx[r0:r0 + chunk].double() @ twd.T / JSD["temperature"])
        part = (rows * keep[r0:r0 + chunk]).sum() / count
        gxc, gwc = torch.autograd.grad(part, (xc, wd))
        gx[r0:r0 + chunk] = gxc
        gw += gwc
        total += part.detach()
        del rows, part, gxc, gwc
    return total, gx, gw


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def accuracy(loss, impls, x, w, args, device):
    """Each impl's errors against the float64 reference: {"rel_err", "grad_x_rel_err", ...}."""
    ref_loss, ref_gx, ref_gw = fp64_reference(loss, x, w, args, chunk=512 if device == "cuda" else 128)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    errors = {}
    for name, fn in impls.items():
        try:
            out = fn(xg, wg, *args)
            gx, gw = torch.autograd.grad(out, (xg, wg))
            errors[name] = {"rel_err": max(rel(gx, ref_gx), rel(gw, ref_gw)), "grad_x_rel_err": rel(gx, ref_gx),
                            "grad_w_rel_err": rel(gw, ref_gw), "loss_rel_err": rel(out.detach(), ref_loss)}
            harness.log(f"    accuracy {name}: " + " ".join(f"{k}={val:.3g}" for k, val in errors[name].items()))
            del out, gx, gw
        except torch.cuda.OutOfMemoryError:
            errors[name] = {}
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return errors


def setup(case):
    loss, shape, dt = case.split("/")
    n, h, v = (int(s) for s in shape.split("x"))
    device = harness.bench_device()
    seq = 64 if device == "cpu" else 1024
    x, w, args = make_inputs(loss, n, h, v, seq, device, DTYPES[dt])
    impls = impls_for(loss)
    errors = accuracy(loss, impls, x, w, args, device) if device == "cpu" or n == ACCURACY_TOKENS else {}
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    flops = (6.0 if loss == "grpo" else 8.0) * n * h * v
    benches = []
    for name, fn in impls.items():
        def run(fn=fn):
            return torch.autograd.grad(fn(xg, wg, *args), (xg, wg))
        e = errors.get(name, {})
        extra = {k: float(f"{val:.3g}") for k, val in e.items() if k != "rel_err"}
        benches.append(Bench(case, "fwdbwd", name, run, flops=flops, rel_err=e.get("rel_err"), extra=extra))
    return benches


if __name__ == "__main__":
    # Without --cases: every case (three losses x three token counts x two vocabularies); e.g.
    #   --cases grpo/ (one loss), --cases 8192x (the accuracy cases), --impls fuseforge,liger.
    # --device cpu: the tiny CPU cases (about two minutes on 2 cores, most of it compiling).
    argv = sys.argv[1:]
    cpu = "--device=cpu" in argv or any(a == "--device" and argv[i + 1:i + 2] == ["cpu"] for i, a in enumerate(argv))
    if not cpu and not torch.cuda.is_available():
        sys.exit("bench_posttraining needs a CUDA GPU (or --device cpu)")
    harness.run("posttraining", CASES, setup, argv=argv, description=__doc__, rounds=3, cpu_cases=CPU_CASES)
