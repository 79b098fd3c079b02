"""attention's sliding windows, softcap and packed variable-length batches (attention_varlen): forward
and backward against the float64 reference of test_attention.py, per sequence for varlen; errors,
opcheck, gradcheck, compile; on CUDA the device-side check of cu_seqlens and sanitizer cases."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fuseforge
from fuseforge.ops.attention import attention, attention_varlen, cu_seqlens_from_lengths, cu_seqlens_from_position_ids
from harness import (assert_compiles, assert_double_backward_raises, poison_allocations, randn, rel_err,
                     requires_dev_knobs, run_opcheck)
from test_attention import CPU_DTYPES, CUDA_DTYPES, DEVICE_DTYPES, TOL, make_qkv, reference, reference_with_grads, \
    requires_cuda, sm90a_kernels_runnable

ops = torch.ops.fuseforge

# (B, Hq, Hk, Sq, Sk, D, causal, window, softcap)
MASK_CASES = [
    (2, 4, 4, 300, 300, 64, True, (40, 0), None),       # sliding window (Mistral: causal, W - 1 = 40)
    (1, 4, 2, 257, 257, 128, False, (33, 70), None),    # two-sided window, GQA
    (1, 2, 2, 130, 130, 64, False, (0, 0), None),       # each query sees only its own key
    (1, 2, 2, 100, 100, 64, True, (500, 0), None),      # window wider than the sequence = causal
    (1, 2, 1, 90, 200, 64, True, (64, 0), None),        # Sq < Sk: bottom-right
    (1, 2, 2, 200, 90, 128, False, (10, 5), None),      # Sq > Sk: rows that see nothing
    (2, 4, 4, 150, 150, 64, False, None, 5.0),          # softcap, full
    (1, 4, 2, 200, 200, 128, True, None, 2.0),          # softcap, causal, GQA
    (1, 2, 2, 190, 190, 64, True, (50, 0), 3.0),        # softcap + window
    (1, 2, 2, 64, 64, 64, False, (-1, 7), None),        # right bound only
    (1, 4, 2, 150, 150, 96, True, (60, 0), 4.0),        # head dim 96 (the 128 kernels), window + softcap
    (1, 4, 2, 200, 200, 256, True, (60, 0), 4.0),       # head dim 256 (Gemma 2): window + softcap, GQA
    (2, 2, 2, 150, 150, 256, False, None, 5.0),         # head dim 256, softcap, full
    (1, 2, 1, 90, 200, 256, False, (33, 70), None),     # head dim 256, two-sided window, MQA, Sq < Sk
    (1, 4, 2, 256, 256, 128, True, None, 50.0),         # Gemma 2's cap 50, scores up to ~4x past it
    (1, 4, 2, 200, 200, 256, True, None, 50.0),         # the same at head dim 256
]


def case_id(c):
    b, hq, hk, sq, sk, d, causal, window, cap = c
    return (f"b{b}h{hq}k{hk}q{sq}k{sk}d{d}{'c' if causal else ''}" + (f"w{window[0]}_{window[1]}" if window else "")
            + (f"cap{cap:g}" if cap else ""))


@pytest.mark.parametrize("case", MASK_CASES, ids=case_id)
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_window_softcap_forward_backward(device, dtype, case):
    b, hq, hk, sq, sk, d, causal, window, cap = case
    q, k, v = make_qkv(b, hq, hk, sq, sk, d, dtype, device)
    # With a softcap, scores scaled up so the cap bites (|z| well past it for many pairs; x3 for the
    # small caps, cap / 2 for 50, as in bench_attention_varlen).
    q = (q.float() * (max(3.0, cap / 2) if cap else 1.0)).to(dtype).requires_grad_(True)
    k, v = k.requires_grad_(True), v.requires_grad_(True)
    poison_allocations(q, q, q)
    out, lse = attention(q, k, v, causal=causal, window=window, softcap=cap, return_lse=True)
    grad = randn(*out.shape, dtype=dtype, device=device)
    ref_out, ref_lse = reference(q, k, v, causal, window=window, softcap=cap)
    assert rel_err(out, ref_out) <= TOL[dtype], rel_err(out, ref_out)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen.cpu())
    assert rel_err(lse[seen], ref_lse[seen]) <= max(TOL[dtype], 1e-6)
    poison_allocations(q, k, v, q)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    _, rq, rk, rv = reference_with_grads(q, k, v, grad, causal, window=window, softcap=cap)
    for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert rel_err(g, r) <= 2 * TOL[dtype], f"{name}: {rel_err(g, r):.3e}"


@pytest.mark.parametrize("device,dtype", [CPU_DTYPES[0], CUDA_DTYPES[1]])
def test_window_matches_explicit_causal(device, dtype):
    """causal=True is window (-1, 0): the same numbers, bit for bit."""
    q, k, v = make_qkv(1, 4, 2, 200, 200, 64, dtype, device)
    a = attention(q, k, v, causal=True)
    b = attention(q, k, v, window=(-1, 0))
    c = attention(q, k, v, window=(None, 0))
    assert torch.equal(a, b) and torch.equal(a, c)


# Sequence lengths of packed batches: empty sequences, one token, tile edges, long ones.
LENGTHS = [[1, 17, 64, 130, 0, 255, 3], [513], [0, 0, 7]]


def pack(seqs):
    return torch.cat(seqs, 0) if seqs else seqs


def varlen_case(lengths_q, lengths_k, hq, hk, d, dtype, device):
    cu_q, max_q = cu_seqlens_from_lengths(lengths_q, device)
    cu_k, max_k = cu_seqlens_from_lengths(lengths_k, device)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = randn(tq, hq, d, dtype=dtype, device=device, requires_grad=True)
    k = randn(tk, hk, d, dtype=dtype, device=device, requires_grad=True)
    v = randn(tk, hk, d, dtype=dtype, device=device, requires_grad=True)
    return q, k, v, cu_q, cu_k, max_q, max_k


def per_sequence_reference(q, k, v, grad, lengths_q, lengths_k, causal, window, cap):
    """Reference output, lse and gradients of each sequence on its own, packed back."""
    outs, lses, gqs, gks, gvs = [], [], [], [], []
    oq = ok = 0
    for lq, lk in zip(lengths_q, lengths_k):
        seq = [t.detach()[o:o + n].transpose(0, 1).unsqueeze(0) for t, o, n in ((q, oq, lq), (k, ok, lk), (v, ok, lk))]
        g = grad[oq:oq + lq].transpose(0, 1).unsqueeze(0)
        out, rq, rk, rv = reference_with_grads(*seq, g, causal, window=window, softcap=cap)
        lse = reference(*seq, causal, window=window, softcap=cap)[1]
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
        gqs.append(rq[0].transpose(0, 1))
        gks.append(rk[0].transpose(0, 1))
        gvs.append(rv[0].transpose(0, 1))
        oq += lq
        ok += lk
    return torch.cat(outs), torch.cat(lses, 1), torch.cat(gqs), torch.cat(gks), torch.cat(gvs)


VARLEN_OPTIONS = [(False, None, None), (True, None, None), (True, (31, 0), None), (False, (20, 9), 4.0),
                  (True, None, 3.0)]


def options_id(o):
    causal, window, cap = o
    return ("causal" if causal else "full") + (f"-w{window[0]}_{window[1]}" if window else "") + (
        f"-cap{cap:g}" if cap else "")


@pytest.mark.parametrize("options", VARLEN_OPTIONS, ids=options_id)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda ls: "len" + "_".join(map(str, ls)))
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_varlen_matches_each_sequence(device, dtype, lengths, options):
    check_varlen_matches_each_sequence(device, dtype, lengths, options, 64 if len(lengths) > 1 else 128)


@pytest.mark.parametrize("options", VARLEN_OPTIONS, ids=options_id)
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_varlen_head_dim_256_matches_each_sequence(device, dtype, options):
    """Gemma 2's head dim: 64-key tiles, sequences shorter than, at and across tile edges."""
    check_varlen_matches_each_sequence(device, dtype, [1, 17, 64, 130, 0, 255, 3], options, 256)


