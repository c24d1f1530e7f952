"""How far the project's evictors and kvpress's presses agree on which states they keep.

    PYTHONPATH=. python -m validation.peer_agreement [--contexts 512] [--windows 2] [--continuation 64]

SmolLM2-135M-Instruct on windows of Jane Austen (the evaluation's model, corpus and
window placement). Per pair, the overlap |ours ∩ theirs| / |ours| of the kept sets,
averaged over layers and kv-heads, per window and budget. Needs kvpress (the 'peers'
extra). With ``--continuation N`` also the ΔPPL of the next N tokens through a cache of
what each method kept (ours and kvpress's presses). Prints Markdown tables (docs/baselines.md "Peers" quotes them).
"""
from __future__ import annotations

import argparse
import os

import numpy as np

PAIRS = [  # (label, ours, kvpress press key, its argument overrides)
    ("StreamingLLM", "streamingllm", "streamingllm", {}),
    ("SnapKV, no pooling", "snapkv-k1", "snapkv", {"kernel_size": 1}),
    ("SnapKV max-pool 7 vs kvpress avg-pool 7", "snapkv", "snapkv", {"kernel_size": 7}),
    ("SnapKV max-pool 7 vs kvpress default avg-pool 5", "snapkv", "snapkv", {}),
    ("H2O vs ObservedAttention", "h2o", "observed", {}),
]


def ours(name, budget):
    from spherical_kv_eval.baselines import H2O, SnapKV, StreamingLLM
    return {"streamingllm": lambda: StreamingLLM(budget), "snapkv": lambda: SnapKV(budget),
            "snapkv-k1": lambda: SnapKV(budget, kernel=1), "h2o": lambda: H2O(budget)}[name]()


def continuation_nll(model, keys, values, keep, last_logits, cont) -> float:
    """Mean NLL of ``cont`` after a context of which the (layer, kv-head) keep the states
    ``keep[l][h]`` (bf16, the same count per head), read through a transformers cache of
    those states (RoPE positions continue at T). The first token is scored by the dense
    prefill's last logits, as in the evaluation."""
    import torch
    from transformers import DynamicCache
    from spherical_kv_eval.baselines import bf16_round
    cache = DynamicCache()
    for l, (k, v, m) in enumerate(zip(keys, values, keep)):
        kk = np.stack([bf16_round(k[h][m[h]]) for h in range(k.shape[0])])
        vv = np.stack([bf16_round(v[h][m[h]]) for h in range(v.shape[0])])
        cache.update(torch.as_tensor(kk)[None], torch.as_tensor(vv)[None], l)
    n, T, C = int(keep[0][0].sum()), keep[0].shape[1], len(cont)
    with torch.no_grad():
        lg = model(torch.as_tensor(cont[:-1])[None], past_key_values=cache,
                   position_ids=torch.arange(T, T + C - 1)[None],
                   cache_position=torch.arange(n, n + C - 1)).logits[0].double()
    lp = torch.log_softmax(torch.cat([last_logits[None].double(), lg]), dim=-1)
    return float(-lp[torch.arange(C), torch.as_tensor(cont)].mean())


def ppl_table(model, ids, T, starts, budgets, continuation, presses):
    """ΔPPL (%, vs the dense bf16 cache) per window of the project's SnapKV, StreamingLLM
    and H2O and of kvpress's ``presses`` (same count per head: AdaKV's ragged sets do not
    fit one transformers cache), same budgets and windows."""
    import torch
    from spherical_kv_eval.baselines import attention_stats
    from spherical_kv_eval.baselines.peers import OBSERVE, KVPressMethod
    from spherical_kv_eval.model import capture_qkv
    print(f"\n| method | context | budget | ΔPPL % per window ({continuation} tokens) | mean |\n"
          "|---|---:|---:|---|---:|")
    out = {}
    for s in starts:
        ctx, cont = ids[s:s + T], ids[s + T:s + T + continuation]
        qkv = capture_qkv(model, ctx)
        with torch.no_grad():
            last = model(torch.as_tensor(ctx)[None]).logits[0, -1]
        full = [np.ones(k.shape[:2], dtype=bool) for k in qkv.keys]
        dense = continuation_nll(model, qkv.keys, qkv.values, full, last, cont)
        stats = attention_stats(qkv.queries, qkv.keys, window=OBSERVE)
        for b in budgets:
            kept = {f"{name} (ours)": [l.keep for l in ours(name, b).compress(
                qkv.keys, qkv.values, stats).layers] for name in ("snapkv", "streamingllm", "h2o")}
            kept.update({f"kvpress-{p}": KVPressMethod(p, b).select(model, ctx).keep
                         for p in presses})
            for label, keep in kept.items():
                nll = continuation_nll(model, qkv.keys, qkv.values, keep, last, cont)
                out.setdefault((label, b), []).append(100 * (np.exp(nll - dense) - 1))
    for (label, b), v in sorted(out.items(), key=lambda kv: (-kv[0][1], np.mean(kv[1]))):
        print(f"| {label} | {T} | {100 * b:g} % | " + ", ".join(f"{x:+.2f}" for x in v)
              + f" | {np.mean(v):+.2f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.10])
    p.add_argument("--continuation", type=int, default=0,
                   help="also ΔPPL of the next N tokens, ours and kvpress's (0: overlap only)")
    p.add_argument("--presses", nargs="+", default=["snapkv", "streamingllm", "expected",
                                                     "tova", "knorm", "observed"],
                   help="kvpress presses of the ΔPPL table (one count per head)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="skip the overlap table")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from spherical_kv_eval.baselines import attention_stats
    from spherical_kv_eval.baselines.peers import OBSERVE, KVPressMethod
    from spherical_kv_eval.evaluate import corpus_tokens, window_starts
    from spherical_kv_eval.model import capture_qkv, load_model
    model, tok = load_model()
    ids, _ = corpus_tokens(tok, (max(a.contexts) + a.continuation + 1) * (a.windows + 1))
    if a.overlap:
        print("| pair | context | budget | overlap per window |\n|---|---:|---:|---|")
    for T in a.contexts:
        starts = window_starts(len(ids), T, a.continuation, a.windows)
        for budget in a.budgets if a.overlap else ():
            rows = {label: [] for label, *_ in PAIRS}
            for s in starts:
                ctx = ids[s:s + T]
                qkv = capture_qkv(model, ctx)
                stats = attention_stats(qkv.queries, qkv.keys, window=OBSERVE)
                for label, mine, press, kw in PAIRS:
                    c = ours(mine, budget).compress(qkv.keys, qkv.values, stats)
                    theirs = KVPressMethod(press, budget, kw).select(model, ctx).keep
                    rows[label].append(np.mean([(l.keep & k).sum() / l.keep.sum()
                                                for l, k in zip(c.layers, theirs)]))
            for label, v in rows.items():
                print(f"| {label} | {T} | {100 * budget:g} % | "
                      + ", ".join(f"{x:.3f}" for x in v) + " |", flush=True)
        if a.continuation:
            ppl_table(model, ids, T, starts, a.budgets, a.continuation, a.presses)


if __name__ == "__main__":
    main()
