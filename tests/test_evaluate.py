"""The evaluation harness on a tiny random Llama (the real run needs SmolLM2): the metrics
are zero for the exact store and move for a lossy one, greedy margins line up with the
tokens, and the line-up holds the extra RDR point once."""
import copy
import json
import pathlib
import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from spherical_kv_eval import evaluate as E  # noqa: E402
# run() looks its helpers up in the units module: the tests patch them there
from spherical_kv_eval import units as U  # noqa: E402


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return E.Runner(tiny_llama(512), tokenizer=None)




def test_exact_store_scores_zero_and_a_lossy_store_does_not(runner):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 101, 200)
    ctx, cont = ids[:160], ids[160:]
    pre = runner.prefill(ctx)
    rec = E._RecordingStore(E._exact_store(pre))
    dense = runner.logprobs(rec, pre, cont)
    # the scored tokens' queries were recorded: one chunk of len(cont) - 1 per layer
    assert sorted(rec.queries) == [0, 1]
    q = [rec.queries[l][0] for l in range(2)]
    assert q[0].shape == (4, len(cont) - 1, 16)
    # teacher-forced log-probs through the exact store are the model's own
    with torch.no_grad():
        ref = torch.log_softmax(runner.model(torch.as_tensor(ids)[None]).logits[0].double(), -1).numpy()
    np.testing.assert_allclose(dense[1:], ref[160:-1], atol=1e-4)
    assert E.attention_error(E._exact_store(pre), pre, q) == pytest.approx(0.0, abs=1e-12)
    store, nbytes = E._spherical_store(pre, runner.cfg, E.TierLadder([(2, 2)]), None, centre=False,
                                       policy=E.CompressPolicy(sinks=0, recent=0, window=8))
    assert 0 < nbytes < 2 * 2 * 2 * 160 * 16 * 2
    assert E.attention_error(store, pre, q) > 0.05
    lossy = runner.logprobs(store, pre, cont)
    kl = np.sum(np.exp(dense) * (dense - lossy), axis=1)
    assert np.all(kl >= -1e-9) and kl.mean() > 0


def test_greedy_margins_are_the_top_two_gap(runner):
    rng = np.random.default_rng(1)
    pre = runner.prefill(rng.integers(0, 101, 100))
    toks, gaps = runner.greedy(E._exact_store(pre), pre, 12, margins=True)
    assert toks.shape == gaps.shape == (12,)
    assert np.all(gaps >= 0)
    top2 = np.sort(pre.last_logits)[-2:]
    assert gaps[0] == pytest.approx(top2[1] - top2[0])
    again = runner.greedy(E._exact_store(pre), pre, 12)
    np.testing.assert_array_equal(toks, again)
    assert torch.get_num_threads() >= 1


def test_lineup_adds_the_extra_rdr_point_once():
    class Cfg:
        num_attention_heads = 9
    names = [m.name for m in E.lineup(Cfg, [0.5, 0.25], rdr_extra=[0.2, 0.25])]
    assert len(names) == len(set(names))
    assert [n for n in names if n.startswith("skv-rdr")] == ["skv-rdr@50%", "skv-rdr@25%", "skv-rdr@20%"]
    assert "h2o@20%" not in names


def test_lineup_rdr_recent_windows_named_and_applied(runner):
    """--rdr-recent: one RDR method per window, the first unnamed, each cache protecting the
    last N tokens (a wider window leaves fewer of the budget's bytes to the older states)."""
    methods = [m for m in E.lineup(runner.cfg, [0.5], rdr_recent=(4, 16))
               if m.name.startswith("skv-rdr")]
    assert [m.name for m in methods] == ["skv-rdr@50%", "skv-rdr@50%+r16"]
    pre = runner.prefill(np.random.default_rng(1).integers(0, 101, 160))
    stores = [m.build(pre)[0] for m in methods]
    assert [s.kv.policy.recent for s in stores] == [4, 16]


