"""`fuseforge.patch(model)` / `fuseforge.unpatch(model)` for Hugging Face Llama-family models (Llama,
Mistral, Ministral, Qwen2, Qwen3, Phi-3, Gemma, Gemma 2, Gemma 3, OLMo 2, OLMo 3, Granite, GLM,
GLM-4, Helium, ERNIE 4.5, SmolLM3, Seed-OSS, EXAONE 4, Hunyuan dense, and the LayerNorm families OLMo,
StableLM, Cohere, Cohere 2 and StarCoder2; and the mixture-of-experts Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, ERNIE 4.5 MoE, Hunyuan MoE, Granite MoE and GLM-4 MoE, whose experts
keep the model's code: SUPPORTED_MODELS).

patch() does three things to one model instance and nothing else (each can be turned off):

1. Attention goes through `fuseforge.ops.attention` (`attention`, or `attention_varlen` for packed
   batches), by transformers' own mechanism: an attention function registered in `AttentionInterface`
   under the name "fuseforge" and a mask function in `AttentionMaskInterface`, selected with
   `model.set_attn_implementation`. The mask function returns, instead of a materialised mask, a
   description of what the kernel computes itself (`KernelMask`) when transformers asks for one of the
   masks it builds for these models: causal, causal with a sliding window (`sliding_window_overlay`:
   key j visible from query i when i - W < j <= i, the kernel's window=(W - 1, 0)), and either one
   restricted to the documents of a packed row (`find_packed_sequence_indices`: a new document where
   position_ids do not step by 1, as `DataCollatorWithFlattening` builds them), with no padding, no
   cache offsets and as many queries as keys. It recognises them by the mask factory functions
   transformers passes it (their names in transformers.masking_utils; packed masks in the
   form of transformers 5.17, and with the later remap_positions_for_packed_sequence); anything else
   goes to SDPA's mask function unchanged. transformers looks for packed documents only without a cache object
   (use_cache=True, the config default, gives an empty DynamicCache even in training, and its SDPA and
   eager paths then attend across documents); without a 2D mask the attention function looks at the
   `position_ids` keyword itself, as transformers' flash-attention path does. Plain causal attention
   gives None (no position_ids check) while torch.compile traces (where transformers < torch 2.14
   would build the full mask: a decision on shapes alone) and for decode steps, as SDPA's does.
   Packed documents run `attention_varlen` on the (total, H, D) views of q, k, v; their cu_seqlens are
   computed once per mask (one host synchronisation, cached on the KernelMask the layers share: one per
   mask kind a forward builds, so one for Llama, two for Gemma 2/3's sliding and full layers), or taken
   as given from the `cu_seq_lens_q/k`, `max_length_q/k` keyword arguments (flash-attention's varlen kwargs, e.g.
   `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`), which need no synchronisation.
   Gemma 2's `softcap` (attn_logit_softcapping) is the kernel's softcap. While torch.compile traces,
   packed position_ids are left to SDPA's mask (cu_seqlens need the host). Everything the kernel does
   not do goes to transformers' SDPA function with the mask transformers would have built (the
   KernelMask materialises it, once per mask): an explicit mask (padding, a user's 4D mask), dropout,
   a paged cache, output_attentions, and on CUDA float32 without autocast or head dims the kernels
   lack (not a multiple of 8, or above 128 and not 256: Gemma 2's 256 runs the kernel, in training on
   compute capability 9.0 only); with softcapping, which SDPA lacks, it goes to the model's own eager
   attention function with the additive form of that mask.
2. With `labels`, the causal-LM forward computes the loss with
   `fuseforge.ops.linear_cross_entropy.linear_cross_entropy` from the last hidden states and
   `lm_head.weight`: the (tokens x vocab) logits are never materialised, and `logits` in the output
   is None. It shifts labels as transformers' ForCausalLMLoss does (or takes `shift_labels`), ignores
   -100, honours `num_items_in_batch` (sum / num_items_in_batch) and Gemma 2's
   final_logit_softcapping (linear_cross_entropy's softcap). Without labels, or with
   `logits_to_keep` set, the model's own forward runs. The loss is computed inside a call of the
   `lm_head` module (its instance forward takes the labels), so wrappers that act on that call see
   it: FSDP2 gathers a separately `fully_shard`-ed head's weight for it and reduce-scatters its
   gradient. A mixture-of-experts model's router load-balancing loss (`output_router_logits`) is
   added as its own forward adds it.

3. The decoder layers' RMSNorm (or LayerNorm), rotary embedding, gated-MLP activation and the residual
   add before the second norm run fuseforge's rms_norm (layer_norm), rotary and glu ops; under
   autocast, a mixture-of-experts model's grouped experts multiply in the autocast dtype
   (`fuseforge.patch.layers`).

unpatch() restores the attention implementation, the forwards and the decoder modules. Both return the model.

The package: masks.py (KernelMask, the mask function), attention.py (the attention function and its
fallbacks), loss.py (the causal-LM loss), layers.py (norms, rotary, gated MLP, residual adds), and
here the family table and patch / unpatch.
"""
from __future__ import annotations

