"""The backends, one registry: what each supports and how it builds a core.

A core is built once, with its parameters (the one place they pass, checked against the
``PARAMS`` it declares), as its PyTorch forms; a backend then makes it its own:

* 'torch': the core's PyTorch forms as they are;
* 'compile': the same forms through ``torch.compile`` (``variants.compiled``; options mode, dynamic);
* 'triton' and 'fla': the form its family declares in ``backend_forms`` (``BackendForm``: the Triton
  kernels of ``variants.kernels``, flash-linear-attention's through ``variants.fla_backend``).

Every backend reads the core's parameters from the built core, so a new parameter reaches all of
them; one that only some honour says so in its ``Param`` (``params.check_backend``).
``supports(...)`` answers without building anything but the torch core, and ``create`` refuses
exactly what ``supports`` names (UnsupportedBackend). It is also the one place that says which backend
takes packed sequences (``cu_seqlens``) and grouped heads (``base.SHAPES``): a backend's ``shapes`` for the
PyTorch forms, a form's own ``shapes`` otherwise; ``build`` gives them to the core, whose checks refuse the rest.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from . import compiled, delta_rule, lsh, rwkv, softmax, sum_rule  # noqa: F401 (importing the families registers them)
from . import params as parameters
from .base import SHAPES, AttentionCore, UnsupportedBackend, VariantError, core_class, names, registered


class Backend:
    """One backend: its ``name``, its own ``options`` (name -> (accepts(value), what it accepts)),
    whether it runs the core's PyTorch forms (and so takes the options the core class declares in
    ``OPTIONS``, softmax's ``sdpa``) and what it ``runs`` in words, and the package it needs
    (``requires``, with how to install it)."""

    name: str
    options: dict = {}
    runs_torch_forms = False
    #: its forms are this project's own code, written for it (not the PyTorch forms compiled, nor another
    #: package's kernels): what ``attnbench regress`` checks against the reference in each revision
    own_forms = False
    #: what it runs, for messages ("runs its kernels")
    runs = "runs its kernels"
    requires: tuple[str, str] | None = None
    #: what of ``base.SHAPES`` its PyTorch forms take here (a backend with forms of its own: each form's ``shapes``)
    shapes: tuple[str, ...] = ()

    def declared(self, core: AttentionCore):
        """What builds ``core``'s form here (its family's ``backend_forms`` entry), None for the PyTorch
        forms; UnsupportedBackend where the family has none."""
        if self.runs_torch_forms:
            return None
        declared = core.backend_forms.get(self.name)
        if isinstance(declared, str):
            raise UnsupportedBackend(f"{core.variant_name}: {declared}")
        if declared is None:
            has = [backend for backend in BACKENDS if _REGISTRY[backend].runs_torch_forms or _has_form(type(core), backend)]
            torch_only = (
                "has only the 'torch' backend (and 'compile' of its PyTorch forms)"
                if has == ["torch", "compile"]
                else f"backend must be one of {', '.join(has)}"
            )
            raise UnsupportedBackend(f"{core.variant_name}: {torch_only}, got backend={self.name!r}")
        return declared

    def check(self, core: AttentionCore, dtype=None, device=None, shapes=()):
        """The form that runs ``core`` here (None: its PyTorch forms), or UnsupportedBackend with the
        reason: no form in its family, the backend's package missing, a parameter only other backends
        honour, what the form refuses for this configuration or for inputs of ``dtype`` on ``device``, or
        of ``shapes`` ('packed', 'grouped': ``base.SHAPES``) what it does not take."""
        declared = self.declared(core)
        if self.requires is not None and importlib.util.find_spec(self.requires[0]) is None:
            raise UnsupportedBackend(f"{core.variant_name}: backend {self.name!r} needs {self.requires[1]}")
        parameters.check_backend(core, self.name, self.runs)
        form = None if declared is None else declared(core)
        reason = None if form is None else form.refuses(dtype, device)
        if reason is not None:
            raise UnsupportedBackend(reason)
        if "grouped" in shapes and core.head_grouping is None:
            raise UnsupportedBackend(f"{core.variant_name}: this variant takes no grouped heads")
        missing = [SHAPES[shape] for shape in shapes if shape not in self.shapes_taken(form)]
        if missing:
            raise UnsupportedBackend(f"{core.variant_name}: backend {self.name!r} takes no {' and no '.join(missing)} for this variant")
        return form

    def shapes_taken(self, form) -> tuple[str, ...]:
        """What of ``base.SHAPES`` the core takes here, run by ``form`` (None: its PyTorch forms)."""
        return self.shapes if form is None else form.shapes

    def supports(self, core: AttentionCore, dtype=None, device=None, shapes=()) -> str | None:
        """None where this backend computes ``core``'s function (for inputs of ``dtype`` on ``device``,
        where given, and of ``shapes``), else the reason."""
        try:
            self.check(core, _dtype(dtype), _device(device), shapes)
        except UnsupportedBackend as exc:
            return str(exc)
        return None

    def build(self, core: AttentionCore, **options) -> AttentionCore:
        form = self.check(core)
        if form is not None:
            form.install()
        core.backend, core.shapes = self.name, self.shapes_taken(form)
        return core


class _Torch(Backend):
    name = "torch"
    runs_torch_forms = True
    own_forms = True
    shapes = tuple(SHAPES)
    runs = "runs the PyTorch forms"


class _Compile(Backend):
    name = "compile"
    options = compiled.OPTIONS
    runs_torch_forms = True
    runs = "compiles the PyTorch forms"

    def build(self, core, **options):
        return compiled.wrap(super().build(core), **options)


class _Triton(Backend):
    name = "triton"
    own_forms = True
    requires = ("triton", "the triton package: pip install 'attnbench[triton]'")


class _Fla(Backend):
    name = "fla"
    requires = ("fla", "flash-linear-attention: pip install 'attnbench[fla]' (package fla-core)")

    def declared(self, core):
        if callable(core.backend_forms.get(self.name)):
            return core.backend_forms[self.name]
        mapped = ", ".join(name for name in names() if _has_form(core_class(registered(name)), self.name))
        reason = core.backend_forms.get(self.name) or "flash-linear-attention has no kernel computing this variant's function"
        raise UnsupportedBackend(f"{core.variant_name}: {reason} (mapped: {mapped})")


def _has_form(cls: type, backend: str) -> bool:
    """Whether core class ``cls`` declares a form on ``backend`` (not only the reason it has none)."""
    return callable(cls.backend_forms.get(backend))


_REGISTRY: dict[str, Backend] = {backend.name: backend for backend in (_Torch(), _Triton(), _Compile(), _Fla())}
#: The backend names, the one list of them: ``params.BACKENDS`` (torch-free), in the order of ``_REGISTRY``.
BACKENDS = parameters.BACKENDS
#: The backends whose forms are this project's code (``Backend.own_forms``).
OWN_FORMS = tuple(name for name, backend in _REGISTRY.items() if backend.own_forms)


def get(name: str, variant: str = "") -> Backend:
    """The backend called ``name``; VariantError naming the known ones."""
    if name not in _REGISTRY:
        raise VariantError(f"{variant + ': ' if variant else ''}backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return _REGISTRY[name]


def _dtype(dtype):
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _device(device):
    return torch.device(device) if isinstance(device, str) else device


def _core_options(backend: str, name: str | None) -> dict:
    """The options the core class registered as ``name`` declares (every registered class's for
    None), where ``backend`` runs its PyTorch forms; else none."""
    if not get(backend).runs_torch_forms:
        return {}
    classes = [core_class(registered(other)) for other in (names() if name is None else [name])]
    return {option: spec for cls in classes for option, spec in getattr(cls, "OPTIONS", {}).items()}


def check_backend_options(backend: str, options: dict | None, name: str | None = None) -> dict:
    """The options of ``backend`` (``backend_options`` of a scenario) for variant ``name`` (any
    variant for None), checked: the backend's own ('compile': mode, dynamic) and, on the backends
    that run the PyTorch forms, the core's (softmax: sdpa)."""
    options, own = dict(options or {}), get(backend).options
    core = _core_options(backend, name)
    for option, value in options.items():
        if option in core:
            accepts, accepted = core[option]
        elif option in own:
            accepts, accepted = own[option]
        elif name is not None and option in _core_options(backend, None):
            owners = ", ".join(other for other in names() if option in getattr(core_class(registered(other)), "OPTIONS", {}))
            raise VariantError(f"{name}: backend option {option} is {owners}'s only, got {option}={value!r}")
        elif own:
            raise VariantError(f"backend {backend!r} takes the options {', '.join(own)}, got {option!r}")
        else:
            raise VariantError(f"backend {backend!r} takes no options, got {', '.join(options)}")
        if not accepts(value):
            raise VariantError(f"backend {backend!r}: option {option} must be one of {accepted}, got {value!r}")
    return options


