"""Shared pytest configuration: hypothesis profiles, the fuzzing budget and its tally, and
the self-skipping ``gpu`` marker (docs/testing.md).

Profiles (``HYPOTHESIS_PROFILE``, default ``fixed``):
  fixed  derandomized, 40 examples per property: the same examples on every run, the
         regression suite of ``python -m pytest`` and the profile to debug with.
  ci     explores: a fresh seed per run (printed in the header and the summary), up to
         2500 examples per property, the whole run's fuzzing held to a time budget
         (``HYPOTHESIS_BUDGET_S``, default 200 s) shared out over the properties.
  deep   explores longer: up to 20 000 examples per property, no budget unless
         ``HYPOTHESIS_BUDGET_S`` sets one.
  dev    15 random examples, for a quick local loop.
``HYPOTHESIS_SEED`` (or ``--hypothesis-seed``) fixes the seed of an exploring run to
reproduce it. Every failure prints its ``@reproduce_failure`` blob.
"""
import functools
import os
import random
import time

import pytest
from hypothesis import HealthCheck, core, settings, stateful

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fixed", max_examples=40, derandomize=True, **_COMMON)
# The exploring profiles say derandomize=False outright: where CI=true is set, hypothesis's
# own default is derandomized, and a registered profile inherits it.
settings.register_profile("ci", max_examples=2500, database=None, derandomize=False, **_COMMON)
settings.register_profile("deep", max_examples=20000, derandomize=False, **_COMMON)
settings.register_profile("dev", max_examples=15, derandomize=False, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "fixed")
settings.load_profile(PROFILE)
#: seconds for all the properties of one run; None: each runs to max_examples
_BUDGET_DEFAULT = {"ci": 200.0}


class _Fuzzing:
    """The run's fuzzing budget and tally. With a budget, each property gets an equal share
    of what is left of it when the property starts (a property that finishes early hands
    its time on). It runs in rounds, seeds S, S + 1, …: CALIBRATE examples first, then each
    round half of what the time left allows at the last round's cost per example, until a
    round would be small; at most max_examples in all.
    ``examples`` counts the test bodies that ran (generated, replayed and shrinking calls)."""

    CALIBRATE = 10

    def __init__(self):
        budget = os.environ.get("HYPOTHESIS_BUDGET_S")
        self.budget = float(budget) if budget else _BUDGET_DEFAULT.get(PROFILE)
        self.seed = None
        self.pending = set()        # node ids of the properties still to run
        self.examples = {}          # node id -> bodies run
        self.seconds = {}           # node id -> seconds its rounds took
        self.spent = 0.0

    def share(self, nodeid) -> float:
        self.pending.discard(nodeid)
        return max(self.budget - self.spent, 0.0) / (len(self.pending) + 1)

    def next_round(self, left_s, last_s, last_n, done) -> int:
        """Examples for the next round: half the time left at the last round's cost per
        example (examples grow as a run goes on), within max_examples in all."""
        per = max(last_s / max(last_n, 1), 1e-6)
        room = settings.default.max_examples - done
        return int(max(0, min(room, 0.5 * left_s / per)))


FUZZ = _Fuzzing()


def _is_property(item) -> bool:
    return getattr(getattr(item, "obj", None), "is_hypothesis_test", False)


def pytest_configure(config):
    if settings.default.derandomize:
        return
    seed = config.getoption("--hypothesis-seed", None) or os.environ.get("HYPOTHESIS_SEED")
    FUZZ.seed = int(seed) if seed is not None else random.SystemRandom().randrange(2 ** 32)
    core.global_force_seed = FUZZ.seed       # what --hypothesis-seed sets


def pytest_report_header(config):
    how = ("derandomized" if FUZZ.seed is None else
           f"seed {FUZZ.seed} (reproduce: HYPOTHESIS_PROFILE={PROFILE} HYPOTHESIS_SEED={FUZZ.seed})")
    budget = "no time budget" if FUZZ.budget is None else f"budget {FUZZ.budget:g} s"
    return (f"hypothesis profile {PROFILE!r}: {how}, up to {settings.default.max_examples} "
            f"examples per property, {budget}")


