"""The recurrence of :class:`~tf_sparse_split.layers.SparseSplitLSTM`'s
own training loop (compacted or masked products): the forward loop over
time steps (fused ``LstmGates`` ops on the CPU, TensorFlow ops where a GPU
is visible) and its backward pass written out by hand, plus the per-group
GEMM and column gathers it runs on.

The layout is grouped: ``G`` groups of consecutive examples, each with its
own compacted recurrent kernel (the rows of the units its recurrent mask
keeps), so every step is one batched GEMM over the groups. The backward
pass is written out so that the recurrent weight gradient is one GEMM over
all steps (TensorFlow's differentiated while loop would accumulate a
``[groups, k, 4*units]`` gradient in every step). Approximate random
dropout after Z. Song et al., *DNN Training Acceleration via Exploring
GPGPU Friendly Sparsity*, arXiv 2203.05705.

Requires the TensorFlow backend of Keras 3.
"""

import keras  # noqa: F401
import tensorflow as tf

from tf_sparse_split.ops.lstm_gates import lstm_gates, lstm_gates_grad

def _recurrence(zx, h0, c0, r, k, hmask, act, rec_act, keep_all, units):
    """The LSTM recurrence of the own loop, in grouped layout.

    Per step ``t``: ``z = zx[:, t] + (h[..., :k] * hmask) @ r`` (per group;
    gates in the order i, f, o, c), ``c = f * c + i * act(c~)``,
    ``h = o * act(c)``.

    Args:
      zx: ``[G, T, R, 4U]`` input products (bias included), group-major
        (the layout of the batched input GEMM).
      h0, c0: ``[G, R, U]`` initial state.
      r: ``[G or 1, k, 4U]`` compacted recurrent kernel.
      k: number of leading state units multiplied (int or int32 scalar;
        None: all, with tile masks).
      hmask: None, a ``[G, R, k]`` per-example mask of the kept units
        (subsets with ``recurrent_group_share < 1``) or a ``[1, R, U]``
        tile mask applied to h (``k`` None).
      act, rec_act: the cell's activations.
      keep_all: also return the states of all steps.
      units: U.

    Returns:
      ``(h_T, c_T, hs)``: ``hs`` ``[T, G, R, U]`` if ``keep_all``, else None.

    With Keras' default activations (tanh, sigmoid) each step's gate math is
    one fused op (:func:`~tf_sparse_split.ops.lstm_gates`) and the backward
    pass is written out (``_lstm_backward``: one fused op
    :func:`~tf_sparse_split.ops.lstm_gates_grad` per step, and the
    recurrent weight gradient as one batched GEMM over all steps instead of
    a ``[k, 4U]`` per-group accumulation in every step of TensorFlow's
    differentiated while loop); otherwise TensorFlow differentiates the
    loop of elementwise ops.
    """
    manual = (act is keras.activations.tanh
              and rec_act is keras.activations.sigmoid)
    if not manual:
        return _generic_recurrence(zx, h0, c0, r, k, hmask, act, rec_act,
                                   keep_all, units)

    @tf.custom_gradient
    def run(zx, h0, c0, r):
        h, c, hs, saved_ta = _fused_forward(zx, h0, c0, r, k, hmask)

        def grad(*upstream):
            return _lstm_backward(upstream, zx, h0, hs, r, k, hmask, saved_ta,
                                  keep_all)

        return (h, c, hs) if keep_all else (h, c), grad

    out = run(zx, h0, c0, r)
    return (out[0], out[1], out[2] if keep_all else None)


def _step_input(h, k, hmask):
    """The part of the state that enters the recurrent product:
    ``h[..., :k]`` (subsets, row patterns), ``h[..., :k] * hmask``
    (subsets with per-example masks on the kept units, ``hmask`` ``[G, R,
    k]``) or ``h * hmask`` (tile masks, ``k`` = None)."""
    if k is None:
        return h * hmask
    return h[..., :k] if hmask is None else h[..., :k] * hmask


def _gates_ops():
    """``(gates, gates_grad)`` with the signatures of :func:`lstm_gates` and
    :func:`lstm_gates_grad`: the fused ops (CPU kernels only), or the same
    math in TensorFlow elementwise ops when a GPU is visible (the fused ops
    would copy every step's tensors between the devices)."""
    if tf.config.list_logical_devices("GPU"):
        return _tf_gates, _tf_gates_grad
    return lstm_gates, lstm_gates_grad


