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

from tf_sparse_split.layers.base import SparseSplitLayer
from tf_sparse_split.ops.matmul import sparse_split_matmul

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
class SparseSplitDense(SparseSplitLayer, keras.layers.Dense):
    """``keras.layers.Dense`` computed by ``SparseSplitMatMul``.

    ``output = activation(inputs @ kernel + bias)``, the same as ``Dense``;
    the matmul splits the rows of ``inputs`` by density (see the module
    docstring). The bias and a linear, ``"relu"`` or ``"relu6"`` activation
    run in the op's fused epilogue (one pass over the output rows, as Keras
    ``Dense`` gets TF's fused MatMul + BiasAdd + Relu); other activations
    run after the op (the bias is still fused). Inputs of rank > 2 ``[batch, ..., input_dim]`` are reshaped
    to ``[-1, input_dim]`` for the op and the output back to
    ``[batch, ..., units]``.

    Args:
      units, activation, use_bias, kernel_initializer, bias_initializer,
      kernel_regularizer, bias_regularizer, activity_regularizer,
      kernel_constraint, bias_constraint: as in ``keras.layers.Dense``.
      threshold: float, initial split threshold: in ``[0, 1]`` (rows of the
        input with density = nonzeros / input_dim above it go to the dense
        GEMM, the others to the CSR SpMM; 1.0 = all sparse, 0.0 = all
        nonzero rows dense), or negative (default -1.0) to let the op choose
        per call. Stored as a non-trainable float32 ``tf.Variable``
        ``threshold_var`` (so a compiled ``tf.function`` reads the current
        value; a callback changes it with ``.assign()``) and saved with the
        model; it is not a Keras weight: ``get_weights()`` /
        ``set_weights()`` take ``Dense``'s list ``[kernel, bias]``.
      heterogeneous: bool (default False), passed to the op: on a GPU the
        dense rows run on the GPU while the sparse rows run on the CPU
        (overlapped, K.-Y. Peng, NTU 2017), and the
        :class:`~tf_sparse_split.callbacks.SplitThresholdCallback` picks
        the threshold that balances the two devices' finishing times
        (``CostModel.best_threshold(..., heterogeneous=True)``). Without a
        GPU the op runs the normal CPU split (same results), records
        ``stats.HETERO_CPU_FALLBACK`` and warns once per process
        (``RuntimeWarning``). Saved in ``get_config``.
      skip_dead_input_grad: bool (default False). If True, the gradient for
        the layer's input is computed only where the input is nonzero (0
        elsewhere), by an SDDMM whose cost is proportional to the input's
        nonzeros (``grad_a_live_only`` of
        :func:`~tf_sparse_split.sparse_split_matmul`). Exact only when the
        layer before has zero gradient wherever its output is zero: its
        input is a ReLU or FATReLU output, possibly through dropout,
        max-pooling or a reshape -- the usual ``Dense(relu) -> [dropout] ->
        SparseSplitDense`` stack (:class:`SparsityTargetCallback` sets it on
        the layers it controls). Saved in ``get_config``.
      lora_rank, lora_alpha, quantization_config: accepted for signature
        compatibility with ``Dense`` but must be None: LoRA and quantization
        would replace the kernel the op multiplies by, so they are refused
        with ``NotImplementedError`` rather than silently ignored.
      **kwargs: base ``Layer`` arguments (``name``, ``dtype``, ...).

    Dtypes: the op computes in float32 or float64. With another compute
    dtype (``mixed_float16``, ``mixed_bfloat16``) the matmul runs in float32
    and the result is cast back to the compute dtype.

    Statistics: training calls (and eager calls) record the op's statistics
    vector (``tf_sparse_split.stats``) into two ``tf.Variable`` objects that
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
      ValueError: on a bad ``threshold`` (or bad ``Dense`` arguments).
      NotImplementedError: if LoRA or quantization is requested.
      RuntimeError: if the Keras backend is not TensorFlow.
    """

    _keras_equivalent = "keras.layers.Dense"

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
        skip_dead_input_grad=False,
        **kwargs,
    ):
        if not isinstance(skip_dead_input_grad, (bool, np.bool_)):
            raise ValueError(f"skip_dead_input_grad must be a bool, got "
                             f"{skip_dead_input_grad!r}")
        self.skip_dead_input_grad = bool(skip_dead_input_grad)
        if not isinstance(heterogeneous, (bool, np.bool_)):
            raise ValueError(
                f"heterogeneous must be a bool, got {heterogeneous!r}")
        self.heterogeneous = bool(heterogeneous)
        if lora_rank is not None or lora_alpha is not None:
            raise NotImplementedError(
                "SparseSplitDense does not support LoRA (lora_rank/lora_alpha)"
                "; use keras.layers.Dense for LoRA fine-tuning")
        if quantization_config is not None:
            raise NotImplementedError(
                "SparseSplitDense does not support quantization "
                "(quantization_config); the sparse-split op multiplies "
                "float32/float64 kernels only")
        super().__init__(units, threshold=threshold,
                         **self._keras_weight_args(locals()), **kwargs)

    # -- building ---------------------------------------------------------
    def build(self, input_shape):
        if self.quantization_mode is not None:
            raise NotImplementedError(
                "SparseSplitDense does not support quantization (dtype "
                f"policy {self.dtype_policy.name!r})")
        super().build(input_shape)

    # -- refused features -------------------------------------------------
    def quantize(self, *args, **kwargs):
        """Not supported: raises NotImplementedError."""
        raise NotImplementedError(
            "SparseSplitDense does not support quantization; use "
            "keras.layers.Dense")

    # -- forward ----------------------------------------------------------
    def call(self, inputs, training=None):
        x = inputs
        if isinstance(x, tf.SparseTensor):
            x = tf.sparse.to_dense(x)
        x, kernel, out_dtype = self._op_operands(x, self.kernel)
        input_dim = kernel.shape[0]
        rank = x.shape.rank
        if rank == 2:
            x2d = x
        else:
            x2d = tf.reshape(x, [-1, input_dim])
        fused = _fused_activation(self.activation)
        bias = None
        if self.bias is not None:
            bias = tf.convert_to_tensor(self.bias)
            if bias.dtype != x2d.dtype:
                bias = tf.cast(bias, x2d.dtype)
        y, stats_vec = sparse_split_matmul(
            x2d, kernel, threshold=tf.convert_to_tensor(self.threshold_var),
            return_stats=True, heterogeneous=self.heterogeneous,
            grad_a_live_only=self.skip_dead_input_grad, bias=bias,
            activation=fused or "none",
            full_stats=self._records_stats(training))
        self._record_stats(stats_vec, training)
        if rank != 2:
            out_shape = tf.concat([tf.shape(x)[:-1], [self.units]], axis=0)
            y = tf.reshape(y, out_shape)
            y.set_shape(x.shape[:-1].concatenate([self.units]))
        if y.dtype != out_dtype:
            y = tf.cast(y, out_dtype)
        if fused is None:
            y = self.activation(y)
        return y

    # -- serialization ----------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config["heterogeneous"] = self.heterogeneous
        config["skip_dead_input_grad"] = self.skip_dead_input_grad
        return config
