"""fit_latency_budget (FATReLU cutoffs raised to meet a p50 latency) on a
fake clock whose call times fall with the cutoffs, and the budget flags of
the command line (validation, a short run of each command)."""

import re

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("op_library")


def _model():
    import keras

    from tf_sparse_split.layers import SparseSplitDense

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="h1"),
        SparseSplitDense(32, activation="relu", name="h2"),
        SparseSplitDense(4, activation="softmax", name="out")])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


class CutoffClock:
    """Each call advances by 1 ms / (1 + 10 * sum of the cutoffs): a model
    gets faster as its cutoffs rise (deterministic)."""

    def __init__(self):
        self.t = 0.0
        self.fats = []

    def __call__(self):
        self.t += 1e-3 / (1.0 + 10.0 * sum(f.cutoff for f in self.fats))
        return self.t


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16)).astype("float32")
    y = rng.integers(0, 4, 64)
    return x, y


def test_meets_budget_at_least_sparsity_and_reports_points():
    from tf_sparse_split.tools.latency_budget import fit_latency_budget

    model = _model()
    x, y = _data()
    clock = CutoffClock()
    # Two passes: find the FATReLUs (converted in place) for the clock.
    res = fit_latency_budget(model, 1.0, x, rounds=2, warmup=1, clock=clock)
    assert res["reachable"] and res["chosen"] == 0   # loose: as given
    clock.fats = [l.activation for l in model.layers
                  if l.name in ("h1", "h2")]
    assert all(type(f).__name__ == "FATReLU" for f in clock.fats)
    for f in clock.fats:
        f.cutoff_var.assign(0.0)
    res = fit_latency_budget(model, 1e-3, x, accuracy_data=(x, y),
                             rounds=3, warmup=1, clock=clock)
    pts = res["points"]
    assert pts[0]["sparsity"] is None
    assert [p["sparsity"] for p in pts[1:]] == sorted(
        p["sparsity"] for p in pts[1:])
    # p50 falls and measured sparsity rises along the ladder
    assert all(a["p50_ms"] >= b["p50_ms"] for a, b in zip(pts, pts[1:]))
    assert pts[-1]["measured_sparsity"] > pts[0]["measured_sparsity"]
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in pts)
    # the budget sits between two points: the least sparse meeting it
    mid = (pts[2]["p50_ms"] + pts[3]["p50_ms"]) / 2
    for f in clock.fats:
        f.cutoff_var.assign(0.0)
    res = fit_latency_budget(model, mid / 1e3, x, rounds=3, warmup=1,
                             clock=clock)
    assert res["reachable"] and res["chosen"] == 3
    chosen = res["points"][3]["cutoffs"]
    assert [f.cutoff for f in clock.fats] == pytest.approx(
        list(chosen.values()))
    # unreachable: left at the fastest point
    for f in clock.fats:
        f.cutoff_var.assign(0.0)
    res = fit_latency_budget(model, 1e-9, x, rounds=2, warmup=1, clock=clock)
    assert not res["reachable"]
    fastest = min(range(len(res["points"])),
                  key=lambda i: res["points"][i]["p50_ms"])
    assert res["chosen"] == fastest


class LagClock:
    """Each call advances by the :class:`CutoffClock` time of the cutoffs
    in force ``lag`` model calls earlier: the ops' decisions follow a
    change of sparsity a few calls late. The model's calls are counted
    (with the cutoffs they ran at) by a pass-through layer."""

    def __init__(self, lag):
        self.t, self.lag, self.fats, self.calls = 0.0, lag, [], []

    def note_call(self):
        self.calls.append(sum(f.cutoff for f in self.fats))

    def __call__(self):
        back = self.calls[-1 - self.lag] if len(self.calls) > self.lag \
            else 0.0
        self.t += 1e-3 / (1.0 + 10.0 * back)
        return self.t


def _counted_model(clock):
    import keras
    import tensorflow as tf

    from tf_sparse_split.layers import SparseSplitDense

    class Count(keras.layers.Layer):
        def call(self, x):
            def note(v):
                clock.note_call()
                return v
            y = tf.py_function(note, [x], x.dtype)
            y.set_shape(x.shape)
            return y

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((16,)), Count(),
        keras.layers.Dense(64, activation="relu", name="h1"),
        SparseSplitDense(32, activation="relu", name="h2"),
        SparseSplitDense(4, activation="softmax", name="out")])


