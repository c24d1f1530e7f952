"""Real English text for the model evaluation: Jane Austen's six novels.

The novels come from Debian's ``r-cran-janeaustenr`` package. It is fetched with
``apt-get download`` (no R needed), unpacked with ``dpkg -x`` into the cache directory
(``$SPHERICAL_KV_CACHE``, default ``~/.cache/spherical_kv``), and its lazy-load database
``data/Rdata.rdb`` + ``data/Rdata.rdx`` is parsed by the small R-serialization reader in
this module.

Lazy-load database, as R writes it:

* ``Rdata.rdx`` is an RDS file (gzip, bzip2 or xz around an R serialization; a bare
  4-byte length + zlib stream is accepted as well) of a named list with ``variables``
  (name -> integer (offset, length) into the ``.rdb``), ``references`` and
  ``compressed`` (TRUE = zlib, 2 = bzip2, 3 = xz).
* each ``.rdb`` chunk is a 4-byte big-endian uncompressed length, then (for 2 and 3) one
  type byte (``'Z'`` xz, ``'2'`` bzip2, ``'0'`` stored), then the compressed R
  serialization of one object.

The R serialization (format ``'X'``, XDR big-endian, versions 2 and 3) is read by
:func:`unserialize`. Version 1.0.0 of the Debian package stores one character vector
per novel (``emma``, ``persuasion``, ...); older versions also hold the data frame
``austen_books`` (``text`` character, ``book`` factor); both layouts are understood.

Where the package cannot be had (no apt-get, no dpkg, not root for ``apt-get update``,
no network), :func:`load_austen` falls back to the English licence texts that every
Debian system ships under ``/usr/share/common-licenses`` and warns that it did so.
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import os
import pathlib
import shutil
import struct
import subprocess
import tempfile
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "AUSTEN_TITLES", "Corpus", "DataUnavailable", "RObject", "cache_dir",
    "fetch_janeaustenr", "load_austen", "read_lazyload_db", "austen_from_rdata",
    "unserialize", "read_rds_bytes",
]

DEBIAN_PACKAGE = "r-cran-janeaustenr"
_DATA_SUBDIR = pathlib.Path("usr/lib/R/site-library/janeaustenr/data")
_SYSTEM_DATA_DIR = pathlib.Path("/") / _DATA_SUBDIR
_FALLBACK_DIR = pathlib.Path("/usr/share/common-licenses")
_FALLBACK_FILES = ("GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-2.0", "Apache-2.0")

# Variable name in the package -> title, in publication order (as janeaustenr names them).
AUSTEN_TITLES = {
    "sensesensibility": "Sense & Sensibility",
    "prideprejudice": "Pride & Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


class DataUnavailable(RuntimeError):
    """The Debian package could not be obtained here (no apt, no network, not root...)."""


# --------------------------------------------------------------------------------------
# R serialization reader
# --------------------------------------------------------------------------------------

# SEXP type codes (R internals) and the pseudo-types of the serialization format.
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP = 9, 10, 13, 14, 15, 16
DOTSXP, VECSXP, EXPRSXP, RAWSXP = 17, 19, 20, 24
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP = 255, 254, 253, 252
MISSINGARG_SXP, BASENAMESPACE_SXP, NAMESPACESXP, PACKAGESXP = 251, 250, 249, 248
PERSISTSXP, EMPTYENV_SXP, BASEENV_SXP, ALTREP_SXP = 247, 242, 241, 238

_SPECIAL_NAMES = {
    GLOBALENV_SXP: "<globalenv>", UNBOUNDVALUE_SXP: "<unbound>",
    MISSINGARG_SXP: "<missing-arg>", BASENAMESPACE_SXP: "<base-namespace>",
    EMPTYENV_SXP: "<emptyenv>", BASEENV_SXP: "<baseenv>",
}
_PAIRLIST_TYPES = (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP)

# Flag bits of an item header: type in bits 0-7, then object, attribute and tag bits,
# the "levels" (gp field, which holds a CHARSXP's encoding) from bit 12 up.
_IS_OBJECT, _HAS_ATTR, _HAS_TAG = 1 << 8, 1 << 9, 1 << 10
_LATIN1_MASK, _BYTES_MASK = 1 << 2, 1 << 1

NA_INTEGER = -(2 ** 31)


@dataclass
class RObject:
    """One decoded R object.

    ``sexptype`` is the R type code; ``value`` is a NumPy array (logical / integer as
    int32 with ``NA_INTEGER``, double float64, complex128), a ``list`` (character vector:
    ``str`` or ``None`` for NA; generic vector: items), a ``list`` of ``(tag, value)``
    pairs (pairlists), ``bytes`` (raw) or a ``str`` (symbol name, special environment).
    ``attributes`` maps attribute names to decoded objects.
    """

    sexptype: int
    value: Any
    attributes: dict[str, Any] = field(default_factory=dict)

    def attr(self, name: str) -> Any:
        """The attribute's plain value (``None`` if absent)."""
        a = self.attributes.get(name)
        return a.value if isinstance(a, RObject) else a

    @property
    def names(self) -> list | None:
        return self.attr("names")

    @property
    def classes(self) -> list:
        return list(self.attr("class") or [])

    def __len__(self) -> int:
        return len(self.value)


