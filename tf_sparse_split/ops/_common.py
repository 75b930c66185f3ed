"""Helpers shared by the op wrappers (dtype list, errors, the threshold
operand)."""

import numbers

import numpy as np
import tensorflow as tf

from tf_sparse_split.utils.validation import validate_threshold

FLOAT_DTYPES = (tf.float32, tf.float64)
#: The dtypes of the matmul, SDDMM and FATReLU ops: float32/float64 and the
#: 16-bit storage types (accumulated in float32, rounded once to the dtype).
LOW_PRECISION_DTYPES = (tf.bfloat16, tf.float16)
MATMUL_DTYPES = FLOAT_DTYPES + LOW_PRECISION_DTYPES


def _names(dtypes):
    """``"float32 or float64"``, plus ``" (or the 16-bit bfloat16 or
    float16)"`` for the dtypes that include them."""
    base = " or ".join(d.name for d in dtypes if d in FLOAT_DTYPES)
    low = [d.name for d in dtypes if d in LOW_PRECISION_DTYPES]
    return base + (f" (or the 16-bit {' or '.join(low)})" if low else "")


def invalid(msg):
    """A ``tf.errors.InvalidArgumentError`` with ``msg`` (what the op
    kernels raise for bad inputs, so the wrappers raise the same type)."""
    return tf.errors.InvalidArgumentError(None, None, msg)


def _refuse_sparse(value, op, name):
    """A ``tf.SparseTensor`` / ``tf.RaggedTensor`` operand: a one-line
    error (``convert_to_tensor``'s prints the whole tensor). The ops take
    dense tensors and find the zeros themselves."""
    if isinstance(value, (tf.SparseTensor, tf.RaggedTensor)):
        raise invalid(
            f"{op}: {name} must be a dense tensor, got a "
            f"{type(value).__name__} of shape {value.shape}; the op finds "
            "the zeros itself: pass tf.sparse.to_dense(...) "
            "(SparseSplitDense takes SparseTensor inputs)")


def float_operand(value, op, name, dtypes=FLOAT_DTYPES):
    """``value`` as a tensor, whose dtype must be one of ``dtypes``
    (default float32 or float64; the matmul, SDDMM and FATReLU wrappers pass
    :data:`MATMUL_DTYPES`, which adds bfloat16 and float16).

    Raises:
      tf.errors.InvalidArgumentError: ``"{op}: {name} must be float32 or
        float64, got ..."`` (with ``" (or the 16-bit bfloat16 or float16)"``
        where those are allowed).
    """
    if value is None:   # convert_to_tensor's message names no argument
        raise invalid(f"{op}: {name} must be a {_names(dtypes)} tensor, "
                      "got None")
    _refuse_sparse(value, op, name)
    t = tf.convert_to_tensor(value)
    if t.dtype not in dtypes:
        raise invalid(f"{op}: {name} must be {_names(dtypes)}, got "
                      f"{t.dtype.name}")
    return t


def operand_like(value, ref, op, name, ref_name):
    """``value`` as a tensor of ``ref``'s dtype: arrays and tensors keep
    their own dtype (a mismatch is an error, not a silent cast); Python
    lists and scalars take ``ref``'s dtype.

    Raises:
      tf.errors.InvalidArgumentError: ``"{op}: {name} has dtype ... but
        {ref_name} has ..."``.
    """
    if value is None:
        raise invalid(f"{op}: {name} must be a tensor of {ref_name}'s dtype "
                      f"{ref.dtype.name}, got None")
    _refuse_sparse(value, op, name)
    t = (tf.convert_to_tensor(value) if hasattr(value, "dtype")
         else tf.convert_to_tensor(value, dtype_hint=ref.dtype))
    if t.dtype != ref.dtype:
        raise invalid(f"{op}: {name} has dtype {t.dtype.name} but {ref_name} "
                      f"has {ref.dtype.name}")
    return t


def as_threshold(threshold):
    """The ``threshold`` operand of an op as a float32 scalar tensor.

    A Python or numpy number is checked with
    :func:`~tf_sparse_split.utils.validation.validate_threshold` (``'auto'``
    or a negative number: automatic, passed as -1.0); a tensor or
    variable (e.g. a layer's ``threshold_var``) is only checked for a real
    dtype here, its value by the op kernel.

    Raises:
      tf.errors.InvalidArgumentError: a non-numeric threshold (a string
        other than ``'auto'``), one above 1 or NaN.
    """
    if threshold is None or isinstance(threshold, (str, bytes, bool, np.bool_,
                                                   numbers.Number)):
        try:
            threshold = validate_threshold(threshold)
        except ValueError as e:
            raise invalid(str(e)) from None
    t = tf.convert_to_tensor(threshold)
    if not t.dtype.is_floating and not t.dtype.is_integer:
        raise invalid(f"threshold must be a real number, got dtype {t.dtype.name}")
    return tf.cast(t, tf.float32)
