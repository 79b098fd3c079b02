"""benchmarks/harness.py: the pieces that run without a GPU (the nvidia-smi sample parser, the clock /
power summary of a row, which only GPU runs produce) and, on a GPU, the queued device timing."""
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# By path and under its own name: `harness` is tests/python/harness.py in this process.
_spec = importlib.util.spec_from_file_location("bench_harness", os.path.join(ROOT, "benchmarks", "harness.py"))
harness = sys.modules["bench_harness"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(harness)


def _profiler(monkeypatch):
    """benchmarks/profiler.py by path, on the benchmarks' harness rather than the tests'; monkeypatch
    undoes the sys.path and sys.modules changes."""
    monkeypatch.setitem(sys.modules, "harness", harness)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "python"))
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_profiler", os.path.join(ROOT, "benchmarks", "profiler.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_clock_sampler_parses_clock_reasons_and_power():
    t0 = 1_800_000_000.0
    text = "\n".join([
        f"{_stamp(t0)}, 1755, 0x0000000000000004, 699.50",
        f"{_stamp(t0 + 0.025)}, 1845, 0x0000000000000000, 612.25",
        f"{_stamp(t0 + 0.050)}, 1980, 0x0000000000000000, [N/A]",
        f"{_stamp(t0 + 0.075)}, 19",  # cut short when the sampler was stopped
    ])
    samples = harness.ClockSampler.parse(text)
    assert [s[1:] for s in samples] == [(1755.0, 4, 699.5), (1845.0, 0, 612.25), (1980.0, 0, None)]
    assert abs(samples[1][0] - samples[0][0] - 0.025) < 1e-3

    sampler = harness.ClockSampler()
    sampler.samples = samples
    # The first two samples: one at the cap; power averaged over the samples that have it.
    assert sampler.clock([(t0 - 0.001, t0 + 0.030)]) == {"sm_mhz": 1800, "power_capped": 0.5, "watts": 656}
    # A span with only the [N/A] sample: the clock, no power.
    assert sampler.clock([(t0 + 0.045, t0 + 0.055)]) == {"sm_mhz": 1980, "power_capped": 0.0}
    assert sampler.clock([(t0 + 1, t0 + 2)]) is None


def test_markdown_table_shows_clock_and_power():
    rows = [{"case": "c", "pass": "fwd", "impl": "fuseforge", "ms": 1.0, "sm_mhz": 1700, "power_capped": 0.9,
             "watts": 698},
            {"case": "c", "pass": "fwd", "impl": "peer", "ms": 1.5, "sm_mhz": 1900, "power_capped": 0.2}]
    result = {"rows": rows, "gpu": "GPU", "torch": "t", "cuda": "c", "commit": "abc", "date": "d"}
    table = harness.markdown_table(result)
    assert "| c | fwd | 1 | 1.5 | 1.50x |" in table
    assert "| c | fwd | 1700* / 698 | 1900 |" in table


def test_ncu_ratio_table(monkeypatch):
    """`profiler.py ncu-cycles`'s table: peers' sums over fuseforge's, the clock from cycles / ms."""
    ncu = _profiler(monkeypatch)
    rows = [{"case": "D128/S1024/full", "pass": "fwd", "impl": "fuseforge", "ms": 2.0, "mcycles": 2.9},
            {"case": "D128/S1024/full", "pass": "fwd", "impl": "sdpa_cudnn", "ms": 3.0, "mcycles": 4.35}]
    result = {"rows": rows, "gpu": "GPU", "torch": "t", "cuda": "c", "commit": "0123456789abcdef", "date": "d1",
              "dates": ["d0", "d1"]}
    table = ncu.ratio_table(result)
    assert "| D128/S1024/full | fwd | 2 | 3 | 1.500x |" in table
    assert "(1.45 GHz)" in table and "`0123456789ab`" in table and "d0 and d1 (one run of the script each)" in table


