"""ΔPPL of a KV cache format held the way an engine holds it, computed in transformers:
every key and value of every compressed layer is stored by the format (uncentred, as in a
vLLM block) and every query, the scored tokens' own included, reads the stored states (what
tests/test_vllm_e2e.py's default-tier run computes through vLLM; attention from codes is dense
attention over the decoded states).

    python -m validation.engine_dppl --tier 4/4 --codebook uniform lloyd-max --seeds 0 1 2 3 4
    python -m validation.engine_dppl --model gemma3-270m --tier fp8 8/4 4/4 --seeds 0 1 2

Formats (``--tier``, several at once):
* ``K/V``: the one-tier block format of the plugin (spherical_kv_ref.engine.BlockFormat),
  K key bits and V value bits per coordinate (1, 2, 3, 4, 8, 16);
* ``fp8``: vLLM's ``kv_cache_dtype="fp8"`` (e4m3): x stored as e4m3(x / scale), read as
  e4m3 · scale, one scale per layer for the keys and one for the values (vLLM's per-tensor
  convention). vLLM takes the scales from the checkpoint and uses 1.0 when it has none, as
  for these GGUF-converted models: ``fp8`` is scale 1.0. ``fp8-amax``: the scales a
  calibrated checkpoint ships, amax / 448 per layer, measured on the calibration text.
  Both round to nearest e4m3; ``fp8-rtz``: scale 1.0 rounded toward zero, as vLLM 0.32's CPU
  build stores its fp8 cache (tests/test_vllm_e2e.py compares it with that kernel);
* ``K/V`` with K or V in 5, 6, 7: widths the format does not have (docs/format.md), emulated
  here to see what the kernels would gain: the same rotation, per-vector fp16 scale and
  codebook construction at that width (a 2^b-level codebook of spherical_kv_ref.codebooks),
  counted as densely packed codes plus the scale (4·⌈b·d/32⌉ + 2 bytes a vector);
* ``rdr:K/V``: a tier per layer, chosen by RDR (spherical_kv_ref.rdr, exact solver) from the
  ladder ``RDR_LADDER`` on the calibration text under the bytes of ``K/V`` in every layer
  (``rdr:30%``: under 30 % of bf16's bytes), each layer's distortion RDR's surrogate;
* ``rdr-grad:K/V`` (or ``rdr-grad:30%``): the same problem with each layer's distortion
  measured on the loss instead: Σ_n (∂L/∂o_n · Δo_n)² over the calibration text, o_n the
  layer's attention output at token n, Δo_n its change when the layer alone is held at the
  tier (rotation seed 0), ∂L/∂o_n from one backward pass of the dense model.

The calibration text (fp8-amax, rdr, rdr-grad) is the opening of Jane Austen's first novel
(spherical_kv_eval.data), not the scored passage.

Models (``--model``): SmolLM2-135M (every layer compressed) or Gemma-3-270M, whose three
full-attention layers are compressed and whose sliding-window layers stay exact (the plugin
does not serve sliding windows; the passage is shorter than their window).

Prints one line per (format, codebook, seed): the PPL and ΔPPL against the dense model over
the passage of tests/test_vllm_e2e.py, and the format's bytes per token. ``--json`` keeps the
rows, each with the ``arithmetic`` that made it (arithmetic()): a seed's ΔPPL is one draw,
and float32 kernels of another instruction set draw again (fp8 at scale 1.0 on SmolLM2:
+1.57 % with MKL's AVX2 kernels, +1.23 % with its AVX-512 ones). Needs torch, transformers
and the model's package (spherical_kv_eval.model); CPU, a few seconds per run (SmolLM2, one
thread).
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

#: widths the format does not have, emulated (see the docstring)
LAB_BITS = (5, 6, 7)
#: e4m3's largest finite value (vLLM's fp8 kernels saturate to it)
E4M3_MAX = 448.0
#: the tiers an RDR allocation chooses from, (key bits, value bits)
RDR_LADDER = ((2, 2), (3, 2), (3, 3), (4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4), (8, 8))
#: calibration text: the opening of Sense and Sensibility (not the scored passage), tokens
CALIBRATION_TOKENS = 1024
#: queries of the calibration text that RDR's statistics read (the last ones, as decode sees)
CALIBRATION_QUERIES = 64
#: calibration tokens of the gradient-weighted distortion (rdr-grad)
GRAD_TOKENS = 512


def passage() -> str:
    """The scored passage of the vLLM end-to-end test (read from the test file itself)."""
    spec = importlib.util.spec_from_file_location("_vllm_e2e", ROOT / "tests" / "test_vllm_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PASSAGE


def calibration_ids(tok):
    """CALIBRATION_TOKENS tokens of Jane Austen's first novel (spherical_kv_eval.data)."""
    from spherical_kv_eval.data import load_austen
    text = next(iter(load_austen().texts.values()))
    return tok(text[:20000])["input_ids"][:CALIBRATION_TOKENS]