def _cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config, items):
    if not _cuda_available():
        skip = pytest.mark.skip(reason="no CUDA device (CuPy cannot see one)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    for item in items:           # state machines too, so `-m hypothesis` selects every property
        if _is_property(item):
            item.add_marker("hypothesis")


def pytest_collection_finish(session):
    FUZZ.pending = {item.nodeid for item in session.items if _is_property(item)
                    and not any(m.name == "skip" for m in item.iter_markers())}


def _counted(inner, nodeid):
    @functools.wraps(inner)
    def counted(*a, **kw):
        FUZZ.examples[nodeid] += 1
        return inner(*a, **kw)
    return counted


class _Property:
    """One property's knobs: its settings (a @given test's, or a state machine test case's)
    and a way to run it once more outside pytest's call (the calibration round)."""

    def __init__(self, item):
        self.item = item
        self.machine = getattr(item.obj, "_hypothesis_state_machine_class", None)
        if self.machine is not None:
            self.owner, self.attr = item._testcase, "settings"
        else:
            self.owner, self.attr = getattr(item.obj, "__func__", item.obj), "_hypothesis_internal_use_settings"
        self.original = getattr(self.owner, self.attr, settings.default)
        self.had_own = self.attr in vars(self.owner)

    def set_examples(self, n):
        setattr(self.owner, self.attr, settings(self.original, max_examples=n))

    def restore(self):
        if self.had_own:
            setattr(self.owner, self.attr, self.original)
        elif self.attr in vars(self.owner):
            delattr(self.owner, self.attr)

    def run(self):
        if self.machine is not None:
            self.item._testcase.runTest()
        else:
            self.item.runtest()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_call(item):
    """Count the examples of each property (through the ``inner_test`` of its @given wrapper;
    a state machine's is made by ``get_state_machine_test``, wrapped while it runs) and,
    with a budget, run it in two rounds sized to its share (seeds S and S + 1)."""
    if not _is_property(item):
        yield
        return
    nodeid = item.nodeid
    FUZZ.examples[nodeid] = 0
    prop = _Property(item)
    make = stateful.get_state_machine_test
    if prop.machine is not None:
        def get_state_machine_test(*a, **kw):
            test = make(*a, **kw)
            test.hypothesis.inner_test = _counted(test.hypothesis.inner_test, nodeid)
            return test
        stateful.get_state_machine_test = get_state_machine_test
    else:
        handle = item.obj.hypothesis
        inner = handle.inner_test
        handle.inner_test = _counted(inner, nodeid)
    t0 = time.perf_counter()
    r = 0
    try:
        if FUZZ.budget is not None:
            end = t0 + FUZZ.share(nodeid)
            n = FUZZ.CALIBRATE
            while True:
                core.global_force_seed = FUZZ.seed + r
                prop.set_examples(n)
                t, done = time.perf_counter(), FUZZ.examples[nodeid]
                try:
                    prop.run()
                except BaseException as e:
                    e.add_note(_round_note(r))
                    raise
                r += 1
                n = FUZZ.next_round(end - time.perf_counter(), time.perf_counter() - t,
                                    FUZZ.examples[nodeid] - done, FUZZ.examples[nodeid])
                if n < 2 * FUZZ.CALIBRATE:
                    break
            core.global_force_seed = FUZZ.seed + r
            prop.set_examples(max(n, 1))       # the last round: pytest's own call
        outcome = yield
        if outcome.excinfo is not None and FUZZ.budget is not None:
            outcome.excinfo[1].add_note(_round_note(r))
    finally:
        FUZZ.seconds[nodeid] = time.perf_counter() - t0
        FUZZ.spent += FUZZ.seconds[nodeid]
        core.global_force_seed = FUZZ.seed
        if FUZZ.budget is not None:
            prop.restore()
        if prop.machine is not None:
            stateful.get_state_machine_test = make
        else:
            handle.inner_test = inner


def _round_note(r) -> str:
    return (f"hypothesis: failed in round {r} (seed {FUZZ.seed + r}) of a {PROFILE} run with seed "
            f"{FUZZ.seed}. Replay the example with the @reproduce_failure line above, or rerun "
            f"the run with HYPOTHESIS_PROFILE={PROFILE} HYPOTHESIS_SEED={FUZZ.seed} (docs/testing.md)")


def pytest_terminal_summary(terminalreporter):
    if not FUZZ.examples:
        return
    total = sum(FUZZ.examples.values())
    seed = "derandomized" if FUZZ.seed is None else f"seed {FUZZ.seed}"
    tr = terminalreporter
    if FUZZ.seed is not None:
        tr.section("hypothesis examples per property")
        for nodeid, n in sorted(FUZZ.examples.items(), key=lambda kv: kv[1]):
            tr.write_line(f"{n:8d} {FUZZ.seconds.get(nodeid, 0.0):6.1f} s  {nodeid}")
    tr.write_line(f"hypothesis: {total} examples over {len(FUZZ.examples)} properties, {seed}, "
                  f"profile {PROFILE}, {FUZZ.spent:.0f} s")


@pytest.fixture(scope="session")
def tiny_llama():
    """Build a seeded random 2-layer Llama (4 query / 2 kv-heads, head_dim 16, vocab 101)
    for the transformers tests: ``tiny_llama(max_positions)``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def build(max_positions=256):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=max_positions)
        return transformers.LlamaForCausalLM(cfg).eval()
    return build


@pytest.fixture
def worker(runner):
    """The evaluation tests' ``runner`` (each module defines its own) installed as a worker
    process's, which is what the evaluation's units read; removed after."""
    from spherical_kv_eval import evaluate as E
    E._WORKER.clear()
    E._WORKER.update(runner=runner, cfg=runner.model.config)
    yield runner
    E._WORKER.clear()
