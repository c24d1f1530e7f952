"""``spherical-kv tasks``: the long-context retrieval tasks (``tasks.py``) through every method
of the evaluation's line-up. One unit per (context length, task, instance): a dense prefill of
the context, then per method its compressed copy, the question fed through it and the answer
decoded greedily. Units run over worker processes and are logged to ``units.jsonl`` as each
ends (``--resume`` goes on from it), like the evaluation's; the rows, ``tasks.json``,
``tasks.md`` and ``tasks.png`` come from ``tasks_report.py`` (docs/evaluate.md "Long-context
tasks")."""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

from spherical_kv_eval.evaluate import DEFAULT_OUT
from spherical_kv_eval.evaluate import parser as evaluate_parser
from spherical_kv_eval.lineup import Infeasible
from spherical_kv_eval.tasks import TASKS, exact_match, make_instance, verdict
from spherical_kv_eval.tasks_report import PROTECTED, task_rows, write_task_reports
from spherical_kv_eval.units import (_WORKER, Unfinished, UnitLog, _main_setup, run_to_reports,
                                     _methods, _pool_run, _progress)
from spherical_kv_ref.cli import _positive

#: what --quick sets
QUICK = {"lengths": [512], "instances": 2, "tasks": ["niah-single", "toolcall"],
         "methods": ["dense", "h2o", "skv-rdr"], "budgets": [0.25], "protect": False}
# the settings a unit's result depends on (its length, task and instance are its own): a run
# resumes only units made with the same ones
UNIT_SETTINGS = ("model", "budgets", "methods", "peers", "seed", "protect", "window_bits",
                 "device")
#: options that mean here what they mean in ``spherical-kv evaluate``: taken from its parser,
#: so that their checks and help text are one
SHARED = ("budgets", "window_bits", "peers", "jobs", "resume", "max_units", "time_limit")


def _say(msg: str) -> None:
    print(f"spherical-kv tasks: {msg}", file=sys.stderr, flush=True)


def greedy_answer(runner, store, pre, inst, tok) -> str:
    """The greedy output after ``inst.question`` is fed through the compressed ``store``:
    at most ``inst.max_new`` tokens, ended early at the end-of-text token or once the output
    decides the score (``verdict``), which leaves the score unchanged and spares the steps."""
    torch = runner.torch
    cache = runner._cache(store, pre)
    out = []
    with torch.no_grad():
        lg = runner.model(runner._ids(inst.question), past_key_values=cache,
                          logits_to_keep=1).logits[0, -1]
        for _ in range(inst.max_new):
            t = int(torch.argmax(lg))
            if t == tok.eos_token_id:
                break
            out.append(t)
            if verdict(tok.decode(out), inst.answer) is not None:
                break
            lg = runner.model(runner._ids([t]), past_key_values=cache).logits[0, -1]
    return tok.decode(out)


def _task_unit(job) -> dict:
    """One (length, task/instance) unit: the instance's dense prefill, then every method of
    the run (and, with ``args.protect``, each method that can protect a span once more with
    the planted items protected) answering through its compressed copy."""
    T, w, args, position = job
    t0 = time.time()
    task, index = w.rsplit("/", 1)
    runner, cfg, tok = _WORKER["runner"], _WORKER["cfg"], _WORKER["tok"]
    inst = make_instance(task, T, int(index), tok, args.seed, bos=args.bos)
    pre = runner.prefill(inst.context)
    out = {"T": T, "w": w, "task": task, "index": int(index), "depth": inst.depth,
           "answer": inst.answer, "methods": {}}
    for m in _progress(_methods(cfg, args), desc=f"{task} {index} at {T}", leave=False,
                       position=position):
        runs = [(m.name, ())] + ([(m.name + PROTECTED, inst.spans)]
                                 if args.protect and m.protects else [])
        for name, spans in runs:
            try:
                store, nbytes = m.build(pre, protect=spans) if spans else m.build(pre)
            except Infeasible:
                continue
            text = greedy_answer(runner, store, pre, inst, tok)
            out["methods"][name] = {"correct": exact_match(text, inst.answer), "output": text,
                                    "bytes": nbytes / pre.dense_bytes}
    out["seconds"] = round(time.time() - t0, 1)
    return out


