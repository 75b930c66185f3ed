"""SparseSplitMatMul against a float64 reference, its gradients and bad inputs."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.tuning import stats as S
from tf_sparse_split.testing import random_sparse, reference_matmul, relative_error

pytestmark = pytest.mark.usefixtures("op_library")

SHAPES = [(1, 1, 1), (7, 13, 5), (1000, 3, 17), (33, 70, 129), (64, 300, 70)]
SPARSITIES = [0.0, 0.5, 0.9, 0.99, 1.0]
THRESHOLDS = [0.0, 0.5, 1.0, -1.0]


def _operands(rng, m, k, n, sparsity, ta, tb, dtype=np.float32, structure="uniform"):
    a = random_sparse((m, k), sparsity, rng, dtype, structure)
    if sparsity < 1.0 and not a.any():
        a[rng.integers(m), rng.integers(k)] = 0.5  # keep real nonzeros
    b = rng.standard_normal((k, n)).astype(dtype)
    return (a.T.copy() if ta else a), (b.T.copy() if tb else b)


def _tol(dtype):
    return 1e-5 if dtype == np.float32 else 1e-12


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("sparsity", SPARSITIES)
def test_forward_matches_reference_all_thresholds_and_transposes(m, k, n, sparsity, device):
    with tf.device(device):
        rng = np.random.default_rng([m, k, n, int(sparsity * 100)])
        for ta, tb in itertools.product([False, True], repeat=2):
            a, b = _operands(rng, m, k, n, sparsity, ta, tb)
            ref = reference_matmul(a, b, ta, tb)
            for thr in THRESHOLDS:
                got, st = tfss.sparse_split_matmul(a, b, thr, ta, tb, return_stats=True)
                assert got.shape == (m, n) and got.dtype == tf.float32
                err = relative_error(got, ref)
                assert err <= 1e-5, (m, k, n, sparsity, thr, ta, tb, err)
                st = st.numpy()
                assert st[S.ROWS_DENSE] + st[S.ROWS_SPARSE] == m
                assert st[S.NNZ] == np.count_nonzero(a)
                assert st[S.HISTOGRAM].sum() == m
                assert (st[S.M], st[S.K], st[S.N]) == (m, k, n)
                if thr >= 0:
                    assert st[S.THRESHOLD] == pytest.approx(thr)
                else:
                    assert 0.0 <= st[S.THRESHOLD] <= 1.0


@pytest.mark.parametrize("sparsity", [0.0, 0.7, 0.95])
def test_float64(sparsity, device):
    with tf.device(device):
        rng = np.random.default_rng(7)
        for ta, tb in itertools.product([False, True], repeat=2):
            a, b = _operands(rng, 45, 130, 70, sparsity, ta, tb, np.float64)
            ref = reference_matmul(a, b, ta, tb)
            for thr in THRESHOLDS:
                got = tfss.sparse_split_matmul(a, b, thr, ta, tb)
                assert got.dtype == tf.float64
                assert relative_error(got, ref) <= 1e-12


def test_threshold_routes_rows(device):
    """Threshold 1 sends every row sparse, 0 every nonzero row dense."""
    with tf.device(device):
        rng = np.random.default_rng(1)
        a = random_sparse((50, 80), 0.6, rng)
        a[3:13] = 0.0  # ten all-zero rows: never dense at threshold 0
        b = rng.standard_normal((80, 40)).astype(np.float32)
        _, st = tfss.sparse_split_matmul(a, b, 1.0, return_stats=True)
        assert st[S.ROWS_SPARSE] == 50 and st[S.ROWS_DENSE] == 0
        assert st[S.NNZ_SPARSE] == np.count_nonzero(a)
        _, st = tfss.sparse_split_matmul(a, b, 0.0, return_stats=True)
        assert st[S.ROWS_DENSE] == 40 and st[S.ROWS_SPARSE] == 10
        # A few all-zero rows (< 1/8 of them) are multiplied densely rather
        # than gathering every other row around them.
        a[4:13] = random_sparse((9, 80), 0.6, rng)
        _, st = tfss.sparse_split_matmul(a, b, 0.0, return_stats=True)
        assert st[S.ROWS_DENSE] == 50 and st[S.ROWS_SPARSE] == 0
        dens = np.count_nonzero(a, axis=1) / 80
        thr = float(np.median(dens))
        _, st = tfss.sparse_split_matmul(a, b, thr, return_stats=True)
        assert st[S.ROWS_DENSE] == np.sum(dens > np.float32(thr))


@pytest.mark.parametrize("structure", ["rows", "columns"])
def test_structured_zeros(structure, device):
    """Row-structured zeros and all-zero columns (compacted away)."""
    with tf.device(device):
        rng = np.random.default_rng(3)
        a = random_sparse((200, 256), 0.8, rng, structure=structure)
        b = rng.standard_normal((256, 96)).astype(np.float32)
        ref = reference_matmul(a, b)
        for thr in THRESHOLDS:
            got, st = tfss.sparse_split_matmul(a, b, thr, return_stats=True)
            assert relative_error(got, ref) <= 1e-5
        if structure == "columns":
            dead = int(np.sum(~a.any(axis=0)))
            _, st = tfss.sparse_split_matmul(a, b, 0.0, return_stats=True)
            assert dead > 0 and st[S.ZERO_COLS_SKIPPED] == dead


def test_inside_tf_function_and_unknown_shapes(device):
    with tf.device(device):
        rng = np.random.default_rng(11)
        a, b = _operands(rng, 37, 64, 29, 0.8, False, False)

        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32),
                                      tf.TensorSpec([None, None], tf.float32),
                                      tf.TensorSpec([], tf.float32)])
        def f(x, y, t):
            return tfss.sparse_split_matmul(x, y, t)

        for thr in THRESHOLDS:
            assert relative_error(f(a, b, thr), reference_matmul(a, b)) <= 1e-5
        # The shape function gives the static shape when it is known.
        g = tf.function(lambda x, y: tfss.sparse_split_matmul(x, y, return_stats=True))
        cf = g.get_concrete_function(tf.TensorSpec([37, 64]), tf.TensorSpec([64, 29]))
        assert cf.structured_outputs[0].shape.as_list() == [37, 29]
        assert cf.structured_outputs[1].shape.as_list() == [S.NUM_STATS]


def test_threshold_variable_is_read_each_call(device):
    with tf.device(device):
        rng = np.random.default_rng(5)
        a, b = _operands(rng, 20, 30, 10, 0.5, False, False)
        v = tf.Variable(0.0)

        @tf.function
        def f():
            return tfss.sparse_split_matmul(a, b, v, return_stats=True)[1]

        assert f()[S.ROWS_SPARSE] == np.sum(~a.any(axis=1))
        v.assign(1.0)
        assert f()[S.ROWS_SPARSE] == 20


def test_deterministic_bits(device):
    with tf.device(device):
        rng = np.random.default_rng(9)
        a, b = _operands(rng, 300, 500, 200, 0.9, False, False)
        first = tfss.sparse_split_matmul(a, b, 1.0).numpy()
        for _ in range(3):
            np.testing.assert_array_equal(tfss.sparse_split_matmul(a, b, 1.0).numpy(), first)


@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("thr", [0.0, 1.0, -1.0])
def test_gradients_against_numeric(ta, tb, thr, device):
    with tf.device(device):
        rng = np.random.default_rng([int(ta), int(tb), int(thr + 2)])
        a, b = _operands(rng, 6, 9, 5, 0.5, ta, tb, np.float64)
        f = lambda x, y: tfss.sparse_split_matmul(x, y, thr, ta, tb)  # noqa: E731
        theo, num = tf.test.compute_gradient(f, [tf.constant(a), tf.constant(b)])
        for t_, n_ in zip(theo, num):
            np.testing.assert_allclose(t_, n_, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
def test_gradients_match_tf_matmul(ta, tb, device):
    with tf.device(device):
        rng = np.random.default_rng([3, int(ta), int(tb)])
        a, b = _operands(rng, 40, 70, 30, 0.8, ta, tb)
        a, b = tf.constant(a), tf.constant(b)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([a, b])
            ours = tf.reduce_sum(tf.sin(tfss.sparse_split_matmul(a, b, -1.0, ta, tb)))
            ref = tf.reduce_sum(tf.sin(tf.matmul(a, b, transpose_a=ta, transpose_b=tb)))
        for x in (a, b):
            assert relative_error(tape.gradient(ours, x), tape.gradient(ref, x)) <= 1e-5


def test_grad_b_runs_through_the_sparse_op(device):
    """The b gradient is itself a SparseSplitMatMul with a as sparse operand."""
    with tf.device(device):
        a = tf.constant(random_sparse((8, 6), 0.5, np.random.default_rng(0)))
        b = tf.constant(np.ones((6, 4), np.float32))

        @tf.function
        def grads():
            with tf.GradientTape() as tape:
                tape.watch(b)
                y = tf.reduce_sum(tfss.sparse_split_matmul(a, b))
            return tape.gradient(y, b)

        graph = grads.get_concrete_function().graph
        types = [op.type for op in graph.get_operations()]
        assert types.count("TfSparseSplit>SparseSplitMatMul") == 2


def test_empty_operands(device):
    with tf.device(device):
        for (m, k, n) in [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0)]:
            a = np.zeros((m, k), np.float32)
            b = np.ones((k, n), np.float32)
            got, st = tfss.sparse_split_matmul(a, b, return_stats=True)
            assert got.shape == (m, n)
            np.testing.assert_array_equal(got.numpy(), np.zeros((m, n), np.float32))
            assert (st[S.M], st[S.K], st[S.N]) == (m, k, n)


def test_nan_inf_propagate_like_matmul(device):
    with tf.device(device):
        rng = np.random.default_rng(2)
        a = random_sparse((12, 20), 0.5, rng)
        a[2, 3] = np.nan
        a[5, 7] = np.inf
        a[5, 8] = 0.3
        b = rng.standard_normal((20, 6)).astype(np.float32)
        ref = tf.matmul(a, b).numpy()
        for thr in THRESHOLDS:
            got = tfss.sparse_split_matmul(a, b, thr).numpy()
            np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
            np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
            finite = np.isfinite(ref)
            assert relative_error(got[finite], ref[finite]) <= 1e-5


def test_inf_in_b_facing_zeros_is_skipped(device):
    """Documented: where a is exactly zero the product is skipped (0 not NaN)."""
    with tf.device(device):
        a = np.array([[0.0, 1.0]], np.float32)
        b = np.array([[np.inf], [2.0]], np.float32)
        got = tfss.sparse_split_matmul(a, b, 1.0).numpy()  # sparse path
        assert got[0, 0] == 2.0
        got = tfss.sparse_split_matmul(a, b, 0.0).numpy()  # dense path, compacted
        assert got[0, 0] == 2.0


BAD = [
    (np.ones((2, 3, 4), np.float32), np.ones((4, 5), np.float32), 0.5, "rank 2"),
    (np.ones((3,), np.float32), np.ones((3, 5), np.float32), 0.5, "rank 2"),
    (np.ones((2, 3), np.float32), np.ones((4, 5), np.float32), 0.5, "inner dimensions"),
    (np.ones((2, 3), np.float32), np.ones((3, 5), np.float32), 1.5, "threshold"),
    (np.ones((2, 3), np.float32), np.ones((3, 5), np.float32), np.nan, "threshold"),
    (np.ones((2, 3), np.float32), np.ones((3, 5), np.float32), [0.1, 0.2], "scalar"),
    (np.ones((2, 3), np.int32), np.ones((3, 5), np.int32), 0.5, "float32 or float64"),
    (np.ones((2, 3), np.complex64), np.ones((3, 5), np.complex64), 0.5, "float32 or float64"),
    (np.ones((2, 3), np.float32), np.ones((3, 5), np.float64), 0.5, "dtype"),
]


@pytest.mark.parametrize("a,b,thr,msg", BAD)
def test_bad_inputs_raise_invalid_argument(a, b, thr, msg):
    with pytest.raises(tf.errors.InvalidArgumentError, match=msg):
        tfss.sparse_split_matmul(a, b, thr)


def test_bad_shape_message_names_shapes():
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[2,3\].*\[4,5\]"):
        tfss.sparse_split_matmul(np.ones((2, 3), np.float32), np.ones((4, 5), np.float32))


def test_bad_inputs_inside_tf_function():
    @tf.function
    def f(a, b):
        return tfss.sparse_split_matmul(a, b)

    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        f(tf.ones((2, 3)), tf.ones((4, 5)))

    @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)] * 2)
    def g(a, b):
        return tfss.sparse_split_matmul(a, b)

    with pytest.raises(tf.errors.InvalidArgumentError, match="rank 2"):
        g(tf.ones((2, 3, 1)), tf.ones((3, 5)))


@pytest.mark.parametrize("thr", [None, "0.5", b"x"])
def test_non_numeric_threshold(thr):
    with pytest.raises(tf.errors.InvalidArgumentError, match="threshold"):
        tfss.sparse_split_matmul(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), thr)


def test_stats_of_empty_product_describe_a(device):
    """With N = 0 there is no work, but nnz and the histogram still count a."""
    with tf.device(device):
        a = random_sparse((8, 16), 0.5, np.random.default_rng(4))
        _, st = tfss.sparse_split_matmul(a, np.ones((16, 0), np.float32), return_stats=True)
        assert st[S.NNZ] == np.count_nonzero(a)
        assert st.numpy()[S.HISTOGRAM].sum() == 8


@pytest.mark.parametrize("tb", [False, True])
def test_masked_input_grad_exact_behind_relu(tb, device):
    """With a = relu(z), the live-column input gradient gives the same dz."""
    with tf.device(device):
        rng = np.random.default_rng([21, int(tb)])
        z = rng.standard_normal((30, 40))
        z[:, ::3] = -np.abs(z[:, ::3])  # dead units: all-zero columns after relu
        b = rng.standard_normal((50, 40) if tb else (40, 50))
        z, b = tf.constant(z), tf.constant(b)
        grads = []
        for live_only in (False, True):
            with tf.GradientTape() as tape:
                tape.watch([z, b])
                y = tfss.sparse_split_matmul(tf.nn.relu(z), b, 0.5, transpose_b=tb,
                                             masked_input_grad=live_only)
                loss = tf.reduce_sum(tf.sin(y))
            grads.append(tape.gradient(loss, [z, b]))
        for g0, g1 in zip(*grads):
            assert relative_error(g1, g0) <= 1e-12
        # The raw input gradient is zero exactly where a is (dead columns
        # included) and the full gradient elsewhere.
        a = tf.nn.relu(z)
        with tf.GradientTape() as tape:
            tape.watch(a)
            y = tfss.sparse_split_matmul(a, b, 0.5, transpose_b=tb, masked_input_grad=True)
        ga = tape.gradient(y, a).numpy()
        live = a.numpy() != 0
        dead = ~live.any(axis=0)
        assert dead.sum() >= 13 and np.all(ga[~live] == 0)
        full = tf.matmul(tf.ones((30, 50), tf.float64), b, transpose_b=not tb).numpy()
        np.testing.assert_allclose(ga[live], full[live], rtol=1e-12)


def test_masked_input_grad_bad_type():
    with pytest.raises(TypeError, match="masked_input_grad"):
        tfss.sparse_split_matmul(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32),
                                 masked_input_grad="yes")


@pytest.mark.parametrize("which", ["a", "b"])
def test_sparse_tensor_operand_is_refused_in_one_line(which):
    # convert_to_tensor's own message prints the whole SparseTensor; the op
    # says what to pass instead.
    a = np.zeros((4, 6), np.float32)
    a[0, 2] = 1.5
    b = np.ones((6, 3), np.float32)
    args = {"a": a, "b": b}
    args[which] = tf.sparse.from_dense(args[which])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"{which} must be a dense tensor, got a "
                             "SparseTensor") as e:
        tfss.sparse_split_matmul(args["a"], args["b"])
    assert len(str(e.value).splitlines()) == 1
    assert "indices" not in str(e.value)
    ragged = tf.ragged.constant([[1.0, 2.0], [3.0]])
    with pytest.raises(tf.errors.InvalidArgumentError, match="RaggedTensor"):
        tfss.ops.sparse_split_sddmm(ragged, a, b.T)
