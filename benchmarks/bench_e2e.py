"""End to end: training steps of a Hugging Face causal LM, eager PyTorch against Liger-Kernel's patch,
fuseforge.patch and torch.compile, in one process, one impl after the other, every impl on the same
model (same seed, same init) and the same token stream.

Cases (--config): ``1b`` (Llama: hidden 2048, 16 layers, 16 / 4 heads, intermediate 5632, vocab
128256), ``qwen2`` (Qwen2-shaped: 16 / 2 heads, intermediate 11008, vocab 151936, tied embeddings),
``gemma2`` (Gemma-2-shaped: 12 layers, 8 / 4 heads of 256, intermediate 8192, vocab 256000, softcaps,
GeGLU, a 4096 window), ``8b-layers`` (four Llama-3-8B layers: hidden 4096, intermediate 14336, 32 / 8
heads), ``qwen3-moe-layers`` (four Qwen3-30B-A3B layers: hidden 2048, 32 / 4 heads of 128, 128
experts of 768 with 8 a token, vocab 151936; the experts run transformers' grouped-GEMM code in every
impl but liger, which patches them with its fused MoE kernel; fuseforge's in the autocast dtype). Sequence 2048; the batch given, or
chosen to fit eager (--batch auto: the largest that keeps eager's peak under 88% of the GPU); labels =
inputs.

impls (one recipe for all but fuseforge_bf16: fp32 weights, bf16 autocast)
- eager: transformers' SDPA attention, torch.optim.AdamW(fused=True).
- liger: eager after Liger-Kernel's apply_liger_kernel_to_<family>(model=...) (RoPE, RMSNorm, SwiGLU /
  GeGLU, fused linear cross-entropy).
- fuseforge: fuseforge.patch (attention, the loss, RMSNorm with the residual add, rotary, the gated
  activation, a mixture-of-experts model's experts in the autocast dtype) and fuseforge.optim.AdamW.
- fuseforge_bf16: fuseforge.patch with bf16 weights and fuseforge.optim.AdamW(master_weights=True).
- fuseforge_attn_loss, fuseforge_no_rms_norm, fuseforge_no_rotary, fuseforge_no_glu,
  fuseforge_no_fuse_residual, fuseforge_no_experts (not in the defaults): one fusion left out each, the
  ablation.
- fuseforge_sdpa (not in the defaults): fuseforge with attention left to transformers' SDPA.
- fuseforge_bf16_states, fuseforge_int8_states (not in the defaults): fuseforge with AdamW's moments
  in bfloat16 / int8 (`state_dtype`); with --data text, the check that compact states converge like
  float32 ones (bar: the last 10 steps' mean loss within 1% of fuseforge's); fuseforge_bnb8bit_states
  is the same model with bitsandbytes' AdamW8bit, the reference 8-bit optimizer.
- compile / fuseforge_compile: torch.compile of the eager / fuseforge model.
The compiled impls come last, because their first step (the compilation) takes minutes: results are
written after every impl, so a caller's timeout keeps the rows before.

Measured: the loss of every step (the curves go in the JSON and in e2e_loss.png), the step time
(median of device-event times after the first five steps, which allocate and autotune), and the peak
memory of the whole run (torch.cuda.max_memory_allocated() from before the model is built: weights,
gradients, optimizer state and activations; `peak_extra_mib`).
Bars: mean |loss - eager loss| <= 1% of eager's mean loss; fuseforge >= 1.10x Liger's tokens/s at
<= 1.0x its peak memory; fuseforge_compile >= 1.05x compile.

    python benchmarks/bench_e2e.py --batch 8                       # Llama 1B, on a GPU
    python benchmarks/bench_e2e.py --config qwen2 --impls eager,liger,fuseforge
    python benchmarks/bench_e2e.py                                 # no GPU: a tiny smoke test, results in a temp folder
"""
from __future__ import annotations

import argparse
import contextlib
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