def arithmetic() -> str:
    """What the dense parts of the model run on: torch's version and the CPU kernels it
    picks (ATen's instruction set; MKL_ENABLE_INSTRUCTIONS, when set, lowers MKL's), scipy's
    version (the uniform codebook's scale)."""
    import os
    import scipy
    import torch
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    return (f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"
            + (f", MKL {mkl}" if mkl else "") + f", scipy {scipy.__version__}")


def e4m3(x: np.ndarray, scale: float) -> np.ndarray:
    """x as vLLM's fp8 cache returns it: e4m3(x / scale) · scale (saturating), float64."""
    import torch
    y = torch.from_numpy(np.clip(x / scale, -E4M3_MAX, E4M3_MAX)).to(torch.float8_e4m3fn)
    return y.double().numpy() * scale


def e4m3_toward_zero(x: np.ndarray, scale: float) -> np.ndarray:
    """x as vLLM 0.32's CPU fp8 cache returns it: e4m3(x / scale) · scale with the dropped
    mantissa bits cut (rounded toward zero, saturating), float64. e4m3 has 3 mantissa bits
    and subnormals below 2^-6, so the step at |y| is 2^(max(⌊log2 |y|⌋, -6) - 3)."""
    y = np.clip(x / scale, -E4M3_MAX, E4M3_MAX)
    _, e = np.frexp(np.maximum(np.abs(y), 2.0 ** -6))       # |y| = m · 2^e, m in [0.5, 1)
    step = np.ldexp(1.0, e - 1 - 3)
    return np.trunc(y / step) * step * scale


def parse_bits(text: str):
    """'6/3' -> (6, 3): the format's widths (spherical_kv_vllm.parse_tier) or LAB_BITS."""
    from spherical_kv_vllm import BITS
    kb, vb = (int(b) for b in text.split("/"))
    if kb not in BITS + LAB_BITS or vb not in BITS + LAB_BITS:
        raise ValueError(f"{text!r}: bits must be in {BITS + LAB_BITS}")
    return kb, vb


