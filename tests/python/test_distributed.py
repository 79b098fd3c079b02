"""fuseforge under torch.distributed: FSDP2 (fully_shard, DTensor parameters), DDP and
torch.distributed.checkpoint (DCP), in 2 processes.

Every test starts its own process group in 2 fresh worker processes (this file run as a script:
`python test_distributed.py --worker SCENARIO RANK WORLD DEVICE TMPDIR`); a scenario raises on a
mismatch and the test fails with the workers' output. CPU: gloo (runs everywhere, CI included);
CUDA: nccl, one GPU per rank, skipped unless 2 GPUs and a CUDA build are present.

What is compared, step by step:
- fuseforge.optim.AdamW on FSDP2 DTensor parameters (uneven shards, an empty shard, a plain
  parameter in the same optimizer) against the same optimizer on plain full copies: bitwise (the
  kernel is elementwise), with amsgrad/maximize, tensor lr, grad_scale/found_inf, bf16 master
  weights and param groups; and against torch.optim.AdamW on the same DTensors (float32 rounding).
- a GPT trained under FSDP2 with clip_grad_norm_ on DTensor grads: fuseforge AdamW vs torch AdamW.
- the demo model's fuseforge GPT vs its torch GPT, and fuseforge.patch-ed vs unpatched
  Hugging Face Llama (tied embeddings), under FSDP2 and DDP: losses and gradients.
- DCP: save mid-training, load into a new process group / model / optimizer, resume bitwise; and
  the optimizer checkpoint moves between fuseforge.optim.AdamW and torch.optim.AdamW both ways.
- int8 and bfloat16 states on FSDP2 DTensor parameters against the same optimizer on plain copies
  of the local shards (bitwise), with a DCP round trip that resumes bitwise (paged on GPUs).
- examples/train_distributed.py under torchrun.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORLD = 2

import fuseforge  # noqa: E402,F401  (loads the extension)
from harness import HAS_CUDA, CUDA_SKIP_REASON  # noqa: E402

if not torch.distributed.is_available():
    pytestmark = pytest.mark.skip(reason="torch was built without torch.distributed (USE_DISTRIBUTED=0)")
elif not torch.distributed.is_gloo_available():
    pytestmark = pytest.mark.skip(reason="torch was built without the gloo backend")

HAS_2_GPUS = HAS_CUDA and torch.cuda.device_count() >= 2
TWO_GPU_SKIP_REASON = (CUDA_SKIP_REASON if not HAS_CUDA
                       else f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
requires_2_gpus = pytest.mark.skipif(not HAS_2_GPUS, reason=TWO_GPU_SKIP_REASON)


def backends() -> list:
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_2_gpus])]


# ----------------------------------------------------------------------------------------------------------
# launcher (the test process)

def child_env(device: str) -> dict:
    """The environment of the processes a test starts: this one's imports, one thread each, and on the
    CPU no GPU (on a GPU machine too: FSDP2's default mesh would otherwise take the GPU)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def launch(scenario: str, device: str, timeout: float = 150.0, world: int = WORLD) -> str:
    """Runs `scenario` in `world` worker processes; fails with their output unless all exit 0."""
    tmp = tempfile.mkdtemp(prefix="ff_dist_")
    env = child_env(device)
    procs, logs = [], []
    try:
        for rank in range(world):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", scenario,
                                           str(rank), str(world), device, tmp],
                                          env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        out = ""
        for rank, log in enumerate(logs):
            log.seek(0)
            out += f"---- rank {rank} (exit {codes[rank]}) ----\n{log.read()[-6000:]}\n"
        assert all(c == 0 for c in codes), (f"scenario {scenario} on {device} failed (exit codes {codes}; "
                                            f"None: killed after {timeout:.0f} s):\n{out}")
        return out
    finally:
        for log in logs:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# the tests

@pytest.mark.parametrize("device", backends())
def test_adamw_fsdp2_matches_plain_bitwise(device):
    launch("adamw_exact", device)


@pytest.mark.parametrize("device", backends())
def test_adamw_fsdp2_compact_states_and_dcp(device):
    launch("adamw_compact", device)


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.xfail(strict=False, reason=(
    "known limitation (torch 2.14, CPU): dynamo fails building guards for opt.step over FSDP2 "
    "DTensors at world size 2 (IndexError in ShapeEnv.produce_guards_verbose after tracing the step); "
    "world size 1 compiles and matches")))])
