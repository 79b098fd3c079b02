"""FSDP2 on several GPUs: bench_e2e's 1.2B Llama trained under `fully_shard`, fuseforge-patched
against unpatched, step time and peak memory per rank; and the AdamW step alone on the same shards,
fuseforge.optim.AdamW against torch.optim.AdamW(fused=True).

Run it as a plain script: it starts itself under torchrun, one process a GPU (`--nproc`, default 2;
on a machine without GPUs a smoke test of the tiny config on 2 gloo processes, results in a temp folder).

Case ``fsdp2x<ranks>/llama-hf/<config>`` (b = sequences per rank, by bench_e2e's rule: the largest batch that
keeps eager's peak under 88% of the GPU, probed on the sharded model): every decoder layer and then the
root are `fully_shard`-ed with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the recipe
torchtitan uses: fp32 sharded parameters, gradients and AdamW moments, bf16 compute and all-gathers,
fp32 reduce-scatters. Every rank reads its own fixed random token stream (labels = inputs).
- eager: the Hugging Face model as is (SDPA attention, logits + F.cross_entropy), torch.optim.AdamW(fused=True).
- fuseforge: the same model (same seed, same init) after fuseforge.patch (fuseforge attention, the loss by
  linear_cross_entropy: no logits), fuseforge.optim.AdamW (one launch updates every local shard).
Step time: median of device-event times of steps 6..N on each rank; the row gives the slowest rank's
(ranks run in lockstep: the collectives join them). Peak memory: torch.cuda.max_memory_allocated() of the
training steps minus what the rank held before the model was built (so the sharded weights, gradients,
optimizer states, unsharded layers in flight and activations count), the largest over ranks.

Case ``fsdp2x<ranks>/adamw-shards/...``: the unpatched model's sharded parameters after one backward;
torch's fused AdamW and fuseforge's AdamW step them in turn (each with its own states), median of
device-event times, the slowest rank.

Bars: step >= 1.15x eager's speed, peak memory per rank <= 0.75x eager's, AdamW on the shards
>= 1.1x torch fused; losses within 1% of eager's (mean |diff| over the steps, as bench_e2e).

    python benchmarks/bench_fsdp.py                  # 2 GPUs: writes benchmarks/results/fsdp.json/.md/.png
    python benchmarks/bench_fsdp.py --nproc 4 --batch 6 --steps 30
    python benchmarks/bench_fsdp.py --wrap per-module   # embedding and head sharded on their own: fsdp_per_module.json
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as bench_e2e

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
import bench_e2e  # noqa: E402  (the model, its configs, hyperparameters and flop count)
import harness  # noqa: E402

WARMUP_STEPS = bench_e2e.WARMUP_STEPS
ADAMW_WARMUP, ADAMW_REPS = 3, 20


def parse_args(argv=None):
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs); default 2")
    p.add_argument("--config", choices=sorted(bench_e2e.CONFIGS), default="1b" if on_gpu else "tiny")
    p.add_argument("--seq", type=int, default=2048 if on_gpu else 128)
    p.add_argument("--batch", default="auto" if on_gpu else "2",
                   help="sequences per rank, an int or auto: bench_e2e's rule, the largest that keeps every "
                        "rank's eager peak under 88%% of its GPU")
    p.add_argument("--steps", type=int, default=20 if on_gpu else 4)
    p.add_argument("--impls", default="eager,fuseforge", help="eager first (the reference of the bars)")
    p.add_argument("--no-adamw", action="store_true", help="skip the AdamW-on-shards case")
    p.add_argument("--wrap", choices=["root", "per-module"], default="root",
                   help="root: the embedding, final norm and head belong to the root's FSDP group (the "
                        "README's run); per-module: the embedding and the head are fully_shard-ed on their "
                        "own first, as torchtitan does (their gathers and reduce-scatters then overlap the layers')")
    p.add_argument("--out", default=harness.RESULTS_DIR if on_gpu else os.path.join(tempfile.gettempdir(), "fuseforge_fsdp_cpu"))
    p.add_argument("--cases", default="", help="ignored; accepted like the other benchmarks")
    p.add_argument("--no-memory", action="store_true", help="ignored: memory is always measured")
    return p.parse_args(argv)


def relaunch(args, argv) -> int:
    """Starts this script under torchrun, one process a GPU (gloo processes without GPUs)."""
    n = args.nproc
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise SystemExit(f"--nproc {n} needs {n} GPUs, this machine has {torch.cuda.device_count()}")
    env = dict(os.environ, FUSEFORGE_FSDP_WORKER="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           os.path.abspath(__file__), *argv]
    harness.log(f"fsdp: starting {n} processes: {' '.join(cmd[1:])}")
    return subprocess.call(cmd, env=env)


def setup() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def build(impl: str, cfg: dict, seq: int, device, wrap: str):
    """(FSDP2 model, optimizer) for one impl; the same weights on every rank and for every impl."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = bench_e2e.build_model(cfg, seq, device)
    if impl == "fuseforge":
        import fuseforge  # noqa: F401
        from fuseforge.patch import patch
        model = patch(model)
    # fuseforge's CPU kernels run float32: the smoke test on gloo shards without a bf16 policy.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    kw = {"mp_policy": mp} if mp else {}
    if wrap == "per-module":  # bench_e2e's model has an untied head (the patched loss runs in its call)
        fully_shard(model.model.embed_tokens, **kw)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    if wrap == "per-module":
        fully_shard(model.lm_head, **kw)
    fully_shard(model, **kw)  # the root: what is left (the final norm; root: embeddings and lm_head too)
    if impl == "fuseforge":
        from fuseforge.optim import AdamW
        opt = AdamW(model.parameters(), **bench_e2e.HYPER)
    else:
        opt = torch.optim.AdamW(model.parameters(), **bench_e2e.HYPER, fused=device.type == "cuda")
    return model, opt


