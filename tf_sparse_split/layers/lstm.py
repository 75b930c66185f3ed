"""``SparseSplitLSTM``: ``keras.layers.LSTM`` whose dropout drops whole units,
so the dropped units can be compacted out of every per-step product (where
that pays: "When compaction pays"), in a loop of its own with fused gate
ops.

Z. Song et al., "DNN Training Acceleration via Exploring GPGPU Friendly
Sparsity" (arXiv 2203.05705) apply approximate random dropout -- regular
row/tile patterns instead of element-wise random masks -- to LSTMs and
report 1.24-1.85x faster LSTM training at dropout rates 0.3-0.7.

How the compaction works. Keras draws one dropout mask per batch for the
inputs and one for the recurrent state and holds both over all time steps.
Here the recurrent mask drops the same units for every example of a
*group* and every step, so a dropped unit is zero in every per-step
product of that group. The batch is split into ``pattern_groups`` groups
``G`` of consecutive examples (example ``b`` in group ``b // ceil(batch /
G)``; a batch that ``G`` does not divide is padded with zero examples
inside the layer). Once per batch each group's kept rows of
``recurrent_kernel`` (and, with ``pattern="row"``, of ``kernel``) are
gathered (scaled by the group's ``1 / (1 - realized rate)``), and the layer
runs

* the input product for all steps as one GEMM (``pattern="row"``: one
  batched GEMM ``x_g[:, :, kept_in_g] @ (s_in_g * kernel[kept_in_g])``;
  the input mask is fixed over the steps, so nothing depends on the
  recurrence), and
* per step one batched GEMM ``h_g[:, kept_g] @ (s_g *
  recurrent_kernel[kept_g])`` over the groups (``[G, batch/G, k] @ [G, k,
  4*units]``; the state of each group is kept in its own unit order, kept
  units first, so ``h_g[:, kept_g]`` is a slice),

which is exact: the same values as masking and multiplying by the full
matrices, to float rounding. The backward pass differentiates the same
compacted products, so the input, recurrent and weight gradients shrink
with them (the gathers' gradients scatter into the kept rows only). The
operands are dense after compaction (the LSTM state is a tanh product, not
sparse), so the products use TensorFlow's GEMM; ``sparse_split_matmul`` would
not pay here. With Keras' default activations each step's gate math is one
fused op forward and one backward (:mod:`tf_sparse_split.ops.lstm_gates`):
at LSTM sizes the per-step executor overhead of a dozen small elementwise
ops otherwise costs as much as the step's GEMM. (The fused ops have CPU
kernels only; when a GPU is visible the same math runs as TensorFlow ops.)

When compaction pays (``compaction="auto"``). Compaction copies each
group's kept rows of the kernels (``G`` copies of ``k x 4*units`` values
per batch, and their gradients back) and runs ``G`` small GEMMs of
``ceil(batch / G)`` rows per step; it saves the dropped share of every
product in every step. Per group, the saving over the copy grows as
``T * ceil(batch / G) * r / (1 - r)`` (``T`` steps, compacted rate ``r``:
the recurrent rate, its group part with ``pattern="subset"``, else the
input rate of row patterns), and :func:`compaction_pays` compacts from
``COMPACTION_MIN_ROWS`` = 1024 on; below that the layer multiplies the
full products by the masks (one GEMM of the whole batch per step, the same
values to float rounding). The choice is static where the trace knows the
sizes, and made per call (a ``tf.cond`` holding both loops) where it does
not, as in Keras' ``fit``, whose step is traced with a None batch.
Training steps on the 2-core Xeon (both rates 0.5, row patterns, batch
256, interleaved medians, compacted / masked ms):
8 steps x 128 units 10.2 / 10.8 with one group, 13.5 / 11.4 with 8; 8 x
512 48.0 / 69.7 with one group, 66.9 / 72.0 with 4, 90.2 / 72.2 with 8; 28
x 512 187.8 / 233.5 with 4, 224.6 / 235.7 with 8 (the rule never picks
the side more than 10% slower there: ``tests/test_lstm.py``). The
defaults (``"subset"``, 4 groups, group rate 0.159) and ``"row"`` with 8
groups mask on MNIST rows (28 steps, LSTM(256), batch 128): 1.57-1.64x and
1.53x Keras' step, against 1.27-1.30x and 1.34-1.42x compacted.

Without dropout. The same loop (fused gate ops, the bias folded into the
input GEMM, the written-out backward pass) also runs in training with
both rates 0, on CPUs and with Keras' default activations: 1.08-1.10x
Keras' step at 8 steps x LSTM(128), batch 256, and 1.03x at 28 steps x
LSTM(256). Where a GPU is visible Keras' cuDNN kernel runs instead; at
inference Keras' loop runs (the same bits as ``keras.layers.LSTM``).

Why groups (a departure from Song et al., who draw one pattern per
training iteration for the whole batch): with one pattern per batch every
example drops the same units, so each step trains one sub-network and the
dropped half of the recurrent kernel rows gets no gradient at all; on MNIST
rows (LSTM(256), dropout = recurrent_dropout = 0.5) that cost 12.6 points
of test accuracy after 4 epochs against Keras' per-example masks, almost all
of it from the recurrent mask (docs/guide/lstm.md). All groups keep the
same number of units, so the batched GEMM stays rectangular; more groups
are closer to Keras' per-example masks but read ``G`` compacted copies of
the recurrent kernel per step (16 cost about 20% of the layer's step
against 8; with ``pattern="subset"`` the default is 4 groups plus a
per-example part of the recurrent mask, below).

Which units (``pattern``):

* ``"subset"`` (default). Recurrent dropout: each group drops a uniformly
  random subset of ``n = rate * units`` units (rounded at random so that
  ``E[n] = rate * units``), and the groups' subsets are drawn *balanced*
  (:func:`~tf_sparse_split.layers.dropout.random_subset_keep_mask`): one
  random order of the units per batch, group ``g`` drops a window of ``n``
  ranks starting at ``g * units / G``, so each unit is dropped in
  ``rate * G`` groups (+-1) and gets gradient from the same share of the
  batch (antithetic sampling: summed over the groups, the masks'
  deviations from 1 cancel per unit; exactly when ``G`` divides ``units``
  and ``rate * units`` and ``rate * G`` are whole). Every unit of every
  group is dropped with probability exactly ``rate``; ``E[mask] = 1``.
  With ``recurrent_group_share = s < 1`` (default 0.25) the groups drop
  subsets at the lower rate ``r_g`` with ``1 - r_g = (1 - rate) ** s``
  (compacted as above), and on the kept units a per-example, per-unit
  mask at rate ``r_e`` (``(1 - r_g)(1 - r_e) = 1 - rate``, values 0 and
  ``1 / (1 - r_e)``) multiplies the compacted state ``h[:, kept_g]``
  before each step's GEMM: every unit of every example is dropped with
  probability ``rate``, ``E[mask] = 1``, and the recurrent GEMM shrinks by
  ``r_g`` instead of ``rate`` (rate 0.5: s = 0.25 gives r_g = 0.159, r_e =
  0.405). On MNIST rows (LSTM(256), both rates 0.5, 8 epochs) a mask
  shared by the 16 examples of each of 8 groups (s = 1, the layer's
  earlier default) trailed Keras by 1.6 points; s = 0.25 with 4 groups
  (the defaults) recovers the gap at the same step speed: fewer groups
  read fewer compacted copies of the recurrent kernel per step, which
  pays for the larger kept width (docs/guide/lstm.md).
  Input dropout: per example and feature, as Keras draws it (one mask for
  the four gates), applied to ``x`` before the input GEMM, which is then
  not compacted: it runs once for all steps, while the recurrent products
  run step by step.
* ``"row"``: periodic row patterns (:mod:`tf_sparse_split.layers.dropout`,
  "Pattern definitions") for both masks, with the distribution searched by
  :func:`~tf_sparse_split.search_pattern_distribution` (Song et al.): each
  batch draws one ``(kind, period)`` and every group its own offset (kept
  counts differ by +-1 when the period does not divide the width; the few
  extra rows of the smaller groups are zeroed). The input product is
  compacted too. At rate 0.5 the search puts 74% on "drop 1 of 2", so in
  most batches every group drops either the even or the odd units: two
  distinct sub-networks per batch. On MNIST rows this trailed
  ``keras.layers.LSTM`` by about 3 points after 3-5 epochs; ``"subset"``
  with all of the recurrent rate by 8 groups by about 1.5 after 5 and 8
  epochs, with its defaults by +0.05 +- 0.8 after 8 (docs/guide/lstm.md). ``max_period`` (default 4, 8 in
  :class:`~tf_sparse_split.layers.ApproximateRandomDropout`) bounds the
  realized rate of a batch to 1/4-3/4 at rate 0.5.

``pattern="tile"`` uses tile masks (blocks of ``[batch, units]``): exact
semantics, no compaction (no unit is zero for the whole batch), so no
speed-up from the masks. ``pattern="random"`` uses Keras' own
element-wise masks and Keras' own loop: with the same ``seed`` the layer
equals ``keras.layers.LSTM`` bit for bit, as it does at inference (and in
training without dropout where Keras' loop runs: "Without dropout").

Requires the TensorFlow backend of Keras 3.
"""

