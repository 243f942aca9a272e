"""A variant's forms checked against its float64 reference: ``attnbench check VARIANT`` and a pytest helper.

``check_variant(name, params)`` builds the variant on the CPU and checks, one ``Check`` (one line) each:

* its interface: ``d_dot``, and ``flops``, ``step_flops``, ``state_numel`` (the harness's FLOP, roofline and
  memory columns read them) answer a non-negative int;
* every form against the float64 ``reference`` on the same inputs: the parallel form (at each chunk
  size and scan the variant declares as parameters, ``chunk_size`` and ``scan``), the recurrent step
  loop, and decoding after a prefill (a prefill, a prefill continuing from its state, then steps);
  the output and the gradient of every input (q, k, v and each token input) and learnable parameter,
  at awkward lengths (1, each chunk boundary ±1, a prime, a longer one), in float64, float32 and
  bfloat16, each judged by its relative L2 error against ``precision.REL_ERROR_TOLERANCE``;
* the outputs of the parallel form and the step loop at ``LONGEST`` tokens, beyond the 1,024 up to which a timed
  cell is judged against ``reference`` (beyond them against its float64 parallel form and step loop), in float64
  on one row and head: a parallel form wrong only at long T fails there, named so;
* packed sequences (``cu_seqlens``) and a right-padded batch decoded (``prefill(lengths=)``), where
  the core takes them.

A failure names its cause: the form, the input whose gradient is wrong or not connected to the
output, the interface method that is missing and what it is for (base.py's NotImplementedError
says so), ``d_dot`` left at its default where the forms fail on a shape. The tests' own
``helpers.check_forms`` is ``compare_forms`` below. In a researcher's tests::

    from variants.checking import check_variant

    def test_my_rule():
        check_variant("my_rule", {"chunk_size": 16}).assert_ok()
"""

from __future__ import annotations

import dataclasses
import math
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import params as declared_params
from .base import registered
from .errors import VariantError
from .inputs import time_slice
from .precision import REL_ERROR_TOLERANCE, rel_error

#: The dtypes every form is checked in, each against the float64 reference.
DTYPES = (torch.float64, torch.float32, torch.bfloat16)
#: The shape of the checked inputs: small, so that one variant takes seconds on a CPU.
BATCH, HEADS, D_KEY, D_VALUE = 2, 2, 8, 6
#: Lengths besides 1 and each chunk boundary ±1: a prime and a longer one (several chunks of each size).
PRIME, LONG = 37, 100
#: The chunk sizes of a variant that declares ``chunk_size``, unless one is given (16 divides by 4: T=16 ± 1 straddles both).
CHUNK_SIZES = (4, 16)
#: A length beyond the 1,024 tokens up to which a timed cell's reference is ``core.reference``
#: (``harness.measuring.accuracy.REFERENCE_MAX_TOKENS``): checked in float64 on one row and head.
LONGEST = 1100
#: Packed sequences (``cu_seqlens``) and a right-padded batch's rows: their lengths.
PACKED = (5, 12, 23)
PADDED = (17, 9)
#: A torch error about shapes that do not fit (where ``d_dot`` left at its default is the likely cause).
SHAPE_ERROR = re.compile(r"shape|size of tensor|must match|cannot be multiplied|dimension", re.IGNORECASE)


@dataclass(frozen=True)
class Check:
    """One check: what it compared (or asked), its largest relative error over what it compared
    (``parts``: each compared tensor's) and the tolerance, the cause of a failure, or why it was skipped."""

    what: str
    error: float | None = None
    tolerance: float | None = None
    cause: str | None = None
    skipped: str | None = None
    parts: dict = field(default_factory=dict)
    #: the compared form's output, for comparing the forms with each other
    output: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.cause is None and (self.error is None or self.error <= self.tolerance)

    @property
    def wrong(self) -> list[str]:
        """The compared tensors beyond the tolerance ("output", "d/dk")."""
        return [name for name, error in self.parts.items() if not error <= self.tolerance]

    def line(self) -> str:
        """``ok    what  max rel error 3.1e-08 ≤ 1e-04`` (FAIL with its cause; skip with its reason)."""
        if self.skipped:
            return f"skip  {self.what}: {self.skipped}"
        measured = "" if self.error is None else f"  max rel error {self.error:.1e} {'≤' if self.error <= self.tolerance else '>'} {self.tolerance:.0e}"
        cause = self.cause or (f"{', '.join(self.wrong)} wrong" if self.wrong else None)
        return f"{'ok' if self.ok else 'FAIL':4}  {self.what}{measured}{f': {cause}' if cause else ''}"


