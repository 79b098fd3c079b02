"""The one benchmark harness: every bench_<op>.py describes its cases with `Bench` entries and calls
`run()`, which times them (median of device-event timings after warm-up, the calls queued ahead of
the GPU so that the host's pace does not enter: queued_device_ms; every impl of a case in the same
process), measures peak extra memory, measures the copy and GEMM ceilings in the same run,
and writes benchmarks/results/<op>_<gpu>.json in the format of shared/BENCHMARKS.md, plus a markdown
table (<op>.md) and a plot (<op>.png) generated from that JSON. On CUDA each row also records the SM
clock and the board power nvidia-smi saw while it was timed (`sm_mhz`, `watts`, ClockSampler): under
sustained load the H100 sits at its power cap and clocks each kernel by the power it draws, so a row's
energy a call is about watts x ms. The samples show that; they are too coarse to turn times into
cycles (`benchmarks/profiler.py ncu-cycles` compares impls at one locked clock).

`--device cpu` runs the script's CPU cases on the CPU instead (`cpu_cases`; the setup function asks
`bench_device()`): wall-clock medians (time.perf_counter) after warm-up, peak extra memory as the
growth of the process's peak resident set, results in <op>_cpu.json/.md/.png.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_device = "cuda" if torch.cuda.is_available() else "cpu"
# CPU runs default to at least this many rounds: on a few shared cores one pass over a small case moves
# by 30% between runs (glu 256 x 512 fp32 forward: 0.75x and 1.15x eager in two runs back to back).
CPU_MIN_ROUNDS = 3


def bench_device() -> str:
    """The device this run benchmarks: "cuda" or "cpu" (--device)."""
    return _device


@dataclass
class Bench:
    """One (case, pass, impl) to time. `fn` runs the pass once and returns what it produced (kept
    alive during the memory measurement, so outputs and gradients count). `bytes`/`flops`: the
    minimum the pass must move or do (stated by the bench script) for GB/s and TFLOP/s."""
    case: str
    pass_: str
    impl: str
    fn: Callable[[], Any]
    bytes: Optional[float] = None
    flops: Optional[float] = None
    rel_err: Optional[float] = None
    extra: dict = field(default_factory=dict)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def git_commit() -> str:
    if os.environ.get("FUSEFORGE_COMMIT"):  # set by scripts/gpu_check.sh (the GPU machine's .git may be stale)
        return os.environ["FUSEFORGE_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                                      stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "csrc", "python", "benchmarks/*.py"],
                               cwd=root, stderr=subprocess.DEVNULL).returncode != 0
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FUSEFORGE_COMMIT", "unknown")


def rel_err(got, ref) -> float:
    """||got - ref|| / ||ref||, got taken to float64 (ref: a float64 reference)."""
    return ((got.double() - ref).norm() / ref.norm()).item()


def _as_tuple(got) -> tuple:
    return got if isinstance(got, tuple) else (got,)


def accuracy(fn: Callable, leaves: list, grads_in: tuple, reference: Callable) -> tuple:
    """(the first output's error, the worst of it and every gradient's) of fn(*leaves) against
    reference(*leaves in float64), by rel_err; grads_in: one gradient an output."""
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = _as_tuple(reference(*leaves64))
    got = _as_tuple(fn(*leaves))
    fwd_err = rel_err(got[0], ref[0])
    grads = torch.autograd.grad(got, leaves, grads_in)
    ref_grads = torch.autograd.grad(ref, leaves64, tuple(g.double() for g in grads_in))
    return fwd_err, max([fwd_err] + [rel_err(g, r) for g, r in zip(grads, ref_grads)])


def forward_and_backward_benches(case: str, impls: dict, args: tuple, leaves: list, grads_in: tuple,
                                 fwd_bytes: float, fwdbwd_bytes: float, errors: tuple = (None, None),
                                 checked: str = "fuseforge") -> list:
    """A `fwd` Bench (fn(*args)) and a `fwdbwd` one (fn(*leaves), then the gradients of every leaf from
    grads_in) for each impl name -> fn; `checked`'s rows carry errors (fwd, fwdbwd)."""
    benches = []
    for pass_ in ("fwd", "fwdbwd"):
        for name, fn in impls.items():
            if pass_ == "fwd":
                def run(fn=fn):
                    return fn(*args)
            else:
                def run(fn=fn):
                    return torch.autograd.grad(_as_tuple(fn(*leaves)), leaves, grads_in)
            benches.append(Bench(case, pass_, name, run, bytes=fwd_bytes if pass_ == "fwd" else fwdbwd_bytes,
                                 rel_err=errors[pass_ == "fwdbwd"] if name == checked else None))
    return benches