import keras
import tensorflow as tf

from tf_sparse_split.layers.dropout import (DEFAULT_MAX_PERIOD,  # noqa: F401
                                            DEFAULT_PATTERN_GROUPS,
                                            GROUPED_PATTERNS,
                                            PatternTable,
                                            check_pattern_groups,
                                            table_capacity,
                                            pattern_keep_mask,
                                            random_subset_keep_mask)
from tf_sparse_split.layers._lstm_recurrence import (_recurrence, _grouped_matmul, _gather_cols)
from tf_sparse_split.tuning.pattern_search import (check_tile_fits,
                                                   check_tile_shape,
                                                   search_pattern_distribution)
from tf_sparse_split.utils.validation import (validate_fraction,
                                              validate_int)

__all__ = ["SparseSplitLSTM", "SparseSplitLSTMCell", "LSTM_PATTERNS",
           "compaction_pays"]

#: Values of ``pattern``.
LSTM_PATTERNS = ("subset", "row", "tile", "random")

#: ``pattern="subset"``: the groups' recurrent subsets are drawn balanced
#: (:func:`~tf_sparse_split.layers.dropout.random_subset_keep_mask`).
SUBSET_BALANCED = True

#: Default ``recurrent_group_share`` of new layers (``pattern="subset"``).
DEFAULT_RECURRENT_GROUP_SHARE = 0.25

#: Default ``pattern_groups`` of new layers with ``pattern="subset"`` (the
#: per-example part of the recurrent mask makes fewer, larger groups as
#: accurate; each group reads its own compacted recurrent kernel per step).
DEFAULT_SUBSET_GROUPS = 4

#: ``recurrent_group_share`` of a saved config without the key: all of the
#: recurrent dropout by group subsets, as such layers were saved.
LEGACY_RECURRENT_GROUP_SHARE = 1.0

#: ``compaction="auto"`` compacts a batch's products when ``steps * rows per
#: group * r / (1 - r)`` reaches this (module docstring, "When compaction
#: pays"; measured on the 2-core Xeon, float32).
COMPACTION_MIN_ROWS = 1024


