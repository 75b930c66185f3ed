"""Pure-TensorFlow references used as test oracles for the sparse-split ops."""

import numpy as np
import tensorflow as tf


def reference_matmul(a, b, transpose_a=False, transpose_b=False):
    """``op(a) @ op(b)`` computed by ``tf.matmul`` in float64.

    Args:
      a, b: array-likes (any float dtype), shapes as for ``tf.matmul``.

    Returns:
      float64 numpy array ``[M, N]``.
    """
    a64 = tf.cast(tf.convert_to_tensor(a), tf.float64)
    b64 = tf.cast(tf.convert_to_tensor(b), tf.float64)
    return tf.matmul(a64, b64, transpose_a=transpose_a, transpose_b=transpose_b).numpy()


def random_sparse(shape, sparsity, rng, dtype=np.float32, structure="uniform"):
    """A random matrix with (about) the given fraction of exact zeros.

    Args:
      shape: ``(rows, cols)``.
      sparsity: fraction of zeros in ``[0, 1]``.
      rng: ``numpy.random.Generator``.
      dtype: numpy dtype.
      structure: ``"uniform"`` (each entry zero independently) or ``"rows"``
        (whole rows zero, the rest dense) or ``"columns"`` (whole columns).

    Returns:
      numpy array of ``shape``; nonzeros are uniform in ``[-1, -0.1] U [0.1, 1]``
      so they are never accidentally zero.
    """
    rows, cols = shape
    vals = rng.uniform(0.1, 1.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    if structure == "uniform":
        keep = rng.random(shape) >= sparsity
    elif structure == "rows":
        keep = np.repeat((rng.random((rows, 1)) >= sparsity), cols, axis=1)
    elif structure == "columns":
        keep = np.repeat((rng.random((1, cols)) >= sparsity), rows, axis=0)
    else:
        raise ValueError(f"unknown structure {structure!r}")
    return (vals * keep).astype(dtype)


def relative_error(x, ref):
    """max |x - ref| / max(|ref|max, tiny): one number for a whole tensor."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if ref.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    return float(np.max(np.abs(x - ref))) / scale
