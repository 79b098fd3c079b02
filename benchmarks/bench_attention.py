"""Benchmark: fuseforge.attention vs PyTorch SDPA's flash, efficient and cuDNN backends.

Cases D<d>/S<s>/<mask>: bf16, B = 32768 / s, Hq = Hk = 2048 / d (B * S = 32768 tokens, hidden 2048).
Cases B<b>/Hq<h>/Hk<h>/S<s>/D<d>/<mask>: that shape, bf16. MODEL_CASES run after the grid, which has
no grouped-query heads:
- the attention of benchmarks/bench_e2e.py's 1.2B Llama (GQA 16 / 4, causal, S 2048) at batch 6, the
  shape where a training step meets the kernels;
- an 8B Llama's (32 / 8) at batch 1. Its backward has 128 dk/dv blocks of 4 heads for 132 SMs, the
  case FUSEFORGE_ATTENTION_BWD_HEAD_SPLIT is for.
FLOPs: the forward does 4 * B * H * S * S * D (two matmuls; half with a causal mask); the backward
2.5 x that, so fwdbwd counts 3.5 x the forward. rel_err (fwd rows): the output of batch 0, head 0
against an fp32 reference of that slice.

--device cpu (cases B<b>/Hq<h>/Hk<h>/S<s>/D<d>/<mask>/fp32): the demo GPT's attention (B8/Hq2/Hk1/S128/D64,
causal) and larger ones; impls fuseforge, sdpa (F.scaled_dot_product_attention, its CPU flash kernel),
eager (softmax(q k^T scale + mask) v) and compile (torch.compile of eager). rel_err: every impl's
output (fwd) and the largest of its output's and gradients' errors (fwdbwd) against float64. The
machine's other load shows up in CPU timings: `--rounds 5` interleaves the impls.

Default 3 rounds (harness.time_interleaved: every impl of a pass timed in turn, three times) rather
than one impl after another with fuseforge first and cuDNN last: the same code timed first and last
in one run differs by up to 7% (H100). Three, not two: a run's rounds differ by up to 12% for every
impl (the JSON's `ms_rounds`), and the median of two is the slower one. Two rounds take 64-76 s on
the H100.
`--settle-ms 600 --rounds 2` times each impl after 0.6 s of itself instead (harness._settle), at the
clock its own power allows under the H100's cap rather than the one the impls before it left: rows
move by up to ~10% either way (benchmarks/results/attention_settled_h100.md), so the README's table
names its regime.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Bench, bench_device, run  # noqa: E402

import fuseforge  # noqa: E402,F401
from fuseforge.ops.attention import attention  # noqa: E402

GRID_CASES = [f"D{d}/S{s}/{mask}" for d in (64, 128) for s in (1024, 4096, 16384) for mask in ("full", "causal")]
MODEL_CASES = ["B6/Hq16/Hk4/S2048/D128/causal", "B1/Hq32/Hk8/S2048/D128/causal"]
CASES = GRID_CASES + MODEL_CASES
CPU_CASES = ["B8/Hq2/Hk1/S128/D64/causal/fp32", "B2/Hq8/Hk8/S1024/D64/causal/fp32", "B2/Hq8/Hk8/S1024/D64/full/fp32",
             "B2/Hq8/Hk2/S1024/D64/causal/fp32"]


def parse(case: str):
    d, s, mask = case.split("/")
    return int(d[1:]), int(s[1:]), mask == "causal"


def gpu_shape(case: str):
    """(B, H, S, D, causal) of a grid case: B * S = 32768 tokens, H * D = 2048."""
    d, s, causal = parse(case)
    return 32768 // s, 2048 // d, s, d, causal


def case_shape(case: str):
    """(B, Hq, Hk, S, D, causal) of any case: a grid case (Hq = Hk) or B<b>/Hq<h>/Hk<h>/S<s>/D<d>/<mask>
    (a trailing /fp32, the CPU cases' dtype, is not part of the shape)."""
    if case.startswith("D"):
        b, h, s, d, causal = gpu_shape(case)
        return b, h, h, s, d, causal
    parts = case.split("/")
    b, hq, hk, s, d = (int(x[len(x.rstrip("0123456789")):]) for x in parts[:5])
    return b, hq, hk, s, d, parts[5] == "causal"


def attention_flops(b: int, h: int, s: int, d: int, causal: bool, pass_: str = "fwd") -> float:
    """The useful FLOPs the table counts: the forward's two matmuls (half with a causal mask); the
    backward 2.5 x that, so fwdbwd 3.5 x."""
    fwd = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return fwd * (3.5 if pass_ == "fwdbwd" else 1.0)


def reference_slice(q, k, v, causal):
    """fp32 attention of batch 0, head 0 (S x S scores fit for one head)."""
    q0, k0, v0 = (t[0, 0].float() for t in (q, k, v))
    s = (q0 @ k0.T) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[0]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v0


def rel_err(out, ref):
    return ((out[0, 0].float() - ref).norm() / ref.norm()).item()


def eager_attention(causal: bool):
    """The math version: softmax(q k^T scale [+ causal mask]) v, k and v repeated over GQA groups."""
    def fn(q, k, v):
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if causal:
            sq, sk = s.shape[-2:]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(sk - sq + 1)
            s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, -1) @ v
    return fn


