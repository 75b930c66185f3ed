"""``SparseSplitLayer``: the base class of the sparse-split Keras layers.

It holds what every layer whose op splits work by density shares: the
split threshold (a float32 ``tf.Variable`` ``threshold_var`` that a
:class:`~tf_sparse_split.callbacks.SplitThresholdCallback` assigns; not a
Keras weight, so the weight lists equal ``Dense``'s / ``Conv2D``'s), the
per-call statistics variables and their API (:meth:`~SparseSplitLayer.
latest_stats`, :meth:`~SparseSplitLayer.accumulated_stats`,
:meth:`~SparseSplitLayer.reset_stats`), threshold validation, serialization
(``threshold`` in ``get_config``; the weights and then the threshold saved
in order) and the
cost-model hook :meth:`~SparseSplitLayer.split_work_coefficients`.

Requires the TensorFlow backend of Keras 3.
"""

import functools

import keras
import numpy as np
import tensorflow as tf

try:  # Keras 3's call context (where Layer.__call__ keeps `training`)
    from keras.src.backend.common import global_state as _keras_global_state
except ImportError:  # a Keras without it: only an explicit `training` counts
    _keras_global_state = None

from tf_sparse_split.tuning import stats as _stats
from tf_sparse_split.utils.validation import validate_threshold

__all__ = ["SparseSplitLayer", "RECORD_STATS_MODES", "op_dtype_for"]

#: The dtypes every sparse-split op computes in.
_OP_DTYPES = ("float32", "float64")


@functools.lru_cache(maxsize=None)
def _registered_dtypes(op):
    """The names of the dtypes in the ``T`` attr of the registered op
    ``TfSparseSplit>{op}`` (its kernels' dtypes), loading the library."""
    from tensorflow.python.framework import op_def_registry

    from tf_sparse_split._loader import load_library

    load_library()
    op_def = op_def_registry.get(f"TfSparseSplit>{op}")
    if op_def is None:
        return _OP_DTYPES
    for attr in op_def.attr:
        if attr.name == "T":
            return tuple(tf.as_dtype(t).name
                         for t in attr.allowed_values.list.type)
    return _OP_DTYPES


def op_dtype_for(op, compute_dtype):
    """The dtype the op ``op`` (e.g. ``"SparseSplitMatMul"``,
    ``"SparseSplitConv2D"``, ``"BiasFatRelu"``) runs in for a layer whose
    compute dtype is ``compute_dtype``: the compute dtype itself when the
    op has a kernel for it (float32, float64, and bfloat16/float16 for the
    ops registered with them: their kernels keep 16-bit storage and
    accumulate in float32), else float32 (operands cast to float32 and the
    result back, as TensorFlow ops without a 16-bit kernel are used under a
    mixed policy).

    Args:
      op: the op's name without the ``TfSparseSplit>`` prefix.
      compute_dtype: a dtype or its name.

    Returns:
      the dtype's name (str).
    """
    name = tf.as_dtype(compute_dtype).name
    return name if name in _registered_dtypes(op) else "float32"

#: Values of :attr:`SparseSplitLayer.record_stats`.
RECORD_STATS_MODES = ("auto", True, False)


def _keras_call_training():
    """The ``training`` value Keras resolved for the layer call in progress
    (passed explicitly or inherited from the outer model), or None."""
    if _keras_global_state is None:
        return None
    ctx = _keras_global_state.get_global_attribute("current_call_ctx")
    return None if ctx is None else getattr(ctx, "training", None)


def _is_training(training):
    """True for a training call: ``training`` is True (a Python bool or a
    tensor whose value is known at trace time). An unknown symbolic value
    counts as training (the variables may be written)."""
    if training is None:
        return False
    if isinstance(training, (bool, np.bool_)):
        return bool(training)
    value = tf.get_static_value(training)
    return True if value is None else bool(value)


def _check_backend():
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "tf_sparse_split layers need the TensorFlow backend of Keras; the "
            f"current backend is {keras.backend.backend()!r}. Set "
            "KERAS_BACKEND=tensorflow before importing keras.")


