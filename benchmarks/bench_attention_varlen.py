"""Benchmark: fuseforge's packed variable-length, sliding-window and softcapped attention
against FlexAttention and SDPA-cuDNN. CUDA only; bf16; every impl of a case in one run.

Cases:
- "docs/T32768/H<h>/D<d>/causal" (D128 with H16, D64 with H32: hidden 2048; D96 with H32: Phi-3-mini's
  heads, hidden 3072, where fuseforge runs its 128 kernels with zero columns): a packed batch of
  documents whose lengths are log-uniform over 64..8192 tokens (a long tail: every octave holds as
  many documents, so most tokens sit in long ones; `random.Random(0)`, the same documents for every
  D), drawn until they fill T = 32768 tokens, the last one truncated to fit: 18 documents of 216 to
  5287 tokens. Causal within each document, Hq = Hk. Impls:
    fuseforge          fuseforge.attention_varlen on the packed (T, H, D) tensors.
    flex               torch.compile(flex_attention) on the packed sequence as one batch of 1,
                       (1, H, T, D), with a document-causal BlockMask (create_block_mask over a
                       document-id tensor; mask_mod: same document and q >= kv). The block mask is
                       built once per batch outside the timed region, as a user would build it once
                       per batch and reuse it across layers; its build time (second build, wall clock)
                       is the rows' `block_mask_ms`.
    sdpa_cudnn_loop    a Python loop of F.scaled_dot_product_attention(is_causal=True) per document
                       under sdpa_kernel(CUDNN_ATTENTION) (entered once around the loop), on (1, H, L, D)
                       views of the packed tensors (contiguous per-document copies, made outside the
                       timed region, where cuDNN refuses the views: the row's `layout` says which).
                       fwdbwd: each document's q, k, v are their own leaves (no slice-backward into a
                       packed gradient), one autograd.grad over all of them.
    sdpa_cudnn_padded  one SDPA-cuDNN call (is_causal=True) on the right-padded batch (B = number of
                       documents, S = the longest one; padding zeros, built outside the timed region).
                       A real query only sees keys before it, so causal masking already hides every
                       padding key from it; the padded query rows compute garbage that is ignored (and
                       get a zero output gradient).
    sdpa_cudnn_best    not run: a copy of the faster of the two SDPA rows of the pass (`best_of` names it).
- "window4096/B2/H16/S16384/D128/causal": a sliding window of 4096 tokens including the query itself.
    fuseforge          fuseforge.attention(causal=True, window=(4095, 0)).
    flex               compiled flex_attention with a sliding-window causal BlockMask (q >= kv, q - kv < 4096).
    fuseforge_causal   fuseforge.attention(causal=True) at the same shape (no window).
  The issue's bar: window ms ~ causal ms x the fraction of the causal 128 x 128 tiles (fuseforge's
  forward tile; the backward's tiles differ a little, the same fraction is used) that the window
  leaves unskipped (`tile_fraction`: 0.448 here, the visible pairs' fraction being 0.437); the
  fuseforge window rows carry `causal_x_tile_fraction_ms` (fuseforge_causal's ms of that pass times
  tile_fraction) and `vs_causal_x_tile_fraction` (the window's ms over it: 1.0 meets the bar).
- "softcap50/B2/Hq32/Hk16/S4096/D128/causal": Gemma 2 attention-logit softcapping, softcap 50, scale
  1/sqrt(128). Gemma-2-27B has 32 query and 16 KV heads of head dim 128 (the 27B model itself scales by
  1/sqrt(144), which changes nothing in the timing).
- "softcap50/B2/Hq16/Hk8/S4096/D256/causal": the same at Gemma-2-9B's heads (16 query, 8 KV, head dim
  256, the issue's shape), scale 1/sqrt(256).
  q is scaled by 25 so that scores reach the cap (the output then depends on the softcap; timing does
  not depend on the data).
    fuseforge            fuseforge.attention(causal=True, softcap=50, scale=1/sqrt(128)), GQA.
    flex                 compiled flex_attention, causal BlockMask, score_mod = 50 * tanh(score / 50),
                         enable_gqa=True.
    fuseforge_nosoftcap  fuseforge.attention(causal=True) at the same shape: the cost of the softcap.

FLOPs (the same count for every impl of a case, so TFLOP/s compares): only the visible (q, k) pairs
count, each 4 D flops per query head in the forward (q k^T and P V); fwdbwd counts 3.5 x the forward
(the backward's five matmuls). Visible pairs: L (L + 1) / 2 for a causal sequence of L tokens (summed
over documents: the padded SDPA's extra work on padding is not counted), W (W + 1) / 2 + (S - W) W
for a causal window of W tokens. Every row carries `tokens` (the real tokens: T, or B x S) and
`tokens_per_s` (tokens / the pass's time).
rel_err (fwd rows): an output slice against an fp32 reference of that slice, head 0 (and batch 0):
docs: the last min(L, 1024) query rows of the longest document (not the first one: its offset in the
packed batch is nonzero here); window and softcap: the last 1024 query rows of the sequence.

An impl that fails (the extension not built, a Flex compile error, cuDNN refusing the shapes, out of
memory in its first run) is not timed: its rows are written with "error": "skipped" and a `reason`
(listed under the markdown table too). Defaults to 3 rounds (harness.time_interleaved); a run of all
cases takes several minutes, most of it Flex's compiles. `--settle-ms 600 --rounds 2`: each impl
timed after 0.6 s of itself (bench_attention.py says why; results/attention_varlen_settled.md).
Flags as harness.run: --cases (substrings, e.g. "docs", "D64", "window", "softcap"), --impls (impls
that run: sdpa_cudnn_best is derived, not run), --rounds N, --settle-ms MS, --out, --no-memory.
Needs the extension built with attention_varlen, window and
softcap (fuseforge's rows are skipped, with the import error as the reason, where it is not).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

import harness  # noqa: E402
from harness import Bench, log  # noqa: E402

CASES = ["docs/T32768/H16/D128/causal", "docs/T32768/H32/D64/causal", "docs/T32768/H32/D96/causal",
         "window4096/B2/H16/S16384/D128/causal", "softcap50/B2/Hq32/Hk16/S4096/D128/causal",
         "softcap50/B2/Hq16/Hk8/S4096/D256/causal"]
DOC_MIN, DOC_MAX, DOC_SEED = 64, 8192, 0
REF_ROWS = 1024          # query rows of the fp32 reference slice
TILE = (128, 128)        # fuseforge's forward tile (kBlockM, kBlockN), for the window's tile fraction
SOFTCAP_Q_SCALE = 25.0

SKIPPED: list[dict] = []  # rows of impls that could not run, added to the results after harness.run
_selected_impls: list[str] = []  # --impls: set up only these (empty: all)


# ---------------------------------------------------------------- cases, documents, counts (pure)

def parse_case(case: str) -> dict:
    """"docs/T32768/H16/D128/causal" -> {"kind": "docs", "param": None, "T": 32768, "H": 16, "D": 128,
    "causal": True}; the first field's number (window size, softcap) is "param"."""
    fields = case.split("/")
    head = fields[0]
    kind = head.rstrip("0123456789")
    out: dict = {"kind": kind, "param": int(head[len(kind):]) if head[len(kind):] else None, "causal": False}
    for f in fields[1:]:
        if f == "causal":
            out["causal"] = True
            continue
        key = f.rstrip("0123456789")
        if not key or key == f:
            raise ValueError(f"case {case!r}: field {f!r} is not <name><number>")
        out[key] = int(f[len(key):])
    if kind not in ("docs", "window", "softcap"):
        raise ValueError(f"case {case!r}: unknown kind {kind!r}")
    return out


