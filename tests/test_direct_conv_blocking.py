"""Blocking paths of the direct convolution kernels (cc/core/direct_conv2d.h)
against the float64 references of test_direct_conv.py: the filter
gradient's groups of consecutive input rows (one df read-modify-write per
group), its ring of per-block contiguous dy rows (C_out wider than one
32-channel block), the forward's one-pass tiles stored straight to y, and
results that do not depend on the alignment of the caller's arrays."""

import numpy as np
import pytest

from tf_sparse_split._loader import kernels
from tf_sparse_split.testing import relative_error

from test_direct_conv import _geometry, _sparse_x, ref_conv, ref_filter_grad

K = kernels()

# (n, h, w, c_in, c_out, kh, kw, strides, dilations, padding)
CASES = [
    (1, 1, 5, 3, 64, 3, 3, (1, 1), (1, 1), "SAME"),     # one row: no group
    (2, 2, 6, 5, 64, 3, 3, (1, 1), (1, 1), "SAME"),     # H = 2
    (2, 4, 9, 7, 96, 3, 3, (1, 1), (1, 1), "SAME"),     # 3 + 1 rows
    (1, 5, 5, 8, 520, 3, 3, (1, 1), (1, 1), "SAME"),    # wide C_out, padded
    (2, 10, 70, 6, 48, 3, 3, (1, 1), (1, 1), "SAME"),   # W > 64: 2 segments
    (1, 12, 9, 4, 80, 7, 7, (1, 1), (2, 2), "SAME"),    # 7x7 dilated: 7 taps
    (2, 11, 8, 5, 64, 3, 3, (3, 1), (1, 1), "VALID"),   # stride 3 in height
    (2, 9, 9, 6, 64, 5, 5, (2, 2), (1, 2), "SAME"),     # stride + dilation
    (3, 7, 7, 16, 33, 3, 3, (1, 1), (1, 1), (2, 0, 1, 2)),  # explicit pads
]


def _id(c):
    n, h, w, ci, co, kh, kw, s, d, p = c
    return f"{n}x{h}x{w}x{ci}-{kh}x{kw}x{co}-s{s[0]}{s[1]}-d{d[0]}{d[1]}-{p}"


def _aligned(a, offset):
    """A copy of `a` whose data start `offset` bytes past a 64-byte
    boundary."""
    buf = np.empty(a.nbytes + 128, dtype=np.uint8)
    off = (-buf.ctypes.data) % 64 + offset
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("sparsity", [0.0, 0.6])
def test_filter_grad_blocking_matches_reference(case, sparsity):
    n, h, w, ci, co, kh, kw, s, d, p = case
    rng = np.random.default_rng(abs(hash((_id(case), sparsity, 2))) % 2**32)
    _, oh, ow = _geometry((n, h, w, ci), kh, kw, s, d, p)
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        x = _sparse_x((n, h, w, ci), sparsity, rng, dtype, relu=True)
        dy = rng.standard_normal((n, oh, ow, co)).astype(dtype)
        ref = ref_filter_grad(x, dy, kh, kw, s, d, p)
        got = K.direct_conv2d_backprop_filter(x, dy, kh, kw, strides=s,
                                              dilations=d, padding=p)
        assert got.shape == ref.shape
        assert relative_error(got, ref) <= tol, dtype


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_forward_blocking_matches_reference(case):
    n, h, w, ci, co, kh, kw, s, d, p = case
    rng = np.random.default_rng(abs(hash((_id(case), 3))) % 2**32)
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        x = _sparse_x((n, h, w, ci), 0.55, rng, dtype)
        f = rng.standard_normal((kh, kw, ci, co)).astype(dtype)
        ref = ref_conv(x, f, s, d, p)
        got = K.direct_conv2d(x, f, strides=s, dilations=d, padding=p)
        assert got.shape == ref.shape
        assert relative_error(got, ref) <= tol, dtype


@pytest.mark.parametrize("shape, co", [((1, 14, 14, 24), 256),  # channel tasks
                                       ((4, 8, 8, 16), 96),     # image blocks
                                       ((2, 7, 7, 40), 520)])   # df too large
def test_blocked_filter_grad_bits_do_not_depend_on_threads(shape, co):
    rng = np.random.default_rng(11)
    x = _sparse_x(shape, 0.6, rng, np.float32, relu=True)
    dy = rng.standard_normal(shape[:3] + (co,)).astype(np.float32)
    d1 = K.direct_conv2d_backprop_filter(x, dy, 3, 3, threads=1)
    assert relative_error(d1, ref_filter_grad(x, dy, 3, 3, (1, 1), (1, 1),
                                              "SAME")) <= 1e-5
    for t in (2, 3):
        np.testing.assert_array_equal(
            K.direct_conv2d_backprop_filter(x, dy, 3, 3, threads=t), d1)


