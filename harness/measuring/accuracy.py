"""How far a timed cell computes from the float64 reference (issue 32): ``metrics.rel_error``.

The error of one tensor is the relative L2 error ‖y − y_ref‖₂ / ‖y_ref‖₂ (``precision.rel_error``);
a cell's is the largest over what it produces: the output (forward), the output and every input
gradient (train: for a layer also the weights' gradients, for a model the weights' only), the
generated steps' outputs (decode). The reference is the same function in float64 on the same
inputs (rounded to the cell's dtype first, so that only the arithmetic is judged), computed on a
slice of the batch (and for a core of the heads), ``REFERENCE_ROWS`` of each, since a quadratic
reference of every row could cost more than the cell: the timed form runs on the whole batch and
its slice is compared. A train cell's cotangent is random on that slice and zero elsewhere, so the
gradients of the slice are exactly those of the sliced reference. A packed cell's one row holds every
sequence: its reference runs each (``cu_seqlens``); a mixed decode batch is judged on its first.

The reference of a core is ``core.reference`` (the plainest form: quadratic, or a token loop) up to
``REFERENCE_MAX_TOKENS`` tokens, beyond them the torch backend's parallel form in float64 (which the
tests tie to ``core.reference`` at short lengths only). So that a parallel form wrong only at long T (a
plugin's) is not judged by itself, that float64 form's output is also compared with the core's step loop in
float64 (the recurrent form, other code, which ``attnbench check`` ties to the reference) on the compared
row and head, on the CPU, up to ``STEP_REFERENCE_MAX_TOKENS`` (``rel_error_step_loop``); beyond them, a
cell is judged by its own parallel form only, and its ``rel_error_reference`` says so. A core whose
parallel form only approximates its reference by design
(``approximates_reference``: LSH's sorted chunks once a bucket outgrows the window) is judged against the
function each form computes (``_exact_reference``). A layer or a model is its own twin in float64 with
the torch backend and the same weights, dropout off. Every call here is outside the timed calls.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import TYPE_CHECKING

import torch

from variants import AttentionCore
from variants.precision import REL_ERROR_TOLERANCE, rel_error

from .builders import build_core, build_layer, build_model, lengths_of

if TYPE_CHECKING:
    from ..scenarios.cell import Cell

#: Batch rows (and heads of a core) the reference runs on.
REFERENCE_ROWS = 1
#: Longest sequence ``core.reference`` runs on (a core's [T, T] or T-step float64 reference).
REFERENCE_MAX_TOKENS = 1024
#: Longest sequence beyond ``REFERENCE_MAX_TOKENS`` whose float64 parallel form is also checked against the float64
#: step loop on the CPU (one row and head, docs/results.md: 1.2-7.3 s at 16,384 tokens on a quiet 2-core VM, softmax the dearest).
STEP_REFERENCE_MAX_TOKENS = 16384
#: What ``rel_error_reference`` names: the core's plainest form; the torch backend's float64 form (a core's own
#: parallel form; a layer's or model's twin); that form with its output checked against the float64 step loop too.
REFERENCE, TORCH_FLOAT64, WITH_STEP_LOOP = "reference", "torch float64", "torch float64 + step loop"
#: How far beyond its plainest form's own error in the dtype a cell may be (``reference_floor``).
ILL_CONDITIONED_FACTOR = 10
#: The input of a packed row's offsets: passed to the reference as it is (the sliced row holds every sequence).
PACKED = "cu_seqlens"
#: The tolerance of float32 inputs multiplied in TF32 (10 bits of mantissa, as fp16): ``precision: tf32``.
TF32_TOLERANCE = REL_ERROR_TOLERANCE[torch.float16]


def tolerance(dtype: torch.dtype, params: dict) -> float:
    """The largest error the cell's dtype allows (``precision.REL_ERROR_TOLERANCE``); fp16's for
    float32 inputs the Triton kernels multiply in TF32 (``precision: tf32``)."""
    if dtype == torch.float32 and params.get("precision") == "tf32":
        return TF32_TOLERANCE
    return REL_ERROR_TOLERANCE[dtype]


def record(error: float, dtype: torch.dtype, params: dict, reference: str, floor: float | None = None) -> dict:
    """The accuracy metrics of a cell: ``rel_error``, ``rel_error_tolerance``, ``inaccurate``, what the
    reference was (``rel_error_reference``) on which rows (``rel_error_rows``) and, for a core, the
    error of its plainest form itself in the cell's dtype (``rel_error_floor``, ``reference_floor``):
    the tolerance is the dtype's, or ``ILL_CONDITIONED_FACTOR`` times that floor where the function
    is so ill-conditioned in the dtype that even the plainest form is further off."""
    bound = tolerance(dtype, params)
    if floor is not None and math.isfinite(floor):  # a plainest form that overflows in the dtype says nothing of the cell
        bound = max(bound, ILL_CONDITIONED_FACTOR * floor)
    return {
        "rel_error": error,
        "rel_error_tolerance": bound,
        "inaccurate": not error <= bound,  # NaN is inaccurate
        "rel_error_reference": reference,
        "rel_error_rows": REFERENCE_ROWS,
        **({} if floor is None else {"rel_error_floor": floor}),
    }


def reference_floor(double, inputs: dict, dtype: torch.dtype, leaves) -> float | None:
    """The error of a core's plainest form (``core.reference``) run in ``dtype`` against itself in
    float64, on the compared rows and the first ``REFERENCE_MAX_TOKENS`` tokens of ``inputs``
    (outputs and, with ``leaves``, their gradients, as the cell is judged): what the dtype can do
    on this function and these inputs. ReBased's normaliser a_t = Σ (q'·k')², taken through its
    features, is one such function in float32: its gradient's error grows as u·ā_t / a_t^1.5
    (ā_t: the same sum over |features|) where a_t is small. float32 only: in 16 bits the plainest
    forms keep 16-bit states (the delta rule's loop is 1e-2 off in bfloat16, where the cell's float32
    state is 1e-3 off), which says more of them than of the function. None without a reference."""
    if dtype != torch.float32 or not _defines_reference(double):
        return None
    narrow = copy.deepcopy(double).to(dtype)
    prefix = {name: _rows(x.detach(), 2)[:, :, :REFERENCE_MAX_TOKENS] for name, x in inputs.items() if name != PACKED}
    return forward_error(narrow.reference, double.reference, prefix, 2, leaves=leaves)


def twin(module: torch.nn.Module, build_torch, device) -> torch.nn.Module:
    """``build_torch()`` (the same module with the torch backend) in float64 on the cell's ``device``
    with ``module``'s parameters and buffers, in eval mode (no dropout)."""
    double = build_torch().to(device=device, dtype=torch.float64)
    double.load_state_dict(module.state_dict())
    return double.eval()


