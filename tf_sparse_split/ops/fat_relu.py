"""``bias_fat_relu``: bias + FATReLU in one pass (the ``BiasFatRelu`` op)
and its registered gradient (``BiasFatReluGrad``, one pass)."""

import tensorflow as tf

from tf_sparse_split._loader import load_library
from tf_sparse_split.ops._common import MATMUL_DTYPES, float_operand, invalid
from tf_sparse_split.utils.deprecation import renamed_kwarg

__all__ = ["bias_fat_relu"]


def bias_fat_relu(x, bias, cutoff=None, name=None, threshold=None):
    """``y = where(x + bias > cutoff, x + bias, 0)`` and ``sum(y)``.

    One pass over ``x`` on the CPU (TensorFlow's graph for the same runs
    BiasAdd, Greater, SelectV2 and Sum); the gradient is one pass too:
    ``dx = (y > 0) ? dy + dsum : 0`` and ``dbias`` its sum over all
    dimensions but the last (``cutoff`` gets none). Deterministic (fixed
    blocks, whatever the thread count). A NaN ``x + bias`` gives 0.

    Args:
      x: float32, float64, bfloat16 or float16 tensor ``[..., C]`` (e.g.
        NHWC convolution output). In the 16-bit dtypes ``x + bias`` is
        rounded once to the dtype (as ``tf.nn.bias_add``) before the
        comparison, and the sums (``sum``, the gradient's ``dbias``) are
        accumulated in float32 and rounded once.
      bias: tensor ``[C]`` of the same dtype.
      cutoff: scalar ``>= 0`` (cast to x's dtype): the FATReLU cutoff
        (Kurtz et al., ICML 2020: the forced activation threshold).
      name: optional op name.
      threshold: deprecated alias of ``cutoff`` (same meaning; a
        ``DeprecationWarning``), removed in the next release. It stays the
        name of the op's input, which saved graphs use.

    Returns:
      ``(y, sum)``: ``y`` of x's shape and dtype, ``sum`` a scalar of x's
      dtype (the sum of ``y``, e.g. for an L1 activity penalty).

    Raises:
      tf.errors.InvalidArgumentError: dtype not float32, float64, bfloat16
        or float16, or differing,
        ``bias`` not ``[C]``, a cutoff that is negative, NaN or not a
        scalar.
      TypeError: no ``cutoff`` given, or both ``cutoff`` and ``threshold``.
    """
    cutoff = renamed_kwarg("bias_fat_relu", "threshold", "cutoff", threshold,
                           cutoff, None)
    if cutoff is None:
        raise TypeError("bias_fat_relu: missing the argument `cutoff`")
    lib = load_library()
    with tf.name_scope(name or "BiasFatRelu"):
        x = float_operand(x, "bias_fat_relu", "x", MATMUL_DTYPES)
        bias = tf.convert_to_tensor(bias)
        if bias.dtype != x.dtype:
            raise invalid(f"bias_fat_relu: bias has dtype {bias.dtype.name} "
                          f"but x has {x.dtype.name}")
        t = tf.cast(tf.convert_to_tensor(cutoff), x.dtype)
        return lib.tf_sparse_split_bias_fat_relu(x, bias, t)


@tf.RegisterGradient("TfSparseSplit>BiasFatRelu")
def _bias_fat_relu_grad(op, dy, dsum):
    lib = load_library()
    y = op.outputs[0]
    if dsum is None:
        dsum = tf.zeros([], y.dtype)
    dx, dbias = lib.tf_sparse_split_bias_fat_relu_grad(dy, y, dsum)
    return dx, dbias, None
