"""CPU checks (no GPU needed): every kernel source compiles with nvcc for sm_90, and ptxas
reports no register spills and no stack frame for any kernel instance (docs/design.md §6); and the
module the library builds at run time (NVRTC, the same source string, options and name
expressions as cupy_kernels._module) compiled for sm_90 by NVRTC 13.0 where its library is
installed (the `nvrtc` extra; CI installs it), whose local memory can differ from nvcc's."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_kernels._module import CSRC, DIMS, KERNELS
from validation.build_info import cuda_include, nvrtc_library, offline_build

NVCC = shutil.which("nvcc")
SOURCES = sorted(p.name for p in CSRC.glob("*.cuh"))
# No kernel instance may spill registers or keep a stack frame (nvcc, and NVRTC 13.0, the
# run-time build, whose local memory can differ from nvcc's).
ALLOWED_NVCC: dict = {}
ALLOWED_NVRTC: dict = {}


def check_spills(log: str, allowed: dict, entries_expected: int, what: str) -> None:
    """Every entry function in a ptxas -v log within its spill allowance (0 if unlisted)."""
    entries = re.findall(r"Compiling entry function '([^']+)'", log)
    assert len(entries) == entries_expected, log
    spills = re.findall(r"Compiling entry function '([^']+)'.*?(\d+) bytes stack frame, "
                        r"(\d+) bytes spill stores, (\d+) bytes spill loads", log, re.S)
    assert len(spills) == len(entries), log
    for entry, frame, stores, loads in spills:
        allow = next((v for k, v in allowed.items() if k in entry), 0)
        assert int(stores) <= allow and int(loads) <= 2 * allow, \
            f"register spills in {entry} ({what}): {stores} bytes stored, {loads} loaded"


def test_sources_found():
    assert {"ada_decode.cuh", "encode.cuh", "retier.cuh", "spherical_common.cuh"} <= set(SOURCES)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("name", SOURCES)
def test_compiles_for_sm90_without_spills(name, tmp_path):
    text = (CSRC / name).read_text()
    assert text.lstrip().startswith("//"), f"{name} must open with a comment (thread -> data map)"
    kernels = [k for k in KERNELS if re.search(rf"\b{k}\s*\(", text)]
    instances = [f"skv::{k}<{d}>" for k in kernels for d in DIMS]
    lines = [f'#include "{name}"', "void skv_instantiate() {"]
    lines += [f"  (void)&{i};" for i in instances]
    lines.append("}")
    unit = tmp_path / "unit.cu"
    unit.write_text("\n".join(lines) + "\n")
    res = subprocess.run([NVCC, "-arch=sm_90", "-Xptxas", "-v", "-std=c++17", f"-I{CSRC}", "-c",
                          str(unit), "-o", str(tmp_path / "unit.o")],
                         capture_output=True, text=True, timeout=600)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    if not instances:
        return
    check_spills(log, ALLOWED_NVCC, len(instances), f"nvcc, {name}")
    assert "warning" not in log.lower(), log


def test_module_source_changes_with_any_header(tmp_path, monkeypatch):
    """The string handed to NVRTC (CuPy's on-disk cache key, with the options) carries a digest
    of every header, so an edited .cuh is compiled again instead of loaded stale."""
    from cupy_kernels import _module
    for p in CSRC.glob("*.cuh"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(_module, "CSRC", tmp_path)
    before = _module.source()
    assert before == _module.source()
    with open(tmp_path / "spherical_common.cuh", "a") as f:
        f.write("\n// edited\n")
    after = _module.source()
    assert after != before
    assert after.splitlines()[1:] == before.splitlines()[1:]   # the same #include lines


NVRTC = nvrtc_library()


@pytest.mark.skipif(NVRTC is None or cuda_include() is None,
                    reason="NVRTC 13 library (pip install nvidia-cuda-nvrtc==13.0.*) or CUDA headers missing")
@pytest.mark.parametrize("which", ["ops", "rdr", "wide-fast"])
def test_runtime_build_without_spills(which, monkeypatch):
    """Each module exactly as cupy_kernels._module builds it on the device (source string,
    options, every kernel instance by name): the ops' and RDR's, compiled for sm_90 by NVRTC
    with ptxas -v: every instance within its NVRTC allowance; and the head-dim-256 affine
    decode with its fast pages switched on (WIDE_FAST_ENV), which the default build leaves out."""
    from cupy_kernels import _module
    if which == "wide-fast":
        monkeypatch.setenv(_module.WIDE_FAST_ENV, "1")
        assert "-DSKV_WIDE_FAST_PAGES=1" in _module.build_options()
        source, names = _module.source(), [_module.template_name("ada_decode_affine_kernel", 256)]
    elif which == "ops":
        source, names = _module.source(), _module.instance_names()
    else:
        source, names = _module.source(headers=_module.RDR_HEADERS), list(_module.RDR_KERNELS)
    build = offline_build(source, names, list(_module.build_options()) + ["--ptxas-options=-v"])
    rc, log = build.rc, build.log
    assert rc == 0, log
    check_spills(log, ALLOWED_NVRTC, len(names), "NVRTC")


def test_shared_constants_come_from_the_sources(tmp_path, monkeypatch):
    """The launchers' constants shared with C are read from the .cuh files (one source): an
    edited header changes them, and the values the launchers hold are the headers' (the cell
    table blob the encode launcher builds has the kernels' ENC_WORDS words)."""
    import importlib
    from cupy_kernels import _module, kernel_tables
    enc = importlib.import_module("cupy_kernels.encode")
    dec = importlib.import_module("cupy_kernels.ada_decode")
    c = _module.constants()
    assert dec.THREADS == 32 * c["DEC_WARPS"] and dec.MAX_GROUP == c["DEC_HEADS"]
    assert (dec.TABLE_PATH.ctas_per_sm, dec.AFFINE_PATH.ctas_per_sm) == (c["TABLE_CTAS"], c["AFF_CTAS"])
    assert (dec.TABLE_PATH.ctas(256), dec.AFFINE_PATH.ctas(256), enc.BLOCKS_PER_SM_WIDE) == \
        (c["TABLE_CTAS_WIDE"], c["AFF_CTAS_WIDE"], c["ENC_CTAS_WIDE"])
    assert dec.TABLE_PATH.ctas(128) == c["TABLE_CTAS"] and c["WIDE_DIM"] == 256
    assert sum(enc.BUCKETS.values()) == enc.CELL_NB == c["ENC_NB"]
    for codebook in ("lloyd-max", "uniform"):
        assert enc.cell_tables(kernel_tables([(4, 4), (8, 8)], 128, codebook=codebook)).size == c["ENC_WORDS"]
    for p in CSRC.glob("*.cuh"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    text = (tmp_path / "ada_decode.cuh").read_text()
    assert "constexpr int AFF_CTAS = 4;" in text
    (tmp_path / "ada_decode.cuh").write_text(text.replace("constexpr int AFF_CTAS = 4;",
                                                          "constexpr int AFF_CTAS = 5;"))
    monkeypatch.setattr(_module, "CSRC", tmp_path)
    _module.constants.cache_clear()
    try:
        assert _module.constants()["AFF_CTAS"] == 5
    finally:
        monkeypatch.undo()
        _module.constants.cache_clear()
    assert _module.constants()["AFF_CTAS"] == 4


def test_launch_bounds_name_the_shared_constants():
    """Each kernel's residency asked of ptxas is the named constant the launcher reads."""
    text = (CSRC / "ada_decode.cuh").read_text()
    squash = lambda t: " ".join(t.split())
    text = squash(text)
    assert "__launch_bounds__(DEC_WARPS * 32, D >= WIDE_DIM ? TABLE_CTAS_WIDE : TABLE_CTAS) " \
        "ada_decode_table_kernel(" in text
    assert "__launch_bounds__(DEC_WARPS * 32, D >= WIDE_DIM ? AFF_CTAS_WIDE : AFF_CTAS) " \
        "ada_decode_affine_kernel(" in text
    assert squash((CSRC / "encode.cuh").read_text()).count(
        "__launch_bounds__(ENC_THREADS, D >= WIDE_DIM ? ENC_CTAS_WIDE : ENC_CTAS)") == 2
    assert "__launch_bounds__(RETIER_THREADS)" in (CSRC / "retier.cuh").read_text()


def test_wide_fast_page_lane_maps_on_the_cpu():
    """lab/fast_pages_d256.py: the head_dim-256 fast pages' loads and operands, transcribed per
    lane, give exact logits and value sums on reference-packed pages; a wrong query fragment
    (--mutate) does not."""
    root = Path(__file__).resolve().parents[1]
    script = root / "lab" / "fast_pages_d256.py"
    env = {**os.environ, "PYTHONPATH": str(root)}
    ok = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=root)
    assert ok.returncode == 0 and "all exact" in ok.stdout, ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, str(script), "--mutate"], capture_output=True, text=True,
                         env=env, cwd=root)
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout, bad.stdout + bad.stderr
