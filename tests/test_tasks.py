"""The long-context tasks (``spherical-kv tasks``): instances are a function of (task, length,
index, seed) with the answer planted where they say, the exact-match score, the paired test,
the command line, and a tiny real run on SmolLM2."""
import argparse
import json
import pathlib
import tomllib

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")

from spherical_kv_eval import tasks as K  # noqa: E402
from spherical_kv_eval import tasks_report as R  # noqa: E402
from spherical_kv_eval import tasks_run as TR  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
HAYSTACK = ("It is a truth universally acknowledged, that a single man in possession of a good "
            "fortune, must be in want of a wife.\n\n") * 400


class CharTokenizer:
    """One token per character (ids = code points): decode(encode(s)) == s, so a planted
    item's text can be read back from its span."""
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("task", list(K.TASKS))
def test_instances_are_deterministic_and_plant_the_answer_at_the_stated_depth(task):
    tok = CharTokenizer()
    a = K.make_instance(task, 1500, 3, tok, seed=7, text=HAYSTACK)
    b = K.make_instance(task, 1500, 3, tok, seed=7, text=HAYSTACK)
    assert np.array_equal(a.context, b.context) and np.array_equal(a.question, b.question)
    assert a.answer == b.answer and a.spans == b.spans
    other = K.make_instance(task, 1500, 4, tok, seed=7, text=HAYSTACK)
    assert other.answer != a.answer or not np.array_equal(other.context, a.context)
    assert len(a.context) == 1500
    context = tok.decode(a.context)
    planted = [context[s:e] for s, e in a.spans]
    # the answer-bearing item starts at the stated depth: after that share of the haystack
    fill = a.length - sum(e - s for s, e in a.spans)
    first = next(i for i, (s, _) in enumerate(a.spans) if s == a.start)
    before = sum(e - s for s, e in a.spans[:first])
    assert a.start - before == round(a.depth * fill)
    if task == "toolcall":
        name = a.answer.split("(")[0]
        assert a.depth == 0 and f'"name": "{name}"' in planted[0]
        for arg in a.answer[len(name) + 1:-1].split(", "):
            p, v = arg.split("=")
            assert f'"{p}"' in planted[0] and v.strip('"') in tok.decode(a.question)
    elif task == "vartrack":
        names = a.answer.split(", ")
        value = tok.decode(a.question).split("value ")[1].split(" ")[0]
        assert planted[first].strip() == f"VAR {names[0]} = {value}."
        chain = [p.strip() for p in planted]
        for x, y in zip(names, names[1:]):
            assert f"VAR {y} = VAR {x}." in chain
    elif task == "niah-multivalue":
        values = a.answer.split(", ")
        assert [p.strip().split(": ")[1].rstrip(".") for p in planted] == values
    else:
        assert a.answer in planted[first]
        assert a.answer not in tok.decode(a.question)
    if task == "niah-single":
        assert a.depth == K.DEPTHS[3 % len(K.DEPTHS)]
    if task == "span":
        assert 0.02 <= a.depth <= 0.15
    # the haystack around the items is the corpus text
    assert "a single man in possession" in context


def test_an_instance_does_not_depend_on_the_other_instances_or_lengths():
    tok = CharTokenizer()
    one = K.make_instance("niah-multikey", 1200, 2, tok, text=HAYSTACK)
    for _ in range(3):
        K.make_instance("niah-multikey", 2000, 0, tok, text=HAYSTACK)
    assert np.array_equal(K.make_instance("niah-multikey", 1200, 2, tok, text=HAYSTACK).context,
                          one.context)
    bos = K.make_instance("niah-multikey", 1200, 2, tok, text=HAYSTACK, bos=1)
    assert len(bos.context) == 1200 and bos.context[0] == 1 and bos.answer == one.answer
    text = tok.decode(bos.context)
    assert [text[s:e] for s, e in bos.spans] == [tok.decode(one.context)[s:e] for s, e in one.spans]
    with pytest.raises(ValueError, match="unknown task"):
        K.make_instance("nosuch", 1200, 0, tok, text=HAYSTACK)
    with pytest.raises(ValueError, match="no room"):
        K.make_instance("toolcall", 100, 0, tok, text=HAYSTACK)


def test_the_score_is_an_exact_match_of_the_answer_at_the_head_of_the_output():
    assert K.exact_match(" 4821733.", "4821733")
    assert K.exact_match("4821733", "4821733")
    assert K.exact_match("  get_weather(city=\"Bath\",\n unit=\"celsius\") ok",
                         'get_weather(city="Bath", unit="celsius")')
    assert not K.exact_match(" 48217330", "4821733")          # a longer number
    assert not K.exact_match(" 482173", "4821733")            # cut short
    assert not K.exact_match(" 1, 2, 3, 4, 5", "1, 2, 3, 4")  # a list with one more
    assert not K.exact_match(" The number is 4821733", "4821733")
    # the decoding stops as soon as the verdict is known
    assert K.verdict(" 48", "4821733") is None and K.verdict(" 49", "4821733") is False
    assert K.verdict(" 4821733", "4821733") is None and K.verdict(" 4821733.", "4821733") is True


