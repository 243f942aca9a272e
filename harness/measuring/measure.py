"""Honest timing and memory: warm up, synchronise, repeat until the median is known well
enough (or the time is spent), keep every sample.

What one sample is depends on the timing mode (``measure.timing``, ``TIMINGS``;
docs/profiling.md): ``events`` (CPU: ``time.perf_counter`` around synchronous work; GPU: a CUDA
event pair around every call, with the L2 cache flushed before each, as
``triton.testing.do_bench`` does, so a kernel is not timed on data a previous iteration left in
cache), ``cudagraph`` (the call captured once into a CUDA graph after the warm-up, each replay
timed as ``events``), ``profiler`` (the device time torch.profiler records for one call) or
``wall`` (perf_counter from before the call until the device has finished it). Nothing here
knows any variant: a measured thing is a callable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .stats import median_rel_ci
from .timings import CPU_TIMINGS, MAX_SAMPLES, TIMINGS

#: Bytes written between GPU iterations to evict the L2 cache (H100/H200: 50 MiB of L2).
L2_FLUSH_BYTES = 256 * 1024 * 1024
#: Adaptive sampling checks its interval again once the sample count has grown by this factor.
CHECK_GROWTH = 1.25


@dataclass(frozen=True)
class Timing:
    """Raw per-iteration samples in seconds, with the order statistics a report quotes, and
    whether their median reached ``target_rel_ci`` (None: a fixed number of samples was asked)
    undisturbed by other processes (``disturbed``)."""

    samples_s: tuple[float, ...]
    target_rel_ci: float | None = None
    #: whether another process took a core the samples needed (``busyness.disturbed``; None: not judged, a GPU cell)
    disturbed: bool | None = None

    @property
    def median_s(self) -> float:
        return float(np.median(self.samples_s))

    @property
    def p20_s(self) -> float:
        return float(np.percentile(self.samples_s, 20))

    @property
    def p80_s(self) -> float:
        return float(np.percentile(self.samples_s, 80))

    @property
    def iqr_s(self) -> float:
        return float(np.percentile(self.samples_s, 75) - np.percentile(self.samples_s, 25))

    @property
    def rel_ci(self) -> float:
        return median_rel_ci(self.samples_s)

    @property
    def unstable(self) -> bool | None:
        """True when the interval of the median stayed wider than asked, or the samples were
        ``disturbed`` (samples that all waited alike can agree closely); None when nothing was asked."""
        return None if self.target_rel_ci is None else self.rel_ci > self.target_rel_ci or bool(self.disturbed)

    def summary(self) -> dict:
        return {
            "median_s": self.median_s,
            "p20_s": self.p20_s,
            "p80_s": self.p80_s,
            "iqr_s": self.iqr_s,
            "samples_s": list(self.samples_s),
            "rel_ci": self.rel_ci,
            **({} if self.target_rel_ci is None else {"unstable": self.unstable, "target_rel_ci": self.target_rel_ci}),
            **({} if self.disturbed is None else {"disturbed": self.disturbed}),
        }


def sample_until_stable(take, *, repeats: int, target_rel_ci: float | None = None, max_time_s: float = 0.0) -> Timing:
    """Call ``take() -> seconds`` ``repeats`` times, then (with ``target_rel_ci``) on until the
    95 % bootstrap interval of the median is within ±target_rel_ci of it, ``max_time_s`` of
    sampling is spent or ``MAX_SAMPLES`` are taken, as pyperf and criterion do."""
    start, samples, check_at = time.perf_counter(), [], repeats
    while True:
        samples.append(take())
        if len(samples) < repeats:
            continue
        if target_rel_ci is None or len(samples) >= MAX_SAMPLES or time.perf_counter() - start >= max_time_s:
            break
        if len(samples) >= check_at:
            if median_rel_ci(samples) <= target_rel_ci:
                break
            check_at = max(len(samples) + 1, int(len(samples) * CHECK_GROWTH))
    return Timing(tuple(samples), target_rel_ci)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_device(device):
    """``with on_device(device):`` makes a CUDA ``device`` the current one for the block, so that
    what takes the current device rather than a tensor's (Triton's launcher, CUDA events, the
    allocator's statistics of ``cuda``) works on GPU N of ``cuda:N``, not on GPU 0; a no-op on
    the CPU."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class TimingError(ValueError):
    """A timing mode the cell cannot be timed in: ``cudagraph`` off a CUDA device, a call that
    cannot be captured into a CUDA graph, a per-call mode asked of a decode cell."""


class Clock:
    """Times one call, ``clock(fn) -> (result, seconds)``: CUDA events on a GPU (after an L2
    flush when ``flush_l2``), recorded on the current stream of the clock's device (not of
    the current device: ``cuda:1`` is timed on GPU 1), perf_counter on the CPU (timing ``events``)."""

    #: What one sample reads, by device type (``clock_name``: ``metrics.clock``).
    reads = {"cpu": "wall (perf_counter)", "cuda": "CUDA events"}

    def __init__(self, device, flush_l2: bool):
        self.device = torch.device(device)
        self.flush = None
        if self.device.type == "cuda" and flush_l2:
            self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=self.device)

    def flush_l2(self) -> None:
        """Evict the L2 cache (a no-op on the CPU or without ``flush_l2``), queued before the call on the same stream."""
        if self.flush is not None:
            self.flush.zero_()

    def __call__(self, fn):
        if self.device.type != "cuda":
            start = time.perf_counter()
            result = fn()
            return result, time.perf_counter() - start
        self.flush_l2()
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        result = fn()
        end.record(stream)
        end.synchronize()
        return result, start.elapsed_time(end) / 1e3


