"""``sparse_split_conv2d``: the ``SparseSplitConv2D`` op wrapper (NHWC) and
its registered gradient."""

import numbers

import numpy as np
import tensorflow as tf

from tf_sparse_split._loader import load_library
from tf_sparse_split.ops._common import (as_threshold,
                                         invalid, operand_like)
from tf_sparse_split.tuning import stats as _stats
# The activations the op fuses after its bias (``None`` = ``"none"``), as
# TensorFlow's ``_FusedConv2D`` (fused_ops BiasAdd[, Relu | Relu6]), and
# the gradient mask: the same as SparseSplitMatMul's epilogue.
from tf_sparse_split.ops.matmul import (ACTIVATIONS, _activation_grad,
                                        sparse_split_matmul)
from tf_sparse_split.utils.validation import validate_choice

__all__ = ["sparse_split_conv2d", "sparse_split_conv2d_backprop_input"]

#: The dtypes the convolution ops take (inputs, filter, bias and output share
#: one): float32, float64, and the 16-bit bfloat16 / float16 (stored in the
#: dtype, accumulated in float32, rounded once, as TensorFlow's CPU kernels).
CONV_DTYPES = (tf.float32, tf.float64, tf.bfloat16, tf.float16)


def _conv_operand(value, name, where="sparse_split_conv2d"):
    """``value`` as a tensor of one of :data:`CONV_DTYPES`."""
    if value is None:
        raise invalid(f"{where}: {name} must be a float32, "
                      "float64, bfloat16 or float16 tensor, got None")
    t = tf.convert_to_tensor(value)
    if t.dtype not in CONV_DTYPES:
        raise invalid(
            f"{where}: {name} must be float32, float64, bfloat16 "
            f"or float16, got {t.dtype.name}")
    return t


#: The largest stride, dilation or explicit padding the ops take (their
#: attrs are int32; the C++ kernels refuse paddings above 2^30).
_INT32_MAX = 2**31 - 1
_MAX_EXPLICIT_PADDING = 2**30


def _is_int(v):
    """True for a Python or numpy integer (not a bool), or an integer
    scalar tensor / array."""
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, (numbers.Integral, np.integer)):
        return True
    dtype = getattr(v, "dtype", None)
    return (dtype is not None and getattr(v, "ndim", None) == 0 and
            tf.as_dtype(dtype).is_integer)


def _int_entries(value, what, low, high, where="sparse_split_conv2d"):
    """``value`` (an int or an iterable of ints; not a string) as a list of
    Python ints in ``[low, high]``, else ``InvalidArgumentError`` naming
    ``what`` (floats are refused, not truncated)."""
    if isinstance(value, (str, bytes)) or value is None:
        vals = None
    elif _is_int(value):
        vals = [value]
    else:
        try:
            vals = list(value)
        except TypeError:
            vals = None
    if vals is None or not all(_is_int(v) for v in vals):
        raise invalid(f"{where}: {what} must be ints, got "
                      f"{value!r}")
    vals = [int(v) for v in vals]
    if any(not low <= v <= high for v in vals):
        raise invalid(f"{where}: {what} must be in [{low}, "
                      f"{high}], got {vals}")
    return vals


def _conv_list(value, name, where="sparse_split_conv2d"):
    """strides / dilations as tf.nn.conv2d takes them (int, or 1, 2 or 4
    ints) -> the NHWC list of 4 ints."""
    if isinstance(value, (bool, np.bool_)):
        raise invalid(f"{where}: {name} must be ints, got {value!r}")
    if _is_int(value):
        v = int(value)
        if not 0 < v <= _INT32_MAX:
            raise invalid(f"{where}: {name} must be positive "
                          f"(at most 2^31 - 1), got {v}")
        return [1, v, v, 1]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise invalid(
            f"{where}: {name} must be an int or a list of 1, 2 or "
            f"4 ints, got {value!r}")
    vals = _int_entries(value, name, -_INT32_MAX - 1, _INT32_MAX, where)
    if len(vals) == 1:
        return [1, vals[0], vals[0], 1]
    if len(vals) == 2:
        return [1, vals[0], vals[1], 1]
    if len(vals) == 4:
        return vals
    raise invalid(
        f"{where}: {name} must have 1, 2 or 4 entries, got {vals}")


def _conv_padding(padding, explicit_paddings, where="sparse_split_conv2d"):
    """padding as tf.nn.conv2d takes it -> (padding string, flat list of 8)."""
    if isinstance(padding, (list, tuple)):
        if explicit_paddings is not None:
            raise invalid(f"{where}: give explicit paddings either "
                           "as the padding list or as explicit_paddings")
        try:
            flat = [p for pair in padding for p in pair]
        except TypeError:
            flat = None
        if flat is None or not all(_is_int(p) for p in flat):
            raise invalid(
                f"{where}: explicit padding must be 4 pairs of "
                "ints [[0, 0], [top, bottom], [left, right], [0, 0]], got "
                f"{padding!r}")
        flat = [int(p) for p in flat]
        if len(padding) != 4 or len(flat) != 8:
            raise invalid(
                f"{where}: explicit padding must be 4 pairs "
                f"[[0, 0], [top, bottom], [left, right], [0, 0]], got {padding!r}")
        return "EXPLICIT", flat
    if not isinstance(padding, str) or padding.upper() not in (
            "SAME", "VALID", "EXPLICIT"):
        raise invalid(
            f"{where}: padding must be 'SAME', 'VALID', 'EXPLICIT' "
            f"or a list of 4 [before, after] pairs, got {padding!r}")
    padding = padding.upper()
    if padding == "EXPLICIT":
        if explicit_paddings is None:
            raise invalid(f"{where}: padding 'EXPLICIT' needs "
                           "explicit_paddings (8 ints)")
        flat = _int_entries(explicit_paddings, "explicit_paddings",
                            -_INT32_MAX - 1, _INT32_MAX, where)
        return "EXPLICIT", flat
    if explicit_paddings:
        raise invalid(
            f"{where}: explicit_paddings must be empty unless "
            f"padding is 'EXPLICIT', got {explicit_paddings!r} with {padding!r}")
    return padding, []


