"""Every kernel of one attention forward+backward (or forward), per impl, under ncu at its locked SM
clock: impls compared in cycles, apart from the clock each would get at the H100's power cap (GPU machine).
   python3 scripts/ncu_pass_cycles.py --cases docs/T32768/H16/D128/causal,window4096/B2/H16/S16384/D128/causal \
       --impls fuseforge,flex
   python3 scripts/ncu_pass_cycles.py --cases D64/S1024/full,D128/S16384/causal --impls fuseforge,sdpa_cudnn \
       --passes fwd,fwdbwd --out benchmarks/results    (writes attention_ncu_cycles.json / .md there)
Cases of bench_attention.py ("D128/S16384/causal": impls fuseforge, sdpa_cudnn, sdpa_flash, and
cublas_gemm: one bf16 matmul with the case's useful FLOPs, the GEMM ceiling at the same clock) or of
bench_attention_varlen.py (fuseforge, flex). Runs `ncu --profile-from-start off` on
scripts/kernel_workload.py attention_profiled (one warmed-up call inside cudaProfilerStart / Stop)
and prints, per impl and pass, the kernels' summed duration and elapsed cycles, and its five longest
kernels, then a table of the peers' ratios (with --out also as <name>.json, with the GPU, torch and
commit, and <name>.md, which scripts/update_readme.py pastes into the README). ncu flushes the caches before each kernel and serializes
them, so the sums leave out launch gaps.
--traffic adds what each call moves, summed over its kernels (L2 bytes, of them reductions and
atomics, DRAM bytes, shared-memory wavefronts, instructions): where a power-capped row's energy
goes when its cycles lead (<name>_traffic.md with --out). Metrics this ncu does not list for the
chip are left out with a note.
"""
import argparse
import csv
import io
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}


# --traffic: (column, metric, factor from the metric's base unit to the column's).
TRAFFIC = (("l2_MB", "lts__t_bytes.sum", 1e-6), ("l2_red_MB", "lts__t_sectors_op_red.sum", 32e-6),
           ("l2_atom_MB", "lts__t_sectors_op_atom.sum", 32e-6), ("l2_read_MB", "lts__t_sectors_op_read.sum", 32e-6),
           ("l2_write_MB", "lts__t_sectors_op_write.sum", 32e-6), ("dram_MB", "dram__bytes.sum", 1e-6),
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
    """{kernel launch id: {"name", "ms", "cycles", and each traffic column}} from `ncu --csv` output
    (the workload's own prints before ncu's header are skipped)."""
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


def profile(case: str, impl: str, pass_: str, traffic: tuple = ()) -> dict | None:
    """parse_ncu_csv of one forward+backward (pass_ "fwdbwd") or forward; None where ncu refused the
    traffic metrics (main then profiles without them)."""
    metrics = ",".join(["gpu__time_duration.sum", "sm__cycles_elapsed.max"] + [t[1] for t in traffic])
    cmd = ["ncu", "--profile-from-start", "off", "--metrics", metrics, "--csv",
           sys.executable, os.path.join(ROOT, "scripts", "kernel_workload.py"), "attention_profiled", case, impl, pass_]
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
            "kernel of one warmed-up call summed (`scripts/ncu_pass_cycles.py`). `X / fuseforge` = X's time "
            "/ fuseforge's at that one clock.\n")


def traffic_table(result: dict) -> str:
    """Markdown: per case, pass and impl, each traffic column summed over the call's kernels."""
    cols = [c for c, _, _ in TRAFFIC if any(c in r for r in result["rows"])]
    lines = ["| case | pass | impl | ms | " + " | ".join(cols) + " |", "|" + "---|" * (4 + len(cols))]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['pass']} | {r['impl']} | {r['ms']:.4g} | "
                     + " | ".join(f"{r[c]:.4g}" if c in r else "-" for c in cols) + " |")
    return ("\n".join(lines) + f"\n\n{result['gpu']}, commit `{result['commit'][:12]}`: every kernel of one "
            "warmed-up call summed under ncu (`scripts/ncu_pass_cycles.py --traffic`); MB = 10^6 bytes "
            "(sectors x 32 for reductions, atomics, reads, writes), M = 10^6.\n")


def save(args, result: dict) -> None:
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, args.name + ".json"), "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="docs/T32768/H16/D128/causal")
    ap.add_argument("--impls", default="fuseforge,flex")
    ap.add_argument("--passes", default="fwdbwd", help="comma-separated: fwd, fwdbwd")
    ap.add_argument("--out", default="", help="folder for <name>.json / <name>.md")
    ap.add_argument("--name", default="attention_ncu_cycles")
    ap.add_argument("--append", action="store_true",
                    help="add to the rows of <out>/<name>.json (a grid too long for one device call; same commit only)")
    ap.add_argument("--traffic", action="store_true", help="also sum each call's L2 / DRAM / shared-memory traffic")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from harness import env_info
    result = {"op": args.name, **env_info(), "rows": []}
    path = os.path.join(args.out, args.name + ".json")
    if args.append and os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        if earlier["commit"] != result["commit"]:
            sys.exit(f"--append: {path} is from commit {earlier['commit']}, this tree is {result['commit']}")
        result["rows"] = earlier["rows"]
        result["dates"] = earlier.get("dates", [earlier["date"]]) + [result["date"]]  # one per device call
    impls = args.impls.split(",")
    traffic = available_traffic() if args.traffic else ()
    for case in args.cases.split(","):
        for pass_ in args.passes.split(","):
            for impl in impls:
                kernels = profile(case, impl, pass_, traffic)
                if kernels is None:  # the cycles still count: this row and the rest without traffic
                    traffic = ()
                    kernels = profile(case, impl, pass_)
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
                save(args, result)  # after every row: a device call cut short keeps what it measured
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


if __name__ == "__main__":
    main()
