"""Turn one cell into something to measure, measure it, and return its metrics.

A cell's ``target`` says what is built (the attention ``core``, a whole ``layer`` with its
projections, or a decoder-only LM ``model``) and its ``mode`` what one iteration is:
``forward``; ``train`` (forward + backward; for a model also the optimiser step);
``decode`` (a prefill of ``seq_len`` tokens, then ``decode.new_tokens`` steps, each timed).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import variants
from variants.compiled import compiled_frames

from . import tasks
from .busyness import LoadMeter, other_cores_now, spare_threads
from .machine import missing_tensor_cores
from .measure import Clock, PeakMemory, on_device, sample_until_stable, synchronize, time_callable, usual_allocator
from .roofline import DTYPES
from .tasks.precision import TRAIN_DTYPES


class CellError(ValueError):
    """A cell that cannot be built as specified (recorded as an error, the sweep goes on)."""


@dataclass
class Workload:
    """One iteration (``run``) with how many tokens and FLOPs it processes and the bytes no
    implementation can avoid moving (``min_bytes``: docs/results.md, "Roofline")."""

    run: Callable[[], torch.Tensor]
    tokens: int
    flops: int
    min_bytes: int


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _module_bytes(module) -> int:
    """Bytes of a module's parameters and buffers (read at least once per call)."""
    return tensor_bytes(module.parameters()) + tensor_bytes(module.buffers())


def _generator(device):
    return torch.Generator(device=device).manual_seed(0)


def _backend(cell) -> dict:
    """The cell's backend and its options (``backend_options``), as ``variants.create`` takes them."""
    return {"backend": cell["backend"], "backend_options": cell.get("backend_options") or {}}


def _core(cell):
    return variants.create(cell["variant"], cell["axes"]["d_key"], **_backend(cell), **cell["params"])


def _attention_inputs(core, axes, device, dtype, requires_grad) -> dict:
    """The core's own example inputs (q, k, v and whatever per-token inputs it declares) for the
    cell's shape, drawn from a generator seeded 0 on ``device``."""
    return core.example_inputs(
        axes["batch"], axes["heads"], axes["seq_len"], axes["d_value"], device=device, dtype=dtype, generator=_generator(device),
        requires_grad=requires_grad,
    )


def _core_workload(cell, device, dtype) -> Workload:
    axes = cell["axes"]
    core = _core(cell).to(device=device, dtype=dtype)
    train = cell["mode"] == "train"
    inputs = _attention_inputs(core, axes, device, dtype, train)
    flops = core.flops(axes["batch"], axes["heads"], axes["seq_len"], axes["d_value"])
    read = tensor_bytes(inputs.values())
    output = axes["batch"] * axes["heads"] * axes["seq_len"] * axes["d_value"] * inputs["v"].element_size()
    if not train:
        return Workload(torch.no_grad()(lambda: core(**inputs)), axes["batch"] * axes["seq_len"], flops, read + output + _module_bytes(core))
    leaves = list(inputs.values())
    cotangent = torch.randn_like(inputs["v"])

    def forward_backward():
        out = core(**inputs)
        torch.autograd.grad(out, leaves, cotangent)
        return out.detach()

    # inputs read and their gradients written, output written and its cotangent read
    return Workload(forward_backward, axes["batch"] * axes["seq_len"], 3 * flops, 2 * (read + output) + _module_bytes(core))


def _layer(cell, device, dtype):
    axes = cell["axes"]
    layer = variants.AttentionLayer(
        axes["heads"] * axes["d_value"],
        axes["heads"],
        cell["variant"],
        d_key=axes["d_key"],
        d_value=axes["d_value"],
        **_backend(cell),
        **cell["params"],
    )
    return layer.to(device=device, dtype=dtype)


def _layer_flops(layer, axes) -> int:
    """The core's FLOPs plus 2 per weight per token for the projections."""
    projections = sum(p.numel() for name, p in layer.named_parameters() if name.endswith("weight") and not name.startswith("core"))
    tokens = axes["batch"] * axes["seq_len"]
    return layer.core.flops(axes["batch"], axes["heads"], axes["seq_len"], axes["d_value"]) + 2 * projections * tokens


def _layer_workload(cell, device, dtype) -> Workload:
    axes = cell["axes"]
    layer = _layer(cell, device, dtype)
    x = torch.randn(axes["batch"], axes["seq_len"], axes["heads"] * axes["d_value"], generator=_generator(device), device=device)
    x = x.to(dtype)
    tokens, flops = axes["batch"] * axes["seq_len"], _layer_flops(layer, axes)
    read = tensor_bytes([x]) + _module_bytes(layer)
    if cell["mode"] != "train":
        return Workload(torch.no_grad()(lambda: layer(x)), tokens, flops, read + tensor_bytes([x]))
    x.requires_grad_(True)
    leaves = [x, *layer.parameters()]

    def forward_backward():
        out = layer(x)
        torch.autograd.grad(out.float().square().mean(), leaves)
        return out.detach()

    # x and the weights read and their gradients written, the output written
    return Workload(forward_backward, tokens, 3 * flops, 2 * read + tensor_bytes([x]))