def test_settle_calls_time_each_setting_with_its_own_decisions():
    """Ops that follow a change of sparsity two calls late: strictly
    alternating calls (settle_calls=0) time every point at the original
    cutoffs' speed, so no raised cutoff is found to meet a budget below
    it; with the default settle calls each point is timed at its own speed
    and the budget is met at a raised cutoff."""
    from tf_sparse_split.tools.latency_budget import fit_latency_budget

    x, _ = _data()
    res = {}
    for settle in (0, 3):
        clock = LagClock(lag=2)
        model = _counted_model(clock)
        fit_latency_budget(model, 1.0, x, rounds=2, warmup=1, clock=clock)
        clock.fats = [l.activation for l in model.layers
                      if l.name in ("h1", "h2")]
        for f in clock.fats:
            f.cutoff_var.assign(0.0)
        res[settle] = fit_latency_budget(model, 0.5e-3, x, rounds=4,
                                         warmup=1, clock=clock,
                                         settle_calls=settle)
    p50s = [p["p50_ms"] for p in res[0]["points"]]
    assert max(p50s) == pytest.approx(min(p50s))
    # No raised cutoff is found to meet the budget.
    assert not res[0]["reachable"] or res[0]["chosen"] == 0
    assert res[3]["reachable"] and res[3]["chosen"] > 0
    pts = res[3]["points"]
    assert pts[-1]["p50_ms"] < 0.5 * pts[0]["p50_ms"]


def test_bad_arguments():
    import keras

    from tf_sparse_split.tools.latency_budget import fit_latency_budget

    model = _model()
    x, _ = _data()
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            fit_latency_budget(model, bad, x)
    with pytest.raises(ValueError):
        fit_latency_budget(model, 1.0, x, levels=(0.5, 1.0))
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="settle_calls"):
            fit_latency_budget(model, 1.0, x, settle_calls=bad)
    with pytest.raises(ValueError):
        fit_latency_budget(model, 1.0, np.zeros((0, 16), "float32"))
    plain = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(4, activation="relu")])
    with pytest.raises(ValueError, match="no sparse-split layer"):
        fit_latency_budget(plain, 1.0, x)


@pytest.mark.parametrize("argv", [
    ["train", "--step-budget", "0"], ["train", "--step-budget", "-3"],
    ["train", "--step-budget", "nan"], ["train", "--time-budget", "inf"],
    ["train", "--step-budget", "fast"],
    ["train", "--step-budget", "5", "--time-budget", "60"],
    ["train", "--step-budget", "5", "--baseline"],
    ["train", "--step-budget", "5", "--model", "lstm"],
    ["train", "--step-budget", "5", "--target-sparsity", "0.9"],
    ["profile", "m.keras", "--latency-budget", "0"],
    ["profile", "m.keras", "--latency-budget", "1", "--end-to-end"],
    ["profile", "m.keras", "--curve", "c.png"],
    ["profile", "m.keras", "--latency-budget", "1", "--labels", "y.npy"],
    ["profile", "m.keras", "--latency-budget", "1", "--output", "m.h5"],
])
def test_budget_flags_exit_2_one_line(run_cli, argv):
    rc, _, err = run_cli(argv)
    assert rc == 2
    assert "usage:" in err
    assert len([l for l in err.splitlines() if "error:" in l]) == 1


def test_train_with_step_budget(run_cli, tmp_path):
    plot = tmp_path / "run.png"
    rc, out, _ = run_cli(["train", "--epochs", "2", "--hidden", "32,16",
                          "--batch-size", "32", "--timing-rounds", "0",
                          "--split-all-layers", "--step-budget", "0.01",
                          "--plot", str(plot)])
    assert rc == 0, out
    # a 10 us step budget cannot be met: said, and the run goes on
    assert "not reachable within max_sparsity=0.95" in out
    assert re.search(r"  budget: median step \d+\.\d\d ms, budget 0\.01 ms",
                     out)
    assert "FATReLU cutoff" not in out   # no fixed target with a budget
    assert (tmp_path / "run_budget.png").stat().st_size > 0


