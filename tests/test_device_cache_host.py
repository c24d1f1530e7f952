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
    row.kept = np.arange(int(row.counts.sum()), dtype=np.int64)
    row.tail_from = row.tail_to = row.kept.size
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
    assert row.tail_to == row.tail_from + done
    assert row.positions().tolist() == list(range(row.counts.sum()))
