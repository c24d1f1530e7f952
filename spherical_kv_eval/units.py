"""The evaluation's units: one (context length, window) each, a dense prefill and every
method of the line-up through its own compressed copy; run over worker processes, logged to
``units.jsonl`` as each ends (``--resume`` goes on from it), and turned into the report rows
by ``run``."""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from spherical_kv_eval.lineup import Infeasible, lineup
from spherical_kv_eval.reports import ci95
from spherical_kv_eval.runner import (Runner, _RecordingStore, _exact_store, attention_error,
                                      corpus_tokens, probe_context, window)


def _say(msg: str) -> None:
    print(f"spherical-kv evaluate: {msg}", file=sys.stderr, flush=True)


def _progress(iterable, **kw):
    try:
        from tqdm.auto import tqdm
        return tqdm(iterable, **kw)
    except ImportError:               # tqdm is a dependency; stay usable without it
        return iterable


_WORKER = {}


class NoSuchMethod(ValueError):
    """A ``--methods`` prefix that names no method of the line-up."""


def _methods(cfg, args) -> list:
    """The line-up of a run: ``lineup`` at its budgets, kept to ``--methods`` prefixes
    (``NoSuchMethod`` for a prefix that matches none)."""
    every = lineup(cfg, args.budgets, rdr_extra=args.rdr_extra, rdr_recent=args.rdr_recent,
                   peers=getattr(args, "peers", True))
    if not args.methods:
        return every
    unknown = [p for p in args.methods if not any(m.name.startswith(p) for m in every)]
    if unknown:
        raise NoSuchMethod(f"--methods {' '.join(unknown)} matches no method of the line-up "
                           f"({', '.join(m.name for m in every)})")
    return [m for m in every if any(m.name.startswith(p) for p in args.methods)]


def runner_options(args) -> dict:
    """The keyword arguments of a run's ``Runner``, from its arguments: how the windows are
    held, and where the model (``--device``) and the peers' prefills (``--peer-device``, by
    default the model's device) run. The one place a run's device reaches the model."""
    device = getattr(args, "device", None) or "cpu"
    peer = getattr(args, "peer_device", None)
    return {"window_bits": getattr(args, "window_bits", 16), "device": device,
            "peer_device": peer if peer or device == "cpu" else device}


def _worker_setup(threads: Optional[int], model_name: str = "smollm2",
                  options: Optional[dict] = None) -> None:
    """Load the model once per process (``threads``: torch threads, None = leave;
    ``options``: the ``Runner``'s, ``runner_options``)."""
    if _WORKER:
        return
    import torch
    from spherical_kv_eval.model import load_model
    if threads:
        torch.set_num_threads(threads)
    model, tok = load_model(model_name)
    _WORKER.update(runner=Runner(model, tok, **(options or {})), cfg=model.config, tok=tok)


