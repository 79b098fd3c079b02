"""Profiling tools on the benchmarks' cases and benchmarks/harness.py (a GPU unless noted).

    python3 benchmarks/profiler.py ncu-cycles [--bench attention] --cases D128/S16384/causal --impls fuseforge,sdpa_cudnn
        [--passes fwd,fwdbwd] [--out benchmarks/results] [--traffic]
    python3 benchmarks/profiler.py kernel-times [--bench attention] [--cases D128/S1024/full] [--impls ...]
    python3 benchmarks/profiler.py e2e-kernels [--config qwen3-moe-layers] [--batch 8] [--impls fuseforge,liger]
    python3 benchmarks/profiler.py e2e-attention-ab [--batch 16] [--pairs 12]   (--device cpu: a smoke test)
    python3 benchmarks/profiler.py workload OP ARGS...

ncu-cycles   impls compared in cycles: every kernel of one warmed-up call of any benchmark's case
             summed under Nsight Compute, which locks the SM clock (the power cap clocks each kernel
             by its own draw).
kernel-times every kernel one call launches and the device's idle time between them (torch.profiler).
e2e-kernels  where a training step's device time goes, by kernel, per impl of bench_e2e.py.
e2e-attention-ab  what fuseforge attention saves inside a training step: one model, its attention
             alternated with transformers' SDPA in A B B A steps.
workload     a few calls of one op at one case, for a profiler that wraps a process (ncu,
             compute-sanitizer); ncu-cycles runs it.

`python3 benchmarks/profiler.py SUBCOMMAND -h` describes each. benchmarks/report.py renders the stored
results of ncu-cycles (ratio_table) and e2e-attention-ab (ab_markdown) with the functions below.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (os.path.join(ROOT, "python"), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)
import harness  # noqa: E402


# ---------------------------------------------------------------------------------------------
# workload: a few calls of one op, for ncu / compute-sanitizer

WORKLOAD_DOC = """A few calls of one op at one case, for profilers that wrap a process (ncu, compute-sanitizer).
   profiler.py workload add_mul_act 16384x8192 fp32 gelu
   profiler.py workload adamw llama1b fp32|bf16-master
   profiler.py workload attention D128/S4096/full fuseforge|sdpa_flash|sdpa_cudnn
   profiler.py workload attention docs/T32768/H16/D128/causal fuseforge|flex   (bench_attention_varlen's cases)
   ncu --profile-from-start off python3 benchmarks/profiler.py workload profiled BENCH CASE IMPL [fwd|fwdbwd]
     (one warmed-up pass of bench_BENCH.py's case by one impl inside cudaProfilerStart / Stop; attention's
     IMPL cublas_gemm: one matmul with the case's useful FLOPs)
   ncu --kernel-name regex:backward_kernel --launch-skip 2 --launch-count 1 python3 benchmarks/profiler.py workload ...
"""
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
CALLS = 3


def _dtype(name: str):
    import torch
    return getattr(torch, DTYPES[name])


def workload_add_mul_act(shape: str, dtype: str, act: str) -> None:
    import torch
    import fuseforge
    rows, cols = (int(v) for v in shape.split("x"))
    x, y = (torch.randn(rows, cols, device="cuda", dtype=_dtype(dtype), requires_grad=True) for _ in range(2))
    b = torch.randn(cols, device="cuda", dtype=_dtype(dtype), requires_grad=True)
    g = torch.randn(rows, cols, device="cuda", dtype=_dtype(dtype))
    for _ in range(CALLS):
        out = fuseforge.add_mul_act(x, y, b, alpha=0.5, activation=act)
        torch.autograd.grad(out, (x, y, b), g)


def workload_adamw(case: str, kind: str) -> None:
    import torch
    import fuseforge
    from bench_adamw import llama1b_shapes, make_params
    shapes = llama1b_shapes() if case == "llama1b" else [(4096,)] * 5000
    params = make_params(shapes, torch.float32 if kind == "fp32" else torch.bfloat16)
    opt = fuseforge.optim.AdamW(params, lr=1e-3, master_weights=kind != "fp32")
    for _ in range(CALLS):
        opt.step()


def attention_case(case: str, impl: str):
    """q, k, v of one bench_attention.py case and a forward by one impl."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import fuseforge
    from bench_attention import case_shape
    b, hq, hk, s, d, causal = case_shape(case)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def forward():
        if impl == "fuseforge":
            return fuseforge.attention(q, k, v, causal=causal)
        with sdpa_kernel({"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hk)

    return (q, k, v), forward


def gemm_call(case: str, pass_: str):
    """The GEMM ceiling of a fixed-length case: one bf16 cuBLAS matmul, 8192 x K by K x 8192, with the
    useful FLOPs bench_attention counts for the pass (K rounded to a multiple of 64). At ncu's locked
    clock its time over an attention impl's is the share of the GEMM's rate per cycle that impl runs at."""
    import torch
    from bench_attention import attention_flops, case_shape
    b, hq, _, s, d, causal = case_shape(case)
    flops = attention_flops(b, hq, s, d, causal, pass_)
    m = n = 8192
    kdim = max(64, round(flops / (2 * m * n) / 64) * 64)
    a = torch.randn(m, kdim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(kdim, n, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.mm(a, w)


def attention_call(case: str, impl: str, pass_: str = "fwdbwd"):
    """A callable running one forward + backward (pass_ "fwdbwd") or one forward ("fwd") of an
    attention benchmark case by one impl (bench_attention_varlen's cases, "docs/...", "window...",
    "softcap...", through that script's setup)."""
    import torch
    if impl == "cublas_gemm":
        return gemm_call(case, pass_)
    if not case.startswith(("D", "B")):
        import bench_attention_varlen
        bench_attention_varlen._selected_impls[:] = [impl]  # its setup builds only these
        return bench_call("attention_varlen", case, impl, pass_)
    qkv, forward = attention_case(case, impl)
    if pass_ == "fwd":
        return forward
    g = torch.randn_like(qkv[0])
    return lambda: torch.autograd.grad(forward(), qkv, g)


def bench_cases(bench: str, keys: str) -> list:
    """The cases of bench_<bench>.py that comma-separated `keys` name, by a part of the name as the
    benchmarks' --cases takes it (B1/Hq32: attention's 8B Llama case), or any shape its setup reads."""
    module = importlib.import_module(f"bench_{bench}")
    cases = []
    for key in keys.split(","):
        matches = [c for c in module.CASES if key in c]
        cases += matches if matches and key not in module.CASES else [key]
    return cases


def bench_call(bench: str, case: str, impl: str, pass_: str = "fwdbwd"):
    """A callable running one pass of one impl of a case of any benchmark with a setup(case) (its
    Bench's fn); attention's cases as attention_call takes them."""
    if bench == "attention":
        return attention_call(case, impl, pass_)
    module = importlib.import_module(f"bench_{bench}")
    for b in module.setup(case):
        if b.impl == impl and b.pass_ == pass_:
            return b.fn
    sys.exit(f"bench_{bench}.py has no impl {impl!r} with pass {pass_!r} for case {case!r}")


def workload_attention(case: str, impl: str) -> None:
    """Forward + backward of one attention benchmark case, by one impl."""
    fwdbwd = attention_call(case, impl)
    for _ in range(CALLS):
        fwdbwd()


def workload_profiled(bench: str, case: str, impl: str, pass_: str = "fwdbwd") -> None:
    """One pass of one impl of a benchmark's case, warmed up, then once more inside cudaProfilerStart /
    Stop, so `ncu --profile-from-start off` takes every kernel of exactly one call."""
    import torch
    call = bench_call(bench, case, impl, pass_)
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


WORKLOADS = {"add_mul_act": workload_add_mul_act, "adamw": workload_adamw, "attention": workload_attention,
             "profiled": workload_profiled}


def cmd_workload(args) -> None:
    import torch
    WORKLOADS[args.op](*args.args)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# ncu-cycles: impls compared in cycles at Nsight Compute's locked clock

NCU_DOC = """Every kernel of one forward+backward (or forward) of a benchmark's case, per impl, under ncu at
its locked SM clock: impls compared in cycles, apart from the clock each gets at the power cap.
   profiler.py ncu-cycles --cases docs/T32768/H16/D128/causal,window4096/B2/H16/S16384/D128/causal \\
       --impls fuseforge,flex
   profiler.py ncu-cycles --cases D64/S1024/full,D128/S16384/causal --impls fuseforge,sdpa_cudnn \\
       --passes fwd,fwdbwd --out benchmarks/results    (writes attention_ncu_cycles.json / .md there)
   profiler.py ncu-cycles --bench rotary --cases 16x4x128/bf16 --impls fuseforge,liger --passes fwd --traffic
--bench attention (the default): cases of bench_attention.py ("D128/S16384/causal": impls fuseforge,
sdpa_cudnn, sdpa_flash, and cublas_gemm: one bf16 matmul with the case's useful FLOPs, the GEMM
ceiling at the same clock) or of bench_attention_varlen.py (fuseforge, flex). Any other --bench: the
cases and impls of bench_<bench>.py (a case by a part of its name). Runs `ncu --profile-from-start
off` on `profiler.py workload profiled` and prints, per impl and pass, the kernels' summed duration
and elapsed cycles and its five longest kernels, then a table of the peers' ratios (with --out also
<name>.json, with the GPU, torch and commit, and <name>.md, which benchmarks/report.py renders into
docs/benchmarks.md). ncu flushes the caches before each kernel and serializes them, so the sums leave
out launch gaps.
--traffic adds what each call moves, summed over its kernels (L2 bytes, of them reductions and
atomics, DRAM bytes read and written, global loads at L1 and those that missed it, shared-memory
wavefronts, instructions): where a power-capped row's energy goes when its cycles lead, or what a
peer's kernel moves that ours does not (<name>_traffic.md with --out). Metrics this ncu does not
list for the chip are left out with a note.
"""
UNIT_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
# --traffic: (column, metric, factor from the metric's base unit to the column's).
TRAFFIC = (("l2_MB", "lts__t_bytes.sum", 1e-6), ("l2_red_MB", "lts__t_sectors_op_red.sum", 32e-6),
           ("l2_atom_MB", "lts__t_sectors_op_atom.sum", 32e-6), ("l2_read_MB", "lts__t_sectors_op_read.sum", 32e-6),
           ("l2_write_MB", "lts__t_sectors_op_write.sum", 32e-6), ("dram_MB", "dram__bytes.sum", 1e-6),
           ("dram_read_MB", "dram__bytes_read.sum", 1e-6), ("dram_write_MB", "dram__bytes_write.sum", 1e-6),
           ("l1_load_MB", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", 32e-6),
           ("l1_load_miss_MB", "l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_miss.sum", 32e-6),
           ("smem_wavefronts_M", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", 1e-6),
           ("inst_M", "smsp__inst_executed.sum", 1e-6))
# --traffic, per kernel only (printed for the longest kernels, not summed): its launch shape.
LAUNCH = (("grid", "launch__grid_size", 1.0), ("block", "launch__block_size", 1.0),
          ("cluster", "launch__cluster_size", 1.0), ("cluster_x", "launch__cluster_dim_x", 1.0),
          ("cluster_y", "launch__cluster_dim_y", 1.0), ("smem_B", "launch__shared_mem_per_block", 1.0))


def available_traffic() -> tuple:
    """The TRAFFIC and LAUNCH entries whose base metric `ncu --query-metrics --chip gh100` lists (the
    TRAFFIC ones, with a note, where the query fails)."""
    out = subprocess.run(["ncu", "--query-metrics", "--chip", "gh100"], capture_output=True, text=True, timeout=120)
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.strip() and "__" in line.split()[0]}
    if out.returncode != 0 or not listed:
        print(f"ncu --query-metrics failed (rc {out.returncode}): asking for the traffic metrics only", flush=True)
        return TRAFFIC
    kept = tuple(t for t in TRAFFIC + LAUNCH if t[1].split(".")[0] in listed)
    for t in TRAFFIC + LAUNCH:
        if t not in kept:
            print(f"left out: {t[1]} (not listed for gh100)", flush=True)
    return kept


def _unit_scale(unit: str) -> float:
    """ncu's auto-scaled units ("Mbyte", "Kbyte", "byte", "sector", "inst"): the factor to the base unit."""
    prefix = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return prefix[unit[0]] if len(unit) > 1 and unit[0] in prefix and unit[1:] in ("byte", "sector", "inst") else 1.0


def parse_ncu_csv(text: str, traffic: tuple = ()) -> dict:
    """{kernel launch id: {"name", "ms", "cycles", and each traffic column}} from `ncu --csv` output."""
    rows = list(csv.reader(io.StringIO(text)))
    # The workload's own prints come first (a list of lengths has commas too): start at ncu's header.
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    head = rows[start]
    k, m, v, u = (head.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit"))
    columns = {metric: (col, factor) for col, metric, factor in traffic}
    kernels: dict = {}
    for r in rows[start + 1:]:
        if len(r) != len(head):
            continue
        kernel = kernels.setdefault(r[0], {"name": r[k], "ms": 0.0, "cycles": 0.0})
        value = float(r[v].replace(",", ""))
        if r[m] == "gpu__time_duration.sum":
            kernel["ms"] = value * UNIT_MS[r[u]]
        elif r[m] == "sm__cycles_elapsed.max":
            kernel["cycles"] = value
        elif r[m] in columns:
            col, factor = columns[r[m]]
            kernel[col] = value * factor * _unit_scale(r[u])
    return kernels


def ncu_profile(bench: str, case: str, impl: str, pass_: str, traffic: tuple = ()) -> Optional[dict]:
    """parse_ncu_csv of one pass ("fwd", "fwdbwd") of bench_<bench>.py's case by one impl; None where
    ncu refused the traffic metrics (the caller then profiles without them)."""
    metrics = ",".join(["gpu__time_duration.sum", "sm__cycles_elapsed.max"] + [t[1] for t in traffic])
    cmd = ["ncu", "--profile-from-start", "off", "--metrics", metrics, "--csv",
           sys.executable, os.path.abspath(__file__), "workload", "profiled", bench, case, impl, pass_]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        return parse_ncu_csv(done.stdout, traffic)
    except StopIteration:
        if traffic:  # a metric this ncu refuses
            print(f"ncu refused the traffic metrics for {case} {impl} {pass_}:\n{done.stderr[-1500:]}", flush=True)
            return None
        sys.exit(f"ncu gave no kernel table for {case} {impl} {pass_}:\n{done.stderr[-2000:]}")


def ratio_table(result: dict) -> str:
    """Markdown: per case and pass, fuseforge's summed ms and each peer's, and peer / fuseforge."""
    rows = result["rows"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    peers = [i for i in impls if i != "fuseforge"]
    by = {(r["case"], r["pass"], r["impl"]): r for r in rows}
    lines = ["| case | pass | fuseforge ms | " + " | ".join(f"{i} ms | {i} / fuseforge" for i in peers) + " |",
             "|" + "---|" * (3 + 2 * len(peers))]
    for case, pass_ in dict.fromkeys((r["case"], r["pass"]) for r in rows):
        ff = by[(case, pass_, "fuseforge")]["ms"]
        cells = [case, pass_, f"{ff:.4g}"]
        for i in peers:
            ms = by[(case, pass_, i)]["ms"]
            cells += [f"{ms:.4g}", f"{ms / ff:.3f}x" if ff > 0 else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    clock = sum(r["mcycles"] for r in rows) / max(sum(r["ms"] for r in rows), 1e-9)  # M cycles a ms = GHz
    dates = result.get("dates", [result["date"]])  # a date a run of the script (--append adds one)
    return ("\n".join(lines) + f"\n\n{result['gpu']} at ncu's locked SM clock ({clock:.2f} GHz), torch "
            f"{result['torch']}, CUDA {result['cuda']}, commit `{result['commit'][:12]}`, {' and '.join(dates)}"
            f"{' (one run of the script each)' if len(dates) > 1 else ''}; every "
            "kernel of one warmed-up call summed (`benchmarks/profiler.py ncu-cycles`). `X / fuseforge` = X's time "
            "/ fuseforge's at that one clock.\n")


def traffic_table(result: dict) -> str:
    """Markdown: per case, pass and impl, each traffic column summed over the call's kernels."""
    cols = [c for c, _, _ in TRAFFIC if any(c in r for r in result["rows"])]
    lines = ["| case | pass | impl | ms | " + " | ".join(cols) + " |", "|" + "---|" * (4 + len(cols))]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['pass']} | {r['impl']} | {r['ms']:.4g} | "
                     + " | ".join(f"{r[c]:.4g}" if c in r else "-" for c in cols) + " |")
    return ("\n".join(lines) + f"\n\n{result['gpu']}, commit `{result['commit'][:12]}`: every kernel of one "
            "warmed-up call summed under ncu (`benchmarks/profiler.py ncu-cycles --traffic`); MB = 10^6 bytes "
            "(sectors x 32 for reductions, atomics, reads, writes), M = 10^6.\n")


def cmd_ncu_cycles(args) -> None:
    args.name = args.name or f"{args.bench}_ncu_cycles"
    result = {"op": args.name, **harness.env_info(), "rows": []}
    path = os.path.join(args.out, args.name + ".json")
    if args.append and os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        if earlier["commit"] != result["commit"]:
            sys.exit(f"--append: {path} is from commit {earlier['commit']}, this tree is {result['commit']}")
        result["rows"] = earlier["rows"]
        result["dates"] = earlier.get("dates", [earlier["date"]]) + [result["date"]]  # one per run
    impls = args.impls.split(",")
    traffic = available_traffic() if args.traffic else ()
    cases = args.cases.split(",") if args.bench == "attention" else bench_cases(args.bench, args.cases)
    for case in cases:
        for pass_ in args.passes.split(","):
            for impl in impls:
                kernels = ncu_profile(args.bench, case, impl, pass_, traffic)
                if kernels is None:  # the cycles still count: this row and the rest without traffic
                    traffic = ()
                    kernels = ncu_profile(args.bench, case, impl, pass_)
                kernels = kernels.values()
                ms, cyc = sum(x["ms"] for x in kernels), sum(x["cycles"] for x in kernels)
                row = {"case": case, "pass": pass_, "impl": impl, "kernels": len(kernels), "ms": round(ms, 4),
                       "mcycles": round(cyc / 1e6, 4)}
                row.update({t[0]: round(sum(x.get(t[0], 0.0) for x in kernels), 3) for t in traffic
                            if t not in LAUNCH and any(t[0] in x for x in kernels)})
                result["rows"].append(row)
                print(f"{case} {pass_} {impl}: {len(kernels)} kernels, {ms:.4f} ms at the locked clock, "
                      f"{cyc / 1e6:.3f} M cycles (each kernel's slowest SM)", flush=True)
                for x in sorted(kernels, key=lambda x: -x["ms"])[:5]:
                    extra = "  ".join(f"{c}={x[c]:.4g}" for c, _, _ in traffic if c in x)
                    print(f"    {x['ms']:9.4f} ms {x['cycles'] / 1e6:8.3f} Mcyc  {x['name'][:110]}"
                          + (f"\n        {extra}" if extra else ""))
                if args.out:  # after every row: a run cut short keeps what it measured
                    os.makedirs(args.out, exist_ok=True)
                    with open(path, "w") as f:
                        json.dump(result, f, indent=1)
    table = ratio_table(result) if "fuseforge" in impls and len(impls) > 1 else ""
    print("\n" + table)
    if traffic:
        print("\n" + traffic_table(result))
    if args.out:
        base = os.path.join(args.out, args.name)
        if table:
            with open(base + ".md", "w") as f:
                f.write(table)
        if traffic:
            with open(base + "_traffic.md", "w") as f:
                f.write(traffic_table(result))


# ---------------------------------------------------------------------------------------------
# kernel-times: every kernel of one call and the idle time between kernels

KERNEL_TIMES_DOC = """Device time of every kernel one call launches, per impl, for cases of a benchmark (--bench:
bench_<bench>.py, default attention; torch.profiler, after warm-up; the mean over a few calls). Shows where a
pass's time goes beyond its main kernel (fuseforge's row_dot, dq_accum zeroing and dq convert kernels
beside cuDNN's) and the device's idle time between consecutive kernels (launch latency and ramp: what
programmatic dependent launch can hide), by kernel pair.
"""


def short_kernel_name(name: str) -> str:
    """A kernel's function name without return type, namespace, template arguments and parameters."""
    return re.sub(r".*::", "", re.sub(r"[<(].*", "", name.removeprefix("void ")))


def kernel_times(fn, calls: int) -> tuple:
    """(kernel name, mean ms a call, launches a call) for every kernel fn launches, longest first; and
    (previous kernel -> kernel, mean us idle a call before it, count a call): the gaps between one
    kernel's end and the next one's start, the calls run back to back."""
    import torch
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
            kernels.append((ev.time_range.start, ev.time_range.end, short_kernel_name(ev.name)))
    rows = [(name, us / calls / 1000, count[name] // calls) for name, us in total_us.items()]
    kernels.sort()
    gap_us, gap_count = defaultdict(float), defaultdict(int)
    for (_, prev_end, prev), (start, _, name) in zip(kernels, kernels[1:]):
        gap_us[f"{prev} -> {name}"] += max(0.0, start - prev_end)
        gap_count[f"{prev} -> {name}"] += 1
    gaps = [(pair, us / calls, gap_count[pair] // calls) for pair, us in gap_us.items()]
    return sorted(rows, key=lambda r: -r[1]), sorted(gaps, key=lambda r: -r[1])


def cmd_kernel_times(args) -> None:
    import torch
    bench = importlib.import_module(f"bench_{args.bench}")
    impls = args.impls.split(",")
    for case in bench_cases(args.bench, args.cases):
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


E2E_KERNELS_DOC = """Where one training step's device time goes, per impl of bench_e2e.py: every kernel of a step
(torch.profiler after three warm-up steps, the mean over --steps steps), summed by kernel name, the
device's idle time between kernels, and the step's wall time. For a step that trails a peer (e.g.
--config qwen3-moe-layers --impls fuseforge,liger): which kernels its time is in.

    PYTHONPATH=python python3 benchmarks/profiler.py e2e-kernels --config qwen3-moe-layers --batch 8 --impls fuseforge,liger
"""


def cmd_e2e_kernels(args) -> None:
    import torch
    bench_e2e = importlib.import_module("bench_e2e")
    cfg = bench_e2e.CONFIGS[args.config]
    device = torch.device("cuda")
    ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), device=device,
                        generator=torch.Generator(device).manual_seed(0))
    for impl in args.impls.split(","):
        bench_e2e.free()
        model, opt, autocast, scope = bench_e2e.make_impl(impl, cfg, args.seq, device)
        with scope:
            def step():
                bench_e2e.train_step(model, opt, autocast, ids, device)
            rows, gaps = kernel_times(step, args.steps)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1000 / args.steps
        del model, opt
        by_name, launches = defaultdict(float), defaultdict(int)
        for name, ms, n in rows:
            by_name[short_kernel_name(name)] += ms
            launches[short_kernel_name(name)] += n
        total = sum(by_name.values())
        print(f"\n== {args.config} batch {args.batch} {impl}: step {wall_ms:.1f} ms wall, {total:.1f} ms of kernels, "
              f"{sum(g[1] for g in gaps) / 1000:.1f} ms idle between them, {sum(launches.values())} launches")
        for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {ms:9.2f} ms {100 * ms / total:5.1f}%  x{launches[name]:<5d} {name[:120]}")


# ---------------------------------------------------------------------------------------------
# e2e-attention-ab: what fuseforge attention saves inside a training step

AB_DOC = """Does the patched training step improve by what fuseforge attention saves alone?

One model, bench_e2e.py's fuseforge recipe (patched, bf16 weights, fuseforge AdamW). Its steps alternate
the attention between fuseforge's and transformers' SDPA (cuDNN's kernel on Hopper) in A B B A order,
so both see the same clocks, power, memory and model state: only the attention differs. The step time
difference (SDPA step - fuseforge step) is what fuseforge attention saves inside the step.

Beside it, in the same process: the two attention functions alone (transformers' attention interface,
the call each decoder layer makes, on the model's shapes with (B, S, H, D) memory as the projections
leave it), forward + backward, interleaved rounds. Their difference times the layer count is the
saving the step should show.

Energy (CUDA, where NVML's energy counter reads): joules a step per mode (blocks of steps in A B B A
order) and millijoules a call of each attention alone (2 s back to back after 0.3 s of itself). A step
that runs at the power cap takes about its energy over the cap's watts, so the layers' saved energy
over the step's mean power is the saving to expect there, beside the one of the times alone.

    FUSEFORGE_COMMIT=<sha> PYTHONPATH=python python3 benchmarks/profiler.py e2e-attention-ab [--batch 16] [--pairs 12]
Writes e2e_attention_ab.json and .md into --out (default benchmarks/results).
"""
MODES = ("fuseforge", "sdpa")  # A, B


def abba(groups: int) -> list:
    """The modes in A B B A order, `groups` times."""
    return [m for _ in range(groups) for m in (MODES + MODES[::-1])]


def impl_names() -> dict:
    """Each mode's attention implementation, as the model's set_attn_implementation takes it."""
    from fuseforge.patch import ATTN_IMPLEMENTATION
    return {"fuseforge": ATTN_IMPLEMENTATION, "sdpa": "sdpa"}


def energy_counter(device) -> Optional[harness.EnergyCounter]:
    """The GPU's energy counter where it reads (CUDA with NVML), else None."""
    if device.type != "cuda":
        return None
    counter = harness.EnergyCounter()
    return counter if counter.joules() is not None else None


def step_ab(model, opt, stream, pairs: int, device) -> dict:
    """Step times (ms) per mode: `pairs` A B B A groups after one warm-up step of each mode."""
    import bench_e2e
    impl_name = impl_names()
    order = abba(pairs)
    timers = {m: harness.StepTimer(device.type == "cuda") for m in MODES}
    for i, mode in enumerate(list(MODES) + order):
        model.set_attn_implementation(impl_name[mode])
        warm_up = i < len(MODES)  # allocations, cuDNN's plan
        with contextlib.nullcontext() if warm_up else timers[mode]:
            bench_e2e.train_step(model, opt, False, stream[i % stream.shape[0]], device)
    model.set_attn_implementation(impl_name["fuseforge"])
    return {m: t.ms() for m, t in timers.items()}


def energy_ab(model, opt, stream, groups: int, steps_per_block: int, device,
              counter: harness.EnergyCounter) -> dict:
    """Joules a step per mode from the GPU's energy counter, over blocks of steps_per_block steps (a
    synchronize before and after each block) in A B B A order, `groups` times. With the step at the
    power cap, its time is about its energy over the cap's watts, so a kernel saves in the step what it
    saves in energy."""
    import torch
    import bench_e2e
    impl_name = impl_names()
    blocks = {m: [] for m in MODES}
    i = 0
    for mode in abba(groups):
        model.set_attn_implementation(impl_name[mode])
        torch.cuda.synchronize()
        e0, t0 = counter.joules(), time.perf_counter()
        for _ in range(steps_per_block):
            bench_e2e.train_step(model, opt, False, stream[i % stream.shape[0]], device)
            i += 1
        torch.cuda.synchronize()
        e1, t1 = counter.joules(), time.perf_counter()
        blocks[mode].append(((e1 - e0) / steps_per_block, 1000 * (t1 - t0) / steps_per_block))
    model.set_attn_implementation(impl_name["fuseforge"])
    return {m: {"j_step": round(harness.median(j for j, _ in b), 2), "ms_step": round(harness.median(t for _, t in b), 2),
                "watts": round(1000 * sum(j for j, _ in b) / sum(t for _, t in b), 1),
                "blocks": [[round(j, 2), round(t, 2)] for j, t in b]} for m, b in blocks.items()}


def step_summary(steps: dict, resamples: int = 4000) -> dict:
    """Per mode its median step; the saving (SDPA - fuseforge, ms) as the medians' difference and over
    the pairs of neighbouring steps (A B, then B A: steps timed next to each other): their median,
    quartiles, mean and the mean's bootstrap 95% interval (seeded resampling of the pairs)."""
    med = {m: harness.median(steps[m]) for m in MODES}
    diffs = sorted(b - a for a, b in zip(steps["fuseforge"], steps["sdpa"]))
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    out = {m: {"ms": round(med[m], 2), "step_ms": [round(x, 2) for x in steps[m]]} for m in MODES}
    out.update(saved_ms=round(med["sdpa"] - med["fuseforge"], 2), paired_saved_ms=round(harness.median(diffs), 2),
               paired_q1=round(diffs[len(diffs) // 4], 2), paired_q3=round(diffs[3 * len(diffs) // 4], 2),
               paired_mean_ms=round(statistics.fmean(diffs), 2),
               paired_mean_ci95=[round(means[int(0.025 * resamples)], 2), round(means[int(0.975 * resamples)], 2)])
    return out


def ab_write(result: dict, base: str) -> None:
    """base.json and base.md (the table, printed too)."""
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = ab_markdown(result)
    with open(base + ".md", "w") as f:
        f.write(md)
    print(md)


def attention_alone(model, batch: int, seq: int, rounds: int, device,
                    counter: Optional[harness.EnergyCounter]) -> dict:
    """ms of one layer's attention call, forward + backward and forward, per mode (interleaved rounds);
    with the energy counter also the forward + backward's energy a call."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    attn = model.model.layers[0].self_attn
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator(device=device).manual_seed(0)

    def leaf(heads):  # (B, S, H, D) memory, seen as (B, H, S, D): the projections' layout
        x = torch.randn(batch, seq, heads, d, device=device, dtype=torch.bfloat16, generator=g)
        return x.requires_grad_()

    q, k, v = leaf(cfg.num_attention_heads), leaf(cfg.num_key_value_heads), leaf(cfg.num_key_value_heads)
    grad = torch.randn(batch, seq, cfg.num_attention_heads, d, device=device, dtype=torch.bfloat16, generator=g)
    fns = {m: ALL_ATTENTION_FUNCTIONS[name] for m, name in impl_names().items()}
    benches = []
    for mode in MODES:
        def fwd(f=fns[mode]):
            return f(attn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, dropout=0.0,
                     scaling=attn.scaling, is_causal=True)[0]

        def fwdbwd(fwd=fwd):
            out = fwd()
            out.backward(grad.view_as(out))
            return out
        benches += [harness.Bench("layer", "fwdbwd", mode, fwdbwd), harness.Bench("layer", "fwd", mode, fwd)]
    with torch.no_grad():
        ref = benches[1].fn().float()
        err = (benches[3].fn().float() - ref).norm() / ref.norm()
    times = harness.time_interleaved(benches, rounds, rep_ms=200, settle_ms=300)
    out = {"rel_diff_fwd": float(err)}
    for b in benches:
        out.setdefault(b.pass_, {})[b.impl] = {"ms": harness.median(times[id(b)]), "rounds": times[id(b)]}
    if counter is not None:  # fwdbwd, A B B A, 2 s each
        fwdbwd = {b.impl: b.fn for b in benches if b.pass_ == "fwdbwd"}
        runs = {m: [] for m in MODES}
        for mode in abba(1):
            runs[mode].append(harness.energy_per_call(fwdbwd[mode], counter))
        out["energy_fwdbwd"] = {m: {"mj": round(statistics.fmean(r["mj"] for r in runs[m]), 3),
                                    "ms": round(statistics.fmean(r["ms"] for r in runs[m]), 4),
                                    "watts": round(statistics.fmean(r["watts"] for r in runs[m]), 1), "runs": runs[m]}
                                for m in MODES}
    return out


def ab_markdown(r: dict) -> str:
    """The table of an e2e-attention-ab result, with its provenance line."""
    s, a = r["step"], r["attention_alone"]
    layers = r["layers"]
    lines = [
        "| measured | fuseforge attention | SDPA attention (cuDNN) | SDPA - fuseforge |",
        "|---|---|---|---|",
        f"| training step, ms (median of {len(s['fuseforge']['step_ms'])} each, A B B A) | "
        f"{s['fuseforge']['ms']:.1f} | {s['sdpa']['ms']:.1f} | **{s['saved_ms']:+.2f}** "
        f"(paired: median {s['paired_saved_ms']:+.2f}, quartiles {s['paired_q1']:+.2f} .. {s['paired_q3']:+.2f}; "
        f"mean {s['paired_mean_ms']:+.2f}, bootstrap 95% {s['paired_mean_ci95'][0]:+.2f} .. "
        f"{s['paired_mean_ci95'][1]:+.2f}) |",
    ]
    for p in ("fwdbwd", "fwd"):
        f, c = a[p]["fuseforge"]["ms"], a[p]["sdpa"]["ms"]
        lines.append(f"| attention alone, {p}, one layer, ms | {f:.3f} | {c:.3f} | {c - f:+.3f} ({c / f:.2f}x) |")
    f, c = a["fwdbwd"]["fuseforge"]["ms"], a["fwdbwd"]["sdpa"]["ms"]
    lines.append(f"| attention alone, fwdbwd x {layers} layers, ms | {layers * f:.2f} | {layers * c:.2f} | "
                 f"**{layers * (c - f):+.2f}** |")
    energy, e_alone = r.get("energy_step"), a.get("energy_fwdbwd")
    if energy and e_alone:
        f, c = energy["fuseforge"], energy["sdpa"]
        lines.append(f"| energy a step, J (mean W; ms a step), {len(f['blocks'])} blocks of "
                     f"{r['energy_steps_per_block']} steps each | {f['j_step']:.1f} ({f['watts']:.0f} W; {f['ms_step']:.1f}) | "
                     f"{c['j_step']:.1f} ({c['watts']:.0f} W; {c['ms_step']:.1f}) | {c['j_step'] - f['j_step']:+.2f} J |")
        f, c = e_alone["fuseforge"], e_alone["sdpa"]
        lines.append(f"| attention alone, fwdbwd, energy a call, mJ (mean W; ms a call) | {f['mj']:.1f} "
                     f"({f['watts']:.0f} W; {f['ms']:.3f}) | {c['mj']:.1f} ({c['watts']:.0f} W; {c['ms']:.3f}) | "
                     f"{c['mj'] - f['mj']:+.1f} mJ ({c['mj'] / f['mj']:.3f}x) |")
        saved_j = layers * (c["mj"] - f["mj"]) / 1000
        watts = energy["fuseforge"]["watts"]
        lines.append(f"| the step saving the energy predicts: {layers} layers' saved energy / the step's mean power, ms "
                     f"| | | **{1000 * saved_j / watts:+.2f}** ({saved_j:+.3f} J / {watts:.0f} W) |")
    lines.append("")
    lines.append(f"{r['gpu']}, torch {r['torch']}, CUDA {r['cuda']}, commit `{r['commit']}`, {r['date']}; "
                 f"{r['case']}. The step difference is what fuseforge attention saves inside the step; the last "
                 f"row is what it saves alone (fwd output rel. diff between the two: {a['rel_diff_fwd']:.1e}).")
    return "\n".join(lines) + "\n"


def cmd_e2e_attention_ab(args) -> None:
    import torch
    import bench_e2e
    if args.summarize:
        with open(args.summarize) as f:
            result = json.load(f)
        steps = {m: result["step"][m]["step_ms"] for m in MODES}
        result["step"] = step_summary(steps)
        ab_write(result, os.path.splitext(args.summarize)[0])
        return
    if args.config not in bench_e2e.CONFIGS:
        raise SystemExit(f"--config: one of {', '.join(sorted(bench_e2e.CONFIGS))}")
    device = torch.device(args.device)
    cfg = bench_e2e.CONFIGS[args.config]
    result = {"op": "e2e_attention_ab", **harness.env_info(),
              "case": bench_e2e.case_name(cfg, args.seq, args.batch), "layers": cfg["num_hidden_layers"]}
    harness.log(f"e2e_attention_ab: {result['case']}, {args.pairs} A B B A groups")
    model, opt, _ = bench_e2e.make_impl("fuseforge_bf16", cfg, args.seq, device)[:3]
    g = torch.Generator().manual_seed(1234)
    stream = torch.randint(0, cfg["vocab_size"], (8, args.batch, args.seq), generator=g).to(device)
    from fuseforge.patch import stats
    before = dict(stats)
    steps = step_ab(model, opt, stream, args.pairs, device)
    calls = {k: stats[k] - before[k] for k in stats}
    expected = cfg["num_hidden_layers"] * (1 + 2 * args.pairs)  # a call a layer in each fuseforge step
    if calls != {"fuseforge": expected, "varlen": 0, "sdpa": 0}:  # fuseforge's kernel in every fuseforge step
        raise SystemExit(f"e2e_attention_ab: patched attention calls {calls}, expected {expected} fuseforge calls")
    result["patched_attention_calls"] = calls
    result["step"] = step_summary(steps)
    harness.log(f"  step: fuseforge {result['step']['fuseforge']['ms']:.1f} ms, sdpa {result['step']['sdpa']['ms']:.1f} ms")
    counter = energy_counter(device)
    if counter is not None and args.energy_groups > 0:
        result["energy_step"] = energy_ab(model, opt, stream, args.energy_groups, args.energy_steps, device, counter)
        result["energy_steps_per_block"] = args.energy_steps
    opt.zero_grad(set_to_none=True)
    del opt
    bench_e2e.free()
    result["attention_alone"] = attention_alone(model, args.batch, args.seq, args.rounds, device, counter)
    os.makedirs(args.out, exist_ok=True)
    ab_write(result, os.path.join(args.out, result["op"]))


# ---------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("ncu-cycles", description=NCU_DOC, formatter_class=raw, help="impls compared in cycles under ncu")
    s.add_argument("--bench", default="attention",
                   help="the benchmark whose cases and impls run: bench_<bench>.py (default attention)")
    s.add_argument("--cases", default="docs/T32768/H16/D128/causal")
    s.add_argument("--impls", default="fuseforge,flex")
    s.add_argument("--passes", default="fwdbwd", help="comma-separated: fwd, fwdbwd")
    s.add_argument("--out", default="", help="folder for <name>.json / <name>.md")
    s.add_argument("--name", default="", help="default <bench>_ncu_cycles")
    s.add_argument("--append", action="store_true",
                   help="add to the rows of <out>/<name>.json (a grid measured in several runs; same commit only)")
    s.add_argument("--traffic", action="store_true", help="also sum each call's L2 / DRAM / shared-memory traffic")
    s.set_defaults(func=cmd_ncu_cycles)

    s = sub.add_parser("kernel-times", description=KERNEL_TIMES_DOC, formatter_class=raw,
                       help="every kernel of one call and the idle time between them")
    s.add_argument("--bench", default="attention", help="bench_<bench>.py's cases and impls (default attention)")
    s.add_argument("--cases", default="D128/S1024/full,D128/S16384/full")
    s.add_argument("--impls", default="fuseforge,sdpa_cudnn")
    s.add_argument("--pass", dest="pass_", default="fwdbwd")
    s.add_argument("--calls", type=int, default=5)
    s.set_defaults(func=cmd_kernel_times)

    s = sub.add_parser("e2e-kernels", description=E2E_KERNELS_DOC, formatter_class=raw,
                       help="where a training step's device time goes, by kernel, per impl")
    s.add_argument("--config", default="1b", help="a bench_e2e.py config")
    s.add_argument("--seq", type=int, default=2048)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--impls", default="fuseforge,liger")
    s.add_argument("--steps", type=int, default=3)
    s.add_argument("--top", type=int, default=25, help="kernels listed an impl")
    s.set_defaults(func=cmd_e2e_kernels)

    s = sub.add_parser("e2e-attention-ab", description=AB_DOC, formatter_class=raw,
                       help="what fuseforge attention saves inside a training step")
    s.add_argument("--config", default="1b", help="a bench_e2e.py config (tiny for a smoke test)")
    s.add_argument("--seq", type=int, default=2048)
    s.add_argument("--batch", type=int, default=16, help="default 16: bench_e2e's probed batch on the H100 and H200")
    s.add_argument("--pairs", type=int, default=12, help="A B B A groups: 2 * pairs timed steps a mode")
    s.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the attention-alone timing")
    s.add_argument("--energy-groups", type=int, default=2,
                   help="A B B A groups of step blocks timed by the GPU's energy counter (0: none)")
    s.add_argument("--energy-steps", type=int, default=3, help="steps a block of the energy phase")
    s.add_argument("--out", default=harness.RESULTS_DIR)
    s.add_argument("--device", default="cuda", help="cpu: a smoke test (with --config tiny --seq 64 --batch 2)")
    s.add_argument("--summarize", metavar="JSON", help="recompute a result's step summary from its step times "
                   "and rewrite its .json and .md (no run)")
    s.set_defaults(func=cmd_e2e_attention_ab)

    s = sub.add_parser("workload", description=WORKLOAD_DOC, formatter_class=raw,
                       help="a few calls of one op, for ncu or compute-sanitizer to wrap")
    s.add_argument("op", choices=sorted(WORKLOADS))
    s.add_argument("args", nargs="*")
    s.set_defaults(func=cmd_workload)
    return p


def main(argv: Optional[list] = None) -> None:
    args = parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
