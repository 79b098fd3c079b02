"""The SM clock each attention impl runs at under the benchmarks' sustained load (GPU machine).

Times each impl's pass with do_bench (as benchmarks/harness.py does) while `nvidia-smi` samples the SM
clock and the active clock-event reasons every 50 ms, then prints, per impl: the median ms, the mean and
lowest SM clock over its do_bench window, and the share of samples with the software power cap active.
At the H100's power cap a kernel that keeps the tensor cores busier runs at a lower clock, so two
impls' time ratio is their cycle ratio times their clock ratio (docs/notes_attention.md, seventeenth
session).
   python3 scripts/attention_clock_probe.py [--cases docs/T32768/H16/D128/causal,D128/S16384/causal]
                                            [--impls fuseforge,flex,sdpa_cudnn] [--pass fwdbwd]
Cases of bench_attention.py ("D128/S16384/causal") or bench_attention_varlen.py (the others).
"""
import argparse
import csv
import datetime
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "python"))

SW_POWER_CAP = 0x4  # nvidia-smi clocks_event_reasons bit


def read_samples(path: str) -> list[tuple[float, float, int]]:
    """(unix time, SM MHz, event-reason bits) per nvidia-smi line."""
    rows = []
    with open(path) as f:
        for r in csv.reader(f):
            if len(r) < 3:
                continue
            t = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
            ts = t.replace(tzinfo=datetime.timezone.utc).timestamp()
            rows.append((ts, float(r[1].split()[0]), int(r[2].strip(), 16)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="docs/T32768/H16/D128/causal,window4096/B2/H16/S16384/D128/causal,"
                                       "D128/S16384/causal")
    ap.add_argument("--impls", default="fuseforge,flex,sdpa_cudnn")
    ap.add_argument("--pass", dest="pass_", default="fwdbwd")
    args = ap.parse_args()
    import triton.testing
    import bench_attention
    import bench_attention_varlen
    samples = os.path.join(tempfile.mkdtemp(), "smi.csv")
    # nvidia-smi prints local time, read as UTC: the GPU machine's zone.
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks_event_reasons.active",
                            "--format=csv,noheader", "-lms", "50"], stdout=open(samples, "w"))
    windows = []
    try:
        for case in args.cases.split(","):
            bench = bench_attention if case[0] == "D" else bench_attention_varlen
            for b in bench.setup(case):
                if b.pass_ != args.pass_ or b.impl not in args.impls.split(","):
                    continue
                b.fn()
                torch.cuda.synchronize()
                t0 = time.time()
                ms = triton.testing.do_bench(b.fn, warmup=50, rep=300, return_mode="median")
                windows.append((case, b.impl, ms, t0, time.time()))
            torch.cuda.empty_cache()
    finally:
        smi.terminate()
        smi.wait()
    rows = read_samples(samples)
    print(f"{'case':42s} {'impl':12s} {'ms':>8s} {'mean MHz':>9s} {'min MHz':>8s} {'power cap':>9s}")
    for case, impl, ms, t0, t1 in windows:
        sel = [r for r in rows if t0 + 0.1 <= r[0] <= t1]  # skip do_bench's first estimate
        if not sel:
            print(f"{case:42s} {impl:12s} {ms:8.4f}   (no clock samples)")
            continue
        mean = sum(r[1] for r in sel) / len(sel)
        capped = sum(1 for r in sel if r[2] & SW_POWER_CAP) / len(sel)
        print(f"{case:42s} {impl:12s} {ms:8.4f} {mean:9.0f} {min(r[1] for r in sel):8.0f} {capped:9.0%}")


if __name__ == "__main__":
    main()
