"""vLLM serves SmolLM2-135M through the plugin (spherical_kv_vllm), end to end on vLLM's CPU
build. Skipped by itself where vllm is not installed; CI runs it in a further step with the
``vllm`` extra (docs/serving.md).

Each engine configuration runs once, in a process of its own (tests/vllm_run.py), shared by
the tests that read it:
* own:   vLLM's own CPU attention (the oracle), block size 32;
* t16:   the plugin at 16/16, the same engine arguments: greedy tokens equal to ``own``;
* tdef:  the plugin at its default tier (SPHERICAL_KV_TIER=default, 8/4, uniform codebook),
         block size 16: the prompt's perplexity near ``own``'s (DPPL_DEFAULT);
* small: tdef with a pool of 24 blocks: a request that does not fit is preempted by vLLM, one
         longer than the model length refused, the outputs unchanged;
* fp8:   vLLM's own attention with kv_cache_dtype="fp8" (e4m3, per-tensor scales 1.0: the
         model ships none), block size 32; only where vLLM's CPU build has an fp8 cache (x86
         with AVX-512 or AMX): the prompt's perplexity near ``own``'s (DPPL_FP8).
Every run uses a budget of 64 tokens per step, so the long prompts are prefilled in chunks next
to the short requests' decodes: steps that mix prefill and decode (checked from the plugin's
own metadata builder).
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install '.[vllm]')")

HERE = pathlib.Path(__file__).parent
PASSAGE = (
    "The lighthouse keeper had kept the same routine for eleven years. Every evening, an hour "
    "before sunset, he climbed the hundred and twelve steps of the tower, wiped the salt from "
    "the great lens with a soft cloth, trimmed the wick and filled the reservoir with oil. "
    "Then he sat at the small table by the window and wrote in the logbook: the direction of "
    "the wind, the height of the waves, the ships that passed and the time they passed. Most "
    "nights nothing happened. A fishing boat would come home late, its single lamp swinging, "
    "or a cargo ship would cross the horizon like a slow moving town. In winter the storms "
    "came from the north-west and the whole tower hummed with the wind, and he would stay "
    "awake until morning, listening for the sound of a horn. His daughter lived in the city "
    "and wrote to him every month. She asked when he would retire, whether he was lonely, "
    "whether the doctor had seen his knee. He answered every letter the same week, in "
    "careful handwriting, and told her about the birds that nested on the gallery, the seal "
    "that slept on the rocks below, and the new keeper's cottage the council had promised to "
    "build. He did not tell her that he talked to the lamp, or that he had started to count "
    "the steps out loud, or that some nights he was not sure whether the light he saw on the "
    "water was a ship or only the moon. When the letter came saying that the lighthouse "
    "would be automated in the spring, he read it twice, folded it into the logbook, and "
    "climbed the stairs as he always had.")
#: 6 to 130 tokens: shorter than a block, longer than several (blocks of 16 and 32)
PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea. The sea",
    "A recipe for bread needs flour, water, salt and yeast. First, mix the flour and the "
    "water in a large bowl, then",
    PASSAGE[:600],
]
LONG = PASSAGE[:1150]          # about 250 tokens: with the others more than 24 blocks hold
ENGINE = {"gpu_memory_utilization": 0.2, "max_model_len": 1024, "max_num_batched_tokens": 64}
SMALL_BLOCKS = 24          # one of them is vLLM's null block: 23 hold tokens
CONFIGS = {
    "own": {"tier": None, "engine": dict(ENGINE, block_size=32)},
    "t16": {"tier": "16/16", "engine": dict(ENGINE, block_size=32)},
    "tdef": {"tier": "default", "engine": dict(ENGINE, block_size=16)},
    "small": {"tier": "default", "engine": dict(ENGINE, block_size=16, max_model_len=16 * (SMALL_BLOCKS - 1),
                                            num_gpu_blocks_override=SMALL_BLOCKS),
              "too_long": PASSAGE + " " + PASSAGE},
    "fp8": {"tier": None, "engine": dict(ENGINE, block_size=32, kv_cache_dtype="fp8")},
}
JOBS = {
    "own": [("batch", PROMPTS, 32, False), ("ppl", [PASSAGE], 1, True)],
    "t16": [("batch", PROMPTS, 32, False), ("ppl", [PASSAGE], 1, True)],
    "tdef": [("batch", PROMPTS + [LONG], 32, False), ("ppl", [PASSAGE], 1, True)],
    "small": [("batch", PROMPTS + [LONG], 32, False)],
    "fp8": [("ppl", [PASSAGE], 1, True)],
}


def run_engine(name, tmp):
    cfg = dict(CONFIGS[name])
    cfg["jobs"] = [{"name": n, "prompts": p, "max_tokens": m, "prompt_logprobs": lp}
                   for n, p, m, lp in JOBS[name]]
    cfg_path, out_path = tmp / f"{name}.json", tmp / f"{name}_out.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPHERICAL_KV_")}
    proc = subprocess.run([sys.executable, str(HERE / "vllm_run.py"), str(cfg_path), str(out_path)],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out_path.read_text())


def _fixture(name):
    @pytest.fixture(scope="module", name=name)
    def fx(tmp_path_factory):
        return run_engine(name, tmp_path_factory.mktemp(name))
    return fx


own, t16, tdef, small, fp8 = (_fixture(n) for n in ("own", "t16", "tdef", "small", "fp8"))


def cpu_has_fp8_cache() -> bool:
    """Whether vLLM 0.32's CPU attention keeps an fp8 cache here: it raises for fp8 unless
    the CPU has AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa)."""
    try:
        import torch
        return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())
    except (ImportError, AttributeError):
        return False


def nll(run):
    lp = run["jobs"]["ppl"]["prompt_logprobs"][0][1:]
    return -np.mean(lp), np.asarray(lp)


def mixed_steps(run):
    return sum(1 for prefill, decodes in run["steps"] if prefill and decodes)


def test_fp16_tier_generates_what_vllm_generates(own, t16):
    """16/16: the pages hold fp16 keys and values (rotated); greedy 32 tokens of a batch of
    prompts of different lengths equal those of vLLM's own attention in float32."""
    assert t16["jobs"]["batch"]["tokens"] == own["jobs"]["batch"]["tokens"]
    assert all(len(t) > 0 for t in t16["jobs"]["batch"]["tokens"])
    assert mixed_steps(t16) > 0
    # fp16 storage moves the prompt's perplexity by far less than any compressed tier
    assert abs(nll(t16)[0] - nll(own)[0]) < 1e-3