def test_round_robin_rows_keep_each_round(tmp_path):
    """With rounds > 1 a row's ms is the median of its rounds, and each round's ms is kept beside it
    (a row that moved between rounds shows it)."""
    calls = {"a": 0, "b": 0}

    def bench_fn(name):
        def fn():
            calls[name] += 1
            sum(range(2000))
        return fn

    def setup(case):
        return [harness.Bench(case, "fwd", name, bench_fn(name)) for name in ("a", "b")]

    result = harness.run("roundtest", ["c"], setup, argv=["--device", "cpu", "--no-memory", "--rounds", "3",
                                                        "--out", str(tmp_path)], cpu_cases=["c"])
    rows = result["rows"]
    assert [r["impl"] for r in rows] == ["a", "b"] and calls["a"] > 3 and calls["b"] > 3
    for r in rows:
        assert len(r["ms_rounds"]) == 3 and all(ms > 0 for ms in r["ms_rounds"])
        assert r["ms"] == harness._round(harness.median(r["ms_rounds"]))
    assert (tmp_path / "roundtest_cpu.json").exists()


def test_rounds_vary_the_order(monkeypatch):
    """Each round times every bench once, in an order of its own that is the same in every run: no
    bench is always timed first, or always right after the same bench."""
    def timed_orders():
        order = []
        monkeypatch.setattr(harness, "_time_recorded", lambda b, **kw: (order.append(b.impl), len(order))[1])
        benches = [harness.Bench("c", "fwd", name, lambda: None) for name in ("a", "b", "c", "d")]
        times = harness.time_interleaved(benches, rounds=4)
        for b in benches:  # each bench's timings in round order, one a round
            assert len(times[id(b)]) == 4 and times[id(b)] == sorted(times[id(b)])
        return [order[i:i + 4] for i in range(0, 16, 4)]

    rounds = timed_orders()
    assert all(sorted(r) == ["a", "b", "c", "d"] for r in rounds)
    assert len({r[0] for r in rounds}) > 1
    for name in "abcd":
        before = {r[r.index(name) - 1] if r.index(name) else None for r in rounds}
        assert len(before) > 1, name
    assert timed_orders() == rounds


def test_settle_runs_the_bench_before_its_timed_span(monkeypatch):
    """settle_ms (GPU): the bench runs back to back that long before time_ms, and the span kept for
    its clock and power (_timing_spans) starts after the settling; none on the CPU or with 0."""
    import time

    waits = []

    class Event:  # a stand-in: the settling waits on the call two back, so calls never pile up queued
        def record(self):
            self.n = len(calls)

        def synchronize(self):
            waits.append(len(calls) - self.n)

    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness.torch.cuda, "Event", Event)
    monkeypatch.setattr(harness, "time_ms", lambda fn, **kw: (fn(), 1.0)[1])
    for device, settle_ms, settles in (("cuda", 50, True), ("cuda", 0, False), ("cpu", 50, False)):
        monkeypatch.setattr(harness, "_device", device)
        calls, waits[:] = [], []
        bench = harness.Bench("c", "fwd", "a", lambda: calls.append(time.time()))
        start = time.time()
        assert harness._time_recorded(bench, settle_ms=settle_ms) == 1.0
        (t0, _), = harness._timing_spans.pop(id(bench))
        if settles:
            assert len(calls) > 2 and calls[-2] - start >= 0.045  # settling: all but time_ms's call
            assert calls[-2] <= t0 <= calls[-1]
            assert len(waits) == len(calls) - 3 and set(waits) == {2}  # each call waits for the one 2 back
        else:
            assert len(calls) == 1


def test_markdown_table_names_the_settling():
    row = {"case": "c", "pass": "fwd", "impl": "fuseforge", "ms": 1.0}
    result = {"rows": [row], "gpu": "G", "torch": "t", "cuda": "c", "commit": "0123456789abcdef", "date": "d",
              "rounds": 2}
    assert "settle" not in harness.markdown_table(result)
    assert "after 600 ms of itself (--settle-ms), 2 rounds." in harness.markdown_table({**result, "settle_ms": 600.0})