def doc_lengths(total: int, lo: int = DOC_MIN, hi: int = DOC_MAX, seed: int = DOC_SEED) -> list[int]:
    """Document lengths log-uniform over [lo, hi] (seeded), drawn until they fill `total` tokens; the
    last one truncated to fit."""
    rng = random.Random(seed)
    lengths: list[int] = []
    filled = 0
    while filled < total:
        n = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        n = min(max(n, lo), hi, total - filled)
        lengths.append(n)
        filled += n
    return lengths


def cu_seqlens(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def causal_pairs(n: int) -> int:
    """Visible (q, k) pairs of causal attention over n tokens (the diagonal included)."""
    return n * (n + 1) // 2


def window_pairs(s: int, w: int) -> int:
    """Visible pairs of causal attention over s tokens with a window of w tokens (the query included):
    query i sees min(i + 1, w) keys."""
    w = min(w, s)
    return w * (w + 1) // 2 + (s - w) * w


def visible_tiles(s: int, left: int = -1, block_m: int = TILE[0], block_n: int = TILE[1]) -> int:
    """Number of (block_m query rows) x (block_n keys) tiles of causal attention over s tokens that hold
    at least one visible pair; `left` >= 0: a window where query i sees keys i - left .. i."""
    count = 0
    for m0 in range(0, s, block_m):
        m1 = min(m0 + block_m, s) - 1
        for n0 in range(0, s, block_n):
            n1 = min(n0 + block_n, s) - 1
            # visible iff some j <= i (n0 <= m1) and the closest pair is within the window
            if n0 <= m1 and (left < 0 or m0 - n1 <= left):
                count += 1
    return count


def tile_fraction(s: int, window: int, block_m: int = TILE[0], block_n: int = TILE[1]) -> float:
    """Tiles a causal window of `window` tokens visits / tiles full causal attention visits."""
    return visible_tiles(s, window - 1, block_m, block_n) / visible_tiles(s, -1, block_m, block_n)


# ---------------------------------------------------------------- masks for FlexAttention

def doc_causal_mask_mod(doc_id: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)
    return mask_mod


def sliding_window_mask_mod(window: int):
    """Causal, and at most `window` tokens back, the query included (fuseforge's window=(window - 1, 0))."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return mask_mod


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def softcap_score_mod(cap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return score_mod


def doc_ids(lengths: list[int], device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                   torch.tensor(lengths, dtype=torch.int64)).to(device)


def build_block_mask(mask_mod, seq_len: int, device) -> tuple:
    """(BlockMask over one (1, H, seq_len) sequence, ms of a second build): built once, outside the timing."""
    from torch.nn.attention.flex_attention import create_block_mask
    mask = create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)
    _sync(device)
    t0 = time.perf_counter()
    mask = create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)
    _sync(device)
    return mask, (time.perf_counter() - t0) * 1000


# ---------------------------------------------------------------- reference and errors

def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
              causal: bool = True, left: int = -1, softcap: float = 0.0) -> torch.Tensor:
    """fp32 attention of the query rows q (R, D) at positions q_pos over keys k, v (Sk, D) at 0..Sk-1."""
    q, k, v = q.float(), k.float(), v.float()
    s = (q @ k.T) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.arange(k.shape[0], device=q.device)
    qp = q_pos.to(q.device).view(-1, 1)
    hide = torch.zeros_like(s, dtype=torch.bool)
    if causal:
        hide |= kpos.view(1, -1) > qp
    if left >= 0:
        hide |= qp - kpos.view(1, -1) > left
    return torch.softmax(s.masked_fill(hide, float("-inf")), -1) @ v


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _reason(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _skip(case: str, impl: str, passes, reason: str) -> None:
    log(f"  {impl}: skipped ({reason})")
    for p in passes:
        SKIPPED.append({"case": case, "pass": p, "impl": impl, "error": "skipped", "reason": reason})


def _wanted(impl: str) -> bool:
    return not _selected_impls or impl in _selected_impls


def add_impl(benches: list, case: str, name: str, fwd: Callable, fwdbwd: Callable,
             pick: Callable, ref: torch.Tensor, fwd_flops: float, extra: dict, device="cuda") -> None:
    """Runs the impl's fwd and fwdbwd once (compiles, checks that the backend takes the case) and adds
    its Benches; a pass that fails is recorded as skipped with the reason, the others still run."""
    if not _wanted(name):
        return
    try:
        log(f"  {name}: first fwd")
        out = fwd()
        _sync(device)
        err = rel_err(pick(out), ref)
        del out
    except Exception as e:  # noqa: BLE001  (compile errors, backends refusing the case, OOM): say why
        _skip(case, name, ("fwd", "fwdbwd"), _reason(e))
        _free(device)
        return
    benches.append(Bench(case, "fwd", name, fwd, flops=fwd_flops, rel_err=err, extra=dict(extra)))
    try:
        log(f"  {name}: first fwd+bwd")
        grads = fwdbwd()
        _sync(device)
        del grads
    except Exception as e:  # noqa: BLE001
        _skip(case, name, ("fwdbwd",), _reason(e))
        _free(device)
        return
    benches.append(Bench(case, "fwdbwd", name, fwdbwd, flops=3.5 * fwd_flops, extra=dict(extra)))


def _free(device) -> None:
    import gc
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _fuseforge():
    """fuseforge's attention functions, or the reason they cannot be had (the extension not built)."""
    try:
        from fuseforge.ops.attention import attention, attention_varlen  # imports fuseforge (loads _C)
        return (attention, attention_varlen), None
    except Exception as e:  # noqa: BLE001
        return None, _reason(e)


def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


# ---------------------------------------------------------------- the cases

def impls_docs(case: str, p: dict, q, k, v, grad, lengths: list[int], sdpa_backend=None,
               device="cuda") -> list[Bench]:
    """The docs case's benches from packed (T, H, D) q, k, v and output gradient. sdpa_backend: the
    SDPBackend of the SDPA impls (None: SDPA's own choice, for trying this on the CPU)."""
    from contextlib import nullcontext
    T, H, D = q.shape
    scale = 1.0 / math.sqrt(D)
    cu = cu_seqlens(lengths)
    max_len = max(lengths)
    fwd_flops = 4.0 * D * H * sum(causal_pairs(n) for n in lengths)
    extra = {"tokens": T, "docs": len(lengths), "max_len": max_len}
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    # reference: the last rows of the longest document, head 0
    r = max(range(len(lengths)), key=lambda i: (lengths[i], i))
    a, L = cu[r], lengths[r]
    rows = min(L, REF_ROWS)
    ref = reference(q[a + L - rows:a + L, 0], k[a:a + L, 0], v[a:a + L, 0],
                    torch.arange(L - rows, L), scale, causal=True)
    ref_rows = slice(a + L - rows, a + L)  # in the packed sequence
    benches: list[Bench] = []

    def ctx():
        from torch.nn.attention import sdpa_kernel
        return sdpa_kernel(sdpa_backend) if sdpa_backend is not None else nullcontext()

    # fuseforge
    ff, why = _fuseforge() if _wanted("fuseforge") else (None, None)
    if ff is not None:
        attention_varlen = ff[1]
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)

        def ff_fwd():
            with torch.no_grad():
                return attention_varlen(q, k, v, cu_t, cu_t, max_len, max_len, causal=True)

        def ff_fwdbwd():
            o = attention_varlen(qg, kg, vg, cu_t, cu_t, max_len, max_len, causal=True)
            return torch.autograd.grad(o, (qg, kg, vg), grad)

        add_impl(benches, case, "fuseforge", ff_fwd, ff_fwdbwd, lambda o: o[ref_rows, 0], ref, fwd_flops, extra,
                 device)
    elif why is not None:
        _skip(case, "fuseforge", ("fwd", "fwdbwd"), why)

    # FlexAttention, compiled, packed sequence as one batch of 1 with a document-causal block mask
    if _wanted("flex"):
        try:
            log("  flex: building the document-causal block mask")
            block_mask, mask_ms = build_block_mask(doc_causal_mask_mod(doc_ids(lengths, device)), T, device)
            flex = _compiled_flex()
            qf, kf, vf, gf = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, grad))
            qfg, kfg, vfg = (t.detach().clone().requires_grad_(True) for t in (qf, kf, vf))

            def flex_fwd():
                with torch.no_grad():
                    return flex(qf, kf, vf, block_mask=block_mask, scale=scale)

            def flex_fwdbwd():
                o = flex(qfg, kfg, vfg, block_mask=block_mask, scale=scale)
                return torch.autograd.grad(o, (qfg, kfg, vfg), gf)

            add_impl(benches, case, "flex", flex_fwd, flex_fwdbwd, lambda o: o[0, 0, ref_rows], ref, fwd_flops,
                     {**extra, "block_mask_ms": round(mask_ms, 3)}, device)
        except Exception as e:  # noqa: BLE001  (flex_attention missing, block mask failure)
            _skip(case, "flex", ("fwd", "fwdbwd"), _reason(e))

    # SDPA per document: (1, H, L, D) views of the packed tensors (or contiguous copies)
    if _wanted("sdpa_cudnn_loop"):
        def per_doc(t, contiguous):
            views = [t[cu[i]:cu[i + 1]].transpose(0, 1).unsqueeze(0) for i in range(len(lengths))]
            return [x.contiguous() for x in views] if contiguous else views

        for contiguous in (False, True):
            qs, ks, vs, gs = (per_doc(t, contiguous) for t in (q, k, v, grad))
            leaves = [[x.detach().clone() if contiguous else x.detach() for x in ts] for ts in (qs, ks, vs)]
            for ts in leaves:
                for x in ts:
                    x.requires_grad_(True)
            flat_leaves = [x for ts in zip(*leaves) for x in ts]

            def loop_fwd(qs=qs, ks=ks, vs=vs):
                with torch.no_grad(), ctx():
                    return [F.scaled_dot_product_attention(a_, b_, c_, is_causal=True)
                            for a_, b_, c_ in zip(qs, ks, vs)]

            def loop_fwdbwd(leaves=leaves, flat_leaves=flat_leaves, gs=gs):
                with ctx():
                    outs = [F.scaled_dot_product_attention(a_, b_, c_, is_causal=True) for a_, b_, c_ in zip(*leaves)]
                return torch.autograd.grad(outs, flat_leaves, gs)

            try:  # does the backend take this layout (forward and backward)? One document.
                loop_fwd(qs[:1], ks[:1], vs[:1])
                one = [ts[:1] for ts in leaves]
                loop_fwdbwd(one, [x for ts in one for x in ts], gs[:1])
                _sync(device)
            except Exception as e:  # noqa: BLE001
                if not contiguous:
                    log(f"  sdpa_cudnn_loop: strided views refused ({_reason(e)}): contiguous copies")
                    continue
            layout = "contiguous per-document copies" if contiguous else "views of the packed tensors"
            add_impl(benches, case, "sdpa_cudnn_loop", loop_fwd, loop_fwdbwd, lambda o: o[r][0, 0, L - rows:],
                     ref, fwd_flops, {**extra, "layout": layout}, device)
            break

    # SDPA on the right-padded batch
    if _wanted("sdpa_cudnn_padded"):
        try:
            def pad(t):
                out = t.new_zeros(len(lengths), H, max_len, D)
                for i in range(len(lengths)):
                    out[i, :, :lengths[i]] = t[cu[i]:cu[i + 1]].transpose(0, 1)
                return out

            qp, kp, vp, gp = (pad(t) for t in (q, k, v, grad))  # gp: zero gradient on padding rows
            qpg, kpg, vpg = (t.detach().clone().requires_grad_(True) for t in (qp, kp, vp))

            def pad_fwd():
                with torch.no_grad(), ctx():
                    return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)

            def pad_fwdbwd():
                with ctx():
                    o = F.scaled_dot_product_attention(qpg, kpg, vpg, is_causal=True)
                return torch.autograd.grad(o, (qpg, kpg, vpg), gp)

            add_impl(benches, case, "sdpa_cudnn_padded", pad_fwd, pad_fwdbwd, lambda o: o[r, 0, L - rows:L], ref,
                     fwd_flops, {**extra, "padded_tokens": len(lengths) * max_len}, device)
        except Exception as e:  # noqa: BLE001  (out of memory building the padded batch)
            _skip(case, "sdpa_cudnn_padded", ("fwd", "fwdbwd"), _reason(e))
    return benches


