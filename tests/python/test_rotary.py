"""rotary: rotary position embeddings of q and k (Hugging Face's rope), forward and backward, CPU and CUDA."""
import pytest
import torch

from fuseforge.nn.rotary import RotaryEmbedding
from fuseforge.ops.rotary import rotary
from harness import (TOL, assert_compiles, assert_rel_close, device_dtypes, devices, generator, poison_allocations,
                     randn, rel_err, requires_cuda, run_opcheck)

ops = torch.ops.fuseforge

# (B, Hq, Hk, S, D, R): full rotary, GQA, partial rotary (R < D), odd D, D = 80 and 256, one token,
# and a token of 70 heads of 256 (CUDA: 16-bit inputs stage one token a block, the most that fits).
SHAPES = [(2, 4, 2, 9, 16, 16), (1, 3, 1, 7, 6, 4), (2, 2, 2, 5, 80, 80), (2, 3, 1, 6, 80, 32),
          (3, 4, 4, 1, 64, 64), (1, 2, 1, 11, 256, 256), (2, 5, 3, 33, 128, 128), (1, 1, 1, 3, 10, 6),
          (1, 40, 30, 3, 256, 128)]


def inv_freq_for(rot_dims, base=10000.0, device="cpu"):
    return 1.0 / (base ** (torch.arange(0, rot_dims, 2, device=device, dtype=torch.int64).float() / rot_dims))


def packed_positions(batch, seq, device, dtype=torch.int64):
    """Each row packs sequences of random lengths: positions restart at 0 inside the row."""
    starts = torch.rand(batch, seq, generator=generator("cpu")) < 0.2
    starts[:, :1] = True
    index = torch.arange(seq).expand(batch, seq)
    last_start = torch.where(starts, index, 0).cummax(dim=1).values if seq else index
    return (index - last_start).to(device=device, dtype=dtype)


def make_qk(batch, heads_q, heads_k, seq, head_dim, dtype, device, layout="bshd", requires_grad=False):
    """q (B, Hq, S, D) and k (B, Hk, S, D): "bshd" as the projections' view(B, S, H, D).transpose(1, 2),
    "bhsd" contiguous."""
    def one(heads):
        if layout == "bshd":
            t = randn(batch, seq, heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
        else:
            t = randn(batch, heads, seq, head_dim, dtype=dtype, device=device)
        return t.requires_grad_(requires_grad)
    return one(heads_q), one(heads_k)


def reference(x, inv_freq, position_ids, scaling=1.0, interleaved=False, inverse=False):
    """float64 rope of x (B, H, S, D): Hugging Face's formula with cos/sin in float64 from the same
    float32 angles (position_ids.float() * inv_freq)."""
    batch, _, seq, _ = x.shape
    half = inv_freq.numel()
    angle = position_ids.expand(batch, seq)[..., None].float() * inv_freq.float()
    cos = (angle.double().cos() * scaling)[:, None].to(x.device)
    sin = (angle.double().sin() * scaling * (-1.0 if inverse else 1.0))[:, None].to(x.device)
    x = x.double()
    rot, passed = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rot, passed), dim=-1)


