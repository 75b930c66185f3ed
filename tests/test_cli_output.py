"""What ``tf-sparse-split`` prints and when it refuses: output paths checked
before training (exit 2, one error line), per-layer lines in words, the one
speed-up line of interleaved step blocks (logic tested on a fake clock),
no rewrite-pass warning of the CLI's own functions, and the inference
benchmark's smoke mode."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tf_sparse_split.tools import timing
from tf_sparse_split.tools.train import auto_block, describe_split

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--epochs", "1", "--hidden", "16,16"]


def _one_error_line(err):
    lines = [l for l in err.strip().splitlines() if "error:" in l]
    assert len(lines) == 1, err
    return lines[0]


# -- output paths fail before training --------------------------------------
@pytest.mark.parametrize("plot, what", [
    ("out.jpg", "PNG"),
    ("{tmp}/nodir/x.png", "does not exist"),
    ("{tmp}", "PNG"),
    ("{tmp}/file.txt/x.png", "does not exist"),
])
def test_bad_plot_path_fails_before_training(run_cli, tmp_path, monkeypatch,
                                             plot, what):
    (tmp_path / "file.txt").write_text("x")
    _no_training(monkeypatch)
    rc, out, err = run_cli(TRAIN + ["--plot", plot.format(tmp=tmp_path)])
    assert rc == 2
    assert what in _one_error_line(err)
    assert out == ""


@pytest.mark.parametrize("flag", ["--tensorboard", "--checkpoint-dir"])
def test_unwritable_directory_fails_before_training(run_cli, tmp_path,
                                                    monkeypatch, flag):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    _no_training(monkeypatch)
    for bad in (blocker, blocker / "sub" / "dir"):
        rc, out, err = run_cli(TRAIN + [flag, str(bad)])
        assert rc == 2
        line = _one_error_line(err)
        assert flag in line and str(bad) in line
        assert out == ""


def test_read_only_directory_is_refused(run_cli, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        _no_training(monkeypatch)
        rc, _, err = run_cli(TRAIN + ["--tensorboard", str(ro / "tb")])
        assert rc == 2 and "not writable" in _one_error_line(err)
    finally:
        ro.chmod(0o700)


def test_good_paths_pass_the_check(tmp_path, monkeypatch):
    from tf_sparse_split.tools import cli

    parser = cli.build_parser()
    args = parser.parse_args(TRAIN + [
        "--plot", str(tmp_path / "a.PNG"), "--tensorboard",
        str(tmp_path / "new" / "tb"), "--checkpoint-dir", str(tmp_path)])
    cli._check_combinations(parser, args)  # no SystemExit
    assert not (tmp_path / "new").exists()  # checked, not created


def _no_training(monkeypatch):
    """Makes any training attempt fail the test."""
    import tf_sparse_split.tools.train as train

    def boom(*a, **k):
        raise AssertionError("training started despite a bad argument")

    monkeypatch.setattr(train, "train_command", boom)


# -- per-layer lines in words ------------------------------------------------
@pytest.mark.parametrize("sparsity, threshold, text", [
    (0.31, 0.0, "dense: 31% zeros, below break-even"),
    (0.925, 1.0, "sparse: 92% zeros, every row on the CSR kernel"),
    (0.85, 0.125, "split: 85% zeros, rows denser than 0.125 dense, the rest "
                  "CSR"),
    (0.6, -1.0, "auto: 60% zeros, the op decides per call"),
])
def test_describe_split(sparsity, threshold, text):
    assert describe_split(sparsity, threshold) == text


@pytest.mark.parametrize("sparsity, rows_sparse, text", [
    (0.24, 0.0, "dense: 24% zeros, below break-even: every row on the dense "
                "GEMM (the op decides per call)"),
    (0.92, 1.0, "sparse: 92% zeros, every row on the CSR kernel (the op "
                "decides per call)"),
    (0.6, 0.45, "split: 60% zeros, 45% of rows on the CSR kernel, the rest "
                "dense (the op decides per call)"),
    (0.6, None, "auto: 60% zeros, the op decides per call"),
    (0.6, float("nan"), "auto: 60% zeros, the op decides per call"),
])
def test_describe_split_of_an_automatic_layer_says_what_ran(
        sparsity, rows_sparse, text):
    assert describe_split(sparsity, -1.0, rows_sparse) == text


def test_epoch_line_of_an_automatic_layer_reads_the_rows_not_the_pick():
    # The op's model may report a split threshold (0.875) for the epoch's
    # mean histogram while the op ran every row dense: the line says what
    # ran.
    import io

    from tf_sparse_split.tools.train import epoch_printer

    out = io.StringIO()
    printer = epoch_printer(1, ["hidden_2", "hidden_3"], out,
                            auto_layers={"hidden_2"})
    printer.on_epoch_begin(0)
    printer.on_epoch_end(0, {"loss": 0.5, "accuracy": 0.9,
                             "hidden_2/sparsity": 0.24,
                             "hidden_2/threshold": 0.875,
                             "hidden_2/rows_sparse": 0.0,
                             "hidden_3/sparsity": 0.74,
                             "hidden_3/threshold": 0.75,
                             "hidden_3/rows_sparse": 0.5})
    lines = out.getvalue().splitlines()
    assert lines[1] == ("  hidden_2: dense: 24% zeros, below break-even: "
                        "every row on the dense GEMM (the op decides per "
                        "call)")
    assert lines[2] == ("  hidden_3: split: 74% zeros, rows denser than "
                        "0.750 dense, the rest CSR")


def test_epoch_lines_say_dense_in_words(run_cli):
    rc, out, _ = run_cli(TRAIN + ["--threshold", "0", "--timing-rounds", "0",
                                  "--target-sparsity", "none"])
    assert rc == 0, out
    assert "threshold 0.0000" not in out and "threshold for next" not in out
    assert re.search(r"  hidden_2: (dense|split|sparse|auto): \d+% zeros", out)
    # The layers that stay plain are named once, with the reason.
    assert ("plain Keras where a sparse-split layer cannot win: hidden_1 (on "
            "the model input), output (10 units)") in out


def test_errors_after_parsing_show_the_subcommands_usage(run_cli):
    # A conflict found after argparse (not by it) prints the usage of the
    # subcommand the user ran, not the top-level "COMMAND ..." line.
    rc, _, err = run_cli(["train", "--step-budget", "20",
                          "--target-sparsity", "0.9"])
    assert rc == 2
    assert "usage: tf-sparse-split train" in err
    assert "tf-sparse-split train: error: --step-budget" in err
    rc, _, err = run_cli(["profile", "m.keras", "--input", "x.npy",
                          "--batch-size", "4"])
    assert rc == 2 and "usage: tf-sparse-split profile" in err


# -- the one speed-up line ---------------------------------------------------
class FakeClock:
    """A clock that advances only when a fake step runs."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_interleaved_blocks_alternate_and_time_each_block():
    clock, order = FakeClock(), []
    cost = {"ours": 0.010, "reference": 0.015}

    def step(name):
        def run(i):
            order.append((name, i))
            clock.t += cost[name]
        return run

    times = timing.interleaved_blocks(
        {"ours": step("ours"), "reference": step("reference")}, rounds=4,
        block=3, clock=clock)
    firsts = [order[k][0] for k in range(0, len(order), 3)][::2]
    assert firsts == ["ours", "reference", "ours", "reference"]
    assert [i for _, i in order[:3]] == [0, 1, 2]
    assert times["ours"] == pytest.approx([0.010] * 4)
    assert times["reference"] == pytest.approx([0.015] * 4)
    s = timing.speedup_summary(times, "ours", "reference")
    assert s["median"] == pytest.approx(1.5)
    assert s["rounds"] == 4


