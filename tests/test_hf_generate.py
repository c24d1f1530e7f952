"""The transformers integration as a transformers or kvpress user meets it: one call
(``SphericalCache(config, budget_fraction=...)`` compresses itself inside ``generate``;
``with spherical_kv(model, ...)`` switches the attention and puts it back), the Cache API
``generate`` calls, the budget as a fraction of the bf16 bytes, and clear errors."""
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spherical_kv_ref.cache import CompressPolicy, SphericalKVCache  # noqa: E402
from spherical_kv_ref.hf import (SphericalCache, SphericalStore, select_attention,  # noqa: E402
                                 spherical_kv, use_spherical_attention)

SMALL = dict(page_bytes=512, policy=CompressPolicy(sinks=2, recent=4))


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """A tiny Llama on sdpa attention, and a prompt of 61 tokens."""
    model = tiny_llama(256)
    ids = torch.randint(0, 101, (1, 61), generator=torch.Generator().manual_seed(1))
    return model, ids


@pytest.fixture
def model(plain):
    m, ids = plain
    yield m, ids
    select_attention(m, "sdpa")             # whatever a test switched, the next starts on sdpa


def _bf16_bytes(cfg, tokens):
    return 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * tokens


def test_one_call_compresses_after_the_prefill_as_a_manual_compress_does(model):
    m, ids = model
    with torch.no_grad(), spherical_kv(m, budget_fraction=0.4, **SMALL) as caches:
        out = m.generate(ids, max_new_tokens=6, do_sample=False)
        # by hand: the dense prefill of the whole prompt, compress, generate from its token
        hand = SphericalCache(m.config, budget_fraction=None, **SMALL)
        first = m(ids, past_key_values=hand).logits[0, -1].argmax().view(1, 1)
        report = hand.compress(budget_fraction=0.4)
        again = m.generate(torch.cat([ids, first], 1), past_key_values=hand, max_new_tokens=5,
                           do_sample=False)
    assert torch.equal(out, again)
    (cache,) = caches
    assert cache.report.budget_bytes == report.budget_bytes == int(0.4 * _bf16_bytes(m.config, 61))
    assert cache.report.bytes_after <= cache.report.budget_bytes
    assert cache.report.states_before == 2 * 2 * 61         # compressed right after the prompt
    assert isinstance(cache.store, SphericalStore)


def test_the_context_manager_restores_the_attention_and_generate(model):
    m, ids = model
    before = [(c, c._attn_implementation) for c in (m.config, m.model.config)]
    with pytest.raises(RuntimeError, match="inside"):
        with spherical_kv(m, budget_fraction=0.5, **SMALL):
            assert m.config._attn_implementation == "spherical_kv"
            assert "generate" in m.__dict__
            raise RuntimeError("inside")
    assert [(c, c._attn_implementation) for c in (m.config, m.model.config)] == before
    assert "generate" not in m.__dict__
    with torch.no_grad():
        with spherical_kv(m, budget_fraction=0.5, **SMALL) as caches:
            own = SphericalCache(m.config, budget_fraction=0.5, **SMALL)
            m.generate(ids, past_key_values=own, max_new_tokens=2, do_sample=False)
        dense = m.generate(ids, max_new_tokens=2, do_sample=False)     # sdpa again, no cache of ours
    assert caches == [] and own.report is not None                     # a given cache is used as is
    assert dense.shape == (1, 63)


def test_entry_checks_the_config_and_budget_and_leaves_the_model_alone(model):
    m, _ = model
    for bad in (0, 0.0, 1.5, -0.2, True, "0.2", None):
        with pytest.raises(ValueError, match="budget_fraction"):
            with spherical_kv(m, budget_fraction=bad):
                pass
    assert m.config._attn_implementation == "sdpa" and "generate" not in m.__dict__


