"""linear_cross_entropy (lm_head + cross-entropy) vs eager PyTorch, torch.compile, Liger and Cut
Cross-Entropy on the issue's cases.

Case "NxHxV/bf16": x = randn(N, H) * 0.5, weight = randn(V, H) * 0.02, every 7th target ignored,
reduction mean. "/lowmem": fuseforge's low-memory strategy (in the sweep, "fuseforge_lowmem"). "/peaky": x leans towards its target's
weight row so that the target has probability ~0.99 (accuracy on a confident model).
Passes: fwd = the loss under torch.no_grad(); fwdbwd = the loss and grad_x, grad_weight (the
gradients are outputs: peak_extra_mib includes them).
TFLOPs counts the matrix products only: 2NHV for fwd, 6NHV for fwdbwd.
rel_err = max(||grad_x - ref||, ||grad_w - ref||) / ||ref|| against a float64 reference computed from
the same bf16 inputs; loss_rel_err the same for the loss. Peers run with their defaults (Liger:
bf16 weight-gradient accumulation; CCE: gradient filtering on).
The sweep's "compile" is torch.compile(dynamic=True) (one compile for every shape); the main case's
is dynamic=False.

--device cpu: the CPU cases (CPU_CASES, float32: the demo's shape and a larger one) against eager
and torch.compile (left out, with the reason printed, where inductor cannot build here); the same
passes, errors against float64 (rel_err of the gradients and loss_rel_err), wall-clock medians, and
peak extra memory as the growth of the peak resident set.
"""
import gc
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

import harness  # noqa: E402
from harness import Bench  # noqa: E402

import fuseforge  # noqa: E402,F401
from fuseforge.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402

try:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
except ImportError:  # not installed: left out
    liger_fused_linear_cross_entropy = None
try:
    from cut_cross_entropy import linear_cross_entropy as cce_linear_cross_entropy
except ImportError:
    cce_linear_cross_entropy = None