@dataclass
class CheckReport:
    """Every check of one variant, in order."""

    variant: str
    checks: list[Check] = field(default_factory=list)

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]

    def lines(self) -> list[str]:
        return [check.line() for check in self.checks]

    def summary(self) -> str:
        failed = len(self.failures)
        return f"{self.variant}: {len(self.checks)} checks, " + (f"{failed} failed" if failed else "all ok")

    def assert_ok(self) -> None:
        """Raise AssertionError listing the failed checks (for a test)."""
        if self.failures:
            raise AssertionError("\n".join([self.summary(), *(check.line() for check in self.failures)]))


# --- inputs --------------------------------------------------------------------------


def make_inputs(core, batch, heads, length, d_value, *, dtype, seed, requires_grad=False) -> dict:
    """``core.example_inputs`` drawn in float64 from ``seed`` and cast to ``dtype`` (the same values
    for every dtype), so that a form in ``dtype`` and the float64 reference see the same inputs.
    ``d_value`` is d_key for a per-channel core (RWKV)."""
    d_value = core.d_key if core.d_value_is_d_key else d_value
    inputs = core.example_inputs(batch, heads, length, d_value, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return cast_inputs(inputs, dtype, requires_grad)


def cast_inputs(inputs: dict, dtype, requires_grad=False) -> dict:
    """The same inputs in ``dtype``, detached (as new leaves when ``requires_grad``)."""
    return {name: x.detach().to(dtype).requires_grad_(requires_grad) for name, x in inputs.items()}


# --- why something failed ----------------------------------------------------------------


def _where(exc: BaseException) -> str:
    """`` (at file:line in function)``: the innermost frame of ``exc`` outside torch, if any."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if f"{Path('torch')}/" not in frame.filename.replace("\\", "/")]
    if not frames or exc.__traceback__ is None:
        return ""
    frame = frames[-1]
    return f" (at {Path(frame.filename).name}:{frame.lineno} in {frame.name})"


def explain(exc: BaseException) -> str:
    """One line: the exception and where it was raised (base.py's NotImplementedError names the
    missing method and what the interface expects of it)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}{_where(exc)}"


def _unconnected(form: str, name: str) -> str:
    return (
        f"the gradient to {name} is not connected: does the {form} use {name} through a detached tensor "
        f"(.detach(), .data, torch.no_grad(), a new tensor made from its values)?"
    )


# --- one set of inputs: every form against the float64 reference ----------------------------


@dataclass
class Target:
    """What the float64 reference computes on one set of inputs: its output, the cotangent a
    backward pass is seeded with, and the gradient of every input and learnable parameter (None:
    not connected in the reference itself)."""

    inputs: dict
    output: torch.Tensor
    cotangent: torch.Tensor
    grads: dict[str, torch.Tensor | None]


def reference_target(reference, inputs: dict, *, backward=True, cotangent=None, seed=0, call=None) -> Target:
    """``reference.reference`` (or ``call(**inputs)``) in float64 on ``inputs``, its output and, with
    ``backward``, the gradients of the inputs and learnable parameters for ``cotangent`` (default:
    random, nonzero everywhere)."""
    exact = cast_inputs(inputs, torch.float64, requires_grad=backward)
    output = (call or reference.reference)(**exact)
    if cotangent is None:
        cotangent = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    grads = {}
    if backward:
        learnable = {name: p for name, p in reference.named_parameters() if p.requires_grad}
        leaves = {**exact, **learnable}
        found = torch.autograd.grad((output * cotangent).sum(), list(leaves.values()), allow_unused=True) if output.requires_grad else [None] * len(leaves)
        grads = dict(zip(leaves, found))
    return Target(inputs, output.detach(), cotangent, grads)