def test_adamw_fsdp2_compiled_step(world):
    """The torch.compile path (_step_lists) on DTensor parameters, then eager steps adopting its state."""
    launch("adamw_compile", "cpu", world=world)


@pytest.mark.parametrize("device", backends())
def test_adamw_fsdp2_training_matches_torch_adamw(device):
    launch("adamw_train", device)


@pytest.mark.parametrize("device", backends())
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_gpt_ops_match_torch(device, wrapper):
    launch(f"gpt_{wrapper}", device)


@pytest.mark.parametrize("device", backends())
@pytest.mark.parametrize("wrapper", ["fsdp", "fsdp_head", "ddp"])
def test_patched_llama_matches_unpatched(device, wrapper):
    pytest.importorskip("transformers")
    launch(f"llama_{wrapper}", device)


@pytest.mark.parametrize("device", backends())
def test_dcp_resume_bitwise_and_torch_interchange(device):
    launch("dcp", device)


@pytest.mark.parametrize("device", backends())
@pytest.mark.parametrize("dp", ["fsdp", "ddp"])
def test_example_train_distributed(dp, device):
    """examples/train_distributed.py under torchrun, 2 processes (CPU: gloo; CUDA: nccl with bf16), a few steps."""
    env = child_env(device)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           os.path.join(ROOT, "examples", "train_distributed.py"), "--device", device, "--dp", dp,
           "--steps", "6", "--log-every", "3"] + (["--bf16"] if device == "cuda" else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    for rank in range(WORLD):
        assert f"rank {rank}" in out and "tokens/s" in out, out[-3000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in r.stdout.splitlines() if "loss " in line]
    assert losses and all(math.isfinite(x) and 3.0 < x < 7.0 for x in losses), out[-3000:]


@pytest.mark.parametrize("wrap", ["root", "per-module"])
def test_bench_fsdp_smoke(wrap, tmp_path):
    """benchmarks/bench_fsdp.py's CPU smoke test (it starts 2 gloo processes under torchrun itself): both
    impls and the AdamW case write their rows, and the patched model's losses follow the unpatched one's."""
    import json
    pytest.importorskip("transformers")
    env = child_env("cpu")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_fsdp.py"), "--steps", "2", "--wrap", wrap,
           "--out", str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    result = json.load(open(tmp_path / ("fsdp_cpu.json" if wrap == "root" else "fsdp_per_module_cpu.json")))
    assert result["ranks"] == WORLD and result["backend"] == "gloo" and result["wrap"] == wrap
    impls = [(row["case"].split("/")[1], row["impl"]) for row in result["rows"]]
    assert impls == [("llama-hf", "eager"), ("llama-hf", "fuseforge"), ("adamw-shards", "torch_fused"),
                     ("adamw-shards", "fuseforge")], impls
    ff = result["rows"][1]
    assert len(ff["loss_curve"]) == 2 and ff["mean_abs_loss_diff_rel"] < 1e-4, ff
    assert all(row["ms"] > 0 for row in result["rows"])


# ----------------------------------------------------------------------------------------------------------
# worker side: helpers

class Ctx:
    def __init__(self, rank: int, world: int, device: str, tmp: str):
        self.rank, self.world, self.tmp = rank, world, tmp
        self.device = torch.device(device if device == "cpu" else f"cuda:{rank}")
        self.backend = "gloo" if device == "cpu" else "nccl"
        self.stores = 0

    def init_pg(self) -> None:
        """A new process group on a new file store (no ports to pick)."""
        import torch.distributed as dist
        self.stores += 1
        dist.init_process_group(self.backend, init_method=f"file://{self.tmp}/store{self.stores}",
                                rank=self.rank, world_size=self.world,
                                **({"device_id": self.device} if self.device.type == "cuda" else {}))

    def destroy_pg(self) -> None:
        import gc
        import torch.distributed as dist
        gc.collect()  # the scenario's DTensors / FSDP states go before their process group does
        dist.barrier()
        dist.destroy_process_group()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _full(a).detach().double().cpu(), _full(b).detach().double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_close(a, b, tol: float, what: str) -> None:
    e = rel(a, b)
    assert e <= tol, f"{what}: relative error {e:.3e} > {tol:.1e}"


def assert_equal(a, b, what: str) -> None:
    a, b = _full(a).detach().cpu(), _full(b).detach().cpu()
    assert torch.equal(a, b), f"{what}: not bitwise equal (max abs diff {(a.double() - b.double()).abs().max().item():.3e})"


def gpt_config(ctx: Ctx):
    from demo_model import GPTConfig
    # CUDA attention runs fp16/bf16 with head dims 64/128 (the GPT runs under bf16 autocast there).
    if ctx.cuda:
        return GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_kv_head=1, d_model=128)
    return GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32, mlp_ratio=2)


