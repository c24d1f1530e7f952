"""The serving frontier's lab pieces (validation/engine_dppl.py, validation/engine_frontier.py):
fp8 e4m3 as vLLM stores it (rounded to nearest; toward zero, as its CPU build does), the
emulated widths, byte budgets and the per-seed summary. No model is loaded here; the
frontier's figures come from the scripts (validation/results/engine)."""
import math

import numpy as np
import pytest

from spherical_kv_eval.model import QKV
from spherical_kv_ref.codec import SphericalCodec, vector_bytes
from validation import engine_dppl as ed
from validation.engine_frontier import summarise


def test_e4m3_rounds_like_vllm_per_tensor_fp8():
    """x -> e4m3(x / s)·s: exact on representable values, relative error at most 2^-4 on
    normal ones (3 mantissa bits), saturated at ±448·s, absolute steps of 2^-9·s below 2^-6·s."""
    s = 0.25
    exact = np.array([0.0, 1.0, -1.5, 448.0, 2.0 ** -6, 2.0 ** -9]) * s
    assert np.array_equal(ed.e4m3(exact, s), exact)
    rng = np.random.default_rng(0)
    x = rng.uniform(2.0 ** -6, 400.0, 1000) * rng.choice([-1, 1], 1000) * s
    assert np.all(np.abs(ed.e4m3(x, s) - x) <= 2.0 ** -4 * np.abs(x))
    assert np.array_equal(ed.e4m3(np.array([1e4, -1e4]) * s, s), np.array([448.0, -448.0]) * s)
    tiny = rng.uniform(0, 2.0 ** -6, 100) * s
    assert np.all(np.abs(ed.e4m3(tiny, s) - tiny) <= 2.0 ** -10 * s)


def test_e4m3_toward_zero_is_the_largest_value_not_above():
    """x -> e4m3 rounded toward zero (fp8-rtz, vLLM's CPU fp8 cache): of every finite e4m3
    value (all 256 bit patterns), the one of largest magnitude not above |x|, with x's sign;
    saturated at ±448·s; on subnormals, normals and values that e4m3 holds exactly."""
    import torch
    s = 0.5
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    grid = grid.double().numpy()
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    rng = np.random.default_rng(1)
    mags = np.concatenate([rng.uniform(0, 2.0 ** -6, 200), rng.uniform(2.0 ** -6, 448, 800),
                           grid, [448.5, 1e4]])
    x = mags * rng.choice([-1, 1], mags.size) * s
    got = ed.e4m3_toward_zero(x, s)
    below = grid[np.searchsorted(grid, np.minimum(mags, 448.0), side="right") - 1]
    assert np.array_equal(np.abs(got), below * s)
    assert np.all(np.sign(got) * np.sign(x) >= 0)
    assert np.array_equal(ed.e4m3_toward_zero(grid * s, s), grid * s)
    # it differs from rounding to nearest: half the normal values round up there
    assert np.mean(np.abs(ed.e4m3(x, s)) > np.abs(got)) > 0.3


def test_fp8_rows_bytes_and_per_tensor_scales():
    """An fp8 row stores one byte per key and value element of every kv-head (exactly half of
    bf16's bytes) and holds two float32 scales per layer once; each layer's keys read back
    through its key scale and its values through its value scale. amax/448 puts a layer's
    largest |x| at e4m3's largest value: nothing saturates, that element comes back exact,
    every normal element within e4m3's 2^-4 relative step."""
    layers, H, d, T = [0, 4, 7], 3, 64, 17
    rng = np.random.default_rng(3)
    keys = [rng.standard_normal((H, T, d)) * (1 + l) for l in range(8)]
    values = [rng.standard_normal((H, T, d)) * 0.01 for _ in range(8)]
    scales = ed.amax_scales(QKV(keys, keys, values), layers)
    fmt = ed.Format("fp8-amax", {l: ("fp8",) + scales[l] for l in layers}, d, H)
    assert fmt.bytes_per_token == len(layers) * H * 2 * d
    assert 2 * fmt.bytes_per_token == fmt.bf16_bytes_per_token
    assert fmt.fixed_bytes == len(layers) * 2 * 4
    for l in layers:
        for part, x in ((0, keys[l]), (1, values[l])):
            s = scales[l][part]
            assert s == np.abs(x).max() / ed.E4M3_MAX
            y = fmt.stored(l, x, part)
            assert np.array_equal(y, ed.e4m3(x, s))
            top = np.unravel_index(np.abs(x).argmax(), x.shape)
            assert math.isclose(y[top], x[top], rel_tol=1e-12)
            normal = np.abs(x) >= 2.0 ** -6 * s
            assert np.all(np.abs(y - x)[normal] <= 2.0 ** -4 * np.abs(x)[normal])
            assert np.all(np.abs(y - x)[~normal] <= 2.0 ** -10 * s)
    assert fmt.tiers() == {l: "fp8" for l in layers}


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_emulated_path_is_the_codec_at_the_formats_widths(bits, monkeypatch):
    """The emulation, run at a width the format has, gives the codec's own decode."""
    x = np.random.default_rng(bits).standard_normal((37, 64)) * 3
    monkeypatch.setattr(ed, "LAB_BITS", (bits,))
    got = ed.LabTier(bits, bits, 64, "uniform", 5).roundtrip(3, 1, 0, x)
    c = SphericalCodec(64, bits, 5, layer=3, head=1, salt=0, codebook="uniform")
    assert np.abs(got - c.decode(c.encode(x))).max() < 1e-12


