"""``sparse_split_sddmm``: the ``SparseSplitSddmm`` op wrapper (sampled
dense-dense product) and its registered gradient.

It computes the input gradient of a ``SparseSplitMatMul`` whose activation
came through a ReLU-family activation (``masked_input_grad=True``): ``dA =
(a != 0) * (dY @ op(b)^T)``, with cost proportional to ``nnz(a) * N`` instead
of ``M * K * N`` -- sparsity exploited in the gradients as well as in the
forward pass (R. Sun and L. Zhang, *Dynamic Sparse Method for Deep Learning
Execution*, 2019).
"""

import numpy as np
import tensorflow as tf

from tf_sparse_split._loader import load_library
from tf_sparse_split.ops._common import (MATMUL_DTYPES, as_threshold,
                                         float_operand,
                                         operand_like)

__all__ = ["sparse_split_sddmm"]


def sparse_split_sddmm(mask, x, b, threshold=-1.0, transpose_b=False,
                       return_stats=False, name=None, full_stats=None):
    """``(x @ op(b)^T)`` restricted to the nonzeros of ``mask`` (SDDMM).

    ``product[i, j] = dot(x[i, :], op(b)[j, :])`` where ``mask[i, j] != 0``,
    else 0. The rows of ``mask`` whose density (fraction of nonzeros) is
    above ``threshold`` are computed by TensorFlow's own GEMM (on those rows
    of ``x``) and then masked; the others by a CSR SDDMM that walks the
    nonzeros of ``mask`` column by column (one dot of length ``N`` per
    nonzero, each row of ``op(b)`` read once). The result is the same to
    float rounding at any threshold. The sparse rows' bits do not depend
    on the thread count; the dense rows' are TensorFlow's GEMM's, whose
    summation order may.

    Args:
      mask: float32, float64, bfloat16 or float16 tensor ``[M, K]``; only
        its zero pattern is used (NaN/Inf count as nonzero). In the 16-bit
        dtypes each dot is accumulated in float32 and rounded once; in
        bfloat16 on CPUs with AVX512_BF16 the sparse rows' dots use
        ``vdpbf16ps``, which flushes float32 denormal inputs, products and
        partial sums to zero.
      x: tensor of the same dtype, ``[M, N]``.
      b: tensor of the same dtype, ``[K, N]`` (``[N, K]`` if
        ``transpose_b``); ``op(b)`` is ``[K, N]``.
      threshold: scalar row-density threshold in ``[0, 1]`` on the rows of
        ``mask``, or negative (default) or ``'auto'``: chosen per call by the cost model
        (``cc/core/cost_model.h``, calibrated on the first such call for
        this dtype, K and N bucket), which keeps the dense GEMM unless the
        SDDMM is predicted at least 10% faster. A float or a scalar tensor.
      transpose_b: if True, ``b`` is ``[N, K]`` and ``op(b) = b^T``.
      return_stats: if True, also return the per-call statistics (layout of
        :mod:`tf_sparse_split.tuning.stats`; the split of the mask's rows).
      name: optional op name.
      full_stats: bool or None. True: every call counts every value of
        ``mask`` (exact statistics). False: an automatic call that the cost
        model keeps on the GEMM may count a strided sample of the mask's
        rows or nothing (see :func:`~tf_sparse_split.ops.sparse_split_matmul`);
        its ``NNZ`` and ``HISTOGRAM`` are then estimates or NaN / zeros,
        flagged in the ``ANALYSIS`` entry. None (default): the value of
        ``return_stats``.

    Returns:
      ``[M, K]`` tensor of the inputs' dtype; with ``return_stats``, a tuple
      ``(product, stats)``.

    Raises:
      tf.errors.InvalidArgumentError: a dtype other than float32, float64,
        bfloat16 or float16, or differing between the inputs, a rank other than 2, sizes that do not
        match (``mask [M, K]``, ``x [M, N]``, ``op(b) [K, N]``), a
        non-scalar threshold or one above 1 or NaN.
      TypeError: ``transpose_b`` not a bool.
      ValueError: rank/shape errors detected while tracing a
        ``tf.function`` (shape inference).
    """
    lib = load_library()
    with tf.name_scope(name or "SparseSplitSddmm"):
        op = "sparse_split_sddmm"
        mask = float_operand(mask, op, "mask", MATMUL_DTYPES)
        x = operand_like(x, mask, op, "x", "mask")
        b = operand_like(b, mask, op, "b", "mask")
        # As sparse_split_matmul's transposes: a bool, not any truthy value
        # (bool("no") is True).
        if not isinstance(transpose_b, (bool, np.bool_)):
            raise TypeError(f"{op}: transpose_b must be a bool, got "
                            f"{transpose_b!r}")
        product, stats = lib.tf_sparse_split_sparse_split_sddmm(
            mask, x, b, as_threshold(threshold), transpose_b=bool(transpose_b),
            full_stats=bool(return_stats if full_stats is None else full_stats))
    return (product, stats) if return_stats else product


@tf.RegisterGradient("TfSparseSplit>SparseSplitSddmm")
def _sparse_split_sddmm_grad(op, grad, unused_grad_stats):
    """Gradients of ``(mask != 0) * (x @ op(b)^T)`` for ``x`` and ``b`` (the
    mask's pattern has none): with ``g = (mask != 0) * grad``,
    ``dx = g @ op(b)`` and ``d op(b) = g^T @ x``."""
    mask, x, b = op.inputs[:3]
    g = tf.where(tf.not_equal(mask, 0), grad, tf.zeros_like(grad))
    tb = op.get_attr("transpose_b")
    grad_x = tf.matmul(g, b, transpose_b=tb)
    grad_b = (tf.matmul(x, g, transpose_a=True) if tb
              else tf.matmul(g, x, transpose_a=True))
    return [None, grad_x, grad_b, None]
