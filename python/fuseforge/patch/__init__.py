"""`fuseforge.patch(model)` / `fuseforge.unpatch(model)` for Hugging Face Llama-family models (Llama,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, OLMo 2, Granite, GLM: SUPPORTED_MODELS).

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
   gradient.

3. The decoder layers' RMSNorm, rotary embedding, gated-MLP activation and the residual add before
   the second norm run fuseforge's rms_norm, rotary and glu ops (`fuseforge.patch.layers`).

unpatch() restores the attention implementation, the forwards and the decoder modules. Both return the model.
"""
from __future__ import annotations

import math
import sys
import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fuseforge.ops.attention import attention, attention_varlen
from fuseforge.ops.linear_cross_entropy import linear_cross_entropy

ATTN_IMPLEMENTATION = "fuseforge"
SUPPORTED_MODELS = ("LlamaForCausalLM", "LlamaModel", "MistralForCausalLM", "MistralModel",
                    "Qwen2ForCausalLM", "Qwen2Model", "Qwen3ForCausalLM", "Qwen3Model", "Phi3ForCausalLM",
                    "Phi3Model", "Gemma2ForCausalLM", "Gemma2Model", "Gemma3ForCausalLM", "Gemma3TextModel",
                    "Olmo2ForCausalLM", "Olmo2Model", "GraniteForCausalLM", "GraniteModel", "GlmForCausalLM",
                    "GlmModel")


def _cuda_head_dim_supported(d: int) -> bool:
    # attention.h's cuda_head_dim_supported: multiples of 8 up to 128, and 256 (Gemma 2).
    return d == 256 or (0 < d <= 128 and d % 8 == 0)


def _cuda_kernel_takes(dtype: torch.dtype, head_dim: int, device: torch.device, needs_grad: bool) -> bool:
    """Whether the CUDA kernels run this call, forward and (when needed) backward. Head dim 256's
    backward is sm_90a code only (attention_bwd_warpspec.cuh): elsewhere it raises, so a call that
    will need it goes to SDPA instead (the forward alone runs on every GPU). A build without sm_90a
    code on an H100 (TORCH_CUDA_ARCH_LIST=9.0, not the default) is not detected here: its backward
    raises the op's error. get_device_properties is constant-folded by torch.compile."""
    if dtype not in (torch.float16, torch.bfloat16) or not _cuda_head_dim_supported(head_dim):
        return False
    if head_dim == 256 and needs_grad:
        props = torch.cuda.get_device_properties(device)
        return (props.major, props.minor) == (9, 0)
    return True


_STATE = "_fuseforge_patch"
_MASKING_UTILS = "transformers.masking_utils"

# How many attention calls took each path since import (tests and benchmarks read these):
# "fuseforge" the kernel (of which "varlen" packed documents through attention_varlen), "sdpa" the
# fallback to transformers (its SDPA function, or the model's eager function for softcapping).
# Eager calls only: a counter bumped inside a torch.compile'd region would be a guard on its value
# and recompile the graph on every step.
stats = {"fuseforge": 0, "varlen": 0, "sdpa": 0}


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
        needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        if not _cuda_kernel_takes(dtype, query.shape[-1], query.device, needs_grad):
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


# ----------------------------------------------------------------------------------------------
# The masks: which of transformers' masks the kernel computes itself


_MISSING = object()


def _closure(fn, name: str):
    """The value of the free variable `name` of a transformers mask closure (_MISSING when it has none:
    a release whose closure differs is not recognised, and its mask goes to SDPA)."""
    try:
        return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents
    except (AttributeError, TypeError, ValueError, IndexError):
        return _MISSING


def _made_by(fn, factory: str, inner: str = "inner_mask") -> bool:
    """Whether `fn` is the closure `inner` that transformers.masking_utils.<factory> returns."""
    return (getattr(fn, "__module__", None) == _MASKING_UTILS
            and getattr(fn, "__qualname__", None) == f"{factory}.<locals>.{inner}"
            and getattr(fn, "__closure__", None) is not None)


