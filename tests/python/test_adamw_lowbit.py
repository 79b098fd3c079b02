"""fuseforge.optim.AdamW(state_dtype="bfloat16" | "int8"): compact optimizer states.

The references are written here from the format's definition (docs/design/adamw.md, "Compact
states"), not from the kernel: the 256-entry code tables built from their formula, nearest-entry
rounding by bucketize, and the counter hash of the bfloat16 stochastic rounding. Each step is
checked on its own: the optimizer's states before the step are decoded, the update runs in float64,
and its result is encoded by these references and compared with what the kernel wrote.
"""
import copy
import io
import math
import os
import subprocess
import sys

import pytest
import torch

import fuseforge  # noqa: F401  (loads the extension)
from fuseforge.optim import AdamW, MIN_COMPACT_NUMEL, QUANT_BLOCK
import fuseforge.ops.adamw as adamw_ops
from harness import TOL, devices, generator, poison_allocations, rel_err, requires_cuda, requires_dev_knobs, run_opcheck
from test_adamw import cuda_kernels_of_a_step

KW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)

# ---- the formats, from their definition -------------------------------------------------------


def small_float_table(mant_bits):
    """value(c) / value(top) for the 4-exponent-bit codes (bias 15, subnormals), ascending."""
    c = torch.arange(16 << mant_bits, dtype=torch.int64)
    e, f = c >> mant_bits, (c & ((1 << mant_bits) - 1)).double()
    v = torch.where(e == 0, f * 2.0 ** (-14 - mant_bits), 2.0 ** (e.double() - 15) * (1 + f / 2 ** mant_bits))
    return v / v[-1]


EXP_AVG_MAGNITUDES = small_float_table(3)  # 128: codes 0..127, code | 0x80 negative
EXP_AVG_SQ_VALUES = small_float_table(4)   # 256


def memory_order(t):
    """A dense tensor's elements in memory order (the order of the int8 blocks)."""
    return t.detach().as_strided((t.numel(),), (1,), t.storage_offset())


