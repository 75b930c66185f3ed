"""``FATReLU``: the forced-activation-threshold ReLU, with the control values
that :class:`~tf_sparse_split.callbacks.SparsityTargetCallback` drives.

``FATReLU(x) = x if x > T else 0`` (M. Kurtz et al., "Inducing and
Exploiting Activation Sparsity for Fast Inference on Deep Neural Networks",
ICML 2020): a ReLU whose cutoff ``T >= 0`` (the paper's "forced activation
threshold"; called ``cutoff`` here so that it is not confused with the
sparse-split layers' density ``threshold``) zeroes the small positive
activations too, so the layer that consumes its output sees more zeros. The
gradient is 1 where ``x > T`` and 0 elsewhere (the same mask as the output),
so a sparse-split layer after it may skip the input gradient of its zeros
exactly (``SparseSplitDense(masked_input_grad=True)``).

Two optional training-time mechanisms, both off by default and both driven
through non-trainable variables (a compiled ``tf.function`` reads their
current values; a callback changes them with ``.assign()``):

* L1 activity penalty ``l1 * mean(|FATReLU(x)|)`` added to the model's loss
  (``add_loss``) in training: pushes pre-activations below the cutoff so
  that cutting them costs less accuracy (Kurtz et al.; C. Song et al.,
  "ProSparse", 2024, ramp the coefficient up progressively).
* Quantile tracking: with ``target > 0`` each training call estimates the
  ``target``-quantile ``q`` of its input ``x`` on ``sample_size`` values at
  uniformly random positions and moves the cutoff toward it,
  ``T <- max(0, momentum * T + (1 - momentum) * q)``. Below the natural
  sparsity of the ReLU (``q <= 0``) the cutoff stays 0. The output then
  has about a fraction ``target`` of zeros whatever the scale of ``x``.
  An empty input leaves the cutoff unchanged (and adds a zero penalty), as
  does a call whose estimate is not finite (NaN/Inf in the input). With
  ``track_every = k > 1`` only every k-th training call (the first one
  included) estimates and moves the cutoff, with the momentum raised to the
  k-th power, ``T <- momentum**k * T + (1 - momentum**k) * q``, so the
  cutoff follows the quantile at the same rate per call while the other
  calls skip the estimate's ~20 small ops (sampling, selection, update).

Requires the TensorFlow backend of Keras 3.
"""

import keras
import tensorflow as tf

from tf_sparse_split.utils.deprecation import (RenamedAttributes,
                                               rename_config_key,
                                               renamed_kwarg)
from tf_sparse_split.utils.validation import (validate_fraction, validate_int,
                                              validate_nonnegative_float)

__all__ = ["FATReLU", "is_relu_activation"]


def is_relu_activation(fn):
    """True for ``keras.activations.relu`` (the function ``"relu"``
    resolves to); a :class:`FATReLU` is checked separately."""
    return fn is keras.activations.relu


