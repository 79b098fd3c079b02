"""Benchmark: fuseforge.attention vs PyTorch SDPA's flash, efficient and cuDNN backends.

Cases D<d>/S<s>/<mask>: bf16, B = 32768 / s, Hq = Hk = 2048 / d (B * S = 32768 tokens, hidden 2048).
FLOPs: the forward does 4 * B * H * S * S * D (two matmuls; half with a causal mask); the backward
2.5 x that, so fwdbwd counts 3.5 x the forward. rel_err (fwd rows): the output of batch 0, head 0
against an fp32 reference of that slice.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Bench, run  # noqa: E402

import fuseforge  # noqa: E402,F401
from fuseforge.ops.attention import attention  # noqa: E402

CASES = [f"D{d}/S{s}/{mask}" for d in (64, 128) for s in (1024, 4096, 16384) for mask in ("full", "causal")]


def parse(case: str):
    d, s, mask = case.split("/")
    return int(d[1:]), int(s[1:]), mask == "causal"


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


def setup(case: str) -> list[Bench]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d, s, causal = parse(case)
    b, h = 32768 // s, 2048 // d
    dev, dt = "cuda", torch.bfloat16
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dt) for _ in range(3))
    grad = torch.randn(b, h, s, d, device=dev, dtype=dt)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    fwd_flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    ref = reference_slice(q, k, v, causal)

    impls = {"fuseforge": lambda q_, k_, v_: attention(q_, k_, v_, causal=causal)}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(q_, k_, v_, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
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
        benches.append(Bench(case, "fwdbwd", name, fwdbwd, flops=3.5 * fwd_flops))
    return benches


if __name__ == "__main__":
    run("attention", CASES, setup, description=__doc__)
