"""The feature maps φ: DPFP, FAVOR+, elu+1, identity, sum normalisation, and how d_dot
resolves to m (FAVOR+) or ν (DPFP), directly and through ``variants.create``."""

from __future__ import annotations

import math

import pytest
import torch

import variants
from variants.feature_maps import DPFP, EPS, Elu1, Favor, Identity, SumNormalized, make_feature_map


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny; Favor.redraw runs one small QR per block of d_key rows, which
    is orders of magnitude slower with several intra-op threads on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def randn(gen, *shape, scale=1.0):
    return scale * torch.randn(*shape, generator=gen, dtype=torch.float64)


def unwrap(phi):
    """The map inside a SumNormalized wrapper (or the map itself)."""
    return phi.inner if isinstance(phi, SumNormalized) else phi


# --- DPFP ------------------------------------------------------------------------------


@pytest.mark.parametrize("d_key, nu", [(2, 1), (2, 3), (5, 2), (8, 1), (8, 4), (16, 7)])
def test_dpfp_dims_and_nonnegative(d_key, nu, seed):
    phi = DPFP(d_key, nu)
    assert phi.d_dot == 2 * d_key * nu
    x = randn(torch.Generator().manual_seed(seed), 3, 7, d_key, scale=3.0)
    features = phi(x)
    assert features.shape == (3, 7, 2 * d_key * nu), f"seed {seed}"
    assert (features >= 0).all(), f"seed {seed}: DPFP gave a negative feature"
    assert (features > 0).any(), f"seed {seed}: DPFP gave only zeros"


def test_dpfp_disjoint_quadrants_are_orthogonal(seed):
    """Schlag et al. 2021, §5.4: for d_key = 2, ν = 1 each quadrant switches on its own feature."""
    gen = torch.Generator().manual_seed(seed)
    phi = DPFP(2, 1)
    signs = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [-1.0, -1.0], [1.0, -1.0]], dtype=torch.float64)
    per_quadrant = 6
    # random magnitudes over several orders, kept away from the axes
    magnitudes = torch.exp(randn(gen, 4, per_quadrant, 2, scale=1.5)) + 1e-3
    points = signs[:, None, :] * magnitudes  # [quadrant, point, 2]
    features = phi(points.reshape(-1, 2))
    gram = features @ features.T
    quadrant = torch.arange(4).repeat_interleave(per_quadrant)
    same = quadrant[:, None] == quadrant[None, :]
    assert (gram[~same] == 0).all(), f"seed {seed}: features of different quadrants are not orthogonal:\n{gram}"
    assert (gram[same] > 0).all(), f"seed {seed}: features within a quadrant should overlap:\n{gram}"
    # within a quadrant all points share the same single active feature
    assert ((features > 0).sum(-1) == 1).all(), f"seed {seed}: {features}"