@pytest.mark.parametrize("offset", [4, 16, 32])
def test_results_do_not_depend_on_input_alignment(offset):
    rng = np.random.default_rng(offset)
    x = _sparse_x((2, 9, 11, 20), 0.5, rng, np.float32)
    f = rng.standard_normal((3, 3, 20, 40)).astype(np.float32)
    dy = rng.standard_normal((2, 9, 11, 40)).astype(np.float32)
    y0 = K.direct_conv2d(_aligned(x, 0), _aligned(f, 0))
    d0 = K.direct_conv2d_backprop_filter(_aligned(x, 0), _aligned(dy, 0), 3, 3)
    np.testing.assert_array_equal(
        K.direct_conv2d(_aligned(x, offset), _aligned(f, offset)), y0)
    np.testing.assert_array_equal(
        K.direct_conv2d_backprop_filter(_aligned(x, offset),
                                        _aligned(dy, offset), 3, 3), d0)
    assert relative_error(y0, ref_conv(x, f, (1, 1), (1, 1), "SAME")) <= 1e-5


def test_nan_in_one_row_of_a_group_stays_in_its_taps():
    # Rows 3, 4, 5 form one group; a NaN in row 4 reaches exactly the df
    # entries of its channel that a dense filter gradient makes NaN.
    rng = np.random.default_rng(5)
    x = _sparse_x((1, 9, 8, 6), 0.5, rng, np.float32)
    x[0, 4, 3, 2] = np.nan
    dy = rng.standard_normal((1, 9, 8, 64)).astype(np.float32)
    got = K.direct_conv2d_backprop_filter(x, dy, 3, 3)
    ref = ref_filter_grad(x, dy, 3, 3, (1, 1), (1, 1), "SAME")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(got[:, :, 2, :]).all()
    fin = np.isfinite(ref)
    assert relative_error(got[fin], ref[fin]) <= 1e-5


# The forward's (channel block, row group) tasks run row groups outer when
# the call's input outweighs its filter and blocks outer otherwise: each
# case below has several channel blocks and row groups, on the sliding
# (3x3, stride 1) and the tiled (1x1, strided) kernels, in both orders.
FORWARD_ORDER_CASES = [
    # (x shape, kh, kw, c_out, strides): input values vs filter values
    ((8, 12, 12, 16), 3, 3, 96, (1, 1)),    # 18432 >= 13824: rows outer
    ((1, 6, 6, 16), 3, 3, 200, (1, 1)),     # 576 < 28800: blocks outer
    ((4, 10, 10, 32), 1, 1, 256, (1, 1)),   # 12800 >= 8192, 8-vector blocks
    ((1, 5, 5, 64), 1, 1, 384, (1, 1)),     # 1600 < 24576, 8-vector blocks
    ((6, 14, 14, 8), 3, 3, 96, (2, 2)),     # 9408 >= 6912, strided tiles
    ((1, 9, 9, 24), 3, 3, 160, (2, 2)),     # 1944 < 34560, strided tiles
]


@pytest.mark.parametrize("shape, kh, kw, co, strides", FORWARD_ORDER_CASES)
def test_forward_task_order_covers_every_block_and_row(shape, kh, kw, co,
                                                       strides):
    rng = np.random.default_rng(sum(shape) + co)
    x = _sparse_x(shape, 0.5, rng, np.float32, relu=True)
    f = rng.standard_normal((kh, kw, shape[3], co)).astype(np.float32)
    y1 = K.direct_conv2d(x, f, strides=strides, threads=1)
    ref = ref_conv(x, f, strides, (1, 1), "SAME")
    assert y1.shape == ref.shape
    assert relative_error(y1, ref) <= 1e-5
    for t in (2, 3):
        np.testing.assert_array_equal(
            K.direct_conv2d(x, f, strides=strides, threads=t), y1)


# 1x1 filter gradients take output-channel blocks of up to 8 vectors (one
# tap: every nonzero of x feeds 8 accumulators); C_out below covers 1..8
# vectors per block, a tail block, C_out padded to whole vectors, image
# blocks (n > 1) and the in-place channel-group tasks (n = 1).
ONE_TAP_CASES = [
    # (n, h, w, c_in, c_out, strides)
    (3, 5, 6, 7, 48, (1, 1)),     # 3 vectors (float32)
    (2, 4, 9, 20, 128, (1, 1)),   # 8 vectors
    (2, 6, 5, 9, 144, (1, 1)),    # 8 + 1 vectors
    (1, 7, 7, 70, 200, (1, 1)),   # n = 1, C_out padded, 8 + 5 vectors
    (4, 9, 9, 16, 96, (2, 2)),    # strided
    (2, 3, 70, 5, 80, (1, 1)),    # W > 64: two segments
]


