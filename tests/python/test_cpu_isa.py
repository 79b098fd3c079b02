"""The CPU kernels (add_mul_act, attention, linear_cross_entropy, AdamW, rms_norm, rotary, glu) are built once per ISA level (baseline, AVX2, AVX-512; csrc/common/cpu_isa.h) and
picked at run time from torch's CPU capability, which ATEN_CPU_CAPABILITY overrides. The other
test files run whichever build this machine picks; this one runs each build in a subprocess
(the choice is read once per process) on every op's CPU kernels against float64, and checks that
AdamW's update and rms_norm's forward and backward are the same bit for bit in every build."""
import os
import subprocess
import sys

import pytest
import torch

import fuseforge  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
LEVELS = ["default", "avx2", "avx512"]

# Runs in the subprocess: prints the capability torch reports, then one line per check.
CHECK = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import fuseforge
from fuseforge.optim import AdamW
from harness import rel_err, randn
print("capability", torch.backends.cpu.get_cpu_capability())
errs = {}
for dt, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3), (torch.float64, 1e-12)):
    for act in ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "identity"):
        x, y = randn(37, 301, dtype=dt, requires_grad=True), randn(37, 301, dtype=dt, requires_grad=True)
        b = randn(301, dtype=dt, requires_grad=True)
        g = randn(37, 301, dtype=dt)
        out = fuseforge.add_mul_act(x, y, b, 0.5, act)
        grads = torch.autograd.grad(out, (x, y, b), g)
        x64, y64, b64 = (t.detach().double().requires_grad_() for t in (x, y, b))
        f = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
             "sigmoid": torch.sigmoid, "identity": lambda z: z,
             "gelu_tanh": lambda z: torch.nn.functional.gelu(z, approximate="tanh")}[act]
        ref = f(x64 + 0.5 * y64 + b64)
        refs = torch.autograd.grad(ref, (x64, y64, b64), g.double())
        e = max([rel_err(out, ref)] + [rel_err(a, r) for a, r in zip(grads, refs)])
        assert e <= tol, (dt, act, e)
def attention_ref(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    return torch.softmax(s, -1) @ v
for dt, tol in ((torch.float32, 2e-6), (torch.float64, 1e-12)):
    for causal in (False, True):
        q = randn(2, 4, 70, 40, dtype=dt, requires_grad=True)
        k, v = randn(2, 2, 130, 40, dtype=dt, requires_grad=True), randn(2, 2, 130, 40, dtype=dt, requires_grad=True)
        g = randn(2, 4, 70, 40, dtype=dt)
        out = fuseforge.attention(q, k, v, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), g)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = attention_ref(q64, k64, v64, causal)
        refs = torch.autograd.grad(ref, (q64, k64, v64), g.double())
        e = max([rel_err(out, ref)] + [rel_err(a, r) for a, r in zip(grads, refs)])
        assert e <= tol, ("attention", dt, causal, e)
from fuseforge.ops.rms_norm import rms_norm
from fuseforge.ops.rotary import rotary
from fuseforge.ops.glu import glu
import torch.nn.functional as F
for dt, tol in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3), (torch.float64, 1e-12)):
    for offset, with_res in ((0.0, False), (1.0, True)):
        # 301 columns: whole tiles, whole vectors and a partial one; Gemma's offset with a residual.
        x = randn(5, 301, dtype=dt, requires_grad=True)
        res = randn(5, 301, dtype=dt, requires_grad=True) if with_res else None
        w = (randn(301, dtype=dt, scale=0.3) + (0.0 if offset else 1.0)).detach().requires_grad_()
        got = rms_norm(x, w, 1e-6, res, offset)
        outs = got if with_res else (got,)
        gs = tuple(randn(*o.shape, dtype=o.dtype) for o in outs)
        grads = torch.autograd.grad(outs, (x, w) + ((res,) if with_res else ()), gs)
        h64 = outs[1].detach().double() if with_res else x.detach().double()
        h64.requires_grad_()
        w64 = w.detach().double().requires_grad_()
        ref = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + w64)
        gh, gw = torch.autograd.grad(ref, (h64, w64), gs[0].double())
        if with_res:
            gh = gh + gs[1].double()
        refs = (gh, gw) + ((gh,) if with_res else ())
        e = max([rel_err(outs[0], ref)] + [rel_err(a, r) for a, r in zip(grads, refs)])
        assert e <= tol, ("rms_norm", dt, offset, e)
