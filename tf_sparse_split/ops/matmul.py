"""Python wrappers of the sparse-split ops and their registered gradients."""

import threading
import warnings

import numpy as np
import tensorflow as tf

from tf_sparse_split._loader import load_library

_FLOAT_DTYPES = (tf.float32, tf.float64)

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


def _invalid(msg):
    return tf.errors.InvalidArgumentError(None, None, msg)


def _as_threshold(threshold):
    if threshold is None or isinstance(threshold, (str, bytes)):
        raise _invalid(
            f"threshold must be a number in [0, 1] or negative (automatic), "
            f"got {threshold!r}")
    t = tf.convert_to_tensor(threshold)
    if not t.dtype.is_floating and not t.dtype.is_integer:
        raise _invalid(f"threshold must be a real number, got dtype {t.dtype.name}")
    return tf.cast(t, tf.float32)


def sparse_split_matmul(a, b, threshold=-1.0, transpose_a=False,
                        transpose_b=False, return_stats=False, name=None,
                        heterogeneous=False, grad_a_live_only=False):
    """Matrix product ``op(a) @ op(b)`` that skips the zeros of ``a``.

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

    Gradients are registered for ``a`` and ``b``; the one for ``b``
    (``op(a)^T @ dY``) runs through this op with ``a`` as its sparse operand,
    so its cost is proportional to ``nnz(a) * N``, not ``M * K * N``.

    Non-finite values: NaN/Inf in ``a`` propagate as in ``tf.matmul``. Where
    ``a`` is exactly zero the product is skipped, so a NaN/Inf in ``b`` facing
    only zeros of ``a`` gives 0 instead of NaN (as in ``tf.sparse``) -- on the
    sparse path and for compacted all-zero columns.

    Args:
      a: float32 or float64 tensor ``[M, K]`` (``[K, M]`` if ``transpose_a``).
      b: tensor of the same dtype, ``[K, N]`` (``[N, K]`` if ``transpose_b``).
      threshold: scalar row-density threshold in ``[0, 1]`` (fraction of
        nonzeros): rows above it go dense, rows at or below it sparse --
        except that when the only such rows are all-zero and fewer than 1/8
        of the rows, every row goes dense (cheaper than gathering the rest;
        same result). Negative: the op chooses it from the rates of the two
        paths it measured on this machine for this (K, N), and may send every
        row dense when the split would not pay for gathering the dense rows. A float or a scalar tensor
        (e.g. a non-trainable variable a callback assigns).
      transpose_a: if True, multiply by ``a^T``.
      transpose_b: if True, multiply by ``b^T``.
      return_stats: if True, also return the per-call statistics.
      name: optional op name.
      heterogeneous: bool; if True, dense rows on the GPU and sparse rows on
        the CPU, overlapped (see above). Default False.
      grad_a_live_only: bool; if True (and ``transpose_a`` is False), the
        gradient for ``a`` is computed only for the columns of ``a`` that are
        not all zero (dead/dropped units) and is 0 in the others: a smaller
        GEMM ``dY @ b[live]^T``. This is the true gradient only when whatever
        produced ``a`` zeroes the gradient of its all-zero columns anyway --
        e.g. ``a`` is a ReLU output (ReluGrad is 0 where the output is 0), or
        an :class:`~tf_sparse_split.ApproximateRandomDropout` output of a
        ReLU output (dropped units get 0 from the dropout mask). Default
        False (the exact dense gradient).

    Returns:
      The product ``[M, N]`` of the inputs' dtype; with ``return_stats``, a
      tuple ``(product, stats)`` where ``stats`` is a float64 vector laid out
      as in :mod:`tf_sparse_split.stats` (rows dense/sparse, nnz, all-zero
      columns skipped, seconds in each part, threshold used, ...).

    Raises:
      tf.errors.InvalidArgumentError: for a dtype other than float32/float64
        or differing between ``a`` and ``b``, a rank other than 2, mismatched
        inner dimensions, a non-scalar threshold or one above 1 or NaN.
      ValueError: for rank/shape errors detected while tracing a
        ``tf.function`` (shape inference).
    """
    if not isinstance(heterogeneous, (bool, np.bool_)):
        raise TypeError(
            f"heterogeneous must be a bool, got {heterogeneous!r}")
    if not isinstance(grad_a_live_only, (bool, np.bool_)):
        raise TypeError(
            f"grad_a_live_only must be a bool, got {grad_a_live_only!r}")
    heterogeneous = bool(heterogeneous)
    lib = load_library()
    if heterogeneous:
        _warn_if_no_gpu()
    with tf.name_scope(name or "SparseSplitMatMul"):
        a = tf.convert_to_tensor(a)
        # Arrays and tensors keep their dtype (a mismatch is an error, not a
        # silent cast); Python lists/scalars take a's dtype.
        b = (tf.convert_to_tensor(b) if hasattr(b, "dtype")
             else tf.convert_to_tensor(b, dtype_hint=a.dtype))
        if a.dtype not in _FLOAT_DTYPES:
            raise _invalid(
                f"sparse_split_matmul: a must be float32 or float64, got {a.dtype.name}")
        if b.dtype != a.dtype:
            raise _invalid(
                f"sparse_split_matmul: b has dtype {b.dtype.name} but a has {a.dtype.name}")
        product, stats = lib.tf_sparse_split_sparse_split_mat_mul(
            a, b, _as_threshold(threshold), transpose_a=transpose_a,
            transpose_b=transpose_b, heterogeneous=heterogeneous,
            grad_a_live_only=bool(grad_a_live_only))
    return (product, stats) if return_stats else product