def test_ncu_csv_traffic_columns(monkeypatch):
    """`profiler.py ncu-cycles --traffic`: each kernel's metrics in the columns' units, ncu's auto-scaled
    units undone, the workload's own prints before ncu's header skipped."""
    ncu = _profiler(monkeypatch)
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    text = "\n".join(["lengths: 1,2,3", head,
                      '"0","k0","gpu__time_duration.sum","usecond","1,500.00"',
                      '"0","k0","sm__cycles_elapsed.max","cycle","2,175,000"',
                      '"0","k0","lts__t_bytes.sum","Mbyte","40.96"',
                      '"0","k0","lts__t_sectors_op_red.sum","sector","1,000,000"',
                      '"1","k1","gpu__time_duration.sum","msecond","2.0"',
                      '"1","k1","lts__t_bytes.sum","Gbyte","1.5"'])
    kernels = ncu.parse_ncu_csv(text, ncu.TRAFFIC)
    assert kernels["0"]["ms"] == 1.5 and kernels["0"]["cycles"] == 2175000
    assert abs(kernels["0"]["l2_MB"] - 40.96) < 1e-9 and abs(kernels["0"]["l2_red_MB"] - 32.0) < 1e-9
    assert kernels["1"]["ms"] == 2.0 and abs(kernels["1"]["l2_MB"] - 1500.0) < 1e-9 and "l2_red_MB" not in kernels["1"]
    rows = [{"case": "c", "pass": "fwdbwd", "impl": "fuseforge", "ms": 3.5, "l2_MB": 1540.96, "l2_red_MB": 32.0}]
    table = ncu.traffic_table({"rows": rows, "gpu": "GPU", "commit": "0123456789abcdef"})
    assert "| c | fwdbwd | fuseforge | 3.5 | 1541 | 32 |" in table and "| l2_MB | l2_red_MB |" in table


def test_profiler_takes_any_benchmarks_cases(monkeypatch):
    """`profiler.py ncu-cycles / kernel-times --bench B`: cases of bench_B.py by a part of their name
    (or a shape as given), and one pass of one impl as its setup builds it; a missing impl is named."""
    prof = _profiler(monkeypatch)
    monkeypatch.delitem(sys.modules, "bench_rotary", raising=False)
    assert prof.bench_cases("rotary", "16x4x128,2x256/8x2x64/fp32") == ["8x2048/16x4x128/bf16", "2x256/8x2x64/fp32"]
    call = prof.bench_call("rotary", "2x256/8x2x64/fp32", "fuseforge", "fwd")
    q_out, k_out = call()
    assert q_out.shape == (2, 8, 256, 64) and k_out.shape == (2, 2, 256, 64)
    with pytest.raises(SystemExit, match="no impl 'nope' with pass 'fwd'"):
        prof.bench_call("rotary", "2x256/8x2x64/fp32", "nope", "fwd")
    assert prof.parser().parse_args(["ncu-cycles", "--bench", "rotary"]).bench == "rotary"


def test_e2e_attention_ab_runs_both_attentions_on_the_cpu(tmp_path):
    """`profiler.py e2e-attention-ab` (the training step's attention A/B) on a tiny Llama on the CPU:
    every fuseforge step ran fuseforge's attention in every layer (the subcommand checks the patch's
    call counts), both modes were timed in A B B A order, and the table names the saving."""
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "profiler.py"), "e2e-attention-ab", "--device", "cpu",
                    "--config", "tiny", "--seq", "32", "--batch", "2", "--pairs", "2", "--rounds", "1",
                    "--out", str(tmp_path)], check=True, env=env, capture_output=True, timeout=600)
    result = json.loads((tmp_path / "e2e_attention_ab.json").read_text())
    assert result["patched_attention_calls"] == {"fuseforge": 2 * (1 + 2 * 2), "varlen": 0, "sdpa": 0}
    assert [len(result["step"][m]["step_ms"]) for m in ("fuseforge", "sdpa")] == [4, 4]
    low, high = result["step"]["paired_mean_ci95"]
    assert low <= result["step"]["paired_mean_ms"] <= high
    assert set(result["attention_alone"]) == {"fwdbwd", "fwd", "rel_diff_fwd"}
    assert result["attention_alone"]["rel_diff_fwd"] < 2e-2  # the two attentions agree (bf16)
    assert "SDPA - fuseforge" in (tmp_path / "e2e_attention_ab.md").read_text()