def _check_conv_attrs(strides, dilations, padding, explicit,
                      where="sparse_split_conv2d"):
    for name, v in (("strides", strides), ("dilations", dilations)):
        if v[0] != 1 or v[3] != 1:
            raise invalid(
                f"{where}: {name} on the batch and channel "
                f"dimensions must be 1, got {v}")
        if v[1] <= 0 or v[2] <= 0:
            raise invalid(f"{where}: {name} must be positive, got {v}")
    if padding == "EXPLICIT":
        if len(explicit) != 8:
            raise invalid(
                f"{where}: explicit_paddings must have 8 entries "
                f"(before/after for N, H, W, C), got {explicit}")
        if any(p < 0 for p in explicit):
            raise invalid(
                f"{where}: explicit paddings must be >= 0, got {explicit}")
        if any(p > _MAX_EXPLICIT_PADDING for p in explicit):
            raise invalid(
                f"{where}: explicit paddings must be at most 2^30, "
                f"got {explicit}")
        if explicit[0] or explicit[1] or explicit[6] or explicit[7]:
            raise invalid(
                f"{where}: explicit paddings on the batch and "
                f"channel dimensions must be 0, got {explicit}")


def sparse_split_conv2d(input, filters, strides, padding, dilations=1,  # noqa: A002
                        explicit_paddings=None, threshold=-1.0,
                        return_stats=False, name=None, bias=None,
                        activation=None, full_stats=None):
    """``act(tf.nn.conv2d(input, filters) + bias)`` (NHWC input, HWIO
    filter) that skips the input's zeros.

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
    rounding at any threshold; only the speed changes. At a fixed
    threshold the results are deterministic (independent of the thread
    count); the automatic threshold splits by measured timings, so its bits
    may differ between runs within float rounding. An input smaller than
    the dilated filter under VALID padding gives an empty output (an output
    side of 0) eagerly and where the traced sizes are unknown; traced with
    known sizes, shape inference refuses it (``ValueError``) as it does
    ``tf.nn.conv2d``'s.

    Gradients are registered and exploit the zeros of both operands (R. Sun
    and L. Zhang, "Dynamic Sparse Method for Deep Learning Execution",
    2019). At stride 1 (any dilation) the input gradient is a
    ``SparseSplitConv2DBackpropInput`` of the output gradient ``dY``
    (automatic threshold): dense images through TensorFlow's
    ``Conv2DBackpropInput`` on the filter, sparse ones through the forward
    sparse kernels on the filter rotated 180 degrees with its channels
    swapped (built in the kernel), so the zeros that ReLU masks and
    max-pooling put into ``dY`` are skipped;
    at other strides, or with explicit paddings wider than the filter, it
    is ``Conv2DBackpropInput`` (dense). The filter gradient is
    ``SparseSplitConv2DBackpropFilter`` over the input's zeros (sparse path
    ``nnz(input) * KH * KW * C_out`` instead of
    ``N * OH * OW * KH * KW * C_in * C_out``) or, at stride 1 when ``dY`` is
    the cheaper operand (a ``tf.cond`` on the nonzero counts both ops
    already measured), the same op over ``dY``'s zeros in the transposed
    formulation (:func:`conv2d_filter_grad`). With dilations > 1 in
    float64, or with EXPLICIT padding, which TensorFlow 2.21's CPU
    ``Conv2DBackpropInput`` / ``Conv2DBackpropFilter`` refuse (so
    ``tf.nn.conv2d`` has no gradient there), a non-stride-1 input gradient
    is computed through ``tf.image.extract_patches`` (slower, exact) and the
    filter gradient entirely by the sparse kernel.

    Cost of the analysis: with an automatic threshold and ``full_stats``
    False, a call that the cost model keeps all-dense does not count every
    value of ``input``: it counts a strided sample of every image's pixels
    (a full count follows when the estimate is near the break-even) or,
    where no plan but the dense kernel can save the policy's minimum gain
    whatever the zeros, nothing, and runs TensorFlow's (fused) kernel on the
    inputs; a full count still runs every 16-256 calls to keep the cost
    model fresh. An automatic all-sparse plan whose sparse kernel is the
    direct one decides on a sample of about 1/16 of the pixels between
    those full counts, and so does ``threshold=1`` (the direct kernel
    tests every value itself). The result is the same; the statistics then
    hold estimates, flagged in their ``ANALYSIS`` entry.

    Dtypes: float32, float64, bfloat16 and float16. In bfloat16 / float16
    (e.g. under ``keras.mixed_precision`` policies) the contract is
    TensorFlow's CPU kernels' for the dtype: values stored in the dtype,
    products accumulated in float32, each output rounded once to the dtype
    (round-to-nearest-even). The dense part is TensorFlow's own kernel in
    the dtype; the sparse part widens the sparse images and the filter to
    float32 once, runs the float32 sparse kernels and rounds once.

    Non-finite values: NaN/Inf in ``input`` propagate as in ``tf.nn.conv2d``.
    Where the input is exactly zero the product is skipped, so a NaN/Inf in
    the filter facing only zeros gives 0 on the sparse path and for
    compacted channels (as in ``tf.sparse``).

    Fused bias and activation (``bias``, ``activation``), as TensorFlow's
    ``_FusedConv2D`` (what Grappler's remapper makes of ``Conv2D + BiasAdd
    + Relu`` in inference graphs): a call whose plan is all-dense runs
    TensorFlow's fused kernel itself (oneDNN's ``_MklNativeFusedConv2D`` in
    float32; in float64, where TensorFlow's graph does not fuse either,
    ``Conv2D`` followed by one bias + activation pass); otherwise the dense
    images come finished from that kernel and the sparse images get one
    bias + activation pass after the sparse kernel. Gradients: the incoming
    gradient is first masked by the activation's derivative, read from the
    output (relu: ``out > 0``; relu6: ``0 < out < 6``, as TensorFlow's
    ``ReluGrad``/``Relu6Grad``); the bias gradient is its sum over N, H, W;
    the input and filter gradients are those above, of the masked gradient
    (whose zeros the sparse paths then skip).

    Args:
      input: float32, float64, bfloat16 or float16 tensor
        ``[N, H, W, C_in]``.
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
        (default) or ``'auto'`` to let the op choose with its cost model
        (``cc/core/cost_model.h``, calibrated on the first such call for
        this layer geometry on this machine; dense unless the sparse path is
        predicted clearly faster). A float or scalar tensor (e.g. a
        non-trainable variable).
      return_stats: also return the per-call statistics.
      name: optional op name.
      bias: optional vector ``[C_out]`` of the input's dtype, added to every
        output pixel (default None: no bias).
      activation: ``None`` or ``"none"`` (default), ``"relu"`` (``max(x,
        0)``) or ``"relu6"`` (``min(max(x, 0), 6)``), applied after the
        bias. NaN stays NaN, except with a bias in float32, bfloat16 and
        float16 where TensorFlow's fused kernel is oneDNN's: its relu and
        relu6 map NaN to 0, as TensorFlow's own fused graph does, and the
        sparse images' epilogue does the same (the threshold never changes
        the answer).
      full_stats: bool or None. True: every call counts every value of
        ``input`` (exact statistics, what the layers ask for while their
        statistics are recorded). False: an automatic call, and one with
        ``threshold`` 1, may count a sample or nothing (above); its
        ``NNZ`` and ``HISTOGRAM`` are then
        estimates (``stats.ANALYSIS_SAMPLED``) or NaN / zeros
        (``stats.ANALYSIS_SKIPPED``). None (default): the value of
        ``return_stats``.

    Returns:
      the output ``act(conv2d(input, filters) + bias)``
      ``[N, OH, OW, C_out]`` of the input dtype; with
      ``return_stats``, ``(output, stats)``, ``stats`` a float64 vector laid
      out as in :mod:`tf_sparse_split.tuning.stats` with rows = images and columns =
      the ``H*W*C_in`` values of an image (see there).

    Raises:
      tf.errors.InvalidArgumentError: dtype not float32/float64/bfloat16/
        float16, or differing between input, filters and bias,
        rank other than 4, ``C_in`` differing between input and filter
        (grouped convolution is not supported), strides/dilations not
        positive or not 1 on the batch/channel dimensions, strides,
        dilations or explicit paddings that are not ints (floats, strings),
        a bad padding (unknown string, explicit list not 8 values /
        negative / above 2^30 / nonzero on N or C), a dilated filter side
        ``(K - 1) * dilation + 1`` or a padded input side above 2^30
        (TensorFlow's CPU kernel, the dense part, crashes there), a threshold above 1, NaN or not scalar, a ``bias`` that is
        not a vector ``[C_out]`` of the input's dtype.
      ValueError: an unknown ``activation``; shape errors detected while
        tracing a ``tf.function`` (shape inference).
    """
    activation = validate_choice(
        "none" if activation is None else activation, "activation",
        ACTIVATIONS)
    lib = load_library()
    with tf.name_scope(name or "SparseSplitConv2D"):
        x = _conv_operand(input, "input")
        # An array or tensor keeps its dtype (a float64 filter with float32
        # input is an error, not a silent cast); a Python list takes x's.
        f = operand_like(filters, x, "sparse_split_conv2d", "filters",
                         "input")
        for t, what in ((x, "input [N, H, W, C_in]"),
                        (f, "filters [KH, KW, C_in, C_out]")):
            if t.shape.rank is not None and t.shape.rank != 4:
                raise invalid(
                    f"sparse_split_conv2d: {what} must be rank 4, got shape {t.shape}")
        cin, fcin = x.shape[-1] if x.shape.rank else None, \
            f.shape[2] if f.shape.rank else None
        if cin is not None and fcin is not None and cin != fcin:
            raise invalid(
                f"sparse_split_conv2d: input has {cin} channels (shape "
                f"{x.shape}) but filters expect {fcin} (shape {f.shape}); "
                "grouped convolution is not supported")
        strides = _conv_list(strides, "strides")
        dilations = _conv_list(dilations, "dilations")
        pad, explicit = _conv_padding(padding, explicit_paddings)
        _check_conv_attrs(strides, dilations, pad, explicit)
        biases = []
        if bias is not None:
            op = "sparse_split_conv2d"
            bias = operand_like(bias, x, op, "bias", "input")
            cout = f.shape[3] if f.shape.rank else None
            if bias.shape.rank is not None and (
                    bias.shape.rank != 1 or (cout is not None and
                                             bias.shape[0] is not None and
                                             bias.shape[0] != cout)):
                raise invalid(
                    f"{op}: bias must be a vector [C_out] = [{cout}], got "
                    f"shape {bias.shape}")
            biases = [bias]
        out, stats = lib.tf_sparse_split_sparse_split_conv2d(
            x, f, as_threshold(threshold), biases, strides=strides,
            padding=pad, explicit_paddings=explicit, dilations=dilations,
            activation=activation,
            full_stats=bool(return_stats if full_stats is None else full_stats))
    return (out, stats) if return_stats else out


