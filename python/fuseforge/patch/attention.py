"""The attention function of fuseforge.patch: transformers' attention interface entry that runs
fuseforge.attention / attention_varlen, and falls back to transformers' own functions for what the
kernels do not take."""
from __future__ import annotations

import math
import sys
from typing import Optional

import torch
from torch import Tensor, nn

from fuseforge.ops.attention import attention, attention_varlen
from fuseforge.patch.masks import KernelMask, _doc_ids_from_cu_seqlens, _doc_ids_from_position_ids, fuseforge_mask

ATTN_IMPLEMENTATION = "fuseforge"


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
