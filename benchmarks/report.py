"""Generates docs/benchmarks.md, every measured table, from benchmarks/results/*.json, and the headline
block of README.md (between <!-- headline --> and <!-- /headline -->) from the same files.

    python3 benchmarks/report.py            # rewrite both
    python3 benchmarks/report.py --check    # exit 1 if either is not what the JSON gives

Nothing here is typed by hand but the section titles and what each benchmark runs: every number comes
from a JSON file, and each table ends with that file's provenance (device, torch, CUDA, commit, date).
A results file is named <bench>_<gpu>.json (shared/BENCHMARKS.md); where several files hold the same
bench and device (a run written as <op>.json before it was renamed), the newest by its `date` is used.
The tables are rendered by the code that wrote them: harness.markdown_table, bench_attention_varlen's
notes_md, profiler.py's ratio_table (ncu-cycles) and ab_markdown (e2e-attention-ab). The output depends
only on the JSON files, so running this twice gives the same bytes.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import harness  # noqa: E402

RESULTS = os.path.join(HERE, "results")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
README = os.path.join(ROOT, "README.md")
DEVICE_ORDER = ("h200", "h100", "a100", "cpu")  # newest GPU first; others after these, by name

# (bench, title, what it runs). The bench is the results file's name without _<gpu>.
SECTIONS = [
    ("attention", "attention: the fixed-length grid against SDPA's backends",
     "`benchmarks/bench_attention.py`: bf16, B x S = 32768 tokens, H x D = 2048, causal and full, every "
     "SDPA backend in the same run, each pass's impls timed in turn over three rounds (a row is the median "
     "of its rounds, `ms_rounds` in the JSON). TFLOP/s count 4·B·H·S²·D for the forward (half with "
     "causal) and 3.5x that for forward+backward. The last rows (`B6/Hq16/Hk4...`, `B1/Hq32/Hk8...`) "
     "are the grouped-query shapes of the end-to-end 1.2B Llama and of an 8B Llama at batch 1."),
    ("attention_model", "attention: the grouped-query model shapes alone",
     "`bench_attention.py --cases B6/Hq16/Hk4/S2048/D128/causal,B1/Hq32/Hk8/S2048/D128/causal`: the "
     "model rows of the grid, rerun on their own."),
    ("attention_settled", "attention: each impl timed at its own steady clock",
     "`bench_attention.py --settle-ms 600 --rounds 2`: before each timing the impl runs back to back "
     "for 0.6 s, so it is timed at the clock its own power draw allows under the GPU's power cap "
     "rather than at the state the impl before it left. Rows move against the interleaved table "
     "above, some either way: neither regime is a training step."),
    ("attention_ncu_cycles", "attention: the grid at ncu's locked clock",
     "`benchmarks/profiler.py ncu-cycles`: every kernel of one warmed-up call summed under Nsight Compute, "
     "which locks the SM clock, so the ratio is one of cycles, free of the power cap."),
    ("attention_ncu_model", "attention: the end-to-end model's shape at ncu's locked clock",
     "`benchmarks/profiler.py ncu-cycles` on the B6/Hq16/Hk4/S2048/D128/causal case."),
    ("attention_varlen", "attention_varlen: windows, softcap and packed documents",
     "`benchmarks/bench_attention_varlen.py`: FlexAttention compiled (document or sliding-window "
     "`BlockMask` built outside the timed region, the softcap as `score_mod`), SDPA-cuDNN per document "
     "or on the padded batch. Cases: 32768 packed tokens of 18 documents; a 4096-key window on "
     "S = 16384; softcap 50 at head dims 128 and 256."),
    ("attention_varlen_energy", "attention_varlen: energy a call",
     "`bench_attention_varlen.py --energy-ms 2000`: NVML's energy counter over 2 s of each impl run "
     "back to back, after 0.3 s of itself."),
    ("attention_varlen_settled", "attention_varlen: each impl timed at its own steady clock",
     "`bench_attention_varlen.py --settle-ms 600 --rounds 2`."),
    ("attention_varlen_ncu_cycles", "attention_varlen at ncu's locked clock",
     "`benchmarks/profiler.py ncu-cycles`; FlexAttention's forward is its one kernel, its backward its two."),
    ("linear_cross_entropy", "linear_cross_entropy: the Llama-3 head",
     "`benchmarks/bench_linear_cross_entropy.py`: N = 8192 tokens, H = 4096, V = 128256, bf16; each "
     "pass's impls timed round-robin over 5 rounds. `lowmem` is `low_memory=True` (against Cut "
     "Cross-Entropy, the peer built for memory); `peaky` a confident model (target probability ~0.9). "
     "`rel_err` is the larger of grad_x's and grad_W's error against float64."),
    ("linear_cross_entropy_sweep", "linear_cross_entropy: the N x V sweep",
     "`bench_linear_cross_entropy.py --rounds 1` over N in {4096, 16384} and V in {32000, 128256, "
     "256000}; `compile` is `torch.compile(dynamic=True)`, one compilation for all shapes; "
     "`fuseforge_lowmem` is `low_memory=True`."),
    ("add_mul_act", "add_mul_act",
     "`benchmarks/bench_add_mul_act.py`: `act(x + 0.5 * y + bias)` on 16384 x 8192 for relu, gelu and "
     "silu in float32 and bf16 (forward, and forward+backward with every gradient), then a grid of "
     "small shapes (forward, float32 relu), where launch overhead dominates."),
    ("adamw", "AdamW",
     "`benchmarks/bench_adamw.py`: one optimizer step. `llama1b`: a 1B Llama's 953M parameters in "
     "float32, or in bf16 with float32 master weights (`bf16-master`); `small5000`: 5000 tensors of "
     "4096 elements. torch's impls on the same parameters: `torch_fused` (`fused=True`), "
     "`torch_foreach`, `compile` (`torch.compile` of the step)."),
    ("rms_norm", "rms_norm", "`benchmarks/bench_rms_norm.py`."),
    ("rotary", "rotary", "`benchmarks/bench_rotary.py`."),
    ("glu", "glu", "`benchmarks/bench_glu.py`."),
    ("e2e", "End to end: a 1.2B Llama with `fuseforge.patch`",
     "`benchmarks/bench_e2e.py`: a `transformers` LlamaForCausalLM (hidden 2048, 16 layers, 16 query "
     "heads on 4 KV heads, vocabulary 128256, S = 2048), random init, 50 steps on a fixed token stream, "
     "the batch the largest that keeps the eager recipe under 88% of the GPU. `eager`: fp32 weights, "
     "bf16 autocast, SDPA, `torch.optim.AdamW(fused=True)`; `fuseforge`: the same model patched, bf16 "
     "weights, `fuseforge.optim.AdamW(master_weights=True)`; `compile` / `fuseforge_compile`: "
     "`torch.compile` of each. The script now also runs Liger-Kernel's patch (`liger`); the stored runs "
     "below predate that row, and predate the patch's RMSNorm, rotary and gated-MLP routing."),
    ("e2e_attention_ab", "End to end: what fuseforge attention saves inside the training step",
     "`benchmarks/profiler.py e2e-attention-ab`: one patched model alternates its attention between fuseforge's and "
     "transformers' SDPA (cuDNN's kernels) step by step in A B B A order, beside the two attention calls "
     "alone at the model's shape and, where NVML reads, the energy of both. S = 2048 at batch 16."),
    ("e2e_attention_ab_s8192", "End to end: the attention A/B at S = 8192",
     "As above at S = 8192, batch 4 (the same tokens a step; attention is a larger share of it)."),
    ("fsdp", "FSDP2 on two GPUs",
     "`benchmarks/bench_fsdp.py` (starts itself under torchrun, one process a GPU): the end-to-end "
     "1.2B Llama, every decoder layer and then the root `fully_shard`-ed with "
     "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, the batch a rank the largest that "
     "keeps the unpatched model under 88% of the GPU. `eager`: the model as is with torch's fused "
     "AdamW; `fuseforge`: patched, with `fuseforge.optim.AdamW`. ms is the slower rank's median step, "
     "MiB the larger rank's peak. The second row steps the unpatched model's local shards with each "
     "optimizer in turn."),
    ("fsdp_b10", "FSDP2 on two GPUs, 10 sequences a rank", "`bench_fsdp.py --batch 10`."),
    ("fsdp_per_module", "FSDP2 on two GPUs, embedding and head sharded on their own",
     "`bench_fsdp.py --wrap per-module` (torchtitan's wrap), 10 sequences a rank."),
]

# The headline: (bench, impl, against, case filter, label). Speed-up = against's time / impl's.
HEADLINE = [
    ("attention", "fuseforge", "sdpa_cudnn", "^D", "attention (grid)"),
    ("attention", "fuseforge", "sdpa_flash", "^D", "attention (grid)"),
    ("attention", "fuseforge", "sdpa_cudnn", "^B", "attention (GQA model shapes)"),
    ("attention_varlen", "fuseforge", "flex", "", "attention_varlen"),
    ("attention_varlen", "fuseforge", "sdpa_cudnn_best", "docs", "attention_varlen"),
    ("linear_cross_entropy", "fuseforge", "compile", "!lowmem", "linear_cross_entropy"),
    ("linear_cross_entropy", "fuseforge", "liger", "!lowmem", "linear_cross_entropy"),
    ("linear_cross_entropy", "fuseforge", "cce", "lowmem", "linear_cross_entropy, low_memory"),
    ("add_mul_act", "fuseforge", "compile", "16384x8192", "add_mul_act, 16384 x 8192"),
    ("add_mul_act", "fuseforge", "eager", "16384x8192", "add_mul_act, 16384 x 8192"),
    ("adamw", "fuseforge", "torch_fused", "llama1b", "AdamW, 1B Llama (fp32; bf16 + fp32 masters)"),
    ("adamw", "fuseforge", "compile", "llama1b", "AdamW, 1B Llama (fp32; bf16 + fp32 masters)"),
    ("adamw", "fuseforge", "torch_fused", "small5000", "AdamW, 5000 small tensors"),
    ("e2e", "fuseforge", "eager", "", "1.2B Llama step, patched"),
    ("e2e", "fuseforge", "compile", "", "1.2B Llama step, patched"),
    ("e2e", "fuseforge_compile", "compile", "", "1.2B Llama step, patched + compiled"),
    ("fsdp", "fuseforge", "eager", "llama", "1.2B Llama step, FSDP2 x 2"),
    ("fsdp", "fuseforge", "torch_fused", "adamw", "AdamW step on FSDP2 shards"),
]


def _device_key(tag: str) -> tuple:
    return (DEVICE_ORDER.index(tag) if tag in DEVICE_ORDER else len(DEVICE_ORDER), tag)


def load_all(results_dir: str = RESULTS) -> dict:
    """{bench: {gpu tag: (file stem, result)}}: the newest file of each bench and device."""
    out: dict = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        result = harness.load_result(path)
        if "op" not in result or "gpu" not in result:
            continue
        stem = os.path.splitext(os.path.basename(path))[0]
        tag = harness.gpu_tag(result)
        bench = stem[: -len(tag) - 1] if stem.endswith("_" + tag) else stem
        current = out.setdefault(bench, {}).get(tag)
        if current is None or str(result.get("date", "")) > str(current[1].get("date", "")):
            out[bench][tag] = (stem, result)
    return out


def render(bench: str, result: dict) -> str:
    """The table the benchmark itself writes for this JSON, with its provenance line."""
    if "attention_alone" in result:
        import profiler
        return profiler.ab_markdown(result)
    if any("mcycles" in r for r in result.get("rows", [])):
        import profiler
        return profiler.ratio_table(result)
    table = harness.markdown_table(result)
    if result["op"] == "attention_varlen":
        import bench_attention_varlen
        table += bench_attention_varlen.notes_md(result)
    return table


def device_name(result: dict) -> str:
    return result["cpu"] if result.get("gpu") == "cpu" and "cpu" in result else result["gpu"]


def _case_matches(case: str, flt: str) -> bool:
    if not flt:
        return True
    if flt.startswith("^"):
        return case.startswith(flt[1:])
    return flt[1:] not in case if flt.startswith("!") else flt in case


def headline_rows(results: dict) -> list:
    """One row per HEADLINE entry and pass, from the newest GPU run of its bench."""
    rows = []
    for bench, impl, peer, flt, label in HEADLINE:
        runs = {t: v for t, v in results.get(bench, {}).items() if t != "cpu"}
        if not runs:
            continue
        stem, result = max(runs.values(), key=lambda v: str(v[1].get("date", "")))
        by = {(r["case"], r["pass"], r["impl"]): r for r in result["rows"] if r.get("ms")}
        for pass_ in dict.fromkeys(r["pass"] for r in result["rows"]):
            speed, mem = [], []
            for case in dict.fromkeys(r["case"] for r in result["rows"] if r["pass"] == pass_):
                a, b = by.get((case, pass_, impl)), by.get((case, pass_, peer))
                if not (a and b and _case_matches(case, flt)):
                    continue
                speed.append(b["ms"] / a["ms"])
                if a.get("peak_extra_mib", 0) >= 1 and b.get("peak_extra_mib", 0) >= 1:  # not noise-sized
                    mem.append(a["peak_extra_mib"] / b["peak_extra_mib"])
            if speed:
                rows.append((label, harness.gpu_tag(result).upper(), pass_, impl, peer, speed, mem, stem))
    return rows


def _span(xs: list, fmt: str = "{:.2f}x") -> str:
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if f"{lo:.2f}" == f"{hi:.2f}" else f"{fmt.format(lo)} - {fmt.format(hi)}"


def headline_table(results: dict, link_prefix: str) -> str:
    lines = ["| op | GPU | pass | speed-up over | min - max | rows slower | peak memory, ours / theirs |",
             "|---|---|---|---|---|---|---|"]
    for label, gpu, pass_, impl, peer, speed, mem, stem in headline_rows(results):
        who = peer if impl == "fuseforge" else f"{peer} (ours: {impl})"
        slower = sum(1 for s in speed if s < 1.0)
        lines.append(f"| {label} | {gpu} | {pass_} | {who} | {_span(speed)} | {slower} of {len(speed)} | "
                     f"{_span(mem) if mem else '-'} |")
    lines.append("")
    lines.append("Speed-up = the peer's median time / fuseforge's over the rows of the newest GPU run of each "
                 "benchmark (above 1: fuseforge is faster); `rows slower` counts the rows where it is not. "
                 f"Every row's table, device, commit and date: [docs/benchmarks.md]({link_prefix}docs/benchmarks.md).")
    return "\n".join(lines) + "\n"


def plots(results: dict, link_prefix: str) -> str:
    """One plot per op, the newest GPU run's."""
    out = []
    for bench in ("attention", "attention_varlen", "linear_cross_entropy", "add_mul_act", "adamw", "e2e"):
        runs = {t: v for t, v in results.get(bench, {}).items() if t != "cpu"}
        if not runs:
            continue
        stem, _ = max(runs.values(), key=lambda v: str(v[1].get("date", "")))
        if os.path.exists(os.path.join(RESULTS, stem + ".png")):
            out.append(f"![{stem}]({link_prefix}benchmarks/results/{stem}.png)")
    return "\n".join(out) + "\n"


