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

A dropped unit is zero for the *whole batch*: a zero column of ``X``, which
``SparseSplitMatMul`` compacts away (statistic ``ZERO_COLS_SKIPPED``).

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
the README/benchmark notes.

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

import math

import keras
import numpy as np
import tensorflow as tf

__all__ = [
    "ApproximateRandomDropout",
    "SensitivityAwareDropout",
    "PatternDistribution",
    "search_pattern_distribution",
    "pattern_list",
]

_PATTERNS = ("row", "tile")


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------
def _check_rate(rate):
    if isinstance(rate, bool):
        raise ValueError(f"rate must be a number in [0, 1), got {rate!r}")
    try:
        value = float(rate)
    except (TypeError, ValueError):
        raise ValueError(
            f"rate must be a number in [0, 1), got {rate!r}") from None
    if not 0.0 <= value < 1.0:  # also rejects NaN
        raise ValueError(f"rate must be in [0, 1), got {rate!r}")
    return value


def _check_pos_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got "
                         f"{value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_pattern(pattern):
    if pattern not in _PATTERNS:
        raise ValueError(
            f"pattern must be one of {_PATTERNS}, got {pattern!r}")
    return pattern


def _check_tile_shape(tile_shape):
    try:
        tb, tu = tile_shape
    except (TypeError, ValueError):
        raise ValueError(
            "tile_shape must be a pair (batch_rows, units) of positive "
            f"integers, got {tile_shape!r}") from None
    return (_check_pos_int("tile_shape[0] (batch rows)", tb),
            _check_pos_int("tile_shape[1] (units)", tu))


def _check_tile_fits(tile_shape, units):
    tb, tu = tile_shape
    if tu > units:
        raise ValueError(
            f"tile_shape {tuple(tile_shape)} is wider ({tu} units) than the "
            f"layer ({units} units)")
    if units % tu:
        raise ValueError(
            f"tile_shape {tuple(tile_shape)}: {tu} units per tile does not "
            f"divide the layer's {units} units")


# ---------------------------------------------------------------------------
# patterns and the distribution search
# ---------------------------------------------------------------------------
def pattern_list(num_columns, max_period):
    """The candidate patterns ``[(kind, period), ...]`` for ``num_columns``
    units (or tile columns): ``("keep", 1)`` (identity), ``("drop", p)`` for
    ``2 <= p <= P`` and ``("keep", p)`` for ``3 <= p <= P``, with
    ``P = min(max_period, num_columns)``."""
    num_columns = _check_pos_int("num_columns", num_columns)
    max_period = _check_pos_int("max_period", max_period, 2)
    top = min(max_period, num_columns)
    out = [("keep", 1)]
    out += [("drop", p) for p in range(2, top + 1)]
    out += [("keep", p) for p in range(3, top + 1)]
    return out


def _pattern_rates(patterns, num_columns):
    """Per pattern: the realized drop fraction for each offset (array of
    length p) over ``num_columns`` units."""
    j = np.arange(num_columns)
    out = []
    for kind, p in patterns:
        rates = []
        for o in range(p):
            hit = ((j - o) % p) == 0
            dropped = hit if kind == "drop" else ~hit
            rates.append(dropped.mean())
        out.append(np.array(rates))
    return out


