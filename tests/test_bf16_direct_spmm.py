"""The two bfloat16 CSR SpMM kernels: packed (B widened into a float32 pack
per K block) and direct (B's values widened in registers per nonzero).

Both run through ``_kernels.lowp_spmm`` (CountNonzeros + BuildCsr +
CsrSpmm) with the kernel forced (``path`` 0 packed, 1 direct, -1 the
per-call choice) and each instruction-set copy forced (``isa`` 0 scalar,
1 AVX2, 2 AVX-512, clamped to what the CPU has). They must give identical
bits -- the same fused multiply-adds in ascending k from zero, rounded once
-- and stay within the float32-accumulation bound of a float64 reference.
The shapes cross the direct kernel's block edges: 32-column vectors, its
256-column tiles (a narrower last tile: single-vector blocks, then a scalar
tail), 256-row K blocks and 512-row row groups.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_sparse_split.testing import random_sparse

pytestmark = pytest.mark.usefixtures("op_library")

EPS_BF16 = 2.0 ** -7
EPS_F32 = 2.0 ** -23


def _bits(x):
    return tf.bitcast(tf.cast(tf.constant(x, tf.float32), tf.bfloat16),
                      tf.uint16).numpy()


def _values(u):
    return tf.cast(tf.bitcast(tf.constant(u), tf.bfloat16), tf.float64).numpy()


def _kernels():
    from tf_sparse_split import _kernels as k
    return k


def _all_outputs(a_bits, b_bits, transpose_a=False):
    kern = _kernels()
    return {(path, isa): kern.lowp_spmm(a_bits, b_bits, "bfloat16",
                                        transpose_a, isa=isa, path=path)
            for path in (-1, 0, 1) for isa in (0, 1, 2)}


def _assert_identical(outs):
    ref = outs[(0, 2)]
    for key, out in outs.items():
        assert out.dtype == np.uint16 and out.shape == ref.shape, key
        np.testing.assert_array_equal(out, ref, err_msg=str(key))


SHAPES = [
    # (m, k, n): n around the 32-column vector and the 256-column tile
    (1, 1, 32), (7, 13, 33), (33, 70, 63), (5, 300, 64), (40, 257, 255),
    (17, 256, 256), (9, 600, 257), (130, 31, 300), (3, 1000, 520),
    (600, 64, 96),   # more rows than one 512-row group
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sparsity", [0.0, 0.6, 0.95, 0.995, 1.0])
def test_kernels_identical_bits_and_accurate(shape, sparsity):
    m, k, n = shape
    rng = np.random.default_rng(m * 7919 + k * 31 + n + int(sparsity * 1000))
    a = random_sparse((m, k), sparsity, rng)
    if sparsity < 1.0 and not a.any():
        a[rng.integers(m), rng.integers(k)] = 0.75   # real nonzeros
    b = rng.standard_normal((k, n)) * 4.0
    a_bits, b_bits = _bits(a), _bits(b)
    outs = _all_outputs(a_bits, b_bits)
    _assert_identical(outs)
    a64, b64 = _values(a_bits), _values(b_bits)
    ref = a64 @ b64
    got = _values(outs[(1, 2)])
    tol = EPS_BF16 * np.abs(ref) + (4 * k * EPS_F32) * (
        np.abs(a64) @ np.abs(b64)) + 1e-30
    assert np.all(np.abs(got - ref) <= tol)
    if sparsity == 1.0:
        assert not got.any()   # every output row written (zeros)


@pytest.mark.parametrize("transpose_a", [False, True])
def test_transposed_operand(transpose_a):
    rng = np.random.default_rng(5)
    m, k, n = 70, 530, 290
    a = random_sparse((m, k), 0.99, rng)
    a_in = a.T.copy() if transpose_a else a
    b = rng.standard_normal((k, n))
    outs = _all_outputs(_bits(a_in), _bits(b), transpose_a)
    _assert_identical(outs)
    ref = _values(_bits(a)) @ _values(_bits(b))
    np.testing.assert_allclose(_values(outs[(1, 2)]), ref, rtol=0.02,
                               atol=0.05)


def test_nan_inf_and_rounding_edges():
    """NaN/Inf in the nonzeros and in B propagate identically on every
    path; Inf in B where op(a) is zero gives no NaN (the product is
    skipped); a sum above bfloat16's largest finite value rounds to Inf and
    ties round to even, as FloatToBf16 does."""
    rng = np.random.default_rng(9)
    m, k, n = 12, 300, 260
    a = random_sparse((m, k), 0.97, rng)
    b = rng.standard_normal((k, n))
    a[:, [4, 7]] = 0.0
    a[0, 3] = np.inf          # row 0: Inf nonzero
    a[1, 4] = np.nan          # row 1: NaN nonzero
    b[7, :] = np.inf          # B's row 7 meets only row 2's nonzero
    a[2, 7] = 1.0
    a[3, :] = 0.0             # row 3: 3.3895e38 + 1e36 > bfloat16 max
    a[3, 10] = a[3, 12] = 1.0
    b[10, 0], b[12, 0] = 3.3895e38, 1.0e36
    a[4, :] = 0.0             # row 4: ties
    a[4, 11] = a[4, 13] = 1.0
    b[11, 1], b[13, 1] = 1.0, 2.0 ** -8       # 1 + 2^-8 -> 1 (even)
    b[11, 2], b[13, 2] = 1.0, 3 * 2.0 ** -8   # 1 + 3 2^-8 -> 1 + 2^-6 (even)
    outs = _all_outputs(_bits(a), _bits(b))
    _assert_identical(outs)
    got = _values(outs[(1, 2)])
    assert not np.isfinite(got[0]).any()
    assert np.isnan(got[1]).all()
    assert np.isposinf(got[2]).all()
    assert np.isposinf(got[3, 0])
    assert got[4, 1] == 1.0 and got[4, 2] == 1.0 + 2.0 ** -6
    assert np.all(np.isfinite(got[3, 1:]))
    assert np.all(np.isfinite(got[4:]))   # no 0 * Inf from B's row 7


def test_path_argument_checked():
    kern = _kernels()
    a = _bits(np.eye(4))
    with pytest.raises(ValueError, match="path"):
        kern.lowp_spmm(a, a, "bfloat16", path=4)
    with pytest.raises(ValueError, match="path"):
        kern.lowp_spmm(a, a, "bfloat16", path=-2)


def test_float16_ignores_the_path():
    """float16 has one kernel (packed): every path value gives its bits."""
    kern = _kernels()
    rng = np.random.default_rng(3)
    a = random_sparse((20, 300, ), 0.99, rng)
    b = rng.standard_normal((300, 100))
    a16 = tf.bitcast(tf.constant(a, tf.float16), tf.uint16).numpy()
    b16 = tf.bitcast(tf.constant(b, tf.float16), tf.uint16).numpy()
    outs = [kern.lowp_spmm(a16, b16, "float16", path=p) for p in (-1, 0, 1)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_kernel_choice_rule():
    """Without the dot kernels (dot=False): direct up to nnz = 3 k +
    16 n_rows with n >= 32 (the packed kernel's per-call costs ~ k n for its
    pack and ~ n_rows n for its float32 output buffer), on the shapes the
    constants were fitted to."""
    import functools
    choose = functools.partial(_kernels().bf16_spmm_kernel, dot=False)
    # forward 128x2048x2048 (batch 128): 8192 nonzeros (97% zeros) direct,
    # 13107 (95%) packed
    assert choose(128, 2048, 2048, 8192) == "direct"
    assert choose(128, 2048, 2048, 13107) == "packed"
    # weight gradient a^T dY of the same layer: 2048 rows, k = 128
    assert choose(2048, 128, 2048, 26214) == "direct"     # 90% zeros
    assert choose(2048, 128, 2048, 52429) == "packed"     # 80%
    assert choose(10, 100, 2048, 3 * 100 + 16 * 10) == "direct"  # the edge
    assert choose(10, 100, 2048, 3 * 100 + 16 * 10 + 1) == "packed"
    assert choose(128, 2048, 31, 1) == "packed"             # narrow output
    assert choose(128, 2048, 32, 1) == "direct"
    with pytest.raises(ValueError):
        choose(-1, 1, 1, 1)
