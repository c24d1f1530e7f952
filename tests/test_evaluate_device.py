"""``spherical-kv evaluate --device``: the CPU path is the default's byte for byte, a device
torch cannot see is refused at once, a run's log keeps to one device, and (with a GPU) the
model on CUDA gives the CPU's rows within their CIs and its logits within float32 rounding."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spherical_kv_eval import evaluate as E  # noqa: E402
from spherical_kv_eval.device_store import DeviceDenseStore  # noqa: E402
# run() looks its helpers up in the units module: the tests patch them there
from spherical_kv_eval import units as U  # noqa: E402

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return E.Runner(tiny_llama(512), tokenizer=None)


TINY = ("--contexts 256 --budgets 0.5 --rdr-extra --windows 2 --continuation 16 --generate 4 "
        "--probe 8 --methods skv-rdr h2o --no-peers --jobs 1").split()


@pytest.fixture
def tiny_run(worker, monkeypatch):
    """``run(out, *options) -> (rows, meta)``: the command line's run of two windows of the
    tiny model at 256 tokens (RDR and H2O at 50 %, 16 scored and 4 greedy tokens, an 8-token
    probe) and ``options``, its units run by the worker process's runner (``use`` installs
    another)."""
    ids = np.random.default_rng(7).integers(0, 101, 4000)
    monkeypatch.setattr(U, "_main_setup", lambda *a, **k: (worker.model.config, None))
    monkeypatch.setattr(U, "corpus_tokens", lambda tok, need, special=True: (ids, "test"))

    def run(out, *options):
        return E.run(E.parse(TINY + ["--out", str(out), *options]))

    def use(r):
        E._WORKER.update(runner=r, cfg=r.model.config)
    run.use = use
    return run


def _unit_lines(out):
    """The logged units of a run without their timings."""
    lines = (out / "units.jsonl").read_text().splitlines()[1:]
    return [json.dumps({k: v for k, v in json.loads(x).items() if k != "seconds"}) for x in lines]


def test_device_cpu_gives_the_default_s_rows_byte_for_byte(tiny_run, worker, tmp_path):
    """A run that names no device and one with ``device="cpu"`` through a Runner built for
    the CPU give the same rows and log the same units, to the byte; the meta says where."""
    default, meta = tiny_run(tmp_path / "default")
    tiny_run.use(E.Runner(worker.model, None, device="cpu"))
    cpu, cpu_meta = tiny_run(tmp_path / "cpu", "--device", "cpu")
    assert json.dumps(cpu) == json.dumps(default)
    assert _unit_lines(tmp_path / "cpu") == _unit_lines(tmp_path / "default")
    for m in (meta, cpu_meta):
        assert m["device"] == "cpu" and m["device_name"] and "gpu_peak_bytes" not in m
        assert m["peer_device"] == "cpu"


def test_the_device_s_statistics_and_stores_give_the_numpy_rows(tiny_run, worker, tmp_path):
    """What a run on a GPU computes in torch (the attention statistics, the dense reference's
    and the baselines' stores), here in torch on the CPU: every figure of every row the NumPy
    path's, up to float32 rounding in the statistics (exact H2O ties aside, none here)."""
    numpy_rows, _ = tiny_run(tmp_path / "numpy", "--methods", "dense", "fp8", "h2o",
                             "snapkv", "skv-rdr")
    in_torch = E.Runner(worker.model, None)
    in_torch.store_device = torch.device("cpu")
    pre = in_torch.prefill(np.arange(40) % 101)
    assert pre.device == torch.device("cpu") and isinstance(E._exact_store(pre), DeviceDenseStore)
    tiny_run.use(in_torch)
    torch_rows, _ = tiny_run(tmp_path / "torch", "--methods", "dense", "fp8", "h2o",
                             "snapkv", "skv-rdr")
    assert [r["method"] for r in torch_rows] == [r["method"] for r in numpy_rows]
    assert len(numpy_rows) == 5
    for a, b in zip(numpy_rows, torch_rows):
        for key in ("delta_ppl_pct", "kl_nats", "top1_agreement", "greedy_agreement",
                    "greedy_margin_err", "attn_out_rel_err", "bytes_fraction", "retrieval_loss"):
            if a[key] is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-12), (a["method"], key)


def test_a_log_keeps_to_one_device(tiny_run, tmp_path):
    """``--resume`` refuses a log made on another device (its units are not mixed with this
    device's); a log from before the device was a setting was made on the CPU and resumes
    there."""
    whole, _ = tiny_run(tmp_path)
    log = tmp_path / "units.jsonl"
    first, *units = log.read_text().splitlines()
    assert json.loads(first)["settings"]["device"] == "cpu"
    on_gpu = E.parse(TINY + ["--out", str(tmp_path), "--resume"])
    on_gpu.device = "cuda"          # as parsed where torch sees a GPU; refused before any use
    with pytest.raises(ValueError, match=r"other settings \(device differ"):
        E.run(on_gpu)
    settings = json.loads(first)
    del settings["settings"]["device"]
    log.write_text("\n".join([json.dumps(settings)] + units) + "\n")
    again, meta = tiny_run(tmp_path, "--resume")
    assert again == whole and meta["units_resumed"] == 3
    with pytest.raises(ValueError, match=r"device differ"):
        E.run(on_gpu)


