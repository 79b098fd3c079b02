"""fused AdamW step vs torch.optim.AdamW (fused=True, foreach=True), torch.compile of its step, and
8-bit optimizers (bitsandbytes, torchao).

Cases:
  llama1b/fp32         147 float32 tensors shaped like a 1B Llama (953M params; embedding and an
                       untied head of 32000x2048, 16 layers of 4x(2048x2048), 2x(5632x2048),
                       (2048x5632), 2x(2048,), a final norm).
  small5000/fp32       5000 float32 tensors of 4096.
  llama1b/bf16-master  bfloat16 params and grads with float32 master weights. fuseforge keeps the
                       masters inside the optimizer (master_weights=True); the other impls run the
                       usual recipe: bf16 grads copied into the fp32 masters' grads, the fp32 step,
                       the masters copied back into the bf16 params (foreach copies), all timed.
  llama1b/fp32-capped  llama1b/fp32 under torch.cuda.set_per_process_memory_fraction: the caching
                       allocator may hold the params and grads and 1 GiB more (CAPPED_HEADROOM), so
                       neither float32 nor int8 states fit there while paged ones (CUDA managed
                       memory, outside the caching allocator) do. The cap limits torch's allocator,
                       not the GPU: managed pages still live on the GPU while it has room, so this
                       times paged states that stay resident; paging to the host starts only when the
                       GPU itself is full. GPU only.
Impls: fuseforge (float32 states), fuseforge_bf16 / fuseforge_int8 (state_dtype="bfloat16" /
"int8"), fuseforge_paged / fuseforge_int8_paged (paged=True: float32 / int8 states in managed
memory, prefetched every step; GPU only), torch_fused, torch_foreach, compile (llama cases), and
where installed (GPU only; a missing one is left out with the reason printed) bnb_adamw8bit
(bitsandbytes.optim.AdamW8bit), bnb_paged_adamw8bit (bitsandbytes.optim.PagedAdamW8bit) and
torchao_adamw8bit (torchao.optim.AdamW8bit; llama cases only: its per-tensor compiled step took
longer than a run's time limit on small5000). The capped case runs fuseforge, fuseforge_int8 (both
expected to run out of memory), the two paged impls and bnb_paged_adamw8bit.
Pass "step": opt.step() as the user calls it (Python and host work included), grads fixed between
calls. GBps counts the bytes a parameter's update must move: param and grad read, param written
(12 bytes for float32; with bf16 masters, master read and written, bf16 grad read and param
written: also 12), plus both moments read and written: 16 bytes in float32, 8 in bfloat16, 4 in
8-bit codes (block scales not counted): 28, 20 or 16 bytes a parameter.
Extra fields: host_us = median host time of one opt.step() call (perf_counter, no synchronize:
the per-step CPU cost); state_bytes = bytes of the optimizer's state tensors after a step (shared
tensors such as code tables once; the recipes' float32 masters included, as fuseforge's
master_param is); on small5000, list_op_host_us = host time of torch.ops.fuseforge.adamw_fused_
given the 5000-tensor lists (what the dispatcher costs without the cached handle).
Optimizers are built lazily and one at a time (the previous impl's state is freed first), so the
llama cases fit in 80 GB. "compile" runs only for the llama cases (5000 tensors compile too slowly).
Managed memory is not the caching allocator's: the paged impls' (and bnb's paged) states count in
state_bytes but not in peak_extra_mib.
"""
import gc
import importlib
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