def test_a_fresh_cache_handed_to_generate_warns_that_nothing_compresses_it(model):
    m, ids = model
    use_spherical_attention(m)
    with torch.no_grad():
        with pytest.warns(UserWarning, match="nothing has compressed"):
            m.generate(ids, past_key_values=SphericalCache(m.config), max_new_tokens=3,
                       do_sample=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            m.generate(ids, past_key_values=SphericalCache(m.config, budget_fraction=None),
                       max_new_tokens=3, do_sample=False)


def test_defer_compresses_after_that_many_generated_tokens(model):
    m, ids = model
    with torch.no_grad(), spherical_kv(m, budget_fraction=0.5, defer=3, observe=8, **SMALL) as caches:
        m.generate(ids, max_new_tokens=6, do_sample=False)
    assert caches[0].report.states_before == 2 * 2 * (61 + 3)
    assert caches[0].kv.policy.window == 8


def test_a_model_on_another_attention_is_named_not_silently_wrong(model):
    m, ids = model
    cache = SphericalCache(m.config, budget_fraction=0.5, **SMALL)
    with torch.no_grad(), pytest.raises(ValueError, match="use_spherical_attention"):
        m.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    # attention switched away after compression: the next pass says so
    use_spherical_attention(m)
    cache = SphericalCache(m.config, budget_fraction=None, **SMALL)
    with torch.no_grad():
        m(ids, past_key_values=cache)
        cache.compress(budget_fraction=0.5)
        select_attention(m, "sdpa")
        m(ids[:, :1], past_key_values=cache)
        with pytest.raises(RuntimeError, match="spherical_kv"):
            m(ids[:, :1], past_key_values=cache)


def test_reset_empties_the_store_and_a_later_compress_runs(model):
    m, ids = model
    with torch.no_grad(), spherical_kv(m, budget_fraction=0.5, **SMALL):
        cache = SphericalCache(m.config, budget_fraction=0.5, **SMALL)
        a = m.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        cache.reset()
        assert cache.store is None and cache.kv is None and cache.get_seq_length() == 0
        assert cache.report is None and all(o is None for o in cache.observed)
        b = m.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        cache.reset()
        m(ids, past_key_values=cache)
        cache.budget_fraction = None
        assert cache.compress(budget_fraction=0.5).bytes_after > 0     # not "already compressed"
    assert torch.equal(a, b)


def test_crop_drops_dense_tokens_and_refuses_once_compressed(model):
    m, ids = model
    use_spherical_attention(m)
    with torch.no_grad():
        cropped = SphericalCache(m.config, budget_fraction=None, observe=16, **SMALL)
        m(ids[:, :50], past_key_values=cropped)
        cropped.crop(-10)                       # transformers' convention: drop 10
        cropped.crop(45)                        # the older one: keep the first 45 (a no-op here)
        short = SphericalCache(m.config, budget_fraction=None, observe=16)
        m(ids[:, :40], past_key_values=short)
        assert cropped.get_seq_length() == 40
        # equal up to float32 rounding: a 50-row and a 40-row projection may round apart
        # (CPU matmul kernels block by size: AVX-512 builds differ in the last bit)
        for i in range(2):
            np.testing.assert_allclose(cropped.dense_kv(i)[0], short.dense_kv(i)[0], rtol=1e-5, atol=1e-6)
        # the queries of the dropped tokens go too: 6 of the 16 recorded stay
        assert cropped.observed[0].shape == (4, 6, 16)
        np.testing.assert_allclose(cropped.observed[0], short.observed[0][:, -6:], atol=1e-6)
        a = m(ids[:, 40:45], past_key_values=cropped).logits
        b = m(ids[:, 40:45], past_key_values=short).logits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        cropped.compress(budget_fraction=0.8)
        with pytest.raises(NotImplementedError, match="compressed"):
            cropped.crop(-1)


def test_batch_and_beam_hooks_are_no_ops_at_batch_1_and_refused_above(model):
    m, ids = model
    cache = SphericalCache(m.config, budget_fraction=None)
    cache.batch_repeat_interleave(1)
    cache.reorder_cache(torch.tensor([0]))
    cache.batch_select_indices(torch.tensor([0]))
    for call in (lambda: cache.batch_repeat_interleave(2),
                 lambda: cache.reorder_cache(torch.tensor([0, 0])),
                 lambda: cache.batch_select_indices(torch.tensor([1]))):
        with pytest.raises(NotImplementedError, match="batch 1"):
            call()
    with torch.no_grad(), spherical_kv(m, budget_fraction=0.5, **SMALL):
        with pytest.raises((NotImplementedError, ValueError), match="batch"):
            m.generate(ids, max_new_tokens=2, num_beams=2, do_sample=False)


def test_unsupported_configs_say_what_is_missing():
    with pytest.raises(ValueError, match="got None"):
        SphericalCache(None)
    with pytest.raises(ValueError, match="GPT2Config has no num_key_value_heads"):
        SphericalCache(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32))
    with pytest.raises(ValueError, match="T5Config is an encoder-decoder"):
        SphericalCache(transformers.T5Config(num_layers=2))


def test_the_store_is_made_in_one_place_and_can_be_another_class(model):
    m, ids = model
    made = []

    class Recording(SphericalStore):
        def __init__(self, kv, seq):
            made.append((kv, seq))
            super().__init__(kv, seq)
    with pytest.raises(ValueError, match="store_class"):
        SphericalCache(m.config, store_class=3)
    with torch.no_grad(), spherical_kv(m, budget_fraction=0.5, store_class=Recording, **SMALL) as caches:
        m.generate(ids, max_new_tokens=2, do_sample=False)
    assert isinstance(caches[0].store, Recording) and made == [(caches[0].kv, caches[0].seq)]


def test_budget_fraction_is_of_the_bf16_bytes_in_the_reference_cache_too():
    rng = np.random.default_rng(0)
    cache = SphericalKVCache(2, 2, 32, pool_bytes=1 << 21, policy=CompressPolicy(sinks=1, recent=2))
    seq = cache.new_sequence()
    for layer in range(2):
        cache.append(seq, layer, rng.standard_normal((2, 300, 32)), rng.standard_normal((2, 300, 32)))
    assert cache.bf16_bytes(seq) == 2 * 2 * 300 * 2 * 2 * 32
    report = cache.compress(seq, budget_fraction=0.25)
    assert report.budget_bytes == cache.bf16_bytes(seq) // 4
    assert cache.bytes_in_use(seq) <= report.budget_bytes
