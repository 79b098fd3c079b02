"""fuseforge.optim.AdamW(paged=True): optimizer states in CUDA managed memory.

Paging moves where the states live, not what the step computes: every test compares a paged run
with the same optimizer unpaged, bit for bit, and checks where the states are with
torch.ops.fuseforge.adamw_is_managed (cudaPointerGetAttributes).
"""
import copy
import io

import pytest
import torch

import fuseforge  # noqa: F401  (loads the extension)
from fuseforge.optim import AdamW, MIN_COMPACT_NUMEL
from harness import devices, requires_cuda
from test_adamw import cuda_kernels_of_a_step
from test_adamw_lowbit import KW, heavy_grads, make_params, set_grads

_is_managed = torch.ops.fuseforge.adamw_is_managed
STATE_DTYPES = ["float32", "bfloat16", "int8"]


def twin(params):
    """Copies of `params` with their layouts (views into storages as the originals are not)."""
    return [torch.nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device).copy_(p))
            for p in params]


def state_tensors(opt):
    return [(i, k, v) for i, st in enumerate(opt.state.values()) for k, v in st.items() if k != "step"]


def assert_same_run(opt_a, a, opt_b, b):
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert set(sa) == set(sb)
        for k in sa:
            assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def train(pairs, steps):
    """Steps every (optimizer, params) pair on the same heavy-tailed grads."""
    for _ in range(steps):
        grads = heavy_grads(pairs[0][1])
        for opt, params in pairs:
            set_grads(params, grads)
            opt.step()


# ---- the setting, CPU parameters ----------------------------------------------------------------


def test_paged_argument_errors():
    p = torch.nn.Parameter(torch.randn(8))
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="paged must be True or False"):
            AdamW([p], paged=bad)
    opt = AdamW([p])
    with pytest.raises(ValueError, match="paged must be True or False"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "paged": "no"})


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_cpu_params_ignore_paged(state_dtype):
    """CPU parameters keep their states in ordinary host memory: the same bits as paged=False."""
    a = make_params("cpu")
    b = twin(a)
    opt_a = AdamW(a, **KW, state_dtype=state_dtype, paged=True)
    opt_b = AdamW(b, **KW, state_dtype=state_dtype)
    assert opt_a.param_groups[0]["paged"] is True
    train([(opt_a, a), (opt_b, b)], 3)
    assert_same_run(opt_a, a, opt_b, b)
    assert not any(_is_managed(v) for _, _, v in state_tensors(opt_a))
    # A setting of the optimizer that loads, as state_dtype: not in the saved groups, and kept on a
    # load even where a group has it.
    assert all("paged" not in g for g in opt_a.state_dict()["param_groups"])
    for opt, saved in ((opt_b, True), (opt_a, False)):
        sd = opt.state_dict()
        sd["param_groups"][0]["paged"] = saved
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["paged"] is not saved


def test_is_managed_op_cpu():
    assert _is_managed(torch.randn(4)) is False
    torch.library.opcheck(_is_managed, (torch.randn(4),), test_utils=("test_schema", "test_autograd_registration"))


# ---- CUDA -----------------------------------------------------------------------------------------


def cuda_pair(state_dtype, dtype=torch.float32, **kw):
    a = make_params("cuda", dtype)
    b = twin(a)
    return a, AdamW(a, **KW, state_dtype=state_dtype, paged=True, **kw), b, AdamW(b, **KW, state_dtype=state_dtype,
                                                                                  **kw)


@requires_cuda
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("dtype,master", [(torch.float32, False), (torch.bfloat16, True)])
def test_paged_states_in_managed_memory_bitwise_equal(state_dtype, dtype, master):
    """Every state of a paged optimizer (moments, int8 scales, master weights) is managed memory,
    allocated outside torch's caching allocator, and the run equals the unpaged one bit for bit."""
    a, opt_a, b, opt_b = cuda_pair(state_dtype, dtype, master_weights=master)
    grads = heavy_grads(a)
    set_grads(a, grads)
    set_grads(b, grads)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt_a.step()  # creates the states
    torch.cuda.synchronize()
    grew = torch.cuda.memory_allocated() - before
    opt_b.step()
    states = state_tensors(opt_a)
    expected = {"exp_avg", "exp_avg_sq"} | ({"master_param"} if master else set()) | (
        {"exp_avg_absmax", "exp_avg_sq_absmax"} if state_dtype == "int8" else set())
    assert {k for _, k, _ in states} == expected
    for i, k, v in states:
        assert v.is_cuda and _is_managed(v), (i, k)
    assert grew < sum(v.nbytes for _, _, v in states) / 4, (grew, "states came from the caching allocator")
    train([(opt_a, a), (opt_b, b)], 4)
    assert_same_run(opt_a, a, opt_b, b)
    assert not any(_is_managed(v) for _, _, v in state_tensors(opt_b))


@requires_cuda
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_paged_one_launch_a_step(state_dtype):
    params = [torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL * 2, device="cuda")) for _ in range(40)]
    params += [torch.nn.Parameter(torch.randn(100, device="cuda")) for _ in range(10)]
    opt = AdamW(params, state_dtype=state_dtype, paged=True)
    names = cuda_kernels_of_a_step(opt, params)
    assert len([n for n in names if "adamw_multi_tensor_kernel" in n]) == 1, names[:20]
    assert not any("patch_words" in n for n in names), "grads did not move: nothing to upload"
    h = opt._handles[0]
    assert all(_is_managed(v) for _, _, v in state_tensors(opt))
    assert h.flags[0] & 16  # kFlagPaged