def impls_window(case: str, p: dict, q, k, v, grad, device="cuda") -> list[Bench]:
    B, H, S, D = q.shape
    W = p["param"]
    scale = 1.0 / math.sqrt(D)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    rows = min(S, REF_ROWS)
    q_pos = torch.arange(S - rows, S)
    ref_w = reference(q[0, 0, S - rows:], k[0, 0], v[0, 0], q_pos, scale, causal=True, left=W - 1)
    ref_c = reference(q[0, 0, S - rows:], k[0, 0], v[0, 0], q_pos, scale, causal=True)
    flops_w = 4.0 * D * B * H * window_pairs(S, W)
    flops_c = 4.0 * D * B * H * causal_pairs(S)
    frac = tile_fraction(S, W)
    extra = {"tokens": B * S, "window": W, "tile_fraction": round(frac, 4)}
    pick = lambda o: o[0, 0, S - rows:]  # noqa: E731
    benches: list[Bench] = []

    ff, why = _fuseforge() if (_wanted("fuseforge") or _wanted("fuseforge_causal")) else (None, None)
    if ff is not None:
        attention = ff[0]
        for name, window, ref, flops in (("fuseforge", (W - 1, 0), ref_w, flops_w),
                                         ("fuseforge_causal", None, ref_c, flops_c)):
            def f_fwd(window=window):
                with torch.no_grad():
                    return attention(q, k, v, causal=True, window=window)

            def f_fwdbwd(window=window):
                o = attention(qg, kg, vg, causal=True, window=window)
                return torch.autograd.grad(o, (qg, kg, vg), grad)

            add_impl(benches, case, name, f_fwd, f_fwdbwd, pick, ref, flops,
                     extra if window else {"tokens": B * S}, device)
    elif why is not None:
        for name in ("fuseforge", "fuseforge_causal"):
            _skip(case, name, ("fwd", "fwdbwd"), why)

    if _wanted("flex"):
        try:
            log("  flex: building the sliding-window block mask")
            block_mask, mask_ms = build_block_mask(sliding_window_mask_mod(W), S, device)
            flex = _compiled_flex()

            def flex_fwd():
                with torch.no_grad():
                    return flex(q, k, v, block_mask=block_mask, scale=scale)

            def flex_fwdbwd():
                o = flex(qg, kg, vg, block_mask=block_mask, scale=scale)
                return torch.autograd.grad(o, (qg, kg, vg), grad)

            add_impl(benches, case, "flex", flex_fwd, flex_fwdbwd, pick, ref_w, flops_w,
                     {**extra, "block_mask_ms": round(mask_ms, 3)}, device)
        except Exception as e:  # noqa: BLE001
            _skip(case, "flex", ("fwd", "fwdbwd"), _reason(e))
    return benches