def _grad_a_live_columns(a, b, grad, tb):
    """dA = dY @ op(b)^T computed for the live (not all-zero) columns of
    ``a`` [M, K] only; 0 in its all-zero columns (see ``grad_a_live_only``).

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


@tf.RegisterGradient("TfSparseSplit>SparseSplitMatMul")
def _sparse_split_matmul_grad(op, grad, unused_grad_stats):
    """Gradients of ``op(a) @ op(b)``; the ``b`` gradient exploits a's zeros."""
    a, b, threshold = op.inputs
    ta = op.get_attr("transpose_a")
    tb = op.get_attr("transpose_b")
    hetero = op.get_attr("heterogeneous")
    lib = load_library()

    def sparse(x, y, transpose_a):
        return lib.tf_sparse_split_sparse_split_mat_mul(x, y, threshold, transpose_a=transpose_a,
                                        heterogeneous=hetero)[0]

    if not ta and op.get_attr("grad_a_live_only"):
        grad_a = _grad_a_live_columns(a, b, grad, tb)
        grad_b = sparse(a, grad, True)                       # A^T dC
        if tb:
            grad_b = tf.transpose(grad_b)
    elif not ta and not tb:  # C = A B
        grad_a = tf.matmul(grad, b, transpose_b=True)
        grad_b = sparse(a, grad, True)                       # A^T dC
    elif not ta and tb:      # C = A B^T
        grad_a = tf.matmul(grad, b)
        grad_b = tf.transpose(sparse(a, grad, True))         # (A^T dC)^T
    elif ta and not tb:      # C = A^T B
        grad_a = tf.matmul(b, grad, transpose_b=True)
        grad_b = sparse(a, grad, False)                      # A dC
    else:                    # C = A^T B^T
        grad_a = tf.matmul(b, grad, transpose_a=True, transpose_b=True)
        grad_b = tf.transpose(sparse(a, grad, False))        # (A dC)^T
    return grad_a, grad_b, None


# --------------------------------------------------------------------------
# SparseSplitConv2D
# --------------------------------------------------------------------------

def _conv_list(value, name):
    """strides / dilations as tf.nn.conv2d takes them (int, or 1, 2 or 4
    ints) -> the NHWC list of 4 ints."""
    if isinstance(value, bool):
        raise _invalid(f"sparse_split_conv2d: {name} must be ints, got {value!r}")
    if isinstance(value, (int,)) or (hasattr(value, "dtype") and
                                     getattr(value, "ndim", 1) == 0):
        v = int(value)
        return [1, v, v, 1]
    try:
        vals = [int(v) for v in value]
    except (TypeError, ValueError):
        raise _invalid(
            f"sparse_split_conv2d: {name} must be an int or a list of 1, 2 or "
            f"4 ints, got {value!r}") from None
    if len(vals) == 1:
        return [1, vals[0], vals[0], 1]
    if len(vals) == 2:
        return [1, vals[0], vals[1], 1]
    if len(vals) == 4:
        return vals
    raise _invalid(
        f"sparse_split_conv2d: {name} must have 1, 2 or 4 entries, got {vals}")


def _conv_padding(padding, explicit_paddings):
    """padding as tf.nn.conv2d takes it -> (padding string, flat list of 8)."""
    if isinstance(padding, (list, tuple)):
        if explicit_paddings is not None:
            raise _invalid("sparse_split_conv2d: give explicit paddings either "
                           "as the padding list or as explicit_paddings")
        try:
            flat = [int(p) for pair in padding for p in pair]
        except (TypeError, ValueError):
            raise _invalid(
                "sparse_split_conv2d: explicit padding must be 4 pairs "
                f"[[0, 0], [top, bottom], [left, right], [0, 0]], got {padding!r}"
            ) from None
        if len(padding) != 4 or len(flat) != 8:
            raise _invalid(
                "sparse_split_conv2d: explicit padding must be 4 pairs "
                f"[[0, 0], [top, bottom], [left, right], [0, 0]], got {padding!r}")
        return "EXPLICIT", flat
    if not isinstance(padding, str) or padding.upper() not in (
            "SAME", "VALID", "EXPLICIT"):
        raise _invalid(
            "sparse_split_conv2d: padding must be 'SAME', 'VALID', 'EXPLICIT' "
            f"or a list of 4 [before, after] pairs, got {padding!r}")
    padding = padding.upper()
    if padding == "EXPLICIT":
        if explicit_paddings is None:
            raise _invalid("sparse_split_conv2d: padding 'EXPLICIT' needs "
                           "explicit_paddings (8 ints)")
        flat = [int(p) for p in explicit_paddings]
        return "EXPLICIT", flat
    if explicit_paddings:
        raise _invalid(
            "sparse_split_conv2d: explicit_paddings must be empty unless "
            f"padding is 'EXPLICIT', got {explicit_paddings!r} with {padding!r}")
    return padding, []


