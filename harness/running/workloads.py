"""Turn one cell into something to measure, measure it, and return its metrics.

A cell's ``target`` says what is built (the attention ``core``, a whole ``layer`` with its
projections, or a decoder-only LM ``model``) and its ``mode`` what one iteration is:
``forward``; ``train`` (forward + backward; for a model also the optimiser step);
``decode`` (a prefill of ``seq_len`` tokens, then ``decode.new_tokens`` steps, each timed).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import os

import numpy as np
import torch

import variants
from variants.compiled import compiled_frames

from .. import tasks
from ..measuring import accuracy, profiling
from ..measuring.builders import BUILDERS, CellError, attention_inputs, build_core, build_decoder, decode_contexts, head_arguments
from ..measuring.busyness import LoadMeter, disturbed
from ..measuring.machine import missing_tensor_cores
from ..measuring.measure import (
    Clock,
    PeakMemory,
    Timing,
    TimingError,
    clock_for,
    clock_name,
    on_device,
    sample_until_stable,
    synchronize,
    time_callable,
    usual_allocator,
)
from ..measuring.roofline import DTYPES
from ..measuring.timings import DECODE_TIMINGS
from ..scenarios.cell import Cell
from ..tasks.precision import TRAIN_DTYPES
from ..tasks.training import cell_checkpoints


def _finite(output) -> bool:
    return bool(torch.isfinite(output).all())


def measure_cell(cell: Cell) -> dict:
    """Build, check and time one cell: ``{"status", "error", "metrics"}``, with the machine's
    load meanwhile in ``metrics.load``. A backend that turns out not to run the cell
    (``variants.UnsupportedBackend``) makes it skipped with the reason; other exceptions (and
    out-of-memory errors) propagate to the caller, which records them. A CUDA cell runs with its
    GPU as the current device (``on_device``); a 16-bit cell on a GPU without tensor cores for
    its dtype is skipped before anything is built (``machine.missing_tensor_cores``). A timed CPU
    cell runs on its run's threads (``measure.threads``, ``busyness.run_threads``), at most one per
    CPU of ``measure.cpus``; any other on the threads the worker started with."""
    axes = cell.axes
    device, dtype = torch.device(axes["device"]), DTYPES[axes["dtype"]]
    if device.type == "cuda" and not torch.cuda.is_available():
        return {"status": "skipped", "error": "CUDA is not available on this machine", "metrics": {}}
    if refusal := missing_tensor_cores(device, axes["dtype"]):
        return {"status": "skipped", "error": refusal, "metrics": {}}
    pin(cell.measure.get("cpus"), cell.measure.get("threads"))
    with on_device(device), LoadMeter(device) as load:
        try:
            result = _measure(cell, device, dtype)
        except variants.UnsupportedBackend as exc:  # found only when it runs: fla without Triton's interpreter on a CPU, or decoding Based
            return {"status": "skipped", "error": str(exc), "metrics": {}}
    result["metrics"]["load"] = load.record
    return result


#: The worker's CPUs and threads as it started, restored for a cell without ``measure.cpus``.
_UNPINNED = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None, torch.get_num_threads())


def pin(cpus, threads: int | None = None) -> None:
    """Pin this process to ``cpus`` (measure.cpus; None: the CPUs it started on) and run ``threads``
    torch threads (the run's, measure.threads; None: as many as it started with), no more than CPUs."""
    affinity, started = _UNPINNED
    threads = threads or started
    if affinity is not None:
        chosen = affinity if cpus is None else set(cpus)
        os.sched_setaffinity(0, chosen)
        threads = min(threads, len(chosen))
    torch.set_num_threads(threads)


def _sampling(measure: dict) -> dict:
    """The adaptive sampling settings of a cell (harness.measuring.measure.sample_until_stable)."""
    return {"repeats": measure["repeats"], "target_rel_ci": measure.get("target_rel_ci"), "max_time_s": measure.get("max_time_s", 0.0)}


def _timing(cell) -> str:
    """The cell's ``measure.timing`` (``events`` for a cell of a scenario loaded before there were modes)."""
    return cell.measure.get("timing", "events")


def _measure(cell, device, dtype) -> dict:
    measure = cell.measure
    if cell.quality:
        return _measure_quality(cell, device, dtype)
    torch.manual_seed(0)
    choices = _implementation_choices(cell, device, dtype)
    with _kernel_identity(cell) as identity:
        first_call_s = _warm_up_libraries(cell, device, dtype)
    choices.update(identity)
    compiled_before = compiled_frames() if cell.backend == "compile" else 0
    if cell.mode == "decode":
        result = _measure_decode(cell, device, dtype)
        result["metrics"].update(choices)
        return _compile_record(cell, result, first_call_s, compiled_before)
    with PeakMemory(device) as peak:
        workload = BUILDERS[cell.target](cell, device, dtype)
        finite = _finite(workload.run())
    timing, timed_load = _judged(
        device,
        lambda: time_callable(workload.run, warmup=measure["warmup"], device=device, flush_l2=measure["flush_l2"], timing=_timing(cell), **_sampling(measure)),
    )
    metrics = {
        **timing.summary(),
        **timed_load,
        "timing": _timing(cell),
        "clock": clock_name(_timing(cell), device),
        "tokens": workload.tokens,
        "tokens_per_s": workload.tokens / timing.median_s,
        "peak_mem_bytes": peak.bytes,
        "memory_kind": peak.kind,
        "flops": workload.flops,
        "min_bytes": workload.min_bytes,
        "flops_per_s": workload.flops / timing.median_s,
        "torch_threads": torch.get_num_threads(),
        **_lengths(cell),
        **choices,
    }
    if cell.target == "model":
        metrics["words_per_s"] = metrics["tokens_per_s"]
    result = _compile_record(cell, _result(finite, metrics), first_call_s, compiled_before)
    result["metrics"].update(_accuracy(lambda: accuracy.measure(cell, device, dtype, workload)))
    return _profiled(cell, result, workload.run, device)


def _judged(device, sample) -> tuple[Timing, dict]:
    """``sample()``'s Timing, taken under ``usual_allocator``; on the CPU judged by the load over it
    (``busyness.disturbed``: a disturbed timing is unstable), with that load as ``{"timed_load": ...}``."""
    with usual_allocator(), LoadMeter() as meter:
        timing = sample()
    if device.type != "cpu":
        return timing, {}
    load = {**meter.record, "threads": torch.get_num_threads()}
    return dataclasses.replace(timing, disturbed=disturbed(load)), {"timed_load": load}


def _profiled(cell, result: dict, call, device) -> dict:
    """``result`` with ``metrics.profile`` and the ``trace`` of one more ``call()`` after the timed
    ones, where ``--profile`` asked (``harness.measuring.profiling.profile``; the runner writes the trace)."""
    found, trace = profiling.profile(cell, call, device)
    if found is not None:
        result["metrics"]["profile"] = found
    if trace is not None:
        result["trace"] = trace
    return result


def _accuracy(check) -> dict:
    """``check()``: ``metrics.rel_error``, its tolerance and ``inaccurate`` (``harness.measuring.accuracy``),
    outside every timed call. A check that fails (the float64 reference out of memory, a form that
    raises) leaves the cell's timing as measured, with no rel_error and ``rel_error_skipped`` saying why."""
    try:
        return check()
    except Exception as exc:
        what = "the float64 reference ran out of memory" if is_out_of_memory(exc) else f"the accuracy check failed: {type(exc).__name__}"
        return {"rel_error": None, "rel_error_skipped": f"{what}: {(str(exc).strip().splitlines() or [''])[0][:200]}"}


def _implementation_choices(cell, device, dtype) -> dict:
    """What the cell's attention core runs on inputs of the cell's shape (softmax: ``sdpa_backend``;
    fla: ``fla_kernel`` and ``chunk_size``), asked before anything runs, so that a pinned choice
    that cannot run them skips the cell with the core's reason (UnsupportedBackend). The inputs
    require grad in a train cell, as SDPA's dispatcher weighs that too."""
    core = build_core(cell).to(device=device, dtype=dtype)
    return core.implementation_choices(**attention_inputs(core, cell, device, dtype, cell.mode == "train"))


def _kernel_identity(cell):
    """A Triton cell's kernels over its warm-up call, where they compile and autotune (``variants.kernels.identity``:
    ``metrics.triton_version``, ``metrics.triton_kernels``); nothing for other backends."""
    if cell.backend != "triton":
        return contextlib.nullcontext({})
    from variants.kernels import identity

    return identity.recording()


#: Backends whose first call compiles (and autotunes) Triton kernels: their cells record that call as ``metrics.compile_s``.
FIRST_USE_BACKENDS = ("triton", "fla")


def _compile_record(cell, result: dict, first_call_s: float, compiled_before: int) -> dict:
    """For a 'compile' cell: ``metrics.compile_s`` (the warm-up's first call: tracing, compiling
    and one run) and ``metrics.backend_options``; a CellError if anything compiled after the
    warm-up (a recompilation would have been timed). For a 'triton' or 'fla' cell: ``metrics.compile_s``,
    the warm-up's first call (its Triton kernels compiled, or loaded from Triton's on-disk cache, and
    autotuned for the cell's shapes, and one run), never part of the timed calls."""
    if cell.backend in FIRST_USE_BACKENDS:
        result["metrics"]["compile_s"] = first_call_s
        return result
    if cell.backend != "compile":
        return result
    again = compiled_frames() - compiled_before
    if again:
        raise CellError(f"torch.compile compiled {again} frame(s) again after the warm-up (a guard failed); the timings would include compilation")
    result["metrics"].update(compile_s=first_call_s, backend_options=cell.backend_options)
    return result


def _measure_quality(cell, device, dtype) -> dict:
    """Train and evaluate the cell's registered task (``harness.tasks``); its metrics are the task's own.
    Its checkpoints carry the cell's identity, and one of another cell is refused (``cell_checkpoints``)."""
    task = tasks.get(cell.task["name"])
    if cell.axes["dtype"] not in TRAIN_DTYPES or (device.type != "cpu" and not task.any_device):
        where = "" if task.any_device else " on the CPU (axes.device: cpu)"
        raise CellError(f"task {task.name!r} trains in {', '.join(TRAIN_DTYPES)} (axes.dtype){where}")
    with cell_checkpoints(cell):
        metrics = tasks.resolve(task.run)(cell)
    return _profiled(cell, _result(bool(np.isfinite(metrics.get("loss", 0.0))), metrics), None, device)


def _warm_up_libraries(cell, device, dtype) -> float:
    """Build and run the cell once and throw it away, so that one-time costs of the process
    (thread pools, library initialisation, kernel selection, torch.compile's compilation of
    every form the cell calls: backend 'compile') stay out of the measured peak memory of the
    fresh build that follows and out of every timed call. Returns the seconds that first call
    took (``metrics.compile_s`` of a 'compile' cell); a compilation failure is a CellError."""
    clock = Clock(device, flush_l2=False)
    try:
        if cell.mode == "decode":
            with torch.no_grad():  # the decoder of the measurement (same shapes and strides), two steps: a growing KV cache recompiles once
                new_tokens = cell.decode["new_tokens"]
                decoder = build_decoder(cell, device, dtype, cell.axes["seq_len"], new_tokens)
                _, seconds = clock(lambda: functools.reduce(lambda state, i: decoder.step(i, state)[1], range(min(2, new_tokens)), decoder.prefill()[1]))
        else:
            _, seconds = clock(BUILDERS[cell.target](cell, device, dtype).run)
    except Exception as exc:
        if cell.backend == "compile" and _compile_failure(exc):
            raise CellError(f"torch.compile failed: {type(exc).__name__}: {_first_paragraph(exc)}") from None
        raise
    gc.collect()
    synchronize(device)
    return seconds


def _compile_failure(exc: Exception) -> bool:
    """Whether ``exc`` comes from torch.compile (TorchDynamo or Inductor: BackendCompilerFailed, Unsupported, ...)."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(exc, TorchDynamoException) or type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))


def _first_paragraph(exc: Exception) -> str:
    """The message of ``exc`` up to its first blank line, on one line (torch.compile's errors go on
    with pages of advice): ``backend='inductor' raised: RuntimeError: ...``."""
    return " ".join(str(exc).strip().split("\n\n")[0].split())


def _measure_decode(cell, device, dtype) -> dict:
    """Prefill ``seq_len`` tokens, then time ``new_tokens`` single steps, in rounds (after
    ``warmup`` untimed ones) sampled as any call is (``sample_until_stable``: a sample is the
    total of a round's steps); each round starts from a fresh prefill. Peak memory is that of
    building the decoder and one round, before any timing."""
    axes, measure, new_tokens = cell.axes, cell.measure, cell.decode["new_tokens"]
    if cell.target not in ("core", "layer"):
        raise CellError(f"decode mode measures target 'core' or 'layer', not {cell.target!r}")
    if _timing(cell) not in DECODE_TIMINGS:
        raise TimingError(f"measure.timing: {_timing(cell)!r} times one call; a decode cell times each step with {' or '.join(DECODE_TIMINGS)}")
    context, clock = axes["seq_len"], clock_for(_timing(cell), device, flush_l2=False)

    def decode_round():
        (_, state), prefill_s = clock(prefill)
        step_s = []
        for i in range(new_tokens):
            (out, state), seconds = clock(lambda: step(i, state))
            step_s.append(seconds)
        return prefill_s, step_s, _finite(out)

    with torch.no_grad():
        with PeakMemory(device) as peak:
            decoder = build_decoder(cell, device, dtype, context, new_tokens)
            core, prefill, step, step_bytes = decoder.core, decoder.prefill, decoder.step, decoder.step_bytes
            decode_round()
        rounds = []

        def timed_round():
            rounds.append(decode_round())
            return sum(rounds[-1][1])

        def warmed_up():
            for _ in range(measure["warmup"]):
                decode_round()
            return sample_until_stable(timed_round, **_sampling(measure))

        timing, timed_load = _judged(device, warmed_up)
    finite = all(ok for _, _, ok in rounds)
    heads, grouped = head_arguments(core, axes)
    rows = collections.Counter(decode_contexts(cell, context))  # prompt length -> sequences
    tokens = sum(rows.values()) * new_tokens
    flops = sum(core.step_flops(count, heads, axes["d_value"], length + i, **grouped) for length, count in rows.items() for i in range(new_tokens))
    state_bytes = torch.finfo(core.state_dtype(dtype)).bits // 8
    traffic = sum(_state_traffic(core, count, heads, axes["d_value"], length + i, grouped) for length, count in rows.items() for i in range(new_tokens))
    metrics = {
        **timing.summary(),
        **timed_load,
        "timing": _timing(cell),
        "clock": clock_name(_timing(cell), device),
        "tokens": tokens,
        "tokens_per_s": tokens / timing.median_s,
        "step_latency_s": np.median([step_s for _, step_s, _ in rounds], axis=0).tolist(),
        "prefill_median_s": float(np.median([prefill_s for prefill_s, _, _ in rounds])),
        "peak_mem_bytes": peak.bytes,
        "memory_kind": peak.kind,
        "state_numel": sum(core.state_numel(count, heads, axes["d_value"], length + new_tokens, **grouped) for length, count in rows.items()),
        "flops": flops,
        "min_bytes": traffic * state_bytes + new_tokens * step_bytes,
        "flops_per_s": flops / timing.median_s,
        "torch_threads": torch.get_num_threads(),
        **_lengths(cell),
        **_accuracy(lambda: accuracy.measure_decode(cell, device, dtype, decoder)),
    }
    return _profiled(cell, _result(finite, metrics), torch.no_grad()(decode_round), device)


def _state_traffic(core, batch: int, heads: int, d_value: int, position: int, grouped: dict) -> int:
    """Elements of the decoding state one step at ``position`` must read and write (``batch`` sequences
    there): all of it read; written, what it adds (a KV cache) or all of it (a state of fixed size)."""
    before, after = (core.state_numel(batch, heads, d_value, length, **grouped) for length in (position, position + 1))
    return before + (after - before if after != before else after)


def _lengths(cell) -> dict:
    """``metrics.lengths``: a packed batch's sequence lengths (``axes.lengths`` names their distribution)."""
    return {"lengths": cell.lengths} if cell.lengths is not None else {}


def _result(finite: bool, metrics: dict) -> dict:
    return {"status": "ok" if finite else "nan", "error": None if finite else "the output contains NaN or Inf", "metrics": metrics}


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception means the device (or host) ran out of memory."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