CASES = ["llama1b/fp32", "small5000/fp32", "llama1b/bf16-master", "llama1b/fp32-capped"]
# --device cpu: the demo GPT's parameters (examples/demo.py's CPU preset, 0.8M) and 16 2048x2048
# matrices (67M); torch's CPU impls as peers (fused, foreach, and the for-loop CPU default).
CPU_CASES = ["gptdemo/fp32", "mats16x2048x2048/fp32"]
# ADAMW_BENCH_COMPILE=0 leaves the compile impl out (it costs ~40 s of compilation per case).
WITH_COMPILE = os.environ.get("ADAMW_BENCH_COMPILE", "1") == "1"
KW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
CAPPED_HEADROOM = 1 << 30  # bytes the capped case lets the caching allocator hold beyond params and grads


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
    """Builds each impl's optimizer at its first call and frees the previous impl's first. A build
    returns (step, state_tensors): state_tensors() lists what the optimizer keeps (state_bytes)."""

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
                step, state_tensors = build()
                self.live[name] = step
                extra["host_us"] = host_us(step)
                extra["state_bytes"] = tensor_bytes(state_tensors())
                if extra_probe:
                    extra_probe(extra)
            return step()
        return fn


def tensor_bytes(tensors):
    """Bytes of the storages behind `tensors`, each storage once; tensor subclasses (torchao's
    quantized states) by their inner tensors."""
    seen, total = set(), 0

    def visit(t):
        nonlocal total
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            for inner in t.__tensor_flatten__()[0]:
                visit(getattr(t, inner))
            return
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device))
        if key not in seen:
            seen.add(key)
            total += st.nbytes()

    for t in tensors:
        visit(t)
    return total


def optimizer_states(opt):
    return lambda: [v for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]


def peer_optimizers():
    """(impl, constructor) of the 8-bit peers that are installed; each missing one is reported."""
    peers = [("bnb_adamw8bit", "bitsandbytes.optim", "AdamW8bit"),
             ("bnb_paged_adamw8bit", "bitsandbytes.optim", "PagedAdamW8bit"),
             ("torchao_adamw8bit", "torchao.optim", "AdamW8bit")]
    if harness.bench_device() != "cuda":
        harness.log("    8-bit peers (bitsandbytes, torchao): skipped on the CPU (GPU optimizers)")
        return []
    found = []
    for impl, module, cls in peers:
        try:
            found.append((impl, getattr(importlib.import_module(module), cls)))
        except (ImportError, AttributeError) as e:
            harness.log(f"    {impl}: skipped ({module}.{cls} not available: {e})")
    return found


# Bytes a parameter's step moves, by how the moments are stored (see the docstring).
STEP_BYTES = {"float32": 28, "bfloat16": 20, "int8": 16}


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


def cap_memory(capped):
    """The capped case: a per-process fraction that leaves the caching allocator CAPPED_HEADROOM bytes
    beyond what it holds now (the case's params and grads); every other case runs uncapped."""
    if harness.bench_device() != "cuda":
        return
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if not capped:
        torch.cuda.set_per_process_memory_fraction(1.0)
        return
    gc.collect()
    torch.cuda.empty_cache()
    allowed = torch.cuda.memory_reserved() + CAPPED_HEADROOM
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    harness.log(f"    capped: the caching allocator may hold {allowed / 2**30:.2f} GiB of {total / 2**30:.1f}")


