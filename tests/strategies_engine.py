"""Synthetic engine steps for the adapter tests (test_engine_adapter.py): a vLLM-style pool,
random block tables and slot mappings, and a mixed prefill + decode batch."""
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from spherical_kv_ref.engine import BlockFormat

#: one tier per pool: lossless-equivalent fp16, the plugin's default 8/4, 4/4, fewer value
#: bits, the 3-bit split layout, and 8-bit keys with fp16 values (values without a scale)
TIERS = ((16, 16), (8, 4), (4, 4), (4, 2), (3, 3), (8, 16))


@dataclass
class Step:
    """One step: the earlier tokens already in the pool, then this step's new tokens.
    keys/values[r] (seq_len, H, d) float64; query (N, Hq, d); metadata as the engine has it."""
    fmt: BlockFormat
    layer: int
    keys: list
    values: list
    context: list            # tokens of each request cached before the step
    query: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    slot_mapping: np.ndarray  # the step's tokens (padding: -1)
    context_slots: np.ndarray
    context_rows: list        # (request, position) of each context slot, in write order
    num_blocks: int


def make_step(rng, fmt: BlockFormat, requests, group=3, pad=0, spare_blocks=3, layer=1):
    """requests: [(context_len, new_len)]; new_len 1 is a decode, more a prefill chunk (with
    context 0 a fresh prompt). Blocks are drawn at random from the pool and the unused columns
    of the block table name blocks of other requests (the adapter must not read them)."""
    B, H, d = fmt.block_size, fmt.num_kv_heads, fmt.head_dim
    seq = np.array([c + n for c, n in requests], np.int64)
    need = -(-seq // B)
    num_blocks = int(need.sum()) + spare_blocks
    ids = rng.permutation(num_blocks)
    width = int(need.max()) + 1
    table = rng.integers(0, num_blocks, (len(requests), width))
    a = 0
    for r, m in enumerate(need):
        table[r, :m] = ids[a:a + m]
        a += m
    # float32, as an engine hands them: both paths then encode the same numbers
    keys = [(rng.standard_normal((s, H, d)) * rng.lognormal(0, 0.4, (s, H, 1)) + 0.7).astype(np.float32)
            for s in seq]
    values = [(rng.standard_normal((s, H, d)) - 0.3).astype(np.float32) for s in seq]

    def slot(r, p):
        return table[r, p // B] * B + p % B
    ctx = [(r, p) for r, (c, _) in enumerate(requests) for p in range(c)]
    order = rng.permutation(len(ctx))
    ctx = [ctx[i] for i in order]
    qlen = np.array([n for _, n in requests])
    qsl = np.concatenate([[0], np.cumsum(qlen)])
    step_slots = [slot(r, c + i) for r, (c, n) in enumerate(requests) for i in range(n)]
    slots = np.array(step_slots + [-1] * pad, np.int64)
    query = rng.standard_normal((slots.size, H * group, d)) * 1.5
    return Step(fmt, layer, keys, values, [c for c, _ in requests], query, qsl, seq, table,
                slots, np.array([slot(r, p) for r, p in ctx], np.int64), ctx, num_blocks)


def step_kv(step):
    """(context keys, context values, step keys, step values) as (n, H, d) arrays in the
    order of context_slots and slot_mapping (padding rows: finite junk)."""
    ck = np.array([step.keys[r][p] for r, p in step.context_rows]).reshape(-1, *step.keys[0].shape[1:])
    cv = np.array([step.values[r][p] for r, p in step.context_rows]).reshape(ck.shape)
    sk, sv = [], []
    for r, c in enumerate(step.context):
        sk.append(step.keys[r][c:])
        sv.append(step.values[r][c:])
    pad = step.slot_mapping.size - sum(len(x) for x in sk)
    sk.append(np.full((pad,) + ck.shape[1:], 3.0))
    sv.append(np.full((pad,) + ck.shape[1:], -3.0))
    return ck, cv, np.concatenate(sk), np.concatenate(sv)


#: (context_len, new_len) per request: decodes, prefills longer than a block, a chunked
#: prefill on top of a cached context, a context ending exactly at a block boundary
requests = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 37)), min_size=1, max_size=4)
formats = st.builds(lambda t, d, H, B: BlockFormat(t[0], t[1], d, H, B),
                    st.sampled_from(TIERS), st.sampled_from([16, 32]), st.integers(1, 2),
                    st.sampled_from([16, 32]))
