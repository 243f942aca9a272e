"""The parameters a core declares: what each accepts, checked in one place (``variants.create``)
before the core is built, so that a wrong value ends in one line naming the parameter and what
it expects, not in an exception from deep inside torch (a feature count too large to allocate,
a seed torch's generator cannot take).

A core class lists its parameters in ``PARAMS`` (merged along its base classes; a factory
function registered with ``register(name, core=Class)`` takes its class's). A parameter that only
some backends honour names them in ``backends``: on every other backend only its ``default`` is
accepted (``precision='tf32'`` is the Triton kernels' option; ``scan``, how the PyTorch forms run
the chunks, is refused by the kernels), so that a swept value never measures one configuration
under several labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .base import UnsupportedBackend, VariantError

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
    value the others take) and ``scope``, what it does, for the refusal ("is a Triton kernel option")."""

    rules: tuple[tuple[Callable[[Any], bool], str], ...]
    backends: tuple[str, ...] | None = None
    default: Any = None
    scope: str = ""

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
    return Param(((lambda v: isinstance(v, str) and v in values, f"one of {named}"),), **restricted)


def positive_number() -> Param:
    """A finite number > 0, or None."""
    accepts = lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)
    return Param(((accepts, "a finite number > 0"),))


#: ``seed`` of every core that draws random numbers when it is built (torch's generators take int64's range).
SEED = integer(0, MAX_SEED, optional=False)


def declared(factory) -> dict[str, Param]:
    """The parameters ``factory`` (a registered core class, or a function with ``core``) declares."""
    owner = getattr(factory, "core_class", factory)
    specs: dict[str, Param] = {}
    for cls in reversed(getattr(owner, "__mro__", ())):
        specs.update(vars(cls).get("PARAMS", {}))
    return specs


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= QUOTE else text[:QUOTE] + "…"


def check(variant: str, factory, params: dict) -> None:
    """Refuse a value a declared parameter does not accept, or a parameter the factory sets itself:
    VariantError naming it and what it expects."""
    specs = declared(factory)
    for name, value in params.items():
        if name in getattr(factory, "fixed_params", ()):
            raise VariantError(f"{variant}: {name} is set by the variant itself, not a parameter of it, got {_shown(value)}")
        problem = specs[name].problem(value) if name in specs else None
        if problem is not None:
            raise VariantError(f"{variant}: {name} must be {problem}, got {_shown(value)}")


def check_backend(core, backend: str, runs: str) -> None:
    """Refuse, on ``backend`` (which ``runs`` the core's PyTorch forms, or its kernels), a parameter
    of ``core`` set to a value only other backends honour (UnsupportedBackend naming them)."""
    for name, spec in declared(type(core)).items():
        value = getattr(core, name, spec.default)
        if spec.backends is not None and backend not in spec.backends and value != spec.default:
            use = " or ".join(f"backend={b!r}" for b in spec.backends) + f", or leave {name} at {spec.default!r}"
            raise UnsupportedBackend(f"{core.variant_name}: {name}={value!r} {spec.scope}; backend={backend!r} {runs} (use {use})")
