"""Why the fixed 4/4 codec costs more ΔPPL on Gemma-3-270M (head_dim 256, one kv head)
than on SmolLM2-135M (head_dim 64): per-layer key/value statistics and ΔPPL of codec
variants, at the evaluation's short shape (384 context tokens, 64 scored).

``python -m validation.codec_shape --model gemma3-270m`` (or ``smollm2``) writes
``validation/results/codec_shape/<model>.json`` and prints the tables docs/codec_shape.md
reads. Every layer is compressed, as the evaluation's fixed points do: 384 + 64 tokens are
inside Gemma's 512-token window, so its sliding layers compute the full-attention
function and go through the store like the others. A lab script: it imports the library
and is never imported by it.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import pathlib
import sys

import numpy as np

from spherical_kv_ref.cache import CompressPolicy, SphericalKVCache
from spherical_kv_ref.codec import SphericalCodec
from spherical_kv_ref.rotation import KEY_SALT, VALUE_SALT
from spherical_kv_ref.tiers import TierLadder

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "codec_shape"
T, C = 384, 64
HEAVY = 0.24        # a layer whose 4-bit logit error exceeds this share of the logit spread


class _Mixed:
    """Layers in ``use_b`` read store b, the others store a."""

    def __init__(self, a, b, use_b):
        self.a, self.b, self.use_b = a, b, set(use_b)
        self.num_q_heads, self.num_kv_heads = a.num_q_heads, a.num_kv_heads

    def attend(self, layer, q, scale):
        return (self.b if layer in self.use_b else self.a).attend(layer, q, scale)

    def append(self, layer, k, v):
        return (self.b if layer in self.use_b else self.a).append(layer, k, v)

    def nbytes(self):
        return 0


def layer_stats(keys, values, queries, scale, layer):
    """Per-layer statistics of kv-head 0: the keys' mean share of their energy, mean norms,
    the rotated directions' kurtosis (3 for a Gaussian-like coordinate), the codec's
    relative error at 4 bits (raw and centred), and the 4-bit logit error against the
    logits' spread for the last 32 queries."""
    d = keys.shape[-1]
    row = {"layer": layer}
    for name, x, salt in (("k", keys, KEY_SALT), ("v", values, VALUE_SALT)):
        mu = x.mean(0)
        row[f"{name}_mean_share"] = float(mu @ mu / np.mean(np.sum(x * x, 1)))
        codec = SphericalCodec(d, 4, 0, layer=layer, head=0, salt=salt, codebook="uniform")
        y = codec.rotation.apply(x)
        u = np.sqrt(d) * y / np.linalg.norm(y, axis=1, keepdims=True)
        row[f"{name}_rot_kurtosis"] = float(np.mean(u ** 4) / np.mean(u ** 2) ** 2)
        for tag, m in (("", None), ("_centred", mu)):
            e = np.linalg.norm(codec.decode(codec.encode(x, mean=m)) - x, axis=1)
            row[f"{name}_relerr{tag}"] = float(np.sqrt(np.mean((e / np.linalg.norm(x, axis=1)) ** 2)))
    q = queries[:, -32:].reshape(-1, d)
    z = scale * q @ keys.T
    codec = SphericalCodec(d, 4, 0, layer=layer, head=0, salt=KEY_SALT, codebook="uniform")
    zh = scale * q @ codec.decode(codec.encode(keys)).T
    row["q_norm"] = float(np.linalg.norm(q, axis=1).mean())
    row["k_norm"] = float(np.linalg.norm(keys, axis=1).mean())
    row["logit_spread"] = float(z.std(1).mean())
    row["logit_err_share"] = float(np.sqrt(np.mean((zh - z) ** 2))) / row["logit_spread"]
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gemma3-270m", "smollm2"), default="gemma3-270m")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from spherical_kv_ref import hf as H
    from spherical_kv_eval.data import load_austen
    from spherical_kv_eval.model import load_model
    model, tok = load_model(args.model)
    H.use_spherical_attention(model)
    cfg = copy.deepcopy(model.config)
    L = cfg.num_hidden_layers
    if getattr(cfg, "layer_types", None):       # T + C inside the window: the same function
        cfg.layer_types = ["full_attention"] * L
    ids = np.array(tok(load_austen().joined()[:400000], add_special_tokens=False).input_ids)
    starts = np.random.default_rng(0).choice(len(ids) - T - C, args.windows, replace=False)
    bos = tok.bos_token_id if args.model == "gemma3-270m" else None

    def window(s):
        return ids[s:s + T + C] if bos is None else np.concatenate([[bos], ids[s:s + T + C - 1]])

    def spherical(keys, values, tiers, centre, codebook, scale, sinks=0):
        kv = SphericalKVCache(L, keys[0].shape[0], keys[0].shape[2], TierLadder(tiers),
                              page_bytes=2048, pool_bytes=64 << 20, centre=centre,
                              num_q_heads=cfg.num_attention_heads, codebook=codebook,
                              softmax_scale=scale,
                              policy=CompressPolicy(sinks=sinks, recent=0, window=8))
        seq = H.fill_cache(kv, keys, values)
        kv.demote_all(seq, 1)
        return H.SphericalStore(kv, seq)

    def logprobs(store, w):
        cache = H.SphericalCache.from_store(cfg, store, T)
        with torch.no_grad():
            lg = model(torch.as_tensor(w[T:])[None], past_key_values=cache).logits[0, :-1].double()
        return torch.log_softmax(lg, dim=-1).numpy()

    def nll(store, w):
        """Per-token NLL of the scored tokens; also records the per-position KL(dense ‖
        store) against ``dense_lp`` (the window's exact log-probs) into ``last_kl``."""
        lp = logprobs(store, w)
        if dense_lp:
            last_kl[:] = [np.sum(np.exp(dense_lp[0]) * (dense_lp[0] - lp), axis=1)]
        return -lp[np.arange(len(lp)), w[T + 1:]]

    four = [(4, 4), (16, 16)]
    variants = {
        "4/4 uniform (the fixed point)": lambda K, V, s: spherical(K, V, four, False, "uniform", s),
        "4/4 uniform, centred": lambda K, V, s: spherical(K, V, four, True, "uniform", s),
        "4/4 Lloyd-Max": lambda K, V, s: spherical(K, V, four, False, "lloyd-max", s),
        "keys 4, values 16": lambda K, V, s: spherical(K, V, [(4, 16), (16, 16)], False, "uniform", s),
        "keys 16, values 4": lambda K, V, s: spherical(K, V, [(16, 4), (16, 16)], False, "uniform", s),
    }
    diffs = {name: [] for name in variants}
    diffs["4/4 centred, 4 sinks at fp16"] = []
    diffs["4/4 in the heavy layers only"] = []
    diffs["4/4 in the other layers only"] = []
    stats, heavy = None, None
    dense_lp, last_kl = [], []
    kls = {name: [] for name in diffs}
    for s in starts:
        w = window(s)
        cache = H.SphericalCache(cfg, observe=T)
        with torch.no_grad():
            model(torch.as_tensor(w[:T])[None], past_key_values=cache)
        scale = cache.scaling
        keys, values = zip(*[cache.dense_kv(l) for l in range(L)])

        def exact():
            return H.DenseStore(keys, values, cfg.num_attention_heads, 0)
        dense_lp[:] = []
        base = nll(exact(), w)
        dense_lp[:] = [logprobs(exact(), w)]
        if stats is None:
            stats = [layer_stats(keys[l][0], values[l][0], cache.observed[l], scale, l) for l in range(L)]
            heavy = [r["layer"] for r in stats if r["logit_err_share"] > HEAVY]
        for name, build in variants.items():
            diffs[name].append(nll(build(keys, values, scale), w) - base)
            kls[name].append(last_kl[0])
        # the sinks at the top tier (RDR's protection, 4 states a row): centring without
        # turning them into the largest errors
        diffs["4/4 centred, 4 sinks at fp16"].append(
            nll(spherical(keys, values, four, True, "uniform", scale, sinks=4), w) - base)
        kls["4/4 centred, 4 sinks at fp16"].append(last_kl[0])
        fixed = variants["4/4 uniform (the fixed point)"]
        diffs["4/4 in the heavy layers only"].append(nll(_Mixed(exact(), fixed(keys, values, scale), heavy), w) - base)
        kls["4/4 in the heavy layers only"].append(last_kl[0])
        diffs["4/4 in the other layers only"].append(nll(_Mixed(fixed(keys, values, scale), exact(), heavy), w) - base)
        kls["4/4 in the other layers only"].append(last_kl[0])
        print(f"window at {s}: " + ", ".join(f"{k} {np.mean(v[-1]):+.4f}" for k, v in diffs.items()),
              file=sys.stderr, flush=True)
    dppl = {k: 100 * (math.exp(float(np.mean(np.concatenate(v)))) - 1) for k, v in diffs.items()}
    kl = {k: float(np.mean(np.concatenate(v))) for k, v in kls.items()}
    out = {"model": args.model, "context": T, "scored": C, "windows": [int(s) for s in starts],
           "softmax_scale": scale, "heavy_layers": heavy, 
           "dppl_pct": dppl, "kl_nats": kl, "layers": stats}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.model}.json").write_text(json.dumps(out, indent=1))
    print(f"ΔPPL % and KL(dense ‖ variant) over {args.windows} windows ({T} context, "
          f"{C - 1} scored tokens each):")
    for k, v in dppl.items():
        print(f"  {k:40s} {v:+.2f}  {kl[k]:.4f}")
    print("heavy layers:", heavy)

    cols = list(stats[0])
    print(" ".join(f"{c[:13]:>13}" for c in cols))
    for r in stats:
        print(" ".join(f"{r[c]:13.3g}" for c in cols))


if __name__ == "__main__":
    main()
