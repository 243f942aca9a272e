"""``backend='compile'``: a core's PyTorch forms through ``torch.compile``.

``wrap`` replaces the parallel form, ``prefill`` and ``step`` of a torch core by
``torch.compile``'d ones (TorchDynamo captures the graph, TorchInductor generates C++/OpenMP
code on the CPU and Triton kernels on a GPU). The argument checks of ``forward``, ``step`` and
``prefill`` stay eager; only the computation behind them is compiled. Compilation is lazy: it
happens at the first call of each form with a new input shape, so a benchmark runs each form
once before timing it (``harness.running.workloads`` does, and records the first call as
``metrics.compile_s``). ``compiled_frames()`` counts frames compiled so far in the process,
so a caller can check that no timed call compiled anything.
"""

from __future__ import annotations

import torch

#: ``torch.compile``'s modes (its ``mode`` argument); None is its default.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: The options ``backend='compile'`` takes (scenario ``backend_options``): name -> (accepts(value), what it accepts).
OPTIONS = {
    "mode": (lambda value: isinstance(value, str) and value in MODES, ", ".join(MODES)),
    "dynamic": (lambda value: value is None or isinstance(value, bool), "true, false or null (torch.compile's automatic dynamic shapes)"),
}
#: The forms compiled: the parallel form, the prefill (parallel form with a state) and the decode step.
FORMS = ("_parallel", "_prefill", "_step")


def wrap(core, *, mode: str | None = None, dynamic: bool | None = None):
    """Make ``core``'s parallel form, prefill and step ``torch.compile``'d (in place; returns it)."""
    for form in FORMS:
        setattr(core, form, torch.compile(getattr(core, form), mode=mode, dynamic=dynamic))
    core.compiled = True
    core.compile_options = {"mode": mode or "default", "dynamic": dynamic}
    return core


def chunk_form(core, body):
    """``body`` (one chunk of a loop scan, ``chunked.sum_rule_chunk``, ...) as ``core`` runs it: itself
    eagerly, or ``torch.compile``'d once per core with its options under backend 'compile'. The loop
    over the chunks is kept out of the compiled graphs (``chunked.outside_compiled_graphs``) and calls it, so
    the graph is one chunk's whatever T."""
    if not core.compiled:
        return body
    bodies = core.__dict__.setdefault("_compiled_chunks", {})
    if body not in bodies:
        options = core.compile_options
        bodies[body] = torch.compile(body, mode=None if options["mode"] == "default" else options["mode"], dynamic=options["dynamic"])
    return bodies[body]


def compiled_frames() -> int:
    """Frames TorchDynamo has compiled in this process so far (its ``frames.ok`` counter)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]
