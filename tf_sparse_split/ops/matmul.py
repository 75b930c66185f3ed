"""``sparse_split_matmul``: the ``SparseSplitMatMul`` op wrapper and its
registered gradient."""

import threading
import warnings

import numpy as np
import tensorflow as tf

from tf_sparse_split._loader import load_library
from tf_sparse_split.ops._common import (MATMUL_DTYPES, as_threshold,
                                         float_operand,
                                         invalid, operand_like)
from tf_sparse_split.utils.deprecation import renamed_kwarg
from tf_sparse_split.utils.validation import validate_choice

__all__ = ["sparse_split_matmul", "ACTIVATIONS"]

#: The activations the op fuses into its epilogue (``None`` = ``"none"``).
ACTIVATIONS = ("none", "relu", "relu6")

_no_gpu_warned = False
_no_gpu_lock = threading.Lock()


def _warn_if_no_gpu():
    """Warns once per process that heterogeneous=True has no GPU to use.

    Called when a ``heterogeneous=True`` op is created (eagerly: each call;
    under ``tf.function``: at tracing). Only the first time in the process
    warns; the op then runs the normal CPU split and records
    ``stats.HETERO_CPU_FALLBACK`` in its statistics.
    """
    global _no_gpu_warned
    if _no_gpu_warned or tf.config.list_physical_devices("GPU"):
        return
    with _no_gpu_lock:
        if _no_gpu_warned:
            return
        _no_gpu_warned = True
    warnings.warn(
        "tf_sparse_split: heterogeneous=True needs a GPU (dense rows on the "
        "GPU, sparse rows on the CPU), but TensorFlow sees none; the op runs "
        "the normal CPU split instead (same results; stats entry "
        "HETEROGENEOUS = HETERO_CPU_FALLBACK). This warning is shown once.",
        RuntimeWarning, stacklevel=3)