def median(xs: Iterable[float]) -> float:
    """The middle value (the upper one of an even count), as every timing here reports."""
    xs = sorted(xs)
    return xs[len(xs) // 2]


class StepTimer:
    """Times each `with timer:` block, for work that runs once per sample (a training step) rather than
    under do_bench: device events on CUDA, read after one synchronize in ms(); wall clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.pairs: list = []

    def __enter__(self):
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self.pairs.append((self._start, end))

    def ms(self) -> list:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self.pairs]
        return [(e - s) * 1000 for s, e in self.pairs]


WARMUP_MS, REP_MS = 50, 300  # time_ms's default warm-up and timed span


def time_ms(fn: Callable[[], Any], warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS) -> float:
    """Median milliseconds of fn over repeated runs: device events of calls queued ahead on CUDA
    (queued_device_ms; HostSynchronizes where fn waits on the GPU), wall clock on the CPU."""
    if _device == "cuda":
        return queued_device_ms(fn, warmup_ms, rep_ms)
    times = []
    fn()
    deadline = time.perf_counter() + rep_ms / 1000
    while time.perf_counter() < deadline or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return median(times)


def _proc_status_mib(key: str) -> Optional[float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _cpu_peak_extra_mib(fn: Callable[[], Any]) -> Optional[float]:
    """How far the peak resident set rose above the resident set before one run of fn (Linux: the
    peak is reset to the current size through /proc/self/clear_refs)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _proc_status_mib("VmRSS:")
    out = fn()
    peak = _proc_status_mib("VmHWM:")
    del out
    return None if before is None or peak is None else max(0.0, peak - before)


def peak_extra_mib(fn: Callable[[], Any]) -> Optional[float]:
    """torch.cuda.max_memory_allocated() during one run of fn minus what was allocated before it
    (on the CPU: the growth of the peak resident set)."""
    if _device == "cpu":
        return _cpu_peak_extra_mib(fn)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**20


def measure_ceilings() -> dict:
    if _device == "cpu":
        n = 1 << 28  # 256 MiB copy: counts bytes read + written
        src = torch.empty(n, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        copy_ms = time_ms(lambda: dst.copy_(src))
        del src, dst
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        gemm_ms = time_ms(lambda: a @ b)
        return {"copy_GBps": round(2 * n / copy_ms / 1e6, 1), "fp32_gemm_TFLOPs": round(2 * 2048**3 / gemm_ms / 1e9, 3)}
    n = 1 << 30  # 1 GiB copy: counts bytes read + written
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_ms = time_ms(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_GBps": round(2 * n / copy_ms / 1e6, 1), "bf16_gemm_TFLOPs": round(2 * 8192**3 / gemm_ms / 1e9, 1)}


def env_info() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "commit": git_commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if _device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    else:
        info["gpu"] = "cpu"
        info["cpu"] = f"{_cpu_model()}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _round(v: Optional[float], digits: int = 4) -> Optional[float]:
    if v is None:
        return None
    return float(f"{v:.{digits}g}")


class ClockSampler:
    """The SM clock, the board power and the active clock-event reasons, sampled by `nvidia-smi` every
    `interval_ms` in the background between start() and stop(); clock(spans) then summarizes the
    samples inside the (start, end) time.time() spans a bench was timed in. Where nvidia-smi cannot
    run, nothing is sampled and clock() returns None."""
    SW_POWER_CAP = 0x4  # nvidia-smi's clocks_event_reasons bit for the software power cap

    def __init__(self, interval_ms: int = 25):
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, float, int, Optional[float]]] = []  # (time.time(), MHz, reasons, W)
        self._proc = None
        self._path = ""

    @staticmethod
    def power_field() -> str:
        """power.draw.instant where the driver has it (newer drivers' power.draw is a 1 s average,
        longer than a row's timing), else power.draw."""
        try:
            probe = subprocess.run(["nvidia-smi", "--query-gpu=power.draw.instant", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=20)
            return "power.draw.instant" if probe.returncode == 0 else "power.draw"
        except (OSError, subprocess.SubprocessError):
            return "power.draw"

    def start(self) -> "ClockSampler":
        fd, self._path = tempfile.mkstemp(suffix=".csv")
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu=timestamp,clocks.sm,clocks_event_reasons.active,{self.power_field()}",
                 "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=fd, stderr=subprocess.DEVNULL)
        except OSError:
            self._proc = None
        os.close(fd)
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None
        if self._path:
            with open(self._path) as f:
                self.samples = self.parse(f.read())
            os.unlink(self._path)
            self._path = ""

    @staticmethod
    def parse(text: str) -> list[tuple[float, float, int, Optional[float]]]:
        """nvidia-smi's lines ("2026/11/26 14:15:20.123, 1755, 0x0000000000000004, 695.12"; local time)
        as (time.time(), MHz, reason bits, watts or None where it printed [N/A]); lines that do not
        parse (its last, cut short) are skipped."""
        out = []
        for line in text.splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                t = _dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                sample = (t, float(parts[1]), int(parts[2], 16))
            except (IndexError, ValueError):
                continue
            try:
                watts: Optional[float] = float(parts[3])
            except (IndexError, ValueError):
                watts = None
            out.append(sample + (watts,))
        return out

    def clock(self, spans: Iterable[tuple[float, float]]) -> Optional[dict]:
        """{"sm_mhz": mean clock, "power_capped": share of samples at the software power cap, "watts":
        mean board power where sampled} over the samples inside the spans; None without samples there."""
        spans = list(spans)
        inside = [s for s in self.samples if any(a <= s[0] <= b for a, b in spans)]
        if not inside:
            return None
        out = {"sm_mhz": round(sum(s[1] for s in inside) / len(inside)),
               "power_capped": round(sum(1 for s in inside if s[2] & self.SW_POWER_CAP) / len(inside), 2)}
        watts = [s[3] for s in inside if s[3] is not None]
        if watts:
            out["watts"] = round(sum(watts) / len(watts))
        return out


class EnergyCounter:
    """The GPU's energy counter (NVML's nvmlDeviceGetTotalEnergyConsumption: millijoules since the
    driver loaded), read through ctypes from the driver's libnvidia-ml, so no pynvml is needed. joules()
    is None where NVML or the counter is missing (CPU machines, old GPUs). The counter advances in
    steps of some milliseconds: read it over spans of a second or more."""

    def __init__(self, device: Optional[int] = None):
        self._nvml = self._handle = None
        try:
            import ctypes
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() != 0:
                return
            index = torch.cuda.current_device() if device is None else device
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [x.strip() for x in visible.split(",") if x.strip()]
            if ids and all(x.isdigit() for x in ids):  # NVML counts every GPU; CUDA the visible ones
                index = int(ids[index])
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
                return
            self._nvml, self._handle, self._ctypes = nvml, handle, ctypes
            if self.joules() is None:
                self._nvml = None
        except (OSError, AttributeError, RuntimeError):
            self._nvml = None

    def joules(self) -> Optional[float]:
        if self._nvml is None:
            return None
        mj = self._ctypes.c_ulonglong()
        if self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle, self._ctypes.byref(mj)) != 0:
            return None
        return mj.value / 1000.0


# Device timing. triton.testing.do_bench brackets each call with events as the host issues it, so
# where the host takes longer to issue a call than the GPU to run it (a small op's fwd+bwd under
# autograd: 0.1-0.4 ms of Python and launches a call on a slow host, against 0.04-0.3 ms of kernels)
# its events time the host's pace, and which impl wins depends on the host. Here the GPU spins
# (torch.cuda._sleep) while the host queues a batch of calls, each after the same 256 MiB L2 flush as
# do_bench's; a batch counts only if the spin was still running when the host had queued all of it,
# so every call's events bracket its own device work, back to back with the flush before it.
class HostSynchronizes(RuntimeError):
    """fn waits on the GPU inside a call (a synchronize, an .item()): no call can be queued ahead."""


def _do_bench_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


QUEUE_BATCH_CALLS = 16  # calls queued behind one spin (fewer where the launch queue cannot hold them)
_spin_cycles_a_ms: Optional[float] = None


def _spin_rate() -> float:
    """torch.cuda._sleep cycles a millisecond on this GPU, measured once."""
    global _spin_cycles_a_ms
    if _spin_cycles_a_ms is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # first launch outside the measurement
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _spin_cycles_a_ms = 20_000_000 / start.elapsed_time(end)
    return _spin_cycles_a_ms


def _l2_flush_buffer() -> torch.Tensor:
    """The 256 MiB that each timed call's flush zeroes (do_bench's size): more than L2 holds."""
    return torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")


def _queued_calls(fn: Callable[[], Any], flush: torch.Tensor, calls: int, spin_ms: float) -> Optional[list]:
    """Device ms of each of `calls` calls of fn (each after an L2 flush) queued behind a spin of spin_ms;
    None where the spin ended before the host had queued them all (a call may then have waited on the
    host, or the launch queue was full)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    torch.cuda._sleep(int(spin_ms * _spin_rate()))
    spun = torch.cuda.Event()
    spun.record()
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    queued_ahead = not spun.query()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)] if queued_ahead else None


def queued_device_ms(fn: Callable[[], Any], warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS) -> float:
    """Median device ms of fn, its calls queued ahead of the GPU (see above): about rep_ms of calls
    after warmup_ms of them, counted at the slower of the device's and the host's pace a call."""
    fn()
    torch.cuda.synchronize()
    flush = _l2_flush_buffer()
    t0 = time.perf_counter()
    for _ in range(5):
        flush.zero_()
        fn()
    host_ms = (time.perf_counter() - t0) * 1000 / 5  # a call's, with its flush
    torch.cuda.synchronize()
    # The spin's length over the host's measured time to queue the batch, and the most calls a
    # batch; both kept for the later batches once a spin ran out.
    margin, batch = 1.5, QUEUE_BATCH_CALLS

    def queued(calls: int) -> list:
        nonlocal margin, batch
        while True:
            calls = min(calls, batch)
            got = _queued_calls(fn, flush, calls, margin * calls * host_ms + 0.05)
            if got is not None:
                return got
            # The spin ran out first: a launch queue too short for the batch, or a slower host.
            batch, margin = max(1, calls // 2), margin * 2
            if margin > 100:
                raise HostSynchronizes("queued_device_ms: the host never got ahead of the GPU (does fn synchronize?)")

    pace_ms = max(median(queued(5)), host_ms)
    for _ in range(max(1, int(warmup_ms / pace_ms))):
        fn()
    n_repeat, times = max(10, int(rep_ms / pace_ms)), []
    while len(times) < n_repeat:
        times += queued(n_repeat - len(times))
    return median(times)


# id(bench) -> the (start, end) time.time() spans it was timed in, for the clock it ran at (run()).
_timing_spans: dict[int, list[tuple[float, float]]] = {}


def _settle(fn: Callable[[], Any], settle_ms: float) -> None:
    """Runs fn back to back for settle_ms (GPU only), so that what is timed next runs at fn's own
    steady clock and power rather than at the state the previous bench left: the H100's power limiter
    acts over about a second, so after a cooler impl the next one's first ~100 ms run at a higher clock."""
    if settle_ms <= 0 or _device != "cuda":
        return
    _back_to_back(fn, settle_ms)


def _back_to_back(fn: Callable[[], Any], ms: float) -> int:
    """Calls fn back to back for ms of wall time (GPU), then synchronizes; returns the number of calls."""
    deadline = time.perf_counter() + ms / 1000
    in_flight: list = []
    calls = 0
    while time.perf_counter() < deadline:
        fn()
        calls += 1
        in_flight.append(torch.cuda.Event())
        in_flight[-1].record()
        if len(in_flight) > 2:  # two calls queued: no gap on the GPU, and the host's clock is the GPU's
            in_flight.pop(0).synchronize()
    torch.cuda.synchronize()
    return calls


def energy_per_call(fn: Callable[[], Any], counter: EnergyCounter, ms: float = 2000,
                    settle_ms: float = 300) -> Optional[dict]:
    """{"mj": millijoules a call, "ms": wall ms a call, "watts": mean board power} of fn run back to
    back for ms after settle_ms of itself (GPU), from the energy counter; None without the counter."""
    _settle(fn, settle_ms)
    e0, t0 = counter.joules(), time.perf_counter()
    calls = _back_to_back(fn, ms)
    e1, t1 = counter.joules(), time.perf_counter()
    if e0 is None or e1 is None:
        return None
    return {"mj": round(1000 * (e1 - e0) / calls, 3), "ms": round(1000 * (t1 - t0) / calls, 4),
            "watts": round((e1 - e0) / (t1 - t0), 1)}


def _time_recorded(bench: Bench, settle_ms: float = 0, warmup_ms: float = WARMUP_MS,
                   rep_ms: float = REP_MS) -> float:
    """time_ms(bench.fn, ...) after _settle(bench.fn, settle_ms), the timed part's wall-clock span
    recorded in _timing_spans. A fn whose calls cannot be queued ahead (HostSynchronizes) is timed as
    issued, with do_bench, and its row says so (bench.extra's "timing")."""
    _settle(bench.fn, settle_ms)
    t0 = time.time()
    try:
        ms = time_ms(bench.fn, warmup_ms=warmup_ms, rep_ms=rep_ms)
    except HostSynchronizes:
        log(f"    {bench.impl}: fn synchronizes with the host: timed with triton's do_bench")
        bench.extra["timing"] = "do_bench"
        ms = _do_bench_ms(bench.fn, warmup_ms, rep_ms)
    _timing_spans.setdefault(id(bench), []).append((t0, time.time()))
    return ms


def failure_text(e: BaseException) -> str:
    """A row's error for an impl that raised: "out of memory", or the exception's type and start."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of memory"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def time_interleaved(benches: list[Bench], rounds: int, rep_ms: float = 100,
                     settle_ms: float = 0) -> dict[int, list[float] | str]:
    """Each bench's ms in each of `rounds` rounds that time every bench in turn (time_ms with rep_ms
    each, after settle_ms of itself: _settle): slow drifts of the GPU's clocks and temperature fall on
    every impl alike instead of on whichever is timed first. Each round takes the benches in its own
    order (a shuffle seeded by the round's index: the same in every run), so no bench is always timed
    first after the case's setup, or always right after the same bench (H200: Liger's rope timed
    right after torch.compile's ran 0.0421 ms, after ours 0.0460-0.0463). For a bench that raised
    (out of memory, a peer's compiler failing), its error text instead: the other impls still run."""
    times: dict[int, list[float]] = {id(b): [] for b in benches}
    failed: dict[int, str] = {}
    for r in range(rounds):
        order = list(benches)
        random.Random(r).shuffle(order)
        for b in order:
            if id(b) in failed:
                continue
            try:
                times[id(b)].append(_time_recorded(b, settle_ms=settle_ms, rep_ms=rep_ms))
            except Exception as e:  # noqa: BLE001  (recorded in the row; the run goes on)
                failed[id(b)] = failure_text(e)
                log(f"    {b.impl}: {failed[id(b)]}")
                gc.collect()
                torch.cuda.empty_cache()
    return {k: failed.get(k, v) for k, v in times.items()}


def measure(bench: Bench, with_memory: bool = True, ms: Optional[float] = None, settle_ms: float = 0) -> dict:
    """One result row: ms timed here (after settle_ms of bench.fn) unless given (time_interleaved), then
    the peak memory."""
    row = {"case": bench.case, "pass": bench.pass_, "impl": bench.impl}
    try:
        if ms is None:
            ms = _time_recorded(bench, settle_ms=settle_ms)
        row["ms"] = _round(ms)
        if bench.bytes:
            row["GBps"] = _round(bench.bytes / ms / 1e6)
        if bench.flops:
            row["TFLOPs"] = _round(bench.flops / ms / 1e9)
        if with_memory:
            mem = peak_extra_mib(bench.fn)
            if mem is not None:
                row["peak_extra_mib"] = round(mem, 1)
    except Exception as e:  # noqa: BLE001  (recorded in the row; the run goes on)
        row["error"] = failure_text(e)
        gc.collect()
        torch.cuda.empty_cache()
    if bench.rel_err is not None:
        row["rel_err"] = _round(bench.rel_err, 3)
    row.update(bench.extra)
    return row


def run(op: str, cases: Iterable[str], setup: Callable[[str], list[Bench]], argv: Optional[list] = None,
        description: str = "", rounds: int = 1, cpu_cases: Optional[Iterable[str]] = None,
        settle_ms: float = 0) -> dict:
    """Times every Bench that setup(case) returns, case by case, and writes the results. rounds > 1:
    each pass's impls are timed round-robin (time_interleaved), for ops whose impls run long enough
    to heat the GPU between one impl's timing and the next's. settle_ms > 0 (GPU): each timing
    follows that long of the same bench (_settle), for impls that run at the power cap. cpu_cases:
    the cases of --device cpu (results in <op>_cpu.json)."""
    global _device
    parser = argparse.ArgumentParser(description=description or f"benchmark {op}")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=_device,
                        help=f"what to benchmark (default here: {_device}); cpu runs the CPU cases")
    parser.add_argument("--cases", default="", help="comma-separated substrings: run only matching cases")
    parser.add_argument("--out", default=RESULTS_DIR, help="folder for <op>_<gpu>.json/.md/.png")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--name", default="",
                        help="the result's name in place of the op's (its files <name>_<gpu>.*), for a run of "
                             "a subset of cases kept beside the op's full table")
    parser.add_argument("--impls", default="", help="comma-separated impl names: time only these")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"round-robin rounds over each pass's impls (default {rounds}, at least "
                             f"{CPU_MIN_ROUNDS} on the CPU; 1: one impl after another)")
    parser.add_argument("--settle-ms", type=float, default=settle_ms,
                        help=f"GPU: run each bench this long before timing it (default {settle_ms:g}; 0: none)")
    parser.add_argument("--energy-ms", type=float, default=0,
                        help="GPU: also read the energy a call from NVML's counter over this many ms of each "
                             "bench run back to back, after 300 ms of itself (energy_per_call; 0: not measured)")
    args = parser.parse_args(argv)
    _device = args.device
    if _device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (use --device cpu)")
    if args.rounds is not None:
        rounds = args.rounds
    elif _device == "cpu":
        rounds = max(rounds, CPU_MIN_ROUNDS)
    rounds = max(1, rounds)
    impls = [i for i in args.impls.split(",") if i]
    if _device == "cpu":
        if cpu_cases is None:
            parser.error(f"--device cpu: bench_{op}.py has no CPU cases")
        cases, op = cpu_cases, op + "_cpu"
    cases = list(cases)
    if args.cases:
        keys = [k for k in args.cases.split(",") if k]
        cases = [c for c in cases if any(k in c for k in keys)]
    if args.name:
        op = args.name
    result = {"op": op, **env_info(), "ceilings": measure_ceilings(), "rounds": rounds, "rows": []}
    if _device == "cuda":
        result["timing"] = "queued"  # queued_device_ms; results before it timed with triton's do_bench
    if _device == "cuda" and args.settle_ms > 0:
        result["settle_ms"] = args.settle_ms
    log(f"{op}: {len(cases)} cases on {result.get('cpu', result['gpu'])} (torch {result['torch']}, commit {result['commit']}), "
        f"ceilings {result['ceilings']}")
    sampler = ClockSampler().start() if _device == "cuda" else None
    counter = EnergyCounter() if _device == "cuda" and args.energy_ms > 0 else None
    if counter is not None and counter.joules() is None:
        log("--energy-ms: no NVML energy counter on this GPU; energy not measured")
        counter = None
    if counter is not None:
        result["energy_ms"] = args.energy_ms
    row_spans: list[tuple[dict, list]] = []  # each row with its bench's timing spans
    for i, case in enumerate(cases):
        log(f"[{i + 1}/{len(cases)}] {case}")
        benches = [b for b in setup(case) if not impls or b.impl in impls]
        timed: dict[int, Optional[float]] = {}
        if rounds > 1:  # every pass's impls, round-robin
            for pass_ in dict.fromkeys(b.pass_ for b in benches):
                timed.update(time_interleaved([b for b in benches if b.pass_ == pass_], rounds,
                                              settle_ms=args.settle_ms))
        for b in benches:
            if rounds > 1 and isinstance(timed[id(b)], str):
                row = {"case": b.case, "pass": b.pass_, "impl": b.impl, "error": timed[id(b)]}
            else:
                rounds_ms = timed.get(id(b))
                row = measure(b, with_memory=not args.no_memory, ms=median(rounds_ms) if rounds_ms else None,
                              settle_ms=args.settle_ms)
                if rounds_ms:  # each round's median: a row that moved between rounds shows it
                    row["ms_rounds"] = [_round(ms) for ms in rounds_ms]
                if counter is not None and "error" not in row:
                    energy = energy_per_call(b.fn, counter, ms=args.energy_ms)
                    if energy is not None:  # at the impl's own steady power, beside its interleaved ms
                        row.update({"mj": energy["mj"], "energy_call_ms": energy["ms"],
                                    "energy_watts": energy["watts"]})
            result["rows"].append(row)
            row_spans.append((row, _timing_spans.pop(id(b), [])))
            log("    " + "  ".join(f"{k}={v}" for k, v in row.items() if k != "case"))
        del benches
        gc.collect()
        if _device == "cuda":
            torch.cuda.empty_cache()
        if i + 1 < len(cases):  # a run stopped by a time limit keeps the cases it finished
            write_json({**result, "incomplete": f"{i + 1} of {len(cases)} cases"}, args.out)
    if sampler is not None:
        sampler.stop()
        for row, spans in row_spans:
            row.update(sampler.clock(spans) or {})
    write(result, args.out)
    return result


