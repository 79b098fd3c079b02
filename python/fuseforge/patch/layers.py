"""The decoder half of `fuseforge.patch`: RMSNorm / LayerNorm, rotary embeddings, the gated MLP's
activation and the residual add, routed through fuseforge's ops on one model instance.

What is replaced, each an instance `forward` (the classes are untouched, so other models are not):
- every RMSNorm module of a family in NORMS: `fuseforge.rms_norm` (Llama's `w * x` or Gemma's
  `(1 + w) * x`), and every LayerNorm over the hidden size (LAYER_NORMS: OLMo's, StableLM's):
  `fuseforge.layer_norm`; each takes an optional `residual=` so that the add before it is the same pass;
- the attention module: the projections, the q / k norms where the family has them (Qwen3, Gemma 3),
  `fuseforge.rotary` from `position_ids` and the rotary module's current `inv_freq` (so Llama 3, YaRN,
  linear, dynamic and long-rope scaling are Hugging Face's own), then the attention function the model is
  set to, and the output projection;
- the MLP: `fuseforge.glu` on the gate and up projections (or on Phi-3's fused gate_up projection) for
  SiLU, tanh-GELU and GELU; a mixture-of-experts block's dense and shared-expert MLPs too, and its
  experts' gate (`act(gate) * up` on the grouped [gate | up] projection, in transformers' experts
  implementations) while their routing and matrix products stay the model's code; under autocast with
  float32 weights, the grouped and batched experts' matrix products in the autocast dtype, as autocast
  runs every other matrix product of the model (transformers casts their input to the weights' dtype,
  which runs them in float32), the backward casting the weights again rather than keeping the copies;
- the decoder layer: the residual add after attention goes into the next norm (`norm(h, residual=r)`
  returns the normalised output and `h + r` in one pass).

Under autocast a norm whose input is float32 (the residual stream of float32 weights) returns the
autocast dtype directly: its consumers are matrix products that would cast it, so the values are the
ones eager computes, in half the bytes. Anything the kernels do not take (an activation or a dtype
without a kernel, attention without position_ids) runs the module's own forward.
"""
from __future__ import annotations

import contextlib
import types
from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from fuseforge.ops.glu import glu
from fuseforge.ops.layer_norm import layer_norm
from fuseforge.ops.rms_norm import rms_norm
from fuseforge.ops.rotary import rotary

# RMSNorm classes and their weight offset: 0 for w * x, 1 for Gemma's (1 + w) * x.
NORMS = {"LlamaRMSNorm": 0.0, "MistralRMSNorm": 0.0, "MinistralRMSNorm": 0.0, "Qwen2RMSNorm": 0.0,
         "Qwen3RMSNorm": 0.0, "Phi3RMSNorm": 0.0, "Olmo2RMSNorm": 0.0, "Olmo3RMSNorm": 0.0, "GraniteRMSNorm": 0.0,
         "GlmRMSNorm": 0.0, "HeliumRMSNorm": 0.0, "Ernie4_5RMSNorm": 0.0, "SmolLM3RMSNorm": 0.0,
         "SeedOssRMSNorm": 0.0, "Exaone4RMSNorm": 0.0, "HunYuanDenseV1RMSNorm": 0.0, "MixtralRMSNorm": 0.0,
         "Qwen2MoeRMSNorm": 0.0, "Qwen3MoeRMSNorm": 0.0, "OlmoeRMSNorm": 0.0, "Ernie4_5_MoeRMSNorm": 0.0,
         "HunYuanMoEV1RMSNorm": 0.0, "GraniteMoeRMSNorm": 0.0, "Glm4MoeRMSNorm": 0.0, "Glm4RMSNorm": 0.0,
         "GemmaRMSNorm": 1.0, "Gemma2RMSNorm": 1.0, "Gemma3RMSNorm": 1.0}