def backend_option_owners() -> dict[str, tuple[str, ...]]:
    """Every backend option's name -> the backends that take it (``{'mode': ('compile',), 'sdpa': ('torch', 'compile'), ...}``)."""
    owners: dict[str, tuple[str, ...]] = {}
    for backend in BACKENDS:
        for option in [*get(backend).options, *_core_options(backend, None)]:
            owners[option] = (*owners.get(option, ()), backend)
    return owners


def backend_options_for(name: str, backend: str, options: dict) -> dict:
    """Of a scenario's ``backend_options``, those that variant ``name`` takes on ``backend`` (a
    scenario pinning softmax's SDPA kernel measures its other variants as they are)."""
    taken = {*get(backend).options, *_core_options(backend, name)}
    return {option: value for option, value in options.items() if option in taken}


def build_torch(name: str, d_key: int, **params: Any) -> AttentionCore:
    """The core registered as ``name`` with its PyTorch forms, its parameters checked first."""
    factory = registered(name)
    if not isinstance(d_key, int) or isinstance(d_key, bool) or d_key < 1:
        raise VariantError(f"{name}: d_key must be a positive int, got {d_key!r}")
    parameters.check(name, params, factory)
    try:
        core = factory(d_key, **params)
    except TypeError as exc:  # a keyword a plugin's constructor does not take
        raise VariantError(f"{name}: {exc}") from None
    core.variant_name = name
    return core


