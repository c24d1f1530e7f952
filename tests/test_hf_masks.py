"""transformers integration against the model's own attention, on a plain Llama and on a
sliding-window hybrid (a tiny Gemma-3 with an 8-token window): the registered attention
keeps transformers' masks (causal from an offset, sliding windows), a dense chunk after a
prefill equals the model's logits, the store path leaves the window layers their window,
and generate() runs the documented way."""
import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spherical_kv_ref.hf import (DenseStore, SphericalCache, layer_kinds,  # noqa: E402
                                 use_spherical_attention)

WINDOW = 8
N = 61            # tokens of the test sequence: several windows
PREFILL = 40
DENSE_TOL = 1e-5  # float32 forward passes of the same function in another order
# the top tier keeps keys and values in fp16 (relative rounding 2^-11), so logits of this
# O(1)-logit model move by ~1e-4; 2e-3 leaves 10x room and is far below any mask error (> 0.1)
TOP_TIER_TOL = 2e-3


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg)


def _gemma():
    # window layers first and between the full ones, so layer and store indices differ;
    # one kv head, head_dim 32, and Gemma's own softmax scale (query_pre_attn_scalar)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        query_pre_attn_scalar=64, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    return transformers.Gemma3ForCausalLM(cfg)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    """(model with spherical_kv attention, ids, the logits sdpa gives for ids)."""
    torch.manual_seed(0)
    m = {"llama": _llama, "gemma3": _gemma}[request.param]().eval()
    m.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 101, (1, N), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits.double()
    use_spherical_attention(m)
    return m, ids, ref


def _run(m, ids, cache):
    with torch.no_grad():
        return m(ids, past_key_values=cache).logits.double()


def _max_err(a, b):
    return float((a - b).abs().max())


def _continue(m, ids, ref, cache, chunk, tol):
    """Run ids[PREFILL:] through ``cache`` in chunks of ``chunk`` tokens (one-token steps:
    a window and one more), each chunk's logits within ``tol`` of the model's."""
    end = PREFILL + WINDOW + 1 if chunk == 1 else N
    for a in range(PREFILL, end, chunk):
        b = min(a + chunk, end)
        assert _max_err(_run(m, ids[:, a:b], cache), ref[:, a:b]) <= tol, (a, b)


def test_the_sliding_model_really_depends_on_its_window():
    # the checks on the Gemma-3 model would prove nothing if its window changed nothing
    torch.manual_seed(0)
    m = _gemma().eval()
    m.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 101, (1, N), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits.double()
        m.config.sliding_window = 10 ** 6
        wide = m(ids).logits.double()
    assert _max_err(wide, ref) > 0.05


def test_registered_attention_without_a_cache_is_the_models_own(model):
    m, ids, ref = model
    with torch.no_grad():
        got = m(ids).logits.double()
    assert _max_err(got, ref) <= DENSE_TOL


@pytest.mark.parametrize("chunk", [1, 7, N - PREFILL])
def test_dense_continuation_after_a_prefill_equals_the_model(model, chunk):
    # chunk > 1 read its past through a top-left causal mask before the mask function was
    # registered; chunk 1 always matched
    m, ids, ref = model
    cache = SphericalCache(m.config, budget_fraction=None)
    assert _max_err(_run(m, ids[:, :PREFILL], cache), ref[:, :PREFILL]) <= DENSE_TOL
    _continue(m, ids, ref, cache, chunk, DENSE_TOL)


def test_window_layers_hold_only_their_window_and_the_bytes_say_so(model):
    m, ids, _ = model
    cache = SphericalCache(m.config)
    _run(m, ids[:, :PREFILL], cache)
    kinds, window = layer_kinds(m.config)
    held = cache.held_bytes()
    assert set(held.store_layers) | set(held.window_layers) == set(range(len(kinds)))
    assert all(kinds[i] == "full_attention" for i in held.store_layers)
    per_state = 2 * 2 * cache.num_kv_heads * cache.head_dim        # bf16 keys + values
    assert held.store == len(held.store_layers) * PREFILL * per_state
    assert held.window == len(held.window_layers) * (WINDOW - 1) * per_state
    for i in held.window_layers:
        assert cache.dense_kv(i)[0].shape == (cache.num_kv_heads, WINDOW - 1, cache.head_dim)
    for i in held.store_layers:
        assert cache.dense_kv(i)[0].shape == (cache.num_kv_heads, PREFILL, cache.head_dim)


@pytest.mark.parametrize("chunk", [1, N - PREFILL])
def test_exact_store_continuation_equals_the_model(model, chunk):
    # the store path with a lossless store (the prefill's own states): chunked and
    # one-token continuation are the model's logits; the windows stay with their layers
    m, ids, ref = model
    cache = SphericalCache(m.config)
    _run(m, ids[:, :PREFILL], cache)
    keys, values = zip(*[cache.dense_kv(i) for i in cache.store_layers])
    cache.set_store(DenseStore(keys, values, cache.num_q_heads, 0))
    _continue(m, ids, ref, cache, chunk, DENSE_TOL)
    assert cache.store.keys[0][0].rows.shape[0] == cache.get_seq_length()   # the chunks entered it