def write_json(result: dict, out_dir: str = RESULTS_DIR) -> str:
    """<out_dir>/<op>_<gpu>.json; returns the path without the extension."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, result_name(result))
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    return base


def write(result: dict, out_dir: str = RESULTS_DIR) -> None:
    base = write_json(result, out_dir)
    with open(base + ".md", "w") as f:
        f.write(markdown_table(result))
    try:
        plot(result, base + ".png")
    except ImportError:
        log("matplotlib missing: no plot")
    log(f"wrote {base}.json/.md/.png")


def markdown_table(result: dict) -> str:
    """One row per (case, pass): each impl's ms, and fuseforge's speed-up over it (x > 1: faster)."""
    rows = result["rows"]
    impls = []
    for r in rows:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    keys = []
    for r in rows:
        if (r["case"], r["pass"]) not in keys:
            keys.append((r["case"], r["pass"]))
    by = {(r["case"], r["pass"], r["impl"]): r for r in rows}
    others = [i for i in impls if i != "fuseforge"]
    head = ["case", "pass"] + [f"{i} ms" for i in impls] + [f"vs {i}" for i in others]
    has_mem = any("peak_extra_mib" in r for r in rows)
    if has_mem:
        head += [f"{i} MiB" for i in impls]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, pass_ in keys:
        cells = [case, pass_]
        ff = by.get((case, pass_, "fuseforge"), {}).get("ms")
        for i in impls:
            r = by.get((case, pass_, i))
            cells.append("-" if r is None else (r.get("error") or f"{r['ms']:.4g}"))
        for i in others:
            r = by.get((case, pass_, i))
            cells.append(f"{r['ms'] / ff:.2f}x" if (r and ff and r.get("ms")) else "-")
        if has_mem:
            for i in impls:
                r = by.get((case, pass_, i))
                cells.append(f"{r['peak_extra_mib']:.0f}" if r and "peak_extra_mib" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    def impl_table(title: str, key: str, cell: Callable[[dict], str]) -> list[str]:
        """A table under `title` of one cell an impl for each (case, pass), where some row has `key`;
        "-" where that impl's row has none."""
        if not any(key in r for r in rows):
            return []
        out = ["", title, "", "| case | pass | " + " | ".join(impls) + " |", "|" + "---|" * (len(impls) + 2)]
        for case, pass_ in keys:
            cells = [case, pass_]
            for i in impls:
                r = by.get((case, pass_, i), {})
                cells.append("-" if key not in r else cell(r))
            out.append("| " + " | ".join(cells) + " |")
        return out

    lines += impl_table("SM clock and board power while timed (MHz / W, means of nvidia-smi samples; * = the "
                        "software power cap active in most of them):", "sm_mhz",
                        lambda r: f"{r['sm_mhz']}{'*' if r.get('power_capped', 0) >= 0.5 else ''}"
                                  + (f" / {r['watts']}" if "watts" in r else ""))
    lines += impl_table(f"Energy a call (mJ; ms a call and mean board power W), from NVML's counter over "
                        f"{result.get('energy_ms', 0):g} ms of each impl back to back after 300 ms of itself "
                        "(--energy-ms):", "mj",
                        lambda r: f"{r['mj']:.4g} ({r['energy_call_ms']:.4g} ms, {r['energy_watts']:.0f} W)")
    where = result["cpu"] if result.get("gpu") == "cpu" and "cpu" in result else result["gpu"]
    # "-dirty": the tree differed from that commit (a device's .git can be older than its tree)
    sha = result["commit"].removesuffix("-dirty")
    commit = sha[:12] + ("-dirty" if sha != result["commit"] else "")
    meta = (f"\n{where}, torch {result['torch']}, CUDA {result['cuda']}, commit `{commit}`, "
            f"{result['date']}; ceilings {result.get('ceilings', {})}. `vs X` = X's time / fuseforge's.")
    if result.get("timing") == "queued":
        meta += " Device time of calls queued ahead of the GPU (the host's pace excluded)."
        as_issued = [f"{r['impl']} ({r['case']}, {r['pass']})" for r in result["rows"] if r.get("timing") == "do_bench"]
        if as_issued:
            meta += (" Timed as issued (do_bench), their calls synchronizing with the host: "
                     + ", ".join(as_issued) + ".")
    if result.get("settle_ms"):
        meta += (f" Each impl timed after {result['settle_ms']:g} ms of itself (--settle-ms), "
                 f"{result.get('rounds', 1)} rounds.")
    return "\n".join(lines) + "\n" + meta + "\n"


