"""Issue 17's end-to-end bar: does the patched training step improve by what fuseforge attention saves?

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

    FUSEFORGE_COMMIT=<sha> PYTHONPATH=python python3 scripts/e2e_attention_ab.py [--batch 16] [--pairs 12]
Writes e2e_attention_ab.json and .md into --out (default benchmarks/results).
"""
import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_e2e  # noqa: E402
import harness  # noqa: E402

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


def step_ab(model, opt, stream: torch.Tensor, pairs: int, device) -> dict:
    """Step times (ms) per mode: `pairs` A B B A groups after one warm-up step of each mode."""
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


def energy_ab(model, opt, stream: torch.Tensor, groups: int, steps_per_block: int, device,
              counter: harness.EnergyCounter) -> dict:
    """Joules a step per mode from the GPU's energy counter, over blocks of steps_per_block steps (a
    synchronize before and after each block) in A B B A order, `groups` times. With the step at the
    power cap, its time is about its energy over the cap's watts, so a kernel saves in the step what it
    saves in energy."""
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


def write(result: dict, base: str) -> None:
    """base.json and base.md (the table, printed too)."""
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(base + ".md", "w") as f:
        f.write(md)
    print(md)


def attention_alone(model, batch: int, seq: int, rounds: int, device,
                    counter: Optional[harness.EnergyCounter]) -> dict:
    """ms of one layer's attention call, forward + backward and forward, per mode (interleaved rounds);
    with the energy counter also the forward + backward's energy a call."""
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


def markdown(r: dict) -> str:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(bench_e2e.CONFIGS), default="1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="default 16: bench_e2e's probed batch on the H100 and H200")
    p.add_argument("--pairs", type=int, default=12, help="A B B A groups: 2 * pairs timed steps a mode")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the attention-alone timing")
    p.add_argument("--energy-groups", type=int, default=2,
                   help="A B B A groups of step blocks timed by the GPU's energy counter (0: none)")
    p.add_argument("--energy-steps", type=int, default=3, help="steps a block of the energy phase")
    p.add_argument("--out", default=harness.RESULTS_DIR)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test (with --config tiny --seq 64 --batch 2)")
    p.add_argument("--summarize", metavar="JSON", help="recompute a result's step summary from its step times "
                   "and rewrite its .json and .md (no run)")
    args = p.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            result = json.load(f)
        steps = {m: result["step"][m]["step_ms"] for m in MODES}
        result["step"] = step_summary(steps)
        write(result, os.path.splitext(args.summarize)[0])
        return
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
    write(result, os.path.join(args.out, result["op"]))


if __name__ == "__main__":
    main()
