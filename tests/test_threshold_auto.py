"""One spelling of the automatic threshold everywhere: ``"auto"`` (any case)
or a negative number is taken by the op wrappers, the layers' ``threshold=``
and ``set_threshold``, ``sparse_split_model``, ``rewrite.enable`` and the
command line; NaN, numbers above 1 and other strings are refused with a
message that names what is allowed. Also runs the README's "API in a few
lines" code."""

import math
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import sparse_normal

import tf_sparse_split as tfss
from tf_sparse_split import rewrite
from tf_sparse_split.tools import cli

REPO = Path(__file__).resolve().parents[1]
AUTO = ["auto", "AUTO", " Auto ", -1.0, -0.5, -1, np.float32(-2.0)]
BAD = ["fast", "", "0.5", math.nan, 1.5, math.inf]
ALLOWED = r"'auto' or a negative number for automatic"


def _sparse(rng, shape):
    return sparse_normal(rng, shape, 0.6, np.float64)


# -- op wrappers --------------------------------------------------------------
def _matmul(a, b, threshold):
    return tfss.sparse_split_matmul(a, b, threshold=threshold)


def _conv2d(x, f, threshold):
    return tfss.sparse_split_conv2d(x, f, strides=1, padding="SAME",
                                    threshold=threshold)


def _sddmm(mask, x, b, threshold):
    return tfss.ops.sparse_split_sddmm(mask, x, b, threshold=threshold)


def _cases(rng):
    a, b = _sparse(rng, (13, 7)), rng.standard_normal((7, 5))
    x, f = _sparse(rng, (2, 5, 5, 3)), rng.standard_normal((3, 3, 3, 4))
    mask, xs, bs = _sparse(rng, (9, 6)), rng.standard_normal((9, 4)), \
        rng.standard_normal((6, 4))
    masked = (mask != 0) * (xs @ bs.T)
    return {
        "matmul": (_matmul, (a, b), a @ b),
        "conv2d": (_conv2d, (x, f),
                   tf.nn.conv2d(x, f, 1, "SAME").numpy()),
        "sddmm": (_sddmm, (mask, xs, bs), masked),
    }


@pytest.mark.parametrize("op", ["matmul", "conv2d", "sddmm"])
def test_op_wrappers_take_auto_and_negative(op, op_library, rng):
    fn, args, want = _cases(rng)[op]
    args32 = [tf.constant(v, tf.float32) for v in args]
    for threshold in AUTO + [0.0, 1.0]:
        got = fn(*args32, threshold)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5,
                                   err_msg=repr(threshold))
    # Under tf.function too (the string is parsed at trace time).
    graph = tf.function(lambda *xs: fn(*xs, "auto"))
    np.testing.assert_allclose(graph(*args32).numpy(), want, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("op", ["matmul", "conv2d", "sddmm"])
@pytest.mark.parametrize("threshold", BAD, ids=repr)
def test_op_wrappers_refuse_bad_thresholds(op, threshold, op_library, rng):
    fn, args, _ = _cases(rng)[op]
    with pytest.raises(tf.errors.InvalidArgumentError, match=ALLOWED):
        fn(*[tf.constant(v, tf.float32) for v in args], threshold)


# -- layers ---------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda **kw: tfss.SparseSplitDense(3, **kw),
    lambda **kw: tfss.SparseSplitConv2D(2, 3, **kw)], ids=["dense", "conv2d"])