from test_rotary import reference as rotary_ref  # the float64 rope of test_rotary.py
# 18 frequencies (whole vectors and a partial one), 36 of 40 dims rotated.
inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 36, 2).float() / 36))
pos = torch.randint(0, 3000, (2, 33))
for dt, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3), (torch.float64, 1e-12)):
    for interleaved in (False, True):
        q = randn(2, 33, 4, 40, dtype=dt).transpose(1, 2).requires_grad_()
        k = randn(2, 2, 33, 40, dtype=dt, requires_grad=True)
        outs = rotary(q, k, inv_freq, pos, 0.85, interleaved)
        gs = tuple(randn(*o.shape, dtype=dt) for o in outs)
        grads = torch.autograd.grad(outs, (q, k), gs)
        q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
        refs = tuple(rotary_ref(t, inv_freq, pos, 0.85, interleaved) for t in (q64, k64))
        ref_grads = torch.autograd.grad(refs, (q64, k64), tuple(g.double() for g in gs))
        e = max([rel_err(a, r) for a, r in zip(outs + grads, refs + ref_grads)])
        assert e <= tol, ("rotary", dt, interleaved, e)
for dt, tol in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3), (torch.float64, 1e-12)):
    for act in ("silu", "gelu_tanh", "gelu"):
        f = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}[act]
        for fused in (False, True):
            gate = randn(7, 602 if fused else 301, dtype=dt, scale=2.0, requires_grad=True)
            up = None if fused else randn(7, 301, dtype=dt, requires_grad=True)
            inputs = (gate,) if fused else (gate, up)
            out = glu(gate, up, act)
            g = randn(7, 301, dtype=dt)
            grads = torch.autograd.grad(out, inputs, g)
            in64 = tuple(t.detach().double().requires_grad_() for t in inputs)
            g64, u64 = in64[0].chunk(2, -1) if fused else in64
            ref = f(g64) * u64
            ref_grads = torch.autograd.grad(ref, in64, g.double())
            e = max([rel_err(out, ref)] + [rel_err(a, r) for a, r in zip(grads, ref_grads)])
            assert e <= tol, ("glu", dt, act, fused, e)
# Inputs from integers: torch's own randn rounds differently in each of its CPU builds.
gen = torch.Generator().manual_seed(0)
def rand(shape):
    return torch.randint(-2**20, 2**20, shape, generator=gen).float() / 2**19
params = [torch.nn.Parameter(rand(s)) for s in ((1000,), (37, 3), (5,))]
params += [torch.nn.Parameter(rand((333,)).to(torch.bfloat16))]
opt = AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, master_weights=True)
for _ in range(3):
    for p in params:
        p.grad = rand(p.shape).to(p.dtype)
    opt.step()
blob = torch.cat([p.detach().float().reshape(-1) for p in params]
                 + [opt.state[p][k].reshape(-1) for p in params for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")])
print("adamw", blob.double().sum().item(), blob.view(torch.int32).long().sum().item())
# rms_norm sums a row in lanes fixed by the element index, whatever the vector width: the same bits.
parts = []
for dt, out_dt in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)):
    x = rand((9, 1000)).to(dt).requires_grad_()
    res = rand((9, 1000)).to(dt).requires_grad_()
    w = rand((1000,)).requires_grad_()
    out, h = rms_norm(x, w, 1e-6, res, 1.0, out_dt)
    grads = torch.autograd.grad((out, h), (x, w, res), (rand(out.shape).to(out_dt), rand(h.shape).to(dt)))
    parts += [t.detach().float().reshape(-1) for t in (out, h) + grads]
blob = torch.cat(parts)
print("rms_norm", blob.double().sum().item(), blob.view(torch.int32).long().sum().item())
"""


def run_level(level):
    env = dict(os.environ, ATEN_CPU_CAPABILITY=level, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHECK, HERE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    return lines


@pytest.fixture(scope="module")
def results():
    machine = torch.backends.cpu.get_cpu_capability()
    order = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}
    levels = [lv for lv in LEVELS if order[lv.upper()] <= order.get(machine, 0)]
    return {lv: run_level(lv) for lv in levels}


def test_every_build_runs_and_is_accurate(results):
    for level, lines in results.items():
        assert lines["capability"].lower() == level, (level, lines["capability"])


def test_adamw_bitwise_across_builds(results):
    if len(results) < 2:
        pytest.skip("this CPU runs only the baseline build")
    blobs = {level: lines["adamw"] for level, lines in results.items()}
    assert len(set(blobs.values())) == 1, blobs


def test_rms_norm_bitwise_across_builds(results):
    if len(results) < 2:
        pytest.skip("this CPU runs only the baseline build")
    blobs = {level: lines["rms_norm"] for level, lines in results.items()}
    assert len(set(blobs.values())) == 1, blobs
