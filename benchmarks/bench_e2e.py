"""End to end (issue 7): 50 training steps of a Hugging Face LlamaForCausalLM, eager against
fuseforge.patch and torch.compile, in one process, one impl after the other.

Case ``llama-hf/<config>``: random init, hidden 2048, 16 layers, 16 heads (4 KV heads), intermediate
5632, vocab 128256, sequence 2048, the batch chosen to fit eager (probed: the largest that keeps
eager's peak under 88% of the GPU), 50 steps on a fixed random token stream (labels = inputs).

impls
- eager: the standard mixed-precision recipe: fp32 weights, bf16 autocast, transformers' SDPA
  attention, torch.optim.AdamW(fused=True).
- fuseforge: the same model (same seed, same init) patched with fuseforge.patch (fuseforge attention,
  the loss by linear_cross_entropy), bf16 weights with fuseforge.optim.AdamW(master_weights=True):
  fp32 master weights and fp32 moments, the recipe fuseforge recommends.
- fuseforge_sdpa (not in the defaults): the fuseforge recipe with attention left to transformers'
  SDPA (cuDNN's kernel on Hopper): its step time minus fuseforge's is what fuseforge attention saves
  inside the patched step.
- compile: torch.compile of the eager model (same recipe as eager).
- fuseforge_compile: the fuseforge recipe with torch.compile of the patched model (the ops trace
  without graph breaks; compile fuses what fuseforge leaves to eager: RMSNorm, rotary, SwiGLU,
  residual adds).
The compiled impls come last, because their first step (the compilation) takes minutes: results are
written after every impl, so a caller's timeout keeps the rows before. FUSEFORGE_E2E_IMPLS=eager,fuseforge
(or --impls) skips them.

Measured: the loss of every step (the curves go in the JSON and in e2e_loss.png), the step time
(median of device-event times of steps 6..50: the first five include allocation and autotuning),
and the peak memory of the whole run (torch.cuda.max_memory_allocated() from before the model is
built: weights, gradients, optimizer state and activations; `peak_extra_mib`).
Bars: mean |loss - eager loss| <= 1% of eager's mean loss; step time >= 1.1x faster than eager;
peak memory <= 0.7x eager's.

    python benchmarks/bench_e2e.py                    # the issue's case, on a GPU
    python benchmarks/bench_e2e.py --impls eager,fuseforge   # without torch.compile
    python benchmarks/bench_e2e.py                    # no GPU: a tiny smoke test, results in a temp folder
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # same allocator for every impl

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
import harness  # noqa: E402

CONFIGS = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=128256),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=1000),
}
WARMUP_STEPS = 5
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def case_name(cfg: dict, seq: int, batch: int) -> str:
    return (f"llama-hf/h{cfg['hidden_size']}-l{cfg['num_hidden_layers']}-q{cfg['num_attention_heads']}"
            f"-kv{cfg['num_key_value_heads']}-i{cfg['intermediate_size']}-v{cfg['vocab_size']}-s{seq}-b{batch}")


def build_model(cfg: dict, seq: int, device, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**cfg, max_position_embeddings=seq, tie_word_embeddings=False, use_cache=False,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)  # fp32, initialised on the device from the seed
    model.train()
    return model


def make_impl(impl: str, cfg: dict, seq: int, device):
    """(model, optimizer, autocast on?) for one impl, built from the same seed."""
    model = build_model(cfg, seq, device)
    fused = device.type == "cuda"
    if impl == "eager":
        return model, torch.optim.AdamW(model.parameters(), **HYPER, fused=fused), True
    if impl == "compile":
        opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=fused)
        return torch.compile(model), opt, True
    if impl in ("fuseforge", "fuseforge_compile", "fuseforge_sdpa"):
        import fuseforge  # noqa: F401
        from fuseforge.optim import AdamW
        from fuseforge.patch import patch
        model = patch(cast_parameters(model, torch.bfloat16))
        if impl == "fuseforge_sdpa":  # the loss and the optimizer stay fuseforge's
            model.set_attn_implementation("sdpa")
        opt = AdamW(model.parameters(), **HYPER, master_weights=True)
        return (torch.compile(model) if impl == "fuseforge_compile" else model), opt, False
    raise ValueError(impl)


def cast_parameters(model, dtype):
    """Casts the parameters only: model.to(dtype) would also round the rotary embedding's fp32
    inv_freq buffer to bf16, which shifts the rotation angles at long positions."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model