def _penalty_dtype(dtype):
    """The dtype the L1 penalty is summed in: float64 for float64
    activations, else float32 (a float16 activation's sum, and even its
    size, can exceed float16's range; bfloat16 keeps 8 bits of a sum)."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def _fused_op_applies(x):
    """Whether a training call on ``x`` runs the fused ``BiasFatRelu`` op
    (CPU kernels, float32/float64, rank >= 1): not where a GPU is visible,
    whose placement would copy the activation to the host and back."""
    return (x.dtype in (tf.float32, tf.float64) and x.shape.rank is not None
            and x.shape.rank >= 1
            and not tf.config.list_logical_devices("GPU"))


@tf.custom_gradient
def _fat_relu_l1(x, t, l1):
    """``(y, l1 * mean(y))`` with ``y = where(x > t, x, 0)``, ``t >= 0``
    (so ``y >= 0`` and ``|y| = y``), with one fused gradient.

    ``x`` and ``t`` have one dtype; ``l1`` and the penalty are float32
    (float64 for float64 ``x``), the sum accumulated in that dtype.
    TensorFlow's own gradient of ``where`` plus ``l1 * mean(abs(y))`` runs
    about eight element-wise passes over the activation (Abs, Sign, two
    Muls, Tile, AddN and the two Selects); here the backward pass is one
    add and one ``ReluGrad``: ``dx = (dy + dpenalty * l1 / size) * (y > 0)``
    -- the mask ``x > t`` is ``y > 0`` since ``t >= 0`` -- with the
    semantics of ``tf.nn.relu``'s gradient (a NaN/Inf gradient at a masked
    position gives NaN; ``SelectV2`` is 2-3x slower than ``ReluGrad`` on a
    128x28x28x32 activation). The coefficient ``dpenalty * l1 / size`` is
    formed in the penalty's dtype and rounded once to ``x``'s. ``t`` and
    ``l1`` get no gradient (they are controls, not weights).
    """
    mask = x > t
    zero = tf.zeros([], x.dtype)
    y = tf.where(mask, x, zero)
    acc = l1.dtype
    size = tf.cast(tf.maximum(tf.size(x), 1), acc)   # empty x: penalty 0
    penalty = l1 * tf.reduce_sum(tf.cast(y, acc)) / size

    def grad(dy, dpenalty):
        if dpenalty is not None:  # None: the penalty does not reach the loss
            dy = dy + tf.cast(tf.cast(dpenalty, acc) * l1 / size, x.dtype)
        return tf.raw_ops.ReluGrad(gradients=dy, features=y), None, None

    return (y, penalty), grad


def _order_statistic(values, fraction):
    """``sort(values)[floor(fraction * (m - 1))]`` of a float32 vector
    ``[m]`` (``fraction`` a float32 scalar in ``[0, 1]``), without sorting
    it: the minimum of the ``m - i`` largest values (``tf.math.top_k``), or,
    when fewer values lie below index ``i``, minus the minimum of the
    ``i + 1`` largest negated values -- a partial selection of at most half
    of the values (about 4x faster than ``tf.sort`` of 4096 values).
    """
    m = tf.size(values)
    i = tf.cast(tf.floor(fraction * tf.cast(m - 1, tf.float32)), tf.int32)
    below = i + 1 <= m - i
    sign = tf.where(below, tf.constant(-1.0), tf.constant(1.0))
    k = tf.where(below, i + 1, m - i)
    top = tf.math.top_k(sign * values, k, sorted=False).values
    return sign * tf.reduce_min(top)


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class FATReLU(RenamedAttributes, keras.layers.Layer):
    """Forced-activation-threshold ReLU (Kurtz et al., ICML 2020).

    ``output = where(x > cutoff, x, 0)``; same shape and dtype as ``x``.
    Usable as a layer (``keras.Sequential([..., FATReLU(), ...])``) or as
    the ``activation`` of a layer
    (``SparseSplitDense(512, activation=FATReLU())``).

    Args:
      cutoff: initial cutoff ``T >= 0`` (default 0: a plain ReLU); the
        paper's forced activation threshold.
      l1: initial L1 activity-penalty coefficient ``>= 0`` (default 0); in
        training the layer adds ``l1 * mean(|output|)`` to the model's loss.
      target: initial quantile target in ``[0, 1)`` (default 0: off). When
        positive, training calls move the cutoff toward the
        ``target``-quantile of the input (module docstring).
      momentum: in ``[0, 1)`` (default 0.9), the cutoff's exponential
        moving-average momentum under quantile tracking.
      sample_size: int >= 16 (default 4096), values of the input sampled
        (uniformly at random, with replacement) per call for the quantile
        estimate.
      track_every: int >= 1 (default 1), training calls per cutoff update
        under quantile tracking (module docstring); a Python int, read when
        a function is traced.
      threshold: deprecated alias of ``cutoff`` (same meaning; a
        ``DeprecationWarning``, as for the attributes ``threshold`` and
        ``threshold_var`` and ``set_controls(threshold=...)``), removed in
        the next release. Configurations saved with the key ``threshold``
        (``.keras`` files) load without a warning; ``get_config`` writes
        ``cutoff``.
      **kwargs: base ``Layer`` arguments.

    Attributes (non-trainable float32 scalar weights, saved with the model;
    ``get_config`` also stores their current values):
      cutoff_var, l1_var, target_var.

    Dtypes: the output has the input's dtype (the compute dtype under a
    mixed policy, e.g. ``mixed_bfloat16``: the cutoff is compared in it);
    the control variables are float32 and never autocast, and the L1
    penalty and the quantile estimate are computed in float32 (float64 for
    float64 inputs).

    Raises:
      ValueError: on a negative/NaN cutoff or l1, a target or momentum
        outside ``[0, 1)``, a sample_size below 16 or a track_every below
        1.
      TypeError: both ``cutoff`` and ``threshold`` given.
    """

    #: Deprecated attribute aliases (utils.deprecation.RenamedAttributes).
    _RENAMED_ATTRIBUTES = {"threshold": "cutoff",
                           "threshold_var": "cutoff_var"}

    def __init__(self, cutoff=0.0, l1=0.0, target=0.0, momentum=0.9,
                 sample_size=4096, threshold=None, track_every=1, **kwargs):
        # A bad value is named by the argument the caller passed (the old
        # name `threshold` too).
        given = "cutoff" if threshold is None else "threshold"
        cutoff = renamed_kwarg("FATReLU", "threshold", "cutoff", threshold,
                               cutoff, 0.0)
        super().__init__(**kwargs)
        self._init_values = {
            "cutoff": validate_nonnegative_float(cutoff, given),
            "l1": validate_nonnegative_float(l1, "l1"),
            "target": validate_fraction(target, "target"),
        }
        self.momentum = validate_fraction(momentum, "momentum")
        self.sample_size = validate_int(sample_size, "sample_size", 16)
        self.track_every = validate_int(track_every, "track_every", 1)
        self.supports_masking = True
        self.cutoff_var = None
        self.l1_var = None
        self.target_var = None
        self._track_calls = None
        # Scalar state, independent of the input shape: created now so the
        # layer works as another layer's activation and after loading.
        self.build(None)

    def build(self, input_shape=None):
        if self.cutoff_var is not None:
            return
        for key in ("cutoff", "l1", "target"):
            var = self.add_weight(
                name=key, shape=(), dtype="float32", trainable=False,
                autocast=False,
                initializer=keras.initializers.Constant(self._init_values[key]))
            setattr(self, f"{key}_var", var)
        # Training calls so far (for track_every): a plain tf.Variable, not
        # a Keras weight, so the weight list (and .keras files) stay as
        # they are; created outside any function being traced.
        with tf.init_scope():
            self._track_calls = tf.Variable(
                tf.constant(0, tf.int64), trainable=False,
                name=f"{self.name}_track_calls")
        self.built = True

    def compute_output_shape(self, input_shape):
        return input_shape

    # -- control values -----------------------------------------------------
    def _value(self, key):
        var = getattr(self, f"{key}_var")
        return float(var.numpy()) if var is not None else self._init_values[key]

    @property
    def cutoff(self):
        """Current cutoff (Python float)."""
        return self._value("cutoff")

    @property
    def l1(self):
        """Current L1 coefficient (Python float)."""
        return self._value("l1")

    @property
    def target(self):
        """Current quantile target (Python float; 0 = off)."""
        return self._value("target")

    def set_controls(self, cutoff=None, l1=None, target=None,
                     threshold=None):
        """Assigns any of the control values (validated as in ``__init__``;
        ``threshold`` is the deprecated alias of ``cutoff``).

        Raises:
          ValueError: on an invalid value.
          TypeError: both ``cutoff`` and ``threshold`` given.
        """
        cutoff = renamed_kwarg("FATReLU.set_controls", "threshold", "cutoff",
                               threshold, cutoff, None)
        if cutoff is not None:
            self.cutoff_var.assign(
                validate_nonnegative_float(cutoff, "cutoff"))
        if l1 is not None:
            self.l1_var.assign(validate_nonnegative_float(l1, "l1"))
        if target is not None:
            self.target_var.assign(validate_fraction(target, "target"))

    # -- forward -------------------------------------------------------------
    def call(self, inputs, training=False):
        x = tf.convert_to_tensor(inputs)
        # The variable is validated >= 0 wherever this class assigns it; the
        # clamp keeps y >= 0 (so |y| = y below) even after a direct assign.
        t = tf.maximum(tf.cast(tf.convert_to_tensor(self.cutoff_var),
                               x.dtype), tf.zeros([], x.dtype))
        if not training:
            # x > T with T >= 0: also zeroes negatives, i.e. ReLU at T = 0.
            return tf.where(x > t, x, tf.zeros_like(x))
        if _fused_op_applies(x):
            # One pass forward and one backward (the fused op with a zero
            # bias) instead of Greater, SelectV2 and Sum, then AddV2 and
            # ReluGrad: what a plain Keras Conv2D/Dense with this activation
            # (the layer on a model's input) runs in training.
            from tf_sparse_split.ops.fat_relu import bias_fat_relu

            y, total = bias_fat_relu(x, tf.zeros(tf.shape(x)[-1:], x.dtype), t)
            self._add_l1_penalty(x, total)
            self._track_quantile(x)
            return y
        l1 = tf.convert_to_tensor(self.l1_var)
        y, penalty = _fat_relu_l1(x, t,
                                  tf.cast(l1, _penalty_dtype(x.dtype)))
        self.add_loss(tf.cast(penalty, tf.float32))
        self._track_quantile(x)
        return y

    def bias_call(self, x, bias, training=False):
        """``FATReLU(x + bias)`` with the bias broadcast over the last
        dimension, in one pass (:func:`~tf_sparse_split.ops.bias_fat_relu`;
        its gradient is one pass too, with the L1 penalty's and the bias
        gradient folded in). Same value, penalty and cutoff tracking as
        ``self(x + bias, training=training)``; what
        :class:`~tf_sparse_split.layers.SparseSplitConv2D` runs when this
        is its activation.

        Args:
          x: tensor ``[..., C]`` of a dtype
            :func:`~tf_sparse_split.ops.bias_fat_relu` takes (float32,
            float64; bfloat16/float16 where its kernel is registered for
            them).
          bias: ``[C]`` of x's dtype.
          training: as in ``call``.

        Returns:
          ``FATReLU(x + bias)``, x's shape and dtype.
        """
        from tf_sparse_split.ops.fat_relu import bias_fat_relu

        x = tf.convert_to_tensor(x)
        t = tf.maximum(tf.cast(tf.convert_to_tensor(self.cutoff_var),
                               x.dtype), tf.zeros([], x.dtype))
        y, total = bias_fat_relu(x, bias, t)
        if training:
            acc = _penalty_dtype(x.dtype)
            if x.dtype == tf.float16:
                # The op's sum is rounded to float16, whose range (65504)
                # a large activation's sum exceeds: sum y in float32 (its
                # gradient reaches x through y's, the same mask).
                total = tf.reduce_sum(tf.cast(y, acc))
            self._add_l1_penalty(x, total)
            self._track_quantile(x, bias)
        return y

    def _add_l1_penalty(self, x, total):
        """Adds the L1 penalty ``l1 * total / size(x)`` as a float32 loss,
        ``total`` being the sum of the output ``y`` (computed in
        :func:`_penalty_dtype` of x's dtype); ``max(size, 1)``: an empty
        batch has a zero penalty, not 0 / 0."""
        acc = _penalty_dtype(x.dtype)
        l1 = tf.cast(tf.convert_to_tensor(self.l1_var), acc)
        size = tf.cast(tf.maximum(tf.size(x), 1), acc)
        self.add_loss(tf.cast(l1 * tf.cast(total, acc) / size, tf.float32))

    def _track_quantile(self, x, bias=None):
        target = tf.convert_to_tensor(self.target_var)

        def update():
            # The sampled values are gathered in x's dtype and only they are
            # widened to float32 (not all of x: a whole pass over a bfloat16
            # activation for 4096 values).
            flat = tf.reshape(tf.stop_gradient(x), [-1])
            # Uniform random positions: a fixed stride would sample only the
            # units/channels it is not coprime with (e.g. 1 in 64 of the
            # units of a [batch, 2048] activation for a stride of 64).
            idx = tf.random.uniform([self.sample_size], 0, tf.size(flat),
                                    dtype=tf.int32)
            values = tf.cast(tf.gather(flat, idx), tf.float32)
            if bias is not None:  # the pre-activation is x + bias
                b = tf.stop_gradient(tf.cast(bias, tf.float32))
                values = values + tf.gather(b, idx % tf.size(b))
            q = tf.maximum(_order_statistic(values, target), 0.0)
            mom = self.momentum ** self.track_every
            old = tf.convert_to_tensor(self.cutoff_var)
            new = tf.maximum(mom * old + (1.0 - mom) * q, 0.0)
            # A NaN/Inf input can make the sampled quantile NaN: the cutoff
            # keeps its value (a NaN cutoff would zero every later output,
            # as x > NaN is false, and stay NaN through the average).
            new = tf.where(tf.math.is_finite(new), new, old)
            self.cutoff_var.assign(tf.reshape(new, []))
            return tf.constant(True)

        # An empty input (a batch of 0 rows) has no quantile to track.
        due = tf.logical_and(target > 0.0, tf.size(x) > 0)
        if self.track_every > 1:
            calls = self._track_calls.assign_add(
                tf.constant(1, tf.int64), read_value=True)
            due = tf.logical_and(
                due, tf.equal((calls - 1) % self.track_every, 0))
        tf.cond(due, update, lambda: tf.constant(False))

    def get_config(self):
        config = super().get_config()
        config.update({"cutoff": self.cutoff, "l1": self.l1,
                       "target": self.target, "momentum": self.momentum,
                       "sample_size": self.sample_size,
                       "track_every": self.track_every})
        return config

    @classmethod
    def from_config(cls, config):
        # Configurations saved before the rename hold "threshold".
        return super().from_config(rename_config_key(config, "threshold",
                                                     "cutoff"))