def check_output_layout(out, x, dtype):
    """(B, H, S, D) views of (B, S, H, D) memory."""
    batch, heads, seq, head_dim = x.shape
    assert out.shape == x.shape and out.dtype == dtype and out.device == x.device
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_forward_matches_float64(device, dtype, shape, interleaved, layout):
    batch, heads_q, heads_k, seq, head_dim, rot_dims = shape
    q, k = make_qk(batch, heads_q, heads_k, seq, head_dim, dtype, device, layout)
    inv_freq = inv_freq_for(rot_dims, device=device)
    positions = packed_positions(batch, seq, device)
    poison_allocations(q, k)
    q_out, k_out = rotary(q, k, inv_freq, positions, 0.85, interleaved)
    check_output_layout(q_out, q, dtype)
    check_output_layout(k_out, k, dtype)
    assert_rel_close(q_out, reference(q, inv_freq, positions, 0.85, interleaved), TOL[dtype], "q_out")
    assert_rel_close(k_out, reference(k, inv_freq, positions, 0.85, interleaved), TOL[dtype], "k_out")


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_position_ids_forms(device, dtype, interleaved):
    """(1, S) broadcast over B > 1, int32 and int64, packed rows, large positions (float32 angles up
    to ~1e5 rad), and strided position_ids."""
    q, k = make_qk(3, 4, 2, 12, 32, dtype, device)
    inv_freq = inv_freq_for(32, device=device)
    forms = {
        "broadcast": torch.arange(12, device=device)[None],
        "int32": packed_positions(3, 12, device, torch.int32),
        "packed": packed_positions(3, 12, device),
        "large": 100000 + torch.randint(0, 1000, (3, 12), generator=generator("cpu")).to(device),
        "strided": torch.arange(72, device=device).view(3, 24)[:, ::2],
        "max": torch.full((1, 12), 2**20, device=device) - torch.arange(12, device=device),
    }
    for name, positions in forms.items():
        q_out, k_out = rotary(q, k, inv_freq, positions, 1.0, interleaved)
        assert_rel_close(q_out, reference(q, inv_freq, positions, 1.0, interleaved), TOL[dtype], f"{name} q_out")
        assert_rel_close(k_out, reference(k, inv_freq, positions, 1.0, interleaved), TOL[dtype], f"{name} k_out")


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)],
                         ids=str)
def test_out_dtype(device, in_dtype, out_dtype):
    """One rounding to out_dtype (fp32 in, bf16 out: autocast's q * cos in fp32 then the cast)."""
    q, k = make_qk(2, 4, 2, 10, 64, in_dtype, device)
    inv_freq = inv_freq_for(64, device=device)
    positions = packed_positions(2, 10, device)
    q_out, k_out = rotary(q, k, inv_freq, positions, 1.0, False, out_dtype)
    check_output_layout(q_out, q, out_dtype)
    for got, x in ((q_out, q), (k_out, k)):
        ref = reference(x, inv_freq, positions)
        assert_rel_close(got, ref, max(TOL[out_dtype], TOL[in_dtype]))
        if in_dtype == torch.float32:
            # Rounded once from float32: every element within one out_dtype unit of the float64 result,
            # and almost all of them that result rounded once (float32's error moves a value across a
            # rounding midpoint only within ~1e-7 of it: ~4e-4 of the elements at fp16, fewer at bf16).
            got64, ref64 = got.double().cpu(), ref.double().cpu()
            info = torch.finfo(out_dtype)
            unit = info.eps * torch.exp2(torch.floor(torch.log2(ref64.abs().clamp_min(info.tiny))))
            assert ((got64 - ref64).abs() <= unit).all()
            assert (got.cpu() != ref.to(out_dtype).cpu()).double().mean().item() <= 1e-2


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_inverse_undoes_forward(device, dtype, interleaved):
    q, k = make_qk(2, 3, 1, 8, 24, dtype, device)
    inv_freq = inv_freq_for(16, device=device)
    positions = packed_positions(2, 8, device)
    q_out, k_out = ops.rotary(q, k, inv_freq, positions, 1.0, interleaved, False)
    q_back, k_back = ops.rotary(q_out, k_out, inv_freq, positions, 1.0, interleaved, True)
    tol = 3 * TOL[dtype]  # two roundings to dtype
    assert_rel_close(q_back, q, tol, "q")
    assert_rel_close(k_back, k, tol, "k")