def _rows(x: torch.Tensor, dims: int) -> torch.Tensor:
    """The first REFERENCE_ROWS of each of the leading ``dims`` dimensions."""
    return x[(slice(0, REFERENCE_ROWS),) * dims]


def reference_inputs(inputs: dict, dims: int, grad: bool) -> dict:
    """The sliced inputs in float64 (float ones as leaves with ``grad``); a packed row's ``cu_seqlens`` as it is."""
    sliced = {name: _rows(x.detach(), dims).double() if x.is_floating_point() else _rows(x, dims) for name, x in inputs.items() if name != PACKED}
    sliced |= {name: x for name, x in inputs.items() if name == PACKED}
    return {name: x.requires_grad_(grad and x.is_floating_point()) for name, x in sliced.items()}


def _cotangent(output: torch.Tensor, dims: int, generator: torch.Generator) -> torch.Tensor:
    """Random on the compared rows, zero elsewhere."""
    cotangent = torch.zeros_like(output)
    rows = _rows(cotangent, dims)
    rows.copy_(torch.randn(rows.shape, generator=generator, device=output.device, dtype=torch.float32))
    return cotangent


def forward_error(module, reference, inputs: dict, dims: int, *, leaves=(), weights: bool = False) -> float:
    """The largest error of ``module(**inputs)`` against ``reference`` on the sliced float64 inputs;
    with ``leaves`` (names of inputs) also of their gradients' rows, with ``weights`` of all the
    weights' gradients as one vector (a tensor of tiny gradients alone would weigh as much as the
    largest), under a cotangent random on the compared rows and zero elsewhere."""
    sliced = reference_inputs(inputs, dims, bool(leaves))
    if not leaves and not weights:
        with torch.no_grad():
            return rel_error(_rows(module(**inputs), dims), reference(**sliced))
    given = {name: x.detach().requires_grad_(name in leaves) for name, x in inputs.items()}
    output, expected = module(**given), reference(**sliced)
    cotangent = _cotangent(output, dims, torch.Generator(output.device).manual_seed(1))
    owners = (list(module.parameters()), list(reference.parameters())) if weights else ([], [])
    actual = torch.autograd.grad(output, [given[name] for name in leaves] + owners[0], cotangent)
    wanted = torch.autograd.grad(expected, [sliced[name] for name in leaves] + owners[1], _rows(cotangent, dims).double())
    errors = [rel_error(_rows(output, dims), expected)]
    errors += [rel_error(_rows(a, dims), w) for a, w in zip(actual[: len(leaves)], wanted)]
    if weights:
        errors.append(rel_error(_flat(actual[len(leaves) :]), _flat(wanted[len(leaves) :])))
    return max(errors)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.double().flatten() for t in tensors])


# --- a cell's error ------------------------------------------------------------------------


