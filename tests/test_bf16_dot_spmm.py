"""The bfloat16 dot SpMM kernels (AVX512_BF16 ``vdpbf16ps``).

``_kernels.lowp_spmm(..., path=2)`` forces the dot kernel (B's rows read in
place), ``path=3`` the dot kernel with each K block of B copied first (to
L1 from density 1/10, else to L2); ``path=0`` / ``1`` are the float32-FMA
packed / direct kernels.
The contract (``cc/core/spmm.h``): each output is the ascending-k sum of
its products, one rounding per product (``vdpbf16ps`` adds the odd
bfloat16 of a pair first; the kernel puts the earlier nonzero there), so
the bits equal the FMA kernels' wherever no value, product or partial sum
is a float32 denormal; those the instruction flushes to zero (DAZ/FTZ).
Tests of the kernels themselves skip on CPUs without AVX512_BF16; the
choice rule (``_kernels.bf16_spmm_kernel(..., dot=True|False)``) is tested
everywhere.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

from tf_sparse_split.testing import random_sparse

pytestmark = pytest.mark.usefixtures("op_library")

#: Unit roundoff of bfloat16 (8 significant bits) and of float32.
U_BF16 = 2.0 ** -8
U_F32 = 2.0 ** -24


def _kernels():
    from tf_sparse_split import _kernels as k
    return k


def _has_dot():
    return bool(_kernels().bf16_dot_available())


@pytest.fixture
def dot_kernels(op_library):
    """Skips the test where the dot kernels cannot run (no AVX512_BF16)."""
    if not _has_dot():
        pytest.skip("the CPU lacks AVX512_BF16 (the dot kernels cannot run)")


needs_dot = pytest.mark.usefixtures("dot_kernels")


def _bits(x):
    return tf.bitcast(tf.cast(tf.constant(x, tf.float32), tf.bfloat16),
                      tf.uint16).numpy()


def _values(u):
    return tf.cast(tf.bitcast(tf.constant(u), tf.bfloat16), tf.float64).numpy()


def _spmm(a_bits, b_bits, path, transpose_a=False, isa=-1, threads=0):
    return _kernels().lowp_spmm(a_bits, b_bits, "bfloat16", transpose_a,
                                isa=isa, threads=threads, path=path)


def _tolerance(a64, b64, k):
    """|got - ref| bound: one bfloat16 rounding of the output plus float32
    accumulation of k products (gamma_k = k u / (1 - k u)), doubled."""
    gamma = k * U_F32 / (1.0 - k * U_F32)
    ref = a64 @ b64
    return ref, 2.0 * (U_BF16 * np.abs(ref) + gamma * (np.abs(a64) @ np.abs(b64))) + 1e-300


SHAPES = [
    # (m, k, n): around the 32-column vector, the 128-column packed block
    # and the 256-column in-place block, the 128/256/1024-row K blocks (odd
    # counts leave an unpaired nonzero; the packed kernel's 32 KB copy of
    # 128 rows from density 1/10, its 256 KB copy of 1024 rows below) and
    # the 512-row row groups
    (1, 1, 32), (7, 13, 33), (33, 70, 63), (5, 300, 64), (40, 257, 255),
    (17, 256, 256), (9, 600, 257), (130, 31, 300), (3, 1000, 520),
    (600, 64, 96), (2, 129, 129), (700, 127, 160), (6, 2100, 161),
]


@needs_dot
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_dot_kernels_match_fma_bits_and_float64(shape, sparsity):
    m, k, n = shape
    rng = np.random.default_rng(m * 7919 + k * 31 + n + int(sparsity * 1000))
    a = random_sparse((m, k), sparsity, rng)
    if sparsity < 1.0 and not a.any():
        a[rng.integers(m), rng.integers(k)] = 0.75
    b = rng.standard_normal((k, n)) * 4.0
    a_bits, b_bits = _bits(a), _bits(b)
    fma = _spmm(a_bits, b_bits, 0, isa=2)
    for path in (2, 3):
        got = _spmm(a_bits, b_bits, path)
        assert got.dtype == np.uint16 and got.shape == (m, n)
        # normal-range inputs: no denormal anywhere, so the FMA kernels' bits
        np.testing.assert_array_equal(got, fma, err_msg=f"path {path}")
        ref, tol = _tolerance(_values(a_bits), _values(b_bits), k)
        assert np.all(np.abs(_values(got) - ref) <= tol)
        if sparsity == 1.0:
            assert not got.any()


@needs_dot
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_weight_gradient_shape_transposed(transpose_a, threads):
    """a^T @ dY (the weight gradient: CSR of the transpose) and a @ b, one
    and two threads: the same bits."""
    rng = np.random.default_rng(11)
    m, k, n = 300, 96, 290
    a = random_sparse((m, k), 0.9, rng)
    a_in = a.T.copy() if transpose_a else a
    b = rng.standard_normal((k, n))
    ref_bits = _spmm(_bits(a_in), _bits(b), 0, transpose_a, isa=2)
    for path in (2, 3):
        got = _spmm(_bits(a_in), _bits(b), path, transpose_a, threads=threads)
        np.testing.assert_array_equal(got, ref_bits)
    ref, tol = _tolerance(_values(_bits(a)), _values(_bits(b)), k)
    assert np.all(np.abs(_values(ref_bits) - ref) <= tol)


@needs_dot
@pytest.mark.parametrize("path", [2, 3])
def test_nan_inf_propagate_and_zeros_skip_inf(path):
    """NaN/Inf in the nonzeros and in B propagate; Inf in a row of B that
    only zeros of op(a) meet gives no NaN, also next to an unpaired
    nonzero (its partner is a zero vector, not a row of B); overflow
    rounds to Inf; ties round to even."""
    rng = np.random.default_rng(9)
    m, k, n = 12, 300, 260
    a = random_sparse((m, k), 0.97, rng)
    b = rng.standard_normal((k, n))
    a[:, [4, 7, 8]] = 0.0
    a[0, 3] = np.inf
    a[1, 4] = np.nan
    b[7, :] = np.inf          # met only by row 2's nonzero
    b[8, :] = np.nan          # met by nothing
    a[2, 7] = 1.0
    a[3, :] = 0.0
    a[3, 10] = a[3, 12] = 1.0
    b[10, 0], b[12, 0] = 3.3895e38, 1.0e36
    a[4, :] = 0.0
    a[4, 11] = a[4, 13] = 1.0
    b[11, 1], b[13, 1] = 1.0, 2.0 ** -8
    b[11, 2], b[13, 2] = 1.0, 3 * 2.0 ** -8
    a[5, :] = 0.0
    a[5, 9] = 2.0             # one nonzero: unpaired, next to B's NaN row 8
    got = _values(_spmm(_bits(a), _bits(b), path))
    fma = _values(_spmm(_bits(a), _bits(b), 0, isa=2))
    assert not np.isfinite(got[0]).any()
    assert np.isnan(got[1]).all()
    assert np.isposinf(got[2]).all()
    assert np.isposinf(got[3, 0])
    assert got[4, 1] == 1.0 and got[4, 2] == 1.0 + 2.0 ** -6
    assert np.all(np.isfinite(got[3, 1:]))
    assert np.all(np.isfinite(got[4:]))
    np.testing.assert_array_equal(got[5], 2.0 * _values(_bits(b))[9])
    # the same NaN / Inf positions and finite values as the FMA kernels
    np.testing.assert_array_equal(np.isnan(got), np.isnan(fma))
    fin = np.isfinite(fma)
    np.testing.assert_array_equal(got[fin], fma[fin])


@needs_dot
@pytest.mark.parametrize("path", [2, 3])
def test_denormals_flush_to_zero(path):
    """The documented difference: vdpbf16ps treats denormal inputs as zero
    and flushes denormal results whatever MXCSR says (the FMA kernels
    follow the calling thread's MXCSR: denormals kept unless FTZ/DAZ are
    set, as TensorFlow sets them in its threads)."""
    k, n = 4, 64
    a = np.zeros((3, k))
    b = np.zeros((k, n))
    a[0, 0], b[0, :] = 2.0 ** -70, 2.0 ** -60     # product 2^-130: denormal
    a[1, 1], b[1, :] = 2.0 ** -130, 2.0 ** 10     # denormal input value
    a[2, 2], b[2, :] = 1.0, 1.5                   # normal: unaffected
    fma = _values(_spmm(_bits(a), _bits(b), 0, isa=2))
    got = _values(_spmm(_bits(a), _bits(b), path))
    assert np.all((fma[0] == 2.0 ** -130) | (fma[0] == 0.0))
    assert np.all((fma[1] == 2.0 ** -120) | (fma[1] == 0.0))
    assert not got[0].any() and not got[1].any()
    assert np.all(got[2] == 1.5)


@needs_dot
def test_forced_lower_isa_runs_that_direct_kernel():
    """With the instruction set forced below AVX-512 the dot paths run that
    copy's direct kernel (same bits on normal inputs)."""
    rng = np.random.default_rng(4)
    a = random_sparse((20, 100), 0.8, rng)
    b = rng.standard_normal((100, 70))
    ref = _spmm(_bits(a), _bits(b), 1, isa=1)
    for path in (2, 3):
        np.testing.assert_array_equal(_spmm(_bits(a), _bits(b), path, isa=1),
                                      ref)
        np.testing.assert_array_equal(_spmm(_bits(a), _bits(b), path, isa=0),
                                      ref)