def batch(step: int, ctx: Ctx, seq: int, per_rank: int = 2, vocab: int = 256, rank=None):
    """This rank's batch of step `step` (the same on every run)."""
    rank = ctx.rank if rank is None else rank
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (per_rank, seq + 1), generator=g)
    return ids[:, :-1].to(ctx.device), ids[:, 1:].to(ctx.device)


def autocast(ctx: Ctx):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=ctx.cuda)


def shard_gpt(model):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


# ----------------------------------------------------------------------------------------------------------
# scenarios

def scenario_adamw_exact(ctx: Ctx) -> None:
    """fuseforge AdamW on FSDP2 DTensor params vs the same optimizer on plain full copies, bitwise."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
    from fuseforge.optim import AdamW
    # Uneven shards, a 1-row param (rank 1's shard is empty), a bias; plus a plain parameter.
    shapes = [(7, 5), (1, 6), (3,), (16, 4), (9,)]

    def make(dtype):
        g = torch.Generator().manual_seed(0)
        m = torch.nn.Module()
        m.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes)
        return m.to(ctx.device)

    configs = [
        dict(name="fp32", kw=dict(lr=1e-2, weight_decay=0.1)),
        dict(name="amsgrad+maximize", kw=dict(lr=1e-2, amsgrad=True, maximize=True)),
        dict(name="tensor lr", kw=dict(lr="tensor")),
        dict(name="grad_scale/found_inf", kw=dict(lr=1e-2), scale=True),
        dict(name="bf16 master", kw=dict(lr=1e-2, master_weights=True), dtype=torch.bfloat16),
        dict(name="groups", kw=dict(lr=1e-2), groups=True),
    ]
    for cfg in configs:
        dtype = cfg.get("dtype", torch.float32)
        sharded, plain = make(dtype), make(dtype)
        fully_shard(sharded)
        extra = torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(1)).to(ctx.device, dtype))
        extra_ref = torch.nn.Parameter(extra.detach().clone())
        dps, pps = list(sharded.ps) + [extra], list(plain.ps) + [extra_ref]
        assert all(isinstance(p, DTensor) for p in dps[:-1])
        kw = dict(cfg["kw"])
        lrs = []
        if kw.get("lr") == "tensor":
            lrs = [torch.tensor(1e-2, device=ctx.device), torch.tensor(1e-2, device=ctx.device)]
            kw["lr"] = lrs[0]

        def opt_for(ps, i):
            k = dict(kw, lr=lrs[i]) if lrs else kw
            if cfg.get("groups"):
                return AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "betas": (0.8, 0.99),
                                                   "weight_decay": 0.0}], **k)
            return AdamW(ps, **k)

        opt, ref = opt_for(dps, 0), opt_for(pps, 1)
        for step in range(6):
            g = torch.Generator().manual_seed(100 + step)
            grads = [torch.randn(p.shape, generator=g).to(ctx.device, dtype) for p in pps]
            for p, q, gr in zip(dps, pps, grads):
                q.grad = gr.clone()
                p.grad = distribute_tensor(gr, p.device_mesh, p.placements) if isinstance(p, DTensor) else gr.clone()
            if cfg.get("scale"):
                for o in (opt, ref):
                    o.grad_scale = torch.tensor(4.0, device=ctx.device)
                    o.found_inf = torch.tensor(1.0 if step == 3 else 0.0, device=ctx.device)
            opt.step()
            ref.step()
            if lrs:
                for t in lrs:
                    t.fill_(1e-2 / (step + 2))
            what = f"[{cfg['name']}] step {step}"
            assert len(opt._handles) == 1, "one handle (one launch) per device"
            for i, (p, q) in enumerate(zip(dps, pps)):
                assert_equal(p, q, f"{what} param {i}")
                assert_equal(p.grad, q.grad, f"{what} grad {i} (unscaled in place)")
                st, rst = opt.state[p], ref.state[q]
                assert set(st) == set(rst), (what, set(st), set(rst))
                for k in st:
                    assert_equal(st[k], rst[k], f"{what} state {k} of param {i}")
                assert not isinstance(st["step"], DTensor) and st["step"].dim() == 0
                if isinstance(p, DTensor):
                    for k in set(st) - {"step"}:
                        v = st[k]
                        assert isinstance(v, DTensor) and v.placements == p.placements and \
                            v.device_mesh == p.device_mesh and v.shape == p.shape, (what, k)
                    assert p._local_tensor.grad is None, "the local shard must not keep the grad"
            opt.zero_grad()
            ref.zero_grad()
            assert all(p.grad is None for p in dps)
        if cfg.get("scale"):
            assert opt.state[dps[0]]["step"].item() == 5  # the found_inf step was skipped
        # The handle holds the local shards themselves: one launch updates them all.
        h = opt._handles[0]
        for p, t in zip(h.params, h.tensors):
            assert t is (p._local_tensor if isinstance(p, DTensor) else p)
    # A local shard replaced behind the optimizer's back (FSDP's lazy init does this) is picked up.
    sharded, plain = make(torch.float32), make(torch.float32)
    fully_shard(sharded)
    opt, ref = AdamW(list(sharded.ps), lr=1e-2), AdamW(list(plain.ps), lr=1e-2)
    for step in range(3):
        if step == 1:
            for p in sharded.ps:
                p._local_tensor = p._local_tensor.clone()
        for p, q in zip(sharded.ps, plain.ps):
            q.grad = torch.full(q.shape, 0.5 + step, device=ctx.device)
            p.grad = distribute_tensor(q.grad, p.device_mesh, p.placements)
        opt.step()
        ref.step()
    for p, q in zip(sharded.ps, plain.ps):
        assert_equal(p, q, "after a replaced local shard")
    # Against torch.optim.AdamW on the same DTensors (torch rounds differently on the CPU). On CUDA its
    # fused kernel, which fuseforge's rounds like: torch's default (foreach) path takes 1 - beta2 in
    # double, 1.3e-5 off the float32 1 - beta2 both kernels use (a 1.29e-5 relative error in exp_avg_sq).
    a, b = make(torch.float32), make(torch.float32)
    fully_shard(a)
    fully_shard(b)
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
    opt, tref = AdamW(list(a.ps), **kw), torch.optim.AdamW(list(b.ps), **kw, fused=ctx.cuda)
    for step in range(10):
        g = torch.Generator().manual_seed(200 + step)
        for p, q in zip(a.ps, b.ps):
            gr = torch.randn(p.shape, generator=g).to(ctx.device)
            p.grad = distribute_tensor(gr, p.device_mesh, p.placements)
            q.grad = distribute_tensor(gr, q.device_mesh, q.placements)
        opt.step()
        tref.step()
    for i, (p, q) in enumerate(zip(a.ps, b.ps)):
        assert_close(p, q, 2e-6, f"vs torch.optim.AdamW param {i}")
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert_close(opt.state[p][k], tref.state[q][k], 2e-6, f"vs torch.optim.AdamW state {k} of param {i}")
        assert opt.state[p]["step"].item() == tref.state[q]["step"].item() == 10


def scenario_adamw_compact(ctx: Ctx) -> None:
    """int8 and bfloat16 states on FSDP2 DTensor params: bitwise equal to the same optimizer on plain
    copies of each rank's local shards (the kernel sees the same tensors; compact states round per
    shard, so a run on the full tensors differs), int8 block scales as a padded DTensor sharded on
    dim 0; a DCP save after 3 steps loads into a new model and optimizer and resumes bit for bit. On
    GPUs the int8 optimizer is paged (states in managed memory), its reference not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from fuseforge.optim import AdamW, QUANT_BLOCK
    # Even rows; uneven rows (shards of 4257 and 4224 elements, partial last blocks); one row (rank
    # 1's shard is empty); a small one (float32 states).
    shapes = [(130, 64), (257, 33), (1, 5000), (7, 5)]

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        m = torch.nn.Module()
        m.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes)
        m = m.to(ctx.device)
        fully_shard(m)
        return m

    def grads_of(step):
        g = torch.Generator().manual_seed(300 + step)
        return [torch.randn(s, generator=g).to(ctx.device) for s in shapes]

    def step_sharded(m, o, step):
        for p, gr in zip(m.ps, grads_of(step)):
            p.grad = distribute_tensor(gr, p.device_mesh, p.placements)
        o.step()
        o.zero_grad()

    def local_states(o, m):
        return [{k: (v._local_tensor if isinstance(v, DTensor) else v).clone() for k, v in o.state[p].items()}
                for p in m.ps]

    for state_dtype in ("int8", "bfloat16"):
        paged = ctx.cuda and state_dtype == "int8"
        kw = dict(lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
        m = make(0)
        opt = AdamW(m.parameters(), paged=paged, **kw)
        plain = [torch.nn.Parameter(p._local_tensor.detach().clone()) for p in m.ps]
        ref = AdamW(plain, **kw)
        for step in range(3):
            step_sharded(m, opt, step)
            for p, q, gr in zip(m.ps, plain, grads_of(step)):
                q.grad = distribute_tensor(gr, p.device_mesh, p.placements)._local_tensor.clone()
            ref.step()
            what = f"[{state_dtype}] step {step}"
            for i, (p, q) in enumerate(zip(m.ps, plain)):
                assert_equal(p._local_tensor, q, f"{what} param {i}")
                st, rst = opt.state[p], ref.state[q]
                if q.numel() == 0:  # an empty shard (its plain copy keeps float32 states)
                    continue
                assert set(st) == set(rst), (what, i, set(st), set(rst))
                for k in set(st) - {"step"}:
                    v = st[k]
                    assert isinstance(v, DTensor), (what, i, k)
                    if k.endswith("_absmax"):
                        blocks = -(-q.numel() // QUANT_BLOCK)
                        local = v._local_tensor
                        assert v.placements == (Shard(0),) and v.shape[0] == ctx.world * local.numel(), (what, k)
                        assert_equal(local[:blocks], rst[k], f"{what} {k} of param {i}")
                        assert not local[blocks:].any(), (what, k, "padding written")
                    else:
                        assert v.placements == p.placements and v.shape == p.shape, (what, i, k)
                        assert_equal(v._local_tensor, rst[k], f"{what} {k} of param {i}")
                    if paged:
                        assert torch.ops.fuseforge.adamw_is_managed(v._local_tensor), (what, i, k)
            if state_dtype == "int8":  # the keys are the same on every rank, empty shards included
                assert set(opt.state[m.ps[2]]) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_absmax",
                                                   "exp_avg_sq_absmax"}
        # DCP: save, run on, then load into a new model and optimizer and run the same steps.
        path = os.path.join(ctx.tmp, f"ckpt_{state_dtype}")
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        saved = local_states(opt, m)
        for step in range(3, 6):
            step_sharded(m, opt, step)
        m2 = make(1)
        opt2 = AdamW(m2.parameters(), paged=paged, **kw)
        msd, osd = get_state_dict(m2, opt2)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(m2, opt2, model_state_dict=msd, optim_state_dict=osd)
        for i, (a, b) in enumerate(zip(saved, local_states(opt2, m2))):
            assert set(a) == set(b), (state_dtype, i, set(a), set(b))
            for k in a:
                assert_equal(b[k], a[k], f"[{state_dtype}] loaded {k} of param {i}")
        for step in range(3, 6):
            step_sharded(m2, opt2, step)
        for i, (p, q) in enumerate(zip(m.ps, m2.ps)):
            assert_equal(q._local_tensor, p._local_tensor, f"[{state_dtype}] resumed param {i}")
        for i, (a, b) in enumerate(zip(local_states(opt, m), local_states(opt2, m2))):
            for k in a:
                assert_equal(b[k], a[k], f"[{state_dtype}] resumed {k} of param {i}")


def scenario_adamw_compile(ctx: Ctx) -> None:
    """torch.compile(opt.step) (the traced adamw_fused_ path, on local shards) on DTensor params, then
    eager steps: bitwise equal to eager steps on plain full copies."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from fuseforge.optim import AdamW
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2)).to(ctx.device)
    fully_shard(m)
    plain = [torch.nn.Parameter(p.full_tensor().detach().clone()) for p in m.parameters()]
    opt, ref = AdamW(m.parameters(), lr=1e-2, amsgrad=True), AdamW(plain, lr=1e-2, amsgrad=True)
    step = torch.compile(opt.step, fullgraph=True, backend="aot_eager", dynamic=False)
    for i in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i)).to(ctx.device)
        m(x).square().sum().backward()
        for p, q in zip(m.parameters(), plain):
            q.grad = p.grad.full_tensor().clone()
        (step if i < 2 else opt.step)()
        ref.step()
        opt.zero_grad()
        for j, (p, q) in enumerate(zip(m.parameters(), plain)):
            assert_equal(p, q, f"step {i} ({'compiled' if i < 2 else 'eager'}) param {j}")
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                assert isinstance(opt.state[p][k], DTensor)
                assert_equal(opt.state[p][k], ref.state[q][k], f"step {i} state {k} of param {j}")


def scenario_adamw_train(ctx: Ctx) -> None:
    """A GPT under FSDP2 with clip_grad_norm_ on DTensor grads: fuseforge AdamW vs torch AdamW."""
    from demo_model import TorchGPT
    from fuseforge.optim import AdamW
    c = gpt_config(ctx)
    models = []
    for _ in range(2):
        m = TorchGPT(c)
        m.reset_parameters(0)
        models.append(shard_gpt(m.to(ctx.device)))
    groups = lambda m: [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},  # noqa
                        {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opts = [AdamW(groups(models[0]), lr=3e-3), torch.optim.AdamW(groups(models[1]), lr=3e-3, fused=ctx.cuda)]
    for step in range(6):
        x, y = batch(step, ctx, c.block_size)
        losses, norms = [], []
        for m, o in zip(models, opts):
            with autocast(ctx):
                loss = m(x, y)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).full_tensor())
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
        assert torch.isfinite(losses[0])
        assert_close(losses[0], losses[1], 1e-5 if not ctx.cuda else 1e-3, f"loss at step {step}")
        assert_close(norms[0], norms[1], 1e-5 if not ctx.cuda else 1e-3, f"grad norm at step {step}")
        assert norms[0].item() > 0.5  # clipping was active
    for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert_close(p, q, 1e-5 if not ctx.cuda else 1e-3, f"param {n} after 6 steps")


def _gpt_pair(ctx: Ctx, wrapper: str):
    from demo_model import make_pair
    c = gpt_config(ctx)
    ff, ref = make_pair(c, seed=0, device=ctx.device)
    plain_ff, _ = make_pair(c, seed=0, device=ctx.device)
    if wrapper == "fsdp":
        ff, ref = shard_gpt(ff), shard_gpt(ref)
        # The tied head/embedding weight reaches linear_cross_entropy unsharded (a plain tensor).
        seen = []
        ff.register_forward_hook(lambda *a: seen.append(type(ff.head.weight)))
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [ctx.device.index] if ctx.cuda else None
        ff, ref = DDP(ff, device_ids=ids), DDP(ref, device_ids=ids)
        seen = None
    return c, ff, ref, plain_ff, seen


def _scenario_gpt(ctx: Ctx, wrapper: str) -> None:
    """The fuseforge GPT vs the torch GPT under one wrapper: losses and grads, step by step."""
    c, ff, ref, plain_ff, seen = _gpt_pair(ctx, wrapper)
    tol = dict(loss=1e-5, grad=2e-5, param=2e-5) if not ctx.cuda else dict(loss=2e-2, grad=5e-2, param=5e-2)
    # CUDA (bf16 autocast): AdamW's first steps move each element by about lr whatever its gradient's
    # size, so where a gradient is at bf16 noise level (zero-initialised biases) the two models step
    # apart (a LayerNorm bias 6.5e-2 off after 4 steps on 2 H100s, grads within 5e-2 at every step).
    # SGD keeps the parameters' difference in proportion to the gradients'.
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) if not ctx.cuda else
            torch.optim.SGD(m.parameters(), lr=3e-2, momentum=0.9) for m in (ff, ref)]
    named_ref = dict(ref.named_parameters())
    for step in range(4):
        x, y = batch(step, ctx, c.block_size)
        with autocast(ctx):
            loss_ff = ff(x, y)
            loss_ref = ref(x, y)
        loss_ff.backward()
        loss_ref.backward()
        assert_close(loss_ff.detach().float(), loss_ref.detach().float(), tol["loss"], f"loss at step {step}")
        if step == 0:  # the wrapped model's forward equals the unwrapped fuseforge model's
            with autocast(ctx):
                local = plain_ff(x, y)
            assert_close(loss_ff.detach().float(), local.detach().float(), tol["loss"], "wrapped vs unwrapped")
        for n, p in ff.named_parameters():
            assert p.grad is not None, f"no grad for {n}"
            assert_close(p.grad, named_ref[n].grad, tol["grad"], f"grad of {n} at step {step}")
        for o in opts:
            o.step()
            o.zero_grad()
    for n, p in ff.named_parameters():
        assert_close(p, named_ref[n], tol["param"], f"param {n}")
    if seen is not None:
        from torch.distributed.tensor import DTensor
        assert seen and not any(issubclass(t, DTensor) for t in seen), seen


def scenario_gpt_fsdp(ctx: Ctx) -> None:
    _scenario_gpt(ctx, "fsdp")


def scenario_gpt_ddp(ctx: Ctx) -> None:
    _scenario_gpt(ctx, "ddp")


def _scenario_llama(ctx: Ctx, wrapper: str) -> None:
    """fuseforge.patch-ed vs unpatched tiny Llama under one wrapper: tied embeddings owned by the root
    (fsdp, ddp), or untied with the embedding and the head sharded on their own as torchtitan does
    (fsdp_head: the patched loss must run inside the head's call for FSDP2 to gather its weight)."""
    from test_patch import make_model
    from fuseforge.patch import patch, stats
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    head_dim = 64 if ctx.cuda else 16
    tied = wrapper != "fsdp_head"
    models = [make_model("llama", dtype=dtype, device=ctx.device, head_dim=head_dim, tie_word_embeddings=tied)
              for _ in range(2)]
    assert (models[0].lm_head.weight is models[0].model.embed_tokens.weight) == tied
    patch(models[0])
    if wrapper.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard
        for m in models:
            for layer in m.model.layers:
                fully_shard(layer)
            if not tied:
                fully_shard(m.model.embed_tokens)
                fully_shard(m.lm_head)
            fully_shard(m)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        models = [DDP(m, device_ids=[ctx.device.index] if ctx.cuda else None) for m in models]
    tol = dict(loss=1e-5, grad=3e-5) if not ctx.cuda else dict(loss=2e-2, grad=5e-2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    calls_before = dict(stats)
    for step in range(3):
        ids, _ = batch(step, ctx, 24, vocab=131)
        outs = []
        for m in models:
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            outs.append(out)
        assert outs[0].logits is None and outs[1].logits is not None, "the patched loss path did not run"
        assert_close(outs[0].loss.detach().float(), outs[1].loss.detach().float(), tol["loss"], f"loss at step {step}")
        named_ref = dict(models[1].named_parameters())
        for n, p in models[0].named_parameters():
            assert_close(p.grad, named_ref[n].grad, tol["grad"], f"grad of {n} at step {step}")
        for o in opts:
            o.step()
            o.zero_grad()
    assert dict(stats) != calls_before, f"fuseforge attention was not called: {dict(stats)}"


def scenario_llama_fsdp(ctx: Ctx) -> None:
    _scenario_llama(ctx, "fsdp")


def scenario_llama_ddp(ctx: Ctx) -> None:
    _scenario_llama(ctx, "ddp")


def scenario_llama_fsdp_head(ctx: Ctx) -> None:
    _scenario_llama(ctx, "fsdp_head")


def scenario_dcp(ctx: Ctx) -> None:
    """DCP save mid-training, load into a new process group, model and optimizer: bitwise resume.
    Then the same checkpoint into torch.optim.AdamW, and a torch.optim.AdamW checkpoint into
    fuseforge's."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from demo_model import FuseforgeGPT
    from fuseforge.optim import AdamW
    c = gpt_config(ctx)
    kw = dict(lr=3e-3, weight_decay=0.1, amsgrad=True)
    ckpt = {"fuseforge": os.path.join(ctx.tmp, "ckpt_ff"), "torch": os.path.join(ctx.tmp, "ckpt_torch")}
    opt_cls = {"fuseforge": AdamW, "torch": torch.optim.AdamW}

    def build(seed: int, impl: str):
        m = FuseforgeGPT(c)
        m.reset_parameters(seed)
        m = shard_gpt(m.to(ctx.device))
        return m, opt_cls[impl](m.parameters(), **kw)

    def train(m, o, steps):
        losses = []
        for step in steps:
            x, y = batch(step, ctx, c.block_size)
            with autocast(ctx):
                loss = m(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            o.zero_grad()
            losses.append(loss.detach().float().clone())
        return torch.stack(losses)

    def snapshot(m, o):
        params = {n: p.full_tensor().clone() for n, p in m.named_parameters()}
        states = {n: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in o.state[p].items()}
                  for n, p in m.named_parameters()}
        return params, states

    def save(m, o, path):
        msd, osd = get_state_dict(m, o)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def load(m, o, path):
        msd, osd = get_state_dict(m, o)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(m, o, model_state_dict=msd, optim_state_dict=osd)

    ctx.init_pg()
    runs = {}
    for impl in ("fuseforge", "torch"):
        m, o = build(0, impl)
        train(m, o, range(3))
        save(m, o, ckpt[impl])
        saved = snapshot(m, o)
        losses = train(m, o, range(3, 6))
        runs[impl] = dict(saved=saved, losses=losses, final=snapshot(m, o)[0])
        del m, o
    ctx.destroy_pg()

    ctx.init_pg()  # a new process group: as a restarted job sees it
    assert dist.get_world_size() == ctx.world
    for impl_saved in ("fuseforge", "torch"):
        for impl_loaded in ("fuseforge", "torch"):
            what = f"{impl_saved} checkpoint into {impl_loaded}"
            m, o = build(1, impl_loaded)  # other weights: everything must come from the checkpoint
            load(m, o, ckpt[impl_saved])
            params, states = snapshot(m, o)
            saved_params, saved_states = runs[impl_saved]["saved"]
            for n in params:
                assert_equal(params[n], saved_params[n], f"{what}: loaded param {n}")
                assert set(states[n]) == set(saved_states[n]), (what, n, set(states[n]), set(saved_states[n]))
                for k, v in states[n].items():
                    assert_equal(v.float(), saved_states[n][k].float(), f"{what}: loaded state {k} of {n}")
            if impl_loaded == "fuseforge":
                from torch.distributed.tensor import DTensor
                p0 = next(iter(m.parameters()))
                assert isinstance(o.state[p0]["exp_avg"], DTensor) and not isinstance(o.state[p0]["step"], DTensor)
            losses = train(m, o, range(3, 6))
            final = snapshot(m, o)[0]
            ref = runs[impl_loaded] if impl_saved == impl_loaded else runs[impl_saved]
            if impl_saved == impl_loaded:  # the same optimizer resumes bit for bit
                assert_equal(losses, ref["losses"], f"{what}: losses after resuming")
                for n in final:
                    assert_equal(final[n], ref["final"][n], f"{what}: param {n} after resuming")
            else:  # the other optimizer continues the run to float32 rounding
                tol = 1e-5 if not ctx.cuda else 1e-3
                assert_close(losses, ref["losses"], tol, f"{what}: losses after resuming")
                for n in final:
                    assert_close(final[n], ref["final"][n], tol, f"{what}: param {n} after resuming")
            del m, o
    ctx.destroy_pg()


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in list(globals().items()) if name.startswith("scenario_")}
OWN_PG = {"dcp"}  # scenarios that start (and restart) their process groups themselves


def worker_main(argv) -> None:
    scenario, rank, world, device, tmp = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]
    torch.set_num_threads(1)
    ctx = Ctx(rank, world, device, tmp)
    if ctx.cuda:
        torch.cuda.set_device(ctx.device)
    t0 = time.perf_counter()
    if scenario in OWN_PG:
        SCENARIOS[scenario](ctx)
    else:
        ctx.init_pg()
        SCENARIOS[scenario](ctx)
        ctx.destroy_pg()
    print(f"rank {rank}: {scenario} passed in {time.perf_counter() - t0:.1f} s", flush=True)
    # Every check ran and the process group is destroyed: leave without interpreter finalization.
    # There, in 2 of 240 local runs and once in CI (2-core machine, gloo), the process aborted after
    # this line ("terminate called without an active exception", or SIGSEGV). A core dump of the
    # same abort in examples/train_distributed.py shows gloo's worker thread, which
    # destroy_process_group leaves running, releasing the last barrier's work (tensors that need
    # the GIL) while the interpreter shuts down: torch's exit path, not anything the test checks.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker_main(sys.argv[2:])