def measure(cell: Cell, device, dtype, workload) -> dict:
    """The accuracy metrics (``record``) of a forward or train cell: the timed workload's module on
    its inputs against its float64 reference; train: also the input gradients (core, layer) or the
    weights' gradients (a model, whose inputs are tokens); a long core cell's float64 parallel form also against
    its step loop (``step_loop_error``: the cell's error is the larger). Dropout is off meanwhile."""
    module, inputs, train = workload.module, workload.inputs, cell.mode == "train"
    if cell.target == "core":
        double = twin(module, lambda: build_core(cell, "torch"), device)
        reference, name = _exact_reference(double, cell.axes["seq_len"])
        leaves = [name for name, x in inputs.items() if x.is_floating_point()] if train else ()
        with _without_dropout(module):
            error = forward_error(module, reference, inputs, 2, leaves=leaves)
        floor = reference_floor(double, inputs, dtype, leaves)
        if not _steps_checked(double, inputs, cell.axes["seq_len"]):
            return record(error, dtype, cell.params, name, floor)
        steps = step_loop_error(double, inputs)
        return record(max(error, steps), dtype, cell.params, WITH_STEP_LOOP, floor) | {"rel_error_step_loop": steps}
    if cell.target == "layer":
        double = twin(module, lambda: build_layer(cell, device, torch.float64, "torch"), device)
    else:
        double = twin(module, lambda: build_model(cell, device, torch.float64, "torch")[0], device)
    with _without_dropout(module):
        error = forward_error(module, double, inputs, 1, leaves=("x",) if train and "x" in inputs else (), weights=train and "x" not in inputs)
    return record(error, dtype, cell.params, TORCH_FLOAT64)


def measure_decode(cell: Cell, device, dtype, decoder) -> dict:
    """The accuracy metrics of a decode cell: the timed decoder's generated steps (after a fresh
    prefill) against the reference over prompt and steps, at the steps' positions (of the first
    sequence, prefilled to its own length in a cell of mixed lengths)."""
    context, new_tokens = lengths_of(cell)[0] if cell.lengths is not None else cell.axes["seq_len"], cell.decode["new_tokens"]
    with torch.no_grad():
        _, state = decoder.prefill()
        steps = []
        for i in range(new_tokens):
            out, state = decoder.step(i, state)
            steps.append(out)
        if cell.target == "core":
            reference, name = _exact_reference(twin(decoder.module, lambda: build_core(cell, "torch"), device), decoder.inputs["q"].shape[2], steps=True)
            expected = reference(**reference_inputs(decoder.inputs, 2, False))[:, :, context : context + new_tokens]
            return record(rel_error(_rows(torch.stack(steps, 2), 2), expected), dtype, cell.params, name)
        double = twin(decoder.module, lambda: build_layer(cell, device, torch.float64, "torch"), device)
        expected = double(**reference_inputs(decoder.inputs, 1, False))[:, context:]
        return record(rel_error(_rows(torch.stack(steps, 1), 1), expected), dtype, cell.params, TORCH_FLOAT64)


def _steps_checked(core, inputs: dict, length: int) -> bool:
    """Whether a core cell's float64 parallel form is checked against its step loop: beyond ``REFERENCE_MAX_TOKENS``
    (where it replaced ``core.reference``) up to ``STEP_REFERENCE_MAX_TOKENS``, for a core with a reference whose
    parallel form computes it (not LSH's), on one sequence (a packed row's steps would cross its boundaries)."""
    within = REFERENCE_MAX_TOKENS < length <= STEP_REFERENCE_MAX_TOKENS
    return within and _defines_reference(core) and not core.approximates_reference and PACKED not in inputs


def step_loop_error(core, inputs: dict) -> float:
    """The error of the float64 ``core``'s parallel form against its step loop (the recurrent form, token by token)
    on the compared row and head of ``inputs``, both in float64 on the CPU: the same function computed by other
    code, so a parallel form wrong only at long T is not judged by itself."""
    cpu = copy.deepcopy(core).cpu()
    sliced = {name: x.cpu() for name, x in reference_inputs(inputs, 2, False).items()}
    with torch.no_grad():
        return rel_error(cpu(**sliced), cpu.step_loop(sliced)[0])


def _exact_reference(core, length: int, *, steps: bool = False):
    """The float64 reference of a core and its name: ``core.reference`` up to
    ``REFERENCE_MAX_TOKENS`` tokens, the torch form beyond or where the variant defines no
    reference (a plugin's may not). A core whose parallel form approximates its reference
    (``approximates_reference``, LSH) is judged against the function each form computes: its
    parallel form against itself in float64, its ``steps`` (the exact definition) against the
    reference at any length."""
    exact = steps if core.approximates_reference else length <= REFERENCE_MAX_TOKENS
    return (core.reference, REFERENCE) if exact and _defines_reference(core) else (core, TORCH_FLOAT64)


def _defines_reference(core) -> bool:
    return type(core)._reference is not AttentionCore._reference


@contextlib.contextmanager
def _without_dropout(module):
    """``module`` in eval mode meanwhile if it has dropout (its twin has none); untouched otherwise,
    so that a compiled module is not compiled again for another mode."""
    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules())
    training = module.training
    if dropout:
        module.eval()
    try:
        yield
    finally:
        module.train(training)
