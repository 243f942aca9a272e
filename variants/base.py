"""The common interface of every attention core, its argument checks and the registry.

Tensors are ``[B, H, T, D]`` (batch, heads, time, head dim), as in
``torch.nn.functional.scaled_dot_product_attention``. A core has three faces that
compute the same function:

* ``core(q, k, v, *, causal=True, **token_inputs)``: the parallel (training) form;
* ``core.init_state(...)`` and ``core.step(q_t, k_t, v_t, state, **token_inputs_t)``:
  the recurrent form for autoregressive decoding, one token at a time;
* ``core.reference(q, k, v, *, causal=True, **token_inputs)``: the plainest correct form,
  used by the tests in float64.

Besides q, k, v a core may take per-token inputs, one value per batch row, head and token,
which it declares as ``token_inputs``, a tuple of ``TokenInput`` (the delta rule's write
strength ``BETA``, the gated rule's ``LOG_GATE``). Each is passed as the keyword ``name``
(``[B, H, T]``) to the parallel form, ``reference`` and ``prefill`` and as ``name + "_t"``
(``[B, H]``) to ``step``; the base class checks that exactly the declared ones are given
(None counts as not given), their shapes and their ranges, and hands them on to
``_parallel``, ``_reference``, ``_prefill`` and ``_step`` as keywords ``name``.
``core.example_inputs(...)`` draws valid inputs of every kind; ``token_slice`` and
``time_slice`` cut them for ``step`` and ``prefill``.

Packed sequences: the parallel form, ``reference`` and ``prefill`` take ``cu_seqlens``, int32 offsets
``[N + 1]`` of N sequences packed in one row (fla's convention: q, k, v ``[1, H, total_T, D]``); no token
attends across a boundary. Grouped heads, where a core declares ``head_grouping`` ('gqa': k and v have
fewer heads than q; 'gva': v more than q and k): each of the fewer heads serves a group of consecutive
heads of the more; the output and the token inputs have the larger number.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from . import params
from .errors import UnsupportedBackend, VariantError
from .inputs import in_layout, padded_lengths, token_slice

_REGISTRY: dict[str, Callable[..., AttentionCore]] = {}
#: A variant's name: it stands in scenario files, results, reports and on the command line, one word each.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def register(name: str, *, core: type | None = None, fixes: tuple[str, ...] = ()) -> Callable:
    """Decorator of a core class or factory: make ``variants.create(name, ...)`` build it. A
    factory function names the ``core`` class it builds (whose parameters and backends it has)
    and the parameters of that class it sets itself (``fixes``: refused when given)."""

    def add(factory):
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise VariantError(f"variant name {name!r}: expected letters, digits, '.', '_' and '-', starting with a letter or digit")
        if name in _REGISTRY:
            raise VariantError(f"variant {name!r} is registered twice")
        _REGISTRY[name] = factory
        if isinstance(factory, type):
            factory.variant_name = name
        elif core is not None:
            factory.core_class = core
            factory.fixed_params = fixes
        return factory

    return add


def names() -> list[str]:
    """The registered variant names, sorted."""
    return sorted(_REGISTRY)


def registered(name: str) -> Callable[..., AttentionCore]:
    """The class or factory registered as ``name``; VariantError naming the known ones."""
    if name not in _REGISTRY:
        raise params.unknown_variant(name)
    return _REGISTRY[name]


def core_class(factory) -> type:
    """The core class a registered ``factory`` builds (itself for a class; AttentionCore if unknown)."""
    return factory if isinstance(factory, type) else getattr(factory, "core_class", AttentionCore)


#: What a form may take beyond a dense batch of equal heads: packed sequences (``cu_seqlens``), grouped heads.
SHAPES = {"packed": "cu_seqlens", "grouped": "grouped heads"}
#: The head groupings a core may declare (``head_grouping``): what they allow, for messages.
HEAD_GROUPINGS = {"gqa": "k and v share their heads, a divisor of q's (GQA)", "gva": "q and k share their heads, a divisor of v's (GVA)"}


def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x [B, h, ...]`` on ``heads`` heads (a multiple of h): each head repeated for its group of
    consecutive heads (as GQA shares a key/value head among consecutive query heads)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def state_heads(k: torch.Tensor, v: torch.Tensor) -> int:
    """The heads of the decoding state: k's and v's (GQA: the key/value heads; GVA: the value heads)."""
    return max(k.shape[1], v.shape[1])


def sequences(bounds) -> list[tuple[int, int]]:
    """``(start, stop)`` of each packed sequence, from ``bounds`` (``cu_seqlens`` as ints)."""
    return list(zip(bounds[:-1], bounds[1:]))


class BackendForm:
    """A family's implementation of its core on one backend, listed in the class's
    ``backend_forms`` (``{"triton": ..., "fla": ...}``). Built from the torch core, it raises
    UnsupportedBackend naming why the backend cannot compute this configuration, and changes
    nothing until ``install``, which gives the core its attributes named in ``replaces`` (its
    ``_run``, or its forms). ``refuses(dtype, device)`` names inputs it cannot take (None: any); ``shapes``: what of ``SHAPES`` it takes."""

    replaces: tuple[str, ...] = ()
    shapes: tuple[str, ...] = ()

    def __init__(self, core):
        self.core = core

    def refuses(self, dtype: torch.dtype | None, device: torch.device | None) -> str | None:
        return None

    def install(self) -> None:
        for name in self.replaces:
            setattr(self.core, name, getattr(self, name))


#: Set by ``debug_checks`` (or ATTNBENCH_DEBUG_CHECKS=1 in the environment): check token input
#: ranges in every form on every device, not only where the check needs no device sync.
_DEBUG_CHECKS = os.environ.get("ATTNBENCH_DEBUG_CHECKS", "") not in ("", "0")

#: Every ``TokenInput`` by name, for the message that refuses one a core does not take.
_KNOWN_INPUTS: dict[str, TokenInput] = {}


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    """Within the block, the parallel form, ``prefill`` and ``step`` check the ranges of token inputs
    on accelerators too (each check then waits for the device; see ``TokenInput.bounds``), and the
    causal reads keep a non-finite input from reaching earlier outputs there (``chunked.causal_read``).
    Outside it the forms that a benchmark times hold no check that costs a kernel or a sync."""
    global _DEBUG_CHECKS
    previous, _DEBUG_CHECKS = _DEBUG_CHECKS, enabled
    try:
        yield
    finally:
        _DEBUG_CHECKS = previous


def checks_due(device: torch.device) -> bool:
    """Whether a timed form runs its input checks on ``device``: on CPU tensors (no device sync, no
    kernel launch) or under ``debug_checks``."""
    return _DEBUG_CHECKS or device.type == "cpu"


@dataclass(frozen=True)
class TokenInput:
    """A per-token input of a core besides q, k, v: one value per batch row, head and token.

    ``name`` is its keyword in the parallel form, ``reference`` and ``prefill`` (``[B, H, T]``);
    ``step`` takes ``name + "_t"`` (``[B, H]``). ``doc`` says what it is ("the write strength")
    and ``owner`` who takes it ("the delta rule"), both for error messages. ``draw(shape, *,
    generator, device, dtype)`` returns valid random values (``example_inputs``). Valid values
    are finite and within the closed ``bounds`` (either may be ±inf). ``layer(d_model, n_heads)``
    builds ``AttentionLayer``'s projection of this input: a module from the layer input
    ``[..., d_model]`` to values within the bounds ``[..., n_heads]`` (``ActivatedLinear`` for an
    activation of a linear map), kept as the attribute ``projection`` (default: ``name``). A
    plugin declares a new input by making one and listing it in its core's ``token_inputs``.
    """

    name: str
    doc: str
    draw: Callable[..., torch.Tensor]
    bounds: tuple[float, float]
    layer: Callable[[int, int], nn.Module]
    owner: str
    projection: str | None = None

    def __post_init__(self):
        _KNOWN_INPUTS.setdefault(self.name, self)

    @property
    def layer_attribute(self) -> str:
        """The name of ``AttentionLayer``'s projection that computes this input."""
        return self.projection or self.name

    def range_text(self) -> str:
        low, high = self.bounds
        if low == -math.inf:
            return f"≤ {high:g}"
        return f"≥ {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"

    def check_range(self, x: torch.Tensor, variant: str, label: str) -> None:
        """Refuse values that are not finite or outside ``bounds`` (one reduction of ``x``)."""
        least, most = (float(m) for m in torch.aminmax(x.detach()))
        low, high = self.bounds
        if not (math.isfinite(least) and math.isfinite(most) and low <= least and most <= high):
            raise VariantError(f"{variant}: {label} must be finite and {self.range_text()} ({self.doc}), got values from {least:.4g} to {most:.4g}")


