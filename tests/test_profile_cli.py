"""Tests of ``tf-sparse-split profile`` (in-process; needs the op library)."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.tools import cli, profile

pytestmark = pytest.mark.usefixtures("op_library")


def _rows(out):
    """{node name: fields} from the report's table."""
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 9 and parts[1] in ("MatMul", "Conv2D"):
            rows[parts[0]] = parts
    return rows


@pytest.fixture(scope="module")
def keras_model(tmp_path_factory):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(24, activation="relu", name="h1"),
        keras.layers.Dense(5, name="out")])
    path = str(tmp_path_factory.mktemp("k") / "mlp.keras")
    model.save(path)
    return model, path


def test_profile_keras_file_with_input(keras_model, tmp_path, capsys):
    model, path = keras_model
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 12)).astype(np.float32)
    x[:, :9] = 0.0  # 75% zeros, 9 all-zero columns
    np.save(tmp_path / "x.npy", x)
    rc = cli.main(["profile", path, "--input", str(tmp_path / "x.npy"),
                   "--repeats", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "inputs: [40, 12]" in out and "0.750 zeros" in out
    rows = _rows(out)
    assert len(rows) == 2, out
    first = next(r for n, r in rows.items() if "h1" in n)
    second = next(r for n, r in rows.items() if "out" in n)
    assert first[2] == "40x12x24" and second[2] == "40x24x5"
    # The first layer reads the model's input ("Input", a default producer).
    assert first[3] == "Input" and first[4] == "yes"
    assert second[3] == "Relu" and second[4] == "yes"
    assert float(first[5]) == pytest.approx(0.75, abs=1e-3)
    assert float(first[6]) == pytest.approx(0.75, abs=1e-3)
    w, b = model.get_layer("h1").get_weights()
    h = np.maximum(x @ w + b, 0)
    assert float(second[5]) == pytest.approx(float(np.mean(h == 0)), abs=1e-3)
    for r in (first, second):  # dense ms, split ms, speed-up
        assert float(r[7]) > 0 and float(r[8]) > 0 and r[9].endswith("x")
    # The headline covers the nodes the pass would replace: both.
    m = re.search(r"total \(pass=yes nodes\)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+"
                  r"\d+\.\d+x", out)
    assert m, out
    assert float(m.group(1)) == pytest.approx(
        float(first[7]) + float(second[7]), abs=2e-3)
    assert "headline: the 2 node(s) the rewrite pass would replace" in out
    assert "not replaced" not in out, out
    assert re.search(r"whole model, end to end \(one call, rewrite pass off "
                     r"vs on\): \d+\.\d+ ms vs \d+\.\d+ ms, \d+\.\d+x", out)
    assert "jit_compile=False" in out


def test_profile_saved_model_random_inputs(tmp_path, capsys):
    rng = np.random.default_rng(1)

    class M(tf.Module):
        def __init__(self):
            super().__init__()
            self.w1 = tf.Variable(rng.standard_normal((16, 32)).astype(np.float32))
            self.w2 = tf.Variable(rng.standard_normal((32, 4)).astype(np.float32))
            self.k = tf.Variable(rng.standard_normal((3, 3, 1, 2)).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32)])
        def __call__(self, x):
            img = tf.reshape(x, [-1, 4, 4, 1])
            c = tf.nn.conv2d(tf.nn.relu(img), self.k, 1, "SAME")
            h = tf.nn.relu(tf.matmul(x, self.w1)) + tf.reduce_sum(c)
            return tf.matmul(h, self.w2)

    path = str(tmp_path / "sm")
    tf.saved_model.save(M(), path)
    rc = cli.main(["profile", path, "--batch-size", "8", "--repeats", "2",
                   "--input-sparsity", "0.8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "SavedModel, signature 'serving_default'" in out
    assert "inputs: [8, 16]" in out
    rows = _rows(out)
    ops = sorted(r[1] for r in rows.values())
    assert ops == ["Conv2D", "MatMul", "MatMul"], out
    mm = [r for r in rows.values() if r[1] == "MatMul"]
    sparsities = sorted(float(r[5]) for r in mm)
    assert any(abs(s - 0.8) < 0.1 for s in sparsities), out  # input x
    # The pass's own answer: the Conv2D reads relu(img) and is replaced by
    # default (enable() rewrites Conv2D too); of the MatMuls, the one that
    # reads the signature's input is replaced ("Input"), the one that reads
    # relu(...) + sum is not.
    conv = next(r for r in rows.values() if r[1] == "Conv2D")
    assert conv[-7] == "Relu" and conv[-6] == "yes", out
    assert sorted((r[3], r[4]) for r in mm) == [("AddV2", "no"),
                                                ("Input", "yes")], out
    assert "total (pass=yes nodes)" in out


def test_profile_errors(tmp_path, keras_model, capsys):
    assert cli.main(["profile", str(tmp_path / "missing")]) == 1
    assert "no such model" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.zeros((3, 7), np.float32))
    _, path = keras_model
    assert cli.main(["profile", path, "--input", str(tmp_path / "bad.npy")]) == 1
    assert "does not fit" in capsys.readouterr().err
    assert cli.main(["profile", path, "--input-sparsity", "1.5"]) == 2
    capsys.readouterr()


def test_profile_model_api(keras_model):
    _, path = keras_model
    desc, rows, shapes = profile.profile_model(path, batch_size=4, repeats=1)
    assert "Keras" in desc and shapes == [(4, 12)]
    assert [r["op"] for r in rows] == ["MatMul", "MatMul"]
    assert all(r["split_s"] > 0 and r["dense_s"] > 0 for r in rows)


def test_profile_model_with_sparse_split_layers(tmp_path, capsys):
    """Models already built with our layers profile their SparseSplit* nodes
    (their statistics variables are not updated in the frozen graph)."""
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((16,)),
        tfss.SparseSplitDense(32, activation="relu", name="s1"),
        tfss.SparseSplitDense(4, name="s2")])
    path = str(tmp_path / "split.keras")
    model.save(path)
    assert cli.main(["profile", path, "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "TfSparseSplit>SparseSplitMatMul" in ln.split()[1:2]]
    assert len(lines) == 2, out
    assert all(ln.split()[4] == "ours" for ln in lines), out
    assert "the rewrite pass would replace none of these nodes" in out