class _Reader:
    """Sequential reader of one XDR serialization stream, with R's reference table."""

    def __init__(self, data: bytes):
        self.buf = memoryview(data)
        self.pos = 0
        self.refs: list[Any] = []

    def _take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(
                f"truncated R serialization: need {n} bytes at offset {self.pos}, "
                f"{len(self.buf) - self.pos} left")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: upper and lower 32-bit halves
            hi, lo = struct.unpack(">II", self._take(8))
            n = (hi << 32) | lo
        if n < 0:
            raise ValueError(f"negative vector length {n} in R serialization")
        return n

    def array(self, dtype: str, n: int) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        return np.frombuffer(self._take(n * itemsize), dtype=dtype).astype(
            np.dtype(dtype).newbyteorder("="))

    # -- items -------------------------------------------------------------------------
    def item(self) -> Any:
        return self.item_with_flags(self.int())

    def item_with_flags(self, flags: int) -> Any:
        t = flags & 0xFF
        if t == NILVALUE_SXP or t == NILSXP:
            return None
        if t == REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            if not 1 <= idx <= len(self.refs):
                raise ValueError(f"R serialization refers to entry {idx} of a reference "
                                 f"table with {len(self.refs)} entries")
            return self.refs[idx - 1]
        if t in _SPECIAL_NAMES:
            return RObject(t, _SPECIAL_NAMES[t])
        if t == SYMSXP:
            name = self.item()  # a CHARSXP, decoded to str
            sym = RObject(SYMSXP, name)
            self.refs.append(sym)
            return sym
        if t in (PACKAGESXP, NAMESPACESXP, PERSISTSXP):
            if self.int() != 0:
                raise ValueError("malformed string vector in a persistent reference")
            strings = [self.item() for _ in range(self.length())]
            obj = RObject(t, strings)
            self.refs.append(obj)
            return obj
        if t == ENVSXP:
            self.int()  # locked flag
            env = RObject(ENVSXP, {})
            self.refs.append(env)  # before the contents: they may refer back to it
            enclos, frame, hashtab, attrib = (self.item() for _ in range(4))
            env.value = {"enclos": enclos, "frame": frame, "hashtab": hashtab}
            env.attributes = _pairlist_dict(attrib)
            return env
        if t == ALTREP_SXP:
            return self._altrep()
        if t in _PAIRLIST_TYPES:
            return self._pairlist(flags)
        if t == CHARSXP:
            return self._charsxp(flags)

        n = self.length()
        if t in (LGLSXP, INTSXP):
            obj = RObject(t, self.array(">i4", n))
        elif t == REALSXP:
            obj = RObject(t, self.array(">f8", n))
        elif t == CPLXSXP:
            obj = RObject(t, self.array(">c16", n))
        elif t == STRSXP:
            obj = RObject(t, [self.item() for _ in range(n)])
        elif t in (VECSXP, EXPRSXP):
            obj = RObject(t, [self.item() for _ in range(n)])
        elif t == RAWSXP:
            obj = RObject(t, bytes(self._take(n)))
        else:
            raise ValueError(f"unsupported SEXP type {t} in R serialization "
                             f"(at offset {self.pos - 8})")
        if flags & _HAS_ATTR:
            obj.attributes = _pairlist_dict(self.item())
        return obj

    def _charsxp(self, flags: int) -> str | None:
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = bytes(self._take(n))
        levels = flags >> 12
        if levels & _LATIN1_MASK:
            return raw.decode("latin-1")
        if levels & _BYTES_MASK:
            return raw.decode("latin-1")
        return raw.decode("utf-8", errors="replace")

    def _pairlist(self, flags: int) -> RObject:
        # Read cell after cell instead of recursing on CDR: pairlists can be long.
        head = RObject(flags & 0xFF, [])
        if flags & _HAS_ATTR:
            head.attributes = _pairlist_dict(self.item())
        while True:
            tag = self.item() if flags & _HAS_TAG else None
            head.value.append((tag.value if isinstance(tag, RObject) else tag, self.item()))
            flags = self.int()
            t = flags & 0xFF
            if t in (NILVALUE_SXP, NILSXP):
                return head
            if t != head.sexptype:
                # a dotted pair: keep the CDR as a final untagged element
                head.value.append((None, self.item_with_flags(flags)))
                return head
            if flags & _HAS_ATTR:
                self.item()  # attributes on inner cells carry nothing we need

    def _altrep(self) -> RObject:
        info, state, attr = self.item(), self.item(), self.item()
        if not (isinstance(info, RObject) and info.sexptype == LISTSXP and info.value):
            raise ValueError("malformed ALTREP class information")
        cls = info.value[0][1].value
        obj = _expand_altrep(cls, state)
        obj.attributes = _pairlist_dict(attr)
        return obj


