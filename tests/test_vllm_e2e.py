"""vLLM serves SmolLM2-135M through the plugin (spherical_kv_vllm), end to end on vLLM's CPU
build. Skipped by itself where vllm is not installed; CI runs it in a further step with the
``vllm`` extra (docs/serving.md).

Each engine configuration runs once, in a process of its own (tests/vllm_run.py), shared by
the tests that read it:
* own:   vLLM's own CPU attention (the oracle), block size 32;
* t16:   the plugin at 16/16, the same engine arguments: greedy tokens equal to ``own``;
* tdef:  the plugin at its default tier (SPHERICAL_KV_TIER=default, 8/4, uniform codebook,
         rotation seed 0), block size 16: the prompt's perplexity near ``own``'s
         (DPPL_DEFAULT, from the seed spread of this run: validation/vllm_dppl.py);
* small: tdef with a pool of 24 blocks: a request that does not fit is preempted by vLLM, one
         longer than the model length refused, the outputs unchanged;
* fp8:   vLLM's own attention with kv_cache_dtype="fp8" (e4m3, per-tensor scales 1.0: the
         model ships none), block size 32, the peer beside the default tier; only where
         vLLM's CPU build has an fp8 cache (x86 with AVX-512 or AMX): the prompt's
         perplexity near ``own``'s (DPPL_FP8).
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


def run_engine(name, tmp, jobs=None, seed=None):
    """CONFIGS[name] run in a process of its own (tests/vllm_run.py) on the jobs of JOBS[name]
    (those named in ``jobs`` only, if given), the plugin's rotation seed ``seed`` (None: 0).
    Returns vllm_run.py's result; validation/vllm_dppl.py runs the seeds through it."""
    cfg = dict(CONFIGS[name], seed=seed)
    cfg["jobs"] = [{"name": n, "prompts": p, "max_tokens": m, "prompt_logprobs": lp}
                   for n, p, m, lp in JOBS[name] if jobs is None or n in jobs]
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


#: ΔPPL bound of the default tier's run: the largest draw of the measured seed spread plus
#: what the arithmetic moves one figure by, rounded up (derived in the test's docstring)
DPPL_DEFAULT = 0.025
#: ΔPPL bound of vLLM's fp8 cache: its one figure plus the arithmetic's largest move, rounded
#: up (derived in the test's docstring)
DPPL_FP8 = 0.02


