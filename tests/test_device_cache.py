"""The device cache (cupy_kernels.device_cache) against its reference, SphericalKVCache: the
same stored states, attention within the kernel's fp16 budget, the same RDR decision; the
captured decode step equal to the eager one, under torch.cuda.graph and torch.compile;
errors that leave the cache unchanged."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from cupy_kernels.device_cache import DeviceKVCache, PoolExhaustedError  # noqa: E402
from spherical_kv_ref import SphericalKVCache  # noqa: E402
from spherical_kv_ref.cache import CompressPolicy  # noqa: E402
from spherical_kv_ref.paged import stored_rotated  # noqa: E402
from spherical_kv_ref.rotation import KEY_SALT, VALUE_SALT  # noqa: E402

L, H, G = 2, 2, 3
POLICY = CompressPolicy(sinks=2, recent=8, window=4)


def _pair(d, **kw):
    args = dict(num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20)
    args.update(kw)
    return SphericalKVCache(L, H, d, **args), DeviceKVCache(L, H, d, **args)


def _data(rng, t, d):
    # float32 values: the kernels encode float32 rows, the reference whatever it is given
    k = (rng.standard_normal((H, t, d)) * 2 + 0.5).astype(np.float32).astype(np.float64)
    v = rng.standard_normal((H, t, d)).astype(np.float32).astype(np.float64)
    return k, v


def _fill(ref, dev, lengths, d, rng):
    seqs = []
    for t in lengths:
        a, b = ref.new_sequence(), dev.new_sequence()
        assert a == b
        for layer in range(L):
            k, v = _data(rng, t, d)
            ref.append(a, layer, k, v)
            dev.append(b, layer, torch.tensor(k, device="cuda"), torch.tensor(v, device="cuda"))
            q = rng.standard_normal((POLICY.window, H * G, d))
            for qq in q:
                ref.observe(a, layer, qq)
            dev.observe(b, layer, torch.tensor(q, device="cuda"))
        seqs.append(a)
    return seqs


def _close(got, want, rel=4e-3):
    got = got.detach().cpu().double().numpy() if hasattr(got, "detach") else got
    scale = np.abs(want).max() + 1e-9
    assert np.max(np.abs(got - want)) <= rel * scale, np.max(np.abs(got - want)) / scale


def _stored_equal(ref, dev, seq, layer, h):
    """The device's stored vectors (decoded on the device) equal the reference's exactly."""
    row = dev._seq(seq).rows[layer][h]
    page, slot, tier = row.state_slots()
    ref_by_tier = ref.paged.gather((seq, layer, h))
    for t, (ke, ve, pos) in ref_by_tier.items():
        kb, vb = ref.ladder.bits(t)
        sel = tier == t
        yk, yv = dev.stored_rotated(page[sel], slot[sel], t)
        order = np.argsort(row.positions()[sel])
        want_k = stored_rotated(ref.codec(layer, h, kb, KEY_SALT), ke)[np.argsort(pos)]
        want_v = stored_rotated(ref.codec(layer, h, vb, VALUE_SALT), ve)[np.argsort(pos)]
        np.testing.assert_array_equal(yk.cpu().numpy()[order], want_k)
        np.testing.assert_array_equal(yv.cpu().numpy()[order], want_v)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_append_and_decode_equal_the_reference(d):
    rng = np.random.default_rng(d)
    ref, dev = _pair(d)
    seqs = _fill(ref, dev, [17, 97], d, rng)
    for s in seqs:
        for h in range(H):
            _stored_equal(ref, dev, s, 1, h)
    q = rng.standard_normal((2, H * G, d))
    for layer in range(L):
        out, lse = dev.decode(seqs, layer, torch.tensor(q, device="cuda"), lse=True)
        for i, s in enumerate(seqs):
            _close(out[i], ref.decode(s, layer, q[i], record=False))
    assert dev.bytes_in_use(seqs[0]) == ref.bytes_in_use(seqs[0])
    assert dev.num_states(seqs[1]) == ref.num_states(seqs[1]) == 2 * 2 * 97


def test_compress_takes_the_reference_decision():
    rng = np.random.default_rng(5)
    ref, dev = _pair(64)
    seqs = _fill(ref, dev, [150, 61], 64, rng)
    for s in seqs:
        budget = ref.bytes_in_use(s) * 2 // 5
        a = ref.compress(s, budget)
        b = dev.compress(s, budget)
        np.testing.assert_array_equal(a.allocation.tier, b.allocation.tier)
        assert (a.bytes_after, a.states_kept, a.states_demoted) == (b.bytes_after, b.states_kept, b.states_demoted)
        assert b.bytes_after <= budget
        for h in range(H):
            _stored_equal(ref, dev, s, 0, h)
    q = rng.standard_normal((2, H * G, 64))
    for layer in range(L):
        out = dev.decode(seqs, layer, torch.tensor(q, device="cuda"))
        for i, s in enumerate(seqs):
            _close(out[i], ref.decode(s, layer, q[i], record=False))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_stored_states_kernel_equals_the_per_tier_decode(d):
    """After a compress (rows of mixed tiers), the statistics' one-kernel read of every
    state (rdr_device.stored_states) equals stored_rotated tier by tier, bit for bit, and a
    second compress over those mixed tiers still takes the reference's decision."""
    rng = np.random.default_rng(d + 1)
    ref, dev = _pair(d)
    seqs = _fill(ref, dev, [300], d, rng)
    budget = ref.bytes_in_use(seqs[0]) // 4
    ref.compress(seqs[0], budget)
    dev.compress(seqs[0], budget)
    tiers_seen = set()
    on = lambda x: torch.as_tensor(x.astype(np.int64), device="cuda")
    for layer in range(L):
        for h in range(H):
            page, slot, tier = dev._seq(seqs[0]).rows[layer][h].state_slots()
            yk, yv = dev._stored_rows(on(page), on(slot), on(tier))
            for t in np.unique(tier):
                tiers_seen.add(int(t))
                sel = tier == t
                wk, wv = dev.stored_rotated(page[sel], slot[sel], int(t))
                torch.testing.assert_close(yk[torch.as_tensor(sel, device="cuda")], wk, rtol=0, atol=0)
                torch.testing.assert_close(yv[torch.as_tensor(sel, device="cuda")], wv, rtol=0, atol=0)
    assert len(tiers_seen) >= 2, tiers_seen
    a = ref.compress(seqs[0], budget * 4 // 5)
    b = dev.compress(seqs[0], budget * 4 // 5)
    np.testing.assert_array_equal(a.allocation.tier, b.allocation.tier)


def test_device_solver_fits_the_budget_and_bounds_the_host_decision():
    """method="device": statistics, surrogate and LP-greedy on the GPU. The pages fit the
    budget, nothing is promoted, protected states stay, and its bound is below the host fast
    solver's objective (its own objective is the LP cut's: on rows this short the page
    padding it cannot trade makes it worse than the host's; docs/rdr.md)."""
    rng = np.random.default_rng(9)
    ref, dev = _pair(64)
    seqs = _fill(ref, dev, [400, 150], 64, rng)
    for s in seqs:
        budget = ref.bytes_in_use(s) * 3 // 10
        host = ref.compress(s, budget)
        before = [dev._seq(s).rows[l][h].positions() for l in range(L) for h in range(H)]
        got = dev.compress(s, budget, method="device")
        assert got.bytes_after <= budget and got.allocation.method == "device"
        assert got.allocation.lower_bound <= host.allocation.objective * (1 + 1e-9)
        assert got.allocation.objective >= host.allocation.lower_bound * (1 - 1e-9)
        for l in range(L):
            for h in range(H):
                pos = dev._seq(s).rows[l][h].positions()
                keep = dev.protected_mask(s, l, before[l * H + h])
                assert set(before[l * H + h][keep]) <= set(pos)
        q = rng.standard_normal((1, H * G, 64))
        out = dev.decode([s], 0, torch.tensor(q, device="cuda"))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("method", ["device", "fast"])
def test_compress_all_is_compress_of_each(method):
    """Two sequences compressed in one call (one device solve for both) hold what two calls
    leave, on twin caches: the same reports, page tiers and stored states; a budget that
    cannot hold one sequence's protected states changes neither."""
    caches = [DeviceKVCache(L, H, 64, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20)
              for _ in range(2)]
    for c in caches:
        _fill(SphericalKVCache(L, H, 64, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20), c,
              [400, 150], 64, np.random.default_rng(9))
    pages = caches[0].pages.clone()
    with pytest.raises(ValueError, match="protected states"):
        caches[0].compress_all([0, 1], None, method, budget_fraction=0.001)
    assert torch.equal(caches[0].pages, pages) and caches[0].num_states(0) == 400 * L * H
    both = caches[0].compress_all([0, 1], method=method, budget_fraction=0.3)
    each = [caches[1].compress(s, method=method, budget_fraction=0.3) for s in (0, 1)]
    for a, b in zip(both, each):
        assert (a.bytes_before, a.bytes_after, a.states_kept, a.states_demoted) == \
               (b.bytes_before, b.bytes_after, b.states_kept, b.states_demoted)
        assert np.array_equal(a.allocation.tier, b.allocation.tier)
    for s in (0, 1):
        for layer in range(L):
            for h in range(H):
                rows = [c._seq(s).rows[layer][h] for c in caches]
                assert np.array_equal(rows[0].positions(), rows[1].positions())
                assert np.array_equal(rows[0].tiers, rows[1].tiers)
                assert np.array_equal(rows[0].counts, rows[1].counts)
                slots = [r.state_slots() for r in rows]
                for t in np.unique(slots[0][2]):
                    got = [c.stored_rotated(sl[0][sl[2] == t], sl[1][sl[2] == t], int(t))
                           for c, sl in zip(caches, slots)]
                    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="twice"):
        caches[0].compress_all([0, 0], method=method, budget_fraction=0.3)


def _step_tokens(rng, steps, B, d):
    f32 = lambda x: x.astype(np.float32).astype(np.float64)
    return [(f32(rng.standard_normal((B, H * G, d))), f32(rng.standard_normal((L, B, H, d)) + 0.5),
             f32(rng.standard_normal((L, B, H, d)))) for _ in range(steps)]


def test_decode_steps_equal_the_reference():
    """append-then-decode per token through a DecodeStep (the engine's order) equals the
    reference appending the token and decoding; then the bookkeeping equals it too."""
    rng = np.random.default_rng(7)
    ref, dev = _pair(64)
    seqs = _fill(ref, dev, [40, 13], 64, rng)
    ref.compress(seqs[0], ref.bytes_in_use(seqs[0]) // 2)
    dev.compress(seqs[0], dev.bytes_in_use(seqs[0]) // 2)
    steps = 70                         # past a page boundary of the top tier
    step = dev.decode_step(seqs, steps)
    for i, (q, k, v) in enumerate(_step_tokens(rng, steps, 2, 64)):
        step.set_step(i)
        step.slots()
        for layer in range(L):
            step.append(layer, torch.tensor(k[layer], device="cuda"), torch.tensor(v[layer], device="cuda"))
            out = step.decode(layer, torch.tensor(q, device="cuda"))
            for b, s in enumerate(seqs):
                ref.append(s, layer, k[layer, b][:, None], v[layer, b][:, None])
                if i % 23 == 0 or i == steps - 1:
                    _close(out[b], ref.decode(s, layer, q[b], record=False))
    step.close()
    for s in seqs:
        assert dev.num_states(s) == ref.num_states(s)
        assert dev.bytes_in_use(s) == ref.bytes_in_use(s) or dev.bytes_in_use(s) <= ref.bytes_in_use(s) + 2 * L * H * 4096
        for h in range(H):
            _stored_equal(ref, dev, s, 1, h)
    assert dev.bytes_in_use() == sum(dev.bytes_in_use(s) for s in seqs)


def _captured(mode):
    """One model-like decode step over a DecodeStep: per layer a projection, attend (context
    from codes + own token exactly, then append), replayed as a graph or compiled."""
    rng = np.random.default_rng(11)
    ref, dev = _pair(128)
    twin = DeviceKVCache(L, H, 128, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20)
    seqs = _fill(ref, dev, [300, 77], 128, np.random.default_rng(3))
    _fill(SphericalKVCache(L, H, 128, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20), twin,
          [300, 77], 128, np.random.default_rng(3))
    w = torch.tensor(rng.standard_normal((128, 128)) / 12, device="cuda", dtype=torch.float32)
    steps = 40
    a, b = dev.decode_step(seqs, steps), twin.decode_step(seqs, steps)
    q_in = torch.zeros((2, H * G, 128), device="cuda")
    kv_in = torch.zeros((L, 2, 2, H, 128), device="cuda")

    def body(step):
        x = q_in
        for layer in range(L):
            o = step.attend(layer, x @ w, kv_in[layer, 0], kv_in[layer, 1])
            x = torch.tanh(o)
        return x
    tokens = _step_tokens(rng, steps, 2, 128)
    a.set_step(0)
    a.slots()
    body(a)                            # warm-up: kernels loaded, tables on the device
    torch.cuda.synchronize()
    if mode == "graph":
        a.set_step(0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            a.slots()
            out_a = body(a)
        run = graph.replay
    else:
        from torch._dynamo.utils import counters
        torch._dynamo.reset()
        counters.clear()
        for t in a.static_tensors() + [q_in, kv_in, w]:
            torch._dynamo.mark_static_address(t)
        fn = torch.compile(lambda: (a.slots(), body(a))[1], mode="reduce-overhead", fullgraph=True)
        run = None
    got, want = [], []
    for i, (q, k, v) in enumerate(tokens):
        q_in.copy_(torch.tensor(q, device="cuda"))
        kv_in[:, 0].copy_(torch.tensor(k, device="cuda"))
        kv_in[:, 1].copy_(torch.tensor(v, device="cuda"))
        a.set_step(i)
        if run is not None:
            run()
            got.append(out_a.clone())
        else:
            got.append(fn().clone())
        b.set_step(i)
        b.slots()
        want.append(body(b).clone())
    torch.cuda.synchronize()
    a.close()
    b.close()
    # the same kernels on the same inputs under a graph; inductor's own kernels for tanh and
    # the merge round differently in the last bits
    tol = 0 if mode == "graph" else 1e-4
    bad = [i for i, (g, w_) in enumerate(zip(got, want))
           if not torch.allclose(g, w_, rtol=tol, atol=tol)]
    assert not bad, (f"steps {bad[:8]} of {steps} differ; largest difference "
                     f"{max(float((got[i] - want[i]).abs().max()) for i in bad):.3g}")
    if mode == "compile":
        from torch._dynamo.utils import counters
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    return dev, twin, seqs


def test_a_step_run_twice_reads_what_it_read_once():
    """Re-running a step (a warm-up, a replay) gives what one run gives: its own token is
    out of its context at the start of each run."""
    rng = np.random.default_rng(12)
    caches = [DeviceKVCache(L, H, 128, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20) for _ in range(2)]
    for c in caches:
        _fill(SphericalKVCache(L, H, 128, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20), c,
              [33, 90], 128, np.random.default_rng(3))
    q, k, v = (torch.tensor(x, device="cuda", dtype=torch.float32) for x in _step_tokens(rng, 1, 2, 128)[0])
    outs = []
    for runs, c in zip((2, 1), caches):
        step = c.decode_step([0, 1], 3)
        for _ in range(runs):
            step.set_step(0)
            step.slots()
            res = [step.attend(layer, q, k[layer], v[layer]).clone() for layer in range(L)]
        outs.append(res)
        step.close()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(caches[0].page_count, caches[1].page_count)


def test_graph_capture_replays_the_eager_step():
    dev, twin, seqs = _captured("graph")
    assert dev.bytes_in_use() == twin.bytes_in_use()
    assert torch.equal(dev.pages, twin.pages)


def test_torch_compile_reduce_overhead_replays_the_eager_step():
    _captured("compile")


def test_a_captured_step_allocates_nothing_through_cupy():
    """Memory CuPy's pool hands out while a graph is captured goes back to the pool when the
    capture ends, and a replay would write into whatever holds it next: the ops allocate
    nothing of their own."""
    c = DeviceKVCache(L, H, 128, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20)
    _fill(SphericalKVCache(L, H, 128, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20), c,
          [300, 77], 128, np.random.default_rng(3))
    step = c.decode_step([0, 1], 2)
    q, k, v = (torch.tensor(x, device="cuda", dtype=torch.float32)
               for x in _step_tokens(np.random.default_rng(4), 1, 2, 128)[0])
    step.set_step(0)

    def run():
        step.slots()
        return [step.attend(layer, q, k[layer], v[layer]) for layer in range(L)]
    run()                                 # warm-up: kernels loaded, tables on the device
    torch.cuda.synchronize()
    pool, asked = cp.get_default_memory_pool(), []

    def counting(n):
        asked.append(n)
        return pool.malloc(n)
    graph = torch.cuda.CUDAGraph()
    cp.cuda.set_allocator(counting)
    try:
        with torch.cuda.graph(graph):
            run()
    finally:
        cp.cuda.set_allocator(pool.malloc)
    step.close(0)
    assert asked == [], f"CuPy allocations during capture: {asked}"


def test_errors_leave_the_cache_unchanged():
    rng = np.random.default_rng(2)
    dev = DeviceKVCache(L, H, 64, num_q_heads=H * G, policy=POLICY, pool_bytes=64 * 4096)
    s = dev.new_sequence()
    k, v = (torch.tensor(x, device="cuda") for x in _data(rng, 20, 64))
    dev.append(s, 0, k, v)
    free, pages = dev.num_free_pages, dev.pages.clone()
    bad = k.clone()
    bad[1, 3, 5] = float("nan")
    for call, match in ((lambda: dev.append(s, 0, bad, v), "NaN"),
                        (lambda: dev.append(s, 0, k[:, :, :32], v[:, :, :32]), "shape"),
                        (lambda: dev.append(s, 2, k, v), "layer"),
                        (lambda: dev.append(7, 0, k, v), "unknown sequence"),
                        (lambda: dev.append(s, 0, k.cpu(), v), "cache is on"),
                        (lambda: dev.decode([s], 0, torch.zeros((1, 5, 64), device="cuda")), "shape"),
                        (lambda: dev.compress(s, 1), "protected states"),
                        (lambda: dev.decode_step([s], 0), "steps")):
        with pytest.raises(ValueError, match=match):
            call()
        assert dev.num_free_pages == free and torch.equal(dev.pages, pages)
    big = torch.randn((H, 64 * 40, 64), device="cuda")
    with pytest.raises(PoolExhaustedError):
        dev.append(s, 1, big, big)
    assert dev.num_free_pages == free and dev.num_states(s) == 2 * 20
    with pytest.raises(ValueError, match="different lengths"):
        dev.decode_step([s], 4)
    dev.append(s, 1, k, v)
    step = dev.decode_step([s], 4)
    with pytest.raises(ValueError, match="open DecodeStep"):
        dev.append(s, 0, k, v)
    step.close(0)
    assert dev.num_free_pages == free - 4
    dev.free(s)
    assert dev.num_free_pages == 64
    with pytest.raises(ValueError, match="freed"):
        dev.decode([s], 0, torch.zeros((1, H * G, 64), device="cuda"))


# ------------------------------------------------------------------ transformers on the GPU

def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


def _batch(lengths, pad=0):
    g = torch.Generator().manual_seed(4)
    n = max(lengths)
    ids = torch.full((len(lengths), n), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), n), dtype=torch.long)
    prompts = []
    for b, t in enumerate(lengths):
        p = torch.randint(1, 101, (t,), generator=g)
        ids[b, n - t:], mask[b, n - t:] = p, 1
        prompts.append(p)
    return ids, mask, prompts


def generate_against_the_reference(monkeypatch, cpu, gpu, ids, mask, prompts, make_device_cache,
                                   make_reference, budget_of, steps: int, pad: int = 0):
    """Greedy generation of a left-padded batch through a device cache that compresses after
    prefill, against the CPU reference cache run one prompt at a time on the same tokens.

    The GPU model's keys and values differ from the CPU model's by float32 rounding (~1e-7),
    which moves RDR's statistics by as much and can flip a near-tied choice, an eviction
    included, and one evicted state can move a small model's logits by ~10 % (seen on the
    H200). So the GPU's own decision is checked on its own (its objective is the
    reference's within 2 %, on its own statistics), and the logits
    are compared under one decision: a second generation hands the device cache the
    reference's plan for each sequence. Returns, per sequence, the largest error of a step's
    logits relative to the reference's largest |logit|."""
    import cupy_kernels.device_cache as device_cache
    from spherical_kv_ref import cache as ref_cache
    from spherical_kv_ref.hf import use_spherical_attention
    use_spherical_attention(cpu)
    refs, plans, first = [], [], []
    real_plan = ref_cache.plan_compress
    monkeypatch.setattr(ref_cache, "plan_compress", lambda *a: plans.append(real_plan(*a)) or plans[-1])
    for p in prompts:
        refs.append(make_reference())
        with torch.no_grad():
            first.append(cpu(p[None], past_key_values=refs[-1]).logits[0, -1])
            refs[-1].compress(budget_of(p))
    monkeypatch.undo()
    assert len(plans) == len(prompts)

    def generate(handed):
        if handed:
            given = iter(plans)
            monkeypatch.setattr(device_cache, "plan_compress", lambda *a: next(given))
        cache = make_device_cache()
        with cache.bound(gpu), torch.no_grad():
            out = gpu.generate(ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache,
                               max_new_tokens=steps, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=pad)
        monkeypatch.undo()
        assert len(cache.reports) == len(prompts)
        assert all(r.bytes_after < r.bytes_before for r in cache.reports)
        return cache, out
    own, _ = generate(False)
    for plan, report in zip(plans, own.reports):
        # near-ties abound under a tight budget: the tiers themselves may differ widely
        # (49 % agreed for SmolLM2 on the H200), the objective they reach may not
        ours, theirs = report.allocation.objective, plan.allocation.objective
        assert abs(ours - theirs) <= 0.02 * theirs, (ours, theirs)
    cache, out = generate(True)
    new = out.sequences[:, ids.shape[1]:].cpu()
    errs = []
    for b, ref in enumerate(refs):
        assert np.array_equal(cache.reports[b].allocation.tier, plans[b].allocation.tier)
        logits = [first[b]]
        with torch.no_grad():
            for tok in new[b, :-1]:
                logits.append(cpu(tok.view(1, 1), past_key_values=ref).logits[0, -1])
        want = torch.stack(logits).numpy()
        got = torch.stack([lg[b] for lg in out.logits]).float().cpu().numpy()
        errs.append(np.max(np.abs(got - want), axis=1) / np.abs(want).max())
    return errs


def test_generate_left_padded_batch_equals_the_cpu_reference(monkeypatch):
    """Batch 2, prompts of 70 and 45 tokens (left padded), compressed to 50 % of their bf16
    bytes, 12 greedy steps: every step's logits equal the CPU reference cache's (the same
    prefill, compress and tokens, one sequence at a time) within the kernels' fp16 budget."""
    import copy
    from cupy_kernels.hf_device import DeviceSphericalCache
    from spherical_kv_ref.hf import SphericalCache
    cpu = _tiny_llama()
    gpu = copy.deepcopy(cpu).cuda()
    ids, mask, prompts = _batch([70, 45])
    errs = generate_against_the_reference(
        monkeypatch, cpu, gpu, ids, mask, prompts,
        lambda: DeviceSphericalCache(gpu.config, budget_fraction=0.5, policy=POLICY, observe=8),
        lambda: SphericalCache(cpu.config, observe=8, policy=POLICY),
        lambda p: int(0.5 * 2 * 2 * 64 * 2 * 2 * len(p)), 12)      # 50 % of bf16
    for b, err in enumerate(errs):
        assert np.max(err) <= 2e-2, (b, err)


def test_generate_left_padded_batch_at_one_tier_equals_the_cpu_reference():
    """The same as above with no decision to make: one tier (4/4), nothing evicted, so the
    GPU path and the CPU reference read the same codes (up to a rare cell flip from the two
    models' float32 rounding): prefill, left padding, positions and the lse merge."""
    import copy
    from cupy_kernels.hf_device import DeviceSphericalCache
    from spherical_kv_ref.hf import SphericalCache, use_spherical_attention
    from spherical_kv_ref.tiers import TierLadder
    cpu = _tiny_llama()
    gpu = copy.deepcopy(cpu).cuda()
    ids, mask, prompts = _batch([70, 45])
    one = TierLadder([(4, 4)])
    cache = DeviceSphericalCache(gpu.config, ladder=one, observe=8)
    with cache.bound(gpu), torch.no_grad():
        out = gpu.generate(ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache,
                           max_new_tokens=12, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0)
    new = out.sequences[:, ids.shape[1]:].cpu()
    use_spherical_attention(cpu)
    for b, p in enumerate(prompts):
        ref = SphericalCache(cpu.config, observe=8, ladder=one)
        with torch.no_grad():
            logits = [cpu(p[None], past_key_values=ref).logits[0, -1]]
            ref.compress(10 ** 9)                 # a store of every state at the one tier
            for tok in new[b, :-1]:
                logits.append(cpu(tok.view(1, 1), past_key_values=ref).logits[0, -1])
        want = torch.stack(logits).numpy()
        got = torch.stack([lg[b] for lg in out.logits]).float().cpu().numpy()
        err = np.max(np.abs(got - want), axis=1) / np.abs(want).max()
        assert np.max(err) <= 1e-2, (b, err)


def test_generate_at_16_bits_equals_dense_generate():
    from cupy_kernels.hf_device import DeviceSphericalCache
    from spherical_kv_ref.tiers import TierLadder
    gpu = _tiny_llama().cuda()
    ids, mask, _ = _batch([50, 23, 41])
    with torch.no_grad():
        dense = gpu.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=20,
                             do_sample=False, pad_token_id=0)
        cache = DeviceSphericalCache(gpu.config, ladder=TierLadder([(16, 16)]), reserve=7)
        with cache.bound(gpu):
            ours = gpu.generate(ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache,
                                max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(dense, ours)
    assert gpu.config._attn_implementation != "spherical_kv_device"
    from cupy_kernels.hf_device import device_spherical_kv
    with torch.no_grad(), device_spherical_kv(gpu, budget_fraction=None, ladder=TierLadder([(16, 16)])) as caches:
        again = gpu.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=20,
                             do_sample=False, pad_token_id=0)
    assert len(caches) == 1 and torch.equal(dense, again)
    assert "generate" not in gpu.__dict__


@pytest.mark.parametrize("part", ["slots", "decode", "append", "decode_lse"])
def test_each_op_replays_as_it_runs(part):
    """One piece of the step at a time under torch.cuda.graph against the same piece run
    eagerly on a twin cache: the gathers of ``slots``, the decode op (with and without the
    log-sum-exp merge), the append op (pool bytes and counts)."""
    caches, steps = [], []
    for _ in range(2):
        c = DeviceKVCache(L, H, 128, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20)
        _fill(SphericalKVCache(L, H, 128, num_q_heads=H * G, policy=POLICY, pool_bytes=4 << 20), c,
              [300, 77], 128, np.random.default_rng(3))
        caches.append(c)
        steps.append(c.decode_step([0, 1], 4))
    rng = np.random.default_rng(5)
    q = torch.tensor(rng.standard_normal((2, H * G, 128)), device="cuda", dtype=torch.float32)
    kv = torch.tensor(rng.standard_normal((2, 2, H, 128)), device="cuda", dtype=torch.float32)

    def piece(step):
        if part == "slots":
            step.slots()
            return step.dst_page.clone()
        if part == "append":
            step.append(0, kv[0], kv[1])
            return step.cache.page_count.clone()
        out = step.decode(1, q, with_lse=part == "decode_lse")
        return torch.cat([out.reshape(-1), step.lse.reshape(-1)]) if part == "decode_lse" else out.clone()
    a, b = steps
    for s in steps:
        s.set_step(2)
        s.slots()
    piece(a)                              # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = piece(a)
    a.set_step(2)
    graph.replay()
    torch.cuda.synchronize()
    want = piece(b)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if part == "append":
        assert torch.equal(caches[0].pages, caches[1].pages)
    for s in steps:
        s.close(0)
