"""Structured dropout whose zeros the sparse-split ops can skip.

Ordinary dropout zeroes random single activations; a dense GEMM still
multiplies them. The layers here zero *regular* structures instead, drawn
online per training step, so the following layer can hand a smaller problem
to the hardware (Z. Song et al., "Approximate Random Dropout", DATE 2019 /
arXiv 1805.08939, and "DNN Training Acceleration via Exploring GPGPU Friendly
Sparsity", arXiv 2203.05705):

* :class:`ApproximateRandomDropout` -- row and tile dropout patterns over the
  activation matrix ``X[batch, units]`` with a searched distribution over
  patterns (:func:`search_pattern_distribution`).
* :class:`SensitivityAwareDropout` -- drops whole feature maps (channels) of an
  NHWC tensor, preferring the channels of low measured sensitivity.

Pattern definitions
-------------------
Let ``X`` be the layer's input viewed as ``[batch, units]`` (leading axes are
flattened into ``batch``; dropout acts on the last axis). A *pattern* is a
``(kind, period p)`` pair; each training step draws one pattern from the
distribution and an offset ``o`` uniformly from ``{0, ..., p - 1}``.

Row patterns (the paper's row-based dropout patterns; "rows" of the weight
matrix = neurons = *columns* of ``X``), for unit index ``j``:

* ``("drop", p)``: drop units with ``(j - o) mod p == 0`` -- every p-th
  neuron; nominal rate ``1/p`` (p >= 2).
* ``("keep", p)``: keep only units with ``(j - o) mod p == 0`` -- keep every
  p-th neuron; nominal rate ``1 - 1/p`` (p >= 1; ``("keep", 1)`` is the
  identity pattern, rate 0). ``("keep", 2)`` equals ``("drop", 2)`` and is
  not listed twice.

With ``pattern_groups=1`` a dropped unit is zero for the *whole batch*: a
zero column of ``X``, which ``SparseSplitMatMul`` compacts away (statistic
``ZERO_COLS_SKIPPED``). By default (``pattern_groups=8``) the batch is cut
into 8 groups of consecutive examples, each with its own pattern and offset:
a dropped unit is a zero column of its group's rows, and the op skips those
zeros through its sparse rows, its weight gradient over ``X``'s nonzeros
and its SDDMM input gradient. One pattern for the whole batch trains every
example of a step on the same sub-network and cost 1.2-2.4 points of MNIST
accuracy against ``keras.layers.Dropout`` at rate 0.5 (docs/guide/structured-dropout.md); per-group patterns cost 0-0.7.

Tile patterns: ``X`` is cut into tiles of ``tile_shape = (tb, tu)`` (``tb``
batch rows by ``tu`` units; ``tu`` must divide ``units``; the batch axis may
end in a partial tile). Tile ``(r, c)`` (tile row ``r``, tile column ``c``)
plays the role of unit ``c`` shifted by its tile row: with ``q = c - r``,

* ``("drop", p)``: drop tile ``(r, c)`` if ``(q - o) mod p == 0``;
* ``("keep", p)``: keep tile ``(r, c)`` only if ``(q - o) mod p == 0``;

i.e. diagonal stripes of tiles on a regular grid (each tile row uses a
different phase, so every tile column keeps part of the batch). The zeros
are blocks inside the rows of ``X``: rows get sparser but no column of
``X`` becomes all-zero (unless ``tb >= batch``, where a tile pattern is a
row pattern with ``tu``-wide groups). ``SparseSplitMatMul`` only skips them
for rows it sends to its CSR path (row density below its threshold); see
docs/guide/structured-dropout.md and benchmarks/README.md.

With the offset uniform, every unit (tile) is dropped with probability
exactly ``1/p`` under ``("drop", p)`` and ``1 - 1/p`` under ``("keep", p)``,
whatever the layer width, so the per-unit drop probability is
``sum_k pi_k * rate_k`` for every unit -- the statistical equivalence to
ordinary dropout argued in the paper (each unit dropped with the requested
rate, marginally).

Rescaling
---------
In training the kept values are multiplied by ``1 / (1 - realized rate)``,
where the realized rate is the fraction of ``X`` this step's pattern zeroes.
Why not ``1 / (1 - rate)``: the patterns' rates differ from ``rate`` (e.g.
a mixture of "drop 1 of 2" and "keep 1 of 4" for 0.6), so a constant scale
would make a step's activation sum too large or too small by up to a factor
of 2-4; with the realized rate every step's expected activation sum equals
the inference one, and since a unit's keep probability under a pattern is
exactly ``1 - rate_k``, ``E[mask_j * scale] = sum_k pi_k = 1`` per unit
whatever the distribution (exact when the period divides the width; the
realized rate varies slightly with the offset otherwise).
"""

import keras
import numpy as np
import tensorflow as tf

from tf_sparse_split.tuning.pattern_search import (
    check_pattern, check_tile_fits, check_tile_shape,
    search_pattern_distribution)
from tf_sparse_split.utils.validation import (validate_fraction, validate_int,
                                              validate_positive_float)

