"""SparseSplitMatMul, SparseSplitSddmm and BiasFatRelu in bfloat16 and float16.

Each op is compared with a float64 reference computed from the inputs
rounded to the dtype (``tf.cast``, round-to-nearest-even): the ops store
values in the dtype, accumulate in float32 and round once, so the error of
an output is bounded by its rounding (``eps_T / 2 * |ref|``) plus the
float32 accumulation error (``~K * eps_f32 * (|a| @ |b|)``). The bound used
is ``eps_T * |ref| + (eps_T + 4 * K * eps_f32) * (|a| @ |b|)`` -- a bound TF's
own MatMul in the dtype (the dense part) also meets, so it holds at every
threshold. The 16-bit kernels' three instruction-set paths (scalar, AVX2,
AVX-512) are checked for identical bits through the pybind11 module.
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.testing import random_sparse
from tf_sparse_split.tuning import stats as S

pytestmark = pytest.mark.usefixtures("op_library")

DTYPES = [tf.bfloat16, tf.float16]
EPS = {tf.bfloat16: 2.0 ** -7, tf.float16: 2.0 ** -10}  # machine epsilon
EPS_F32 = 2.0 ** -23
SHAPES = [(1, 1, 1), (7, 13, 5), (33, 70, 129), (64, 300, 70), (130, 257, 64)]
SPARSITIES = [0.0, 0.5, 0.9, 0.99, 1.0]


def _rounded(x, dtype):
    """x rounded to dtype (a tensor of dtype) and its exact float64 value."""
    t = tf.cast(tf.constant(x, tf.float32), dtype)
    return t, tf.cast(t, tf.float64).numpy()


def _operands(rng, m, k, n, sparsity, ta, tb, dtype):
    a = random_sparse((m, k), sparsity, rng, np.float32)
    if sparsity < 1.0 and not a.any():
        a[rng.integers(m), rng.integers(k)] = 0.5  # keep real nonzeros
    b = rng.standard_normal((k, n)).astype(np.float32)
    a_t, a64 = _rounded(a.T.copy() if ta else a, dtype)
    b_t, b64 = _rounded(b.T.copy() if tb else b, dtype)
    return a_t, b_t, a64, b64


def _op(x, transpose):
    return x.T if transpose else x


def _check(got, ref, abs_prod, k, dtype, what):
    """Elementwise |got - ref| <= eps_T |ref| + (eps_T + 4 K eps32) |a||b|."""
    got = tf.cast(got, tf.float64).numpy()
    eps = EPS[dtype]
    tol = eps * np.abs(ref) + (eps + 4 * max(k, 1) * EPS_F32) * abs_prod + 1e-30
    err = np.abs(got - ref)
    assert np.all(err <= tol), (what, float(np.max(err - tol)),
                                float(np.max(err)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_matmul_matches_float64_reference(dtype, m, k, n, sparsity):
    rng = np.random.default_rng([m, k, n, int(sparsity * 100), dtype.size])
    for ta, tb in itertools.product([False, True], repeat=2):
        a, b, a64, b64 = _operands(rng, m, k, n, sparsity, ta, tb, dtype)
        ref = _op(a64, ta) @ _op(b64, tb)
        abs_prod = np.abs(_op(a64, ta)) @ np.abs(_op(b64, tb))
        for thr in (0.0, 1.0, -1.0):
            got, st = tfss.sparse_split_matmul(a, b, thr, ta, tb,
                                               return_stats=True)
            assert got.dtype == dtype and got.shape == (m, n)
            _check(got, ref, abs_prod, k, dtype, (ta, tb, thr))
            st = st.numpy()
            assert st[S.NNZ] == np.count_nonzero(a64)
            assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == m
            if thr == 1.0:
                assert st[S.ROWS_SPARSE] == m


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_sparse_rows_zero_and_empty_rows(dtype):
    """All-zero rows give exact zeros; rows split both ways in one call."""
    rng = np.random.default_rng(3)
    a = random_sparse((60, 200), 0.8, rng)
    a[5:15] = 0.0
    a[20:30] = rng.uniform(0.1, 1, (10, 200))  # dense rows
    b = rng.standard_normal((200, 90)).astype(np.float32)
    a_t, a64 = _rounded(a, dtype)
    b_t, b64 = _rounded(b, dtype)
    got, st = tfss.sparse_split_matmul(a_t, b_t, 0.5, return_stats=True)
    assert st[S.ROWS_DENSE] > 0 and st[S.ROWS_SPARSE] > 0
    _check(got, a64 @ b64, np.abs(a64) @ np.abs(b64), 200, dtype, "split")
    assert np.all(tf.cast(got, tf.float32).numpy()[5:15] == 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_all_dense_call_is_tf_matmul(dtype):
    """A call with every row dense and nothing to compact is TF's own
    MatMul in the dtype: the same bits as tf.matmul."""
    rng = np.random.default_rng(4)
    a, _ = _rounded(rng.uniform(0.1, 1, (64, 96)), dtype)
    b, _ = _rounded(rng.standard_normal((96, 48)), dtype)
    got, st = tfss.sparse_split_matmul(a, b, 0.0, return_stats=True)
    assert st[S.ROWS_DENSE] == 64
    np.testing.assert_array_equal(tf.cast(got, tf.float32).numpy(),
                                  tf.cast(tf.matmul(a, b), tf.float32).numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
def test_bias_activation_epilogue(dtype, activation):
    rng = np.random.default_rng(5)
    m, k, n = 40, 150, 70
    a, b, a64, b64 = _operands(rng, m, k, n, 0.8, False, False, dtype)
    bias, bias64 = _rounded(rng.standard_normal(n) * 3, dtype)
    pre = a64 @ b64
    abs_prod = np.abs(a64) @ np.abs(b64)
    for thr in (0.0, 1.0, -1.0):
        got = tfss.sparse_split_matmul(a, b, thr, bias=bias,
                                       activation=activation)
        assert got.dtype == dtype
        # The product is rounded to T, then bias (and the clamp) once more:
        # two roundings, as tf.matmul + tf.nn.bias_add in T.
        ref = pre + bias64
        if activation == "relu":
            ref = np.maximum(ref, 0)
        elif activation == "relu6":
            ref = np.clip(ref, 0, 6)
        _check(got, ref, abs_prod + np.abs(pre) + np.abs(bias64), k, dtype,
               (activation, thr))


def _grads(fn, a, b, bias=None):
    with tf.GradientTape() as tape:
        tape.watch([a, b] + ([bias] if bias is not None else []))
        y = fn(a, b, bias)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * w_loss(y.shape))
    return y, tape.gradient(loss, [a, b] + ([bias] if bias is not None else []))


def w_loss(shape):
    """Fixed loss weights, so dY is not constant."""
    rng = np.random.default_rng(11)
    return tf.constant(rng.standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True),
                                   (True, False), (True, True)])
def test_gradients_match_tf_matmul(dtype, masked, ta, tb):
    """Gradients in T against TF's matmul in the same dtype and in float64
    (on the T-rounded inputs; dY is the same float32 weights, rounded)."""
    if masked and ta:
        pytest.skip("masked_input_grad applies to transpose_a=False")
    rng = np.random.default_rng([7, int(masked), int(ta), int(tb)])
    m, k, n = 48, 96, 80
    a, b, a64, b64 = _operands(rng, m, k, n, 0.85, ta, tb, dtype)
    bias, _ = _rounded(rng.standard_normal(n), dtype)
    act = "relu" if masked else None

    def ours(x, y, bb):
        return tfss.sparse_split_matmul(x, y, 1.0, ta, tb, bias=bb,
                                        activation=act,
                                        masked_input_grad=masked)

    def theirs(x, y, bb):
        out = tf.nn.bias_add(tf.matmul(x, y, transpose_a=ta, transpose_b=tb), bb)
        return tf.nn.relu(out) if masked else out

    y_o, g_o = _grads(ours, a, b, bias)
    y_t, g_t = _grads(theirs, a, b, bias)
    a_d, b_d, bias_d = (tf.cast(t, tf.float64) for t in (a, b, bias))
    y_64, g_64 = _grads(theirs, a_d, b_d, bias_d)
    # The ReLU masks the same outputs except where the pre-activation is
    # within rounding of 0; compare where both agree on the mask.
    pos = [tf.cast(y, tf.float64).numpy() > 0 for y in (y_o, y_t, y_64)]
    same = (pos[0] == pos[1]) & (pos[0] == pos[2])
    if masked:
        assert same.mean() > 0.98
    for name, go, gt, g64 in zip(("a", "b", "bias"), g_o, g_t, g_64):
        assert go.dtype == dtype, name
        go = tf.cast(go, tf.float64).numpy()
        gt = tf.cast(gt, tf.float64).numpy()
        g64 = g64.numpy()
        if masked and name == "a":
            # masked_input_grad: dA only where a != 0 (the producer's
            # gradient is zero elsewhere).
            live = a64 != 0
            gt, g64 = gt * live, g64 * live
        scale = np.max(np.abs(g64)) + 1e-30
        eps = EPS[dtype]
        if not masked or same.all():
            assert np.max(np.abs(go - g64)) / scale < 30 * eps, name
        assert np.max(np.abs(go - gt)) / scale < 60 * eps, name


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("sparsity", [0.0, 0.6, 0.95, 1.0])
def test_sddmm_matches_float64_reference(dtype, sparsity):
    from tf_sparse_split.ops.sddmm import sparse_split_sddmm

    rng = np.random.default_rng([9, int(sparsity * 100), dtype.size])
    for m, k, n, tb in [(1, 1, 1, False), (37, 120, 45, False),
                        (64, 90, 200, True), (5, 33, 64, True)]:
        mask, mask64 = _rounded(random_sparse((m, k), sparsity, rng), dtype)
        x, x64 = _rounded(rng.standard_normal((m, n)), dtype)
        bw = rng.standard_normal((n, k) if tb else (k, n))
        b, b64 = _rounded(bw, dtype)
        yb = b64.T if tb else b64  # op(b) [k, n]
        ref = np.where(mask64 != 0, x64 @ yb.T, 0.0)
        abs_prod = np.abs(x64) @ np.abs(yb.T)
        for thr in (0.0, 1.0, -1.0):
            got = sparse_split_sddmm(mask, x, b, thr, transpose_b=tb)
            assert got.dtype == dtype and got.shape == (m, k)
            _check(got, ref, abs_prod, n, dtype, (m, k, n, tb, thr))
            g = tf.cast(got, tf.float32).numpy()
            assert np.all(g[mask64 == 0] == 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_bias_fat_relu_forward_and_grad(dtype):
    """BiasFatRelu in T equals TF's graph in T (BiasAdd rounds v once, the
    select is exact); its sum and the gradient's dbias accumulate in float32
    and round once."""
    rng = np.random.default_rng(12)
    x, x64 = _rounded(rng.standard_normal((6, 5, 7, 24)), dtype)
    bias, b64 = _rounded(rng.standard_normal(24) * 0.3, dtype)
    cutoff = 0.25
    y, total = tfss.ops.bias_fat_relu(x, bias, cutoff)
    assert y.dtype == dtype and total.dtype == dtype
    v = tf.nn.bias_add(x, bias)
    y_ref = tf.where(v > tf.cast(cutoff, dtype), v, tf.zeros_like(v))
    np.testing.assert_array_equal(tf.cast(y, tf.float32).numpy(),
                                  tf.cast(y_ref, tf.float32).numpy())
    y64 = tf.cast(y_ref, tf.float64).numpy()
    assert abs(float(tf.cast(total, tf.float64)) - y64.sum()) <= (
        EPS[dtype] * np.abs(y64).sum() + 1e-6)
    dy, dy64 = _rounded(rng.standard_normal(y.shape), dtype)
    lib = tfss.load_library()
    dx, dbias = lib.tf_sparse_split_bias_fat_relu_grad(
        dy, y, tf.constant(0.5, dtype))
    kept = y64 > 0
    dx_ref = tf.cast(tf.where(kept, tf.cast(dy, tf.float32) + 0.5, 0.0), dtype)
    np.testing.assert_array_equal(tf.cast(dx, tf.float32).numpy(),
                                  tf.cast(dx_ref, tf.float32).numpy())
    dx64 = tf.cast(dx_ref, tf.float64).numpy()
    want = dx64.reshape(-1, 24).sum(axis=0)
    scale = np.abs(dx64).reshape(-1, 24).sum(axis=0)
    got = tf.cast(dbias, tf.float64).numpy()
    assert np.all(np.abs(got - want) <= EPS[dtype] * np.abs(want)
                  + 300 * EPS_F32 * scale + 1e-30)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_mixed_dtypes_are_rejected(dtype):
    a = tf.cast(tf.ones([4, 6]), dtype)
    b32 = tf.ones([6, 3], tf.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        tfss.sparse_split_matmul(a, b32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        tfss.sparse_split_matmul(a, tf.cast(b32, dtype),
                                 bias=tf.zeros([3], tf.float32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="bfloat16"):
        tfss.sparse_split_matmul(tf.ones([4, 6], tf.int32), b32)
    from tf_sparse_split.ops.sddmm import sparse_split_sddmm

    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        sparse_split_sddmm(a, tf.ones([4, 3], tf.float32), tf.cast(b32, dtype))
    with pytest.raises(tf.errors.InvalidArgumentError, match="dtype"):
        tfss.ops.bias_fat_relu(a, tf.zeros([6], tf.float32), 0.1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_nan_and_inf_propagate(dtype):
    """NaN/Inf in a reach the row they are in at every threshold; a zero of
    a times Inf in b gives no NaN on the sparse path (as tf.sparse)."""
    rng = np.random.default_rng(13)
    a = random_sparse((20, 64), 0.8, rng)
    a[3, 5] = np.nan
    a[7, 9] = np.inf
    b = rng.uniform(0.5, 1.0, (64, 33)).astype(np.float32)
    a_t, _ = _rounded(a, dtype)
    b_t, _ = _rounded(b, dtype)
    for thr in (0.0, 1.0, -1.0):
        got = tf.cast(tfss.sparse_split_matmul(a_t, b_t, thr),
                      tf.float32).numpy()
        assert np.all(np.isnan(got[3])), thr
        assert np.all(np.isinf(got[7]) & (got[7] > 0)), thr
        others = np.delete(got, [3, 7], axis=0)
        assert np.all(np.isfinite(others)), thr
    b_inf = b.copy()
    b_inf[0, :] = np.inf
    a0 = random_sparse((10, 64), 0.7, rng)
    a0[:, 0] = 0.0
    got = tfss.sparse_split_matmul(_rounded(a0, dtype)[0],
                                   _rounded(b_inf, dtype)[0], 1.0)
    assert np.all(np.isfinite(tf.cast(got, tf.float32).numpy()))


def _bits(x, dtype):
    return tf.bitcast(tf.cast(tf.constant(x, tf.float32), dtype),
                      tf.uint16).numpy()


def _from_bits(u, dtype):
    return tf.cast(tf.bitcast(tf.constant(u), dtype), tf.float64).numpy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("transpose_a", [False, True])
def test_kernel_paths_give_identical_bits(dtype, transpose_a):
    """The scalar, AVX2 and AVX-512 copies of the 16-bit SpMM and SDDMM
    give the same bits (fused multiply-adds in the same order); each path
    the CPU lacks is clamped to one it has."""
    from tf_sparse_split import _kernels

    tdt = tf.as_dtype(dtype)
    info = _kernels.low_precision_isa()
    assert info["best"] in ("scalar", "avx2+fma", "avx512f+fma")
    rng = np.random.default_rng(14)
    for m, k, n, sp in [(37, 300, 77, 0.7), (64, 129, 200, 0.95), (3, 5, 1, 0.2)]:
        a = random_sparse((m, k), sp, rng)
        a_bits = _bits(a.T.copy() if transpose_a else a, tdt)
        b_bits = _bits(rng.standard_normal((k, n)), tdt)
        outs = [_kernels.lowp_spmm(a_bits, b_bits, dtype, transpose_a, isa=i)
                for i in (0, 1, 2)]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
        a64 = _from_bits(a_bits, tdt)
        a64 = a64.T if transpose_a else a64
        b64 = _from_bits(b_bits, tdt)
        got = _from_bits(outs[0], tdt)
        tol = EPS[tdt] * np.abs(a64 @ b64) + (4 * k * EPS_F32) * (
            np.abs(a64) @ np.abs(b64)) + 1e-30
        assert np.all(np.abs(got - a64 @ b64) <= tol)
        mask_bits = _bits(random_sparse((m, k), sp, rng), tdt)
        x_bits = _bits(rng.standard_normal((m, n)), tdt)
        y_bits = _bits(rng.standard_normal((k, n)), tdt)
        sd = [_kernels.lowp_sddmm(mask_bits, x_bits, y_bits, dtype, isa=i)
              for i in (0, 1, 2)]
        # bfloat16 on a CPU with AVX512_BF16: the AVX-512 copy runs the
        # vdpbf16ps dots (another summation order; tests/
        # test_bf16_dot_sddmm.py), checked below against the bound only
        same = (sd[1:2] if tdt == tf.bfloat16
                and _kernels.bf16_dot_available() else sd[1:])
        for o in same:
            np.testing.assert_array_equal(o, sd[0])
        x64, y64 = _from_bits(x_bits, tdt), _from_bits(y_bits, tdt)
        ref = np.where(_from_bits(mask_bits, tdt) != 0, x64 @ y64.T, 0.0)
        tol = EPS[tdt] * np.abs(ref) + (4 * n * EPS_F32) * (
            np.abs(x64) @ np.abs(y64.T)) + 1e-30
        for o in sd:
            assert np.all(np.abs(_from_bits(o, tdt) - ref) <= tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_under_tf_function_and_auto_threshold_families(dtype):
    """Traced calls in T; the cost model keeps a family per dtype (the
    family key includes it), so a bfloat16 call never reuses float32 terms."""
    rng = np.random.default_rng(15)
    a, b, a64, b64 = _operands(rng, 128, 256, 96, 0.9, False, False, dtype)

    @tf.function
    def f(x, y):
        return tfss.sparse_split_matmul(x, y, -1.0, return_stats=True)

    for _ in range(3):
        got, st = f(a, b)
        _check(got, a64 @ b64, np.abs(a64) @ np.abs(b64), 256, dtype, "fn")
    from tf_sparse_split import _kernels

    keys = [_kernels.matmul_family_key(0, d.as_datatype_enum, 128, 256, 96)
            for d in (tf.float32, dtype)]
    assert keys[0] != keys[1]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_rewrite_pass_replaces_low_precision_matmuls(rw, dtype):
    """The pass rewrites bfloat16/float16 MatMuls (forward, weight gradients
    and the ReLU-masked input gradients) like float32 ones, with the same
    result to the dtype's rounding."""
    from tf_sparse_split import rewrite

    rng = np.random.default_rng(16)
    ws = [tf.cast(rng.standard_normal(s) * 0.3, dtype)
          for s in ((24, 40), (40, 33), (33, 5))]

    def make():
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(ws)
                h1 = tf.nn.relu(tf.matmul(x, ws[0], name="l1"))
                h2 = tf.nn.relu(tf.matmul(h1, ws[1], name="l2"))
                y = tf.matmul(h2, ws[2], name="l3")
                loss = tf.reduce_sum(tf.cast(y, tf.float32) ** 2)
            return y, tape.gradient(loss, ws)
        return step

    x = tf.cast(rng.standard_normal((17, 24)), dtype)
    y0, g0 = make()(x)
    assert rw.counters() == {}
    with pytest.warns(RuntimeWarning, match="already instantiated"):
        rw.enable()
    y1, g1 = make()(x)
    # Six ReLU-fed MatMuls (two of them SDDMMs) and the two that read x.
    assert rw.counters() == {"MatMul": 8}
    done = [r for r in rewrite.log() if r["action"] == "rewritten"]
    assert {r["kind"] for r in done} >= {"sddmm"}
    for got, want in zip([y1] + list(g1), [y0] + list(g0)):
        assert got.dtype == dtype
        got = tf.cast(got, tf.float64).numpy()
        want = tf.cast(want, tf.float64).numpy()
        assert np.max(np.abs(got - want)) <= 40 * EPS[dtype] * np.max(np.abs(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_each_dtype_calibrates_its_own_family(dtype):
    """An automatic call in T calibrates a family of its own (timing both
    paths in T) even when float32 calls of the same shape already
    calibrated theirs: its terms are not the float32 family's."""
    rng = np.random.default_rng(17)
    a32 = random_sparse((96, 352), 0.9, rng)
    b32 = rng.standard_normal((352, 88)).astype(np.float32)
    _, st32 = tfss.sparse_split_matmul(a32, b32, -1.0, return_stats=True)
    a, _ = _rounded(a32, dtype)
    b, _ = _rounded(b32, dtype)
    _, st = tfss.sparse_split_matmul(a, b, -1.0, return_stats=True)
    st32, st = st32.numpy(), st.numpy()
    assert st32[S.CALIBRATED] == 1 and st[S.CALIBRATED] == 1
    terms = [S.TERM_DENSE_RATE, S.TERM_SPARSE_RATE, S.TERM_CONVERT]
    assert all(st[i] > 0 for i in terms)
    assert [st[i] for i in terms] != [st32[i] for i in terms]
