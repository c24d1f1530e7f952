"""The kernels against the reference cache itself (cupy_kernels.from_cache): a
``SphericalKVCache`` filled by appends, with a protected span, compressed by RDR (mixed
tiers, and evictions in some rows), then decoded on the GPU from its own pool and page
tables; every sequence's output must equal ``cache.decode`` within the kernel's error budget
(tests/test_ada_decode.py: 2^-10 x (1 + 2 softmax_scale |q| max r_K) x max |v_hat - mu_V| per
query head, twice that allowed, an eighth on average). The host part (which signs, tables
and means the kernels get) is checked without a GPU."""
import numpy as np
import pytest

from spherical_kv_ref import SphericalKVCache
from spherical_kv_ref.rotation import KEY_SALT, VALUE_SALT

BOUND = 2.0 * 2.0 ** -10


def filled_cache(dim=128, codebook="uniform", centre=True, lengths=(300, 517), seed=0):
    """Two layers, 2 kv-heads, 8 query heads; each sequence appended in three chunks, tokens
    10-40 of the first protected, then every sequence compressed to 40 % of its bytes (60 % or
    80 % where its protected states need more: short sequences)."""
    rng = np.random.default_rng(seed)
    cache = SphericalKVCache(2, 2, dim, num_q_heads=8, pool_bytes=4096 * 600 * max(1, dim // 128),
                             seed=seed,
                             codebook=codebook, centre=centre)
    seqs = []
    for n in lengths:
        s = cache.new_sequence()
        cuts = [0, n // 3, n // 2, n]
        for a, b in zip(cuts[:-1], cuts[1:]):
            for layer in range(2):
                k = rng.standard_normal((2, b - a, dim)) * rng.uniform(0.5, 2.0, (2, b - a, 1)) + 0.3
                v = rng.standard_normal((2, b - a, dim)) - 0.2
                cache.append(s, layer, k, v)
        seqs.append(s)
    cache.protect(seqs[0], 10, 40)
    q = rng.standard_normal((len(seqs), 8, dim)) * 1.5
    for i, s in enumerate(seqs):
        for layer in range(2):
            cache.observe(s, layer, q[i])
        for frac in (0.4, 0.6, 0.8):
            try:
                cache.compress(s, int(frac * cache.bytes_in_use(s)))
                break
            except ValueError as e:
                assert "protected states" in str(e) and frac < 0.8, e
    return cache, seqs, q


def error_scale(cache, seq, layer, q, values=True):
    """Per query head: (1 + 2 softmax_scale |q| max r_K) max |v_hat - mu_V| over the row's
    kept states (the scale of the kernel's fp16 rounding error); without ``values`` the
    first factor alone (the logits' and the log-sum-exp's)."""
    from validation.decode_cases import stored_radii
    G = cache.group_size
    out = np.zeros(cache.num_q_heads)
    for h in range(cache.num_kv_heads):
        parts = [(ke, ve, cache.codec(layer, h, cache.ladder.bits(t)[0], KEY_SALT),
                  cache.codec(layer, h, cache.ladder.bits(t)[1], VALUE_SALT))
                 for t, (ke, ve, _) in cache.paged.gather((seq, layer, h)).items()]
        rk, vmax = stored_radii(parts)
        qn = np.linalg.norm(q[h * G:(h + 1) * G], axis=1)
        out[h * G:(h + 1) * G] = (1 + 2 * cache.softmax_scale * qn * rk) * (vmax if values else 1.0)
    return out


def test_kernel_inputs_are_the_cache_own():
    """The signs are the layer's codecs' at every tier (one rotation per (layer, head, part)),
    the page table and means are the cache's, the tables lay pages out as the pool does."""
    from cupy_kernels.from_cache import kernel_inputs
    cache, seqs, _ = filled_cache(dim=64, lengths=(300, 140))
    for layer in range(2):
        inp = kernel_inputs(cache, seqs, layer)
        for t in range(1, cache.ladder.top + 1):
            kb, vb = cache.ladder.bits(t)
            for h in range(2):
                assert np.array_equal(inp.sigma_k[h], cache.codec(layer, h, kb, KEY_SALT).signs)
                assert np.array_equal(inp.sigma_v[h], cache.codec(layer, h, vb, VALUE_SALT).signs)
            assert inp.tables.states_per_page(t) == cache.paged.pool.layout[t].states_per_page
        table = cache.page_table(seqs, layer)
        assert np.array_equal(inp.indptr, table.indptr) and np.array_equal(inp.indices, table.indices)
        assert np.array_equal(inp.mean_k, table.mean_k) and inp.mean_k.shape == (4, 64)
        assert inp.softmax_scale == cache.softmax_scale and inp.num_kv_heads == 2
    assert kernel_inputs(filled_cache(dim=64, centre=False, lengths=(50,))[0], 0, 1).mean_v is None
    small = SphericalKVCache(1, 1, 32)
    with pytest.raises(ValueError, match="head dim"):
        kernel_inputs(small, [], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dim,codebook,centre", [(128, "uniform", True), (128, "lloyd-max", False),
                                                 (64, "uniform", False), (64, "lloyd-max", True),
                                                 (256, "uniform", True), (256, "lloyd-max", False)])
def test_gpu_decode_equals_the_cache(dim, codebook, centre):
    import cupy as cp
    from cupy_kernels.from_cache import decode_cache, upload_pool
    cache, seqs, q = filled_cache(dim, codebook, centre)
    pool = upload_pool(cache)
    qd = cp.asarray(q.astype(np.float32))
    for layer in range(2):
        for splits in (None, 1, 3):
            got = decode_cache(cache, seqs, layer, qd, pool=pool, num_splits=splits).get()
            for i, s in enumerate(seqs):
                ref = cache.decode(s, layer, q[i].astype(np.float32), record=False)
                err = np.linalg.norm(got[i] - ref, axis=1) / error_scale(cache, s, layer, q[i])
                assert np.max(err) <= BOUND and np.mean(err) <= BOUND / 8, (layer, splits, i)
        # one sequence alone reads the same pages as it does next to the other
        one = decode_cache(cache, seqs[1], layer, qd[1:], pool=pool).get()
        ref = cache.decode(seqs[1], layer, q[1].astype(np.float32), record=False)
        err = np.linalg.norm(one[0] - ref, axis=1) / error_scale(cache, seqs[1], layer, q[1])
        assert np.max(err) <= BOUND
    with pytest.raises(ValueError, match="q has head dim|num_q_heads"):
        decode_cache(cache, seqs, 0, qd[:, :, : dim // 2], pool=pool)
