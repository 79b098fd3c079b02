"""fused AdamW step vs torch.optim.AdamW (fused=True, foreach=True) and torch.compile of its step.

Cases:
  llama1b/fp32         147 float32 tensors shaped like a 1B Llama (953M params; embedding and an
                       untied head of 32000x2048, 16 layers of 4x(2048x2048), 2x(5632x2048),
                       (2048x5632), 2x(2048,), a final norm).
  small5000/fp32       5000 float32 tensors of 4096.
  llama1b/bf16-master  bfloat16 params and grads with float32 master weights. fuseforge keeps the
                       masters inside the optimizer (master_weights=True); the torch impls run the
                       usual recipe: bf16 grads copied into the fp32 masters' grads, the fp32 step,
                       the masters copied back into the bf16 params (foreach copies), all timed.
Pass "step": opt.step() as the user calls it (Python and host work included), grads fixed between
calls. GBps counts 28 bytes a parameter (read param, grad, exp_avg, exp_avg_sq; write param,
exp_avg, exp_avg_sq; the bf16-master case reads/writes the fp32 master and writes the bf16 param:
also 28 bytes for fuseforge).
Extra fields: host_us = median host time of one opt.step() call (perf_counter, no synchronize:
the per-step CPU cost); on small5000, list_op_host_us = host time of torch.ops.fuseforge.adamw_fused_
given the 5000-tensor lists (what the dispatcher costs without the cached handle).
Optimizers are built lazily and one at a time (the previous impl's state is freed first), so the
llama cases fit in 80 GB. "compile" runs only for the llama cases (5000 tensors compile too slowly).
"""
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import harness  # noqa: E402
from harness import Bench  # noqa: E402

import fuseforge  # noqa: E402,F401
from fuseforge.optim import AdamW  # noqa: E402

CASES = ["llama1b/fp32", "small5000/fp32", "llama1b/bf16-master"]
# --device cpu: the demo GPT's parameters (examples/demo.py's CPU preset, 0.8M) and 16 2048x2048
# matrices (67M); torch's CPU impls as peers (fused, foreach, and the for-loop CPU default).
CPU_CASES = ["gptdemo/fp32", "mats16x2048x2048/fp32"]
# ADAMW_BENCH_COMPILE=0 leaves the compile impl out (it costs ~40 s of compilation per case).
WITH_COMPILE = os.environ.get("ADAMW_BENCH_COMPILE", "1") == "1"
KW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def llama1b_shapes():
    shapes = [(32000, 2048)]
    for _ in range(16):
        shapes += [(2048, 2048)] * 4 + [(5632, 2048)] * 2 + [(2048, 5632)] + [(2048,)] * 2
    shapes += [(2048,), (32000, 2048)]
    assert len(shapes) == 147
    return shapes


def gptdemo_shapes():
    from demo_model import GPTConfig, TorchGPT  # examples/
    config = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=2, n_kv_head=1, d_model=128)
    return [tuple(p.shape) for p in TorchGPT(config).parameters()]


def sync():
    if harness.bench_device() == "cuda":
        torch.cuda.synchronize()


def make_params(shapes, dtype):
    dev = harness.bench_device()
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device=dev, generator=g).to(dtype))
        p.grad = (torch.randn(s, device=dev, generator=g) * 1e-2).to(dtype)
        params.append(p)
    return params


class OneAtATime:
    """Builds each impl's optimizer at its first call and frees the previous impl's first."""

    def __init__(self):
        self.live = {}

    def wrap(self, name, build, extra, extra_probe=None):
        def fn():
            step = self.live.get(name)
            if step is None:
                for other in list(self.live):
                    del self.live[other]
                gc.collect()
                if harness.bench_device() == "cuda":
                    torch.cuda.empty_cache()
                step = self.live[name] = build()
                extra["host_us"] = host_us(step)
                if extra_probe:
                    extra_probe(extra)
            return step()
        return fn


def host_us(fn, reps=50):
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        sync()
    return round(statistics.median(times), 1)


def setup(case):
    name, kind = case.split("/")
    shapes = {"llama1b": llama1b_shapes, "gptdemo": gptdemo_shapes, "mats16x2048x2048": lambda: [(2048, 2048)] * 16,
              "small5000": lambda: [(4096,)] * 5000}[name]()
    numel = sum(torch.Size(s).numel() for s in shapes)
    nbytes = 28 * numel
    torch._dynamo.reset()
    pool = OneAtATime()
    benches = []
    if kind == "fp32":
        params = make_params(shapes, torch.float32)

        def ours():
            opt = AdamW(params, **KW)
            return opt.step

        def torch_opt(**flags):
            def build():
                opt = torch.optim.AdamW(params, **KW, **flags)
                return opt.step
            return build

        def compiled():
            opt = torch.optim.AdamW(params, **KW, foreach=True)
            step = torch.compile(opt.step)
            t0 = time.perf_counter()
            step()
            harness.log(f"    compile: first call {time.perf_counter() - t0:.1f} s")
            return step

        impls = [("fuseforge", ours), ("torch_fused", torch_opt(fused=True)),
                 ("torch_foreach", torch_opt(foreach=True))]
        if harness.bench_device() == "cpu":
            impls.append(("torch_forloop", torch_opt(foreach=False, fused=False)))
        if name == "llama1b" and WITH_COMPILE:
            impls.append(("compile", compiled))
    else:  # bf16 params, fp32 master weights
        params = make_params(shapes, torch.bfloat16)

        def ours():
            opt = AdamW(params, **KW, master_weights=True)
            return opt.step

        def torch_recipe(compile_it=False, **flags):
            def build():
                masters = [torch.nn.Parameter(p.detach().float()) for p in params]
                for m in masters:
                    m.grad = torch.empty_like(m)
                opt = torch.optim.AdamW(masters, **KW, **flags)
                grads = [p.grad for p in params]
                mgrads = [m.grad for m in masters]

                def step():
                    torch._foreach_copy_(mgrads, grads)
                    opt.step()
                    torch._foreach_copy_([p.data for p in params], masters)
                if compile_it:
                    compiled = torch.compile(step)
                    t0 = time.perf_counter()
                    compiled()
                    harness.log(f"    compile: first call {time.perf_counter() - t0:.1f} s")
                    return compiled
                return step
            return build

        impls = [("fuseforge", ours), ("torch_fused", torch_recipe(fused=True)),
                 ("torch_foreach", torch_recipe(foreach=True))]
        if WITH_COMPILE:
            impls.append(("compile", torch_recipe(compile_it=True, foreach=True)))
    def list_op_probe(extra):
        ea, eas = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        st = [torch.zeros((), device=params[0].device) for _ in params]

        def list_op():
            torch.ops.fuseforge.adamw_fused_(params, [p.grad for p in params], ea, eas, [], [], st, lr=1e-3,
                                             beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8, maximize=False)
        extra["list_op_host_us"] = host_us(list_op, reps=20)

    for impl, build in impls:
        extra = {}
        probe = list_op_probe if (impl == "fuseforge" and name == "small5000") else None
        benches.append(Bench(case, "step", impl, pool.wrap(impl, build, extra, probe), bytes=nbytes, extra=extra))
    return benches


if __name__ == "__main__":
    harness.run("adamw", CASES, setup, description=__doc__, cpu_cases=CPU_CASES)
