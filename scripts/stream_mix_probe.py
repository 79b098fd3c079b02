"""Streaming-bandwidth ceilings and add_mul_act's fwd+bwd by kernel (docs/notes_add_mul_act.md).

1. Ceilings: a flat Triton kernel that reads R and writes W tensors of 16384 x 8192 elements
   (best of a few block shapes), for the read:write mixes add_mul_act's kernels run: copy 1:1,
   inference forward 2:1, training forward 2:2 (out and z), backward 1:2 (relu) / 2:2 (z saved) /
   3:2 (z recomputed from x and y). TB/s count every tensor once.
2. Kernels: torch.profiler device time of every kernel in one fwd+bwd of fuseforge and of
   torch.compile at 16384 x 8192 (alpha 0.5, with a bias), so each kernel's bytes can be set
   against the ceiling of its mix.
   python3 scripts/stream_mix_probe.py
"""
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import fuseforge  # noqa: E402

ROWS, COLS = 16384, 8192


@triton.jit
def _mix(a, b, c, o1, o2, n, scale, NR: tl.constexpr, NW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(a + offs, mask=m).to(tl.float32)
    if NR >= 2:
        v += tl.load(b + offs, mask=m).to(tl.float32)
    if NR >= 3:
        v += tl.load(c + offs, mask=m).to(tl.float32)
    tl.store(o1 + offs, v.to(o1.dtype.element_ty), mask=m)
    if NW >= 2:
        tl.store(o2 + offs, (v * scale).to(o2.dtype.element_ty), mask=m)


def ceilings():
    n = ROWS * COLS
    print("== streaming ceilings, 16384 x 8192 elements a tensor (best of block 1024/4096 x 4/8 warps)")
    for dtype in (torch.bfloat16, torch.float32):
        t = [torch.randn(n, device="cuda", dtype=dtype) for _ in range(5)]
        for nr, nw in ((1, 1), (2, 1), (2, 2), (1, 2), (3, 2)):
            runs = []
            for block, warps in ((1024, 4), (4096, 4), (4096, 8)):
                ms = do_bench(lambda: _mix[(triton.cdiv(n, block),)](t[0], t[1], t[2], t[3], t[4], n, 0.5, NR=nr, NW=nw,
                                                                     BLOCK=block, num_warps=warps), warmup=50, rep=300)
                runs.append((ms, block, warps))
            best = min(runs)
            tbs = (nr + nw) * n * t[0].element_size() / best[0] / 1e9
            print(f"   {str(dtype)[6:]:9s} {nr}R:{nw}W  {best[0]:.3f} ms  {tbs:.2f} TB/s  (block {best[1]}, {best[2]} warps)")
        del t


ACT = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu}


def kernels(dtype, act):
    x, y = (torch.randn(ROWS, COLS, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    b = torch.randn(COLS, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(ROWS, COLS, device="cuda", dtype=dtype)
    torch._dynamo.reset()
    impls = {"fuseforge": lambda: fuseforge.add_mul_act(x, y, b, 0.5, act),
             "compile": torch.compile(lambda: ACT[act](x + 0.5 * y + b), dynamic=False)}
    for name, fn in impls.items():
        def step():
            return torch.autograd.grad(fn(), (x, y, b), g)
        total = do_bench(step, warmup=25, rep=200)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:70]] += e.device_time_total / 5 / 1000
        print(f"   {str(dtype)[6:]} {act} {name}: fwd+bwd {total:.3f} ms (do_bench); kernels:")
        for k, ms in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"      {ms:7.3f} ms  {k}")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    ceilings()
    print("== fwd+bwd by kernel, 16384 x 8192, alpha 0.5, bias")
    for dtype, act in ((torch.bfloat16, "relu"), (torch.bfloat16, "gelu"), (torch.float32, "gelu")):
        kernels(dtype, act)