def check_varlen_matches_each_sequence(device, dtype, lengths, options, d):
    causal, window, cap = options
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case(lengths, lengths, 4, 2, d, dtype, device)
    grad = randn(*q.shape, dtype=dtype, device=device)
    poison_allocations(q, q, q)
    out, lse = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window=window, softcap=cap,
                                return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    r_out, r_lse, rq, rk, rv = per_sequence_reference(q, k, v, grad, lengths, lengths, causal, window, cap)
    assert rel_err(out, r_out) <= TOL[dtype], rel_err(out, r_out)
    seen = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen.cpu())
    assert rel_err(lse[seen], r_lse[seen]) <= max(TOL[dtype], 1e-6)
    for deterministic in (False, True):
        out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window=window, softcap=cap,
                               deterministic=deterministic)
        poison_allocations(q, k, v, q)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
            assert rel_err(g, r) <= 2 * TOL[dtype], f"{name} (deterministic={deterministic}): {rel_err(g, r):.3e}"


@requires_cuda
@pytest.mark.parametrize("order", ["0", "1"], ids=["key_blocks_fastest", "key_blocks_slowest"])
@pytest.mark.parametrize("options", VARLEN_OPTIONS, ids=options_id)
@pytest.mark.parametrize("d", [64, 128, 256])
@requires_dev_knobs
def test_cuda_varlen_backward_block_orders(d, options, order, monkeypatch):
    """Both dk/dv block orders with a mask: a sequence's key blocks side by side (the default past a
    few waves, which these small batches are not) and key blocks slowest. Without a mask the first
    is the one order."""
    monkeypatch.setenv("FUSEFORGE_ATTENTION_BWD_KV_SLOWEST", order)
    check_varlen_matches_each_sequence("cuda", torch.bfloat16, [1, 17, 64, 130, 0, 0, 255, 3, 129, 128], options, d)