@requires_cuda
@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_paged_state_dict_round_trip(state_dtype):
    """state_dict() holds the paged tensors; saved and loaded into a paged optimizer the states are
    copied into its managed memory, bit for bit, and into an unpaged one as ordinary tensors."""
    a, opt_a, b, opt_b = cuda_pair(state_dtype)
    train([(opt_a, a), (opt_b, b)], 3)
    sd = opt_a.state_dict()
    assert sd["state"][0]["exp_avg"] is opt_a.state[a[0]]["exp_avg"]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert not any(_is_managed(v) for st in saved["state"].values() for k, v in st.items() if k != "step")
    c, d = twin(a), twin(a)
    opt_c = AdamW(c, **KW, state_dtype=state_dtype, paged=True)
    opt_d = AdamW(d, **KW, state_dtype=state_dtype)
    opt_c.load_state_dict(copy.deepcopy(saved))
    opt_d.load_state_dict(copy.deepcopy(saved))
    assert all(_is_managed(v) for _, _, v in state_tensors(opt_c))
    assert not any(_is_managed(v) for _, _, v in state_tensors(opt_d))
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(opt_c.state_dict()["state"][i][k].cpu(), v.cpu()), (i, k)
    # A paged checkpoint is an ordinary one: the unpaged optimizers continue alike.
    train([(opt_a, a), (opt_b, b), (opt_c, c), (opt_d, d)], 3)
    assert_same_run(opt_a, a, opt_c, c)
    assert_same_run(opt_a, a, opt_d, d)
    assert_same_run(opt_a, a, opt_b, b)


@requires_cuda
def test_paged_rebuild_keeps_states_managed():
    """A new param group rebuilds the handle: the states move into the new handle's managed memory,
    unchanged, and per-group settings mix paged and unpaged parameters in the one launch."""
    a, opt_a, b, opt_b = cuda_pair("int8")
    train([(opt_a, a), (opt_b, b)], 2)
    extra_a = [torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL + 7, device="cuda"))]
    extra_b = twin(extra_a)
    opt_a.add_param_group({"params": extra_a, "paged": False})
    opt_b.add_param_group({"params": extra_b})
    a, b = a + extra_a, b + extra_b
    train([(opt_a, a), (opt_b, b)], 3)
    assert_same_run(opt_a, a, opt_b, b)
    assert len(opt_a._handles) == 1
    for p in a[:-1]:
        assert all(_is_managed(v) for k, v in opt_a.state[p].items() if k != "step")
    assert not any(_is_managed(v) for k, v in opt_a.state[extra_a[0]].items() if k != "step")


@requires_cuda
def test_paged_cuda_graph_capture_replay():
    """Captured steps leave the prefetch out (graphs have no prefetch node): replays still match."""
    a, opt_a, b, opt_b = cuda_pair("int8", capturable=True)
    grads = heavy_grads(a)
    set_grads(a, grads)
    set_grads(b, grads)
    opt_a.step()
    opt_b.step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        opt_a.step()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        grads = heavy_grads(a)
        for p, g in zip(a, grads):
            p.grad.copy_(g)
        graph.replay()
        set_grads(b, grads)
        opt_b.step()
    torch.cuda.synchronize()
    assert_same_run(opt_a, a, opt_b, b)


@requires_cuda
def test_is_managed_op_cuda():
    assert _is_managed(torch.randn(4, device="cuda")) is False
    torch.library.opcheck(_is_managed, (torch.randn(4, device="cuda"),),
                          test_utils=("test_schema", "test_autograd_registration"))


@requires_cuda
@pytest.mark.sanitize
def test_sanitize_paged_states():
    """Small: float32, bfloat16 (amsgrad) and int8 (fp16 params, bf16 + master) states in one paged
    arena, aligned and misaligned tensors."""
    def params():
        g = torch.Generator(device="cuda").manual_seed(7)
        return [torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL + 40, device="cuda", generator=g)),
                torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL + 301, device="cuda", generator=g)[1:]),
                torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL, device="cuda", generator=g).half()),
                torch.nn.Parameter(torch.randn(MIN_COMPACT_NUMEL + 8, device="cuda", generator=g).bfloat16()),
                torch.nn.Parameter(torch.randn(37, device="cuda", generator=g))]

    def groups(ps, paged):
        return [{"params": ps[:1] + ps[4:]}, {"params": ps[1:2], "state_dtype": "bfloat16", "amsgrad": True},
                {"params": ps[2:3], "state_dtype": "int8"},
                {"params": ps[3:4], "state_dtype": "int8", "master_weights": True}], dict(paged=paged, lr=1e-2)

    a, b = params(), params()
    ga, ka = groups(a, True)
    gb, kb = groups(b, False)
    opt_a, opt_b = AdamW(ga, **ka), AdamW(gb, **kb)
    train([(opt_a, a), (opt_b, b)], 3)
    assert_same_run(opt_a, a, opt_b, b)