# LayerNorm classes: OLMo's (no weight or bias, eps 1e-5), torch.nn.LayerNorm (StableLM) and Cohere's
# (a weight, no bias), the ones over the hidden size only (StableLM's and Cohere's per-head q / k norms
# keep their own code).
LAYER_NORMS = ("OlmoLayerNorm", "LayerNorm", "CohereLayerNorm", "Cohere2LayerNorm")
# Hugging Face activation names and glu's.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": None, "gelu": "gelu"}
# Decoder layers whose norms sit before each block (Llama) or around it (Gemma 2 / 3's four norms).
# OLMo 2 normalises after each block, before the add, and Granite scales the block's output before
# the add (OLMo 3 and EXAONE 4 too): their residual adds stay as they are.
PRE_NORM_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "MinistralDecoderLayer", "Qwen2DecoderLayer",
                   "Qwen3DecoderLayer", "Phi3DecoderLayer", "GlmDecoderLayer", "HeliumDecoderLayer",
                   "Ernie4_5DecoderLayer", "SmolLM3DecoderLayer", "SeedOssDecoderLayer", "HunYuanDenseV1DecoderLayer",
                   "GemmaDecoderLayer", "MixtralDecoderLayer", "Qwen2MoeDecoderLayer", "Qwen3MoeDecoderLayer",
                   "OlmoeDecoderLayer", "Ernie4_5_MoeDecoderLayer", "HunYuanMoEV1DecoderLayer", "Glm4MoeDecoderLayer",
                   "OlmoDecoderLayer", "StableLmDecoderLayer", "Starcoder2DecoderLayer")