class ActivatedLinear(nn.Linear):
    """``activation(W x + b)``: a per-token input's projection in ``AttentionLayer`` (β = σ(W_β x + b_β))."""

    def __init__(self, d_model: int, n_heads: int, activation: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__(d_model, n_heads)
        self.activation = activation

    def forward(self, x):
        return self.activation(super().forward(x))


def activated_linear(activation: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[int, int], nn.Module]:
    """``TokenInput.layer`` for ``activation`` of a linear map of the layer input."""
    return lambda d_model, n_heads: ActivatedLinear(d_model, n_heads, activation)


class AttentionCore(nn.Module):
    """Base class of every variant: argument checks around the three forms.

    Subclasses set ``d_dot`` (the dimension after the feature map, the size of the
    memory's key side; None for softmax, whose KV cache has no fixed size), ``token_inputs``
    (the ``TokenInput`` they take besides q, k, v), ``token_shift`` (the layer should
    token-shift its inputs, RWKV), ``supports_noncausal`` and ``d_value_is_d_key`` (a per-channel
    operator, RWKV) and implement ``_parallel``, ``_reference``, ``_prefill``, ``init_state`` and
    ``_step``, which receive the token inputs as keywords ``name``.
    """

    variant_name = "?"
    token_inputs: tuple[TokenInput, ...] = ()
    token_shift = False
    supports_noncausal = True
    d_value_is_d_key = False
    #: the layer computes keys from the queries, k = q / ‖q‖ (the Reformer's shared-QK attention)
    shared_qk = False
    #: its parallel form is an algorithm that approximates ``reference`` on some inputs, not the same
    #: function (LSH's sorted chunks, once a bucket outgrows the window): a cell's accuracy is then
    #: judged against the parallel form itself in float64 (harness.measuring.accuracy)
    approximates_reference = False
    #: example_inputs draws unit-norm q and k (plain rules without φ, stable only for bounded keys)
    example_unit_keys = False
    #: the memory layout the parallel form wants its inputs in (``example_inputs`` gives them so):
    #: 'bhtd' ([B, H, T, D] contiguous) or 'bthd' ([B, H, T, D] views of [B, T, H, D] storage, backend 'fla')
    input_layout = "bhtd"
    #: the backend it runs on (set by ``create``), and whether its forms go through torch.compile
    backend = "torch"
    compiled = False
    #: its implementations on other backends than its PyTorch forms: backend name -> ``BackendForm``
    #: class (or a function of the core returning one), or the reason the backend has none
    backend_forms: dict = {}
    #: the grouped heads its PyTorch forms take: None, 'gqa' or 'gva' (``HEAD_GROUPINGS``)
    head_grouping: str | None = None
    #: what of ``SHAPES`` its forms on its backend take (set by ``backends.Backend.build``, as ``supports`` says)
    shapes: tuple[str, ...] = tuple(SHAPES)
    #: its constructor parameters: name -> ``params.Param`` (checked by ``create``)
    PARAMS: dict = {}

    def __init__(self, d_key: int):
        super().__init__()
        self.d_key = d_key
        self.d_dot = d_key

    # --- the three faces -------------------------------------------------------
    def forward(self, q, k, v, *, causal: bool = True, cu_seqlens=None, **token_inputs) -> torch.Tensor:
        """Parallel form: ``q, k: [B, H, T, Dk]``, ``v: [B, H, T, Dv]``, each token input ``[B, H, T]``
        -> ``[B, H, T, Dv]`` (``cu_seqlens``, grouped heads: the module docstring). Token input ranges
        are checked on CPU tensors (no device sync) or under ``debug_checks``."""
        given = self._check_sequence(q, k, v, causal, token_inputs, always=False, cu_seqlens=cu_seqlens)
        if cu_seqlens is None:
            return self._parallel(q, k, v, causal, **given)
        return self._parallel_packed(q, k, v, causal, cu_seqlens.tolist(), **given)

    def reference(self, q, k, v, *, causal: bool = True, cu_seqlens=None, **token_inputs) -> torch.Tensor:
        """The plainest correct implementation of the same function (for tests): grouped heads repeated,
        packed sequences one by one."""
        given = self._check_sequence(q, k, v, causal, token_inputs, always=True, cu_seqlens=cu_seqlens)
        heads = max(q.shape[1], k.shape[1], v.shape[1])
        q, k, v = (repeat_heads(x, heads) for x in (q, k, v))
        if cu_seqlens is None:
            return self._reference(q, k, v, causal, **given)
        return self._per_sequence(self._reference, q, k, v, causal, cu_seqlens.tolist(), given)

    def step(self, q_t, k_t, v_t, state, **token_inputs_t):
        """Recurrent form: ``q_t, k_t: [B, H, Dk]``, ``v_t: [B, H, Dv]``, each token input ``name_t: [B, H]``
        -> ``(out_t [B, H, Dv], new_state)``. The output at time t includes token t. Ranges are
        checked as in the parallel form."""
        given = self._check_token(q_t, k_t, v_t, token_inputs_t)
        return self._step(q_t, k_t, v_t, state, **given)

    def prefill(self, q, k, v, *, state=None, cu_seqlens=None, lengths=None, **token_inputs):
        """Causal parallel form that also returns the decoding state after its last token,
        continuing from ``state`` when given: ``(out [B, H, T, Dv], state)``; with ``cu_seqlens``, the
        states of the N sequences as a batch of N (where the core's state allows it); with ``lengths``
        (N ints), a right-padded batch: row n's state after its first lengths[n] tokens, its padding
        kept out (``inputs.padded_lengths``). Ranges are checked as in the parallel form (a decode cell times its prefill)."""
        given = self._check_sequence(q, k, v, True, token_inputs, always=False, cu_seqlens=cu_seqlens if lengths is None else None)
        if lengths is not None:
            return self._prefill_padded(q, k, v, padded_lengths(self.variant_name, q, lengths, state=state, cu_seqlens=cu_seqlens), **given)
        if cu_seqlens is None:
            return self._prefill(q, k, v, state, **given)
        return self._prefill_packed(q, k, v, state, cu_seqlens.tolist(), **given)

    def init_state(self, batch: int, heads: int, d_value: int, *, device=None, dtype=None):
        """The empty decoding state (a KV cache, or the fast weight matrix and normaliser), which
        ``_prefill`` and ``_step`` take and return: any tensor or tuple of tensors."""
        raise self._missing("init_state")

    def state_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the decoding state for inputs of ``dtype`` (a KV cache keeps the inputs' own)."""
        return dtype

    def step_loop(self, inputs: dict[str, torch.Tensor], state=None):
        """The recurrent form over a whole sequence, token by token, from ``state`` (default: empty):
        ``inputs`` as ``example_inputs`` gives them -> ``(out [B, H, T, Dv], state)``."""
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        if state is None:
            state = self.init_state(q.shape[0], state_heads(k, v), v.shape[-1], device=q.device, dtype=q.dtype)
        outputs = []
        for t in range(q.shape[2]):
            out, state = self.step(**token_slice(inputs, t), state=state)
            outputs.append(out)
        return torch.stack(outputs, dim=2), state

    def example_inputs(
        self, batch: int, heads: int, seq_len: int, d_value: int, *, device=None, dtype=torch.float32, generator=None, requires_grad=False
    ) -> dict[str, torch.Tensor]:
        """Random valid inputs of the parallel form, so that ``core(**inputs)`` works:
        ``{"q", "k": [B, H, T, d_key] ~ N(0, 1), "v": [B, H, T, d_value] ~ N(0, 1)}`` and each
        declared token input ``[B, H, T]`` from its ``draw`` (β ~ U(0, 1), log gate −3u²). Drawn
        in float64 for ``dtype=torch.float64``, else in float32 and cast, on ``device`` from
        ``generator`` (whose device must match); leaves with ``requires_grad`` when asked.
        Unit-norm q and k for a core with ``example_unit_keys``. Laid out as ``input_layout`` says
        (the same values in either layout)."""
        shape, working = (batch, heads, seq_len), torch.float64 if dtype == torch.float64 else torch.float32
        draw = dict(generator=generator, device=device, dtype=working)
        q, k, v = (torch.randn(*shape, width, **draw) for width in (self.d_key, self.d_key, d_value))
        if self.example_unit_keys:
            q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        inputs = {"q": q, "k": k, "v": v} | {spec.name: spec.draw(shape, **draw) for spec in self.token_inputs}
        return {name: in_layout(x.to(dtype), self.input_layout).requires_grad_(requires_grad) for name, x in inputs.items()}

    def implementation_choices(self, q, k, v, *, causal: bool = True, **token_inputs) -> dict:
        """What the parallel form chooses to run for these inputs, for a cell's ``metrics`` (softmax:
        its SDPA kernel; backend 'fla': its kernel and chunk); called outside any timed call. A
        choice pinned by an option that cannot run them raises UnsupportedBackend. None here."""
        return {}

    def extra_repr(self) -> str:
        return f"d_key={self.d_key}, d_dot={self.d_dot}"

    # --- metadata for the harness (a multiply-add counts as 2 FLOPs) -------------------
    def flops(self, batch: int, heads: int, length: int, d_value: int, *, causal: bool = True) -> int:
        """Matmul FLOPs of one call of the parallel form, as implemented (an int: the roofline and the
        estimates read it)."""
        raise self._missing("flops")

    def step_flops(self, batch: int, heads: int, d_value: int, position: int) -> int:
        """Matmul FLOPs of one ``step`` at 0-based ``position`` (``position`` tokens before it; an int:
        decode cells' roofline reads it)."""
        raise self._missing("step_flops")

    def state_numel(self, batch: int, heads: int, d_value: int, length: int) -> int:
        """Elements of the decoding state after ``length`` tokens (an int: decode cells' memory column
        and roofline read it)."""
        raise self._missing("state_numel")

    # --- implemented by each family (token inputs come as keywords) ---------------------
    def _parallel(self, q, k, v, causal, **token_inputs):
        """The parallel form on checked inputs: ``q, k [B, H, T, Dk]``, ``v [B, H, T, Dv]`` -> ``[B, H, T, Dv]``."""
        raise self._missing("_parallel")

    def _reference(self, q, k, v, causal, **token_inputs):
        """The plainest correct form of the same function (the tests and ``attnbench check`` run it in
        float64): ``[B, H, T, D]`` inputs -> ``[B, H, T, Dv]``."""
        raise self._missing("_reference")

    def _prefill(self, q, k, v, state, **token_inputs):
        """The causal parallel form from ``state`` (None: ``init_state``'s) -> ``(out [B, H, T, Dv], the
        state after the last token)``: decode cells prefill the prompt with it."""
        raise self._missing("_prefill")

    def _step(self, q_t, k_t, v_t, state, **token_inputs):
        """One token: ``q_t, k_t [B, H, Dk]``, ``v_t [B, H, Dv]`` and the state -> ``(out_t [B, H, Dv],
        new state)``, out_t including token t."""
        raise self._missing("_step")

    def _missing(self, method: str) -> NotImplementedError:
        """The error of an interface method the core's class does not implement: which, and what it is for."""
        doc = " ".join(getattr(AttentionCore, method).__doc__.split())
        return NotImplementedError(f"{self.variant_name}: {type(self).__name__} does not implement {method}, which the interface needs: {doc}")

    def _parallel_packed(self, q, k, v, causal, bounds, **token_inputs):
        """The parallel form over packed sequences (``bounds``: ``cu_seqlens`` as ints); here one call
        of ``_parallel`` per sequence, which a family replaces by a form that does not serialise."""
        return self._per_sequence(self._parallel, q, k, v, causal, bounds, token_inputs)

    def _prefill_packed(self, q, k, v, state, bounds, **token_inputs):
        raise VariantError(f"{self.variant_name}: prefill takes no cu_seqlens (softmax, the sum and delta rules return packed states); prefill each sequence")

    def _prefill_padded(self, q, k, v, lengths, **token_inputs):
        raise VariantError(f"{self.variant_name}: prefill takes no lengths (softmax and the sum and delta rules decode a padded batch); prefill each row")

    @staticmethod
    def _per_sequence(form, q, k, v, causal, bounds, token_inputs: dict) -> torch.Tensor:
        """``form(q, k, v, causal, **token_inputs)`` on each packed sequence alone, joined along time."""
        pieces = [
            form(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal, **{name: x[:, :, a:b] for name, x in token_inputs.items()}) for a, b in sequences(bounds)
        ]
        return torch.cat(pieces, 2)

    # --- checks --------------------------------------------------------------------
    def _check_sequence(self, q, k, v, causal, token_inputs: dict, *, always: bool, cu_seqlens=None) -> dict:
        """Check q, k, v ``[B, H, T, D]``, ``cu_seqlens`` and the token inputs ``[B, H, T]``; the declared inputs by name."""
        name = self.variant_name
        for label, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise VariantError(f"{name}: {label} must be a 4-d tensor [B, H, T, D], got {shape}")
        self._check_common(q, k, v, "[B, H, T, D]")
        if q.shape[2] == 0:
            raise VariantError(f"{name}: the sequence is empty (T = 0); give at least one token")
        if not causal and not self.supports_noncausal:
            raise VariantError(f"{name}: this variant is causal only; causal=False is not defined for it")
        if cu_seqlens is not None:
            self._check_cu_seqlens(q, cu_seqlens)
        shape = (q.shape[0], max(q.shape[1], v.shape[1]), q.shape[2])
        return self._check_token_inputs(token_inputs, shape, "[B, H, T]", "", always)

    def _check_cu_seqlens(self, q, cu_seqlens) -> None:
        """int32 offsets ``[N + 1]`` from 0 to T, increasing (every sequence has a token), one packed row."""
        name = self.variant_name
        self._check_shape("packed", "")
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
            got = f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
            raise VariantError(f"{name}: cu_seqlens must be a 1-d int32 tensor of N + 1 offsets, got {got}")
        if q.shape[0] != 1:
            raise VariantError(f"{name}: with cu_seqlens the sequences are packed into one row, q [1, H, total_T, D]; got batch {q.shape[0]}")
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != q.shape[2] or any(b <= a for a, b in sequences(bounds)):
            raise VariantError(f"{name}: cu_seqlens must increase from 0 to T={q.shape[2]} (no empty sequence), got {bounds}")

    def _check_token(self, q_t, k_t, v_t, token_inputs: dict) -> dict:
        """Check q_t, k_t, v_t ``[B, H, D]`` and the token inputs ``name_t: [B, H]``."""
        name = self.variant_name
        for label, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise VariantError(f"{name}: {label} must be a 3-d tensor [B, H, D], got {shape}")
        self._check_common(q_t, k_t, v_t, "[B, H, D]")
        return self._check_token_inputs(token_inputs, (q_t.shape[0], max(q_t.shape[1], v_t.shape[1])), "[B, H]", "_t", False)

    def _check_common(self, q, k, v, layout: str) -> None:
        name = self.variant_name
        if q.shape[:1] + q.shape[2:] != k.shape[:1] + k.shape[2:]:
            raise VariantError(f"{name}: q and k must have the same shape {layout} but for the heads, got {tuple(q.shape)} and {tuple(k.shape)}")
        if v.shape[:1] + v.shape[2:-1] != q.shape[:1] + q.shape[2:-1]:
            raise VariantError(f"{name}: v must match q in every dim but the heads and the last {layout}, got q {tuple(q.shape)} and v {tuple(v.shape)}")
        self._check_heads(q.shape[1], k.shape[1], v.shape[1])
        if q.shape[-1] != self.d_key:
            raise VariantError(f"{name}: the last dim of q and k must be d_key={self.d_key}, got {q.shape[-1]}")
        if self.d_value_is_d_key and v.shape[-1] != self.d_key:
            raise VariantError(f"{name}: the operator is per channel; v's last dim must be d_key={self.d_key}, got {v.shape[-1]}")
        if not (q.dtype == k.dtype == v.dtype):
            raise VariantError(f"{name}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")

    def _check_heads(self, q: int, k: int, v: int) -> None:
        """Equal heads, or the grouping the core declares (``head_grouping``), on a backend that takes it."""
        if q == k == v:
            return
        name, grouping = self.variant_name, self.head_grouping
        allowed = {"gqa": k == v and q % k == 0, "gva": q == k and v % q == 0}.get(grouping, False)
        if not allowed:
            takes = HEAD_GROUPINGS[grouping] if grouping else "this variant takes no grouped heads: q, k and v have the same heads"
            raise VariantError(f"{name}: {takes}; got q {q}, k {k}, v {v} heads")
        self._check_shape("grouped", f" (q {q}, k {k}, v {v})")

    def _check_shape(self, shape: str, detail: str) -> None:
        if shape not in self.shapes:
            raise UnsupportedBackend(f"{self.variant_name}: backend={self.backend!r} takes no {SHAPES[shape]}{detail} (variants.supports names who does)")

    def _check_token_inputs(self, given: dict, shape, layout: str, suffix: str, always: bool) -> dict:
        """Exactly the declared token inputs (keywords ``name + suffix``; None is not given), each of
        ``shape`` and, where due (``always``, or ``checks_due``), within its bounds. Returns them by ``name``."""
        variant = self.variant_name
        declared = {spec.name + suffix: spec for spec in self.token_inputs}
        for label, x in given.items():
            if x is not None and label not in declared:
                known = _KNOWN_INPUTS.get(label.removesuffix(suffix) if suffix else label)
                owner = f" (only {known.owner} does)" if known is not None and known not in self.token_inputs else ""
                takes = f"; it takes {', '.join(declared)}" if declared else ""
                raise VariantError(f"{variant}: this variant takes no {label}{owner}{takes}")
        checked = {}
        for label, spec in declared.items():
            x = given.get(label)
            if x is None:
                raise VariantError(f"{variant}: {spec.owner} needs {spec.doc} {label} {layout}, {spec.range_text()}")
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise VariantError(f"{variant}: {label} must have shape {layout} = {tuple(shape)}, got {got}")
            if always or checks_due(x.device):
                spec.check_range(x, variant, label)
            checked[spec.name] = x
        return checked
