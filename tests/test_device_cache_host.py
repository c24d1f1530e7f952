"""The device cache's host bookkeeping (cupy_kernels.device_cache), which needs no GPU: where
new top-tier states go and what the row holds after them, against a state-by-state walk."""
import numpy as np
import pytest

from cupy_kernels.device_cache import _Row, dense_counts, dense_slots


def test_dense_fill():
    pg, sl = dense_slots(np.array([7, 3, 9], np.int32), 4, 10)
    assert pg.tolist() == [7] * 4 + [3] * 4 + [9] * 2 and sl.tolist() == [0, 1, 2, 3] * 2 + [0, 1]
    assert dense_counts(3, 4, 10).tolist() == [4, 4, 2] and dense_counts(0, 4, 0).size == 0


@pytest.mark.parametrize("open_count, n, done", [(0, 1, 1), (2, 5, 3), (4, 9, 9), (1, 17, 0),
                                                 (3, 6, 2), (None, 8, 8)])
def test_tail_slots_and_grow_follow_one_state_at_a_time(open_count, n, done):
    """A row with an open top-tier page of ``open_count`` states (None: its last page is of
    a lower tier) takes n planned states, of which ``done`` are committed."""
    top, per = 3, 4
    row = _Row()
    row.pages, row.tiers = np.array([11, 12], np.int32), np.array([1, top], np.int32)
    row.counts = np.array([5, per if open_count is None else open_count], np.int32)
    if open_count is None:
        row.tiers[-1] = 2
    n0 = int(row.counts.sum())            # positions 0 .. n0 - 1, appended since a rewrite
    row.tail_from, row.tail_to = 0, n0
    fill = min(row.room(top, per), n)
    new = -(-(n - fill) // per)
    ids = np.arange(100, 100 + new, dtype=np.int32)
    page, slot = row.tail_slots(fill, ids, per, n)
    # the walk: each state into the last page while it is an open top-tier page, else a fresh one
    pages, counts, tiers, fresh = list(row.pages), list(row.counts), list(row.tiers), list(ids)
    for i in range(n):
        if not (tiers[-1] == top and counts[-1] < per):
            pages.append(fresh.pop(0))
            tiers.append(top)
            counts.append(0)
        assert (page[i], slot[i]) == (pages[-1], counts[-1])
        counts[-1] += 1
        if i + 1 == done:
            want = (list(pages), list(counts))
    written, cnt, unused = row.grow(fill, ids, top, per, done)
    if done:
        assert (row.pages.tolist(), row.counts.tolist()) == want
        assert set(written.tolist()) == set(page[:done].tolist())
        assert cnt.tolist() == [want[1][want[0].index(p)] for p in written.tolist()]
    else:
        assert written.size == 0 and row.counts.tolist()[-1] == (per if open_count is None else open_count)
    assert sorted(unused.tolist() + [p for p in row.pages.tolist() if p >= 100]) == ids.tolist()
    assert row.tail_to == n0 + done
    assert row.positions().tolist() == list(range(row.counts.sum()))


# ------------------------------------------------------------------ compress's index work
torch = pytest.importorskip("torch")


def _random_pages(rng, n):
    """n pages of random codes whose fp16 fields (scales, 16-bit states) are finite and of
    the size real states have (|x| <= 4)."""
    pages = torch.as_tensor(rng.integers(0, 256, (n, 4096), dtype=np.uint8))
    halves = pages.view(torch.float16)
    halves.copy_(torch.nan_to_num(halves, 0.75, 0.75, -0.75).clamp(-4, 4))
    return pages


def _cpu_cache(rng, L=2, H=3, d=64, kept=None):
    """A DeviceKVCache whose tensors are on the CPU (its kernels are not called): one
    sequence whose rows hold mixed-tier pages, kept positions (``kept`` in every row, else a
    random count) and a top-tier tail."""
    import cupy_kernels.device_cache as dc
    from spherical_kv_ref.cache import CompressPolicy, set_cache_settings
    from spherical_kv_ref.tiers import TierLadder
    c = dc.DeviceKVCache.__new__(dc.DeviceKVCache)
    _, pool = set_cache_settings(c, L, H, d, TierLadder(), 4096, 4096 * 400, 0, 2 * H, True,
                                 CompressPolicy(sinks=2, recent=5), None)
    from cupy_kernels.kernel_tables import kernel_tables
    c.codebook = "uniform"
    c.tables = kernel_tables(c.ladder, d, 4096, codebook=c.codebook)
    c.device = torch.device("cpu")
    c._codecs, c._rot = {}, {}
    n = pool // 4096
    c.pages = _random_pages(rng, n)
    c.page_tier = torch.zeros(n, dtype=torch.int32)
    c.page_count = torch.zeros(n, dtype=torch.int32)
    c._free = np.arange(n - 1, -1, -1, dtype=np.int32)
    c._num_free = n
    s = dc._Seq(L, H, d, torch, c.device)
    T = c.ladder.top
    per = c._per()
    length = 60
    for layer in range(L):
        for h in range(H):
            row = s.rows[layer][h]
            size = int(rng.integers(0, 30)) if kept is None else kept
            kept_at = np.sort(rng.choice(40, size=size, replace=False))
            tiers = np.sort(rng.integers(1, T + 1, kept_at.size))
            pages, ptiers, counts = [], [], []
            for t in np.unique(tiers):
                k = int(np.sum(tiers == t))
                npg = -(-k // per[t])
                ids = c._allocate(npg)
                pages += ids.tolist()
                ptiers += [t] * npg
                counts += dense_counts(npg, per[t], k).tolist()
            tail = length - 40
            ids = c._allocate(-(-tail // per[T]))
            pages += ids.tolist()
            ptiers += [T] * ids.size
            counts += dense_counts(ids.size, per[T], tail).tolist()
            row.pages, row.tiers = np.array(pages, np.int32), np.array(ptiers, np.int32)
            row.counts = np.array(counts, np.int32)
            row.kept = torch.as_tensor(kept_at.astype(np.int32))
            row.tail_from, row.tail_to = 40, length
            c._set_pages(row.pages, row.tiers, row.counts)
    s.length[:] = length
    s.spans.append((10, 13))
    for layer in range(L):                 # observed queries (float64, as ``observe`` keeps them)
        s.queries[layer] = torch.as_tensor(rng.standard_normal((4, c.num_q_heads, d)))
    c._seqs = {0: s}
    return c, s


def test_state_index_is_the_rows_walked_one_by_one():
    from spherical_kv_ref import SphericalKVCache
    c, s = _cpu_cache(np.random.default_rng(0))
    st = c._state_index(s)
    at = 0
    for layer in range(c.num_layers):
        for h in range(c.num_kv_heads):
            row = s.rows[layer][h]
            page, slot, tier = row.state_slots()
            n = page.size
            assert st.page[at:at + n].tolist() == page.tolist()
            assert st.slot[at:at + n].tolist() == slot.tolist()
            assert st.tier[at:at + n].tolist() == tier.tolist()
            assert st.pos[at:at + n].tolist() == row.positions().tolist()
            want = SphericalKVCache.protected_mask(c, 0, layer, row.positions())
            assert st.protected[at:at + n].tolist() == want.tolist()
            assert set(st.row[at:at + n].tolist()) <= {layer * c.num_kv_heads + h}
            at += n
    assert at == st.page.numel() == int(st.off[-1])


def test_apply_lays_each_changed_row_out_by_tier_in_storage_order(monkeypatch):
    """New tiers (demotions, evictions, rows left as they were) applied: each changed row's
    kept states move to fresh pages, tiers ascending, each tier's states in storage order,
    pages filled densely; unchanged rows keep their pages; old pages go back to the pool."""
    import contextlib
    import cupy_kernels.device_cache as dc
    rng = np.random.default_rng(1)
    c, s = _cpu_cache(rng)
    st = c._state_index(s)
    new = st.tier.clone()
    down = torch.as_tensor(rng.random(new.numel()) < 0.5) & ~st.protected
    new[down] = torch.as_tensor(rng.integers(0, 3, int(down.sum())))
    new = torch.minimum(new, st.tier)
    first_row = st.row == 0
    new[first_row] = st.tier[first_row]                   # row 0 keeps its tiers
    calls = []
    monkeypatch.setattr(dc, "retier", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(dc, "_stream", contextlib.nullcontext)
    before = {(layer, h): (s.rows[layer][h].pages.copy(), *s.rows[layer][h].state_slots(),
                           s.rows[layer][h].positions())
              for layer in range(c.num_layers) for h in range(c.num_kv_heads)}
    free_before = c.num_free_pages
    c._apply(s, st, new, budget=10 ** 9)
    (_, _, _, src_p, src_s, dst_p, dst_s), = calls
    moved = {(int(a), int(b)): (int(x), int(y)) for a, b, x, y in zip(src_p, src_s, dst_p, dst_s)}
    per = c._per()
    released = fresh = k_total = 0
    at = 0
    for (layer, h), (old_pages, page, slot, tier, pos) in before.items():
        row = s.rows[layer][h]
        t_new = new[at:at + page.size].numpy()
        at += page.size
        if np.array_equal(t_new, tier):
            assert np.array_equal(row.pages, old_pages)
            continue
        released += old_pages.size
        fresh += row.pages.size
        order = np.argsort(np.where(t_new > 0, t_new, 99), kind="stable")[:int(np.sum(t_new > 0))]
        assert row.kept.tolist() == pos[order].tolist() and row.tail_from == row.tail_to
        walk_pages, walk_tiers, walk_counts = [], [], []
        k = 0
        for t in range(1, c.ladder.top + 1):
            sel = order[t_new[order] == t]
            for i, j in enumerate(sel):
                if i % per[t] == 0:
                    walk_pages.append(row.pages[len(walk_pages)])
                    walk_tiers.append(t)
                    walk_counts.append(0)
                assert moved[(int(page[j]), int(slot[j]))] == (walk_pages[-1], walk_counts[-1])
                walk_counts[-1] += 1
                k += 1
        assert row.pages.tolist() == walk_pages and row.tiers.tolist() == walk_tiers
        assert row.counts.tolist() == walk_counts
        k_total += k
        assert c.page_tier[torch.as_tensor(row.pages, dtype=torch.long)].tolist() == walk_tiers
        assert c.page_count[torch.as_tensor(row.pages, dtype=torch.long)].tolist() == walk_counts
    assert len(moved) == k_total
    assert c.num_free_pages == free_before + released - fresh
    # the next compress indexes the rewritten rows from their device-held kept positions
    st2 = c._state_index(s)
    at = 0
    for layer in range(c.num_layers):
        for h in range(c.num_kv_heads):
            row = s.rows[layer][h]
            pos = row.positions()
            assert st2.pos[at:at + pos.size].tolist() == pos.tolist()
            at += pos.size
            if row.tail_from == row.tail_to:       # rewritten: every state is a kept one
                assert row.num_kept() == row.num_states()
    assert at == st2.pos.numel()


def _two_sequences(seed=2, **layout):
    """A CPU cache (``_cpu_cache``, its ``layout`` arguments) holding two sequences of the
    same layout and different content, in one pool, with the pool's free list the pages no
    row holds."""
    c, s0 = _cpu_cache(np.random.default_rng(seed), **layout)
    other, s1 = _cpu_cache(np.random.default_rng(seed), **layout)   # the same layout, other content
    rng = np.random.default_rng(seed + 1)
    other.pages = _random_pages(rng, other.pages.shape[0])
    for layer in range(c.num_layers):
        s1.queries[layer] = torch.as_tensor(rng.standard_normal(tuple(s1.queries[layer].shape)))
    shift = c.pages.shape[0]                                 # s1's pages after s0's
    c.pages = torch.cat([c.pages, other.pages])
    c.page_tier = torch.cat([c.page_tier, other.page_tier])
    c.page_count = torch.cat([c.page_count, other.page_count])
    for rows in s1.rows:
        for row in rows:
            row.pages = row.pages + np.int32(shift)
    used = np.concatenate([r.pages for s in (s0, s1) for rows in s.rows for r in rows])
    free = np.setdiff1d(np.arange(c.pages.shape[0], dtype=np.int32), used)
    c._free = np.zeros(c.pages.shape[0], np.int32)          # a stack over the whole pool
    c._free[:free.size], c._num_free = free[::-1], free.size
    c._seqs, c._freed = {0: s0, 1: s1}, set()
    c.compress_seconds = {}
    return c, s0, s1


def test_statistics_of_a_batch_are_each_sequence_s_own():
    """The statistics of two sequences computed in one pass (a layer's rows of both in one
    batch where they hold as many states and queries: here every row, the two sequences
    having the same layout) are those of each sequence alone, in its own order."""
    c, s0, s1 = _two_sequences()
    st = [c._state_index(s) for s in (s0, s1)]
    assert np.array_equal(st[0].n_row, st[1].n_row)
    both = c._statistics([s0, s1], st)
    for i, s in enumerate((s0, s1)):
        (alone, q2), = c._statistics([s], [st[i]])
        for k, v in alone.items():
            assert torch.isfinite(v).all()
            torch.testing.assert_close(both[i][0][k], v, rtol=1e-12, atol=1e-300)
        torch.testing.assert_close(both[i][1], q2, rtol=1e-12, atol=0)
    assert not torch.allclose(both[0][0]["vn"], both[1][0]["vn"])


@pytest.mark.parametrize("together", [1, 2])
def test_statistics_batched_across_layers_are_those_of_one_layer_at_a_time(monkeypatch, together):
    """Rows of every layer holding as many states, in one batch while it is small (one
    sequence's rows: slices of its states; two sequences': gathers), give the statistics
    that one batch per layer gives."""
    import cupy_kernels.device_cache as dc
    c, s0, s1 = _two_sequences(L=3, kept=25)
    seqs = [s0, s1][:together]
    st = [c._state_index(s) for s in seqs]
    from cupy_kernels import rdr_device
    batches, inner = [], rdr_device.row_statistics

    def counted(yk, *args, **kwargs):                        # notes each batch's rows
        batches.append(yk.shape[0])
        return inner(yk, *args, **kwargs)
    monkeypatch.setattr(rdr_device, "row_statistics", counted)
    joined = c._statistics(seqs, st)
    assert len(batches) == 1 and batches[0] == 3 * c.num_kv_heads * together
    monkeypatch.setattr(dc, "STATS_BATCH_BYTES", 0)           # one layer per batch
    apart = c._statistics(seqs, st)
    assert batches[1:] == [c.num_kv_heads * together] * 3
    for (a, qa), (b, qb) in zip(joined, apart):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-300)
        torch.testing.assert_close(qa, qb, rtol=1e-12, atol=0)


@pytest.mark.parametrize("method", ["device", "fast"])
def test_compress_all_leaves_what_compress_of_each_leaves(monkeypatch, method):
    """compress_all over two sequences against compress of one, then the other, on a twin:
    the same reports and the same rows, pages, tiers and counts after (the re-tier kernel's
    moves are the layout test's; here it is not run). A budget one sequence cannot meet
    changes neither; a sequence named twice is refused."""
    import contextlib
    import cupy_kernels.device_cache as dc
    monkeypatch.setattr(dc, "retier", lambda *a, **k: None)
    monkeypatch.setattr(dc, "_stream", contextlib.nullcontext)
    (a, *_), (b, *_) = _two_sequences(), _two_sequences()
    tiers = a.page_tier.clone()
    with pytest.raises(ValueError, match="protected states"):
        a.compress_all([0, 1], 30_000, method)        # the protected states need 61,440
    assert torch.equal(a.page_tier, tiers) and a.num_free_pages == b.num_free_pages
    with pytest.raises(ValueError, match="twice"):
        a.compress_all([1, 1], 120_000, method)
    both = a.compress_all([0, 1], 120_000, method)          # of 204,800 in pages
    each = [b.compress(x, 120_000, method) for x in (0, 1)]
    for x, y in zip(both, each):
        assert (x.bytes_before, x.bytes_after, x.states_before, x.states_kept, x.states_demoted) \
            == (y.bytes_before, y.bytes_after, y.states_before, y.states_kept, y.states_demoted)
        assert x.bytes_after <= x.budget_bytes < x.bytes_before
        assert np.array_equal(x.allocation.tier, y.allocation.tier)
        assert x.allocation.objective == pytest.approx(y.allocation.objective, rel=1e-12)
    for x in (0, 1):
        for ra, rb in zip((r for rows in a._seqs[x].rows for r in rows),
                          (r for rows in b._seqs[x].rows for r in rows)):
            for f in ("pages", "tiers", "counts", "kept"):
                assert np.array_equal(getattr(ra, f), getattr(rb, f)), f
    assert torch.equal(a.page_tier, b.page_tier) and torch.equal(a.page_count, b.page_count)
    assert set(a.compress_seconds) == {"statistics", "solve", "apply"}


@pytest.mark.parametrize("policy_window, observe", [(None, 16), (4, 8), (32, 8)])
def test_the_gpu_transformers_cache_reads_every_recorded_query(monkeypatch, policy_window, observe):
    """DeviceSphericalCache(observe=N) hands its DeviceKVCache a policy whose query window
    holds all N recorded queries, as the CPU SphericalCache does: with the policy's default
    window of 8 it kept only the last 8 of 16, and RDR's estimates (and the decision) came
    out unlike the CPU reference's on the same tokens."""
    pytest.importorskip("transformers")
    import transformers
    from cupy_kernels import hf_device
    from spherical_kv_ref.cache import CompressPolicy
    made = {}
    monkeypatch.setattr(hf_device, "DeviceKVCache", lambda *a, **kw: made.update(kw) or object())
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    kw = {} if policy_window is None else dict(policy=CompressPolicy(window=policy_window, sinks=3))
    cache = hf_device.DeviceSphericalCache(cfg, observe=observe, **kw)
    cache._open("cpu", 0.25)
    assert made["policy"].window == max(observe, policy_window or CompressPolicy().window)
    if policy_window is not None:
        assert made["policy"].sinks == 3             # the rest of the caller's policy kept