class PatternDistribution:
    """Result of :func:`search_pattern_distribution` (plain numpy data).

    Attributes:
      rate: the requested drop rate.
      pattern: ``"row"`` or ``"tile"``.
      num_columns: units (row) or tile columns (tile) the rates refer to.
      patterns: list of ``(kind, period)``.
      probabilities: float64 array, one probability per pattern (sums to 1).
      pattern_rates: float64 array, each pattern's mean realized rate
        (over offsets).
      expected_rate: ``sum(probabilities * pattern_rates)``: the drop
        probability of every unit.
      rate_std: standard deviation of the per-step realized rate.
      loss_history: float64 array, the objective after each SGD step.
      weights: the objective's weights ``(mean, variance, entropy)``.
      seed: the seed used.
    """

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def per_unit_drop_probability(self):
        """Exact drop probability of every unit ``[num_columns]`` under the
        distribution with uniform offsets."""
        j = np.arange(self.num_columns)
        prob = np.zeros(self.num_columns)
        for (kind, p), pi in zip(self.patterns, self.probabilities):
            for o in range(p):
                hit = ((j - o) % p) == 0
                dropped = hit if kind == "drop" else ~hit
                prob += pi / p * dropped
        return prob

    def as_dict(self):
        return {
            "rate": self.rate, "pattern": self.pattern,
            "num_columns": self.num_columns,
            "patterns": [list(p) for p in self.patterns],
            "probabilities": self.probabilities.tolist(),
            "expected_rate": self.expected_rate, "rate_std": self.rate_std,
        }

    def __repr__(self):
        top = np.argsort(-self.probabilities)[:4]
        parts = ", ".join(f"{self.patterns[i][0]} 1/{self.patterns[i][1]}:"
                          f" {self.probabilities[i]:.3f}" for i in top)
        return (f"PatternDistribution(rate={self.rate}, expected_rate="
                f"{self.expected_rate:.4f}, rate_std={self.rate_std:.4f}, "
                f"top=[{parts}])")