def blocks_of(x):
    n = x.numel()
    nb = -(-n // QUANT_BLOCK)
    padded = torch.zeros(nb * QUANT_BLOCK, dtype=x.dtype, device=x.device)
    padded[:n] = x
    return padded.view(nb, QUANT_BLOCK)


def dequantize(codes, absmax, squared):
    """uint8 codes (memory order) and block absmax -> float64 values."""
    c = memory_order(codes).cpu().long()
    scale = absmax.detach().cpu().double().repeat_interleave(QUANT_BLOCK)[:c.numel()]
    if squared:
        return EXP_AVG_SQ_VALUES[c] * scale
    mag = EXP_AVG_MAGNITUDES[c & 0x7F]
    return torch.where(c >= 128, -mag, mag) * scale


def nearest(y, table, slack):
    """Index of the nearest table entry, and whether y lies within `slack` (plus 1e-5 relative) of
    the midpoint between two entries: there the kernel's float32 arithmetic may round the other way."""
    mids = (table[1:] + table[:-1]) / 2
    i = torch.bucketize(y, mids)
    below = mids[(i - 1).clamp(min=0)]
    above = mids[i.clamp(max=mids.numel() - 1)]
    gap = torch.minimum((y - below).abs(), (above - y).abs())
    return i, gap <= slack + 1e-5 * y


def quantize(x, squared, slack=None):
    """float64 values (memory order) -> (codes as int64, absmax, near-tie mask): nearest entry.
    slack: how far (absolute, per element) the kernel's float32 value may be from x."""
    b = blocks_of(x.double().cpu())
    absmax = b.abs().amax(1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    y = b.abs() / scale
    s = blocks_of(slack.double().cpu()) / scale if slack is not None else torch.zeros_like(y)
    if squared:
        c, tie = nearest(y, EXP_AVG_SQ_VALUES, s)
        c = torch.where((c == 0) & (b > 0), torch.ones_like(c), c)  # positive values never code 0
    else:
        mag, tie = nearest(y, EXP_AVG_MAGNITUDES, s)
        c = torch.where((b < 0) & (mag > 0), mag + 128, mag)
    n = x.numel()
    return c.flatten()[:n], absmax, tie.flatten()[:n]


def signed_index(c):
    """Codes on one ordered axis (the exp_avg codes are sign and magnitude)."""
    c = c.long()
    return torch.where(c >= 128, -(c & 0x7F), c)


def assert_codes_match(got, ref, squared, what):
    """The kernel's codes are the nearest entries, but where a value sits on the midpoint between
    two codes (ref[2], the near-tie mask), where it may be the other neighbour."""
    codes, _, tie = ref
    g = memory_order(got).cpu().long()
    if not squared:
        g, codes = signed_index(g), signed_index(codes)
    diff = (g - codes).abs()
    assert diff.max().item() <= 1, f"{what}: a code off by {diff.max().item()}"
    off = (diff > 0) & ~tie
    assert not off.any(), f"{what}: {int(off.sum())} codes differ away from a rounding tie"


U32 = 0xFFFFFFFF


def rounding_bits(index, step):
    """The kernel's counter hash of (element index, step), in int64 arithmetic."""
    h = ((index & U32) * 0x9E3779B1) & U32
    h ^= ((index >> 32) * 0x85EBCA77) & U32
    h ^= (step * 0xC2B2AE3D) & U32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & U32
    h ^= h >> 15
    h = (h * 0x846CA68B) & U32
    h ^= h >> 16
    return h


def bf16_stochastic(x64, random16):
    """float64 -> float32 -> bfloat16 bits: adding 16 random bits and truncating (finite values)."""
    bits = x64.float().view(torch.int32).long() & U32
    return ((bits + (random16 & 0xFFFF)) >> 16) & 0xFFFF


def bf16_bits(t):
    return memory_order(t).cpu().view(torch.int16).long() & 0xFFFF


def bf16_value(bits):
    return (bits << 16).int().view(torch.float32).double()


def bf16_ulp(x):
    """The spacing of bfloat16 values at |x| (x float64 >= 0)."""
    _, e = torch.frexp(x.clamp(min=2.0 ** -126))
    return torch.ldexp(torch.ones_like(x), e - 8)


# ---- helpers ----------------------------------------------------------------------------------

# A multi-chunk tensor with a partial last block, a transposed one, and one a single element
# into its storage (not 16-byte aligned: the kernel's scalar path). All at least MIN_COMPACT_NUMEL.
SHAPES = [(2 * 16384 + 1000,), (96, 64), (5001,)]


def make_params(device, dtype=torch.float32, shapes=SHAPES):
    out = []
    for i, s in enumerate(shapes):
        g = generator(device)
        if i == 1:
            out.append(torch.nn.Parameter(torch.randn(s[::-1], generator=g, device=device).to(dtype).t()))
        elif i == 2:
            base = torch.randn(s[0] + 1, generator=g, device=device).to(dtype)
            out.append(torch.nn.Parameter(base[1:]))
        else:
            out.append(torch.nn.Parameter(torch.randn(s, generator=g, device=device).to(dtype)))
    return out


def heavy_grads(params):
    """Grads whose magnitudes span decades (lognormal scales), laid out like their params, so the
    codes' small values and the exp_avg_sq floor are exercised."""
    out = []
    for p in params:
        g = generator(p.device)
        val = torch.randn(p.shape, generator=g, device=p.device) * torch.exp(
            1.5 * torch.randn(p.shape, generator=g, device=p.device))
        out.append(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device).copy_(val))
    return out


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone(memory_format=torch.preserve_format)


def adamw64(p, g, m, v, step, lr, betas, eps, weight_decay, vmax=None, device="cpu"):
    """torch.optim.AdamW's update in float64 (flat tensors): (p, m, v, vmax), and bounds on how far
    the kernel's float32 m and v may be from these (a few float32 ulps of the terms summed, which
    can exceed the result's own ulp many times where they cancel). On CUDA the betas are rounded to
    float32 first, as the kernel does to match torch's fused AdamW (1 - float(0.999) is 1.3e-5 off
    0.001, far past the moments' tolerance)."""
    b1, b2 = betas
    if torch.device(device).type == "cuda":
        b1, b2 = (torch.tensor(b, dtype=torch.float32).item() for b in betas)
    p = p * (1 - lr * weight_decay)
    m1 = m + (1 - b1) * (g - m)
    v1 = v + (1 - b2) * (g * g - v)
    second = v1 if vmax is None else torch.maximum(vmax, v1)
    p = p - lr / (1 - b1 ** step) * m1 / (second.sqrt() / math.sqrt(1 - b2 ** step) + eps)
    ulps = 2.0 ** -21
    slack = (ulps * (m.abs() + (1 - b1) * g.abs() + m1.abs()), ulps * (v + (1 - b2) * g * g + v1))
    return p, m1, v1, (second if vmax is not None else None), slack


def moments64(opt, p):
    """(exp_avg, exp_avg_sq) of p as float64 in memory order (zeros before its first step)."""
    st = opt.state.get(p)
    if not st:
        z = torch.zeros(p.numel(), dtype=torch.float64)
        return z, z.clone()
    if st["exp_avg"].dtype == torch.uint8:
        return (dequantize(st["exp_avg"], st["exp_avg_absmax"], False),
                dequantize(st["exp_avg_sq"], st["exp_avg_sq_absmax"], True))
    return memory_order(st["exp_avg"]).cpu().double(), memory_order(st["exp_avg_sq"]).cpu().double()


def param64(opt, p):
    st = opt.state.get(p, {})
    src = st["master_param"] if "master_param" in st else p
    return memory_order(src).cpu().double()


# ---- int8 -------------------------------------------------------------------------------------

INT8_CASES = [pytest.param(torch.float32, False, id="fp32"), pytest.param(torch.bfloat16, True, id="bf16-master"),
              pytest.param(torch.float16, False, id="fp16")]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype,master", INT8_CASES)
def test_int8_step_against_float64_reference(device, dtype, master):
    params = make_params(device, dtype)
    opt = AdamW(params, **KW, state_dtype="int8", master_weights=master)
    ptol = 1e-6 if (dtype == torch.float32 or master) else TOL[dtype]
    for step in range(1, 7):
        grads = heavy_grads(params)
        before = [(param64(opt, p), *moments64(opt, p)) for p in params]
        set_grads(params, grads)
        opt.step()
        for i, (p, g, (p0, m0, v0)) in enumerate(zip(params, grads, before)):
            st = opt.state[p]
            assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg"].stride() == p.stride()
            assert st["exp_avg_absmax"].shape == (-(-p.numel() // QUANT_BLOCK),)
            p1, m1, v1, _, (m_slack, v_slack) = adamw64(p0, memory_order(g).cpu().double(), m0, v0, step, **KW, device=device)
            what = f"step {step} param {i}"
            assert rel_err(param64(opt, p), p1) <= ptol, what
            for key, ref, squared, slack in (("exp_avg", m1, False, m_slack), ("exp_avg_sq", v1, True, v_slack)):
                q = quantize(ref, squared, slack)
                assert rel_err(st[key + "_absmax"], q[1]) <= 1e-6, (what, key)
                assert_codes_match(st[key], q, squared, f"{what} {key}")
                # The format's own error: a 4-exponent-bit code keeps ~3-6% per element.
                got = dequantize(st[key], st[key + "_absmax"], squared)
                assert rel_err(got, ref) <= (0.03 if squared else 0.04), (what, key)


@pytest.mark.parametrize("device", devices())
def test_int8_all_zero_and_tiny_blocks(device):
    """A block whose moments are all zero keeps absmax 0 and codes 0; a block whose gradients are
    1e-6 of another block's keeps its own scale (blocks are independent)."""
    p = torch.nn.Parameter(torch.zeros(MIN_COMPACT_NUMEL, device=device))  # blocks 4.. stay zero
    opt = AdamW([p], lr=1e-3, weight_decay=0.0, state_dtype="int8")
    g = torch.zeros_like(p)
    g[QUANT_BLOCK:2 * QUANT_BLOCK] = torch.randn(QUANT_BLOCK, generator=generator(device), device=device)
    g[2 * QUANT_BLOCK:3 * QUANT_BLOCK] = 1e-6 * torch.randn(QUANT_BLOCK, generator=generator(device), device=device)
    g[3 * QUANT_BLOCK] = 1.0  # one element: absmax from it, the rest of its block zero
    p.grad = g
    opt.step()
    st = opt.state[p]
    am = st["exp_avg_absmax"].cpu()
    assert am[0].item() == 0 and not st["exp_avg"][:QUANT_BLOCK].any() and not st["exp_avg_sq"][:QUANT_BLOCK].any()
    for b in (1, 2, 3):
        blk = g[b * QUANT_BLOCK:(b + 1) * QUANT_BLOCK].cpu().double()
        assert am[b].item() == pytest.approx(0.1 * blk.abs().max().item(), rel=1e-6)
    m = dequantize(st["exp_avg"], st["exp_avg_absmax"], False)
    assert rel_err(m[2 * QUANT_BLOCK:3 * QUANT_BLOCK], 0.1 * g[2 * QUANT_BLOCK:3 * QUANT_BLOCK].cpu()) <= 0.04
    # First step: m_hat = g, v_hat = g^2, the update lr * g / (|g| + eps) (nothing where g = 0).
    g64 = g.cpu().double()
    assert rel_err(p.detach().cpu(), -1e-3 * g64 / (g64.abs() + 1e-8)) <= 1e-3


# ---- bfloat16 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("amsgrad", [False, True])
def test_bf16_step_against_float64_reference(device, amsgrad):
    params = make_params(device)
    opt = AdamW(params, **KW, amsgrad=amsgrad, state_dtype="bfloat16")
    for step in range(1, 6):
        grads = heavy_grads(params)
        before = []
        for p in params:
            st = opt.state.get(p)
            vmax = memory_order(st["max_exp_avg_sq"]).cpu().double() if st and amsgrad else \
                torch.zeros(p.numel(), dtype=torch.float64)
            before.append((param64(opt, p), *moments64(opt, p), vmax))
        set_grads(params, grads)
        opt.step()
        for i, (p, g, (p0, m0, v0, x0)) in enumerate(zip(params, grads, before)):
            st = opt.state[p]
            assert st["exp_avg"].dtype == torch.bfloat16 and st["exp_avg"].stride() == p.stride()
            p1, m1, v1, x1, (m_slack, v_slack) = adamw64(p0, memory_order(g).cpu().double(), m0, v0, step, **KW,
                                                         vmax=x0 if amsgrad else None, device=device)
            assert rel_err(param64(opt, p), p1) <= 1e-6, (step, i)
            r = rounding_bits(torch.arange(p.numel(), dtype=torch.int64), step)
            pairs = [("exp_avg", m1, r >> 16, m_slack), ("exp_avg_sq", v1, r, v_slack)]
            if amsgrad:
                pairs.append(("max_exp_avg_sq", x1, r, v_slack))
            for key, ref, rnd, slack in pairs:
                want = bf16_stochastic(ref, rnd)
                got = bf16_bits(st[key])
                # The kernel's float32 value differs from float64's by up to `slack`: where that
                # straddles the edge the random bits set, the rounding goes the other way, one
                # bfloat16 step (or `slack`, where it exceeds a step).
                diff = (bf16_value(got) - bf16_value(want)).abs()
                step_size = bf16_ulp(torch.maximum(bf16_value(got).abs(), bf16_value(want).abs()))
                assert (diff <= step_size + slack).all(), (step, i, key)
                assert (got != want).double().mean().item() <= 1e-3, (step, i, key)


def test_bf16_second_moment_decays_unbiased():
    """Why stochastic rounding: a gradient that shrinks 10x must pull exp_avg_sq down. A bfloat16
    round-to-nearest step of beta2 = 0.999 moves a value by less than half an ulp, so exp_avg_sq
    would stay at its old level (7x too large here); stochastic rounding tracks float32 on average."""
    g0 = generator("cpu")
    p32 = torch.nn.Parameter(torch.randn(8192, generator=g0))
    p16 = torch.nn.Parameter(p32.detach().clone())
    opt32 = AdamW([p32], lr=1e-4, state_dtype="float32")
    opt16 = AdamW([p16], lr=1e-4, state_dtype="bfloat16")
    for it in range(2000):
        g = torch.randn(8192, generator=g0) * (1.0 if it < 50 else 0.1)
        p32.grad, p16.grad = g.clone(), g.clone()
        opt32.step()
        opt16.step()
    ratio = opt16.state[p16]["exp_avg_sq"].double() / opt32.state[p32]["exp_avg_sq"].double()
    assert abs(ratio.mean().item() - 1) <= 0.03, ratio.mean().item()
    assert opt32.state[p32]["exp_avg_sq"].mean().item() < 0.3  # it did decay from ~1


# ---- formats, fallbacks and errors ------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_small_tensors_keep_float32_states(device, state_dtype):
    shapes = [(MIN_COMPACT_NUMEL - 1,), (3, 5), (0,), (MIN_COMPACT_NUMEL,)]
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = AdamW(params, **KW, state_dtype=state_dtype)
    ref_opt = AdamW(ref, **KW)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=generator(device), device=device) for p in params]
        set_grads(params, grads)
        set_grads(ref, grads)
        opt.step()
        ref_opt.step()
    compact = torch.uint8 if state_dtype == "int8" else torch.bfloat16
    for p, q, s in zip(params[:3], ref[:3], shapes):
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.float32 and "exp_avg_absmax" not in st, s
        assert torch.equal(p, q) and torch.equal(st["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"]), s
    assert opt.state[params[3]]["exp_avg"].dtype == compact


def test_float64_params_keep_float64_states():
    p = torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL * 2, dtype=torch.float64))
    opt = AdamW([p], state_dtype="int8")
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float64 and "exp_avg_absmax" not in opt.state[p]