def judge_form(core, form: str, run: Callable[[dict], torch.Tensor], target: Target, dtype, *, label: str = "", against: str = "float64 reference") -> Check:
    """``run`` (a form of ``core`` on the inputs in ``dtype``) against ``target``: its output where the
    cotangent is nonzero and, where ``target`` has gradients, the gradient of each input and learnable
    parameter; one check, its error the largest. A form that raises fails naming the exception."""
    backward = bool(target.grads)
    what = f"{label}{form} vs {against}: output" + "".join(f", d/d{name}" for name in target.grads)
    tolerance = REL_ERROR_TOLERANCE[dtype]
    low = cast_inputs(target.inputs, dtype, requires_grad=backward)
    try:
        out = run(low)
    except Exception as exc:  # noqa: BLE001 - the researcher's code: any error is a finding
        return Check(what, tolerance=tolerance, cause=f"the {form} raised {explain(exc)}")
    if wrong := _not_a_tensor_of(out, target.output.shape, dtype):
        return Check(what, tolerance=tolerance, cause=wrong)
    kept = target.cotangent != 0
    parts = {"output": rel_error(out[kept], target.output[kept])}

    def failed(cause: str) -> Check:
        """The check failed for ``cause``, with what was compared so far."""
        return Check(what, tolerance=tolerance, parts=parts, output=out.detach(), cause=cause)

    if backward:
        learnable = {name: p for name, p in core.named_parameters() if p.requires_grad}
        leaves = {**low, **learnable}
        if not out.requires_grad:
            return failed(f"the {form}'s output is connected to no input (computed under torch.no_grad() or from detached tensors?)")
        try:
            grads = torch.autograd.grad((out * target.cotangent.to(dtype)).sum(), list(leaves.values()), allow_unused=True)
        except Exception as exc:  # noqa: BLE001
            return failed(f"the {form}'s backward raised {explain(exc)}")
        for name, grad in zip(leaves, grads, strict=True):
            want = target.grads[name]
            if want is None:
                return failed(_unconnected("float64 reference", name))
            if not want.abs().max() > 0:
                return failed(f"the float64 reference's d/d{name} is zero on these inputs: the check would say nothing")
            if grad is None:
                return failed(_unconnected(form, name))
            parts[f"d/d{name}"] = rel_error(grad, want)
    return Check(what, max(parts.values(), key=lambda error: math.inf if math.isnan(error) else error), tolerance, parts=parts, output=out.detach())


def _not_a_tensor_of(out, shape, dtype) -> str | None:
    """Why ``out`` (what a form returned) is not a ``dtype`` tensor of ``shape``, or None."""
    if isinstance(out, torch.Tensor) and out.shape == shape and out.dtype == dtype:
        return None
    got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
    return f"expected a {dtype} tensor of shape {tuple(shape)}, got {got}"


def compare_forms(core, reference, inputs: dict, dtype, *, backward=True, cotangent=None, seed=0, label="") -> list[Check]:
    """The parallel form and the step loop of ``core`` (in ``dtype``) against ``reference.reference``
    in float64 (``reference``: a core with the same parameter values) on the same ``inputs``: the
    outputs where ``cotangent`` is nonzero (default: random, nonzero everywhere) and, with
    ``backward``, the gradients of every input and learnable parameter (a zero reference gradient
    fails: it would test nothing). The checks of ``tests/helpers.check_forms``."""
    try:
        target = reference_target(reference, inputs, backward=backward, cotangent=cotangent, seed=seed)
    except Exception as exc:  # noqa: BLE001
        return [Check(f"{label}float64 reference", cause=f"the reference raised {explain(exc)}")]
    forms = {"parallel form": lambda x: core(**x), "step loop": lambda x: core.step_loop(x)[0]}
    return _with_hints({form: judge_form(core, form, run, target, dtype, label=label) for form, run in forms.items()})


