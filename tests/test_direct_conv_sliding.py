"""The sliding-window forward kernel of the direct convolution
(cc/core/direct_conv2d.h: KW == 3, stride 1 and dilation 1 in width) through
the pybind11 module, against the float64 reference of test_direct_conv.py
in both of its sweeps (two input columns a step, the default, and one:
TFSS_DIRECT_FWD_KERNEL=columns) and against the tiled kernel
(TFSS_DIRECT_FWD_KERNEL=tiles): partial input
channel chunks (C_in not a multiple of 16), partial output vectors (C_out
not a multiple of 16), several 64-channel output blocks, filter-row groups
(KH > 3), one filter row a pass from output width 14 on (the 48-channel
chunks; three rows when C_in fits one 16-channel chunk), row strides and
dilations, explicit paddings that put the first
or last input column outside every window, narrow rows, batch 1, NaN/Inf
in the input and in the filter, and bits that do not depend on the thread
count."""

import numpy as np
import pytest

from tf_sparse_split._loader import kernels
from tf_sparse_split.testing import relative_error

from test_direct_conv import (_geometry, _same_nonfinite, _sparse_x,
                              assert_forward_matches, ref_conv)

K = kernels()

# (n, h, w, c_in, c_out, kh, strides, dilations, padding); KW = 3 always.
CASES = [
    (2, 6, 9, 17, 20, 3, (1, 1), (1, 1), "SAME"),        # 16 + 1 channels
    (1, 5, 12, 33, 65, 3, (1, 1), (1, 1), "SAME"),       # 3 chunks, 2 blocks
    (2, 7, 5, 50, 130, 3, (1, 1), (1, 1), "VALID"),      # 3 blocks, last 2 lanes
    (1, 4, 1, 16, 16, 3, (1, 1), (1, 1), "SAME"),        # W = 1
    (2, 3, 2, 5, 7, 3, (1, 1), (1, 1), "SAME"),          # W = 2
    (1, 8, 3, 9, 40, 3, (1, 1), (1, 1), "VALID"),        # one output column
    (2, 9, 8, 6, 24, 5, (1, 1), (1, 1), "SAME"),         # KH = 5: rows 3 + 2
    (1, 11, 7, 4, 18, 7, (1, 1), (1, 1), "SAME"),        # KH = 7: 3 + 3 + 1
    (2, 6, 6, 20, 33, 1, (1, 1), (1, 1), "SAME"),        # KH = 1: 48-channel chunk
    (2, 6, 7, 40, 17, 2, (1, 1), (1, 1), "SAME"),        # KH = 2: 32-bit masks
    (2, 10, 9, 12, 31, 4, (1, 1), (1, 1), "VALID"),      # KH = 4: rows 3 + 1
    (2, 11, 10, 7, 19, 3, (2, 1), (1, 1), "SAME"),       # row stride 2
    (1, 12, 8, 10, 21, 3, (3, 1), (2, 1), "VALID"),      # row stride + dilation
    (2, 7, 9, 8, 16, 3, (1, 1), (1, 1), (0, 2, 2, 0)),   # pad_left 2: column 0 unseen at right
    (2, 7, 9, 8, 16, 3, (1, 1), (1, 1), (1, 0, 0, 2)),   # pad_left 0, pad_right 2
    (2, 5, 6, 3, 5, 3, (1, 1), (1, 1), (2, 2, 3, 3)),    # pads wider than the filter
    (1, 14, 14, 70, 72, 3, (1, 1), (1, 1), "SAME"),      # batch 1, one row: 48 + 22 channels
    (2, 6, 14, 100, 40, 5, (1, 1), (1, 1), "SAME"),      # one row a pass, KH 5: 48 + 48 + 4
    (1, 9, 16, 20, 17, 3, (2, 1), (1, 1), "VALID"),      # out_w 14: one row, row stride 2
    (2, 5, 13, 33, 20, 3, (1, 1), (1, 1), "SAME"),       # out_w 13: three rows a pass
    (2, 6, 28, 1, 64, 3, (1, 1), (1, 1), "SAME"),        # out_w 28, C_in 1: three rows, one pass
    (2, 5, 14, 16, 32, 3, (1, 1), (1, 1), "SAME"),       # out_w 14, C_in 16: three rows, one pass
    (1, 9, 15, 3, 20, 5, (1, 1), (1, 1), "SAME"),        # out_w 15, C_in 3, KH 5: rows 3 + 2
    (2, 5, 14, 17, 18, 3, (1, 1), (1, 1), "SAME"),       # out_w 14, C_in 17: one row a pass
]


def _id(c):
    n, h, w, ci, co, kh, s, d, p = c
    return f"{n}x{h}x{w}x{ci}-{kh}x3x{co}-s{s[0]}1-d{d[0]}1-{p}"


def _forward(x, f, s, d, p, **kw):
    return K.direct_conv2d(x, f, strides=s, dilations=d, padding=p, **kw)


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("sweep", ["pairs", "columns"])
def test_sliding_forward_matches_reference(case, sparsity, sweep,
                                           monkeypatch):
    # "pairs": the paired sweep also where the automatic choice would take
    # the row scatter (thin inputs).
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", sweep)
    n, h, w, ci, co, kh, s, d, p = case
    s, d = (s[0], 1), (d[0], 1)
    rng = np.random.default_rng(abs(hash((_id(case), sparsity, 5))) % 2**32)
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        x = _sparse_x((n, h, w, ci), sparsity, rng, dtype,
                      relu=sparsity == 0.7)
        f = rng.standard_normal((kh, 3, ci, co)).astype(dtype)
        assert_forward_matches(_forward(x, f, s, d, p), ref_conv(x, f, s, d, p),
                               dtype, tol, sparsity == 1.0)