def test_speedup_summary_is_the_median_of_per_block_ratios():
    times = {"ours": [1.0, 1.0, 2.0, 1.0, 4.0],
             "reference": [1.2, 1.5, 2.0, 1.4, 4.4]}
    s = timing.speedup_summary(times, "ours", "reference")
    assert s["median"] == pytest.approx(1.2)      # of 1.2 1.5 1.0 1.4 1.1
    assert (s["min"], s["max"]) == pytest.approx((1.0, 1.5))
    line = timing.format_speedup(s, 8)
    assert line == ("speed-up vs plain Keras: 1.20x (median of 5 interleaved "
                    "blocks of 8 steps, range 1.00-1.50x; 1000.0 ms vs "
                    "1500.0 ms per step)")
    with pytest.raises(ValueError):
        timing.speedup_summary({"ours": [1.0], "reference": []}, "ours",
                               "reference")
    with pytest.raises(ValueError):
        timing.speedup_summary({"ours": [0.0], "reference": [1.0]}, "ours",
                               "reference")
    with pytest.raises(ValueError):
        timing.interleaved_blocks({"a": lambda i: None}, 0, 1)


def test_auto_block_sizes_blocks_by_step_time():
    assert auto_block(0.004) == 50          # 0.2 s / 4 ms
    assert auto_block(0.1) == 8             # at least 8 steps
    assert auto_block(1e-5) == 64           # at most 64
    assert auto_block(0.0) == 8