def sparse_split_matmul(a, b, threshold=-1.0, transpose_a=False,
                        transpose_b=False, return_stats=False, name=None,
                        heterogeneous=False, masked_input_grad=False,
                        bias=None, activation=None, full_stats=None,
                        grad_a_live_only=None):
    """Matrix product ``act(op(a) @ op(b) + bias)`` that skips the zeros of
    ``a``.

    The rows of ``op(a)`` (the activation operand) whose density -- the
    fraction of nonzeros -- is above ``threshold`` go to a dense GEMM (Eigen
    on TensorFlow's intra-op thread pool); the other rows go to a tiled CSR
    SpMM whose cost is proportional to their nonzeros; all-zero columns of
    ``op(a)`` are compacted away from the dense part together with the
    matching rows of ``op(b)``. The result equals ``tf.matmul``'s to float
    rounding at any threshold; only the speed changes. Method: K.-Y. Peng,
    *Adaptive runtime exploiting sparsity in tensor of deep learning on
    heterogeneous systems*, NTU 2017 (split by run-time density statistics).

    Heterogeneous split (``heterogeneous=True``, Peng 2017): on the GPU
    kernel the sparse rows are copied to host memory and multiplied by the
    CPU SpMM on TensorFlow's CPU thread pool while the dense rows run on the
    GPU (cuBLAS through TF's MatMul kernel); the two overlap, and the result
    is merged on the GPU. The answer is the same. Without a GPU the op runs
    on its CPU kernel, which does the normal CPU split (identical results to
    ``heterogeneous=False``) and records ``stats.HETERO_CPU_FALLBACK`` in the
    ``stats.HETEROGENEOUS`` entry; the first such op created in a process
    with no visible GPU also issues a ``RuntimeWarning`` (once per process).
    The gradient's sparse product inherits the flag.

    Fused epilogue (``bias``, ``activation``): the op adds ``bias`` to every
    row of the product and applies the activation, as
    ``tf.nn.relu(tf.matmul(a, b) + bias)`` would. When every row goes dense
    and nothing is compacted and there is a bias, the op runs TF's own fused
    kernel (``_FusedMatMul``, oneDNN's ``_MklNativeFusedMatMul`` with its
    BiasAdd and Relu/Relu6 post-ops: what Grappler fuses
    ``tf.nn.relu(tf.matmul(a, b) + bias)`` into; with an activation only
    where the dtype has oneDNN's kernel, float32 and bfloat16 on CPUs that
    run it); otherwise one pass over the output rows after the dense and
    sparse parts have written them. The gradient masks the incoming
    gradient with the output (relu: ``out > 0``; relu6: ``0 < out < 6``, as
    TF's ``ReluGrad``/``Relu6Grad``) and sums it over rows for ``bias``.

    Gradients are registered for ``a``, ``b`` and ``bias``; the one for ``b``
    (``op(a)^T @ dY``) runs through this op with ``a`` as its sparse operand,
    so its cost is proportional to ``nnz(a) * N``, not ``M * K * N``. The one
    for ``a`` exploits the zeros of the incoming gradient ``dY`` [M, N] (the
    activation's derivative masks it: ReLU, FATReLU, dropout downstream):
    ``dY @ op(b)^T`` runs through this op with ``dY`` as its sparse operand
    and an automatic threshold (TF's GEMM when ``N < 64``); with
    ``masked_input_grad`` it is the SDDMM masked by ``a`` instead (below).
    Sparsity per component of training, gradients included: R. Sun and
    L. Zhang, *Dynamic Sparse Method for Deep Learning Execution*, 2019.

    Cost of the analysis: with an automatic threshold and ``full_stats``
    False, a call that the cost model keeps all-dense does not count every
    value of ``a``: it counts a strided sample of its rows (a full count
    follows when the estimate is near the break-even) or, where no plan but
    the dense GEMM can save the policy's minimum gain whatever the zeros
    (e.g. a small N), nothing; a full count still runs every 16-256 calls
    (the fewer the cheaper the GEMM) to keep the cost model fresh. The
    result is the same; the statistics then hold estimates, flagged in their
    ``ANALYSIS`` entry.

    Non-finite values: NaN/Inf in ``a`` propagate as in ``tf.matmul``. Where
    ``a`` is exactly zero the product is skipped, so a NaN/Inf in ``b`` facing
    only zeros of ``a`` gives 0 instead of NaN (as in ``tf.sparse``) -- on the
    sparse path and for compacted all-zero columns.

    Args:
      a: float32, float64, bfloat16 or float16 tensor ``[M, K]`` (``[K, M]``
        if ``transpose_a``). In bfloat16/float16 the values stay in that
        dtype (2 bytes per nonzero in the CSR), every product is accumulated
        in float32 and rounded once (round-to-nearest-even), as TF's CPU
        MatMul in that dtype does; the bias add rounds once more, as
        ``tf.nn.bias_add`` in that dtype. Gradients are in the same dtype.
      b: tensor of the same dtype, ``[K, N]`` (``[N, K]`` if ``transpose_b``).
      threshold: scalar row-density threshold in ``[0, 1]`` (fraction of
        nonzeros): rows above it go dense, rows at or below it sparse --
        except that when the only such rows are all-zero and fewer than 1/8
        of the rows, every row goes dense (cheaper than gathering the rest;
        same result). Negative or ``'auto'``: the op chooses the split with its cost model
        (``cc/core/cost_model.h``: per-call fixed, CSR-conversion,
        flop-rate and copy terms, calibrated on the first such call for
        this dtype, K and N bucket on this machine), which keeps every row
        dense unless a split is predicted at least 10% faster, and keeps its
        choice from call to call unless the timings really change. A float
        or a scalar tensor (e.g. a non-trainable variable a callback
        assigns).
      transpose_a: if True, multiply by ``a^T``.
      transpose_b: if True, multiply by ``b^T``.
      return_stats: if True, also return the per-call statistics.
      name: optional op name.
      heterogeneous: bool; if True, dense rows on the GPU and sparse rows on
        the CPU, overlapped (see above). Default False.
      masked_input_grad: bool; if True (and ``transpose_a`` is False), the
        gradient for the input ``a`` is computed only where ``a`` is
        nonzero and is 0 elsewhere: ``(a != 0) * (dY @ op(b)^T)``, by the SDDMM op
        (:func:`~tf_sparse_split.ops.sparse_split_sddmm`, cost ``nnz(a) *
        N`` instead of ``M * K * N``; CPU only: under an explicit GPU
        device, a GEMM over the live columns, then masked). This is the
        true gradient only when whatever produced ``a`` has zero gradient
        wherever ``a`` is zero -- e.g. ``a`` is a
        ReLU or FATReLU output (their gradient is 0 where the output is 0),
        possibly through dropout (dropped units get 0 from the mask),
        max-pooling or a reshape. Default False (the exact dense gradient).
      bias: optional vector ``[N]`` of the inputs' dtype added to every row
        of the product (default None: no bias).
      activation: ``None`` or ``"none"`` (default), ``"relu"`` (``max(x,
        0)``) or ``"relu6"`` (``min(max(x, 0), 6)``), applied after the bias.
        NaN stays NaN, except with a bias where TensorFlow's fused kernel is
        oneDNN's (float32; bfloat16 on CPUs that run it): its relu and relu6
        map NaN to 0, as TensorFlow's own fused graph does, and every plan
        does the same (the threshold never changes the answer).
      full_stats: bool or None. True: every call counts every value of
        ``a`` (exact statistics: what the layers ask for while their
        statistics are recorded, for ``SplitThresholdCallback``,
        ``SparsityTargetCallback`` and ``ThresholdTuner``). False: an
        automatic call may count a sample or nothing (above); its ``NNZ`` and
        ``HISTOGRAM`` are then estimates (``stats.ANALYSIS_SAMPLED``) or
        NaN / zeros (``stats.ANALYSIS_SKIPPED``). None (default): the value
        of ``return_stats``.
      grad_a_live_only: deprecated alias of ``masked_input_grad`` (same
        meaning; a ``DeprecationWarning``), removed in the next release. It
        stays the name of the op's attr, which saved graphs use.

    Returns:
      The product ``act(op(a) @ op(b) + bias)``, ``[M, N]``, of the inputs'
      dtype; with ``return_stats``, a
      tuple ``(product, stats)`` where ``stats`` is a float64 vector laid out
      as in :mod:`tf_sparse_split.tuning.stats` (rows dense/sparse, nnz, all-zero
      columns skipped, seconds in each part, threshold used, ...).

    Raises:
      tf.errors.InvalidArgumentError: for a dtype other than float32,
        float64, bfloat16 or float16, or differing between ``a`` and ``b`` (or ``bias``), a rank other than
        2, mismatched inner dimensions, a non-scalar threshold or one above 1
        or NaN, a ``bias`` that is not a vector ``[N]``.
      ValueError: an unknown ``activation``; rank/shape errors detected
        while tracing a ``tf.function`` (shape inference).
      TypeError: a non-bool ``heterogeneous`` or ``masked_input_grad``, or
        both ``masked_input_grad`` and ``grad_a_live_only`` given.
    """
    if not isinstance(heterogeneous, (bool, np.bool_)):
        raise TypeError(
            f"heterogeneous must be a bool, got {heterogeneous!r}")
    masked_input_grad = renamed_kwarg(
        "sparse_split_matmul", "grad_a_live_only", "masked_input_grad",
        grad_a_live_only, masked_input_grad, False)
    if not isinstance(masked_input_grad, (bool, np.bool_)):
        raise TypeError(
            f"masked_input_grad must be a bool, got {masked_input_grad!r}")
    heterogeneous = bool(heterogeneous)
    activation = validate_choice(
        "none" if activation is None else activation, "activation",
        ACTIVATIONS)
    lib = load_library()
    if heterogeneous:
        _warn_if_no_gpu()
    with tf.name_scope(name or "SparseSplitMatMul"):
        op = "sparse_split_matmul"
        a = float_operand(a, op, "a", MATMUL_DTYPES)
        b = operand_like(b, a, op, "b", "a")
        biases = []
        if bias is not None:
            bias = operand_like(bias, a, op, "bias", "a")
            if bias.shape.rank is not None and bias.shape.rank != 1:
                raise invalid(
                    "sparse_split_matmul: bias must be a vector [N], got "
                    f"shape {bias.shape}")
            biases = [bias]
        product, stats = lib.tf_sparse_split_sparse_split_mat_mul(
            a, b, as_threshold(threshold), biases, transpose_a=transpose_a,
            transpose_b=transpose_b, heterogeneous=heterogeneous,
            grad_a_live_only=bool(masked_input_grad), activation=activation,
            full_stats=bool(return_stats if full_stats is None else full_stats))
    return (product, stats) if return_stats else product


