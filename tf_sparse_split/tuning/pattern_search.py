"""Pattern search for :class:`~tf_sparse_split.layers.ApproximateRandomDropout`.

The candidate row/tile dropout patterns (:func:`pattern_list`), the SGD search
of their probabilities for a target rate (:func:`search_pattern_distribution`,
Z. Song et al., "Approximate Random Dropout", arXiv 1805.08939) and its result
(:class:`PatternDistribution`). The patterns are defined in
:mod:`tf_sparse_split.layers.dropout`. Plain numpy; no TensorFlow.
"""

import math

import numpy as np

from tf_sparse_split.utils.validation import (validate_fraction, validate_int,
                                              validate_positive_float)

__all__ = [
    "PatternDistribution",
    "search_pattern_distribution",
    "pattern_list",
    "PATTERNS",
]

PATTERNS = ("row", "tile")


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------
def check_pattern(pattern):
    if pattern not in PATTERNS:
        raise ValueError(
            f"pattern must be one of {PATTERNS}, got {pattern!r}")
    return pattern


def check_tile_shape(tile_shape):
    try:
        tb, tu = tile_shape
    except (TypeError, ValueError):
        raise ValueError(
            "tile_shape must be a pair (batch_rows, units) of positive "
            f"integers, got {tile_shape!r}") from None
    return (validate_int(tb, "tile_shape[0] (batch rows)"),
            validate_int(tu, "tile_shape[1] (units)"))


def check_tile_fits(tile_shape, units):
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
    num_columns = validate_int(num_columns, "num_columns")
    max_period = validate_int(max_period, "max_period", 2)
    top = min(max_period, num_columns)
    out = [("keep", 1)]
    out += [("drop", p) for p in range(2, top + 1)]
    out += [("keep", p) for p in range(3, top + 1)]
    return out


def _pattern_rates(patterns, num_columns):
    """Per pattern: the realized drop fraction for each offset (array of
    length p) over ``num_columns`` units.

    Counted, not masked: the units ``j < C`` with ``j = o (mod p)`` number
    ``ceil((C - o) / p)`` for ``o < C`` (0 beyond), so the cost is the
    number of offsets, not offsets times units (a mask per offset took 342 s
    at rate 0.999 over 10,000 units, whose periods reach 2,000)."""
    c = int(num_columns)
    out = []
    for kind, p in patterns:
        o = np.arange(p)
        hits = np.where(o < c, (c - o + p - 1) // p, 0)
        dropped = hits if kind == "drop" else c - hits
        out.append(dropped / float(c))
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
    rate = validate_fraction(rate, "rate")
    check_pattern(pattern)
    num_units = validate_int(num_units, "num_units")
    max_period = validate_int(max_period, "max_period", 2)
    steps = validate_int(steps, "steps")
    lr = validate_positive_float(lr, "lr")
    for name, w in (("mean_weight", mean_weight),
                    ("variance_weight", variance_weight),
                    ("entropy_weight", entropy_weight)):
        if not float(w) >= 0:
            raise ValueError(f"{name} must be >= 0, got {w!r}")
    if pattern == "tile":
        if tile_shape is None:
            raise ValueError("pattern='tile' needs tile_shape=(rows, units)")
        tile_shape = check_tile_shape(tile_shape)
        check_tile_fits(tile_shape, num_units)
        num_columns = num_units // tile_shape[1]
    else:
        num_columns = num_units
    if rate > 0 and num_columns < 2:
        raise ValueError(
            f"rate {rate} needs at least 2 units (tile columns) to drop from, "
            f"got {num_columns}")
    top_rate = 1.0 - 1.0 / num_columns
    if rate > top_rate + 1e-12:
        hint = (f"; a narrower tile_shape (now {tuple(tile_shape)}) "
                "gives more columns" if pattern == "tile" else "")
        raise ValueError(
            f"rate {rate} is not reachable with {num_columns} units (tile "
            f"columns): the highest pattern rate is 1 - 1/{num_columns}"
            + hint)
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