def _with_hints(checks: dict[str, Check]) -> list[Check]:
    """The checks of the forms on one set of inputs, each failure told what the others say: a gradient
    wrong where the output is right (the backward), one form wrong where another is right (which)."""
    hinted = []
    for form, check in checks.items():
        wrong, agreeing = check.wrong, [other for other, found in checks.items() if found.parts and "output" not in found.wrong]
        if check.cause is None and wrong and "output" not in wrong:
            cause = f"the output is right, {' and '.join(wrong)} is not: the backward of the {form} is wrong (a custom autograd.Function?)"
            check = dataclasses.replace(check, cause=cause)
        elif check.cause is None and "output" in wrong and agreeing:
            where = " (its _step or init_state)" if form == "step loop" else " (its _prefill, or _step after it)" if form.startswith("prefill") else ""
            check = dataclasses.replace(check, cause=f"{', '.join(wrong)} wrong; the {agreeing[0]} agrees with the reference: the {form} differs{where}")
        elif check.cause is None and "output" in wrong and (alike := _alike(form, check, checks)):
            check = dataclasses.replace(check, cause=f"{', '.join(wrong)} wrong; {alike}: is _reference right?")
        hinted.append(check)
    return hinted


def _alike(form: str, check: Check, checks: dict[str, Check]) -> str | None:
    """``the parallel form agrees with it (rel error 1e-16)``: another form whose output, wrong too, is this one's."""
    for other, found in checks.items():
        if other != form and found.output is not None and check.output is not None and found.output.shape == check.output.shape:
            error = rel_error(check.output, found.output)
            if error <= check.tolerance:
                return f"the {other} agrees with it (rel error {error:.1e})"
    return None


# --- the whole variant -----------------------------------------------------------------