def _model_workload(cell, device, dtype) -> Workload:
    from .models import DecoderLM, lm_config

    axes, spec = cell["axes"], cell["model"]
    variant_params = dict(cell["params"], **_backend(cell))
    config = lm_config(spec["preset"], spec["vocab_size"], variant=cell["variant"], variant_params=variant_params, **spec["overrides"])
    d_head = config.d_model // config.n_heads
    if (axes["heads"], axes["d_key"]) != (config.n_heads, d_head):
        raise CellError(
            f"model preset {spec['preset']!r} has {config.n_heads} heads of dimension {d_head}; "
            f"set axes.heads={config.n_heads} and axes.d_key={d_head} (got heads={axes['heads']}, d_key={axes['d_key']})"
        )
    if axes["seq_len"] > config.context:
        raise CellError(f"seq_len={axes['seq_len']} exceeds the model's context {config.context}")
    model = DecoderLM(config).to(device=device, dtype=dtype)
    gen = _generator(device)
    tokens = torch.randint(config.vocab_size, (axes["batch"], axes["seq_len"] + 1), generator=gen, device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    count = axes["batch"] * axes["seq_len"]
    attention = model.blocks[0].attn.core.flops(axes["batch"], config.n_heads, axes["seq_len"], d_head)
    dense = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "pos" not in name)
    flops = 2 * dense * count + config.n_layers * attention
    if cell["mode"] != "train":
        logits = count * config.vocab_size * torch.finfo(dtype).bits // 8
        return Workload(torch.no_grad()(lambda: model(inputs)), count, flops, tensor_bytes([inputs]) + _module_bytes(model) + logits)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(inputs, targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    # the tokens read; the weights and Adam's two moments read and written (gradients fused away)
    return Workload(train_step, count, 3 * flops, tensor_bytes([tokens]) + 6 * tensor_bytes(model.parameters()))


BUILDERS = {"core": _core_workload, "layer": _layer_workload, "model": _model_workload}


def _finite(output) -> bool:
    return bool(torch.isfinite(output).all())


def measure_cell(cell: dict) -> dict:
    """Build, check and time one cell: ``{"status", "error", "metrics"}``, with the machine's
    load meanwhile in ``metrics.load``. A backend that turns out not to run the cell
    (``variants.UnsupportedBackend``) makes it skipped with the reason; other exceptions (and
    out-of-memory errors) propagate to the caller, which records them. A CUDA cell runs with its
    GPU as the current device (``on_device``); a 16-bit cell on a GPU without tensor cores for
    its dtype is skipped before anything is built (``machine.missing_tensor_cores``). A timed CPU
    cell without ``measure.cpus`` runs on the threads other processes leave free (``load.spare_threads``)."""
    axes = cell["axes"]
    device, dtype = torch.device(axes["device"]), DTYPES[axes["dtype"]]
    if device.type == "cuda" and not torch.cuda.is_available():
        return {"status": "skipped", "error": "CUDA is not available on this machine", "metrics": {}}
    if refusal := missing_tensor_cores(device, axes["dtype"]):
        return {"status": "skipped", "error": refusal, "metrics": {}}
    pin(cell["measure"].get("cpus"))
    if device.type == "cpu" and cell["mode"] != "quality" and cell["measure"].get("cpus") is None:
        torch.set_num_threads(spare_threads(torch.get_num_threads(), len(_UNPINNED[0] or range(os.cpu_count())), other_cores_now()))
    with on_device(device), LoadMeter(device) as load:
        try:
            result = _measure(cell, device, dtype)
        except variants.UnsupportedBackend as exc:  # found only when it runs: fla without Triton's interpreter on a CPU, or decoding Based
            return {"status": "skipped", "error": str(exc), "metrics": {}}
    result["metrics"]["load"] = load.record
    return result


#: The worker's CPUs and threads as it started, restored for a cell without ``measure.cpus``.
_UNPINNED = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None, torch.get_num_threads())


def pin(cpus) -> None:
    """Pin this process to ``cpus`` (measure.cpus) with no more threads than CPUs; None: as it started."""
    affinity, threads = _UNPINNED
    if affinity is None:
        return
    chosen = affinity if cpus is None else set(cpus)
    os.sched_setaffinity(0, chosen)
    torch.set_num_threads(min(threads, len(chosen)))


def _sampling(measure: dict) -> dict:
    """The adaptive sampling settings of a cell (harness.measure.sample_until_stable)."""
    return {"repeats": measure["repeats"], "target_rel_ci": measure.get("target_rel_ci"), "max_time_s": measure.get("max_time_s", 0.0)}


