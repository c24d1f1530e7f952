"""Codebooks: Lloyd–Max conditions, the marginal density, error constants (docs/design.md §3 step 3)."""
import numpy as np
import pytest
from scipy import integrate

from spherical_kv_ref import codebooks as cb

DIMS = (64, 96, 128, 256)


@pytest.mark.parametrize("dim", DIMS)
def test_marginal_density_is_normalised_with_unit_variance(dim):
    s = np.sqrt(dim)
    mass = integrate.quad(lambda t: cb.marginal_pdf(t, dim), -s, s)[0]
    var = integrate.quad(lambda t: t * t * cb.marginal_pdf(t, dim), -s, s)[0]
    assert abs(mass - 1) < 1e-10 and abs(var - 1) < 1e-10


@pytest.mark.parametrize("dim", (64, 96))
def test_closed_form_cdf_and_first_moment_match_quadrature(dim):
    s = np.sqrt(dim)
    for t in (-2.5, -0.3, 0.0, 0.7, 3.1):
        cdf = integrate.quad(lambda x: cb.marginal_pdf(x, dim), -s, t)[0]
        mom = integrate.quad(lambda x: x * cb.marginal_pdf(x, dim), -s, t)[0]
        assert abs(cb.marginal_cdf(t, dim) - cdf) < 1e-10
        assert abs(cb.marginal_first_moment(t, dim) - mom) < 1e-10


@pytest.mark.parametrize("bits", cb.BITS)
@pytest.mark.parametrize("dim", DIMS)
def test_lloyd_max_centroid_and_boundary_conditions(bits, dim):
    levels = cb.codebook(bits, dim)
    assert np.all(np.diff(levels) > 0) and np.allclose(levels, -levels[::-1], atol=0)
    # centroid: each level is the mean of t over its cell (computed by quadrature here)
    edges = cb.boundaries(levels, dim)
    for i in range(0, len(levels), max(1, len(levels) // 16)):
        a, b = edges[i], edges[i + 1]
        p = integrate.quad(lambda t: cb.marginal_pdf(t, dim), a, b, epsabs=1e-14)[0]
        m = integrate.quad(lambda t: t * cb.marginal_pdf(t, dim), a, b, epsabs=1e-14)[0]
        assert abs(m / p - levels[i]) < 1e-6
    # boundary: quantisation switches exactly at the midpoints between levels
    mid = 0.5 * (levels[1:] + levels[:-1])
    below = cb.quantize(np.nextafter(mid, -np.inf), levels)
    above = cb.quantize(np.nextafter(mid, np.inf), levels)
    assert np.array_equal(below, np.arange(len(mid))) and np.array_equal(above, np.arange(1, len(levels)))


@pytest.mark.parametrize("bits", cb.BITS)
def test_uniform_codebook_is_affine_and_no_better_than_lloyd_max(bits):
    u = cb.codebook(bits, 128, "uniform")
    assert np.allclose(np.diff(u), u[1] - u[0], rtol=1e-12)
    assert cb.mse(u, 128) >= cb.mse(cb.codebook(bits, 128), 128) - 1e-15


def test_uniform_costs_about_a_fifth_more_mse_at_four_bits():
    ratio = cb.mse(cb.codebook(4, 128, "uniform"), 128) / cb.mse(cb.codebook(4, 128), 128)
    assert 1.1 < ratio < 1.3


@pytest.mark.parametrize("bits,design", [(1, 0.36), (2, 0.12), (3, 0.035), (4, 0.0095)])
def test_distortion_matches_design_constants_at_large_d(bits, design):
    assert abs(cb.mse(cb.codebook(bits, 256), 256) - design) / design < 0.06


@pytest.mark.parametrize("bits", (1, 2, 3, 4, 8))
def test_monte_carlo_angle_error_agrees_with_leading_order(bits):
    mc = cb.expected_sq_angle_error(bits, 128)
    lead = cb.leading_order_sq_angle_error(bits, 128)
    assert abs(mc - lead) / lead < 0.03


def test_angle_error_constants_decrease_with_bits_and_fp16_is_tiny():
    e = [cb.expected_sq_angle_error(b, 64) for b in (1, 2, 3, 4, 8, 16)]
    assert all(a > b for a, b in zip(e, e[1:]))
    assert e[-1] < 1e-6


def test_bad_codebook_arguments_raise():
    with pytest.raises(ValueError, match="bits"):
        cb.codebook(5, 64)
    with pytest.raises(ValueError, match="kind"):
        cb.codebook(4, 64, "kmeans")
    with pytest.raises(ValueError, match="dim"):
        cb.codebook(4, 2)