class LabTier:
    """A (key bits, value bits) pair where a width may be one of LAB_BITS: each part is coded
    like spherical_kv_ref.codec.SphericalCodec (rotation, nearest level of the codebook for
    √d·u, fp16 scale r/‖ĉ‖) with the codebook built at that width."""

    def __init__(self, key_bits, value_bits, head_dim, codebook, seed):
        self.key_bits, self.value_bits = key_bits, value_bits
        self.head_dim, self.codebook, self.seed = head_dim, codebook, seed

    @staticmethod
    def vector_bytes(bits, dim):
        from spherical_kv_ref.codec import vector_bytes
        return 4 * -(-bits * dim // 32) + 2 if bits in LAB_BITS else vector_bytes(bits, dim)

    @property
    def state_bytes(self):
        return sum(self.vector_bytes(b, self.head_dim) for b in (self.key_bits, self.value_bits))

    def roundtrip(self, layer, head, part, x):
        from spherical_kv_ref import codebooks
        from spherical_kv_ref.codec import SphericalCodec
        bits = (self.key_bits, self.value_bits)[part]
        d = self.head_dim
        if bits not in LAB_BITS:
            c = SphericalCodec(d, bits, self.seed, layer=layer, head=head, salt=part,
                               codebook=self.codebook)
            return c.decode(c.encode(x))
        rot = SphericalCodec(d, 4, self.seed, layer=layer, head=head, salt=part).rotation
        levels = (codebooks._lloyd_max(bits, d) if self.codebook == "lloyd-max"
                  else codebooks._uniform(bits, d))
        y = rot.apply(x)
        r = np.linalg.norm(y, axis=1)
        u = y / np.where(r == 0, 1.0, r)[:, None]
        c = levels[codebooks.quantize(np.sqrt(d) * u, levels)]
        scale = (r / np.sqrt(np.sum(c * c, axis=1) / d)).astype(np.float16).astype(np.float64)
        return rot.inverse(scale[:, None] * c / np.sqrt(d))


class Format:
    """What one run stores: per compressed layer either (rounding, key scale, value scale),
    rounding 'fp8' (to nearest) or 'fp8-rtz' (toward zero), or a BlockFormat.
    ``bytes_per_token``: bytes of one token's keys and values over the compressed layers
    (every kv-head); ``fixed_bytes``: bytes held once per layer (fp8's
    scales, float32), not per token."""

    def __init__(self, name, layers, head_dim, num_kv_heads):
        self.name, self.layers = name, layers
        self.head_dim, self.num_kv_heads = head_dim, num_kv_heads

    def stored(self, layer: int, x: np.ndarray, part: int) -> np.ndarray:
        """x (H, T, d) as the format holds it (part 0: keys, 1: values)."""
        f = self.layers[layer]
        if isinstance(f, tuple):
            return (e4m3_toward_zero if f[0] == "fp8-rtz" else e4m3)(x, f[1 + part])
        out = np.empty(x.shape)
        if isinstance(f, LabTier):
            for h in range(x.shape[0]):
                out[h] = f.roundtrip(layer, h, part, x[h])
            return out
        for h in range(x.shape[0]):
            c = f.codec(layer, h, part)
            out[h] = c.decode(c.encode(x[h]))
        return out

    def layer_state_bytes(self, layer: int) -> int:
        """Bytes of one (key, value) state of one kv-head in this layer."""
        f = self.layers[layer]
        return 2 * self.head_dim if isinstance(f, tuple) else f.state_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * sum(self.layer_state_bytes(l) for l in self.layers)

    @property
    def bf16_bytes_per_token(self) -> int:
        return self.num_kv_heads * len(self.layers) * 4 * self.head_dim

    @property
    def fixed_bytes(self) -> int:
        return sum(8 for f in self.layers.values() if isinstance(f, tuple))

    def tiers(self):
        """{layer: 'K/V', 'fp8' or 'fp8-rtz'} of the run (the JSON rows keep it)."""
        return {l: f[0] if isinstance(f, tuple) else f"{f.key_bits}/{f.value_bits}"
                for l, f in self.layers.items()}


def run(model, ids, fmt, variants=(), compressed=None) -> float:
    """Mean next-token NLL of ids (1, T) with every attention of the ``compressed`` layers
    (all when None) reading ``fmt``'s stored states (fmt None: the dense model)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from spherical_kv_ref.hf import select_attention

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        layer = module.layer_idx
        if compressed is not None and layer not in compressed:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, **kw)
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
        kh = k if "keys-exact" in variants else fmt.stored(layer, (k - mk) * sk, 0) / sk + mk
        vh = v if "values-exact" in variants else fmt.stored(layer, v - mv, 1) + mv
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


def amax_scales(qkv, layers):
    """{layer: (key scale, value scale)} = amax / E4M3_MAX of the calibration text."""
    return {l: (float(np.abs(qkv.keys[l]).max()) / E4M3_MAX,
                float(np.abs(qkv.values[l]).max()) / E4M3_MAX) for l in layers}


def budget_bytes(spec: str, head_dim: int, states: int) -> int:
    """Bytes of ``states`` (layer, kv-head) states under 'K/V' (that tier's) or 'NN%' (of bf16)."""
    from spherical_kv_ref.codec import vector_bytes
    if spec.endswith("%"):
        return int(float(spec[:-1]) / 100 * 4 * head_dim * states)
    kb, vb = parse_bits(spec)
    return states * (vector_bytes(kb, head_dim) + vector_bytes(vb, head_dim))


def solve_layers(D, layers, budget, H, head_dim):
    """{layer: (key bits, value bits)}: RDR's exact solver over one tier per layer.
    D (layers, 1 + len(RDR_LADDER)), column 0 (eviction) unused; budget in bytes per token."""
    from spherical_kv_ref import rdr
    from spherical_kv_ref.codec import vector_bytes
    D = np.array(D, dtype=np.float64)
    D[:, 0] = 10.0 * D[:, 1:].max() + 1.0         # eviction is not an option here
    cost = [0] + [H * (vector_bytes(k, head_dim) + vector_bytes(v, head_dim)) for k, v in RDR_LADDER]
    problem = rdr.Problem(D, np.array(cost), np.arange(len(layers)),
                          np.zeros(len(layers), bool), budget)
    alloc = rdr.solve(problem, "milp")
    return {l: RDR_LADDER[int(t) - 1] for l, t in zip(layers, alloc.tier)}


def grad_distortion(model, ids, layers, head_dim, codebook, seed):
    """D (layers, 1 + len(RDR_LADDER)): Σ_n (∂L/∂o_n · Δo_n)² per layer and tier over ids
    (1, T), with o_n the layer's attention output (every query head) at token n, ∂L/∂o_n from
    one backward pass of the dense model, and Δo_n the change of o_n when this layer alone
    reads its keys and values from the tier's codes (rotation ``seed``)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from spherical_kv_ref.engine import BlockFormat
    from spherical_kv_ref.hf import select_attention
    seen = {}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        out, w = sdpa_attention_forward(module, query, key, value, attention_mask,
                                        dropout=dropout, scaling=scaling, **kw)
        if module.layer_idx in layers:
            out.retain_grad()
            seen[module.layer_idx] = (query.detach()[0].double(), key.detach()[0].double().numpy(),
                                      value.detach()[0].double().numpy(), scaling, out)
        return out, w

    select_attention(model, "engine_grad", attention)
    logits = model(ids, use_cache=False).logits[0, :-1]
    torch.nn.functional.cross_entropy(logits, ids[0, 1:]).backward()
    model.zero_grad(set_to_none=True)
    D = np.zeros((len(layers), len(RDR_LADDER) + 1))
    for i, l in enumerate(layers):
        q, k, v, scaling, out = seen[l]
        g = out.grad[0].transpose(0, 1).double()                 # (Hq, T, d)
        o = out.detach()[0].transpose(0, 1).double()
        H, T = k.shape[0], k.shape[1]
        rep = q.shape[0] // H
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        for j, (kb, vb) in enumerate(RDR_LADDER):
            fmt = Format("", {l: BlockFormat(kb, vb, head_dim, H, 16, codebook, seed)}, head_dim, H)
            kh, vh = (torch.from_numpy(fmt.stored(l, x, part)).repeat_interleave(rep, 0)
                      for part, x in ((0, k), (1, v)))
            p = torch.softmax((scaling * q @ kh.transpose(1, 2)).masked_fill(mask, float("-inf")), -1)
            D[i, j + 1] = float((((p @ vh - o) * g).sum(-1) ** 2).sum())
    return D


def rdr_allocation(qkv, layers, budget_tier, head_dim, softmax_scale, codebook):
    """{layer: (key bits, value bits)}: RDR's choice from RDR_LADDER, one tier per layer (a
    vLLM layer has one state size), within the bytes ``budget_tier`` names (budget_bytes).

    Each layer is one item of an RDR problem: its distortion at tier t is the surrogate
    (spherical_kv_ref.rdr.distortion, lognormal key term, prior 0.2) summed over its kv-heads'
    states of the calibration text, with the statistics of its last CALIBRATION_QUERIES
    queries; its cost is the tier's bytes per token. Eviction is not an option (its
    distortion is set above every tier's)."""
    from spherical_kv_ref import rdr
    from spherical_kv_ref.rdr.statistics import row_statistics
    ek, ev = rdr.tier_error_constants(RDR_LADDER, head_dim, kind=codebook)
    H = qkv.keys[layers[0]].shape[0]
    D = np.zeros((len(layers), len(RDR_LADDER) + 1))
    for i, l in enumerate(layers):
        q, k, v = (np.asarray(a, np.float64) for a in (qkv.queries[l], qkv.keys[l], qkv.values[l]))
        g = q.shape[0] // H
        for h in range(H):
            qs = q[h * g:(h + 1) * g, -CALIBRATION_QUERIES:].reshape(-1, head_dim)
            p, q2, r, vn, res, kappa = row_statistics(k[h], v[h], qs, softmax_scale, 0.2)
            D[i] += rdr.distortion(p, q2, r, vn, res, ek, ev, head_dim, softmax_scale=softmax_scale,
                                   eviction_factor=kappa, key_term="lognormal").sum(axis=0)
    return solve_layers(D, layers, budget_bytes(budget_tier, head_dim, H * len(layers)), H,
                        head_dim)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 or gemma3-270m")
    ap.add_argument("--tier", nargs="+", default=["4/4"],
                    help="formats: K/V, fp8, fp8-amax, fp8-rtz, rdr:K/V, rdr:NN%%, rdr-grad:K/V, "
                         "rdr-grad:NN%% (see the module's docstring)")
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
    from spherical_kv_eval.model import MODELS, capture_qkv, load_model
    from spherical_kv_ref.engine import BlockFormat
    from spherical_kv_vllm import parse_tier
    model, tok = load_model(a.model)
    cfg = model.config.get_text_config(decoder=True)
    d, H = cfg.head_dim, cfg.num_key_value_heads
    layers = list(MODELS[a.model].full_layers or range(cfg.num_hidden_layers))
    ids = torch.tensor([tok(passage())["input_ids"]])
    dense = run(model, ids, None)
    print(f"{a.model}: dense PPL {math.exp(dense):.4f} over {ids.shape[1] - 1} scored tokens; "
          f"compressed layers {layers}", flush=True)
    qkv = None
    if any(t == "fp8-amax" or t.startswith("rdr:") for t in a.tier):
        qkv = capture_qkv(model, calibration_ids(tok))
    grad_ids = torch.tensor([calibration_ids(tok)[:GRAD_TOKENS]]) \
        if any(t.startswith("rdr-grad:") for t in a.tier) else None
    softmax_scale = float(model.model.layers[layers[0]].self_attn.scaling)
    rows, chosen = [], {}
    for name in a.tier:
        fp8 = name in ("fp8", "fp8-amax", "fp8-rtz")
        for cb in (["-"] if fp8 else a.codebook):
            for seed in ([0] if fp8 else a.seeds):
                if name in ("fp8", "fp8-rtz"):
                    per = {l: (name, 1.0, 1.0) for l in layers}
                elif name == "fp8-amax":
                    per = {l: ("fp8",) + s for l, s in amax_scales(qkv, layers).items()}
                elif name.startswith("rdr:"):
                    if (name, cb) not in chosen:       # the allocation does not depend on the seed
                        chosen[name, cb] = rdr_allocation(qkv, layers, name[4:], d,
                                                          softmax_scale, cb)
                    per = {l: BlockFormat(*chosen[name, cb][l], d, H, 16, cb, seed) for l in layers}
                elif name.startswith("rdr-grad:"):
                    if (name, cb) not in chosen:       # measured with rotation seed 0
                        D = grad_distortion(model, grad_ids, layers, d, cb, 0)
                        chosen[name, cb] = solve_layers(
                            D, layers, budget_bytes(name[9:], d, H * len(layers)), H, d)
                    per = {l: BlockFormat(*chosen[name, cb][l], d, H, 16, cb, seed) for l in layers}
                elif set(parse_bits(name)) & set(LAB_BITS):
                    per = {l: LabTier(*parse_bits(name), d, cb, seed) for l in layers}
                else:
                    per = {l: BlockFormat(*parse_tier(name), d, H, 16, cb, seed) for l in layers}
                fmt = Format(name, per, d, H)
                nll = run(model, ids, fmt, a.variant, compressed=set(layers))
                dp = math.exp(nll - dense) - 1
                row = {"model": a.model, "tier": name, "codebook": cb, "seed": seed,
                       "ppl": math.exp(nll), "dense_ppl": math.exp(dense), "dppl": dp,
                       "bytes_per_token": fmt.bytes_per_token,
                       "bf16_bytes_per_token": fmt.bf16_bytes_per_token,
                       "fixed_bytes": fmt.fixed_bytes, "arithmetic": arithmetic()}
                if a.variant:
                    row["variant"] = list(a.variant)
                if name.startswith("rdr") or name == "fp8-amax":
                    row["layers"] = fmt.tiers() if name.startswith("rdr") else \
                        {l: list(per[l][1:]) for l in layers}
                rows.append(row)
                frac = fmt.bytes_per_token / fmt.bf16_bytes_per_token
                print(f"{name} {cb:9s} seed {seed}: PPL {math.exp(nll):.4f}  ΔPPL {100 * dp:+.2f} %"
                      f"  ({fmt.bytes_per_token} B/token, {100 * frac:.1f} % of bf16)", flush=True)
    for name in a.tier:
        for cb in sorted({r["codebook"] for r in rows if r["tier"] == name}):
            ds = [r["dppl"] for r in rows if r["tier"] == name and r["codebook"] == cb]
            print(f"{name} {cb:9s}: mean ΔPPL {100 * np.mean(ds):+.2f} % "
                  f"(min {100 * min(ds):+.2f}, max {100 * max(ds):+.2f}) over {len(ds)} seeds")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
