"""Write the conformance vectors: reference/vectors/<case>.npz and reference/manifest.json.

Every case comes from spherical_kv_ref.conformance (seeds and shapes are in the manifest with a
sha256 of the arrays' contents). Run `python -m reference.generate` after a deliberate
format change; tests/test_conformance.py regenerates in memory and compares."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from spherical_kv_ref import conformance

ROOT = Path(__file__).resolve().parent
VECTORS = ROOT / "vectors"


def content_sha256(arrays: dict) -> str:
    """Hash of the arrays themselves (name, dtype, shape, bytes), independent of zip metadata."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(str(a.dtype.str).encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def manifest_entry(case: conformance.Case, arrays: dict) -> dict:
    return {"name": case.name, "file": f"vectors/{case.name}.npz", "params": case.params(),
            "tolerance": conformance.TOLERANCE[case.op],
            "arrays": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in arrays.items()},
            "sha256": content_sha256(arrays)}


def main() -> int:
    VECTORS.mkdir(parents=True, exist_ok=True)
    entries = []
    for case in conformance.CASES:
        arrays = conformance.build(case)
        np.savez_compressed(VECTORS / f"{case.name}.npz", **arrays)
        entries.append(manifest_entry(case, arrays))
    (ROOT / "manifest.json").write_text(json.dumps(
        {"format": "docs/format.md", "generator": "reference/generate.py", "cases": entries},
        indent=1) + "\n")
    print(f"wrote {len(entries)} cases to {VECTORS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