def _tf_gates(zx, zh, c_prev):
    """:func:`lstm_gates` in TensorFlow ops."""
    units = tf.shape(c_prev)[-1]
    z = zx + zh
    sig = tf.sigmoid(z[..., :3 * units])
    cand = tf.tanh(z[..., 3 * units:])
    i, f, o = tf.split(sig, 3, axis=-1)
    c = f * c_prev + i * cand
    tc = tf.tanh(c)
    return o * tc, c, tf.concat([sig, cand, tc, c_prev], -1)


def _tf_gates_grad(saved, dh_rec, dh_out, dc):
    """:func:`lstm_gates_grad` in TensorFlow ops."""
    i, f, o, cand, tc, c_prev = tf.split(saved, 6, axis=-1)
    pad = tf.shape(dh_out)[-1] - tf.shape(dh_rec)[-1]
    dh = dh_out + tf.pad(dh_rec, [[0, 0]] * (dh_rec.shape.rank - 1)
                         + [[0, pad]])
    dc = dc + dh * o * (1.0 - tc * tc)
    dz = tf.concat([dc * cand * i * (1.0 - i), dc * c_prev * f * (1.0 - f),
                    dh * tc * o * (1.0 - o), dc * i * (1.0 - cand * cand)],
                   -1)
    return dz, dc * f


def _fused_forward(zx, h0, c0, r, k, hmask):
    """Forward loop with the fused gate op: per step one gather of
    ``zx[:, t]``, one slice, one GEMM, one :func:`lstm_gates` and two
    TensorArray writes. Returns ``(h_T, c_T, hs [T, G, R, U], saved_ta)``;
    ``saved_ta`` holds each step's ``saved`` output for the backward pass.
    (TensorFlow does not differentiate this loop, so reading ``zx[:, t]``
    in it costs no full-size gradient per step, and ``zx`` needs no
    transpose to time-major.)"""
    steps = tf.shape(zx)[1]
    hs_ta = tf.TensorArray(zx.dtype, size=steps)
    saved_ta = tf.TensorArray(zx.dtype, size=steps)
    gates = _gates_ops()[0]

    def body(t, h, c, hs_ta, saved_ta):
        zh = _grouped_matmul(_step_input(h, k, hmask), r)
        h, c, saved = gates(tf.gather(zx, t, axis=1), zh, c)
        return t + 1, h, c, hs_ta.write(t, h), saved_ta.write(t, saved)

    _, h, c, hs_ta, saved_ta = tf.while_loop(
        lambda t, *_: t < steps, body, (tf.constant(0), h0, c0, hs_ta,
                                         saved_ta),
        maximum_iterations=steps)
    return h, c, hs_ta.stack(), saved_ta


def _generic_recurrence(zx, h0, c0, r, k, hmask, act, rec_act, keep_all,
                        units):
    """:func:`_recurrence` for other activations: elementwise TF ops,
    differentiated by TensorFlow."""
    steps = tf.shape(zx)[1]
    # Read per step from a TensorArray: slicing the [G, T, ...] tensor
    # inside the differentiated loop would make every step's gradient a
    # full-size tensor (O(T^2) memory traffic in the backward pass).
    zx_ta = tf.TensorArray(zx.dtype, size=steps).unstack(
        tf.transpose(zx, [1, 0, 2, 3]))
    hs_ta = tf.TensorArray(zx.dtype, size=steps)

    def body(t, h, c, hs_ta):
        z = zx_ta.read(t) + _grouped_matmul(_step_input(h, k, hmask), r)
        i, f, o = tf.split(rec_act(z[..., :3 * units]), 3, axis=-1)
        c = f * c + i * act(z[..., 3 * units:])
        h = o * act(c)
        if keep_all:
            hs_ta = hs_ta.write(t, h)
        return t + 1, h, c, hs_ta

    _, h, c, hs_ta = tf.while_loop(
        lambda t, *_: t < steps, body, (tf.constant(0), h0, c0, hs_ta),
        maximum_iterations=steps)
    return h, c, hs_ta.stack() if keep_all else None