def _measure(cell, device, dtype) -> dict:
    measure = cell["measure"]
    if cell["mode"] == "quality":
        return _measure_quality(cell, device, dtype)
    torch.manual_seed(0)
    choices = _implementation_choices(cell, device, dtype)
    with _kernel_identity(cell) as identity:
        first_call_s = _warm_up_libraries(cell, device, dtype)
    choices.update(identity)
    compiled_before = compiled_frames() if cell["backend"] == "compile" else 0
    if cell["mode"] == "decode":
        result = _measure_decode(cell, device, dtype)
        result["metrics"].update(choices)
        return _compile_record(cell, result, first_call_s, compiled_before)
    with PeakMemory(device) as peak:
        workload = BUILDERS[cell["target"]](cell, device, dtype)
        finite = _finite(workload.run())
    with usual_allocator():
        timing = time_callable(workload.run, warmup=measure["warmup"], device=device, flush_l2=measure["flush_l2"], **_sampling(measure))
    metrics = {
        **timing.summary(),
        "tokens": workload.tokens,
        "tokens_per_s": workload.tokens / timing.median_s,
        "peak_mem_bytes": peak.bytes,
        "memory_kind": peak.kind,
        "flops": workload.flops,
        "min_bytes": workload.min_bytes,
        "flops_per_s": workload.flops / timing.median_s,
        "torch_threads": torch.get_num_threads(),
        **choices,
    }
    if cell["target"] == "model":
        metrics["words_per_s"] = metrics["tokens_per_s"]
    return _compile_record(cell, _result(finite, metrics), first_call_s, compiled_before)


def _implementation_choices(cell, device, dtype) -> dict:
    """What the cell's attention core runs on inputs of the cell's shape (softmax: ``sdpa_backend``;
    fla: ``fla_kernel`` and ``chunk_size``), asked before anything runs, so that a pinned choice
    that cannot run them skips the cell with the core's reason (UnsupportedBackend). The inputs
    require grad in a train cell, as SDPA's dispatcher weighs that too."""
    core = _core(cell).to(device=device, dtype=dtype)
    return core.implementation_choices(**_attention_inputs(core, cell["axes"], device, dtype, cell["mode"] == "train"))


def _kernel_identity(cell):
    """A Triton cell's kernels over its warm-up call, where they compile and autotune (``variants.kernels.identity``:
    ``metrics.triton_version``, ``metrics.triton_kernels``); nothing for other backends."""
    if cell["backend"] != "triton":
        return contextlib.nullcontext({})
    from variants.kernels import identity

    return identity.recording()


def _compile_record(cell, result: dict, first_call_s: float, compiled_before: int) -> dict:
    """For a 'compile' cell: ``metrics.compile_s`` (the warm-up's first call: tracing, compiling
    and one run) and ``metrics.backend_options``; a CellError if anything compiled after the
    warm-up (a recompilation would have been timed)."""
    if cell["backend"] != "compile":
        return result
    again = compiled_frames() - compiled_before
    if again:
        raise CellError(f"torch.compile compiled {again} frame(s) again after the warm-up (a guard failed); the timings would include compilation")
    result["metrics"].update(compile_s=first_call_s, backend_options=cell.get("backend_options") or {})
    return result


def _measure_quality(cell, device, dtype) -> dict:
    """Train and evaluate the cell's registered task (``harness.tasks``); its metrics are the task's own."""
    task = tasks.get(cell["task"]["name"])
    if cell["axes"]["dtype"] not in TRAIN_DTYPES or (device.type != "cpu" and not task.any_device):
        where = "" if task.any_device else " on the CPU (axes.device: cpu)"
        raise CellError(f"task {task.name!r} trains in {', '.join(TRAIN_DTYPES)} (axes.dtype){where}")
    metrics = task.run(cell)
    return _result(bool(np.isfinite(metrics.get("loss", 0.0))), metrics)


