"""How a kernel's time per call moves after the GPU ran another kernel (GPU machine).

The benchmarks time each impl for 50 ms of warm-up and 100 ms of calls, in turn with the others
(harness.time_interleaved). Under the H100's power cap the clock follows the power each kernel draws,
so a row can carry the state the previous impl left. This runs, for each ordered pair (A, B) of the
chosen impls, A for --lead-ms and then B for --run-ms, with a CUDA event pair around every call of
B, and reports B's median ms in windows of its run (the first 50 ms: do_bench's warm-up; 50-150 ms:
what the table times; then the rest), beside nvidia-smi's clock and power in the same windows.

  python3 scripts/timing_transient.py --bench attention --case D128/S16384/causal --pass fwd \
      --impls fuseforge,sdpa_cudnn [--out DIR]
"""
import argparse
import importlib
import json
import os
import sys
import time
from statistics import median

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import harness  # noqa: E402

WINDOWS_MS = ((0, 50), (50, 150), (150, None))


def window_key(lo: float, hi) -> str:
    return f"{lo}-{hi if hi is not None else 'end'}ms"


def run_for(fn, ms: float, record: bool):
    """Calls fn back to back for ms of GPU time; with record, each call's (start offset, ms)."""
    calls = []
    t_begin = torch.cuda.Event(enable_timing=True)
    t_begin.record()
    elapsed = 0.0
    while elapsed < ms:
        batch = []
        for _ in range(8):  # a few calls between syncs, so the GPU never waits on the host
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            batch.append((a, b))
        torch.cuda.synchronize()
        for a, b in batch:
            calls.append((t_begin.elapsed_time(a), a.elapsed_time(b)))
        elapsed = calls[-1][0] + calls[-1][1]
    return calls if record else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", default="attention")
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--pass", dest="pass_", default="fwd")
    ap.add_argument("--impls", default="fuseforge,sdpa_cudnn")
    ap.add_argument("--lead-ms", type=float, default=300)
    ap.add_argument("--run-ms", type=float, default=600)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    module = importlib.import_module(f"bench_{args.bench}")
    impls = args.impls.split(",")
    sampler = harness.ClockSampler(interval_ms=10).start()
    results = []
    for case in args.case:
        benches = {b.impl: b for b in module.setup(case) if b.pass_ == args.pass_ and b.impl in impls}
        for b in benches.values():  # compile / autotune outside the windows
            run_for(b.fn, 20, record=False)
        for lead in benches:
            for name, bench in benches.items():
                run_for(benches[lead].fn, args.lead_ms, record=False)
                t0 = time.time()
                calls = run_for(bench.fn, args.run_ms, record=True)
                row = {"case": case, "pass": args.pass_, "after": lead, "impl": name, "calls": len(calls)}
                for lo, hi in WINDOWS_MS:
                    sel = [ms for start, ms in calls if start >= lo and (hi is None or start < hi)]
                    row[window_key(lo, hi)] = round(median(sel), 4) if sel else None
                results.append((row, t0))
                print(json.dumps(row), flush=True)
    sampler.stop()  # its samples are read here
    for row, t0 in results:
        for lo, hi in WINDOWS_MS:
            clock = sampler.clock([(t0 + lo / 1000, t0 + (hi if hi is not None else args.run_ms) / 1000)])
            if clock:
                row[window_key(lo, hi) + "_clock"] = clock
        print(json.dumps(row))
    results = [row for row, _ in results]
    with open(os.path.join(args.out, "timing_transient.json"), "w") as f:
        json.dump({**harness.env_info(), "lead_ms": args.lead_ms, "run_ms": args.run_ms, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
