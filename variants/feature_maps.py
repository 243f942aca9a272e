"""Feature maps φ: R^d_key -> R^d_dot that linearise attention (Schlag et al. 2021, §5).

Every linear-time variant is an update rule (sum or delta) times one of these maps.
Each map is a small module with ``d_dot`` (its output dimension) and ``forward(x)``
acting on the last dim of ``x``. A map may treat queries and keys differently (ReBased
learns one affine transform for each): the scans apply ``phi.for_queries`` to queries and
``phi.for_keys`` to keys, which are the map itself for every symmetric map.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import VariantError
from .params import PHI_NAMES

#: ε in the sum normalisation φ(x) / (Σ_j φ(x)_j + ε) and in the attention normaliser.
EPS = 1e-6


class FeatureMap(nn.Module):
    """φ acting on the last dim: ``[..., d_key] -> [..., d_dot]``."""

    def __init__(self, d_key: int, d_dot: int):
        super().__init__()
        self.d_key = d_key
        self.d_dot = d_dot

    @property
    def for_queries(self) -> FeatureMap:
        """The map applied to queries (``self`` unless queries and keys have their own)."""
        return self

    @property
    def for_keys(self) -> FeatureMap:
        """The map applied to keys (``self`` unless queries and keys have their own)."""
        return self

    def extra_repr(self) -> str:
        return f"d_key={self.d_key}, d_dot={self.d_dot}"


class Identity(FeatureMap):
    """φ(x) = x: plain (unnormalised) linear attention, the 1992 fast weight programmer."""

    def __init__(self, d_key: int):
        super().__init__(d_key, d_key)

    def forward(self, x):
        return x


class Elu1(FeatureMap):
    """φ(x) = elu(x) + 1 (Katharopoulos et al. 2020, eq. 7): positive, d_dot = d_key."""

    def __init__(self, d_key: int):
        super().__init__(d_key, d_key)

    def forward(self, x):
        return F.elu(x) + 1


class Favor(FeatureMap):
    """FAVOR+ positive random features, hyperbolic form (Choromanski et al. 2021, Lemma 1,
    eq. 7; Schlag et al. 2021, eq. 31-32).

    φ(x) = exp(-‖x̃‖²/2) / sqrt(2m) · [exp(ω_i·x̃), exp(-ω_i·x̃)]_{i=1..m}, with x̃ = x / d_key^{1/4},
    so that E[φ(q)·φ(k)] = exp(q·k / sqrt(d_key)), the softmax kernel with SDPA's scale.
    ω are ``m`` orthogonal random features (blocks of d_key orthogonal rows, each row
    rescaled to the norm of a Gaussian vector), drawn from ``seed``; d_dot = 2m.
    """

    def __init__(self, d_key: int, m: int, *, seed: int = 0, orthogonal: bool = True):
        if not isinstance(m, int) or m < 1:
            raise VariantError(f"favor: the number of random features m must be a positive int, got {m!r}")
        super().__init__(d_key, 2 * m)
        self.m = m
        self.orthogonal = orthogonal
        self.register_buffer("omega", torch.empty(m, d_key, dtype=torch.float64))
        self.redraw(seed)

    def redraw(self, seed: int | None = None) -> None:
        """Draw fresh random features ω; the same ``seed`` gives the same features."""
        gen = torch.Generator()
        gen.manual_seed(int(torch.randint(2**62, ()).item()) if seed is None else seed)
        gaussian = torch.randn(self.m, self.d_key, generator=gen, dtype=torch.float64)
        if self.orthogonal:
            blocks = -(-self.m // self.d_key)
            squares = torch.randn(blocks, self.d_key, self.d_key, generator=gen, dtype=torch.float64)
            directions = torch.linalg.qr(squares).Q.transpose(-1, -2).reshape(-1, self.d_key)[: self.m]
            gaussian = directions * gaussian.norm(dim=-1, keepdim=True)
        self.omega.copy_(gaussian)

    def forward(self, x):
        x = x * self.d_key**-0.25
        projected = x @ self.omega.to(x.dtype).T
        half_sq_norm = 0.5 * (x * x).sum(-1, keepdim=True)
        features = torch.cat([projected - half_sq_norm, -projected - half_sq_norm], dim=-1)
        return torch.exp(features) / math.sqrt(2 * self.m)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, m={self.m}, orthogonal={self.orthogonal}"


class DPFP(FeatureMap):
    """Deterministic parameter-free projection (Schlag et al. 2021, §5.4, eq. 37).

    r(x) = [ReLU(x), ReLU(-x)] ∈ R^{2d}; φ(x) = [r(x)_i · r(x)_{i-s}] for shifts s = 1..ν and
    i = 1..2d (indices modulo 2d; the paper's r_i · r_{i+s} in another order), so
    d_dot = 2·d_key·ν and φ(x) ≥ 0. Keys in disjoint
    sign regions switch on disjoint features, so they map to orthogonal vectors.
    """

    def __init__(self, d_key: int, nu: int):
        if d_key < 2:
            raise VariantError(f"dpfp: needs d_key >= 2 (with d_key=1 every feature is 0), got d_key={d_key}")
        if not isinstance(nu, int) or not 1 <= nu < 2 * d_key:
            raise VariantError(f"dpfp: nu must be an int in [1, 2*d_key-1] = [1, {2 * d_key - 1}], got {nu!r}")
        super().__init__(d_key, 2 * d_key * nu)
        self.nu = nu

    def forward(self, x):
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
        return torch.cat([r * r.roll(shifts=s, dims=-1) for s in range(1, self.nu + 1)], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, nu={self.nu}"


class L2Normalized(FeatureMap):
    """φ(x) = x / ‖x‖₂ (0 for x = 0): the L2-normalised keys and queries of the gated delta rule
    (Yang, Kautz, Hatamizadeh 2024, §3.4), which keep its erase step I − β k kᵀ contractive."""

    def __init__(self, d_key: int):
        super().__init__(d_key, d_key)

    def forward(self, x):
        return F.normalize(x, dim=-1, eps=EPS)


class SiLUL2Normalized(FeatureMap):
    """φ(x) = SiLU(x) / ‖SiLU(x)‖₂: DeltaNet's keys and queries (Yang, Wang, Shen, Panda, Kim
    2024, §3.3), with which the delta rule trains far better than with elu+1 and sum normalisation."""

    def __init__(self, d_key: int):
        super().__init__(d_key, d_key)

    def forward(self, x):
        return F.normalize(F.silu(x), dim=-1, eps=EPS)


class Taylor(FeatureMap):
    """Second-order Taylor expansion of exp(q·k / √d) (Arora et al. 2024, Based, §4.1, eq. 3):

    φ(x) = [1, x / d^{1/4}, (x ⊗ x) / (√2 · √d)], so φ(q)·φ(k) = 1 + q·k/√d + (q·k)²/(2d),
    with d = d_key; d_dot = 1 + d + d² (the full outer product, not its symmetric half).
    """

    def __init__(self, d_key: int):
        super().__init__(d_key, 1 + d_key + d_key * d_key)

    def forward(self, x):
        x = x * self.d_key**-0.25
        square = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2)
        return torch.cat([torch.ones_like(x[..., :1]), x, square], dim=-1)


class NormalizedSquare(FeatureMap):
    """One side of ReBased's kernel (Aksenov et al. 2024, §4, eq. 7): x' = γ ⊙ LayerNorm(x) + β
    (zero mean, unit variance over d_key, ε = 1e-5; learnable γ, β of size d_key, initialised
    to 1 and 0), and φ(x) = x' ⊗ x', so φ(q)·φ(k) = (q'·k')²; d_dot = d_key²."""

    def __init__(self, d_key: int):
        super().__init__(d_key, d_key * d_key)
        self.gamma = nn.Parameter(torch.ones(d_key))
        self.beta = nn.Parameter(torch.zeros(d_key))

    def forward(self, x):
        x = F.layer_norm(x, (self.d_key,), self.gamma.to(x.dtype), self.beta.to(x.dtype))
        return (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)


class ReBased(FeatureMap):
    """ReBased's learnable quadratic kernel with separate γ, β for queries and keys
    (Aksenov et al. 2024, §4): ``query`` and ``key`` are two ``NormalizedSquare`` maps."""

    def __init__(self, d_key: int):
        super().__init__(d_key, d_key * d_key)
        self.query = NormalizedSquare(d_key)
        self.key = NormalizedSquare(d_key)

    @property
    def for_queries(self) -> FeatureMap:
        return self.query

    @property
    def for_keys(self) -> FeatureMap:
        return self.key

    def forward(self, x):
        raise TypeError("ReBased maps queries and keys differently: call phi.for_queries or phi.for_keys")


class SumNormalized(FeatureMap):
    """φ'(x) = φ(x) / (Σ_j φ(x)_j + ε): Schlag et al. 2021's sum normalisation (§4.2, eq. 29)."""

    def __init__(self, inner: FeatureMap):
        if inner.for_queries is not inner:
            raise VariantError(f"sum_norm: {type(inner).__name__} maps queries and keys differently; use sum_norm=False")
        super().__init__(inner.d_key, inner.d_dot)
        self.inner = inner

    def forward(self, x):
        features = self.inner(x)
        return features / (features.sum(-1, keepdim=True) + EPS)


#: the maps without a size parameter, and the d_dot each has
_FIXED = {
    "identity": (Identity, "d_key"),
    "elu1": (Elu1, "d_key"),
    "l2": (L2Normalized, "d_key"),
    "silu_l2": (SiLUL2Normalized, "d_key"),
    "taylor": (Taylor, "1 + d_key + d_key²"),
    "rebased": (ReBased, "d_key²"),
}


def make_feature_map(phi: str, d_key: int, *, m: int | None = None, nu: int | None = None, d_dot: int | None = None, seed: int = 0) -> FeatureMap:
    """Build φ by name. ``d_dot`` may stand in for ``m`` (favor: m = d_dot / 2) or ``nu``
    (dpfp: ν = d_dot / (2 d_key)); it must then be reachable exactly."""
    if phi not in PHI_NAMES:
        raise VariantError(f"unknown feature map phi={phi!r}; known: {', '.join(PHI_NAMES)}")
    if phi == "favor" and nu is not None:
        raise VariantError(f"phi='favor' takes m, not nu (nu={nu!r} belongs to phi='dpfp')")
    if phi == "dpfp" and m is not None:
        raise VariantError(f"phi='dpfp' takes nu, not m (m={m!r} belongs to phi='favor')")
    if phi == "favor":
        m = _resolve(phi, "m", m, d_dot, 2, "d_dot = 2m")
        return Favor(d_key, m, seed=seed)
    if phi == "dpfp":
        nu = _resolve(phi, "nu", nu, d_dot, 2 * d_key, f"d_dot = 2*d_key*nu = {2 * d_key}*nu")
        return DPFP(d_key, nu)
    if m is not None or nu is not None:
        raise VariantError(f"phi={phi!r} takes neither m nor nu")
    build, rule = _FIXED[phi]
    feature_map = build(d_key)
    if d_dot is not None and d_dot != feature_map.d_dot:
        raise VariantError(f"phi={phi!r} has d_dot = {rule} = {feature_map.d_dot}; cannot give d_dot={d_dot}")
    return feature_map


def _resolve(phi: str, label: str, value, d_dot, per_unit: int, rule: str) -> int:
    """Take ``value`` or derive it from ``d_dot`` = per_unit · value."""
    if d_dot is None:
        if value is None:
            raise VariantError(f"phi={phi!r} needs {label} (or d_dot, with {rule})")
        return value
    if not isinstance(d_dot, int) or d_dot < 1 or d_dot % per_unit:
        raise VariantError(f"phi={phi!r}: d_dot={d_dot!r} is not reachable; it must be a positive multiple of {per_unit} ({rule})")
    derived = d_dot // per_unit
    if value is not None and value != derived:
        raise VariantError(f"phi={phi!r}: {label}={value} gives a d_dot other than the asked d_dot={d_dot} ({rule})")
    return derived