def _unit(job) -> dict:
    """One (context length, window): a dense prefill, then every method through its own
    compressed copy. Window ``"probe"``: the retrieval probe of that context length.
    Returns per-method results. A job ``(T, w, start, args, ids, position, part)`` with
    ``args.method_parts`` = N > 1 runs every N-th method of the line-up from the ``part``-th
    on (its own prefill, the same for every part)."""
    t0 = time.time()
    device = getattr(_WORKER["runner"], "device", None)
    on_gpu = device is not None and device.type == "cuda"
    if on_gpu:
        import torch
        torch.cuda.reset_peak_memory_stats(device)
    out = _unit_results(job)
    out["seconds"] = round(time.time() - t0, 1)
    if on_gpu:          # this process's peak over the unit (the model's copy included)
        out["device_name"] = torch.cuda.get_device_name(device)
        out["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


def _method_parts(args) -> int:
    """How many units each window's line-up is split over (``--method-parts``, at least 1)."""
    return max(1, getattr(args, "method_parts", 1) or 1)


def _unit_results(job) -> dict:
    T, w, s, args, ids, position, *rest = job
    part, parts = (rest[0] if rest else 0), _method_parts(args)
    extra = tuple(rest[1]) if len(rest) > 1 and rest[1] else ()
    runner, cfg = _WORKER["runner"], _WORKER["cfg"]
    if extra:           # a supplement: only these methods (the line-up grew since the log)
        methods = [m for m in _methods(cfg, args) if m.name in extra]
    else:
        methods = _methods(cfg, args)[part::parts]
    out = {"T": T, "w": w, "part": part, "parts": parts, "methods": {},
           "attempted": [m.name for m in methods]}
    if extra:
        out["extra"] = list(extra)
    bos = getattr(args, "bos", None)
    if w == "probe":        # one planted context per context length
        pctx, span, p0 = probe_context(ids[s:], T, args.probe, np.random.default_rng([args.seed, T]),
                                       bos)
        ppre = runner.prefill(pctx)
        for m in _progress(methods, desc=f"T={T} probe", leave=False, position=position):
            try:
                pstore, _ = m.build(ppre)
            except Infeasible:
                continue
            r = out["methods"][m.name] = {}
            r["ret"] = float(runner.score(pstore, ppre, span)[1:].mean())
            if m.protects:
                pstore, _ = m.build(ppre, protect=[(p0, p0 + args.probe)])
                r["ret_p"] = float(runner.score(pstore, ppre, span)[1:].mean())
        return out
    ctx, cont = window(ids, s, T, args.continuation, bos)
    pre = runner.prefill(ctx)
    out["window_bytes"] = pre.window_bytes / pre.dense_bytes
    rec = _RecordingStore(_exact_store(pre))
    dense_lp = runner.logprobs(rec, pre.reference(), cont)
    # the scored tokens' own queries (every 8th): what later decoding asks of the context
    future_q = [q[0][:, ::8] for _, q in sorted(rec.queries.items())]
    if args.generate:
        gpre = pre
        if args.defer:      # compress after the first ``defer`` tokens, generated densely
            first = runner.greedy(_exact_store(pre), pre.reference(), args.defer)
            gpre = runner.prefill(np.concatenate([ctx, first]), observe=args.defer)
        ref_tokens, ref_gaps = runner.greedy(_exact_store(gpre), gpre.reference(), args.generate,
                                             margins=True)
        out["dense_gaps"] = [float(g) for g in ref_gaps]
    out["dense_nll"] = float(-dense_lp[np.arange(len(cont)), cont].mean())
    for m in _progress(methods, desc=f"T={T} window {w + 1}", leave=False, position=position):
        try:
            store, nbytes = m.build(pre)
        except Infeasible:          # the windows alone exceed this budget: no point
            continue
        r = out["methods"][m.name] = {}
        fresh = None                                    # the greedy run's store
        if args.generate:
            fresh = m.build(gpre)[0] if args.defer else copy.deepcopy(store)   # scoring appends
        r["bytes"] = nbytes / pre.dense_bytes
        r["store_bytes"] = (nbytes - pre.window_bytes) / pre.store_dense_bytes
        r["err"] = attention_error(store, pre, future_q)
        lp = runner.logprobs(store, pre, cont)
        r["nll"] = float(-lp[np.arange(len(cont)), cont].mean())
        r["kl"] = float(np.mean(np.sum(np.exp(dense_lp) * (dense_lp - lp), axis=1)))
        r["top1"] = float(np.mean(lp.argmax(axis=1) == dense_lp.argmax(axis=1)))
        if args.generate:
            r.update(greedy_on_dense_path(runner.logprobs(fresh, gpre, ref_tokens), ref_tokens, ref_gaps))
    return out


def greedy_on_dense_path(lp: np.ndarray, ref_tokens: np.ndarray, ref_gaps: np.ndarray) -> dict:
    """A method's greedy agreement with dense, read off one teacher-forced pass along the
    dense greedy tokens (``lp``: log-probs (G, vocab) of that pass, ``Runner.logprobs``).

    No store compresses or evicts while it generates: each appends the generated tokens'
    keys and values one by one, the same way in one chunk as in G steps. So up to its first
    disagreement the method's own greedy run *is* the dense run, with exactly these logits,
    and the common prefix is the first position where ``argmax lp`` leaves ``ref_tokens``
    (``tests/test_evaluate.py`` checks this against stepping). One chunk instead of G
    one-token steps is what lets the default run afford four windows.
    Returns ``agree`` (common prefix / G), ``gap`` (dense's own top-2 logit gap where the
    method left it; None: never left), ``tokens`` (share of the G positions where the
    method's next token is dense's, given dense's prefix: the tie-robust companion, since
    one near-tie of the dense run ends every lossy method's common prefix at the same place)
    and ``margin_err``: the RMS over the G positions of the change the method makes to the
    margin the greedy choice is made on (dense's token against the best other token; dense's
    own margin is ``ref_gaps``). A position flips exactly when the change exceeds dense's
    margin there, so this is the error to set against the dense run's near-ties.
    """
    rows = np.arange(len(ref_tokens))
    hit = lp.argmax(axis=1) == ref_tokens
    miss = np.flatnonzero(~hit)
    first = int(miss[0]) if miss.size else len(hit)
    others = lp.copy()
    others[rows, ref_tokens] = -np.inf
    margin = lp[rows, ref_tokens] - others.max(axis=1)
    return {"agree": first / len(hit), "gap": float(ref_gaps[first]) if miss.size else None,
            "tokens": float(hit.mean()),
            "margin_err": float(np.sqrt(np.mean((margin - ref_gaps) ** 2)))}


def _gap_summary(gaps: np.ndarray) -> dict:
    """The dense greedy runs' top-2 logit gaps: the share of positions under a few gaps, and
    the smallest ones (the near-ties a perturbed cache flips first)."""
    return {"positions": int(gaps.size),
            "share_below": {str(g): float(np.mean(gaps < g)) for g in (0.01, 0.02, 0.05, 0.1, 0.2)},
            "smallest": [float(g) for g in np.sort(gaps)[:8]]}


def _main_setup(procs: int, model_name: str = "smollm2", options: Optional[dict] = None):
    """(model config, tokenizer) for the main process of a run. With one process the units
    run here too, so the model is loaded once, for them as well; with more, the workers load
    their own and this process keeps only the config and the tokenizer (on the CPU: it runs
    no unit, so it holds nothing on a GPU)."""
    if procs <= 1:
        _worker_setup(None, model_name, options)
        return _WORKER["cfg"], _WORKER["tok"]
    from spherical_kv_eval.model import load_model
    model, tok = load_model(model_name)
    return model.config, tok


def _device_record(device: str, units) -> dict:
    """What a run's meta says of where it ran: ``device``, ``device_name`` and, on a GPU,
    ``gpu_peak_bytes``: the most GPU memory one worker process held during one unit
    (``torch.cuda.max_memory_allocated``, its model's copy included; every worker holds
    its own)."""
    if device == "cpu":
        return {"device": device, "device_name": _cpu_name()}
    names = sorted({u["device_name"] for u in units if "device_name" in u})
    peaks = [u["gpu_peak_bytes"] for u in units if "gpu_peak_bytes" in u]
    return {"device": device, "device_name": " + ".join(names) or None,
            "gpu_peak_bytes": max(peaks) if peaks else None}


def _cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows."""
    import platform
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def window_starts(num_ids: int, T: int, continuation: int, windows: int) -> np.ndarray:
    """Where the ``windows`` windows of T context + ``continuation`` tokens start: evenly
    over the corpus tokens, neither end included."""
    return np.linspace(0, num_ids - T - continuation - 1, windows + 2)[1:-1].astype(int)


def run_windows(tok, args, unit):
    """The lab scripts' loop: ``args.windows`` windows of ``args.context`` tokens (and
    ``args.continuation`` more) spread over the corpus, the first ``args.first`` of them, each
    a job (T, window, start, args, ids) run by ``unit`` over ``args.jobs`` worker processes."""
    T = args.context
    ids, _ = corpus_tokens(tok, (T + args.continuation) * (args.windows + 1))
    starts = window_starts(len(ids), T, args.continuation, args.windows)
    jobs = [(T, w, int(s), args, ids) for w, s in enumerate(starts)][:args.first]
    return _pool_run(jobs, args.jobs, unit=unit)


def _as_they_end(pool, unit, jobs, procs: int, may_start: Callable):
    """Results of ``unit`` over ``jobs`` in ``pool``, as each ends: ``procs`` run at once,
    and a job starts only while ``may_start(slowest)`` (``slowest``: the longest a unit has
    taken so far, in seconds; None before one ends); a unit's exception is raised here."""
    import queue
    ended = queue.Queue()
    todo = iter(jobs)
    running, slowest = 0, None

    def start() -> int:
        if not may_start(slowest):
            return 0
        job = next(todo, None)
        if job is None:
            return 0
        t0 = time.monotonic()
        pool.apply_async(unit, (job,), callback=lambda r: ended.put((r, time.monotonic() - t0)),
                         error_callback=lambda e: ended.put((e, None)))
        return 1

    for _ in range(procs):
        running += start()
    while running:
        result, took = ended.get()
        running -= 1
        if isinstance(result, BaseException):
            raise result
        slowest = max(slowest or 0.0, took)
        yield result
        running += start()


