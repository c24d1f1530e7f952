"""kvpress's presses as baselines (spherical_kv_eval/baselines/peers.py), on a tiny random
Llama built here: each press keeps what its budget pays for, bytes are counted as the
project's evictors count them, and the project's StreamingLLM and SnapKV keep the same
states as kvpress's where both are configured alike."""
import numpy as np
import pytest

from spherical_kv_eval.baselines import SnapKV, StreamingLLM, attention_stats, bf16_round
from spherical_kv_eval.baselines import peers as P

needs_kvpress = pytest.mark.skipif(not P.kvpress_available(),
                                   reason="kvpress is not installed (the 'peers' extra)")
T = 97                    # not a multiple of anything; > SnapKV's 32-token window


@pytest.fixture(scope="module")
def prefill(tiny_llama):
    from spherical_kv_eval.model import capture_qkv
    model = tiny_llama()
    ids = np.random.default_rng(3).integers(0, 101, T)
    return model, ids, capture_qkv(model, ids)


@needs_kvpress
@pytest.mark.parametrize("press", list(P.PEER_LINEUP) + ["adakv-snapkv"])
@pytest.mark.parametrize("budget", [0.12, 0.3, 1.0])
def test_press_keeps_what_its_budget_pays_for(prefill, press, budget):
    model, ids, qkv = prefill
    m = P.KVPressMethod(press, budget)
    sel = m.select(model, ids)
    c = m.compress(qkv.keys, qkv.values, sel)
    H, _, d = qkv.keys[0].shape
    n = m.tokens_per_head(H, T, d)
    state = 2 * d * 2 + (0 if press == "streamingllm" else 4)
    meta = {"per-head": 0, "pattern": 8, "ragged": 4 * H}[m.spec.layout]
    layer_budget = int(np.floor(budget * H * T * 2 * d * 2))
    assert H * (n + 1) * state + meta > layer_budget or n == T     # one more would not fit
    for l, layer in enumerate(c.layers):
        counts = layer.keep.sum(axis=1)
        if n == T:
            assert layer.keep.all() and layer.nbytes == H * T * 2 * d * 2
            continue
        if m.spec.layout == "ragged":
            assert counts.sum() == H * n and counts.min() >= 1
        else:
            np.testing.assert_array_equal(counts, np.full(H, n))
        assert layer.nbytes == counts.sum() * state + meta <= layer_budget
        np.testing.assert_array_equal(layer.keys[layer.keep], bf16_round(qkv.keys[l])[layer.keep])
        np.testing.assert_array_equal(layer.values[~layer.keep], 0.0)
    assert c.fraction <= budget
    assert all(getattr(lay.self_attn, "masked_key_indices", None) is None
               for lay in model.model.layers)


@needs_kvpress
def test_streamingllm_keeps_the_same_states_as_kvpress(prefill):
    model, ids, qkv = prefill
    for budget in (0.1, 0.37):
        ours = StreamingLLM(budget).compress(qkv.keys, qkv.values)
        theirs = P.KVPressMethod("streamingllm", budget).select(model, ids)
        for a, b in zip(ours.layers, theirs.keep):
            np.testing.assert_array_equal(a.keep, b)


@needs_kvpress
def test_snapkv_without_pooling_keeps_the_same_states_as_kvpress(prefill):
    """Same window (32), no pooling (kernel 1): the same votes (mean vs sum over the window's
    queries, averaged over the GQA group) and so the same states, at budgets that keep more
    than the window (below it, kvpress's window states tie and top-k picks among them)."""
    model, ids, qkv = prefill
    stats = attention_stats(qkv.queries, qkv.keys, window=P.OBSERVE)
    for budget in (0.4, 0.6):
        assert P.KVPressMethod("snapkv", budget).tokens_per_head(2, T, 16) > P.OBSERVE
        ours = SnapKV(budget, kernel=1).compress(qkv.keys, qkv.values, stats)
        theirs = P.KVPressMethod("snapkv", budget, {"kernel_size": 1}).select(model, ids)
        for a, b in zip(ours.layers, theirs.keep):
            np.testing.assert_array_equal(a.keep, b)


