"""Timing and memory measurement, tested for behaviour (never for speed)."""

from __future__ import annotations

import pytest
import torch

from harness.measuring.measure import PeakMemory, Timing, time_callable, time_interleaved


def test_warmup_is_excluded_and_samples_are_counted():
    calls = []
    timing = time_callable(lambda: calls.append(1), warmup=3, repeats=5)
    assert len(calls) == 8 and len(timing.samples_s) == 5
    assert all(sample >= 0 for sample in timing.samples_s)


def test_interleaved_rounds_alternate_and_time_each_call():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    timings = time_interleaved(fns, warmup=1, repeats=3)
    assert order == ["a", "b"] + ["a", "b"] * 3, "warm-up first, then A B A B ..."
    assert {key: len(t.samples_s) for key, t in timings.items()} == {"a": 3, "b": 3}


def test_a_slower_callable_measures_slower():
    import time

    timings = time_interleaved({"fast": lambda: None, "slow": lambda: time.sleep(0.02)}, warmup=0, repeats=3)
    assert timings["slow"].median_s >= 0.02 > timings["fast"].median_s


def test_timing_statistics():
    timing = Timing((5.0, 1.0, 3.0, 2.0, 4.0))
    assert timing.median_s == 3.0 and timing.p20_s == pytest.approx(1.8) and timing.p80_s == pytest.approx(4.2)
    assert timing.iqr_s == pytest.approx(2.0)
    assert timing.summary()["samples_s"] == [5.0, 1.0, 3.0, 2.0, 4.0]


@pytest.mark.parametrize("warmup, repeats", [(-1, 3), (1, 0)])
def test_bad_counts_are_refused(warmup, repeats):
    with pytest.raises(ValueError, match="warmup"):
        time_callable(lambda: None, warmup=warmup, repeats=repeats)


def test_cpu_peak_memory_sees_a_large_allocation():
    with PeakMemory("cpu") as small:
        torch.ones(1024)
    with PeakMemory("cpu") as large:
        block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, written so that it is resident
        del block
    if large.kind == "unavailable":
        pytest.skip("/proc/self/clear_refs is not writable here; CPU peak memory is unavailable")
    assert large.kind == "rss_peak_delta"
    assert large.bytes >= 60 * 1024 * 1024 > small.bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_memory_and_event_timing():
    with PeakMemory("cuda") as peak:
        block = torch.ones(16 * 1024 * 1024 // 4, device="cuda")
        del block
    assert peak.kind == "cuda_max_allocated" and peak.bytes >= 16 * 1024 * 1024
    timing = time_callable(lambda: torch.cuda._sleep(1_000_000), warmup=1, repeats=3, device="cuda")
    assert timing.median_s > 0


class _FakeLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, parameter, value):
        self.calls.append(("mallopt", parameter, value))

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))


def test_timing_gets_the_usual_allocator_and_the_exact_rss_settings_come_back(monkeypatch):
    """In a worker started with worker.WORKER_ENV, timing runs with glibc's usual thresholds."""
    from harness.measuring import measure
    from harness.running.worker import WORKER_ENV

    libc = _FakeLibc()
    monkeypatch.setattr(measure, "_glibc", lambda: libc)
    for name, value in WORKER_ENV.items():
        monkeypatch.setenv(name, value)
    with measure.usual_allocator():
        inside = list(libc.calls)
    usual = {("mallopt", measure._MALLOPT[name], value) for name, value in measure.USUAL_MALLOC.items()}
    assert set(inside) == usual
    restored = {("mallopt", measure._MALLOPT[name], int(value)) for name, value in WORKER_ENV.items()}
    assert set(libc.calls[len(inside) : -1]) == restored and libc.calls[-1] == ("malloc_trim", 0)


def test_the_usual_allocator_leaves_an_ordinary_process_alone(monkeypatch):
    from harness.measuring import measure

    libc = _FakeLibc()
    monkeypatch.setattr(measure, "_glibc", lambda: libc)
    for name in measure._MALLOPT:
        monkeypatch.delenv(name, raising=False)
    with measure.usual_allocator():
        pass
    assert libc.calls == []