class WallClock(Clock):
    """Timing ``wall``: the whole call as the caller's code sees it, perf_counter from before the
    call until the device has finished it (a synchronisation after the call, outside it), so
    Python, dispatch and kernel launches count; the L2 flush (GPU) is done and waited for first."""

    reads = {"cpu": "wall (perf_counter)", "cuda": "wall (perf_counter to synchronize)"}

    def __call__(self, fn):
        self.flush_l2()
        synchronize(self.device)
        start = time.perf_counter()
        result = fn()
        synchronize(self.device)
        return result, time.perf_counter() - start


class ProfilerClock(Clock):
    """Timing ``profiler``: the device time torch.profiler records for one call. On a GPU the
    summed durations of the kernels, copies and fills it ran (Kineto's CUPTI activities; launch
    gaps and host time left out), after the L2 flush; on the CPU the summed self time of its
    operators (time inside ATen operators; Python between them left out). Kineto's one-time
    start-up (seconds) is paid when the clock is made, outside every sample."""

    reads = {"cpu": "profiler (operators' self CPU time)", "cuda": "profiler (device activity time)"}

    def __init__(self, device, flush_l2: bool):
        super().__init__(device, flush_l2)
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        with quiet_profiler(self.activities):
            pass

    def __call__(self, fn):
        self.flush_l2()
        synchronize(self.device)
        with quiet_profiler(self.activities) as profile:
            result = fn()
            synchronize(self.device)
        return result, device_seconds(profile.events(), self.device)


