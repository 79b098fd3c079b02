"""The loss of fuseforge.patch: the causal-LM loss by linear_cross_entropy from the last hidden
states and lm_head's weight, inside a call of the lm_head module."""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fuseforge.ops.linear_cross_entropy import linear_cross_entropy
from fuseforge.patch.attention import _autocast_dtype
from fuseforge.patch.masks import set_whole_rows


def causal_lm_loss(hidden_states: Tensor, lm_head: nn.Linear, labels: Optional[Tensor] = None,
                   shift_labels: Optional[Tensor] = None, num_items_in_batch=None,
                   ignore_index: int = -100, softcap: Optional[float] = None,
                   logits_scaling: Optional[float] = None) -> Tensor:
    """transformers' ForCausalLMLoss on ``lm_head(hidden_states)`` (divided by ``logits_scaling``:
    Granite's; capped to ``softcap * tanh(logits / softcap)`` with a softcap: Gemma 2's
    final_logit_softcapping), without the logits."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if logits_scaling is not None and logits_scaling != 1.0:
        hidden_states = hidden_states / logits_scaling  # (x / s) W^T = (x W^T) / s, on the narrow side
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    target = shift_labels.reshape(-1).to(x.device)
    dtype = _autocast_dtype(x.device) or x.dtype
    weight, bias = lm_head.weight, lm_head.bias
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = linear_cross_entropy(x.to(dtype), weight.to(dtype), target, None if bias is None else bias.to(dtype),
                                ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _lm_head_forward(self, hidden_states: Tensor, loss_labels: Optional[Tensor] = None,
                     shift_labels: Optional[Tensor] = None, num_items_in_batch=None,
                     softcap: Optional[float] = None, logits_scaling: Optional[float] = None) -> Tensor:
    """The patched lm_head's forward: its class's (logits) without labels, else the causal-LM loss
    from its weight. A module call rather than a read of lm_head.weight, so FSDP2's hooks on the head
    (a separately sharded one) gather the weight before and reduce-scatter its gradient after."""
    if loss_labels is None and shift_labels is None:
        return type(self).forward(self, hidden_states)
    return causal_lm_loss(hidden_states, self, loss_labels, shift_labels, num_items_in_batch, softcap=softcap,
                          logits_scaling=logits_scaling)


def _logits_scaling(model: nn.Module) -> Optional[float]:
    """What the model divides its logits by: Granite's logits_scaling, or one over the logit_scale that
    Cohere multiplies them by."""
    scale = getattr(model, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1.0:
        return 1.0 / scale
    return getattr(model.config, "logits_scaling", None)


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                       labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """The Llama-family ForCausalLM forward with the loss from linear_cross_entropy. The cache travels
    in kwargs under the caller's name (`cache`, or `past_key_values` before transformers renamed it).
    A mixture-of-experts model (one with `router_aux_loss_coef`) adds its router load-balancing loss
    as its own forward does, when `output_router_logits` (the argument, else the config's) asks."""
    original = type(self).forward
    keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
    moe = hasattr(self, "router_aux_loss_coef")
    if moe and labels is not None and keep_all:
        router_logits_wanted = kwargs.pop("output_router_logits", None)
        if router_logits_wanted is None:
            router_logits_wanted = self.config.output_router_logits
        kwargs["output_router_logits"] = router_logits_wanted
    # Without position_ids, a mask or varlen arguments, every row is one sequence (masks._whole_rows).
    whole_rows = position_ids is None and attention_mask is None and kwargs.get("cu_seq_lens_q") is None
    previous = set_whole_rows(whole_rows)
    try:
        if labels is None or not keep_all:
            return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, labels=labels,
                            use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        decoder = getattr(self, self.base_model_prefix)
        outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          inputs_embeds=inputs_embeds, use_cache=use_cache,
                          **kwargs)
    finally:
        set_whole_rows(previous)
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    loss = self.lm_head(outputs.last_hidden_state, loss_labels=labels, shift_labels=kwargs.get("shift_labels"),
                        num_items_in_batch=kwargs.get("num_items_in_batch"),
                        softcap=getattr(self.config, "final_logit_softcapping", None),
                        logits_scaling=_logits_scaling(self))
    # the cache field is `cache` since transformers renamed `past_key_values` (the old name warns)
    cache_field = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    fields = dict(logits=None, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                  **{cache_field: getattr(outputs, cache_field, None)})
    if moe:
        aux_loss = None
        if kwargs["output_router_logits"]:
            balance = sys.modules[type(self).__module__].load_balancing_loss_func
            aux_loss = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        out = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, router_logits=outputs.router_logits, **fields)
    else:
        out = CausalLMOutputWithPast(loss=loss, **fields)
    if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
        return out.to_tuple()
    return out
