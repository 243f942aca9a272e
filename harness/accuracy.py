"""How far a timed cell computes from the float64 reference (issue 32): ``metrics.rel_error``.

The error of one tensor is the relative L2 error ‖y − y_ref‖₂ / ‖y_ref‖₂ (``precision.rel_error``);
a cell's is the largest over what it produces: the output (forward), the output and every input
gradient (train: for a layer also the weights' gradients, for a model the weights' only), the
generated steps' outputs (decode). The reference is the same function in float64 on the same
inputs (rounded to the cell's dtype first, so that only the arithmetic is judged), computed on a
slice of the batch (and for a core of the heads), ``REFERENCE_ROWS`` of each, since a quadratic
reference of every row could cost more than the cell: the timed form runs on the whole batch and
its slice is compared. A train cell's cotangent is random on that slice and zero elsewhere, so the
gradients of the slice are exactly those of the sliced reference.

The reference of a core is ``core.reference`` (the plainest form: quadratic, or a token loop) up to
``REFERENCE_MAX_TOKENS`` tokens, beyond them the torch backend's parallel form in float64 (which the
tests tie to ``core.reference``); a layer or a model is its own twin in float64 with the torch
backend and the same weights, dropout off. Every call here is outside the timed calls.
"""

from __future__ import annotations

import contextlib

import torch

from variants import AttentionCore
from variants.precision import REL_ERROR_TOLERANCE, rel_error

from .builders import build_core, build_layer, build_model

#: Batch rows (and heads of a core) the reference runs on.
REFERENCE_ROWS = 1
#: Longest sequence ``core.reference`` runs on (a core's [T, T] or T-step float64 reference).
REFERENCE_MAX_TOKENS = 1024
#: The tolerance of float32 inputs multiplied in TF32 (10 bits of mantissa, as fp16): ``precision: tf32``.
TF32_TOLERANCE = REL_ERROR_TOLERANCE[torch.float16]


def tolerance(dtype: torch.dtype, params: dict) -> float:
    """The largest error the cell's dtype allows (``precision.REL_ERROR_TOLERANCE``); fp16's for
    float32 inputs the Triton kernels multiply in TF32 (``precision: tf32``)."""
    if dtype == torch.float32 and params.get("precision") == "tf32":
        return TF32_TOLERANCE
    return REL_ERROR_TOLERANCE[dtype]


def record(error: float, dtype: torch.dtype, params: dict, reference: str) -> dict:
    """The accuracy metrics of a cell: ``rel_error``, ``rel_error_tolerance``, ``inaccurate``, and
    what the reference was (``rel_error_reference``) on which rows (``rel_error_rows``)."""
    bound = tolerance(dtype, params)
    return {
        "rel_error": error,
        "rel_error_tolerance": bound,
        "inaccurate": not error <= bound,  # NaN is inaccurate
        "rel_error_reference": reference,
        "rel_error_rows": REFERENCE_ROWS,
    }


def twin(module: torch.nn.Module, build_torch) -> torch.nn.Module:
    """``build_torch()`` (the same module with the torch backend) in float64 with ``module``'s
    parameters and buffers, in eval mode (no dropout)."""
    double = build_torch().to(device=_device_of(module), dtype=torch.float64)
    double.load_state_dict(module.state_dict())
    return double.eval()


def _device_of(module) -> torch.device:
    tensor = next(iter(module.state_dict().values()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _rows(x: torch.Tensor, dims: int) -> torch.Tensor:
    """The first REFERENCE_ROWS of each of the leading ``dims`` dimensions."""
    return x[(slice(0, REFERENCE_ROWS),) * dims]


def reference_inputs(inputs: dict, dims: int, grad: bool) -> dict:
    """The sliced inputs in float64 (float ones as leaves with ``grad``)."""
    sliced = {name: _rows(x.detach(), dims).double() if x.is_floating_point() else _rows(x, dims) for name, x in inputs.items()}
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


def measure(cell: dict, device, dtype, workload) -> dict:
    """The accuracy metrics (``record``) of a forward or train cell: the timed workload's module on
    its inputs against its float64 reference; train: also the input gradients (core, layer) or the
    weights' gradients (a model, whose inputs are tokens). Dropout is off meanwhile."""
    module, inputs, train = workload.module, workload.inputs, cell["mode"] == "train"
    if cell["target"] == "core":
        reference, name = _exact_reference(twin(module, lambda: build_core(cell, "torch")), cell["axes"]["seq_len"])
        with _without_dropout(module):
            error = forward_error(module, reference, inputs, 2, leaves=list(inputs) if train else ())
        return record(error, dtype, cell["params"], name)
    if cell["target"] == "layer":
        double = twin(module, lambda: build_layer(cell, device, torch.float64, "torch"))
    else:
        double = twin(module, lambda: build_model(cell, device, torch.float64, "torch")[0])
    with _without_dropout(module):
        error = forward_error(module, double, inputs, 1, leaves=("x",) if train and "x" in inputs else (), weights=train and "x" not in inputs)
    return record(error, dtype, cell["params"], "torch float64")


def measure_decode(cell: dict, device, dtype, decoder) -> dict:
    """The accuracy metrics of a decode cell: the timed decoder's generated steps (after a fresh
    prefill) against the reference over prompt and steps, at the steps' positions."""
    context, new_tokens = cell["axes"]["seq_len"], cell["decode"]["new_tokens"]
    with torch.no_grad():
        _, state = decoder.prefill()
        steps = []
        for i in range(new_tokens):
            out, state = decoder.step(i, state)
            steps.append(out)
        if cell["target"] == "core":
            reference, name = _exact_reference(twin(decoder.module, lambda: build_core(cell, "torch")), context + new_tokens)
            expected = reference(**reference_inputs(decoder.inputs, 2, False))[:, :, context:]
            return record(rel_error(_rows(torch.stack(steps, 2), 2), expected), dtype, cell["params"], name)
        double = twin(decoder.module, lambda: build_layer(cell, device, torch.float64, "torch"))
        expected = double(**reference_inputs(decoder.inputs, 1, False))[:, context:]
        return record(rel_error(_rows(torch.stack(steps, 1), 1), expected), dtype, cell["params"], "torch float64")


def _exact_reference(core, length: int):
    """The float64 reference of a core and its name: ``core.reference`` up to
    ``REFERENCE_MAX_TOKENS`` tokens, the torch form beyond or where the variant defines no
    reference (a plugin's may not)."""
    defined = type(core)._reference is not AttentionCore._reference
    return (core.reference, "reference") if defined and length <= REFERENCE_MAX_TOKENS else (core, "torch float64")


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