def test_per_group_state_dtype_and_one_handle():
    a, b, c = (torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL)) for _ in range(3))
    opt = AdamW([{"params": [a]}, {"params": [b], "state_dtype": "bfloat16"}, {"params": [c]}], state_dtype="int8")
    for p in (a, b, c):
        p.grad = torch.randn_like(p)
    opt.step()
    assert [opt.state[p]["exp_avg"].dtype for p in (a, b, c)] == [torch.uint8, torch.bfloat16, torch.uint8]
    assert len(opt._handles) == 1
    assert opt.param_groups[0]["state_dtype"] == "int8" and opt.param_groups[1]["state_dtype"] == "bfloat16"
    # torch dtypes are accepted and stored as names
    assert AdamW([a], state_dtype=torch.bfloat16).param_groups[0]["state_dtype"] == "bfloat16"


def test_errors():
    p = torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL))
    for bad in ("fp8", "float16", torch.float16, None, ["int8"]):
        with pytest.raises(ValueError, match="state_dtype must be 'float32', 'bfloat16' or 'int8'"):
            AdamW([p], state_dtype=bad)
    with pytest.raises(ValueError, match="amsgrad=True is not supported with state_dtype='int8'"):
        AdamW([p], amsgrad=True, state_dtype="int8")
    opt = AdamW([p], state_dtype="bfloat16")
    with pytest.raises(ValueError, match="state_dtype must be"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "state_dtype": "int4"})
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "state_dtype": "int8", "amsgrad": True})
    # A loaded int8 state needs its block scales.
    opt = AdamW([p], state_dtype="int8")
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    del sd["state"][0]["exp_avg_sq_absmax"]
    opt2 = AdamW([p], state_dtype="int8")
    with pytest.raises(RuntimeError, match="'exp_avg_sq_absmax' must hold its 16 float32 block scales"):
        opt2.load_state_dict(sd)
    # The list op: uint8 exp_avgs without absmax lists, and absmax of the wrong size.
    args = _list_args("cpu", "int8")
    with pytest.raises(RuntimeError, match="exp_avg_absmaxs and exp_avg_sq_absmaxs must hold the block scales"):
        torch.ops.fuseforge.adamw_fused_(*args[:7], [], [], **LIST_KW)
    args = _list_args("cpu", "int8")
    args[7][0] = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"exp_avg_absmaxs\[0\] must be a contiguous float32 vector"):
        torch.ops.fuseforge.adamw_fused_(*args, **LIST_KW)
    args = _list_args("cpu", "int8")
    with pytest.raises(RuntimeError, match="amsgrad .* is not supported with int8"):
        torch.ops.fuseforge.adamw_fused_(*args[:4], [torch.zeros_like(x) for x in args[0]], *args[5:], **LIST_KW)