def supports(name: str, d_key: int, backends=BACKENDS, *, dtype=None, device=None, packed=False, heads=None, **params: Any) -> dict[str, str | None]:
    """Per backend of ``backends``: None where it computes variant ``name`` with ``params`` (for
    inputs of ``dtype`` on ``device``, where given; packed sequences, ``cu_seqlens``, with ``packed``;
    ``heads`` of q, k and v where they differ), else the reason. Builds only the torch core (so a
    parameter no backend could take raises VariantError, and so do heads its grouping cannot take)."""
    core = build_torch(name, d_key, **params)
    grouped = heads is not None and len(set(heads)) > 1
    if grouped:
        core._check_heads(*heads)  # the variant's own grouping (its torch forms take every shape it allows)
    shapes = ("packed",) * bool(packed) + ("grouped",) * grouped
    return {backend: get(backend, name).supports(core, dtype, device, shapes) for backend in backends}


def create(name: str, d_key: int, *, backend: str = "torch", backend_options: dict | None = None, **params: Any) -> AttentionCore:
    """Build the attention core registered as ``name`` for head dimension ``d_key``.

    ``backend`` picks the implementation: 'torch' (every variant), 'triton' (the linear-time
    rules' kernels), 'compile' (the torch core through torch.compile, ``backend_options`` mode and
    dynamic) or 'fla' (flash-linear-attention's kernels where they compute the same function);
    ``UnsupportedBackend`` names why elsewhere (what ``supports`` says). The core's own options
    (softmax's ``sdpa``, on 'torch' and 'compile') become its attributes of the same name."""
    registered(name)
    chosen = get(backend, name)
    options = check_backend_options(backend, backend_options, name)
    core = build_torch(name, d_key, **params)
    for option in _core_options(backend, name):
        if option in options:
            setattr(core, option, options.pop(option))
    return chosen.build(core, **options)