def _grad_a_live_columns(a, b, grad, tb):
    """dA = dY @ op(b)^T computed for the live (not all-zero) columns of
    ``a`` [M, K] only; 0 in its all-zero columns (see ``masked_input_grad``).

    The gather of op(b)'s live rows and the scatter of the result cost
    memory passes, so the smaller GEMM is used only when at least a quarter
    of the columns are dead (e.g. row dropout); otherwise the plain GEMM.
    """
    live_mask = tf.reduce_any(tf.not_equal(a, 0), axis=0)
    k = tf.shape(a, out_type=tf.int64)[1]
    m = tf.shape(a, out_type=tf.int64)[0]
    n_live = tf.reduce_sum(tf.cast(live_mask, tf.int64))

    def full():
        return tf.matmul(grad, b, transpose_b=not tb)

    def live_only():
        live = tf.where(live_mask)[:, 0]                         # [k_live]
        if tb:   # op(b) = b^T, b [N, K]: live columns of b
            g_live = tf.matmul(grad, tf.gather(b, live, axis=1))
        else:    # b [K, N]: live rows of b
            g_live = tf.matmul(grad, tf.gather(b, live, axis=0), transpose_b=True)
        grad_a_t = tf.scatter_nd(live[:, None], tf.transpose(g_live),
                                 tf.stack([k, m]))
        return tf.transpose(grad_a_t)

    return tf.cond(n_live * 4 <= k * 3, live_only, full)