@requires_cuda
@pytest.mark.parametrize("rows,align", [("80", "16"), ("80", "80"), ("64", "16")],
                         ids=["80", "80_align80", "64"])
@pytest.mark.parametrize("options", [o for o in VARLEN_OPTIONS if o[2] is None] + [(False, (20, 9), None)],
                         ids=options_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@requires_dev_knobs
def test_cuda_varlen_backward_tiles_80(dtype, options, rows, align, monkeypatch):
    """Head dim 128's dk/dv tiles of 80 queries (from each key block's first visible row rounded down to
    16 rows, or to 80 as before) and of 64 on packed sequences: shorter than a tile, empty, exactly one
    and two tiles, one row past, long."""
    if not sm90a_kernels_runnable():
        pytest.skip("the 80-query backward is a TMA kernel (sm_90 GPUs only)")
    monkeypatch.setenv("FUSEFORGE_ATTENTION_TMA", "1")
    monkeypatch.setenv("FUSEFORGE_ATTENTION_BWD_ROWS", rows)
    monkeypatch.setenv("FUSEFORGE_ATTENTION_BWD_ROW_ALIGN", align)
    check_varlen_matches_each_sequence("cuda", dtype, [1, 17, 80, 0, 81, 255, 160, 3, 700], options, 128)


def varlen_dq_accum_bytes(total_q, sequences, hq, d):
    """dq_accum's size for a packed batch: (Hq, R, D) floats with R = 16 (total / 16 + B + 1), sequences
    never sharing a 16-row tile (attention_params.h), so poison_allocations can fill blocks that size."""
    return hq * 16 * (total_q // 16 + sequences + 1) * d * 4


def check_varlen_dq_zeroed_ahead(lengths_q, lengths_k, hq, hk, d, options, env, monkeypatch):
    """bf16 gradients of a packed batch against the per-sequence float64 reference with dq_accum zeroed
    by the dk/dv kernel (the TMA kernels, key blocks in their default order, `env`'s knobs) and
    allocated from blocks full of NaN, so a unit nobody zeroes, or one zeroed after a reduction into
    it, shows in dQ."""
    causal, window, cap = options
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case(lengths_q, lengths_k, hq, hk, d, torch.bfloat16, "cuda")
    grad = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    for name, value in {"FUSEFORGE_ATTENTION_TMA": "1", "FUSEFORGE_ATTENTION_BWD_KV_SLOWEST": "0", **env}.items():
        monkeypatch.setenv(name, value)
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window=window, softcap=cap)
    dq_accum_bytes = varlen_dq_accum_bytes(q.shape[0], len(lengths_q), hq, d)
    poison_allocations(dq_accum_bytes, dq_accum_bytes, q, q)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    _, _, *ref_grads = per_sequence_reference(q, k, v, grad, lengths_q, lengths_k, causal, window, cap)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) <= 2 * TOL[torch.bfloat16], (name, rel_err(g, r))


@requires_cuda
@pytest.mark.parametrize("order", ["1", "0"], ids=["longest_first", "given_order"])
@pytest.mark.parametrize("ahead", ["1", "20"])
@pytest.mark.parametrize("options", [(True, None, None), (False, None, None), (True, (31, 0), None)],
                         ids=options_id)