def setup(case):
    name, kind = case.split("/")
    capped = kind.endswith("-capped")
    kind = kind.removesuffix("-capped")
    cap_memory(False)
    shapes = {"llama1b": llama1b_shapes, "gptdemo": gptdemo_shapes, "mats16x2048x2048": lambda: [(2048, 2048)] * 16,
              "small5000": lambda: [(4096,)] * 5000}[name]()
    numel = sum(torch.Size(s).numel() for s in shapes)
    torch._dynamo.reset()
    pool = OneAtATime()
    peers = peer_optimizers()
    impls = []  # (impl, build, how the moments are stored)
    if kind == "fp32":
        params = make_params(shapes, torch.float32)
        cap_memory(capped)

        def ours(state_dtype, paged=False):
            def build():
                opt = AdamW(params, **KW, state_dtype=state_dtype, paged=paged)
                return opt.step, optimizer_states(opt)
            return build

        def other(cls, **flags):
            def build():
                opt = cls(params, **KW, **flags)
                return opt.step, optimizer_states(opt)
            return build

        def compiled():
            opt = torch.optim.AdamW(params, **KW, foreach=True)
            step = torch.compile(opt.step)
            t0 = time.perf_counter()
            step()
            harness.log(f"    compile: first call {time.perf_counter() - t0:.1f} s")
            return step, optimizer_states(opt)

        impls = [("fuseforge", ours("float32"), "float32"), ("fuseforge_bf16", ours("bfloat16"), "bfloat16"),
                 ("fuseforge_int8", ours("int8"), "int8"),
                 ("torch_fused", other(torch.optim.AdamW, fused=True), "float32"),
                 ("torch_foreach", other(torch.optim.AdamW, foreach=True), "float32")]
        if harness.bench_device() == "cpu":
            impls.append(("torch_forloop", other(torch.optim.AdamW, foreach=False, fused=False), "float32"))
        else:
            impls += [("fuseforge_paged", ours("float32", paged=True), "float32"),
                      ("fuseforge_int8_paged", ours("int8", paged=True), "int8")]
        if name == "small5000" and any(impl == "torchao_adamw8bit" for impl, _ in peers):
            harness.log("    torchao_adamw8bit: left out of small5000 (its per-tensor compiled step is too slow to build)")
        impls += [(impl, other(cls), "int8") for impl, cls in peers
                  if not (name == "small5000" and impl == "torchao_adamw8bit")]
        if name == "llama1b" and WITH_COMPILE and not capped:
            impls.append(("compile", compiled, "float32"))
        if capped:
            impls = [i for i in impls if i[0] in ("fuseforge", "fuseforge_int8", "fuseforge_paged",
                                                   "fuseforge_int8_paged", "bnb_paged_adamw8bit")]
    else:  # bf16 params, fp32 master weights
        params = make_params(shapes, torch.bfloat16)

        def ours(state_dtype):
            def build():
                opt = AdamW(params, **KW, master_weights=True, state_dtype=state_dtype)
                return opt.step, optimizer_states(opt)
            return build

        def recipe(cls, compile_it=False, **flags):
            def build():
                masters = [torch.nn.Parameter(p.detach().float()) for p in params]
                for m in masters:
                    m.grad = torch.empty_like(m)
                opt = cls(masters, **KW, **flags)
                grads = [p.grad for p in params]
                mgrads = [m.grad for m in masters]

                def step():
                    torch._foreach_copy_(mgrads, grads)
                    opt.step()
                    torch._foreach_copy_([p.data for p in params], masters)
                states = optimizer_states(opt)
                if compile_it:
                    compiled = torch.compile(step)
                    t0 = time.perf_counter()
                    compiled()
                    harness.log(f"    compile: first call {time.perf_counter() - t0:.1f} s")
                    return compiled, lambda: states() + masters
                return step, lambda: states() + masters
            return build

        impls = [("fuseforge", ours("float32"), "float32"), ("fuseforge_bf16", ours("bfloat16"), "bfloat16"),
                 ("fuseforge_int8", ours("int8"), "int8"),
                 ("torch_fused", recipe(torch.optim.AdamW, fused=True), "float32"),
                 ("torch_foreach", recipe(torch.optim.AdamW, foreach=True), "float32")]
        impls += [(impl, recipe(cls), "int8") for impl, cls in peers]
        if WITH_COMPILE:
            impls.append(("compile", recipe(torch.optim.AdamW, compile_it=True, foreach=True), "float32"))

    def list_op_probe(extra):
        ea, eas = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        st = [torch.zeros((), device=params[0].device) for _ in params]

        def list_op():
            torch.ops.fuseforge.adamw_fused_(params, [p.grad for p in params], ea, eas, [], [], st, [], [], lr=1e-3,
                                             beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8, maximize=False)
        extra["list_op_host_us"] = host_us(list_op, reps=20)

    benches = []
    for impl, build, moments in impls:
        extra = {}
        probe = list_op_probe if (impl == "fuseforge" and name == "small5000") else None
        benches.append(Bench(case, "step", impl, pool.wrap(impl, build, extra, probe),
                             bytes=STEP_BYTES[moments] * numel, extra=extra))
    return benches


if __name__ == "__main__":
    harness.run("adamw", CASES, setup, description=__doc__, cpu_cases=CPU_CASES)