@pytest.mark.parametrize("steps,warmup,samples", [
    (30, 5, 3), (10, 2, 2), (1, 2, 2), (90, 15, 8), (160, 20, 8),
    (5000, 20, 8)])
def test_budget_pacing_steers_short_runs(steps, warmup, samples):
    from tf_sparse_split.tools.train import budget_pacing

    assert budget_pacing(steps) == (warmup, samples)


def test_cli_budget_callback_decides_within_the_default_digits_run():
    import argparse

    from tf_sparse_split.tools.train import make_budget_callback

    # The default run on the embedded digits: 1438 examples, batch 256,
    # 5 epochs = 30 steps; warm-up and one decision's samples fit in it.
    args = argparse.Namespace(step_budget=30.0, time_budget=None,
                              tensorboard=None, quiet=True, epochs=5,
                              batch_size=256)
    x = np.zeros((1438, 64), np.float32)
    y = np.zeros(1438, np.int32)
    cb = make_budget_callback(args, x, y, None)
    assert cb.warmup_steps + cb.min_samples < 30
    assert (cb.kind, cb.seconds) == ("step_time", pytest.approx(0.03))


def test_latency_table_without_labels_prints_no_nan():
    import io
    import math

    from tf_sparse_split.tools.latency_budget import format_latency_budget

    point = dict(sparsity=None, measured_sparsity=0.5, p50_ms=1.0,
                 p90_ms=1.2, ratio=1.0, est_p50_ms=1.0, accuracy=math.nan)
    out = io.StringIO()
    format_latency_budget({"points": [point, dict(point, sparsity=0.9)],
                           "chosen": 1, "reachable": True, "budget_ms": 2.0,
                           "activations": ["h1"]}, out)
    rows = out.getvalue().splitlines()[2:4]
    assert "nan" not in out.getvalue()
    assert all(r.split()[6] == "-" for r in rows), rows


def test_epoch_line_says_a_spent_time_budget_in_words():
    import io

    from tf_sparse_split.tools.train import epoch_printer

    out = io.StringIO()
    printer = epoch_printer(1, [], out)
    printer.on_epoch_begin(0)
    printer.on_epoch_end(0, {"loss": 0.5, "accuracy": 0.9,
                             "budget/step_time": 0.05814,
                             "budget/step_budget": 0.0,
                             "budget/reachable": 0.0})
    assert out.getvalue().splitlines()[1] == (
        "  budget: median step 58.14 ms, the time budget is spent (not "
        "reachable within the bounds)")


def test_profile_latency_budget(run_cli, tmp_path):
    model = _model()
    x, y = _data()
    path = str(tmp_path / "m.keras")
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    rc, out, err = run_cli(["profile", path, "--latency-budget", "1000",
                            "--input", str(tmp_path / "x.npy"), "--labels",
                            str(tmp_path / "y.npy"), "--repeats", "2",
                            "--curve", str(tmp_path / "c.png"), "--output",
                            str(tmp_path / "out.keras")])
    assert rc == 0, err
    assert "latency budget 1000.000 ms (p50)" in out
    assert "<- chosen" in out
    assert (tmp_path / "c.png").stat().st_size > 0
    assert (tmp_path / "out.keras").stat().st_size > 0
    # Bad output paths fail before the search.
    for flag, bad in (("--output", str(tmp_path / "nodir" / "o.keras")),
                      ("--curve", str(tmp_path / "nodir" / "c.png"))):
        rc, out, err = run_cli(["profile", path, "--latency-budget", "1000",
                                "--input", str(tmp_path / "x.npy"), flag,
                                bad])
        assert rc != 0 and flag in err and "does not exist" in err, err
        assert "latency budget" not in out


class LoadClock(CutoffClock):
    """A CutoffClock whose machine is 50x slower for the calls of the
    points after the first ``fast_points`` (the load moves between
    points, as on a shared machine; each point's two arms share it)."""

    def __init__(self, reads_per_point, fast_points):
        super().__init__()
        self.reads, self.per, self.fast = 0, reads_per_point, fast_points

    def __call__(self):
        self.reads += 1
        slow = 50.0 if self.reads > self.per * self.fast else 1.0
        self.t += slow * 1e-3 / (1.0 + 10.0 * sum(f.cutoff
                                                  for f in self.fats))
        return self.t