#: Smallest inner dimension (columns of dY) for which the input gradient
#: runs through the sparse-split op with dY as its sparse operand: below it
#: the product is a few fixed costs, and the op's counting pass and call
#: overhead cannot be won back (the cost model would choose the dense GEMM
#: anyway). Unknown static sizes go through the op (its cost model decides).
_MIN_SPARSE_DY_COLUMNS = 64


def _dy_product(grad, b, transpose_b, hetero, transpose_out=False):
    """``dY @ op(b)`` (``^T`` with ``transpose_out``) with ``dY`` [M, N] as
    the sparse operand: dY is itself mostly zeros when the layer's output
    goes through ReLU/FATReLU or dropout (masked by the activation's
    derivative), which the op measures per call; where it does not pay, the
    cost model keeps TF's dense GEMM (same result to float rounding).
    """
    n = grad.shape[1]
    if n is not None and n < _MIN_SPARSE_DY_COLUMNS:
        if transpose_out:  # (dY op(b))^T = op(b)^T dY^T
            return tf.matmul(b, grad, transpose_a=not transpose_b,
                             transpose_b=True)
        return tf.matmul(grad, b, transpose_b=transpose_b)
    out = load_library().tf_sparse_split_sparse_split_mat_mul(
        grad, b, as_threshold(-1.0), [], transpose_b=transpose_b,
        heterogeneous=hetero, full_stats=False)[0]
    return tf.transpose(out) if transpose_out else out