IGNORE = -100
MAIN = "8192x4096x128256/bf16"
CASES = [MAIN, MAIN + "/lowmem", MAIN + "/peaky"]
SWEEP = [f"{n}x4096x{v}/bf16" for n in (4096, 16384, 65536) for v in (32000, 128256, 256000)]
CASES += SWEEP
CPU_CASES = ["1024x128x256/fp32", "4096x1024x32000/fp32"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def eager_loss(x, w, t):
    return F.cross_entropy((x @ w.T).float(), t, ignore_index=IGNORE)


_compiled_static = torch.compile(eager_loss, dynamic=False)
_compiled_dynamic = torch.compile(eager_loss, dynamic=True)


def make_inputs(n, h, v, peaky, seed=0, device="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    w = torch.randn(v, h, device=device, generator=g) * 0.02
    t = torch.randint(0, v, (n,), device=device, generator=g)
    x = torch.randn(n, h, device=device, generator=g) * 0.5
    if peaky:
        wt = w[t]
        x = 0.1 * x + 14.0 * wt / wt.square().sum(1, keepdim=True)
        del wt
    t[::7] = IGNORE
    return x.to(dtype), w.to(dtype), t


def fp64_reference(x, w, t, row_chunk=1024):
    """Loss, grad_x, grad_w of the mean loss in float64 from the given inputs (fp64 GEMMs on x's device)."""
    xd, wd = x.double(), w.double()
    valid = t != IGNORE
    count = valid.sum().clamp_min(1).double()
    gx = torch.empty_like(xd)
    gw = torch.zeros_like(wd)
    loss = torch.zeros((), dtype=torch.float64, device=x.device)
    for r0 in range(0, x.shape[0], row_chunk):
        z = xd[r0:r0 + row_chunk] @ wd.T
        vc = valid[r0:r0 + row_chunk]
        tcl = t[r0:r0 + row_chunk].clamp_min(0)
        lse = torch.logsumexp(z, 1)
        loss += ((lse - z.gather(1, tcl[:, None])[:, 0]) * vc).sum()
        z.sub_(lse[:, None]).exp_()
        z.scatter_add_(1, tcl[:, None], -torch.ones_like(z[:, :1]))
        z.mul_((vc.double() / count)[:, None])
        gx[r0:r0 + row_chunk] = z @ wd
        gw.addmm_(z.T, xd[r0:r0 + row_chunk])
        del z
    del xd, wd
    return loss / count, gx, gw


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _cpu_compile_reason():
    """Why torch.compile cannot run on the CPU here, or None when it can (inductor needs a C++ compiler)."""
    try:
        fn = torch.compile(lambda a: (a * 2).sum())
        fn(torch.ones(4))
        return None
    except Exception as e:  # noqa: BLE001  (any failure to build leaves compile out)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def cpu_impls():
    impls = {"fuseforge": lambda x, w, t: linear_cross_entropy(x, w, t, ignore_index=IGNORE), "eager": eager_loss}
    reason = _cpu_compile_reason()
    if reason is None:
        impls["compile"] = _compiled_static
    else:
        harness.log(f"    compile left out: torch.compile cannot build on this CPU machine ({reason})")
    return impls


def impls_for(case):
    if harness.bench_device() == "cpu":
        return cpu_impls()
    low = case.endswith("/lowmem")
    sweep = case in SWEEP
    impls = {"fuseforge": lambda x, w, t: linear_cross_entropy(x, w, t, ignore_index=IGNORE, low_memory=low)}
    if sweep:  # both strategies over the sweep (the low-memory one is the one to set against CCE)
        impls["fuseforge_lowmem"] = lambda x, w, t: linear_cross_entropy(x, w, t, ignore_index=IGNORE, low_memory=True)
    if low:
        if cce_linear_cross_entropy is not None:
            impls["cce"] = lambda x, w, t: cce_linear_cross_entropy(x, w, t, ignore_index=IGNORE)
        return impls
    impls["eager"] = eager_loss
    impls["compile"] = _compiled_dynamic if sweep else _compiled_static
    if liger_fused_linear_cross_entropy is not None:
        impls["liger"] = lambda x, w, t: liger_fused_linear_cross_entropy(x, w, t, ignore_index=IGNORE)
    if cce_linear_cross_entropy is not None:
        impls["cce"] = lambda x, w, t: cce_linear_cross_entropy(x, w, t, ignore_index=IGNORE)
    return impls


def setup(case):
    parts = case.split("/")
    n, h, v = (int(s) for s in parts[0].split("x"))
    peaky = "peaky" in parts
    device = harness.bench_device()
    dtype = DTYPES[parts[1]] if len(parts) > 1 and parts[1] in DTYPES else torch.bfloat16
    x, w, t = make_inputs(n, h, v, peaky, device=device, dtype=dtype)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    impls = impls_for(case)
    sweep = case in SWEEP
    errors = {}
    if not sweep:  # accuracy of every impl against the float64 reference
        ref_loss, ref_gx, ref_gw = fp64_reference(x, w, t)
        for name, fn in impls.items():
            try:
                loss = fn(xg, wg, t)
                gx, gw = torch.autograd.grad(loss, (xg, wg))
                errors[name] = {"rel_err": max(rel(gx, ref_gx), rel(gw, ref_gw)),
                                "grad_x_rel_err": rel(gx, ref_gx), "grad_w_rel_err": rel(gw, ref_gw),
                                "loss_rel_err": rel(loss.detach(), ref_loss)}
                harness.log(f"    accuracy {name}: " + " ".join(f"{k}={val:.3g}" for k, val in errors[name].items()))
                del loss, gx, gw
            except torch.cuda.OutOfMemoryError:
                errors[name] = {}
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        del ref_gx, ref_gw
    passes = ["fwdbwd"] if (sweep or peaky) else ["fwd", "fwdbwd"]
    flops = {"fwd": 2.0 * n * h * v, "fwdbwd": 6.0 * n * h * v}
    benches = []
    for pass_ in passes:
        for name, fn in impls.items():
            if pass_ == "fwd":
                def run(fn=fn):
                    with torch.no_grad():
                        return fn(x, w, t)
            else:
                def run(fn=fn):
                    loss = fn(xg, wg, t)
                    return torch.autograd.grad(loss, (xg, wg))
            e = errors.get(name, {})
            extra = {k: round(val, 7) for k, val in e.items() if k != "rel_err"} if pass_ == "fwdbwd" else {}
            benches.append(Bench(case, pass_, name, run, flops=flops[pass_],
                                 rel_err=e.get("rel_err") if pass_ == "fwdbwd" else None, extra=extra))
    return benches


def plot_sweep(result: dict, path: str) -> bool:
    """Time and peak extra memory of every impl over the sweep's N, one panel pair per V."""
    rows = [r for r in result["rows"] if r["case"] in SWEEP and r["pass"] == "fwdbwd"]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs = sorted({int(r["case"].split("/")[0].split("x")[2]) for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(2, len(vocabs), figsize=(4.2 * len(vocabs), 7), squeeze=False)
    for j, v in enumerate(vocabs):
        for impl in impls:
            pts = sorted((int(r["case"].split("x")[0]), r.get("ms"), r.get("peak_extra_mib")) for r in rows
                         if r["impl"] == impl and r["case"].split("/")[0].endswith(f"x{v}"))
            pts = [p for p in pts if p[1]]
            if pts:
                axes[0, j].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=impl)
                axes[1, j].plot([p[0] for p in pts], [p[2] / 1024 for p in pts], "o-", label=impl)
        axes[0, j].set_title(f"V = {v}, H = 4096, bf16, fwd+bwd", fontsize=9)
        for ax, label in ((axes[0, j], "ms"), (axes[1, j], "peak extra GiB (incl. gradients)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (tokens)")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
    fig.suptitle(f"linear_cross_entropy sweep ({result['gpu']}; missing points: out of memory)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    # Without --cases: the three cases (~1.5 min). The sweep takes ~6 min more:
    #   --cases 4096x4096,16384x4096,65536x4096   (or both: --cases 4096x)
    # --device cpu: every CPU case (a few minutes on 2 cores).
    argv = sys.argv[1:]
    cpu = "--device=cpu" in argv or any(a == "--device" and argv[i + 1:i + 2] == ["cpu"] for i, a in enumerate(argv))
    if not cpu and not torch.cuda.is_available():
        sys.exit("bench_linear_cross_entropy needs a CUDA GPU (or --device cpu)")
    if not cpu and not any(a == "--cases" or a.startswith("--cases=") for a in argv):
        argv += ["--cases", MAIN]
    # 5 rounds: the impls of a pass are timed in turn, 5 times (harness.time_interleaved). Each
    # fwd+bwd is ~40 ms of GEMMs at the GPU's power limit; timed one impl after another, drifts of
    # clocks and temperature would fall on whichever impl came last.
    out = harness.run("linear_cross_entropy", CASES, setup, argv=argv, description=__doc__, rounds=5,
                      cpu_cases=CPU_CASES)
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else harness.RESULTS_DIR
    try:
        if plot_sweep(out, os.path.join(out_dir, "linear_cross_entropy_sweep.png")):
            harness.log("wrote linear_cross_entropy_sweep.png")
    except ImportError:
        harness.log("matplotlib missing: no sweep plot")