def test_runner_options_thread_the_device_to_the_peers():
    """The peers' prefills run where the model runs unless --peer-device says otherwise."""
    opts = E.runner_options(SimpleNamespace(window_bits=4, peer_device=None))
    assert opts == {"window_bits": 4, "device": "cpu", "peer_device": None}
    assert E.runner_options(SimpleNamespace(device="cuda", peer_device=None))["peer_device"] == "cuda"
    assert E.runner_options(SimpleNamespace(device="cuda", peer_device="cpu"))["peer_device"] == "cpu"


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="torch sees no CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_dense_store_is_the_reference_dense_store(device):
    """DeviceDenseStore against DenseStore: heads of 17, 0 and 97 states (an evicting
    method's), a non-contiguous query, an append of a chunk and of one token, the bytes;
    equal up to float64 rounding, and the same refusals."""
    from spherical_kv_ref.hf import DenseStore
    rng = np.random.default_rng(2)
    d, nq = 16, 6
    keys = [[rng.standard_normal((n, d)).astype(np.float32) for n in (17, 0, 97)] for _ in range(2)]
    values = [[rng.standard_normal((n, d)).astype(np.float32) for n in (17, 0, 97)] for _ in range(2)]
    ref, dev = (cls(keys, values, nq, 1000, **kw) for cls, kw in
                ((DenseStore, {}), (DeviceDenseStore, {"device": device})))
    q = rng.standard_normal((nq, 10, 2 * d))[:, :, ::2]          # strided
    for chunk in (5, 1):
        for layer in range(2):
            (o1, l1), (o2, l2) = ref.attend(layer, q, 0.25), dev.attend(layer, q, 0.25)
            assert o2.dtype == np.float64 and o2.shape == (nq, 10, d) and l2.shape == (nq, 10)
            np.testing.assert_allclose(o2, o1, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(l2, l1, rtol=1e-12, atol=1e-12)
            k, v = rng.standard_normal((2, 3, chunk, d))
            assert ref.append(layer, k, v)[0] is k and dev.append(layer, k, v)[0] is k
        assert dev.nbytes() == ref.nbytes()
    with pytest.raises(ValueError, match="keys"):
        DeviceDenseStore([[np.full((2, d), np.nan)]], [[np.zeros((2, d))]], 1, 0, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_spherical_store_is_the_reference_spherical_store(device):
    """DeviceSphericalStore against SphericalStore over one compressed sequence (centred,
    RDR to a budget that evicts and demotes, so several tiers and an empty-headed layer can
    occur): attention of a strided query block before and after appends of a chunk and of
    one token, the held states an append returns and the bytes, equal up to float64
    rounding; the sequence's pages are the reference cache's own."""
    from spherical_kv_eval.device_store import DeviceSphericalStore
    from spherical_kv_ref.cache import CompressPolicy, SphericalKVCache
    from spherical_kv_ref.hf import SphericalStore, fill_cache
    from spherical_kv_ref.tiers import TierLadder
    rng = np.random.default_rng(5)
    L, H, nq, d, n = 2, 2, 4, 16, 120

    def build():
        kv = SphericalKVCache(L, H, d, TierLadder(), page_bytes=512, pool_bytes=1 << 20, seed=3,
                              num_q_heads=nq, policy=CompressPolicy(sinks=2, recent=8, window=8))
        g = np.random.default_rng(11)
        seq = fill_cache(kv, [g.standard_normal((H, n, d)) for _ in range(L)],
                         [g.standard_normal((H, n, d)) for _ in range(L)],
                         [g.standard_normal((nq, 8, d)) for _ in range(L)])
        kv.compress(seq, int(0.25 * kv.bytes_in_use(seq)))
        return kv, seq
    ref = SphericalStore(*build())
    dev = DeviceSphericalStore(*build(), device=device)
    assert len({t for layer in range(L) for h in range(H)
                for t in ref.kv.paged.gather((ref.seq, layer, h))}) > 1     # a mix of tiers
    q = rng.standard_normal((nq, 9, 2 * d))[:, :, ::2]
    for chunk in (5, 1, 0):
        for layer in range(L):
            (o1, l1), (o2, l2) = ref.attend(layer, q, 0.3), dev.attend(layer, q, 0.3)
            assert o2.dtype == np.float64 and o2.shape == (nq, 9, d) and l2.shape == (nq, 9)
            np.testing.assert_allclose(o2, o1, rtol=1e-11, atol=1e-12)
            np.testing.assert_allclose(l2, l1, rtol=1e-11, atol=1e-12)
            if chunk:
                k, v = rng.standard_normal((2, H, chunk, d))
                for a, b in zip(ref.append(layer, k, v), dev.append(layer, k, v)):
                    np.testing.assert_array_equal(a, b)
        assert dev.nbytes() == ref.nbytes()


def test_rdr_points_of_a_unit_share_one_encoding_and_give_what_fresh_builds_give(runner):
    """Every RDR point (and the probe's protected build) of a unit compresses its own copy of
    one filled cache: the same bytes and attention, to the bit, as a build from a prefill that
    has filled none, and no build changes the cache the next one copies."""
    import dataclasses
    from spherical_kv_eval.lineup import lineup
    pre = runner.prefill(np.arange(400) % 101)
    rdr = [m for m in lineup(runner.cfg, [0.6, 0.45], peers=False) if m.family == "skv-rdr"]
    assert len(rdr) == 2
    q = np.random.default_rng(3).standard_normal((runner.cfg.num_attention_heads, 5, 16))
    for m in rdr + rdr:
        for protect in ((), ((40, 60),)):
            shared, n1 = m.build(pre, protect=protect)
            fresh, n2 = m.build(dataclasses.replace(pre, filled={}), protect=protect)
            assert n1 == n2
            for layer in range(runner.cfg.num_hidden_layers):
                for a, b in zip(shared.attend(layer, q, 0.25), fresh.attend(layer, q, 0.25)):
                    np.testing.assert_array_equal(a, b)
    assert len(pre.filled) == 1


@pytest.mark.skipif(CUDA, reason="checks the refusal where torch sees no CUDA device")
def test_device_cuda_without_cuda_fails_at_once(runner, capsys):
    with pytest.raises(SystemExit):
        E.parse(["--device", "cuda"])
    err = capsys.readouterr().err
    assert "--device cuda" in err and "no CUDA device" in err and "--device cpu" in err
    with pytest.raises(ValueError, match="sees no CUDA device"):
        E.Runner(runner.model, None, device="cuda")
    with pytest.raises(ValueError, match="one of cpu, cuda"):
        E.check_device("tpu")
    with pytest.raises(SystemExit):
        E.parse(["--device", "tpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="torch sees no CUDA device")
def test_the_model_on_cuda_gives_the_cpu_s_rows_and_logits(tiny_run, worker, tmp_path):
    """Two windows on the CPU and on CUDA: every figure of every row within the CPU row's
    95 % CI (or float32 rounding where the CI is 0), the same next tokens at 16 of 16
    positions and log-probabilities within float32 rounding; the meta names the GPU and the
    peak memory."""
    gpu = E.Runner(worker.model, None, device="cuda")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 101, 216)
    ctx, cont = ids[:200], ids[200:]
    lps = []
    for r in (worker, gpu):
        pre = r.prefill(ctx)
        lps.append(r.logprobs(E._exact_store(pre), pre, cont))
    assert isinstance(E._exact_store(pre), DeviceDenseStore)
    assert lps[0].shape == (16, 101)
    assert np.array_equal(lps[0].argmax(axis=1), lps[1].argmax(axis=1))
    np.testing.assert_allclose(lps[1], lps[0], atol=1e-4)

    cpu_rows, _ = tiny_run(tmp_path / "cpu")
    tiny_run.use(gpu)
    cuda_rows, meta = tiny_run(tmp_path / "cuda", "--device", "cuda")
    assert meta["device"] == "cuda" and meta["device_name"] and meta["gpu_peak_bytes"] > 0
    assert [r["method"] for r in cuda_rows] == [r["method"] for r in cpu_rows]
    for c, g in zip(cpu_rows, cuda_rows):
        for key in ("delta_ppl_pct", "kl_nats", "top1_agreement", "greedy_agreement",
                    "greedy_token_agreement", "greedy_margin_err", "attn_out_rel_err"):
            ci = "delta_ppl_ci95" if key == "delta_ppl_pct" else key + "_ci95"
            half = max(c[ci], 1e-5)
            assert abs(g[key] - c[key]) <= half, (c["method"], key, c[key], g[key], half)
        # the budgets bind both: at most a page apart where RDR's allocation moved
        assert g["bytes_fraction"] == pytest.approx(c["bytes_fraction"], abs=0.01)


@pytest.mark.gpu
@pytest.mark.parametrize("T, window, stride, block", __import__("test_baselines").STATS_CASES)
def test_attention_stats_on_the_gpu_are_the_numpy_reference_s(T, window, stride, block):
    """test_baselines' torch-statistics check, on a CUDA device (skipped without one)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from test_baselines import test_attention_stats_in_torch_are_the_numpy_reference_s as check
    check("cuda", T, window, stride, block)