# ---- state_dict --------------------------------------------------------------------------------


def _trained(device, state_dtype, steps=4, params=None, **kw):
    params = params or make_params(device)
    opt = AdamW(params, **KW, state_dtype=state_dtype, **kw)
    for _ in range(steps):
        set_grads(params, heavy_grads(params))
        opt.step()
    return params, opt


def _saved(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_state_dict_round_trip_bit_exact(device, state_dtype):
    a, opt_a = _trained(device, state_dtype)
    sd = _saved(opt_a)
    assert all("state_dtype" not in g for g in sd["param_groups"])
    keys = {"step", "exp_avg", "exp_avg_sq"}
    if state_dtype == "int8":
        keys |= {"exp_avg_absmax", "exp_avg_sq_absmax"}
    assert set(sd["state"][0]) == keys
    b = [torch.nn.Parameter(torch.empty_strided(p.shape, p.stride(), device=device).copy_(p)) for p in a]
    opt_b = AdamW(b, **KW, state_dtype=state_dtype)
    opt_b.load_state_dict(copy.deepcopy(sd))
    sd_b = opt_b.state_dict()
    for i in sd["state"]:
        for k, v in sd["state"][i].items():
            assert torch.equal(sd_b["state"][i][k].cpu(), v.cpu()), (i, k)
    more = [heavy_grads(a) for _ in range(3)]
    for grads in more:
        set_grads(a, grads)
        set_grads(b, grads)
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(opt_a.state[p]["exp_avg"], opt_b.state[q]["exp_avg"])


@pytest.mark.parametrize("device", devices())
def test_load_float32_states_into_int8_and_bf16(device):
    """A torch.optim.AdamW checkpoint loads into compact states: quantized on load by the
    optimizer's own quantizer (the same codes as the reference's nearest-entry rounding)."""
    a = make_params(device)
    torch_opt = torch.optim.AdamW(a, **KW)
    for _ in range(3):
        set_grads(a, heavy_grads(a))
        torch_opt.step()
    sd = _saved(torch_opt)
    for state_dtype in ("int8", "bfloat16"):
        b = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in a]
        opt = AdamW(b, **KW, state_dtype=state_dtype)
        opt.load_state_dict(copy.deepcopy(sd))
        for i, q in enumerate(b):
            st = opt.state[q]
            for key, squared in (("exp_avg", False), ("exp_avg_sq", True)):
                saved = sd["state"][i][key]
                if state_dtype == "bfloat16":
                    assert st[key].dtype == torch.bfloat16 and st[key].stride() == q.stride()
                    assert torch.equal(st[key].cpu(), saved.cpu().to(torch.bfloat16))
                    continue
                q = quantize(memory_order(saved.to(device)).cpu().double(), squared)
                assert rel_err(st[key + "_absmax"], q[1]) <= 1e-6
                assert_codes_match(st[key], q, squared, key)
        # ... and training goes on.
        set_grads(b, heavy_grads(b))
        opt.step()
        assert all(opt.state[q]["step"].item() == 4 for q in b)