def train_step(model, opt, autocast: bool, ids: torch.Tensor, device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def step_peaks(step, vocab: int, seq: int, device) -> list:
    """Peak memory (bytes allocated) of a training step at batch 1 and at batch 2, after a first step
    at batch 1 that allocates the optimizer's state: without it batch 1's peak lacks the state and the
    difference charges it to one sequence (bench_e2e probed batch 6 with eager at 67% of the GPU so)."""
    peaks = []
    for b in (1, 1, 2):
        ids = torch.randint(0, vocab, (b, seq), device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(ids)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    return peaks[1:]


def batch_from_peaks(peaks: list, total: int, fraction: float = 0.88, cap: int = 16) -> tuple:
    """(batch, message): the largest batch whose peak stays under `fraction` of `total` bytes, from
    the peaks at batch 1 and 2 (a fixed part and a part a sequence)."""
    per_seq = max(peaks[1] - peaks[0], 1)
    fixed = peaks[0] - per_seq
    batch = max(1, min(int((fraction * total - fixed) // per_seq), cap))
    return batch, (f"peak {peaks[0] / 2**30:.1f} GiB at batch 1, {peaks[1] / 2**30:.1f} GiB at batch 2: "
                   f"{per_seq / 2**30:.2f} GiB a sequence, {fixed / 2**30:.1f} GiB fixed -> batch {batch}")


def probe_batch(cfg: dict, seq: int, device) -> int:
    """The largest batch whose eager training step keeps the peak under 88% of the GPU."""
    if device.type != "cuda":
        return 2
    model, opt, ac = make_impl("eager", cfg, seq, device)
    peaks = step_peaks(lambda ids: train_step(model, opt, ac, ids, device), cfg["vocab_size"], seq, device)
    del model, opt
    free()
    batch, msg = batch_from_peaks(peaks, torch.cuda.get_device_properties(device).total_memory)
    harness.log("probe: eager " + msg)
    return batch


def model_flops(cfg: dict, seq: int, tokens: int) -> float:
    """6 * (matmul parameters) * tokens + causal attention (QK^T and PV, forward and backward)."""
    h, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    matmul_params = layers * per_layer + vocab * h  # lm_head; the embedding is a lookup
    return 6 * matmul_params * tokens + 6 * layers * seq * h * tokens


def run_impl(impl: str, cfg: dict, seq: int, stream: torch.Tensor, device) -> dict:
    free()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t_build = time.perf_counter()
    model, opt, ac = make_impl(impl, cfg, seq, device)
    harness.log(f"  {impl}: built in {time.perf_counter() - t_build:.1f} s")
    timer, losses = harness.StepTimer(device.type == "cuda"), []
    t0 = time.perf_counter()
    for step in range(stream.shape[0]):
        with timer:
            losses.append(train_step(model, opt, ac, stream[step], device))
        if step == 0:
            harness.log(f"  {impl}: first step (incl. compilation/autotuning) done after {time.perf_counter() - t0:.1f} s, "
                        f"loss {losses[0].item():.4f}")
    step_ms = timer.ms()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
    curve = [float(x) for x in torch.stack(losses).float().cpu()]
    timed = step_ms[WARMUP_STEPS:] or step_ms  # the first steps allocate and autotune
    ms = harness.median(timed)
    del model, opt, losses
    free()
    harness.log(f"  {impl}: step {ms:.1f} ms (median of {len(timed)}), peak {peak and round(peak)} MiB, "
                f"loss {curve[0]:.4f} -> {curve[-1]:.4f}, wall {time.perf_counter() - t0:.1f} s")
    return {"ms": ms, "peak": peak, "curve": curve, "step_ms": step_ms}


def plot_losses(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in result["rows"]:
        if row.get("loss_curve"):
            ax.plot(range(1, len(row["loss_curve"]) + 1), row["loss_curve"], label=row["impl"],
                    lw=1.8 if row["impl"] == "fuseforge" else 1.0, ls="--" if row["impl"] == "compile" else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{result['rows'][0]['case']}\n({result['gpu']}, torch {result['torch']})", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    on_gpu = torch.cuda.is_available()
    p.add_argument("--config", choices=sorted(CONFIGS), default="1b" if on_gpu else "tiny",
                   help="default: 1b on a GPU, tiny (a smoke test) on the CPU")
    p.add_argument("--seq", type=int, default=2048 if on_gpu else 128)
    p.add_argument("--batch", default="auto" if on_gpu else "2", help="an int, or auto: the largest that fits eager")
    p.add_argument("--steps", type=int, default=50 if on_gpu else 4)
    p.add_argument("--impls", default=os.environ.get("FUSEFORGE_E2E_IMPLS", "eager,fuseforge,compile,fuseforge_compile"),
                   help="default: $FUSEFORGE_E2E_IMPLS or eager,fuseforge,compile,fuseforge_compile")
    p.add_argument("--device", default="cuda" if on_gpu else "cpu")
    p.add_argument("--out", default=harness.RESULTS_DIR if on_gpu else os.path.join(tempfile.gettempdir(), "fuseforge_e2e_cpu"),
                   help="default: benchmarks/results on a GPU; a temporary folder for the CPU smoke test")
    p.add_argument("--cases", default="", help="ignored (one case); accepted like the other benchmarks")
    p.add_argument("--no-memory", action="store_true", help="ignored: memory is always measured")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = CONFIGS[args.config]
    impls = [i for i in args.impls.split(",") if i]
    if impls and impls[0] != "eager":
        raise SystemExit("--impls must start with eager (the reference of the bars)")

    result = {"op": "e2e", **harness.env_info(), "ceilings": harness.measure_ceilings(), "rows": []}
    batch = probe_batch(cfg, args.seq, device) if args.batch == "auto" else int(args.batch)
    case = case_name(cfg, args.seq, batch)
    tokens = batch * args.seq
    g = torch.Generator().manual_seed(1234)
    stream = torch.randint(0, cfg["vocab_size"], (args.steps, batch, args.seq), generator=g).to(device)
    flops = model_flops(cfg, args.seq, tokens)
    harness.log(f"e2e: {case}, {args.steps} steps, impls {impls}, {flops / 1e12:.1f} TFLOP a step")

    eager = None
    for impl in impls:
        try:
            r = run_impl(impl, cfg, args.seq, stream, device)
        except Exception as e:  # noqa: BLE001  (an impl that fails leaves a row saying why; the others still run)
            if impl == "eager":
                raise
            oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
            error = "out of memory" if oom else f"{type(e).__name__}: {str(e)[:300]}"
            harness.log(f"  {impl}: {error}")
            result["rows"].append({"case": case, "pass": "step", "impl": impl, "error": error})
            del e
            free()
            harness.write(result, args.out)
            continue
        row = {"case": case, "pass": "step", "impl": impl, "ms": harness._round(r["ms"]),
               "TFLOPs": harness._round(flops / r["ms"] / 1e9), "tokens_per_s": round(tokens / r["ms"] * 1000),
               "batch": batch, "steps": args.steps}
        if r["peak"] is not None:
            row["peak_extra_mib"] = round(r["peak"], 1)
        row["mean_loss"] = harness._round(sum(r["curve"]) / len(r["curve"]), 6)
        if impl == "eager":
            eager = r
        elif eager is not None:
            diff = sum(abs(a - b) for a, b in zip(r["curve"], eager["curve"])) / len(r["curve"])
            mean_eager = sum(eager["curve"]) / len(eager["curve"])
            row["mean_abs_loss_diff_rel"] = harness._round(diff / mean_eager, 3)
            row["speedup_vs_eager"] = harness._round(eager["ms"] / r["ms"], 3)
            if r["peak"] is not None and eager["peak"]:
                row["peak_vs_eager"] = harness._round(r["peak"] / eager["peak"], 3)
            if impl == "fuseforge":
                result["bars"] = {
                    "loss_curve_mean_abs_diff_le_1pct": row["mean_abs_loss_diff_rel"] <= 0.01,
                    "step_time_ge_1.1x": row["speedup_vs_eager"] >= 1.1,
                    "peak_memory_le_0.7x": row.get("peak_vs_eager", math.inf) <= 0.7,
                }
        row["loss_curve"] = [round(x, 5) for x in r["curve"]]
        row["step_ms"] = [round(x, 2) for x in r["step_ms"]]
        result["rows"].append(row)
        harness.write(result, args.out)  # after every impl: a later failure keeps what was measured
        try:
            plot_losses(result, os.path.join(args.out, "e2e_loss.png"))
        except ImportError:
            pass
    if "bars" in result:
        harness.log(f"bars: {result['bars']}")
        harness.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
