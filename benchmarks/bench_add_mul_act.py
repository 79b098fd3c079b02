"""add_mul_act vs eager PyTorch and torch.compile on the issue's cases.

Bytes counted (the minimum a pass must move): fwd reads x and y and writes out (3 tensors);
fwdbwd (alpha = 0.5, grads for x, y and bias) adds the backward's read of grad_out and writes of
grad_x and grad_y (3 more); the bias, the relu bit mask and the saved state are not counted.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

import harness  # noqa: E402
from harness import Bench  # noqa: E402

import fuseforge  # noqa: E402

ALPHA = 0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EAGER_ACT = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu}

LARGE = [f"16384x8192/{d}/{a}" for d in ("fp32", "bf16") for a in ("relu", "gelu", "silu")]
SEED = [f"{b}x{w}/fp32/relu" for b, w in ((4, 4), (16, 8), (64, 16), (256, 32), (1024, 64), (4096, 128),
                                           (16384, 256), (65536, 512), (262144, 1024))]
CASES = LARGE + SEED
# --device cpu: the demo's MLP epilogue (batch 8 x seq 128 tokens, 512 features) and a larger one.
CPU_CASES = [f"{shape}/{d}/gelu" for shape in ("1024x512", "16384x2048") for d in ("fp32", "bf16")]


def eager_fn(activation):
    act = EAGER_ACT[activation]

    def fn(x, y, b):
        return act(x + ALPHA * y + b)
    return fn


def fuseforge_fn(activation):
    def fn(x, y, b):
        return fuseforge.add_mul_act(x, y, b, ALPHA, activation)
    return fn


def setup(case):
    # A fresh compile per case: the eager function's code object is shared by every case, and
    # dynamo would otherwise hit its recompile limit and fall back to eager.
    torch._dynamo.reset()
    shape, dtype_name, activation = case.split("/")
    rows, cols = (int(v) for v in shape.split("x"))
    dtype = DTYPES[dtype_name]
    dev = harness.bench_device()
    x = torch.randn(rows, cols, device=dev, dtype=dtype)
    y = torch.randn(rows, cols, device=dev, dtype=dtype)
    b = torch.randn(cols, device=dev, dtype=dtype)
    grad_out = torch.randn(rows, cols, device=dev, dtype=dtype)
    tensor_bytes = rows * cols * x.element_size()
    impls = {"fuseforge": fuseforge_fn(activation), "eager": eager_fn(activation),
             "compile": torch.compile(eager_fn(activation), dynamic=False)}
    passes = ["fwd"] if case in SEED else ["fwd", "fwdbwd"]

    # Accuracy of fuseforge against float64 (forward and every gradient).
    xg, yg, bg = (t.clone().requires_grad_() for t in (x, y, b))
    x64, y64, b64 = (t.double().requires_grad_() for t in (x, y, b))
    ref = eager_fn(activation)(x64, y64, b64)
    out = fuseforge_fn(activation)(xg, yg, bg)
    fwd_err = harness.rel_err(out, ref)
    grads = torch.autograd.grad(out, (xg, yg, bg), grad_out)
    ref_grads = torch.autograd.grad(ref, (x64, y64, b64), grad_out.double())
    bwd_err = max([fwd_err] + [harness.rel_err(g, r) for g, r in zip(grads, ref_grads)])
    del x64, y64, b64, ref, out, grads, ref_grads

    benches = []
    for pass_ in passes:
        for name, fn in impls.items():
            if pass_ == "fwd":
                run = (lambda fn=fn: fn(x, y, b))
                nbytes = 3 * tensor_bytes
            else:
                def run(fn=fn):
                    o = fn(xg, yg, bg)
                    return torch.autograd.grad(o, (xg, yg, bg), grad_out)
                nbytes = 6 * tensor_bytes
            err = (fwd_err if pass_ == "fwd" else bwd_err) if name == "fuseforge" else None
            benches.append(Bench(case, pass_, name, run, bytes=nbytes, rel_err=err))
    return benches


if __name__ == "__main__":
    harness.run("add_mul_act", CASES, setup, description=__doc__, cpu_cases=CPU_CASES)