def search_pattern_distribution(rate, num_units, pattern="row", max_period=8,
                                steps=500, lr=0.5, seed=0, tile_shape=None,
                                mean_weight=100.0, variance_weight=1.0,
                                entropy_weight=0.01):
    """SGD search for the probabilities of the dropout patterns.

    The distribution over the candidate patterns (:func:`pattern_list`) is
    ``pi = softmax(theta)``; ``theta`` starts at ``seed``-drawn small random
    values and takes ``steps`` gradient steps (full-batch gradient descent
    with a step size ``lr``; the objective is deterministic, so the result
    is reproducible from the seed) on::

      L(pi) = mean_weight     * (sum_k pi_k m_k - rate)^2
            + variance_weight * sum_k pi_k E_o[(r_k(o) - rate)^2]
            - entropy_weight  * H(pi) / log K

    where ``r_k(o)`` is pattern k's realized rate at offset ``o``, ``m_k``
    its mean over offsets and ``K`` the number of patterns. The first term
    makes every unit's drop probability equal to ``rate`` (it is
    ``sum_k pi_k m_k`` for every unit, see the module docstring); the second
    keeps each step's realized rate near ``rate`` (ordinary dropout's
    realized rate concentrates at ``rate`` too); the third spreads the
    distribution over many patterns (more different sub-networks, closer to
    the diversity of random dropout). This is our formulation of the
    paper's SGD-based search (its exact loss was not available to us).

    After the last step the mean is corrected exactly by mixing in the
    lowest- or highest-rate pattern with a small weight (typically < 1e-2),
    so ``expected_rate == rate`` to float rounding. ``max_period`` is raised
    to ``2 * ceil(1 / (1 - rate))`` where needed (capped by the number of
    columns) so that patterns on both sides of the target exist.

    Args:
      rate: target drop rate in ``[0, 1)``.
      num_units: the layer's width (units).
      pattern: ``"row"`` or ``"tile"``.
      max_period: the largest period ``p`` considered (>= 2); limited to the
        number of columns.
      steps: gradient steps (>= 1).
      lr: step size (> 0).
      seed: integer seed of the initial ``theta``.
      tile_shape: ``(tb, tu)`` for ``pattern="tile"`` (the patterns then run
        over ``num_units // tu`` tile columns).
      mean_weight, variance_weight, entropy_weight: the objective's weights
        (>= 0).

    Returns:
      a :class:`PatternDistribution`.

    Raises:
      ValueError: on a bad argument (rate outside [0, 1), tile shape not
        dividing the width, a rate above ``1 - 1/columns``, ...).
    """
    rate = _check_rate(rate)
    _check_pattern(pattern)
    num_units = _check_pos_int("num_units", num_units)
    max_period = _check_pos_int("max_period", max_period, 2)
    steps = _check_pos_int("steps", steps)
    lr = float(lr)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    for name, w in (("mean_weight", mean_weight),
                    ("variance_weight", variance_weight),
                    ("entropy_weight", entropy_weight)):
        if not float(w) >= 0:
            raise ValueError(f"{name} must be >= 0, got {w!r}")
    if pattern == "tile":
        if tile_shape is None:
            raise ValueError("pattern='tile' needs tile_shape=(rows, units)")
        tile_shape = _check_tile_shape(tile_shape)
        _check_tile_fits(tile_shape, num_units)
        num_columns = num_units // tile_shape[1]
    else:
        num_columns = num_units
    if rate > 0 and num_columns < 2:
        raise ValueError(
            f"rate {rate} needs at least 2 units (tile columns) to drop from, "
            f"got {num_columns}")
    top_rate = 1.0 - 1.0 / num_columns
    if rate > top_rate + 1e-12:
        raise ValueError(
            f"rate {rate} is not reachable with {num_columns} units (tile "
            f"columns): the highest pattern rate is 1 - 1/{num_columns}")
    # Make sure the target is inside the range of the candidates' rates.
    need = int(math.ceil(1.0 / (1.0 - rate) - 1e-9))
    max_period = max(max_period, 2 * need)
    patterns = pattern_list(num_columns, max_period)
    offset_rates = _pattern_rates(patterns, num_columns)
    m = np.array([r.mean() for r in offset_rates])
    v = np.array([np.mean((r - rate) ** 2) for r in offset_rates])
    k = len(patterns)
    log_k = math.log(k) if k > 1 else 1.0

    rng = np.random.default_rng(seed)
    theta = 0.01 * rng.standard_normal(k)
    history = np.empty(steps)

    def objective(pi):
        e = pi @ m
        h = -np.sum(pi * np.log(pi + 1e-300))
        loss = (mean_weight * (e - rate) ** 2 + variance_weight * (pi @ v)
                - entropy_weight * h / log_k)
        # dL/dpi
        g = (2 * mean_weight * (e - rate) * m + variance_weight * v
             + entropy_weight * (np.log(pi + 1e-300) + 1) / log_k)
        return loss, g

    for t in range(steps):
        z = theta - theta.max()
        pi = np.exp(z) / np.exp(z).sum()
        loss, g = objective(pi)
        history[t] = loss
        # Chain rule through the softmax: dL/dtheta = pi * (g - pi.g).
        theta = theta - lr * pi * (g - pi @ g)
    z = theta - theta.max()
    pi = np.exp(z) / np.exp(z).sum()
    # Final exact correction of the mean (the penalty leaves an error of
    # ~1e-3): mix in the lowest- or highest-rate pattern, whichever lies on
    # the other side of the target, with the weight that makes the expected
    # rate equal ``rate``.
    e = float(pi @ m)
    j = int(np.argmax(m)) if e < rate else int(np.argmin(m))
    if e != rate and m[j] != e:
        lam = (rate - e) / (m[j] - e)
        if 0.0 < lam <= 1.0:
            pi = (1.0 - lam) * pi
            pi[j] += lam
    e = float(pi @ m)
    second = sum(p_k * np.mean(r ** 2) for p_k, r in zip(pi, offset_rates))
    return PatternDistribution(
        rate=rate, pattern=pattern, num_columns=num_columns,
        tile_shape=tile_shape, patterns=patterns, probabilities=pi,
        pattern_rates=m, expected_rate=e,
        rate_std=float(math.sqrt(max(second - e * e, 0.0))),
        loss_history=history,
        weights=(float(mean_weight), float(variance_weight),
                 float(entropy_weight)),
        seed=seed)