# Layers with a norm before and after each block: their (post-attention, pre-MLP, post-MLP) norms' names.
SANDWICH_LAYERS = {
    "Gemma2DecoderLayer": ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "Gemma3DecoderLayer": ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "Glm4DecoderLayer": ("post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
}
# Attention classes whose rotation pairs dims 2i and 2i + 1 (GLM's) instead of i and i + R / 2.
INTERLEAVED_ROTARY = ("GlmAttention", "Glm4Attention", "HeliumAttention", "Ernie4_5Attention", "Ernie4_5_MoeAttention",
                      "CohereAttention", "Cohere2Attention")
# Attention classes that rotate only in their sliding-window layers (Cohere 2's full layers: no positions).
SLIDING_ONLY_ROTARY = ("Cohere2Attention",)
# Attention classes whose full-attention layers rotate nothing and see the whole sequence when the model
# also has sliding layers (EXAONE 4's hybrid models: every layer holds sliding_window, is_sliding says
# which use it).
HYBRID_NOPE_ATTENTION = ("Exaone4Attention",)
FEATURES = ("rms_norm", "rotary", "glu", "fuse_residual", "experts")
# transformers' experts implementations that cast their input to the weights' dtype.
CASTING_EXPERTS = ("grouped_mm", "batched_mm")

_PATCHED = "_fuseforge_layer_patch"


# ----------------------------------------------------------------------------------------------
# RMSNorm and LayerNorm


def _norm_out_dtype(x: Tensor) -> torch.dtype:
    if x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        if dtype in (torch.float16, torch.bfloat16):
            return dtype
    return x.dtype


def _same_dtype(x: Tensor, residual: Optional[Tensor]):
    """(x, residual) in one dtype: the residual stream (float32 under autocast) and a branch's output
    (bfloat16) sum in the wider type, as the unfused add gives."""
    if residual is not None and residual.dtype != x.dtype:
        wide = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(wide), residual.to(wide)
    return x, residual


def _module_norm(norm: nn.Module, x: Tensor, residual: Optional[Tensor]):
    """The norm module's own forward, on x + residual where there is one (returned beside it)."""
    h = x if residual is None else x + residual
    out = type(norm).forward(norm, h)
    return out if residual is None else (out, h)


def _norm_eps(norm: nn.Module, default: Optional[float] = None) -> Optional[float]:
    """The norm module's epsilon, `variance_epsilon` (Llama's RMSNorm, Cohere's LayerNorm) or `eps`
    (Gemma's RMSNorm, torch.nn.LayerNorm); `default` where it has neither."""
    eps = getattr(norm, "variance_epsilon", None)
    return getattr(norm, "eps", default) if eps is None else eps


def _norm_forward(self, hidden_states: Tensor, residual: Optional[Tensor] = None):
    """The patched RMSNorm: `norm(x)`, or with a residual `(norm(x + residual), x + residual)`."""
    offset = self._fuseforge_weight_offset
    eps = _norm_eps(self)
    weight = self.weight
    x, residual = _same_dtype(hidden_states, residual)
    # Llama's form returns weight * normalised.to(input dtype): a float32 weight on a 16-bit input without
    # autocast gives float32, which the kernel does not write; so does a weight of a third type.
    takes = weight.dtype in (x.dtype, torch.float32) and (
        offset != 0.0 or weight.dtype == x.dtype or torch.is_autocast_enabled(x.device.type))
    if not takes:
        return _module_norm(self, x, residual)
    return rms_norm(x, weight, eps, residual=residual, weight_offset=offset, out_dtype=_norm_out_dtype(x))


def _layer_norm_forward(self, hidden_states: Tensor, residual: Optional[Tensor] = None):
    """The patched LayerNorm: `norm(x)`, or with a residual `(norm(x + residual), x + residual)`."""
    weight, bias = getattr(self, "weight", None), getattr(self, "bias", None)
    x, residual = _same_dtype(hidden_states, residual)
    if any(p is not None and p.dtype not in (x.dtype, torch.float32) for p in (weight, bias)):
        return _module_norm(self, x, residual)
    # OLMo's norm has no epsilon attribute: its forward passes layer_norm's default, 1e-5.
    return layer_norm(x, weight, bias, _norm_eps(self, 1e-5), residual=residual, out_dtype=_norm_out_dtype(x))


def _patched_layer_norm(module: nn.Module, config) -> bool:
    cls = type(module).__name__
    if cls == "OlmoLayerNorm":
        return True
    if cls in ("CohereLayerNorm", "Cohere2LayerNorm"):
        return tuple(module.weight.shape) == (config.hidden_size,)
    return cls == "LayerNorm" and isinstance(module, nn.LayerNorm) and \
        tuple(module.normalized_shape) == (config.hidden_size,)


def _norm_with_residual(norm: nn.Module, x: Tensor, residual: Tensor):
    """(norm(x + residual), x + residual), in one pass when `norm` is patched."""
    if getattr(norm, "_fuseforge_norm", False):
        return norm(x, residual=residual)
    h = residual + x
    return norm(h), h


# ----------------------------------------------------------------------------------------------
# Rotary embeddings and attention


def _rope_source(rotary_emb: nn.Module, config, layer_idx: int):
    """(inv_freq attribute, attention_scaling attribute) of the rotary module for one layer, or None.
    Read at call time: dynamic and long-rope scaling replace inv_freq in the rotary module's forward,
    which the model still runs once per forward before its layers."""
    if hasattr(rotary_emb, "inv_freq"):
        return "inv_freq", "attention_scaling"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_idx < len(layer_types):
        name = layer_types[layer_idx]
        if hasattr(rotary_emb, f"{name}_inv_freq"):
            return f"{name}_inv_freq", f"{name}_attention_scaling"
    return None


def _attention_function(module: nn.Module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from fuseforge.patch.attention import ATTN_IMPLEMENTATION, fuseforge_attention_forward
    impl = module.config._attn_implementation
    if impl == ATTN_IMPLEMENTATION:
        return fuseforge_attention_forward
    if impl in (None, "eager"):
        import sys
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return ALL_ATTENTION_FUNCTIONS[impl]


def _hybrid_full_attention(attn: nn.Module) -> bool:
    """A hybrid EXAONE 4's full-attention layer: no rotary, no window."""
    return (type(attn).__name__ in HYBRID_NOPE_ATTENTION and attn.sliding_window is not None
            and not attn.is_sliding)


def _rotates(attn: nn.Module) -> bool:
    """False for SmolLM3's NoPE layers and the full-attention layers of a hybrid EXAONE 4 and of Cohere 2."""
    if type(attn).__name__ in SLIDING_ONLY_ROTARY:
        return attn.sliding_window is not None
    return getattr(attn, "use_rope", True) and not _hybrid_full_attention(attn)


def _layer_window(attn: nn.Module) -> Optional[int]:
    return None if _hybrid_full_attention(attn) else attn.sliding_window


def _residual_dropout(module: nn.Module, out: Tensor) -> Tensor:
    """Seed-OSS's dropout on a block's output (`residual_dropout`), as its own forward applies it."""
    p = getattr(module, "residual_dropout", 0.0)
    return nn.functional.dropout(out, p=p, training=module.training) if p else out


def _attention_forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask=None, **kwargs):
    """Hugging Face's decoder attention with the rotation by fuseforge.rotary. Without position_ids
    (or a rotary module it knows) the module's own forward runs."""
    position_ids = kwargs.get("position_ids")
    # OLMoE's clip_qkv clamps the projections, which this forward does not.
    if position_ids is None or self._fuseforge_rope is None or getattr(self.config, "clip_qkv", None) is not None:
        return type(self).forward(self, hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, **kwargs)
    # The cache keyword: `cache`, or `past_key_values` before transformers renamed it (training with
    # use_cache=True gets an empty one too).
    cache = kwargs.pop("cache", None)
    legacy_cache = kwargs.pop("past_key_values", None)
    rotary_emb, freq_name, scaling_name = self._fuseforge_rope
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    if hasattr(self, "qkv_proj"):  # Phi-3: one projection, [q | k | v]
        qkv = self.qkv_proj(hidden_states)
        q_size = self.config.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
        query, key, value = (t.view(hidden_shape) for t in (query, key, value))
    else:
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        value = self.v_proj(hidden_states).view(hidden_shape)
    if hasattr(self, "q_norm"):  # norms before the rotation: per head (Qwen3, Gemma 3; Cohere's with a
        # weight a head) or of the whole projection (OLMo 2)
        if self.q_norm.weight.numel() == self.head_dim or self.q_norm.weight.dim() == 2:
            query, key = self.q_norm(query), self.k_norm(key)
        else:
            query = self.q_norm(query.flatten(-2)).view(hidden_shape)
            key = self.k_norm(key.flatten(-2)).view(hidden_shape)
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    if getattr(self, "qk_layernorm", False):  # StableLM's per-head LayerNorms, on (B, H, S, D)
        query, key = self.q_layernorm(query), self.k_layernorm(key)
    if _rotates(self):
        inv_freq = getattr(rotary_emb, freq_name)
        scaling = float(getattr(rotary_emb, scaling_name, 1.0))
        query, key = rotary(query, key, inv_freq.to(device=query.device, dtype=torch.float32),
                            position_ids.to(query.device), scaling,
                            interleaved=type(self).__name__ in INTERLEAVED_ROTARY)
    if hasattr(self, "query_layernorm"):  # HunYuan's per-head q / k norms, after the rotation
        query, key = self.query_layernorm(query), self.key_layernorm(key)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    elif legacy_cache is not None:
        key, value = legacy_cache.update(key, value, self.layer_idx)
    extra = {}
    if hasattr(self, "attn_logit_softcapping"):
        extra["softcap"] = self.attn_logit_softcapping
    if hasattr(self, "sliding_window"):
        extra["sliding_window"] = _layer_window(self)
    attn_output, attn_weights = _attention_function(self)(
        self, query, key, value, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scaling, **extra, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return _residual_dropout(self, self.o_proj(attn_output)), attn_weights


# ----------------------------------------------------------------------------------------------
# MLP


def _mlp_forward(self, x: Tensor) -> Tensor:
    if hasattr(self, "gate_up_proj"):  # Phi-3: [gate | up] from one projection, read in place
        return self.down_proj(glu(self.gate_up_proj(x), None, self._fuseforge_activation))
    out = self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self._fuseforge_activation))
    return _residual_dropout(self, out)


