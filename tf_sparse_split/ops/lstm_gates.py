"""``lstm_gates`` / ``lstm_gates_grad``: one LSTM time step's gate math as
one op each way (``LstmGates`` / ``LstmGatesGrad``, cc/ops/lstm_gates_ops.cc).

The per-step loop of :class:`~tf_sparse_split.SparseSplitLSTM` runs these
instead of about ten small TensorFlow ops per step forward and twenty
backward, whose executor overhead outweighs their arithmetic at LSTM sizes.
Gate order along the last axis: input, forget, output, candidate (i, f, o,
g); sigmoid gates and tanh activations (Keras' defaults).

Dtypes: float32, float64, bfloat16 and float16 (one dtype for all inputs
and outputs). bfloat16/float16 are storage only: the kernels widen each row
to float32, compute the whole step in float32 and round every output once
to the input dtype (round-to-nearest-even), where Keras' LSTM cell under a
``mixed_bfloat16``/``mixed_float16`` policy rounds after each elementwise
op; the two agree within the dtype's precision (relative error about
``2**-8`` for bfloat16, ``2**-11`` for float16, per op).
"""

import tensorflow as tf

from tf_sparse_split._loader import load_library
from tf_sparse_split.ops._common import invalid

__all__ = ["lstm_gates", "lstm_gates_grad", "LSTM_GATES_DTYPES"]

#: The dtypes the gate ops take (the kernels' ``T``).
LSTM_GATES_DTYPES = (tf.float32, tf.float64, tf.bfloat16, tf.float16)


def _same_dtype(what, tensors):
    dtype = tensors[0].dtype
    if dtype not in LSTM_GATES_DTYPES:
        raise invalid(f"{what}: inputs must be float32, float64, bfloat16 "
                      f"or float16, got {dtype.name}")
    for t in tensors[1:]:
        if t.dtype != dtype:
            raise invalid(f"{what}: all inputs must have one dtype, got "
                          f"{dtype.name} and {t.dtype.name}")


def lstm_gates(zx, zh, c_prev, name=None):
    """One LSTM step from its pre-activations: ``(h, c, saved)``.

    With ``z = zx + zh = (z_i, z_f, z_o, z_g)`` (each ``units`` wide):
    ``c = sigmoid(z_f) * c_prev + sigmoid(z_i) * tanh(z_g)``,
    ``h = sigmoid(z_o) * tanh(c)``. Rows (leading dimensions) are
    independent; the bits do not depend on the thread count.

    Args:
      zx, zh: float32/float64/bfloat16/float16 tensors ``[..., 4 * units]``
        (e.g. the input and the recurrent product plus bias), same shape
        and dtype.
      c_prev: ``[..., units]`` previous cell state.
      name: optional op name.

    Returns:
      ``h`` and ``c`` ``[..., units]``, and ``saved`` ``[..., 6 * units]`` =
      ``(sigmoid(z_i), sigmoid(z_f), sigmoid(z_o), tanh(z_g), tanh(c),
      c_prev)`` along the last axis, the input of :func:`lstm_gates_grad`
      (in float32/float64 ``h`` equals ``saved[..., 2u:3u] * saved[...,
      4u:5u]`` bit for bit; in bfloat16/float16 ``h`` is rounded once from
      the float32 product, the saved factors are rounded separately).
      All outputs have the inputs' dtype.
      The registered gradient propagates the gradients of ``h`` and ``c``;
      ``saved`` is treated as having none.

    Raises:
      tf.errors.InvalidArgumentError: a dtype other than float32, float64,
        bfloat16 or float16, or differing between the inputs, ``zh`` not shaped like ``zx``, a last
        dimension of ``zx`` not a multiple of 4, ``c_prev`` not
        ``[..., units]`` with ``zx``'s leading dimensions.
      ValueError: shape errors detected while tracing (shape inference).
    """
    lib = load_library()
    with tf.name_scope(name or "LstmGates"):
        ts = [tf.convert_to_tensor(t) for t in (zx, zh, c_prev)]
        _same_dtype("lstm_gates", ts)
        return lib.tf_sparse_split_lstm_gates(*ts)


def lstm_gates_grad(saved, dh_rec, dh_out, dc, name=None):
    """Gradient of :func:`lstm_gates`: ``(dz, dc_prev)``.

    Args:
      saved: ``[..., 6 * units]``, the ``saved`` output of
        :func:`lstm_gates`.
      dh_rec: ``[..., k]``, ``0 <= k <= units``: gradient of ``h`` on its
        first ``k`` units (the others get none from it); e.g. the input
        gradient of a recurrent product that only the first ``k`` units
        enter.
      dh_out: ``[..., units]`` further gradient of ``h``.
      dc: ``[..., units]`` gradient of ``c``.
      name: optional op name.

    Returns:
      ``dz`` ``[..., 4 * units]``, the gradient of ``zx`` (and of ``zh``),
      and ``dc_prev`` ``[..., units]``, the gradient of ``c_prev``.

    Raises:
      tf.errors.InvalidArgumentError: dtypes as in :func:`lstm_gates`, a
        last dimension of ``saved`` not a multiple of 6, ``dh_out``/``dc``
        not ``[..., units]``, ``dh_rec`` with other leading dimensions or
        more than ``units`` columns.
      ValueError: shape errors detected while tracing (shape inference).
    """
    lib = load_library()
    with tf.name_scope(name or "LstmGatesGrad"):
        ts = [tf.convert_to_tensor(t) for t in (saved, dh_rec, dh_out, dc)]
        _same_dtype("lstm_gates_grad", ts)
        return lib.tf_sparse_split_lstm_gates_grad(*ts)


@tf.RegisterGradient("TfSparseSplit>LstmGates")
def _lstm_gates_grad(op, grad_h, grad_c, unused_grad_saved):
    saved = op.outputs[2]
    zeros = tf.zeros_like(op.inputs[2])
    dh = zeros if grad_h is None else grad_h
    dc = zeros if grad_c is None else grad_c
    dz, dc_prev = lstm_gates_grad(saved, zeros[..., :0], dh, dc)
    return [dz, dz, dc_prev]