def benchmarks_md(results: dict) -> str:
    parts = [
        "# Benchmarks",
        "",
        "<!-- Generated by `python3 benchmarks/report.py` from benchmarks/results/*.json; do not edit. -->",
        "",
        "Every table below is generated from a JSON file in `benchmarks/results/` (one file per "
        "benchmark and device, `<bench>_<gpu>.json`, written by `benchmarks/harness.py`). Times are medians of device-event timings after warm-up (CPU: "
        "wall-clock medians), every impl of a row measured in the same process and run; `MiB` is the "
        "peak memory a pass allocates beyond its inputs. `vs X` = X's time / fuseforge's: above 1, "
        "fuseforge is faster. Peers that were not installed are left out, not faked. Each table ends "
        "with its run's device, torch, CUDA, commit and date.",
        "",
        "On the H100 and H200 the longer rows run at the 700 W power cap, where each kernel gets the "
        "clock its own power draw allows; the tables of nvidia-smi's clock and power samples under the "
        "timings show it, and the locked-clock (ncu) and settled tables measure the same kernels in the "
        "other two regimes.",
        "",
        "## Summary",
        "",
        headline_table(results, "../").replace("[docs/benchmarks.md](../docs/benchmarks.md)", "the sections below"),
    ]
    for bench, title, what in SECTIONS:
        runs = results.get(bench, {})
        parts += [f"## {title}", "", what, ""]
        if not runs:
            parts += [f"GPU tables pending: no stored run of this benchmark yet "
                      f"(`python3 benchmarks/bench_{bench}.py` writes one).", ""]
            continue
        for tag in sorted(runs, key=_device_key):
            stem, result = runs[tag]
            parts += [f"### {device_name(result)}", "", render(bench, result).rstrip("\n"), ""]
            if os.path.exists(os.path.join(RESULTS, stem + ".png")):
                parts += [f"![{stem}](../benchmarks/results/{stem}.png)", ""]
            loss = os.path.join(RESULTS, f"{bench}_loss_{tag}.png")
            if os.path.exists(loss):
                parts += [f"![{bench} loss curves, {tag}](../benchmarks/results/{os.path.basename(loss)})", ""]
    return "\n".join(parts).rstrip("\n") + "\n"


def readme_block(text: str, results: dict) -> str:
    start, end = "<!-- headline -->", "<!-- /headline -->"
    if start not in text or end not in text:
        raise SystemExit(f"README.md has no {start} ... {end} block")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    block = headline_table(results, "") + "\n" + plots(results, "")
    return head + start + "\n" + block + end + tail


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md or README.md's block is stale")
    args = p.parse_args(argv)
    results = load_all()
    doc = benchmarks_md(results)
    with open(README) as f:
        readme = f.read()
    new_readme = readme_block(readme, results)
    stale = []
    old_doc = open(DOC).read() if os.path.exists(DOC) else ""
    for path, old, new in ((DOC, old_doc, doc), (README, readme, new_readme)):
        if old != new:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    if args.check:
        if stale:
            print("stale: " + ", ".join(stale) + " (run python3 benchmarks/report.py)")
            return 1
        return 0
    print("wrote " + (", ".join(stale) if stale else "nothing (up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