# ---------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------
@keras.saving.register_keras_serializable(package="tf_sparse_split")
class ApproximateRandomDropout(keras.layers.Layer):
    """Approximate random dropout: row or tile patterns (module docstring).

    In training, each call draws one pattern ``(kind, p)`` from the
    distribution and an offset ``o`` uniformly in ``[0, p)``, zeroes the
    pattern and multiplies the kept values by ``1 / (1 - realized rate)``
    (see "Rescaling" in the module docstring). At inference (or with
    ``rate=0``) it is the identity. Gradients flow through the kept values
    only (the same mask and scale).

    Args:
      rate: target drop rate in ``[0, 1)``.
      pattern: ``"row"`` (drop whole neurons = columns of ``X[batch,
        units]`` for the whole batch; the following ``SparseSplitDense``
        compacts them away) or ``"tile"`` (drop ``tile_shape`` blocks of
        ``X`` on a regular diagonal grid).
      tile_shape: ``(batch_rows, units)`` per tile, for ``pattern="tile"``
        (default ``(32, 32)``); the units must divide the layer width.
      max_period: largest period considered by the search (default 8).
      seed: integer seed of the per-step pattern/offset draws (a Keras
        ``SeedGenerator``) and of the search; ``None`` for a random one.
      probabilities: optional explicit distribution: a list of
        ``[kind, period, probability]`` triples (as ``get_config`` stores
        it). Default: ``search_pattern_distribution`` at build time.
      **kwargs: base ``Layer`` arguments.

    Raises:
      ValueError: bad rate, pattern or tile shape (a tile wider than the
        layer or not dividing it is reported at build time).
    """

    def __init__(self, rate, pattern="row", tile_shape=None, max_period=8,
                 seed=None, probabilities=None, **kwargs):
        super().__init__(**kwargs)
        self.rate = _check_rate(rate)
        self.pattern = _check_pattern(pattern)
        if pattern == "tile":
            self.tile_shape = _check_tile_shape(
                (32, 32) if tile_shape is None else tile_shape)
        else:
            if tile_shape is not None:
                raise ValueError("tile_shape is only used with pattern='tile'")
            self.tile_shape = None
        self.max_period = _check_pos_int("max_period", max_period, 2)
        if seed is not None:
            seed = _check_pos_int("seed", seed, 0)
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
        try:
            for kind, p, prob in probabilities:
                if kind not in ("drop", "keep"):
                    raise ValueError(f"pattern kind must be 'drop' or 'keep',"
                                     f" got {kind!r}")
                p = _check_pos_int("period", p, 2 if kind == "drop" else 1)
                prob = float(prob)
                if not prob >= 0:
                    raise ValueError(f"probability must be >= 0, got {prob}")
                out.append((kind, p, prob))
        except TypeError:
            raise ValueError(
                "probabilities must be a list of [kind, period, probability]"
                f" triples, got {probabilities!r}") from None
        total = sum(x[2] for x in out)
        if not out or not total > 0:
            raise ValueError("probabilities must contain a positive entry")
        return [(k, p, prob / total) for k, p, prob in out]

    def build(self, input_shape):
        units = input_shape[-1]
        if units is None:
            raise ValueError("ApproximateRandomDropout needs a known last "
                             "(units) dimension")
        self._units = int(units)
        if self.pattern == "tile":
            _check_tile_fits(self.tile_shape, self._units)
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
        elif self.rate > 0:
            self.distribution = search_pattern_distribution(
                self.rate, self._units, pattern=self.pattern,
                max_period=self.max_period, tile_shape=self.tile_shape,
                seed=0 if self.seed is None else self.seed)
            self._patterns = list(self.distribution.patterns)
            self._probs = self.distribution.probabilities
        else:
            self._patterns, self._probs = [("keep", 1)], np.ones(1)
        self._columns = columns
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
        logits = tf.math.log(tf.constant(
            np.maximum(self._probs, 1e-30)[None, :], tf.float32))
        idx = tf.cast(tf.reshape(keras.random.categorical(
            logits, 1, seed=self.seed_generator), []), tf.int32)
        periods = tf.constant([p for _, p in self._patterns], tf.int32)
        drops = tf.constant([k == "drop" for k, _ in self._patterns])
        p = tf.gather(periods, idx)
        u = keras.random.uniform((), seed=self.seed_generator)
        o = tf.minimum(tf.cast(tf.floor(u * tf.cast(p, tf.float32)),
                               tf.int32), p - 1)
        return tf.gather(drops, idx), p, o

    def keep_mask(self, batch_size=None):
        """Draws one training-step mask: float32 ``[1, units]`` (row) or
        ``[batch_size, units]`` (tile); 1 = kept. Advances the seed state."""
        is_drop, p, o = self._draw()
        if self.pattern == "row":
            q = tf.range(self._units, dtype=tf.int32)[None, :]
        else:
            tb, tu = self.tile_shape
            rows = tf.range(batch_size, dtype=tf.int32) // tb
            cols = tf.range(self._units, dtype=tf.int32) // tu
            q = cols[None, :] - rows[:, None]
        hit = tf.math.floormod(q - o, p) == 0
        dropped = tf.where(is_drop, hit, tf.logical_not(hit))
        return tf.cast(tf.logical_not(dropped), tf.float32)

    def call(self, inputs, training=False):
        if not training or self.rate == 0.0:
            return inputs
        x = tf.convert_to_tensor(inputs)
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
            "probabilities": ([[k, p, float(q)] for (k, p), q in
                               zip(self._patterns, self._probs)]
                              if self.built else
                              ([list(x) for x in self._given]
                               if self._given else None)),
        })
        return config


