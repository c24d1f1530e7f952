"""One vLLM engine run for tests/test_vllm_e2e.py, in a process of its own:

    python tests/vllm_run.py config.json result.json

config: {"tier": "4/4" or null (vLLM's own attention), "seed": the plugin's rotation seed
(SPHERICAL_KV_SEED; absent: the plugin's default, 0), "engine": {LLM keyword arguments},
"jobs": [{"name", "prompts": [str], "max_tokens", "prompt_logprobs": bool}],
"too_long": str or null (a prompt longer than max_model_len, expected to be refused)}.
result: per job the generated token ids and, if asked, each prompt token's log-probability;
the steps the plugin's metadata builder saw ([prefill tokens, decode requests] each); vLLM's
preemption count; the refusal's message.

The engine runs in this process (no engine-core or worker processes), so the builder can be
watched here. Nothing of the library's numba code may be imported before ``LLM(...)``: vLLM's
CPU worker scans the loaded modules when it starts (see spherical_kv_vllm).
"""
import json
import os
import sys
import time


def main(config_path, result_path):
    cfg = json.loads(open(config_path).read())
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cfg["tier"]:
        os.environ["SPHERICAL_KV_TIER"] = cfg["tier"]
    else:
        os.environ.pop("SPHERICAL_KV_TIER", None)
    if cfg.get("seed") is not None:
        os.environ["SPHERICAL_KV_SEED"] = str(cfg["seed"])
    from vllm import LLM, SamplingParams
    from spherical_kv_eval.model import model_folder

    t0 = time.time()
    llm = LLM(model=str(model_folder()), dtype="float32", seed=0, enforce_eager=True,
              distributed_executor_backend="uni", disable_log_stats=False, **cfg["engine"])
    started = time.time() - t0
    steps = []
    if cfg["tier"]:
        from spherical_kv_vllm import backend
        build = backend.SphericalKVMetadataBuilder.build

        def watched(self, *args, **kwargs):
            meta = build(self, *args, **kwargs)
            plan = meta.plan
            req = plan.request[plan.query_tokens]
            qlen = [int((req == r).sum()) for r in sorted(set(req.tolist()))]
            steps.append([sum(n for n in qlen if n > 1), sum(1 for n in qlen if n == 1)])
            return meta
        backend.SphericalKVMetadataBuilder.build = watched
    out = {"started_s": started, "jobs": {}}
    for job in cfg["jobs"]:
        sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"],
                            prompt_logprobs=0 if job.get("prompt_logprobs") else None)
        res = llm.generate(job["prompts"], sp, use_tqdm=False)
        entry = {"tokens": [list(r.outputs[0].token_ids) for r in res]}
        if job.get("prompt_logprobs"):
            # entry i: {token id: Logprob} of prompt token i (None for the first)
            entry["prompt_logprobs"] = [
                [None if d is None else d[tid].logprob for d, tid in zip(r.prompt_logprobs, r.prompt_token_ids)]
                for r in res]
        out["jobs"][job["name"]] = entry
    if cfg.get("too_long"):
        from vllm.exceptions import VLLMValidationError
        try:
            llm.generate([cfg["too_long"]], SamplingParams(max_tokens=4), use_tqdm=False)
            out["refused"] = None
        except (ValueError, VLLMValidationError) as e:
            out["refused"] = f"{type(e).__name__}: {e}"
    out["steps"] = steps
    out["preemptions"] = sum(int(getattr(m, "value", 0)) for m in llm.get_metrics()
                             if m.name == "vllm:num_preemptions")
    out["total_s"] = time.time() - t0
    with open(result_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
