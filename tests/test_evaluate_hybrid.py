"""The evaluation on a sliding-window hybrid (a tiny random Gemma-3, window 8: the real run
needs Gemma-3-270M): the sliding layers keep their windows as the model holds them in every
method, the methods compress the full-attention layers only, the budget is of the whole
cache with the windows' bytes taken off first, and a budget the windows alone exceed gives
no point."""
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spherical_kv_eval import evaluate as E  # noqa: E402
from spherical_kv_eval import model as M  # noqa: E402

WINDOW = 8
KINDS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _gemma():
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        query_pre_attn_scalar=64, max_position_embeddings=512, layer_types=KINDS)
    return transformers.Gemma3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def runner():
    return E.Runner(_gemma(), tokenizer=None)




def test_prefill_splits_full_layers_from_windows_and_the_exact_store_is_the_model(runner):
    ids = np.random.default_rng(0).integers(0, 101, 70)
    ctx, cont = ids[:50], ids[50:]
    pre = runner.prefill(ctx, observe=16)
    assert pre.store_layers == (1, 3) and pre.window_layers == (0, 2)
    assert [k.shape for k in pre.keys] == [(1, 50, 32)] * 2
    assert [q.shape for q in pre.queries] == [(4, 16, 32)] * 2
    assert [k.shape for k, _ in pre.windows] == [(1, WINDOW - 1, 32)] * 2
    assert pre.scale == pytest.approx(64 ** -0.5)          # Gemma's own, not 1/sqrt(head_dim)
    # the queries the statistics rank by are the attention's own (after QK-norm and RoPE):
    # their last 16 are the ones the cache recorded for RDR
    assert pre.stats.accumulated[0].shape == (1, 50)
    # window bytes: two layers of 7 states, keys and values at bf16; the total adds the full
    # layers' 50 states
    assert pre.window_bytes == 2 * 2 * 7 * 32 * 2
    assert pre.dense_bytes == pre.window_bytes + 2 * 2 * 50 * 32 * 2
    # through the exact store and the windows the teacher-forced log-probs are the model's
    dense = runner.logprobs(E._exact_store(pre), pre, cont)
    with torch.no_grad():
        ref = torch.log_softmax(runner.model(torch.as_tensor(ids)[None]).logits[0].double(), -1).numpy()
    np.testing.assert_allclose(dense[1:], ref[50:-1], atol=1e-4)


def test_a_chunked_prefill_leaves_what_one_pass_leaves(runner):
    """The Runner prefills a sliding-window model in chunks (linear in T for the window
    layers): keys, windows, queries, statistics and last logits are the one-pass ones."""
    ids = np.random.default_rng(4).integers(0, 101, 45)
    one = E.Runner(runner.model, None, prefill_chunk=10 ** 6).prefill(ids, observe=8)
    chunked = E.Runner(runner.model, None, prefill_chunk=13).prefill(ids, observe=8)
    assert runner.prefill_chunk == E.PREFILL_CHUNK
    for a, b in [(one.keys, chunked.keys), (one.values, chunked.values),
                 (one.queries, chunked.queries), (one.stats.accumulated, chunked.stats.accumulated),
                 ([w[0] for w in one.windows], [w[0] for w in chunked.windows])]:
        for x, y in zip(a, b):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(one.last_logits, chunked.last_logits, rtol=1e-4, atol=1e-5)


def test_recorded_queries_are_the_ones_the_attention_reads(runner):
    """``recording_attention`` sees Gemma's normed, rotated queries: the observation window
    the cache records for RDR is their tail."""
    ids = np.random.default_rng(1).integers(0, 101, 30)
    from spherical_kv_ref.hf import SphericalCache
    cache = SphericalCache(runner.cfg, observe=5, budget_fraction=None)
    with M.recording_attention(runner.model) as seen, torch.no_grad():
        runner.model(torch.as_tensor(ids)[None], past_key_values=cache)
    assert sorted(seen) == [0, 1, 2, 3]
    for layer in (1, 3):
        np.testing.assert_allclose(seen[layer][0][:, -5:], cache.observed[layer], rtol=1e-6)
    assert runner.model.config._attn_implementation == "spherical_kv"     # restored


def test_budgets_are_of_the_whole_cache_with_the_windows_off_first(runner):
    pre = runner.prefill(np.random.default_rng(2).integers(0, 101, 400))
    share = pre.window_bytes / pre.dense_bytes
    assert share == pytest.approx(7 / 407)                  # 7 window states against 400
    methods = {m.name: m for m in E.lineup(runner.cfg, [0.5, 0.25], rdr_extra=[0.01])}
    for name, b in (("skv-rdr@50%", 0.5), ("skv-rdr@25%", 0.25), ("h2o@25%", 0.25),
                    ("snapkv@50%", 0.5), ("streamingllm@25%", 0.25)):
        store, nbytes = methods[name].build(pre)
        assert nbytes <= b * pre.dense_bytes, name
        # the full-attention layers get what the windows leave: nearly all of it
        assert nbytes > (b - 0.03) * pre.dense_bytes, name
        assert store.num_kv_heads == 1
    # every method counts the windows in its bytes, the dense one at 100 %
    _, dense = methods["dense-bf16"].build(pre)
    assert dense == pre.dense_bytes
    _, fixed = methods["skv-fixed-4/4"].build(pre)
    assert pre.window_bytes < fixed < 0.35 * pre.dense_bytes
    with pytest.raises(E.Infeasible):
        methods["skv-rdr@1%"].build(pre)


