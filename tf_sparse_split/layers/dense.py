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

import math

import keras
import numpy as np
import tensorflow as tf

from tf_sparse_split import stats as _stats

__all__ = ["SparseSplitDense", "SplitLayerMixin", "validate_threshold"]

_OP_DTYPES = ("float32", "float64")


def validate_threshold(threshold):
    """Checks a split threshold and returns it as a Python float.

    Args:
      threshold: a number in ``[0, 1]`` (rows with density above it go
        dense, the others sparse), or negative for "automatic" (the op picks
        the split itself).

    Returns:
      ``float(threshold)``.

    Raises:
      ValueError: if it is not a real number, is NaN, or is above 1.
    """
    if isinstance(threshold, bool):
        raise ValueError(f"threshold must be a number, got {threshold!r}")
    try:
        value = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(
            f"threshold must be a number in [0, 1] or negative (automatic), "
            f"got {threshold!r}") from None
    if math.isnan(value) or value > 1.0:
        raise ValueError(
            f"threshold must be in [0, 1] or negative (automatic), got "
            f"{threshold!r}")
    return value


def _check_backend():
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "tf_sparse_split layers need the TensorFlow backend of Keras; the "
            f"current backend is {keras.backend.backend()!r}. Set "
            "KERAS_BACKEND=tensorflow before importing keras.")