@pytest.mark.parametrize("device,dtype", device_dtypes())
@pytest.mark.parametrize("shape", [(2, 4, 2, 9, 16, 16), (2, 3, 1, 6, 80, 32), (1, 3, 1, 7, 6, 4),
                                   (1, 2, 2, 0, 8, 8)], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_gradients_match_float64(device, dtype, shape, interleaved):
    batch, heads_q, heads_k, seq, head_dim, rot_dims = shape
    q, k = make_qk(batch, heads_q, heads_k, seq, head_dim, dtype, device, requires_grad=True)
    inv_freq = inv_freq_for(rot_dims, device=device)
    positions = packed_positions(batch, seq, device)
    grad_q = randn(batch, heads_q, seq, head_dim, dtype=dtype, device=device)
    grad_k = randn(batch, seq, heads_k, head_dim, dtype=dtype, device=device).transpose(1, 2)
    poison_allocations(q, k, q, k)
    q_out, k_out = rotary(q, k, inv_freq, positions, 1.3, interleaved)
    gq, gk = torch.autograd.grad((q_out, k_out), (q, k), (grad_q, grad_k))
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    refs = (reference(q64, inv_freq, positions, 1.3, interleaved), reference(k64, inv_freq, positions, 1.3, interleaved))
    rq, rk = torch.autograd.grad(refs, (q64, k64), (grad_q.double(), grad_k.double()))
    assert gq.dtype == dtype and gq.shape == q.shape and gk.shape == k.shape
    assert_rel_close(gq, rq, TOL[dtype], "grad_q")
    assert_rel_close(gk, rk, TOL[dtype], "grad_k")


@pytest.mark.parametrize("device", devices())
def test_gradients_with_bf16_output_come_back_float32(device):
    q, k = make_qk(2, 4, 2, 5, 32, torch.float32, device, requires_grad=True)
    inv_freq = inv_freq_for(32, device=device)
    positions = packed_positions(2, 5, device)
    q_out, k_out = rotary(q, k, inv_freq, positions, 1.0, False, torch.bfloat16)
    grads = (randn(*q_out.shape, dtype=torch.bfloat16, device=device),
             randn(*k_out.shape, dtype=torch.bfloat16, device=device))
    gq, gk = torch.autograd.grad((q_out, k_out), (q, k), grads)
    assert gq.dtype == torch.float32 and gk.dtype == torch.float32
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    rq, rk = torch.autograd.grad((reference(q64, inv_freq, positions), reference(k64, inv_freq, positions)),
                                 (q64, k64), tuple(g.double() for g in grads))
    assert_rel_close(gq, rq, TOL[torch.float32], "grad_q")
    assert_rel_close(gk, rk, TOL[torch.float32], "grad_k")


@pytest.mark.parametrize("device", devices())
def test_gradient_through_one_output(device):
    """Only q_out reaches the loss: grad_k is zero, grad_q right."""
    q, k = make_qk(2, 2, 1, 4, 8, torch.float32, device, requires_grad=True)
    inv_freq = inv_freq_for(8, device=device)
    positions = torch.arange(4, device=device)[None]
    q_out, _ = rotary(q, k, inv_freq, positions)
    grad = randn(*q_out.shape, device=device)
    gq, gk = torch.autograd.grad(q_out, (q, k), grad)
    q64 = q.detach().double().requires_grad_()
    (rq,) = torch.autograd.grad(reference(q64, inv_freq, positions), q64, grad.double())
    assert_rel_close(gq, rq, TOL[torch.float32], "grad_q")
    assert torch.count_nonzero(gk) == 0 and gk.shape == k.shape
    # A gradient of a reduction arrives expanded (stride 0 in the last dim): copied once, still right.
    gq_sum = torch.autograd.grad(rotary(q, k, inv_freq, positions)[0].sum(), q)[0]
    (rq_sum,) = torch.autograd.grad(reference(q64, inv_freq, positions).sum(), q64)
    assert_rel_close(gq_sum, rq_sum, TOL[torch.float32], "grad_q of a sum")


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_gradcheck_float64_cpu(interleaved):
    for batch, heads_q, heads_k, seq, head_dim, rot_dims in ((2, 2, 1, 3, 8, 8), (1, 1, 2, 4, 6, 4)):
        q, k = make_qk(batch, heads_q, heads_k, seq, head_dim, torch.float64, "cpu", requires_grad=True)
        inv_freq = inv_freq_for(rot_dims)
        positions = packed_positions(batch, seq, "cpu")
        assert torch.autograd.gradcheck(lambda q, k: rotary(q, k, inv_freq, positions, 0.7, interleaved), (q, k))
        assert torch.autograd.gradgradcheck(lambda q, k: rotary(q, k, inv_freq, positions, 0.7, interleaved), (q, k))


def test_functorch_grad_and_its_grad_float64_cpu():
    """torch.func.grad gives autograd's gradients, and (the backward being the op itself) a grad of that
    gradient too; vmap of grad gives each sample's."""
    q, k = make_qk(2, 2, 1, 3, 8, torch.float64, "cpu")
    inv_freq, positions = inv_freq_for(8), packed_positions(1, 3, "cpu")  # (1, S): every row, every sample
    weights = torch.randn(q.shape, dtype=torch.float64, generator=generator("cpu"))

    def loss(q_, k_, weights_=weights):
        out_q, out_k = rotary(q_, k_, inv_freq, positions, 0.7)
        return (out_q * weights_).sum() + (out_k ** 2).sum()

    def grad_norm(q_, k_):
        return sum((g ** 2).sum() for g in torch.autograd.grad(loss(q_, k_), (q_, k_), create_graph=True))
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    plain = torch.autograd.grad(loss(*leaves), leaves)
    second = torch.autograd.grad(grad_norm(*leaves), leaves)
    for got, ref in zip(torch.func.grad(loss, argnums=(0, 1))(q, k), plain):
        assert_rel_close(got, ref, 1e-12, "torch.func.grad")
    def func_grad_norm(q_, k_):
        return sum((g ** 2).sum() for g in torch.func.grad(loss, argnums=(0, 1))(q_, k_))
    for got, ref in zip(torch.func.grad(func_grad_norm, argnums=(0, 1))(q, k), second):
        assert_rel_close(got, ref, 1e-12, "torch.func.grad of torch.func.grad")
    per_sample = torch.func.vmap(torch.func.grad(lambda q_, k_, w_: loss(q_[None], k_[None], w_[None])))(q, k, weights)
    assert_rel_close(per_sample, plain[0], 1e-12, "vmap(grad)")


@pytest.mark.parametrize("device", devices())
def test_opcheck(device):
    inv_freq = inv_freq_for(8, device=device)
    for layout in ("bshd", "bhsd"):
        q, k = make_qk(2, 3, 1, 5, 12, torch.float32, device, layout, requires_grad=True)
        run_opcheck(ops.rotary, (q, k, inv_freq, packed_positions(2, 5, device), 0.9, False, False))
        run_opcheck(ops.rotary, (q, k, inv_freq, torch.arange(5, device=device, dtype=torch.int32)[None], 1.0, True,
                                 True), {"out_dtype": torch.bfloat16})


@pytest.mark.parametrize("device", devices())
def test_compiles_fullgraph(device):
    q, k = make_qk(2, 4, 2, 6, 16, torch.float32, device, requires_grad=True)
    inv_freq = inv_freq_for(16, device=device)
    positions = packed_positions(2, 6, device)

    def fn(q, k, positions):
        q_out, k_out = rotary(q, k, inv_freq, positions, 1.1, False)
        return (q_out * q_out.detach().sin()).sum() + k_out.square().sum()

    got = assert_compiles(fn, q, k, positions, device=device)
    want = fn(q, k, positions)
    assert_rel_close(got, want, 1e-5)
    for a, w in zip(torch.autograd.grad(got, (q, k)), torch.autograd.grad(want, (q, k))):
        assert_rel_close(a, w, 1e-5)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32, torch.bfloat16)))