def _check_conv_attrs(strides, dilations, padding, explicit):
    for name, v in (("strides", strides), ("dilations", dilations)):
        if v[0] != 1 or v[3] != 1:
            raise _invalid(
                f"sparse_split_conv2d: {name} on the batch and channel "
                f"dimensions must be 1, got {v}")
        if v[1] <= 0 or v[2] <= 0:
            raise _invalid(f"sparse_split_conv2d: {name} must be positive, got {v}")
    if padding == "EXPLICIT":
        if len(explicit) != 8:
            raise _invalid(
                "sparse_split_conv2d: explicit_paddings must have 8 entries "
                f"(before/after for N, H, W, C), got {explicit}")
        if any(p < 0 for p in explicit):
            raise _invalid(
                f"sparse_split_conv2d: explicit paddings must be >= 0, got {explicit}")
        if explicit[0] or explicit[1] or explicit[6] or explicit[7]:
            raise _invalid(
                "sparse_split_conv2d: explicit paddings on the batch and "
                f"channel dimensions must be 0, got {explicit}")


def sparse_split_conv2d(input, filters, strides, padding, dilations=1,  # noqa: A002
                        explicit_paddings=None, threshold=-1.0,
                        return_stats=False, name=None):
    """``tf.nn.conv2d`` (NHWC input, HWIO filter) that skips the input's zeros.

    Split (K.-Y. Peng, *Adaptive runtime exploiting sparsity in tensor of
    deep learning on heterogeneous systems*, NTU 2017): each image of the
    batch whose density -- nonzeros / (H * W * C_in) -- is above
    ``threshold`` goes to TensorFlow's own CPU convolution kernel (the oneDNN
    kernel ``tf.nn.conv2d`` runs, for float32), run in-process; the other
    images go to a sparse kernel whose cost is proportional to their
    nonzeros (each output pixel gathers the nonzeros under its window times
    the matching filter rows, vectorised over C_out). Input channels that are
    zero in every image are compacted away from the dense part, with the
    matching filter slices. The result equals ``tf.nn.conv2d``'s to float
    rounding at any threshold; only the speed changes. Results are
    deterministic (independent of the thread count).

    Gradients are registered: the input gradient runs
    ``Conv2DBackpropInput`` (dense), the filter gradient
    ``SparseSplitConv2DBackpropFilter``, whose sparse path costs
    ``nnz(input) * KH * KW * C_out`` instead of
    ``N * OH * OW * KH * KW * C_in * C_out``. With dilations > 1 in float64,
    or with EXPLICIT padding, which TensorFlow 2.21's CPU
    ``Conv2DBackpropInput`` / ``Conv2DBackpropFilter`` refuse (so
    ``tf.nn.conv2d`` has no gradient there), the input gradient is computed
    through ``tf.image.extract_patches`` (slower, exact) and the filter
    gradient entirely by the sparse kernel.

    Non-finite values: NaN/Inf in ``input`` propagate as in ``tf.nn.conv2d``.
    Where the input is exactly zero the product is skipped, so a NaN/Inf in
    the filter facing only zeros gives 0 on the sparse path and for
    compacted channels (as in ``tf.sparse``).

    Args:
      input: float32 or float64 tensor ``[N, H, W, C_in]``.
      filters: tensor of the same dtype ``[KH, KW, C_in, C_out]``.
      strides: int, or 1, 2 or 4 ints (as ``tf.nn.conv2d``; the batch and
        channel entries of 4 must be 1), all positive.
      padding: ``"SAME"``, ``"VALID"``, ``"EXPLICIT"`` (with
        ``explicit_paddings``), or a list of 4 ``[before, after]`` pairs
        ``[[0, 0], [top, bottom], [left, right], [0, 0]]``.
      dilations: int, or 1, 2 or 4 ints, positive. Strides and dilations
        above 1 may be combined (TensorFlow's CPU ``Conv2D`` allows it).
      explicit_paddings: with ``padding="EXPLICIT"``, 8 ints: before/after
        for N, H, W, C (N and C entries 0).
      threshold: scalar image-density threshold in ``[0, 1]``, or negative
        (default) to let the op choose from the rates of both paths it
        measured on this machine. A float or scalar tensor (e.g. a
        non-trainable variable).
      return_stats: also return the per-call statistics.
      name: optional op name.

    Returns:
      the output ``[N, OH, OW, C_out]`` of the input dtype; with
      ``return_stats``, ``(output, stats)``, ``stats`` a float64 vector laid
      out as in :mod:`tf_sparse_split.stats` with rows = images and columns =
      the ``H*W*C_in`` values of an image (see there).

    Raises:
      tf.errors.InvalidArgumentError: dtype not float32/float64 or differing,
        rank other than 4, ``C_in`` differing between input and filter
        (grouped convolution is not supported), strides/dilations not
        positive or not 1 on the batch/channel dimensions, a bad padding
        (unknown string, explicit list not 8 values / negative / nonzero on
        N or C), an input smaller than the dilated filter with VALID
        padding, a threshold above 1, NaN or not scalar.
    """
    lib = load_library()
    with tf.name_scope(name or "SparseSplitConv2D"):
        x = tf.convert_to_tensor(input)
        f = tf.convert_to_tensor(filters, dtype_hint=x.dtype)
        if x.dtype not in _FLOAT_DTYPES:
            raise _invalid(
                f"sparse_split_conv2d: input must be float32 or float64, got {x.dtype.name}")
        if f.dtype != x.dtype:
            raise _invalid(
                f"sparse_split_conv2d: filters have dtype {f.dtype.name} but "
                f"input has {x.dtype.name}")
        for t, what in ((x, "input [N, H, W, C_in]"),
                        (f, "filters [KH, KW, C_in, C_out]")):
            if t.shape.rank is not None and t.shape.rank != 4:
                raise _invalid(
                    f"sparse_split_conv2d: {what} must be rank 4, got shape {t.shape}")
        cin, fcin = x.shape[-1] if x.shape.rank else None, \
            f.shape[2] if f.shape.rank else None
        if cin is not None and fcin is not None and cin != fcin:
            raise _invalid(
                f"sparse_split_conv2d: input has {cin} channels (shape "
                f"{x.shape}) but filters expect {fcin} (shape {f.shape}); "
                "grouped convolution is not supported")
        strides = _conv_list(strides, "strides")
        dilations = _conv_list(dilations, "dilations")
        pad, explicit = _conv_padding(padding, explicit_paddings)
        _check_conv_attrs(strides, dilations, pad, explicit)
        out, stats = lib.tf_sparse_split_sparse_split_conv2d(
            x, f, _as_threshold(threshold), strides=strides, padding=pad,
            explicit_paddings=explicit, dilations=dilations)
    return (out, stats) if return_stats else out