def _experts_gate(self, gate_up: Tensor) -> Tensor:
    """transformers' experts' `_apply_gate`: act(gate) * up of the [gate | up] rows, read in place."""
    return glu(gate_up, None, self._fuseforge_activation)


def _experts_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    """The experts with float32 weights under autocast: the model's forward on the weights cast to the
    autocast dtype (the casts are differentiable: the gradients reach the float32 weights), so its
    grouped GEMMs run in that dtype. The backward casts the weights again instead of keeping the
    forward's copies (`_recast_in_backward`)."""
    device = hidden_states.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    implementation = getattr(getattr(self, "config", None), "_experts_implementation", None)
    if (self._fuseforge_casting or implementation not in CASTING_EXPERTS
            or dtype not in (torch.float16, torch.bfloat16)):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    params = dict(self.named_parameters(recurse=False))
    copies = {p: p.to(dtype) for p in params.values() if p.dtype == torch.float32}
    if not copies:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    cast = {name: copies.get(p, p) for name, p in params.items()}
    self._fuseforge_casting = True  # functional_call calls this forward again: the model's runs there
    try:
        with _recast_in_backward(copies):
            return torch.func.functional_call(self, cast, (hidden_states, *args), kwargs)
    finally:
        self._fuseforge_casting = False


def _recast_in_backward(casts: dict):
    """Saved-tensor hooks under which a tensor the autograd graph saves that is (a view of) one of the
    `casts` values, `{float32 parameter: its copy in a 16-bit dtype}`, is saved as its parameter and cast
    again when the backward needs it: the copies (a 16-bit copy of every expert weight, 1.2 GB a
    Qwen3-30B-A3B layer) are then freed after the forward instead of living until the backward. Inside
    torch.compile the graph's own partitioner decides what to save, and under hooks already set
    (activation checkpointing drops every saved tensor, the copies too) those decide: no hooks there."""
    if torch.compiler.is_compiling() or _saved_tensor_hooks_set():
        return contextlib.nullcontext()
    by_storage = {c.untyped_storage().data_ptr(): (p, c.dtype) for p, c in casts.items()}

    def pack(t: Tensor):
        if t.layout != torch.strided or t.is_nested:
            return t
        source = by_storage.get(t.untyped_storage().data_ptr())
        if source is None or t.dtype != source[1]:
            return t
        return _Recast(source[0], source[1], t.size(), t.stride(), t.storage_offset())

    def unpack(saved):
        return saved.tensor() if isinstance(saved, _Recast) else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _saved_tensor_hooks_set() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class _Recast(NamedTuple):
    """A saved view of a parameter's 16-bit copy, rebuilt from the parameter."""
    param: Tensor
    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    offset: int

    def tensor(self) -> Tensor:
        return self.param.to(self.dtype).as_strided(self.size, self.stride, self.offset)


