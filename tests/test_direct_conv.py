"""The zero-skipping direct convolution kernels (cc/core/direct_conv2d.h)
through the pybind11 module, against a float64 numpy reference."""

import numpy as np
import pytest

from tf_sparse_split._loader import kernels
from tf_sparse_split.testing import relative_error

K = kernels()


def _pads(size, k, stride, dilation, padding):
    ek = (k - 1) * dilation + 1
    if padding == "SAME":
        out = -(-size // stride)
        total = max((out - 1) * stride + ek - size, 0)
        return total // 2, total - total // 2
    if padding == "VALID":
        return 0, 0
    return padding


def _geometry(x_shape, kh, kw, strides, dilations, padding):
    _, h, w, _ = x_shape
    if isinstance(padding, str):
        pt, pb = _pads(h, kh, strides[0], dilations[0], padding)
        pl, pr = _pads(w, kw, strides[1], dilations[1], padding)
    else:
        pt, pb, pl, pr = padding
    ekh, ekw = (kh - 1) * dilations[0] + 1, (kw - 1) * dilations[1] + 1
    oh = max(0, (h + pt + pb - ekh) // strides[0] + 1)
    ow = max(0, (w + pl + pr - ekw) // strides[1] + 1)
    return (pt, pb, pl, pr), oh, ow


def _patch(xp, i, j, oh, ow, strides, dilations):
    sh, sw = strides
    r0, c0 = i * dilations[0], j * dilations[1]
    return xp[:, r0:r0 + (oh - 1) * sh + 1:sh, c0:c0 + (ow - 1) * sw + 1:sw, :]


def ref_conv(x, f, strides, dilations, padding):
    kh, kw, _, co = f.shape
    (pt, pb, pl, pr), oh, ow = _geometry(x.shape, kh, kw, strides, dilations,
                                         padding)
    xp = np.pad(x.astype(np.float64), ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    y = np.zeros((x.shape[0], oh, ow, co))
    if oh == 0 or ow == 0:
        return y
    for i in range(kh):
        for j in range(kw):
            y += np.einsum("nhwc,co->nhwo", _patch(xp, i, j, oh, ow, strides,
                                                   dilations),
                           f[i, j].astype(np.float64))
    return y


def ref_filter_grad(x, dy, kh, kw, strides, dilations, padding):
    (pt, pb, pl, pr), oh, ow = _geometry(x.shape, kh, kw, strides, dilations,
                                         padding)
    xp = np.pad(x.astype(np.float64), ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    df = np.zeros((kh, kw, x.shape[3], dy.shape[3]))
    if oh == 0 or ow == 0:
        return df
    for i in range(kh):
        for j in range(kw):
            df[i, j] = np.einsum("nhwc,nhwo->co",
                                 _patch(xp, i, j, oh, ow, strides, dilations),
                                 dy.astype(np.float64))
    return df


def assert_forward_matches(got, ref, dtype, tol, all_zero):
    """``got`` (a forward kernel's output) has the reference's dtype and
    shape and is within ``tol`` relative error of it; all zeros where the
    input was all zeros."""
    assert got.dtype == dtype and got.shape == ref.shape
    assert relative_error(got, ref) <= tol, dtype
    if all_zero:
        np.testing.assert_array_equal(got, np.zeros_like(got))


def _sparse_x(shape, sparsity, rng, dtype, relu=False):
    if relu:
        # ReLU of a Gaussian whose bias puts `sparsity` of the mass below 0.
        z = rng.standard_normal(shape)
        return np.maximum(z - np.quantile(z, sparsity), 0).astype(dtype)
    vals = rng.uniform(0.1, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
    return (vals * (rng.random(shape) >= sparsity)).astype(dtype)


# (n, h, w, c_in, c_out, kh, kw, strides, dilations, padding)
CASES = [
    (2, 7, 7, 3, 17, 3, 3, (1, 1), (1, 1), "SAME"),
    (1, 1, 1, 1, 1, 3, 3, (1, 1), (1, 1), "SAME"),
    (3, 13, 13, 17, 3, 3, 3, (1, 1), (1, 1), "VALID"),
    (2, 13, 7, 64, 40, 3, 3, (1, 1), (1, 1), "SAME"),      # a 64-channel mask
    (1, 9, 70, 70, 33, 3, 3, (1, 1), (1, 1), "SAME"),      # W > 64, C_in > 64
    (2, 13, 13, 17, 19, 3, 3, (2, 2), (1, 1), "SAME"),     # stride 2
    (2, 11, 10, 4, 7, 3, 3, (2, 2), (2, 2), "SAME"),       # stride + dilation
    (2, 11, 10, 5, 16, 3, 3, (1, 1), (2, 2), (0, 1, 2, 3)),  # explicit
    (2, 8, 8, 3, 33, 5, 5, (2, 1), (1, 1), "VALID"),
    (4, 6, 6, 2, 16, 1, 1, (1, 1), (1, 1), "VALID"),       # 1x1
    (5, 7, 9, 6, 65, 2, 3, (1, 2), (1, 1), "SAME"),        # non-square
    (1, 14, 14, 32, 64, 3, 3, (1, 1), (1, 1), "SAME"),     # batch 1
    (2, 3, 4, 3, 5, 5, 5, (1, 1), (1, 1), "SAME"),         # filter > input
    # 1x1 with C_out a multiple of 128: 8-vector blocks of 3-pixel tiles.
    (2, 9, 10, 70, 128, 1, 1, (1, 1), (1, 1), "SAME"),     # C_in > 64
    (2, 9, 9, 24, 256, 1, 1, (2, 2), (1, 1), "VALID"),     # stride 2, 2 blocks
    (1, 5, 13, 200, 128, 1, 1, (1, 1), (1, 1), "SAME"),    # passes over C_in
]


def _id(c):
    n, h, w, ci, co, kh, kw, s, d, p = c
    return f"{n}x{h}x{w}x{ci}-{kh}x{kw}x{co}-s{s[0]}{s[1]}-d{d[0]}{d[1]}-{p}"


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_forward_matches_reference(case, sparsity):
    n, h, w, ci, co, kh, kw, s, d, p = case
    rng = np.random.default_rng(abs(hash((_id(case), sparsity))) % 2**32)
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        x = _sparse_x((n, h, w, ci), sparsity, rng, dtype)
        f = rng.standard_normal((kh, kw, ci, co)).astype(dtype)
        ref = ref_conv(x, f, s, d, p)
        got = K.direct_conv2d(x, f, strides=s, dilations=d, padding=p)
        assert got.dtype == dtype and got.shape == ref.shape
        assert relative_error(got, ref) <= tol, dtype
        pix = K.direct_conv2d(x, f, strides=s, dilations=d, padding=p,
                              pixel_csr=True)
        assert relative_error(pix, ref) <= tol, dtype


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_filter_grad_matches_reference(case, sparsity):
    n, h, w, ci, co, kh, kw, s, d, p = case
    rng = np.random.default_rng(abs(hash((_id(case), sparsity, 1))) % 2**32)
    _, oh, ow = _geometry((n, h, w, ci), kh, kw, s, d, p)
    for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        x = _sparse_x((n, h, w, ci), sparsity, rng, dtype)
        dy = rng.standard_normal((n, oh, ow, co)).astype(dtype)
        ref = ref_filter_grad(x, dy, kh, kw, s, d, p)
        got = K.direct_conv2d_backprop_filter(x, dy, kh, kw, strides=s,
                                              dilations=d, padding=p)
        assert got.dtype == dtype and got.shape == ref.shape
        assert relative_error(got, ref) <= tol, dtype


@pytest.mark.parametrize("sparsity", [0.5, 0.7])
def test_relu_of_gaussian_inputs(sparsity):
    rng = np.random.default_rng(int(sparsity * 10))
    x = _sparse_x((3, 28, 28, 32), sparsity, rng, np.float32, relu=True)
    assert abs(np.mean(x == 0) - sparsity) < 0.02
    f = rng.standard_normal((3, 3, 32, 48)).astype(np.float32)
    assert relative_error(K.direct_conv2d(x, f),
                          ref_conv(x, f, (1, 1), (1, 1), "SAME")) <= 1e-5
    dy = rng.standard_normal((3, 28, 28, 48)).astype(np.float32)
    assert relative_error(K.direct_conv2d_backprop_filter(x, dy, 3, 3),
                          ref_filter_grad(x, dy, 3, 3, (1, 1), (1, 1),
                                          "SAME")) <= 1e-5


@pytest.mark.parametrize("shape, co", [((3, 14, 14, 64), 64),   # image blocks
                                       ((1, 9, 9, 80), 35),     # channel tasks
                                       ((2, 7, 7, 130), 300)])  # large df
def test_bits_do_not_depend_on_thread_count(shape, co):
    rng = np.random.default_rng(7)
    x = _sparse_x(shape, 0.5, rng, np.float32)
    f = rng.standard_normal((3, 3, shape[3], co)).astype(np.float32)
    dy = rng.standard_normal(shape[:3] + (co,)).astype(np.float32)
    y1 = K.direct_conv2d(x, f, threads=1)
    d1 = K.direct_conv2d_backprop_filter(x, dy, 3, 3, threads=1)
    for t in (2, 3, 5):
        np.testing.assert_array_equal(K.direct_conv2d(x, f, threads=t), y1)
        np.testing.assert_array_equal(
            K.direct_conv2d_backprop_filter(x, dy, 3, 3, threads=t), d1)


def _same_nonfinite(got, ref):
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert relative_error(got[fin], ref[fin]) <= 1e-5


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_propagates_like_dense(bad):
    rng = np.random.default_rng(3)
    x = _sparse_x((2, 9, 9, 20), 0.5, rng, np.float32)
    x[0, 4, 4, 3] = bad
    x[1, 0, 8, 19] = bad
    f = rng.standard_normal((3, 3, 20, 18)).astype(np.float32)
    _same_nonfinite(K.direct_conv2d(x, f), ref_conv(x, f, (1, 1), (1, 1), "SAME"))
    dy = rng.standard_normal((2, 9, 9, 18)).astype(np.float32)
    _same_nonfinite(K.direct_conv2d_backprop_filter(x, dy, 3, 3),
                    ref_filter_grad(x, dy, 3, 3, (1, 1), (1, 1), "SAME"))


def test_inf_filter_times_zero_input_is_skipped():
    # Products with exact zeros of x are skipped: an Inf in the filter row of
    # a channel that is zero everywhere gives 0, not NaN (documented).
    rng = np.random.default_rng(4)
    x = _sparse_x((2, 8, 8, 6), 0.5, rng, np.float32)
    x[..., 2] = 0
    f = rng.standard_normal((3, 3, 6, 5)).astype(np.float32)
    f[1, 1, 2, :] = np.inf
    got = K.direct_conv2d(x, f)
    f0 = f.copy()
    f0[1, 1, 2, :] = 0
    assert np.all(np.isfinite(got))
    assert relative_error(got, ref_conv(x, f0, (1, 1), (1, 1), "SAME")) <= 1e-5


@pytest.mark.parametrize("call, match", [
    (lambda: K.direct_conv2d(np.zeros((2, 3, 3), np.float32),
                             np.zeros((3, 3, 3, 1), np.float32)), "4-D"),
    (lambda: K.direct_conv2d(np.zeros((1, 3, 3, 2), np.float32),
                             np.zeros((3, 3, 3, 1), np.float32)), "C_in"),
    (lambda: K.direct_conv2d(np.zeros((1, 3, 3, 2), np.float32),
                             np.zeros((3, 3, 2, 1), np.float32),
                             strides=(0, 1)), "strides"),
    (lambda: K.direct_conv2d(np.zeros((1, 3, 3, 2), np.float32),
                             np.zeros((3, 3, 2, 1), np.float32),
                             padding="FULL"), "padding"),
    (lambda: K.direct_conv2d_backprop_filter(
        np.zeros((1, 3, 3, 2), np.float32), np.zeros((1, 2, 3, 4), np.float32),
        3, 3), "dy shape"),
])
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_sparse_kernel_choice_from_recorded_timings():
    # Recorded timings on 1M values: the direct kernel scans every value
    # (2 ns each) and spends 1 ns per nonzero; the pixel CSR builds at 1 ns
    # per value and spends 4 ns per nonzero. Break-even at nnz/values = 1/3.
    v = 1e6
    direct = (5e5, 2e-3 + 5e5 * 1e-9, 6.25e4, 2e-3 + 6.25e4 * 1e-9)
    csr = (5e5, 1e-3 + 5e5 * 4e-9, 6.25e4, 1e-3 + 6.25e4 * 4e-9)
    c = K.conv_sparse_kernel_choice(2e6, 1e6, direct, csr, v)  # 50% dense
    assert c["direct"]
    assert c["direct_per_value"] == pytest.approx(2e-9)
    assert c["direct_per_nnz"] == pytest.approx(1e-9)
    assert c["csr_per_value"] == pytest.approx(1e-9)
    assert c["csr_per_nnz"] == pytest.approx(4e-9)
    assert c["direct_s"] == pytest.approx(2e6 * 2e-9 + 1e6 * 1e-9)
    assert not K.conv_sparse_kernel_choice(2e6, 2e5, direct, csr, v)["direct"]
    assert K.conv_sparse_kernel_choice(3e6, 1.01e6, direct, csr, v)["direct"]
    assert not K.conv_sparse_kernel_choice(3e6, 0.99e6, direct, csr, v)["direct"]
    # Noise that makes the thinned run slower gives a per-value-only fit.
    noisy = K.conv_sparse_kernel_choice(1e6, 1e5, (5e5, 1e-3, 6e4, 2e-3),
                                        csr, v)
    assert noisy["direct_per_nnz"] == 0.0
    assert noisy["direct_per_value"] == pytest.approx(1e-9)
    # A fit whose per-value term would be negative keeps the per-nnz one.
    steep = K.conv_sparse_kernel_choice(1e6, 1e5, (5e5, 1e-3, 6e4, 1e-6),
                                        csr, v)
    assert steep["direct_per_value"] == 0.0
    assert steep["direct_per_nnz"] == pytest.approx(1e-3 / 5e5)
    with pytest.raises(ValueError, match="timings"):
        K.conv_sparse_kernel_choice(1e6, 1e5, (1.0, 2.0), csr, v)