def _warm_up_libraries(cell, device, dtype) -> float:
    """Build and run the cell once and throw it away, so that one-time costs of the process
    (thread pools, library initialisation, kernel selection, torch.compile's compilation of
    every form the cell calls: backend 'compile') stay out of the measured peak memory of the
    fresh build that follows and out of every timed call. Returns the seconds that first call
    took (``metrics.compile_s`` of a 'compile' cell); a compilation failure is a CellError."""
    clock = Clock(device, flush_l2=False)
    try:
        if cell["mode"] == "decode":
            with torch.no_grad():  # the decoder of the measurement (same shapes and strides), two steps: a growing KV cache recompiles once
                new_tokens = cell["decode"]["new_tokens"]
                _, prefill, step, _ = _decoder(cell, device, dtype, cell["axes"]["seq_len"], new_tokens)
                _, seconds = clock(lambda: functools.reduce(lambda state, i: step(i, state)[1], range(min(2, new_tokens)), prefill()[1]))
        else:
            _, seconds = clock(BUILDERS[cell["target"]](cell, device, dtype).run)
    except Exception as exc:
        if cell["backend"] == "compile" and _compile_failure(exc):
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
    axes, measure, new_tokens = cell["axes"], cell["measure"], cell["decode"]["new_tokens"]
    if cell["target"] not in ("core", "layer"):
        raise CellError(f"decode mode measures target 'core' or 'layer', not {cell['target']!r}")
    context, clock = axes["seq_len"], Clock(device, flush_l2=False)

    def decode_round():
        (_, state), prefill_s = clock(prefill)
        step_s = []
        for i in range(new_tokens):
            (out, state), seconds = clock(lambda: step(i, state))
            step_s.append(seconds)
        return prefill_s, step_s, _finite(out)

    with torch.no_grad():
        with PeakMemory(device) as peak:
            core, prefill, step, step_bytes = _decoder(cell, device, dtype, context, new_tokens)
            decode_round()
        with usual_allocator():
            for _ in range(measure["warmup"]):
                decode_round()
            rounds = []

            def timed_round():
                rounds.append(decode_round())
                return sum(rounds[-1][1])

            timing = sample_until_stable(timed_round, **_sampling(measure))
    finite = all(ok for _, _, ok in rounds)
    tokens = axes["batch"] * new_tokens
    flops = sum(core.step_flops(axes["batch"], axes["heads"], axes["d_value"], context + i) for i in range(new_tokens))
    metrics = {
        **timing.summary(),
        "tokens": tokens,
        "tokens_per_s": tokens / timing.median_s,
        "step_latency_s": np.median([step_s for _, step_s, _ in rounds], axis=0).tolist(),
        "prefill_median_s": float(np.median([prefill_s for prefill_s, _, _ in rounds])),
        "peak_mem_bytes": peak.bytes,
        "memory_kind": peak.kind,
        "state_numel": core.state_numel(axes["batch"], axes["heads"], axes["d_value"], context + new_tokens),
        "flops": flops,
        "min_bytes": sum(_state_traffic(core, axes, context + i) * torch.finfo(core.state_dtype(dtype)).bits // 8 + step_bytes for i in range(new_tokens)),
        "flops_per_s": flops / timing.median_s,
        "torch_threads": torch.get_num_threads(),
    }
    return _result(finite, metrics)


def _state_traffic(core, axes, position: int) -> int:
    """Elements of the decoding state one step at ``position`` must read and write: all of it
    read; written, what it adds (a KV cache) or all of it (a state of fixed size)."""
    before, after = (core.state_numel(axes["batch"], axes["heads"], axes["d_value"], length) for length in (position, position + 1))
    return before + (after - before if after != before else after)


def _decoder(cell, device, dtype, context, new_tokens):
    """``(core, prefill() -> (out, state), step(i, state) -> (out, state), step_bytes)`` for a
    decode cell; ``step_bytes``: what a step reads and writes besides the state (its token's
    inputs, its output, the weights)."""
    axes = cell["axes"]
    total = dict(axes, seq_len=context + new_tokens)
    if cell["target"] == "core":
        core = _core(cell).to(device=device, dtype=dtype)
        inputs = _attention_inputs(core, total, device, dtype, False)
        # the prompt in the core's layout and each token's inputs contiguous, so that no timed call copies them
        prompt = {name: variants.in_layout(x, core.input_layout) for name, x in variants.time_slice(inputs, 0, context).items()}
        tokens = [{name: x.contiguous() for name, x in variants.token_slice(inputs, context + i).items()} for i in range(new_tokens)]
        prefill = lambda: core.prefill(**prompt)  # noqa: E731
        step = lambda i, state: core.step(**tokens[i], state=state)  # noqa: E731
        output = axes["batch"] * axes["heads"] * axes["d_value"] * inputs["v"].element_size()
        return core, prefill, step, tensor_bytes(variants.token_slice(inputs, context).values()) + output + _module_bytes(core)
    layer = _layer(cell, device, dtype)
    x = torch.randn(axes["batch"], context + new_tokens, axes["heads"] * axes["d_value"], generator=_generator(device), device=device)
    x = x.to(dtype)
    step_bytes = 2 * tensor_bytes([x[:, context]]) + _module_bytes(layer)  # the token in, its output out, the weights
    return layer.core, (lambda: layer.prefill(x[:, :context])), (lambda i, state: layer.step(x[:, context + i], state)), step_bytes


def _result(finite: bool, metrics: dict) -> dict:
    return {"status": "ok" if finite else "nan", "error": None if finite else "the output contains NaN or Inf", "metrics": metrics}


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception means the device (or host) ran out of memory."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)

