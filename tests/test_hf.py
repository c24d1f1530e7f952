"""transformers integration: the cache reproduces dense attention through a store, the
compressed path matches the reference decode, and generate() runs on compressed state."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from strategies_hf import chunk_plans

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spherical_kv_ref.hf import DenseStore, SphericalCache, use_spherical_attention  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    model = tiny_llama(256)
    ids = torch.randint(0, 101, (1, 61), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits.double()
    use_spherical_attention(model)
    return model, ids, ref


def test_prefill_then_dense_store_reproduces_the_model(tiny_model):
    model, ids, ref = tiny_model
    cache = SphericalCache(model.config)
    with torch.no_grad():
        a = model(ids[:, :40], past_key_values=cache).logits.double()
        store = DenseStore(*zip(*[cache.dense_kv(l) for l in range(2)]), num_q_heads=4, nbytes=0)
        cache.set_store(store)
        b = model(ids[:, 40:], past_key_values=cache).logits.double()
    assert torch.allclose(a, ref[:, :40], atol=1e-5)
    assert torch.allclose(b, ref[:, 40:], atol=1e-5)
    assert store.keys[0][0].rows.shape[0] == 61                # the chunk entered the store


def test_compressed_store_attention_equals_the_paged_reference_decode(tiny_model):
    model, ids, _ = tiny_model
    from spherical_kv_ref.cache import CompressPolicy
    cache = SphericalCache(model.config, page_bytes=512, policy=CompressPolicy(sinks=2, recent=4))
    with torch.no_grad():
        model(ids[:, :50], past_key_values=cache)
    full = cache.layers[0].length
    report = cache.compress(budget_bytes=16 * 512)        # forces eviction and demotion
    assert report.bytes_after <= 16 * 512
    q = np.random.default_rng(0).standard_normal((4, 1, 16))
    out, _ = cache.store.attend(1, q, 0.25)
    ref = cache.kv.decode(cache.seq, 1, q[:, 0], record=False)
    assert np.allclose(out[:, 0], ref, rtol=1e-10, atol=1e-10)
    assert report.states_kept < report.states_before or report.states_demoted > 0
    assert report.states_before == 2 * 2 * full


def test_generate_runs_on_compressed_state_and_matches_dense_at_full_budget(tiny_model):
    model, ids, _ = tiny_model
    prompt = ids[:, :40]
    with torch.no_grad():
        dense = model.generate(prompt, max_new_tokens=6, do_sample=False)
        cache = SphericalCache(model.config, page_bytes=512)
        model(prompt[:, :-1], past_key_values=cache)
        cache.compress(budget_bytes=10 ** 8)               # everything stays at the top tier
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == dense.shape
    assert torch.equal(out[0, 40:], dense[0, 40:])


def test_observed_queries_roll_on_through_dense_decode_steps(tiny_model):
    # compressing after a few dense decode steps: the estimate holds their queries, as
    # if the prefill had covered them
    model, ids, _ = tiny_model
    stepped, whole = SphericalCache(model.config, observe=8, budget_fraction=None), SphericalCache(model.config, observe=8, budget_fraction=None)
    with torch.no_grad():
        model(ids[:, :40], past_key_values=stepped)
        for t in range(40, 43):
            model(ids[:, t:t + 1], past_key_values=stepped)
        model(ids[:, :43], past_key_values=whole)
    for a, b in zip(stepped.observed, whole.observed):
        assert a.shape == b.shape == (4, 8, 16)
        assert np.allclose(a, b, atol=1e-5)


def test_batch_above_one_is_refused(tiny_model):
    model, ids, _ = tiny_model
    cache = SphericalCache(model.config)
    with pytest.raises(ValueError, match="batch 1"), torch.no_grad():
        model(ids[:, :5].repeat(2, 1), past_key_values=cache)


def test_deferred_compression_generates_on_after_the_dense_tokens(tiny_model):
    # generate a few tokens on the dense cache, compress then (the estimate from their
    # queries), generate on: at a budget that keeps everything it is the dense run
    model, ids, _ = tiny_model
    prompt = ids[:, :40]
    with torch.no_grad():
        dense = model.generate(prompt, max_new_tokens=10, do_sample=False)
        cache = SphericalCache(model.config, observe=12, page_bytes=512, budget_fraction=None)
        first = model.generate(prompt, past_key_values=cache, max_new_tokens=4, do_sample=False)
        held = cache.layers[0].length
        cache.compress(budget_bytes=10 ** 8)
        out = model.generate(first, past_key_values=cache, max_new_tokens=6, do_sample=False)
    assert held == 43                      # the prompt and three of the four new tokens
    # RDR read all 12 observed queries (the prompt's last 9, the 3 dense steps), not the
    # policy's default window of 8
    assert cache.kv.policy.window == 12 and all(o.shape == (4, 12, 16) for o in cache.observed)
    assert torch.equal(out, dense)


def test_compress_refuses_a_float_budget_and_takes_a_fraction(tiny_model):
    """compress(0.25) is a ValueError that points to budget_fraction, and the cache stays
    dense and usable; budget_fraction=0.25 then keeps at most a quarter of the store."""
    from spherical_kv_ref.cache import CompressPolicy
    model, ids, ref = tiny_model
    cache = SphericalCache(model.config, page_bytes=256, budget_fraction=None, policy=CompressPolicy(sinks=1, recent=4))
    with torch.no_grad():
        model(ids[:, :59], past_key_values=cache)
        with pytest.raises(ValueError, match="budget_fraction"):
            cache.compress(0.25)
        assert cache.store is None
        got = model(ids[:, 59:60], past_key_values=cache).logits.double()
        assert (got - ref[:, 59:60]).abs().max().item() < 1e-4
        report = cache.compress(budget_fraction=0.25)
    assert 0 < report.bytes_after <= 0.25 * report.bytes_before


# ------------------------------------------------------------------ property

def _feed_and_compare(model, ids, ref, plan):
    """Feed ids by the plan (chunks, compress_at); every chunk's logits must be the dense
    model's over the whole sequence, to fp16 rounding of the keys and values (the budget
    keeps every state at the top tier)."""
    chunks, compress_at = plan
    cache = SphericalCache(model.config, page_bytes=512, budget_fraction=None)
    at = 0
    with torch.no_grad():
        for i, size in enumerate(chunks):
            if i == compress_at:
                report = cache.compress(budget_bytes=10 ** 8)
                assert report.states_kept == report.states_before
            got = model(ids[:, at:at + size], past_key_values=cache).logits.double()
            err = (got - ref[:, at:at + size]).abs().max().item()
            assert err < 2e-3, f"chunk {i} (tokens {at}..{at + size - 1}) of {chunks}, " \
                               f"compressed before chunk {compress_at}: logits off by {err:.3g}"
            at += size


@given(plan=chunk_plans(max_tokens=40))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_chunking_equals_the_dense_model_at_the_lossless_tier(tiny_model, plan):
    """A random prefill, random dense chunks and one-token steps, compress at a random
    point, then random prompt chunks and steps on the compressed cache: the dense model's
    logits throughout (a dense multi-token chunk once read its past with the wrong causal
    alignment; this property finds that at once)."""
    _feed_and_compare(*tiny_model, plan)


def test_rope_frequencies_are_the_models(tiny_model):
    from spherical_kv_ref.hf import rope_frequencies
    model, _, _ = tiny_model
    got = rope_frequencies(model.config)
    assert np.allclose(got, model.model.rotary_emb.inv_freq.double().numpy(), rtol=1e-6)
    scaled = model.config.__class__(**{**model.config.to_dict(), "rope_scaling":
                                       {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})
    assert rope_frequencies(scaled) is None


def test_compress_with_a_horizon_runs_through_the_hf_cache(tiny_model):
    from spherical_kv_ref.cache import CompressPolicy
    model, ids, _ = tiny_model
    cache = SphericalCache(model.config, observe=8, page_bytes=512,
                           policy=CompressPolicy(sinks=2, recent=4, horizon=32))
    with torch.no_grad():
        model(ids[:, :50], past_key_values=cache)
    report = cache.compress(budget_bytes=16 * 512)
    assert report.bytes_after <= 16 * 512
    assert np.allclose(cache.kv.rope_inv_freq, model.model.rotary_emb.inv_freq.double().numpy(), rtol=1e-6)


def test_compress_without_recorded_queries_estimates_uniform_attention(tiny_model):
    # observe=0 records no query: compress estimates uniform attention (docs/rdr.md §5),
    # keeps to its budget, and the model runs on
    from spherical_kv_ref.cache import CompressPolicy
    model, ids, _ = tiny_model
    for fraction in (0.35, 0.5, 0.9):
        cache = SphericalCache(model.config, observe=0, page_bytes=512,
                               policy=CompressPolicy(sinks=2, recent=4))
        with torch.no_grad():
            model(ids[:, :-1], past_key_values=cache)
            report = cache.compress(budget_fraction=fraction)
            logits = model(ids[:, -1:], past_key_values=cache).logits
        assert cache.observed == [None, None]
        assert report.bytes_after <= report.budget_bytes
        assert bool(torch.isfinite(logits).all())