def test_default_tier_costs_little_perplexity(own, tdef):
    """The default tier (8/4, 2.56x fewer bytes than bf16, 5.1x than float32, rotation seed 0):
    the prompt's perplexity within DPPL_DEFAULT of vLLM's own attention, and visibly not the
    same computation.

    The bound. This run is validation/engine_dppl.py's computation (the same passage, its
    322 scored tokens from the same converted model and tokenizer, every key and value of
    every layer read from codes, every query its own token's included) with vLLM's float32
    kernels and chunked prefill in place of transformers' kernels and float64 attention. A
    seed's figure is one draw; other kernels draw again. SmolLM2 on one AVX-512 CPU (where
    engine_dppl repeats the fixed-tier sweep's figures to the digit):

    * this run over seeds 0-19 (``python -m validation.vllm_dppl``,
      validation/results/engine/vllm/): mean +0.49 % (sd 0.51), -0.40 to +1.42 %, the
      largest at seed 0 (the seed this test runs);
    * engine_dppl over seeds 0-19 (validation/results/engine/fixed_tier/): mean +0.46 %
      (sd 0.72), -0.85 to +1.85 %, the largest at seed 0 again; seed for seed the two
      computations differ by 0.45 points (sd), 0.89 at most;
    * the arithmetic moves one figure by about 0.3 points: engine_dppl's fp8 at scale 1.0 is
      +1.57 % with MKL's AVX2 kernels and +1.23 % with its AVX-512 ones (docs/serving.md "The
      fixed-tier frontier"; a CPU without AVX-512 redraws 8/4's seeds 0-9 by 0.40 points on
      average).

    1.85 + 0.3 = 2.15, rounded up: 2.5 %, engine_dppl's mean plus 2.8 sd and this run's
    mean plus 3.9 sd; seed 0's run here plus the largest seed-for-seed gap (1.42 + 0.89)
    stays inside. Outside it (engine_dppl's seeds): 17 of 20 seeds of 4-bit keys (4/4, mean
    +4.28 %), every seed of 2-bit values (8/2), and a broken path (tens of %); 3-bit values
    (8/3, mean +1.30 %) mostly are not. 8 % held 4-bit keys, 3 % the seeds 0-9 of a CPU
    without AVX-512 before this run was measured.
    """
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
    prompt's perplexity within DPPL_FP8 of vLLM's own float32 attention.

    The bound. fp8 has no seed: one figure, which the arithmetic moves. This run on an
    AVX-512 CPU: -1.17 % over the 322 tokens (validation/results/engine/vllm/). vLLM's CPU
    kernel rounds e4m3 toward zero (test_vllm_cpu_fp8_cache_rounds_toward_zero); engine_dppl
    gives -0.60 % rounded so (fp8-rtz), 0.57 points from this run, and +1.23 % rounded to
    nearest (fp8). The largest move of the figure measured is that 0.57 (MKL's kernel sets
    moved engine_dppl's fp8 by 0.34): 1.17 + 0.57 = 1.74, rounded up: 2 %."""
    got = np.asarray(fp8["jobs"]["ppl"]["prompt_logprobs"][0][1:])
    dense_nll, dense = nll(own)
    assert got.shape == dense.shape
    dppl = math.exp(nll(fp8)[0] - dense_nll) - 1
    print(f"vLLM fp8: delta PPL {100 * dppl:.2f} % over {got.size} tokens")
    assert np.abs(got - dense).max() > 1e-4
    assert abs(dppl) <= DPPL_FP8


@pytest.mark.skipif(not cpu_has_fp8_cache(),
                    reason="vLLM's CPU build keeps an fp8 cache only on x86 with AVX-512 or AMX")
def test_vllm_cpu_fp8_cache_rounds_toward_zero():
    """vLLM's CPU fp8 cache, written by the kernel its attention picks for the ``fp8`` run
    (float32, blocks of 32, head size 64), holds e4m3 rounded toward zero and saturated at
    ±448: the bytes of validation/engine_dppl.py's fp8-rtz, not of its fp8 (rounded to
    nearest, the frontier's fp8 row). Magnitudes from subnormal to saturated. The values sit
    token by token in the block; the keys in the kernel's own order, compared as a multiset."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from validation.engine_dppl import e4m3, e4m3_toward_zero
    block, d = 32, 64
    isa = _get_attn_isa(torch.float32, block, d, "fp8")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((block, 1, d)) * np.logspace(-4, 3, block)[:, None, None])
    x = x.astype(np.float32)
    cache = torch.zeros(1, 1, 2 * block, d, dtype=torch.uint8)
    keys, values = cache.chunk(2, dim=2)
    t = torch.from_numpy(x)
    ops.cpu_attn_reshape_and_cache(t, t.clone(), keys, values, torch.arange(block), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="fp8")

    def e4m3_bytes(y):
        f8 = torch.from_numpy(y.astype(np.float32)).to(torch.float8_e4m3fn)
        return f8.view(torch.uint8).reshape(-1)

    toward_zero = e4m3_bytes(e4m3_toward_zero(x.astype(np.float64), 1.0))
    assert torch.equal(values.reshape(-1), toward_zero)
    assert torch.equal(keys.reshape(-1).sort().values, toward_zero.sort().values)
    assert not torch.equal(values.reshape(-1), e4m3_bytes(e4m3(x.astype(np.float64), 1.0)))


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