def _attr_str(op, name):
    v = op.get_attr(name)
    return v.decode() if isinstance(v, bytes) else v


@tf.RegisterGradient("TfSparseSplit>SparseSplitConv2D")
def _sparse_split_conv2d_grad(op, grad, unused_grad_stats):
    """Input gradient: Conv2DBackpropInput; filter gradient:
    SparseSplitConv2DBackpropFilter (exploits the input's zeros)."""
    x, f, threshold = op.inputs
    strides = list(op.get_attr("strides"))
    dilations = list(op.get_attr("dilations"))
    padding = _attr_str(op, "padding")
    explicit = list(op.get_attr("explicit_paddings"))
    lib = load_library()
    dilated = dilations[1] > 1 or dilations[2] > 1
    if dilated and (x.dtype == tf.float64 or padding == "EXPLICIT"):
        # TF 2.21's CPU Conv2DBackpropInput refuses dilations > 1 in float64
        # and, in float32 (oneDNN), together with EXPLICIT padding.
        from tf_sparse_split.testing import _patches

        kh, kw, ci, co = tf.unstack(tf.shape(f))
        with tf.GradientTape() as tape:
            tape.watch(x)
            p = _patches(x, int(f.shape[0]), int(f.shape[1]),
                         strides[1:3], padding, dilations[1:3], explicit)
            y = tf.einsum("nhwk,ko->nhwo", p,
                          tf.reshape(f, [kh * kw * ci, co]))
        grad_x = tape.gradient(y, x, output_gradients=grad)
    else:
        grad_x = tf.raw_ops.Conv2DBackpropInput(
            input_sizes=tf.shape(x), filter=f, out_backprop=grad,
            strides=strides, padding=padding, explicit_paddings=explicit,
            dilations=dilations, data_format="NHWC")
    grad_f = lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
        x, tf.shape(f), grad, threshold, strides=strides, padding=padding,
        explicit_paddings=explicit, dilations=dilations)[0]
    return grad_x, grad_f, None
