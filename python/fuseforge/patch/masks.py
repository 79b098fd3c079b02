"""The masks of fuseforge.patch: which of transformers' masks the attention kernel computes itself
(KernelMask, returned by the mask function fuseforge_mask in place of a materialised mask)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_MASKING_UTILS = "transformers.masking_utils"

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
    """Whether `fn` is the closure `inner` that transformers.masking_utils.<factory> returns. The name
    is read from the code object: while tracing, dynamo answers getattr(closure, "__qualname__") with
    None."""
    code = getattr(fn, "__code__", None)
    qualname = getattr(code, "co_qualname", None) or getattr(fn, "__qualname__", None)
    return (getattr(fn, "__module__", None) == _MASKING_UTILS
            and qualname == f"{factory}.<locals>.{inner}"
            and getattr(fn, "__closure__", None) is not None)


# Whether the forward in flight runs rows that are each one sequence: set by the patched
# ForCausalLM forward when it was given neither position_ids nor an attention mask (transformers
# then numbers every row 0..S-1). Eager transformers finds that out from the positions itself;
# while tracing it cannot, and hands the mask function a per-token document index, which would send
# every layer to SDPA with a materialised mask. With this set, the index is dropped.
_whole_rows = {"on": False}


def set_whole_rows(on: bool) -> bool:
    """Sets the flag above; returns its previous value (to restore)."""
    previous = _whole_rows["on"]
    _whole_rows["on"] = on
    return previous


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
    if described is None and _whole_rows["on"] and torch.compiler.is_compiling():
        # Some torch releases' dynamo cannot inspect a mask closure made inside the traced region.
        # Rows that are whole sequences leave transformers' causal mask or, with local_size, its
        # sliding-window mask (the only masks the patched families build without a 2D mask).
        described = (local_size, None)
    sizes_known = isinstance(q_length, int) and isinstance(kv_length, int)
    if described is not None and sizes_known:
        sliding_window, doc_ids = described
        if doc_ids is not None and _whole_rows["on"]:
            doc_ids = None  # one document a row (see _whole_rows)
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