def _experts_activation(experts: nn.Module, config) -> Optional[str]:
    """glu's activation for experts that gate with transformers' default `_apply_gate` (act(gate) * up
    of concatenated [gate | up] rows), else None (an interleaved layout, a model's own gate)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    if getattr(type(experts), "_apply_gate", None) is not _default_apply_gate or "_apply_gate" in experts.__dict__:
        return None
    if not getattr(experts, "has_gate", False) or not getattr(experts, "is_concatenated", False):
        return None
    return _config_activation(config)


def _config_activation(config) -> Optional[str]:
    """glu's name for the model's gated activation, or None where glu has no kernel for it."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    return ACTIVATIONS.get(name) if isinstance(name, str) else None


def _mlp_activation(mlp: nn.Module, config) -> Optional[str]:
    if not (hasattr(mlp, "gate_up_proj") or hasattr(mlp, "gate_proj")):
        return None
    return _config_activation(config)


# ----------------------------------------------------------------------------------------------
# Decoder layers with the residual add in the next norm


def _pre_norm_layer_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    """Llama's decoder layer: h = x + attn(norm1(x)); out = h + mlp(norm2(h)), with norm2 taking the add."""
    if args:  # the models pass everything but the hidden states by name
        return type(self).forward(self, hidden_states, *args, **kwargs)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states, residual = _norm_with_residual(self.post_attention_layernorm, hidden_states, residual)
    out = self.mlp(hidden_states)
    if isinstance(getattr(self, "dropout", None), nn.Dropout):  # StableLM's, on the MLP's output
        out = self.dropout(out)
    return residual + out