@pytest.mark.parametrize("device", devices())
def test_int8_states_load_into_float32_bf16_and_torch(device):
    """An int8 checkpoint loads into state_dtype float32 / bfloat16 (dequantized), from where
    torch.optim.AdamW takes it; into a parameter laid out differently (transposed) it is
    dequantized in the saved layout and quantized again in the new one."""
    a, opt_a = _trained(device, "int8")
    sd = _saved(opt_a)
    deq = {i: {k: dequantize(sd["state"][i][k], sd["state"][i][k + "_absmax"], k == "exp_avg_sq")
               for k in ("exp_avg", "exp_avg_sq")} for i in sd["state"]}
    b = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in a]
    opt_f = AdamW(b, **KW)
    opt_f.load_state_dict(copy.deepcopy(sd))
    for i, q in enumerate(b):
        for k in ("exp_avg", "exp_avg_sq"):
            st = opt_f.state[q][k]
            assert st.dtype == torch.float32 and st.stride() == q.stride()
            assert rel_err(memory_order(st), deq[i][k]) <= 1e-6  # float32 rounding of the decode
        assert "exp_avg_absmax" not in opt_f.state[q]
    sd_f = opt_f.state_dict()
    c = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in a]
    torch_opt = torch.optim.AdamW(c, **KW)
    torch_opt.load_state_dict(copy.deepcopy(sd_f))  # (torch adopts same-dtype tensors without a copy)
    grads = heavy_grads(a)
    set_grads(b, grads)
    set_grads(c, grads)
    opt_f.step()
    torch_opt.step()
    assert max(rel_err(p, q) for p, q in zip(b, c)) <= 1e-5
    # bfloat16 target
    d = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in a]
    opt_h = AdamW(d, **KW, state_dtype="bfloat16")
    opt_h.load_state_dict(copy.deepcopy(sd))
    for i, q in enumerate(d):
        assert opt_h.state[q]["exp_avg"].dtype == torch.bfloat16
        assert rel_err(memory_order(opt_h.state[q]["exp_avg"]), deq[i]["exp_avg"]) <= 4e-3
    # Another layout: the transposed parameter becomes contiguous.
    e = [torch.nn.Parameter(p.detach().contiguous()) for p in a]
    opt_e = AdamW(e, **KW, state_dtype="int8")
    opt_e.load_state_dict(copy.deepcopy(sd))
    st = opt_e.state[e[1]]
    assert st["exp_avg"].is_contiguous() and not a[1].is_contiguous()
    saved_layout = torch.empty_strided(a[1].shape, a[1].stride(), dtype=torch.float64)
    memory_order(saved_layout).copy_(deq[1]["exp_avg"])
    want = saved_layout.contiguous().flatten()  # memory order of the new layout
    assert rel_err(dequantize(st["exp_avg"], st["exp_avg_absmax"], False), want) <= 0.04


# ---- the list op (torch.compile path) -----------------------------------------------------------

LIST_KW = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, maximize=False)


def _list_args(device, fmt):
    """adamw_fused_'s positional arguments: one compact tensor (per fmt) and one float32 one."""
    g0 = generator(device)
    params = [torch.randn(MIN_COMPACT_NUMEL + 300, generator=g0, device=device), torch.randn(37, generator=g0,
                                                                                            device=device)]
    grads = [torch.randn(p.shape, generator=g0, device=device) for p in params]
    dt = {"int8": torch.uint8, "bfloat16": torch.bfloat16}[fmt]
    ea = [torch.zeros_like(params[0], dtype=dt), torch.zeros_like(params[1])]
    eas = [torch.zeros_like(params[0], dtype=dt), torch.zeros_like(params[1])]
    steps = [torch.zeros((), device=device) for _ in params]
    if fmt == "int8":  # (the float32 tensor's entries are not read)
        nb = -(-params[0].numel() // QUANT_BLOCK)
        am = [torch.zeros(nb, device=device), torch.empty(0, device=device)]
        asq = [torch.zeros(nb, device=device), torch.empty(0, device=device)]
    else:
        am, asq = [], []
    return [params, grads, ea, eas, [], [], steps, am, asq]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_list_op_matches_handle_and_opcheck(device, fmt):
    args = _list_args(device, fmt)
    params = [torch.nn.Parameter(p.clone()) for p in args[0]]
    opt = AdamW(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, eps=1e-8, state_dtype=fmt)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=generator(device), device=device) for p in params]
        for i, g in enumerate(grads):
            args[1][i] = g.clone()
        set_grads(params, grads)
        adamw_ops.adamw_fused_(*args[:7], **LIST_KW, exp_avg_absmaxs=args[7], exp_avg_sq_absmaxs=args[8])
        opt.step()
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), args[0][i]), i  # the same kernel, the same bits
        assert torch.equal(opt.state[p]["exp_avg"], args[2][i])
        if fmt == "int8" and i == 0:
            assert torch.equal(opt.state[p]["exp_avg_absmax"], args[7][0])
    assert all(s.item() == 3 for s in args[6])
    run_opcheck(torch.ops.fuseforge.adamw_fused_, tuple(_list_args(device, fmt)), LIST_KW)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_compile_fullgraph(state_dtype):
    """The compiled step (adamw_fused_ over lists) and the eager step (the handle) give the same
    bits; states created by a compiled step are adopted by eager ones."""
    a = make_params("cpu", shapes=[(MIN_COMPACT_NUMEL + 300,), (64, 96), (37,)])
    b = [torch.nn.Parameter(torch.empty_strided(p.shape, p.stride()).copy_(p)) for p in a]
    opt_a, opt_b = AdamW(a, **KW, state_dtype=state_dtype), AdamW(b, **KW, state_dtype=state_dtype)
    torch._dynamo.reset()
    step = torch.compile(opt_b.step, fullgraph=True, backend="aot_eager")
    for it in range(4):
        grads = heavy_grads(a)
        set_grads(a, grads)
        set_grads(b, grads)
        opt_a.step()
        step() if it < 3 else opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for k, v in opt_a.state[p].items():
            assert torch.equal(v, opt_b.state[q][k]), k


