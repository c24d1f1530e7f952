"""Random paged decode cases, declared once for the GPU tests, the benchmarks and the
validation scripts, so they cannot drift apart.

A case is one layer's cache: rows (sequence b, kv-head h) with ragged lengths, each row's
states split into chunks of random tiers (mixed across pages), encoded by the reference
codec and laid into pages by ``pack_pages``; plus queries and the float64 reference output
from ``spherical_kv_ref.ada.mixed_tier_attention``. The benchmark pools (the shapes of one
Llama-3.1-8B layer, ``bench_layout``, ``encoded_pool``, a captured decode step ``ada_step``)
serve validation/decode_bench.py and the asv benchmarks alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from cupy_kernels.kernel_tables import KernelTables, PackedPages, kernel_tables, pack_pages, rotation_signs


@dataclass
class DecodeCase:
    tables: KernelTables
    packed: PackedPages
    q: np.ndarray            # (batch, Hq, d) float32
    sigma_k: np.ndarray      # (Hkv, d) float32
    sigma_v: np.ndarray
    mean_k: Optional[np.ndarray]   # (rows, d) float32 or None
    mean_v: Optional[np.ndarray]
    num_kv_heads: int
    lengths: np.ndarray      # (rows,) states per row
    parts: list              # per row: [(keys Encoded, values Encoded, kc, vc), ...]

    def reference(self, softmax_scale=None) -> np.ndarray:
        """float64 (batch, Hq, d) from the NumPy reference."""
        from spherical_kv_ref.ada import mixed_tier_attention
        b, hq, d = self.q.shape
        g = hq // self.num_kv_heads
        out = np.zeros((b, hq, d))
        for r, parts in enumerate(self.parts):
            bi, h = divmod(r, self.num_kv_heads)
            qh = self.q[bi, h * g:(h + 1) * g].astype(np.float64)
            out[bi, h * g:(h + 1) * g] = mixed_tier_attention(
                qh, parts,
                key_mean=None if self.mean_k is None else self.mean_k[r],
                value_mean=None if self.mean_v is None else self.mean_v[r],
                softmax_scale=softmax_scale)
        return out

    def error_scale(self, softmax_scale=None) -> np.ndarray:
        """Per (batch, head) the scale of the kernel's rounding error (docs/PERF_NOTES.md):
        (1 + 2*softmax_scale*|q|*max r_K) * max |v_hat| with r_K the stored key radius and
        v_hat the stored values (centred; mu_V is added exactly) — fp16 operands carry 2^-11 relative error each."""
        b, hq, d = self.q.shape
        g = hq // self.num_kv_heads
        sc = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
        out = np.zeros((b, hq))
        for r, parts in enumerate(self.parts):
            bi, h = divmod(r, self.num_kv_heads)
            rk, vmax = stored_radii(parts)
            qn = np.linalg.norm(self.q[bi, h * g:(h + 1) * g].astype(np.float64), axis=1)
            out[bi, h * g:(h + 1) * g] = (1.0 + 2.0 * sc * qn * rk) * vmax
        return out


def stored_radii(parts) -> tuple:
    """(max r_K, max |v_hat|) over one row's parts [(keys, values, key codec, value codec)]:
    the largest stored key and value norms, centred (mu added back exactly is left out)."""
    def largest(enc, codec):
        return float(np.max(np.linalg.norm(codec.decode(enc) - (0 if enc.mean is None else enc.mean),
                                           axis=1)))
    return (max(largest(ke, kc) for ke, _, kc, _ in parts),
            max(largest(ve, vc) for _, ve, _, vc in parts))


def build_case(batch: int, num_kv_heads: int, group: int, dim: int, lengths: Sequence[int],
               ladder, tier_choices: Sequence[int], seed: int = 0, centred: bool = False,
               page_bytes: int = 4096, chunks_per_row: int = 3, shuffle: bool = True,
               fill_random: bool = True, reference_parts: bool = True,
               codebook: str = "lloyd-max") -> DecodeCase:
    """lengths: states per row (rows = batch * num_kv_heads); every row gets up to
    ``chunks_per_row`` chunks, each at a tier drawn from ``tier_choices``. codebook: the
    codecs' and the pool's ("uniform" decodes on the affine path)."""
    from spherical_kv_ref import SphericalCodec, TierLadder
    ladder = ladder if isinstance(ladder, TierLadder) else TierLadder(ladder)
    tables = kernel_tables(ladder, dim, page_bytes, codebook=codebook)
    rng = np.random.default_rng(seed)
    rows = batch * num_kv_heads
    if len(lengths) != rows:
        raise ValueError(f"{rows} rows but {len(lengths)} lengths")
    codecs = {}

    def codec(h, bits, salt):
        key = (h, bits, salt)
        if key not in codecs:
            codecs[key] = SphericalCodec(dim, bits, seed=seed, head=h, salt=salt,
                                         codebook=codebook)
        return codecs[key]

    sigma_k = rotation_signs([codec(h, 4, 0) for h in range(num_kv_heads)])
    sigma_v = rotation_signs([codec(h, 4, 1) for h in range(num_kv_heads)])
    mean_k = rng.normal(0, 1.0, (rows, dim)).astype(np.float32) if centred else None
    mean_v = rng.normal(0, 1.0, (rows, dim)).astype(np.float32) if centred else None
    packed_rows, parts = [], []
    for r in range(rows):
        h = r % num_kv_heads
        n = int(lengths[r])
        cuts = np.sort(rng.integers(0, n + 1, max(0, chunks_per_row - 1)))
        bounds = [0, *cuts.tolist(), n]
        chunks, rparts = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b <= a:
                continue
            t = int(rng.choice(tier_choices))
            kb, vb = ladder.bits(t)
            k = rng.normal(0, 1.0, (b - a, dim)) * rng.uniform(0.5, 2.0, (b - a, 1))
            v = rng.normal(0, 1.0, (b - a, dim))
            if centred:
                k += mean_k[r]
                v += mean_v[r]
            kc, vc = codec(h, kb, 0), codec(h, vb, 1)
            ke = kc.encode(k, mean=None if mean_k is None else mean_k[r])
            ve = vc.encode(v, mean=None if mean_v is None else mean_v[r])
            chunks.append((t, ke, ve))
            rparts.append((ke, ve, kc, vc))
        packed_rows.append(chunks)
        parts.append(rparts)
    packed = pack_pages(packed_rows, tables, rng=rng if shuffle else None,
                        fill=None if fill_random else 0)
    q = rng.normal(0, 1.0, (batch, num_kv_heads * group, dim)).astype(np.float32)
    return DecodeCase(tables, packed, q, sigma_k, sigma_v, mean_k, mean_v, num_kv_heads,
                      np.asarray(lengths), parts if reference_parts else [])


def to_device(case: DecodeCase) -> dict:
    """CuPy arrays of a case, keyed like ``ada_decode``'s arguments."""
    from cupy_kernels._module import cupy
    cp = cupy()
    p = case.packed
    return dict(q=cp.asarray(case.q), pages=cp.asarray(p.pages), page_tier=cp.asarray(p.page_tier),
                page_count=cp.asarray(p.page_count), indptr=cp.asarray(p.indptr),
                indices=cp.asarray(p.indices), sigma_k=cp.asarray(case.sigma_k),
                sigma_v=cp.asarray(case.sigma_v),
                mean_k=None if case.mean_k is None else cp.asarray(case.mean_k),
                mean_v=None if case.mean_v is None else cp.asarray(case.mean_v))


