"""CPU checks of the step-anatomy script (validation/decode_anatomy.py): the figures it
derives from per-CTA timestamps, and its picture of the committed H200 run (the stamps come
from a DEC7_TRACE build on the GPU)."""
import json

import numpy as np
import pytest

from validation.decode_anatomy import POINTS, PROGRESS_SLOTS, plot, progress_rates, summarize
from validation.plot_decode import RESULTS


def _stamps(entry, prologue, warp_ends, exits, sm):
    """tr[cta, point] in nanoseconds, as the kernel writes them (points 0-8)."""
    n = len(entry)
    tr = np.zeros((n, POINTS), np.uint64)
    t0 = 5_000_000_000
    tr[:, 0] = t0 + np.asarray(entry)
    tr[:, 1] = t0 + np.asarray(prologue)
    tr[:, 4:8] = t0 + np.asarray(warp_ends)
    tr[:, 2] = tr[:, 4:8].max(axis=1) + 100
    tr[:, 3] = t0 + np.asarray(exits)
    tr[:, 8] = sm
    return tr


def test_summary_figures_from_known_stamps():
    """Two rows of two CTAs: the prologue, the spread of the warps' ends, the epilogue and the
    span come out as the stamps were laid (microseconds from the first entry)."""
    tr = _stamps(entry=[0, 1000, 0, 2000], prologue=[10_000, 11_000, 9_000, 12_000],
                 warp_ends=[[50_000, 51_000, 52_000, 53_000], [60_000] * 4,
                            [70_000, 70_000, 71_000, 80_000], [55_000] * 4],
                 exits=[56_000, 63_500, 83_000, 58_000], sm=[0, 1, 2, 3])
    s = summarize(tr, splits=2)
    assert s["span_us"] == pytest.approx(83.0)
    assert s["entry_spread_us"] == pytest.approx(2.0)
    assert s["prologue_us_median"] == pytest.approx(10.0)      # 10, 10, 9, 10
    assert s["pages_end_us_max"] == pytest.approx(80.0)
    assert s["pages_end_us_median"] == pytest.approx(57.5)     # 53, 60, 80, 55
    assert s["warp_spread_us_max"] == pytest.approx(10.0)
    assert s["epilogue_us_max"] == pytest.approx(3.4)          # 63.5 - (60 + 0.1)
    assert s["epilogue_us_median"] == pytest.approx(2.9)
    assert s["row_end_spread_us_median"] == pytest.approx((7.5 + 25.0) / 2)
    assert s["sms"] == 4


def test_anatomy_plot_draws_the_committed_run(tmp_path):
    data = json.loads((RESULTS / "decode_anatomy_h200.json").read_text())
    assert {r["tiers"] for r in data["rows"]} == {"4/4", "rdr-mix"}
    for r in data["rows"]:   # the prologue and the tail are what the notes say they are
        assert 5.0 < r["prologue_us_median"] < 15.0
        assert r["pages_end_us_max"] - r["pages_end_us_median"] > 5.0
    png = tmp_path / "anatomy.png"
    plot(data, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_rates_tell_a_slow_sm_from_a_slowing_warp():
    """Progress stamps every 4 pages: on SM 0 a warp at 1 page/us throughout; on SM 1 a warp
    at 1 page/us that halves its rate in the second half; the other warps have no stamps."""
    tr = _stamps(entry=[0, 0], prologue=[1000, 1000], warp_ends=[[30_000] * 4] * 2,
                 exits=[31_000, 31_000], sm=[0, 1])
    prog = np.zeros((2, 4, PROGRESS_SLOTS), np.uint64)
    t0 = 5_000_000_000
    prog[0, 0, :5] = t0 + 1000 * np.array([4, 8, 12, 16, 20])     # gaps 4, 4, 4, 4 us
    prog[1, 0, :5] = t0 + 1000 * np.array([4, 8, 12, 20, 28])     # gaps 4, 4, 8, 8 us
    r = progress_rates(tr, prog)
    assert r["late_over_early_rate_median"] == pytest.approx((1.0 + 0.5) / 2)
    assert r["sm_rate_min_over_max"] == pytest.approx((16 / 24) / 1.0)
    assert r["warp_pages_per_us_median"] == pytest.approx((1.0 + 16 / 24) / 2)
    s = summarize(tr, splits=1, prog=prog)
    assert s["sm_rate_min_over_max"] == pytest.approx(16 / 24)
    assert progress_rates(tr, np.zeros_like(prog)) == {}