__all__ = [
    "ApproximateRandomDropout",
    "PatternTable",
    "SensitivityAwareDropout",
    "draw_pattern",
    "pattern_keep_mask",
    "random_subset_keep_mask",
]

# ---------------------------------------------------------------------------
# pattern draws (shared with the LSTM's recurrent dropout)
# ---------------------------------------------------------------------------
#: Logit of an unused slot of a :class:`PatternTable` (probability 1e-30,
#: the floor the draws put under every probability).
_PAD_LOGIT = float(np.log(1e-30))


class PatternTable:
    """A pattern distribution held in non-trainable ``tf.Variable`` s, so
    a compiled training step draws from whatever distribution was last
    assigned (a rate change needs no retracing; the way a FATReLU's target
    is a variable).

    ``capacity`` slots: float32 logits ``[1, capacity]`` (``log(max(p,
    1e-30))``), int32 periods ``[capacity]`` and bool kinds ``[capacity]``
    (True = ``"drop"``); unused slots hold ``("keep", 1)`` at probability
    1e-30 (never drawn in practice). The variables are not Keras weights:
    the layer's config stores the distribution, as before.

    Args:
      capacity: slots (int >= 1).
      name: prefix of the variables' names.
      patterns, probs: the initial distribution (default: the identity
        pattern ``("keep", 1)``); the variables are created with it (under
        ``tf.init_scope``, so a layer built inside a traced function holds
        it from the start).

    Raises:
      ValueError: more patterns than ``capacity``.
    """

    def __init__(self, capacity, name="patterns", patterns=None,
                 probs=None):
        self.capacity = validate_int(capacity, "capacity")
        if patterns is None:
            patterns, probs = [("keep", 1)], np.ones(1)
        logits, periods, drops = self._arrays(patterns, probs)
        with tf.init_scope():
            self.logits = tf.Variable(logits, trainable=False,
                                      name=f"{name}_logits")
            self.periods = tf.Variable(periods, trainable=False,
                                       name=f"{name}_periods")
            self.drops = tf.Variable(drops, trainable=False,
                                     name=f"{name}_drops")

    def _arrays(self, patterns, probs):
        n = len(patterns)
        if n > self.capacity:
            raise ValueError(f"{n} patterns do not fit the table's "
                             f"{self.capacity} slots")
        logits = np.full([1, self.capacity], _PAD_LOGIT, np.float32)
        logits[0, :n] = np.log(np.maximum(np.asarray(probs, np.float64),
                                          1e-30))
        periods = np.ones([self.capacity], np.int32)
        periods[:n] = [p for _, p in patterns]
        drops = np.zeros([self.capacity], bool)
        drops[:n] = [k == "drop" for k, _ in patterns]
        return logits, periods, drops

    def assign(self, patterns, probs):
        """Stores ``patterns`` (list of ``(kind, period)``) with ``probs``
        (numpy, sums to 1). Call it between steps (eagerly).

        Raises:
          ValueError: more patterns than ``capacity``.
        """
        logits, periods, drops = self._arrays(patterns, probs)
        self.logits.assign(logits)
        self.periods.assign(periods)
        self.drops.assign(drops)

    def tensors(self):
        """``(logits [1, capacity], periods [capacity], is_drop
        [capacity])`` read from the variables."""
        return (tf.convert_to_tensor(self.logits),
                tf.convert_to_tensor(self.periods),
                tf.convert_to_tensor(self.drops))


def table_capacity(num_columns, max_period, rates=(0.95,)):
    """Slots a :class:`PatternTable` needs for the searched distributions
    of every rate up to ``max(rates)`` over ``num_columns`` units (tile
    columns): the size of the search's candidate list at that rate
    (:func:`~tf_sparse_split.tuning.pattern_search.pattern_list`, with the
    period raised as the search raises it)."""
    from tf_sparse_split.tuning.pattern_search import pattern_list

    top = min(max(float(r) for r in rates), 1.0 - 1.0 / max(num_columns, 2))
    need = int(np.ceil(1.0 / (1.0 - top) - 1e-9))
    return len(pattern_list(max(int(num_columns), 1),
                            max(int(max_period), 2 * need, 2)))