def run_case(case: DecodeCase, dev: Optional[dict] = None, **kw):
    from cupy_kernels.ada_decode import ada_decode
    dev = to_device(case) if dev is None else dev
    return ada_decode(dev["q"], dev["pages"], dev["page_tier"], dev["page_count"], dev["indptr"],
                      dev["indices"], case.tables, dev["sigma_k"], dev["sigma_v"],
                      num_kv_heads=case.num_kv_heads, mean_k=dev["mean_k"], mean_v=dev["mean_v"],
                      **kw)


# ------------------------------------------------------------------ large synthetic layouts

@dataclass
class SyntheticLayout:
    """A page table for benchmarks: every row holds ``context`` states split over tiers."""
    tables: KernelTables
    page_tier: np.ndarray
    page_count: np.ndarray
    indptr: np.ndarray
    indices: np.ndarray
    dst_page: np.ndarray     # (rows * context,) page of each state, row-major
    dst_slot: np.ndarray
    state_head: np.ndarray   # kv-head of each state
    tier_of_state: np.ndarray

    @property
    def cache_bytes(self) -> int:
        """Bytes of the valid states (codes + scales) the decode must read."""
        per = np.array([0] + [self.tables.bytes_per_state(t)
                              for t in range(1, self.tables.num_tiers + 1)])
        return int(np.sum(self.page_count[self.indices] * per[self.page_tier[self.indices]]))

    @property
    def page_bytes_total(self) -> int:
        return int(self.indices.size) * self.tables.page_bytes


