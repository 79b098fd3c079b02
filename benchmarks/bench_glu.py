"""glu (SwiGLU / GeGLU) vs eager PyTorch, torch.compile and Liger-Kernel on the issue's cases.

Cases are rows x I (8 x 2048 tokens; Llama 1B, Qwen2, Llama 8B widths and the hidden sizes
2048/4096/8192; GeGLU at Gemma's widths), gate and up separate tensors as Hugging Face's MLPs make
them. Bytes counted (the minimum a pass must move), in tensors of rows x I: fwd reads gate and up and
writes out (3); fwdbwd adds the backward's reads of grad_out, gate and up and writes of grad_gate and
grad_up (5 more, 8 in all). Liger's backward writes its gradients over its saved inputs (no new
tensors), so it gets its own copies of the inputs.

Three rounds (harness.time_interleaved: every impl of a pass timed in turn, three times; the median
kept): the forward rows are within 1% of the peers', below one timing's spread.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

import harness  # noqa: E402
from harness import Bench  # noqa: E402

from fuseforge.ops.glu import glu  # noqa: E402

try:
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
except ImportError:  # not installed: left out
    LigerGELUMulFunction = LigerSiLUMulFunction = None

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROWS = 16384
CASES = ([f"{ROWS}x{i}/bf16/silu" for i in (2048, 4096, 5632, 8192, 11008, 14336)]
         + [f"{ROWS}x{i}/bf16/gelu_tanh" for i in (8192, 9216)] + [f"{ROWS}x8192/fp32/silu"])
CPU_CASES = ["256x512/fp32/silu", "256x512/bf16/gelu_tanh", "2048x1408/bf16/silu"]


def eager_fn(activation):
    """As Hugging Face's LlamaMLP / GemmaMLP write it."""
    if activation == "silu":
        return lambda gate, up: F.silu(gate) * up
    return lambda gate, up: F.gelu(gate, approximate="tanh") * up


def fuseforge_fn(activation):
    return lambda gate, up: glu(gate, up, activation)


def liger_fn(activation):
    if LigerSiLUMulFunction is None:
        return None
    if activation == "silu":
        return LigerSiLUMulFunction.apply
    return LigerGELUMulFunction.apply


def setup(case):
    # A fresh compile per case: the eager function's code object is shared by every case, and
    # dynamo would otherwise hit its recompile limit and fall back to eager.
    torch._dynamo.reset()
    shape, dtype_name, activation = case.split("/")
    rows, cols = (int(v) for v in shape.split("x"))
    dtype = DTYPES[dtype_name]
    dev = harness.bench_device()
    gate = torch.randn(rows, cols, device=dev, dtype=dtype) * 2
    up = torch.randn(rows, cols, device=dev, dtype=dtype)
    grad_out = torch.randn(rows, cols, device=dev, dtype=dtype)
    tensor_bytes = rows * cols * gate.element_size()
    impls = {"fuseforge": fuseforge_fn(activation), "eager": eager_fn(activation),
             "compile": torch.compile(eager_fn(activation), dynamic=False)}
    if dev == "cuda" and liger_fn(activation) is not None:
        impls["liger"] = liger_fn(activation)

    # Accuracy of fuseforge against float64 (forward and both gradients).
    gate_g, up_g = (t.clone().requires_grad_() for t in (gate, up))
    gate64, up64 = (t.double().requires_grad_() for t in (gate, up))
    ref = eager_fn(activation)(gate64, up64)
    out = fuseforge_fn(activation)(gate_g, up_g)
    fwd_err = harness.rel_err(out, ref)
    grads = torch.autograd.grad(out, (gate_g, up_g), grad_out)
    ref_grads = torch.autograd.grad(ref, (gate64, up64), grad_out.double())
    bwd_err = max([fwd_err] + [harness.rel_err(g, r) for g, r in zip(grads, ref_grads)])
    del gate64, up64, ref, out, grads, ref_grads

    benches = []
    for pass_ in ("fwd", "fwdbwd"):
        for name, fn in impls.items():
            if pass_ == "fwd":
                run = (lambda fn=fn: fn(gate, up))
                nbytes = 3 * tensor_bytes
            else:
                g, u = (gate_g, up_g) if name != "liger" else (t.clone().requires_grad_() for t in (gate, up))

                def run(fn=fn, g=g, u=u):
                    o = fn(g, u)
                    return torch.autograd.grad(o, (g, u), grad_out)
                nbytes = 8 * tensor_bytes
            err = (fwd_err if pass_ == "fwd" else bwd_err) if name == "fuseforge" else None
            benches.append(Bench(case, pass_, name, run, bytes=nbytes, rel_err=err))
    return benches


if __name__ == "__main__":
    harness.run("glu", CASES, setup, description=__doc__, cpu_cases=CPU_CASES, rounds=3)