def test_a_unit_scores_every_feasible_method_and_skips_the_rest(worker):
    ids = np.random.default_rng(3).integers(0, 101, 800)
    args = SimpleNamespace(budgets=[0.25], rdr_extra=[0.01], rdr_recent=[32],
                           methods=["dense", "skv-rdr", "h2o", "skv-fixed-4"], continuation=12,
                           generate=6, defer=0, probe=8, seed=0, bos=1, peers=False)
    out = E._unit((400, 0, 40, args, ids, 0))
    assert out["window_bytes"] == pytest.approx(7 / 407)
    got = out["methods"]
    assert "skv-rdr@1%" not in got                          # below the windows' bytes
    assert got["dense-bf16"]["kl"] == pytest.approx(0.0, abs=1e-5)
    assert got["skv-rdr@25%"]["bytes"] <= 0.25
    assert 0 < got["skv-rdr@25%"]["store_bytes"] < 0.25 * 1.1
    assert got["skv-fixed-4/4"]["kl"] > 0
    probe = E._unit((400, "probe", 40, args, ids, 0))["methods"]
    assert "ret_p" in probe["skv-rdr@25%"] and "skv-rdr@1%" not in probe


def test_contexts_start_with_bos_where_the_model_wants_it():
    ids = np.arange(100, 200)
    ctx, cont = E.window(ids, 10, 20, 5, bos=2)
    assert ctx[0] == 2 and list(ctx[1:]) == list(range(110, 129)) and list(cont) == list(range(129, 134))
    ctx, cont = E.window(ids, 10, 20, 5)
    assert list(ctx) == list(range(110, 130)) and list(cont) == list(range(130, 135))
    pctx, span, start = E.probe_context(ids, 40, 4, np.random.default_rng(0), bos=2)
    assert pctx[0] == 2 and start == 5 and list(pctx[5:9]) == list(span) and len(pctx) == 40


def test_cli_takes_the_model_and_its_long_contexts():
    a = E.parse(["--model", "gemma3-270m", "--windows", "16"])
    assert a.contexts == [8192, 16384, 32768] and a.windows == 16
    a = E.parse(["--model", "gemma3-270m", "--context", "2048"])
    assert a.contexts == [2048]
    assert E.parse([]).contexts == [2048, 4096] and E.parse([]).model == "smollm2"
    with pytest.raises(SystemExit):
        E.parse(["--model", "gemma3-270m", "--contexts", "65536"])


def test_layer_summary_says_what_the_budget_is_of(runner):
    got = E.layer_summary(runner.cfg)
    assert got["full_attention"] == [1, 3] and got["sliding_attention"] == [0, 2]
    assert got["sliding_window"] == WINDOW and "windows" in got["budget_of"]


def test_model_registry_checks_gemma_geometry():
    cfg = transformers.Gemma3TextConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        layer_types=["full_attention" if i in (5, 11, 17) else "sliding_attention" for i in range(18)])
    M.check_config(cfg, "gemma3-270m")
    cfg.layer_types = ["full_attention"] * 18
    with pytest.raises(ValueError, match="layer kinds"):
        M.check_config(cfg, "gemma3-270m")
    with pytest.raises(ValueError, match="unknown model"):
        M.check_config(cfg, "llama-7b")
    assert "Gemma-3-270M" in M.describe_model("gemma3-270m")


def test_pages_hold_as_many_states_at_every_head_dim():
    from spherical_kv_ref.tiers import TierLadder
    ladder = TierLadder()
    assert E.page_bytes_for(64) == 2048 and E.page_bytes_for(32) == 2048
    def unused(d, page):       # the largest share of a page no whole state of a tier fills
        return max((page % ladder.bytes_per_state(t, d)) / page for t in range(1, ladder.top + 1))
    assert unused(256, 2048) > 0.2                      # the 8/8 tier: 3 states, 24 % unused
    assert unused(256, E.page_bytes_for(256)) < 0.06
    assert unused(64, E.page_bytes_for(64)) < 0.06


def test_coded_windows_count_their_bytes_and_open_the_low_budgets(runner):
    """--window-bits 4: every method holds the windows in the 4-bit code (their codes,
    scales and means counted); the budgets are still of the bf16 total, so a budget under
    the bf16 windows' share but above the coded one's becomes feasible."""
    ids = np.random.default_rng(5).integers(0, 101, 100)
    exact = runner.prefill(ids)
    coded = E.Runner(runner.model, None, window_bits=4).prefill(ids)
    assert coded.dense_bytes == exact.dense_bytes
    d = 32
    assert coded.window_bytes == 2 * (2 * 7 * (4 * d // 8 + 2) + 2 * d * 4)
    assert coded.window_bytes < exact.window_bytes        # 7 states a row: the means weigh
    err = np.linalg.norm(coded.windows[0][0] - exact.windows[0][0]) / np.linalg.norm(exact.windows[0][0])
    assert 0.01 < err < 0.3
    b = 0.5 * (exact.window_bytes + coded.window_bytes) / exact.dense_bytes
    with pytest.raises(E.Infeasible):
        exact.store_budget(b)
    assert coded.store_budget(b) > 0
    lp = runner.logprobs(E._exact_store(coded), coded, ids[-10:])
    ref = runner.logprobs(E._exact_store(exact), exact, ids[-10:])
    assert 0 < np.abs(lp - ref).max() < 1.0
    # the dense reference reads the model's own windows: the code is a cost of every method
    np.testing.assert_array_equal(
        runner.logprobs(E._exact_store(coded), coded.reference(), ids[-10:]), ref)
    assert exact.reference() is exact