@pytest.mark.parametrize("case", ONE_TAP_CASES)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9])
def test_one_tap_filter_grad_blocks_match_reference(case, sparsity):
    n, h, w, ci, co, s = case
    rng = np.random.default_rng(sum(case[:5]) + int(sparsity * 10))
    _, oh, ow = _geometry((n, h, w, ci), 1, 1, s, (1, 1), "SAME")
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        x = _sparse_x((n, h, w, ci), sparsity, rng, dtype, relu=True)
        dy = rng.standard_normal((n, oh, ow, co)).astype(dtype)
        ref = ref_filter_grad(x, dy, 1, 1, s, (1, 1), "SAME")
        got = K.direct_conv2d_backprop_filter(x, dy, 1, 1, strides=s)
        assert got.shape == ref.shape
        assert relative_error(got, ref) <= tol, dtype
        for t in (1, 3):
            np.testing.assert_array_equal(
                K.direct_conv2d_backprop_filter(x, dy, 1, 1, strides=s,
                                                threads=t), got)


def test_one_tap_filter_grad_large_filter_in_place_tasks():
    # df of 1100 x 2000 values (> 2^21) takes the channel-group tasks that
    # write df in place, 8-vector blocks of C_out.
    rng = np.random.default_rng(21)
    x = _sparse_x((2, 2, 3, 1100), 0.5, rng, np.float32, relu=True)
    dy = rng.standard_normal((2, 2, 3, 2000)).astype(np.float32)
    got = K.direct_conv2d_backprop_filter(x, dy, 1, 1)
    ref = ref_filter_grad(x, dy, 1, 1, (1, 1), (1, 1), "SAME")
    assert relative_error(got, ref) <= 1e-5


# Image blocks of the filter gradient: a power of two within the cap (4M
# values of private df copies and, for df over 16K values, 3136 input
# pixels a block, at least two blocks; 1M values and 1024 pixels for 1x1),
# none of them empty.
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 16, 24, 30, 32, 33, 64])
@pytest.mark.parametrize("kh, ci, co, hw", [
    (3, 64, 64, 56), (3, 128, 128, 28), (3, 256, 256, 14), (3, 512, 512, 7),
    (3, 256, 256, 4), (1, 256, 1024, 14), (1, 128, 512, 8), (3, 3, 8, 5)])
def test_filter_grad_blocks_are_equal_and_within_the_cap(n, kh, ci, co, hw):
    blocks = K.filter_grad_blocks(n, kh, kh, ci, co, hw, hw)
    fsize = kh * kh * ci * co
    cap = min(max(n, 1), 16, max(1, (1 << (20 if kh == 1 else 22)) // fsize))
    if kh == 1:
        cap = min(cap, max(1, n * hw * hw // 1024))
    elif fsize > 16384:
        cap = min(cap, max(2, n * hw * hw // 3136))
    assert 1 <= blocks <= cap
    if n <= 1:
        assert blocks == 1
        return
    per = -(-n // blocks)
    assert per * (blocks - 1) < n <= per * blocks  # no empty block
    pow2 = 1 << (cap.bit_length() - 1)
    assert per == -(-n // pow2)  # the power of two's block size


@pytest.mark.parametrize("args", [
    (-1, 3, 3, 8, 8, 5, 5), (2, 3, 3, 8, 8, -5, 5), (2, 0, 3, 8, 8, 5, 5),
    (2, 3, 3, 8, -8, 5, 5)])
def test_filter_grad_blocks_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        K.filter_grad_blocks(*args)


# 3x3 filter gradients in image blocks whose last block is shorter (two
# blocks of ceil(n / 2) images on these small maps): equal to the
# reference, bitwise the same over thread counts, direct and pixel-CSR
# kernels.
@pytest.mark.parametrize("n", [3, 7, 12])
@pytest.mark.parametrize("pixel_csr", [False, True])
def test_filter_grad_short_last_block_matches_reference(n, pixel_csr):
    rng = np.random.default_rng(n + 10 * pixel_csr)
    x = _sparse_x((n, 3, 4, 256), 0.5, rng, np.float32, relu=True)
    dy = rng.standard_normal((n, 3, 4, 256)).astype(np.float32)
    assert K.filter_grad_blocks(n, 3, 3, 256, 256, 3, 4) >= 2
    ref = ref_filter_grad(x, dy, 3, 3, (1, 1), (1, 1), "SAME")
    got = K.direct_conv2d_backprop_filter(x, dy, 3, 3, pixel_csr=pixel_csr)
    assert relative_error(got, ref) <= 1e-5
    for t in (1, 3):
        np.testing.assert_array_equal(
            K.direct_conv2d_backprop_filter(x, dy, 3, 3, pixel_csr=pixel_csr,
                                            threads=t), got)
