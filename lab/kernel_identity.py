"""Machine code of the shipped kernels, compared between two source trees, without a GPU.

Builds each tree's kernel instances the way the run-time module does (NVRTC 13, the same
source string, options and name expressions as ``cupy_kernels._module``, for sm_90) and
compares, per kernel instance, the cubin's machine code (the bytes of its ``.text`` section),
its register count, its shared and constant-bank sizes and its relocations (symbol names
mapped from the old kernel names to the new). Identical bytes mean identical instructions,
so identical behaviour and timing on the device.

    PYTHONPATH=. python lab/kernel_identity.py --before kernels-before-cut
    PYTHONPATH=. python lab/kernel_identity.py --before kernels-before-cut --save before.json

``--before``: a git revision (its cupy_kernels/csrc is read with ``git archive``) or a folder
holding the .cuh files; the instances built there are the keys of RENAMED (old name -> name
in this tree) where the old name occurs in that tree's sources, else today's names (a revision
after the renames). For a git revision the launch side is compared too (``launch_settings``):
the kernel, dynamic shared memory, geometry padding, merge kernel and default split count the
revision's launcher picks for each codebook, head dim, page size and shape (at the tag: its
default version), against today's ``DecodePath``, on a modelled 132-SM device, and the encode
launcher's cell tables (bit for bit) and block shape.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import tarfile
import tempfile
from pathlib import Path

# kernel name at kernels-before-cut -> the kernel of the same code today
RENAMED = {
    "ada_decode_v4_kernel": "ada_decode_table_kernel",
    "ada_decode_uniform_v7_kernel": "ada_decode_affine_kernel",
    "ada_merge_kernel": "ada_merge_kernel",
    "ada_merge_v7_kernel": "ada_merge_per_head_kernel",
    "encode_v3_kernel": "encode_table_kernel",
    "encode_v3_uniform_kernel": "encode_affine_kernel",
    "retier_kernel": "retier_kernel",
}


# the tier ladder of the launch-setting comparisons
LADDER = [(2, 2), (3, 3), (4, 4), (8, 8), (16, 16)]


def build(csrc: Path, names: list, options: tuple) -> tuple:
    """(cubin bytes, {name expression: lowered (mangled) name}) of one NVRTC build."""
    from validation.build_info import offline_build
    from cupy_kernels._module import source
    got = offline_build(source(csrc), names, list(options) + [f"-I{csrc}"])
    if got.rc:
        raise RuntimeError(got.log)
    return got.cubin, got.lowered


def elf_sections(blob: bytes) -> dict:
    """{section name: (sh_type, sh_info, data, sh_link)} of a 64-bit little-endian ELF."""
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    strtab = hdrs[shstrndx]
    def name(off, tab=strtab):
        s = blob[tab[4] + off:blob.index(b"\0", tab[4] + off)]
        return s.decode()
    out = {}
    for h in hdrs:
        sh_name, sh_type, _, _, off, size, link, info, _, _ = h
        data = blob[off:off + size] if sh_type != 8 else b"\0" * size   # NOBITS: a size only
        out[name(sh_name)] = (sh_type, info, data, link, hdrs)
    return out


def module_info(data: bytes) -> dict:
    """{(symbol index, attribute): value} of the module-wide .nv.info records that name a
    function (register count, frame and stack sizes): EIFMT_SVAL records of 8 bytes."""
    out, i = {}, 0
    while i + 4 <= len(data):
        fmt, attr, size = struct.unpack_from("<BBH", data, i)
        if fmt == 0x04:   # EIFMT_SVAL: a payload of `size` bytes
            if size == 8:
                sym, val = struct.unpack_from("<II", data, i + 4)
                out[(sym, attr)] = val
            i += 4 + size
        else:             # EIFMT_NVAL / EIFMT_HVAL: no payload
            i += 4
    return out


def symbols(blob: bytes, secs: dict) -> list:
    """Symbol names of the ELF's .symtab, by index."""
    _, _, data, link, hdrs = secs[".symtab"]
    strtab = hdrs[link]
    names = []
    for i in range(len(data) // 24):
        st_name, = struct.unpack_from("<I", data, 24 * i)
        s = blob[strtab[4] + st_name:blob.index(b"\0", strtab[4] + st_name)]
        names.append(s.decode())
    return names


EIATTR_PARAM_CBANK = 0x0A   # payload: the constant bank's section symbol (an index), offset, size


def kernel_info(data: bytes) -> list:
    """A kernel's .nv.info records (parameter layout, exit offsets, attributes used) with the
    one module-dependent field, the parameter bank's symbol index, left out."""
    out, i = [], 0
    while i + 4 <= len(data):
        fmt, attr, size = struct.unpack_from("<BBH", data, i)
        if fmt == 0x04:
            payload = data[i + 4:i + 4 + size]
            if attr == EIATTR_PARAM_CBANK:
                payload = payload[4:]
            out.append((attr, payload.hex()))
            i += 4 + size
        else:
            out.append((attr, size))
            i += 4
    return out


def fingerprint(blob: bytes, mangled: str, rename) -> dict:
    """What decides one kernel's behaviour and timing: its machine code and resources."""
    secs = elf_sections(blob)
    syms = symbols(blob, secs)
    text = secs[f".text.{mangled}"]
    sym_index = syms.index(mangled)
    attrs = {f"attr_{a:#04x}": v for (sym, a), v in module_info(secs[".nv.info"][2]).items()
             if sym == sym_index}
    relocs = []
    for rel_name in (f".rel.text.{mangled}", f".rela.text.{mangled}"):
        if rel_name in secs:
            data = secs[rel_name][2]
            step = 16 if rel_name.startswith(".rel.") else 24
            for i in range(len(data) // step):
                off, info = struct.unpack_from("<QQ", data, step * i)
                addend = struct.unpack_from("<q", data, step * i + 16)[0] if step == 24 else 0
                relocs.append((off, info & 0xffffffff, rename(syms[info >> 32]), addend))
    def size(prefix):
        s = secs.get(f"{prefix}.{mangled}")
        return len(s[2]) if s else 0
    kinfo = kernel_info(secs[f".nv.info.{mangled}"][2])
    return dict(registers=attrs.get("attr_0x2f"), function_attributes=attrs,
                kernel_info_sha256=hashlib.sha256(repr(kinfo).encode()).hexdigest(), text_sha256=hashlib.sha256(text[2]).hexdigest(),
                text_bytes=len(text[2]), shared_bytes=size(".nv.shared"),
                constant0_bytes=size(".nv.constant0"), relocations=relocs)


def tree(rev_or_dir: str, workdir: Path) -> Path:
    if os.path.isdir(rev_or_dir):
        return Path(rev_or_dir)
    tar = workdir / "before.tar"
    subprocess.run(["git", "archive", "-o", str(tar), rev_or_dir, "cupy_kernels/csrc"], check=True)
    with tarfile.open(tar) as t:
        t.extractall(workdir)
    return workdir / "cupy_kernels" / "csrc"


def fingerprints(csrc: Path, kernels, dims, options, rename=lambda s: s) -> dict:
    names = [f"skv::{k}<{d}>" for k in kernels for d in dims]
    blob, lowered = build(csrc, names, options)
    return {n: fingerprint(blob, lowered[n], rename) for n in names}


def old_to_new(symbol: str) -> str:
    """A mangled symbol of the old tree with the kept kernels' names replaced by today's
    (length-prefixed in the Itanium mangling)."""
    for old, new in RENAMED.items():
        symbol = symbol.replace(f"{len(old)}{old}", f"{len(new)}{new}")
    return symbol


def kept_pairs(csrc: Path) -> dict:
    """{kernel name in the tree at csrc: its name today} of the kept kernels: RENAMED's old name
    where the tree's sources still use it, else today's."""
    text = "".join(p.read_text() for p in Path(csrc).glob("*.cuh"))
    return {(old if f" {old}(" in text else new): new for old, new in RENAMED.items()}


def launch_settings(rev: str, workdir: Path) -> int:
    """Compares the revision's decode launcher with today's on every (codebook, dim, page
    bytes, rows, pages per row) of a grid, and the encode launcher's cell tables and launch
    shape; returns the number of settings compared (an AssertionError names the first that
    differs)."""
    import importlib
    import sys
    subprocess.run(["git", "archive", "-o", str(workdir / "py.tar"), rev, "cupy_kernels"], check=True)
    with tarfile.open(workdir / "py.tar") as t:
        t.extractall(workdir / "py")
    ours = {k: m for k, m in sys.modules.items() if k.startswith("cupy_kernels")}
    for k in ours:
        del sys.modules[k]
    sys.path.insert(0, str(workdir / "py"))
    try:
        old = importlib.import_module("cupy_kernels.ada_decode")
        # the tag predates kernel_tables.py (its tables come from cupy_kernels.pages)
        old_pages = (importlib.import_module("cupy_kernels.pages")
                     if (workdir / "py" / "cupy_kernels" / "pages.py").exists() else None)
        old_enc = importlib.import_module("cupy_kernels.encode")
    finally:
        sys.path.pop(0)
        for k in [k for k in sys.modules if k.startswith("cupy_kernels")]:
            del sys.modules[k]
        sys.modules.update(ours)
    new = importlib.import_module("cupy_kernels.ada_decode")
    new_enc = importlib.import_module("cupy_kernels.encode")
    from cupy_kernels.kernel_tables import kernel_tables
    old._sm_count = new._sm_count = lambda: 132
    if hasattr(old, "decode_path"):
        return same_api_settings(old, old_enc, new, new_enc, kernel_tables)
    names = {"ada_decode_v4_kernel": "ada_decode_table_kernel",
             "ada_decode_uniform_v7_kernel": "ada_decode_affine_kernel"}
    n = 0
    for codebook in ("uniform", "lloyd-max"):
        for dim in (64, 128):
            for page_bytes in (2048, 4096, 8192, 16384):
                to = old_pages.kernel_tables(LADDER, dim, page_bytes, codebook=codebook)
                tn = kernel_tables(LADDER, dim, page_bytes, codebook=codebook)
                path = new.decode_path(tn)
                v = old.default_version(to)
                uni = codebook == "uniform"
                stages = {7: old.STAGES_V7, 8: old.STAGES_V8}.get(v, 2) if uni else 2
                case = (codebook, dim, page_bytes)
                assert old.decode_smem_bytes(dim, page_bytes, uni, stages, query_apart=uni and v == 7) \
                    == new.decode_smem_bytes(dim, page_bytes, path), case
                kv = 6 if (v >= 7 and not uni) else v
                name = "ada_decode_uniform_kernel" if uni else "ada_decode_kernel"
                if kv != 5:
                    name = name.replace("_kernel", f"_v{kv}_kernel")
                assert names[name] == path.kernel, case
                assert (old.GEOM_ROWS_V7 if uni and v == 7 else 0) == path.geom_rows, case
                assert (v >= 7 and old.MERGE_V7 and old.MERGE_PDL) == path.per_head_merge, case
                assert old.MERGE7_MAX_SPLITS == new.MERGE_HEAD_MAX_SPLITS
                assert (kv >= 6) == path.mean_out_of_logits, case
                assert old.THREADS == new.THREADS
                # the encode kernels' cell tables, bit for bit, and their launch shape
                assert old_enc.v3_tables(to).tobytes() == new_enc.cell_tables(tn).tobytes(), case
                assert (old_enc.THREADS, old_enc.V2_BLOCKS_PER_SM) == (new_enc.THREADS, new_enc.BLOCKS_PER_SM)
                n += same_splits(lambda r, p: old.splits_for(to, None, r, p),
                                 lambda r, p: new.splits_for(tn, r, p), case)
    return n


def same_splits(old, new, case) -> int:
    """Asserts old(rows, total pages) == new(rows, total pages), the default split counts, on
    the grid of rows and pages per row; returns the number of points."""
    n = 0
    for rows in (1, 2, 3, 8, 16, 33, 64, 100, 256, 1000):
        for pages in (1, 7, 100, 1058, 4229, 70000):
            assert old(rows, rows * pages) == new(rows, rows * pages), case + (rows, pages)
            n += 1
    return n


def same_api_settings(old, old_enc, new, new_enc, kernel_tables) -> int:
    """launch_settings for a revision whose launchers have today's interface (DecodePath,
    cell_tables): the same comparisons, at every head dim of the module, both sides on tables
    built by today's kernel_tables."""
    import dataclasses
    n = 0
    for codebook in ("uniform", "lloyd-max"):
        for dim in (64, 128, 256):
            for page_bytes in (2048, 4096, 8192, 16384):
                tn = kernel_tables(LADDER, dim, page_bytes, codebook=codebook)
                case = (codebook, dim, page_bytes)
                po, pn = old.decode_path(tn), new.decode_path(tn)
                assert dataclasses.asdict(po) == dataclasses.asdict(pn), case
                assert old.decode_smem_bytes(dim, page_bytes, po) == new.decode_smem_bytes(dim, page_bytes, pn), case
                assert old_enc.cell_tables(tn).tobytes() == new_enc.cell_tables(tn).tobytes(), case
                n += same_splits(lambda r, p: old.splits_for(tn, r, p),
                                 lambda r, p: new.splits_for(tn, r, p), case)
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="git revision or csrc folder")
    ap.add_argument("--save", help="write both fingerprints to this JSON file")
    args = ap.parse_args(argv)
    from cupy_kernels import _module
    dims = _module.DIMS
    with tempfile.TemporaryDirectory() as tmp:
        csrc = tree(args.before, Path(tmp))
        pairs = kept_pairs(csrc)
        before = fingerprints(csrc, pairs, dims, _module.OPTIONS, old_to_new)
    after = fingerprints(_module.CSRC, RENAMED.values(), dims, _module.OPTIONS)
    missing = sorted(set(_module.KERNELS) - set(RENAMED.values()))
    if missing:
        print(f"kernels of the module with no counterpart in RENAMED: {missing}")
    same = True
    for old, new in pairs.items():
        for d in dims:
            a, b = before[f"skv::{old}<{d}>"], after[f"skv::{new}<{d}>"]
            diff = [k for k in a if a[k] != b[k]]
            same &= not diff
            print(f"{old}<{d}> -> {new}<{d}>: {'identical' if not diff else 'DIFFERS in ' + ', '.join(diff)}"
                  f" ({b['text_bytes']} bytes of code, {b['registers']} registers)")
    if args.save:
        Path(args.save).write_text(json.dumps(dict(before=before, after=after), indent=1))
    print("all kept kernels identical" if same else "some kernels differ")
    if not os.path.isdir(args.before):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"launch settings identical on {launch_settings(args.before, Path(tmp))} "
                  "(codebook, dim, page bytes, rows, pages) cases")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
