"""CPU check (no GPU needed): every kernel source compiles with nvcc for sm_90, and ptxas
reports no register spills and no stack frame for any kernel instance (DESIGN §6)."""
import re
import shutil
import subprocess

import pytest

from cupy_kernels._module import CSRC, DIMS, KERNELS

NVCC = shutil.which("nvcc")
SOURCES = sorted(p.name for p in CSRC.glob("*.cuh"))


def test_sources_found():
    assert {"ada_decode.cuh", "encode.cuh", "retier.cuh", "spherical_common.cuh"} <= set(SOURCES)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("name", SOURCES)
def test_compiles_for_sm90_without_spills(name, tmp_path):
    text = (CSRC / name).read_text()
    assert text.lstrip().startswith("//"), f"{name} must open with a comment (thread -> data map)"
    kernels = [k for k in KERNELS if re.search(rf"\b{k}\s*\(", text)]
    lines = [f'#include "{name}"', "void skv_instantiate() {"]
    lines += [f"  (void)&skv::{k}<{d}>;" for k in kernels for d in DIMS]
    lines.append("}")
    unit = tmp_path / "unit.cu"
    unit.write_text("\n".join(lines) + "\n")
    res = subprocess.run([NVCC, "-arch=sm_90", "-Xptxas", "-v", "-std=c++17", f"-I{CSRC}", "-c",
                          str(unit), "-o", str(tmp_path / "unit.o")],
                         capture_output=True, text=True, timeout=600)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    if not kernels:
        return
    entries = re.findall(r"Compiling entry function '([^']+)'", log)
    assert len(entries) == len(kernels) * len(DIMS), log
    spills = re.findall(r"Compiling entry function '([^']+)'.*?(\d+) bytes stack frame, "
                        r"(\d+) bytes spill stores, (\d+) bytes spill loads", log, re.S)
    assert len(spills) == len(entries), log
    for entry, frame, stores, loads in spills:
        # The v4 affine kernel, kept only for the side-by-side benchmark, holds one value
        # across the page loop in 4 bytes of stack (one store before the loop, loads after
        # the prologue and in the epilogue; docs/PERF_NOTES.md v5). The v6 affine kernel keeps
        # one 4-byte page-loop variable in local memory (stores and a load in the page header,
        # once per page, never inside the 32-state step; docs/PERF_NOTES.md v6): measured faster
        # than the spill-free one-sub-tile build. The v8 affine kernel (D = 128) keeps one
        # prologue value for the epilogue in 4 bytes of stack (one store before the page loop,
        # loads in the prologue and the epilogue; nothing inside the loop). Nothing else may spill.
        allowed = {"ada_decode_uniform_v4_kernel": 8, "ada_decode_uniform_v6_kernel": 16,
                   "ada_decode_uniform_v8_kernel": 8}
        allowed = next((v for k, v in allowed.items() if k in entry), 0)
        assert int(stores) <= allowed and int(loads) <= 2 * allowed, \
            f"register spills in {entry} ({name}):\n{log}"
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