# ---- GradScaler, convergence ---------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_grad_scale_and_found_inf(device, state_dtype):
    a = make_params(device)
    b = [torch.nn.Parameter(torch.empty_strided(p.shape, p.stride(), device=device).copy_(p)) for p in a]
    opt_a, opt_b = AdamW(a, **KW, state_dtype=state_dtype), AdamW(b, **KW, state_dtype=state_dtype)
    scale = torch.tensor(1024.0, device=device)
    for it in range(4):
        grads = heavy_grads(a)
        set_grads(a, grads)
        set_grads(b, [g * 1024 for g in grads])
        opt_b.grad_scale = scale
        opt_b.found_inf = torch.tensor(1.0 if it == 2 else 0.0, device=device)
        before = {k: v.clone() for k, v in opt_b.state[b[0]].items()} if it == 2 else None
        if it != 2:
            opt_a.step()
        opt_b.step()
        if it == 2:  # found_inf: nothing changes, codes and scales included
            assert all(torch.equal(v, opt_b.state[b[0]][k]) for k, v in before.items())
        else:
            assert max(rel_err(q.grad, g) for q, g in zip(b, grads)) <= 1e-6  # grads come back unscaled
    for p, q in zip(a, b):
        assert rel_err(q, p) <= 1e-6
        assert opt_b.state[q]["step"].item() == 3


def _convergence_loss(state_dtype, steps=300):
    """A three-layer MLP student of a teacher MLP, fresh noisy minibatches each step; the loss
    on held-out clean data."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))
    student = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                                  torch.nn.GELU(), torch.nn.Linear(128, 32))
    g = torch.Generator().manual_seed(1)
    x_eval = torch.randn(2048, 64, generator=g)
    with torch.no_grad():
        y_eval = teacher(x_eval)
    opt = AdamW(student.parameters(), lr=3e-3, weight_decay=1e-2, state_dtype=state_dtype)
    for _ in range(steps):
        x = torch.randn(128, 64, generator=g)
        with torch.no_grad():
            y = teacher(x) + 0.1 * torch.randn(128, 32, generator=g)
        loss = torch.nn.functional.mse_loss(student(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    compact = [p for p in student.parameters() if p.numel() >= MIN_COMPACT_NUMEL]
    assert state_dtype == "float32" or all(opt.state[p]["exp_avg"].dtype != torch.float32 for p in compact)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(student(x_eval), y_eval).item()


def test_convergence_tiny_model_cpu():
    """300 AdamW steps (lr 3e-3): compact states end within a few percent of float32 states' loss
    (measured: bfloat16 +0.03%, int8 +0.6%)."""
    base = _convergence_loss("float32")
    start = _convergence_loss("float32", steps=0)
    assert base < 0.2 * start, (base, start)
    for state_dtype in ("bfloat16", "int8"):
        loss = _convergence_loss(state_dtype)
        assert loss <= 1.05 * base, (state_dtype, loss, base)


# The chunk knob is read once per process: run it in a child. 256-element chunks put each int8
# block in its own work item; the bits must not change.
CHUNK_SCRIPT = """
import sys, torch, fuseforge
from fuseforge.optim import AdamW
device = sys.argv[1]
g = torch.Generator().manual_seed(0)
ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in [(9000,), (4100,), (37,)]]
opt = AdamW(ps, lr=1e-2, state_dtype="int8")
for _ in range(4):
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(device)
    opt.step()
out = torch.cat([p.detach().cpu().flatten() for p in ps]
                + [opt.state[p][k].cpu().flatten().float() for p in ps[:2] for k in
                   ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")])
print(out.double().sum().item(), out.double().abs().sum().item())
"""


@requires_dev_knobs
@pytest.mark.parametrize("device", devices())
def test_chunk_knob_int8(device):
    outs = []
    for chunk in (None, "256"):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.pop("FUSEFORGE_ADAMW_CHUNK_ELEMS", None)
        if chunk:
            env["FUSEFORGE_ADAMW_CHUNK_ELEMS"] = chunk
        r = subprocess.run([sys.executable, "-c", CHUNK_SCRIPT, device], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout.split())
    assert outs[0] == outs[1]


# The CPU update is built per ISA level (common/cpu_isa.h) and must give the same bits in each:
# ATEN_CPU_CAPABILITY picks the build, in a child per level. Inputs from integers: torch's own randn
# rounds differently in each of its CPU builds.
ISA_SCRIPT = """
import torch, fuseforge
from fuseforge.optim import AdamW
gen = torch.Generator().manual_seed(0)
def rand(shape):
    return torch.randint(-2**20, 2**20, shape, generator=gen).float() / 2**19
p32 = [torch.nn.Parameter(rand((5000,))), torch.nn.Parameter(rand((4500,))[1:])]
p16 = [torch.nn.Parameter(rand((4400,)).to(torch.bfloat16)), torch.nn.Parameter(rand((4300,)).to(torch.float16))]
params = p32 + p16
opt = AdamW([{"params": p32, "state_dtype": "int8"}, {"params": p16[:1], "state_dtype": "int8", "master_weights": True},
             {"params": p16[1:], "state_dtype": "bfloat16", "amsgrad": True}], lr=1e-2, weight_decay=0.1)
for _ in range(3):
    for p in params:
        p.grad = (rand(p.shape) * torch.exp(rand(p.shape))).to(p.dtype)
    opt.step()
parts = [p.detach().float().reshape(-1) for p in params]
parts += [v.reshape(-1).float() for p in params for k, v in sorted(opt.state[p].items()) if k != "step"]
blob = torch.cat(parts)
print(torch.backends.cpu.get_cpu_capability(), blob.double().sum().item(), blob.view(torch.int32).long().sum().item())
"""


def test_cpu_builds_bitwise_equal():
    order = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}
    machine = order.get(torch.backends.cpu.get_cpu_capability(), 0)
    levels = [lv for lv in ("default", "avx2", "avx512") if order[lv.upper()] <= machine]
    if len(levels) < 2:
        pytest.skip("this CPU runs only the baseline build")
    outs = {}
    for level in levels:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=level, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        r = subprocess.run([sys.executable, "-c", ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        capability, *sums = r.stdout.split()
        assert capability.lower() == level
        outs[level] = tuple(sums)
    assert len(set(outs.values())) == 1, outs


# DTensor parameters in a one-rank process group (its own child process): compact states are
# DTensors laid out like the parameter and update as plain tensors do; int8 block scales are a
# DTensor sharded on dim 0 (several ranks: test_distributed.py).
DTENSOR_SCRIPT = """
import os, sys, tempfile, torch, torch.distributed as dist, fuseforge
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
from fuseforge.optim import AdamW
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "store"), rank=0,
                        world_size=1)
