"""vLLM serves SmolLM2-135M through the plugin (spherical_kv_vllm), end to end on vLLM's CPU
build. Skipped by itself where vllm is not installed; CI runs it in a further step with the
``vllm`` extra (docs/serving.md).

Each engine configuration runs once, in a process of its own (tests/vllm_run.py), shared by
the tests that read it:
* own:   vLLM's own CPU attention (the oracle), block size 32;
* t16:   the plugin at 16/16, the same engine arguments: greedy tokens equal to ``own``;
* t44:   the plugin at 4/4 (uniform codebook), block size 16: the prompt's perplexity near
         ``own``'s (DPPL_4BIT);
* small: t44 with a pool of 24 blocks: a request that does not fit is preempted by vLLM, one
         longer than the model length refused, the outputs unchanged.
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
    "t44": {"tier": "4/4", "engine": dict(ENGINE, block_size=16)},
    "small": {"tier": "4/4", "engine": dict(ENGINE, block_size=16, max_model_len=16 * (SMALL_BLOCKS - 1),
                                            num_gpu_blocks_override=SMALL_BLOCKS),
              "too_long": PASSAGE + " " + PASSAGE},
}
JOBS = {
    "own": [("batch", PROMPTS, 32, False), ("ppl", [PASSAGE], 1, True)],
    "t16": [("batch", PROMPTS, 32, False), ("ppl", [PASSAGE], 1, True)],
    "t44": [("batch", PROMPTS + [LONG], 32, False), ("ppl", [PASSAGE], 1, True)],
    "small": [("batch", PROMPTS + [LONG], 32, False)],
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


own, t16, t44, small = (_fixture(n) for n in ("own", "t16", "t44", "small"))


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


#: ΔPPL bound of the 4/4 run. Uncentred 4/4 with every token, the scored ones included, read
#: from codes; 1 % is beyond what 322 tokens resolve at this tier: the same computation in
#: transformers (validation/engine_dppl.py) gives +0.35 % to +6.56 % over rotation seeds 0-9
#: (mean +4.45 %; cells of the codebook are crossed and the change runs through 30 layers;
#: docs/serving.md, validation/results/engine/). The figure of one seed also moves with the
#: environment: seed 0 in transformers is +4.09 % with scipy 1.16.3 and +5.01 % with 1.17.1,
#: whose bounded minimiser puts the uniform codebook's scale 1.6e-7 (relative) elsewhere, and
#: this vLLM run went from under 2 % to +5.49 % with it. So the bound is the seeds' measured
#: spread with a point of margin: it tells the tier's cost from a broken path (tens of %), not
#: one seed's luck.
DPPL_4BIT = 0.08


def test_4bit_tier_costs_little_perplexity(own, t44):
    """4/4 (uniform codebook, 8x fewer bytes than float32): the prompt's perplexity within
    DPPL_4BIT of vLLM's own attention, and visibly not the same computation."""
    got = np.asarray(t44["jobs"]["ppl"]["prompt_logprobs"][0][1:])
    dense_nll, dense = nll(own)
    assert got.shape == dense.shape and got.size > 300
    dppl = math.exp(nll(t44)[0] - dense_nll) - 1
    print(f"4/4 uniform: delta PPL {100 * dppl:.2f} % over {got.size} tokens, "
          f"max |d logprob| {np.abs(got - dense).max():.3f}")
    assert np.abs(got - dense).max() > 1e-2       # the tier is really in the path
    assert abs(dppl) <= DPPL_4BIT
    assert mixed_steps(t44) > 0


def test_pool_exhaustion_preempts_without_changing_outputs(t44, small):
    """24 blocks of 16 tokens cannot hold the batch at once: vLLM preempts (and later
    recomputes) requests; every request still generates what it generates with a large pool,
    and a prompt longer than the model length is refused (vLLM's validation error) while
    the engine goes on."""
    assert small["preemptions"] > 0
    assert small["jobs"]["batch"]["tokens"] == t44["jobs"]["batch"]["tokens"]
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