def _pool_run(jobs, procs: int, unit=None, model_name: str = "smollm2",
              options: Optional[dict] = None, done: Optional[Callable] = None,
              time_limit: Optional[float] = None):
    """Run ``unit`` (default ``_unit``) over the jobs, in ``procs`` worker processes of one
    thread each (two processes on two cores beat one process of two threads: numpy's BLAS
    and torch's threads fight); ``options``: each worker's ``Runner`` (``runner_options``:
    with ``device`` "cuda" every worker holds its own copy of the model on the GPU and runs
    its forward passes there, its NumPy work on its own core; docs/evaluate.md "On a GPU");
    ``done(result)``, if given, is called on each result as it comes (in this process).
    ``time_limit``: seconds from now within which to end: a unit starts only while the
    slowest unit so far (none: any) would still end within it, and those running finish, so
    a part of a run under a wall-clock limit loses no unit to it. Returns the results."""
    unit = _unit if unit is None else unit
    done = done or (lambda result: None)
    stop = None if time_limit is None else time.monotonic() + time_limit
    may_start = lambda slowest: stop is None or time.monotonic() + (slowest or 0.0) < stop
    if procs <= 1:
        _worker_setup(None, model_name, options)
        out, slowest = [], None
        for j in jobs:
            if not may_start(slowest):
                break
            t0 = time.monotonic()
            out.append(unit(j))
            slowest = max(slowest or 0.0, time.monotonic() - t0)
            done(out[-1])
        return out
    import multiprocessing as mp
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update({k: "1" for k in saved})          # the workers' BLAS reads this at import
    try:
        with mp.get_context("spawn").Pool(procs, initializer=_worker_setup,
                                     initargs=(1, model_name, options)) as pool:
            out = []
            for result in _progress(_as_they_end(pool, unit, jobs, procs, may_start),
                                    total=len(jobs), desc="(context, window) units",
                                    position=procs):
                out.append(result)
                done(result)
            return out
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def layer_summary(cfg) -> dict:
    """Which model layers are full attention (compressed by every method) and which attend
    a sliding window (kept as the model holds them), and what the budgets are of."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    full = [i for i, t in enumerate(types) if t != "sliding_attention"]
    slide = [i for i, t in enumerate(types) if t == "sliding_attention"]
    out = {"full_attention": full, "sliding_attention": slide}
    if slide:
        out["sliding_window"] = int(cfg.sliding_window)
        out["budget_of"] = ("the whole dense bf16 cache as the model holds it: the "
                            "full-attention layers' context and the sliding layers' windows; "
                            "the windows are kept at bf16 by every method and their bytes "
                            "come off each budget first")
    return out


# the settings a (context, window) unit's result depends on (the context lengths are the
# units' own): a run resumes only units made with the same ones. The device is one: a GPU's
# float32 differs from the CPU's in the last bits, which can flip a near-tie of a greedy run,
# and a window's figures are paired across methods, so one run's units come from one device.
UNIT_SETTINGS = ("model", "budgets", "rdr_extra", "rdr_recent", "windows",
                 "continuation", "generate", "defer", "probe", "methods", "peers", "seed",
                 "window_bits", "device")
#: what a log made before a setting existed was made with
LEGACY_SETTINGS = {"device": "cpu"}


class UnitLog:
    """``units.jsonl`` under a run's folder: its first line the unit settings, then one line
    per finished (context, window) unit, appended as each ends, so an interrupted run (or
    one split with ``--max-units``) goes on with ``--resume`` where it stopped. Without
    ``resume`` the log is started afresh; with it, a log made with other settings is
    refused (nothing is mixed)."""

    def __init__(self, path: Path, settings: dict, resume: bool):
        self.path, self.done = path, {}
        settings = json.loads(json.dumps(settings))          # as it reads back
        if resume and path.exists():
            text = path.read_text()
            if text and not text.endswith("\n"):     # cut off mid-line: later lines start anew
                with path.open("a") as f:
                    f.write("\n")
            lines = text.splitlines()
            first = json.loads(lines[0]) if lines else {}
            logged = first.get("settings")
            if logged is not None:
                logged = dict({k: v for k, v in LEGACY_SETTINGS.items() if k in settings},
                              **logged)
            if logged != settings:
                diff = sorted(k for k in set(settings) | set(logged or {})
                              if settings.get(k) != (logged or {}).get(k))
                raise ValueError(f"--resume: {path} was made with other settings ({', '.join(diff)} "
                                 f"differ); run without --resume to start afresh")
            for line in lines[1:]:
                try:
                    u = json.loads(line)
                except json.JSONDecodeError:        # a line cut off by the interruption
                    continue
                self.done[self._key(u)] = u
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"settings": settings}) + "\n")

    def add(self, unit: dict) -> None:
        self.done[self._key(unit)] = unit
        with self.path.open("a") as f:
            f.write(json.dumps(unit) + "\n")

    @staticmethod
    def _key(unit: dict) -> tuple:
        return (unit["T"], unit["w"], unit.get("part", 0), unit.get("parts", 1),
                tuple(unit.get("extra", ())))

    def find(self, T, w, part: int, parts: int) -> Optional[dict]:
        """The logged unit holding part ``part`` of ``parts`` of (T, w): that part, or the
        window whole (a unit of one part), or None."""
        return self.done.get((T, w, part, parts, ())) or self.done.get((T, w, 0, 1, ()))

    def supplements(self, T, w) -> list:
        """The logged supplements of (T, w): units of methods the line-up gained later."""
        return [u for k, u in self.done.items() if k[:2] == (T, w) and k[4]]


def _attempted(units) -> set:
    """The methods the units ran (or found infeasible); a unit logged before units said so
    ran those it holds."""
    return {name for u in units for name in u.get("attempted", u["methods"])}


def _merge_parts(units: list) -> dict:
    """One (length, window) unit from its parts (the same unit, alone, when it is whole):
    their methods together, the prefill's figures from the first, checked equal in every
    part (each part ran the same prefill; a difference would mix two computations)."""
    units = list({id(u): u for u in units}.values())
    if len(units) == 1:
        return units[0]
    out = dict(units[0], methods={}, seconds=sum(u.get("seconds", 0.0) for u in units))
    for u in units:
        for k in ("dense_nll", "dense_gaps", "window_bytes"):
            if not _same_figure(u.get(k), units[0].get(k)):
                raise RuntimeError(f"the parts of unit (T={u['T']}, window {u['w']}) disagree "
                                   f"on {k}: their prefills differ")
        out["methods"].update(u["methods"])
    return out


def _same_figure(a, b) -> bool:
    """Whether two parts' prefill figures come from one computation: equal, or within
    float32 rounding (the same run on another host's BLAS build differs in the last bits;
    another window, model or setting differs by far more)."""
    if a is None or b is None:
        return a is b
    return np.allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-5, atol=1e-6)


def _supplements(log: UnitLog, jobs, parts: int, names) -> list:
    """The supplement jobs ``(T, w, start, args, ids, 0, methods)`` of every window whose
    logged units (all its parts there) lack some of the line-up's ``names``."""
    out = []
    for T, w, s, args, ids, _ in [j for j in jobs if j[5] == 0]:
        logged = [log.find(T, w, k, parts) for k in range(parts)]
        if None in logged:
            continue
        have = _attempted(logged + log.supplements(T, w))
        lacking = tuple(n for n in names if n not in have)
        if lacking:
            out.append((T, w, s, args, ids, 0, lacking))
    return out