def gpu_tag(result: dict) -> str:
    """The short name of the device a result ran on, for file names and tables: "h100", "h200", "a100",
    ... from the GPU's name ("cpu" for CPU runs)."""
    gpu = str(result.get("gpu", "unknown"))
    if gpu == "cpu":
        return "cpu"
    for word in gpu.replace("-", " ").split():
        if len(word) >= 3 and word[0].isalpha() and word[1:].isdigit():
            return word.lower()
    return "".join(c for c in gpu.lower() if c.isalnum())[:16] or "gpu"


def result_name(result: dict) -> str:
    """<op>_<gpu> (shared/BENCHMARKS.md's file name, without the extension): CPU runs' op already ends
    in _cpu."""
    op, tag = result["op"], gpu_tag(result)
    return op if op.endswith("_" + tag) else f"{op}_{tag}"


def load_result(path: str) -> dict:
    """One stored result (benchmarks/results/<op>_<gpu>.json)."""
    with open(path) as f:
        return json.load(f)


def plot(result: dict, path: str) -> None:
    """Speed-up of every impl over a baseline per case, one panel per pass. The baseline is eager
    where the case has one, else the first peer the benchmark lists for it (e.g. sdpa_flash, torch_fused)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("ms")]
    passes = list(dict.fromkeys(r["pass"] for r in rows))
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(8, 0.6 * len(rows) / max(1, len(passes))), 3.6 * len(passes)),
                             squeeze=False)
    for ax, pass_ in zip(axes[:, 0], passes):
        prow = [r for r in rows if r["pass"] == pass_]
        cases = list(dict.fromkeys(r["case"] for r in prow))
        impls = list(dict.fromkeys(r["impl"] for r in prow))
        width = 0.8 / max(1, len(impls))
        baselines = set()
        for k, impl in enumerate(impls):
            xs, ys = [], []
            for ci, case in enumerate(cases):
                by_impl = {r["impl"]: r["ms"] for r in prow if r["case"] == case}
                peers = [i for i in by_impl if i != "fuseforge"] or list(by_impl)
                baseline = "eager" if "eager" in by_impl else peers[0]  # per case: cases may differ in impls
                baselines.add(baseline)
                if impl in by_impl:
                    xs.append(ci + k * width)
                    ys.append(by_impl[baseline] / by_impl[impl])
            ax.bar(xs, ys, width, label=impl)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(f"speed-up over {' / '.join(sorted(baselines))}", fontsize=9 if len(baselines) == 1 else 7)
        where = result["cpu"] if result.get("gpu") == "cpu" and "cpu" in result else result["gpu"]
        ax.set_title(f"{result['op']} / {pass_}  ({where}, torch {result['torch']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    # Regenerate the tables and plots of existing JSON files: python benchmarks/harness.py results/*.json
    for p in sys.argv[1:]:
        with open(p) as f:
            write(json.load(f), os.path.dirname(os.path.abspath(p)))