def _describe_unpacked(mask_function):
    """(sliding_window,) for causal_mask_function (None) or and_masks(sliding_window_overlay(W),
    causal_mask_function) (W), else None."""
    from transformers.masking_utils import causal_mask_function
    if mask_function is causal_mask_function:
        return (None,)
    if not _made_by(mask_function, "and_masks", "and_mask"):
        return None
    parts = _closure(mask_function, "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    first, second = parts
    if _made_by(first, "sliding_window_overlay") and second is causal_mask_function:
        window = _closure(first, "sliding_window")
        if isinstance(window, int) and not isinstance(window, bool) and window >= 1:
            return (window,)
    return None


def _describe_mask(mask_function):
    """(sliding_window, doc_ids) when `mask_function` is one of the mask factories transformers builds
    for these models, else None. sliding_window: W of `sliding_window_overlay(W)` or None; doc_ids: the
    (B, S) packed-sequence index tensor of `packed_sequence_mask_function` or None. The structures
    (create_causal_mask / create_sliding_window_causal_mask in transformers.masking_utils):
      causal_mask_function
      and_masks(sliding_window_overlay(W), causal_mask_function)
    and, for packed documents (find_packed_sequence_indices), either one as
      and_masks(<it>, packed_sequence_mask_function(doc_ids))                  (transformers <= 5.17)
      and_masks(remap_positions_for_packed_sequence(<it>, position_ids),
                packed_sequence_mask_function(doc_ids))                        (later releases)
    A document is a contiguous run of equal indices (doc_ids is a cumulative sum) within which
    position_ids step by 1 (that is where transformers splits documents): both the packed row's own
    indices and the remapped positions differ within a document as the document's own indices do, so
    either form is the kernel's causal mask and window per document."""
    described = _describe_unpacked(mask_function)
    if described is not None:
        return described[0], None
    if not _made_by(mask_function, "and_masks", "and_mask"):
        return None
    parts = _closure(mask_function, "mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    first, second = parts
    if not _made_by(second, "packed_sequence_mask_function"):
        return None
    if _made_by(first, "remap_positions_for_packed_sequence"):
        first = _closure(first, "mask_function")
    inner = _describe_unpacked(first)
    doc_ids = _closure(second, "packed_sequence_mask")
    if inner is None or not torch.is_tensor(doc_ids) or doc_ids.dim() != 2:
        return None
    return inner[0], doc_ids


def _cu_seqlens_from_doc_ids(doc_ids: Tensor):
    """(cu_seqlens int32 on doc_ids' device, max length) of the documents of a (B, S) packed-sequence
    index (rows one after another, a new document where the index changes). One host sync."""
    starts = torch.ones(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = starts.reshape(-1).cpu()  # the one synchronisation
    bounds = torch.cat([torch.nonzero(starts).reshape(-1), torch.tensor([starts.numel()])])
    max_len = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
    return bounds.to(dtype=torch.int32, device=doc_ids.device), max_len


def _doc_ids_from_position_ids(position_ids: Tensor, batch: int) -> Tensor:
    """transformers' find_packed_sequence_indices without its early exit: (B, S) document index, a new
    document where position_ids do not step by 1."""
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    pos = pos.expand(batch, -1) if pos.shape[0] != batch else pos
    step = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def _doc_ids_from_cu_seqlens(cu: Tensor, total: int) -> Tensor:
    """(1, total) document index of each packed row from cumulative lengths."""
    rows = torch.arange(total, device=cu.device)
    return (torch.searchsorted(cu[1:].to(rows.dtype), rows, right=True)).unsqueeze(0)


class KernelMask:
    """What the fuseforge mask function returns in place of a mask the kernel computes itself:
    causal, with `sliding_window` W (key j visible from query i when i - W < j <= i) or without, per
    document of a packed batch when `doc_ids` is set. The decoder layers pass it to the attention
    function as `attention_mask`; transformers' modeling code treats masks as opaque (a BlockMask for
    flex attention, None for flash). `materialize()` builds SDPA's boolean mask for the fallback."""

    __slots__ = ("sliding_window", "doc_ids", "length", "documents_from_positions", "_mask_kwargs", "_packed",
                 "_mask")

    def __init__(self, sliding_window: Optional[int], doc_ids: Optional[Tensor], length: int, mask_kwargs: dict,
                 documents_from_positions: bool = False):
        self.sliding_window = sliding_window
        self.doc_ids = doc_ids
        self.length = length
        # transformers looks for packed documents only without a cache object; with an empty one
        # (use_cache=True in training, a prefill) the attention function finds them in position_ids,
        # as transformers' flash-attention path does.
        self.documents_from_positions = documents_from_positions
        self._mask_kwargs = mask_kwargs
        self._packed = None
        self._mask = None

    @property
    def window(self):
        return None if self.sliding_window is None else (self.sliding_window - 1, 0)

    def cu_seqlens(self, position_ids: Optional[Tensor] = None, batch: int = 1):
        """(cu_seqlens, max length) of the packed documents, or None when every row is one document;
        computed on first use and shared by every layer that gets this mask: one host sync per mask
        per forward (not one per layer)."""
        if self._packed is None:
            doc_ids = self.doc_ids
            if doc_ids is None and self.documents_from_positions and position_ids is not None:
                doc_ids = _doc_ids_from_position_ids(position_ids, batch)
            packed = None
            if doc_ids is not None:
                cu, max_len = _cu_seqlens_from_doc_ids(doc_ids)
                packed = (cu, max_len) if cu.numel() - 1 > doc_ids.shape[0] else None
            self._packed = (packed,)
        return self._packed[0]

    def materialize(self) -> Tensor:
        """The boolean (B, 1, S, S) mask transformers' SDPA mask function builds for this request."""
        if self._mask is None:
            from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
            self._mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**{**self._mask_kwargs, "allow_is_causal_skip": False})
        return self._mask

    def __repr__(self):
        return (f"KernelMask(sliding_window={self.sliding_window}, packed={self.doc_ids is not None}, "
                f"length={self.length})")


def _no_padding(attention_mask, kv_length) -> bool:
    """A 2D padding mask that hides nothing (read on the host, as SDPA's mask function does)."""
    if attention_mask is None:
        return True
    if (attention_mask.dim() != 2 or attention_mask.shape[-1] != kv_length
            or torch.compiler.is_compiling() or attention_mask.device.type == "meta"):
        return False
    return bool(attention_mask.all())


def fuseforge_mask(*args, **kwargs):
    """transformers mask function (keyword arguments as create_causal_mask /
    create_sliding_window_causal_mask pass them). None (plain causal: the kernel applies it) for the
    causal mask without padding with as many queries as keys or one query: the cases where SDPA's
    mask function returns None outside tracing. A KernelMask for the causal / sliding-window / packed
    masks of a forward without cache offsets. Everything else goes to SDPA's mask function."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    if args:
        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)
    q_length = kwargs.get("q_length")
    if q_length is None and kwargs.get("cache_position") is not None:  # older releases
        q_length = kwargs["cache_position"].shape[0]
    kv_length, local_size = kwargs.get("kv_length"), kwargs.get("local_size")
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    described = _describe_mask(kwargs.get("mask_function"))
    sizes_known = isinstance(q_length, int) and isinstance(kv_length, int)
    if described is not None and sizes_known:
        sliding_window, doc_ids = described
        # A forward over whole sequences (training, a prefill): no offsets, queries == keys.
        whole = (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == 0 and kv_offset == 0
                 and q_length == kv_length)
        # Packed documents need cu_seqlens on the host: eager only (while tracing, SDPA's mask).
        traceable = doc_ids is None or not torch.compiler.is_compiling()
        if whole and traceable and _no_padding(kwargs.get("attention_mask"), kv_length):
            # transformers looks for packed documents only without a 2D mask and without a cache
            # object, and the mask function cannot tell whether there was one (an empty DynamicCache
            # with use_cache=True, the default, in training): without a 2D mask the attention function
            # looks at position_ids itself (one host sync per forward, read in the first layer), as
            # transformers' flash-attention path does. Not while tracing (cu_seqlens need the host).
            from_positions = (doc_ids is None and kwargs.get("attention_mask") is None
                              and not torch.compiler.is_compiling())
            if sliding_window is None and doc_ids is None and not from_positions:
                return None
            return KernelMask(sliding_window, doc_ids, q_length, {**kwargs, "attention_mask": None},
                              documents_from_positions=from_positions)
        # Decode steps and cached prefixes: plain causal only, on SDPA's own conditions.
        if (sliding_window is None and doc_ids is None and kwargs.get("allow_is_causal_skip", True)
                and kwargs.get("attention_mask") is None and q_length in (1, kv_length)
                and (local_size is None or kv_length < local_size)):
            return None
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**kwargs)


# ----------------------------------------------------------------------------------------------
# The attention function


def _varlen_kwargs(kwargs):
    """flash-attention's varlen keyword arguments when all four are given, else None."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    values = [kwargs.get(n) for n in names]
    return None if any(v is None for v in values) else values


def _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    """transformers' SDPA function (or, with softcapping, the model's eager function) with the mask
    transformers would have built: a KernelMask materialised; flash-attention's varlen kwargs as the
    block-diagonal mask their flash path applies."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    _count("sdpa")
    mask = attention_mask.materialize() if isinstance(attention_mask, KernelMask) else attention_mask
    varlen = _varlen_kwargs(kwargs)
    kwargs = {k: v for k, v in kwargs.items()
              if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    softcap = kwargs.pop("softcap", None)
    b, sq, sk = query.shape[0], query.shape[2], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # Documents transformers' mask does not hold: flash-attention's varlen kwargs (used first, as in
    # the kernel path), or those the kernel path finds in position_ids (a forward with a cache object).
    doc_ids = None
    known = isinstance(attention_mask, KernelMask) and attention_mask.doc_ids is not None
    if varlen is not None and not known and b == 1 and sq == sk:
        doc_ids = _doc_ids_from_cu_seqlens(varlen[0].to(query.device), sq)
    elif (isinstance(attention_mask, KernelMask) and attention_mask.documents_from_positions
          and attention_mask.cu_seqlens(kwargs.get("position_ids"), b) is not None):
        doc_ids = _doc_ids_from_position_ids(kwargs["position_ids"], b)
    if doc_ids is not None:
        same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
        if mask is None:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device)
            mask = mask.tril(sk - sq) if causal else mask
        if mask.dtype == torch.bool:
            mask = mask & same_doc
    if softcap is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                               is_causal=is_causal, **kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(f"fuseforge.patch: softcapping fallback needs {type(module).__module__}"
                                  ".eager_attention_forward")
    if mask is None:  # the causal mask SDPA would apply itself (bottom-right: one query sees every key)
        mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device)
        mask = mask.tril(sk - sq) if causal else mask
    if mask.dtype == torch.bool:  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs)


def fuseforge_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                                is_causal: Optional[bool] = None, **kwargs):
    """transformers attention function: query (B, Hq, Sq, D), key/value (B, Hk, Sk, D) -> output
    (B, Sq, Hq, D), None. `attention_mask` None (causal, or none when not is_causal), a KernelMask
    (causal, sliding window, packed documents) or a tensor. The `sliding_window` keyword is not read:
    the mask carries the window transformers built for the layer (SDPA, too, applies only the mask).
    Falls back to transformers where the kernel does not apply."""
    dtype = _kernel_dtype(query, key, value)
    softcap = kwargs.get("softcap")
    kernel_mask = isinstance(attention_mask, KernelMask)
    unsupported = ((attention_mask is not None and not kernel_mask) or dtype is None or dropout != 0.0
                   or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
                   or kwargs.get("output_attentions", False) or kwargs.get("s_aux") is not None
                   or (kernel_mask and not (query.shape[2] == key.shape[2] == attention_mask.length))
                   or (softcap is not None and not (softcap > 0 and math.isfinite(softcap))))
    if unsupported:
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    varlen = _varlen_kwargs(kwargs)
    if varlen is not None and (kernel_mask or query.shape[2] == key.shape[2]):
        cu_q, cu_k, max_q, max_k = varlen
        max_q, max_k = int(max_q), int(max_k)  # ints from the collator (a tensor: one sync)
    elif kernel_mask and (packed := attention_mask.cu_seqlens(kwargs.get("position_ids"), query.shape[0])):
        cu_q, max_q = packed
        cu_k, max_k = cu_q, max_q
    else:
        cu_q = None
    window = attention_mask.window if kernel_mask else None
    # A KernelMask is causal by construction; None is causal unless the module says otherwise.
    causal = True if kernel_mask else bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    _count("fuseforge")
    if cu_q is None:
        # A single query attends to every cached key: with the kernel's bottom-right alignment causal is
        # exact for Sq == 1 as well, and for Sq == Sk it is the plain causal mask.
        out = attention(query.to(dtype), key.to(dtype), value.to(dtype), causal=causal, scale=scaling,
                        window=window, softcap=softcap)
        return out.transpose(1, 2), None  # the output has query's strides: often (B, S, H, D) memory
    # Packed documents: the (B * S, H, D) views of (B, H, S, D) tensors whose memory is (B, S, H, D)
    # (the projections' layout; for B = 1, query[0].transpose(0, 1) always is a view).
    _count("varlen")
    b, hq, s, d = query.shape
    q, k, v = (x.to(dtype).transpose(1, 2).reshape(-1, x.shape[1], d) for x in (query, key, value))
    out = attention_varlen(q, k, v, cu_q.to(device=q.device, dtype=torch.int32),
                           cu_k.to(device=q.device, dtype=torch.int32), max_q, max_k, causal=causal, scale=scaling,
                           window=window, softcap=softcap)
    return out.view(b, s, hq, d), None


def _register() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, fuseforge_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, fuseforge_mask)


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


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                       labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """The Llama-family ForCausalLM forward with the loss from linear_cross_entropy. The cache travels
    in kwargs under the caller's name (`cache`, or `past_key_values` before transformers renamed it)."""
    original = type(self).forward
    keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
    if labels is None or not keep_all:
        return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, labels=labels,
                        use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return_dict = kwargs.pop("return_dict", None)
    decoder = getattr(self, self.base_model_prefix)
    outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      inputs_embeds=inputs_embeds, use_cache=use_cache,
                      **kwargs)
    loss = self.lm_head(outputs.last_hidden_state, loss_labels=labels, shift_labels=kwargs.get("shift_labels"),
                        num_items_in_batch=kwargs.get("num_items_in_batch"),
                        softcap=getattr(self.config, "final_logit_softcapping", None),
                        logits_scaling=getattr(self.config, "logits_scaling", None))
    # the cache field is `cache` since transformers renamed `past_key_values` (the old name warns)
    cache_field = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    out = CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                 attentions=outputs.attentions, **{cache_field: getattr(outputs, cache_field, None)})
    if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
        return out.to_tuple()
    return out


def is_patched(model: nn.Module) -> bool:
    return hasattr(model, _STATE)


def patch(model: nn.Module, *, attention: bool = True, loss: bool = True, rms_norm: bool = True,
          rotary: bool = True, glu: bool = True, fuse_residual: bool = True) -> nn.Module:
    """Routes a Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3 / OLMo 2 / Granite / GLM model
    (SUPPORTED_MODELS) through fuseforge: the
    attention, for the ForCausalLM classes the training loss (linear_cross_entropy), and in the decoder
    layers RMSNorm, rotary embeddings, the gated MLP's activation and the residual add fused into the
    next norm (fuseforge.patch.layers). Each keyword turns one of them off. In place; returns the model.
    Patching a patched model does nothing."""
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
                                ("fuse_residual", fuse_residual)) if on]
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