class Unfinished(RuntimeError):
    """A run split with ``--max-units`` still has units to do (``--resume`` goes on)."""


def run(args) -> list[dict]:
    from spherical_kv_eval.model import model_spec
    t0 = time.time()
    spec = model_spec(args.model)
    options = runner_options(args)
    parts = _method_parts(args)
    cfg, tok = _main_setup(args.jobs, args.model, options)
    args.bos = tok.bos_token_id if spec.bos else None
    methods = _methods(cfg, args)
    jobs = []
    for T in args.contexts:
        # each context length's windows depend on it alone (not on the other lengths of the
        # run), so a run of more lengths holds a run of fewer, and --resume can add lengths
        ids, source = corpus_tokens(tok, (T + args.continuation) * (args.windows + 1),
                                    special=not spec.bos)
        starts = window_starts(len(ids), T, args.continuation, args.windows)
        windows = [(T, w, int(s)) for w, s in enumerate(starts)]
        if args.probe:                          # --probe 0: no retrieval probe
            windows.append((T, "probe", int(starts[0])))
        jobs += [(T, w, s, args, ids, k) for T, w, s in windows for k in range(parts)]
    # longest first (a window costs about three probes), so the two processes end together
    jobs.sort(key=lambda j: -j[0] * (1 if j[1] == "probe" else 3))
    settings = {k: getattr(args, k, None) for k in UNIT_SETTINGS}
    settings["device"] = options["device"]
    log = UnitLog(args.out / "units.jsonl", settings, getattr(args, "resume", False))
    todo = [j for j in jobs if log.find(j[0], j[1], j[5], parts) is None]
    resumed = len(jobs) - len(todo)
    # a line-up grown since the log was made (a new baseline): each logged window runs only
    # the methods it lacks, in a supplement unit of its own, merged with the rest below
    names = [m.name for m in methods]
    supplements = _supplements(log, jobs, parts, names)
    todo += supplements
    if getattr(args, "max_units", None) is not None:
        todo = todo[:args.max_units]
    if len(todo) < len(jobs) + len(supplements):
        new = f" ({len(supplements)} for methods new to the line-up)" if supplements else ""
        _say(f"{len(jobs) + len(supplements)} units{new}: {resumed} resumed from {log.path}, "
             f"{len(todo)} to run now, {len(jobs) + len(supplements) - resumed - len(todo)} "
             f"left for later")
    todo = [j[:5] + (i % max(args.jobs, 1),) + j[5:] for i, j in enumerate(todo)]
    if todo:
        _pool_run(todo, args.jobs, model_name=args.model, options=options, done=log.add,
                  time_limit=getattr(args, "time_limit", None))
    missing = (sum(log.find(j[0], j[1], j[5], parts) is None for j in jobs)
               + len(_supplements(log, jobs, parts, names)))
    if missing:
        raise Unfinished(f"{missing} of {len(jobs) + len(supplements)} units still to run: the "
                         f"same command with --resume goes on ({log.path})")
    # one unit per (length, window), its parts' methods together; the log may hold other
    # lengths too
    units = [_merge_parts([log.find(T, w, k, parts) for k in range(parts)] + log.supplements(T, w))
             for T, w in dict.fromkeys((j[0], j[1]) for j in jobs)]
    rows, infeasible = [], {}
    for T in args.contexts:
        mine = sorted((u for u in units if u["T"] == T and u["w"] != "probe"), key=lambda u: u["w"])
        probe = [u for u in units if u["T"] == T and u["w"] == "probe"]
        ppl_dense = np.exp(np.array([u["dense_nll"] for u in mine]))
        window_share = float(np.mean([u["window_bytes"] for u in mine]))
        for m in methods:
            if any(m.name not in u["methods"] for u in mine):    # the windows exceed its budget
                infeasible.setdefault(str(T), []).append(m.name)
                continue
            rs = [u["methods"][m.name] for u in mine + probe if m.name in u["methods"]]
            get = lambda k: [r[k] for r in rs if k in r]
            dppl = (np.exp(np.array(get("nll"))) / ppl_dense - 1) * 100
            rows.append({
                "method": m.name, "family": m.family, "budget_fraction": m.budget,
                "bytes_fraction": float(np.mean(get("bytes"))), "context": int(T),
                "store_bytes_fraction": float(np.mean(get("store_bytes"))),
                "window_bytes_fraction": window_share,
                "windows": len(mine), "ppl_dense": float(ppl_dense.mean()),
                "delta_ppl_pct": float(dppl.mean()),
                "delta_ppl_spread": float(dppl.max() - dppl.min()),
                "delta_ppl_ci95": ci95(dppl),
                "delta_ppl_windows": [float(x) for x in dppl],
                "retrieval_loss": float(np.mean(get("ret"))) if get("ret") else None,
                "retrieval_loss_protected": float(np.mean(get("ret_p"))) if get("ret_p") else None,
                "greedy_agreement": float(np.mean(get("agree"))) if get("agree") else None,
                "greedy_agreement_ci95": ci95(get("agree")),
                "greedy_agreement_windows": get("agree"),
                "greedy_dense_gap_at_divergence": [r.get("gap") for r in rs if "agree" in r],
                "greedy_token_agreement": float(np.mean(get("tokens"))) if get("tokens") else None,
                "greedy_token_agreement_ci95": ci95(get("tokens")),
                "greedy_margin_err": float(np.mean(get("margin_err"))) if get("margin_err") else None,
                "greedy_margin_err_ci95": ci95(get("margin_err")),
                "greedy_margin_err_windows": get("margin_err"),     # for window-paired CIs
                "attn_out_rel_err": float(np.mean(get("err"))),
                "attn_out_rel_err_ci95": ci95(get("err")),
                "kl_nats": float(np.mean(get("kl"))),
                "kl_nats_ci95": ci95(get("kl")),
                "kl_windows": get("kl"),
                "top1_agreement": float(np.mean(get("top1"))),
                "top1_agreement_ci95": ci95(get("top1")),
            })
    print(f"{len(methods)} methods x {len(units)} units (context x (windows + probe)) done "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)
    meta = {"model": spec.title, "corpus": source, "continuation": args.continuation,
            "generate": args.generate, "defer": args.defer, "probe_tokens": args.probe, "seed": args.seed,
            "windows": args.windows, "processes": args.jobs, "seconds": round(time.time() - t0, 1),
            "unit_seconds": round(sum(u.get("seconds", 0.0) for u in units), 1),
            "units_resumed": resumed,       # of len(units), made by earlier parts of the run
            "peer_device": options["peer_device"] or "cpu",
            **_device_record(options["device"], log.done.values()),
            "layers": dict(layer_summary(cfg), window_bits=args.window_bits), "infeasible": infeasible}
    if args.generate:     # how close to a tie the dense greedy runs come (their top-2 logit gaps)
        meta["dense_greedy_gaps"] = {
            str(T): _gap_summary(np.concatenate([u["dense_gaps"] for u in units
                                                 if u["T"] == T and u["w"] != "probe"]))
            for T in args.contexts}
    return rows, meta


def run_to_reports(run_fn, args, write) -> Optional[int]:
    """The commands' common ending: ``run_fn(args)`` -> (rows, meta), then ``write(rows,
    meta)``. Returns an exit code for the two ends that are not errors of the run itself:
    0 when the run stopped early on purpose (``Unfinished``, its message said) and 2 for a
    ``--methods`` that names nothing; None once the reports are written."""
    try:
        rows, meta = run_fn(args)
    except Unfinished as e:
        _say(str(e))
        return 0
    except NoSuchMethod as e:
        _say(f"error: {e}")
        return 2
    write(rows, meta)
    return None