@pytest.mark.parametrize("d,rows", [(128, "80"), (128, "64"), (64, "64")])
@requires_dev_knobs
def test_cuda_varlen_backward_dq_zeroed_ahead(d, rows, options, ahead, order, monkeypatch):
    """dq_accum zeroed by the dk/dv kernel on packed sequences, the distance counted in real key blocks
    (those within their sequence, BwdParams::key_block_prefix) in either sequence order: "1" is the
    longest sequence's key blocks ahead, "20" leaves some of the 28 real blocks to the zero-first
    kernel. The q and k lengths differ; one sequence has queries and no keys (its dQ rows, 0, are
    the zero-first kernel's), one neither."""
    if not sm90a_kernels_runnable():
        pytest.skip("the zeroing ahead is the warp-specialized dk/dv kernel's (sm_90 GPUs only)")
    check_varlen_dq_zeroed_ahead([300, 17, 40, 0, 129, 700, 5], [260, 17, 0, 0, 300, 650, 9], 4, 2, d, options,
                                 {"FUSEFORGE_ATTENTION_BWD_ROWS": rows, "FUSEFORGE_ATTENTION_BWD_ZERO_AHEAD": ahead,
                                  "FUSEFORGE_ATTENTION_VARLEN_LONGEST_FIRST": order}, monkeypatch)


@requires_cuda
@pytest.mark.parametrize("order", ["1", "0"], ids=["longest_first", "given_order"])
@requires_dev_knobs
def test_cuda_varlen_backward_dq_zeroed_ahead_many_sequences(order, monkeypatch):
    """520 sequences: the key blocks' prefix sums (BwdParams::key_block_prefix) span three chunks of
    the check kernel's block scan, so a wrong carry between chunks puts units in the wrong place."""
    if not sm90a_kernels_runnable():
        pytest.skip("the zeroing ahead is the warp-specialized dk/dv kernel's (sm_90 GPUs only)")
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 200, (520,), generator=g)
    lengths[::9] = 0
    lengths = lengths.tolist()
    check_varlen_dq_zeroed_ahead(lengths, lengths, 2, 1, 64, (True, None, None),
                                 {"FUSEFORGE_ATTENTION_BWD_ZERO_AHEAD": "1",
                                  "FUSEFORGE_ATTENTION_VARLEN_LONGEST_FIRST": order}, monkeypatch)


@requires_cuda
@pytest.mark.parametrize("overlap", ["1", "0"], ids=["overlap", "serial"])
@requires_dev_knobs
def test_cuda_varlen_backward_no_keys_overlapped(overlap, monkeypatch):
    """12,000 queries without keys and 40 keys without queries: dQ and dK / dV are all 0, the zeroing of
    dq_accum converted, and the dk/dv kernel's blocks leave at once or run no tile. The convert kernel
    is launched overlapping the dk/dv kernel (FUSEFORGE_ATTENTION_BWD_OVERLAP), so it must find the
    zeroing complete through the dk/dv blocks' wait: poisoned dq_accum shows a convert that ran ahead."""
    monkeypatch.setenv("FUSEFORGE_ATTENTION_BWD_OVERLAP", overlap)
    lengths_q, lengths_k, hq, d = [7000, 5000, 0], [0, 0, 40], 16, 128
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case(lengths_q, lengths_k, hq, hq, d, torch.bfloat16, "cuda")
    grad = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    dq_accum_bytes = varlen_dq_accum_bytes(q.shape[0], len(lengths_q), hq, d)
    for _ in range(3):
        out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False)
        poison_allocations(dq_accum_bytes, dq_accum_bytes, q, q, k, k)
        for g in torch.autograd.grad(out, (q, k, v), grad):
            assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("d", [64, 96, 256])
@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_varlen_cross_lengths_and_loose_max(device, dtype, d):
    """q and k lengths differ per sequence (bottom-right causal within each); max_seqlen larger than needed."""
    lq, lk = [5, 70, 0, 129], [9, 40, 3, 200]
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case(lq, lk, 2, 1, d, dtype, device)
    grad = randn(*q.shape, dtype=dtype, device=device)
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q + 100, max_k + 3, causal=True)
    r_out, _, rq, rk, rv = per_sequence_reference(q, k, v, grad, lq, lk, True, None, None)
    assert rel_err(out, r_out) <= TOL[dtype]
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert rel_err(g, r) <= 2 * TOL[dtype], f"{name}: {rel_err(g, r):.3e}"


