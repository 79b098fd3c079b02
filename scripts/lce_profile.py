"""Kernel-time breakdown of one fuseforge linear_cross_entropy fwd+bwd at the issue's case (and the
low-memory strategy), from torch.profiler: where the time goes around the matrix products."""
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import fuseforge  # noqa: E402,F401
from fuseforge.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402


def profile(n, h, v, low_memory):
    x = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda") * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    t[::7] = -100

    def step():
        loss = linear_cross_entropy(x, w, t, low_memory=low_memory)
        return torch.autograd.grad(loss, (x, w))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / 5
    # Host time of one call without a sync: close to the device time means the CPU, not the GPU,
    # paces the step (gaps between kernels while the next launch is being prepared).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    host = (time.perf_counter() - t0) / 5 * 1e3
    torch.cuda.synchronize()
    print(f"   host time a step (no sync): {host:.2f} ms")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_name = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name[:90]][0] += e.device_time_total / 1000 if hasattr(e, "device_time_total") else e.cuda_time_total / 1000
            by_name[e.name[:90]][1] += 1
    # Idle gaps between consecutive kernels on the device timeline: where the step loses time.
    kernels = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps = [(b[0] - a[1], a[2], b[2]) for a, b in zip(kernels, kernels[1:])]
    idle = sum(g for g, _, _ in gaps if g > 0) / 1000
    print(f"   idle between kernels: {idle:.2f} ms over {len(gaps)} boundaries; largest:")
    for g, a, b in sorted(gaps, reverse=True)[:10]:
        print(f"     {g / 1000:7.3f} ms  after {a}  before {b}")
    total = sum(v[0] for v in by_name.values())
    print(f"== {n}x{h}x{v} low_memory={low_memory}: {wall:.2f} ms a step (events), kernels {total:.2f} ms")
    for name, (ms, cnt) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]:
        print(f"  {ms:8.2f} ms  {cnt:5d}x  {name}")


def variants(n, h, v, low_memory, settings):
    """Step time and peak memory under each setting of the development knobs (a dict of env vars)."""
    x = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(v, h, device="cuda") * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    t[::7] = -100
    for env in settings:
        os.environ.update(env)

        def step():
            loss = linear_cross_entropy(x, w, t, low_memory=low_memory)
            return torch.autograd.grad(loss, (x, w))

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        del out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(5):
            step()
        end.record()
        host = (time.perf_counter() - t0) * 1000 / 5
        torch.cuda.synchronize()
        print(f"  low_memory={low_memory} {env}: {start.elapsed_time(end) / 5:.2f} ms a step (host {host:.2f} ms), "
              f"peak extra {peak:.0f} MiB")
        for k in env:
            os.environ.pop(k)


if __name__ == "__main__":
    if "--lowmem" in sys.argv:  # --lowmem: the low-memory strategy only (its column chunk's variants)
        variants(8192, 4096, 128256, True, [{"FUSEFORGE_LCE_LOWMEM_COLS": str(c)} for c in (4096, 8192, 16384)])
        profile(8192, 4096, 128256, True)
        sys.exit(0)
    profile(8192, 4096, 128256, False)
    if "--quick" not in sys.argv:  # --quick: the default strategy's profile only
        variants(8192, 4096, 128256, False, [
            {"FUSEFORGE_LCE_SUB_ROWS": str(sub), "FUSEFORGE_LCE_WORKSPACE_MIB": str(mib)}
            for sub, mib in ((512, 768), (640, 960), (1024, 1024))])
        profile(8192, 4096, 128256, True)
