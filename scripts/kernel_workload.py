"""A few calls of one op at one case, for profilers that wrap a process (ncu, compute-sanitizer).
   python3 scripts/kernel_workload.py add_mul_act 16384x8192 fp32 gelu
   python3 scripts/kernel_workload.py adamw llama1b fp32|bf16-master
   python3 scripts/kernel_workload.py attention D128/S4096/full fuseforge|sdpa_flash|sdpa_cudnn
     (and cublas_gemm for attention_profiled: one matmul with the case's useful FLOPs)
   python3 scripts/kernel_workload.py attention docs/T32768/H16/D128/causal fuseforge|flex   (bench_attention_varlen)
   ncu --profile-from-start off python3 scripts/kernel_workload.py attention_profiled CASE IMPL [fwd|fwdbwd]
     (one forward, or one forward+backward: the default)
   python3 scripts/kernel_workload.py attention_kernels D128/S4096/full sdpa_cudnn   (the impl's
     longest forward and backward kernel: "fwd NAME", "bwd NAME")
   ncu --kernel-name regex:backward_kernel --launch-skip 2 --launch-count 1 python3 scripts/kernel_workload.py ...
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fuseforge  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CALLS = 3


def add_mul_act(shape, dtype, act):
    rows, cols = (int(v) for v in shape.split("x"))
    x, y = (torch.randn(rows, cols, device="cuda", dtype=DTYPES[dtype], requires_grad=True) for _ in range(2))
    b = torch.randn(cols, device="cuda", dtype=DTYPES[dtype], requires_grad=True)
    g = torch.randn(rows, cols, device="cuda", dtype=DTYPES[dtype])
    for _ in range(CALLS):
        out = fuseforge.add_mul_act(x, y, b, alpha=0.5, activation=act)
        torch.autograd.grad(out, (x, y, b), g)


def adamw(case, kind):
    from bench_adamw import llama1b_shapes, make_params
    shapes = llama1b_shapes() if case == "llama1b" else [(4096,)] * 5000
    params = make_params(shapes, torch.float32 if kind == "fp32" else torch.bfloat16)
    opt = fuseforge.optim.AdamW(params, lr=1e-3, master_weights=kind != "fp32")
    for _ in range(CALLS):
        opt.step()


def attention_case(case, impl):
    """q, k, v of one attention benchmark case (bench_attention.py's shapes) and a forward by one impl."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from bench_attention import case_shape
    b, hq, hk, s, d, causal = case_shape(case)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def forward():
        if impl == "fuseforge":
            return fuseforge.attention(q, k, v, causal=causal)
        with sdpa_kernel({"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hk)

    return (q, k, v), forward


def attention_call(case, impl, pass_="fwdbwd"):
    """A callable running one forward + backward (pass_ "fwdbwd") or one forward ("fwd") of an
    attention benchmark case by one impl (bench_attention_varlen's cases, "docs/...", "window...",
    "softcap...", through that script's setup)."""
    if impl == "cublas_gemm":
        return gemm_call(case, pass_)
    if not case.startswith(("D", "B")):
        import bench_attention_varlen
        bench_attention_varlen._selected_impls[:] = [impl]
        return next(b.fn for b in bench_attention_varlen.setup(case) if b.impl == impl and b.pass_ == pass_)
    qkv, forward = attention_case(case, impl)
    if pass_ == "fwd":
        return forward
    g = torch.randn_like(qkv[0])
    return lambda: torch.autograd.grad(forward(), qkv, g)


def gemm_call(case, pass_):
    """The GEMM ceiling of a fixed-length case: one bf16 cuBLAS matmul, 8192 x K by K x 8192, with the
    useful FLOPs bench_attention counts for the pass (K rounded to a multiple of 64). At ncu's locked
    clock its time over an attention impl's is the share of the GEMM's rate per cycle that impl runs at."""
    from bench_attention import attention_flops, case_shape
    b, hq, _, s, d, causal = case_shape(case)
    flops = attention_flops(b, hq, s, d, causal, pass_)
    m = n = 8192
    kdim = max(64, round(flops / (2 * m * n) / 64) * 64)
    a = torch.randn(m, kdim, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(kdim, n, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.mm(a, b)


def attention(case, impl):
    """Forward + backward of one attention benchmark case, by one impl."""
    fwdbwd = attention_call(case, impl)
    for _ in range(CALLS):
        fwdbwd()


def attention_profiled(case, impl, pass_="fwdbwd"):
    """attention()'s forward + backward (or forward only: pass_ "fwd"), warmed up, then once more inside
    cudaProfilerStart / Stop, for `ncu --profile-from-start off` to take every kernel of exactly one
    call (at ncu's locked clock: impls compared in cycles, whatever clock each would get at the power cap)."""
    call = attention_call(case, impl, pass_)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def attention_kernels(case, impl):
    """Prints "fwd NAME" and "bwd NAME": the kernel with the most device time in one forward and in
    one backward of the case (profiled after a warm-up call), for picking kernels to ncu."""
    from torch.profiler import ProfilerActivity, profile
    qkv, forward = attention_case(case, impl)
    torch.autograd.grad(forward(), qkv, torch.randn_like(qkv[0]))  # warm-up: cuDNN builds its graphs here

    def longest(fn):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            result = fn()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        return max(events, key=lambda e: e.self_device_time_total).key, result

    fwd_name, out = longest(forward)
    bwd_name, _ = longest(lambda: torch.autograd.grad(out, qkv, torch.randn_like(out)))
    print("fwd", fwd_name.replace(" ", "_"))
    print("bwd", bwd_name.replace(" ", "_"))


if __name__ == "__main__":
    op, *args = sys.argv[1:]
    {"add_mul_act": add_mul_act, "adamw": adamw, "attention": attention, "attention_profiled": attention_profiled,
     "attention_kernels": attention_kernels}[op](*args)
    torch.cuda.synchronize()