def test_path_argument_checked():
    a = _bits(np.eye(4))
    for bad in (4, -2):
        with pytest.raises(ValueError, match="path"):
            _spmm(a, a, bad)
    if not _kernels().low_precision_isa()["avx512bf16"]:
        with pytest.raises(ValueError, match="AVX512_BF16"):
            _spmm(a, a, 2)


def test_availability_follows_cpuid():
    info = _kernels().low_precision_isa()
    assert info["bf16_spmm_dot"] == _has_dot()
    if _has_dot():
        assert info["avx512bf16"] and info["best"] == "avx512f+fma"


def test_choice_rule_with_dot():
    """With the dot kernels on a CPU whose vdpbf16ps adds half the float32
    FMA's products per second (dot_rate_ratio 0.5, Sapphire Rapids): packed
    above density 1/2, dot packed from density 1/64, dot below; narrow
    outputs (n < 32) packed. The measured crossovers (spmm.cc) on the MLP's
    shapes."""
    choose = functools.partial(_kernels().bf16_spmm_kernel, dot=True,
                               dot_rate_ratio=0.5)
    rows, k, n = 128, 2048, 2048            # forward, batch 128
    dense = rows * k
    assert choose(rows, k, n, dense // 2 + 1) == "packed"
    assert choose(rows, k, n, dense) == "packed"
    assert choose(rows, k, n, dense // 2) == "dot_packed"
    assert choose(rows, k, n, int(0.1 * dense)) == "dot_packed"
    assert choose(rows, k, n, dense // 64) == "dot_packed"
    assert choose(rows, k, n, dense // 64 - 1) == "dot"
    assert choose(rows, k, n, int(0.01 * dense)) == "dot"
    # weight gradient a^T dY: 2048 rows, k = 128
    assert choose(2048, 128, 2048, 26214) == "dot_packed"   # 90%
    assert choose(2048, 128, 2048, 2621) == "dot"           # 99%
    assert choose(128, 2048, 31, 100) == "packed"
    assert choose(128, 2048, 32, 100) == "dot"
    assert choose(0, 0, 64, 0) in ("dot", "dot_packed")


@pytest.mark.parametrize("ratio", [0.5, 0.99, 1.0, 2.1])
def test_choice_rule_follows_the_dot_rate(ratio):
    """Where vdpbf16ps adds at least the FMA's products per second
    (dot_rate_ratio >= 1: Zen 4 measured ~2) the packed dot kernel also
    takes densities above 1/2; the sparse end of the rule and narrow
    outputs do not depend on the ratio."""
    choose = functools.partial(_kernels().bf16_spmm_kernel, dot=True,
                               dot_rate_ratio=ratio)
    rows, k, n = 1024, 4096, 1024
    dense = rows * k
    above_half = "dot_packed" if ratio >= 1.0 else "packed"
    for nnz in (dense // 2 + 1, int(0.7 * dense), dense):
        assert choose(rows, k, n, nnz) == above_half, nnz
    assert choose(rows, k, n, dense // 2) == "dot_packed"
    assert choose(rows, k, n, dense // 20) == "dot_packed"     # 95% zeros
    assert choose(rows, k, n, dense // 100) == "dot"           # 99% zeros
    assert choose(rows, k, 31, dense) == "packed"
    assert choose(rows, k, 31, 10) == "packed"


def test_dot_rate_ratio_of_this_cpu():
    """The measured ratio: 0 without the dot kernels, else positive and the
    same on every call (measured once per process); dot=True without a
    ratio is the rule at this CPU's ratio."""
    kern = _kernels()
    ratio = kern.bf16_dot_rate_ratio()
    assert ratio == kern.bf16_dot_rate_ratio()
    if not _has_dot():
        assert ratio == 0.0
    else:
        assert 0.0 < ratio < 100.0
    for nnz in (1000, 26214, 131072, 200000, 262144):
        assert (kern.bf16_spmm_kernel(128, 2048, 2048, nnz, dot=True)
                == kern.bf16_spmm_kernel(128, 2048, 2048, nnz, dot=True,
                                         dot_rate_ratio=ratio))
    with pytest.raises(ValueError, match="dot_rate_ratio"):
        kern.bf16_spmm_kernel(128, 2048, 2048, 10, dot=True,
                              dot_rate_ratio=-1.0)
    with pytest.raises(ValueError, match="dot_rate_ratio"):
        kern.bf16_spmm_kernel(128, 2048, 2048, 10, dot_rate_ratio=1.0)


def test_choice_rule_without_dot():
    """Without AVX512_BF16 the rule is the direct/packed one."""
    choose = _kernels().bf16_spmm_kernel
    assert choose(128, 2048, 2048, 8192, dot=False) == "direct"
    assert choose(128, 2048, 2048, 13107, dot=False) == "packed"
    assert choose(10, 100, 2048, 3 * 100 + 16 * 10, dot=False) == "direct"
    assert choose(10, 100, 2048, 3 * 100 + 16 * 10 + 1, dot=False) == "packed"
    assert choose(128, 2048, 31, 1, dot=False) == "packed"


def test_choice_on_this_cpu():
    """dot=None is the rule for what this CPU has."""
    choose = _kernels().bf16_spmm_kernel
    for args in [(128, 2048, 2048, 26214), (128, 2048, 2048, 2000),
                 (2048, 128, 2048, 26214), (64, 64, 16, 5)]:
        assert choose(*args) == choose(*args, dot=_has_dot())
    if not _has_dot():
        assert choose(128, 2048, 2048, 26214) != "dot"
    with pytest.raises(ValueError):
        choose(-1, 1, 1, 1, dot=True)
