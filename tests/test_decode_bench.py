"""CPU checks of the decode benchmark's outputs (validation/decode_bench.py,
validation/plot_decode.py); the benchmark itself runs on the GPU."""
import json

import pytest

from validation.plot_decode import RESULTS, decode_rows, floor_us, plot


def test_decode_plot_draws_the_committed_benchmark(tmp_path):
    """The decode picture is drawn from the committed H200 rows: one panel per shape, the
    default ADA kernel of each codebook per tier, the peers of the same run, and the floor
    (bytes at copy bandwidth), which every measured time must lie above."""
    rows = json.loads((RESULTS / "decode_h200.json").read_text())
    shapes = decode_rows(rows)
    assert list(shapes) == [(32, 8192), (8, 32768), (2, 131072), (1, 131072)]
    for got in shapes.values():
        assert {"sdpa_bf16"} <= set(got)
        assert len(got["ada"]) == 8          # 4 tier sets x 2 codebooks, defaults only
        for r in got["ada"].values():
            assert r["default"] and 0 < floor_us(r) < r["us"]
    png = tmp_path / "decode.png"
    plot(rows, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no default ADA rows"):
        plot([r for r in rows if r["method"] != "ada"], tmp_path / "none.png")