import types

from torch import nn

from fuseforge.patch.attention import (ATTN_IMPLEMENTATION, _cuda_head_dim_supported, _cuda_kernel_takes,  # noqa: F401
                                       _register, fuseforge_attention_forward, stats)
from fuseforge.patch.loss import _causal_lm_forward, _lm_head_forward, causal_lm_loss  # noqa: F401
from fuseforge.patch.masks import KernelMask, _describe_mask, fuseforge_mask  # noqa: F401

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_MODELS", "KernelMask", "causal_lm_loss", "fuseforge_attention_forward",
           "fuseforge_mask", "is_patched", "patch", "stats", "unpatch"]

SUPPORTED_MODELS = ("LlamaForCausalLM", "LlamaModel", "MistralForCausalLM", "MistralModel",
                    "MinistralForCausalLM", "MinistralModel", "Qwen2ForCausalLM", "Qwen2Model",
                    "Qwen3ForCausalLM", "Qwen3Model", "Phi3ForCausalLM", "Phi3Model", "Gemma2ForCausalLM",
                    "Gemma2Model", "Gemma3ForCausalLM", "Gemma3TextModel", "Olmo2ForCausalLM", "Olmo2Model",
                    "Olmo3ForCausalLM", "Olmo3Model", "GraniteForCausalLM", "GraniteModel", "GlmForCausalLM",
                    "GlmModel", "HeliumForCausalLM", "HeliumModel", "Ernie4_5ForCausalLM", "Ernie4_5Model",
                    "SmolLM3ForCausalLM", "SmolLM3Model", "SeedOssForCausalLM", "SeedOssModel",
                    "Exaone4ForCausalLM", "Exaone4Model", "HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Model",
                    "GemmaForCausalLM", "GemmaModel", "MixtralForCausalLM", "MixtralModel", "Qwen2MoeForCausalLM",
                    "Qwen2MoeModel", "Qwen3MoeForCausalLM", "Qwen3MoeModel", "OlmoeForCausalLM", "OlmoeModel",
                    "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeModel", "HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Model",
                    "GraniteMoeForCausalLM", "GraniteMoeModel", "Glm4MoeForCausalLM", "Glm4MoeModel",
                    "OlmoForCausalLM", "OlmoModel", "StableLmForCausalLM", "StableLmModel", "CohereForCausalLM",
                    "CohereModel", "Cohere2ForCausalLM", "Cohere2Model", "Starcoder2ForCausalLM", "Starcoder2Model",
                    "Glm4ForCausalLM", "Glm4Model")

_STATE = "_fuseforge_patch"


def is_patched(model: nn.Module) -> bool:
    return hasattr(model, _STATE)


def patch(model: nn.Module, *, attention: bool = True, loss: bool = True, rms_norm: bool = True,
          rotary: bool = True, glu: bool = True, fuse_residual: bool = True, experts: bool = True) -> nn.Module:
    """Routes a model of a supported family (SUPPORTED_MODELS) through fuseforge: the attention, for the
    ForCausalLM classes the training loss (linear_cross_entropy), and in the decoder layers RMSNorm
    (and LayerNorm: `rms_norm=` turns the norms on or off), rotary embeddings, the gated MLP's
    activation, the residual add fused into the next norm and, under autocast, the experts' matrix
    products in the autocast dtype (fuseforge.patch.layers). Each keyword turns one of them off. In
    place; returns the model. Patching a patched model does nothing."""
    from fuseforge.patch.layers import patch_layers
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        raise TypeError(f"fuseforge.patch: model must be one of {', '.join(SUPPORTED_MODELS)}, got {name}")
    if is_patched(model):
        return model
    state = {"attn_implementation": model.config._attn_implementation, "forward": False, "layers": []}
    if attention:
        _register()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(f"fuseforge.patch: {name} did not accept attn_implementation={ATTN_IMPLEMENTATION!r}")
    if loss and name.endswith("ForCausalLM"):
        model.forward = types.MethodType(_causal_lm_forward, model)
        model.lm_head.forward = types.MethodType(_lm_head_forward, model.lm_head)
        state["forward"] = True
    features = [f for f, on in (("rms_norm", rms_norm), ("rotary", rotary), ("glu", glu),
                                ("fuse_residual", fuse_residual), ("experts", experts)) if on]
    state["layers"] = patch_layers(model, features)
    setattr(model, _STATE, state)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undoes patch(): the attention implementation the model had, its class's forward and lm_head's,
    and the decoder modules' forwards."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    from fuseforge.patch.layers import unpatch_layers
    if model.config._attn_implementation != state["attn_implementation"]:
        model.set_attn_implementation(state["attn_implementation"])
    unpatch_layers(state["layers"])
    if state["forward"]:
        del model.forward
        del model.lm_head.forward
    delattr(model, _STATE)
    return model