def synthetic_layout(batch: int, num_kv_heads: int, context: int, tables: KernelTables,
                     tier_counts, seed: int = 0, order: str = "shuffled",
                     last_page_at: Optional[int] = None) -> SyntheticLayout:
    """tier_counts: {tier: states per row} summing to ``context``. ``order``: where a row's
    pages lie in the pool: "shuffled" (a seeded permutation of the page ids: a row's pages
    are scattered, as after a real serving run), "contiguous" (row r's pages form one run of
    consecutive ids) or "strided" (page k of row r is page k * rows + r). A row's pages come
    in tier order, each tier's partial page last; ``last_page_at``: the row's last page (the
    top tier's partial one, if any) moved to that place in the row's page list instead."""
    rng = np.random.default_rng(seed)
    rows = batch * num_kv_heads
    if sum(tier_counts.values()) != context:
        raise ValueError("tier_counts must sum to context")
    per_row_pages = []
    for t, n in sorted(tier_counts.items()):
        p = tables.states_per_page(t)
        full, rest = divmod(n, p)
        per_row_pages += [(t, p)] * full + ([(t, rest)] if rest else [])
    npr = len(per_row_pages)
    if last_page_at is not None:
        if not 0 <= last_page_at < npr:
            raise ValueError(f"last_page_at must be in [0, {npr}), got {last_page_at}")
        per_row_pages.insert(last_page_at, per_row_pages.pop())
    num_pages = rows * npr
    if order == "shuffled":
        ids = rng.permutation(num_pages).astype(np.int32).reshape(rows, npr)
    elif order == "contiguous":
        ids = np.arange(num_pages, dtype=np.int32).reshape(rows, npr)
    elif order == "strided":
        ids = np.arange(num_pages, dtype=np.int32).reshape(npr, rows).T.copy()
    else:
        raise ValueError(f"order must be 'shuffled', 'contiguous' or 'strided', got {order!r}")
    tiers = np.array([t for t, _ in per_row_pages], np.int32)
    counts = np.array([c for _, c in per_row_pages], np.int32)
    page_tier = np.zeros(num_pages, np.int32)
    page_count = np.zeros(num_pages, np.int32)
    page_tier[ids] = tiers[None, :]
    page_count[ids] = counts[None, :]
    indptr = (np.arange(rows + 1) * npr).astype(np.int32)
    slot_in_page = np.concatenate([np.arange(c) for c in counts]).astype(np.int32)
    page_of_state = np.repeat(np.arange(npr), counts)
    dst_page = ids[:, page_of_state].reshape(-1).astype(np.int32)
    dst_slot = np.tile(slot_in_page, rows)
    state_head = np.repeat(np.arange(rows) % num_kv_heads, context).astype(np.int32)
    tier_of_state = np.tile(np.repeat(tiers, counts), rows)
    return SyntheticLayout(tables, page_tier, page_count, indptr, ids.reshape(-1).copy(),
                           dst_page, dst_slot, state_head, tier_of_state)

# ------------------------------------------------------------------ benchmark pools

# One Llama-3.1-8B layer (32 query heads, 8 kv-heads, d = 128) and the benchmark's ladder: the
# shapes validation/decode_bench.py and the asv benchmarks time.
BENCH_HQ, BENCH_HKV, BENCH_D = 32, 8, 128
# Layer shapes the benchmarks take (query heads, kv-heads, head dim): the default one, and a
# head_dim-256 layer of the Gemma-3 family's width (16 query heads, 8 kv-heads).
BENCH_GEOMETRIES = {"llama8b": (BENCH_HQ, BENCH_HKV, BENCH_D), "d256": (16, 8, 256)}
BENCH_LADDER = [(2, 2), (3, 3), (4, 4), (8, 8), (16, 16)]
BENCH_TIERS = {"4/4": 3, "3/3": 2, "2/2": 1}   # tier sets of one tier: name -> tier
#: one-tier sets outside BENCH_LADDER, each with a ladder of its own (BENCH_LADDER with the
#: tier in its place), so the cases above keep their tables: name -> (ladder, tier). 8/4 is
#: the vLLM plugin's default tier (docs/serving.md)
EXTRA_TIERS = {"8/4": ([(2, 2), (3, 3), (4, 4), (8, 4), (8, 8), (16, 16)], 4)}


def bench_ladder(tiers_name: str):
    """The ladder a tier set's benchmark pool is built with."""
    return EXTRA_TIERS[tiers_name][0] if tiers_name in EXTRA_TIERS else BENCH_LADDER


def _one_tier(tiers_name: str) -> int:
    return EXTRA_TIERS[tiers_name][1] if tiers_name in EXTRA_TIERS else BENCH_TIERS[tiers_name]


def rdr_mix(context: int) -> dict:
    """An RDR-style allocation: 4 sinks + 256 recent at the top tier, 2 % at 8/8, then
    40 % 4/4, 30 % 3/3, the rest 2/2 (fractions of the remaining states)."""
    top = min(context, 260)
    rest = context - top
    t8 = int(0.02 * rest)
    t4 = int(0.40 * rest)
    t3 = int(0.30 * rest)
    return {5: top, 4: t8, 3: t4, 2: t3, 1: rest - t8 - t4 - t3}