@pytest.mark.parametrize("case", CASES[:6] + CASES[11:14], ids=_id)
def test_sliding_and_tiled_kernels_agree(case, monkeypatch):
    n, h, w, ci, co, kh, s, d, p = case
    s, d = (s[0], 1), (d[0], 1)
    rng = np.random.default_rng(abs(hash((_id(case), 6))) % 2**32)
    x = _sparse_x((n, h, w, ci), 0.5, rng, np.float64)
    f = rng.standard_normal((kh, 3, ci, co))
    sliding = _forward(x, f, s, d, p)
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "columns")
    columns = _forward(x, f, s, d, p)
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "tiles")
    tiled = _forward(x, f, s, d, p)
    monkeypatch.delenv("TFSS_DIRECT_FWD_KERNEL")
    assert relative_error(sliding, tiled) <= 1e-12
    assert relative_error(columns, tiled) <= 1e-12
    # The variable is read on every call: unset, the paired sweep again.
    np.testing.assert_array_equal(_forward(x, f, s, d, p), sliding)


def test_paired_sweep_reads_both_pixels_of_a_step():
    # Hand-made columns: in one row, a channel nonzero in both pixels of a
    # step, one nonzero only in the first, one only in the second, and a
    # lone nonzero in the last column (an odd width: its step's second
    # column lies outside the row); every output is checked against the
    # float64 reference, which catches a product credited to the wrong
    # pixel or output.
    x = np.zeros((1, 1, 7, 20), np.float64)
    x[0, 0, 2, 3] = 1.5     # step (2, 3): both
    x[0, 0, 3, 3] = -2.0
    x[0, 0, 2, 5] = 0.75    # first pixel only
    x[0, 0, 3, 17] = 3.0    # second pixel only
    x[0, 0, 6, 11] = -1.25  # last column
    x[0, 0, 0, 0] = 2.5     # first column
    rng = np.random.default_rng(12)
    f = rng.standard_normal((1, 3, 20, 70))
    for p in ("SAME", "VALID", (0, 0, 2, 1)):
        np.testing.assert_allclose(_forward(x, f, (1, 1), (1, 1), p),
                                   ref_conv(x, f, (1, 1), (1, 1), p),
                                   rtol=1e-12, atol=1e-12)


def test_tiled_kernel_variable_selects_another_summation_order(monkeypatch):
    # 33 input channels x 9 taps per output: the sliding kernel sums in
    # passes of 16 channels, the tiled one channel by channel per tap, so
    # in float32 some of the 12 x 65 x 5 outputs round differently -- the
    # variable really switches kernels (both within float rounding of the
    # float64 reference).
    rng = np.random.default_rng(11)
    x = _sparse_x((1, 5, 12, 33), 0.3, rng, np.float32)
    f = rng.standard_normal((3, 3, 33, 65)).astype(np.float32)
    ref = ref_conv(x, f, (1, 1), (1, 1), "SAME")
    sliding = K.direct_conv2d(x, f)
    monkeypatch.setenv("TFSS_DIRECT_FWD_KERNEL", "tiles")
    tiled = K.direct_conv2d(x, f)
    assert not np.array_equal(sliding, tiled)
    assert relative_error(sliding, ref) <= 1e-5
    assert relative_error(tiled, ref) <= 1e-5


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_sliding_nonfinite_input_propagates_like_dense(bad):
    rng = np.random.default_rng(8)
    # 40 channels: three chunks (16, 16, 8), so the non-finite values sit in
    # different passes; at the first and last columns and rows (windows cut
    # by the padding) and inside.
    x = _sparse_x((2, 6, 11, 40), 0.5, rng, np.float32)
    x[0, 0, 0, 3] = bad
    x[0, 5, 10, 20] = bad
    x[1, 2, 5, 39] = bad
    f = rng.standard_normal((3, 3, 40, 70)).astype(np.float32)
    _same_nonfinite(_forward(x, f, (1, 1), (1, 1), "SAME"),
                    ref_conv(x, f, (1, 1), (1, 1), "SAME"))


def test_sliding_inf_filter_times_zero_input_is_skipped():
    # As the tiled kernel: an Inf filter value of a channel that is zero in
    # every image gives 0, not NaN (products with exact zeros are skipped).
    rng = np.random.default_rng(9)
    x = _sparse_x((2, 7, 9, 21), 0.5, rng, np.float32)
    x[..., 17] = 0
    f = rng.standard_normal((3, 3, 21, 19)).astype(np.float32)
    f[0, 2, 17, :] = np.inf
    f[2, 0, 17, 4] = -np.inf
    got = _forward(x, f, (1, 1), (1, 1), "SAME")
    f0 = f.copy()
    f0[:, :, 17, :] = 0
    assert np.all(np.isfinite(got))
    assert relative_error(got, ref_conv(x, f0, (1, 1), (1, 1), "SAME")) <= 1e-5


@pytest.mark.parametrize("shape, co", [((3, 9, 20, 40), 80),   # 3 chunks x 2 blocks
                                       ((1, 14, 14, 33), 64),  # batch 1
                                       ((5, 4, 30, 16), 7),    # few rows per task
                                       ((2, 8, 9, 40), 80)])   # three rows a pass
def test_sliding_bits_do_not_depend_on_thread_count(shape, co):
    rng = np.random.default_rng(10)
    x = _sparse_x(shape, 0.5, rng, np.float32)
    f = rng.standard_normal((3, 3, shape[3], co)).astype(np.float32)
    y1 = K.direct_conv2d(x, f, threads=1)
    for t in (2, 3, 7):
        np.testing.assert_array_equal(K.direct_conv2d(x, f, threads=t), y1)