def probe_batch(cfg: dict, seq: int, device, rank: int, wrap: str) -> int:
    """bench_e2e.probe_batch under FSDP2: eager's peaks per rank, the largest over ranks."""
    if device.type != "cuda":
        return 2
    bench_e2e.free()
    model, opt = build("eager", cfg, seq, device, wrap)
    peaks = bench_e2e.step_peaks(lambda ids: train_step(model, opt, ids), cfg["vocab_size"], seq, device)
    del model, opt
    bench_e2e.free()
    t = torch.tensor(peaks, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    batch, msg = bench_e2e.batch_from_peaks([int(x) for x in t.tolist()],
                                            torch.cuda.get_device_properties(device).total_memory)
    if rank == 0:
        harness.log(f"probe: eager (a rank) {msg} a rank")
    return batch


def train_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def run_impl(impl: str, cfg: dict, seq: int, stream: torch.Tensor, device, rank: int, wrap: str) -> dict:
    bench_e2e.free()
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    model, opt = build(impl, cfg, seq, device, wrap)
    if cuda:  # the unsharded fp32 model existed for a moment while fully_shard split it: not a training cost
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if rank == 0:
        harness.log(f"  {impl}: built and sharded in {time.perf_counter() - t0:.1f} s")
    timer, losses = harness.StepTimer(cuda), []
    t0 = time.perf_counter()
    for step in range(stream.shape[0]):
        with timer:
            losses.append(train_step(model, opt, stream[step]))
        if step == 0 and rank == 0:
            harness.log(f"  {impl}: first step done after {time.perf_counter() - t0:.1f} s, loss {losses[0].item():.4f}")
    step_ms = timer.ms()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    curve = torch.stack(losses).float()
    dist.all_reduce(curve)  # the mean loss over ranks, step by step
    curve = [float(x) for x in (curve / dist.get_world_size()).cpu()]
    ms = harness.median(step_ms[WARMUP_STEPS:] or step_ms)  # the first steps allocate
    del model, opt, losses
    bench_e2e.free()
    if rank == 0:
        harness.log(f"  {impl}: rank 0 step {ms:.1f} ms, peak {peak and round(peak)} MiB, "
                    f"loss {curve[0]:.4f} -> {curve[-1]:.4f}, wall {time.perf_counter() - t0:.1f} s")
    return {"ms": ms, "peak": peak, "curve": curve, "step_ms": step_ms}


def run_adamw(cfg: dict, seq: int, ids: torch.Tensor, device, rank: int, wrap: str) -> dict:
    """torch fused vs fuseforge AdamW stepping the same local shards, alternately."""
    import fuseforge  # noqa: F401
    from fuseforge.optim import AdamW
    bench_e2e.free()
    model, _ = build("eager", cfg, seq, device, wrap)
    model(input_ids=ids, labels=ids).loss.backward()  # DTensor grads on every parameter
    params = [p for p in model.parameters() if p.grad is not None]
    opts = {"torch_fused": torch.optim.AdamW(params, **bench_e2e.HYPER, fused=device.type == "cuda"),
            "fuseforge": AdamW(params, **bench_e2e.HYPER)}
    timers = {k: harness.StepTimer(device.type == "cuda") for k in opts}
    for rep in range(ADAMW_WARMUP + ADAMW_REPS):
        for k, opt in opts.items():
            if rep < ADAMW_WARMUP:
                opt.step()
            else:
                with timers[k]:
                    opt.step()
    local = sum(p.to_local().numel() for p in params)
    out = {k: harness.median(t.ms()) for k, t in timers.items()}
    out["params"], out["local_elements"] = len(params), local
    out["elements"] = sum(p.numel() for p in params)
    if rank == 0:
        harness.log(f"  adamw on {len(params)} shards ({local / 1e6:.1f}M elements on rank 0): "
                    + ", ".join(f"{k} {v:.3f} ms" for k, v in out.items() if k in opts))
    del model, opts, params
    bench_e2e.free()
    return out


def worker(args) -> None:
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = bench_e2e.CONFIGS[args.config]
    impls = [i for i in args.impls.split(",") if i]
    if impls[0] != "eager":
        raise SystemExit("--impls must start with eager (the reference of the bars)")
    args.batch = probe_batch(cfg, args.seq, device, rank, args.wrap) if args.batch == "auto" else int(args.batch)
    tokens = args.batch * args.seq  # per rank
    case = f"fsdp2x{world}{'' if args.wrap == 'root' else '-per-module'}/" + bench_e2e.case_name(cfg, args.seq, args.batch)
    g = torch.Generator().manual_seed(1234 + rank)  # every rank its own data
    stream = torch.randint(0, cfg["vocab_size"], (args.steps, args.batch, args.seq), generator=g).to(device)
    flops = bench_e2e.model_flops(cfg, args.seq, tokens)  # per rank
    op = "fsdp" if args.wrap == "root" else "fsdp_per_module"  # results/<op>_<gpu>.json: runs of both wraps side by side
    result = {"op": op, "wrap": args.wrap, **harness.env_info(), "ranks": world, "backend": dist.get_backend(), "rows": []}
    if rank == 0:
        harness.log(f"fsdp: {case}, {world} ranks ({dist.get_backend()}), {args.steps} steps, impls {impls}, "
                    f"{flops / 1e12:.1f} TFLOP a step per rank")
        result["ceilings"] = harness.measure_ceilings() if device.type == "cuda" else {}
    eager = None
    for impl in impls:
        r = run_impl(impl, cfg, args.seq, stream, device, rank, args.wrap)
        gathered = [None] * world
        dist.all_gather_object(gathered, {"ms": r["ms"], "peak": r["peak"], "step_ms": r["step_ms"]})
        if rank != 0:
            continue
        ms = max(x["ms"] for x in gathered)
        peaks = [x["peak"] for x in gathered]
        peak = max(peaks) if None not in peaks else None
        row = {"case": case, "pass": "step", "impl": impl, "ms": harness._round(ms),
               "TFLOPs": harness._round(flops / ms / 1e9), "tokens_per_s": round(world * tokens / ms * 1000),
               "batch_per_rank": args.batch, "steps": args.steps,
               "ms_per_rank": [harness._round(x["ms"]) for x in gathered]}
        if peak is not None:
            row["peak_extra_mib"] = round(peak, 1)
            row["peak_per_rank_mib"] = [round(x, 1) for x in peaks]
        row["mean_loss"] = harness._round(sum(r["curve"]) / len(r["curve"]), 6)
        if impl == "eager":
            eager = {"ms": ms, "peak": peak, "curve": r["curve"]}
        else:
            diff = sum(abs(a - b) for a, b in zip(r["curve"], eager["curve"])) / len(r["curve"])
            row["mean_abs_loss_diff_rel"] = harness._round(diff / (sum(eager["curve"]) / len(eager["curve"])), 3)
            row["speedup_vs_eager"] = harness._round(eager["ms"] / ms, 3)
            if peak is not None and eager["peak"]:
                row["peak_vs_eager"] = harness._round(peak / eager["peak"], 3)
            if impl == "fuseforge":
                result.setdefault("bars", {}).update({
                    "loss_curve_mean_abs_diff_le_1pct": row["mean_abs_loss_diff_rel"] <= 0.01,
                    "step_time_ge_1.15x": row["speedup_vs_eager"] >= 1.15,
                    "peak_memory_per_rank_le_0.75x": row.get("peak_vs_eager", math.inf) <= 0.75})
        row["loss_curve"] = [round(x, 5) for x in r["curve"]]
        row["step_ms_rank0"] = [round(x, 2) for x in gathered[0]["step_ms"]]
        result["rows"].append(row)
        harness.write(result, args.out)  # after every impl: a later failure keeps what was measured
    if not args.no_adamw:
        a = run_adamw(cfg, args.seq, stream[0], device, rank, args.wrap)
        gathered = [None] * world
        dist.all_gather_object(gathered, a)
        if rank == 0:
            adam_case = (f"fsdp2x{world}/adamw-shards/{a['params']}-params-{a['elements'] / 1e9:.2f}B-fp32")
            ms = {k: max(x[k] for x in gathered) for k in ("torch_fused", "fuseforge")}
            for impl in ("torch_fused", "fuseforge"):
                row = {"case": adam_case, "pass": "step", "impl": impl, "ms": harness._round(ms[impl], 4),
                       "ms_per_rank": [harness._round(x[impl], 4) for x in gathered],
                       "local_elements_per_rank": [x["local_elements"] for x in gathered],
                       # read + write of param, grad (read), exp_avg, exp_avg_sq: 7 fp32 streams
                       "GBps": harness._round(7 * 4 * max(x["local_elements"] for x in gathered) / ms[impl] / 1e6)}
                if impl == "fuseforge":
                    row["speedup_vs_torch_fused"] = harness._round(ms["torch_fused"] / ms[impl], 3)
                    result.setdefault("bars", {})["adamw_on_shards_ge_1.1x_torch_fused"] = row["speedup_vs_torch_fused"] >= 1.1
                result["rows"].append(row)
    if rank == 0:
        if "bars" in result:
            harness.log(f"bars: {result['bars']}")
        harness.write(result, args.out)
    dist.barrier()
    time.sleep(0.05)  # gloo: let its worker thread drop its tensors before shutdown (train_distributed.py says why)
    dist.destroy_process_group()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.environ.get("FUSEFORGE_FSDP_WORKER") == "1" and "LOCAL_RANK" in os.environ:
        worker(args)
        return 0
    return relaunch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
