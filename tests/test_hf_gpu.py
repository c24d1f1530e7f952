"""The transformers integration on the GPU kernels (cupy_kernels.hf_store): the GPU store's
attention and log-sum-exps equal the reference store's within the kernel's fp16 budget, and
a model reading its compressed context through it gives the reference store's logits."""
import copy

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
cp = pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def compressed():
    """A seeded random 2-layer Llama with head_dim 64 (a size the kernels take), 120 tokens
    prefilled and compressed to 40 % of their top-tier bytes (mixed tiers, evictions)."""
    from spherical_kv_ref.cache import CompressPolicy
    from spherical_kv_ref.hf import SphericalCache, use_spherical_attention
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=256, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    use_spherical_attention(model)
    ids = torch.randint(0, 101, (1, 130), generator=torch.Generator().manual_seed(2))
    cache = SphericalCache(model.config, policy=CompressPolicy(sinks=2, recent=8))
    with torch.no_grad():
        model(ids[:, :120], past_key_values=cache)
    report = cache.compress(budget_bytes=40 * 1024)      # 31 % of the top tier's 128 KiB of pages
    assert report.states_kept < report.states_before or report.states_demoted > 0
    return model, ids, cache


def test_gpu_store_attention_equals_the_reference_store(compressed):
    from cupy_kernels.hf_store import GpuSphericalStore
    _, _, cache = compressed
    from test_cache_kernels import BOUND, error_scale
    kv = cache.kv
    gpu = GpuSphericalStore(kv, cache.seq)
    q = np.random.default_rng(0).standard_normal((4, 5, 64)) * 1.5
    for layer in range(2):
        ref_o, ref_l = cache.store.attend(layer, q, kv.softmax_scale)
        got_o, got_l = gpu.attend(layer, q, kv.softmax_scale)
        assert got_o.shape == ref_o.shape and got_l.shape == ref_l.shape
        for t in range(q.shape[1]):    # the kernel's fp16 budget, per query head (as in test_cache_kernels)
            scale = error_scale(kv, cache.seq, layer, q[:, t])
            err = np.linalg.norm(got_o[:, t] - ref_o[:, t], axis=1) / scale
            assert np.max(err) <= BOUND, (layer, t)
            # the log-sum-exp moves by at most the logits' error, 2^-10 (1 + 2 scale |q| r_K)
            lse_err = np.abs(got_l[:, t] - ref_l[:, t]) / error_scale(kv, cache.seq, layer, q[:, t], values=False)
            assert np.max(lse_err) <= BOUND, (layer, t)
    with pytest.raises(ValueError, match="softmax scale"):
        gpu.attend(0, q, 2.0 * cache.kv.softmax_scale)
    with pytest.raises(ValueError, match="num_q_heads"):
        gpu.attend(0, q[:2], cache.kv.softmax_scale)


def test_model_on_the_gpu_store_gives_the_reference_logits(compressed):
    from cupy_kernels.hf_store import GpuSphericalStore
    from spherical_kv_ref.hf import SphericalCache
    model, ids, cache = compressed
    logits = []
    for gpu in (False, True):
        c = copy.deepcopy(cache)          # each run appends its own new tokens
        if gpu:
            c.set_store(GpuSphericalStore(c.kv, c.seq))
        with torch.no_grad():
            a = model(ids[:, 120:125], past_key_values=c).logits.double()      # a chunk
            b = model(ids[:, 125:126], past_key_values=c).logits.double()      # then a step
        logits.append(torch.cat([a, b], dim=1))
        assert isinstance(c.store, GpuSphericalStore) == gpu
    assert isinstance(cache, SphericalCache)
    ref, got = logits
    assert torch.max(torch.abs(got - ref)) <= 2e-2 * (1 + torch.max(torch.abs(ref)))
