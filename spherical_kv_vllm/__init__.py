"""vLLM plugin: vLLM serves a model with its KV cache in Spherical KV pages (docs/serving.md).

A thin shell around ``spherical_kv_ref.engine`` (the engine-independent adapter): vLLM
allocates, frees and preempts its blocks as always; each block holds the block's tokens in
the project's page format at one tier; the adapter writes the new keys and values into
their slots and computes attention from the codes (CPU: the reference's numba path; GPU:
``cupy_kernels``).

It is chosen explicitly, never silently. vLLM runs ``register`` in every process it starts
(the ``vllm.general_plugins`` entry point); ``register`` does nothing unless the environment
names a tier:

    SPHERICAL_KV_TIER=default        the recommended tier (DEFAULT_TIER, 8/4), or key bits /
                                     value bits of every state: 4/4, 8/4, ... (1, 2, 3, 4, 8, 16)
    SPHERICAL_KV_CODEBOOK=uniform    or lloyd-max (uniform: the GPU kernel's fast path)
    SPHERICAL_KV_SEED=0              rotation seed

With a tier set, the plugin answers vLLM's request for its CPU attention backend
(``CPU_ATTN``) on the CPU platform, and the ``CUSTOM`` backend elsewhere (select it with
``attention_config={"backend": "CUSTOM"}`` or ``--attention-backend CUSTOM``). Block sizes:
multiples of 16 (16 keeps a step's decode calls few).
"""
from __future__ import annotations

import os

__all__ = ["register", "settings", "parse_tier", "TIER_ENV", "CODEBOOK_ENV", "SEED_ENV",
           "BACKEND_PATH", "DEFAULT_TIER"]

TIER_ENV = "SPHERICAL_KV_TIER"
CODEBOOK_ENV = "SPHERICAL_KV_CODEBOOK"
SEED_ENV = "SPHERICAL_KV_SEED"
BACKEND_PATH = "spherical_kv_vllm.backend.SphericalKVBackend"
#: the codec's bit widths (spherical_kv_ref.codec.BITS, which a test compares). This module
#: imports nothing of the library: vLLM 0.32's CPU worker scans every loaded module when it
#: starts and fails on llvmlite's wrappers, so numba must not be loaded before that.
BITS = (1, 2, 3, 4, 8, 16)
#: the tier ``SPHERICAL_KV_TIER=default`` names: of the format's tiers, the one with the fewest
#: bytes whose engine ΔPPL, averaged over rotation seeds 0-9, is within 1 % on SmolLM2-135M
#: and on Gemma-3-270M's full-attention layers (39 % of bf16's bytes at head_dim 64, 38 % at
#: 256; docs/serving.md "Choosing a tier", validation/results/engine/frontier.md). The keys
#: carry the loss: 4-bit keys cost +4.9 % (SmolLM2) and +7.8 % (Gemma) on average.
DEFAULT_TIER = (8, 4)


def parse_tier(text: str):
    """'4/4' -> (4, 4): key bits / value bits of the one tier the blocks hold; 'default' ->
    DEFAULT_TIER."""
    if str(text).strip() == "default":
        return DEFAULT_TIER
    parts = str(text).strip().split("/")
    try:
        kb, vb = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"tier must read 'default' or 'key_bits/value_bits' such as '4/4' or "
                         f"'16/16', got {text!r}") from None
    for b in (kb, vb):
        if b not in BITS:
            raise ValueError(f"tier {text!r}: bits must be one of {BITS}")
    return kb, vb


def settings():
    """(tier (key_bits, value_bits), codebook, seed) from the environment, or None when
    ``SPHERICAL_KV_TIER`` is unset or empty (the plugin is off). ValueError naming the
    variable for a value it cannot read."""
    text = os.environ.get(TIER_ENV, "").strip()
    if not text:
        return None
    try:
        tier = parse_tier(text)
    except ValueError as e:
        raise ValueError(f"{TIER_ENV}: {e}") from None
    codebook = os.environ.get(CODEBOOK_ENV, "uniform").strip() or "uniform"
    if codebook not in ("uniform", "lloyd-max"):
        raise ValueError(f"{CODEBOOK_ENV} must be 'uniform' or 'lloyd-max', got {codebook!r}")
    seed_text = os.environ.get(SEED_ENV, "0").strip() or "0"
    try:
        seed = int(seed_text)
    except ValueError:
        raise ValueError(f"{SEED_ENV} must be an integer, got {seed_text!r}") from None
    return tier, codebook, seed


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the backend when a tier is set."""
    if settings() is None:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    # The CPU platform always asks for CPU_ATTN (it ignores CUSTOM); the registry's
    # overrides answer that request first.
    which = AttentionBackendEnum.CPU_ATTN if current_platform.is_cpu() else AttentionBackendEnum.CUSTOM
    register_backend(which, BACKEND_PATH)