@keras.saving.register_keras_serializable(package="tf_sparse_split")
class SensitivityAwareDropout(keras.layers.Layer):
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

    Args:
      rate: fraction of channels to drop, in ``[0, 1)``.
      temperature: > 0 (default 1.0).
      momentum: EMA momentum of the score in ``[0, 1)`` (default 0.9).
      seed: integer seed, or None.
      **kwargs: base ``Layer`` arguments.

    Raises:
      ValueError: on bad arguments, or an input that is not rank 4 with a
        known channel count.
    """

    def __init__(self, rate, temperature=1.0, momentum=0.9, seed=None,
                 **kwargs):
        super().__init__(**kwargs)
        self.rate = _check_rate(rate)
        self.temperature = float(temperature)
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.momentum = float(momentum)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if seed is not None:
            seed = _check_pos_int("seed", seed, 0)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.sensitivity = None

    def build(self, input_shape):
        if len(input_shape) != 4 or input_shape[-1] is None:
            raise ValueError(
                "SensitivityAwareDropout expects NHWC input [batch, height, "
                f"width, channels] with known channels, got {input_shape}")
        self.channels = int(input_shape[-1])
        self.num_drop = int(round(self.rate * self.channels))
        if self.num_drop >= self.channels:
            self.num_drop = self.channels - 1
        if self.rate > 0 and self.num_drop == 0:
            raise ValueError(
                f"rate {self.rate} of {self.channels} channel(s) drops no "
                f"channel (round(rate * channels) = 0 after keeping at least "
                f"one); use a higher rate or a layer with more channels")
        self.sensitivity = self.add_weight(
            name="sensitivity", shape=(self.channels,), dtype="float32",
            initializer="zeros", trainable=False, autocast=False)
        self.score_updates = self.add_weight(
            name="score_updates", shape=(), dtype="int64",
            initializer="zeros", trainable=False, autocast=False)
        self.built = True

    def compute_output_shape(self, input_shape):
        return input_shape

    def keep_mask(self):
        """Draws the channel mask ``[channels]`` (1 = kept) from the
        current scores; advances the seed state."""
        c = self.channels
        if self.num_drop == 0:
            return tf.ones([c], tf.float32)
        s = tf.convert_to_tensor(self.sensitivity)
        logits = -tf.math.log(s + 1e-6) / self.temperature
        logits = tf.where(self.score_updates > 0, logits, tf.zeros_like(s))
        u = keras.random.uniform((c,), minval=1e-7, maxval=1.0,
                                 seed=self.seed_generator)
        gumbel = -tf.math.log(-tf.math.log(u))
        _, drop_idx = tf.math.top_k(logits + gumbel, k=self.num_drop)
        dropped = tf.scatter_nd(drop_idx[:, None],
                                tf.ones([self.num_drop], tf.float32), [c])
        return 1.0 - dropped

    def call(self, inputs, training=False):
        if not training or self.num_drop == 0:
            return inputs
        x = tf.convert_to_tensor(inputs)
        keep = self.keep_mask()
        batch_score = tf.cast(
            tf.reduce_mean(tf.abs(tf.stop_gradient(x)), axis=[0, 1, 2]),
            tf.float32)
        m = self.momentum
        new = tf.where(self.score_updates > 0,
                       m * self.sensitivity + (1.0 - m) * batch_score,
                       batch_score)
        self.sensitivity.assign(new)
        self.score_updates.assign_add(1)
        scale = self.channels / (self.channels - self.num_drop)
        return x * tf.cast(keep * scale, x.dtype)[None, None, None, :]

    def get_config(self):
        config = super().get_config()
        config.update({"rate": self.rate, "temperature": self.temperature,
                       "momentum": self.momentum, "seed": self.seed})
        return config