def _grad_a_masked(op, a, b, grad, tb):
    """dA = (a != 0) * (dY @ op(b)^T) (``masked_input_grad``): the SDDMM op
    computes only the entries where ``a`` is nonzero, cost ``nnz(a) * N``.
    The SDDMM has no GPU kernel: an op placed on a GPU keeps the
    live-column GEMM there."""
    device = getattr(op, "device", None) or getattr(a, "device", None) or ""
    if "GPU" in device.upper():
        full = _grad_a_live_columns(a, b, grad, tb)
        return tf.where(tf.not_equal(a, 0), full, tf.zeros_like(full))
    from tf_sparse_split.ops.sddmm import sparse_split_sddmm

    return sparse_split_sddmm(a, grad, b, -1.0, transpose_b=tb,
                              full_stats=False)


def _activation_grad(activation, out, grad):
    """The incoming gradient masked by the activation's derivative, from the
    op's output: relu: ``out > 0``; relu6: ``0 < out < 6``. TF's own
    ``ReluGrad``/``Relu6Grad`` kernels on the output (one pass; a
    ``Greater`` + ``SelectV2`` pair took 3-4x as long on a 128x8x8x64
    activation): ``out > 0`` exactly where the pre-activation is, and
    ``out < 6`` where it is below 6, so the mask is the one TF's gradient
    of ``tf.nn.relu``/``relu6`` applies, with its semantics (a NaN/Inf
    incoming gradient at a masked position gives NaN).
    """
    if activation == "relu":
        return tf.raw_ops.ReluGrad(gradients=grad, features=out)
    if activation == "relu6":
        return tf.raw_ops.Relu6Grad(gradients=grad, features=out)
    return grad


@tf.RegisterGradient("TfSparseSplit>SparseSplitMatMul")
def _sparse_split_matmul_grad(op, grad, unused_grad_stats):
    """Gradients of ``act(op(a) @ op(b) + bias)``; the ``b`` gradient exploits
    a's zeros."""
    a, b, threshold = op.inputs[:3]
    has_bias = op.get_attr("num_bias") == 1
    activation = op.get_attr("activation")
    if isinstance(activation, bytes):
        activation = activation.decode()
    # d(pre-activation): the product and bias gradients start from it.
    grad = _activation_grad(activation, op.outputs[0], grad)
    grad_bias = [tf.reduce_sum(grad, axis=0)] if has_bias else []
    ta = op.get_attr("transpose_a")
    tb = op.get_attr("transpose_b")
    hetero = op.get_attr("heterogeneous")
    lib = load_library()

    def sparse(x, y, transpose_a):
        # Nothing reads the gradient products' statistics: an automatic
        # call that stays dense may skip most of its counting pass.
        return lib.tf_sparse_split_sparse_split_mat_mul(
            x, y, threshold, [], transpose_a=transpose_a,
            heterogeneous=hetero, full_stats=False)[0]

    if not ta and op.get_attr("grad_a_live_only"):
        grad_a = _grad_a_masked(op, a, b, grad, tb)
        grad_b = sparse(a, grad, True)                       # A^T dC
        if tb:
            grad_b = tf.transpose(grad_b)
    elif not ta and not tb:  # C = A B
        grad_a = _dy_product(grad, b, True, hetero)          # dC B^T
        grad_b = sparse(a, grad, True)                       # A^T dC
    elif not ta and tb:      # C = A B^T
        grad_a = _dy_product(grad, b, False, hetero)         # dC B
        grad_b = tf.transpose(sparse(a, grad, True))         # (A^T dC)^T
    elif ta and not tb:      # C = A^T B
        grad_a = _dy_product(grad, b, True, hetero, transpose_out=True)
        grad_b = sparse(a, grad, False)                      # A dC
    else:                    # C = A^T B^T
        grad_a = _dy_product(grad, b, False, hetero, transpose_out=True)
        grad_b = tf.transpose(sparse(a, grad, False))        # (A dC)^T
    return [grad_a, grad_b, None] + grad_bias
