"""Which Triton kernels a call launched and how they were built (issue 32, item 4).

Inside ``with recording() as identity:`` every launch through ``_common.launch`` is noted; when the block
exits, ``identity`` holds ``triton_version`` and ``triton_kernels``, one entry per kernel in the order of their
first launch, named as ``attnbench kernels`` names them:

- ``source_hash``: sha256 of the kernel's source and of every @triton.jit function of this package it calls,
  transitively (``source_hash``; the same natively and under the interpreter, unlike Triton's ``cache_key``);
- ``config``: the constexprs and options it ran with (an autotuned kernel's: the chosen candidate's; values
  JSON has no type for as text);
- ``autotune``: null for a kernel without candidates, else how the candidate was chosen: ``timing`` (Triton
  timed the candidates here), ``only candidate`` (one was left after pruning), ``earlier call`` (chosen before
  the recording, by this process), ``interpreter: first candidate, untimed`` (``_common.launch``);
- ``compile_s``: the seconds Triton spent compiling it, or loading it from its on-disk cache, during the recording
  (between its ``jit_cache_hook`` and ``jit_post_compile_hook``), 0.0 when this process had compiled it already;
  null under the interpreter, where nothing compiles;
- ``tune_s``: the seconds the autotuner spent timing candidates (``timing`` only, else null).

A cell of the ``fla`` backend records ``fla_version`` and ``triton_version`` (``fla_identity``) beside the fla op
it calls (``fla_backend``'s ``implementation_choices``): fla's kernels are not launched through ``_common.launch``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import time
import types

import triton

#: The kernels noted while ``recording`` (None outside it), by name.
entries: dict[str, dict] | None = None
_current: str | None = None  #: the kernel being launched, whose entry Triton's compile hooks add to
_compile_started: float = 0.0
_previous_hooks: tuple = (None, None)  #: Triton's JIT compile hooks before ``recording``, called in turn


def fla_identity() -> dict:
    """``fla_version`` (flash-linear-attention's ``__version__``, package fla-core) and ``triton_version``: what an fla
    cell's kernels were built from."""
    import fla

    return {"fla_version": fla.__version__, "triton_version": triton.__version__}


def python_function(kernel):
    """The Python function under a @triton.jit function, an autotuned one or the interpreter's."""
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


@functools.cache
def source_hash(function) -> str:
    """sha256 of ``function``'s source (a kernel's Python function) and of every @triton.jit function of its top
    package that it reads by a global name (or as ``module.name``), transitively."""
    sources, pending, package = {}, [function], function.__module__.split(".")[0]
    while pending:
        current = pending.pop()
        name = f"{current.__module__}.{current.__qualname__}"
        if name in sources:
            continue
        sources[name] = inspect.getsource(current)
        names = current.__code__.co_names
        for value in map(current.__globals__.get, names):
            for found in [getattr(value, n, None) for n in names] if isinstance(value, types.ModuleType) else [value]:
                called = python_function(found)
                if called is not found and inspect.isfunction(called) and called.__module__.split(".")[0] == package:
                    pending.append(called)
    return hashlib.sha256("".join(f"{name}\n{text}\n" for name, text in sorted(sources.items())).encode()).hexdigest()


def _compile_starts(**kwargs):
    global _compile_started
    _compile_started = time.perf_counter()
    return _previous_hooks[0] and _previous_hooks[0](**kwargs)  # a true value makes Triton skip the compilation


def _compile_ends(**kwargs):
    if entries is not None and _current in entries:
        entries[_current]["compile_s"] += time.perf_counter() - _compile_started
    return _previous_hooks[1] and _previous_hooks[1](**kwargs)


@contextlib.contextmanager
def recording():
    """Note the launches of the block (module docstring); the dict it yields is filled when the block exits.
    Triton's JIT compile hooks are ours meanwhile (hooks set before are called in turn, and restored); not reentrant."""
    global entries, _previous_hooks
    if entries is not None:
        raise RuntimeError("kernel identity: recording is not reentrant")
    hooks = triton.knobs.runtime
    identity, entries, _previous_hooks = {"triton_version": triton.__version__, "triton_kernels": []}, {}, (hooks.jit_cache_hook, hooks.jit_post_compile_hook)
    hooks.jit_cache_hook, hooks.jit_post_compile_hook = _compile_starts, _compile_ends
    try:
        yield identity
    finally:
        identity["triton_kernels"] = list(entries.values())
        entries, (hooks.jit_cache_hook, hooks.jit_post_compile_hook) = None, _previous_hooks


def note(name: str, kernel, run, constexprs: dict, options: dict, tuner=None) -> None:
    """``run()`` (the launch of ``kernel``, with ``options``) noted as ``name``; ``tuner``: the Autotuner it was
    chosen from (``kernel`` is then the tuner itself natively, its first candidate's function in the interpreter)."""
    global _current
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    entry = entries.setdefault(name, {
        "kernel": name, "source_hash": source_hash(python_function(kernel)), "config": None, "autotune": None,
        "compile_s": None if interpreted else 0.0, "tune_s": None,
    })  # fmt: skip
    before = (len(tuner.cache), getattr(tuner, "bench_time", None)) if tuner is not None and not interpreted else None
    _current = name
    try:
        run()
    finally:
        _current = None
    config = {**constexprs, **(tuner.best_config.all_kwargs() if before else options)}
    entry["config"] = {key: value if isinstance(value, (bool, int, float, str, type(None))) else str(value) for key, value in config.items()}
    if interpreted and tuner is not None:
        entry["autotune"] = "interpreter: first candidate, untimed"
    elif before:
        chose = len(tuner.cache) > before[0] or len(tuner.configs) == 1  # (a lone config is not cached)
        timed = chose and getattr(tuner, "bench_time", None) is not before[1]
        entry["autotune"] = "timing" if timed else "only candidate" if chose else entry["autotune"] or "earlier call"
        entry["tune_s"] = tuner.bench_time if timed else entry["tune_s"]
