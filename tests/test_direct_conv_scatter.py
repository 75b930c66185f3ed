"""The row-scatter forward kernel of the direct convolution
(cc/core/direct_conv2d.h, ScatterForward: thin inputs, stride 1 and
dilation 1 in width) through the pybind11 module, against the float64
reference of test_direct_conv.py and against the other kernels: filter
widths 1 to 7, filter rows 1 to 5, row strides and dilations, SAME, VALID
and explicit paddings (columns outside every window), one to sixteen input
channels, partial output vectors and several output blocks (8-vector blocks
of 1x1 filters with C_out a multiple of 128), all-zero and all-nonzero
inputs, NaN/Inf in the input and the filter, bits that do not depend on the
thread count, and which kernel the automatic choice takes."""

import numpy as np
import pytest

from tf_sparse_split._loader import kernels
from tf_sparse_split.testing import relative_error

from test_direct_conv import (_same_nonfinite, _sparse_x,
                              assert_forward_matches, ref_conv)

K = kernels()

# (n, h, w, c_in, c_out, kh, kw, strides, dilations, padding)
CASES = [
    (2, 9, 28, 1, 16, 3, 3, (1, 1), (1, 1), "SAME"),       # MNIST first layer
    (3, 6, 11, 2, 20, 3, 3, (1, 1), (1, 1), "SAME"),       # partial 2nd vector
    (2, 7, 9, 1, 33, 3, 3, (1, 1), (1, 1), "VALID"),       # 3 vectors, 1 lane
    (2, 8, 10, 3, 32, 5, 5, (1, 1), (1, 1), "SAME"),       # 5x5
    (1, 12, 13, 16, 70, 5, 5, (1, 1), (1, 1), "SAME"),     # 2 blocks
    (2, 9, 9, 3, 8, 7, 7, (1, 1), (1, 1), "SAME"),         # 7x7 wider than half the row
    (2, 6, 7, 4, 5, 2, 2, (1, 1), (1, 1), "VALID"),        # 2x2
    (2, 5, 6, 2, 17, 1, 1, (1, 1), (1, 1), "SAME"),        # 1x1
    (1, 4, 5, 3, 256, 1, 1, (1, 1), (1, 1), "SAME"),       # 1x1, 8-vector blocks
    (2, 11, 10, 2, 19, 3, 3, (2, 1), (1, 1), "SAME"),      # row stride 2
    (1, 12, 8, 5, 21, 3, 5, (3, 1), (2, 1), "VALID"),      # row stride + dilation
    (2, 7, 9, 1, 16, 3, 3, (1, 1), (1, 1), (0, 2, 2, 0)),  # column 0 unseen at right
    (2, 7, 9, 2, 16, 3, 3, (1, 1), (1, 1), (1, 0, 0, 2)),  # last columns unseen
    (2, 5, 6, 3, 5, 3, 3, (1, 1), (1, 1), (2, 2, 3, 3)),   # pads wider than the filter
    (1, 3, 1, 1, 16, 3, 3, (1, 1), (1, 1), "SAME"),        # W = 1
    (2, 4, 70, 1, 16, 3, 3, (1, 1), (1, 1), "SAME"),       # a row over 64 values
    (2, 4, 40, 2, 8, 3, 5, (1, 1), (1, 1), "SAME"),        # 80 values, C_in 2
]


def _id(c):
    n, h, w, ci, co, kh, kw, s, d, p = c
    return f"{n}x{h}x{w}x{ci}-{kh}x{kw}x{co}-s{s[0]}1-d{d[0]}1-{p}"


def _forward(x, f, s, d, p, **kw):
    return K.direct_conv2d(x, f, strides=s, dilations=d, padding=p, **kw)


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_scatter_forward_matches_reference(case, sparsity, monkeypatch):
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "scatter")
    n, h, w, ci, co, kh, kw, s, d, p = case
    rng = np.random.default_rng(abs(hash((_id(case), sparsity))) % 2**32)
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        x = _sparse_x((n, h, w, ci), sparsity, rng, dtype,
                      relu=sparsity == 0.5)
        f = rng.standard_normal((kh, kw, ci, co)).astype(dtype)
        assert_forward_matches(_forward(x, f, s, d, p), ref_conv(x, f, s, d, p),
                               dtype, tol, sparsity == 1.0)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_scatter_agrees_with_the_other_kernels(case, monkeypatch):
    n, h, w, ci, co, kh, kw, s, d, p = case
    rng = np.random.default_rng(abs(hash((_id(case), 3))) % 2**32)
    x = _sparse_x((n, h, w, ci), 0.6, rng, np.float64)
    f = rng.standard_normal((kh, kw, ci, co))
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "scatter")
    scatter = _forward(x, f, s, d, p)
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "tiles")
    tiled = _forward(x, f, s, d, p)
    assert relative_error(scatter, tiled) <= 1e-12