def check_variant(name: str, params: dict | None = None, *, d_key: int = D_KEY, d_value: int = D_VALUE, seed: int = 0, dtypes=DTYPES) -> CheckReport:
    """Every check of variant ``name`` built with ``params`` (the module docstring); a registered
    plugin's variant as any other. ``report.assert_ok()`` fails a test with the failed lines."""
    params = dict(params or {})
    report = CheckReport(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors of a few hundred elements: one thread is several times faster, more so on a busy machine
    try:
        core = _build(name, d_key, params)
    except Exception as exc:  # noqa: BLE001
        torch.set_num_threads(threads)
        report.checks.append(Check(f"build {name} with {params or 'its defaults'}", cause=explain(exc)))
        return report
    try:
        report.checks += _interface(core, d_value)
        configs = _configurations(name, core, params)
        for dtype in dtypes:  # every length in float64, whose tolerance shows any mistake; a prime and a long one in the others
            for length in _lengths(core, configs) if dtype == torch.float64 else (PRIME, LONG):
                report.checks += _sequence_checks(name, d_key, d_value, configs, length, dtype, seed)
            report.checks += _packed_checks(name, d_key, d_value, configs[0], dtype, seed)
            report.checks += _padded_checks(name, d_key, d_value, configs[0], dtype, seed)
        if torch.float64 in dtypes:
            report.checks += _long_checks(name, d_key, d_value, configs, seed, report.checks)
    finally:
        torch.set_num_threads(threads)
    report.checks[0] = _d_dot(core, report.checks)
    return report


def _build(name: str, d_key: int, params: dict, dtype=torch.float64):
    import variants

    return variants.create(name, d_key, **params).to(dtype)


def _configurations(name: str, core, params: dict) -> list[dict]:
    """The parameters each parallel form is checked with: each chunk size and scan the variant declares,
    unless given (a core whose parallel form approximates its reference keeps its own chunks)."""
    declared = declared_params.declared(type(core))
    chunks = [{}]
    if "chunk_size" in declared and "chunk_size" not in params and not core.approximates_reference:
        chunks = [{"chunk_size": size} for size in CHUNK_SIZES]
    scans = [{}]
    scan = declared.get("scan")
    if scan is not None and scan.names and "scan" not in params:
        scans = [{"scan": value} for value in scan.names if value != scan.default]
    return [{**params, **chunk, **choice} for chunk in chunks for choice in scans]


def _lengths(core, configs: list[dict]) -> list[int]:
    """1, the largest chunk's boundary ±1 (16 for a core without chunks; a multiple of the smaller sizes), a prime, a longer one."""
    size = max(config.get("chunk_size") or getattr(core, "chunk_size", None) or CHUNK_SIZES[-1] for config in configs)
    return sorted({1, PRIME, LONG, *(length for length in (size - 1, size, size + 1) if 1 <= length <= LONG)})


def _label(config: dict, base: dict) -> str:
    extra = {key: value for key, value in config.items() if key not in base}
    return "".join(f" {key}={value}" for key, value in extra.items())


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sequence_checks(name, d_key, d_value, configs, length, dtype, seed, *, long=False) -> list[Check]:
    """At one length in one dtype: the step loop once, and per configuration the parallel form and
    decoding after a prefill, each against the float64 reference. ``long``: the step loop's and the parallel
    forms' outputs only, on one row and head (the backward of a loop over a long sequence costs more than the rest)."""
    reference = _build(name, d_key, configs[0])
    inputs = make_inputs(reference, *((1, 1) if long else (BATCH, HEADS)), length, d_value, dtype=torch.float64, seed=seed + length)
    where = f"{_dtype_name(dtype)} T={length}" + (" (long) B=1 H=1" if long else "")
    backward = length > 1 and not long
    try:  # at T = 1 the output only: a gradient may be zero there (softmax's d/dq, a decay's) or rounding noise
        target = reference_target(reference, inputs, backward=backward, seed=seed)
    except Exception as exc:  # noqa: BLE001
        return [Check(f"{where}: float64 reference", cause=f"the reference raised {explain(exc)}")]
    checks, step = [], None
    for config in configs:
        core = _build(name, d_key, config, dtype)
        label = f"{where}{_label(config, configs[0] if len(configs) == 1 else {})}: "
        own = core.approximates_reference  # its parallel form and prefill judged by themselves in float64, as a timed cell's
        parallel = _own_target(name, d_key, config, inputs, seed, lambda core, x: core(**x), backward=backward) if own else target
        forms = {
            "parallel form": judge_form(
                core, "parallel form", lambda x, core=core: core(**x), parallel, dtype, label=label, against=_against(core, "parallel form")
            )
        }
        if step is None:
            step = judge_form(core, "step loop", lambda x, core=core: core.step_loop(x)[0], target, dtype, label=f"{where}: ")
        if length >= 3 and not long:
            decode = _own_target(name, d_key, config, inputs, seed, _decode, backward=False) if own else dataclasses.replace(target, grads={})
            form = "prefill, prefill, steps"
            forms[form] = judge_form(core, form, lambda x, core=core: _decode(core, x), decode, dtype, label=label, against=_against(core, form))
        hinted = _with_hints({"step loop": step, **forms})
        checks += hinted[0 if not checks else 1 :]
    return checks


def _long_checks(name, d_key, d_value, configs, seed, shorter: list[Check]) -> list[Check]:
    """The outputs of the parallel form and step loop at ``LONGEST`` tokens in float64 on one row and head; a failure
    where every shorter length passed is said to be one of long sequences only."""
    checks = _sequence_checks(name, d_key, d_value, configs, LONGEST, torch.float64, seed, long=True)
    if any(not check.ok for check in shorter):
        return checks
    only = f"wrong only at long T: every check passed up to T={LONG} (a timed cell beyond 1,024 tokens is judged by its float64 parallel form and step loop)"
    return [check if check.ok else dataclasses.replace(check, cause=f"{check.cause or ', '.join(check.wrong) + ' wrong'}; {only}") for check in checks]


def _own_target(name, d_key, config, inputs, seed, run, *, backward) -> Target:
    """``run(core, inputs)`` of the core in float64: what a form of a core whose parallel form approximates its reference is judged by."""
    own = _build(name, d_key, config)
    return reference_target(own, inputs, backward=backward, seed=seed, call=lambda **x: run(own, x))


def _against(core, form: str) -> str:
    return f"float64 {form} (its parallel form approximates its reference)" if core.approximates_reference else "float64 reference"


def _decode(core, inputs: dict) -> torch.Tensor:
    """The outputs of decoding after a prefill: a prefill of the first third, a prefill of the second
    continuing from its state, then the step loop over the rest (without autograd, as decoding runs)."""
    length = inputs["q"].shape[2]
    first, second = length // 3, 2 * length // 3
    with torch.no_grad():
        head, state = core.prefill(**time_slice(inputs, 0, first))
        middle, state = core.prefill(**time_slice(inputs, first, second), state=state)
        tail, _ = core.step_loop(time_slice(inputs, second), state)
    return torch.cat([head, middle, tail], 2)


def _packed_checks(name, d_key, d_value, config, dtype, seed) -> list[Check]:
    """Sequences packed in one row (``cu_seqlens``): the parallel form against the reference of each alone."""
    core = _build(name, d_key, config, dtype)
    what = f"{_dtype_name(dtype)} packed T={'+'.join(map(str, PACKED))}"
    if "packed" not in core.shapes:
        return [Check(what, skipped="the core takes no cu_seqlens")]
    bounds = torch.tensor([0, *torch.tensor(PACKED).cumsum(0).tolist()], dtype=torch.int32)
    reference = _build(name, d_key, config)
    inputs = make_inputs(reference, 1, HEADS, sum(PACKED), d_value, dtype=torch.float64, seed=seed)
    try:
        form = reference if core.approximates_reference else reference.reference
        target = reference_target(reference, inputs, seed=seed, call=lambda **x: form(**x, cu_seqlens=bounds))
    except Exception as exc:  # noqa: BLE001
        return [Check(f"{what}: float64 reference", cause=f"the reference raised {explain(exc)}")]
    checked = judge_form(
        core, "parallel form", lambda x: core(**x, cu_seqlens=bounds), target, dtype, label=f"{what}: ", against=_against(core, "parallel form")
    )
    return _with_hints({"parallel form": checked})


def _padded_checks(name, d_key, d_value, config, dtype, seed) -> list[Check]:
    """A right-padded batch decoded: ``prefill(lengths=)``, then one step of each row at its own
    position, against the reference of each row's tokens alone."""
    core = _build(name, d_key, config, dtype)
    what = f"{_dtype_name(dtype)} padded T={','.join(map(str, PADDED))}: prefill(lengths=), step"
    reference = _build(name, d_key, config)
    inputs = make_inputs(reference, len(PADDED), HEADS, max(PADDED) + 1, d_value, dtype=torch.float64, seed=seed)
    rows = [time_slice({key: x[n : n + 1] for key, x in inputs.items()}, 0, length + 1) for n, length in enumerate(PADDED)]
    with torch.no_grad():
        expected = torch.cat([reference.reference(**row).flatten(2, -1) for row in rows], 2)
        low = cast_inputs(inputs, dtype)
        try:
            out, state = core.prefill(**time_slice(low, 0, max(PADDED)), lengths=list(PADDED))
        except VariantError as exc:
            if "takes no lengths" in str(exc):
                return [Check(what, skipped=f"{exc} (optional: _prefill_padded)")]
            return [Check(what, cause=explain(exc))]
        except Exception as exc:  # noqa: BLE001
            return [Check(what, cause=explain(exc))]
        at = torch.tensor(PADDED)
        token = {key: x[torch.arange(len(PADDED)), :, at] for key, x in low.items()}
        try:
            step, _ = core.step(**{f"{key}_t": x for key, x in token.items()}, state=state)
        except Exception as exc:  # noqa: BLE001
            return [Check(what, cause=explain(exc))]
        for form, returned, shape in (("prefill", out, (len(PADDED), HEADS, max(PADDED), d_value)), ("step", step, (len(PADDED), HEADS, d_value))):
            if wrong := _not_a_tensor_of(returned, shape, dtype):
                return [Check(what, cause=f"{form}: {wrong}")]
        got = torch.cat([torch.cat([out[n : n + 1, :, :length], step[n : n + 1, :, None]], 2).flatten(2, -1) for n, length in enumerate(PADDED)], 2)
    return [Check(what, rel_error(got, expected), REL_ERROR_TOLERANCE[dtype])]


def _interface(core, d_value: int) -> list[Check]:
    """``d_dot`` (its line is completed once the forms have run: ``_d_dot``) and the metadata the harness reads."""
    checks = [Check(f"interface: d_dot = {core.d_dot}")]
    calls = {
        "flops": lambda: core.flops(BATCH, HEADS, LONG, d_value),
        "step_flops": lambda: core.step_flops(BATCH, HEADS, d_value, LONG),
        "state_numel": lambda: core.state_numel(BATCH, HEADS, d_value, LONG),
    }
    for method, call in calls.items():
        what = f"interface: {method}"
        try:
            value = call()
        except Exception as exc:  # noqa: BLE001
            checks.append(Check(what, cause=explain(exc)))
            continue
        good = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        cause = None if good else f"expected a non-negative int, got {value!r}"
        if good and method == "state_numel":
            cause = _state_mismatch(core, d_value, value)
        checks.append(Check(f"{what} = {value}" if good else what, cause=cause))
    if missing := declared_params.undeclared(registered(core.variant_name)):  # a line only where one is missing
        names = ", ".join(missing)
        cause = f"its constructor takes {names}, which PARAMS do not declare: create refuses a value for it; {declared_params.declare(missing[0])}"
        checks.append(Check(f"interface: PARAMS: {names}", cause=cause))
    return checks


def _state_mismatch(core, d_value: int, numel: int) -> str | None:
    """Why ``numel`` (``state_numel`` after LONG tokens, which decode cells' memory column and roofline read) is not
    the element count of the state a prefill of LONG tokens returns (its tensors', however nested); None when it is,
    or when the prefill fails (the decoding checks name that)."""
    try:
        with torch.no_grad():
            _, state = core.prefill(**make_inputs(core, BATCH, HEADS, LONG, d_value, dtype=torch.float64, seed=0))
    except Exception:  # noqa: BLE001
        return None
    tensors = [leaf for leaf in torch.utils._pytree.tree_leaves(state) if isinstance(leaf, torch.Tensor)]
    held = sum(tensor.numel() for tensor in tensors)
    if held == numel:
        return None
    shapes = ", ".join(str(list(tensor.shape)) for tensor in tensors)
    return f"the state after a prefill of {LONG} tokens holds {held} elements ({shapes}), not {numel}: state_numel(batch, heads, d_value, length) counts them"


def _d_dot(core, checks: list[Check]) -> Check:
    """The line of ``d_dot``: None (a KV cache, no fixed size) or a positive int, named as the likely cause
    where it is still d_key, AttentionCore's default, and a form failed on a shape."""
    d_dot, what = core.d_dot, checks[0].what
    if d_dot is not None and not (isinstance(d_dot, int) and d_dot > 0):
        return Check(what, cause="d_dot must be a positive int (the width of the features the state stores) or None (a cache of no fixed size)")
    shape_failure = any(check.cause and SHAPE_ERROR.search(check.cause) for check in checks[1:])
    if d_dot == core.d_key and shape_failure:
        return Check(
            what,
            cause=f"d_dot is unset: still d_key = {core.d_key}, AttentionCore's default, and the forms fail on a shape below. "
            f"Set self.d_dot in the constructor to the width of the features the state stores (its key side: init_state, "
            f"state_numel, the shared chunked scans and the retrieval plot read it)",
        )
    return checks[0]