# Model shapes; "family" picks the Hugging Face classes (FAMILIES) and Liger-Kernel's patch for them.
CONFIGS = {
    "1b": dict(family="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=4, intermediate_size=5632, vocab_size=128256),
    # Qwen2-shaped: vocab 151936 with tied embeddings, 2 KV heads, a wide MLP.
    "qwen2": dict(family="qwen2", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=2, intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
    # Gemma-2-shaped: head dim 256, attention and final logit softcaps, GeGLU, a 4096 window every other layer.
    "gemma2": dict(family="gemma2", hidden_size=2048, num_hidden_layers=12, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=256, intermediate_size=8192, vocab_size=256000,
                   sliding_window=4096),
    # Llama-3-8B-shaped layers (4 of its 32), its vocabulary.
    "8b-layers": dict(family="llama", hidden_size=4096, num_hidden_layers=4, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    # Qwen3-30B-A3B-shaped layers (4 of its 48): 128 experts of 768, 8 a token; its vocabulary.
    "qwen3-moe-layers": dict(family="qwen3_moe", hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                             num_experts=128, num_experts_per_tok=8, vocab_size=151936),
    "tiny": dict(family="llama", hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=1000),
}
FAMILIES = {  # family: (transformers config class, model class, Liger-Kernel's patch function)
    "llama": ("LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "apply_liger_kernel_to_qwen2"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "apply_liger_kernel_to_gemma2"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "apply_liger_kernel_to_qwen3_moe"),
}
DEFAULT_IMPLS = "eager,liger,fuseforge,fuseforge_bf16,compile,fuseforge_compile"
WARMUP_STEPS = 5
HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# fuseforge rows: the keyword arguments of fuseforge.patch, and the recipe. "autocast" is the one recipe
# every impl shares (fp32 weights, bf16 autocast; fuseforge's AdamW for fuseforge); "bf16" keeps bf16
# weights with fp32 master weights in fuseforge's AdamW. The *_no_* rows leave one fusion out (the
# ablation: what each one buys); fuseforge_attn_loss is attention and the loss alone. The
# *_states rows keep AdamW's moments in bfloat16 or int8 (the convergence check of compact states).
FUSEFORGE_IMPLS = {
    "fuseforge": ({}, "autocast"),
    "fuseforge_bf16": ({}, "bf16"),
    "fuseforge_bf16_states": ({}, "autocast", dict(state_dtype="bfloat16")),
    "fuseforge_int8_states": ({}, "autocast", dict(state_dtype="int8")),
    "fuseforge_bnb8bit_states": ({}, "autocast", "bitsandbytes"),
    "fuseforge_attn_loss": (dict(rms_norm=False, rotary=False, glu=False, fuse_residual=False, experts=False),
                            "autocast"),
    "fuseforge_no_rms_norm": (dict(rms_norm=False), "autocast"),
    "fuseforge_no_rotary": (dict(rotary=False), "autocast"),
    "fuseforge_no_glu": (dict(glu=False), "autocast"),
    "fuseforge_no_fuse_residual": (dict(fuse_residual=False), "autocast"),
    "fuseforge_no_experts": (dict(experts=False), "autocast"),
    "fuseforge_sdpa": (dict(attention=False), "autocast"),
    "fuseforge_compile": ({}, "autocast"),
}


def case_name(cfg: dict, seq: int, batch: int) -> str:
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    mlp = (f"e{cfg['num_experts']}x{cfg['moe_intermediate_size']}-top{cfg['num_experts_per_tok']}"
           if "num_experts" in cfg else f"i{cfg['intermediate_size']}")
    return (f"{cfg['family']}-hf/h{cfg['hidden_size']}-l{cfg['num_hidden_layers']}-q{cfg['num_attention_heads']}"
            f"-kv{cfg['num_key_value_heads']}-d{head_dim}-{mlp}-v{cfg['vocab_size']}-s{seq}-b{batch}")


def build_model(cfg: dict, seq: int, device, seed: int = 0):
    import transformers
    config_cls, model_cls, _ = FAMILIES[cfg["family"]]
    kwargs = {k: v for k, v in cfg.items() if k != "family"}
    kwargs.setdefault("tie_word_embeddings", False)
    config = getattr(transformers, config_cls)(**kwargs, max_position_embeddings=max(seq, 8192), use_cache=False,
                                               attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config)  # fp32, initialised on the device from the seed
    model.train()
    return model


class LigerPatch:
    """Liger-Kernel's patch of one model (RoPE, RMSNorm, SwiGLU / GeGLU, fused linear cross-entropy):
    it also replaces names in the transformers modeling module (apply_rotary_pos_emb, the norm and MLP
    classes), which would leak into the rows after it, so __exit__ puts that module's names back."""

    def __init__(self, family: str):
        import importlib
        self.module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        self.saved = dict(vars(self.module))
        self.apply = getattr(importlib.import_module("liger_kernel.transformers"), FAMILIES[family][2])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for name in set(vars(self.module)) - set(self.saved):
            delattr(self.module, name)
        vars(self.module).update(self.saved)


def make_impl(impl: str, cfg: dict, seq: int, device, seed: int = 0):
    """(model, optimizer, autocast on?, a context the steps run in) for one impl, built from the same
    seed."""
    model = build_model(cfg, seq, device, seed)
    fused = device.type == "cuda"
    if impl == "eager":
        return model, torch.optim.AdamW(model.parameters(), **HYPER, fused=fused), True, contextlib.nullcontext()
    if impl == "compile":
        opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=fused)
        return torch.compile(model), opt, True, contextlib.nullcontext()
    if impl == "liger":
        liger = LigerPatch(cfg["family"])
        try:
            liger.apply(model=model)
        except BaseException:
            liger.__exit__(None, None, None)
            raise
        return model, torch.optim.AdamW(model.parameters(), **HYPER, fused=fused), True, liger
    if impl in FUSEFORGE_IMPLS:
        import fuseforge  # noqa: F401
        from fuseforge.optim import AdamW
        from fuseforge.patch import patch
        features, recipe, *opt_kwargs = FUSEFORGE_IMPLS[impl]
        if recipe == "bf16":
            model = cast_parameters(model, torch.bfloat16)
        model = patch(model, **features)
        if opt_kwargs == ["bitsandbytes"]:  # the reference 8-bit optimizer, for the convergence comparison
            import bitsandbytes
            opt = bitsandbytes.optim.AdamW8bit(model.parameters(), **HYPER)
        else:
            opt = AdamW(model.parameters(), **HYPER, master_weights=recipe == "bf16", **(opt_kwargs[0] if opt_kwargs else {}))
        model = torch.compile(model) if impl.endswith("_compile") else model
        return model, opt, recipe == "autocast", contextlib.nullcontext()
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
    model, opt, ac, _ = make_impl("eager", cfg, seq, device)
    peaks = step_peaks(lambda ids: train_step(model, opt, ac, ids, device), cfg["vocab_size"], seq, device)
    del model, opt
    free()
    batch, msg = batch_from_peaks(peaks, torch.cuda.get_device_properties(device).total_memory)
    harness.log("probe: eager " + msg)
    return batch


def model_flops(cfg: dict, seq: int, tokens: int) -> float:
    """6 * (matmul parameters a token uses) * tokens + causal attention (QK^T and PV, forward and
    backward). A mixture-of-experts layer counts its router and the experts a token is sent to."""
    h, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = head_dim * cfg["num_attention_heads"], head_dim * cfg["num_key_value_heads"]
    if "num_experts" in cfg:
        mlp = 3 * h * cfg["moe_intermediate_size"] * cfg["num_experts_per_tok"] + h * cfg["num_experts"]
    else:
        mlp = 3 * h * inter
    per_layer = h * q * 2 + h * kv * 2 + mlp
    matmul_params = layers * per_layer + vocab * h  # lm_head; the embedding is a lookup
    return 6 * matmul_params * tokens + 6 * layers * seq * q * tokens


def run_impl(impl: str, cfg: dict, seq: int, stream: torch.Tensor, device, seed: int = 0) -> dict:
    free()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t_build = time.perf_counter()
    model, opt, ac, scope = make_impl(impl, cfg, seq, device, seed)
    harness.log(f"  {impl}: built in {time.perf_counter() - t_build:.1f} s")
    timer, losses = harness.StepTimer(device.type == "cuda"), []
    t0 = time.perf_counter()
    with scope:  # Liger's module-level replacements end with its row, also when the row fails
        for step in range(stream.shape[0]):
            with timer:
                losses.append(train_step(model, opt, ac, stream[step], device))
            if step == 0:
                harness.log(f"  {impl}: first step (incl. compilation/autotuning) done after "
                            f"{time.perf_counter() - t0:.1f} s, loss {losses[0].item():.4f}")
        step_ms = timer.ms()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else None
        curve = [float(x) for x in torch.stack(losses).float().cpu()]
        del model, opt, losses
    timed = step_ms[WARMUP_STEPS:] or step_ms  # the first steps allocate and autotune
    ms = harness.median(timed)
    free()
    harness.log(f"  {impl}: step {ms:.1f} ms (median of {len(timed)}), peak {peak and round(peak)} MiB, "
                f"loss {curve[0]:.4f} -> {curve[-1]:.4f}, wall {time.perf_counter() - t0:.1f} s")
    return {"ms": ms, "peak": peak, "curve": curve, "step_ms": step_ms}


def corpus_bytes() -> torch.Tensor:
    """examples/data/*.txt as one tensor of byte values (int64)."""
    folder = os.path.join(os.path.dirname(HERE), "examples", "data")
    data = b"".join(open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder)) if f.endswith(".txt"))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def text_stream(steps: int, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """(steps, batch, seq) windows at random offsets of examples/data/*.txt, bytes as token ids."""
    text = corpus_bytes()
    if text.numel() <= seq:
        raise SystemExit(f"examples/data holds {text.numel()} bytes: too few for --seq {seq}")
    starts = torch.randint(0, text.numel() - seq, (steps, batch), generator=g)
    return text[starts[..., None] + torch.arange(seq)]


NGRAM_ORDER = 3


def ngram_stream(steps: int, batch: int, seq: int, g: torch.Generator) -> torch.Tensor:
    """(steps, batch, seq) fresh samples of a byte-level order-3 Markov model fitted to examples/data's
    text (the corpus read as a loop, so every context has a successor): text-like statistics that a
    model learns gradually (characters, then words), and every window is new, so nothing can be
    memorised, unlike --data text."""
    text = corpus_bytes()
    looped = torch.cat([text, text[:NGRAM_ORDER]])
    codes = torch.zeros(text.numel(), dtype=torch.long)
    for k in range(NGRAM_ORDER):
        codes = codes * 256 + looped[k:k + text.numel()]
    successor = looped[NGRAM_ORDER:NGRAM_ORDER + text.numel()]
    contexts, row = torch.unique(codes, return_inverse=True)
    counts = torch.zeros(contexts.numel(), 256)
    counts.index_put_((row, successor), torch.ones(row.numel()), accumulate=True)
    cdf = counts.cumsum(1)
    cdf /= cdf[:, -1:].clone()
    n = steps * batch
    x = torch.empty(n, seq, dtype=torch.long)
    start = torch.randint(0, text.numel(), (n,), generator=g)
    x[:, :NGRAM_ORDER] = looped[start[:, None] + torch.arange(NGRAM_ORDER)]
    code = torch.zeros(n, dtype=torch.long)
    for k in range(NGRAM_ORDER):
        code = code * 256 + x[:, k]
    for t in range(NGRAM_ORDER, seq):
        r = torch.searchsorted(contexts, code)
        u = torch.rand(n, 1, generator=g)
        x[:, t] = torch.searchsorted(cdf[r], u).squeeze(1).clamp_(max=255)
        code = (code % 256 ** (NGRAM_ORDER - 1)) * 256 + x[:, t]
    return x.view(steps, batch, seq)


def plot_losses(result: dict, path: str) -> None:
    """The loss curves (a line style a seed); with compact-state rows (*_states), a second panel: each
    row's loss relative to the same seed's fuseforge (float32 states), a 10-step running mean, against
    the 1% band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r.get("loss_curve")]

    def seed_of(row):
        return row["case"].rsplit("-", 1)[1] if "-seed" in row["case"] else ""

    seeds = sorted({seed_of(r) for r in rows} - {""})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {impl: f"C{k}" for k, impl in enumerate(impls)}
    styles = {seed: ls for seed, ls in zip(seeds, ("-", "--", ":", "-."))}
    compact = any(r["impl"].endswith("_states") for r in rows)
    fig, axes = plt.subplots(1, 2 if compact else 1, figsize=(12 if compact else 7, 4), squeeze=False)
    ax = axes[0][0]
    for row in rows:
        seed = seed_of(row)
        ax.plot(range(1, len(row["loss_curve"]) + 1), row["loss_curve"], label=f"{row['impl']} {seed}".strip(),
                color=colors[row["impl"]], ls=styles.get(seed, "--" if "compile" in row["impl"] else "-"),
                lw=1.8 if row["impl"] == "fuseforge" else 1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{rows[0]['case'].rsplit('-seed', 1)[0]}\n({result['gpu']}, torch {result['torch']})", fontsize=8)
    if compact:
        ax = axes[0][1]
        fp32 = {seed_of(r): torch.tensor(r["loss_curve"]) for r in rows if r["impl"] == "fuseforge"}
        for row in rows:
            seed = seed_of(row)
            if row["impl"] == "fuseforge" or seed not in fp32:
                continue
            rel = (torch.tensor(row["loss_curve"]) - fp32[seed]) / fp32[seed] * 100
            window = min(10, len(rel))  # (shorter runs: their whole length)
            smooth = torch.nn.functional.avg_pool1d(rel[None, None], window, 1)[0, 0]
            ax.plot(range(window, len(rel) + 1), smooth, color=colors[row["impl"]], ls=styles.get(seed, "-"),
                    label=f"{row['impl']} {seed}".strip())
        ax.axhspan(-1, 1, color="0.85", zorder=0)
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("loss vs fuseforge (float32 states), %, 10-step mean")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title("relative to the same seed's float32-state run (grey: +-1%)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_seed(result: dict, case: str, suffix: str, impls: list, cfg: dict, args, stream: torch.Tensor, device,
             seed: int, batch: int, flops: float) -> None:
    """Every impl on one seed's model and token stream: its rows, and the bars (keys ending in suffix)."""
    tokens = batch * args.seq

    def bar(name: str, met: bool) -> None:
        result.setdefault("bars", {})[name + suffix] = met

    eager = liger = compiled = fuseforge_fp32 = None
    for impl in impls:
        try:
            r = run_impl(impl, cfg, args.seq, stream, device, seed)
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
            if impl == "liger":
                liger = r
            if liger is not None and impl.startswith("fuseforge"):
                row["speedup_vs_liger"] = harness._round(liger["ms"] / r["ms"], 3)
                if r["peak"] is not None and liger["peak"]:
                    row["peak_vs_liger"] = harness._round(r["peak"] / liger["peak"], 3)
            if impl == "fuseforge":
                bar("loss_curve_mean_abs_diff_le_1pct", row["mean_abs_loss_diff_rel"] <= 0.01)
                if "speedup_vs_liger" in row:
                    bar("tokens_per_s_ge_1.1x_liger", row["speedup_vs_liger"] >= 1.1)
                    bar("peak_memory_le_1.0x_liger", row.get("peak_vs_liger", math.inf) <= 1.0)
            if impl.endswith("_states") and fuseforge_fp32 is not None:
                tail = min(10, len(r["curve"]))
                ref = sum(fuseforge_fp32["curve"][-tail:]) / tail
                row["final_loss_vs_fp32_states_rel"] = harness._round((sum(r["curve"][-tail:]) / tail - ref) / ref, 4)
                bar(f"{impl}_final_loss_within_1pct", abs(row["final_loss_vs_fp32_states_rel"]) <= 0.01)
            if impl == "fuseforge":
                fuseforge_fp32 = r
            if impl == "fuseforge_compile" and compiled is not None:
                row["speedup_vs_compile"] = harness._round(compiled["ms"] / r["ms"], 3)
                bar("compile_ge_1.05x_torch_compile", row["speedup_vs_compile"] >= 1.05)
            if impl == "compile":
                compiled = r
        row["loss_curve"] = [round(x, 5) for x in r["curve"]]
        row["step_ms"] = [round(x, 2) for x in r["step_ms"]]
        result["rows"].append(row)
        harness.write(result, args.out)  # after every impl: a later failure keeps what was measured
        try:
            plot_losses(result, os.path.join(args.out, f"{result['op']}_loss.png"))
        except ImportError:
            pass


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    on_gpu = torch.cuda.is_available()
    p.add_argument("--config", choices=sorted(CONFIGS), default="1b" if on_gpu else "tiny",
                   help="default: 1b on a GPU, tiny (a smoke test) on the CPU")
    p.add_argument("--seq", type=int, default=2048 if on_gpu else 128)
    p.add_argument("--batch", default="auto" if on_gpu else "2", help="an int, or auto: the largest that fits eager")
    p.add_argument("--steps", type=int, default=50 if on_gpu else 4)
    p.add_argument("--impls", default=os.environ.get("FUSEFORGE_E2E_IMPLS", DEFAULT_IMPLS),
                   help=f"default: $FUSEFORGE_E2E_IMPLS or {DEFAULT_IMPLS}; also " + ", ".join(
                       i for i in FUSEFORGE_IMPLS if i not in DEFAULT_IMPLS.split(",")))
    p.add_argument("--device", default="cuda" if on_gpu else "cpu")
    p.add_argument("--out", default=harness.RESULTS_DIR if on_gpu else os.path.join(tempfile.gettempdir(), "fuseforge_e2e_cpu"),
                   help="default: benchmarks/results on a GPU; a temporary folder for the CPU smoke test")
    p.add_argument("--data", choices=("random", "text", "ngram"), default="random",
                   help="random: uniform token ids (timing); text: windows of examples/data's bytes as token ids, "
                        "which a model can learn and, over many steps, memorise; ngram: fresh samples of a byte "
                        "order-3 Markov model of that text, which cannot be memorised (convergence)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (model init and data); each runs every impl, "
                   "its rows' case named -seed<N> when there are several")
    p.add_argument("--op", default=None, help="the results file's name (default: e2e, or e2e_<config>)")
    p.add_argument("--cases", default="", help="ignored (one case); accepted like the other benchmarks")
    p.add_argument("--no-memory", action="store_true", help="ignored: memory is always measured")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = CONFIGS[args.config]
    impls = [i for i in args.impls.split(",") if i]
    if impls and impls[0] != "eager":
        raise SystemExit("--impls must start with eager (the reference of the bars)")
    if "liger" in impls:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            harness.log("liger-kernel is not installed: no liger row")
            impls.remove("liger")

    op = args.op or ("e2e" if args.config == "1b" else f"e2e_{args.config.replace('-', '_')}")
    result = {"op": op, **harness.env_info(), "ceilings": harness.measure_ceilings(), "rows": []}
    batch = probe_batch(cfg, args.seq, device) if args.batch == "auto" else int(args.batch)
    case = case_name(cfg, args.seq, batch)
    tokens = batch * args.seq
    flops = model_flops(cfg, args.seq, tokens)
    seeds = [int(x) for x in args.seeds.split(",") if x]
    for seed in seeds:
        g = torch.Generator().manual_seed(1234 + seed)
        if args.data == "text":
            stream = text_stream(args.steps, batch, args.seq, g).to(device)
        elif args.data == "ngram":
            stream = ngram_stream(args.steps, batch, args.seq, g).to(device)
        else:
            stream = torch.randint(0, cfg["vocab_size"], (args.steps, batch, args.seq), generator=g).to(device)
        seed_case = case if len(seeds) == 1 else f"{case}-seed{seed}"
        harness.log(f"e2e: {seed_case}, {args.steps} steps, impls {impls}, {flops / 1e12:.1f} TFLOP a step")
        run_seed(result, seed_case, "" if len(seeds) == 1 else f"_seed{seed}", impls, cfg, args, stream, device,
                 seed, batch, flops)
        del stream
    if "bars" in result:
        harness.log(f"bars: {result['bars']}")
        harness.write(result, args.out)
    return result


if __name__ == "__main__":
    main()