def test_e2e_attention_ab_table_predicts_the_step_saving_from_energy(monkeypatch):
    """The energy rows of e2e_attention_ab's table: the layers' saved energy a call over the step's mean
    power is the step saving a power-capped step should show (16 x 5 mJ / 500 W = 0.16 ms)."""
    pytest.importorskip("transformers")
    ab = _profiler(monkeypatch)
    steps = {"fuseforge": [100.0, 101.0], "sdpa": [102.0, 103.0]}
    energy = {m: {"j_step": j, "ms_step": t, "watts": w, "blocks": [[j, t]] * 4}
              for m, j, t, w in (("fuseforge", 50.0, 100.0, 500.0), ("sdpa", 51.0, 102.0, 500.0))}
    alone = {"rel_diff_fwd": 1e-3,
             "fwdbwd": {"fuseforge": {"ms": 1.0}, "sdpa": {"ms": 1.1}}, "fwd": {"fuseforge": {"ms": 0.3}, "sdpa": {"ms": 0.3}},
             "energy_fwdbwd": {"fuseforge": {"mj": 600.0, "ms": 1.0, "watts": 600.0},
                               "sdpa": {"mj": 605.0, "ms": 1.1, "watts": 550.0}}}
    result = {"step": ab.step_summary(steps), "attention_alone": alone, "layers": 16, "energy_step": energy,
              "energy_steps_per_block": 3, "gpu": "GPU", "torch": "2", "cuda": "13", "commit": "abc", "date": "d",
              "case": "c"}
    table = ab.ab_markdown(result)
    assert "| energy a step, J (mean W; ms a step), 4 blocks of 3 steps each | 50.0 (500 W; 100.0) |" in table
    assert "| 605.0 (550 W; 1.100) | +5.0 mJ (1.008x) |" in table
    assert "**+0.16** (+0.080 J / 500 W)" in table


def test_markdown_table_shows_energy_a_call():
    """--energy-ms rows: each impl's mJ a call with the ms a call and the power it was read at; rows
    without it (a peer out of memory) show "-"."""
    rows = [{"case": "c", "pass": "fwdbwd", "impl": "fuseforge", "ms": 6.1, "mj": 4412.5, "energy_call_ms": 6.3,
             "energy_watts": 700.4},
            {"case": "c", "pass": "fwdbwd", "impl": "peer", "ms": 8.8}]
    result = {"rows": rows, "gpu": "G", "torch": "t", "cuda": "c", "commit": "0123456789abcdef", "date": "d",
              "energy_ms": 2000.0}
    table = harness.markdown_table(result)
    assert "over 2000 ms of each impl" in table
    assert "| c | fwdbwd | 4412 (6.3 ms, 700 W) | - |" in table
    assert "Energy a call" not in harness.markdown_table({**result, "rows": [rows[1]]})


def test_cpu_runs_default_to_several_rounds(tmp_path):
    """A CPU run without --rounds takes at least CPU_MIN_ROUNDS rounds (one pass over a small case is
    noise on a few cores); --rounds still overrides it."""
    def setup(case):
        return [harness.Bench(case, "fwd", "a", lambda: sum(range(200)))]

    argv = ["--device", "cpu", "--no-memory", "--out", str(tmp_path)]
    result = harness.run("roundtest", ["c"], setup, argv=argv, cpu_cases=["c"])
    assert result["rounds"] == harness.CPU_MIN_ROUNDS >= 3
    assert len(result["rows"][0]["ms_rounds"]) == harness.CPU_MIN_ROUNDS
    result = harness.run("roundtest", ["c"], setup, argv=argv + ["--rounds", "1"], cpu_cases=["c"])
    assert result["rounds"] == 1


@pytest.mark.skipif(not harness.torch.cuda.is_available(), reason="queued_device_ms times CUDA work (needs a GPU)")
def test_queued_device_ms_times_the_device_not_the_host():
    """A call that spends 2 ms of host time to issue ~0.1 ms of device work: do_bench-style events would
    read ~2 ms (the GPU waits on the host); the queued timing reads the kernel, about what the same
    spin reads alone. A fn that synchronizes cannot be queued ahead and says so."""
    import time

    torch = harness.torch
    cycles = int(0.1 * harness._spin_rate())  # 0.1 ms of spinning

    def slow_host_call():
        time.sleep(0.002)
        torch.cuda._sleep(cycles)

    ms = harness.queued_device_ms(slow_host_call, warmup_ms=5, rep_ms=40)
    alone = harness.queued_device_ms(lambda: torch.cuda._sleep(cycles), warmup_ms=5, rep_ms=40)
    assert 0.08 < alone < 0.2, alone
    assert abs(ms - alone) < 0.02, (ms, alone)

    def synchronizing_call():
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()

    with pytest.raises(harness.HostSynchronizes, match="never got ahead"):
        harness.queued_device_ms(synchronizing_call, warmup_ms=1, rep_ms=2)