def setup_cpu(case: str) -> list[Bench]:
    b, hq, hk, s, d, causal = case_shape(case)
    torch.manual_seed(0)
    q, k, v = torch.randn(b, hq, s, d), torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    grad = torch.randn(b, hq, s, d)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    fwd_flops, fwdbwd_flops = (attention_flops(b, hq, s, d, causal, pass_) for pass_ in ("fwd", "fwdbwd"))

    eager = eager_attention(causal)
    impls = {"fuseforge": lambda q_, k_, v_: attention(q_, k_, v_, causal=causal),
             "sdpa": lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal,
                                                                       enable_gqa=hq != hk),
             "eager": eager}
    torch._dynamo.reset()  # a fresh compile per case (the eager function's code is shared)
    try:
        compiled = torch.compile(eager_attention(causal), dynamic=False)
        o = compiled(qg, kg, vg)
        torch.autograd.grad(o, (qg, kg, vg), grad)
        impls["compile"] = compiled
    except Exception as e:  # noqa: BLE001  (no C++ compiler for inductor, ...): leave it out, say why
        print(f"  compile: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)

    # float64 reference output and gradients.
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    ref = eager(q64, k64, v64)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    ref = ref.detach()

    def err(x, r):
        return ((x.double() - r).norm() / r.norm()).item()

    benches = []
    for name, fn in impls.items():
        out = fn(qg, kg, vg)
        grads = torch.autograd.grad(out, (qg, kg, vg), grad)
        fwd_err = err(out, ref)
        bwd_err = max([fwd_err] + [err(g_, r) for g_, r in zip(grads, ref_grads)])
        del out, grads

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(q, k, v)

        def fwdbwd(fn=fn):
            o = fn(qg, kg, vg)
            return torch.autograd.grad(o, (qg, kg, vg), grad)

        benches.append(Bench(case, "fwd", name, fwd, flops=fwd_flops, rel_err=fwd_err))
        benches.append(Bench(case, "fwdbwd", name, fwdbwd, flops=fwdbwd_flops, rel_err=bwd_err))
    return benches


def setup(case: str) -> list[Bench]:
    if bench_device() == "cpu":
        return setup_cpu(case)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, hq, hk, s, d, causal = case_shape(case)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, hq, s, d, device=dev, dtype=dt)
    k, v = (torch.randn(b, hk, s, d, device=dev, dtype=dt) for _ in range(2))
    grad = torch.randn(b, hq, s, d, device=dev, dtype=dt)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    fwd_flops, fwdbwd_flops = (attention_flops(b, hq, s, d, causal, pass_) for pass_ in ("fwd", "fwdbwd"))
    ref = reference_slice(q, k, v, causal)

    impls = {"fuseforge": lambda q_, k_, v_: attention(q_, k_, v_, causal=causal)}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(q_, k_, v_, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=hq != hk)
        impls[name] = call

    benches = []
    for name, fn in impls.items():
        try:
            out = fn(q, k, v)
            torch.cuda.synchronize()
        except RuntimeError as e:  # a backend that does not take this case is left out
            print(f"  {name}: unavailable ({str(e).splitlines()[0][:120]})", flush=True)
            continue
        err = rel_err(out, ref)
        del out

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(q, k, v)

        def fwdbwd(fn=fn):
            o = fn(qg, kg, vg)
            return torch.autograd.grad(o, (qg, kg, vg), grad)

        benches.append(Bench(case, "fwd", name, fwd, flops=fwd_flops, rel_err=err))
        benches.append(Bench(case, "fwdbwd", name, fwdbwd, flops=fwdbwd_flops))
    return benches


if __name__ == "__main__":
    run("attention", CASES, setup, description=__doc__, cpu_cases=CPU_CASES, rounds=3)