mesh = init_device_mesh("cpu", (1,))
g = torch.Generator().manual_seed(0)
full = [torch.randn(s, generator=g) for s in [(80, 64), (5000,)]]
for state_dtype, moment in (("bfloat16", torch.bfloat16), ("int8", torch.uint8)):
    dt = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
    plain = [torch.nn.Parameter(t.clone()) for t in full]
    opt_d, opt_p = AdamW(dt, lr=1e-2, state_dtype=state_dtype), AdamW(plain, lr=1e-2, state_dtype=state_dtype)
    for _ in range(3):
        for a, b in zip(dt, plain):
            grad = torch.randn(b.shape, generator=g)
            b.grad = grad.clone()
            a.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        opt_d.step()
        opt_p.step()
    for a, b in zip(dt, plain):
        st, ref = opt_d.state[a], opt_p.state[b]
        assert set(st) == set(ref), (set(st), set(ref))
        assert isinstance(st["exp_avg"], DTensor) and st["exp_avg"].dtype == moment
        assert st["exp_avg"].placements == a.placements
        assert torch.equal(a.full_tensor(), b.detach())
        for k in set(st) - {"step"}:
            assert torch.equal(st[k].full_tensor(), ref[k]), (state_dtype, k)
        if state_dtype == "int8":
            assert st["exp_avg_absmax"].placements == (Shard(0),) and st["exp_avg_absmax"].shape == ref["exp_avg_absmax"].shape
# int8 scales follow the local shard: a plain int8 checkpoint does not load into DTensor params, nor
# the reverse (float states do, either way).
for src, dst, words in ((opt_p, dt, "plain parameter and cannot load into a DTensor"),
                        (opt_d, plain, "DTensor parameter and cannot load into a plain")):
    try:
        AdamW(dst, lr=1e-2, state_dtype="int8").load_state_dict(src.state_dict())
    except ValueError as e:
        assert words in str(e) and "state_dtype='float32'" in str(e), e
    else:
        raise AssertionError("an int8 checkpoint loaded across shardings")
# The traced step (torch.compile) creates int8 states of DTensor params as the handle does: padded
# DTensor scales; eager steps after it adopt them.
dt = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
plain = [torch.nn.Parameter(t.clone()) for t in full]
opt_c, opt_p = AdamW(dt, lr=1e-2, state_dtype="int8"), AdamW(plain, lr=1e-2, state_dtype="int8")
step = torch.compile(opt_c.step, fullgraph=True, backend="aot_eager", dynamic=False)
for i in range(4):
    for a, b in zip(dt, plain):
        grad = torch.randn(b.shape, generator=g)
        b.grad = grad.clone()
        a.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
    (step if i < 2 else opt_c.step)()
    opt_p.step()
    for a, b in zip(dt, plain):
        assert torch.equal(a.full_tensor(), b.detach()), i
        for k in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
            assert isinstance(opt_c.state[a][k], DTensor), (i, k)
            assert torch.equal(opt_c.state[a][k].full_tensor(), opt_p.state[b][k]), (i, k)
from torch.distributed.tensor import Replicate
sd = opt_d.state_dict()
sd["state"][0]["exp_avg_absmax"] = DTensor.from_local(sd["state"][0]["exp_avg_absmax"].to_local(), mesh, [Replicate()])
try:
    AdamW(dt, lr=1e-2, state_dtype="int8").load_state_dict(sd)
except ValueError as e:
    assert "load only into the sharding they were saved with" in str(e), e
else:
    raise AssertionError("int8 scales of another placement were accepted")
dist.destroy_process_group()
print("ok", flush=True)
# Leave without interpreter finalization, where gloo's worker thread can abort the process after
# every check has passed (test_distributed.py's worker_main says why).
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch was built without torch.distributed or gloo")
def test_dtensor_params():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", DTENSOR_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


