"""The engine adapter (spherical_kv_ref.engine, docs/design.md §8): vLLM-style metadata (block table,
slot mapping, sequence lengths, query start locations) over a block pool in the project's
page format, against a flat reference that sees no pages: for every query token, ADA
attention (``ada.attention``) over its own request's states 0..p, encoded by the codecs.
The GPU path (cupy_kernels.engine) against the CPU path on the same steps."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from spherical_kv_ref import attention, dense_attention
from spherical_kv_ref.engine import BlockFormat, CpuPagedAttention, plan_step
from spherical_kv_ref.rotation import KEY_SALT, VALUE_SALT

from strategies_engine import formats, make_step, requests, step_kv
from cupy_kernels._module import DIMS as KERNEL_DIMS   # importable without CuPy

REL = 1e-9      # float64 on both sides: pages, splits and merges change the summation order only
MIXED = [(0, 37), (21, 1), (16, 1), (33, 5), (0, 1), (40, 16)]   # prefills, decodes, a chunk


def fill(step, ops, pool, to=np.asarray):
    """Write the context (an earlier step) and then the step's tokens; return the plan.
    to: moves the arrays where the ops want them (cupy.asarray for the GPU path)."""
    ck, cv, sk, sv = (to(x) for x in step_kv(step))
    if len(ck):
        ops.write(pool, step.layer, ck, cv, to(step.context_slots))
    ops.write(pool, step.layer, sk, sv, to(step.slot_mapping))
    return plan_step(step.query_start_loc, step.seq_lens, step.block_table, step.fmt.block_size,
                     num_tokens=step.slot_mapping.size)


def random_pool(rng, step):
    """A pool of random bytes: no slot the adapter should not read can pass for a state."""
    return rng.integers(0, 256, (step.num_blocks, step.fmt.block_bytes), dtype=np.uint8)


def flat_reference(step, scale):
    fmt = step.fmt
    H = fmt.num_kv_heads
    G = step.query.shape[1] // H
    out = np.zeros(step.query.shape)
    t = 0
    for r, c in enumerate(step.context):
        for p in range(c, step.seq_lens[r]):
            for h in range(H):
                kc, vc = fmt.codec(step.layer, h, KEY_SALT), fmt.codec(step.layer, h, VALUE_SALT)
                out[t, h * G:(h + 1) * G] = attention(
                    step.query[t, h * G:(h + 1) * G], kc.encode(step.keys[r][:p + 1, h]),
                    vc.encode(step.values[r][:p + 1, h]), kc, vc, softmax_scale=scale)
            t += 1
    return out


@given(fmt=formats, reqs=requests, pad=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_mixed_batch_equals_flat_reference(fmt, reqs, pad, seed):
    rng = np.random.default_rng(seed)
    step = make_step(rng, fmt, reqs, group=int(rng.integers(1, 4)), pad=pad)
    ops = CpuPagedAttention(fmt)
    pool = random_pool(rng, step)
    plan = fill(step, ops, pool)
    scale = 1.0 / np.sqrt(fmt.head_dim)
    got = ops.attend(pool, step.layer, step.query, plan, scale)
    ref = flat_reference(step, scale)
    real = plan.query_tokens
    assert np.all(got[plan.num_tokens - pad:] == 0.0)
    err = np.abs(got[real] - ref[real]).max()
    assert err <= REL * (1 + np.abs(ref).max()), err


def test_fp16_tier_is_dense_attention_to_fp16_rounding():
    """At 16/16 the pages hold the rotated keys and values in fp16: the output is causal dense
    attention over the originals, to fp16's relative rounding (2^-11) amplified by the softmax."""
    rng = np.random.default_rng(3)
    fmt = BlockFormat(16, 16, 64, 2)
    step = make_step(rng, fmt, MIXED)
    ops = CpuPagedAttention(fmt)
    pool = random_pool(rng, step)
    plan = fill(step, ops, pool)
    got = ops.attend(pool, step.layer, step.query, plan, 0.125)
    t = 0
    for r, c in enumerate(step.context):
        for p in range(c, step.seq_lens[r]):
            for h in range(2):
                q = step.query[t, 3 * h:3 * h + 3]
                k, v = step.keys[r][:p + 1, h], step.values[r][:p + 1, h]
                ref = dense_attention(q, k, v, 0.125)
                # logit error <= 0.125 |q| |k| 2^-11 sqrt(2); output error <= that x 2 max|v|
                # plus the values' own rounding
                dz = 0.125 * np.linalg.norm(q, axis=1).max() * np.linalg.norm(k, axis=1).max() \
                    * 2.0 ** -11 * 2
                bound = (2 * dz + 2.0 ** -10) * np.abs(v).max() * 1.5
                assert np.abs(got[t, 3 * h:3 * h + 3] - ref).max() <= bound
            t += 1


