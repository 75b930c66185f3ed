"""CLI flags of induced sparsity: ``train --target-sparsity`` (mlp, cnn) and
``train --model lstm`` (one short epoch on the embedded digits)."""

import re

import pytest


pytestmark = pytest.mark.usefixtures("op_library")


def test_target_sparsity_mlp_compare(run_cli):
    rc, out, _ = run_cli(["train", "--epochs", "2", "--hidden", "64,64",
                          "--target-sparsity", "0.8", "--compare",
                          "--split-all-layers", "--timing-rounds", "2",
                          "--timing-steps", "2"])
    assert rc == 0, out
    # Per-epoch lines of the induced model show the FATReLU controls.
    assert re.search(r"  hidden_2: (dense|split|sparse|auto): \d+% zeros[^\n]*"
                     r"; FATReLU cutoff \d+\.\d{4}, L1 activity penalty ",
                     out), out
    assert "  hidden_1: " in out
    assert "FATReLU" not in out.split("  hidden_1: ")[1].split(
        "\n")[0]  # fed by the pixels: not controlled
    for label in ("test accuracy", "hidden_2 in. sparsity",
                  "output in. sparsity"):
        assert re.search(rf"{re.escape(label)}\s+\d+\.\d+\s+\d+\.\d+", out), \
            label
    assert len([l for l in out.splitlines() if "speed-up" in l]) == 1
    assert re.search(r"speed-up vs plain Keras: \d+\.\d\dx \(median of 2 "
                     r"interleaved blocks of 2 steps", out)


def test_target_sparsity_cnn(run_cli):
    rc, out, _ = run_cli(["train", "--model", "cnn", "--epochs", "1",
                          "--filters", "4,8", "--target-sparsity",
                          "0.8", "--quiet", "--timing-rounds", "0"])
    assert rc == 0, out
    assert re.search(r"sparse-split: test accuracy \d\.\d{4}", out)


def test_lstm(run_cli):
    rc, out, _ = run_cli(["train", "--model", "lstm", "--units", "16",
                          "--epochs", "1", "--dropout", "row",
                          "--dropout-rate", "0.5",
                          "--recurrent-dropout-rate", "0.3", "--quiet",
                          "--timing-rounds", "0"])
    assert rc == 0, out
    assert ("model: sparse-split LSTM 8 steps x 8 features -> LSTM(16, "
            "dropout=0.5, recurrent_dropout=0.3) -> dense(10) "
            "(SparseSplitLSTM pattern=row)") in out
    assert re.search(r"sparse-split: test accuracy \d\.\d{4}", out)


def test_lstm_baseline_is_keras_lstm_with_same_rates():
    from tf_sparse_split.tools.models import build_lstm

    model = build_lstm(8, 8, 4, 10, sparse=False, dropout="row",
                       dropout_rate=0.5, recurrent_dropout_rate=0.5)
    layer = model.get_layer("lstm")
    assert type(layer) is __import__("keras").layers.LSTM
    assert layer.dropout == 0.5 and layer.recurrent_dropout == 0.5


@pytest.mark.parametrize("argv,code", [
    (["--target-sparsity", "1.0"], 2),
    (["--target-sparsity", "-0.1"], 2),
    (["--model", "lstm", "--target-sparsity", "0.5"], 2),
    (["--recurrent-dropout-rate", "0.5"], 2),
    (["--model", "gru"], 2),
    (["--units", "0"], 2),
])
def test_bad_arguments(run_cli, argv, code):
    rc, _, err = run_cli(["train", "--epochs", "1", "--hidden", "8"] + argv)
    assert rc == code, err
    assert ("usage:" in err) if code == 2 else ("error:" in err)