def test_layers_take_auto_in_init_and_set_threshold(make, op_library):
    layer = make(threshold="auto")
    assert layer.threshold == -1.0
    layer.set_threshold(0.25)
    layer.set_threshold("AUTO")      # before build
    assert layer.threshold == -1.0
    shape = (None, 4) if isinstance(layer, tfss.SparseSplitDense) else \
        (None, 5, 5, 2)
    layer.build(shape)
    assert float(layer.threshold_var.numpy()) == -1.0
    for value, want in (("auto", -1.0), (-0.5, -0.5), (0.75, 0.75)):
        layer.set_threshold(value)   # after build: assigns the variable
        assert layer.threshold == want
    # get_config keeps the number; from_config reads it back.
    layer.set_threshold("auto")
    config = layer.get_config()
    assert config["threshold"] == -1.0
    assert type(layer).from_config(config).threshold == -1.0
    for bad in BAD:
        with pytest.raises(ValueError, match=ALLOWED):
            layer.set_threshold(bad)
        with pytest.raises(ValueError, match=ALLOWED):
            make(threshold=bad)
    assert layer.threshold == -1.0   # unchanged by the refused values


# -- convert, rewrite, CLI ----------------------------------------------------
def test_sparse_split_model_takes_auto_and_negative(op_library):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
    for threshold, want in (("auto", -1.0), ("Auto", -1.0), (-0.5, -0.5)):
        split = tfss.sparse_split_model(model, threshold=threshold)
        assert split.layers[0].threshold == want
    for bad in BAD:
        with pytest.raises(ValueError, match=ALLOWED):
            tfss.sparse_split_model(model, threshold=bad)


def test_rewrite_takes_auto_and_negative(op_library):
    try:
        for threshold in ("auto", "AUTO", -0.5, 0.5):
            rewrite.enable(threshold=threshold)
            assert rewrite.is_enabled()
            assert rewrite.config()["threshold"] == threshold
            rewrite.disable()
        for bad in BAD:
            with pytest.raises(ValueError, match=ALLOWED):
                rewrite.enable(threshold=bad)
            assert not rewrite.is_enabled()
    finally:
        rewrite.disable()


@pytest.mark.parametrize("text, want", [
    ("auto", -1.0), ("AUTO", -1.0), ("-1", -1.0), ("-0.5", -0.5),
    ("0.3", 0.3), ("1", 1.0)])
def test_cli_threshold(text, want):
    parser = cli.build_parser()
    assert parser.parse_args(["train", "--threshold", text]).threshold == want
    assert parser.parse_args(["profile", "m.keras", "--threshold",
                              text]).threshold == want


@pytest.mark.parametrize("text", ["fast", "nan", "1.5", ""])
def test_cli_refuses_bad_thresholds(text, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["train", "--threshold", text])
    assert e.value.code == 2
    assert re.search(ALLOWED, capsys.readouterr().err)


# -- the README's example -----------------------------------------------------
def _readme_block(heading):
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_api_example_runs(op_library):
    """The "API in a few lines" block runs as written (it defines its own
    small data and models: ``a``, ``b``, ``x``, ``y``, ``trained``)."""
    keras.backend.clear_session()    # layer names as in a fresh process
    keras.utils.set_random_seed(0)
    names = {}
    code = _readme_block("## API in a few lines")
    assert "tf_sparse_split_sparse_split_mat_mul" in code
    exec(compile(code, "README.md", "exec"), names)
    a, b, x = names["a"], names["b"], names["x"]
    assert 0.3 < np.mean(a == 0) < 0.7            # real zeros, not all
    # The last assignment of `ab` is the raw op's product.
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(names["ab"].numpy(), want, rtol=1e-5,
                               atol=1e-4)
    assert names["stats"].shape == (tfss.tuning.stats.NUM_STATS,)
    hist = names["history"].history
    assert len(hist["sparse_split_dense/sparsity"]) == 5
    assert all(0.3 < s < 0.7 for s in hist["sparse_split_dense/sparsity"])
    assert len(hist["sparse_split_dense_1/sparsity"]) == 5
    trained = names["trained"]
    np.testing.assert_allclose(names["split"].predict(x[:4], verbose=0),
                               trained.predict(x[:4], verbose=0),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(names["plain"].predict(x[:4], verbose=0),
                                  trained.predict(x[:4], verbose=0))