@pytest.mark.parametrize("chunk", [1, N - PREFILL])
def test_compressed_keep_all_continuation_equals_the_model(model, chunk):
    m, ids, ref = model
    cache = SphericalCache(m.config, page_bytes=512)
    _run(m, ids[:, :PREFILL], cache)
    window_before = cache.held_bytes().window
    report = cache.compress(budget_bytes=10 ** 8)
    # RDR saw the full-attention layers only, and used the model's softmax scale
    assert report.states_before == report.states_kept == \
        len(cache.store_layers) * cache.num_kv_heads * PREFILL
    assert cache.kv.num_layers == len(cache.store_layers)
    assert cache.kv.softmax_scale == pytest.approx(float(m.model.layers[0].self_attn.scaling))
    held = cache.held_bytes()
    assert held.store == cache.kv.bytes_in_use(cache.seq) and held.window == window_before
    _continue(m, ids, ref, cache, chunk, TOP_TIER_TOL)


def test_a_small_budget_compresses_the_full_layers_and_keeps_the_windows(model):
    m, ids, ref = model
    from spherical_kv_ref.cache import CompressPolicy
    cache = SphericalCache(m.config, page_bytes=512, policy=CompressPolicy(sinks=2, recent=4))
    _run(m, ids[:, :PREFILL], cache)
    window = cache.held_bytes().window
    budget = 6 * 512 * len(cache.store_layers)
    report = cache.compress(budget_bytes=budget)
    held = cache.held_bytes()
    assert report.states_kept < report.states_before or report.states_demoted > 0
    assert held.store == report.bytes_after <= budget and held.window == window
    got = _run(m, ids[:, PREFILL:], cache)
    assert got.shape == ref[:, PREFILL:].shape and torch.isfinite(got).all()
    if cache.window_layers:        # the windows moved on with the chunk
        assert held.window == cache.held_bytes().window


def test_from_store_resumes_where_the_prefill_left(model):
    m, ids, ref = model
    cache = SphericalCache(m.config)
    _run(m, ids[:, :PREFILL], cache)
    keys, values = zip(*[cache.dense_kv(i) for i in cache.store_layers])
    windows = [cache.dense_kv(i) for i in cache.window_layers]
    resumed = SphericalCache.from_store(m.config, DenseStore(keys, values, cache.num_q_heads, 0),
                                        PREFILL, windows)
    assert resumed.get_seq_length() == PREFILL
    assert _max_err(_run(m, ids[:, PREFILL:], resumed), ref[:, PREFILL:]) <= DENSE_TOL
    if cache.window_layers:
        with pytest.raises(ValueError, match="windows"):
            SphericalCache.from_store(m.config, DenseStore(keys, values, cache.num_q_heads, 0),
                                      PREFILL, windows[:-1])
        short = [(k[:, 1:], v[:, 1:]) for k, v in windows]
        with pytest.raises(ValueError, match="windows"):
            SphericalCache.from_store(m.config, DenseStore(keys, values, cache.num_q_heads, 0),
                                      PREFILL, short)


def test_documented_generate_runs_on_compressed_state(model):
    # the module docstring's usage: prefill all but the last token, compress, generate()
    # with the whole ids; at a budget that keeps everything it is the dense run
    m, ids, _ = model
    prompt = ids[:, :PREFILL]
    with torch.no_grad():
        m.config._attn_implementation = "sdpa"
        try:
            dense = m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        finally:
            use_spherical_attention(m)
        cache = SphericalCache(m.config)
        m(prompt[:, :-1], past_key_values=cache)
        cache.compress(budget_bytes=10 ** 8)
        out = m.generate(prompt, past_key_values=cache, max_new_tokens=6, do_sample=False,
                         pad_token_id=0)
    assert torch.equal(out, dense)


def test_a_pass_of_no_new_tokens_names_the_generate_contract(model):
    m, ids, _ = model
    cache = SphericalCache(m.config, budget_fraction=None)
    _run(m, ids[:, :PREFILL], cache)
    with pytest.raises(ValueError, match="whole sequence"):
        _run(m, ids[:, :0], cache)


def test_layer_kinds_refuses_what_it_cannot_serve():
    cfg = _gemma().config
    cfg.layer_types = ["chunked_attention"] * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="layer_types"):
        SphericalCache(cfg)
    cfg = _gemma().config
    cfg.sliding_window = None
    with pytest.raises(ValueError, match="sliding_window"):
        layer_kinds(cfg)


def test_batch_above_one_is_refused_on_window_layers_too(model):
    m, ids, _ = model
    with pytest.raises(ValueError, match="batch 1"):
        _run(m, ids[:, :5].repeat(2, 1), SphericalCache(m.config))