@needs_kvpress
def test_snapkv_pooling_differs_by_design_but_keeps_the_window(prefill):
    """Ours max-pools the votes over 7 positions, kvpress average-pools over 5: the kept
    sets differ, but both keep the observation window and the same number of states."""
    model, ids, qkv = prefill
    stats = attention_stats(qkv.queries, qkv.keys, window=P.OBSERVE)
    ours = SnapKV(0.5).compress(qkv.keys, qkv.values, stats)
    theirs = P.KVPressMethod("snapkv", 0.5).select(model, ids)
    for a, b in zip(ours.layers, theirs.keep):
        assert a.keep[:, -P.OBSERVE:].all() and b[:, -P.OBSERVE:].all()
        np.testing.assert_array_equal(a.keep.sum(axis=1), b.sum(axis=1))


@needs_kvpress
def test_evaluation_lineup_runs_the_presses(prefill):
    from spherical_kv_eval import evaluate as E
    model, ids, qkv = prefill
    names = [m.name for m in E.lineup(model.config, [0.25])]
    assert [n for n in names if n.startswith("kvpress-")] == \
        [f"kvpress-{p}@25%" for p in P.PEER_LINEUP]
    assert not any(m.name.startswith("kvpress-")
               for m in E.lineup(model.config, [0.25], peers=False))
    (knorm,) = [m for m in E.lineup(model.config, [0.25]) if m.name == "kvpress-knorm@25%"]
    pre = E.Prefill(qkv.keys, qkv.values, [], None, None, T, ids=ids, model=model)
    store, nbytes = knorm.build(pre)
    assert nbytes == store.nbytes() <= 0.25 * pre.dense_bytes
    kept = P.KVPressMethod("knorm", 0.25).select(model, ids).keep
    assert [len(h.rows) for h in store.keys[0]] == list(kept[0].sum(axis=1))


@needs_kvpress
def test_kvpress_leaves_the_attention_functions_as_registered():
    """Importing kvpress wraps every attention function (for its own decode-time masking);
    the adapter undoes that, so a function registered before it (the project's
    spherical_kv attention) is called with its own signature."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def mine(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        return scaling
    AttentionInterface.register("peer-test", mine)
    from kvpress.attention_patch import patch_attention_functions
    patch_attention_functions()             # what importing kvpress after it does
    assert ALL_ATTENTION_FUNCTIONS["peer-test"] is not mine
    P._kvpress()
    assert ALL_ATTENTION_FUNCTIONS["peer-test"] is mine
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


def test_without_kvpress_the_peers_are_absent_with_a_reason(monkeypatch):
    from spherical_kv_eval import evaluate as E
    monkeypatch.setattr(P, "kvpress_available", lambda: False)
    with pytest.raises(P.PeersUnavailable, match="pip install"):
        P.peer_methods([0.25])
    with pytest.raises(P.PeersUnavailable, match="kvpress"):
        P.KVPressMethod("knorm", 0.25).make_press(0.5)

    class Cfg:
        num_attention_heads = 9
    assert not any(m.name.startswith("kvpress-") for m in E.lineup(Cfg, [0.25]))


def test_press_arguments_are_checked():
    with pytest.raises(ValueError, match="press"):
        P.KVPressMethod("h2o", 0.25)
    with pytest.raises(ValueError, match="budget"):
        P.KVPressMethod("knorm", 0.0)
    for n in (0, 1, 48, 96):
        r = P.KVPressMethod.compression_ratio(T, n)
        assert max(1, int(T * (1 - r))) == n or n == 0
    assert P.KVPressMethod.compression_ratio(T, T) == 0.0


def test_a_state_the_press_changed_is_refused():
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 2, 9, 4)).astype(np.float32)
    keep = P._kept_positions(k, v, k[:, [7, 1]], v[:, [7, 1]])
    np.testing.assert_array_equal(np.flatnonzero(keep[0]), [1, 7])
    edited = k[:, [7, 1]].copy()
    edited[1, 0, 0] += 1e-3
    with pytest.raises(RuntimeError, match="changed"):
        P._kept_positions(k, v, edited, v[:, [7, 1]])


# ----------------------------------------------------------------------------- QuantizedCache

needs_hqq = pytest.mark.skipif(not P.quantized_cache_available(),
                               reason="hqq is not installed (the 'peers' extra)")


def _kv(H=3, n=128, d=64, layers=2, seed=0):
    rng = np.random.default_rng(seed)
    return ([rng.standard_normal((H, n, d)).astype(np.float32) for _ in range(layers)],
            [rng.standard_normal((H, n, d)).astype(np.float32) for _ in range(layers)])


@needs_hqq
def test_quantized_cache_holds_what_transformers_own_cache_returns():
    """Each layer's states are what transformers' QuantizedCache (public API, HQQ, axis 1)
    hands the attention on the step after the prefill, and the bytes are its tensors'."""
    import torch
    from transformers import LlamaConfig, QuantizedCache
    keys, values = _kv()
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
                      hidden_size=192)
    for bits in (4, 2):
        got = P.QuantizedCacheMethod(bits).compress(keys, values)
        cache = QuantizedCache("hqq", cfg, nbits=bits, axis_key=1, axis_value=1)
        for l, (k, v) in enumerate(zip(keys, values)):
            bk = torch.as_tensor(k)[None].bfloat16()
            bv = torch.as_tensor(v)[None].bfloat16()
            cache.update(bk, bv, l)                                   # the prefill
            k_seen, v_seen = cache.update(bk[:, :, :1], bv[:, :, :1], l)   # the next token
            np.testing.assert_array_equal(got.layers[l].keys, k_seen[0, :, :-1].float().numpy())
            np.testing.assert_array_equal(got.layers[l].values, v_seen[0, :, :-1].float().numpy())
            assert got.layers[l].keep.all()
        # packed codes + a bf16 scale and zero point per 64 elements, against bf16's 2 bytes
        assert got.fraction == pytest.approx((bits / 8 + 4 / 64) / 2)