class SparseSplitLayer(keras.layers.Layer):
    """Base class of the layers computed by a sparse-split op.

    A concrete layer inherits from it first and from the Keras layer it
    replaces second (``class SparseSplitDense(SparseSplitLayer,
    keras.layers.Dense)``), passes ``threshold`` through to this
    ``__init__`` and, in ``call``, runs its op with
    ``threshold=tf.convert_to_tensor(self.threshold_var)`` and
    ``return_stats=True``, casting its operands with :meth:`_op_operands`
    and handing the statistics vector to :meth:`_record_stats`. It
    overrides :meth:`split_work_coefficients` when its work is not a
    matmul's. ``build`` (here) creates the threshold variable after the
    Keras layer's own weights; it is not a Keras weight, so
    ``get_weights()`` is ``[kernel, (bias,)]`` as for the Keras layer
    replaced and ``set_weights`` takes that layer's list. LoRA is the Keras
    layer's own (``enable_lora``, ``lora_rank``): the list then ends with
    ``lora_kernel_a``, ``lora_kernel_b`` as there, and ``.keras`` files hold
    the merged kernel (:meth:`save_own_variables`).

    Args:
      *args: positional arguments of the Keras layer replaced.
      threshold: initial split threshold: a number in ``[0, 1]``, or
        negative or ``'auto'`` (default -1.0) to let the op choose per call.
      **kwargs: keyword arguments of the Keras layer replaced.

    Attributes:
      threshold_var: the threshold, a non-trainable float32 scalar
        ``tf.Variable`` (None until built); saved in ``.keras`` files, and
        tracked by TensorFlow for SavedModels and checkpoints.
      record_stats: when calls record the op's statistics into the
        statistics variables (a public switch, see "Statistics" below):
        ``"auto"`` (default) in training calls (``training=True``, e.g.
        ``model.fit``) and in eager calls, never in inference graphs;
        ``True`` in every call, inference graphs included (explicitly
        enabled, e.g. to collect statistics during ``model.predict``);
        ``False`` never.

    Statistics: a recording call assigns the latest statistics vector and
    adds it to the running sum (``tf.Variable`` assign ops in a graph).
    Under ``record_stats="auto"`` a graph traced for inference --
    ``model.predict``/``evaluate``, ``model.export``,
    ``tf.saved_model.save``, a ``tf.function`` calling the layer with
    ``training`` False or unset -- holds no variable writes, so an exported
    serving function is free of them (read-only). Eager calls record (they
    build no graph), so ``layer(x); layer.latest_stats()`` works
    interactively.
      supports_jit: False: the ops have no XLA kernels, so Keras does not
        JIT-compile a model holding this layer (docs/ARCHITECTURE.md, "Keras and XLA").

    Raises:
      ValueError: on a bad ``threshold``.
      RuntimeError: if the Keras backend is not TensorFlow.
    """

    def __init__(self, *args, threshold=-1.0, **kwargs):
        _check_backend()
        self._initial_threshold = validate_threshold(threshold)
        super().__init__(*args, **kwargs)
        self.supports_jit = False
        self.threshold_var = None
        self._stats_vars = None
        self.record_stats = "auto"

    #: The ``keras.layers.Dense``/``Conv2D`` arguments the subclasses take
    #: and pass on unchanged (see :meth:`_keras_weight_args`).
    _KERAS_WEIGHT_ARGS = ("activation", "use_bias", "kernel_initializer",
                          "bias_initializer", "kernel_regularizer",
                          "bias_regularizer", "activity_regularizer",
                          "kernel_constraint", "bias_constraint")

    @classmethod
    def _keras_weight_args(cls, arguments):
        """The entries of ``arguments`` (a subclass ``__init__``'s
        ``locals()``) named in :attr:`_KERAS_WEIGHT_ARGS`, as keyword
        arguments for the Keras layer's ``__init__``."""
        return {k: arguments[k] for k in cls._KERAS_WEIGHT_ARGS}

    def build(self, input_shape):
        super().build(input_shape)
        self._build_split_state()

    #: The op the layer runs (its dtypes decide :meth:`_op_operands`'s).
    _SPLIT_OP = "SparseSplitMatMul"

    def _op_operands(self, x, kernel):
        """Casts (inputs, kernel) for the op; returns them and the dtype of
        the layer's output.

        Like ``keras.layers.Dense``, the output has the layer's compute dtype
        (integer or other-float inputs are cast to it first), and under a
        mixed policy (``mixed_bfloat16``, ``mixed_float16``) the float32
        variables arrive autocast to it (Keras casts them inside ``call``).
        The op runs in the compute dtype when it has a kernel for it
        (:func:`op_dtype_for`; bfloat16/float16 storage, float32
        accumulation), else in float32 with the result cast back.
        """
        out_dtype = tf.as_dtype(self.compute_dtype)
        op_dtype = tf.as_dtype(op_dtype_for(self._SPLIT_OP, out_dtype))
        x = tf.convert_to_tensor(x)
        if x.dtype != op_dtype:
            x = tf.cast(x, op_dtype)
        kernel = tf.convert_to_tensor(kernel)
        if kernel.dtype != op_dtype:
            kernel = tf.cast(kernel, op_dtype)
        return x, kernel, out_dtype

    def _build_split_state(self):
        # The threshold is a plain tf.Variable, not a Keras weight: the
        # weight lists (get_weights/set_weights, model.get_weights) are then
        # exactly those of keras.layers.Dense / Conv2D, so weights move
        # between a plain model and its sparse-split copy. TensorFlow tracks
        # it (SavedModel, checkpoints); .keras files store it through
        # save_own_variables/load_own_variables below, at the index it had
        # when it was a weight (files written by 0.1 load unchanged).
        with tf.init_scope():
            self.threshold_var = tf.Variable(
                tf.constant(self._initial_threshold, tf.float32),
                trainable=False, name=f"{self.name}_threshold")
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
        """Flops per unit of work of the two paths, for
        :class:`~tf_sparse_split.tuning.CostModel` (offline fits; the op
        itself writes the same numbers into its statistics' cost entries,
        which the tuner uses).

        The dense path's work is ``ROWS_DENSE * (K - ZERO_COLS_SKIPPED) *
        dense_coef`` and the sparse path's ``NNZ_SPARSE * sparse_coef``
        (statistics of :mod:`tf_sparse_split.tuning.stats`). For a matmul both
        coefficients are ``2 * N``.

        Args:
          stats_vector: one statistics vector (or an average of several).

        Returns:
          ``(dense_coef, sparse_coef)``, floats (flop).
        """
        n = float(np.asarray(stats_vector, dtype=np.float64)[_stats.N])
        return 2.0 * n, 2.0 * n

    @property
    def record_stats(self):
        """When calls record statistics: ``"auto"``, True or False (see the
        class docstring). Set it before tracing (a ``tf.function`` traced
        earlier keeps what it traced).

        Raises:
          ValueError: on setting any other value.
        """
        return self._record_stats_mode

    @record_stats.setter
    def record_stats(self, mode):
        if isinstance(mode, np.bool_):
            mode = bool(mode)
        if not any(mode is m or (isinstance(mode, str) and mode == m)
                   for m in RECORD_STATS_MODES):
            raise ValueError(
                "`record_stats` must be 'auto', True or False. "
                f"Received: record_stats={mode!r}")
        self._record_stats_mode = mode

    def _records_stats(self, training):
        """Whether this call records its statistics (see ``record_stats``).

        ``training``: the call's ``training`` argument, or None to take the
        value Keras resolved for the current call (inherited from the outer
        model's call)."""
        mode = self._record_stats_mode
        if mode is True or mode is False:
            return mode
        if tf.executing_eagerly():
            return True
        if training is None:
            training = _keras_call_training()
        return _is_training(training)

    def _record_stats(self, stats_vec, training=None):
        """Records one call's statistics vector when :meth:`_records_stats`
        says so (no op otherwise: nothing enters the graph)."""
        sv = self._stats_vars
        if sv is None or not self._records_stats(training):
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
        variable, which a compiled training step reads at its next call.
        This is the one way thresholds are written, by users and by
        :class:`~tf_sparse_split.tuning.ThresholdTuner` alike. A number in
        [0, 1] fixes the split (the op's automatic mode is off until a
        negative value or ``'auto'`` is set again); the tuner writes one
        only into layers it tunes (see its "Who decides when").

        Raises:
          ValueError: unless the threshold is in [0, 1], negative or
            ``'auto'`` (NaN, above 1, another string).
        """
        value = validate_threshold(threshold)
        if self.threshold_var is None:
            self._initial_threshold = value
        else:
            self.threshold_var.assign(value)

    # -- statistics -------------------------------------------------------
    def statistics_variables(self):
        """The variables the layer records its op's statistics into, for
        readers that run on the device (a tuner inside ``strategy.run``, an
        exported function), or None before the layer is built.

        Returns:
          None, or an object with the attributes ``latest`` (float64
          ``tf.Variable`` ``[stats.NUM_STATS]``: the latest recorded call's
          vector), ``total`` (float64 ``[stats.NUM_STATS]``: the sum over
          the calls since the last :meth:`reset_stats`) and ``calls``
          (int64 scalar ``tf.Variable``: their number). Read them, do not
          assign them (:meth:`reset_stats` zeroes the sum).
        """
        return self._stats_vars

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
          ``"n"``, ``"heterogeneous"`` and the cost entries (``"k_live"`` ...
          ``"calibrated"``, see :mod:`~tf_sparse_split.tuning.stats`) are
          averages over calls; ``"sparsity"`` is the fraction of
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
            cost = slice(_stats.COST_FIRST, _stats.COST_LAST + 1)
            v[cost] = total[cost] / calls
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

    # -- serialization ----------------------------------------------------
    def get_config(self):
        config = super().get_config()
        config["threshold"] = self.threshold
        return config

    def save_own_variables(self, store):
        """Writes what ``keras.layers.Dense``/``Conv2D`` write -- the kernel
        (with LoRA enabled, merged: ``kernel + lora_alpha / lora_rank *
        lora_kernel_a @ lora_kernel_b``) and the bias if any -- and then
        the threshold, under the next index (the layout of files written
        when the threshold was a weight)."""
        if not self.built:
            return
        weights = [self.kernel] + ([self.bias] if self.bias is not None
                                   else [])
        for i, v in enumerate(weights):
            store[str(i)] = v
        store[str(len(weights))] = self.threshold_var.numpy()

    def load_own_variables(self, store):
        """Reads what :meth:`save_own_variables` wrote; the threshold entry
        is optional (a store with only the Keras weights keeps the current
        threshold). As in Keras, a layer with LoRA enabled loads the
        (merged) kernel into its frozen kernel and zeroes ``lora_kernel_a``
        and ``lora_kernel_b``.

        Raises:
          ValueError: if the store holds a different number of entries.
        """
        if not self.built:
            return
        weights = [self._kernel] + ([self.bias] if self.bias is not None
                                    else [])
        n = len(store.keys())
        if n not in (len(weights), len(weights) + 1):
            raise ValueError(
                f"layer {self.name!r} expects {len(weights)} variables "
                f"(kernel{', bias' if len(weights) > 1 else ''}) and optionally "
                f"the threshold, but the file holds {n}")
        for i, v in enumerate(weights):
            v.assign(store[str(i)])
        if n == len(weights) + 1:
            self.threshold_var.assign(
                np.asarray(store[str(len(weights))], np.float32).reshape(()))
        if getattr(self, "lora_enabled", False):
            self.lora_kernel_a.assign(tf.zeros(self.lora_kernel_a.shape,
                                               self.lora_kernel_a.dtype))
            self.lora_kernel_b.assign(tf.zeros(self.lora_kernel_b.shape,
                                               self.lora_kernel_b.dtype))

    def set_weights(self, weights):
        """Sets ``[kernel, (bias,)]`` (with LoRA enabled, then
        ``lora_kernel_a``, ``lora_kernel_b``) as ``keras.layers.Dense`` /
        ``Conv2D`` do (e.g. ``layer.set_weights(dense.get_weights())``).

        Also accepts the 0.1 list with the threshold appended
        (``[kernel, (bias,), threshold]``), which then sets the threshold.

        Raises:
          ValueError: on a wrong number of arrays or wrong shapes.
        """
        weights = list(weights)
        n = len(self.weights)
        if self.built and len(weights) == n + 1 and \
                np.ndim(weights[-1]) == 0:
            self.set_threshold(float(np.asarray(weights[-1])))
            weights = weights[:-1]
        super().set_weights(weights)


class _StatsVariables(tf.Module):
    """Holds a layer's statistics variables (tracked by TensorFlow so an
    exported function can capture them; invisible to Keras' weight lists)."""

    def __init__(self, latest, total, calls):
        super().__init__(name=None)
        self.latest = latest
        self.total = total
        self.calls = calls