def bench_layout(batch, context, tiers_name, tables, seed=0, order="shuffled", last_page_at=None,
                 num_kv_heads=BENCH_HKV):
    """The page table of (batch, context) states per kv-head row at one tier set (a name of
    BENCH_TIERS or EXTRA_TIERS, or "rdr-mix"; ``tables`` of ``bench_ladder(tiers_name)``),
    ``num_kv_heads`` rows per sequence."""
    counts = rdr_mix(context) if tiers_name == "rdr-mix" else {_one_tier(tiers_name): context}
    return synthetic_layout(batch, num_kv_heads, context, tables, counts, seed=seed, order=order,
                            last_page_at=last_page_at)


def encode_inputs(batch, context, tiers_name, tables, seed=0, order="shuffled", last_page_at=None,
                  num_kv_heads=BENCH_HKV):
    """(layout, inputs) of an encode of every state of (batch, context, tiers) into a pool
    (``order``: synthetic_layout's, shuffled by default): the page tiers, key and value
    rotation signs (seeded), heads, destinations and random rows, on the GPU."""
    from cupy_kernels._module import cupy
    cp = cupy()
    lay = bench_layout(batch, context, tiers_name, tables, seed, order, last_page_at, num_kv_heads)
    rng = np.random.default_rng(seed)
    d = tables.dim
    sig = [cp.asarray((1 - 2 * rng.integers(0, 2, (num_kv_heads, d))).astype(np.float32)) for _ in "kv"]
    head, dpg, dsl = (cp.asarray(a) for a in (lay.state_head, lay.dst_page, lay.dst_slot))
    x = cp.random.standard_normal((lay.dst_page.size, d), dtype=cp.float32)
    return lay, dict(page_tier=cp.asarray(lay.page_tier), sig=sig, head=head, dst_page=dpg,
                     dst_slot=dsl, x=x)


def encode_keys_values(inp, tables, pages, status):
    """Keys and values of ``encode_inputs``' rows (the same rows, each part its own signs) into
    ``pages`` by ``encode_kv_into_pages`` (one launch; no sync, status not read)."""
    from cupy_kernels.encode import encode_kv_into_pages
    sk, sv = inp["sig"]
    encode_kv_into_pages(inp["x"], inp["x"], pages, inp["page_tier"], tables, sk, sv, inp["head"],
                         inp["dst_page"], inp["dst_slot"], check=False, status=status)


def encoded_pool(batch, context, tiers_name, tables, seed=0, order="shuffled", last_page_at=None,
                 num_kv_heads=BENCH_HKV):
    """A page pool of ``bench_layout``'s states with random keys and values encoded into it
    by the encode kernel (checked: ValueError on a bad status). Returns (state, encode,
    status): the state dict ``ada_step`` takes (with the layout), the encode call that wrote
    the pool (rerunnable: the same bytes, no sync, status not read) and its status word."""
    from cupy_kernels._module import cupy
    from cupy_kernels.encode import raise_status
    cp = cupy()
    lay, inp = encode_inputs(batch, context, tiers_name, tables, seed, order, last_page_at,
                             num_kv_heads)
    pages = cp.zeros((lay.page_tier.size, tables.page_bytes), cp.uint8)
    status = cp.zeros(1, cp.int32)

    def encode():
        encode_keys_values(inp, tables, pages, status)
    encode()
    raise_status(status)
    sig_k, sig_v = inp["sig"]
    state = dict(layout=lay, pages=pages, page_tier=inp["page_tier"],
                 page_count=cp.asarray(lay.page_count), indptr=cp.asarray(lay.indptr),
                 indices=cp.asarray(lay.indices), sigma_k=sig_k, sigma_v=sig_v,
                 num_kv_heads=num_kv_heads)
    return state, encode, status


def ada_step(state, tables, q, batch):
    """A captured CUDA graph of one decode step of q (batch, query heads, d) over ``state``
    (``encoded_pool``'s); returns (replay fn, output, splits)."""
    from cupy_kernels._module import cupy
    from cupy_kernels.ada_decode import ada_decode, make_workspace, splits_for
    cp = cupy()
    hkv = state["num_kv_heads"]
    _, hq, d = q.shape
    rows = batch * hkv
    splits = splits_for(tables, rows, int(state["indices"].size))
    ws = make_workspace(rows, hq // hkv, d, splits)
    out = cp.empty((batch, hq, d), cp.float32)
    kw = dict(num_kv_heads=hkv, out=out, workspace=ws)
    args = (q, state["pages"], state["page_tier"], state["page_count"], state["indptr"],
            state["indices"], tables, state["sigma_k"], state["sigma_v"])
    ada_decode(*args, **kw)                      # validates once, compiles
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        ada_decode(*args, validate=False, **kw)
        graph = stream.end_capture()
    cp.cuda.Device().synchronize()
    null = cp.cuda.Stream.null

    def run():
        graph.launch(null)
    return run, out, splits
