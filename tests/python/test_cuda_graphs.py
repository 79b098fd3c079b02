"""Every op's forward and backward captured in a CUDA graph and replayed on new inputs: a capture
fails on any host synchronization (a `.item()`, a blocking copy, a sync in a launcher), so these
tests hold the ops to "no host sync in a forward or a backward", and they show that the ops serve a
host-bound step through a CUDA graph (`torch.cuda.graph`). The AdamW step's capture is in
test_adamw*.py."""
from typing import Callable

import pytest
import torch

import fuseforge
from harness import TOL, assert_rel_close, randn, requires_cuda

pytestmark = requires_cuda

DEV = "cuda"
BF16 = torch.bfloat16


def run_captured(step: Callable, make_inputs: Callable, tol: float) -> None:
    """step(*inputs) -> the tensors to check (outputs and gradients), inputs from make_inputs(seed).

    Warms step up on a side stream, captures it, copies fresh inputs into the captured ones, poisons
    every captured output and replays: each output must equal an eager run on the fresh inputs."""
    static = make_inputs(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # lazy initialisation (occupancy caches, cuBLAS handles) outside the capture
            step(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static)
    fresh = make_inputs(1)
    with torch.no_grad():
        for s, f in zip(static, fresh):
            s.copy_(f)
        for t in captured:
            t.fill_(float("nan") if t.is_floating_point() else -1)
    graph.replay()
    want = step(*fresh)
    torch.cuda.synchronize()
    assert len(captured) == len(want)
    for i, (got, ref) in enumerate(zip(captured, want)):
        assert torch.isfinite(got).all(), f"output {i}: not written by the replay"
        assert_rel_close(got, ref, tol, f"output {i}")


def grads_of(outputs, leaves):
    """The outputs and the gradients of sum(out * g) for a fixed g of mixed signs (the same in every
    run; no generator, which a capture cannot construct)."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads_in = [torch.cos(torch.arange(o.numel(), device=DEV, dtype=torch.float32) * 0.37).reshape(o.shape).to(o.dtype)
                for o in outputs]
    # The outputs detached: poisoning one that is a view of a multi-output op would make autograd
    # refuse to read it.
    return (*(o.detach() for o in outputs), *torch.autograd.grad(outputs, leaves, grads_in))


def leaves(seed: int, *shapes, dtype=BF16, scale: float = 1.0):
    torch.manual_seed(seed)
    return [randn(*s, dtype=dtype, device=DEV, scale=scale, requires_grad=True) for s in shapes]


def test_rms_norm_and_layer_norm_with_residual():
    def make(seed):
        return leaves(seed, (4, 96, 512), (4, 96, 512), (512,), (512,))

    def step(x, r, w, b):
        out_rms, h = fuseforge.rms_norm(x, w, residual=r)
        out_ln, h2 = fuseforge.layer_norm(h, w, b, residual=r)
        return grads_of((out_rms, out_ln, h2), (x, r, w, b))

    run_captured(step, make, 1e-6)


def test_rotary_glu_and_add_mul_act():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device=DEV, dtype=torch.float32) / 64))

    def make(seed):
        q, k, gate_up, y = leaves(seed, (2, 8, 128, 64), (2, 2, 128, 64), (2, 128, 1024), (2, 128, 512))
        pos = torch.randint(0, 4096, (2, 128), device=DEV)
        return [q, k, gate_up, y, pos]

    def step(q, k, gate_up, y, pos):
        q_out, k_out = fuseforge.rotary(q, k, inv_freq, pos)
        act = fuseforge.glu(gate_up)  # the fused gate_up projection's output
        out = fuseforge.add_mul_act(act, y, alpha=0.5, activation="gelu")
        return grads_of((q_out, k_out, out), (q, k, gate_up, y))

    run_captured(step, make, 1e-6)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_attention_and_varlen(deterministic):
    cu, max_len = fuseforge.cu_seqlens_from_lengths([100, 37, 155], device=DEV)

    def make(seed):
        return leaves(seed, (2, 8, 192, 128), (2, 2, 192, 128), (2, 2, 192, 128), (292, 4, 64), (292, 2, 64),
                      (292, 2, 64))

    def step(q, k, v, qv, kv, vv):
        out = fuseforge.attention(q, k, v, causal=True, deterministic=deterministic)
        out_varlen = fuseforge.attention_varlen(qv, kv, vv, cu, cu, max_len, max_len, causal=True, window=(63, 0),
                                                deterministic=deterministic)
        return grads_of((out, out_varlen), (q, k, v, qv, kv, vv))

    # Without deterministic, dq's float32 atomics may add in another order than the eager run, and a
    # bf16 rounding of the sum flip.
    run_captured(step, make, 0.0 if deterministic else TOL[BF16])


@pytest.mark.parametrize("low_memory", [False, True], ids=["default", "low_memory"])
def test_linear_losses(low_memory):
    def make(seed):
        x, w, b, tx, tw = leaves(seed, (300, 256), (1000, 256), (1000,), (300, 128), (1000, 128), scale=0.5)
        tx, tw = tx.detach(), tw.detach()  # the teacher takes no gradient
        target = torch.randint(0, 1000, (300,), device=DEV)
        target[::7] = -100  # ignored tokens: the mean's count is taken on the device
        return [x, w, b, tx, tw, target]

    def step(x, w, b, tx, tw, target):
        loss = fuseforge.linear_cross_entropy(x, w, target, b, label_smoothing=0.1, z_loss=1e-4,
                                              low_memory=low_memory)
        logprobs, entropy = fuseforge.linear_logprobs(x, w, target, b, temperature=0.7, return_entropy=True)
        jsd = fuseforge.linear_jsd(x, w, tx, tw, target, beta=0.3)
        return grads_of((loss, logprobs, entropy, jsd), (x, w, b))

    run_captured(step, make, 1e-6)