def _lstm_backward(upstream, zx, h0, hs, r, k, hmask, saved_ta, keep_all):
    """Gradients ``(d zx, d h0, d c0, d r)`` of :func:`_recurrence` (tanh
    and sigmoid activations) from the upstream gradients of its outputs
    ``(h_T, c_T[, hs])`` (None = zero); ``hs`` and ``saved_ta`` come from
    :func:`_fused_forward`.

    Per step (backwards): one TensorArray read of ``saved`` (and one of the
    output gradient with ``keep_all``), one :func:`lstm_gates_grad` (which
    takes the recurrent product's ``[G, R, k]`` input gradient as is, no
    padding to ``U``), one TensorArray write and one GEMM."""
    steps = tf.shape(zx)[1]
    zeros = tf.zeros_like(h0)
    d_h = zeros if upstream[0] is None else upstream[0]
    d_c = zeros if upstream[1] is None else upstream[1]
    d_hs = upstream[2] if keep_all else None
    if d_hs is not None:
        d_hs_ta = tf.TensorArray(zx.dtype, size=steps).unstack(d_hs)
    dz_ta = tf.TensorArray(zx.dtype, size=steps)
    gates_grad = _gates_ops()[1]

    def body(t, dh_rec, dc, dz_ta):
        dh_out = zeros if d_hs is None else d_hs_ta.read(t)
        dz, dc = gates_grad(saved_ta.read(t), dh_rec, dh_out, dc)
        dhk = _grouped_matmul(dz, r, transpose_b=True)       # [G, R, k]
        dh_rec = dhk if hmask is None else dhk * hmask
        return t - 1, dh_rec, dc, dz_ta.write(t, dz)

    # The first step's dh_rec is the upstream gradient of h_T (all U
    # units); later ones are k wide.
    _, dh0, dc0, dz_ta = tf.while_loop(
        lambda t, *_: t >= 0, body, (steps - 1, d_h, d_c, dz_ta),
        shape_invariants=(tf.TensorShape([]),
                          d_h.shape[:-1].concatenate([None]),
                          d_c.shape, tf.TensorShape(None)),
        maximum_iterations=steps)
    if k is not None:   # d h0 from the last GEMM is k wide
        dh0 = tf.pad(dh0, [[0, 0], [0, 0], [0, tf.shape(d_h)[-1]
                                              - tf.shape(dh0)[-1]]])
        dh0.set_shape(d_h.shape)
    dz = tf.transpose(dz_ta.stack(), [1, 0, 2, 3])           # [G, T, R, 4U]
    # The recurrent products' inputs of all steps (h_{t-1}), group-major.
    hk = tf.transpose(
        _step_input(tf.concat([h0[None], hs[:-1]], 0), k, hmask),
        [1, 0, 2, 3])                                         # [G, T, R, k]
    # Recurrent weight gradient: one GEMM over all steps (per group).
    n_k, units4 = tf.shape(hk)[-1], tf.shape(dz)[-1]
    if r.shape[0] == 1:
        d_r = tf.matmul(tf.reshape(hk, [-1, n_k]),
                        tf.reshape(dz, [-1, units4]),
                        transpose_a=True)[None]
    else:
        d_r = tf.matmul(tf.reshape(hk, [r.shape[0], -1, n_k]),
                        tf.reshape(dz, [r.shape[0], -1, units4]),
                        transpose_a=True)
    return dz, dh0, dc0, d_r


def _grouped_matmul(a, w, transpose_b=False):
    """``a`` [G, ..., K] times ``w`` [G, K, N] (per group) or [1, K, N]
    (shared: one 2-D GEMM) -> [G, ..., N] (``transpose_b``: ``w`` is
    [G or 1, N, K]). No broadcasting batch matmul: a rank-4 by rank-3
    broadcasting BatchMatMulV2 corrupted the heap in TF 2.21 tests."""
    if a.shape.rank == 3 and w.shape[0] is not None and \
            w.shape[0] == a.shape[0]:   # same batch: no reshapes needed
        return tf.matmul(a, w, transpose_b=transpose_b)
    shape = tf.shape(a)
    a3 = tf.reshape(a, [shape[0] if w.shape[0] != 1 else 1, -1, shape[-1]])
    if w.shape[0] == 1:
        out = tf.matmul(a3[0], w[0], transpose_b=transpose_b)
    else:
        out = tf.matmul(a3, w, transpose_b=transpose_b)
    n = tf.shape(w)[-2] if transpose_b else tf.shape(w)[-1]
    return tf.reshape(out, tf.concat([shape[:-1], [n]], 0))


def _gather_cols(w, cols):
    """``w`` [Gw, K, 4U] with its last axis permuted per group by ``cols``
    [Gc, 4U] (Gw, Gc each 1 or G) -> [max(Gw, Gc), K, 4U]."""
    if cols.shape[0] == 1:
        return tf.gather(w, cols[0], axis=2)
    if w.shape[0] == 1:
        w = tf.broadcast_to(w, tf.concat([tf.shape(cols)[:1],
                                          tf.shape(w)[1:]], 0))
    return tf.gather(w, cols, axis=2, batch_dims=1)