def test_step_speedup_on_fake_models():
    """The CLI's timing of two models: both trained on the same batches,
    interleaved, warm-up excluded; the fake clock advances per step."""
    import numpy as np

    from tf_sparse_split.tools.train import step_speedup

    clock = FakeClock()

    class Fake:
        def __init__(self, cost):
            self.cost, self.seen = cost, []

        def train_on_batch(self, x, y):
            self.seen.append(int(x.shape[0]))
            clock.t += self.cost

    ours, ref = Fake(0.02), Fake(0.05)
    x = np.zeros((100, 4), np.float32)
    y = np.zeros(100, np.int32)
    s = step_speedup(ours, ref, x, y, batch_size=32, rounds=6, block=None,
                     clock=clock)
    assert s["median"] == pytest.approx(2.5)
    assert s["min"] == pytest.approx(2.5) and s["rounds"] == 6
    assert s["block"] == 10                 # 0.2 s / 0.02 s
    assert len(ours.seen) == 4 + 6 * 10 and set(ours.seen) == {32}


def test_compare_prints_one_speedup_line(run_cli):
    rc, out, _ = run_cli(TRAIN + ["--compare", "--timing-rounds", "2",
                                  "--timing-steps", "2"])
    assert rc == 0, out
    lines = [l for l in out.splitlines() if "speed-up" in l]
    assert len(lines) == 1, out
    assert re.fullmatch(
        r"speed-up vs plain Keras: \d+\.\d\dx \(median of 2 interleaved "
        r"blocks of 2 steps, range \d+\.\d\d-\d+\.\d\dx; \d+\.\d ms vs "
        r"\d+\.\d ms per step\)", lines[0])
    assert re.search(r"test accuracy\s+\d\.\d{4}\s+\d\.\d{4}", out)
    assert "steady epoch, median" not in out


# -- profile --end-to-end on a plain model: no warning about itself ---------
def test_end_to_end_profile_of_plain_model_does_not_warn(tmp_path, run_cli):
    import keras

    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(8)])
    path = tmp_path / "plain.keras"
    model.save(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc, out, err = run_cli(["profile", str(path), "--end-to-end",
                                "--repeats", "2", "--batch-size", "8"])
    assert rc == 0, err
    assert not [w for w in caught if "already instantiated" in str(w.message)]
    assert "already instantiated" not in err
    assert "rewrite" in out


# -- the inference benchmark's smoke mode -------------------------------------
@pytest.mark.slow
def test_bench_inference_quick(tmp_path):
    out = tmp_path / "inf.md"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_inference.py"),
         "--quick", "--models", "mlp,cnn-small", "--batches", "4",
         "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.count("\n| mlp | 4 |") == 1 and "| cnn-small | 4 |" in text
    for row in [l for l in text.splitlines() if l.startswith("| mlp")
                or l.startswith("| cnn")]:
        diff = float(row.rstrip(" |").split("|")[-1])
        assert diff < 1e-4                   # the variants agree
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


# -- the plot's legend and the text agree --------------------------------------
def test_plot_legend_uses_the_steady_mean_the_text_prints(tmp_path,
                                                          monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tf_sparse_split.tools import plots, train

    times = [9.0, 1.0, 2.0]
    assert plots.steady_mean(times) == train._steady(times) == 1.5
    assert plots.steady_mean([4.0]) == 4.0
    labels = []
    monkeypatch.setattr(plt, "close", lambda fig: labels.extend(
        t.get_text() for ax in fig.axes if ax.get_legend()
        for t in ax.get_legend().get_texts()))
    summary = {"median": 1.4, "min": 1.2, "max": 1.6}
    plots.plot_training([{"kind": "sparse-split", "epoch_times": times,
                          "tuning_history": []}], tmp_path / "p.png",
                        speedup=summary)
    assert "sparse-split (mean of epochs 2-3: 1.50 s)" in labels
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
