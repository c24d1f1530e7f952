"""Peak memory and time of the evaluation's prefill (``Runner.prefill``: the dense prefill,
the full-attention layers' queries and the evicting baselines' statistics) and of one
method's scoring, at a few context lengths, each in a fresh process, so the figures at 32K
can be extrapolated from what a small machine can run.

``python -m validation.prefill_memory --model gemma3-270m --contexts 2048 4096 8192``
prints one JSON line per context (``peak_rss_mb``: the process's peak resident memory,
model included; ``seconds``) and writes them to ``--out`` when given. A lab script: it
imports the library and is never imported by it.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import time


def _one(model: str, T: int, score: int) -> dict:
    import numpy as np
    import torch
    from spherical_kv_eval import evaluate as E
    from spherical_kv_eval.model import MODELS, load_model
    torch.set_num_threads(1)
    m, tok = load_model(model)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    runner = E.Runner(m, tok)
    ids, _ = E.corpus_tokens(tok, T + score + 1, special=not MODELS[model].bos)
    ctx, cont = E.window(ids, 0, T, score, tok.bos_token_id if MODELS[model].bos else None)
    t0 = time.time()
    pre = runner.prefill(ctx)
    t_prefill = time.time() - t0
    after_prefill = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # RDR with 15 % of the whole cache beyond the windows (budgets under their share are
    # infeasible: at 2K the windows are 55 % of Gemma's cache)
    b = round(pre.window_bytes / pre.dense_bytes + 0.15, 2)
    (rdr,) = [x for x in E.lineup(m.config, [], rdr_extra=[b], peers=False) if x.family == "skv-rdr"]
    t0 = time.time()
    store, nbytes = rdr.build(pre)
    runner.score(store, pre, cont)
    t_score = time.time() - t0
    return {"model": model, "context": T, "scored": score, "prefill_chunk": runner.prefill_chunk,
            "model_rss_mb": round(loaded), "peak_rss_after_prefill_mb": round(after_prefill),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "prefill_seconds": round(t_prefill, 1), "rdr_budget": b,
            "rdr_build_and_score_seconds": round(t_score, 1),
            "dense_cache_bytes": int(pre.dense_bytes), "window_bytes": int(pre.window_bytes),
            "threads": 1}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--score", type=int, default=64)
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(_one(a.model, a.child, a.score)))
        return
    rows = []
    for T in a.contexts:        # a fresh process each: ru_maxrss is a process's peak
        out = subprocess.run([sys.executable, "-m", "validation.prefill_memory", "--model", a.model,
                              "--score", str(a.score), "--child", str(T)],
                             stdout=subprocess.PIPE, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