def run(args):
    """The run's rows and meta; ``Unfinished`` while units are left (``--max-units``)."""
    from spherical_kv_eval.model import model_spec
    t0 = time.time()
    spec = model_spec(args.model)
    # the model, its statistics and the stores where --device says, as in the evaluation
    options = {"window_bits": args.window_bits, "device": args.device,
               "peer_device": args.peer_device}
    cfg, tok = _main_setup(args.jobs, args.model, options)
    args.bos = tok.bos_token_id if spec.bos else None
    methods = _methods(cfg, args)
    jobs = [(T, f"{task}/{i}", args) for T in args.lengths for task in args.tasks
            for i in range(args.instances)]
    log = UnitLog(args.out / "units.jsonl", {k: getattr(args, k) for k in UNIT_SETTINGS},
                  args.resume)
    todo = [j for j in jobs if log.find(j[0], j[1], 0, 1) is None]
    resumed = len(jobs) - len(todo)
    if args.max_units is not None:
        todo = todo[:args.max_units]
    if len(todo) < len(jobs):
        _say(f"{len(jobs)} units: {resumed} resumed from {log.path}, {len(todo)} to run now")
    todo = [j + (i % max(args.jobs, 1),) for i, j in enumerate(todo)]
    if todo:
        _pool_run(todo, args.jobs, unit=_task_unit, model_name=args.model, options=options,
                  done=log.add, time_limit=getattr(args, "time_limit", None))
    missing = sum(log.find(T, w, 0, 1) is None for T, w, _ in jobs)
    if missing:
        raise Unfinished(f"{missing} of {len(jobs)} units still to run: the same command with "
                         f"--resume goes on ({log.path})")
    units = [log.find(T, w, 0, 1) for T, w, _ in jobs]
    rows = task_rows(units, methods, args.tasks, args.lengths)
    meta = {"model": spec.title, "lengths": args.lengths, "tasks": args.tasks,
            "instances": args.instances, "seed": args.seed, "budgets": args.budgets,
            "protect": args.protect, "window_bits": args.window_bits, "device": args.device,
            "processes": args.jobs,
            "seconds": round(time.time() - t0, 1), "units_resumed": resumed,
            "unit_seconds": round(sum(u.get("seconds", 0.0) for u in units), 1)}
    return rows, meta


def parser() -> argparse.ArgumentParser:
    """The options of ``spherical-kv tasks``."""
    p = argparse.ArgumentParser(prog="spherical-kv tasks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke test (3-6 minutes on a shared 2-core machine, RDR's compression "
                        "most of it): 512-token contexts, two instances of niah-single and "
                        "toolcall, dense, H2O and RDR at 25 %%, no protected rows; it shows the "
                        "job runs, not how good the methods are")
    p.add_argument("--model", default="smollm2",
                   help="the evaluation's model (smollm2, gemma3-270m) or a Hugging Face model "
                        "id / local folder, as for spherical-kv evaluate (default smollm2)")
    p.add_argument("--lengths", type=_positive, nargs="+", default=[2048, 4096],
                   help="context lengths in tokens (default 2048 4096; 8K-32K want the GPU)")
    p.add_argument("--instances", type=_positive, default=50,
                   help="instances per (task, length): the accuracies' CIs are over them "
                        "(default 50)")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS),
                   help="the tasks to run (default all: " + ", ".join(TASKS) + ")")
    p.add_argument("--methods", nargs="*", default=None,
                   help="keep only the line-up's methods whose names start with one of these "
                        "prefixes (e.g. skv-rdr h2o kvpress-snapkv); dense always runs, every "
                        "other method is read against it")
    p.add_argument("--no-protect", dest="protect", action="store_false",
                   help="leave out the rows of RDR with the planted items protected "
                        "(skv-rdr@B%%+protect; run by default beside the unprotected rows)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default) runs everything on the CPU; cuda runs the model's "
                        "forward passes, the attention statistics, the context stores' attention "
                        "and the peers' prefills on the GPU, as spherical-kv evaluate --device "
                        "cuda does, and needs one")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the instances: instance i of a task at length T is made from "
                        "(seed, task, T, i) alone (default 0)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"results folder (default: $SPHERICAL_KV_RESULTS or ./{DEFAULT_OUT}/, "
                        f"its tasks/ subfolder, tasks-quick/ with --quick)")
    taken = {a.dest: a for a in evaluate_parser()._actions}
    for dest in SHARED:
        p._add_action(taken[dest])
    return p


def parse(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    a = p.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, copy.copy(v))
    if a.methods and not any(x.startswith("dense") for x in a.methods):
        a.methods = ["dense"] + a.methods
    a.rdr_extra, a.rdr_recent = [], [32]         # what the evaluation's line-up reads
    from spherical_kv_eval.model import model_spec
    try:
        spec = model_spec(a.model)
    except ValueError as e:
        p.error(str(e))
    if spec.max_context is not None and max(a.lengths) > spec.max_context:
        p.error(f"{a.model}'s context is {spec.max_context} tokens; --lengths must not exceed it")
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device here (run with --device cpu)")
    a.peer_device = "cuda" if a.device == "cuda" else None
    if a.out is None:
        a.out = Path(os.environ.get("SPHERICAL_KV_RESULTS") or DEFAULT_OUT)
        a.out = a.out / ("tasks-quick" if a.quick else "tasks")
    return a


def main(argv=None) -> int:
    args = parse(argv)
    if args.quick:
        _say("--quick is a smoke test: its numbers show that the job runs, not how well the "
             "methods do")
    written = []
    code = run_to_reports(run, args,
                          lambda rows, meta: written.extend(write_task_reports(rows, meta, args.out)))
    if code is not None:
        return code
    files = written
    print((args.out / "tasks.md").read_text())
    _say(f"results written to {args.out.resolve()}/ ({', '.join(f.name for f in files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