@pytest.mark.parametrize("bits", [2, 4])
def test_greedy_read_off_the_dense_path_equals_stepping(runner, bits):
    """The common prefix from one teacher-forced pass along dense's greedy tokens is the
    one of the method's own step-by-step greedy run (stores append generated tokens alike
    in one chunk and in steps), and the token share counts the agreeing positions."""
    rng = np.random.default_rng(2 + bits)
    pre = runner.prefill(rng.integers(0, 101, 120))
    ref, gaps = runner.greedy(E._exact_store(pre), pre, 24, margins=True)
    for seed in range(3):
        store, _ = E._spherical_store(pre, runner.cfg, E.TierLadder([(bits, bits)]), None,
                                      centre=False, seed=seed,
                                      policy=E.CompressPolicy(sinks=0, recent=0, window=8))
        stepped = runner.greedy(copy.deepcopy(store), pre, 24)
        got = E.greedy_on_dense_path(runner.logprobs(store, pre, ref), ref, gaps)
        miss = np.flatnonzero(stepped != ref)
        assert got["agree"] == (miss[0] if miss.size else 24) / 24
        assert got["gap"] == (float(gaps[miss[0]]) if miss.size else None)
        assert got["agree"] <= got["tokens"] <= 1.0
    exact = E.greedy_on_dense_path(runner.logprobs(E._exact_store(pre), pre, ref), ref, gaps)
    assert exact.pop("margin_err") < 1e-3
    assert exact == {"agree": 1.0, "gap": None, "tokens": 1.0}


def test_greedy_margin_error_is_the_change_of_the_decision_margin():
    """``margin_err`` is the RMS change of (dense's token − best other token) along the dense
    path; a position where the change exceeds dense's own margin is a flip."""
    ref = np.array([0, 2, 1])
    dense = np.log(np.array([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.25, 0.45, 0.3]]))
    gaps = np.array([np.log(0.5 / 0.3), np.log(0.5 / 0.3), np.log(0.45 / 0.3)])
    method = dense.copy()
    method[1] = np.log([0.2, 0.5, 0.3])            # position 1 flips: margin log(0.3/0.5)
    got = E.greedy_on_dense_path(method, ref, gaps)
    change = np.log(0.3 / 0.5) - gaps[1]
    assert got["agree"] == 1 / 3 and got["tokens"] == 2 / 3
    assert abs(got["gap"] - gaps[1]) < 1e-12
    assert abs(got["margin_err"] - np.sqrt(change ** 2 / 3)) < 1e-12
    assert abs(change) > gaps[1]
    assert E.greedy_on_dense_path(dense, ref, gaps)["margin_err"] < 1e-12


def test_each_baseline_meets_the_rdr_point_with_the_most_bytes_not_above_its_own():
    """The point-by-point check of "RDR below every baseline at the same or more bytes":
    a baseline meets the largest 10-50 % RDR point within its bytes, paired window by window."""
    def row(method, family, budget, nbytes, windows):
        return {"method": method, "family": family, "budget_fraction": budget,
                "bytes_fraction": nbytes, "delta_ppl_pct": float(np.mean(windows)),
                "delta_ppl_windows": windows, "kl_nats": 0.0}
    rows = [row("skv-rdr@25%", "skv-rdr", 0.25, 0.2499, [0.1, 0.3, 0.2]),
            row("skv-rdr@20%", "skv-rdr", 0.20, 0.20, [0.2, 0.4, 0.3]),
            row("skv-rdr@80%", "skv-rdr", 0.8, 0.8, [0.0, 0.0, 0.0]),   # outside 10-50 %
            row("kivi4", "kivi", None, 0.32, [0.0, 0.5, 0.4]),
            row("h2o@25%", "h2o", 0.25, 0.25, [3.0, 2.0, 1.0]),
            row("kivi2", "kivi", None, 0.194, [9.0, 9.0, 9.0]),          # under every RDR point
            row("dense-bf16", "dense", None, 1.0, [0.0, 0.0, 0.0])]
    got = {p["baseline"]["method"]: p for p in E.rdr_against_baselines(rows)}
    assert set(got) == {"kivi4", "h2o@25%"}
    assert got["kivi4"]["rdr"]["method"] == "skv-rdr@25%"
    assert got["h2o@25%"]["rdr"]["method"] == "skv-rdr@25%"
    d = np.array([0.1, -0.2, -0.2])
    p = got["kivi4"]
    assert abs(p["diff"] - d.mean()) < 1e-12 and p["lower"] == 2 and p["windows"] == 3
    assert abs(p["se"] - d.std(ddof=1) / np.sqrt(3)) < 1e-12
    assert got["h2o@25%"]["lower"] == 3