def sparse_split_conv2d_backprop_input(input_sizes, filters, out_backprop,
                                       padding, dilations=1,
                                       explicit_paddings=None, threshold=-1.0,
                                       return_stats=False, full_stats=None,
                                       name=None):
    """``dX``, the input gradient of a stride-1 ``tf.nn.conv2d(x, filters)``
    for the output gradient ``out_backprop`` (as
    ``tf.raw_ops.Conv2DBackpropInput`` with strides 1, NHWC / HWIO), skipping
    the zeros of ``out_backprop``.

    The ``SparseSplitConv2DBackpropInput`` op splits the images of ``dY`` by
    density (K.-Y. Peng, NTU 2017; the zeros of the output gradient behind
    ReLU and max-pooling: R. Sun and L. Zhang, 2019): images above
    ``threshold`` go to TensorFlow's own ``Conv2DBackpropInput`` kernel on
    ``filters`` (oneDNN's), the others to the forward sparse kernels of
    ``SparseSplitConv2D`` (zero-skipping direct convolution, SparseTrain:
    Gong et al. 2019, arXiv 1911.10175, or a pixel CSR) on the filter
    rotated 180 degrees with its channels swapped, which the kernel builds
    only when sparse images run. The result equals TensorFlow's to float
    rounding at any threshold; an all-dense call is exactly TensorFlow's
    kernel. NaN/Inf in ``out_backprop`` propagate; where it is exactly zero
    the product is skipped, so a NaN/Inf filter value facing only zeros
    gives 0 on the sparse path.

    Args:
      input_sizes: int32 or int64 ``[4]`` ``[N, H, W, C_in]``, the shape of
        ``x`` (int64 values must fit in int32).
      filters: ``[KH, KW, C_in, C_out]``, float32, float64, bfloat16 or
        float16.
      out_backprop: ``dY`` ``[N, OH, OW, C_out]`` of the same dtype.
      padding: ``"SAME"``, ``"VALID"``, ``"EXPLICIT"`` (with
        ``explicit_paddings``) or 4 ``[before, after]`` pairs, as
        :func:`sparse_split_conv2d`; explicit paddings may not exceed the
        dilated filter's extent ``(KH - 1) * d``.
      dilations: int or 1, 2 or 4 positive ints.
      explicit_paddings: with ``padding="EXPLICIT"``, 8 ints.
      threshold: image-density threshold of ``dY`` in ``[0, 1]``, or negative
        / ``'auto'`` (default): the op's cost model chooses.
      return_stats: also return the float64 statistics vector (laid out as
        a ``SparseSplitConv2D`` of ``dY``: rows = images, columns = the
        ``OH*OW*C_out`` values of an image, ``NNZ`` = ``dY``'s nonzeros).
      full_stats: as in :func:`sparse_split_conv2d` (None: ``return_stats``).
      name: optional op name.

    Returns:
      ``dX`` ``[N, H, W, C_in]`` of the filter's dtype; with
      ``return_stats``, ``(dX, stats)``.

    Raises:
      tf.errors.InvalidArgumentError: a dtype outside the four, differing
        between ``filters`` and ``out_backprop``; ``input_sizes`` not 4
        non-negative ints (a float or bool dtype, int64 values beyond
        int32) or sizes whose product overflows int64; ranks other than 4; ``C_in`` of ``input_sizes``
        and ``filters`` differing; ``out_backprop`` not of the convolution's
        output shape; paddings beyond the dilated filter; a bad threshold.
    """
    lib = load_library()
    with tf.name_scope(name or "SparseSplitConv2DBackpropInput"):
        where = "sparse_split_conv2d_backprop_input"
        f = _conv_operand(filters, "filters", where)
        # An array or tensor keeps its dtype (a mismatch is an error, as in
        # the matmul and forward wrappers); a Python list takes the filter's.
        dy = operand_like(out_backprop, f, where, "out_backprop", "filters")
        sizes = _input_sizes_int32(input_sizes)
        if _is_int(padding) or isinstance(padding, (bool, np.bool_)):
            # tf.nn.conv2d_backprop_input order (..., strides, padding):
            # this function has no strides.
            raise invalid(
                f"{where}: padding must be 'SAME', 'VALID', 'EXPLICIT' or a "
                f"list of 4 [before, after] pairs, got {padding!r}; the "
                "function takes no strides (the gradient of a stride-1 "
                "convolution): call it as (input_sizes, filters, "
                "out_backprop, padding, dilations=...)")
        dilations = _conv_list(dilations, "dilations", where)
        pad, explicit = _conv_padding(padding, explicit_paddings, where)
        _check_conv_attrs([1, 1, 1, 1], dilations, pad, explicit, where)
        dx, stats = lib.tf_sparse_split_sparse_split_conv2d_backprop_input(
            sizes, f, dy, as_threshold(threshold), strides=[1, 1, 1, 1],
            padding=pad, explicit_paddings=explicit, dilations=dilations,
            full_stats=bool(return_stats if full_stats is None else full_stats))
    return (dx, stats) if return_stats else dx


