"""layer_norm vs eager PyTorch (torch.nn.functional.layer_norm, ATen's fused kernel), torch.compile
and Liger-Kernel's LayerNorm.

Cases `ROWSxHIDDEN/DTYPE/KIND`: DTYPE bf16 (x, weight, bias and out bf16) or fp32_bf16out (fp32 x and
parameters, bf16 out: the autocast recipe); KIND norm (out = norm(x)) or add_norm (h = x + residual,
out = norm(h), both returned: a pre-norm block's add and the next norm; eager, compile and Liger add
then norm). Liger's LayerNorm returns x's dtype, cast to bf16 after it as its caller would.

Bytes counted (the minimum a pass must move; the parameters are not counted): fwd reads x (and the
residual) and writes out (and h); fwdbwd adds the backward's reads of grad_out and h (and of h's own
gradient, add_norm) and its write of grad_input.

Three rounds (harness.time_interleaved), the median kept, as bench_rms_norm.py.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

import harness  # noqa: E402
from bench_rms_norm import norm_case  # noqa: E402  (the same case format, dtypes and bytes)

import fuseforge  # noqa: E402,F401  (loads the extension)
from fuseforge.ops.layer_norm import layer_norm  # noqa: E402

try:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
except ImportError:
    LigerLayerNormFunction = None

EPS = 1e-5

CASES = ([f"16384x{h}/{d}/norm" for h in (1024, 2048, 4096, 8192) for d in ("bf16", "fp32_bf16out")]
         + [f"16384x{h}/bf16/add_norm" for h in (2048, 4096)])
CPU_CASES = ["1024x512/bf16/add_norm", "1024x768/fp32_bf16out/norm"]


def eager_fn(out_dtype):
    def fn(x, w, b, res=None):
        h = res + x if res is not None else x
        out = torch.nn.functional.layer_norm(h, h.shape[-1:], w, b, EPS).to(out_dtype)
        return (out, h) if res is not None else out
    return fn


def fuseforge_fn(out_dtype):
    def fn(x, w, b, res=None):
        return layer_norm(x, w, b, EPS, res, out_dtype)
    return fn


def liger_fn(out_dtype):
    def fn(x, w, b, res=None):
        h = res + x if res is not None else x
        out = LigerLayerNormFunction.apply(h, w, b, EPS).to(out_dtype)
        return (out, h) if res is not None else out
    return fn


def setup(case):
    torch._dynamo.reset()
    c = norm_case(case, x_shift=1.0)  # rows whose mean is not 0: the centering matters
    x, res, grad_out, grad_h, out_dtype, with_residual = c.x, c.res, c.grad_out, c.grad_h, c.out_dtype, c.with_residual
    w = (1 + 0.1 * torch.randn(c.hidden, device=c.device)).to(c.dtype)
    b = (0.1 * torch.randn(c.hidden, device=c.device)).to(c.dtype)
    impls = {"fuseforge": fuseforge_fn(out_dtype), "eager": eager_fn(out_dtype),
             "compile": torch.compile(eager_fn(out_dtype), dynamic=False)}
    if LigerLayerNormFunction is not None and c.device == "cuda":
        impls["liger"] = liger_fn(out_dtype)

    leaves = [t.clone().requires_grad_() for t in (x, w, b) + ((res,) if with_residual else ())]
    grads_in = (grad_out, grad_h) if with_residual else (grad_out,)

    def reference(x, w, b, res=None):
        h = x + res if res is not None else x
        out = torch.nn.functional.layer_norm(h, h.shape[-1:], w, b, EPS)
        return (out, h) if res is not None else out
    errors = harness.accuracy(fuseforge_fn(out_dtype), leaves, grads_in, reference)
    return harness.forward_and_backward_benches(case, impls, (x, w, b) + ((res,) if with_residual else ()), leaves,
                                                grads_in, c.fwd_bytes, c.fwdbwd_bytes, errors)


if __name__ == "__main__":
    harness.run("layer_norm", CASES, setup, description=__doc__, cpu_cases=CPU_CASES, rounds=3)