def test_wilson_intervals_and_the_paired_exact_test():
    lo, hi = R.wilson(50, 50)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(0.9287, abs=1e-3)
    lo, hi = R.wilson(0, 2)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(0.658, abs=1e-3)
    assert R.wilson(0, 0) is None
    # McNemar: only the discordant instances count; 9 against 1 is p = 2 * 11/1024
    a = [1] * 9 + [0] * 1 + [1] * 20
    b = [0] * 9 + [1] * 1 + [1] * 20
    p = R.paired_binary(a, b)
    assert (p["only_a"], p["only_b"]) == (9, 1) and p["p"] == pytest.approx(22 / 1024)
    assert p["verdict"] == "lower" and p["diff"] == pytest.approx(8 / 30)
    assert R.paired_binary(b, a)["verdict"] == "higher"
    assert R.paired_binary([1, 0, 1], [1, 0, 1]) == {"diff": 0.0, "only_a": 0, "only_b": 0,
                                                     "p": 1.0, "verdict": "tie"}
    assert R.paired_binary([1, 0], [1]) is None


def test_the_command_line_checks_its_options(capsys, monkeypatch):
    monkeypatch.delenv("SPHERICAL_KV_RESULTS", raising=False)
    a = TR.parse(["--budgets", "0.5", "1", "--methods", "skv-rdr"])
    assert a.budgets == [0.5, 1.0] and a.methods == ["dense", "skv-rdr"]
    assert a.instances == 50 and a.tasks == list(K.TASKS) and a.protect
    assert a.out == pathlib.Path("spherical-kv-results") / "tasks"
    assert a.window_bits == 16
    # the windows' code reaches the workers' options and is one of the unit settings
    w = TR.parse(["--window-bits", "8", "--model", "gemma3-270m", "--lengths", "8192"])
    seen = {}

    def setup(jobs, model, options):
        seen.update(options)
        raise RuntimeError("stop here")
    monkeypatch.setattr(TR, "_main_setup", setup)
    with pytest.raises(RuntimeError, match="stop here"):
        TR.run(w)
    assert seen["window_bits"] == 8 and "window_bits" in TR.UNIT_SETTINGS
    q = TR.parse(["--quick", "--instances", "9"])
    assert (q.lengths, q.instances, q.protect) == ([512], 2, False)
    assert q.out == pathlib.Path("spherical-kv-results") / "tasks-quick"
    for bad, says in ((["--budgets", "0"], "fraction of the bf16 bytes"),
                      (["--budgets", "1.5"], "fraction of the bf16 bytes"),
                      (["--instances", "0"], ">= 1"), (["--tasks", "nosuch"], "invalid choice"),
                      (["--lengths", "9000"], "must not exceed"),
                      (["--device", "tpu"], "invalid choice"),
                      (["--window-bits", "5"], "invalid choice")):
        with pytest.raises(SystemExit) as e:
            TR.parse(bad)
        assert e.value.code == 2 and says in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            TR.parse(["--device", "cuda"])
        assert "no CUDA device" in capsys.readouterr().err
    for action in TR.parser()._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help, action.option_strings
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry["spherical_kv.commands"]["tasks"] == "spherical_kv_eval.tasks_run:main"