def impls_softcap(case: str, p: dict, q, k, v, grad, device="cuda") -> list[Bench]:
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    cap = float(p["param"])
    scale = 1.0 / math.sqrt(D)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    rows = min(S, REF_ROWS)
    q_pos = torch.arange(S - rows, S)
    ref_s = reference(q[0, 0, S - rows:], k[0, 0], v[0, 0], q_pos, scale, causal=True, softcap=cap)
    ref_n = reference(q[0, 0, S - rows:], k[0, 0], v[0, 0], q_pos, scale, causal=True)
    fwd_flops = 4.0 * D * B * Hq * causal_pairs(S)
    extra = {"tokens": B * S, "softcap": cap}
    pick = lambda o: o[0, 0, S - rows:]  # noqa: E731
    benches: list[Bench] = []

    ff, why = _fuseforge() if (_wanted("fuseforge") or _wanted("fuseforge_nosoftcap")) else (None, None)
    if ff is not None:
        attention = ff[0]
        for name, c, ref in (("fuseforge", cap, ref_s), ("fuseforge_nosoftcap", None, ref_n)):
            def f_fwd(c=c):
                with torch.no_grad():
                    return attention(q, k, v, causal=True, scale=scale, softcap=c)

            def f_fwdbwd(c=c):
                o = attention(qg, kg, vg, causal=True, scale=scale, softcap=c)
                return torch.autograd.grad(o, (qg, kg, vg), grad)

            add_impl(benches, case, name, f_fwd, f_fwdbwd, pick, ref, fwd_flops,
                     extra if c else {"tokens": B * S}, device)
    elif why is not None:
        for name in ("fuseforge", "fuseforge_nosoftcap"):
            _skip(case, name, ("fwd", "fwdbwd"), why)

    if _wanted("flex"):
        try:
            log("  flex: building the causal block mask")
            block_mask, mask_ms = build_block_mask(causal_mask_mod, S, device)
            flex = _compiled_flex()
            score_mod = softcap_score_mod(cap)
            gqa = Hq != Hk

            def flex_fwd():
                with torch.no_grad():
                    return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)

            def flex_fwdbwd():
                o = flex(qg, kg, vg, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
                return torch.autograd.grad(o, (qg, kg, vg), grad)

            add_impl(benches, case, "flex", flex_fwd, flex_fwdbwd, pick, ref_s, fwd_flops,
                     {**extra, "block_mask_ms": round(mask_ms, 3)}, device)
        except Exception as e:  # noqa: BLE001
            _skip(case, "flex", ("fwd", "fwdbwd"), _reason(e))
    return benches


def setup(case: str) -> list[Bench]:
    from torch.nn.attention import SDPBackend

    p = parse_case(case)
    dev, dt = "cuda", torch.bfloat16
    torch._dynamo.reset()  # fresh compiles per case (no recompile limit across cases)
    g = torch.Generator(device=dev)
    g.manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    if p["kind"] == "docs":
        T, H, D = p["T"], p["H"], p["D"]
        lengths = doc_lengths(T)
        log(f"  {len(lengths)} documents, longest {max(lengths)}, lengths {lengths}")
        q, k, v, grad = (randn(T, H, D) for _ in range(4))
        return impls_docs(case, p, q, k, v, grad, lengths, SDPBackend.CUDNN_ATTENTION, dev)
    if p["kind"] == "window":
        B, H, S, D = p["B"], p["H"], p["S"], p["D"]
        q, k, v, grad = (randn(B, H, S, D) for _ in range(4))
        return impls_window(case, p, q, k, v, grad, dev)
    B, Hq, Hk, S, D = p["B"], p["Hq"], p["Hk"], p["S"], p["D"]
    q = randn(B, Hq, S, D) * SOFTCAP_Q_SCALE
    k, v = randn(B, Hk, S, D), randn(B, Hk, S, D)
    grad = randn(B, Hq, S, D)
    return impls_softcap(case, p, q, k, v, grad, dev)


# ---------------------------------------------------------------- after the run

def postprocess(result: dict) -> None:
    """Adds the skipped impls' rows, tokens/s, the best SDPA-cuDNN row of each docs pass and the window's
    tile-fraction bar to the harness's rows (in place)."""
    rows = result["rows"]
    order = list(dict.fromkeys(r["case"] for r in rows + SKIPPED))
    for r in rows:
        if r.get("ms") and r.get("tokens"):
            r["tokens_per_s"] = harness._round(r["tokens"] / (r["ms"] / 1e3))
    best = []
    for case, pass_ in dict.fromkeys((r["case"], r["pass"]) for r in rows):
        sdpa = [r for r in rows if r["case"] == case and r["pass"] == pass_ and r.get("ms")
                and r["impl"] in ("sdpa_cudnn_loop", "sdpa_cudnn_padded")]
        if sdpa:
            fastest = min(sdpa, key=lambda r: r["ms"])
            best.append({**fastest, "impl": "sdpa_cudnn_best", "best_of": fastest["impl"]})
        causal = next((r for r in rows if r["case"] == case and r["pass"] == pass_ and r["impl"] == "fuseforge_causal"
                       and r.get("ms")), None)
        for r in rows:
            if (causal and r["case"] == case and r["pass"] == pass_ and r["impl"] == "fuseforge" and r.get("ms")
                    and "tile_fraction" in r):
                expect = causal["ms"] * r["tile_fraction"]
                r["causal_x_tile_fraction_ms"] = harness._round(expect)
                r["vs_causal_x_tile_fraction"] = harness._round(r["ms"] / expect, 3)
    merged = []
    for case in order:
        for pass_ in ("fwd", "fwdbwd"):
            merged += [r for r in rows if r["case"] == case and r["pass"] == pass_]
            merged += [r for r in best if r["case"] == case and r["pass"] == pass_]
            merged += [r for r in SKIPPED if r["case"] == case and r["pass"] == pass_]
        merged += [r for r in rows if r["case"] == case and r["pass"] not in ("fwd", "fwdbwd")]
    result["rows"] = merged


def notes_md(result: dict) -> str:
    """Tokens/s per impl, the window's bar and the skipped impls' reasons, under the harness's table."""
    rows = result["rows"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lines = ["", "Million tokens/s (real tokens / time; `sdpa_cudnn_best` = the faster SDPA-cuDNN row) "
             "and TFLOP/s of the visible (q, k) pairs:", "",
             "| case | pass | " + " | ".join(impls) + " |", "|" + "---|" * (len(impls) + 2)]
    by = {(r["case"], r["pass"], r["impl"]): r for r in rows}
    for case, pass_ in dict.fromkeys((r["case"], r["pass"]) for r in rows):
        cells = []
        for i in impls:
            r = by.get((case, pass_, i))
            if r and r.get("tokens_per_s"):
                cells.append(f"{r['tokens_per_s'] / 1e6:.3g} M ({r.get('TFLOPs', 0):.3g} TF)"
                             + (f" [{r['best_of']}]" if "best_of" in r else ""))
            else:
                cells.append((r or {}).get("error", "-"))
        lines.append(f"| {case} | {pass_} | " + " | ".join(cells) + " |")
    for r in rows:
        if "vs_causal_x_tile_fraction" in r:
            lines.append(f"\n{r['case']} {r['pass']}: window {r['ms']} ms vs full causal x tile fraction "
                         f"({r['tile_fraction']}) = {r['causal_x_tile_fraction_ms']} ms: "
                         f"{r['vs_causal_x_tile_fraction']}x (1.0 meets the issue's bar).")
    for case in dict.fromkeys(r["case"] for r in rows):
        r = next((r for r in rows if r["case"] == case and "docs" in r), None)
        if r:
            lines.append(f"\n{case}: {r['docs']} documents, longest {r['max_len']} tokens.")
    for r in rows:
        if r.get("error") == "skipped":
            lines.append(f"\nskipped: {r['case']} {r['pass']} {r['impl']}: {r['reason']}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--out", default=harness.RESULTS_DIR)
    pre.add_argument("--impls", default="")
    pre.add_argument("--device", default="cuda")
    known, _ = pre.parse_known_args(argv)
    if known.device != "cuda" or not torch.cuda.is_available():
        sys.exit("bench_attention_varlen needs a CUDA GPU (it has no CPU cases)")
    _selected_impls[:] = [i for i in known.impls.split(",") if i]
    result = harness.run("attention_varlen", CASES, setup, argv=argv, description=__doc__, rounds=3)
    postprocess(result)
    harness.write(result, known.out)
    with open(os.path.join(known.out, result["op"] + ".md"), "a") as f:
        f.write(notes_md(result))
    return result


if __name__ == "__main__":
    main()