def test_a_request_reads_only_its_own_blocks():
    """Two requests, the same new tokens: changing the other request's pages (or the unused
    columns of the block table) changes nothing of the first one's output."""
    rng = np.random.default_rng(5)
    fmt = BlockFormat(4, 4, 32, 2)
    step = make_step(rng, fmt, [(19, 3), (40, 1)])
    ops = CpuPagedAttention(fmt)
    pool = random_pool(rng, step)
    plan = fill(step, ops, pool)
    a = ops.attend(pool, step.layer, step.query, plan, 0.2)
    pages = pool.reshape(step.num_blocks, -1)
    mine = set(step.block_table[0, :2].tolist())
    for b in range(step.num_blocks):
        if b not in mine:
            pages[b] = rng.integers(0, 256, pages.shape[1], dtype=np.uint8)
    b = ops.attend(pool, step.layer, step.query, plan, 0.2)
    assert np.array_equal(a[:3], b[:3])
    assert not np.array_equal(a[3], b[3])


def test_bad_input_raises_and_writes_nothing():
    rng = np.random.default_rng(7)
    fmt = BlockFormat(4, 4, 32, 2)
    step = make_step(rng, fmt, [(5, 2)])
    ops = CpuPagedAttention(fmt)
    pool = random_pool(rng, step)
    before = pool.copy()
    k = np.ones((2, 2, 32))
    bad = k.copy()
    bad[1, 1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        ops.write(pool, 0, bad, k, step.slot_mapping)
    with pytest.raises(ValueError, match="past the pool"):
        ops.write(pool, 0, k, k, np.array([0, step.num_blocks * 16]))
    with pytest.raises(ValueError, match="key must be"):
        ops.write(pool, 0, k[:, :1], k, step.slot_mapping)
    with pytest.raises(ValueError, match="pool must be"):
        ops.write(pool[:, :-1], 0, k, k, step.slot_mapping)
    assert np.array_equal(pool, before)
    with pytest.raises(ValueError, match="needs 2 blocks"):
        plan_step([0, 2], [20], np.zeros((1, 1), np.int32), 16)
    with pytest.raises(ValueError, match="new tokens but seq_len"):
        plan_step([0, 3], [2], np.zeros((1, 1), np.int32), 16)
    with pytest.raises(ValueError, match="negative block id"):
        plan_step([0, 1], [17], np.array([[-1, 0]]), 16)
    plan = plan_step([0, 2], [7], np.zeros((1, 1), np.int32), 16)
    with pytest.raises(ValueError, match="query must be"):
        ops.attend(pool, 0, np.ones((3, 4, 32)), plan, 0.1)


def test_block_format():
    fmt = BlockFormat(4, 4, 64, 3)
    assert fmt.state_bytes == 2 * (32 + 2) and fmt.page_bytes == 16 * 68
    assert fmt.block_bytes == 3 * 16 * 68 and fmt.layout.states_per_page == 16
    with pytest.raises(ValueError, match="multiple of 16"):
        BlockFormat(3, 3, 16, 1, block_size=5)
    with pytest.raises(ValueError, match="codebook"):
        BlockFormat(4, 4, 64, 1, codebook="nf4")


@pytest.mark.gpu
@pytest.mark.parametrize("tier", [(8, 4), (4, 4), (16, 16), (3, 3)])
@pytest.mark.parametrize("dim", KERNEL_DIMS)
@settings(max_examples=5)
@given(seed=st.integers(0, 2 ** 16))
def test_gpu_path_equals_cpu_path(tier, dim, seed):
    """encode_kv_into_pages writes the CPU path's bytes; ada_decode's attention equals the
    CPU path's within the kernel's fp16 budget (tests/test_cache_kernels.py): 2^-10 x
    (1 + 2 scale |q| max r_K) x max ‖v‖, twice that allowed, on a mixed prefill + decode batch."""
    import cupy as cp
    from cupy_kernels.engine import CudaPagedAttention, upload
    rng = np.random.default_rng(seed)
    fmt = BlockFormat(*tier, dim, 2)
    step = make_step(rng, fmt, MIXED, group=4, pad=2)
    cpu, gpu = CpuPagedAttention(fmt), CudaPagedAttention(fmt)
    pool = random_pool(rng, step)
    dev = cp.asarray(pool)
    plan = fill(step, cpu, pool)
    fill(step, gpu, dev, to=cp.asarray)
    assert np.array_equal(cp.asnumpy(dev), pool)
    scale = 1.0 / np.sqrt(dim)
    want = cpu.attend(pool, step.layer, step.query, plan, scale)
    got = cp.asnumpy(gpu.attend(dev, step.layer, cp.asarray(step.query), upload(plan, 2), scale))
    rk = max(np.linalg.norm(k, axis=2).max() for k in step.keys) * 1.01
    vmax = max(np.linalg.norm(v, axis=2).max() for v in step.values) * 1.01
    qn = np.linalg.norm(step.query, axis=2)
    budget = 2.0 * 2.0 ** -10 * (1 + 2 * scale * qn * rk) * vmax
    assert np.all(np.linalg.norm(got - want, axis=2) <= budget)
