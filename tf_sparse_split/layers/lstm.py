"""``SparseSplitLSTM``: ``keras.layers.LSTM`` whose dropout drops whole units,
so the dropped units are compacted out of every per-step product.

Z. Song et al., "DNN Training Acceleration via Exploring GPGPU Friendly
Sparsity" (arXiv 2203.05705) apply approximate random dropout -- regular
row/tile patterns instead of element-wise random masks -- to LSTMs and
report 1.24-1.85x faster LSTM training at dropout rates 0.3-0.7.

How the compaction works. Keras draws one dropout mask per batch for the
inputs and one for the recurrent state and holds both over all time steps.
Here a *row* pattern (:mod:`tf_sparse_split.layers.dropout`, "Pattern
definitions") drops the same units for every example and every step, so a
dropped unit is zero in every per-step product. Once per batch the layer
gathers the kept rows of ``kernel`` and ``recurrent_kernel`` (scaled by the
pattern's ``1 / (1 - realized rate)``) and runs

* the input product for all steps as one GEMM
  ``x[:, :, kept_in] @ (s_in * kernel[kept_in])`` (the input mask is fixed
  over the steps, so nothing depends on the recurrence), and
* per step ``h[:, kept_rec] @ (s_rec * recurrent_kernel[kept_rec])``,

which is exact: the same values as masking and multiplying by the full
matrices, to float rounding. The backward pass differentiates the same
compacted products, so the input, recurrent and weight gradients shrink
with them (the gathers' gradients scatter into the kept rows only). The
operands are dense after compaction (the LSTM state is a tanh product, not
sparse), so the products use TensorFlow's GEMM; ``sparse_split_matmul`` would
not pay here.

``pattern="tile"`` uses tile masks (blocks of ``[batch, units]``): exact
semantics, no compaction (no unit is zero for the whole batch), so no
speed-up. ``pattern="random"`` uses Keras' own element-wise masks and Keras'
own loop: with the same ``seed`` the layer equals ``keras.layers.LSTM``
bit for bit, as it does with ``dropout = recurrent_dropout = 0`` (any
pattern) and at inference.

Requires the TensorFlow backend of Keras 3.
"""

import keras
import tensorflow as tf

from tf_sparse_split.layers.dropout import pattern_keep_mask
from tf_sparse_split.tuning.pattern_search import (check_tile_fits,
                                                   check_tile_shape,
                                                   search_pattern_distribution)
from tf_sparse_split.utils.validation import validate_int

__all__ = ["SparseSplitLSTM", "SparseSplitLSTMCell", "LSTM_PATTERNS"]

#: Values of ``pattern``.
LSTM_PATTERNS = ("row", "tile", "random")


def _check_pattern(pattern):
    if pattern not in LSTM_PATTERNS:
        raise ValueError(f"`pattern` must be one of {LSTM_PATTERNS}. "
                         f"Received: pattern={pattern!r}")
    return pattern