def _sandwich_layer_forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
    """Gemma 2 / 3's and GLM-4's decoder layer (a norm before and after each block), the first add in the
    pre-MLP norm."""
    if args:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    post_attention, pre_mlp, post_mlp = (getattr(self, name) for name in SANDWICH_LAYERS[type(self).__name__])
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states = post_attention(hidden_states)
    hidden_states, residual = _norm_with_residual(pre_mlp, hidden_states, residual)
    hidden_states = post_mlp(self.mlp(hidden_states))
    return residual + hidden_states


def _no_residual_dropout(layer: nn.Module) -> bool:
    """Phi-3's residual dropouts must be identities for the fused form (p = 0, or eval)."""
    for name in ("resid_attn_dropout", "resid_mlp_dropout"):
        drop = getattr(layer, name, None)
        if isinstance(drop, nn.Dropout) and drop.p > 0:
            return False
    return True


# ----------------------------------------------------------------------------------------------
# Patching


def _set_forward(module: nn.Module, fn, patched: list, name: str = "forward") -> None:
    # An instance method set before (another wrapper's) comes back at unpatch.
    patched.append((module, module.__dict__.get(name), name))
    setattr(module, name, types.MethodType(fn, module))


def patch_layers(model: nn.Module, features=FEATURES) -> list:
    """Installs the features named (a subset of FEATURES) on `model`'s modules; returns the modules
    whose forward was replaced, with their previous instance forward (unpatch_layers restores it)."""
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"fuseforge.patch: unknown layer features {sorted(unknown)}; have {FEATURES}")
    config = model.config
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    rotary_emb = getattr(base, "rotary_emb", None)
    patched: list = []
    for module in model.modules():
        cls = type(module).__name__
        if "rms_norm" in features and cls in NORMS:
            module._fuseforge_weight_offset = NORMS[cls]
            module._fuseforge_norm = True
            _set_forward(module, _norm_forward, patched)
        elif "rms_norm" in features and cls in LAYER_NORMS and _patched_layer_norm(module, config):
            module._fuseforge_norm = True
            _set_forward(module, _layer_norm_forward, patched)
        elif "glu" in features and cls.endswith("MLP"):
            act = _mlp_activation(module, config)
            if act is not None:
                module._fuseforge_activation = act
                _set_forward(module, _mlp_forward, patched)
        elif cls.endswith("Experts"):
            act = _experts_activation(module, config) if "glu" in features else None
            if act is not None:
                module._fuseforge_activation = act
                _set_forward(module, _experts_gate, patched, name="_apply_gate")
            if "experts" in features:
                module._fuseforge_casting = False
                _set_forward(module, _experts_forward, patched)
        elif "rotary" in features and cls.endswith("Attention") and hasattr(module, "o_proj") \
                and rotary_emb is not None and hasattr(module, "layer_idx"):
            source = _rope_source(rotary_emb, config, module.layer_idx)
            module._fuseforge_rope = None if source is None else (rotary_emb, *source)
            _set_forward(module, _attention_forward, patched)
        elif "fuse_residual" in features and "rms_norm" in features and _no_residual_dropout(module):
            if cls in PRE_NORM_LAYERS and not getattr(module, "use_parallel_residual", False):
                _set_forward(module, _pre_norm_layer_forward, patched)
            elif cls in SANDWICH_LAYERS:
                _set_forward(module, _sandwich_layer_forward, patched)
    return patched


def unpatch_layers(patched: list) -> None:
    for module, previous, name in patched:
        if previous is not None:
            setattr(module, name, previous)
        elif name in module.__dict__:
            delattr(module, name)
        for attr in ("_fuseforge_weight_offset", "_fuseforge_norm", "_fuseforge_activation", "_fuseforge_rope",
                     "_fuseforge_casting"):
            if attr in module.__dict__:
                delattr(module, attr)
