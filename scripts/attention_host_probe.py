"""GPU machine: the host (CPU) time of one attention call, forward + backward, against SDPA's cuDNN
backend, and where a timed call leaves the GPU idle waiting for the host.

A small call (an 8B Llama's attention at batch 1: ~0.35 ms of kernels) can be timed longer than its
kernels when the host issues them more slowly than the GPU runs them. This prints, per impl:
- host us a call: issuing N calls back to back (no synchronize), forward+backward and each alone;
- GPU ms a call: the same N calls queued behind a sleep, so the GPU never waits for the host;
- the torch.profiler CPU ops of one call, by self CPU time, and a chrome trace (--trace DIR).

    PYTHONPATH=python python3 scripts/attention_host_probe.py [--case B1/Hq32/Hk8/S2048/D128/causal]
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_attention  # noqa: E402
import fuseforge  # noqa: E402


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return 1e6 * (t1 - t0) / n


def gpu_ms(fn, n=100):
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # the host queues every call while the GPU sleeps
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="B1/Hq32/Hk8/S2048/D128/causal")
    ap.add_argument("--trace", default="", help="write one chrome trace a impl here")
    args = ap.parse_args()
    b, hq, hk, s, d, causal = bench_attention.case_shape(args.case)
    torch.manual_seed(0)
    mk = lambda h: torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(hq), mk(hk), mk(hk)
    g = torch.randn_like(q)
    scale = d ** -0.5

    def ff_fwd():
        return fuseforge.attention(q, k, v, causal=causal)

    def ff_fwdbwd():
        return torch.autograd.grad(ff_fwd(), (q, k, v), g)

    out, lse = torch.ops.fuseforge.attention_fwd(q, k, v, causal, scale, -1, -1, 0.0)

    def ff_bwd_op():  # the backward op alone, no autograd
        return torch.ops.fuseforge.attention_bwd(g, q, k, v, out, lse, causal, scale, False, -1, -1, 0.0)

    def cudnn_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hk)

    def cudnn_fwdbwd():
        return torch.autograd.grad(cudnn_fwd(), (q, k, v), g)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, commit {os.environ.get('FUSEFORGE_COMMIT', '?')}, "
          f"case {args.case}")
    fns = {"fuseforge fwdbwd": ff_fwdbwd, "fuseforge fwd": ff_fwd, "fuseforge bwd op": ff_bwd_op,
           "cudnn fwdbwd": cudnn_fwdbwd, "cudnn fwd": cudnn_fwd}
    for rnd in range(2):
        for name, fn in fns.items():
            print(f"  round {rnd}: {name:18s} host {host_us(fn):7.1f} us a call, GPU {gpu_ms(fn):.3f} ms a call")
    from torch.profiler import ProfilerActivity, profile
    for name, fn in (("fuseforge", ff_fwdbwd), ("cudnn", cudnn_fwdbwd)):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"== {name}: 10 calls, CPU ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace, f"host_{name}.json"))


if __name__ == "__main__":
    main()