def test_points_are_judged_by_the_interleaved_ratio():
    """A load that slows every call 50x from the third point on: by their
    own p50 the later (sparser) points look slower than the model as
    given, by the interleaved ratio they are faster, and the fastest point
    is the sparsest."""
    from tf_sparse_split.tools.latency_budget import fit_latency_budget

    model = _model()
    x, _ = _data()
    clock = CutoffClock()
    fit_latency_budget(model, 1.0, x, rounds=2, warmup=1, clock=clock)
    fats = [l.activation for l in model.layers if l.name in ("h1", "h2")]
    for f in fats:
        f.cutoff_var.assign(0.0)
    # 4 rounds of two timed calls, two clock reads each, per point.
    clock = LoadClock(reads_per_point=16, fast_points=2)
    clock.fats = fats
    res = fit_latency_budget(model, 1e-9, x, rounds=4, warmup=1, clock=clock)
    pts = res["points"]
    assert pts[-1]["p50_ms"] > pts[0]["p50_ms"]       # the load
    assert pts[-1]["ratio"] > 1.0
    assert not res["reachable"]
    assert res["chosen"] == len(pts) - 1
    assert pts[-1]["est_p50_ms"] < pts[0]["est_p50_ms"]


def test_each_timed_function_sees_one_setting_of_the_cutoffs(monkeypatch):
    """The original cutoffs are timed through one function and each point
    through a new one of its own: every function (per input shape) runs
    at one setting, so a sparse-split op instance's decision memory and
    analysis back-off never carry one setting's plan into the other's
    timed calls."""
    import tf_sparse_split.tools.latency_budget as lb

    model = _model()
    x, y = _data()
    lb.fit_latency_budget(model, 1.0, x, rounds=1, warmup=1)   # FATReLUs in
    fats = [l.activation for l in model.layers if l.name in ("h1", "h2")]
    seen, calls = {}, {}
    real = lb.function_per_instance

    class TogglingClock:   # odd reads start a timed call, even reads end it
        reads = 0

        def __call__(self):
            self.reads += 1
            return float(self.reads)

    clock = TogglingClock()

    made = []

    def recording(fn, **kwargs):
        f = real(fn, **kwargs)
        made.append(f)   # kept alive: no id reused
        serial = len(made)

        def call(t):
            key = (serial, tuple(np.shape(t)))
            setting = tuple(round(v.cutoff, 9) for v in fats)
            seen.setdefault(key, set()).add(setting)
            if clock.reads % 2:   # a timed call
                calls.setdefault(key, set()).add(setting)
            return f(t)
        return call

    monkeypatch.setattr(lb, "function_per_instance", recording)
    res = lb.fit_latency_budget(model, 1e-9, x, accuracy_data=(x, y),
                                rounds=3, warmup=1, settle_calls=1,
                                clock=clock)
    assert len(res["points"]) >= 3
    # the original setting, then one function per point, each timed at
    # one setting and never called at another (the accuracy pass included)
    assert len(calls) == 1 + len(res["points"])
    for key, settings in calls.items():
        assert len(settings) == 1 and seen[key] == settings, (key, seen)


def test_bad_samples_and_accuracy_data_are_named():
    from tf_sparse_split.tools.latency_budget import fit_latency_budget

    model = _model()
    x, y = _data()
    bad = [
        (dict(sample=None), "sample"),
        (dict(sample=x[:, :8]), "sample"),
        (dict(sample=x[:, 0]), "sample"),
        (dict(accuracy_data=(x[:, :8], y)), "accuracy_data"),
        (dict(accuracy_data=(np.full_like(x, np.nan), y)), "accuracy_data"),
        (dict(accuracy_data=(x, y + 100)), r"classes in \[0, 4\)"),
        (dict(accuracy_data=(x, y - 5)), r"classes in \[0, 4\)"),
        (dict(clock=5), "clock"),
        (dict(out=5), "out"),
        (dict(settle_calls=10 ** 6), "settle_calls"),
    ]
    for kwargs, match in bad:
        args = dict(sample=x)
        args.update(kwargs)
        sample = args.pop("sample")
        with pytest.raises(ValueError, match=match):
            fit_latency_budget(model, 1.0, sample, **args)