@contextmanager
def quiet_profiler(activities, **options):
    """``torch.profiler.profile(activities, **options)``, with the two lines Kineto writes to the
    process's stderr at each start and stop (``USDT: ... profiler_start``) left out, so a
    thousand profiled samples do not flood the run's terminal; anything else written meanwhile
    is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            with torch.profiler.profile(activities=activities, **options) as profile:
                yield profile
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


def device_seconds(events, device: torch.device) -> float:
    """The device time of profiled ``events`` (torch.profiler's ``FunctionEvent``s), in seconds:
    on a GPU the summed durations of its device activities (kernels, memory copies and fills),
    on the CPU the summed self time of its operators (user annotations, which span others, left out)."""
    measured = [event for event in events if not event.is_user_annotation]
    if device.type == "cuda":
        return sum(event.time_range.elapsed_us() for event in measured if event.device_type == torch.autograd.DeviceType.CUDA) / 1e6
    return sum(event.self_cpu_time_total for event in measured) / 1e6


#: The clock of each ``measure.timing`` mode (``cudagraph``: events, on the replays).
CLOCKS = {"events": Clock, "cudagraph": Clock, "profiler": ProfilerClock, "wall": WallClock}


def clock_for(timing: str, device, flush_l2: bool) -> Clock:
    """The clock of one ``measure.timing`` mode (``CLOCKS``); a ``TimingError`` for ``cudagraph``
    off a CUDA device, before anything runs."""
    device = torch.device(device)
    if timing not in TIMINGS:
        raise TimingError(f"measure.timing: expected one of {', '.join(TIMINGS)}, got {timing!r}")
    if timing == "cudagraph" and device.type != "cuda":
        raise TimingError(f"measure.timing: 'cudagraph' replays a CUDA graph and needs a CUDA device, not {device.type!r} ({CPU_TIMINGS})")
    return CLOCKS[timing](device, flush_l2)


def clock_name(timing: str, device) -> str:
    """What times one sample of ``measure.timing`` mode ``timing`` on ``device`` (``metrics.clock``):
    on the CPU ``wall (perf_counter)`` for ``events`` and ``wall`` (the CPU has no events: its work
    is synchronous), ``profiler (operators' self CPU time)`` for ``profiler``; on a GPU ``CUDA events``,
    ``CUDA events, graph replays``, ``wall (perf_counter to synchronize)`` or ``profiler (device activity time)``."""
    reads = CLOCKS[timing].reads
    name = reads.get(torch.device(device).type, reads["cpu"])  # any other device is timed as the CPU is (Clock.__call__)
    return f"{name}, graph replays" if timing == "cudagraph" else name


def graph_replay(fn, device):
    """``fn`` captured once into a CUDA graph on ``device``: a callable that replays it and
    returns the captured call's output (overwritten by each replay). ``fn`` has been warmed up
    eagerly (compiled, autotuned); one more eager call on a side stream first does the lazy
    initialisations (cuBLAS workspaces) capture must not see. A call that cannot be captured
    (a host synchronisation, an optimiser that is not ``capturable``) is a ``TimingError``."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        fn()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            output = fn()
    except Exception as exc:  # noqa: BLE001 - every capture failure is named in one line
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise TimingError(f"measure.timing: 'cudagraph' could not capture the call ({type(exc).__name__}: {first}); time it with 'events'") from None

    def replay():
        graph.replay()
        return output

    return replay


def time_interleaved(fns: dict, *, warmup: int = 2, repeats: int = 7, device="cpu", flush_l2: bool = True) -> dict:
    """Time several callables in rounds (A B C A B C ...), so that drift of a noisy machine
    hits all of them alike. Each is warmed up ``warmup`` times first (this also triggers
    compilation and autotuning); each sample is one call."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    clock = Clock(device, flush_l2)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(clock.device)
    samples = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            samples[key].append(clock(fn)[1])
    return {key: Timing(tuple(values)) for key, values in samples.items()}


def time_callable(
    fn,
    *,
    warmup: int = 2,
    repeats: int = 7,
    device="cpu",
    flush_l2: bool = True,
    target_rel_ci: float | None = None,
    max_time_s: float = 0.0,
    timing: str = "events",
) -> Timing:
    """Run ``fn()`` ``warmup`` times untimed, then time calls one by one in the ``timing`` mode
    (``clock_for``; ``cudagraph``: the replays of one call captured after the warm-up):
    ``repeats`` of them, and with ``target_rel_ci`` more until the median is that sure
    (``sample_until_stable``)."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    clock = clock_for(timing, device, flush_l2)
    for _ in range(warmup):
        fn()
    synchronize(clock.device)
    if timing == "cudagraph":
        fn = graph_replay(fn, clock.device)
    return sample_until_stable(lambda: clock(fn)[1], repeats=repeats, target_rel_ci=target_rel_ci, max_time_s=max_time_s)


#: glibc's mallopt parameters (malloc.h) and the environment variables that set them at start-up.
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2, "MALLOC_MMAP_THRESHOLD_": -3}
#: Where glibc's own dynamic thresholds settle in a process that allocates and frees large
#: blocks (64-bit: mmap threshold up to 32 MiB, trim threshold twice that, top pad 128 KiB).
USUAL_MALLOC = {"MALLOC_MMAP_THRESHOLD_": 32 * 2**20, "MALLOC_TRIM_THRESHOLD_": 64 * 2**20, "MALLOC_TOP_PAD_": 128 * 2**10}


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


@contextmanager
def usual_allocator():
    """Time with the allocator every other process has. A worker that measures CPU peak
    memory starts with glibc's mmap threshold at 64 KiB and trimming on (worker.WORKER_ENV),
    so that freed tensors leave the resident set; every large allocation then costs fresh
    pages (measured: chunked linear attention and the delta rule at T=1024 took 2.3x the CPU
    time). Inside this block glibc gets the thresholds its dynamic defaults settle at
    (``USUAL_MALLOC``); on exit the start-up settings come back and freed memory is returned.
    A no-op in a process without those settings or without glibc."""
    tuned = {name: int(os.environ[name]) for name in _MALLOPT if name in os.environ}
    libc = _glibc() if tuned else None
    if libc is None:
        yield
        return
    for name, value in USUAL_MALLOC.items():
        libc.mallopt(_MALLOPT[name], value)
    try:
        yield
    finally:
        for name, value in USUAL_MALLOC.items():
            libc.mallopt(_MALLOPT[name], tuned.get(name, value))
        libc.malloc_trim(0)


class PeakMemory:
    """Peak memory of what runs inside ``with PeakMemory(device) as peak:``, in ``peak.bytes``.

    GPU: ``torch.cuda.max_memory_allocated`` after a reset, minus what was allocated at the
    start (kind ``cuda_max_allocated``). CPU (Linux): the rise of the process's peak
    resident set (VmHWM, reset through /proc/self/clear_refs) above its resident set at
    the start, after freed heap blocks are handed back (kind ``rss_peak_delta``); this
    counts every allocation, PyTorch's or not. It is exact in a worker whose large
    allocations are mmapped (worker.WORKER_ENV); elsewhere glibc may serve small blocks
    from pages that were already resident. Where
    neither is available, ``bytes`` is None (kind ``unavailable``).
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.bytes: int | None = None
        self.kind = "unavailable"

    def __enter__(self):
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            _release_freed_heap()
            self._start = _status_bytes("VmRSS") if _reset_peak_rss() else None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.kind = "cuda_max_allocated"
        elif self._start is not None:
            self.bytes = max(0, _status_bytes("VmHWM") - self._start)
            self.kind = "rss_peak_delta"
        return False


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _release_freed_heap() -> None:
    """Hand the pages of freed heap blocks back to the OS (glibc ``malloc_trim``). Freed blocks
    stay resident otherwise, and the measured code reuses them without raising the resident
    set: in a worker shared with earlier cells a delta-rule forward (B=8 H=8 T=512) read 15-25
    MiB against 46-49 MiB in a fresh worker, and its inputs alone are 24 MiB. With the trim it
    reads 53-61 MiB there (its own freed blocks stay resident): hence a fresh worker per CPU cell."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
