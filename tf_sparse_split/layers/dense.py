"""Keras layers backed by the sparse-split ops.

:class:`SparseSplitDense` is a drop-in replacement for ``keras.layers.Dense``
whose matmul is ``SparseSplitMatMul``: rows of the input with density above
the layer's threshold go to a dense GEMM, the others to a CSR SpMM, and
all-zero input columns are skipped (K.-Y. Peng, "Adaptive runtime exploiting
sparsity in tensor of deep learning on heterogeneous systems", NTU 2017). The
result equals ``Dense``'s to float rounding at any threshold; the threshold
only changes the speed. A :class:`~tf_sparse_split.callbacks.
SplitThresholdCallback` tunes it during training.

Requires the TensorFlow backend of Keras 3.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_sparse_split.layers.activations import FATReLU
from tf_sparse_split.layers.base import (SparseSplitLayer,
                                         _is_training, _keras_call_training,
                                         op_dtype_for)
from tf_sparse_split.ops.matmul import sparse_split_matmul
from tf_sparse_split.utils.deprecation import (RenamedAttributes,
                                               rename_config_key,
                                               renamed_kwarg)

__all__ = ["SparseSplitDense"]


def _fused_activation(activation):
    """The op's epilogue name for a Keras activation it can fuse ('none',
    'relu', 'relu6'), or None when the activation must run separately."""
    if activation is None or activation is keras.activations.linear:
        return "none"
    if activation is keras.activations.relu:
        return "relu"
    if activation is keras.activations.relu6:
        return "relu6"
    return None


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class SparseSplitDense(RenamedAttributes, SparseSplitLayer,
                       keras.layers.Dense):
    """``keras.layers.Dense`` computed by ``SparseSplitMatMul``.

    ``output = activation(inputs @ kernel + bias)``, the same as ``Dense``;
    the matmul splits the rows of ``inputs`` by density (see the module
    docstring). The bias and a linear, ``"relu"`` or ``"relu6"`` activation
    run in the op's fused epilogue (one pass over the output rows, as Keras
    ``Dense`` gets TF's fused MatMul + BiasAdd + Relu); a
    :class:`~tf_sparse_split.layers.FATReLU` activation runs with the bias
    in one ``BiasFatRelu`` pass after the op, forward and backward
    (:meth:`FATReLU.bias_call`; CPU); other activations run after the op
    (the bias is still fused). Inputs of rank > 2 ``[batch, ..., input_dim]`` are reshaped
    to ``[-1, input_dim]`` for the op and the output back to
    ``[batch, ..., units]``. A rank-2 ``tf.SparseTensor`` input is
    multiplied by the kernel rows of its live columns only, and the
    kernel's gradient is a ``tf.IndexedSlices`` over those rows, as
    ``Dense`` gives (:meth:`_sparse_tensor_call`); a higher-rank one is made
    dense first.

    Args:
      units, activation, use_bias, kernel_initializer, bias_initializer,
      kernel_regularizer, bias_regularizer, activity_regularizer,
      kernel_constraint, bias_constraint: as in ``keras.layers.Dense``.
      threshold: float or ``'auto'``, initial split threshold: in ``[0, 1]`` (rows of the
        input with density = nonzeros / input_dim above it go to the dense
        GEMM, the others to the CSR SpMM; 1.0 = all sparse, 0.0 = all
        nonzero rows dense), or negative (default -1.0) or ``'auto'`` to let the op choose
        per call. Stored as a non-trainable float32 ``tf.Variable``
        ``threshold_var`` (so a compiled ``tf.function`` reads the current
        value; a callback changes it with ``.assign()``) and saved with the
        model; it is not a Keras weight: ``get_weights()`` /
        ``set_weights()`` take ``Dense``'s list ``[kernel, bias]``.
      heterogeneous: bool (default False), passed to the op: on a GPU the
        dense rows run on the GPU while the sparse rows run on the CPU
        (overlapped, K.-Y. Peng, NTU 2017), and the
        op's cost model picks the split that balances the two devices'
        finishing times (its prediction is ``max`` of the two parts, see
        docs/ARCHITECTURE.md, "The cost model"). Without a
        GPU the op runs the normal CPU split (same results), records
        ``stats.HETERO_CPU_FALLBACK`` and warns once per process
        (``RuntimeWarning``). Saved in ``get_config``.
      masked_input_grad: bool (default False). If True, the gradient for
        the layer's input is computed only where the input is nonzero (0
        elsewhere), by an SDDMM whose cost is proportional to the input's
        nonzeros (``masked_input_grad`` of
        :func:`~tf_sparse_split.sparse_split_matmul`). Exact only when the
        layer before has zero gradient wherever its output is zero: its
        input is a ReLU or FATReLU output, possibly through dropout,
        max-pooling or a reshape -- the usual ``Dense(relu) -> [dropout] ->
        SparseSplitDense`` stack (:class:`SparsityTargetCallback` sets it on
        the layers it controls). Saved in ``get_config``.
      skip_dead_input_grad: deprecated alias of ``masked_input_grad`` (same
        meaning; a ``DeprecationWarning``, as for the attribute of that
        name), removed in the next release. Configurations saved with it
        (``.keras`` files) load without a warning.
      lora_rank, lora_alpha: LoRA as in ``keras.layers.Dense``
        (also :meth:`enable_lora`): the kernel is frozen, trainable
        float32 ``lora_kernel_a`` ``[input_dim, rank]`` (``he_uniform``)
        and ``lora_kernel_b`` ``[rank, units]`` (zeros) are added, the
        output is that of the merged kernel ``kernel + lora_alpha /
        lora_rank * lora_kernel_a @ lora_kernel_b`` (what ``.kernel``
        returns and ``.keras`` files store), and ``lora_rank``/
        ``lora_alpha`` are saved in ``get_config``. The low-rank branch
        ``(inputs @ a) @ b`` is computed beside the frozen product, by a
        second ``SparseSplitMatMul`` on the same sparse input
        (:meth:`_lora_product`), so no gradient work is spent on the
        frozen kernel. Unlike Keras 3.15's ``Dense.build``, a
        ``lora_alpha`` given with ``lora_rank`` is kept.
      quantization_config: must be None: int8/int4/float8 quantization
        would replace the float kernel the op multiplies by, so it is
        refused with ``NotImplementedError`` (as is :meth:`quantize`).
      **kwargs: base ``Layer`` arguments (``name``, ``dtype``, ...).

    Dtypes: as ``Dense``, under a mixed policy (``mixed_bfloat16``,
    ``mixed_float16``) the variables are float32 and Keras autocasts them
    to the compute dtype inside ``call``; the op then runs in the compute
    dtype when it has a kernel for it (bfloat16/float16 storage, float32
    accumulation; its gradients likewise), else in float32 with the result
    cast back.
    The output has the compute dtype; the statistics stay float64. Under
    ``mixed_float16`` Keras' ``LossScaleOptimizer`` (what ``compile``
    installs) scales the loss as for ``Dense``.

    Statistics: training calls (and eager calls) record the op's statistics
    vector (``tf_sparse_split.tuning.stats``) into two ``tf.Variable`` objects that
    are not Keras weights (``get_weights()`` is ``[kernel, bias]``, or
    ``[kernel]`` without bias, as for ``Dense``): the latest vector, and the sum
    since the last :meth:`reset_stats` with the number of calls. Under
    ``tf.function`` (``model.fit``) they are updated with assign ops;
    inference graphs (``model.predict``, exported serving functions) write
    no variables unless ``record_stats = True`` (see
    :class:`~tf_sparse_split.layers.base.SparseSplitLayer`). Read them with
    :meth:`latest_stats` and :meth:`accumulated_stats`.

    XLA: the op has no XLA kernel, so ``supports_jit`` is False and Keras
    does not JIT-compile a model holding this layer (docs/ARCHITECTURE.md, "Keras and
    XLA").

    Raises:
      ValueError: on a bad ``threshold``, a non-bool ``heterogeneous`` or
        ``masked_input_grad`` (or bad ``Dense`` arguments).
      TypeError: both ``masked_input_grad`` and ``skip_dead_input_grad``
        given.
      NotImplementedError: if quantization is requested.
      RuntimeError: if the Keras backend is not TensorFlow.
    """

    def __init__(
        self,
        units,
        activation=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        lora_rank=None,
        lora_alpha=None,
        quantization_config=None,
        threshold=-1.0,
        heterogeneous=False,
        masked_input_grad=False,
        skip_dead_input_grad=None,
        **kwargs,
    ):
        masked_input_grad = renamed_kwarg(
            "SparseSplitDense", "skip_dead_input_grad", "masked_input_grad",
            skip_dead_input_grad, masked_input_grad, False)
        if not isinstance(masked_input_grad, (bool, np.bool_)):
            raise ValueError(f"masked_input_grad must be a bool, got "
                             f"{masked_input_grad!r}")
        self.masked_input_grad = bool(masked_input_grad)
        if not isinstance(heterogeneous, (bool, np.bool_)):
            raise ValueError(
                f"heterogeneous must be a bool, got {heterogeneous!r}")
        self.heterogeneous = bool(heterogeneous)
        if quantization_config is not None:
            raise NotImplementedError(
                "SparseSplitDense does not support quantization "
                "(quantization_config); the sparse-split op multiplies "
                "float32/float64 kernels only")
        super().__init__(units, threshold=threshold, lora_rank=lora_rank,
                         lora_alpha=lora_alpha,
                         **self._keras_weight_args(locals()), **kwargs)

    # -- building ---------------------------------------------------------
    def build(self, input_shape):
        if self.quantization_mode is not None:
            raise NotImplementedError(
                "SparseSplitDense does not support quantization (dtype "
                f"policy {self.dtype_policy.name!r})")
        # keras.layers.Dense.build enables LoRA with lora_alpha = lora_rank
        # (it drops the configured alpha); keep it, as Conv2D does.
        lora_alpha = self.lora_alpha
        super().build(input_shape)
        if self.lora_enabled and lora_alpha is not None:
            self.lora_alpha = lora_alpha

    # -- refused features -------------------------------------------------
    def quantize(self, *args, **kwargs):
        """Not supported: raises NotImplementedError."""
        raise NotImplementedError(
            "SparseSplitDense does not support quantization; use "
            "keras.layers.Dense")

    # -- forward ----------------------------------------------------------
    def call(self, inputs, training=None):
        if isinstance(inputs, tf.SparseTensor) and inputs.shape.rank == 2:
            return self._sparse_tensor_call(inputs, training)
        x = inputs
        if isinstance(x, tf.SparseTensor):
            x = tf.sparse.to_dense(x)
        # With LoRA the frozen kernel and the low-rank branch are separate
        # products of the same sparse input (see _lora_product).
        x, kernel, out_dtype = self._op_operands(
            x, self._kernel if self.lora_enabled else self.kernel)
        input_dim = kernel.shape[0]
        rank = x.shape.rank
        if rank == 2:
            x2d = x
        else:
            x2d = tf.reshape(x, [-1, input_dim])
        fat = self._bias_fat_relu(out_dtype)
        fused = None if self.lora_enabled or fat is not None else \
            _fused_activation(self.activation)
        y = self._split_product(x2d, kernel, fused, training,
                                with_bias=fat is None)
        if self.lora_enabled:
            y = y + self._lora_product(x2d)
        if rank != 2:
            out_shape = tf.concat([tf.shape(x)[:-1], [self.units]], axis=0)
            y = tf.reshape(y, out_shape)
            y.set_shape(x.shape[:-1].concatenate([self.units]))
        if y.dtype != out_dtype:
            y = tf.cast(y, out_dtype)
        if fat is not None:
            return self._apply_bias_fat_relu(fat, y, training)
        if fused is None:
            y = self.activation(y)
        return y

    def _bias_fat_relu(self, dtype):
        """The layer's :class:`FATReLU` activation when its bias and the
        FATReLU run as one ``BiasFatRelu`` pass after the op
        (:meth:`FATReLU.bias_call`), else None.

        That is the case for a bias, a FATReLU activation (what
        :class:`~tf_sparse_split.callbacks.SparsityTargetCallback`
        installs), an op kernel of ``BiasFatRelu`` in ``dtype`` (the output
        dtype: float32, float64, bfloat16, float16) and no visible GPU (the
        op has CPU kernels only; on a GPU the product's bias stays fused
        and the FATReLU runs as TensorFlow ops there). The op's matmul then
        has neither bias nor activation, and the FATReLU's separate passes
        (compare, select, penalty sum; in training the gradient's add and
        mask, the bias gradient's sum) become one forward and one backward
        pass that also give the L1 penalty's sum and the bias gradient.
        """
        act = self.activation
        if (self.bias is None or not isinstance(act, FATReLU)
                or op_dtype_for("BiasFatRelu", dtype) != tf.as_dtype(dtype).name
                or tf.config.list_logical_devices("GPU")):
            return None
        return act

    def _apply_bias_fat_relu(self, fat, y, training):
        """``fat(y + bias)`` by :meth:`FATReLU.bias_call` (its penalty and
        cutoff tracking in training calls)."""
        bias = tf.convert_to_tensor(self.bias)
        if bias.dtype != y.dtype:
            bias = tf.cast(bias, y.dtype)
        if training is None:
            training = _keras_call_training()
        return fat.bias_call(y, bias, training=_is_training(training))

    def _split_product(self, x2d, kernel, fused, training, with_bias=True):
        """``fused(x2d @ kernel + bias)`` ``[M, units]`` by the op, with the
        layer's threshold, ``heterogeneous`` and ``masked_input_grad``; the
        call's statistics are recorded (exact where the layer records
        them, :meth:`_records_stats`). ``fused`` is the op's activation
        (``"relu"``, ``"relu6"``) or None (none fused); ``with_bias``
        False leaves the bias out of the op (added by the caller)."""
        bias = None
        if self.bias is not None and with_bias:
            bias = tf.convert_to_tensor(self.bias)
            if bias.dtype != x2d.dtype:
                bias = tf.cast(bias, x2d.dtype)
        y, stats_vec = sparse_split_matmul(
            x2d, kernel, threshold=tf.convert_to_tensor(self.threshold_var),
            return_stats=True, heterogeneous=self.heterogeneous,
            masked_input_grad=self.masked_input_grad, bias=bias,
            activation=fused or "none",
            full_stats=self._records_stats(training))
        self._record_stats(stats_vec, training)
        return y

    def _lora_product(self, x2d):
        """``(lora_alpha / lora_rank) * (x2d @ lora_kernel_a) @
        lora_kernel_b`` ``[M, units]``, in ``x2d``'s dtype.

        ``x2d @ lora_kernel_a`` ``[M, rank]`` is a ``SparseSplitMatMul``
        with ``x2d`` as its sparse operand and the automatic threshold, so
        its gradient for ``lora_kernel_a`` (``x2d^T @ dZ``) skips the zeros
        of ``x2d``; the product by ``lora_kernel_b`` is a small dense GEMM.
        Equal, to float rounding, to the merged kernel of
        ``keras.layers.Dense`` (``kernel + alpha/rank * A @ B``); the frozen
        kernel gets no gradient work (in a ``tf.function`` its unused
        gradient is pruned).
        """
        a = tf.cast(self.lora_kernel_a, x2d.dtype)
        b = tf.cast(self.lora_kernel_b, x2d.dtype)
        xa = sparse_split_matmul(x2d, a, threshold=-1.0,
                                 heterogeneous=self.heterogeneous,
                                 masked_input_grad=self.masked_input_grad)
        scale = tf.constant(self.lora_alpha / self.lora_rank, x2d.dtype)
        return scale * tf.matmul(xa, b)

    def _sparse_tensor_call(self, inputs, training):
        """A rank-2 ``tf.SparseTensor`` input ``[batch, input_dim]``.

        Only the kernel rows of the input's live columns (those holding a
        stored value) are used: the ``U`` live columns are gathered from the
        kernel (``tf.gather``, so the kernel's gradient is a
        ``tf.IndexedSlices`` over those rows, as ``keras.layers.Dense``
        gives through ``tf.nn.embedding_lookup_sparse``), the input is
        scattered into a dense ``[batch, U']`` matrix and multiplied by the
        op like a dense input (bias and activation fused, statistics
        recorded). ``U'`` is ``U`` rounded up to a power of two (at most
        ``input_dim``; the padding columns are zero), so the op's cost model
        sees few distinct problem sizes. Duplicate indices are summed. With
        LoRA the merged kernel is gathered, as Keras multiplies by it.
        Keras' own product was 6-58x slower in forward + backward
        (``benchmarks/bench_dropins.py``): its gradient holds one kernel row
        per stored value.
        """
        kernel = tf.convert_to_tensor(self.kernel)
        dense_shape = tf.cast(inputs.dense_shape, tf.int64)
        values, kernel, out_dtype = self._op_operands(inputs.values, kernel)
        input_dim = kernel.shape[0]
        live, pos = tf.unique(inputs.indices[:, 1], out_idx=tf.int64)
        u = tf.size(live, out_type=tf.int64)
        u_pad = tf.constant(1, tf.int64)
        u_pad = tf.while_loop(lambda p: p < u, lambda p: [p * 2], [u_pad])[0]
        u_pad = tf.minimum(u_pad, tf.cast(input_dim, tf.int64))
        live = tf.pad(live, [[0, u_pad - u]])
        kernel_live = tf.gather(kernel, live)
        x_c = tf.scatter_nd(tf.stack([inputs.indices[:, 0], pos], axis=1),
                            values, tf.stack([dense_shape[0], u_pad]))
        fat = self._bias_fat_relu(out_dtype)
        fused = None if fat is not None else _fused_activation(
            self.activation)
        y = self._split_product(x_c, kernel_live, fused, training,
                                with_bias=fat is None)
        y.set_shape(inputs.shape[:-1].concatenate([self.units]))
        if y.dtype != out_dtype:
            y = tf.cast(y, out_dtype)
        if fat is not None:
            return self._apply_bias_fat_relu(fat, y, training)
        if fused is None:
            y = self.activation(y)
        return y

    # -- serialization ----------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config["heterogeneous"] = self.heterogeneous
        config["masked_input_grad"] = self.masked_input_grad
        return config

    #: Deprecated attribute aliases (utils.deprecation.RenamedAttributes).
    _RENAMED_ATTRIBUTES = {"skip_dead_input_grad": "masked_input_grad"}

    @classmethod
    def from_config(cls, config):
        # Configurations saved before the rename hold skip_dead_input_grad.
        return super().from_config(rename_config_key(
            config, "skip_dead_input_grad", "masked_input_grad"))
