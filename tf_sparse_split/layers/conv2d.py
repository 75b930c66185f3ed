"""Convolution layers backed by the sparse-split ops.

:class:`SparseSplitConv2D` is a drop-in replacement for
``keras.layers.Conv2D`` (``data_format="channels_last"``; grouped
convolution and LoRA included) whose convolution is ``SparseSplitConv2D``:
images of the batch whose input density is above the layer's threshold go
to TensorFlow's own convolution, the others to a sparse kernel whose cost is
proportional to their nonzeros, and input channels that are zero across the
batch are skipped (K.-Y. Peng,
"Adaptive runtime exploiting sparsity in tensor of deep learning on
heterogeneous systems", NTU 2017). The result equals ``Conv2D``'s to float
rounding at any threshold. Requires the TensorFlow backend of Keras 3.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_sparse_split.layers.activations import FATReLU
from tf_sparse_split.layers.base import (SparseSplitLayer, _is_training,
                                         _keras_call_training)
from tf_sparse_split.layers.dense import _fused_activation
from tf_sparse_split.ops.conv2d import sparse_split_conv2d
from tf_sparse_split.tuning import stats as _stats

__all__ = ["SparseSplitConv2D"]


def _out_size(size, k, stride, dilation, padding):
    ek = (k - 1) * dilation + 1
    if padding == "same":
        return -(-size // stride)
    return max((size - ek) // stride + 1, 0)


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class SparseSplitConv2D(SparseSplitLayer, keras.layers.Conv2D):
    """``keras.layers.Conv2D`` computed by ``SparseSplitConv2D``.

    ``output = activation(conv2d(inputs, kernel) + bias)``, the same as
    ``Conv2D`` with ``data_format="channels_last"``: inputs
    ``[batch, H, W, C_in]``, kernel ``[KH, KW, C_in, filters]``, outputs
    ``[batch, OH, OW, filters]``. With ``use_bias`` and a linear,
    ``"relu"`` or ``"relu6"`` activation the bias and the activation run
    inside the op (``sparse_split_conv2d(..., bias=, activation=)``): an
    all-dense call is TensorFlow's fused convolution, which is what
    ``Conv2D`` gets in inference graphs (Grappler's remapper); other
    activations run after the op.

    Args:
      filters, kernel_size, strides, padding (``"valid"`` or ``"same"``),
      dilation_rate, activation, use_bias, kernel_initializer,
      bias_initializer, kernel_regularizer, bias_regularizer,
      activity_regularizer, kernel_constraint, bias_constraint: as in
      ``keras.layers.Conv2D``.
      data_format: must be ``"channels_last"`` (or None with Keras' image
        data format ``"channels_last"``).
      groups: as in ``keras.layers.Conv2D``: input channels and filters
        are split into ``groups`` groups, group ``i``'s filters see only
        group ``i``'s channels, and the outputs are concatenated along the
        channels. Each group runs its own sparse-split convolution (its
        images split by density, its all-zero channels skipped); see
        :meth:`_grouped_convolution`.
      lora_rank, lora_alpha: as in ``keras.layers.Conv2D`` (LoRA: the
        kernel is frozen and the convolution uses ``kernel + lora_alpha /
        lora_rank * lora_kernel_a @ lora_kernel_b``); also
        :meth:`enable_lora`.
      threshold: initial image-density split threshold in ``[0, 1]`` (images
        whose density nnz / (H*W*C_in) is above it go dense), or negative
        (default -1.0) or ``'auto'`` to let the op choose per call. Stored as the
        non-trainable float32 ``tf.Variable`` ``threshold_var`` that a
        :class:`~tf_sparse_split.callbacks.SplitThresholdCallback` assigns,
        saved with the model (not a Keras weight: ``get_weights()`` is
        ``Conv2D``'s ``[kernel, bias]``).
      **kwargs: base ``Layer`` arguments.

    Dtypes: the op computes in float32 or float64; other compute dtypes are
    cast to float32 and back.

    Statistics and threshold API (``latest_stats``, ``accumulated_stats``,
    ``reset_stats``, ``threshold``, ``set_threshold``) as in
    :class:`~tf_sparse_split.layers.SparseSplitDense`; the statistics map a
    convolution to the matmul layout as described in
    :mod:`tf_sparse_split.tuning.stats` (rows = images, K = H*W*C_in,
    N = KH*KW*filters). ``split_work_coefficients`` gives the cost model the
    convolution's flop formulas.

    XLA: ``supports_jit`` is False (the op has no XLA kernel).

    Raises:
      ValueError: bad threshold, ``channels_first``, or bad ``Conv2D``
        arguments (as ``Conv2D``: filters or input channels not divisible by
        ``groups``).
      RuntimeError: if the Keras backend is not TensorFlow.
    """

    def __init__(self, filters, kernel_size, strides=(1, 1), padding="valid",
                 data_format=None, dilation_rate=(1, 1), groups=1,
                 activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 lora_rank=None, lora_alpha=None, threshold=-1.0, **kwargs):
        fmt = data_format or keras.config.image_data_format()
        if fmt != "channels_last":
            raise ValueError(
                "SparseSplitConv2D supports data_format='channels_last' "
                f"(NHWC) only, got {fmt!r}")
        super().__init__(
            filters, kernel_size, threshold=threshold, strides=strides, padding=padding,
            data_format="channels_last", dilation_rate=dilation_rate,
            groups=groups, lora_rank=lora_rank, lora_alpha=lora_alpha,
            **self._keras_weight_args(locals()), **kwargs)
        self._spatial = None

    def build(self, input_shape):
        super().build(input_shape)
        if input_shape[1] is not None and input_shape[2] is not None:
            self._spatial = (int(input_shape[1]), int(input_shape[2]))

    def call(self, inputs):
        """As ``keras.layers.Conv2D.call``. With a bias and a linear,
        ``"relu"`` or ``"relu6"`` activation, bias and activation are fused
        into the op (``SparseSplitConv2D`` with ``bias``/``activation``:
        TensorFlow's fused convolution for an all-dense call, as
        ``Conv2D`` gets in inference graphs). With a bias and a
        :class:`~tf_sparse_split.layers.FATReLU` activation (what
        :class:`~tf_sparse_split.callbacks.SparsityTargetCallback` installs),
        the bias and the activation run fused in one pass
        (:meth:`FATReLU.bias_call`), forward and backward. Other activations,
        and every activation of a grouped convolution (``groups > 1``, one
        op per group), run after the op."""
        act = self.activation
        if self.use_bias and isinstance(act, FATReLU):
            y = self.convolution_op(inputs, self.kernel)
            bias = tf.convert_to_tensor(self.bias)
            if y.dtype.name not in ("float32", "float64"):
                return act(y + tf.cast(bias, y.dtype))
            training = _is_training(_keras_call_training())
            return act.bias_call(y, tf.cast(bias, y.dtype), training=training)
        fused = (_fused_activation(act)
                 if self.use_bias and self.groups == 1 else None)
        if fused is None:
            return super().call(inputs)
        return self._split_conv(inputs, self.kernel, bias=self.bias,
                                activation=fused)

    def convolution_op(self, inputs, kernel):
        return self._split_conv(inputs, kernel)

    def _split_conv(self, inputs, kernel, bias=None, activation="none"):
        """``act(conv2d(inputs, kernel) + bias)`` by the op, in the op's
        dtype (float32/float64), cast to the layer's compute dtype."""
        x, k, out_dtype = self._op_operands(inputs, kernel)
        if self._spatial is None and x.shape[1] is not None and \
                x.shape[2] is not None:
            self._spatial = (int(x.shape[1]), int(x.shape[2]))
        if self.groups > 1:  # call() fuses only at groups == 1
            return self._grouped_convolution(x, k, out_dtype)
        if bias is not None:
            bias = tf.convert_to_tensor(bias)
            if bias.dtype != x.dtype:
                bias = tf.cast(bias, x.dtype)
        y, stats_vec = sparse_split_conv2d(
            x, k, strides=list(self.strides), padding=self.padding.upper(),
            dilations=list(self.dilation_rate),
            threshold=tf.convert_to_tensor(self.threshold_var),
            return_stats=True, bias=bias, activation=activation,
            full_stats=self._records_stats(None))
        self._record_stats(stats_vec)
        if y.dtype != out_dtype:
            y = tf.cast(y, out_dtype)
        return y

    # -- grouped convolution ----------------------------------------------
    def _grouped_convolution(self, x, kernel, out_dtype):
        """``groups > 1``: one ``SparseSplitConv2D`` per group.

        ``x`` ``[batch, H, W, C_in]`` and ``kernel`` ``[KH, KW, C_in /
        groups, filters]`` (already cast for the op) are split into the
        groups' channels and filters; group ``i`` convolves its
        ``C_in / groups`` channels with its ``filters / groups`` filters
        and the outputs are concatenated along the channels, as
        ``keras.layers.Conv2D(groups=...)``. Each group's op splits its
        images by their density in that group's channels and skips the
        group's all-zero channels, so a group whose channels are mostly
        zero costs little. Gradients are the ops' own, per group.

        Statistics: the groups' vectors are merged by
        :func:`_merge_group_stats`: each (image, group) pair is a row of
        ``K = H*W*C_in/groups`` values and ``N = KH*KW*filters/groups``.

        Returns:
          ``[batch, OH, OW, filters]`` of ``out_dtype``.
        """
        xs = tf.split(x, self.groups, axis=-1)
        ks = tf.split(kernel, self.groups, axis=-1)
        outs, stats = [], []
        for xi, ki in zip(xs, ks):
            yi, si = sparse_split_conv2d(
                xi, ki, strides=list(self.strides),
                padding=self.padding.upper(),
                dilations=list(self.dilation_rate),
                threshold=tf.convert_to_tensor(self.threshold_var),
                return_stats=True, full_stats=self._records_stats(None))
            outs.append(yi)
            stats.append(si)
        self._record_stats(_merge_group_stats(stats))
        y = tf.concat(outs, axis=-1)
        if y.dtype != out_dtype:
            y = tf.cast(y, out_dtype)
        return y

    def split_work_coefficients(self, stats_vector):
        """``(dense_coef, sparse_coef)`` of a convolution (flop): the sparse
        path does ``2*KH*KW*C_out`` flop per input nonzero
        (``2 * stats.N``), the dense path ``2*OH*OW*KH*KW*C_out`` per image
        and live input channel, i.e. ``2 * stats.N * OH*OW / (H*W)`` per
        element of ``K = H*W*C_in``. OH, OW come from the input size the
        layer was built or called with (``1 / (stride_h * stride_w)`` for the
        ratio when unknown)."""
        n = float(np.asarray(stats_vector, dtype=np.float64)[_stats.N])
        if self._spatial is not None:
            h, w = self._spatial
            oh = _out_size(h, self.kernel_size[0], self.strides[0],
                           self.dilation_rate[0], self.padding)
            ow = _out_size(w, self.kernel_size[1], self.strides[1],
                           self.dilation_rate[1], self.padding)
            ratio = (oh * ow) / float(max(h * w, 1))
        else:
            ratio = 1.0 / (self.strides[0] * self.strides[1])
        return 2.0 * n * ratio, 2.0 * n


def _merge_group_stats(vectors):
    """One statistics vector for the per-group calls of a grouped
    convolution: a grouped convolution is ``groups * batch`` independent
    image-group products, each a row of ``K = H*W*C_in/groups`` values
    times ``N = KH*KW*filters/groups``. Counts, times, ``M`` and the
    histogram are summed; ``K``, ``N``, the threshold used,
    ``ZERO_COLS_SKIPPED`` (per image, so averaged) and the cost entries
    (``COST_FIRST`` .. ``COST_LAST``: one group's shape and terms) are the
    groups' mean;
    ``HETEROGENEOUS`` their maximum. ``sparsity`` (``1 - NNZ / (M*K)``)
    is then the input's fraction of zeros.

    Args:
      vectors: list of float64 ``[stats.NUM_STATS]`` tensors, one per group.

    Returns:
      float64 ``[stats.NUM_STATS]`` tensor.
    """
    v = tf.stack(vectors)
    mean_idx = np.zeros([_stats.NUM_STATS], bool)
    mean_idx[[_stats.ZERO_COLS_SKIPPED, _stats.THRESHOLD, _stats.K,
              _stats.N]] = True
    mean_idx[_stats.COST_FIRST:_stats.COST_LAST + 1] = True  # per group
    merged = tf.where(tf.constant(mean_idx), tf.reduce_mean(v, axis=0),
                      tf.reduce_sum(v, axis=0))
    max_idx = np.zeros([_stats.NUM_STATS], bool)
    max_idx[_stats.HETEROGENEOUS] = True
    return tf.where(tf.constant(max_idx), tf.reduce_max(v, axis=0), merged)
