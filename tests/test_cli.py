"""Tests of the tf-sparse-split command line (in-process; needs the op)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tf_sparse_split.tools import cli

pytestmark = pytest.mark.usefixtures("op_library")

REPO = Path(__file__).resolve().parents[1]
SMALL = ["train", "--epochs", "1", "--hidden", "32,16", "--batch-size", "128"]
#: Short timing of the speed-up line (the figure itself is not tested here).
FAST = ["--timing-rounds", "2", "--timing-steps", "2"]


def test_train_sparse_on_digits(run_cli):
    rc, out, _ = run_cli(SMALL + ["--epochs", "2"] + FAST)
    assert rc == 0
    assert "data: scikit-learn digits" in out
    assert "1438 train / 359 test examples, 64 features" in out
    assert ("model: sparse-split MLP 64-32-16-10 (SparseSplitDense; plain "
            "Keras where a sparse-split layer cannot win: hidden_1 (on the "
            "model input), output (10 units))") in out
    assert re.search(r"epoch 1/2: time \d+\.\d\d s, loss \d\.\d{4}, "
                     r"accuracy \d\.\d{4}", out)
    assert "epoch 2/2: time" in out
    # The one sparse-split layer's line, in words, with the FATReLU of the
    # default target sparsity.
    m = re.search(r"  hidden_2: (dense|split|sparse|auto): (\d+)% zeros[^\n]*"
                  r"; FATReLU cutoff \d+\.\d{4}, L1 activity penalty ", out)
    assert m, out
    assert 0 < int(m.group(2)) < 100
    assert "  hidden_1:" not in out and "  output:" not in out
    m = re.search(r"sparse-split: test accuracy (\d\.\d{4})", out)
    assert m and float(m.group(1)) > 0.2  # better than chance after 2 epochs
    assert re.search(r"time/epoch \d+\.\d\d s \(steady state: epoch 2; "
                     r"epoch 1, with tracing: \d+\.\d\d s\)", out)
    speed = [l for l in out.splitlines() if "speed-up" in l]
    assert len(speed) == 1 and speed[0].startswith(
        "speed-up vs plain Keras (same layers and initial weights): "), out
    # stdout is not a terminal here: no progress bar control characters.
    assert "\r" not in out and "\x08" not in out and "\x1b" not in out


def test_split_all_layers(run_cli):
    rc, out, _ = run_cli(SMALL + ["--split-all-layers", "--timing-rounds",
                                  "0", "--target-sparsity", "none"])
    assert rc == 0, out
    assert "model: sparse-split MLP 64-32-16-10 (SparseSplitDense)\n" in out
    for name in ("hidden_1", "hidden_2", "output"):
        assert re.search(rf"  {name}: (dense|split|sparse|auto): \d+% zeros",
                         out), name
    assert "speed-up" not in out and "FATReLU" not in out


def test_train_baseline(run_cli):
    rc, out, _ = run_cli(SMALL + ["--baseline", "--quiet"])
    assert rc == 0
    assert "model: baseline MLP 64-32-16-10 (keras.layers.Dense)" in out
    assert "input sparsity" not in out.split("model:")[1]
    assert "epoch 1/1" not in out  # --quiet
    assert re.search(r"baseline: test accuracy \d\.\d{4}", out)


def test_train_compare(run_cli):
    rc, out, _ = run_cli(SMALL + ["--compare", "--threshold", "0.5",
                                  "--target-sparsity", "none"] + FAST)
    assert rc == 0
    assert "model: sparse-split MLP" in out and "model: baseline MLP" in out
    assert re.search(r"\s+sparse-split\s+baseline", out)
    for label in ("final loss", "final accuracy", "test accuracy",
                  "hidden_2 in. sparsity"):
        assert re.search(rf"{re.escape(label)}\s+\d+\.\d+\s+\d+\.\d+", out), \
            label
    # One speed-up figure, from interleaved step blocks; no epoch ratio.
    speed = [l for l in out.splitlines() if "speed-up" in l]
    assert len(speed) == 1, out
    assert re.match(r"speed-up vs plain Keras: \d+\.\d\dx \(median of 2 "
                    r"interleaved blocks of 2 steps, range ", speed[0])
    assert "time/epoch, " not in out.split("sparse-split      baseline")[1]
    # Same seed, same data, same results to float rounding: the final
    # training losses agree closely.
    loss = re.search(r"final loss\s+(\d+\.\d+)\s+(\d+\.\d+)", out)
    assert abs(float(loss.group(1)) - float(loss.group(2))) < 2e-3


@pytest.mark.parametrize("argv", [
    ["train", "--hidden", "0"], ["train", "--threshold", "2"],
    ["train", "--epochs", "-1"], ["train", "--baseline", "--compare"],
    ["nope"], [],
    ["train", "--threshold", "fast"], ["profile", "m.keras", "--threshold", "nan"],
    # conflicting or ignored flags
    ["train", "--model", "cnn", "--hidden", "8"],
    ["train", "--filters", "4,4"],
    ["train", "--baseline", "--threshold", "0.5"],
    ["train", "--model", "cnn", "--dropout", "row"],
    ["train", "--dropout-rate", "0.3"],
    ["train", "--dropout", "row", "--tile-shape", "2,2"],
    ["profile", "m.keras", "--input", "x.npy", "--batch-size", "4"],
    ["profile", "m.keras", "--input", "x.npy", "--input-sparsity", "0.2"],
    ["train", "--target-sparsity", "0.95x"],
    ["train", "--timing-rounds", "-1"], ["train", "--timing-steps", "0"],
    ["train", "--baseline", "--split-all-layers"],
    ["train", "--baseline", "--timing-rounds", "3"],
])
def test_bad_arguments_exit_2(run_cli, argv):
    rc, _, err = run_cli(argv)
    assert rc == 2
    assert "usage:" in err


def test_missing_data_dir_exits_1(run_cli, tmp_path):
    rc, _, err = run_cli(SMALL + ["--data", str(tmp_path / "none")])
    assert rc == 1
    assert "MNIST directory not found" in err


def test_python_dash_m_help():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, "-m", "tf_sparse_split", "train", "--help"],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: tf-sparse-split train" in proc.stdout
    assert "--baseline" in proc.stdout and "--compare" in proc.stdout


def test_threshold_help_matches_accepted_values(capsys):
    assert cli.main(["train", "--threshold", "auto", "--help"]) == 0
    out = capsys.readouterr().out
    assert "[0, 1]" in out and "'auto'" in out and "negative" not in out
    assert cli.parse_threshold("auto") == -1.0
    assert cli.parse_threshold("0.25") == 0.25


@pytest.mark.parametrize("how", ["console_script", "dash_m"])
def test_help_is_fast_and_does_not_import_tensorflow(how):
    """--help must not import TensorFlow (no TF log lines, under 2 s)."""
    script = Path(sys.executable).parent / "tf-sparse-split"
    if how == "console_script":
        if not script.exists():
            pytest.skip("console script not installed")
        cmd = [str(script), "--help"]
    else:
        cmd = [sys.executable, "-m", "tf_sparse_split", "--help"]
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=120)
        times.append(time.perf_counter() - t0)
        assert proc.returncode == 0, proc.stderr
        assert "usage: tf-sparse-split" in proc.stdout
        assert proc.stderr == ""  # no TensorFlow log lines
    assert min(times) < 2.0, times
    probe = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom tf_sparse_split.tools import "
         "cli\ncli.build_parser()\nimport tf_sparse_split.__main__\n"
         "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))"],
        capture_output=True, text=True, env=env, timeout=120)
    assert probe.stdout.strip() == "[]", probe.stderr
