"""The README as a new user meets it: every Python block runs as written, the commands CI
runs are the README's, and the first-contact behaviours it promises (``--version``, the
subcommands, ``help``, a short compress report) hold."""
import ast
import importlib.util
import pathlib
import pydoc
import subprocess
import sys

import numpy as np
import pytest

import readme_blocks as R
import spherical_kv_ref as skv
from spherical_kv_ref import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYTHON_BLOCKS = [b for b in R.blocks() if b.lang == "python"]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"README-line-{b.line}" for b in PYTHON_BLOCKS])
def test_readme_python_block_runs_as_written(block, tmp_path, monkeypatch):
    missing = [m for m in block.needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"README line {block.line} needs {', '.join(missing)}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = {"__name__": "__readme__"}
    exec(compile(block.code, f"README.md:{block.line}", "exec"), names)
    if "caches" in names:      # the one-call transformers block: the cache compressed itself
        (cache,) = names["caches"]
        report = cache.report
        assert report is not None and report.bytes_after <= report.budget_bytes
        # 20 % of the bf16 bytes of the prompt's states (2 bytes a coordinate, keys and values)
        assert report.budget_bytes == int(0.2 * 2 * 2 * cache.head_dim * report.states_before)

def test_readme_transformers_usage_is_one_call():
    """The README shows the integration as one call, not a hand-made prefill and byte count."""
    (block,) = [b for b in PYTHON_BLOCKS if "spherical_kv_ref.hf" in b.code]
    assert "spherical_kv(model, budget_fraction=" in block.code
    assert "compress(" not in block.code and "ids[:, :-1]" not in block.code


def test_readme_has_the_two_commands_and_the_benchmarks_once_each():
    assert R.command("test").endswith("python -m pytest")
    assert R.command("main").endswith("spherical-kv evaluate --quick")
    assert "asv run" in R.command("bench")
    # CI reads them from here, not from a copy of its own
    ci = (ROOT / ".ci" / "run").read_text()
    assert "tests/readme_blocks.py" in ci
    first = [line.split()[1] for line in ci.splitlines() if line.startswith("readme ")]
    assert first[:2] == ["test", "main"], first       # the two commands come first


def test_block_markers_hold_for_the_next_block_only():
    text = ("<!-- needs: nosuchmodule -->\n```python\nx = 1\n```\ntext\n```python\ny = 2\n```\n"
            "<!-- command: go -->\n\n```bash\necho hi\n```\n")
    a, b, c = R.blocks(text)
    assert a.needs == ("nosuchmodule",) and b.needs == () and c.command == "go"
    assert R.command("go", text) == "echo hi"
    with pytest.raises(ValueError, match="expected 1"):
        R.command("other", text)
    with pytest.raises(ValueError, match="not closed"):
        R.blocks("```python\nx = 1\n")


def test_version_and_help_name_the_commands(capsys, monkeypatch):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"spherical-kv {skv.__version__}"

    class EP:              # an entry point as importlib.metadata gives it
        name, value = "evaluate", "fake_eval:main"

        @staticmethod
        def load():
            return lambda argv: 7 if argv == ["--x"] else 1
    monkeypatch.setattr(cli, "_commands", lambda: {"evaluate": EP})
    assert cli.main(["--help"]) == 0
    assert "evaluate" in capsys.readouterr().out
    assert cli.main([]) == 2                      # no subcommand: the help, as a usage error
    assert "usage: spherical-kv" in capsys.readouterr().err
    assert cli.main(["evaluate", "--x"]) == 7
    assert cli.main(["nosuch"]) == 2
    assert "unknown command 'nosuch'" in capsys.readouterr().err


def test_installed_entry_point_registers_evaluate():
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        distribution("spherical-kv")
    except PackageNotFoundError:
        pytest.skip("the package is not installed (running from the source tree)")
    assert cli._commands()["evaluate"].value == "spherical_kv_eval.evaluate:main"
    out = subprocess.run([sys.executable, "-m", "spherical_kv_ref.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "evaluate" in out


def _imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_dependencies_point_down():
    """The reference imports neither the evaluation nor the experiment scripts; the
    evaluation imports no experiment script; neither changes sys.path."""
    for pkg, banned in (("spherical_kv_ref", ("spherical_kv_eval", "validation")),
                        ("spherical_kv_eval", ("validation",))):
        for f in (ROOT / pkg).rglob("*.py"):
            bad = [m for m in _imported_modules(f) if m.split(".")[0] in banned]
            assert not bad, f"{f.relative_to(ROOT)} imports {bad}"
            assert "sys.path.insert" not in f.read_text(), f


def test_help_of_the_package_points_to_docs_and_lists_the_cache():
    assert "SphericalKVCache" in skv.__all__
    assert all(hasattr(skv, name) for name in skv.__all__)
    text = pydoc.render_doc(skv, renderer=pydoc.plaintext)
    assert "docs/" in text and "DESIGN" not in text
    assert "DESIGN" not in pydoc.render_doc(skv.SphericalKVCache, renderer=pydoc.plaintext)


def test_compress_report_repr_is_a_one_line_summary():
    rng = np.random.default_rng(1)
    cache = skv.SphericalKVCache(2, 2, 32, pool_bytes=1 << 21)
    seq = cache.new_sequence()
    for layer in range(2):
        cache.append(seq, layer, rng.standard_normal((2, 400, 32)), rng.standard_normal((2, 400, 32)))
    report = cache.compress(seq, cache.bytes_in_use(seq) // 3)
    text = repr(report)
    assert "\n" not in text and len(text) < 250, text
    assert f"{report.bytes_before} -> {report.bytes_after}" in text
    assert f"{report.states_kept} kept" in text and report.allocation.method in text
    assert report.allocation.tier.size == 2 * 2 * 400     # the entries are still there


def test_packaging_has_an_hf_extra_one_torch_pin_and_the_cpu_torch_recipe():
    """``hf`` is torch and transformers alone (the evaluation builds on it); torch is pinned
    below the next minor version, the same everywhere; the README says how to get a CPU-only
    torch."""
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert sorted(r.split(">")[0].split("<")[0] for r in extras["hf"]) == ["torch", "transformers"]
    assert "spherical-kv[hf]" in extras["eval"]
    torches = [r for reqs in extras.values() for r in reqs if r.startswith("torch")]
    assert torches and all(r == "torch>=2.4,<2.14" for r in torches), torches
    readme = (ROOT / "README.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
    assert 'pip install -e ".[hf]"' in readme