def test_greedy_oracle_default_is_the_evaluation_rdr_and_the_oracle_sees_the_greedy_queries(worker):
    """validation.greedy_oracle: its "default" variant builds the evaluation's own RDR store
    (same margins along the dense greedy path), and the oracle variants estimate attention
    from the greedy run's queries, so they keep different states."""
    from types import SimpleNamespace
    from validation import greedy_oracle as O
    runner = worker
    ids = np.random.default_rng(7).integers(0, 101, 400)
    args = SimpleNamespace(budgets=[0.5], generate=12,
                           variants=["default", "oracle", "oracle-no-prior", "last128"])
    got = O._unit((320, 0, 40, args, ids))["results"]
    pre = runner.prefill(ids[40:360])
    ref, gaps = runner.greedy(E._exact_store(pre), pre, 12, margins=True)
    (rdr,) = [m for m in E.lineup(runner.cfg, [0.5]) if m.name == "skv-rdr@50%"]
    want = E.greedy_on_dense_path(runner.logprobs(rdr.build(pre)[0], pre, ref), ref, gaps)
    assert set(got) == {"default@50%", "oracle@50%", "oracle-no-prior@50%", "last128@50%"}
    assert abs(got["default@50%"]["margin_err"] - want["margin_err"]) < 1e-9
    assert got["oracle-no-prior@50%"]["margin_err"] != got["default@50%"]["margin_err"]
    assert all(r["bytes"] <= 0.5 for r in got.values())


def test_deferred_greedy_protocol_compresses_after_the_dense_lookahead(worker):
    """``--defer N``: the greedy run is measured after N tokens generated on the dense cache,
    every method compressing the context + those N with their queries as its estimate; the
    evaluation's RDR point then equals greedy_oracle's defer variant, and differs from
    compressing right after the prefill."""
    from types import SimpleNamespace
    from validation import greedy_oracle as O
    ids = np.random.default_rng(8).integers(0, 101, 500)
    common = dict(budgets=[0.5], rdr_extra=[], rdr_recent=[32], methods=["skv-rdr"],
                  continuation=16, generate=12, probe=16, seed=0)
    deferred = E._unit((320, 0, 40, SimpleNamespace(defer=32, **common), ids, 0))
    at_prefill = E._unit((320, 0, 40, SimpleNamespace(defer=0, **common), ids, 0))
    oracle = O._unit((320, 0, 40, SimpleNamespace(budgets=[0.5], generate=12, variants=["defer32"]),
                      ids))["results"]["defer32@50%"]
    got, before = deferred["methods"]["skv-rdr@50%"], at_prefill["methods"]["skv-rdr@50%"]
    assert abs(got["margin_err"] - oracle["margin_err"]) < 1e-9 and got["agree"] == oracle["agree"]
    assert got["margin_err"] != before["margin_err"]
    # the scoring side is the same in both protocols
    assert got["nll"] == before["nll"] and got["bytes"] == before["bytes"]
    assert deferred["dense_gaps"] != at_prefill["dense_gaps"]


COMMITTED = pathlib.Path(__file__).resolve().parent.parent / "validation" / "results" / "evaluation"


def test_default_output_is_in_the_working_directory_never_the_committed_results(monkeypatch):
    monkeypatch.delenv("SPHERICAL_KV_RESULTS", raising=False)
    assert E.parse([]).out == pathlib.Path("spherical-kv-results")
    assert E.parse(["--quick"]).out == pathlib.Path("spherical-kv-results") / "quick"
    assert E.parse(["--quick", "--out", "x"]).out == pathlib.Path("x")
    monkeypatch.setenv("SPHERICAL_KV_RESULTS", "elsewhere")
    assert E.parse([]).out == pathlib.Path("elsewhere")


