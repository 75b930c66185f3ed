"""SparseSplitConv2D / SparseSplitConv2DBackpropFilter with each sparse
kernel forced (TFSS_CONV_SPARSE_KERNEL=direct|csr) at a forced-sparse or
split threshold, against the float64 references of tf_sparse_split.testing;
and the op's gradient against tf.nn.conv2d's."""

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import testing as T
from _helpers import conv_shape_args as _args, conv_shape_id as _ids

pytestmark = pytest.mark.usefixtures("op_library")

# (n, h, w, c_in, c_out, kh, kw, strides, dilations, padding, explicit)
SHAPES = [
    (3, 7, 7, 3, 17, 3, 3, 1, 1, "SAME", None),
    (2, 13, 13, 17, 1, 3, 3, 1, 1, "VALID", None),
    (2, 11, 10, 4, 7, 3, 3, 2, 2, "SAME", None),
    (2, 11, 10, 4, 7, 3, 3, 1, 2, "EXPLICIT", [0, 0, 1, 2, 3, 0, 0, 0]),
    (4, 6, 6, 2, 16, 1, 1, 1, 1, "VALID", None),
    (5, 7, 9, 6, 40, 2, 3, (1, 2), 1, "SAME", None),
    (1, 14, 14, 64, 33, 3, 3, 1, 1, "SAME", None),
    # "mixed" at threshold 0.5: one dense and one sparse image, the direct
    # filter gradient summing into the dense part's df in place.
    (2, 9, 9, 8, 32, 3, 3, 1, 1, "SAME", None),
]




@pytest.fixture(params=["direct", "csr"])
def kernel(request, monkeypatch):
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", request.param)
    return request.param


def _mixed_images(xs, rng):
    """Images of densities 0.05 .. 0.95 (a 0.5 threshold splits them)."""
    n = xs[0]
    dens = np.linspace(0.05, 0.95, n) if n > 1 else [0.4]
    return np.stack([T.random_sparse_images((1,) + xs[1:], 1 - d, rng,
                                            np.float64)[0] for d in dens])


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("sparsity", [0.5, 0.9, "mixed"])
def test_forward(shape, sparsity, kernel):
    rng = np.random.default_rng(abs(hash((_ids(shape), str(sparsity)))) % 2**32)
    xs, fs, kw = _args(shape)
    x = (_mixed_images(xs, rng) if sparsity == "mixed" else
         T.random_sparse_images(xs, sparsity, rng, np.float64))
    f = rng.normal(size=fs)
    ref = T.reference_conv2d(x, f, **kw)
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        for thr in (1.0, 0.5):
            y = tfss.sparse_split_conv2d(x.astype(dtype), f.astype(dtype),
                                         threshold=thr, **kw)
            assert T.relative_error(y, ref) <= tol, (dtype, thr)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("sparsity", [0.5, "mixed"])
def test_filter_gradient(shape, sparsity, kernel, op_library):
    rng = np.random.default_rng(abs(hash((_ids(shape), str(sparsity), 1))) % 2**32)
    xs, fs, kw = _args(shape)
    x = (_mixed_images(xs, rng) if sparsity == "mixed" else
         T.random_sparse_images(xs, sparsity, rng, np.float64))
    dy = rng.normal(size=T.reference_conv2d(x, np.zeros(fs), **kw).shape)
    ref = T.reference_conv2d_filter_grad(x, fs, dy, **kw)
    s, d = kw["strides"], kw["dilations"]
    s = [1, *((s, s) if isinstance(s, int) else s), 1]
    d = [1, d, d, 1]
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        for thr in (1.0, 0.5):
            g, _ = op_library.tf_sparse_split_sparse_split_conv2d_backprop_filter(
                x.astype(dtype), fs, dy.astype(dtype), thr, strides=s,
                padding=kw["padding"], dilations=d,
                explicit_paddings=kw["explicit_paddings"] or [])
            assert T.relative_error(g, ref) <= tol, (dtype, thr)


@pytest.mark.parametrize("strides", [1, 2])
def test_gradients_match_tf_conv2d(strides, kernel):
    rng = np.random.default_rng(strides)
    x = tf.constant(np.maximum(rng.normal(size=(3, 10, 10, 8)), 0), tf.float32)
    f = tf.constant(rng.normal(size=(3, 3, 8, 12)), tf.float32)
    dy = tf.constant(np.maximum(rng.normal(size=(3, 10 // strides, 10 // strides,
                                                 12)), 0), tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, f])
        ours = tfss.sparse_split_conv2d(x, f, strides, "SAME", threshold=1.0)
        ref = tf.nn.conv2d(x, f, strides, "SAME")
        lo, lr = tf.reduce_sum(ours * dy), tf.reduce_sum(ref * dy)
    assert T.relative_error(ours, ref.numpy()) <= 1e-5
    for a, b in zip(tape.gradient(lo, [x, f]), tape.gradient(lr, [x, f])):
        assert T.relative_error(a, b.numpy()) <= 1e-5


def test_nan_propagates_through_the_direct_kernel(monkeypatch):
    monkeypatch.setenv("TFSS_CONV_SPARSE_KERNEL", "direct")
    rng = np.random.default_rng(5)
    x = T.random_sparse_images((2, 8, 8, 5), 0.6, rng, np.float32)
    x[1, 3, 3, 2] = np.nan
    f = rng.normal(size=(3, 3, 5, 4)).astype(np.float32)
    y = tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=1.0).numpy()
    ref = tf.nn.conv2d(x, f, 1, "SAME").numpy()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    assert np.isnan(y).sum() == 9 * 4


def test_automatic_choice_matches_reference(monkeypatch):
    # No override: the first automatic call calibrates the sparse-kernel
    # choice and the family; the answer is the same whichever is taken.
    monkeypatch.delenv("TFSS_CONV_SPARSE_KERNEL", raising=False)
    rng = np.random.default_rng(6)
    x = T.random_sparse_images((4, 12, 12, 16), 0.6, rng, np.float64)
    f = rng.normal(size=(3, 3, 16, 24))
    ref = T.reference_conv2d(x, f, strides=1, padding="SAME")
    for _ in range(3):
        y = tfss.sparse_split_conv2d(x.astype(np.float32), f.astype(np.float32),
                                     1, "SAME", threshold=-1.0)
        assert T.relative_error(y, ref) <= 1e-5
