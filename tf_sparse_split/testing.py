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


def _conv_padding(size, k, stride, dilation, padding, explicit):
    """(pad_before, pad_after, out) of one spatial dimension, as TF computes
    them (explicit = (before, after) for EXPLICIT)."""
    ek = (k - 1) * dilation + 1
    if padding == "SAME":
        out = -(-size // stride)
        total = max((out - 1) * stride + ek - size, 0)
        return total // 2, total - total // 2, out
    before, after = explicit if padding == "EXPLICIT" else (0, 0)
    out = (size + before + after - ek) // stride + 1
    return before, after, out


def _patches(x64, kh, kw, strides, padding, dilations, explicit_paddings):
    """im2col of the NHWC float64 x: ``[N, OH, OW, KH*KW*C_in]`` (kh, kw, c
    order), by explicit zero padding and ``tf.image.extract_patches``."""
    sh, sw = strides
    dh, dw = dilations
    ep = list(explicit_paddings or [0] * 8)
    pt, pb, _ = _conv_padding(int(x64.shape[1]), kh, sh, dh, padding, ep[2:4])
    pl, pr, _ = _conv_padding(int(x64.shape[2]), kw, sw, dw, padding, ep[4:6])
    xp = tf.pad(x64, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
    return tf.image.extract_patches(
        xp, sizes=[1, kh, kw, 1], strides=[1, sh, sw, 1],
        rates=[1, dh, dw, 1], padding="VALID")


def _pair(v, name):
    if isinstance(v, int):
        return v, v
    v = list(v)
    if len(v) == 2:
        return int(v[0]), int(v[1])
    if len(v) == 4:
        return int(v[1]), int(v[2])
    raise ValueError(f"{name} must be an int, 2 or 4 ints, got {v!r}")


def reference_conv2d(x, filters, strides=1, padding="VALID", dilations=1,
                     explicit_paddings=None):
    """``tf.nn.conv2d`` (NHWC, HWIO) in float64 without any convolution
    kernel: explicit zero padding, ``tf.image.extract_patches`` (im2col) and
    a matrix product. Same argument conventions as ``tf.nn.conv2d``
    (``explicit_paddings`` is the flat list of 8 used with
    ``padding="EXPLICIT"``).

    Returns:
      float64 numpy array ``[N, OH, OW, C_out]``.
    """
    x64 = tf.cast(tf.convert_to_tensor(x), tf.float64)
    f64 = tf.cast(tf.convert_to_tensor(filters), tf.float64)
    kh, kw, ci, co = (int(d) for d in f64.shape)
    p = _patches(x64, kh, kw, _pair(strides, "strides"), padding,
                 _pair(dilations, "dilations"), explicit_paddings)
    return tf.einsum("nhwk,ko->nhwo", p,
                     tf.reshape(f64, [kh * kw * ci, co])).numpy()


def reference_conv2d_filter_grad(x, filter_shape, dy, strides=1,
                                 padding="VALID", dilations=1,
                                 explicit_paddings=None):
    """Filter gradient of :func:`reference_conv2d`, ``sum x (*) dy``, in
    float64 from im2col patches (works for every dilation, unlike TF's CPU
    float64 ``Conv2DBackpropFilter``).

    Returns:
      float64 numpy array of ``filter_shape`` ``[KH, KW, C_in, C_out]``.
    """
    x64 = tf.cast(tf.convert_to_tensor(x), tf.float64)
    dy64 = tf.cast(tf.convert_to_tensor(dy), tf.float64)
    kh, kw, ci, co = (int(d) for d in filter_shape)
    p = _patches(x64, kh, kw, _pair(strides, "strides"), padding,
                 _pair(dilations, "dilations"), explicit_paddings)
    return tf.reshape(tf.einsum("nhwk,nhwo->ko", p, dy64),
                      [kh, kw, ci, co]).numpy()


def random_sparse_images(shape, sparsity, rng, dtype=np.float32,
                         zero_channels=0.0):
    """A random NHWC tensor with about ``sparsity`` exact zeros, and a
    fraction ``zero_channels`` of its channels zero in every image.

    Nonzeros are uniform in ``[-1, -0.1] U [0.1, 1]``.
    """
    vals = rng.uniform(0.1, 1.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    keep = rng.random(shape) >= sparsity
    c = shape[-1]
    dead = rng.permutation(c)[:int(round(zero_channels * c))]
    keep[..., dead] = False
    return (vals * keep).astype(dtype)


def _apply_activation(y, activation):
    if activation in (None, "none"):
        return y
    if activation == "relu":
        return tf.nn.relu(y)
    if activation == "relu6":
        return tf.nn.relu6(y)
    raise ValueError(f"unknown activation {activation!r}")


def reference_conv2d_bias_act(x, filters, bias=None, activation=None,
                              strides=1, padding="VALID", dilations=1,
                              explicit_paddings=None):
    """``act(conv2d(x, filters) + bias)`` in float64 (what TensorFlow's
    ``_FusedConv2D`` with fused_ops BiasAdd[, Relu | Relu6] computes):
    :func:`reference_conv2d`, then ``tf.nn.bias_add`` and ``tf.nn.relu`` /
    ``tf.nn.relu6``. ``bias`` None: no bias; ``activation`` None/"none",
    "relu" or "relu6".

    Returns:
      float64 numpy array ``[N, OH, OW, C_out]``.
    """
    y = tf.constant(reference_conv2d(x, filters, strides, padding, dilations,
                                     explicit_paddings))
    if bias is not None:
        y = tf.nn.bias_add(y, tf.cast(tf.convert_to_tensor(bias), tf.float64))
    return _apply_activation(y, activation).numpy()


def reference_conv2d_bias_act_grads(x, filters, bias, dy, activation=None,
                                    strides=1, padding="VALID", dilations=1,
                                    explicit_paddings=None):
    """Gradients ``(dx, dfilters, dbias)`` of
    :func:`reference_conv2d_bias_act` for the output gradient ``dy``, in
    float64 by ``tf.GradientTape`` through the im2col formulation (every
    dilation; the activation's derivative is TensorFlow's
    ``ReluGrad``/``Relu6Grad``). ``bias`` None: ``dbias`` is None.

    Returns:
      float64 numpy arrays of the shapes of ``x``, ``filters`` and ``bias``.
    """
    x64 = tf.cast(tf.convert_to_tensor(x), tf.float64)
    f64 = tf.cast(tf.convert_to_tensor(filters), tf.float64)
    b64 = None if bias is None else tf.cast(tf.convert_to_tensor(bias),
                                            tf.float64)
    dy64 = tf.cast(tf.convert_to_tensor(dy), tf.float64)
    kh, kw, ci, co = (int(d) for d in f64.shape)
    with tf.GradientTape() as tape:
        tape.watch(x64)
        tape.watch(f64)
        if b64 is not None:
            tape.watch(b64)
        p = _patches(x64, kh, kw, _pair(strides, "strides"), padding,
                     _pair(dilations, "dilations"), explicit_paddings)
        y = tf.einsum("nhwk,ko->nhwo", p, tf.reshape(f64, [kh * kw * ci, co]))
        if b64 is not None:
            y = tf.nn.bias_add(y, b64)
        y = _apply_activation(y, activation)
    srcs = [x64, f64] + ([b64] if b64 is not None else [])
    grads = tape.gradient(y, srcs, output_gradients=dy64)
    out = [g.numpy() for g in grads]
    return out[0], out[1], (out[2] if b64 is not None else None)
