"""``bias_fat_relu``: bias + FATReLU in one pass (the ``BiasFatRelu`` op)
and its registered gradient (``BiasFatReluGrad``, one pass)."""

import numbers

import numpy as np
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
        ``bias`` not ``[C]``, a ``cutoff`` that is negative, NaN, not a
        scalar, a bool or not a number (named ``cutoff`` when its value is
        known before the op runs; the kernel's own check of a symbolic
        tensor names the op's input, ``threshold``).
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
        t = tf.cast(_cutoff_operand(cutoff), x.dtype)
        return lib.tf_sparse_split_bias_fat_relu(x, bias, t)


def _cutoff_operand(cutoff):
    """``cutoff`` checked under its own name before the op (whose input,
    and so whose kernel's message, is named ``threshold``): a real scalar
    ``>= 0``, not NaN. A number, a numpy scalar or a tensor whose value is
    known (eager, or a constant) is checked here; a symbolic tensor's value
    by the kernel at run time (FATReLU passes its variable clamped to
    ``>= 0``).

    Raises:
      tf.errors.InvalidArgumentError: a bool, a string or other non-number,
        a non-scalar, a negative or NaN value.
    """
    msg = "bias_fat_relu: cutoff must be a real scalar >= 0 (not NaN), got"
    if isinstance(cutoff, (bool, np.bool_, str, bytes)):
        raise invalid(f"{msg} {cutoff!r}")
    if isinstance(cutoff, (numbers.Real, np.number)):
        value = float(cutoff)
        if not value >= 0.0:
            raise invalid(f"{msg} {cutoff!r}")
        return tf.constant(value)
    try:
        t = tf.convert_to_tensor(cutoff)
    except (TypeError, ValueError):
        raise invalid(f"{msg} {cutoff!r}") from None
    if not (t.dtype.is_floating or t.dtype.is_integer) or t.dtype.is_bool:
        raise invalid(f"{msg} dtype {t.dtype.name}")
    if t.shape.rank is not None and t.shape.rank != 0:
        raise invalid(f"{msg} shape {t.shape}")
    value = tf.get_static_value(t)
    if value is not None and not float(value) >= 0.0:
        raise invalid(f"{msg} {float(value)!r}")
    return t


@tf.RegisterGradient("TfSparseSplit>BiasFatRelu")
def _bias_fat_relu_grad(op, dy, dsum):
    lib = load_library()
    y = op.outputs[0]
    if dsum is None:
        dsum = tf.zeros([], y.dtype)
    dx, dbias = lib.tf_sparse_split_bias_fat_relu_grad(dy, y, dsum)
    return dx, dbias, None