@needs_hqq
def test_quantized_cache_error_falls_with_its_bits_and_its_inputs_are_checked():
    keys, values = _kv(seed=1)
    err = {b: np.sqrt(np.mean((P.QuantizedCacheMethod(b).compress(keys, values).layers[0].keys
                               - keys[0]) ** 2)) for b in (2, 4, 8)}
    assert err[8] < err[4] / 4 < err[2] / 8 and err[4] < 0.15
    with pytest.raises(ValueError, match="NaN"):
        P.QuantizedCacheMethod(4).compress([np.full((3, 128, 64), np.nan, np.float32)] * 2,
                                           values)
    with pytest.raises(ValueError, match="groups of 64"):
        P.QuantizedCacheMethod(4).compress([k[:, :5, :7] for k in keys],
                                           [v[:, :5, :7] for v in values])
    for kw in ({"nbits": 5}, {"axis": 2}, {"backend": "quanto"}):
        with pytest.raises(ValueError):
            P.QuantizedCacheMethod(**kw)


@needs_hqq
def test_evaluation_lineup_runs_the_quantized_cache(prefill):
    from spherical_kv_eval import evaluate as E
    model, ids, qkv = prefill
    lineup = {m.name: m for m in E.lineup(model.config, [0.25]) if m.name.startswith("hf-")}
    assert list(lineup) == ["hf-hqq4", "hf-hqq2"]
    assert not any(m.name.startswith("hf-") for m in E.lineup(model.config, [0.25], peers=False))
    keys, values = _kv(H=model.config.num_key_value_heads, n=64)   # d = 64: whole groups
    pre = E.Prefill(keys, values, [], None, None, 64, ids=ids[:64], model=model)
    store, nbytes = lineup["hf-hqq4"].build(pre)
    assert nbytes == store.nbytes() == P.QuantizedCacheMethod(4).compress(keys, values).nbytes
    assert nbytes / pre.dense_bytes == pytest.approx(0.28125)


def test_without_hqq_the_quantized_cache_is_absent_with_a_reason(monkeypatch):
    from spherical_kv_eval import evaluate as E
    monkeypatch.setattr(P, "quantized_cache_available", lambda backend="hqq": False)
    with pytest.raises(P.PeersUnavailable, match="pip install"):
        P.quantized_cache_methods()

    class Cfg:
        num_attention_heads = 9
    assert not any(m.name.startswith("hf-") for m in E.lineup(Cfg, [0.25]))


def test_eager_press_prefills_on_a_gpu_take_turns_across_processes(tmp_path, monkeypatch):
    """An eager-attention press's prefill on a GPU waits for another process's to end; on
    the CPU, or with another attention, nothing waits."""
    import subprocess
    import sys
    import tempfile
    import time
    import torch
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    lock = tmp_path / "spherical_kv_eager_prefill.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(lock)!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(1.5)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with P._one_eager_prefill(torch.device("cpu"), "eager"), \
                P._one_eager_prefill(torch.device("cuda"), "sdpa"):
            pass
        assert time.monotonic() - t0 < 0.5           # neither takes the lock
        with P._one_eager_prefill(torch.device("cuda"), "eager"):
            waited = time.monotonic() - t0
        assert waited > 1.0                          # until the holder let go
    finally:
        holder.kill()