def test_emulated_widths_sit_between_their_neighbours():
    """Relative error of the emulated 5 and 6 bits between the format's 4 and 8 bits, and
    bytes counted as densely packed codes plus an fp16 scale."""
    x = np.random.default_rng(1).standard_normal((400, 64))

    def err(bits):
        y = ed.LabTier(bits, bits, 64, "uniform", 0).roundtrip(0, 0, 0, x)
        return float(np.mean(np.sum((y - x) ** 2, 1) / np.sum(x * x, 1)))
    e = [err(b) for b in (4, 5, 6, 8)]
    assert e[0] > e[1] > e[2] > e[3]
    assert ed.LabTier(6, 3, 64, "uniform", 0).state_bytes == 4 * 12 + 2 + vector_bytes(3, 64)
    assert ed.LabTier(5, 4, 256, "uniform", 0).state_bytes == 4 * 40 + 2 + vector_bytes(4, 256)


def test_budgets():
    assert ed.budget_bytes("4/4", 64, 90) == 90 * 2 * vector_bytes(4, 64)
    assert ed.budget_bytes("30%", 64, 90) == int(0.3 * 4 * 64 * 90)
    with pytest.raises(ValueError):
        ed.parse_bits("9/4")


def test_layer_allocation_spends_the_budget_where_the_distortion_is():
    """Two layers, one far more sensitive: under 4/4's bytes in both, the sensitive one gets
    more bits than the other, and the bytes stay within the budget."""
    T = len(ed.RDR_LADDER)
    bytes_ = np.array([vector_bytes(k, 64) + vector_bytes(v, 64) for k, v in ed.RDR_LADDER])
    D = np.zeros((2, T + 1))
    D[0, 1:] = 1.0 / bytes_ ** 2
    D[1, 1:] = 100.0 / bytes_ ** 2
    got = ed.solve_layers(D, [7, 9], ed.budget_bytes("4/4", 64, 3 * 2), 3, 64)
    cost = {l: vector_bytes(k, 64) + vector_bytes(v, 64) for l, (k, v) in got.items()}
    assert cost[9] > cost[7] and 3 * sum(cost.values()) <= ed.budget_bytes("4/4", 64, 6)


def test_summary_over_seeds():
    rows = [{"model": "m", "tier": "8/4", "codebook": "uniform", "seed": s, "dppl": d,
             "bytes_per_token": 100, "bf16_bytes_per_token": 256} for s, d in enumerate([0.01, 0.03])]
    (s,) = summarise(rows)
    assert s["seeds"] == 2 and math.isclose(s["mean"], 0.02) and s["max"] == 0.03
    assert math.isclose(s["bytes_frac"], 100 / 256) and s["ci95"] > 0 and not s["lab"]
    with pytest.raises(ValueError, match="twice"):
        summarise(rows + rows[:1])


def test_frontier_labels_do_not_overlap():
    """Three formats at one point and one far away: the three labels take three places, the
    lone one the first choice."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from validation.engine_frontier import LABEL_PLACES, place_labels
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    labels = [("8/4", 50, 50), ("8/4 LM", 50, 50), ("rdr:8/4", 50, 50), ("fp8", 10, 90)]
    got = place_labels(ax, labels, [(x, y) for _, x, y in labels])
    assert len(set(got[:3])) == 3 and got[3] == LABEL_PLACES[0]
    plt.close(fig)