# ---- CUDA ---------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_cuda_matches_cpu(state_dtype):
    """The CUDA kernel and the CPU backend: the same codes but where the two math forms (torch's
    fused rounding on the GPU, the exact one on the CPU) put a value on the other side of a
    rounding edge."""
    cpu = make_params("cpu")
    poison_allocations(*[torch.empty(p.numel() * 4, dtype=torch.uint8) for p in cpu])
    gpu = [torch.nn.Parameter(torch.empty_strided(p.shape, p.stride(), device="cuda").copy_(p)) for p in cpu]
    opt_c, opt_g = AdamW(cpu, **KW, state_dtype=state_dtype), AdamW(gpu, **KW, state_dtype=state_dtype)
    for _ in range(5):
        grads = heavy_grads(cpu)
        set_grads(cpu, grads)
        set_grads(gpu, [g.cuda() for g in grads])
        opt_c.step()
        opt_g.step()
    for p, q in zip(cpu, gpu):
        assert rel_err(q, p) <= 1e-5
        for k in ("exp_avg", "exp_avg_sq"):
            if state_dtype == "int8":
                a = dequantize(opt_c.state[p][k], opt_c.state[p][k + "_absmax"], k == "exp_avg_sq")
                b = dequantize(opt_g.state[q][k], opt_g.state[q][k + "_absmax"], k == "exp_avg_sq")
                assert rel_err(b, a) <= 1e-2, k
                same = (memory_order(opt_c.state[p][k]) == memory_order(opt_g.state[q][k]).cpu()).double().mean()
                assert same.item() >= 0.99, k
            else:
                assert rel_err(opt_g.state[q][k], opt_c.state[p][k]) <= 1e-3, k


@requires_cuda
def test_cuda_one_launch_mixed_formats():
    params = [torch.nn.Parameter(torch.randn(8192, device="cuda")) for _ in range(30)]
    params += [torch.nn.Parameter(torch.randn(5000, device="cuda", dtype=torch.bfloat16)) for _ in range(10)]
    params += [torch.nn.Parameter(torch.randn(100, device="cuda")) for _ in range(10)]
    opt = AdamW([{"params": params[:20], "state_dtype": "int8"}, {"params": params[20:35], "state_dtype": "bfloat16"},
                 {"params": params[35:]}])
    names = cuda_kernels_of_a_step(opt, params)
    assert len([n for n in names if "adamw_multi_tensor_kernel" in n]) == 1, names[:20]


@requires_cuda
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_cuda_graph_capture_replay(state_dtype):
    ours = make_params("cuda")
    ref = [torch.nn.Parameter(torch.empty_strided(p.shape, p.stride(), device="cuda").copy_(p)) for p in ours]
    lr = torch.tensor(1e-2, device="cuda")
    opt = AdamW(ours, lr=lr, capturable=True, state_dtype=state_dtype)
    ref_opt = AdamW(ref, lr=1e-2, state_dtype=state_dtype)
    grads = heavy_grads(ours)
    set_grads(ours, grads)
    set_grads(ref, grads)
    opt.step()  # warm-up: creates the state
    ref_opt.step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        opt.step()
    torch.cuda.current_stream().wait_stream(s)
    for it in range(4):
        grads = heavy_grads(ours)
        for p, g in zip(ours, grads):
            p.grad.copy_(g)
        lr.fill_(1e-2 * 0.9 ** it)
        graph.replay()
        set_grads(ref, grads)
        ref_opt.param_groups[0]["lr"] = 1e-2 * 0.9 ** it
        ref_opt.step()
    torch.cuda.synchronize()
    for p, q in zip(ours, ref):
        assert rel_err(p, q) <= 1e-6
        assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])


@requires_cuda
@pytest.mark.sanitize
def test_sanitize_compact_states():
    """Small, every compact path: int8 aligned (vector) and misaligned (scalar) with fp32, fp16 and
    bf16 + master params, a partial last block; bfloat16 states with amsgrad."""
    p_mis = torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL + 301, device="cuda")[1:])  # not 16-byte aligned
    int8 = [torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL + 40, device="cuda")), p_mis,
            torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL, device="cuda", dtype=torch.float16))]
    master = [torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL + 8, device="cuda", dtype=torch.bfloat16))]
    bf16 = [torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL + 3, device="cuda"))]
    opt = AdamW([{"params": int8, "state_dtype": "int8"},
                 {"params": master, "state_dtype": "int8", "master_weights": True},
                 {"params": bf16, "state_dtype": "bfloat16", "amsgrad": True}])
    params = int8 + master + bf16
    cpu = [torch.nn.Parameter(p.detach().cpu().clone()) for p in params]
    ref = AdamW([{"params": cpu[:3], "state_dtype": "int8"},
                 {"params": cpu[3:4], "state_dtype": "int8", "master_weights": True},
                 {"params": cpu[4:], "state_dtype": "bfloat16", "amsgrad": True}])
    for _ in range(3):
        grads = heavy_grads(cpu)
        set_grads(cpu, grads)
        set_grads(params, [g.cuda() for g in grads])
        opt.grad_scale, ref.grad_scale = torch.tensor(2.0, device="cuda"), torch.tensor(2.0)
        opt.step()
        ref.step()
    for p, q in zip(params, cpu):
        assert rel_err(p, q) <= (TOL[p.dtype] if p.dtype != torch.float32 else 1e-5)


@requires_cuda
@pytest.mark.slow
def test_int8_more_than_2_31_elements():
    n = (1 << 31) + 4099
    p = torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16))
    p.grad = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    tail = slice(n - 70000, n)
    p0, g0 = p.detach()[tail].float().clone(), p.grad[tail].float().clone()
    opt = AdamW([p], lr=1e-2, weight_decay=0.1, state_dtype="int8")
    opt.step()
    st = opt.state[p]
    # First step: m = 0.1 g, v = 0.001 g^2, the update lr * g / (|g| + eps).
    expect = p0 * (1 - 1e-2 * 0.1) - 1e-2 * g0 / (g0.abs() + 1e-8)
    assert rel_err(p.detach()[tail].float(), expect) <= 8e-3
    blocks = slice((n - 70000) // QUANT_BLOCK + 1, None)
    first = ((n - 70000) // QUANT_BLOCK + 1) * QUANT_BLOCK
    m = dequantize(st["exp_avg"][first:], st["exp_avg_absmax"][blocks], False)
    assert rel_err(m, 0.1 * p.grad[first:].double().cpu()) <= 0.04
