"""Re-tier / compaction launcher (docs/design.md §4, §6; kernel in csrc/retier.cuh).

Applies moves (src_page, src_slot) -> (dst_page, dst_slot) after an RDR decision: equal
bits at both ends copy the stored codes and scales (compaction), fewer bits re-encode the
stored rotated vector y = s * C[c] / sqrt(d) at the destination's bits (the reference's
``paged.encode_rotated(stored_rotated(...))``). The destination pages must already carry
their tier in page_tier; page_count is the caller's bookkeeping. No slot may be both a
source and a destination in one call; every page id must lie inside the pool, every page
named carry a tier of the ladder (no free page), every slot lie inside its page and no move
add bits (all checked before the launch when ``check=True``: ValueError naming the argument,
nothing written).
"""
from __future__ import annotations

import numpy as np

from ._module import constants, cupy, kernel
from .encode import check_inputs, index_array, raise_status, slot_checks
from .kernel_tables import KernelTables, as_device, device_tables, pool_views

THREADS = constants()["RETIER_THREADS"]


def retier(pages, page_tier, tables: KernelTables, src_page, src_slot, dst_page, dst_slot,
           *, check: bool = True, status=None):
    cp = cupy()
    pg, pt = pool_views(pages, page_tier, tables)
    sp, _ = as_device(src_page, "src_page", np.int32, 1)
    n = sp.shape[0]
    sp = index_array(sp, "src_page", n)
    ss = index_array(src_slot, "src_slot", n, "src_page entry")
    dp = index_array(dst_page, "dst_page", n, "src_page entry")
    ds = index_array(dst_slot, "dst_slot", n, "src_page entry")
    if check and n:
        num = pt.shape[0]
        geom = device_tables(tables)["geom"]
        top = tables.num_tiers

        def bits(page):
            return geom[cp.clip(pt[cp.clip(page, 0, num - 1)], 0, top)][:, :2]
        added = cp.any(bits(dp) > bits(sp), axis=1).astype(cp.int32)
        check_inputs((sp, num, f"a src_page is outside the pool of {num} pages"),
                     (dp, num, f"a dst_page is outside the pool of {num} pages"),
                     *slot_checks(cp, sp, ss, pt, tables, "src"),
                     *slot_checks(cp, dp, ds, pt, tables, "dst"),
                     (added, 1, "a move from a src_page to a dst_page would add bits "
                                "(promotion is never allowed)"))
        src = set(zip(sp.get().tolist(), ss.get().tolist()))
        dst = list(zip(dp.get().tolist(), ds.get().tolist()))
        if len(set(dst)) != len(dst):
            raise ValueError("two moves write the same destination slot")
        if src & set(dst):
            raise ValueError("a slot is both a source and a destination; split the moves")
    if status is None:
        status = cp.zeros(1, cp.int32)
    if n:
        dev = device_tables(tables)
        blocks = max(1, min(-(-n * 32 // THREADS), 132 * 16))
        kernel("retier_kernel", tables.dim)(
            (blocks,), (THREADS,),
            (np.int32(n), sp, ss, dp, ds, pg, np.int32(tables.page_words), pt, dev["geom"],
             np.int32(tables.num_tiers), dev["levels64"], dev["mids64"], status))
    if check:
        raise_status(status)
    return status