class SplitLayerMixin:
    """Threshold weight, per-call statistics and cost-model hooks shared by
    the sparse-split Keras layers (:class:`SparseSplitDense`,
    :class:`~tf_sparse_split.conv_layers.SparseSplitConv2D`).

    A layer using it calls :meth:`_init_split_state` at the end of its
    ``__init__`` (after setting ``self._initial_threshold``), then
    :meth:`_build_split_state` in ``build`` and :meth:`_record_stats` with
    the op's statistics vector in ``call``. It may override
    :meth:`split_work_coefficients` when its work is not a matmul's.
    """

    def _init_split_state(self):
        self.supports_jit = False
        self.threshold_var = None
        self._stats_vars = None
        # Whether calls record the op's statistics (False for graphs that
        # cannot update variables, e.g. frozen for profiling).
        self.record_stats = True

    def _op_operands(self, x, kernel):
        """Casts (inputs, kernel) for the op; returns them and the dtype of
        the layer's output.

        Like ``keras.layers.Dense``, the output has the layer's compute dtype
        (integer or other-float inputs are cast to it first). The op computes
        in float32 or float64; other compute dtypes (``mixed_float16``, ...)
        run it in float32 and cast the result back.
        """
        out_dtype = tf.as_dtype(self.compute_dtype)
        op_dtype = out_dtype if out_dtype.name in _OP_DTYPES else tf.float32
        x = tf.convert_to_tensor(x)
        if x.dtype != op_dtype:
            x = tf.cast(x, op_dtype)
        kernel = tf.convert_to_tensor(kernel)
        if kernel.dtype != op_dtype:
            kernel = tf.cast(kernel, op_dtype)
        return x, kernel, out_dtype

    def _build_split_state(self):
        self.threshold_var = self.add_weight(
            name="threshold",
            shape=(),
            dtype="float32",
            initializer=keras.initializers.Constant(self._initial_threshold),
            trainable=False,
            autocast=False,
        )
        # Statistics: plain tf.Variables, not Keras weights. Created outside
        # any tf.function being traced.
        with tf.init_scope():
            zeros = tf.zeros([_stats.NUM_STATS], tf.float64)
            self._stats_vars = _StatsVariables(
                latest=tf.Variable(zeros, trainable=False,
                                   name=f"{self.name}_stats_latest"),
                total=tf.Variable(zeros, trainable=False,
                                  name=f"{self.name}_stats_sum"),
                calls=tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                  name=f"{self.name}_stats_calls"),
            )

    # -- cost model -------------------------------------------------------
    def split_work_coefficients(self, stats_vector):
        """Flops per unit of work of the two paths, for the cost model.

        The dense path's work is ``ROWS_DENSE * (K - ZERO_COLS_SKIPPED) *
        dense_coef`` and the sparse path's ``NNZ_SPARSE * sparse_coef``
        (statistics of :mod:`tf_sparse_split.stats`). For a matmul both
        coefficients are ``2 * N``.

        Args:
          stats_vector: one statistics vector (or an average of several).

        Returns:
          ``(dense_coef, sparse_coef)``, floats (flop).
        """
        n = float(np.asarray(stats_vector, dtype=np.float64)[_stats.N])
        return 2.0 * n, 2.0 * n

    def _record_stats(self, stats_vec):
        sv = self._stats_vars
        if sv is None or not self.record_stats:
            return
        stats_vec = tf.cast(stats_vec, tf.float64)
        sv.latest.assign(stats_vec)
        sv.total.assign_add(stats_vec)
        sv.calls.assign_add(tf.constant(1, tf.int64))

    # -- threshold --------------------------------------------------------
    @property
    def threshold(self):
        """Current split threshold (Python float; negative = automatic)."""
        if self.threshold_var is None:
            return self._initial_threshold
        return float(np.asarray(self.threshold_var.numpy()))

    def set_threshold(self, threshold):
        """Sets the split threshold (validated as in the constructor).

        Works before and after the layer is built; after, it assigns the
        weight, which a compiled training step reads at its next call.

        Raises:
          ValueError: if the threshold is not in [0, 1] or negative.
        """
        value = validate_threshold(threshold)
        if self.threshold_var is None:
            self._initial_threshold = value
        else:
            self.threshold_var.assign(value)

    # -- statistics -------------------------------------------------------
    def _require_stats(self):
        if self._stats_vars is None:
            raise RuntimeError(
                f"layer {self.name!r} is not built yet: call it on an input "
                "before reading its statistics")
        return self._stats_vars

    def latest_stats_vector(self):
        """The op's statistics vector of the latest call (float64 numpy
        ``[stats.NUM_STATS]``; zeros before the first call).

        Raises:
          RuntimeError: if the layer is not built.
        """
        return self._require_stats().latest.numpy().copy()

    def latest_stats(self):
        """The latest call's statistics as ``stats.as_dict`` gives them
        (counts, times in seconds, ``"histogram"``, ``"sparsity"``).

        Raises:
          RuntimeError: if the layer is not built.
        """
        return _stats.as_dict(self.latest_stats_vector())

    def accumulated_stats_vector(self):
        """``(sum, calls)``: the element-wise sum of the statistics vectors
        of all calls since the last reset (float64 numpy), and their number.

        Raises:
          RuntimeError: if the layer is not built.
        """
        sv = self._require_stats()
        return sv.total.numpy().copy(), int(sv.calls.numpy())

    def accumulated_stats(self):
        """Statistics summed over the calls since the last reset.

        Returns:
          dict with the keys of ``stats.as_dict``: counts (rows, nnz, skipped
          columns, ``m``) and times (seconds) are sums over calls and
          ``"histogram"`` sums the row counts; ``"threshold"``, ``"k"``,
          ``"n"`` and ``"heterogeneous"`` are averages over calls; ``"sparsity"`` is the fraction of
          zeros over all rows seen (``nan`` without calls); plus
          ``"calls"``, the number of calls.

        Raises:
          RuntimeError: if the layer is not built.
        """
        total, calls = self.accumulated_stats_vector()
        v = total.copy()
        if calls > 0:
            for i in (_stats.THRESHOLD, _stats.K, _stats.N,
                      _stats.HETEROGENEOUS):
                v[i] = total[i] / calls
        out = _stats.as_dict(v)
        out["calls"] = calls
        return out

    def reset_stats(self):
        """Zeroes the accumulated statistics and the call count (the latest
        vector is kept).

        Raises:
          RuntimeError: if the layer is not built.
        """
        sv = self._require_stats()
        sv.total.assign(tf.zeros([_stats.NUM_STATS], tf.float64))
        sv.calls.assign(0)


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class SparseSplitDense(SplitLayerMixin, keras.layers.Dense):
    """``keras.layers.Dense`` computed by ``SparseSplitMatMul``.

    ``output = activation(inputs @ kernel + bias)``, the same as ``Dense``;
    the matmul splits the rows of ``inputs`` by density (see the module
    docstring). Inputs of rank > 2 ``[batch, ..., input_dim]`` are reshaped
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
        per call. Stored as a non-trainable float32 Keras weight
        ``threshold_var`` (so a compiled ``tf.function`` reads the current
        value; a callback changes it with ``.assign()``) and saved with the
        model.
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
        the layer's input is computed only for input units that are not zero
        in the whole batch (0 for the others), a GEMM that shrinks with the
        dead/dropped units. Exact only when the layer before zeroes the
        gradient of those units anyway: its input is a ReLU output, or an
        ``ApproximateRandomDropout`` (row pattern) output of a ReLU output
        -- the usual ``Dense(relu) -> [dropout] -> SparseSplitDense`` stack.
        Saved in ``get_config``.
      lora_rank, lora_alpha, quantization_config: accepted for signature
        compatibility with ``Dense`` but must be None: LoRA and quantization
        would replace the kernel the op multiplies by, so they are refused
        with ``NotImplementedError`` rather than silently ignored.
      **kwargs: base ``Layer`` arguments (``name``, ``dtype``, ...).

    Dtypes: the op computes in float32 or float64. With another compute
    dtype (``mixed_float16``, ``mixed_bfloat16``) the matmul runs in float32
    and the result is cast back to the compute dtype.

    Statistics: every call records the op's statistics vector
    (``tf_sparse_split.stats``) into two ``tf.Variable`` objects that are not
    Keras weights (``get_weights()`` is ``[kernel, bias, threshold]``, or
    ``[kernel, threshold]`` without bias): the latest vector, and the sum
    since the last :meth:`reset_stats` with the number of calls. Under
    ``tf.function`` (``model.fit``, ``model.predict``) they are updated with
    assign ops. Read them with :meth:`latest_stats` and
    :meth:`accumulated_stats`.

    XLA: the op has no XLA kernel, so ``supports_jit`` is False and Keras
    does not JIT-compile a model holding this layer (DESIGN.md, "Keras and
    XLA").

    Raises:
      ValueError: on a bad ``threshold`` (or bad ``Dense`` arguments).
      NotImplementedError: if LoRA or quantization is requested.
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
        skip_dead_input_grad=False,
        **kwargs,
    ):
        _check_backend()
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
        self._initial_threshold = validate_threshold(threshold)
        super().__init__(
            units,
            activation=activation,
            use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            **kwargs,
        )
        self._init_split_state()

    # -- building ---------------------------------------------------------
    def build(self, input_shape):
        if self.quantization_mode is not None:
            raise NotImplementedError(
                "SparseSplitDense does not support quantization (dtype "
                f"policy {self.dtype_policy.name!r})")
        super().build(input_shape)
        self._build_split_state()

    # -- refused features -------------------------------------------------
    def enable_lora(self, *args, **kwargs):
        """Not supported: raises NotImplementedError."""
        raise NotImplementedError(
            "SparseSplitDense does not support LoRA; use keras.layers.Dense")

    def quantize(self, *args, **kwargs):
        """Not supported: raises NotImplementedError."""
        raise NotImplementedError(
            "SparseSplitDense does not support quantization; use "
            "keras.layers.Dense")

    # -- forward ----------------------------------------------------------
    def call(self, inputs, training=None):
        from tf_sparse_split.ops import sparse_split_matmul

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
        y, stats_vec = sparse_split_matmul(
            x2d, kernel, threshold=tf.convert_to_tensor(self.threshold_var),
            return_stats=True, heterogeneous=self.heterogeneous,
            grad_a_live_only=self.skip_dead_input_grad)
        self._record_stats(stats_vec)
        if rank != 2:
            out_shape = tf.concat([tf.shape(x)[:-1], [self.units]], axis=0)
            y = tf.reshape(y, out_shape)
            y.set_shape(x.shape[:-1].concatenate([self.units]))
        if y.dtype != out_dtype:
            y = tf.cast(y, out_dtype)
        if self.bias is not None:
            y = tf.nn.bias_add(y, tf.cast(self.bias, y.dtype))
        if self.activation is not None:
            y = self.activation(y)
        return y

    # -- serialization ----------------------------------------------------
    def get_config(self):
        config = super().get_config()
        for key in ("lora_rank", "lora_alpha"):
            config.pop(key, None)
        config["threshold"] = self.threshold
        config["heterogeneous"] = self.heterogeneous
        config["skip_dead_input_grad"] = self.skip_dead_input_grad
        return config

    def save_own_variables(self, store):
        # Dense's version writes only kernel and bias; ours writes every
        # weight in order (kernel, [bias], threshold). LoRA and quantization,
        # which Dense's version handles, are refused by this layer.
        keras.layers.Layer.save_own_variables(self, store)

    def load_own_variables(self, store):
        keras.layers.Layer.load_own_variables(self, store)


class _StatsVariables(tf.Module):
    """Holds a layer's statistics variables (tracked by TensorFlow so an
    exported function can capture them; invisible to Keras' weight lists)."""

    def __init__(self, latest, total, calls):
        super().__init__(name=None)
        self.latest = latest
        self.total = total
        self.calls = calls