def test_dpfp_hand_computed_values():
    # d_key = 2, ν = 1, x = (2, 3): r = (2, 3, 0, 0), r.roll(1) = (0, 2, 3, 0) -> φ = (0, 6, 0, 0)
    x = torch.tensor([2.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(DPFP(2, 1)(x), torch.tensor([0.0, 6.0, 0.0, 0.0], dtype=torch.float64), rtol=0, atol=0)
    # d_key = 3, ν = 2, x = (1, 2, -3): r = (1, 2, 0, 0, 0, 3)
    #   roll(1) = (3, 1, 2, 0, 0, 0) -> r * roll(1) = (3, 2, 0, 0, 0, 0)
    #   roll(2) = (0, 3, 1, 2, 0, 0) -> r * roll(2) = (0, 6, 0, 0, 0, 0)
    x = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float64)
    expected = torch.tensor([3.0, 2, 0, 0, 0, 0, 0, 6, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(DPFP(3, 2)(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("d_key, nu", [(2, 1), (4, 3), (6, 2)])
def test_dpfp_kernel_matches_the_papers_definition(d_key, nu, seed):
    """Eq. 37 indexes r_i · r_{i+s}; any consistent index order gives the same kernel φ(x)·φ(y)."""
    gen = torch.Generator().manual_seed(seed)
    x, y = randn(gen, 9, d_key), randn(gen, 9, d_key)

    def paper_phi(z):
        r = torch.cat([torch.relu(z), torch.relu(-z)], -1)
        n = 2 * d_key
        return torch.stack([r[..., i] * r[..., (i + s) % n] for s in range(1, nu + 1) for i in range(n)], -1)

    phi = DPFP(d_key, nu)
    torch.testing.assert_close(phi(x) @ phi(y).T, paper_phi(x) @ paper_phi(y).T, msg=lambda m: f"seed {seed}: {m}")


# --- FAVOR+ -----------------------------------------------------------------------------


@pytest.mark.parametrize("d_key, m", [(4, 1), (4, 6), (8, 8), (5, 23)])
def test_favor_positive_with_dim_2m(d_key, m, seed):
    phi = Favor(d_key, m, seed=seed)
    assert phi.d_dot == 2 * m and phi.omega.shape == (m, d_key)
    x = randn(torch.Generator().manual_seed(seed), 4, 3, d_key, scale=2.0)
    features = phi(x)
    assert features.shape == (4, 3, 2 * m)
    assert (features > 0).all(), f"seed {seed}: FAVOR+ features must be positive"


def test_favor_seed_determines_omega(seed):
    a, b, c = Favor(8, 20, seed=seed), Favor(8, 20, seed=seed), Favor(8, 20, seed=seed + 1)
    assert torch.equal(a.omega, b.omega), f"seed {seed}: same seed, different omega"
    assert not torch.allclose(a.omega, c.omega), f"seed {seed}: different seeds gave the same omega"
    x = randn(torch.Generator().manual_seed(seed), 5, 8)
    assert torch.equal(a(x), b(x))


def test_favor_redraw(seed):
    phi = Favor(6, 12, seed=seed)
    original = phi.omega.clone()
    phi.redraw(seed + 7)
    assert not torch.allclose(phi.omega, original), f"seed {seed}: redraw with a new seed kept omega"
    assert torch.equal(phi.omega, Favor(6, 12, seed=seed + 7).omega)
    phi.redraw(seed)
    assert torch.equal(phi.omega, original), f"seed {seed}: redraw with the original seed did not restore omega"
    phi.redraw()  # unseeded: fresh features
    assert not torch.allclose(phi.omega, original)


def test_favor_estimate_approaches_softmax_kernel(seed):
    """E[φ(q)·φ(k)] = exp(q·k / sqrt(d_key)); the error shrinks as m grows."""
    d_key = 8
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(gen, d_key, scale=0.3), randn(gen, d_key, scale=0.3)
    exact = math.exp((q @ k).item() / math.sqrt(d_key))

    def mean_relative_error(m, draws):
        errors = []
        for draw in range(draws):
            phi = Favor(d_key, m, seed=seed + 1000 * draw)
            errors.append(abs((phi(q) @ phi(k)).item() - exact) / exact)
        return sum(errors) / draws

    small, large = mean_relative_error(16, draws=16), mean_relative_error(4096, draws=16)
    assert large < 0.02, f"seed {seed}: m=4096 mean relative error {large:.4g}"
    assert large < 0.5 * small, f"seed {seed}: error did not shrink with m: m=16 {small:.4g}, m=4096 {large:.4g}"


@pytest.mark.parametrize("d_key, m", [(4, 4), (8, 20), (6, 13)])
def test_favor_orthogonal_blocks(d_key, m, seed):
    phi = Favor(d_key, m, seed=seed)
    omega = phi.omega
    for start in range(0, m, d_key):
        block = omega[start : start + d_key]
        gram = block @ block.T
        off_diagonal = gram - torch.diag(torch.diagonal(gram))
        assert off_diagonal.abs().max() < 1e-10 * gram.diagonal().max(), f"seed {seed}: rows {start}.. not orthogonal:\n{gram}"
        assert (gram.diagonal() > 0).all()
    # iid features are not orthogonal: the check above can fail
    iid = Favor(d_key, m, seed=seed, orthogonal=False).omega[:d_key]
    gram = iid @ iid.T
    assert (gram - torch.diag(torch.diagonal(gram))).abs().max() > 1e-6


def test_favor_row_norms_are_gaussian(seed):
    """Each orthogonal row is rescaled to the norm of a Gaussian vector: E‖ω‖² = d_key."""
    d_key = 8
    omega = Favor(d_key, 4096, seed=seed).omega
    mean_sq = (omega * omega).sum(-1).mean().item()
    assert abs(mean_sq - d_key) < 0.1 * d_key, f"seed {seed}: mean squared row norm {mean_sq:.4g}, want about {d_key}"


# --- elu+1, identity, sum normalisation ---------------------------------------------------


def test_elu1(seed):
    x = randn(torch.Generator().manual_seed(seed), 6, 10, scale=3.0)
    phi = Elu1(10)
    assert phi.d_dot == 10
    expected = torch.where(x > 0, x + 1, torch.exp(x))
    torch.testing.assert_close(phi(x), expected, msg=lambda m: f"seed {seed}: {m}")
    assert (phi(x) > 0).all()


def test_identity(seed):
    x = randn(torch.Generator().manual_seed(seed), 3, 5)
    phi = Identity(5)
    assert phi.d_dot == 5
    assert torch.equal(phi(x), x)


@pytest.mark.parametrize("inner", [lambda: Elu1(8), lambda: DPFP(8, 2), lambda: Favor(8, 10)], ids=["elu1", "dpfp", "favor"])
def test_sum_normalized(inner, seed):
    inner = inner()
    phi = SumNormalized(inner)
    assert phi.d_dot == inner.d_dot and phi.d_key == inner.d_key
    x = randn(torch.Generator().manual_seed(seed), 4, 6, 8)
    raw, features = inner(x), phi(x)
    sums = features.sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    # a rescaling of φ, not some other map
    torch.testing.assert_close(features, raw / (raw.sum(-1, keepdim=True) + EPS))
    assert (features >= 0).all()


# --- make_feature_map and create -----------------------------------------------------------


@pytest.mark.parametrize("d_key, d_dot, m", [(4, 2, 1), (8, 16, 8), (8, 30, 15), (16, 256, 128)])
def test_make_favor_from_d_dot(d_key, d_dot, m):
    phi = make_feature_map("favor", d_key, d_dot=d_dot)
    assert isinstance(phi, Favor) and phi.m == m and phi.d_dot == d_dot
    phi = make_feature_map("favor", d_key, m=m, d_dot=d_dot)  # consistent m and d_dot
    assert phi.m == m


@pytest.mark.parametrize("d_key, d_dot, nu", [(2, 4, 1), (2, 12, 3), (8, 32, 2), (64, 256, 2)])
def test_make_dpfp_from_d_dot(d_key, d_dot, nu):
    phi = make_feature_map("dpfp", d_key, d_dot=d_dot)
    assert isinstance(phi, DPFP) and phi.nu == nu and phi.d_dot == d_dot


@pytest.mark.parametrize(
    "phi, d_key, d_dot, rule",
    [
        ("dpfp", 64, 100, r"2\*d_key\*nu"),
        ("dpfp", 4, 12, r"2\*d_key\*nu"),
        ("favor", 8, 7, r"2m"),
        ("favor", 8, 0, r"2m"),
    ],
)
def test_unreachable_d_dot(phi, d_key, d_dot, rule):
    with pytest.raises(variants.VariantError, match=rf"d_dot={d_dot}\b.*{rule}"):
        make_feature_map(phi, d_key, d_dot=d_dot)


def test_d_dot_beyond_the_dpfp_range():
    # d_dot = 16 for d_key = 2 would need ν = 4 >= 2*d_key
    with pytest.raises(variants.VariantError, match=r"nu.*\[1, 3\].*got 4"):
        make_feature_map("dpfp", 2, d_dot=16)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: make_feature_map("favor", 8, m=0), r"m must be a positive int, got 0"),
        (lambda: Favor(8, -3), r"m must be a positive int, got -3"),
        (lambda: make_feature_map("dpfp", 8, nu=0), r"nu must be an int in .*\[1, 15\].*got 0"),
        (lambda: DPFP(4, 8), r"nu must be an int in .*\[1, 7\].*got 8"),
        (lambda: DPFP(4, 9), r"nu must be an int in .*\[1, 7\].*got 9"),
    ],
    ids=["favor-m0", "favor-m-neg", "dpfp-nu0", "dpfp-nu-2dk", "dpfp-nu-big"],
)
def test_out_of_range_m_and_nu(build, match):
    with pytest.raises(variants.VariantError, match=match):
        build()


def test_dpfp_largest_nu_is_allowed():
    assert DPFP(4, 7).d_dot == 56


def test_create_d_dot():
    assert variants.create("dpfp", 64, nu=3).d_dot == 384
    assert variants.create("performer", 16, m=32).d_dot == 64
    assert variants.create("linear", 16).d_dot == 16
    core = variants.create("dpfp", 64, d_dot=256)
    assert core.d_dot == 256
    assert isinstance(unwrap(core.phi), DPFP) and unwrap(core.phi).nu == 2
    performer = variants.create("performer", 16, d_dot=10)
    assert isinstance(unwrap(performer.phi), Favor) and unwrap(performer.phi).m == 5
    delta = variants.create("delta", 8, phi="dpfp", d_dot=48)  # sum-normalised by default
    assert isinstance(delta.phi, SumNormalized) and unwrap(delta.phi).nu == 3 and delta.d_dot == 48
