"""rotary (rope of q and k, cos/sin computed in the kernel) vs Hugging Face's eager code,
torch.compile of it and Liger-Kernel's rope.

Cases: batch 8 x sequence 2048, heads (Hq x Hk x D) of Llama 3.2 1B (hidden 2048), Llama 3 8B
(4096), Llama 3 70B (8192), Gemma 2 (D = 256) and Qwen2 (16 x 2); bf16, and 8B in fp32. q and k
are the projections' views (B, S, H, D) -> (B, H, S, D), as in the model; position_ids (B, S).

Impls: `eager` is Hugging Face's LlamaRotaryEmbedding.forward (cos/sin from position_ids and
inv_freq) followed by apply_rotary_pos_emb; `compile` is torch.compile of that; `liger` is
Liger-Kernel's LigerRopeFunction, which gets cos/sin precomputed (a model computes them once per
forward for all layers, so their cost is left out of liger's time; it rotates q and k in place).

Bytes counted (the minimum a pass must move): fwd reads q and k and writes q_out and k_out
(2 x (q + k) bytes); fwdbwd adds the backward's read of grad_q_out, grad_k_out and writes of
grad_q, grad_k (4 x (q + k) bytes). position_ids, inv_freq and cos/sin are not counted.

Three rounds (harness.time_interleaved: every impl of a pass timed in turn, three times; the median
kept): one impl's forward, timed once, moved by 5-30% between runs (Liger's 8B and Gemma 2 rows).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

import harness  # noqa: E402
from harness import Bench  # noqa: E402

import fuseforge  # noqa: E402,F401
from fuseforge.ops.rotary import rotary  # noqa: E402

try:
    from liger_kernel.ops.rope import LigerRopeFunction
except ImportError:  # not installed: left out
    LigerRopeFunction = None

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BASE = 500000.0
SHAPES = ["16x4x128", "32x8x128", "64x8x128", "8x4x256", "16x2x128"]  # Hq x Hk x D
CASES = [f"8x2048/{s}/bf16" for s in SHAPES] + ["8x2048/32x8x128/fp32"]
CPU_CASES = ["2x256/8x2x64/fp32", "2x256/8x2x64/bf16"]


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_cos_sin(inv_freq, position_ids, dtype, attention_scaling=1.0):
    """Hugging Face's LlamaRotaryEmbedding.forward."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def eager(q, k, inv_freq, position_ids):
    """Hugging Face's rotary embedding + apply_rotary_pos_emb."""
    cos, sin = hf_cos_sin(inv_freq, position_ids, q.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def fuseforge_fn(q, k, inv_freq, position_ids):
    return rotary(q, k, inv_freq, position_ids)


def reference64(x, inv_freq, position_ids):
    angle = position_ids[..., None].float() * inv_freq
    cos, sin = angle.double().cos()[:, None], angle.double().sin()[:, None]
    x = x.double()
    half = inv_freq.numel()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def setup(case):
    torch._dynamo.reset()  # a fresh compile per case (dynamo's recompile limit)
    tokens, heads, dtype_name = case.split("/")
    batch, seq = (int(v) for v in tokens.split("x"))
    heads_q, heads_k, head_dim = (int(v) for v in heads.split("x"))
    dtype = DTYPES[dtype_name]
    dev = harness.bench_device()
    inv_freq = 1.0 / (BASE ** (torch.arange(0, head_dim, 2, device=dev, dtype=torch.int64).float() / head_dim))
    # Packed rows: two sequences a row, positions restarting at 0 halfway.
    position_ids = (torch.arange(seq, device=dev) % (seq // 2 + 1))[None].expand(batch, seq).contiguous()

    def projection(heads, requires_grad=False):
        t = torch.randn(batch, seq, heads, head_dim, device=dev, dtype=dtype, requires_grad=requires_grad)
        return t, t.transpose(1, 2)

    q_leaf, q = projection(heads_q)
    k_leaf, k = projection(heads_k)
    qg_leaf, qg = projection(heads_q, True)
    kg_leaf, kg = projection(heads_k, True)
    grads = (projection(heads_q)[1], projection(heads_k)[1])  # the attention's gradients, (B, S, H, D) memory
    tensor_bytes = (q.numel() + k.numel()) * q.element_size()

    impls = {"fuseforge": fuseforge_fn, "eager": eager, "compile": torch.compile(eager, dynamic=False)}
    if LigerRopeFunction is not None and dev == "cuda":
        cos, sin = hf_cos_sin(inv_freq, position_ids, dtype)  # precomputed once per forward in a model
        impls["liger"] = lambda q, k, inv_freq, position_ids: LigerRopeFunction.apply(q, k, cos, sin)

    # Accuracy of fuseforge against float64 (forward, and the gradients of the fwdbwd pass).
    q_out, k_out = fuseforge_fn(qg, kg, inv_freq, position_ids)
    fwd_err = max(harness.rel_err(q_out, reference64(qg, inv_freq, position_ids)),
                  harness.rel_err(k_out, reference64(kg, inv_freq, position_ids)))
    dq, dk = torch.autograd.grad((q_out, k_out), (qg_leaf, kg_leaf), grads)
    q64, k64 = (t.detach().double().requires_grad_() for t in (qg, kg))
    refs = (reference64(q64, inv_freq, position_ids), reference64(k64, inv_freq, position_ids))
    rq, rk = torch.autograd.grad(refs, (q64, k64), tuple(g.double() for g in grads))
    bwd_err = max(fwd_err, harness.rel_err(dq, rq.transpose(1, 2)), harness.rel_err(dk, rk.transpose(1, 2)))
    del q_out, k_out, dq, dk, q64, k64, refs, rq, rk

    benches = []
    for pass_ in ("fwd", "fwdbwd"):
        for name, fn in impls.items():
            if pass_ == "fwd":
                def run(fn=fn):
                    with torch.no_grad():
                        return fn(q, k, inv_freq, position_ids)
                nbytes = 2 * tensor_bytes
            else:
                def run(fn=fn):
                    outs = fn(qg, kg, inv_freq, position_ids)
                    return torch.autograd.grad(outs, (qg_leaf, kg_leaf), grads)
                nbytes = 4 * tensor_bytes
            err = (fwd_err if pass_ == "fwd" else bwd_err) if name == "fuseforge" else None
            benches.append(Bench(case, pass_, name, run, bytes=nbytes, rel_err=err))
    return benches


if __name__ == "__main__":
    harness.run("rotary", CASES, setup, description=__doc__, cpu_cases=CPU_CASES, rounds=3)