def _first(mask):
    """Keras' cell keeps four masks (one per gate) when implementation=1
    (forced by recurrent dropout); the pattern masks are the same four."""
    return mask[0] if isinstance(mask, (list, tuple)) else mask


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class SparseSplitLSTMCell(keras.layers.LSTMCell):
    """``keras.layers.LSTMCell`` with row/tile-pattern dropout masks.

    Same arguments as ``keras.layers.LSTMCell`` plus ``pattern``,
    ``tile_shape`` and ``max_period`` (see :class:`SparseSplitLSTM`). The
    masks are drawn once per batch (Keras caches them over the steps) from
    a distribution found by
    :func:`~tf_sparse_split.search_pattern_distribution`, so every unit is
    dropped with probability ``dropout`` (``recurrent_dropout``); kept
    values are scaled by ``1 / (1 - realized rate)``, so ``E[mask] = 1``
    per unit. Row masks are ``[1, dim]``, tile masks ``[batch, dim]``.
    Unlike Keras' random masks (one per gate when ``implementation=1``,
    which Keras forces for ``recurrent_dropout > 0``), the four gates share
    one pattern: a dropped unit is then absent from all four gate products,
    which is what lets the layer compact it away (Song et al.).
    """

    def __init__(self, units, pattern="row", tile_shape=None, max_period=8,
                 **kwargs):
        self.pattern = _check_pattern(pattern)
        if pattern == "tile":
            self.tile_shape = check_tile_shape(
                (32, 32) if tile_shape is None else tile_shape)
        else:
            if tile_shape is not None:
                raise ValueError("`tile_shape` is only used with "
                                 f"pattern='tile'. Received: tile_shape="
                                 f"{tile_shape!r}")
            self.tile_shape = None
        self.max_period = validate_int(max_period, "max_period", 2)
        super().__init__(units, **kwargs)
        self._distributions = {}

    def build(self, input_shape):
        super().build(input_shape)
        if self.pattern == "random":
            return
        seed = 0 if self.seed is None else int(self.seed)
        for key, rate, dim in (("input", self.dropout, int(input_shape[-1])),
                               ("recurrent", self.recurrent_dropout,
                                self.units)):
            if not rate > 0:
                continue
            if self.pattern == "tile":
                try:
                    check_tile_fits(self.tile_shape, dim)
                except ValueError as e:
                    raise ValueError(f"{key} dropout of {self.name!r}: {e}; "
                                     "choose tile_shape accordingly") from None
            dist = search_pattern_distribution(
                rate, dim, pattern=self.pattern, max_period=self.max_period,
                tile_shape=self.tile_shape, seed=seed)
            self._distributions[key] = (dist, dim)

    def pattern_distribution(self, which="recurrent"):
        """The :class:`~tf_sparse_split.PatternDistribution` of the
        ``"input"`` or ``"recurrent"`` dropout (None if that rate is 0 or
        ``pattern="random"``)."""
        entry = self._distributions.get(which)
        return entry[0] if entry else None

    def _pattern_mask(self, which, step_input):
        dist, dim = self._distributions[which]
        x = tf.convert_to_tensor(step_input)
        keep = pattern_keep_mask(dist.patterns, dist.probabilities, dim,
                                 self.seed_generator, pattern=self.pattern,
                                 tile_shape=self.tile_shape,
                                 batch_size=tf.shape(x)[0])
        mask = keep * tf.math.divide_no_nan(1.0, tf.reduce_mean(keep))
        mask = tf.cast(mask, x.dtype)
        count = getattr(self, "dropout_mask_count", None)
        return mask if count is None else [mask] * count

    def get_dropout_mask(self, step_input):
        if self.pattern == "random":
            return super().get_dropout_mask(step_input)
        if getattr(self, "_dropout_mask", None) is None and self.dropout > 0:
            self._dropout_mask = self._pattern_mask("input", step_input)
        return getattr(self, "_dropout_mask", None)

    def get_recurrent_dropout_mask(self, step_input):
        if self.pattern == "random":
            return super().get_recurrent_dropout_mask(step_input)
        if getattr(self, "_recurrent_dropout_mask", None) is None and \
                self.recurrent_dropout > 0:
            self._recurrent_dropout_mask = self._pattern_mask("recurrent",
                                                              step_input)
        return getattr(self, "_recurrent_dropout_mask", None)

    def get_config(self):
        config = super().get_config()
        config.update({"pattern": self.pattern,
                       "tile_shape": (list(self.tile_shape) if self.tile_shape
                                      else None),
                       "max_period": self.max_period})
        return config


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class SparseSplitLSTM(keras.layers.LSTM):
    """Drop-in for ``keras.layers.LSTM`` with compacting pattern dropout.

    Same constructor arguments, call arguments, weights (``kernel``
    ``[input_dim, 4*units]``, ``recurrent_kernel`` ``[units, 4*units]``,
    ``bias`` ``[4*units]``, gate order i, f, c, o) and serialization as
    ``keras.layers.LSTM``, plus:

    Args:
      pattern: ``"row"`` (default; whole units dropped for the batch and
        every step, compacted out of the products: module docstring),
        ``"tile"`` (tile masks, no compaction) or ``"random"`` (Keras'
        element-wise masks; equals ``keras.layers.LSTM`` with the same seed).
      tile_shape: ``(batch_rows, units)`` tile for ``pattern="tile"``
        (default ``(32, 32)``); its units must divide both the input
        features (if ``dropout > 0``) and ``units`` (if
        ``recurrent_dropout > 0``).
      max_period: largest pattern period the search considers (>= 2,
        default 8).

    The compacted loop runs in training with ``pattern="row"`` or
    ``"tile"`` and a nonzero dropout rate, without a time mask and without
    ``unroll``; every other case (inference, masks,
    ``unroll=True``, ``pattern="random"``) runs Keras' own loop with this
    layer's masks. ``go_backwards``, ``return_sequences``, ``return_state``,
    ``stateful`` and initial states work in both.

    ``supports_jit`` is False (the kept-unit count is data dependent).

    Raises:
      ValueError: bad ``pattern``, ``tile_shape`` or ``max_period``, a tile
        not dividing the dimension it drops, or bad ``LSTM`` arguments.
    """

    def __init__(self, units, activation="tanh",
                 recurrent_activation="sigmoid", use_bias=True,
                 kernel_initializer="glorot_uniform",
                 recurrent_initializer="orthogonal", bias_initializer="zeros",
                 unit_forget_bias=True, kernel_regularizer=None,
                 recurrent_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, kernel_constraint=None,
                 recurrent_constraint=None, bias_constraint=None,
                 dropout=0.0, recurrent_dropout=0.0, seed=None,
                 return_sequences=False, return_state=False,
                 go_backwards=False, stateful=False, unroll=False,
                 use_cudnn="auto", pattern="row", tile_shape=None,
                 max_period=8, **kwargs):
        cell = SparseSplitLSTMCell(
            units, pattern=pattern, tile_shape=tile_shape,
            max_period=max_period, activation=activation,
            recurrent_activation=recurrent_activation, use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            unit_forget_bias=unit_forget_bias,
            recurrent_initializer=recurrent_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            recurrent_regularizer=recurrent_regularizer,
            bias_regularizer=bias_regularizer,
            kernel_constraint=kernel_constraint,
            recurrent_constraint=recurrent_constraint,
            bias_constraint=bias_constraint, dropout=dropout,
            recurrent_dropout=recurrent_dropout,
            dtype=kwargs.get("dtype", None),
            trainable=kwargs.get("trainable", True), name="lstm_cell",
            seed=seed, implementation=kwargs.pop("implementation", 2))
        # keras.layers.LSTM.__init__ would build its own LSTMCell: run the
        # RNN constructor with ours and repeat LSTM's own checks.
        keras.layers.RNN.__init__(
            self, cell, return_sequences=return_sequences,
            return_state=return_state, go_backwards=go_backwards,
            stateful=stateful, unroll=unroll,
            activity_regularizer=activity_regularizer, **kwargs)
        self.input_spec = keras.layers.InputSpec(ndim=3)
        if use_cudnn not in ("auto", True, False):
            raise ValueError(
                "Invalid valid received for argument `use_cudnn`. Expected "
                f"one of {{'auto', True, False}}. Received: use_cudnn="
                f"{use_cudnn}")
        self.use_cudnn = use_cudnn
        self.supports_jit = False

    @property
    def pattern(self):
        return self.cell.pattern

    def _use_compacted_loop(self, mask, training):
        cell = self.cell
        return bool(training) and cell.pattern != "random" and (
            cell.dropout > 0 or cell.recurrent_dropout > 0) and \
            mask is None and not self.unroll

    def inner_loop(self, sequences, initial_state, mask, training=False):
        if isinstance(mask, (list, tuple)):
            mask = mask[0]
        if not self._use_compacted_loop(mask, training):
            return super().inner_loop(sequences, initial_state, mask=mask,
                                      training=training)
        return self._compacted_loop(sequences, initial_state)

    def _compacted_loop(self, sequences, initial_state):
        cell = self.cell
        units = cell.units
        x = tf.convert_to_tensor(sequences)
        dtype = x.dtype
        h0 = tf.convert_to_tensor(initial_state[0])
        c0 = tf.convert_to_tensor(initial_state[1])
        kernel = tf.cast(tf.convert_to_tensor(cell.kernel), dtype)
        rkernel = tf.cast(tf.convert_to_tensor(cell.recurrent_kernel), dtype)
        bias = (tf.cast(tf.convert_to_tensor(cell.bias), dtype)
                if cell.use_bias else None)
        row = cell.pattern == "row"

        # Units in the loop are kept in the order ``perm``: with row
        # recurrent dropout the kept units first, so each step's compacted
        # state is a column prefix of h (a slice, not a gather); outputs are
        # put back in order at the end. Gate columns are reordered to
        # (i, f, o, c) so one sigmoid covers the three sigmoid gates.
        perm = n_kept = None
        rdp = None
        if cell.recurrent_dropout > 0:
            rdp = _first(cell.get_recurrent_dropout_mask(h0))
            if row:
                keep = rdp[0] > 0
                kept_r = tf.where(keep)[:, 0]
                perm = tf.concat([kept_r, tf.where(tf.logical_not(keep))[:, 0]],
                                 0)
                n_kept = tf.size(kept_r)
        unit_order = (perm if perm is not None
                      else tf.range(units, dtype=tf.int64))
        cols = tf.concat([unit_order + g * units for g in (0, 1, 3, 2)], 0)
        kernel = tf.gather(kernel, cols, axis=1)
        rkernel = tf.gather(rkernel, cols, axis=1)
        if bias is not None:
            bias = tf.gather(bias, cols)
        if perm is not None:
            h0 = tf.gather(h0, perm, axis=1)
            c0 = tf.gather(c0, perm, axis=1)

        # Input product of all steps at once, on the kept input features.
        if cell.dropout > 0:
            dp = _first(cell.get_dropout_mask(x[:, 0, :]))
            if row:
                kept = tf.where(dp[0] > 0)[:, 0]
                x = tf.gather(x, kept, axis=2)
                kernel = tf.gather(kernel, kept) * tf.reduce_max(dp)
            else:
                x = x * dp[:, None, :]
        if self.go_backwards:
            x = tf.reverse(x, [1])
        xt = tf.transpose(x, [1, 0, 2])                       # [T, B, F']
        steps, batch = tf.shape(xt)[0], tf.shape(xt)[1]
        zx = tf.matmul(tf.reshape(xt, [steps * batch, -1]), kernel)
        if bias is not None:
            zx = zx + bias
        # Read per step from a TensorArray: slicing the [T, B, 4U] tensor
        # inside the loop would make every step's gradient a full-size
        # tensor (O(T^2) memory traffic in the backward pass).
        zx = tf.TensorArray(dtype, size=steps).unstack(
            tf.reshape(zx, [steps, batch, 4 * units]))

        # Recurrent product on the kept units of the state.
        if perm is not None:
            r_c = tf.gather(rkernel, kept_r) * tf.reduce_max(rdp)

            def recurrent(h):
                return tf.matmul(h[:, :n_kept], r_c)
        elif rdp is not None:   # tile masks
            rdp = tf.gather(rdp, unit_order, axis=1)

            def recurrent(h):
                return tf.matmul(h * rdp, rkernel)
        else:
            def recurrent(h):
                return tf.matmul(h, rkernel)

        act, rec_act = cell.activation, cell.recurrent_activation
        keep_all = self.return_sequences
        out_ta = tf.TensorArray(dtype, size=steps if keep_all else 1)

        def body(t, h, c, ta):
            z = zx.read(t) + recurrent(h)
            i, f, o = tf.split(rec_act(z[:, :3 * units]), 3, axis=1)
            c = f * c + i * act(z[:, 3 * units:])
            h = o * act(c)
            if keep_all:
                ta = ta.write(t, h)
            return t + 1, h, c, ta

        _, h, c, out_ta = tf.while_loop(
            lambda t, *_: t < steps, body, (tf.constant(0), h0, c0, out_ta),
            maximum_iterations=steps)
        if perm is not None:
            inv = tf.math.invert_permutation(perm)
            h = tf.gather(h, inv, axis=1)
            c = tf.gather(c, inv, axis=1)
        if keep_all:
            outputs = tf.transpose(out_ta.stack(), [1, 0, 2])
            if perm is not None:
                outputs = tf.gather(outputs, inv, axis=2)
        else:
            outputs = h[:, None, :]
        return h, outputs, [h, c]

    def get_config(self):
        config = super().get_config()
        config.update({"pattern": self.cell.pattern,
                       "tile_shape": (list(self.cell.tile_shape)
                                      if self.cell.tile_shape else None),
                       "max_period": self.cell.max_period})
        return config