def _expand_altrep(cls: str, state: Any) -> RObject:
    """The ordinary vector an ALTREP compact form stands for."""
    if cls in ("compact_intseq", "compact_realseq"):
        n, start, step = (float(x) for x in state.value[:3])
        seq = start + step * np.arange(int(n), dtype=np.float64)
        if cls == "compact_intseq":
            return RObject(INTSXP, seq.astype(np.int32))
        return RObject(REALSXP, seq)
    if cls.startswith("wrap_"):
        inner = state.value[0]  # state = list(x, meta)
        return RObject(inner.sexptype, inner.value, dict(inner.attributes))
    if cls == "deferred_string":
        arg = state.value[0][1] if state.sexptype == LISTSXP else state
        vals = arg.value
        if arg.sexptype == REALSXP:
            strings = [None if np.isnan(v) else f"{v:.15g}" for v in vals]
        else:
            strings = [None if v == NA_INTEGER else str(int(v)) for v in vals]
        return RObject(STRSXP, strings)
    raise ValueError(f"unsupported ALTREP class {cls!r} in R serialization")


def _pairlist_dict(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if not isinstance(obj, RObject) or obj.sexptype != LISTSXP:
        raise ValueError("attributes of an R object must be a pairlist")
    return {tag: val for tag, val in obj.value}


def unserialize(data: bytes) -> Any:
    """Decode one R serialization (format 'X', XDR binary, version 2 or 3).

    Returns an :class:`RObject` (``None`` for R's NULL). Raises ValueError for other
    formats (ASCII 'A', native binary 'B'), other versions and malformed streams.
    """
    if len(data) < 2 or data[:2] != b"X\n":
        head = bytes(data[:2])
        raise ValueError(f"not an XDR R serialization (starts with {head!r}; "
                         "only format 'X' is supported)")
    r = _Reader(data)
    r.pos = 2
    version = r.int()
    r.int()  # R version that wrote it
    r.int()  # minimal R version to read it
    if version == 3:
        r._take(r.int())  # native encoding name, e.g. b"UTF-8"
    elif version != 2:
        raise ValueError(f"R serialization version {version} is not supported (2 or 3)")
    return r.item()


def read_rds_bytes(data: bytes) -> Any:
    """Decode an RDS file's bytes: gzip / bzip2 / xz / bare (length + zlib) / plain."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    elif data[:3] == b"BZh":
        data = bz2.decompress(data)
    elif data[:6] == b"\xfd7zXZ\x00":
        data = lzma.decompress(data)
    elif data[:2] != b"X\n" and len(data) > 6 and data[4] == 0x78:
        data = _zlib_chunk(data)
    return unserialize(data)


def _zlib_chunk(raw: bytes) -> bytes:
    expected = struct.unpack(">I", raw[:4])[0]
    out = zlib.decompress(raw[4:])
    if len(out) != expected:
        raise ValueError(f"lazy-load chunk says {expected} bytes, inflates to {len(out)}")
    return out


def _decompress_chunk(raw: bytes, compressed: int) -> bytes:
    if compressed == 0:
        return raw
    if compressed == 1:
        return _zlib_chunk(raw)
    expected = struct.unpack(">I", raw[:4])[0]
    kind, body = raw[4:5], raw[5:]
    if kind == b"0":
        out = body
    elif kind == b"2":
        out = bz2.decompress(body)
    elif kind == b"Z":
        try:
            out = lzma.decompress(body)
        except lzma.LZMAError:
            out = lzma.decompress(body, format=lzma.FORMAT_RAW, filters=[
                {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}])
    else:
        raise ValueError(f"unknown lazy-load chunk compression type {kind!r}")
    if len(out) != expected:
        raise ValueError(f"lazy-load chunk says {expected} bytes, inflates to {len(out)}")
    return out


def read_lazyload_db(data_dir: str | os.PathLike, stem: str = "Rdata") -> dict[str, Any]:
    """Every variable of the lazy-load database ``<stem>.rdb`` + ``<stem>.rdx``."""
    data_dir = pathlib.Path(data_dir)
    rdx, rdb = data_dir / f"{stem}.rdx", data_dir / f"{stem}.rdb"
    for p in (rdx, rdb):
        if not p.is_file():
            raise FileNotFoundError(f"lazy-load database file {p} does not exist")
    index = read_rds_bytes(rdx.read_bytes())
    if not (isinstance(index, RObject) and index.sexptype == VECSXP and index.names):
        raise ValueError(f"{rdx} is not a lazy-load index (a named list)")
    parts = dict(zip(index.names, index.value))
    if "variables" not in parts:
        raise ValueError(f"{rdx} has no 'variables' entry")
    comp = parts.get("compressed")
    compressed = 1 if comp is None else int(comp.value[0])
    variables = parts["variables"]
    blob = rdb.read_bytes()
    out = {}
    for name, where in zip(variables.names or [], variables.value):
        offset, length = (int(x) for x in where.value[:2])
        if offset < 0 or offset + length > len(blob):
            raise ValueError(f"variable {name!r}: chunk [{offset}, {offset + length}) lies "
                             f"outside {rdb} ({len(blob)} bytes)")
        out[name] = unserialize(_decompress_chunk(blob[offset:offset + length], compressed))
    return out


def _factor_labels(obj: RObject) -> list:
    levels = obj.attr("levels")
    if obj.sexptype != INTSXP or levels is None:
        raise ValueError("not an R factor (integer codes with a 'levels' attribute)")
    return [None if c == NA_INTEGER else levels[c - 1] for c in obj.value]


def austen_from_rdata(objects: dict[str, Any], *, reflow: bool = True) -> dict[str, str]:
    """Title -> full text from the package's data objects.

    The package holds the novels as fixed-width lines. ``reflow=True`` joins the lines
    of a paragraph with spaces and separates paragraphs by a blank line (natural prose,
    what a language model was trained on); ``reflow=False`` joins every line with a
    newline, keeping the original wrapping.

    Understands the data frame ``austen_books`` (``text``, ``book`` factor) and the
    per-novel character vectors (``emma``, ``persuasion``, ...).
    """
    lines: dict[str, list[str]] = {}
    books = objects.get("austen_books")
    if isinstance(books, RObject) and "data.frame" in books.classes:
        cols = dict(zip(books.names, books.value))
        if "text" not in cols or "book" not in cols:
            raise ValueError("austen_books lacks the 'text' or 'book' column")
        for text, book in zip(cols["text"].value, _factor_labels(cols["book"])):
            lines.setdefault(book, []).append(text or "")
    else:
        for var, title in AUSTEN_TITLES.items():
            obj = objects.get(var)
            if isinstance(obj, RObject) and obj.sexptype == STRSXP:
                lines[title] = [s or "" for s in obj.value]
    if not lines:
        raise ValueError("no Jane Austen novel found among the objects "
                         f"{sorted(objects)}")
    order = {t: i for i, t in enumerate(AUSTEN_TITLES.values())}
    join = _reflow if reflow else "\n".join
    return {t: join(lines[t]).strip() + "\n"
            for t in sorted(lines, key=lambda t: order.get(t, len(order)))}


def _reflow(lines: list[str]) -> str:
    """Undo the fixed-width line wrapping: lines of one paragraph joined by spaces,
    paragraphs (runs of blank lines) separated by one blank line."""
    paragraphs, current = [], []
    for line in lines:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


# --------------------------------------------------------------------------------------
# Obtaining the package
# --------------------------------------------------------------------------------------

def cache_dir() -> pathlib.Path:
    """``$SPHERICAL_KV_CACHE`` or ``~/.cache/spherical_kv``."""
    env = os.environ.get("SPHERICAL_KV_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "spherical_kv"


def _run(cmd: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def fetch_janeaustenr(root: str | os.PathLike | None = None) -> pathlib.Path:
    """The package's ``data`` directory, downloading and unpacking it if needed.

    Looks in ``<root>/debian/r-cran-janeaustenr`` (``root`` defaults to
    :func:`cache_dir`), then at a system-wide R installation, then runs
    ``apt-get download`` (after one ``apt-get update`` when the package is unknown and
    we are root) and ``dpkg -x``. Raises :class:`DataUnavailable` when that fails.
    """
    root = pathlib.Path(root) if root is not None else cache_dir()
    target = root / "debian" / DEBIAN_PACKAGE
    data_dir = target / _DATA_SUBDIR
    if (data_dir / "Rdata.rdb").is_file():
        return data_dir
    if (_SYSTEM_DATA_DIR / "Rdata.rdb").is_file():
        return _SYSTEM_DATA_DIR
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise DataUnavailable(f"{tool} is not available to fetch {DEBIAN_PACKAGE}")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tmp = pathlib.Path(tmp)
        os.chmod(tmp, 0o755)  # lets apt's unprivileged download user write here
        res = _run(["apt-get", "download", DEBIAN_PACKAGE], tmp)
        if res.returncode != 0 and hasattr(os, "geteuid") and os.geteuid() == 0:
            upd = _run(["apt-get", "update"], tmp)
            if upd.returncode != 0:
                raise DataUnavailable(f"apt-get update failed: {upd.stderr.strip()[-300:]}")
            res = _run(["apt-get", "download", DEBIAN_PACKAGE], tmp)
        if res.returncode != 0:
            raise DataUnavailable(
                f"apt-get download {DEBIAN_PACKAGE} failed (an 'apt-get update' as root "
                f"may be needed): {res.stderr.strip()[-300:]}")
        debs = sorted(tmp.glob(f"{DEBIAN_PACKAGE}_*.deb"))
        if not debs:
            raise DataUnavailable(f"apt-get download produced no {DEBIAN_PACKAGE} .deb")
        unpack = tmp / "unpacked"
        res = _run(["dpkg", "-x", str(debs[-1]), str(unpack)], tmp)
        if res.returncode != 0 or not (unpack / _DATA_SUBDIR / "Rdata.rdb").is_file():
            raise DataUnavailable(f"dpkg -x of {debs[-1].name} failed: {res.stderr[-300:]}")
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(unpack, target)  # atomic: a half-unpacked tree is never seen
    return data_dir


@dataclass(frozen=True)
class Corpus:
    """Texts by title. ``source`` names where they came from; ``is_fallback`` is True
    when the Austen package could not be had and licence texts stand in."""

    source: str
    texts: dict[str, str]
    is_fallback: bool = False

    def joined(self, separator: str = "\n\n") -> str:
        return separator.join(self.texts.values())


def _fallback_corpus(reason: str, reflow: bool = True) -> Corpus:
    texts = {}
    for name in _FALLBACK_FILES:
        p = _FALLBACK_DIR / name
        if p.is_file():
            text = p.read_text(encoding="utf-8", errors="replace")
            texts[name] = _reflow(text.splitlines()) + "\n" if reflow else text
    if not texts:
        raise DataUnavailable(f"{reason}; and no fallback text in {_FALLBACK_DIR}")
    warnings.warn(
        f"Jane Austen's novels are unavailable ({reason}); using the English licence "
        f"texts {sorted(texts)} from {_FALLBACK_DIR} instead", RuntimeWarning,
        stacklevel=3)
    return Corpus(source=f"fallback:{_FALLBACK_DIR}", texts=texts, is_fallback=True)


def load_austen(root: str | os.PathLike | None = None, *, fallback: bool = True,
                reflow: bool = True) -> Corpus:
    """Jane Austen's six novels by title (see module docstring for how).

    ``fallback=False`` raises :class:`DataUnavailable` instead of substituting text;
    ``reflow`` as in :func:`austen_from_rdata` (the fallback texts are reflowed too).
    """
    try:
        data_dir = fetch_janeaustenr(root)
    except (DataUnavailable, OSError, subprocess.SubprocessError) as exc:
        if not fallback:
            raise DataUnavailable(str(exc)) from exc
        return _fallback_corpus(str(exc), reflow)
    texts = austen_from_rdata(read_lazyload_db(data_dir), reflow=reflow)
    return Corpus(source=f"debian:{DEBIAN_PACKAGE}:{data_dir}", texts=texts)