def test_queued_device_ms_retries_until_the_spin_outlasts_the_queueing(monkeypatch):
    """The retry logic, with the CUDA calls stubbed: a batch whose spin ended before the host had
    queued it is dropped and queued again behind a longer spin with fewer calls; only the kept
    batches' times count; a fn the host can never get ahead of raises."""
    torch = harness.torch
    spins, batches = [], []
    state = {"spin_ends_early": 2, "calls": 0}

    class Event:
        def __init__(self, enable_timing=False):
            self.call = state["calls"]

        def record(self):
            self.call = state["calls"]

        def query(self):  # the spin's event: done already (the host was too slow) while failures remain
            batches.append(state["calls"] - self.call)
            if state["spin_ends_early"] > 0:
                state["spin_ends_early"] -= 1
                return True
            return False

        def elapsed_time(self, end):
            return 0.25

        def synchronize(self):
            pass

    def fn():  # 1 ms of the host's (fake) clock a call
        state["calls"] += 1
        state["clock"] += 0.001

    state["clock"] = 0.0
    monkeypatch.setattr(harness.time, "perf_counter", lambda: state["clock"])
    monkeypatch.setattr(harness, "_spin_rate", lambda: 1000.0)
    monkeypatch.setattr(harness, "_l2_flush_buffer", lambda: torch.empty(8))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: spins.append(cycles))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert harness.queued_device_ms(fn, warmup_ms=1, rep_ms=5) == 0.25
    # The estimate's 5 calls failed twice: queued again as 2, then 1, each behind a spin of the
    # host's 1 ms a call times a margin that doubles (1.5, 3, 6), plus 0.05 ms; cycles at 1000 a ms.
    assert batches[:3] == [5, 2, 1]
    assert [round(c) for c in spins[:3]] == [7550, 6050, 6050]
    assert round(spins[3]) == 6050 and batches[3] == 1  # the timed batches keep the last margin
    assert all(b <= harness.QUEUE_BATCH_CALLS for b in batches)
    state["spin_ends_early"] = 10**9
    with pytest.raises(harness.HostSynchronizes, match="never got ahead"):
        harness.queued_device_ms(fn, warmup_ms=1, rep_ms=5)


def test_a_synchronizing_fn_is_timed_as_issued_and_its_row_says_so(monkeypatch):
    """A fn that queued timing cannot get ahead of (HostSynchronizes) is timed with do_bench instead
    of failing its row; the row records "timing": "do_bench" and the table's footer names it."""
    def never_ahead(fn, warmup_ms, rep_ms):
        raise harness.HostSynchronizes("never got ahead")

    monkeypatch.setattr(harness, "_device", "cuda")
    monkeypatch.setattr(harness, "queued_device_ms", never_ahead)
    monkeypatch.setattr(harness, "_do_bench_ms", lambda fn, warmup_ms, rep_ms: 2.0)
    syncing = harness.Bench("c", "fwd", "paged", lambda: None)
    row = harness.measure(syncing, with_memory=False)
    assert row["ms"] == 2.0 and row["timing"] == "do_bench"
    monkeypatch.setattr(harness, "queued_device_ms", lambda fn, warmup_ms, rep_ms: 1.0)
    plain = harness.measure(harness.Bench("c", "fwd", "fuseforge", lambda: None), with_memory=False)
    assert plain["ms"] == 1.0 and "timing" not in plain
    result = {"rows": [plain, row], "gpu": "G", "torch": "t", "cuda": "c", "commit": "0123456789abcdef",
              "date": "d", "timing": "queued"}
    assert "Timed as issued (do_bench), their calls synchronizing with the host: paged (c, fwd)." in \
        harness.markdown_table(result)