@pytest.mark.parametrize("rope_parameters", [{"rope_type": "default", "rope_theta": 500000.0},
                                             {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 256}], ids=["default", "yarn"])
def test_matches_transformers(device, dtype, rope_parameters):
    """Against Hugging Face's LlamaRotaryEmbedding + apply_rotary_pos_emb on the same tensors (yarn:
    attention_scaling != 1). Hugging Face rounds cos, sin and each product to the dtype, so its own
    error against float64 bounds the difference at 16 bits."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=1024, rope_parameters=rope_parameters)
    hf_rope = LlamaRotaryEmbedding(config).to(device)
    q, k = make_qk(2, 8, 2, 40, 64, dtype, device)
    positions = torch.cat([torch.arange(30), torch.arange(10)]).to(device)[None].expand(2, 40) + \
        torch.tensor([[0], [500]], device=device)
    cos, sin = hf_rope(q, positions)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out = rotary(q, k, hf_rope.inv_freq, positions, hf_rope.attention_scaling)
    for got, hf, x in ((q_out, hf_q, q), (k_out, hf_k, k)):
        ref = reference(x, hf_rope.inv_freq, positions, hf_rope.attention_scaling)
        assert_rel_close(got, ref, TOL[dtype])
        assert_rel_close(got, hf, max(TOL[dtype], 2 * rel_err(hf, ref)), "vs transformers")


@pytest.mark.parametrize("device", devices())
def test_module(device):
    rope = RotaryEmbedding(32, base=500000.0, attention_scaling=0.9, device=device)
    assert rope.inv_freq.dtype == torch.float32 and rope.inv_freq.shape == (16,)
    assert torch.equal(rope.inv_freq, inv_freq_for(32, 500000.0, device=device))
    assert "inv_freq" not in rope.state_dict()
    q, k = make_qk(2, 4, 2, 7, 48, torch.float32, device, requires_grad=True)
    positions = packed_positions(2, 7, device)
    q_out, k_out = rope(q, k, positions)
    assert_rel_close(q_out, reference(q, rope.inv_freq, positions, 0.9), TOL[torch.float32])
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad is not None and k.grad is not None
    q_bf16, _ = rope(q, k, positions, out_dtype=torch.bfloat16)
    assert q_bf16.dtype == torch.bfloat16
    custom = RotaryEmbedding(8, interleaved=True, inv_freq=torch.tensor([1.0, 0.5, 0.25, 0.125]), device=device)
    assert_rel_close(custom(q, k, positions)[1], reference(k, custom.inv_freq, positions, 1.0, True),
                     TOL[torch.float32])
    assert "interleaved=True" in repr(custom)
    with pytest.raises(ValueError, match="must be even"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match=r"inv_freq must have shape \(4,\)"):
        RotaryEmbedding(8, inv_freq=torch.ones(3))


@pytest.mark.parametrize("device", devices())
def test_bad_inputs_raise_clear_errors(device):
    q, k = make_qk(2, 4, 2, 5, 8, torch.float32, device)
    inv_freq = inv_freq_for(8, device=device)
    positions = torch.arange(5, device=device)[None]
    with pytest.raises(RuntimeError, match=r"R = 10 rotary dims exceed the head dim D = 8"):
        rotary(q, k, inv_freq_for(10, device=device), positions)
    with pytest.raises(RuntimeError, match=r"inv_freq must be a 1-D float32 tensor of R / 2 >= 1 elements"):
        rotary(q, k, inv_freq.double(), positions)
    with pytest.raises(RuntimeError, match=r"inv_freq must be a 1-D float32 tensor"):
        rotary(q, k, inv_freq.view(2, 2), positions)
    with pytest.raises(RuntimeError, match=r"inv_freq must be a 1-D float32 tensor"):
        rotary(q, k, inv_freq[:0], positions)
    with pytest.raises(RuntimeError, match=r"k must have the dtype of q"):
        rotary(q, k.bfloat16(), inv_freq, positions)
    with pytest.raises(RuntimeError, match=r"q must be float32, float16 or bfloat16"):
        rotary(q.int(), k.int(), inv_freq, positions)
    with pytest.raises(RuntimeError, match=r"position_ids must have shape \(B, S\) = \(2, 5\) or \(1, 5\)"):
        rotary(q, k, inv_freq, torch.arange(6, device=device)[None])
    with pytest.raises(RuntimeError, match=r"position_ids must have shape"):
        rotary(q, k, inv_freq, torch.zeros(3, 5, dtype=torch.int64, device=device))
    with pytest.raises(RuntimeError, match=r"position_ids must have shape"):
        rotary(q, k, inv_freq, torch.arange(5, device=device))
    with pytest.raises(RuntimeError, match=r"position_ids must be int64 or int32, got Float"):
        rotary(q, k, inv_freq, positions.float())
    with pytest.raises(RuntimeError, match=r"k must have q's batch, sequence and head dims"):
        rotary(q, k[..., :6], inv_freq, positions)
    with pytest.raises(RuntimeError, match=r"k must have q's batch, sequence and head dims"):
        rotary(q, k[:1], inv_freq, positions)
    with pytest.raises(RuntimeError, match=r"q must have shape \(B, Hq, S, D\)"):
        rotary(q[0], k, inv_freq, positions)
    with pytest.raises(RuntimeError, match=r"k must have shape \(B, Hk, S, D\)"):
        rotary(q, k[0], inv_freq, positions)
    with pytest.raises(RuntimeError, match=r"out_dtype must be float32, float16 or bfloat16"):
        rotary(q, k, inv_freq, positions, out_dtype=torch.int32)


@requires_cuda
def test_mixed_devices_raise():
    q, k = make_qk(2, 4, 2, 5, 8, torch.float32, "cuda")
    inv_freq = inv_freq_for(8, device="cuda")
    positions = torch.arange(5, device="cuda")[None]
    with pytest.raises(RuntimeError, match=r"k must be on the device of q"):
        rotary(q, k.cpu(), inv_freq, positions)
    with pytest.raises(RuntimeError, match=r"inv_freq must be on the device of q"):
        rotary(q, k, inv_freq.cpu(), positions)
    with pytest.raises(RuntimeError, match=r"position_ids must be on the device of q"):
        rotary(q, k, inv_freq, positions.cpu())
    with pytest.raises(RuntimeError, match=r"float64 only on the CPU"):
        rotary(q.double(), k.double(), inv_freq, positions)
    with pytest.raises(RuntimeError, match=r"out_dtype must be .*float64 only on the CPU"):
        rotary(q, k, inv_freq, positions, out_dtype=torch.float64)


@pytest.mark.parametrize("device,dtype", device_dtypes(cpu_dtypes=(torch.float32,)))
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_unaligned_and_strided_inputs(device, dtype, interleaved):
    """Inputs the vector path cannot take (an odd storage offset, strides not a multiple of 16
    bytes, a non-dense last dim) and ones it can (a sliced head dim of a wider buffer)."""
    batch, heads_q, heads_k, seq, head_dim = 2, 3, 2, 6, 32
    inv_freq = inv_freq_for(16, device=device)
    positions = packed_positions(batch, seq, device)
    flat = randn(batch * seq * heads_q * head_dim + 1, dtype=dtype, device=device)
    cases = {
        "offset": flat[1:].view(batch, seq, heads_q, head_dim).transpose(1, 2),
        "odd_stride": randn(batch, seq, heads_q, head_dim + 1, dtype=dtype, device=device)[..., :head_dim]
        .transpose(1, 2),
        "wide": randn(batch, heads_q, seq, 2 * head_dim, dtype=dtype, device=device)[..., head_dim:],
        "last_dim_strided": randn(batch, heads_q, seq, 2 * head_dim, dtype=dtype, device=device)[..., ::2],
    }
    k = randn(batch, seq, heads_k, head_dim + 3, dtype=dtype, device=device)[..., 3:].transpose(1, 2)
    for name, q in cases.items():
        q_out, k_out = rotary(q, k, inv_freq, positions, 1.0, interleaved)
        assert_rel_close(q_out, reference(q, inv_freq, positions, 1.0, interleaved), TOL[dtype], f"{name} q_out")
        assert_rel_close(k_out, reference(k, inv_freq, positions, 1.0, interleaved), TOL[dtype], f"{name} k_out")


@pytest.mark.parametrize("device", devices())
def test_empty(device):
    inv_freq = inv_freq_for(8, device=device)
    for batch, heads_q, heads_k, seq in ((2, 3, 1, 0), (0, 3, 1, 4), (2, 0, 1, 4), (2, 0, 0, 4)):
        q, k = make_qk(batch, heads_q, heads_k, seq, 8, torch.float32, device, requires_grad=True)
        positions = torch.zeros(batch, seq, dtype=torch.int64, device=device)
        q_out, k_out = rotary(q, k, inv_freq, positions)
        assert q_out.shape == q.shape and k_out.shape == k.shape
        gq, gk = torch.autograd.grad((q_out, k_out), (q, k), (torch.ones_like(q_out), torch.ones_like(k_out)))
        assert gq.shape == q.shape and gk.shape == k.shape


@requires_cuda
@pytest.mark.parametrize("shape", [(8, 16, 4, 300, 128, 128), (2, 8, 4, 257, 256, 256), (3, 16, 2, 100, 64, 64),
                                   (1, 1, 1, 5000, 8, 8), (5, 16, 4, 2047, 128, 128), (2, 16, 4, 33, 128, 64),
                                   (2, 16, 2, 65, 128, 128), (1, 16, 16, 40, 128, 128), (2, 32, 8, 70, 128, 128),
                                   (1, 64, 8, 9, 128, 128)],
                         ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_cuda_model_shapes_match_float64(shape, interleaved, layout):
    """The grouped-query token kernel (16-bit, half-split, Hq / Hk = 4, 2, 8; 128 to 512 threads a
    token; tokens under and over 8 KB, read without and with the L2 evict-last policy), the token
    kernel (a block a token: fp32, interleaved, partial rotary, Hq = Hk) and the staged one (D = 64 with 18 heads, D = 8: blocks of several tokens across batch
    rows, many trips, one chunk a head); a grid of several waves; both layouts (bhsd: strided heads);
    bf16, fp16 and fp32."""
    batch, heads_q, heads_k, seq, head_dim, rot_dims = shape
    inv_freq = inv_freq_for(rot_dims, device="cuda")
    positions = packed_positions(batch, seq, "cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        q, k = make_qk(batch, heads_q, heads_k, seq, head_dim, dtype, "cuda", layout)
        poison_allocations(q, k)
        q_out, k_out = rotary(q, k, inv_freq, positions, 1.0, interleaved)
        assert_rel_close(q_out, reference(q, inv_freq, positions, 1.0, interleaved), TOL[dtype], "q_out")
        assert_rel_close(k_out, reference(k, inv_freq, positions, 1.0, interleaved), TOL[dtype], "k_out")


@requires_cuda
@pytest.mark.sanitize
@pytest.mark.parametrize("shape", [(2, 4, 2, 9, 16, 16), (1, 3, 1, 7, 6, 4), (2, 3, 1, 6, 80, 32),
                                   (1, 40, 30, 2, 256, 128), (2, 16, 4, 3, 128, 64), (2, 16, 2, 3, 128, 128),
                                   (1, 32, 8, 2, 128, 128)],
                         ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_cuda_small_for_sanitizer(shape, interleaved):
    """Every kernel path (grouped-query token, token, staged, register vector and scalar;
    half-split and interleaved; rotary and pass-through chunks; bf16 output from fp32) on small
    shapes, forward and backward."""
    batch, heads_q, heads_k, seq, head_dim, rot_dims = shape
    inv_freq = inv_freq_for(rot_dims, device="cuda")
    positions = packed_positions(batch, seq, "cuda", torch.int32)
    for dtype, out_dtype in ((torch.bfloat16, None), (torch.float32, torch.bfloat16)):
        q, k = make_qk(batch, heads_q, heads_k, seq, head_dim, dtype, "cuda", requires_grad=True)
        q_out, k_out = rotary(q, k, inv_freq, positions, 1.0, interleaved, out_dtype)
        gq, gk = torch.autograd.grad((q_out, k_out), (q, k), (torch.randn_like(q_out), torch.randn_like(k_out)))
        torch.cuda.synchronize()
        assert torch.isfinite(gq.float()).all() and torch.isfinite(gk.float()).all()


@requires_cuda
@pytest.mark.slow
def test_more_than_2_to_31_elements():
    """int64 offsets: q of 2^31 + 2^20 bf16 elements (about 4.3 GB; the grouped-query token kernel,
    32 / 4 heads); tokens at both ends checked."""
    heads_q, head_dim = 32, 128
    seq = (2**31 + 2**20) // (heads_q * head_dim)
    q = torch.randn(1, seq, heads_q, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, seq, 4, head_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    inv_freq = inv_freq_for(head_dim, device="cuda")
    positions = torch.arange(seq, device="cuda")[None]
    q_out, k_out = rotary(q, k, inv_freq, positions)
    for sl in (slice(0, 4), slice(seq - 4, seq)):
        assert_rel_close(q_out[:, :, sl], reference(q[:, :, sl], inv_freq, positions[:, sl]), TOL[torch.bfloat16])
        assert_rel_close(k_out[:, :, sl], reference(k[:, :, sl], inv_freq, positions[:, sl]), TOL[torch.bfloat16])