def test_cu_seqlens_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 0]])
    cu, max_len = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 4, 8, 9] and cu.dtype == torch.int32 and max_len == 4
    with pytest.raises(ValueError, match="start at 0"):
        cu_seqlens_from_position_ids(torch.tensor([1, 2, 0]))


@pytest.mark.parametrize("device,dtype", [CPU_DTYPES[0], CUDA_DTYPES[1]])
def test_double_backward_raises(device, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case([3, 0, 5], [4, 2, 5], 2, 2, 64, dtype, device)
    assert_double_backward_raises(lambda a, b_, c: attention_varlen(a, b_, c, cu_q, cu_k, max_q, max_k, causal=True),
                                  q, k, v, op_name="attention_varlen")


def test_gradcheck_cpu_float64_window_softcap_varlen():
    q, k, v = make_qkv(1, 2, 1, 7, 9, 8, torch.float64, "cpu", requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b_, c: attention(a, b_, c, causal=True, window=(3, 0), softcap=1.5, scale=0.9), (q, k, v))
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case([3, 0, 5], [4, 2, 5], 2, 2, 8, torch.float64, "cpu")
    assert torch.autograd.gradcheck(
        lambda a, b_, c: attention_varlen(a, b_, c, cu_q, cu_k, max_q, max_k, window=(2, 1), softcap=2.0),
        (q, k, v))


@pytest.mark.parametrize("device,dtype", [CPU_DTYPES[0], CUDA_DTYPES[1]])
def test_opcheck_window_softcap_varlen(device, dtype):
    q, k, v = make_qkv(1, 4, 2, 40, 50, 64, dtype, device, requires_grad=True)
    run_opcheck(ops.attention_fwd, (q, k, v, True, 0.125, 9, 0, 4.0))
    out, lse = ops.attention_fwd(q.detach(), k.detach(), v.detach(), True, 0.125, 9, 0, 4.0)
    grad = randn(*q.shape, dtype=dtype, device=device)
    run_opcheck(ops.attention_bwd, (grad, q.detach(), k.detach(), v.detach(), out, lse, True, 0.125, False, 9, 0, 4.0))
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case([30, 0, 45], [30, 0, 45], 4, 2, 64, dtype, device)
    args = (cu_q, cu_k, max_q, max_k, True, 0.125, 11, 0, 3.0)
    run_opcheck(ops.attention_varlen_fwd, (q, k, v) + args)
    out, lse = ops.attention_varlen_fwd(q.detach(), k.detach(), v.detach(), *args)
    grad = randn(*q.shape, dtype=dtype, device=device)
    run_opcheck(ops.attention_varlen_bwd, (grad, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, max_q,
                                           max_k, True, 0.125, False, 11, 0, 3.0))


@pytest.mark.parametrize("device,dtype", [CPU_DTYPES[0], CUDA_DTYPES[1]])
def test_compile_fullgraph_window_softcap_varlen(device, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case([20, 45, 1], [20, 45, 1], 4, 2, 64, dtype, device)

    def f(q, k, v, cu_q, cu_k):
        a = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window=(15, 0), softcap=5.0)
        b = attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], window=(4, 4))
        return a.float().square().sum() + b.float().sum()

    loss = assert_compiles(f, q, k, v, cu_q, cu_k, device=device)
    loss.backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    eager = f(q, k, v, cu_q, cu_k)
    assert abs(loss.item() - eager.item()) <= 3 * TOL[dtype] * abs(eager.item())


