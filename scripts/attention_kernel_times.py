"""Device time of every kernel one call launches, per impl, for cases of bench_attention.py or
bench_attention_varlen.py (torch.profiler, after warm-up; the mean over a few calls). Shows where a
pass's time goes beyond its main kernel: fuseforge's row_dot, dq_accum zeroing and dq convert
kernels beside cuDNN's; and the device's idle time between consecutive kernels (launch latency and
ramp: what programmatic dependent launch could hide), by kernel pair.
   python3 scripts/attention_kernel_times.py [--bench attention] [--cases D128/S1024/full,B1/Hq32,...]
                                             [--impls fuseforge,sdpa_cudnn] [--pass fwdbwd] [--calls 5]
"""
import argparse
import importlib
import os
import re
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "python"))


def short(name: str) -> str:
    """A kernel's function name without return type, namespace, template arguments and parameters."""
    return re.sub(r".*::", "", re.sub(r"[<(].*", "", name.removeprefix("void ")))


def kernel_times(fn, calls: int) -> tuple[list[tuple[str, float, int]], list[tuple[str, float, int]]]:
    """(kernel name, mean ms a call, launches a call) for every kernel fn launches, longest first; and
    (previous kernel -> kernel, mean us idle a call before it, count a call): the gaps between one
    kernel's end and the next one's start, the calls run back to back."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us, count = defaultdict(float), defaultdict(int)
    kernels = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total_us[ev.name] += ev.device_time
            count[ev.name] += 1
            kernels.append((ev.time_range.start, ev.time_range.end, short(ev.name)))
    rows = [(name, us / calls / 1000, count[name] // calls) for name, us in total_us.items()]
    kernels.sort()
    gap_us, gap_count = defaultdict(float), defaultdict(int)
    for (_, prev_end, prev), (start, _, name) in zip(kernels, kernels[1:]):
        gap_us[f"{prev} -> {name}"] += max(0.0, start - prev_end)
        gap_count[f"{prev} -> {name}"] += 1
    gaps = [(pair, us / calls, gap_count[pair] // calls) for pair, us in gap_us.items()]
    return sorted(rows, key=lambda r: -r[1]), sorted(gaps, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="attention", choices=["attention", "attention_varlen"])
    ap.add_argument("--cases", default="D128/S1024/full,D128/S16384/full")
    ap.add_argument("--impls", default="fuseforge,sdpa_cudnn")
    ap.add_argument("--pass", dest="pass_", default="fwdbwd")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    bench = importlib.import_module(f"bench_{args.bench}")
    impls = args.impls.split(",")
    # A case of the benchmark's list by a part of its name, as --cases of the benchmarks takes it
    # (B1/Hq32: its 8B Llama case), or any shape the benchmark's setup reads.
    cases = []
    for key in args.cases.split(","):
        matches = [c for c in bench.CASES if key in c]
        cases += matches if matches and key not in bench.CASES else [key]
    for case in cases:
        for b in bench.setup(case):
            if b.pass_ != args.pass_ or b.impl not in impls:
                continue
            rows, gaps = kernel_times(b.fn, args.calls)
            print(f"\n== {case} {b.pass_} {b.impl}: {sum(r[1] for r in rows):.4f} ms of kernels a call, "
                  f"{sum(g[1] for g in gaps):.1f} us idle between them")
            for name, ms, n in rows:
                print(f"  {ms:9.4f} ms  x{n:<3d} {name[:150]}")
            for pair, us, n in gaps:
                print(f"  {us:7.1f} us idle x{n:<3d} {pair[:150]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