def test_main_says_where_results_and_model_go_and_that_quick_is_a_smoke_test(
        tmp_path, monkeypatch, capsys):
    rows = json.loads((COMMITTED / "default" / "evaluate.json").read_text())
    meta = json.loads((COMMITTED / "default" / "evaluate_meta.json").read_text())
    monkeypatch.setattr(E, "run", lambda args: (rows, meta))     # no model run here
    monkeypatch.delenv("SPHERICAL_KV_CACHE", raising=False)
    assert E.main(["--quick", "--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err
    assert f"results written to {(tmp_path / 'r').resolve()}/" in err
    assert "evaluate.json" in err and "pareto.png" in err and "smoke test" in err
    assert f"under {tmp_path / 'c'} (~0.5 GB" in err and "SPHERICAL_KV_CACHE" in err
    assert "Q4_1 GGUF" in err
    for f in ("evaluate.json", "evaluate_meta.json", "evaluate.md", "pareto.png", "greedy.png"):
        assert (tmp_path / "r" / f).stat().st_size > 0


def test_replot_redraws_the_figures_from_the_json_alone(tmp_path, capsys):
    shutil.copy(COMMITTED / "4k_16windows" / "evaluate.json", tmp_path / "evaluate.json")
    assert E.main(["--replot", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["greedy.png", "pareto.png"]
    assert "wrote" in capsys.readouterr().out


def test_the_figures_have_one_legend_outside_the_panels_and_presses_apart(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    rows = json.loads((COMMITTED / "default" / "evaluate.json").read_text())
    drawn, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig) or save(fig, *a, **k))
    E.plot(rows, tmp_path / "pareto.png")
    (fig,) = drawn
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    names = [t.get_text() for t in legend.get_texts()]
    families = {r["family"] for r in rows} - {"dense"}
    assert set(names) == families | {"target: ΔPPL 1 %"} and names[0] == "skv-rdr"
    # the legend is right of every panel
    right = max(ax.get_position().x1 for ax in fig.axes)
    assert legend.get_window_extent().x0 >= right * fig.bbox.width - 1
    # every family its own colour (the presses most of all: eight dashed lines together)
    colours = [E.COLORS[f.removeprefix("kvpress-")] for f in sorted(families)]
    assert len(set(colours)) == len(colours)
    # ΔPPL's axis is written in percentages
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "+1 %" in labels and "0" in labels


@pytest.mark.parametrize("scale", ["log", "symlog", "linear"])
def test_plot_limits_hold_every_point_with_room(scale):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.set_yscale(scale)
    values = [-0.3, 0.002, 1.0, 17.0] if scale != "log" else [3e-5, 0.01, 0.2]
    lo, hi = E._padded_limits(ax.yaxis, values)
    assert lo < min(values) and hi > max(values)
    t = ax.yaxis.get_transform()
    span = t.transform(np.array([max(values)]))[0] - t.transform(np.array([min(values)]))[0]
    assert t.transform(np.array([hi]))[0] - t.transform(np.array([max(values)]))[0] > 0.05 * span
    plt.close(fig)


def _row(method, family, budget, nbytes, dppl, kl=None, margin=None):
    kl = [0.01] * len(dppl) if kl is None else kl
    margin = [0.1] * len(dppl) if margin is None else margin
    return {"method": method, "family": family, "budget_fraction": budget, "bytes_fraction": nbytes,
            "delta_ppl_pct": float(np.mean(dppl)), "delta_ppl_windows": dppl,
            "kl_nats": float(np.mean(kl)), "kl_windows": kl,
            "greedy_margin_err": float(np.mean(margin)), "greedy_margin_err_windows": margin}


def test_paired_differences_say_lower_higher_or_tie_by_their_95_ci():
    """A difference whose 95 % CI excludes 0 is a verdict, one that holds 0 is a tie; the
    half-width is Student's t over the windows."""
    from scipy.stats import t
    a = _row("skv-rdr@25%", "skv-rdr", 0.25, 0.25, [0.1, 0.2, 0.1, 0.2], kl=[0.1, 0.3, 0.1, 0.3])
    b = _row("h2o@25%", "h2o", 0.25, 0.25, [1.0, 1.1, 1.2, 1.0], kl=[0.0, 0.4, 0.2, 0.2])
    p = E.paired_difference(a, b, "delta_ppl_pct")
    d = np.array([-0.9, -0.9, -1.1, -0.8])
    assert abs(p["diff"] - d.mean()) < 1e-12 and p["verdict"] == "lower" and p["lower"] == 4
    assert abs(p["ci95"] - t.ppf(0.975, 3) * d.std(ddof=1) / 2) < 1e-12
    assert E.paired_difference(b, a, "delta_ppl_pct")["verdict"] == "higher"
    assert E.paired_difference(a, b, "kl_nats")["verdict"] == "tie"      # +0.1, -0.1, -0.1, +0.1
    assert E.paired_difference(a, dict(b, kl_windows=[0.1]), "kl_nats") is None
    assert E.paired_difference(a, dict(b, greedy_margin_err_windows=[]), "greedy_margin_err") is None
    cell = E._paired_cell(E.paired_difference(a, b, "kl_nats"), 2)
    assert cell.endswith("*tie*") and "0.00 ± 0.18" in cell


def test_greedy_target_sets_the_largest_rdr_point_within_20_percent_against_fp8():
    fp8 = _row("fp8-e4m3", "fp8e4m3", None, 0.5, [0.4] * 3, margin=[0.07, 0.06, 0.08])
    rows = [fp8, _row("skv-rdr@25%", "skv-rdr", 0.25, 0.25, [0.1] * 3, margin=[0.01] * 3),
            _row("skv-rdr@20%", "skv-rdr", 0.2, 0.1995, [0.5] * 3, margin=[0.09, 0.07, 0.10]),
            _row("skv-rdr@10%", "skv-rdr", 0.1, 0.1, [1.0] * 3, margin=[0.01] * 3)]
    got = E.greedy_target(rows)
    assert got["rdr"] == "skv-rdr@20%" and got["fp8"] == "fp8-e4m3"
    assert abs(got["diff"] - 0.05 / 3) < 1e-12 and not got["met"]
    assert E.greedy_target(rows[1:]) is None


def test_reports_mark_ties_and_state_the_greedy_target(tmp_path):
    rows = [_row("fp8-e4m3", "fp8e4m3", None, 0.5, [0.4, 0.5, 0.3], margin=[0.07, 0.06, 0.08]),
            _row("skv-rdr@20%", "skv-rdr", 0.2, 0.1995, [0.5, 0.2, 0.4], margin=[0.03, 0.04, 0.05])]
    for r in rows:
        r.update(context=2048, windows=3, delta_ppl_spread=0.2, delta_ppl_ci95=0.1,
                 top1_agreement=0.9, retrieval_loss=1.0, retrieval_loss_protected=None,
                 greedy_agreement=0.5, greedy_token_agreement=0.9, attn_out_rel_err=0.1)
    meta = {"model": "m", "corpus": "debian:x", "continuation": 8, "generate": 4,
            "probe_tokens": 4, "seconds": 1.0}
    E.write_reports(rows, meta, tmp_path)
    md = (tmp_path / "evaluate.md").read_text()
    assert "| fp8-e4m3 | 50.0 | skv-rdr@20% | 20.0 | -0.03 ± " in md and "*tie*" in md
    assert "margin err" in md and "Greedy target" in md and ": met." in md
    assert "0.400 ± " not in md and "0.40 ± 0.10" in md        # ΔPPL with its CI


def test_a_run_in_parts_resumes_to_the_rows_of_one_run(worker, tmp_path, monkeypatch):
    """``--max-units`` stops a run with units left (``Unfinished``), ``--resume`` goes on
    from ``units.jsonl`` and gives the rows one whole run gives; a log of other settings is
    refused, and a line cut off by an interruption is run again."""
    from types import SimpleNamespace
    ids = np.random.default_rng(3).integers(0, 101, 4000)
    monkeypatch.setattr(U, "_main_setup", lambda *a, **k: (worker.model.config, None))
    monkeypatch.setattr(U, "corpus_tokens", lambda tok, need, special=True: (ids, "test"))

    def args(out, **kw):
        base = dict(model="smollm2", contexts=[256], budgets=[0.5], rdr_extra=[], rdr_recent=[32],
                    windows=2, continuation=16, generate=4, defer=0, probe=8, methods=["skv-rdr", "h2o"],
                    peers=False, seed=0, window_bits=16, jobs=1, out=out, resume=False,
                    max_units=None, peer_device=None)
        return SimpleNamespace(**dict(base, **kw))

    whole, _ = E.run(args(tmp_path / "whole"))
    with pytest.raises(E.Unfinished, match="--resume"):          # no time: no unit starts
        E.run(args(tmp_path / "parts", time_limit=0))
    with pytest.raises(E.Unfinished, match="--resume"):
        E.run(args(tmp_path / "parts", max_units=1, resume=True))
    log = tmp_path / "parts" / "units.jsonl"
    assert len(log.read_text().splitlines()) == 2
    log.write_text(log.read_text() + '{"T": 256, "w": 1, "meth')          # cut off
    with pytest.raises(ValueError, match="continuation"):
        E.run(args(tmp_path / "parts", resume=True, continuation=8))
    parts, meta = E.run(args(tmp_path / "parts", resume=True))
    assert parts == whole
    assert meta["unit_seconds"] > 0
    # each window's line-up split over two units (every other method): the same rows
    split, _ = E.run(args(tmp_path / "split", method_parts=2))
    assert split == whole
    logged = [json.loads(x) for x in (tmp_path / "split" / "units.jsonl").read_text().splitlines()[1:]]
    assert sorted((str(u["w"]), u["part"]) for u in logged) == [
        ("0", 0), ("0", 1), ("1", 0), ("1", 1), ("probe", 0), ("probe", 1)]
    assert all(len(u["methods"]) < len(whole) for u in logged)
    # a whole-window log resumes under a split: nothing runs again
    again, meta = E.run(args(tmp_path / "parts", resume=True, method_parts=2))
    assert again == whole and meta["units_resumed"] == 6


def test_a_grown_line_up_resumes_with_only_the_new_methods(worker, tmp_path, monkeypatch):
    """A log made before the line-up gained a method resumes by running that method alone,
    in one supplement unit per window, and gives the rows of one whole run; a supplement
    whose prefill differs from its window's is refused."""
    from types import SimpleNamespace
    ids = np.random.default_rng(5).integers(0, 101, 4000)
    monkeypatch.setattr(U, "_main_setup", lambda *a, **k: (worker.model.config, None))
    monkeypatch.setattr(U, "corpus_tokens", lambda tok, need, special=True: (ids, "test"))

    def args(out, **kw):
        base = dict(model="smollm2", contexts=[256], budgets=[0.5], rdr_extra=[], rdr_recent=[32],
                    windows=2, continuation=16, generate=4, defer=0, probe=8,
                    methods=["skv-rdr", "h2o", "fp8"], peers=False, seed=0, window_bits=16,
                    jobs=1, out=out, resume=False, max_units=None, peer_device=None)
        return SimpleNamespace(**dict(base, **kw))

    whole, _ = E.run(args(tmp_path / "whole"))
    full = E._methods
    monkeypatch.setattr(U, "_methods", lambda cfg, a: [m for m in full(cfg, a) if m.name != "fp8-e4m3"])
    older, _ = E.run(args(tmp_path / "grown"))
    assert "fp8-e4m3" not in {r["method"] for r in older}
    monkeypatch.setattr(U, "_methods", full)
    ran = []
    real = E._unit
    monkeypatch.setattr(U, "_unit", lambda job: ran.append(job) or real(job))
    with pytest.raises(E.Unfinished, match="--resume"):          # one supplement at a time
        E.run(args(tmp_path / "grown", resume=True, max_units=1))
    grown, meta = E.run(args(tmp_path / "grown", resume=True))
    assert grown == whole
    assert sorted(str(j[1]) for j in ran) == ["0", "1", "probe"]
    assert all(tuple(j[7]) == ("fp8-e4m3",) for j in ran)
    again, _ = E.run(args(tmp_path / "grown", resume=True))      # nothing left to run
    assert again == whole and len(ran) == 3
    log = tmp_path / "grown" / "units.jsonl"
    units = [json.loads(x) for x in log.read_text().splitlines()]
    extra = next(u for u in units[1:] if u.get("extra") and u["w"] == 0)
    extra["dense_nll"] += 0.5                                    # another prefill
    log.write_text("\n".join(json.dumps(u) for u in units) + "\n")
    with pytest.raises(RuntimeError, match="disagree on dense_nll"):
        E.run(args(tmp_path / "grown", resume=True))


def test_a_context_length_s_windows_do_not_depend_on_the_other_lengths(worker, tmp_path, monkeypatch):
    """A run of two lengths holds the run of one: --resume adds a length to a finished run
    and reuses its units, and the shorter length's rows are the same either way."""
    from types import SimpleNamespace
    ids = np.random.default_rng(4).integers(0, 101, 6000)
    monkeypatch.setattr(U, "_main_setup", lambda *a, **k: (worker.model.config, None))
    monkeypatch.setattr(U, "corpus_tokens", lambda tok, need, special=True: (ids[:need * 2], "test"))
    ran = []
    real = E._unit
    monkeypatch.setattr(U, "_unit", lambda job: ran.append(job[:2]) or real(job))

    def args(contexts, resume):
        return SimpleNamespace(model="smollm2", contexts=contexts, budgets=[0.5], rdr_extra=[],
                               rdr_recent=[32], windows=2, continuation=16, generate=0, defer=0,
                               probe=8, methods=["h2o"], peers=False, seed=0, window_bits=16, jobs=1,
                               out=tmp_path, resume=resume, max_units=None, peer_device=None)
    one, _ = E.run(args([192], False))
    ran.clear()
    both, _ = E.run(args([192, 256], True))
    assert sorted(set(t for t, _ in ran)) == [256]            # the 192 units were resumed
    assert [r for r in both if r["context"] == 192] == one


# ------------------------------------------------------------------ the command line

def test_budgets_are_fractions_in_0_1_checked_by_argparse(capsys):
    assert E.parse(["--budgets", "0.5", "1", "--rdr-extra", "0.2"]).budgets == [0.5, 1.0]
    for bad in (["--budgets", "0"], ["--budgets", "1.5"], ["--budgets", "25"],
                ["--budgets", "x"], ["--rdr-extra", "-0.1"]):
        with pytest.raises(SystemExit) as e:
            E.parse(bad)
        assert e.value.code == 2
        assert "fraction of the bf16 bytes" in capsys.readouterr().err


def test_quick_says_which_of_the_given_flags_it_overrides(capsys):
    a = E.parse(["--quick", "--windows", "8", "--budgets", "0.5"])
    assert (a.windows, a.budgets, a.contexts) == (2, [0.25], [512])      # --quick's, as before
    err = capsys.readouterr().err
    assert "--windows 2" in err and "--budgets [0.25]" in err and "--generate" not in err
    E.parse(["--quick", "--contexts", "256"])
    assert "over the command line" not in capsys.readouterr().err


def test_every_option_has_help_text():
    import argparse
    from spherical_kv_ref import cli
    for parser in (E.parser(), cli.demo_parser()):
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, (parser.prog, action.option_strings)


def test_methods_that_match_nothing_are_an_error(runner):
    from types import SimpleNamespace
    args = SimpleNamespace(budgets=[0.5], rdr_extra=[], rdr_recent=[32], peers=False,
                           methods=["dense", "skv-rdr@50", "nosuch"])
    with pytest.raises(E.NoSuchMethod, match="--methods nosuch matches no method"):
        E._methods(runner.cfg, args)
    args.methods = ["dense", "skv-rdr@50"]
    assert [m.name for m in E._methods(runner.cfg, args)] == ["dense-bf16", "skv-rdr@50%"]


def test_a_unit_starts_only_while_the_slowest_so_far_would_end_in_time():
    """``_as_they_end`` keeps ``procs`` units running while ``may_start`` allows, tells it
    the slowest unit's time once one has ended, lets the running ones end and yields every
    started unit's result; a unit's error is raised."""
    from multiprocessing.pool import ThreadPool
    import time
    asked, started = [], []

    def unit(j):
        started.append(j)
        time.sleep(0.05)
        return j * 10

    def may_start(slowest):
        asked.append(slowest)
        return len(asked) <= 3           # three starts, then the time is up

    with ThreadPool(2) as pool:
        out = sorted(U._as_they_end(pool, unit, range(8), 2, may_start))
    assert sorted(started) == [0, 1, 2] and out == [0, 10, 20]
    assert asked[:2] == [None, None] and all(s >= 0.05 for s in asked[2:])

    def bad(j):
        raise RuntimeError(f"unit {j} failed")
    with ThreadPool(2) as pool, pytest.raises(RuntimeError, match="failed"):
        list(U._as_they_end(pool, bad, range(3), 2, lambda slowest: True))