def test_errors_cpu():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case([3, 5], [3, 5], 2, 2, 16, torch.float32, "cpu")
    f = attention_varlen
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be an int32"):
        f(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must have as many entries"):
        f(q, k, v, cu_q, cu_k[:2], max_q, max_k)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be 1-D"):
        f(q, k, v, cu_q[None], cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        f(q, k, v, torch.tensor([0, 6, 5, 8], dtype=torch.int32), torch.tensor([0, 3, 5, 8], dtype=torch.int32), 8, 8)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_q\[-1\] must equal the packed length"):
        f(q, k, v, torch.tensor([0, 3, 7], dtype=torch.int32), cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k\[0\] must be 0"):
        f(q, k, v, cu_q, torch.tensor([1, 3, 8], dtype=torch.int32), max_q, max_k)
    with pytest.raises(RuntimeError, match="more than max_seqlen_q"):
        f(q, k, v, cu_q, cu_k, 4, max_k)
    with pytest.raises(RuntimeError, match="max_seqlen_k must be >= 0"):
        f(q, k, v, cu_q, cu_k, max_q, -1)
    with pytest.raises(RuntimeError, match="q must be 3-D"):
        f(q[None], k, v, cu_q, cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match="window_left must be >= 0"):
        f(q, k, v, cu_q, cu_k, max_q, max_k, window=(-2, 0))
    with pytest.raises(RuntimeError, match="window_right must be >= 0"):
        attention(*make_qkv(1, 2, 2, 4, 4, 8, torch.float32, "cpu"), window=(3, -5))
    with pytest.raises(RuntimeError, match="softcap must be a positive number"):
        attention(*make_qkv(1, 2, 2, 4, 4, 8, torch.float32, "cpu"), softcap=-1.0)
    with pytest.raises(ValueError, match="window must be a pair"):
        attention(*make_qkv(1, 2, 2, 4, 4, 8, torch.float32, "cpu"), window=(3,))
    out, lse = ops.attention_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, False, 0.25)
    with pytest.raises(RuntimeError, match=r"lse must have shape \(2, 8\)"):
        ops.attention_varlen_bwd(out, q, k, v, out, lse[:, :4], cu_q, cu_k, max_q, max_k, False, 0.25, False)


@requires_cuda
def test_errors_cuda_unsupported():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case([3, 5], [3, 5], 2, 2, 136, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="multiples of 8 up to 128"):
        attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case([3, 5], [3, 5], 2, 2, 64, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be on the device of q"):
        attention_varlen(q, k, v, cu_q.cpu(), cu_k, max_q, max_k)


BAD_CU_SCRIPT = r"""
import sys, torch, fuseforge
q = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16)
cu_q = torch.tensor({cu}, dtype=torch.int32, device="cuda")
out = fuseforge.attention_varlen(q, q, q, cu_q, cu_q, {max_len}, {max_len})
torch.cuda.synchronize()
print("NO ERROR")
"""


@requires_cuda
@pytest.mark.parametrize("cu,max_len,message", [
    ([0, 6, 5, 8], 8, "non-decreasing"),
    ([0, 3, 8], 4, "more than (max_seqlen_q, max_seqlen_k)"),
    ([0, 3, 7], 8, "must equal the packed lengths"),
])
def test_cuda_bad_cu_seqlens_stop_with_a_named_error(cu, max_len, message):
    """The device-side check (no host sync) stops the stream with an assert; run in a subprocess since
    a device-side assert ends the CUDA context."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", BAD_CU_SCRIPT.format(cu=cu, max_len=max_len)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode != 0 and "NO ERROR" not in r.stdout
    assert message in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]


@requires_cuda
@pytest.mark.parametrize("d", [128, 256])
def test_cuda_varlen_deterministic_is_bitwise_repeatable(d):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case([700, 1, 300, 1200], [700, 1, 300, 1200], 8, 2, d,
                                                    torch.bfloat16, "cuda")
    grad = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    runs = []
    for _ in range(2):
        out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window=(256, 0), softcap=30.0,
                               deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@requires_cuda
@pytest.mark.parametrize("d", [64, 128, 256])
@requires_dev_knobs
def test_cuda_varlen_schedules_give_the_same_bits(d, monkeypatch):
    """The sequence order (longest first, or as given) changes which SM runs a tile and when, never a
    result: the forward and the deterministic backward are bitwise the same under both (3 persistent
    forward blocks, so each takes many tiles and skips those past their sequence)."""
    lengths = [130, 1, 0, 700, 65, 1200, 3]
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case(lengths, lengths, 4, 2, d, torch.bfloat16, "cuda")
    grad = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setenv("FUSEFORGE_ATTENTION_FWD_BLOCKS", "3")

    def run(longest_first):
        monkeypatch.setenv("FUSEFORGE_ATTENTION_VARLEN_LONGEST_FIRST", longest_first)
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True,
                                    deterministic=True)
        return (out, lse) + torch.autograd.grad(out, (q, k, v), grad)

    base = run("1")
    r_out, _, rq, rk, rv = per_sequence_reference(q, k, v, grad, lengths, lengths, True, None, None)
    for name, g, r in (("out", base[0], r_out), ("dq", base[2], rq), ("dk", base[3], rk), ("dv", base[4], rv)):
        assert rel_err(g, r) <= 2 * TOL[torch.bfloat16], f"{name}: {rel_err(g, r):.3e}"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), base, run("0")):
        assert torch.equal(a, b), f"{name} differs between the longest-first and the given order"


# ---- small cases for compute-sanitizer (memcheck, racecheck) ------------------------------------
def check_small_varlen_case(lengths, d, causal, window=None, softcap=None, deterministic=False):
    """fp16 on CUDA, 4 query heads on 2 key heads, a gradient of ones: output and gradients against the
    per-sequence float64 reference (small enough for the sanitizers)."""
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case(lengths, lengths, 4, 2, d, torch.float16, "cuda")
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window=window, softcap=softcap,
                           deterministic=deterministic)
    grad = torch.ones_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    r_out, _, rq, rk, rv = per_sequence_reference(q, k, v, grad, lengths, lengths, causal, window, softcap)
    assert rel_err(out, r_out) <= TOL[torch.float16]
    for g, r in ((dq, rq), (dk, rk), (dv, rv)):
        assert rel_err(g, r) <= 2 * TOL[torch.float16]


@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@requires_dev_knobs
def test_cuda_sanitize_varlen_tiles_80(causal, monkeypatch):
    """Head dim 128's 80-query dk/dv kernel and its dQ convert on packed sequences."""
    if not sm90a_kernels_runnable():
        pytest.skip("the 80-query backward is a TMA kernel (sm_90 GPUs only)")
    monkeypatch.setenv("FUSEFORGE_ATTENTION_TMA", "1")
    monkeypatch.setenv("FUSEFORGE_ATTENTION_BWD_ROWS", "80")
    check_small_varlen_case([70, 0, 150, 1, 80], 128, causal=causal)


@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("d", [64, 128])
@requires_dev_knobs
def test_cuda_sanitize_varlen_dq_zeroed_ahead(d, monkeypatch):
    """dq_accum zeroed by the dk/dv kernel a key block row ahead (real blocks: 16 of 36 grid slots)."""
    if not sm90a_kernels_runnable():
        pytest.skip("the zeroing ahead is the warp-specialized dk/dv kernel's (sm_90 GPUs only)")
    for name, value in {"FUSEFORGE_ATTENTION_TMA": "1", "FUSEFORGE_ATTENTION_BWD_KV_SLOWEST": "0",
                        "FUSEFORGE_ATTENTION_BWD_ZERO_AHEAD": "1"}.items():
        monkeypatch.setenv(name, value)
    check_small_varlen_case([70, 0, 150, 1, 80, 300], d, causal=True)


@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@requires_dev_knobs
def test_cuda_sanitize_varlen_window_softcap(d, deterministic, monkeypatch):
    # Two blocks for the persistent forward: each runs many tiles and skips those past their sequence.
    monkeypatch.setenv("FUSEFORGE_ATTENTION_FWD_BLOCKS", "2")
    # Both dk/dv block orders (test_cuda_varlen_backward_block_orders): a sequence's key blocks side
    # by side on the atomic path, key blocks slowest on the deterministic one.
    monkeypatch.setenv("FUSEFORGE_ATTENTION_BWD_KV_SLOWEST", "1" if deterministic else "0")
    check_small_varlen_case([70, 0, 150, 1], d, causal=True, window=(40, 0), softcap=5.0,
                            deterministic=deterministic)


@requires_cuda
@pytest.mark.slow
def test_more_than_2_to_31_elements():
    """int64 offsets, forward and backward: q of 2^31 + 2^23 bf16 elements (about 4.3 GB) in 8224 causal
    sequences of 256 tokens, GQA 4:1; the sequences at both ends checked against float32."""
    hq, hk, d, s = 8, 2, 128, 256
    sequences = (2**31 + 2**23) // (hq * d * s)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_case([s] * sequences, [s] * sequences, hq, hk, d, torch.bfloat16,
                                                    "cuda")
    grad = randn(*q.shape, dtype=torch.bfloat16, device="cuda")
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    for seq in (0, 1, sequences - 2, sequences - 1):
        rows = slice(seq * s, (seq + 1) * s)
        as_bhsd = lambda t: t[rows].transpose(0, 1)[None]  # noqa: E731
        want = reference_with_grads(as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(grad), causal=True,
                                    dtype=torch.float32)
        for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
            err = rel_err(as_bhsd(got), ref)
            assert err <= 2 * TOL[torch.bfloat16], f"sequence {seq}: {name} {err:.3e}"
