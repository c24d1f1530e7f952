"""Shared pytest configuration: hypothesis profiles and the self-skipping ``gpu`` marker."""
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "deep", max_examples=1000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=15, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device (CuPy cannot see one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama():
    """Build a seeded random 2-layer Llama (4 query / 2 kv-heads, head_dim 16, vocab 101)
    for the transformers tests: ``tiny_llama(max_positions)``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def build(max_positions=256):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=max_positions)
        return transformers.LlamaForCausalLM(cfg).eval()
    return build