def draw_pattern(patterns, probs, seed_generator, groups=None,
                 same_pattern=False):
    """Draws one pattern of a distribution and its offset (or ``groups`` of
    them).

    Args:
      patterns: list of ``(kind, period)``, or a :class:`PatternTable`
        (then ``probs`` is ignored: the table's variables are read, so a
        compiled step follows an assigned distribution).
      probs: their probabilities (numpy, sums to 1).
      seed_generator: a ``keras.random.SeedGenerator`` (advanced).
      groups: None for one draw (scalars), or an int ``G >= 1`` for ``G``
        independent draws (vectors ``[G]``).
      same_pattern: with ``groups``: one ``(kind, period)`` draw shared by
        all groups, each group with its own offset.

    Returns:
      ``(is_drop, period, offset)``: bool and two int32 tensors (scalars, or
      ``[groups]``), each offset uniform in ``[0, period)``.
    """
    if isinstance(patterns, PatternTable):
        logits, periods, drops = patterns.tensors()
    else:
        logits = tf.math.log(tf.constant(
            np.maximum(probs, 1e-30)[None, :], tf.float32))
        periods = tf.constant([p for _, p in patterns], tf.int32)
        drops = tf.constant([k == "drop" for k, _ in patterns])
    shape = () if groups is None else (groups,)
    n_kinds = 1 if groups is None or same_pattern else groups
    idx = tf.cast(tf.reshape(keras.random.categorical(
        logits, n_kinds, seed=seed_generator), [n_kinds]), tf.int32)
    idx = tf.broadcast_to(idx, shape) if groups else tf.reshape(idx, [])
    p = tf.gather(periods, idx)
    u = keras.random.uniform(shape, seed=seed_generator)
    o = tf.minimum(tf.cast(tf.floor(u * tf.cast(p, tf.float32)),
                           tf.int32), p - 1)
    return tf.gather(drops, idx), p, o


def pattern_keep_mask(patterns, probs, units, seed_generator, pattern="row",
                      tile_shape=None, batch_size=None, groups=None,
                      same_pattern=False):
    """Draws one row/tile keep mask (module docstring, "Pattern
    definitions"): float32 ``[1, units]`` for ``pattern="row"``, ``[batch_size,
    units]`` for ``"tile"``; 1 = kept, 0 = dropped (not rescaled). With
    ``groups=G`` (row only): ``[G, units]``, one independent row pattern per
    row (``same_pattern``: see :func:`draw_pattern`). Advances
    ``seed_generator``.

    Raises:
      ValueError: ``groups`` with ``pattern="tile"``.
    """
    if groups is not None and pattern != "row":
        raise ValueError("groups of row patterns need pattern='row', got "
                         f"{pattern!r}")
    is_drop, p, o = draw_pattern(patterns, probs, seed_generator,
                                 groups=groups, same_pattern=same_pattern)
    if groups is not None:
        q = tf.range(units, dtype=tf.int32)[None, :]
        is_drop, p, o = is_drop[:, None], p[:, None], o[:, None]
    elif pattern == "row":
        q = tf.range(units, dtype=tf.int32)[None, :]
    else:
        tb, tu = tile_shape
        rows = tf.range(batch_size, dtype=tf.int32) // tb
        cols = tf.range(units, dtype=tf.int32) // tu
        q = cols[None, :] - rows[:, None]
    hit = tf.math.floormod(q - o, p) == 0
    dropped = tf.where(is_drop, hit, tf.logical_not(hit))
    return tf.cast(tf.logical_not(dropped), tf.float32)


