"""`fuseforge.patch(model)` / `fuseforge.unpatch(model)` for Hugging Face Llama-family models.

patch() does two things to one model instance and nothing else:

1. Attention goes through `fuseforge.ops.attention.attention`, by transformers' own mechanism: an
   attention function registered in `AttentionInterface` under the name "fuseforge" (with a mask
   function around SDPA's in `AttentionMaskInterface`), selected with `model.set_attn_implementation`.
   SDPA's mask function returns no mask for plain causal attention (no padding, or a decode step),
   which is what the kernel computes (causal, bottom-right aligned, grouped-query heads); while
   torch.compile traces, transformers builds the full mask anyway on torch < 2.14 (it cannot tell
   tracing from export there), so the mask function registered here returns None itself for plain
   causal attention without a padding mask (a decision on shapes alone, no tensor values). Everything
   the kernel does not do is handed to transformers' SDPA function unchanged: an explicit mask
   (padding, packed sequences, a sliding window that binds), dropout, softcapping, a paged cache,
   and on CUDA float32 without autocast or head dims other than 64 and 128.
2. With `labels`, the causal-LM forward computes the loss with
   `fuseforge.ops.linear_cross_entropy.linear_cross_entropy` from the last hidden states and
   `lm_head.weight`: the (tokens x vocab) logits are never materialised, and `logits` in the output
   is None. It shifts labels as transformers' ForCausalLMLoss does (or takes `shift_labels`), ignores
   -100, and honours `num_items_in_batch` (sum / num_items_in_batch). Without labels, or with
   `logits_to_keep` set, the model's own forward runs.

unpatch() restores the attention implementation and the forward. Both return the model.
"""
from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fuseforge.ops.attention import attention
from fuseforge.ops.linear_cross_entropy import linear_cross_entropy

ATTN_IMPLEMENTATION = "fuseforge"
SUPPORTED_MODELS = ("LlamaForCausalLM", "LlamaModel", "MistralForCausalLM", "MistralModel",
                    "Qwen2ForCausalLM", "Qwen2Model")
_CUDA_HEAD_DIMS = (64, 128)
_STATE = "_fuseforge_patch"

# How many attention calls took each path since import (tests and benchmarks read these). Eager
# calls only: a counter bumped inside a torch.compile'd region would be a guard on its value and
# recompile the graph on every step.
stats = {"fuseforge": 0, "sdpa": 0}


def _count(path: str) -> None:
    if not torch.compiler.is_compiling():
        stats[path] += 1


def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _kernel_dtype(query: Tensor, key: Tensor, value: Tensor) -> Optional[torch.dtype]:
    """The dtype fuseforge attention runs these inputs in, or None when it does not take them."""
    autocast_dtype = _autocast_dtype(query.device)
    # Under autocast with fp32 weights, q and k leave the rotary embedding in fp32 while v is bf16:
    # all three are cast to the autocast dtype, as SDPA's autocast rule does.
    if autocast_dtype is None and not (query.dtype == key.dtype == value.dtype):
        return None
    dtype = autocast_dtype or query.dtype
    if query.device.type == "cuda":
        if dtype not in (torch.float16, torch.bfloat16) or query.shape[-1] not in _CUDA_HEAD_DIMS:
            return None
    elif query.device.type == "cpu":
        if not dtype.is_floating_point:
            return None
    else:
        return None
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return None
    if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        return None
    return dtype


def fuseforge_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                attention_mask: Optional[Tensor], dropout: float = 0.0,
                                scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                                **kwargs):
    """transformers attention function: query (B, Hq, Sq, D), key/value (B, Hk, Sk, D) -> output
    (B, Sq, Hq, D), None. Falls back to transformers' SDPA function where the kernel does not apply."""
    dtype = _kernel_dtype(query, key, value)
    unsupported = (attention_mask is not None or dtype is None or dropout != 0.0
                   or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
                   or kwargs.get("cache") is not None or kwargs.get("output_attentions", False)
                   or kwargs.get("s_aux") is not None)
    if unsupported:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        _count("sdpa")
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, is_causal=is_causal, **kwargs)
    _count("fuseforge")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # A single query attends to every cached key: with the kernel's bottom-right alignment causal is
    # exact for Sq == 1 as well, and for Sq == Sk it is the plain causal mask.
    out = attention(query.to(dtype), key.to(dtype), value.to(dtype), causal=bool(causal), scale=scaling)
    return out.transpose(1, 2), None  # the output has query's strides: often (B, S, H, D) memory


def fuseforge_mask(*args, **kwargs):
    """transformers mask function: None (the kernel applies the causal mask itself) for plain causal
    attention without a padding mask, with as many queries as keys or one query: the cases where
    SDPA's mask function returns None outside tracing. Everything else goes to SDPA's mask function.
    Keyword names as transformers passes them (q_length, or cache_position in older releases)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function
    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:
        q_length = kwargs["cache_position"].shape[0]
    kv_length, local_size = kwargs.get("kv_length"), kwargs.get("local_size")
    if (not args and kwargs.get("allow_is_causal_skip", True) and kwargs.get("attention_mask") is None
            and kwargs.get("mask_function") is causal_mask_function
            and isinstance(q_length, int) and isinstance(kv_length, int) and q_length in (1, kv_length)
            and (local_size is None or kv_length < local_size)):
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


def _register() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, fuseforge_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, fuseforge_mask)


def causal_lm_loss(hidden_states: Tensor, lm_head: nn.Linear, labels: Optional[Tensor] = None,
                   shift_labels: Optional[Tensor] = None, num_items_in_batch=None,
                   ignore_index: int = -100) -> Tensor:
    """transformers' ForCausalLMLoss on ``lm_head(hidden_states)``, without the logits."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = shift_labels.reshape(-1).to(x.device)
    dtype = _autocast_dtype(x.device) or x.dtype
    weight, bias = lm_head.weight, lm_head.bias
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(x.to(dtype), weight.to(dtype), target, None if bias is None else bias.to(dtype),
                                ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """The Llama-family ForCausalLM forward with the loss from linear_cross_entropy."""
    original = type(self).forward
    keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
    if labels is None or not keep_all:
        return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                        use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return_dict = kwargs.pop("return_dict", None)
    decoder = getattr(self, self.base_model_prefix)
    outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                      **kwargs)
    loss = causal_lm_loss(outputs.last_hidden_state, self.lm_head, labels, kwargs.get("shift_labels"),
                          kwargs.get("num_items_in_batch"))
    out = CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                 hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
        return out.to_tuple()
    return out


def is_patched(model: nn.Module) -> bool:
    return hasattr(model, _STATE)


def patch(model: nn.Module) -> nn.Module:
    """Routes a Llama / Mistral / Qwen2 model's attention through fuseforge attention and, for the
    ForCausalLM classes, computes the training loss with linear_cross_entropy. In place; returns the
    model. Patching a patched model does nothing."""
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        raise TypeError(f"fuseforge.patch: model must be one of {', '.join(SUPPORTED_MODELS)}, got {name}")
    if is_patched(model):
        return model
    _register()
    state = {"attn_implementation": model.config._attn_implementation, "forward": False}
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise RuntimeError(f"fuseforge.patch: {name} did not accept attn_implementation={ATTN_IMPLEMENTATION!r}")
    if name.endswith("ForCausalLM"):
        model.forward = types.MethodType(_causal_lm_forward, model)
        state["forward"] = True
    setattr(model, _STATE, state)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undoes patch(): the attention implementation the model had, and its class's forward."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    model.set_attn_implementation(state["attn_implementation"])
    if state["forward"]:
        del model.forward
    delattr(model, _STATE)
    return model