def _input_sizes_int32(input_sizes):
    """``input_sizes`` as int32: int32 as given; int64 only when every value
    fits in int32 (checked at run time, a ``tf.debugging`` assertion, so a
    size is never wrapped into another one); other dtypes (float, bool)
    raise ``InvalidArgumentError`` rather than being truncated."""
    if isinstance(input_sizes, (list, tuple)) and all(
            isinstance(v, (int, float, np.number)) for v in input_sizes):
        # Through numpy: TensorFlow would wrap a Python int beyond int32.
        input_sizes = np.asarray(input_sizes)
    if isinstance(input_sizes, (tf.Tensor, tf.Variable, np.ndarray)):
        sizes = tf.convert_to_tensor(input_sizes)
    else:
        try:
            sizes = tf.convert_to_tensor(input_sizes, dtype_hint=tf.int32)
        except (TypeError, ValueError) as e:
            raise invalid("sparse_split_conv2d_backprop_input: input_sizes "
                          f"must be 4 int32 or int64 values, got "
                          f"{input_sizes!r} ({e})") from None
    if sizes.dtype == tf.int32:
        return sizes
    if sizes.dtype != tf.int64:
        raise invalid("sparse_split_conv2d_backprop_input: input_sizes must "
                      f"be int32 or int64, got {sizes.dtype.name}")
    lim = np.iinfo(np.int32)
    msg = ("sparse_split_conv2d_backprop_input: input_sizes must fit in "
           "int32")
    with tf.control_dependencies([
            tf.debugging.assert_less_equal(sizes, tf.constant(lim.max,
                                                              tf.int64),
                                           message=msg),
            tf.debugging.assert_greater_equal(sizes, tf.constant(
                lim.min, tf.int64), message=msg)]):
        return tf.cast(sizes, tf.int32)


