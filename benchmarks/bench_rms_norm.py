"""rms_norm vs eager PyTorch (Hugging Face's LlamaRMSNorm code), torch.compile and Liger-Kernel.

Cases `ROWSxHIDDEN/DTYPE/KIND`: DTYPE bf16 (x, weight and out bf16) or fp32_bf16out (the autocast
recipe: fp32 x and weight, bf16 out); KIND norm (out = norm(x)) or add_norm (h = x + residual,
out = norm(h), both returned: a decoder layer's add and norm; eager and compile add then norm,
Liger runs its fused add + norm). 262144x128 is Qwen3's q/k norm (16384 tokens x 16 heads of 128).
Liger runs with in_place=False (its in-place backward overwrites grad_out, which the timing loop
reuses); with fp32_bf16out it returns fp32 and is cast to bf16, as a caller of it would.

Bytes counted (the minimum a pass must move; the weight is not counted): fwd reads x (and the
residual) and writes out (and h); fwdbwd adds the backward's reads of grad_out and h (and of h's
own gradient, add_norm) and its write of grad_input (one tensor: x's and the residual's gradient
are equal).

Three rounds (harness.time_interleaved: every impl of a pass timed in turn, three times; the median
kept): the peers' forwards, timed once, moved by 5-30% between runs.
"""
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

import harness  # noqa: E402

import fuseforge  # noqa: E402,F401  (loads the extension)
from fuseforge.ops.rms_norm import rms_norm  # noqa: E402

try:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
except ImportError:
    LigerRMSNormFunction = LigerFusedAddRMSNormFunction = None

EPS = 1e-6
DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "fp32_bf16out": (torch.float32, torch.bfloat16)}

CASES = ([f"16384x{h}/{d}/{k}" for h in (2048, 4096, 8192) for d in ("bf16", "fp32_bf16out")
          for k in ("norm", "add_norm")]
         + ["262144x128/bf16/norm"])
# --device cpu: a small model's hidden and a q/k norm.
CPU_CASES = ["1024x512/bf16/add_norm", "8192x128/bf16/norm"]


def eager_fn(out_dtype):
    def fn(x, w, res=None):
        # LlamaRMSNorm.forward, after the decoder layer's `residual + hidden_states`.
        h = res + x if res is not None else x
        input_dtype = h.dtype
        hs = h.to(torch.float32)
        variance = hs.pow(2).mean(-1, keepdim=True)
        hs = hs * torch.rsqrt(variance + EPS)
        out = (w * hs.to(input_dtype)).to(out_dtype)
        return (out, h) if res is not None else out
    return fn


def fuseforge_fn(out_dtype):
    def fn(x, w, res=None):
        return rms_norm(x, w, EPS, res, 0.0, out_dtype)
    return fn


def liger_fn(out_dtype):
    def fn(x, w, res=None):
        if res is not None:
            out, h = LigerFusedAddRMSNormFunction.apply(x, res, w, EPS, 0.0, "llama", False)
            return out.to(out_dtype), h
        return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False).to(out_dtype)
    return fn


def norm_case(case: str, x_shift: float = 0.0):
    """A norm benchmark's case `ROWSxHIDDEN/DTYPE/KIND` (bench_layer_norm.py's too): dtype and out_dtype,
    x (+ x_shift), the residual (add_norm) and the output gradients on the benchmark's device, and the
    bytes each pass must move."""
    shape, dtype_name, kind = case.split("/")
    rows, hidden = (int(v) for v in shape.split("x"))
    dtype, out_dtype = DTYPES[dtype_name]
    with_residual = kind == "add_norm"
    dev = harness.bench_device()
    elems = rows * hidden
    in_b, out_b = elems * dtype.itemsize, elems * out_dtype.itemsize
    fwd_bytes = in_b * (3 if with_residual else 1) + out_b
    return types.SimpleNamespace(
        hidden=hidden, dtype=dtype, out_dtype=out_dtype, device=dev, with_residual=with_residual,
        x=torch.randn(rows, hidden, device=dev, dtype=dtype) + x_shift,
        res=torch.randn(rows, hidden, device=dev, dtype=dtype) if with_residual else None,
        grad_out=torch.randn(rows, hidden, device=dev, dtype=out_dtype),
        grad_h=torch.randn(rows, hidden, device=dev, dtype=dtype) if with_residual else None,
        fwd_bytes=fwd_bytes, fwdbwd_bytes=fwd_bytes + out_b + in_b * (3 if with_residual else 2))


def setup(case):
    torch._dynamo.reset()  # a fresh compile per case (the eager code object is shared by every case)
    c = norm_case(case)
    x, res, grad_out, grad_h, out_dtype, with_residual = c.x, c.res, c.grad_out, c.grad_h, c.out_dtype, c.with_residual
    w = (1 + 0.1 * torch.randn(c.hidden, device=c.device)).to(c.dtype)
    impls = {"fuseforge": fuseforge_fn(out_dtype), "eager": eager_fn(out_dtype),
             "compile": torch.compile(eager_fn(out_dtype), dynamic=False)}
    if LigerRMSNormFunction is not None and c.device == "cuda":
        impls["liger"] = liger_fn(out_dtype)

    leaves = [t.clone().requires_grad_() for t in (x, w) + ((res,) if with_residual else ())]
    grads_in = (grad_out, grad_h) if with_residual else (grad_out,)

    def reference(x, w, res=None):
        h = x + res if res is not None else x
        out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w
        return (out, h) if res is not None else out
    errors = harness.accuracy(fuseforge_fn(out_dtype), leaves, grads_in, reference)
    return harness.forward_and_backward_benches(case, impls, (x, w) + ((res,) if with_residual else ()), leaves,
                                                grads_in, c.fwd_bytes, c.fwdbwd_bytes, errors)


if __name__ == "__main__":
    harness.run("rms_norm", CASES, setup, description=__doc__, cpu_cases=CPU_CASES, rounds=3)
