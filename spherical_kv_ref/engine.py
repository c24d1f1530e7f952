"""The engine adapter: a serving engine's paged-attention metadata on the project's pages
(docs/design.md §8, "adapter"; docs/serving.md).

A paged serving engine (vLLM) owns a pool of blocks, each ``block_size`` tokens of every
kv-head of one layer, and describes a step by four arrays: ``query_start_loc`` (R + 1,)
where each request's new tokens start in the batch, ``seq_lens`` (R,) each request's length
after this step, ``block_table`` (R, W) the blocks of each request in token order, and
``slot_mapping`` (N,) the slot ``block · block_size + offset`` each new token is written to.

How a block holds the project's pages (``BlockFormat``): engine block ``b`` is H pages of
the storage format (docs/format.md "Pages"), page ``b·H + h`` holding kv-head h's states at
one tier, ``page_bytes = block_size · bytes_per_state`` so a page holds exactly
``block_size`` states and engine slot ``s`` is slot ``s % block_size`` of page
``(s // block_size)·H + h``. The engine allocates, frees and preempts blocks; this module
never keeps state between steps, so whatever the engine does with its blocks is safe.

Attention of a step (``plan_step``): the query token at position p of a request attends to
the request's states 0..p (causal inside the new tokens, all of them already written):
* its *context part*: the full blocks 0 .. p // B − 1 (B = block_size). Every block before a
  request's last one is full once the step's tokens are written, so one page count (B)
  serves every such page for every query token;
* its *own block*: slots 0 .. p % B of block p // B. Tokens are grouped by o = p % B, so that
  within one decode call every page has a single valid count, o + 1;
the parts are merged by their log-sum-exps, exactly (docs/design.md §6, split-K merge).

``CpuPagedAttention`` runs the two operations (write, attend) with the reference codecs and the numba paged decode (``paged_decode.decode_pool``);
``cupy_kernels.engine.CudaPagedAttention`` runs the same interface with
``encode_kv_into_pages`` and ``ada_decode``. Both take the plan this module makes, so the
engine shell around them (spherical_kv_vllm) is the same for both devices. Keys and values
are not centred (an engine block outlives no per-sequence mean the adapter could keep).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from .ada import merge_attention
from .codec import SphericalCodec
from .paged import TierLayout, page_layout, scatter_states
from .paged_decode import PagedDecodeTables, decode_pool
from .rotation import KEY_SALT, VALUE_SALT
from .tiers import TierLadder

__all__ = ["BlockFormat", "StepPlan", "plan_step", "CpuPagedAttention",
           "merge_into", "context_table", "own_block_groups"]


@dataclass(frozen=True)
class BlockFormat:
    """The layout of one engine block at one tier: ``num_kv_heads`` pages of
    ``page_bytes = block_size · state_bytes`` bytes (docs/format.md "Pages", P = block_size).

    codebook, seed: the codecs' (rotation seeds per (seed, layer, kv-head, key/value))."""
    key_bits: int
    value_bits: int
    head_dim: int
    num_kv_heads: int
    block_size: int = 16
    codebook: str = "uniform"
    seed: int = 0

    def __post_init__(self):
        for name in ("head_dim", "num_kv_heads", "block_size"):
            v = getattr(self, name)
            if int(v) != v or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.head_dim < 4:
            raise ValueError(f"head_dim must be at least 4, got {self.head_dim}")
        if self.codebook not in ("uniform", "lloyd-max"):
            raise ValueError(f"codebook must be 'uniform' or 'lloyd-max', got {self.codebook!r}")
        ladder = self.ladder          # validates the bits
        if self.page_bytes % 16:
            raise ValueError(f"block_size={self.block_size} x {self.state_bytes} bytes per state "
                             f"is not a multiple of 16 bytes (docs/format.md); use a block size "
                             f"that is a multiple of 16")
        if ladder.states_per_page(1, self.head_dim, self.page_bytes) != self.block_size:
            raise RuntimeError("a page does not hold exactly one block's states; this is a bug")

    @property
    def tier(self) -> Tuple[int, int]:
        return (int(self.key_bits), int(self.value_bits))

    @property
    def ladder(self) -> TierLadder:
        """The one-tier ladder of the pool (every page is tier 1)."""
        return TierLadder([self.tier])

    @property
    def state_bytes(self) -> int:
        """Bytes of one (key, value) state of one kv-head: codes + fp16 scales."""
        return self.ladder.bytes_per_state(1, self.head_dim)

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.state_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one engine block (every kv-head of one layer)."""
        return self.num_kv_heads * self.page_bytes

    @property
    def layout(self) -> TierLayout:
        return page_layout(self.ladder, self.head_dim, self.page_bytes)[1]

    def codec(self, layer: int, head: int, part: int) -> SphericalCodec:
        """The codec of (layer, kv-head, keys (0) or values (1)) at this tier."""
        bits = self.key_bits if part == KEY_SALT else self.value_bits
        return SphericalCodec(self.head_dim, bits, self.seed, layer=layer, head=head, salt=part,
                              codebook=self.codebook)

    def pages_of(self, pool) -> np.ndarray:
        """The pool's bytes as pages, uint8 (num_blocks · H, page_bytes), a view (no copy).
        pool: the engine's block pool, uint8 with num_blocks · block_bytes bytes, C-contiguous
        (e.g. (num_blocks, H, block_size, state_bytes)); ValueError otherwise."""
        a = np.asarray(pool)
        if a.dtype != np.uint8 or not a.flags.c_contiguous or a.ndim < 1 \
                or a.size % self.block_bytes or a.shape[0] * self.block_bytes != a.size:
            raise ValueError(f"pool must be C-contiguous uint8 blocks of {self.block_bytes} bytes "
                             f"({self.num_kv_heads} kv-heads x {self.page_bytes}), got "
                             f"{a.dtype} {a.shape}")
        return a.reshape(-1, self.page_bytes)


@dataclass(frozen=True)
class StepPlan:
    """What one step's attention reads, from the engine's metadata (host arrays, int64).

    position, request (N,): each new token's position in its request and the request's
    index (−1 for a padding token past query_start_loc[-1]). Context part: ctx_tokens (Nc,)
    the tokens with at least one full block before their own, ctx_indptr (Nc + 1,) and
    ctx_blocks their engine blocks (CSR). Own block: own_block, own_len (N,): the block
    holding each token and how many of its slots the token sees (p % B + 1)."""
    num_tokens: int
    block_size: int
    position: np.ndarray
    request: np.ndarray
    ctx_tokens: np.ndarray
    ctx_indptr: np.ndarray
    ctx_blocks: np.ndarray
    own_block: np.ndarray
    own_len: np.ndarray

    @property
    def query_tokens(self) -> np.ndarray:
        """Indices of the tokens that carry a query (not padding)."""
        return np.flatnonzero(self.request >= 0)


def _int_array(x, name: str, ndim: int) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != ndim or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a {ndim}-d integer array, got {a.dtype} {a.shape}")
    return a.astype(np.int64)


def plan_step(query_start_loc, seq_lens, block_table, block_size: int,
              num_tokens: int | None = None) -> StepPlan:
    """The reads of one step (module docstring). query_start_loc (R + 1,), seq_lens (R,),
    block_table (R, W) integer arrays as the engine keeps them; num_tokens: rows of the
    step's query (default query_start_loc[-1]; rows past it are padding). ValueError for
    metadata that does not describe a step (a request longer than its block table, new
    tokens beyond its length, a negative block id it reads)."""
    qsl = _int_array(query_start_loc, "query_start_loc", 1)
    seq = _int_array(seq_lens, "seq_lens", 1)
    bt = _int_array(block_table, "block_table", 2)
    B = int(block_size)
    if B < 1 or B != block_size:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    R = seq.shape[0]
    if qsl.shape[0] != R + 1 or bt.shape[0] < R:
        raise ValueError(f"query_start_loc must have {R + 1} entries and block_table at least "
                         f"{R} rows for {R} requests, got {qsl.shape[0]} and {bt.shape[0]}")
    qlen = np.diff(qsl)
    if R and (qsl[0] != 0 or np.any(qlen < 0)):
        raise ValueError("query_start_loc must start at 0 and be non-decreasing")
    N = int(qsl[-1]) if num_tokens is None else int(num_tokens)
    if N < int(qsl[-1]):
        raise ValueError(f"num_tokens={N} is less than query_start_loc[-1]={int(qsl[-1])}")
    if np.any(seq < qlen):
        r = int(np.flatnonzero(seq < qlen)[0])
        raise ValueError(f"request {r}: {int(qlen[r])} new tokens but seq_len {int(seq[r])}")
    need = -(-seq // B)
    if np.any(need > bt.shape[1]):
        r = int(np.flatnonzero(need > bt.shape[1])[0])
        raise ValueError(f"request {r}: seq_len {int(seq[r])} needs {int(need[r])} blocks, the "
                         f"block table has {bt.shape[1]} columns")
    request = np.full(N, -1, np.int64)
    position = np.full(N, -1, np.int64)
    request[:qsl[-1]] = np.repeat(np.arange(R), qlen)
    tok = np.arange(int(qsl[-1]))
    position[:qsl[-1]] = (seq - qlen)[request[:qsl[-1]]] + tok - qsl[request[:qsl[-1]]]
    real = tok
    r, p = request[real], position[real]
    nfull = p // B
    own_block = np.full(N, -1, np.int64)
    own_len = np.zeros(N, np.int64)
    own_block[real] = bt[r, nfull]
    own_len[real] = p % B + 1
    has_ctx = nfull > 0
    ctx_tokens = real[has_ctx]
    counts = nfull[has_ctx]
    ctx_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    seg = np.repeat(np.arange(ctx_tokens.size), counts)
    col = np.arange(int(ctx_indptr[-1])) - ctx_indptr[seg]
    ctx_blocks = bt[request[ctx_tokens][seg], col]
    read = np.concatenate([ctx_blocks, own_block[real]])
    if read.size and read.min() < 0:
        raise ValueError("block_table names a negative block id where a request reads")
    return StepPlan(N, B, position, request, ctx_tokens, ctx_indptr, ctx_blocks,
                    own_block, own_len)


def context_table(plan: StepPlan, num_kv_heads: int):
    """CSR page table of the context part: rows (ctx token, kv-head), token-major;
    returns (indptr int64 (Nc·H + 1,), indices int64 page ids b·H + h)."""
    H = int(num_kv_heads)
    nb = np.diff(plan.ctx_indptr)
    row_len = np.repeat(nb, H)
    indptr = np.concatenate([[0], np.cumsum(row_len)]).astype(np.int64)
    rowid = np.repeat(np.arange(row_len.size), row_len)
    a, h = rowid // H, rowid % H
    j = np.arange(int(indptr[-1])) - indptr[rowid]
    return indptr, plan.ctx_blocks[plan.ctx_indptr[a] + j] * H + h


def own_block_groups(plan: StepPlan, num_kv_heads: int) -> List[Tuple[int, np.ndarray, np.ndarray]]:
    """The own-block part as decode calls: [(count, tokens (n,), pages (n·H,))], one per
    distinct count o + 1; row (token i, kv-head h) reads the single page pages[i·H + h]."""
    H = int(num_kv_heads)
    toks = plan.query_tokens
    out = []
    for c in np.unique(plan.own_len[toks]):
        t = toks[plan.own_len[toks] == c]
        out.append((int(c), t, (plan.own_block[t][:, None] * H + np.arange(H)).reshape(-1)))
    return out


def merge_into(xp, out, lse, tokens, part_out, part_lse) -> None:
    """Merge one part's attention into the running (out, lse) of ``tokens``, in place, exactly
    (``ada.merge_attention``). out (N, Hq, d), lse (N, Hq) (−inf where nothing merged yet);
    tokens (n,) distinct; part_out (n, Hq, d), part_lse (n, Hq). xp: numpy or cupy."""
    out[tokens], lse[tokens] = merge_attention(out[tokens], lse[tokens], part_out, part_lse, xp)


class CpuPagedAttention:
    """The adapter's two operations on the host (numpy arrays in and out).

    write(pool, layer, key, value, slot_mapping): encode the step's keys and values (N, H, d)
    at the format's tier and store them in their slots (slots < 0 are padding, skipped).
    attend(pool, layer, query, plan, softmax_scale): attention (N, Hq, d) float64 of the
    step's queries over their requests' pages (zeros on padding rows)."""

    def __init__(self, fmt: BlockFormat):
        self.fmt = fmt
        self.tables = PagedDecodeTables.for_layout(page_layout(fmt.ladder, fmt.head_dim,
                                                               fmt.page_bytes),
                                                   fmt.head_dim, fmt.codebook)
        self._codecs: Dict[tuple, SphericalCodec] = {}

    def _codec(self, layer: int, head: int, part: int) -> SphericalCodec:
        key = (int(layer), int(head), int(part))
        c = self._codecs.get(key)
        if c is None:
            c = self._codecs[key] = self.fmt.codec(layer, head, part)
        return c

    def _check_heads(self, x, name: str, heads: int) -> np.ndarray:
        a = np.asarray(x)
        if a.ndim != 3 or a.shape[1] != heads or a.shape[2] != self.fmt.head_dim:
            raise ValueError(f"{name} must be (N, {heads}, {self.fmt.head_dim}), got {a.shape}")
        return a

    def write(self, pool, layer: int, key, value, slot_mapping) -> None:
        fmt = self.fmt
        H = fmt.num_kv_heads
        pages = fmt.pages_of(pool)
        k = self._check_heads(key, "key", H)
        v = self._check_heads(value, "value", H)
        slots = _int_array(slot_mapping, "slot_mapping", 1)
        if k.shape != v.shape or slots.shape[0] > k.shape[0]:
            raise ValueError(f"key {k.shape}, value {v.shape} and {slots.shape[0]} slots")
        keep = np.flatnonzero(slots >= 0)
        block, slot = slots[keep] // fmt.block_size, slots[keep] % fmt.block_size
        if block.size and block.max() * H >= pages.shape[0]:
            raise ValueError(f"a slot lies past the pool's {pages.shape[0] // H} blocks")
        encoded = [(self._codec(layer, h, KEY_SALT).encode(k[keep, h]),
                    self._codec(layer, h, VALUE_SALT).encode(v[keep, h])) for h in range(H)]
        for h, (ke, ve) in enumerate(encoded):      # all encoded first: a bad input writes nothing
            scatter_states(pages, fmt.layout, block * H + h, slot, ke, ve)

    def attend(self, pool, layer: int, query, plan: StepPlan, softmax_scale: float) -> np.ndarray:
        fmt = self.fmt
        H, d, B = fmt.num_kv_heads, fmt.head_dim, fmt.block_size
        if plan.block_size != B:
            raise ValueError(f"the plan is for block_size {plan.block_size}, the pool's is {B}")
        pages = fmt.pages_of(pool)
        q = np.asarray(query, np.float64)
        if q.ndim != 3 or q.shape[0] != plan.num_tokens or q.shape[2] != d or q.shape[1] % H:
            raise ValueError(f"query must be ({plan.num_tokens}, a multiple of {H}, {d}), "
                             f"got {q.shape}")
        Hq = q.shape[1]
        G = Hq // H
        # Π_K q per kv-head, (N, H, G, d): rows of a head's group use that head's rotation
        qr = np.empty((q.shape[0], H, G, d))
        for h in range(H):
            qr[:, h] = self._codec(layer, h, KEY_SALT).rotation.apply(
                q[:, h * G:(h + 1) * G].reshape(-1, d)).reshape(-1, G, d)
        acc = np.zeros((q.shape[0], Hq, d))
        lse = np.full((q.shape[0], Hq), -np.inf)
        tier = np.ones(pages.shape[0], np.int32)
        count = np.zeros(pages.shape[0], np.int32)

        def run(tokens, indptr, indices):
            a, l = decode_pool(pages, tier, count, indptr, indices, qr[tokens].reshape(-1, G, d),
                               np.zeros((tokens.size * H, G)), self.tables, softmax_scale, 1)
            merge_into(np, acc, lse, tokens, a.reshape(-1, Hq, d), l.reshape(-1, Hq))

        if plan.ctx_tokens.size:
            indptr, indices = context_table(plan, H)
            count[indices] = B
            run(plan.ctx_tokens, indptr, indices)
        for c, tokens, idx in own_block_groups(plan, H):
            count[idx] = c
            run(tokens, np.arange(idx.size + 1), idx)
        out = np.zeros_like(acc)
        real = plan.query_tokens
        for h in range(H):          # Π_Vᵀ once per query head, on the merged accumulator
            sl = slice(h * G, (h + 1) * G)
            out[real, sl] = self._codec(layer, h, VALUE_SALT).rotation.inverse(
                acc[real, sl].reshape(-1, d)).reshape(-1, G, d)
        return out