def compaction_pays(steps, batch, groups, rate):
    """Whether compacting the dropped units out of an LSTM's products is
    predicted to be faster than multiplying by the masks (module
    docstring, "When compaction pays").

    Args:
      steps: time steps ``T`` (int, or None if unknown at trace time).
      batch: batch size (int, or None if unknown).
      groups: ``pattern_groups`` ``G`` (int >= 1).
      rate: the compacted rate ``r`` in ``[0, 1)``: the share of units
        each group drops from its products.

    Returns:
      True when ``T * ceil(batch / G) * r / (1 - r) >=
      COMPACTION_MIN_ROWS``, or when ``T`` or the batch is unknown (the
      larger sizes are the ones compaction was built for); False at
      ``r = 0``.
    """
    if steps is None or batch is None:
        return rate > 0.0
    return bool(_compaction_rule(steps, -(-int(batch) // int(groups)), rate))


def _compaction_rule(steps, rows, rate):
    """``steps * rows * r / (1 - r) >= COMPACTION_MIN_ROWS``, without the
    division (false at ``r = 0``), on Python numbers or float64 tensors."""
    return steps * rows * rate >= COMPACTION_MIN_ROWS * (1.0 - rate)


def _with_group_share(config):
    """A copy of a saved config; one saved before ``recurrent_group_share``
    existed gets :data:`LEGACY_RECURRENT_GROUP_SHARE` (all recurrent dropout
    by groups, as it was saved)."""
    config = dict(config)
    config.setdefault("recurrent_group_share", LEGACY_RECURRENT_GROUP_SHARE)
    return config


def split_recurrent_rate(rate, share):
    """``(group_rate, example_rate)`` of a recurrent dropout ``rate`` of
    which the fraction ``share`` (of ``log(1 - rate)``) is drawn per group
    of examples as a unit subset and the rest per example and unit:
    ``1 - group_rate = (1 - rate) ** share`` and ``(1 - group_rate) * (1 -
    example_rate) = 1 - rate``. ``share = 1``: ``(rate, 0)``; ``share =
    0``: ``(0, rate)``."""
    keep = (1.0 - rate) ** share
    group_rate = 1.0 - keep
    example_rate = 1.0 - (1.0 - rate) / keep if keep > 0 else 0.0
    return group_rate, max(example_rate, 0.0)


def _split_rate_tensor(rate, share):
    """:func:`split_recurrent_rate` on a float64 tensor ``rate``."""
    keep = tf.pow(1.0 - rate, tf.constant(share, tf.float64))
    example = tf.where(keep > 0, 1.0 - (1.0 - rate) / keep,
                       tf.zeros_like(keep))
    return 1.0 - keep, tf.maximum(example, 0.0)


def _check_group_share(share, pattern):
    if share is None:
        return DEFAULT_RECURRENT_GROUP_SHARE if pattern == "subset" else 1.0
    if isinstance(share, bool) or not isinstance(share, (int, float)) or \
            not 0.0 <= float(share) <= 1.0:
        raise ValueError("`recurrent_group_share` must be a number in [0, 1]"
                         f". Received: recurrent_group_share={share!r}")
    if pattern != "subset" and float(share) != 1.0:
        raise ValueError("`recurrent_group_share` < 1 needs pattern='subset'"
                         f". Received: recurrent_group_share={share!r}, "
                         f"pattern={pattern!r}")
    return float(share)


def _check_pattern(pattern):
    if pattern not in LSTM_PATTERNS:
        raise ValueError(f"`pattern` must be one of {LSTM_PATTERNS}. "
                         f"Received: pattern={pattern!r}")
    return pattern


@tf.custom_gradient
def _dense_gradient(w):
    """``w``, whose gradient is passed on as a dense tensor: the row
    gathers of the loop would otherwise hand the optimizer
    ``IndexedSlices``, whose sparse update (deduplicating the indices
    every step) costs more than the dense one for weights read whole."""
    return tf.identity(w), lambda dy: tf.convert_to_tensor(dy)


def _first(mask):
    """Keras' cell keeps four masks (one per gate) when implementation=1
    (forced by recurrent dropout); the pattern masks are the same four."""
    return mask[0] if isinstance(mask, (list, tuple)) else mask


def _ceil_div(a, b):
    return (a + b - 1) // b


def _group_masks(mask, groups, rows):
    """The ``[G, dim]`` per-group masks of a cell mask (``[1, dim]``, or
    ``[batch, dim]`` with example ``b`` in group ``b // rows``). Groups
    made only of padding repeat the last group's mask; an empty batch gets
    all-ones masks (nothing to drop)."""
    n = tf.shape(mask)[0]
    # One row of ones after the masks: read only when the batch is empty.
    padded = tf.concat([mask, tf.ones([1, tf.shape(mask)[1]], mask.dtype)], 0)
    last = tf.maximum(n - 1, 0)
    return tf.gather(padded, tf.minimum(tf.range(groups) * rows, last))


def _kept_first(masks):
    """Per group (row of ``masks`` [G, dim]): the unit order with the kept
    units first (``perm`` [G, dim], stable), the largest kept count ``k``
    over the groups, and the mask values of each group's first ``k`` units
    in that order (``[G, k]``: the rescale factor, 0 where a group keeps
    fewer than ``k`` units -- those rows of the compacted kernel are
    zeroed)."""
    dropped = tf.cast(masks <= 0, tf.int32)
    perm = tf.argsort(dropped, axis=1, stable=True)
    k = tf.reduce_max(tf.reduce_sum(1 - dropped, axis=1))
    return perm, k, tf.gather(masks, perm[:, :k], axis=1, batch_dims=1)


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class SparseSplitLSTMCell(keras.layers.LSTMCell):
    """``keras.layers.LSTMCell`` with subset/row/tile-pattern dropout masks.

    Same arguments as ``keras.layers.LSTMCell`` plus ``pattern``,
    ``tile_shape``, ``max_period``, ``pattern_groups`` and
    ``recurrent_group_share`` (see :class:`SparseSplitLSTM`). The masks are drawn once per batch (Keras
    caches them over the steps): ``pattern="subset"``: the recurrent mask
    from :func:`~tf_sparse_split.layers.dropout.random_subset_keep_mask`
    (balanced over the groups; with ``recurrent_group_share < 1`` at the
    group rate, times a per-example mask, the two factors kept in
    ``_recurrent_parts`` for the own loop), the input mask per
    example (values 0 and ``1 / (1 - dropout)``); ``"row"``/``"tile"``: from a distribution found
    by :func:`~tf_sparse_split.search_pattern_distribution`. Every unit is
    dropped with probability ``dropout`` (``recurrent_dropout``); kept
    values are scaled by ``1 / (1 - realized rate)`` (per group for subsets
    and row patterns), so ``E[mask] = 1`` per unit. Masks are float
    ``[1, dim]`` with one group, ``[batch, dim]`` (constant within each
    group) with several; tile masks and subset input masks ``[batch, dim]``.
    Unlike Keras' random masks (one per gate when ``implementation=1``,
    which Keras forces for ``recurrent_dropout > 0``), the four gates share
    one pattern: a dropped unit is then absent from all four gate products,
    which is what lets the layer compact it away (Song et al.).
    """

    def __init__(self, units, pattern="subset", tile_shape=None,
                 max_period=DEFAULT_MAX_PERIOD, pattern_groups=None,
                 recurrent_group_share=None, **kwargs):
        self.pattern = _check_pattern(pattern)
        if pattern == "subset" and pattern_groups is None:
            pattern_groups = DEFAULT_SUBSET_GROUPS
        self.pattern_groups = check_pattern_groups(pattern_groups, pattern)
        self.recurrent_group_share = _check_group_share(
            recurrent_group_share, pattern)
        if pattern == "tile":
            # None: a default tile per masked dimension (``_tile``).
            self.tile_shape = (None if tile_shape is None
                               else check_tile_shape(tile_shape))
        else:
            if tile_shape is not None:
                raise ValueError("`tile_shape` is only used with "
                                 f"pattern='tile'. Received: tile_shape="
                                 f"{tile_shape!r}")
            self.tile_shape = None
        self.max_period = validate_int(max_period, "max_period", 2)
        # Rates in [0, 1), as set_rates takes them: keras.layers.LSTMCell
        # clamps instead (dropout=1.0 gave NaN outputs here, -0.1 or NaN
        # became 0 and True 1.0 without a word).
        for attr in ("dropout", "recurrent_dropout"):
            if attr in kwargs:
                kwargs[attr] = validate_fraction(kwargs[attr], attr)
        super().__init__(units, **kwargs)
        self._distributions = {}
        self._tables = {}
        self._rate_vars = {}
        self._dims = {}
        # The masks the last traced training step has ("input",
        # "recurrent"); None before any trace (SparseSplitLSTM.inner_loop).
        self._masked = None

    def build(self, input_shape):
        super().build(input_shape)
        self._dims = {"input": int(input_shape[-1]),
                      "recurrent": self.units}
        # The rates in force as float64 variables (exactly the Python
        # values) that the compiled step reads: set_rates() moves them
        # between steps without retracing. Not Keras weights: the config
        # keeps the rates, as for keras.layers.LSTM.
        with tf.init_scope():
            for key, rate in (("input", self.dropout),
                              ("recurrent", self.recurrent_dropout)):
                self._rate_vars[key] = tf.Variable(
                    float(rate), dtype=tf.float64, trainable=False,
                    name=f"{key}_dropout_rate")
        if self.pattern in ("random", "subset"):
            return
        for key, rate in (("input", self.dropout),
                          ("recurrent", self.recurrent_dropout)):
            if rate > 0:
                self._search(key, rate)

    def _tile(self, key):
        """The tile of the ``key`` mask (``"input"``/``"recurrent"``) for
        ``pattern="tile"``: the given ``tile_shape``, else ``(32, w)`` with
        ``w`` the largest divisor of the masked dimension up to 32 that
        leaves at least two tile columns to drop from (4 for 8 input
        features, 14 for 28, 32 for 128 units). None for other patterns."""
        if self.pattern != "tile":
            return None
        if self.tile_shape is not None:
            return self.tile_shape
        dim = self._dims[key]
        return (32, max(w for w in range(1, max(1, min(dim // 2, 32)) + 1)
                        if dim % w == 0))

    def _search(self, key, rate):
        """Row/tile patterns: searches the distribution of ``rate`` and
        stores it in the key's pattern table (made on first use)."""
        dim = self._dims[key]
        tile = self._tile(key)
        if tile is not None:
            try:
                check_tile_fits(tile, dim)
            except ValueError as e:
                raise ValueError(f"{key} dropout of {self.name!r}: {e}; "
                                 "choose tile_shape accordingly") from None
        seed = 0 if self.seed is None else int(self.seed)
        dist = search_pattern_distribution(
            rate, dim, pattern=self.pattern, max_period=self.max_period,
            tile_shape=tile, seed=seed)
        table = self._tables.get(key)
        if table is None:
            columns = dim // tile[1] if tile is not None else dim
            self._tables[key] = PatternTable(
                max(table_capacity(columns, self.max_period, (0.95, rate)),
                    len(dist.patterns)), name=f"{key}_patterns",
                patterns=list(dist.patterns), probs=dist.probabilities)
        else:
            if len(dist.patterns) > table.capacity:
                raise ValueError(
                    f"{key} dropout rate {rate} of {self.name!r} needs more "
                    "pattern slots than the layer was built with (rates up "
                    "to 0.95)")
            table.assign(list(dist.patterns), dist.probabilities)
        self._distributions[key] = (dist, dim)

    def set_rates(self, dropout=None, recurrent_dropout=None):
        """Changes the input and/or recurrent dropout rate between training
        steps.

        With ``pattern`` ``"subset"``, ``"row"`` or ``"tile"`` a built cell
        stores the rate in a variable the compiled step reads (row/tile:
        the pattern distribution is searched again and stored in a
        variable table), so no retracing is needed -- unless the rate was
        0 when the training step was traced (the step then has no mask to
        scale; a step at rate 0 keeps its masks, as identities).
        ``pattern="random"`` uses Keras' masks, which read the Python
        value at trace time.

        Args:
          dropout, recurrent_dropout: rates in ``[0, 1)``, or None (kept).

        Returns:
          True if a compiled step must be retraced to see the change (a
          rate raised from 0, or ``pattern="random"``), else False.

        Raises:
          ValueError: a rate outside ``[0, 1)`` or one the width cannot
            reach with row/tile patterns.
        """
        retrace = False
        # Both rates are checked before either changes: a call that raises
        # leaves the cell as it was.
        checked = [(key, attr, validate_fraction(value, attr))
                   for key, attr, value in (
                       ("input", "dropout", dropout),
                       ("recurrent", "recurrent_dropout", recurrent_dropout))
                   if value is not None]
        for key, attr, v in checked:
            old = float(getattr(self, attr))
            if v == old:
                continue
            if self.built and self.pattern in ("row", "tile"):
                if v > 0:
                    self._search(key, v)
                elif key in self._tables:   # rate 0: the identity pattern
                    self._tables[key].assign([("keep", 1)], [1.0])
                    self._distributions.pop(key, None)
            if self.pattern == "random" or (
                    v > 0 and self._masked is not None and
                    key not in self._masked):
                retrace = True
            setattr(self, attr, v)
            if self.built:
                self._rate_vars[key].assign(v)
        return retrace

    def _rate(self, which):
        """The rate in force (float64 tensor from its variable once built,
        else the Python value)."""
        var = self._rate_vars.get(which)
        if var is None:
            return tf.constant(self.dropout if which == "input" else
                               self.recurrent_dropout, tf.float64)
        return tf.convert_to_tensor(var)

    def pattern_distribution(self, which="recurrent"):
        """The :class:`~tf_sparse_split.PatternDistribution` of the
        ``"input"`` or ``"recurrent"`` dropout (None if that rate is 0 or
        ``pattern`` is ``"random"`` or ``"subset"``, which search none)."""
        entry = self._distributions.get(which)
        return entry[0] if entry else None

    def _pattern_mask(self, which, step_input):
        x = tf.convert_to_tensor(step_input)
        batch = tf.shape(x)[0]
        grouped = self.pattern in GROUPED_PATTERNS
        groups = self.pattern_groups if grouped else 1
        count = getattr(self, "dropout_mask_count", None)
        rate = self._rate(which)
        if self.pattern == "subset" and which == "input":
            # Per example and unit, as Keras' (one mask for the 4 gates).
            keep = keras.random.uniform(tf.shape(x)[:2],
                                        seed=self.seed_generator) \
                >= tf.cast(rate, tf.float32)
            mask = tf.cast(keep, x.dtype) / tf.cast(1.0 - rate, x.dtype)
            return mask if count is None else [mask] * count
        example = None
        if self.pattern == "subset":
            group_rate, example_rate = _split_rate_tensor(
                rate, self.recurrent_group_share)
            keep = random_subset_keep_mask(self.units, group_rate,
                                           self.seed_generator, groups=groups,
                                           balanced=SUBSET_BALANCED)
            if self.recurrent_group_share < 1.0:
                # per example and unit, on top
                example = tf.cast(
                    keras.random.uniform(tf.stack([batch, self.units]),
                                         seed=self.seed_generator)
                    >= tf.cast(example_rate, tf.float32), x.dtype) / \
                    tf.cast(1.0 - example_rate, x.dtype)
        else:
            if which not in self._tables:   # rate raised from 0 unbuilt
                self._search(which, float(getattr(
                    self, "dropout" if which == "input" else
                    "recurrent_dropout")))
            dim = self._dims[which]
            keep = pattern_keep_mask(self._tables[which], None, dim,
                                     self.seed_generator,
                                     pattern=self.pattern,
                                     tile_shape=self._tile(which),
                                     batch_size=batch,
                                     groups=groups if groups > 1 else None,
                                     same_pattern=True)
        # Row patterns and subsets are rescaled per group (E[mask] = 1 in
        # every group), tile masks by the whole mask's realized rate.
        kept = (tf.reduce_mean(keep, axis=1, keepdims=True)
                if grouped else tf.reduce_mean(keep))
        mask = keep * tf.math.divide_no_nan(1.0, kept)
        if groups > 1:   # example b belongs to group b // ceil(batch / G)
            mask = tf.gather(mask, tf.range(batch) // _ceil_div(batch, groups))
        mask = tf.cast(mask, x.dtype)
        if example is not None:
            # The own loop reads the two factors (group, example).
            self._recurrent_parts = (mask, example)
            mask = mask * example
        return mask if count is None else [mask] * count

    def get_dropout_mask(self, step_input):
        if self.pattern == "random":
            return super().get_dropout_mask(step_input)
        if getattr(self, "_dropout_mask", None) is None and self.dropout > 0:
            self._dropout_mask = self._pattern_mask("input", step_input)
        return getattr(self, "_dropout_mask", None)

    def reset_recurrent_dropout_mask(self):
        super().reset_recurrent_dropout_mask()
        self._recurrent_parts = None

    def get_recurrent_dropout_mask(self, step_input):
        if self.pattern == "random":
            return super().get_recurrent_dropout_mask(step_input)
        if getattr(self, "_recurrent_dropout_mask", None) is None and \
                self.recurrent_dropout > 0:
            self._recurrent_parts = None
            self._recurrent_dropout_mask = self._pattern_mask("recurrent",
                                                              step_input)
        return getattr(self, "_recurrent_dropout_mask", None)

    def get_config(self):
        config = super().get_config()
        config.update({"pattern": self.pattern,
                       "tile_shape": (list(self.tile_shape) if self.tile_shape
                                      else None),
                       "max_period": self.max_period,
                       "pattern_groups": self.pattern_groups,
                       "recurrent_group_share": self.recurrent_group_share})
        return config

    @classmethod
    def from_config(cls, config):
        return super().from_config(_with_group_share(config))


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class SparseSplitLSTM(keras.layers.LSTM):
    """Drop-in for ``keras.layers.LSTM`` with compacting pattern dropout.

    Same constructor arguments, call arguments, weights (``kernel``
    ``[input_dim, 4*units]``, ``recurrent_kernel`` ``[units, 4*units]``,
    ``bias`` ``[4*units]``, gate order i, f, c, o) and serialization as
    ``keras.layers.LSTM``, plus:

    Args:
      pattern: ``"subset"`` (default: random unit subsets per group of
        examples for the recurrent state, compacted out of the per-step
        products; per-example input masks: module docstring, "Which
        units"), ``"row"`` (periodic row patterns for both, both
        compacted; stored in the config of layers saved with it, which load
        unchanged), ``"tile"`` (tile masks, no compaction)
        or ``"random"`` (Keras' element-wise masks; equals
        ``keras.layers.LSTM`` with the same seed).
      tile_shape: ``(batch_rows, units)`` tile for ``pattern="tile"``;
        its units must divide both the input features (if ``dropout > 0``)
        and ``units`` (if ``recurrent_dropout > 0``). Default None: per
        mask, ``(32, w)`` with ``w`` the largest divisor of its dimension
        up to 32 that leaves at least two tiles across it (``(32, 4)`` on
        8 input features, ``(32, 32)`` on 128 units).
      max_period: largest pattern period the search considers
        (``pattern="row"``/``"tile"``; >= 2, default
        ``DEFAULT_MAX_PERIOD`` = 4: shorter periods keep each batch's
        realized rate nearer the target, e.g. at most 3 of 4 units dropped
        at rate 0.5 instead of 7 of 8).
      pattern_groups: number ``G >= 1`` of example groups with their own
        subsets / row-pattern offsets (module docstring, "Why groups");
        default ``DEFAULT_SUBSET_GROUPS`` (4) for ``pattern="subset"``,
        ``DEFAULT_PATTERN_GROUPS`` (8) for ``"row"``, 1 otherwise (more than 1 needs one of those two). ``G =
        1`` is one mask for the whole batch (Song et al.), fastest but
        markedly less accurate.
      recurrent_group_share: ``pattern="subset"`` only: the share ``s`` in
        ``[0, 1]`` of the recurrent dropout drawn per group (compacted);
        the rest is drawn per example and unit on the kept units (module
        docstring, "Which units"): group rate ``1 - (1 - rate) ** s``,
        per-example rate ``1 - (1 - rate) ** (1 - s)``. Default
        ``DEFAULT_RECURRENT_GROUP_SHARE`` (0.25); 1 = all by groups (the
        value of saved configs without this key, which load unchanged),
        0 = all per example (Keras' masks, nothing compacted). Other
        patterns: 1 only.
      compaction: ``"auto"`` (default), True or False: whether a training
        step with ``pattern`` ``"subset"`` or ``"row"`` compacts the
        dropped units out of its products (True) or multiplies the full
        products by the same masks (False; the same values to float
        rounding). ``"auto"`` decides per trace from the static sizes and
        the rate (:func:`compaction_pays`; module docstring, "When
        compaction pays"), and :meth:`set_rates` asks for a retrace when a
        new rate changes that choice; where the batch size or the step
        count is unknown at trace time (Keras' ``fit`` traces its step
        with a None batch) the step holds both and chooses per call from
        the run-time sizes and the rates in force (``tf.cond``).

    The layer's own loop (fused gate ops, written-out backward pass,
    compacted or masked products) runs in training with ``pattern="subset"``,
    ``"row"`` or ``"tile"`` and a nonzero dropout rate, and without dropout
    when no GPU is visible and the activations are Keras' defaults (module
    docstring, "Without dropout"); always without a time mask and without
    ``unroll``. Every other case (inference, masks, ``unroll=True``,
    ``pattern="random"``, a visible GPU without dropout) runs Keras' own
    loop with this layer's masks. ``go_backwards``, ``return_sequences``,
    ``return_state``, ``stateful`` and initial states work in both.

    ``supports_jit`` is False (the kept-unit count is data dependent).

    Dtypes: as ``keras.layers.LSTM``; under a mixed policy
    (``mixed_bfloat16``, ``mixed_float16``) the weights are float32 and the
    own loop runs in the compute dtype: its GEMMs are TensorFlow's in
    that dtype, and the fused gate ops keep bfloat16/float16 storage but
    compute each step's gate math in float32, rounding each output once
    (Keras' cell rounds after every elementwise op), so both agree within
    the dtype's precision.

    Raises:
      ValueError: bad ``pattern``, ``tile_shape``, ``max_period``,
        ``dropout`` or ``recurrent_dropout`` (not a number in [0, 1):
        ``keras.layers.LSTM`` clamps such rates instead),
        ``pattern_groups`` (not an int >= 1, or > 1 with ``pattern="tile"``
        or ``"random"``), ``recurrent_group_share`` (not in [0, 1], or
        < 1 without ``pattern="subset"``), ``compaction`` (not "auto",
        True or False), a tile not dividing the dimension it drops, or
        bad ``LSTM`` arguments.
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
                 use_cudnn="auto", pattern="subset", tile_shape=None,
                 max_period=DEFAULT_MAX_PERIOD, pattern_groups=None,
                 recurrent_group_share=None, compaction="auto",
                 **kwargs):
        if not (isinstance(compaction, bool) or compaction == "auto"):
            raise ValueError("`compaction` must be 'auto', True or False. "
                             f"Received: compaction={compaction!r}")
        cell = SparseSplitLSTMCell(
            units, pattern=pattern, tile_shape=tile_shape,
            max_period=max_period, pattern_groups=pattern_groups,
            recurrent_group_share=recurrent_group_share,
            activation=activation,
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
        self.compaction = compaction
        # (steps, batch, compacted) of the last training trace: set_rates
        # asks for a retrace when a new rate would change the choice.
        self._traced_compaction = None

    @property
    def pattern(self):
        return self.cell.pattern

    def set_rates(self, dropout=None, recurrent_dropout=None):
        """Changes the dropout and/or recurrent dropout rate between
        training steps (:meth:`SparseSplitLSTMCell.set_rates`: no
        retracing with ``pattern`` subset/row/tile unless a rate is raised
        from one that was 0 when the training step was traced).

        Returns:
          True if the compiled step must be retraced to see the change
          (also when, with ``compaction="auto"``, the new rate changes
          whether the traced step's static shapes compact): e.g.
          ``model.make_train_function(force=True)`` before the next
          ``fit``, as :class:`~tf_sparse_split.TimeBudgetCallback` does.

        Raises:
          ValueError: a rate outside ``[0, 1)``.
        """
        retrace = self.cell.set_rates(dropout=dropout,
                                      recurrent_dropout=recurrent_dropout)
        traced = self._traced_compaction
        if traced is not None and \
                self._compacts(traced[0], traced[1]) != traced[2]:
            retrace = True
        return retrace

    def _use_own_loop(self, mask, training):
        cell = self.cell
        if not training or cell.pattern == "random" or mask is not None \
                or self.unroll:
            return False
        if cell.dropout > 0 or cell.recurrent_dropout > 0:
            return True
        # No dropout: the fused gate ops and the written-out backward pass
        # still beat Keras' loop on CPUs (module docstring, "Without
        # dropout"); where a GPU is visible Keras runs cuDNN's kernel.
        return (cell.activation is keras.activations.tanh
                and cell.recurrent_activation is keras.activations.sigmoid
                and not tf.config.list_logical_devices("GPU"))

    def inner_loop(self, sequences, initial_state, mask, training=False):
        if isinstance(mask, (list, tuple)):
            mask = mask[0]
        if training is True:
            # Which masks this training trace holds (set_rates reports a
            # rate raised where it holds none).
            self.cell._masked = {k for k, r in (
                ("input", self.cell.dropout),
                ("recurrent", self.cell.recurrent_dropout)) if r > 0}
        if not self._use_own_loop(mask, training):
            return super().inner_loop(sequences, initial_state, mask=mask,
                                      training=training)
        return self._own_loop(sequences, initial_state)

    def _compacted_rate(self, live=False):
        """The share of units each group drops from the products: the
        recurrent rate (its group part with ``pattern="subset"``), else
        the input rate of row patterns, else 0. A Python float from the
        rates set, or (``live``) a float64 tensor read from the cell's rate
        variables in the traced step."""
        cell = self.cell
        if cell.recurrent_dropout > 0:
            rate = (cell._rate("recurrent") if live
                    else float(cell.recurrent_dropout))
            if cell.pattern == "subset":
                split = _split_rate_tensor if live else split_recurrent_rate
                rate = split(rate, cell.recurrent_group_share)[0]
            return rate
        if cell.pattern == "row" and cell.dropout > 0:
            return cell._rate("input") if live else float(cell.dropout)
        return 0.0

    def _compacts(self, steps, batch):
        """Whether a training step of these static sizes compacts
        (``compaction``; "auto": :func:`compaction_pays`), or None: "auto"
        with ``steps`` or ``batch`` unknown, decided per call
        (:meth:`_compaction_pays_now`)."""
        if self.cell.pattern not in GROUPED_PATTERNS:
            return False
        if self.compaction != "auto":
            return self.compaction
        if steps is None or batch is None:
            return None
        return compaction_pays(steps, batch, self.cell.pattern_groups,
                               self._compacted_rate())

    def _compaction_pays_now(self, x):
        """:func:`compaction_pays` as a boolean tensor, on ``x``'s run-time
        sizes and the rates in force (the cell's rate variables)."""
        shape = tf.shape(x)
        rows = _ceil_div(shape[0], self.cell.pattern_groups)
        return _compaction_rule(tf.cast(shape[1], tf.float64),
                                tf.cast(rows, tf.float64),
                                tf.cast(self._compacted_rate(live=True),
                                        tf.float64))

    def _own_loop(self, sequences, initial_state):
        cell = self.cell
        x = tf.convert_to_tensor(sequences)
        dtype = x.dtype
        kernel = _dense_gradient(tf.cast(tf.convert_to_tensor(cell.kernel),
                                         dtype))
        rkernel = _dense_gradient(tf.cast(
            tf.convert_to_tensor(cell.recurrent_kernel), dtype))
        bias = (_dense_gradient(tf.cast(tf.convert_to_tensor(cell.bias),
                                        dtype))
                if cell.use_bias else None)
        h0 = tf.convert_to_tensor(initial_state[0])
        c0 = tf.convert_to_tensor(initial_state[1])
        dp = (_first(cell.get_dropout_mask(x[:, 0, :]))
              if cell.dropout > 0 else None)
        rdp = (_first(cell.get_recurrent_dropout_mask(h0))
               if cell.recurrent_dropout > 0 else None)
        # Whole units dropped per group: compacted where that pays, else
        # (and for tile masks) the masks multiply the full products. With
        # a batch size or step count unknown at trace time (Keras' fit
        # traces its step with a None batch) the choice is made per call.
        row = self._compacts(x.shape[1], x.shape[0])
        self._traced_compaction = (x.shape[1], x.shape[0], row)

        def body(row):
            return self._loop_body(row, x, h0, c0, dp, rdp, kernel, rkernel,
                                   bias)

        if row is None:
            h, c, outputs = tf.cond(self._compaction_pays_now(x),
                                    lambda: body(True), lambda: body(False))
        else:
            h, c, outputs = body(row)
        return h, outputs, [h, c]

    def _loop_body(self, row, x, h0, c0, dp, rdp, kernel, rkernel, bias):
        """The own loop after the masks are drawn, compacted (``row``) or
        masked; returns ``(h, c, outputs)``."""
        cell = self.cell
        units = cell.units
        # The batch runs as G groups of ``rows`` examples ([G, rows, ...]),
        # each with its own row patterns (tile masks: one group); a batch
        # that G does not divide is padded with zero examples, whose
        # outputs are cut off at the end.
        groups = cell.pattern_groups if row else 1
        batch = tf.shape(x)[0]
        rows = _ceil_div(batch, groups)
        pad = groups * rows - batch

        def grouped(t):      # [batch, ...] -> [G, rows, ...]
            t = tf.pad(t, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1))
            return tf.reshape(t, tf.concat([[groups, rows],
                                            tf.shape(t)[1:]], 0))

        # Units in the loop are kept in a per-group order ``perm`` [G, U]:
        # with row recurrent dropout each group's kept units first, so a
        # step's compacted state is a column prefix of h (a slice, not a
        # gather); outputs are put back in order at the end. Gate columns
        # are reordered to (i, f, o, c) so one sigmoid covers the three
        # sigmoid gates.
        perm = None
        # Subsets with recurrent_group_share < 1: the group factor of the
        # recurrent mask (compacted) and the per-example factor on top.
        parts = (getattr(cell, "_recurrent_parts", None)
                 if rdp is not None and cell.pattern == "subset" else None)
        if rdp is not None and row:
            perm, n_kept, r_scale = _kept_first(
                _group_masks(rdp if parts is None else parts[0], groups,
                             rows))
            order = perm
        else:
            order = tf.range(units)[None, :]
        cols = tf.concat([order + g * units for g in (0, 1, 3, 2)], 1)
        h0, c0 = grouped(h0), grouped(c0)
        if perm is not None:
            h0 = tf.gather(h0, perm, axis=2, batch_dims=1)
            c0 = tf.gather(c0, perm, axis=2, batch_dims=1)
        if bias is not None:
            bias = tf.gather(bias, cols)[:, None, :]          # [G', 1, 4U]

        # Input product of all steps at once, on the kept input features.
        if self.go_backwards:
            x = tf.reverse(x, [1])
        kernel = kernel[None]                                 # [1, F, 4U]
        if dp is not None and row and cell.pattern == "row":
            in_perm, n_in, in_scale = _kept_first(
                _group_masks(dp, groups, rows))
            kept_in = in_perm[:, :n_in]
            kernel = (tf.gather(kernel[0], kept_in)           # [G, F', 4U]
                      * in_scale[:, :, None])
            x = tf.gather(grouped(x), kept_in, axis=3, batch_dims=1)
        else:
            if dp is not None:   # per-example masks (subset, tile)
                x = x * dp[:, None, :]
            x = grouped(x)
        kernel = _gather_cols(kernel, cols)                   # [G', F', 4U]
        xt = tf.transpose(x, [0, 2, 1, 3])                    # [G, T, R, F']
        if bias is not None:
            # The bias as one more input feature (a column of ones) of the
            # GEMM: no separate add over [G, T, R, 4U], and its gradient
            # comes out of the kernel gradient's GEMM.
            # (tf.ones, not ones_like(xt[..., :1]): that column is
            # empty for inputs with no features.)
            xt = tf.concat([xt, tf.ones(tf.concat(
                [tf.shape(xt)[:-1], [1]], 0), xt.dtype)], -1)
            g_max = max(kernel.shape[0], bias.shape[0])
            kernel = tf.concat(
                [tf.broadcast_to(w, tf.concat([[g_max], tf.shape(w)[1:]], 0))
                 for w in (kernel, bias)], 1)                 # [G', F'+1, 4U]
        zx = _grouped_matmul(xt, kernel)                      # [G, T, R, 4U]

        # Recurrent product on the kept units of the state:
        # h[:, :, :k] (times the tile mask) @ r per group.
        if perm is not None:
            r = _gather_cols(tf.gather(rkernel, perm[:, :n_kept])
                             * r_scale[:, :, None], cols)     # [G, k, 4U]
            hmask = None
            if parts is not None:   # per-example mask of the kept units
                hmask = tf.gather(grouped(parts[1]), perm[:, :n_kept],
                                  axis=2, batch_dims=1)       # [G, R, k]
        else:
            r = _gather_cols(rkernel[None], cols)             # [1, U, 4U]
            n_kept = units if rdp is None else None
            # Tile masks and uncompacted row/subset masks: [batch, U],
            # or [1, U] for one pattern over the whole batch.
            hmask = (None if rdp is None else rdp[None]
                     if rdp.shape[0] == 1 else grouped(rdp))
        h, c, hs = _recurrence(zx, h0, c0, r, n_kept, hmask,
                               cell.activation, cell.recurrent_activation,
                               self.return_sequences, units)

        def ungrouped(t):    # [G, rows, ..., U] -> [batch, ..., U]
            if perm is not None:
                t = tf.gather(t, tf.argsort(perm, axis=1), axis=-1,
                              batch_dims=1)
            t = tf.reshape(t, tf.concat([[groups * rows], tf.shape(t)[2:]],
                                        0))
            return t[:batch]

        h, c = ungrouped(h), ungrouped(c)
        if self.return_sequences:
            outputs = ungrouped(tf.transpose(hs, [1, 2, 0, 3]))
        else:
            outputs = h[:, None, :]
        return h, c, outputs

    def get_config(self):
        config = super().get_config()
        config.update({"pattern": self.cell.pattern,
                       "tile_shape": (list(self.cell.tile_shape)
                                      if self.cell.tile_shape else None),
                       "max_period": self.cell.max_period,
                       "pattern_groups": self.cell.pattern_groups,
                       "recurrent_group_share":
                           self.cell.recurrent_group_share,
                       "compaction": self.compaction})
        return config

    @classmethod
    def from_config(cls, config):
        return super().from_config(_with_group_share(config))
