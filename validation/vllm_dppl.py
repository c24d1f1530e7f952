"""ΔPPL of the vLLM end-to-end test's runs over the plugin's rotation seeds: the default
tier's perplexity run of tests/test_vllm_e2e.py (``tdef``, the same engine arguments and
passage), once per seed, against vLLM's own attention (``own``), and vLLM's own fp8 cache
(``fp8``, no seed) beside it. The draws that the test's bound (DPPL_DEFAULT) is read against
(docs/serving.md "Measured").

    python -m validation.vllm_dppl --seeds 0 1 2 3 4 --fp8 --json rows.json

Needs vLLM's CPU build and the model (docs/serving.md "Install and select"); each run is one
engine process (tests/vllm_run.py), about 30 s for SmolLM2 on 2 cores. Prints one line per
run and the seeds' mean, sd, min and max; ``--json`` keeps the rows, each with the arithmetic
that made it (validation.engine_dppl.arithmetic and vLLM's version).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def e2e_module():
    """tests/test_vllm_e2e.py as a module: its configurations, jobs and run_engine."""
    spec = importlib.util.spec_from_file_location("_vllm_e2e", ROOT / "tests" / "test_vllm_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--fp8", action="store_true", help="vLLM's kv_cache_dtype='fp8' as well")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    import vllm
    from spherical_kv_vllm import parse_tier
    from validation.engine_dppl import arithmetic
    e2e = e2e_module()
    stamp = f"{arithmetic()}, vllm {vllm.__version__}"
    with tempfile.TemporaryDirectory(prefix="vllm_dppl_") as tmp:
        rows = sweep(e2e, pathlib.Path(tmp), a.seeds, a.fp8, stamp,
                     "%d/%d" % parse_tier(e2e.CONFIGS["tdef"]["tier"]))
    ds = np.array([r["dppl"] for r in rows if r["run"] == "tdef"])
    sd = ds.std(ddof=1) if ds.size > 1 else float("nan")
    print(f"tdef {rows[-1]['tier']}: mean ΔPPL {100 * ds.mean():+.2f} % (sd {100 * sd:.2f}, min "
          f"{100 * ds.min():+.2f}, max {100 * ds.max():+.2f}) over {ds.size} seeds")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def sweep(e2e, tmp, seeds, fp8, stamp, tier):
    """The rows: the dense run once, then fp8 (if asked) and the default tier at each seed."""

    def ppl_run(name, seed=None):
        out = tmp / f"{name}_{seed}"
        out.mkdir()
        return e2e.run_engine(name, out, jobs=["ppl"], seed=seed)

    dense_nll, dense = e2e.nll(ppl_run("own"))
    print(f"vLLM's own attention: PPL {math.exp(dense_nll):.4f} over {dense.size} scored tokens",
          flush=True)
    rows = []

    def row(name, label, seed, run):
        got_nll, got = e2e.nll(run)
        if got.shape != dense.shape:
            raise RuntimeError(f"{name}: {got.size} scored tokens, the dense run {dense.size}")
        dp = math.exp(got_nll - dense_nll) - 1
        rows.append({"model": "smollm2", "run": name, "tier": label,
                     "codebook": "-" if seed is None else "uniform", "seed": seed,
                     "ppl": math.exp(got_nll), "dense_ppl": math.exp(dense_nll), "dppl": dp,
                     "tokens": int(got.size), "engine": e2e.CONFIGS[name]["engine"],
                     "arithmetic": stamp})
        print(f"{name} {label} seed {seed}: PPL {math.exp(got_nll):.4f}  ΔPPL {100 * dp:+.2f} %",
              flush=True)

    if fp8:
        row("fp8", "fp8", None, ppl_run("fp8"))
    for seed in seeds:
        row("tdef", tier, seed, ppl_run("tdef", seed))
    return rows


if __name__ == "__main__":
    sys.exit(main())