#: ΔPPL bound of the default tier's run (8/4, uniform codebook, rotation seed 0), from the
#: measured seed spread. The same computation in transformers (validation/engine_dppl.py:
#: every key and value of every layer read from codes; docs/serving.md "Choosing a tier")
#: gives over rotation seeds 0-9 +0.67 % on average (sd 0.76, -0.79 to +1.59 %) with float64
#: attention and +0.74 % (sd 0.65, -0.31 to +1.62 %) with transformers' float32 sdpa, the
#: arithmetic moving a seed by up to 0.58 points. This run is one more draw of that spread:
#: float32 kernels, or a scipy build that moves the uniform codebook's scale by 1e-7, change
#: the stored codes the way another seed does (4/4's seed 0 went from +4.09 % to +5.01 % with
#: scipy, its vLLM run from +1.26 % to +5.49 %). Over the 20 draws (mean +0.70 %, sd 0.69,
#: max +1.62 %), 3 % is the mean plus 3.3 sd: a draw beyond it is about 1 in 2500, while
#: 4-bit keys (4/4, the tier this test held before: every seed at +2.60 % or more, mean
#: +4.85 %) mostly and a broken path (tens of %) always land outside it. 8 % was 4/4's bound.
DPPL_DEFAULT = 0.03
#: ΔPPL bound of vLLM's fp8 cache. fp8 has no seed: in transformers, e4m3 with vLLM's scale
#: 1.0 gives +1.57 % (+0.92 % below dense with calibrated amax/448 scales); the rounding of
#: vLLM's CPU kernel is compiled code, not read here, so the bound is the default tier's.
DPPL_FP8 = 0.03


def test_default_tier_costs_little_perplexity(own, tdef):
    """The default tier (8/4, 2.56x fewer bytes than bf16, 5.1x than float32): the prompt's
    perplexity within DPPL_DEFAULT of vLLM's own attention, and visibly not the same
    computation."""
    got = np.asarray(tdef["jobs"]["ppl"]["prompt_logprobs"][0][1:])
    dense_nll, dense = nll(own)
    assert got.shape == dense.shape and got.size > 300
    dppl = math.exp(nll(tdef)[0] - dense_nll) - 1
    print(f"default tier: delta PPL {100 * dppl:.2f} % over {got.size} tokens, "
          f"max |d logprob| {np.abs(got - dense).max():.3f}")
    assert np.abs(got - dense).max() > 1e-3       # the tier is really in the path
    assert abs(dppl) <= DPPL_DEFAULT
    assert mixed_steps(tdef) > 0


@pytest.mark.skipif(not cpu_has_fp8_cache(),
                    reason="vLLM's CPU build keeps an fp8 cache only on x86 with AVX-512 or AMX")
def test_vllm_fp8_cache_costs_little_perplexity(own, fp8):
    """vLLM's own fp8 cache (e4m3, per-tensor scales 1.0) beside the plugin's default: the
    prompt's perplexity within DPPL_FP8 of vLLM's own float32 attention."""
    got = np.asarray(fp8["jobs"]["ppl"]["prompt_logprobs"][0][1:])
    dense_nll, dense = nll(own)
    assert got.shape == dense.shape
    dppl = math.exp(nll(fp8)[0] - dense_nll) - 1
    print(f"vLLM fp8: delta PPL {100 * dppl:.2f} % over {got.size} tokens")
    assert np.abs(got - dense).max() > 1e-4
    assert abs(dppl) <= DPPL_FP8


def test_pool_exhaustion_preempts_without_changing_outputs(tdef, small):
    """24 blocks of 16 tokens cannot hold the batch at once: vLLM preempts (and later
    recomputes) requests; every request still generates what it generates with a large pool,
    and a prompt longer than the model length is refused (vLLM's validation error) while
    the engine goes on."""
    assert small["preemptions"] > 0
    assert small["jobs"]["batch"]["tokens"] == tdef["jobs"]["batch"]["tokens"]
    assert small["refused"] is not None and "maximum context length" in small["refused"]


def readme_block(heading="## Serving with vLLM"):
    """The first python block under ``heading`` in the README, as written."""
    lines = (HERE.parent / "README.md").read_text().splitlines()
    start = lines.index(heading)
    open_ = next(i for i in range(start, len(lines)) if lines[i].strip() == "```python")
    close = next(i for i in range(open_ + 1, len(lines)) if lines[i].strip() == "```")
    return "\n".join(lines[open_ + 1:close]) + "\n"


def test_readme_snippet_runs_as_written(tmp_path):
    """The README's vLLM example, run as a script (vLLM's worker processes and all)."""
    script = tmp_path / "serve.py"
    script.write_text(readme_block())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPHERICAL_KV_")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "Paris" in proc.stdout