def test_a_tiny_run_on_smollm2_writes_the_rows(tmp_path):
    """One task at 160 tokens, two instances, dense and RDR at 50 %: the units, the rows
    (dense first in the table, the paired test against it) and the three files."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from spherical_kv_eval.model import ModelUnavailable, load_model
    try:
        load_model("smollm2")
    except ModelUnavailable as e:
        pytest.skip(str(e))
    TR._WORKER.clear()
    try:
        assert TR.main(["--lengths", "160", "--instances", "2", "--tasks", "span",
                        "--methods", "skv-rdr", "--budgets", "0.5", "--no-protect",
                        "--no-peers", "--jobs", "1", "--out", str(tmp_path)]) == 0
    finally:
        TR._WORKER.clear()
    rows = json.loads((tmp_path / "tasks.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["dense-bf16", "skv-rdr@50%"]
    for r in rows:
        assert r["task"] == "span" and r["context"] == 160 and r["instances"] == 2
        assert r["accuracy"] == r["correct"] / 2 and len(r["outcomes"]) == 2
        lo, hi = r["accuracy_ci95"]
        assert lo <= r["accuracy"] <= hi
    assert rows[0]["bytes_fraction"] == 1.0 and rows[1]["bytes_fraction"] <= 0.5 + 1e-9
    assert rows[0]["vs_dense"] is None and rows[1]["vs_dense"]["verdict"] in ("tie", "lower", "higher")
    md = (tmp_path / "tasks.md").read_text()
    assert md.index("dense accuracy") < md.index("### span")
    assert (tmp_path / "tasks.png").stat().st_size > 0
    assert len((tmp_path / "units.jsonl").read_text().splitlines()) == 3


@pytest.mark.gpu
def test_a_tiny_run_on_the_gpu_answers_as_on_the_cpu(tmp_path):
    """The same two instances at 160 tokens on the CPU and with --device cuda (the model,
    its statistics and the stores' attention on the GPU): the same outputs, scores and bytes
    for dense, H2O and RDR at 50 %."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from spherical_kv_eval.model import ModelUnavailable, load_model
    try:
        load_model("smollm2")
    except ModelUnavailable as e:
        pytest.skip(str(e))
    units = {}
    for device in ("cpu", "cuda"):
        TR._WORKER.clear()
        try:
            assert TR.main(["--lengths", "160", "--instances", "2", "--tasks", "span", "niah-single",
                            "--methods", "skv-rdr", "h2o", "--budgets", "0.5", "--no-protect",
                            "--no-peers", "--jobs", "1", "--device", device,
                            "--out", str(tmp_path / device)]) == 0
        finally:
            TR._WORKER.clear()
        lines = (tmp_path / device / "units.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["settings"]["device"] == device
        units[device] = [{k: v for k, v in json.loads(x).items() if k != "seconds"}
                         for x in lines[1:]]
    assert len(units["cpu"]) == 4
    for c, g in zip(units["cpu"], units["cuda"]):
        assert c["w"] == g["w"] and set(c["methods"]) == set(g["methods"]) and len(c["methods"]) == 3
        for name, m in c["methods"].items():
            assert g["methods"][name]["output"] == m["output"], (c["w"], name)
            assert g["methods"][name]["correct"] == m["correct"]
            assert g["methods"][name]["bytes"] == pytest.approx(m["bytes"], abs=0.01)


def test_rows_pair_each_baseline_with_the_rdr_point_at_no_more_bytes(tmp_path):
    """From logged units alone: the protected RDR run is a row of its own, a baseline meets
    the unprotected RDR point with the most bytes not above its own, dense comes first."""
    from types import SimpleNamespace as M
    methods = [M(name="dense-bf16", family="dense", budget=None),
               M(name="h2o@25%", family="h2o", budget=0.25),
               M(name="skv-rdr@50%", family="skv-rdr", budget=0.5),
               M(name="skv-rdr@25%", family="skv-rdr", budget=0.25)]
    right = {"dense-bf16": [1] * 12, "h2o@25%": [0] * 10 + [1] * 2,
             "skv-rdr@50%": [1] * 12, "skv-rdr@25%": [1] * 11 + [0],
             "skv-rdr@25%" + R.PROTECTED: [1] * 12}
    nbytes = {"dense-bf16": 1.0, "h2o@25%": 0.25, "skv-rdr@50%": 0.5, "skv-rdr@25%": 0.249,
              "skv-rdr@25%" + R.PROTECTED: 0.249}
    units = [{"T": 512, "w": f"span/{i}", "task": "span", "index": i, "depth": 0.1,
              "methods": {n: {"correct": bool(v[i]), "output": "x", "bytes": nbytes[n]}
                          for n, v in right.items()}} for i in range(12)]
    rows = R.task_rows(units, methods, ["span"], [512])
    by = {r["method"]: r for r in rows}
    assert list(by) == ["dense-bf16", "h2o@25%", "skv-rdr@50%", "skv-rdr@25%",
                        "skv-rdr@25%" + R.PROTECTED]
    assert by["skv-rdr@25%" + R.PROTECTED]["protected"] and not by["skv-rdr@25%"]["protected"]
    h2o = by["h2o@25%"]
    assert h2o["vs_rdr"]["rdr"] == "skv-rdr@25%" and h2o["vs_rdr"]["verdict"] == "lower"
    assert h2o["vs_dense"]["verdict"] == "higher" and h2o["accuracy"] == pytest.approx(2 / 12)
    assert by["skv-rdr@25%"]["vs_rdr"] is None and by["skv-rdr@25%"]["vs_dense"]["verdict"] == "tie"
    R.write_task_reports(rows, {"model": "m", "instances": 12, "seed": 0, "seconds": 1.0}, tmp_path)
    md = (tmp_path / "tasks.md").read_text()
    assert md.index("| span | 1.00 [0.76, 1.00] |") < md.index("### span")
    assert "| h2o@25% | 25.0 | 0.17 [0.05, 0.45] | -0.83 (p 0.002) **higher** | " \
           "skv-rdr@25%: +0.75 (p 0.012) **lower** |" in md
    assert json.loads((tmp_path / "tasks.json").read_text())["rows"] == json.loads(json.dumps(rows))
    # the single needle's table has the accuracy at each of its depths
    for u in units:
        u.update(task="niah-single", depth=K.DEPTHS[u["index"] % len(K.DEPTHS)])
    rows = R.task_rows(units, methods, ["niah-single"], [512])
    assert rows[1]["by_depth"] == pytest.approx({"0.1": 1 / 3, "0.25": 1 / 3, "0.5": 0.0,
                                                 "0.75": 0.0, "0.9": 0.0})     # right at 10, 11
    R.write_task_reports(rows, {"model": "m", "instances": 12, "seed": 0, "seconds": 1.0}, tmp_path)
    assert "| 10%: 0.33, 25%: 0.33, 50%: 0.00, 75%: 0.00, 90%: 0.00 |" in \
        (tmp_path / "tasks.md").read_text()
