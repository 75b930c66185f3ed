"""``benchmarks/bench_cli_configs.py``'s reading of the CLI's output and
its choice of configurations (no CLI run: the runs belong to the
benchmark). The speed-up line is made by the CLI's own formatter, so the
parser follows it."""

import pytest
from _helpers import import_benchmark

from tf_sparse_split.tools.timing import format_speedup


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_cli_configs")


def _output(block, median=1.34, lo=1.21, hi=1.46):
    summary = {"median": median, "min": lo, "max": hi, "rounds": 16,
               "ours_s": 0.0123, "reference_s": 0.0165}
    return ("epoch 5/5: time 0.24 s, loss 0.1910, accuracy 0.9805\n"
            "                       sparse-split      baseline\n"
            "final accuracy               0.9096        0.9096\n"
            "test accuracy                0.9777        0.9582\n"
            "hidden_2 in. sparsity         0.618         0.248\n"
            + format_speedup(summary, block) + "\n")


@pytest.mark.parametrize("block", [1, 8])
def test_parses_the_cli_speedup_line_and_accuracies(bench, block):
    r = bench.parse(_output(block, median=0.97, lo=0.64, hi=1.10))
    assert r["speedup"] == pytest.approx(0.97)
    assert (r["lo"], r["hi"]) == (pytest.approx(0.64), pytest.approx(1.10))
    assert (r["blocks"], r["steps"]) == (16, block)
    assert (r["ours_ms"], r["plain_ms"]) == (pytest.approx(12.3),
                                             pytest.approx(16.5))
    assert (r["acc_ours"], r["acc_plain"]) == (pytest.approx(0.9777),
                                               pytest.approx(0.9582))


def test_output_without_a_speedup_line_is_an_error(bench):
    with pytest.raises(ValueError, match="no speed-up line"):
        bench.parse("baseline: test accuracy 0.9582\n")


def test_configurations_cover_every_model_and_dropout(bench, tmp_path):
    labels = [label for label, _ in bench.selected("", tmp_path)]
    assert labels[0] == "default"
    for word in ("--model cnn", "--model lstm", "--dropout row",
                 "--dropout tile", "--dropout standard",
                 "--target-sparsity none", "--data MNIST"):
        assert any(word in label for label in labels), word
    # The MNIST directory goes into the flags; without one that
    # configuration is left out.
    flags = dict(bench.selected("", tmp_path))["--data MNIST"]
    assert flags == ("--data", str(tmp_path))
    assert all("MNIST" not in label for label, _ in bench.selected("", None))


def test_only_keeps_the_configurations_naming_a_word(bench):
    got = [label for label, _ in bench.selected("lstm,default", None)]
    assert got[0] == "default"
    assert all(label == "default" or "lstm" in label for label in got)
    assert len(got) == 5