def random_subset_keep_mask(units, rate, seed_generator, groups=1,
                            balanced=False):
    """Draws ``groups`` keep masks that each drop a uniformly random subset
    of the same number of units (float32 ``[groups, units]``; 1 = kept, 0 =
    dropped, not rescaled).

    The number dropped, ``n``, is drawn once per call (shared by the
    groups): ``floor(rate * units)``, plus one with probability
    ``frac(rate * units)``, so ``E[n] = rate * units`` and every unit of
    every group is dropped with probability exactly ``rate`` (``n`` is
    capped at ``units - 1``: one unit is always kept, which lowers the rate
    only where ``rate > 1 - 1/units``). Each group's subset is uniform
    among the subsets of size ``n`` and independent of the other groups'.
    Rescaled by ``units / (units - n)``, every unit's expected mask value is
    1. Unlike the periodic row patterns (:func:`pattern_keep_mask`), no two
    units are always dropped together, and all groups keep the same count,
    which keeps a compacted product (one ``[k, N]`` slice per group)
    rectangular. Advances ``seed_generator``.

    With ``balanced=True`` the groups' subsets are drawn jointly: one
    uniformly random order of the units per call, and group ``g`` drops
    the ``n`` units whose ranks lie in ``[s_g, s_g + n)`` (cyclically, ``s_g
    = floor(g * units / groups)``). Each group's subset is still uniform
    (so the per-unit rate and unbiasedness above hold), but within a call
    every unit is dropped by ``n * groups / units`` groups (+-1; two groups
    at rate 0.5 get complementary subsets), where independent subsets
    leave some units in few groups and others in many. For a batch whose
    groups share these masks, every unit (row of the following weight
    matrix) then gets gradient from the same share of the batch, and the
    part of the mask noise that is linear in the mask cancels over the
    groups (antithetic sampling).

    Args:
      units: the width (int >= 1).
      rate: drop rate in ``[0, 1)``, or a scalar float tensor (e.g. read
        from a variable; not validated).
      seed_generator: a ``keras.random.SeedGenerator``.
      groups: number of masks (int >= 1).
      balanced: draw the groups' subsets jointly (above).

    Raises:
      ValueError: bad ``units``, ``rate`` or ``groups``.
    """
    units = validate_int(units, "units")
    groups = validate_int(groups, "groups")
    u = keras.random.uniform((), seed=seed_generator)
    if tf.is_tensor(rate):
        # A rate read from a variable inside a compiled step (float64, so
        # the count is the one the same Python float gives).
        r = tf.cast(rate, tf.float64)
        base = tf.floor(r * units)
        frac = r * units - base
        n = tf.minimum(tf.cast(base, tf.int32) +
                       tf.cast(tf.cast(u, tf.float64) < frac, tf.int32),
                       units - 1)
    else:
        rate = validate_fraction(rate, "rate")
        base = int(np.floor(rate * units))
        frac = rate * units - base
        n = tf.minimum(base + tf.cast(u < frac, tf.int32), units - 1)
    if balanced:
        noise = keras.random.uniform((1, units), seed=seed_generator)
        rank = tf.argsort(tf.argsort(noise, axis=1), axis=1)
        start = (tf.range(groups, dtype=tf.int32) * units // groups)[:, None]
        return tf.cast(tf.math.floormod(rank - start, units) >= n,
                       tf.float32)
    noise = keras.random.uniform((groups, units), seed=seed_generator)
    # rank of each unit in its group's random order: the n lowest drop.
    rank = tf.argsort(tf.argsort(noise, axis=1), axis=1)
    return tf.cast(rank >= n, tf.float32)


# ---------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------
#: Default ``pattern_groups`` of row patterns and default ``max_period`` of
#: ``ApproximateRandomDropout`` and ``SparseSplitLSTM`` (measured: docs/guide/
#: structured-dropout.md and lstm.md).
DEFAULT_PATTERN_GROUPS = 8
DEFAULT_MAX_PERIOD = 4
#: Patterns drawn per group of consecutive examples (``pattern_groups``):
#: periodic row patterns and :func:`random_subset_keep_mask`'s subsets
#: (``SparseSplitLSTM``).
GROUPED_PATTERNS = ("row", "subset")


def check_pattern_groups(pattern_groups, pattern):
    """``pattern_groups`` of a layer with pattern ``pattern``: None -> the
    default (row: :data:`DEFAULT_PATTERN_GROUPS`, otherwise 1).

    Raises:
      ValueError: not an integer >= 1, or more than one group with a
        pattern not in :data:`GROUPED_PATTERNS`.
    """
    if pattern_groups is None:
        return DEFAULT_PATTERN_GROUPS if pattern in GROUPED_PATTERNS else 1
    groups = validate_int(pattern_groups, "pattern_groups")
    if groups > 1 and pattern not in GROUPED_PATTERNS:
        raise ValueError(
            "`pattern_groups` > 1 needs pattern='row' or 'subset' (the masks "
            "of the other patterns differ between examples already). "
            "Received: "
            f"pattern_groups={groups}, pattern={pattern!r}")
    return groups


def _host_rate(rate):
    """``validate_fraction(rate, "rate")`` for ``set_rate``, which runs on
    the host between steps: a symbolic tensor (``set_rate`` called inside a
    ``tf.function`` or a Keras model's ``call``) is refused with a message
    that says so rather than as "not a number"."""
    if tf.is_tensor(rate) and not hasattr(rate, "numpy"):
        raise ValueError(
            "`rate` must be a Python number or an eager tensor: set_rate() "
            "assigns the layer's variables on the host between training "
            "steps and cannot take a symbolic tensor (inside a tf.function, "
            "assign the rate before the call). Received: "
            f"rate={rate!r}")
    return validate_fraction(rate, "rate")


class _SettableRate:
    """The ``rate`` property of a dropout layer whose rate changes between
    training steps: reads ``_rate``, assigns through the layer's
    ``set_rate`` (which validates it and updates what the compiled step
    reads)."""

    @property
    def rate(self):
        """The drop rate in force (Python float; :meth:`set_rate` changes
        it)."""
        return self._rate

    @rate.setter
    def rate(self, value):
        self.set_rate(value)


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class ApproximateRandomDropout(_SettableRate, keras.layers.Layer):
    """Approximate random dropout: row or tile patterns (module docstring).

    In training, each call draws one pattern ``(kind, p)`` from the
    distribution and an offset ``o`` uniformly in ``[0, p)`` (one per group
    of examples with ``pattern_groups``), zeroes the pattern and multiplies
    the kept values by ``1 / (1 - realized rate)`` (see "Rescaling" in the
    module docstring). At inference (or with
    ``rate=0``) it is the identity. Gradients flow through the kept values
    only (the same mask and scale).

    Args:
      rate: target drop rate in ``[0, 1)``.
      pattern: ``"row"`` (drop whole neurons = columns of ``X[batch,
        units]`` for a group of examples, or the whole batch with
        ``pattern_groups=1``) or ``"tile"`` (drop ``tile_shape`` blocks of
        ``X`` on a regular diagonal grid).
      tile_shape: ``(batch_rows, units)`` per tile, for ``pattern="tile"``
        (default ``(32, 32)``); the units must divide the layer width.
      max_period: largest period considered by the search (default 4; the
        search goes beyond it where a rate needs longer periods, e.g. 0.9).
        Long periods make single steps drop 7/8 of the units (scaled by 8),
        which trains worse than rates near the mean.
      seed: integer seed of the per-step pattern/offset draws (a Keras
        ``SeedGenerator``) and of the search; ``None`` for a random one.
      probabilities: optional explicit distribution: a list of
        ``[kind, period, probability]`` triples (as ``get_config`` stores
        it). Default: ``search_pattern_distribution`` at build time.
      pattern_groups: ``pattern="row"`` only: the batch (the leading axis)
        is cut into this many groups of consecutive examples (``ceil(batch
        / G)`` each), and each group draws its own pattern and offset.
        Default (None): 8 for row patterns, 1 for tile patterns. ``1`` is
        Song et al.'s one pattern per step for the whole batch: dropped
        units are then all-zero columns, compacted away, but every example
        of a step trains the same sub-network, which costs accuracy (module
        docstring). With groups the following ``SparseSplitDense`` skips
        the zeros through its sparse rows and its SDDMM input gradient
        instead of compacting columns.
      **kwargs: base ``Layer`` arguments.

    The rate and the pattern distribution live in non-trainable
    ``tf.Variable`` s (``rate_var`` and a :class:`PatternTable`) that the
    compiled step reads, so :meth:`set_rate` (or assigning ``rate``) takes
    effect at the next step without retracing, from any rate to any other,
    0 included (a callback such as ``TimeBudgetCallback`` moves it between
    steps). They are not Keras weights: ``get_config`` stores the rate and
    distribution in force, and ``.keras`` files keep their layout.

    Raises:
      ValueError: bad rate, pattern, tile shape or ``probabilities`` (not
        ``[kind, period, probability]`` triples, a probability negative,
        NaN or infinite); at build time, inputs of rank < 2 or a tile wider
        than the layer or not dividing it.
    """

    def __init__(self, rate, pattern="row", tile_shape=None,
                 max_period=DEFAULT_MAX_PERIOD, seed=None, probabilities=None,
                 pattern_groups=None, **kwargs):
        super().__init__(**kwargs)
        self._rate = validate_fraction(rate, "rate")
        self.rate_var = None
        self._table = None
        self.pattern = check_pattern(pattern)
        self.pattern_groups = check_pattern_groups(pattern_groups, pattern)
        if pattern == "tile":
            self.tile_shape = check_tile_shape(
                (32, 32) if tile_shape is None else tile_shape)
        else:
            if tile_shape is not None:
                raise ValueError("tile_shape is only used with pattern='tile'")
            self.tile_shape = None
        self.max_period = validate_int(max_period, "max_period", 2)
        if seed is not None:
            seed = validate_int(seed, "seed", 0)
        self.seed = seed
        self._given = None
        if probabilities is not None:
            self._given = self._check_probabilities(probabilities)
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.supports_masking = True
        self.distribution = None
        self._units = None

    @staticmethod
    def _check_probabilities(probabilities):
        out = []
        bad = ValueError(
            "probabilities must be a list of [kind, period, probability]"
            f" triples, got {probabilities!r}")
        if isinstance(probabilities, (str, bytes)):
            raise bad
        try:
            for triple in probabilities:
                if isinstance(triple, (str, bytes)) or len(triple) != 3:
                    raise bad
                kind, p, prob = triple
                if kind not in ("drop", "keep"):
                    raise ValueError(f"pattern kind must be 'drop' or 'keep',"
                                     f" got {kind!r}")
                p = validate_int(p, "period", 2 if kind == "drop" else 1)
                try:
                    prob = float(prob)
                except ValueError:
                    raise ValueError("probability must be a finite number "
                                     f">= 0, got {prob!r}") from None
                # An infinite entry would normalise to NaN probabilities.
                if not 0 <= prob < float("inf"):
                    raise ValueError("probability must be a finite number "
                                     f">= 0, got {prob}")
                out.append((kind, p, prob))
        except TypeError:
            raise ValueError(
                "probabilities must be a list of [kind, period, probability]"
                f" triples, got {probabilities!r}") from None
        total = sum(x[2] for x in out)
        if not out or not total > 0:
            raise ValueError("probabilities must contain a positive entry")
        if abs(total - 1.0) <= 1e-9:   # saved by get_config: keep the bits
            return out
        return [(k, p, prob / total) for k, p, prob in out]

    def set_rate(self, rate):
        """Changes the drop rate between training steps, without retracing.

        The pattern distribution is searched again for the new rate
        (:func:`~tf_sparse_split.search_pattern_distribution`, the same
        arguments as at build time; an explicit ``probabilities`` list is
        replaced by it, unless the rate is unchanged) and assigned to the
        layer's pattern table and ``rate_var``, non-trainable
        ``tf.Variable`` s that the compiled step reads (rate 0: the
        identity, as at construction). Before the layer
        is built only the value is stored.

        Args:
          rate: drop rate in ``[0, 1)``.

        Raises:
          ValueError: a rate outside ``[0, 1)``, or one the layer's width
            cannot reach (above ``1 - 1/columns``, or needing more pattern
            slots than the table was built with: rates up to
            ``max(0.95, rate at build)``).
        """
        rate = _host_rate(rate)
        if not self.built:
            self._rate = rate
            return
        if rate == self._rate:
            return      # (an explicit ``probabilities`` list stays)
        patterns, probs, dist = self._distribution_for(rate)
        if len(patterns) > self._table.capacity:
            raise ValueError(
                f"rate {rate} needs {len(patterns)} patterns; the layer "
                f"{self.name!r} was built with room for "
                f"{self._table.capacity} (rates up to 0.95 or its rate at "
                "build time)")
        self._table.assign(patterns, probs)
        self.rate_var.assign(rate)
        self._rate = rate
        self._given = None
        self.distribution = dist
        self._patterns, self._probs = patterns, probs

    def _distribution_for(self, rate):
        """``(patterns, probs, PatternDistribution or None)`` searched for
        ``rate`` (identity at 0)."""
        if rate > 0:
            dist = search_pattern_distribution(
                rate, self._units, pattern=self.pattern,
                max_period=self.max_period, tile_shape=self.tile_shape,
                seed=0 if self.seed is None else self.seed)
            return list(dist.patterns), dist.probabilities, dist
        return [("keep", 1)], np.ones(1), None

    def build(self, input_shape):
        if len(input_shape) < 2:
            raise ValueError(
                "ApproximateRandomDropout needs inputs of rank >= 2 "
                "([batch, ..., units]), got shape "
                f"{tuple(input_shape)}")
        units = input_shape[-1]
        if units is None:
            raise ValueError("ApproximateRandomDropout needs a known last "
                             "(units) dimension")
        self._units = int(units)
        if self.pattern == "tile":
            check_tile_fits(self.tile_shape, self._units)
            columns = self._units // self.tile_shape[1]
        else:
            columns = self._units
        if self._given is not None:
            for kind, p, _ in self._given:
                if p > columns:
                    raise ValueError(f"period {p} exceeds the {columns} "
                                     "columns the pattern runs over")
            self._patterns = [(k, p) for k, p, _ in self._given]
            self._probs = np.array([x[2] for x in self._given])
        else:
            self._patterns, self._probs, self.distribution = \
                self._distribution_for(self._rate)
        self._columns = columns
        # The distribution as variables the compiled step reads (room for
        # the distributions of every rate up to 0.95, or the layer's own).
        capacity = max(table_capacity(columns, self.max_period,
                                      (0.95, self._rate)),
                       len(self._patterns))
        self._table = PatternTable(capacity, name=f"{self.name}_patterns",
                                   patterns=self._patterns,
                                   probs=self._probs)
        with tf.init_scope():
            self.rate_var = tf.Variable(self._rate, dtype=tf.float32,
                                        trainable=False,
                                        name=f"{self.name}_rate")
        self.built = True

    def compute_output_shape(self, input_shape):
        return input_shape

    def pattern_probabilities(self):
        """``[(kind, period, probability), ...]`` the layer draws from."""
        if not self.built:
            raise RuntimeError("the layer is not built yet")
        return [(k, p, float(q)) for (k, p), q in
                zip(self._patterns, self._probs)]

    # -- mask -------------------------------------------------------------
    def _draw(self):
        """Draws (kind_is_drop, period, offset) as int32 scalars."""
        return draw_pattern(self._table, None, self.seed_generator)

    def keep_mask(self, batch_size=None):
        """Draws one training-step mask: float32 ``[1, units]`` (row) or
        ``[batch_size, units]`` (tile); 1 = kept. Advances the seed state.

        Raises:
          ValueError: tile patterns without ``batch_size``.
        """
        if self.pattern == "tile" and batch_size is None:
            raise ValueError("keep_mask: tile patterns need `batch_size` "
                             "(the rows of the mask)")
        return pattern_keep_mask(self._table, None, self._units,
                                 self.seed_generator, pattern=self.pattern,
                                 tile_shape=self.tile_shape,
                                 batch_size=batch_size)

    def _grouped_row_mask(self, x):
        """``[batch, 1.., units]`` mask (kept values already rescaled) with
        one independent row pattern per group of consecutive examples."""
        groups = self.pattern_groups
        keep = pattern_keep_mask(self._table, None, self._units,
                                 self.seed_generator, pattern="row",
                                 groups=groups)              # [G, units]
        scale = tf.math.divide_no_nan(
            1.0, tf.reduce_mean(keep, axis=1, keepdims=True))
        batch = tf.shape(x)[0]
        per_group = (batch + groups - 1) // groups
        group_of = tf.range(batch) // tf.maximum(per_group, 1)   # [batch]
        mask = tf.gather(keep * scale, group_of)             # [batch, units]
        shape = tf.concat([[batch], tf.ones([x.shape.rank - 2], tf.int32),
                           [self._units]], 0)
        return tf.cast(tf.reshape(mask, shape), x.dtype)

    def call(self, inputs, training=False):
        if not training:
            return inputs
        x = tf.convert_to_tensor(inputs)
        # The rate is read from its variable: a step traced at one rate
        # runs at whatever rate set_rate() assigned since (0: identity).
        return tf.cond(tf.convert_to_tensor(self.rate_var) > 0.0,
                       lambda: self._dropped(x), lambda: tf.identity(x))

    def _dropped(self, x):
        if self.pattern == "row" and self.pattern_groups > 1:
            return x * self._grouped_row_mask(x)
        if self.pattern == "row":
            keep = self.keep_mask()
            shape = [1] * (x.shape.rank - 1) + [self._units]
            mask = tf.reshape(keep, shape)
        else:
            x2 = tf.reshape(x, [-1, self._units])
            keep = self.keep_mask(tf.shape(x2)[0])
        kept = tf.reduce_mean(keep)
        # A pattern never drops everything (("drop", 1) is not a candidate),
        # but guard anyway.
        scale = tf.math.divide_no_nan(1.0, kept)
        if self.pattern == "row":
            return x * tf.cast(mask * scale, x.dtype)
        y = x2 * tf.cast(keep * scale, x.dtype)
        return tf.reshape(y, tf.shape(x))

    def get_config(self):
        config = super().get_config()
        config.update({
            "rate": self.rate, "pattern": self.pattern,
            "tile_shape": (list(self.tile_shape) if self.tile_shape
                           else None),
            "max_period": self.max_period, "seed": self.seed,
            "pattern_groups": self.pattern_groups,
            "probabilities": ([[k, p, float(q)] for (k, p), q in
                               zip(self._patterns, self._probs)]
                              if self.built else
                              ([list(x) for x in self._given]
                               if self._given else None)),
        })
        return config


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class SensitivityAwareDropout(_SettableRate, keras.layers.Layer):
    """Drops whole input feature maps (channels) of an NHWC tensor,
    preferring channels of low sensitivity (after Z. Song et al., arXiv
    2203.05705).

    Sensitivity score: ``s_c``, an exponential moving average (``momentum``)
    of the mean absolute activation of channel ``c`` over batch and space,
    updated at every training call from the layer's input (a non-trainable
    weight ``sensitivity``, saved with the model). Activation magnitude is
    used rather than ``|activation * gradient|`` because it is available in
    the forward pass without a second backward hook; a channel whose
    activations are near zero contributes little to the next convolution,
    so dropping it changes the output least.

    Which channels: every training call drops exactly
    ``n = round(rate * C)`` channels for the whole batch, sampled without
    replacement with weights ``(s_c + eps) ** (-1 / temperature)`` (Gumbel
    top-k on ``-log(s_c + eps) / temperature``), using the scores from the
    *previous* calls (uniform before the first); low ``temperature`` means
    nearly deterministic "drop the least sensitive", high means close to
    uniform channel dropout. Kept channels are multiplied by
    ``C / (C - n)`` (the realized rate is fixed, so this is also
    ``1 / (1 - n / C)``); unlike ordinary dropout, a channel's own keep
    probability is not ``1 - rate`` (that is the point), so the rescaling
    preserves the per-step total, not every channel's expectation.

    A dropped channel is zero for the whole batch and all positions: an
    all-zero input channel of the following convolution, i.e. ``kh*kw``
    all-zero columns of its im2col matrix, which a sparse-split convolution
    compacts away. At inference it is the identity.

    The number of dropped channels lives in a non-trainable ``tf.Variable``
    (``num_drop_var``, int32) that the compiled step reads, so
    :meth:`set_rate` (or assigning ``rate``) takes effect at the next step
    without retracing, from any rate to any other, 0 included (a callback
    such as ``TimeBudgetCallback`` moves it between steps, as it does
    :meth:`ApproximateRandomDropout.set_rate`). It is not a Keras weight:
    ``get_config`` stores the rate in force, and ``.keras`` files keep
    their layout (files saved before it load unchanged). The scores are
    updated at every training call, also while no channel is dropped, so
    they are current when the rate rises; a channel whose batch score is
    NaN or Inf (a NaN/Inf input) keeps its previous score.

    Args:
      rate: fraction of channels to drop, in ``[0, 1)``.
      temperature: > 0 (default 1.0).
      momentum: EMA momentum of the score in ``[0, 1)`` (default 0.9).
      seed: integer seed, or None.
      **kwargs: base ``Layer`` arguments.

    Attributes:
      num_drop: channels dropped per training call (int, after build).
      realized_rate: ``num_drop / channels`` (after build; the rate before).

    Raises:
      ValueError: on bad arguments, or an input that is not rank 4 with a
        known channel count (at build; also a positive ``rate`` that drops
        no channel of the layer).
    """

    def __init__(self, rate, temperature=1.0, momentum=0.9, seed=None,
                 **kwargs):
        super().__init__(**kwargs)
        self._rate = validate_fraction(rate, "rate")
        self.temperature = validate_positive_float(temperature, "temperature")
        self.momentum = validate_fraction(momentum, "momentum")
        if seed is not None:
            seed = validate_int(seed, "seed", 0)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.sensitivity = None
        self.num_drop_var = None
        self.channels = None
        self._num_drop = None

    @property
    def num_drop(self):
        """Channels dropped per training call (None before build)."""
        return self._num_drop

    @property
    def realized_rate(self):
        """The fraction of channels dropped, ``num_drop / channels`` (the
        rate before build)."""
        if self._num_drop is None:
            return self._rate
        return self._num_drop / self.channels

    def _count(self, rate):
        """Channels dropped at ``rate``: ``round(rate * channels)``, at most
        ``channels - 1``."""
        return min(int(round(rate * self.channels)), self.channels - 1)

    def set_rate(self, rate):
        """Changes the drop rate between training steps, without retracing.

        The number of dropped channels becomes ``round(rate * channels)``
        (at most ``channels - 1``), assigned to ``num_drop_var``, which the
        compiled step reads; a rate below ``0.5 / channels`` drops none
        (the layer is then the identity until the rate rises again). Before
        the layer is built only the value is stored.

        Args:
          rate: drop rate in ``[0, 1)`` (a Python number or an eager
            scalar tensor).

        Raises:
          ValueError: a rate outside ``[0, 1)``, NaN, a bool, or a
            symbolic tensor.
        """
        rate = _host_rate(rate)
        self._rate = rate
        if self.num_drop_var is None:
            return
        self._num_drop = self._count(rate)
        self.num_drop_var.assign(self._num_drop)

    def build(self, input_shape):
        if len(input_shape) != 4 or input_shape[-1] is None:
            raise ValueError(
                "SensitivityAwareDropout expects NHWC input [batch, height, "
                f"width, channels] with known channels, got {input_shape}")
        self.channels = int(input_shape[-1])
        n = self._count(self._rate)
        if self._rate > 0 and n == 0:
            raise ValueError(
                f"rate {self._rate} of {self.channels} channel(s) drops no "
                f"channel (round(rate * channels) = 0 after keeping at least "
                f"one); use a higher rate or a layer with more channels")
        self.sensitivity = self.add_weight(
            name="sensitivity", shape=(self.channels,), dtype="float32",
            initializer="zeros", trainable=False, autocast=False)
        self.score_updates = self.add_weight(
            name="score_updates", shape=(), dtype="int64",
            initializer="zeros", trainable=False, autocast=False)
        with tf.init_scope():
            self.num_drop_var = tf.Variable(n, dtype=tf.int32,
                                            trainable=False,
                                            name=f"{self.name}_num_drop")
        self._num_drop = n
        self.built = True

    def compute_output_shape(self, input_shape):
        return input_shape

    def keep_mask(self):
        """Draws the channel mask ``[channels]`` (1 = kept) from the
        current scores; advances the seed state. The ``num_drop_var``
        channels with the largest ``-log(s + eps) / temperature + Gumbel``
        are dropped (the same set ``top_k`` would choose)."""
        c = self.channels
        n = tf.convert_to_tensor(self.num_drop_var)
        s = tf.convert_to_tensor(self.sensitivity)
        logits = -tf.math.log(s + 1e-6) / self.temperature
        logits = tf.where(self.score_updates > 0, logits, tf.zeros_like(s))
        u = keras.random.uniform((c,), minval=1e-7, maxval=1.0,
                                 seed=self.seed_generator)
        gumbel = -tf.math.log(-tf.math.log(u))
        # Rank of every channel in descending order of its perturbed logit
        # (stable: ties go to the lower index, as top_k's): the first n
        # ranks are dropped, n read from the variable at run time.
        order = tf.argsort(logits + gumbel, direction="DESCENDING",
                           stable=True)
        rank = tf.scatter_nd(order[:, None], tf.range(c, dtype=tf.int32),
                             [c])
        return tf.cast(rank >= n, tf.float32)

    def call(self, inputs, training=False):
        if not training:
            return inputs
        x = tf.convert_to_tensor(inputs)
        n = tf.convert_to_tensor(self.num_drop_var)
        c = self.channels

        def dropped():
            keep = self.keep_mask()
            scale = tf.cast(c, tf.float32) / tf.cast(c - n, tf.float32)
            return x * tf.cast(keep * scale, x.dtype)[None, None, None, :]

        # The count is read from its variable: a step traced at one rate
        # runs at whatever rate set_rate() assigned since (0: identity).
        y = tf.cond(n > 0, dropped, lambda: tf.identity(x))
        # In float32: a float16/bfloat16 mean over N*H*W values loses the
        # small differences between channels (or overflows the sum). The
        # mask above used the previous calls' scores.
        batch_score = tf.reduce_mean(
            tf.abs(tf.cast(tf.stop_gradient(x), tf.float32)), axis=[0, 1, 2])
        m = self.momentum
        new = tf.where(self.score_updates > 0,
                       m * self.sensitivity + (1.0 - m) * batch_score,
                       batch_score)
        # A NaN/Inf input (a diverging step) must not poison the scores of
        # every later call through the average: such channels keep theirs.
        new = tf.where(tf.math.is_finite(batch_score), new, self.sensitivity)
        self.sensitivity.assign(new)
        self.score_updates.assign_add(1)
        return y

    def get_config(self):
        config = super().get_config()
        config.update({"rate": self.rate, "temperature": self.temperature,
                       "momentum": self.momentum, "seed": self.seed})
        return config
