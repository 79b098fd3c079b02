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
     "`torch_foreach`, `compile` (`torch.compile` of the step). 8-bit peers: bitsandbytes' "
     "`AdamW8bit` / `PagedAdamW8bit`, torchao's `AdamW8bit`; `_paged` rows keep their states in CUDA "
     "managed memory. `llama1b/fp32-capped`: `torch.cuda.set_per_process_memory_fraction` leaves the "
     "caching allocator 1 GiB beyond the parameters and gradients, so unpaged fp32 and int8 states run "
     "out of memory; managed memory is outside that cap and stays on the GPU while it has room, so the "
     "paged rows time resident states, not paging to the host."),
    ("adamw_convergence", "AdamW's compact states: 200 training steps",
     "`bench_e2e.py --batch 4 --steps 200 --data ngram --seeds 0,1 --op adamw_convergence`: the 1.2B "
     "Llama patched by fuseforge, trained on fresh samples of a byte-level order-3 Markov model of "
     "`examples/data`'s text (text-like, never repeated, so nothing is memorised), with AdamW's "
     "moments in float32 (`fuseforge`), int8 (`fuseforge_int8_states`) and bitsandbytes' `AdamW8bit` "
     "(`fuseforge_bnb8bit_states`); `eager` is the unpatched model with torch's fused AdamW (float32 "
     "states). Two seeds (model and data). The plot's right panel: each run's loss against the same "
     "seed's float32-state run (10-step running mean); the JSON's `final_loss_vs_fp32_states_rel` "
     "compares the last 10 steps' mean losses."),
    ("rms_norm", "rms_norm: RMSNorm and the residual add before it",
     "`benchmarks/bench_rms_norm.py`: fuseforge's `rms_norm` against eager PyTorch (Hugging Face's "
     "LlamaRMSNorm code), `torch.compile` of it and Liger-Kernel's RMSNorm. Cases "
     "`ROWSxHIDDEN/DTYPE/KIND`: 16384 rows at hidden 2048, 4096 and 8192; `bf16` (x, weight and out "
     "bf16) or `fp32_bf16out` (the autocast recipe: fp32 x and weight, bf16 out); `norm` (out = "
     "norm(x)) or `add_norm` (h = x + residual, out = norm(h), both returned: a decoder layer's add and "
     "norm; eager and compile add then norm, Liger runs its fused add + norm). `262144x128` is Qwen3's "
     "q/k norm (16384 tokens x 16 heads of 128). Liger runs with `in_place=False`; with `fp32_bf16out` "
     "it returns fp32, cast to bf16 as a caller would. GB/s counts the minimum a pass must move, the "
     "weight left out: fwd reads x (and the residual) and writes out (and h); fwdbwd adds the "
     "backward's reads of grad_out and h (and of h's own gradient, add_norm) and its write of "
     "grad_input (one tensor: x's and the residual's gradients are equal)."),
    ("layer_norm", "layer_norm: LayerNorm and the residual add before it",
     "`benchmarks/bench_layer_norm.py`: fuseforge's `layer_norm` (rms_norm's kernels, centered, with a "
     "bias) against eager PyTorch (`torch.nn.functional.layer_norm`, ATen's fused kernel), "
     "`torch.compile` of it and Liger-Kernel's LayerNorm. Cases `ROWSxHIDDEN/DTYPE/KIND` as rms_norm's: "
     "16384 rows at hidden 1024 to 8192, `bf16` or `fp32_bf16out` (Liger's output cast to bf16 after "
     "it), `norm` or `add_norm` (eager, compile and Liger add then norm). GB/s counts what rms_norm's "
     "does. The 1024- and 2048-wide forward+backward rows run ~0.1-0.3 ms a call, where every impl's "
     "host time shows (fuseforge's autograd runs in Python): those rows move with the machine's CPU."),
    ("rotary", "rotary: rope of q and k from position_ids",
     "`benchmarks/bench_rotary.py`: fuseforge's `rotary` (cos/sin computed in the kernel) against "
     "Hugging Face's eager code (LlamaRotaryEmbedding.forward, then apply_rotary_pos_emb), "
     "`torch.compile` of it and Liger-Kernel's `LigerRopeFunction`, which is given cos/sin precomputed "
     "(a model computes them once a forward for all layers, so their cost is left out of liger's "
     "time) and rotates q and k in place. Cases: batch 8 x sequence 2048, heads Hq x Hk x D of Llama "
     "3.2 1B (16x4x128), Llama 3 8B (32x8x128), Llama 3 70B (64x8x128), Gemma 2 (8x4x256) and Qwen2 "
     "(16x2x128) in bf16, and 8B's in fp32; q and k are the projections' (B, S, H, D) -> (B, H, S, D) "
     "views, as in the model. GB/s counts 2 x (q + k) bytes forward (read q and k, write both outputs) "
     "and 4 x (q + k) forward+backward; position_ids, inv_freq and cos/sin are not counted."),
    ("posttraining", "Post-training losses: GRPO, DPO and distillation",
     "`benchmarks/bench_posttraining.py`: forward+backward of each loss from hidden states (tokens x "
     "4096, bf16) through a vocabulary head, against eager PyTorch (logits materialised), "
     "`torch.compile` of it and Liger-Kernel 0.8.5's `LigerFusedLinearGRPOLoss` / "
     "`LigerFusedLinearDPOLoss` / `LigerFusedLinearJSD`, each computing the same loss (the script's "
     "docstring). fuseforge: `GRPOLoss` (on `linear_logprobs`), `PreferenceLoss` (chunks of whole "
     "pairs, gradients in the forward) and `linear_jsd`. `rel_err` (8192-token cases) is the larger of grad_x's and grad_W's error against float64. "
     "DPO's time includes the reference model's forward (four matrix products in all, as Liger's). "
     "Liger's 16384-token GRPO row failed in its own `torch.compile` of the loss (a dynamo error, "
     "recorded in the row)."),
    ("posttraining_32k", "Post-training losses at 32768 tokens",
     "`benchmarks/bench_posttraining.py --cases dpo/32768x,jsd/32768x --impls fuseforge,liger --rounds 2 "
     "--name posttraining_32k`: the DPO and JSD cases of the table above at 32768 tokens, against "
     "Liger-Kernel only (eager and `torch.compile` materialise 16-20 GB of logits there)."),
    ("glu", "glu: SwiGLU and GeGLU",
     "`benchmarks/bench_glu.py`: fuseforge's `glu`, `act(gate) * up`, against eager PyTorch (as Hugging "
     "Face's LlamaMLP / GemmaMLP write it), `torch.compile` of it and Liger-Kernel's SiLU-mul and "
     "GELU-mul. Cases `ROWSxI/DTYPE/ACT`: 16384 rows (8 x 2048 tokens); SiLU in bf16 at I = 2048, "
     "4096, 5632, 8192, 11008 and 14336 (the hidden sizes and Llama 1B's, Qwen2's and Llama 8B's MLP "
     "widths), tanh-GELU in bf16 at Gemma's 8192 and 9216, and SiLU in fp32 at 8192; gate and up are "
     "separate tensors, as Hugging Face's MLPs make them. GB/s counts tensors of rows x I: fwd reads "
     "gate and up and writes out (3); fwdbwd adds the backward's reads of grad_out, gate and up and "
     "writes of grad_gate and grad_up (8 in all). Liger's backward writes its gradients over its saved "
     "inputs, so it gets its own copies of them. The forward+backward rows at I = 2048 and 4096 (0.15-0.6 "
     "ms) move up to 2x between runs for every impl (Liger's 4096 row 0.26 and 0.42 ms, compile's 0.29 "
     "and 0.60, fuseforge's 0.26 and 0.33), with the board's power low while they ran (the GPU partly "
     "idle); the cause is not known."),
    ("e2e", "End to end: a 1.2B Llama with `fuseforge.patch` against Liger-Kernel",
     "`benchmarks/bench_e2e.py --batch 8`: a `transformers` LlamaForCausalLM (hidden 2048, 16 layers, "
     "16 query heads on 4 KV heads of 128, intermediate 5632, vocabulary 128256, untied head), S = "
     "2048, batch 8, random init, 15 steps on a fixed token stream, every impl on the same model and "
     "tokens in one process. ms is the median step after the first five (which allocate and "
     "autotune); MiB the peak of the whole run (weights, gradients, optimizer state, activations). One "
     "recipe for every impl: fp32 weights, bf16 autocast. `eager`: transformers' SDPA attention, "
     "`torch.optim.AdamW(fused=True)`; `liger`: eager after Liger-Kernel 0.8.5's "
     "`apply_liger_kernel_to_llama(model=...)` (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy); "
     "`fuseforge`: `fuseforge.patch` (attention, the loss, RMSNorm, rotary, the gated MLP and the "
     "residual add fused into the next norm) with `fuseforge.optim.AdamW`. The ablation rows are "
     "`fuseforge` with one fusion off: `fuseforge_no_rms_norm` (`patch(rms_norm=False)`: transformers' "
     "RMSNorm, and with it the residual fusion, which runs inside the norm), `fuseforge_no_rotary` "
     "(transformers' rotary embedding), `fuseforge_no_glu` (transformers' MLP activation and product), "
     "`fuseforge_no_fuse_residual` (the residual adds left to PyTorch, the norms still fuseforge's). "
     "The H100 table is an earlier run of the previous recipe (50 steps; `fuseforge` with bf16 weights "
     "and fp32 master weights, the patch routing attention and the loss only; no `liger` row)."),
    ("e2e_compile", "End to end: the 1.2B Llama under `torch.compile`",
     "`bench_e2e.py --batch 8 --impls eager,compile,fuseforge,fuseforge_compile`: the model, batch, "
     "steps and recipe of the section above, in a run of its own. `compile`: `torch.compile` of the "
     "eager model (torch's fused AdamW); `fuseforge_compile`: `torch.compile` of the patched model, "
     "with `fuseforge.optim.AdamW`. The first step, the compilation, is left out of the median as the "
     "first five steps are."),
    ("e2e_qwen2", "End to end: a Qwen2-shaped model",
     "`bench_e2e.py --config qwen2 --impls eager,liger,fuseforge`: a Qwen2ForCausalLM with hidden "
     "2048, 16 layers, 16 query heads on 2 KV heads of 128, intermediate 11008, vocabulary 151936 with "
     "tied embeddings; S = 2048, batch 12; Liger's patch is `apply_liger_kernel_to_qwen2`. Recipe, "
     "steps and impls as in the 1.2B Llama section."),
    ("e2e_gemma2", "End to end: a Gemma-2-shaped model",
     "`bench_e2e.py --config gemma2 --impls eager,liger,fuseforge`: a Gemma2ForCausalLM with hidden "
     "2048, 12 layers, 8 query heads on 4 KV heads of 256, intermediate 8192 (GeGLU), vocabulary 256000, "
     "attention and final-logit softcaps, a 4096-token window every other layer; S = 2048, batch 9; "
     "Liger's patch is `apply_liger_kernel_to_gemma2`. Recipe, steps and impls as in the 1.2B Llama "
     "section."),
    ("e2e_8b_layers", "End to end: four Llama-3-8B layers",
     "`bench_e2e.py --config 8b-layers --impls eager,liger,fuseforge`: 4 of Llama 3 8B's 32 layers "
     "(hidden 4096, 32 query heads on 8 KV heads of 128, intermediate 14336) with its vocabulary "
     "(128256, untied head); S = 2048, batch 16; Liger's patch is `apply_liger_kernel_to_llama`. Recipe, "
     "steps and impls as in the 1.2B Llama section."),
    ("e2e_qwen3_moe_layers", "End to end: four Qwen3-30B-A3B layers (mixture of experts)",
     "`bench_e2e.py --config qwen3-moe-layers --batch 8 --impls eager,liger,fuseforge,fuseforge_no_experts`: 4 of Qwen3-30B-A3B's "
     "48 layers (hidden 2048, 32 query heads on 4 KV heads of 128, q/k norms, 128 experts of 768 with 8 a "
     "token, no shared expert) with its vocabulary (151936, untied head); S = 2048, batch 8. The experts "
     "run transformers' grouped-GEMM implementation (its default), which casts their input to the weights' "
     "dtype (fp32 here, under autocast too); `fuseforge` patches them to multiply in the autocast dtype "
     "(`patch(experts=True)`, the default), `fuseforge_no_experts` leaves them to transformers (their gate "
     "on `glu`). Liger's `apply_liger_kernel_to_qwen3_moe` replaces them with its fused MoE kernel. "
     "Recipe and steps as in the 1.2B Llama section."),
    ("e2e_qwen3_moe_glu_ab", "End to end: the experts' gate on glu",
     "`bench_e2e.py --config qwen3-moe-layers --batch 8 --impls eager,fuseforge,fuseforge_no_glu`: the "
     "model above with the experts' `act(gate) * up` (transformers' `_apply_gate` on the grouped "
     "[gate | up] rows) on `glu` (`fuseforge`) and left to transformers (`fuseforge_no_glu`, which also "
     "leaves the dense MLPs, of which this model has none)."),
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
    ("rms_norm", "fuseforge", "liger", "", "rms_norm"),
    ("rms_norm", "fuseforge", "compile", "", "rms_norm"),
    ("layer_norm", "fuseforge", "liger", "", "layer_norm"),
    ("layer_norm", "fuseforge", "compile", "", "layer_norm"),
    ("rotary", "fuseforge", "liger", "", "rotary"),
    ("rotary", "fuseforge", "compile", "", "rotary"),
    ("glu", "fuseforge", "liger", "", "glu"),
    ("glu", "fuseforge", "compile", "", "glu"),
    ("adamw", "fuseforge", "torch_fused", "llama1b", "AdamW, 1B Llama (fp32; bf16 + fp32 masters)"),
    ("adamw", "fuseforge", "compile", "llama1b", "AdamW, 1B Llama (fp32; bf16 + fp32 masters)"),
    ("adamw", "fuseforge", "torch_fused", "small5000", "AdamW, 5000 small tensors"),
    ("adamw", "fuseforge_int8", "bnb_adamw8bit", "", "AdamW, int8 states"),
    ("posttraining", "fuseforge", "liger", "", "GRPO / DPO / JSD losses"),
    ("e2e", "fuseforge", "liger", "", "1.2B Llama step, patched"),
    ("e2e", "fuseforge", "eager", "", "1.2B Llama step, patched"),
    ("e2e_compile", "fuseforge", "compile", "", "1.2B Llama step, patched"),
    ("e2e_compile", "fuseforge_compile", "compile", "", "1.2B Llama step, patched + compiled"),
    ("e2e_qwen2", "fuseforge", "liger", "", "Qwen2-shaped step, patched"),
    ("e2e_qwen2", "fuseforge", "eager", "", "Qwen2-shaped step, patched"),
    ("e2e_gemma2", "fuseforge", "liger", "", "Gemma-2-shaped step, patched"),
    ("e2e_gemma2", "fuseforge", "eager", "", "Gemma-2-shaped step, patched"),
    ("e2e_8b_layers", "fuseforge", "liger", "", "4 Llama-3-8B layers step, patched"),
    ("e2e_8b_layers", "fuseforge", "eager", "", "4 Llama-3-8B layers step, patched"),
    ("e2e_qwen3_moe_layers", "fuseforge", "liger", "", "4 Qwen3-30B-A3B layers (MoE) step, patched"),
    ("e2e_qwen3_moe_layers", "fuseforge", "eager", "", "4 Qwen3-30B-A3B layers (MoE) step, patched"),
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
                 "benchmark (above 1: fuseforge is faster); `rows slower` counts the rows where it is not; peak memory "
                 "is fuseforge's peak MiB / the peer's (end to end: the whole training run's). "
                 f"Every row's table, device, commit and date: [docs/benchmarks.md]({link_prefix}docs/benchmarks.md).")
    return "\n".join(lines) + "\n"


def plots(results: dict, link_prefix: str) -> str:
    """One plot per op, the newest GPU run's."""
    out = []
    for bench in ("attention", "attention_varlen", "linear_cross_entropy", "add_mul_act", "rms_norm", "layer_norm",
                  "rotary", "glu", "adamw", "adamw_convergence", "posttraining", "e2e"):
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
        "wall-clock medians); tables whose footer says so time calls queued ahead of the GPU, so that a "
        "slow host's launch pace does not enter a small row's time (the others: `triton.testing.do_bench`). "
        "Every impl of a row is measured in the same process and run; `MiB` is the "
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
            script = f"benchmarks/bench_{bench}.py"
            how = f" (`python3 {script}` writes one)" if os.path.exists(os.path.join(ROOT, script)) else ""
            parts += [f"GPU tables pending: no stored run of this benchmark yet{how}.", ""]
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