def _attr_str(op, name):
    v = op.get_attr(name)
    return v.decode() if isinstance(v, bytes) else v


def _transposed_paddings(kh, kw, dilations, padding, explicit):
    """The explicit paddings (flat list of 8) under which the input gradient
    of a stride-1 convolution is a forward convolution of its output
    gradient, or None where no such padding exists.

    For stride 1, ``dX[h] = sum_k dY[h + pad_top - k * d] W[k]``; with the
    filter rotated 180 degrees (``k' = KH - 1 - k``) and its channels
    swapped this is the forward convolution of ``dY`` with dilation ``d``
    and leading padding ``(KH - 1) * d - pad_top`` (trailing likewise). The
    original padding must not exceed the dilated filter's extent
    (``pad <= (KH - 1) * d``), else the new padding would be negative (only
    possible with EXPLICIT padding).
    """
    ek_h = (kh - 1) * dilations[1]
    ek_w = (kw - 1) * dilations[2]
    if padding == "VALID":
        pads = (0, 0, 0, 0)
    elif padding == "SAME":
        # TensorFlow's SAME at stride 1: total ek, the extra one after.
        pads = (ek_h // 2, ek_h - ek_h // 2, ek_w // 2, ek_w - ek_w // 2)
    else:
        pads = tuple(explicit[2:6])
    t, b, l, r = pads
    if max(t, b) > ek_h or max(l, r) > ek_w:
        return None
    return [0, 0, ek_h - t, ek_h - b, ek_w - l, ek_w - r, 0, 0]


#: Filters of up to this many values are rotated by one gather of a constant
#: permutation (TensorFlow's oneDNN Transpose costs about 0.1-1 ms per call
#: even on a 3x3x16x32 filter); larger ones by reverse + transpose (a
#: GatherV2 moves one value per index: ~36 ms on a 3x3x512x512 filter, where
#: reverse + transpose takes ~8 ms).
_GATHER_ROTATION_MAX = 1 << 16


def _is_one_by_one(f):
    """True for a filter of known shape ``[1, 1, C_in, C_out]``."""
    return f.shape.is_fully_defined() and int(f.shape[0]) == 1 and \
        int(f.shape[1]) == 1


def _rotated_filter(f):
    """``[KH, KW, C_in, C_out] -> [KH, KW, C_out, C_in]``, rotated 180
    degrees in the spatial dimensions: the filter of the transposed
    convolution. The input gradient no longer needs it (its op rotates in
    the kernel, only for a sparse part); the filter gradient's transposed
    formulation rotates its result back with it. A 1x1 filter is only
    transposed; up to ``_GATHER_ROTATION_MAX`` values of known shape, one
    gather of a constant permutation; else reverse + transpose."""
    if _is_one_by_one(f):
        return tf.transpose(f, [0, 1, 3, 2])
    if not f.shape.is_fully_defined() or \
            f.shape.num_elements() > _GATHER_ROTATION_MAX:
        return tf.transpose(tf.reverse(f, axis=[0, 1]), [0, 1, 3, 2])
    kh, kw, ci, co = (int(d) for d in f.shape)
    idx = np.arange(kh * kw * ci * co, dtype=np.int32).reshape(kh, kw, ci, co)
    idx = np.ascontiguousarray(idx[::-1, ::-1].transpose(0, 1, 3, 2))
    return tf.reshape(tf.gather(tf.reshape(f, [-1]), idx.reshape(-1)),
                      [kh, kw, co, ci])


def _transposed_conv(f, strides, dilations, padding, explicit):
    """``(pads, padding)`` of the transposed convolution of a stride-1
    convolution with filter ``f`` (:func:`_transposed_paddings`; the
    padding string is ``"SAME"`` when the paddings are TensorFlow's SAME,
    so the dense kernels run their SAME path), or None where the identity
    does not apply (strides other than 1, unknown filter size, paddings
    beyond the filter)."""
    if strides[1] != 1 or strides[2] != 1:
        return None
    if f.shape.rank != 4 or f.shape[0] is None or f.shape[1] is None:
        return None
    kh, kw = int(f.shape[0]), int(f.shape[1])
    pads = _transposed_paddings(kh, kw, dilations, padding, explicit)
    if pads is None:
        return None
    ek_h, ek_w = (kh - 1) * dilations[1], (kw - 1) * dilations[2]
    if pads[2:6] == [ek_h // 2, ek_h - ek_h // 2, ek_w // 2, ek_w - ek_w // 2]:
        return [], "SAME"
    return pads, "EXPLICIT"


def _strided_one_by_one(f, strides, padding, explicit):
    """``(sh, sw)`` where ``conv2d(x, f)`` is a 1x1 convolution with a
    stride above 1 and no padding (``SAME`` and ``VALID`` pad nothing for a
    1x1 filter; ``EXPLICIT`` all zeros): output pixel ``(i, j)`` reads input
    pixel ``(sh * i, sw * j)`` alone. None otherwise."""
    if (strides[1] == 1 and strides[2] == 1) or not _is_one_by_one(f):
        return None
    if padding == "EXPLICIT" and any(int(p) != 0 for p in explicit):
        return None
    return int(strides[1]), int(strides[2])


def _spread_strided(dx2, x, sh, sw):
    """The input gradient of a strided 1x1 convolution from its values at
    the pixels the convolution reads: ``dx2`` ``[N, OH, OW, C_in]`` goes to
    pixels ``(sh * i, sw * j)`` of a zero ``[N, H, W, C_in]`` (the shape of
    ``x``), by one pad of ``[N, OH, 1, OW, 1, C_in]`` to ``sh`` x ``sw``
    blocks (``OH = ceil(H / sh)``), then a slice where ``H`` or ``W`` is not
    a multiple of the stride."""
    d = tf.expand_dims(tf.expand_dims(dx2, 2), 4)
    d = tf.pad(d, [[0, 0], [0, 0], [0, sh - 1], [0, 0], [0, sw - 1], [0, 0]])
    s = tf.shape(dx2)
    d = tf.reshape(d, tf.stack([s[0], s[1] * sh, s[2] * sw, s[3]]))
    h, w = x.shape[1], x.shape[2]
    oh, ow = dx2.shape[1], dx2.shape[2]
    if None not in (h, w, oh, ow) and oh * sh == h and ow * sw == w:
        return d
    xs = tf.shape(x)
    d = d[:, :xs[1], :xs[2], :]
    d.set_shape(x.shape)  # the slice keeps no size of x's static shape
    return d


def _strided_pixels(x, sh, sw):
    """``x[:, ::sh, ::sw, :]``, the pixels a strided 1x1 convolution reads,
    ``[N, ceil(H / sh), ceil(W / sw), C]``. Where H and W are known
    multiples of the strides: a reshape to ``[N, H/sh, sh, W/sw, sw, C]``
    and a slice of the first of each block; otherwise one gather of the
    pixels' rows. TensorFlow's strided 4-D slice copied value by value,
    10-50x slower (0.6-2.1 ms against 16-194 us on ResNet50's shapes)."""
    _, h, w, c = x.shape
    xs = tf.shape(x)
    if h is not None and w is not None and c is not None and \
            h % sh == 0 and w % sw == 0:
        y = tf.reshape(x, tf.stack([xs[0], h // sh, sh, w // sw, sw, c]))
        return y[:, :, 0, :, 0, :]
    oh, ow = (xs[1] + sh - 1) // sh, (xs[2] + sw - 1) // sw
    pix = tf.reshape((tf.range(oh) * (sh * xs[2]))[:, None] +
                     (tf.range(ow) * sw)[None, :], [-1])
    idx = tf.reshape(tf.range(xs[0])[:, None] * (xs[1] * xs[2]) +
                     pix[None, :], [-1])
    rows = tf.gather(tf.reshape(x, tf.stack([-1, xs[3]])), idx)
    return tf.reshape(rows, tf.stack([xs[0], oh, ow, xs[3]]))


def conv2d_input_grad(x, f, grad, strides, padding, explicit, dilations,
                      return_stats=False):
    """Input gradient ``dX`` of ``conv2d(x, f)`` for the output gradient
    ``grad`` (the layout and attrs of the ``SparseSplitConv2D`` op: 4-entry
    strides/dilations, padding string, flat explicit paddings).

    With strides 1 (any dilation), and paddings that fit the filter, ``dX``
    is the ``SparseSplitConv2DBackpropInput`` op of ``grad`` and the
    original filter with the automatic threshold: it splits the images of
    ``grad`` like a forward ``SparseSplitConv2D`` of ``grad`` with the
    rotated, channel-swapped filter (:func:`_transposed_paddings`), runs
    the dense images through TensorFlow's ``Conv2DBackpropInput`` on ``f``
    and the sparse ones through the forward sparse kernels on a rotated
    copy of ``f`` that the kernel builds only then (R. Sun and L. Zhang,
    "Dynamic Sparse Method for Deep Learning Execution", 2019: the output
    gradient after ReLU and max-pooling is mostly zeros); its cost model
    keeps TensorFlow's kernel where the zeros do not pay. No rotated
    filter appears in the graph.
    A 1x1 filter at stride 1 is the product ``grad[N*H*W, C_out] @
    f[C_in, C_out]^T`` instead (``sparse_split_matmul`` with
    ``transpose_b``: no rotated filter); at a larger stride without
    padding (ResNet's downsampling 1x1 convolutions) the same product on
    ``grad[N*OH*OW, C_out]``, spread to the pixels the convolution read,
    zero elsewhere (oneDNN's strided Conv2DBackpropInput ran 1.6-3.5x the
    product's time on ResNet50's six at batch 16, 64x64). Otherwise
    ``Conv2DBackpropInput`` (dense); with dilations > 1 in float64 or with
    EXPLICIT padding, which TensorFlow 2.21's CPU kernel refuses, an im2col
    formulation (slower, exact).

    Returns:
      ``dX``, same shape and dtype as ``x``; with ``return_stats``,
      ``(dX, stats)``: ``stats`` is the statistics vector of the
      input-gradient op (laid out as a ``SparseSplitConv2D`` of ``grad``),
      or of the matmul for 1x1 (stride 1, or strided without padding; its
      ``NNZ`` counts ``grad``'s nonzeros), None on the other paths.
    """
    tc = _transposed_conv(f, strides, dilations, padding, explicit)
    st = (1, 1) if tc is not None and _is_one_by_one(f) else \
        _strided_one_by_one(f, strides, padding, explicit)
    if st is not None:
        # A 1x1 convolution without padding (none fits a 1x1 filter at
        # stride 1) is the product grad[N*OH*OW, C_out] @ f[C_in, C_out]^T
        # at the pixels it read: the matmul op skips grad's zero rows and
        # columns, and needs no rotated filter. At stride 1 those pixels
        # are all of x's; at a larger stride the product is spread to them.
        ci, co = int(f.shape[2]), int(f.shape[3])
        dx2, stats = sparse_split_matmul(
            tf.reshape(grad, [-1, co]), tf.reshape(f, [ci, co]),
            transpose_b=True, return_stats=True, full_stats=False)
        if st == (1, 1):
            dx = tf.reshape(dx2, tf.shape(x))
        else:
            gs = tf.shape(grad)
            dx2 = tf.reshape(dx2, tf.stack([gs[0], gs[1], gs[2], ci]))
            dx2.set_shape(grad.shape[:3].concatenate([ci]))
            dx = _spread_strided(dx2, x, *st)
        return (dx, stats) if return_stats else dx
    if tc is not None:
        # The op splits grad's images: dense ones through TensorFlow's
        # Conv2DBackpropInput on f itself, sparse ones through the forward
        # sparse kernels on a rotated copy of f built inside the kernel only
        # when they run (no rotated filter in the graph).
        lib = load_library()
        dx, stats = lib.tf_sparse_split_sparse_split_conv2d_backprop_input(
            tf.shape(x, out_type=tf.int32), f, grad,
            tf.constant(-1.0, tf.float32), strides=[1, 1, 1, 1],
            padding=padding, explicit_paddings=explicit, dilations=dilations,
            full_stats=False)
        return (dx, stats) if return_stats else dx
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
        dx = tape.gradient(y, x, output_gradients=grad)
    else:
        dx = tf.raw_ops.Conv2DBackpropInput(
            input_sizes=tf.shape(x), filter=f, out_backprop=grad,
            strides=strides, padding=padding, explicit_paddings=explicit,
            dilations=dilations, data_format="NHWC")
    return (dx, None) if return_stats else dx


#: Cost of converting one value to CSR, in multiply-adds of the sparse
#: kernels (measured ~13 on the CLI CNN's conv_2: a CSR build reads every
#: value, the kernel's work grows with the nonzeros).
_CONVERT_FMA_PER_VALUE = 16.0


def _bias_grad(grad):
    """``sum(grad, axis=[0, 1, 2])`` of an NHWC gradient: TensorFlow's
    one-pass ``BiasAddGrad`` for float32/float64 (a ``reduce_sum`` over
    three axes took ~3x as long on a 128x8x8x64 gradient); summed in
    float32 and rounded once for the 16-bit dtypes (a float16
    ``reduce_sum`` over N*OH*OW values would lose digits at every step)."""
    if grad.dtype in (tf.float32, tf.float64):
        return tf.raw_ops.BiasAddGrad(out_backprop=grad, data_format="NHWC")
    return tf.cast(tf.reduce_sum(tf.cast(grad, tf.float32), axis=[0, 1, 2]),
                   grad.dtype)


def conv2d_filter_grad(x, f, grad, threshold, strides, padding, explicit,
                       dilations, nnz_x=None, nnz_grad=None, bias=False):
    """Filter gradient ``dF = sum x (*) grad`` of ``conv2d(x, f)`` and,
    with ``bias``, the bias gradient ``db = sum(grad, axis=[0, 1, 2])``
    computed with it.

    ``SparseSplitConv2DBackpropFilter`` over ``x``'s zeros (sparse work
    ``nnz(x) * KH*KW*C_out`` multiply-adds plus a CSR build reading all of
    ``x``). With strides 1 and both nonzero counts given (scalar tensors;
    the gradient takes them from the statistics of the forward op and of
    the input-gradient convolution, so they cost nothing), the transposed
    formulation over ``grad``'s zeros can be taken instead: ``dF`` rotated
    180 degrees with its channels swapped is the filter gradient of the
    transposed convolution (:func:`conv2d_input_grad`), whose input is
    ``grad`` and whose output gradient is ``x`` (Sun and Zhang 2019: use
    whichever operand is sparser). A ``tf.cond`` takes it
    when its estimated cost ``16 * size(grad) + nnz(grad) * KH*KW*C_in`` is
    below ``16 * size(x) + nnz(x) * KH*KW*C_out`` (no ``tf.cond`` where
    the shapes alone rule that branch out). That branch uses the automatic
    threshold.

    With ``bias`` the branch over ``x`` is one
    ``SparseSplitConv2DBackpropFilterWithBias`` op, which sums ``grad`` in
    one vectorised pass of its own (no separate ``BiasAddGrad`` op;
    ``TFSS_CONV_BIAS_GRAD=fused`` runs oneDNN's fused filter + bias
    gradient ``_MklNativeConv2DBackpropFilterWithBias`` for the dense part
    instead, the kernel TensorFlow's own graph runs for ``Conv2D +
    BiasAdd``, measured slower). The branch over ``grad`` sums it with
    ``BiasAddGrad`` (float32 for the 16-bit dtypes).

    A 1x1 filter with a stride above 1 and no padding is the product of
    the strided pixels of ``x`` (transposed) with ``grad`` on the matmul
    op instead, and ``db`` a ``BiasAddGrad``.

    Returns:
      ``dF`` ``[KH, KW, C_in, C_out]`` of ``x``'s dtype; with ``bias``,
      ``(dF, db)``, ``db`` ``[C_out]``.
    """
    lib = load_library()
    st = _strided_one_by_one(f, strides, padding, explicit)
    if st is not None:
        # A strided 1x1 convolution without padding: x's strided pixels
        # [P, C_in] transposed times grad [P, C_out], on the matmul op (its
        # a^T dY product, over the pixels' zeros where that pays). oneDNN's
        # strided filter gradient ran 1.3-3.6x the product's time on
        # ResNet50's shapes (16x4x4x1024 -> 2048: 3.5-4.7 ms against 1.0).
        ci, co = int(f.shape[2]), int(f.shape[3])
        df = sparse_split_matmul(
            tf.reshape(_strided_pixels(x, *st), [-1, ci]),
            tf.reshape(grad, [-1, co]), threshold, transpose_a=True,
            full_stats=False)
        df = tf.reshape(df, [1, 1, ci, co])
        return (df, _bias_grad(grad)) if bias else df

    def over_x():
        if bias:
            df, db, _ = \
                lib.tf_sparse_split_sparse_split_conv2d_backprop_filter_with_bias(
                    x, tf.shape(f), grad, threshold, strides=strides,
                    padding=padding, explicit_paddings=explicit,
                    dilations=dilations, full_stats=False)
            return df, db
        return lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            x, tf.shape(f), grad, threshold, strides=strides,
            padding=padding, explicit_paddings=explicit,
            dilations=dilations, full_stats=False)[0]

    tc = _transposed_conv(f, strides, dilations, padding, explicit)
    if tc is None or nnz_x is None or nnz_grad is None or \
            not f.shape.is_fully_defined() or \
            not x.shape.is_fully_defined() or \
            not grad.shape.is_fully_defined():
        return over_x()
    pads, pad = tc
    kh, kw, ci, co = (int(d) for d in f.shape)
    a = _CONVERT_FMA_PER_VALUE
    size_x, size_g = float(x.shape.num_elements()), \
        float(grad.shape.num_elements())
    # The grad branch cannot win even with no nonzeros in grad.
    if a * size_g >= a * size_x + size_x * kh * kw * co:
        return over_x()

    def over_grad():
        g = lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            grad, [kh, kw, co, ci], x, tf.constant(-1.0, tf.float32),
            strides=[1, 1, 1, 1], padding=pad, explicit_paddings=pads,
            dilations=dilations, full_stats=False)[0]
        if bias:
            return _rotated_filter(g), _bias_grad(grad)
        return _rotated_filter(g)

    # A count the op skipped (its statistics' NNZ is NaN: the cost model
    # kept that call all-dense without counting) makes the comparison
    # false: the filter gradient then runs over x, the default.
    nnz_g = tf.cast(nnz_grad, tf.float64)
    cost_x = a * size_x + tf.cast(nnz_x, tf.float64) * (kh * kw * co)
    cost_g = a * size_g + nnz_g * (kh * kw * ci)
    return tf.cond(cost_g < cost_x, over_grad, over_x)


#: Ops that feed data into a graph (function arguments, constants, tf.data
#: iterators), and ops that pass a tensor on unchanged in value or layout.
_SOURCE_OPS = ("Placeholder", "Const", "IteratorGetNext",
               "IteratorGetNextSync", "OptionalGetValue")
_PASS_OPS = ("Identity", "Cast", "Reshape", "ExpandDims", "Squeeze")


def _is_graph_input(t):
    """True for a graph tensor that is data fed to the graph (a placeholder,
    a constant or a tf.data element, possibly cast or reshaped: a model's
    first layer); False for anything else and in eager mode."""
    try:
        op = t.op
        while op.type in _PASS_OPS and op.inputs:
            op = op.inputs[0].op
        return op.type in _SOURCE_OPS
    except AttributeError:  # an eager tensor has no op
        return False


@tf.RegisterGradient("TfSparseSplit>SparseSplitConv2D")
def _sparse_split_conv2d_grad(op, grad, unused_grad_stats):
    """Gradients of ``act(conv2d(x, f) + bias)``: ``grad`` masked by the
    activation's derivative (from the output), then the input gradient
    :func:`conv2d_input_grad` (a sparse-split forward convolution of the
    masked gradient at stride 1), the filter gradient
    :func:`conv2d_filter_grad` (over the zeros of ``x`` or, when sparser,
    of the masked gradient) and the bias gradient (its sum over N, H, W,
    computed by the filter-gradient op)."""
    x, f, threshold = op.inputs[:3]
    has_bias = op.get_attr("num_bias") == 1
    grad = _activation_grad(_attr_str(op, "activation"), op.outputs[0], grad)
    strides = list(op.get_attr("strides"))
    dilations = list(op.get_attr("dilations"))
    padding = _attr_str(op, "padding")
    explicit = list(op.get_attr("explicit_paddings"))
    grad_x, dx_stats = conv2d_input_grad(x, f, grad, strides, padding,
                                         explicit, dilations,
                                         return_stats=True)
    # nnz(x) and nnz(grad) come free from the statistics of the forward op
    # and of the input-gradient convolution. Not for an input fed by the
    # graph (a placeholder or constant: a model's first layer), whose input
    # gradient is usually unused: reading its statistics would keep it
    # from being pruned.
    nnz_grad = None
    if dx_stats is not None and not _is_graph_input(x):
        nnz_grad = dx_stats[_stats.NNZ]
    # The bias gradient comes with the filter gradient (one op over x, which
    # sums grad in one pass of its own), not from a BiasAddGrad pass.
    grad_f = conv2d_filter_grad(x, f, grad, threshold, strides, padding,
                                explicit, dilations,
                                op.outputs[1][_stats.NNZ], nnz_grad,
                                bias=has_bias)
    if has_bias:
        grad_f, grad_b = grad_f
        return [grad_x, grad_f, None, grad_b]
    return [grad_x, grad_f, None]
