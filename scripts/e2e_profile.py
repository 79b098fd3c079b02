"""Where a training step of the end-to-end case goes, by kernel family, for each impl of
benchmarks/bench_e2e.py (one profiled step after warm-up; torch.profiler device times).
   python3 scripts/e2e_profile.py [--impls eager,fuseforge,fuseforge_sdpa] [--batch 6] [--config 1b]
Kernel times are summed per family; kernels launched early (programmatic dependent launch) count
their wait too, so the step's event time, not the sum, is what an impl costs.
"""
import argparse
import os
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_e2e  # noqa: E402

# First match wins: (family, substrings of the kernel name, lower case).
FAMILIES = [
    ("attention", ("attention", "flash", "fmha", "cudnn", "sdpa", "efficient")),
    ("linear_cross_entropy", ("linear_cross_entropy", "row_softmax")),
    ("optimizer", ("adamw", "adam", "multi_tensor")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "cublas", "sm90_")),
    ("softmax / loss", ("softmax", "nll", "cross_entropy")),
    ("reduction", ("reduce",)),
    ("elementwise / copies", ("elementwise", "copy", "fill", "memset", "memcpy", "cat", "index")),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def profile_impl(impl: str, cfg: dict, seq: int, batch: int, device) -> None:
    bench_e2e.free()
    model, opt, autocast = bench_e2e.make_impl(impl, cfg, seq, device)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device=device)
    for _ in range(3):
        bench_e2e.train_step(model, opt, autocast, ids, device)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    bench_e2e.train_step(model, opt, autocast, ids, device)
    end.record()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        bench_e2e.train_step(model, opt, autocast, ids, device)
        torch.cuda.synchronize()
    by_family, by_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = (e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total) / 1000
        by_family[family(e.name)] += ms
        by_name[e.name[:100]][0] += ms
        by_name[e.name[:100]][1] += 1
    total = sum(by_family.values())
    print(f"== {impl}: step {start.elapsed_time(end):.1f} ms (events), kernels {total:.1f} ms")
    for fam, ms in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"   {fam:24s} {ms:8.2f} ms  {100 * ms / total:5.1f}%")
    print("   largest kernels:")
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    for name, (ms, count) in ranked[:14]:
        print(f"     {ms:8.2f} ms {count:5d}x  {name}")
    print("   every attention kernel:")  # the family's total is compared between impls: show all of it
    for name, (ms, count) in ranked:
        if family(name) == "attention":
            print(f"     {ms:8.2f} ms {count:5d}x  {name}")
    del model, opt
    bench_e2e.free()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default="eager,fuseforge")
    p.add_argument("--config", choices=sorted(bench_e2e.CONFIGS), default="1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=6)
    args = p.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, config {args.config}, "
          f"seq {args.seq}, batch {args.batch}")
    for impl in args.impls.split(","):
        profile_impl(impl, bench_e2e.CONFIGS[args.config], args.seq, args.batch, device)


if __name__ == "__main__":
    main()
