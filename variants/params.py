"""The parameters a core declares: what each accepts, checked in one place (``variants.create``)
before the core is built, so that a wrong value ends in one line naming the parameter and what
it expects, not in an exception from deep inside torch (a feature count too large to allocate,
a seed torch's generator cannot take).

A core class lists its parameters in ``PARAMS`` (merged along its base classes; a factory
function registered with ``register(name, core=Class)`` takes its class's). The shipped variants'
are written here, with their names (``SHIPPED``), and this module imports no torch: a scenario's
variant names and parameters are checked before torch and the variants load. A parameter that only
some backends honour names them in ``backends``: on every other backend only its ``default`` is
accepted (``precision='tf32'`` is the Triton kernels' option; ``scan``, how the PyTorch forms run
the chunks, is refused by the kernels), so that a swept value never measures one configuration
under several labels.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import UnsupportedBackend, VariantError, did_you_mean

#: The largest width a feature map or a count of random features may ask for: past it a core's
#: buffers (FAVOR+'s ω is m × d_key) no longer fit any machine's memory.
MAX_WIDTH = 2**20
#: The largest seed: torch.Generator().manual_seed takes [0, 2^64); attnbench keeps to int64's range.
MAX_SEED = 2**63 - 1
#: How much of a refused value an error quotes.
QUOTE = 60


@dataclass(frozen=True)
class Param:
    """One constructor parameter: its ``rules``, each ``(accepts(value), what it expects)``, the first
    refusing one named in the error; where only some ``backends`` honour it, its ``default`` (the one
    value the others take) and ``scope``, what it does, for the refusal ("is a Triton kernel option");
    ``names``: the values of a choice (a refused one is told the closest)."""

    rules: tuple[tuple[Callable[[Any], bool], str], ...]
    backends: tuple[str, ...] | None = None
    default: Any = None
    scope: str = ""
    names: tuple[str, ...] = ()

    def problem(self, value) -> str | None:
        """What ``value`` should have been, or None when it is accepted."""
        return next((expects for accepts, expects in self.rules if not accepts(value)), None)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int = 1, high: int | None = MAX_WIDTH, optional: bool = True) -> Param:
    """An int (not a bool or a float) >= ``low`` and at most ``high``; None too where ``optional``."""
    given = lambda v: optional and v is None
    kind = "a positive int" if low == 1 else f"an int >= {low}"
    rules = [(lambda v: given(v) or (_is_int(v) and v >= low), kind)]
    if high is not None:
        rules.append((lambda v: given(v) or v <= high, f"at most {high}"))
    return Param(tuple(rules))


def flag() -> Param:
    """true or false (not a string that merely looks like one)."""
    return Param(((lambda v: isinstance(v, bool), "true or false"),))


def choice(*values, quoted: bool = True, **restricted) -> Param:
    """One of ``values`` (named in the error with their quotes, or without); ``restricted`` as
    ``Param`` takes it (backends, default, scope)."""
    named = ", ".join(map(repr, values) if quoted else values)
    return Param(((lambda v: isinstance(v, str) and v in values, f"one of {named}"),), names=values, **restricted)


def positive_number() -> Param:
    """A finite number > 0, or None."""
    accepts = lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
    return Param(((accepts, "a finite number > 0"),))


#: ``seed`` of every core that draws random numbers when it is built (torch's generators take int64's range).
SEED = integer(0, MAX_SEED, optional=False)
#: The feature maps φ of the sum and delta rules (``feature_maps.make_feature_map`` builds each).
PHI_NAMES = ("identity", "elu1", "favor", "dpfp", "l2", "silu_l2", "taylor", "rebased")
#: The backends' names, the one list of them (``backends`` builds one of each).
BACKENDS = ("torch", "triton", "compile", "fla")
#: How the causal PyTorch forms of the sum and delta rules run the chunks (``scan=``): 'loop' (``chunked``: a Python
#: loop over the chunks), 'parallel' (``chunk_scan``: every chunk at once), 'auto' (``FastWeightCore.scan_choice``).
SCANS = ("auto", "loop", "parallel")
#: The sum and delta rules' parameters (``fast_weights.FastWeightCore``).
FAST_WEIGHTS = {
    "phi": choice(*PHI_NAMES),
    "sum_norm": flag(),
    "normalize": flag(),
    "chunk_size": integer(high=None),
    "m": integer(),
    "nu": integer(),
    "d_dot": integer(),
    "seed": SEED,
    "precision": choice("ieee", "tf32", backends=("triton",), default="ieee", scope="is a Triton kernel option"),
    "scan": choice(*SCANS, quoted=False, backends=("torch", "compile"), default="auto", scope="picks a PyTorch form"),
}
#: Softmax's, LSH attention's and RWKV's parameters (``softmax.Softmax``, ``lsh.LSHAttention``, ``rwkv.RWKV``).
SOFTMAX = {"scale": positive_number()}
LSH = {"n_rounds": integer(optional=False), "n_buckets": integer(2, optional=False), "chunk_size": integer(high=None, optional=False), "seed": SEED}
RWKV = {"chunk_size": integer(high=None, optional=False)}


@dataclass(frozen=True)
class Variant:
    """A variant's parameters: its core class's (``params``) but those it sets itself (``fixes``);
    ``complete``: they are every keyword its constructor takes (a plugin's class may take more than it declares)."""

    params: dict[str, Param]
    fixes: tuple[str, ...] = ()
    complete: bool = True

    def names(self) -> list[str]:
        return sorted(set(self.params) - set(self.fixes))


#: The shipped variants by name, as ``register`` registers them (tests/test_harness/test_refusals.py ties the two).
SHIPPED = {
    "softmax": Variant(SOFTMAX),
    "linear": Variant(FAST_WEIGHTS),
    "performer": Variant(FAST_WEIGHTS, fixes=("phi",)),
    "dpfp": Variant(FAST_WEIGHTS, fixes=("phi",)),
    "based": Variant(FAST_WEIGHTS, fixes=("phi",)),
    "rebased": Variant(FAST_WEIGHTS, fixes=("phi",)),
    "delta": Variant(FAST_WEIGHTS),
    "deltanet": Variant(FAST_WEIGHTS),
    "gated_delta": Variant(FAST_WEIGHTS),
    "lsh": Variant(LSH),
    "rwkv": Variant(RWKV),
}


def _registry():
    """``variants.base`` where it is loaded (a plugin registers into it), else None: nothing but the shipped variants."""
    return sys.modules.get("variants.base")


def variant_names() -> list[str]:
    """Every variant's name, sorted, without loading torch: the shipped ones and those the registry holds
    where it is loaded (a plugin's)."""
    base = _registry()
    return sorted(set(SHIPPED) | set(base.names() if base else ()))


def declaration(variant: str, factory=None) -> Variant:
    """The parameters of ``variant``: a shipped one's (``SHIPPED``), else those its ``factory`` (default: the
    registered one) declares; VariantError naming the known variants (and the close ones) for an unknown name."""
    if variant in SHIPPED:
        return SHIPPED[variant]
    if factory is None:
        if variant not in variant_names():
            raise unknown_variant(variant)
        factory = _registry().registered(variant)
    return Variant(declared(factory), tuple(getattr(factory, "fixed_params", ())), complete=False)


def unknown_variant(variant: str) -> VariantError:
    """The error of a name no variant is registered under: the closest name and every known one."""
    known = variant_names()
    return VariantError(f"unknown variant {variant!r}{did_you_mean(variant, known)}; known variants: {', '.join(known)}")


def declared(factory) -> dict[str, Param]:
    """The parameters ``factory`` (a registered core class, or a function with ``core``) declares."""
    owner = getattr(factory, "core_class", factory)
    specs: dict[str, Param] = {}
    for cls in reversed(getattr(owner, "__mro__", ())):
        specs.update(vars(cls).get("PARAMS", {}))
    return specs


def declare(name: str) -> str:
    """How to declare parameter ``name`` (the end of the messages of an undeclared one)."""
    return f"declare it in the class's PARAMS, e.g. {{{name!r}: integer()}} (variants.params: integer, flag, choice, positive_number or a Param)"


def undeclared(factory) -> list[str]:
    """The keywords the constructor of ``factory`` names (d_key, its first, and ``**kwargs`` aside) that its
    ``PARAMS`` do not declare and it does not set itself (``fixes``): a value given for one would go unchecked."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return []
    named = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)][1:]
    known = set(declared(factory)) | set(getattr(factory, "fixed_params", ()))
    return [name for name in named if name not in known]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= QUOTE else text[:QUOTE] + "…"


def refusal(variant: str, params: dict, factory=None) -> str | None:
    """What is wrong with ``params`` of ``variant`` (None: nothing): a parameter it does not have (the close
    ones and all of them named), one it sets itself, a value its declaration does not accept. Torch-free for
    a shipped variant (``declaration``)."""
    spec = declaration(variant, factory)
    for key, value in params.items():
        if key in spec.fixes:
            return f"{key} is set by the variant itself, not a parameter of it, got {_shown(value)}"
        if key not in spec.params:
            if spec.complete:
                return f"no parameter {key!r}{did_you_mean(key, spec.names())}; its parameters: {', '.join(spec.names()) or 'none'}"
            if key in undeclared(factory or _registry().registered(variant)):
                return f"{key} is a keyword of its constructor that its PARAMS do not declare, so its value would go unchecked; {declare(key)}"
            continue  # a keyword its constructor does not name: the constructor refuses it (or takes it in **kwargs)
        param = spec.params[key]
        if (problem := param.problem(value)) is not None:
            return f"{key} must be {problem}, got {_shown(value)}{did_you_mean(value, param.names) if isinstance(value, str) else ''}"
    return None


def check(variant: str, params: dict, factory=None) -> None:
    """``refusal`` as VariantError: ``{variant}: {what is wrong}``."""
    if (problem := refusal(variant, params, factory)) is not None:
        raise VariantError(f"{variant}: {problem}")


def check_backend(core, backend: str, runs: str) -> None:
    """Refuse, on ``backend`` (which ``runs`` the core's PyTorch forms, or its kernels), a parameter
    of ``core`` set to a value only other backends honour (UnsupportedBackend naming them)."""
    for name, spec in declared(type(core)).items():
        value = getattr(core, name, spec.default)
        if spec.backends is not None and backend not in spec.backends and value != spec.default:
            use = " or ".join(f"backend={b!r}" for b in spec.backends) + f", or leave {name} at {spec.default!r}"
            raise UnsupportedBackend(f"{core.variant_name}: {name}={value!r} {spec.scope}; backend={backend!r} {runs} (use {use})")