def test_scatter_bits_do_not_depend_on_threads(monkeypatch):
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "scatter")
    rng = np.random.default_rng(7)
    x = _sparse_x((5, 13, 28, 2), 0.7, rng, np.float32)
    f = rng.standard_normal((5, 5, 2, 40)).astype(np.float32)
    one = K.direct_conv2d(x, f, threads=1)
    for t in (2, 3, 8):
        np.testing.assert_array_equal(K.direct_conv2d(x, f, threads=t), one)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_scatter_nonfinite_input_propagates_like_dense(bad, monkeypatch):
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "scatter")
    rng = np.random.default_rng(5)
    x = _sparse_x((2, 9, 12, 2), 0.5, rng, np.float32)
    x[0, 4, 4, 1] = bad
    x[1, 0, 11, 0] = bad  # a corner: feeds outputs of one row edge only
    f = rng.standard_normal((3, 3, 2, 16)).astype(np.float32)
    _same_nonfinite(K.direct_conv2d(x, f), ref_conv(x, f, (1, 1), (1, 1),
                                                    "SAME"))


def test_scatter_nonfinite_filter_facing_zeros_gives_zero(monkeypatch):
    # A NaN/Inf filter tap multiplies only the nonzeros: where every input
    # under it is zero the output stays finite (as the other sparse kernels).
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "scatter")
    x = np.zeros((1, 5, 6, 1), np.float32)
    x[0, 2, 3, 0] = 2.0
    f = np.ones((3, 3, 1, 16), np.float32)
    f[0, 0, 0, 3] = np.nan
    f[2, 2, 0, 5] = np.inf
    y = K.direct_conv2d(x, f)
    # Output (oh, ow) reads x[oh - 1 + kh, ow - 1 + kw]: tap (0, 0) meets
    # the nonzero only at output (3, 4), tap (2, 2) only at (1, 2).
    assert np.isnan(y[0, 3, 4, 3]) and np.isposinf(y[0, 1, 2, 5])
    mask = np.ones(y.shape, bool)
    mask[0, 3, 4, 3] = mask[0, 1, 2, 5] = False
    assert np.isfinite(y[mask]).all()
    ref = ref_conv(x, np.nan_to_num(f, nan=0.0, posinf=0.0), (1, 1), (1, 1),
                   "SAME")
    np.testing.assert_allclose(y[mask], ref[mask], rtol=1e-6, atol=1e-6)


def test_automatic_choice_takes_scatter_for_thin_inputs(monkeypatch):
    # Summation orders differ between kernels, so in float32 the unset
    # variable gives the forced scatter's bits on a thin input and the
    # paired sweep's on a wider one.
    rng = np.random.default_rng(9)
    thin = _sparse_x((4, 14, 28, 2), 0.5, rng, np.float32)
    fthin = rng.standard_normal((3, 3, 2, 16)).astype(np.float32)
    wide = _sparse_x((4, 14, 28, 3), 0.5, rng, np.float32)
    fwide = rng.standard_normal((3, 3, 3, 64)).astype(np.float32)
    auto_thin, auto_wide = K.direct_conv2d(thin, fthin), K.direct_conv2d(wide, fwide)
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "scatter")
    scatter_thin, scatter_wide = K.direct_conv2d(thin, fthin), K.direct_conv2d(wide, fwide)
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "pairs")
    pairs_thin, pairs_wide = K.direct_conv2d(thin, fthin), K.direct_conv2d(wide, fwide)
    np.testing.assert_array_equal(auto_thin, scatter_thin)
    assert not np.array_equal(auto_thin, pairs_thin)
    np.testing.assert_array_equal(auto_wide, pairs_wide)
    assert not np.array_equal(auto_wide, scatter_wide)
    # 5x5 filters (the tiled kernel's otherwise) take it up to 16 channels.
    x5 = _sparse_x((2, 10, 12, 16), 0.5, rng, np.float32)
    f5 = rng.standard_normal((5, 5, 16, 24)).astype(np.float32)
    monkeypatch.delenv("TFSS_DIRECT_FWD_KERNEL")
    auto5 = K.direct_conv2d(x5, f5)
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "scatter")
    np.testing.assert_array_equal(auto5, K.direct_conv2d(x5, f5))
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "tiles")
    assert not np.array_equal(auto5, K.direct_conv2d(x5, f5))
