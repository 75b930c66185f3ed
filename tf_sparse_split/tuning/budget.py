"""Execution under a time budget: the controller behind
:class:`~tf_sparse_split.callbacks.TimeBudgetCallback`, free of Keras so that
it runs (and is tested) on recorded or synthetic step times and a fake clock.

R. Sun and L. Zhang, *Dynamic Sparse Method for Deep Learning Execution*
(2019): resources and user demands change during execution, so the amount of
sparsity a model is executed with should be chosen at run time, per layer
and component, by each one's ability to be sparsified. Here the user's demand
is a step time (or an epoch time or a deadline, turned into step times), the
resource is the machine's speed as measured by the steps themselves, and the
knobs are the activation sparsity at each sparse-split layer's input (driven
by a FATReLU cutoff) and, second, dropout rates (an
``ApproximateRandomDropout`` in front of a controlled layer, whose zeros
add to that layer's input; a ``SparseSplitLSTM``'s rates, whose effect is
measured).

The pieces, each a small class or function:

* :class:`LayerCost` -- a layer's predicted forward op seconds as a function
  of its input sparsity, from the op's own statistics: the cost problem
  (``tuning.op_model.cost_problem``: shape, flop per value and per nonzero)
  and its family's terms (seconds per call, flop/s per path). The op takes
  the cheaper of its dense and sparse paths, so the prediction is
  ``min(dense(s), sparse(s))``: flat while the dense path wins, falling with
  density once the sparse one does.
* :class:`StepModel` -- ``step = fixed + factor * sum_l cost_l(s_l)``
  (``factor`` counts the backward products: ~3 GEMM-sized products per
  layer per step), fitted online to the measured medians by ridge
  regression toward its prior, and scaled by ``kappa = measured / predicted``
  at the current settings: the model gives the shape, the measurement the
  level. A measured median far off the prediction at unchanged settings
  (a load came or went) restarts the fit (:meth:`StepModel.restart`).
* :class:`RateCost` -- step seconds of a component against its dropout
  rate, ``slope * kept(rate)``, from two measured medians (for a
  ``SparseSplitLSTM``, whose own loop no op statistic describes);
  :class:`RateKnob` -- a rate's bounds and what predicts it.
* :func:`allocate` -- the per-layer sparsities that meet a predicted step
  time at the least predicted accuracy loss: greedy on a grid, each move the
  one with the most seconds saved per unit of loss (looking ahead over the
  layer's remaining levels, so a layer whose gain starts only past the
  op's break-even is still found). Each layer's loss is its measured
  sensitivity (loss increase per unit of sparsity, Song et al., arXiv
  2203.05705, measured by the callback on a held batch) times the sparsity
  added above its natural level, with the marginal loss assumed to rise
  linearly to twice its measured value at the bound (pruning curves are
  convex). Rates are a second tier, raised only when the activations at
  their bound leave the goal unmet; moves saving less than a least gain are
  not taken; a trimming pass lowers each knob as far as the goal allows
  (rates first).
* :class:`BudgetController` -- the feedback loop: robust step-time estimate
  (median of the steps since the last change, at least ``min_samples`` of
  them, the first ``settle`` after a change left out), a dead band around
  the budget, re-allocation from the layers' natural sparsity each time it
  is left (so sparsity falls again when the machine gets faster; the
  natural sparsity measured again whenever a layer sits at it, since it
  grows as the layer trains), aimed at the band's middle, limits
  on the change per decision (a fall: half a rise; no limit on rises for
  the first move of a deadline from the natural sparsity, whose steps short
  of the allocation are lost time; falls judged against a cautious budget
  where the caller gives one, and then as large as rises), no move against
  the measurement (over the budget no target falls, under it none rises),
  and a log of each decision with its reasons.
* :func:`step_budget` -- an epoch time or a deadline for the whole fit
  turned into a step budget for the remaining steps.

Units: seconds everywhere; sparsity is a fraction of zeros in ``[0, 1]``.
"""

import dataclasses
import math

import numpy as np

from tf_sparse_split.tuning import stats as _stats

__all__ = ["LayerCost", "StepModel", "Allocation", "allocate",
           "RateCost", "RateKnob", "combined_sparsity",
           "activation_sparsity",
           "BudgetController", "Decision", "step_budget",
           "validate_budget_args", "robust_step_time"]


def _finite_positive(value, name):
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError   # float("0.1") would accept text
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a number of seconds. "
                         f"Received: {name}={value!r}") from None
    if isinstance(value, bool) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"`{name}` must be a finite number of seconds > 0. "
                         f"Received: {name}={value!r}")
    return v


def _fraction(value, name, lo=0.0, hi=1.0, hi_open=True):
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a number in [{lo}, {hi}). "
                         f"Received: {name}={value!r}") from None
    if isinstance(value, bool) or not math.isfinite(v) or v < lo or \
            (v >= hi if hi_open else v > hi):
        bracket = ")" if hi_open else "]"
        raise ValueError(f"`{name}` must be in [{lo}, {hi}{bracket}. "
                         f"Received: {name}={value!r}")
    return v


def validate_budget_args(step_time=None, epoch_time=None, deadline=None,
                         max_sparsity=0.95, min_rate=0.0, max_rate=0.7):
    """Checks the budget arguments of :class:`TimeBudgetCallback` and
    :class:`BudgetController`.

    Exactly one of ``step_time``, ``epoch_time``, ``deadline`` (seconds,
    finite, > 0) must be given; ``max_sparsity`` in ``[0, 1)``; ``0 <=
    min_rate <= max_rate < 1``.

    Returns:
      ``(kind, seconds)`` with ``kind`` one of ``"step_time"``,
      ``"epoch_time"``, ``"deadline"``.

    Raises:
      ValueError: none or several budgets, a non-positive, NaN or infinite
        budget, or bounds out of range.
    """
    given = {k: v for k, v in (("step_time", step_time),
                               ("epoch_time", epoch_time),
                               ("deadline", deadline)) if v is not None}
    if len(given) != 1:
        raise ValueError(
            "give exactly one budget: step_time, epoch_time or deadline "
            f"(seconds). Received: {given or 'none'}")
    (kind, value), = given.items()
    seconds = _finite_positive(value, kind)
    _fraction(max_sparsity, "max_sparsity")
    lo = _fraction(min_rate, "min_rate")
    hi = _fraction(max_rate, "max_rate")
    if lo > hi:
        raise ValueError(f"`min_rate` ({lo}) must not exceed `max_rate` "
                         f"({hi})")
    return kind, seconds


# ---------------------------------------------------------------------------
# prediction
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerCost:
    """Predicted forward op seconds of one layer against its input sparsity.

    ``dense = dense_fixed_s * k_live / k + m * k_live * dense_flops_per_elem
    / dense_rate`` (the fixed term scaled as the op scales it when
    compacting)
    ``sparse(s) = sparse_fixed_s + convert_s_per_elem * m * k
    + (1 - s) * m * k * sparse_flops_per_nnz / sparse_rate``
    and the op runs the cheaper: ``seconds(s) = min(dense, sparse(s))`` (the
    op's cost model, ``cc/core/cost_model.h``, without its margins). A path
    whose rate is unknown (0) is left out; with neither known the layer's
    measured seconds per call are returned whatever ``s`` (no prediction).

    Attributes: the terms above (seconds, flop, flop/s), ``measured_s``
    (mean op seconds per call recorded: dense + sparse + analysis parts).
    """

    m: float
    k: float
    k_live: float
    dense_flops_per_elem: float
    sparse_flops_per_nnz: float
    dense_fixed_s: float = 0.0
    dense_rate: float = 0.0
    sparse_fixed_s: float = 0.0
    convert_s_per_elem: float = 0.0
    sparse_rate: float = 0.0
    measured_s: float = 0.0

    @classmethod
    def from_stats(cls, vector, calls=1):
        """From a statistics vector (one call's, or a sum over ``calls``).

        Args:
          vector: float64 ``[stats.NUM_STATS]``.
          calls: the calls summed in ``vector`` (>= 1).

        Raises:
          ValueError: wrong length, ``calls < 1``.
        """
        v = np.asarray(vector, np.float64).reshape(-1)
        if v.shape[0] != _stats.NUM_STATS:
            raise ValueError(f"expected {_stats.NUM_STATS} statistics, got "
                             f"{v.shape[0]}")
        calls = int(calls)
        if calls < 1:
            raise ValueError(f"calls must be >= 1, got {calls}")
        mean = v / calls

        def term(i):
            x = float(mean[i])
            return x if math.isfinite(x) and x > 0 else 0.0

        k = term(_stats.K)
        return cls(
            m=term(_stats.M), k=k, k_live=term(_stats.K_LIVE) or k,
            dense_flops_per_elem=term(_stats.DENSE_FLOPS_PER_ELEM) or
            2.0 * term(_stats.N),
            sparse_flops_per_nnz=term(_stats.SPARSE_FLOPS_PER_NNZ) or
            2.0 * term(_stats.N),
            dense_fixed_s=term(_stats.TERM_DENSE_FIXED),
            dense_rate=term(_stats.TERM_DENSE_RATE),
            sparse_fixed_s=term(_stats.TERM_SPARSE_FIXED),
            convert_s_per_elem=term(_stats.TERM_CONVERT),
            sparse_rate=term(_stats.TERM_SPARSE_RATE),
            measured_s=term(_stats.TIME_DENSE) + term(_stats.TIME_SPARSE) +
            term(_stats.TIME_ANALYZE))

    def dense_seconds(self, live_scale=1.0):
        """The dense path's predicted seconds (inf when its rate is
        unknown), with the live columns ``k_live`` scaled by
        ``live_scale`` (all-zero input channels a channel dropout adds,
        compacted away; at most ``k / k_live``)."""
        if self.dense_rate <= 0:
            return math.inf
        live = min(self.k_live * max(float(live_scale), 0.0), self.k)
        # As in the op's model: with columns compacted away, the fixed
        # term (the read of the weights at small m) covers the live ones.
        fixed = self.dense_fixed_s * (live / self.k if 0 < live < self.k
                                      else 1.0)
        return fixed + \
            self.m * live * self.dense_flops_per_elem / self.dense_rate

    def sparse_seconds(self, sparsity):
        """The sparse path's predicted seconds at ``sparsity`` (inf when its
        rate is unknown)."""
        if self.sparse_rate <= 0:
            return math.inf
        elems = self.m * self.k
        return (self.sparse_fixed_s + self.convert_s_per_elem * elems +
                (1.0 - sparsity) * elems * self.sparse_flops_per_nnz /
                self.sparse_rate)

    @property
    def predicts(self):
        """Whether at least one path's rate is known."""
        return self.dense_rate > 0 or self.sparse_rate > 0

    def seconds(self, sparsity, live_scale=1.0):
        """Predicted op seconds per call at input ``sparsity`` in [0, 1]
        (``live_scale``: :meth:`dense_seconds`)."""
        if not self.predicts:
            return self.measured_s
        s = min(max(float(sparsity), 0.0), 1.0)
        return min(self.dense_seconds(live_scale), self.sparse_seconds(s))


class StepModel:
    """``step(s) = fixed + factor * sum_l cost_l(s_l)`` (seconds), fitted
    online.

    Each observation is a pair (``x = sum_l cost_l(s_l)`` at the settings
    in force, ``y`` = the robust measured step time there). ``fixed`` and
    ``factor`` minimise the squared error over the last ``window``
    observations plus ``prior_weight`` observations' worth of pull toward
    the prior (``factor0``; ``fixed0`` = the first observation's
    ``y - factor0 * x``, at least 0), so two nearly equal ``x`` never give
    a wild slope. ``factor`` is kept in ``[factor_min, factor_max]`` and
    ``fixed >= 0``.

    Args:
      factor0: prior of ``factor`` (default 3: forward product, weight
        gradient and input gradient, each about one forward product).
      window: observations kept (default 8).
      prior_weight: weight of the prior in observations (default 2).
      factor_min, factor_max: bounds of ``factor`` (default 1 and 6).
    """

    def __init__(self, factor0=3.0, window=8, prior_weight=2.0,
                 factor_min=1.0, factor_max=6.0):
        self.factor0 = float(factor0)
        self.window = int(window)
        self.prior_weight = float(prior_weight)
        self.factor_min, self.factor_max = float(factor_min), float(factor_max)
        self.fixed0 = None
        self.fixed = None
        self.factor = self.factor0
        self._obs = []

    def observe(self, x, y, extra=0.0):
        """Adds one observation (``x`` predicted op seconds summed over
        layers, ``y`` measured step seconds, ``extra`` predicted step
        seconds of the rate-driven components, :class:`RateCost`, taken off
        ``y`` before the fit) and refits."""
        x, y = float(x), float(y) - float(extra)
        if not (math.isfinite(x) and math.isfinite(y)) or y <= 0:
            return
        if self.fixed0 is None:
            self.fixed0 = max(y - self.factor0 * x, 0.0)
        self._obs.append((x, y))
        self._obs = self._obs[-self.window:]
        self._fit()

    def restart(self, x, y, extra=0.0):
        """Forgets the observations after a level shift of the machine (a
        load that came or went): the fitted ``factor`` becomes the prior,
        ``fixed`` is re-estimated from this one observation. Without it
        the window would keep fitting ``fixed`` to the steps of the old
        level, and the first predictions at the new one would scale every
        saving by the wrong ``kappa``."""
        self.factor0 = self.factor
        self.fixed0 = None
        self._obs = []
        self.observe(x, y, extra)

    @property
    def observations(self):
        """Observations in the window."""
        return len(self._obs)

    def _fit(self):
        # Ridge toward (fixed0, factor0): the prior counts as prior_weight
        # observations at x0 = the mean x (so it pulls both parameters).
        xs = np.array([o[0] for o in self._obs])
        ys = np.array([o[1] for o in self._obs])
        lam = self.prior_weight
        scale = max(float(np.mean(xs)), 1e-12)
        # Parameters (fixed, factor*scale) are of comparable size.
        a = np.stack([np.ones_like(xs), xs / scale], axis=1)
        ata = a.T @ a + lam * np.eye(2)
        aty = a.T @ ys + lam * np.array([self.fixed0,
                                         self.factor0 * scale])
        fixed, slope = np.linalg.solve(ata, aty)
        factor = float(np.clip(slope / scale, self.factor_min,
                               self.factor_max))
        self.factor = factor
        self.fixed = max(float(np.mean(ys - factor * xs)) if lam == 0 else
                         float(fixed), 0.0)

    def predict(self, x, extra=0.0):
        """Predicted step seconds for op seconds ``x`` plus ``extra`` step
        seconds of the rate-driven components (before any observation:
        ``factor0 * x + extra``)."""
        return (self.fixed or 0.0) + self.factor * float(x) + float(extra)


def robust_step_time(times):
    """The median of ``times`` (seconds): the step-time estimate the
    controller acts on; a few slow steps among many do not move it.

    Raises:
      ValueError: on an empty sequence.
    """
    t = np.asarray(list(times), np.float64)
    if t.size == 0:
        raise ValueError("no step times")
    return float(np.median(t))


# ---------------------------------------------------------------------------
# allocation
# ---------------------------------------------------------------------------
def combined_sparsity(sparsity, rates=()):
    """Fraction of zeros at a layer's input when an activation with
    ``sparsity`` zeros is followed by dropouts at ``rates`` (drawn
    independently of the activation's zeros): ``1 - (1 - s) * prod(1 -
    r)``."""
    keep = 1.0 - float(sparsity)
    for r in rates:
        keep *= 1.0 - float(r)
    return 1.0 - keep


def activation_sparsity(measured, rates=()):
    """The inverse of :func:`combined_sparsity`: the activation's own
    zeros behind a measured input sparsity and the dropout ``rates``
    (clipped to ``[0, 1]``)."""
    keep = 1.0
    for r in rates:
        keep *= 1.0 - float(r)
    if keep <= 0:
        return 0.0
    return min(max(1.0 - (1.0 - float(measured)) / keep, 0.0), 1.0)


class RateCost:
    """Step seconds of a component whose work shrinks with a dropout rate
    and that no op statistic describes (the own loop of
    :class:`~tf_sparse_split.layers.SparseSplitLSTM`):
    ``seconds(r) = slope_s * kept(r)``, ``kept(r)`` the fraction of the
    component's compactable work left at rate ``r`` (e.g. the units a
    recurrent subset keeps, ``(1 - r) ** share``), ``slope_s`` the step
    seconds that work takes at ``kept = 1``.

    Args:
      kept: function of the rate (in [0, 1)) to the fraction kept
        (default ``1 - r``).
      slope_s: seconds (>= 0; 0 = no prediction yet).
    """

    def __init__(self, kept=None, slope_s=0.0):
        self.kept = kept if kept is not None else (lambda r: 1.0 - r)
        s = float(slope_s)
        self.slope_s = s if math.isfinite(s) and s > 0 else 0.0

    @classmethod
    def from_two_rates(cls, kept, rate0, seconds0, rate1, seconds1):
        """The slope through two measured ``(rate, step seconds)`` points
        (robust medians at two rates, the rest of the model unchanged):
        ``(seconds0 - seconds1) / (kept(rate0) - kept(rate1))``, 0 where
        the rates keep the same work or the step got no faster with less
        work."""
        dk = float(kept(rate0)) - float(kept(rate1))
        if abs(dk) < 1e-9:
            return cls(kept, 0.0)
        return cls(kept, (float(seconds0) - float(seconds1)) / dk)

    @property
    def predicts(self):
        """Whether a slope was measured."""
        return self.slope_s > 0

    def seconds(self, rate):
        """Predicted step seconds of the component at ``rate``."""
        return self.slope_s * float(self.kept(min(max(float(rate), 0.0),
                                                  0.999)))


@dataclasses.dataclass
class RateKnob:
    """A dropout rate the controller may move (the second tier: raised
    only when the activation targets alone cannot meet the budget, lowered
    first when there is slack).

    Attributes:
      floor: the lowest rate (the user's own, clipped to the bounds).
      upper: the highest (``max_rate``).
      layer: the controlled layer whose input the dropout thins (its
        zeros add to that layer's input sparsity, predicted by the layer's
        :class:`LayerCost` at :func:`combined_sparsity`), or None.
      cost: a :class:`RateCost` for a component no layer cost covers
        (None for a dropout in front of a controlled layer).
      compacts: whether the dropped units are all-zero input channels of
        ``layer`` that its dense path compacts away
        (:class:`~tf_sparse_split.layers.SensitivityAwareDropout` before a
        convolution): the layer's dense part is then predicted with its
        live columns scaled by ``(1 - rate) / (1 - measured_at)``.
      measured_at: the rate in force when ``layer``'s cost was last read
        (kept by :meth:`BudgetController.set_cost`).
    """

    floor: float
    upper: float
    layer: str = None
    cost: RateCost = None
    compacts: bool = False
    measured_at: float = 0.0


def _layer_seconds(cost, act, knobs, rates):
    """A layer's predicted op seconds at activation sparsity ``act`` with
    its attached rate knobs ``knobs`` (``{name: RateKnob}``) at ``rates``."""
    live = 1.0
    for r, k in knobs.items():
        if k.compacts:
            live *= (1.0 - rates[r]) / max(1.0 - k.measured_at, 1e-6)
    return cost.seconds(combined_sparsity(act, [rates[r] for r in knobs]),
                        live_scale=live)


@dataclasses.dataclass
class Allocation:
    """Result of :func:`allocate`.

    Attributes:
      targets: ``{layer: sparsity}`` chosen (fractions of zeros of the
        activation feeding each layer, before any dropout).
      rates: ``{rate knob: rate}`` chosen.
      predicted_s: predicted step seconds there (after ``kappa``).
      reachable: whether ``predicted_s <= goal_s``.
      reasons: ``{layer or rate knob: text}``: why each got its value.
      moves: ``[(knob, from, to, seconds saved, loss added)]`` in order
        (the greedy moves, before the trimming pass).
    """

    targets: dict
    predicted_s: float
    reachable: bool
    reasons: dict
    moves: list
    rates: dict = dataclasses.field(default_factory=dict)


def _levels(floor, upper, step):
    if upper <= floor + 1e-9:
        return [floor]
    n = int(math.floor((upper - floor) / step + 1e-9))
    lv = [floor + i * step for i in range(n + 1)]
    if upper - lv[-1] > 1e-6:
        lv.append(upper)
    return lv


def marginal_loss(sensitivity, floor, upper, s0, s1):
    """Predicted loss added by raising a layer's sparsity from ``s0`` to
    ``s1`` (``floor <= s0 <= s1 <= upper``): the integral of a marginal loss
    that rises linearly from ``sensitivity`` at ``floor`` to twice that at
    ``upper`` (units of ``sensitivity``: loss per unit of sparsity)."""
    span = max(upper - floor, 1e-9)

    def cum(s):
        u = s - floor
        return sensitivity * (u + 0.5 * u * u / span)

    return cum(s1) - cum(s0)


def allocate(costs, floors, sensitivities, upper, goal_s, model, kappa=1.0,
             step=0.05, start=None, rates=None, rate_step=0.05,
             min_saving_s=0.0, fixed=None, fine_step=None):
    """Per-layer sparsities (and dropout rates) that meet a predicted step
    time at the least predicted loss (greedy; module docstring).

    Two tiers: the activation targets first; the rates (``rates``) only
    if the activations at their bounds leave the goal unmet, each rate
    move ranked by seconds saved per unit of rate added. A move that saves
    less than ``min_saving_s`` is not taken (no accuracy is spent on a
    saving the measurement cannot see). Once the goal is met, a trimming
    pass lowers each knob as far as the goal still allows -- rates first,
    then the layers from the most sensitive -- since a greedy move past an
    op's break-even can overshoot; the layers' targets on a grid of
    ``fine_step``, so the prediction ends just under the goal.

    Args:
      costs: ``{layer: LayerCost}``.
      floors: ``{layer: natural sparsity}`` (the least the layer can have).
      sensitivities: ``{layer: loss per unit sparsity}`` (>= 0; a missing
        layer counts as the mean of the others, 1 if none).
      upper: the largest sparsity allowed (``max_sparsity``).
      goal_s: the step seconds to meet.
      model: a :class:`StepModel`.
      kappa: measured / predicted step time at the settings in force.
      step: grid of sparsity levels (default 0.05).
      start: optional ``{layer: sparsity}`` to start from instead of the
        floors (only raised from there).
      rates: optional ``{name: RateKnob}``.
      rate_step: grid of rate levels (default 0.05).
      min_saving_s: least predicted seconds a move must save (default 0).
      fixed: optional ``{layer: reason}``: layers kept where they start
        (their reason is logged as given).
      fine_step: grid of the layers' targets in the trimming pass
        (default ``step``: the greedy grid).

    Returns:
      :class:`Allocation`.
    """
    rates = dict(rates or {})
    names = list(costs)
    rnames = list(rates)
    known = [float(v) for v in sensitivities.values() if v is not None]
    default = float(np.mean(known)) if known else 1.0
    sens = {n: max(float(sensitivities.get(n, default)
                         if sensitivities.get(n) is not None else default),
                   1e-12) for n in names}
    floor = {n: min(max(float(floors.get(n, 0.0)), 0.0), upper)
             for n in names}
    cur = {n: floor[n] if start is None else
           min(max(float(start.get(n, floor[n])), floor[n]), upper)
           for n in names}
    levels = {n: _levels(floor[n], upper, step) for n in names}
    rfloor = {r: min(max(float(rates[r].floor), 0.0), float(rates[r].upper))
              for r in rnames}
    rup = {r: float(rates[r].upper) for r in rnames}
    rcur = dict(rfloor)
    rlevels = {r: _levels(rfloor[r], rup[r], rate_step) for r in rnames}
    attached = {n: [r for r in rnames if rates[r].layer == n] for n in names}
    # Knobs as (kind, name): one table of settings, levels, loss weights.
    fixed = dict(fixed or {})
    knobs = [("act", n) for n in names if n not in fixed] + [
        ("rate", r) for r in rnames
                                           if rates[r].layer in costs or
                                           rates[r].cost is not None]

    def predicted(act, rt):
        x = sum(_layer_seconds(costs[n], act[n],
                               {r: rates[r] for r in attached[n]}, rt)
                for n in names)
        extra = sum(rates[r].cost.seconds(rt[r]) for r in rnames
                    if rates[r].cost is not None)
        return kappa * model.predict(x, extra)

    def settings(kind):
        return cur if kind == "act" else rcur

    def bounds(kind, n):
        return ((floor[n], upper, levels[n], sens[n]) if kind == "act" else
                (rfloor[n], rup[n], rlevels[n], 1.0))

    def trial(kind, n, value):
        act, rt = dict(cur), dict(rcur)
        (act if kind == "act" else rt)[n] = value
        return predicted(act, rt)

    moves = []
    now = predicted(cur, rcur)
    for tier in ("act", "rate"):
        while now > goal_s:
            best = None
            for kind, n in knobs:
                if kind != tier:
                    continue
                lo, hi, lv_list, sw = bounds(kind, n)
                c0 = settings(kind)[n]
                for lv in lv_list:
                    if lv <= c0 + 1e-9:
                        continue
                    saved = now - trial(kind, n, lv)
                    if saved <= 0 or saved < min_saving_s:
                        continue
                    loss = marginal_loss(sw, lo, hi, c0, lv)
                    # A move that meets the goal by itself is judged by the
                    # part of its saving that is needed (a larger saving
                    # than needed buys nothing).
                    useful = min(saved, now - goal_s)
                    ratio = useful / max(loss, 1e-18)
                    if best is None or ratio > best[0] + 1e-15:
                        best = (ratio, n, lv, saved, loss)
            if best is None:
                break
            _, n, lv, saved, loss = best
            moves.append((n, settings(tier)[n], lv, saved, loss))
            settings(tier)[n] = lv
            now = predicted(cur, rcur)
    reachable = now <= goal_s
    if reachable:
        order = [k for k in knobs if k[0] == "rate"] + sorted(
            (k for k in knobs if k[0] == "act"), key=lambda k: -sens[k[1]])
        for kind, n in order:
            lo, hi, lv_list, _ = bounds(kind, n)
            if kind == "act" and fine_step:
                lv_list = _levels(lo, hi, fine_step)
            c0 = settings(kind)[n]
            for lv in lv_list:
                if lv >= c0 - 1e-9:
                    break
                if trial(kind, n, lv) <= goal_s:
                    settings(kind)[n] = lv
                    break
        now = predicted(cur, rcur)
    reasons = {}
    for kind, n in [("act", n) for n in names] + [("rate", r)
                                                  for r in rnames]:
        lo, hi, _, sw = bounds(kind, n)
        v = settings(kind)[n]
        if kind == "act" and not costs[n].predicts:
            reasons[n] = "no cost prediction yet (op rates unknown)"
            continue
        if kind == "act" and n in fixed:
            reasons[n] = fixed[n]
            continue
        if kind == "rate" and (kind, n) not in knobs:
            reasons[n] = "no prediction of its effect on the step time"
            continue
        what = "natural sparsity" if kind == "act" else "floor rate"
        if v <= lo + 1e-9:
            if reachable:
                why = "budget met without it"
            elif min_saving_s > 0:
                why = ("raising it saves no predicted time (or less than "
                       f"{min_saving_s * 1e3:.2f} ms/step)")
            else:
                why = "raising it saves no predicted time"
            reasons[n] = f"kept at its {what}: {why}"
            continue
        saved = trial(kind, n, lo) - now
        loss = marginal_loss(sw, lo, hi, lo, v)
        unit = (f"sensitivity {sw:.3g}/unit" if kind == "act"
                else "rate counted as loss 1/unit")
        reasons[n] = (f"raised {lo:.2f}->{v:.2f}: saves {saved * 1e3:.2f} "
                      f"ms/step for predicted loss {loss:.3g} ({unit}, "
                      f"{saved * 1e3 / max(loss, 1e-18):.3g} ms per unit "
                      "loss)")
    return Allocation(targets=cur, predicted_s=now, reachable=reachable,
                      reasons=reasons, moves=moves, rates=rcur)


# ---------------------------------------------------------------------------
# deadlines
# ---------------------------------------------------------------------------
def step_budget(kind, seconds, steps_per_epoch=None, epochs=None,
                elapsed_total=0.0, elapsed_epoch=0.0, steps_done_total=0,
                steps_done_epoch=0, overhead_per_epoch=0.0):
    """The step budget (seconds) for the remaining steps.

    * ``"step_time"``: ``seconds``.
    * ``"epoch_time"``: ``(seconds - overhead_per_epoch - elapsed_epoch) /
      (steps_per_epoch - steps_done_epoch)``.
    * ``"deadline"`` (seconds from the start of training for the whole
      fit): ``(seconds - elapsed_total - overhead_per_epoch * epochs_left)
      / (epochs * steps_per_epoch - steps_done_total)``, with ``epochs_left``
      the epochs not yet finished (the current one included).

    ``overhead_per_epoch`` is the time of an epoch spent outside training
    steps (validation, callbacks at epoch end). A budget already spent
    gives 0 (the caller then runs at the bounds and logs it). The
    arithmetic from given totals; :class:`~tf_sparse_split.tuning.deadline.
    WallTimePlan` (what ``TimeBudgetCallback`` uses) measures the parts of
    a fit's wall time outside its steps as the fit goes.

    Raises:
      ValueError: unknown ``kind``, or ``steps_per_epoch``/``epochs``
        missing where needed.
    """
    if kind == "step_time":
        return float(seconds)
    if not steps_per_epoch or steps_per_epoch < 1:
        raise ValueError(f"a {kind} budget needs the steps per epoch "
                         "(a dataset of known length, or steps_per_epoch)")
    if kind == "epoch_time":
        left = max(int(steps_per_epoch) - int(steps_done_epoch), 1)
        return max((seconds - overhead_per_epoch - elapsed_epoch) / left, 0.0)
    if kind == "deadline":
        if not epochs or epochs < 1:
            raise ValueError("a deadline needs the number of epochs")
        total = int(epochs) * int(steps_per_epoch)
        left = max(total - int(steps_done_total), 1)
        epochs_left = int(epochs) - int(steps_done_total) // int(
            steps_per_epoch)
        return max((seconds - elapsed_total -
                    overhead_per_epoch * max(epochs_left, 0)) / left, 0.0)
    raise ValueError(f"unknown budget kind {kind!r}")


# ---------------------------------------------------------------------------
# feedback
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Decision:
    """One decision of :class:`BudgetController` (its ``log``).

    Attributes: ``step`` (the controller's step count: the steps it
    observed; :class:`~tf_sparse_split.TimeBudgetCallback` records the
    fit's training step, counted from 1, first step included), ``budget_s``,
    ``measured_s`` (robust estimate), ``predicted_s`` (at the new targets),
    ``kappa``, ``targets`` (``{layer: sparsity}``), ``reachable``,
    ``action`` (``"hold"``, ``"reallocate"``, ``"unreachable"``, or
    ``"test fall"`` and ``"test fall undone"``: see
    :class:`BudgetController`'s ``test_falls``),
    ``reasons`` (``{layer or rate knob: text}``), ``rates`` (``{rate knob:
    rate}``), ``best_s`` (predicted step seconds at the allocation aimed at,
    before the limits on the change per decision: the fastest the bounds
    allow when the budget is unreachable; NaN for a hold in the dead
    band).
    """

    step: int
    budget_s: float
    measured_s: float
    predicted_s: float
    kappa: float
    targets: dict
    reachable: bool
    action: str
    reasons: dict
    rates: dict = dataclasses.field(default_factory=dict)
    best_s: float = math.nan


class BudgetController:
    """Chooses per-layer sparsity targets (and dropout rates) to meet a
    step budget, from measured step times (module docstring).

    Call :meth:`observe_step` after every step with its seconds, keep
    :meth:`set_cost`, :meth:`set_floor` and :meth:`set_sensitivity` current,
    and call :meth:`decide` with the budget; it returns the targets to apply
    (or None while it waits for samples or holds); :attr:`rates` holds the
    rates to apply.

    Args:
      layers: the controlled layers' names (may be empty when ``rates``
        is not).
      max_sparsity: the largest target, in ``[0, 1)``.
      step: grid of sparsity levels (default 0.05).
      min_samples: steps measured at a setting before deciding (default 8).
      settle: steps left out after a change (default 3: the FATReLU cutoff
        follows its target with a moving average).
      window: most recent steps the median is taken over (default 32).
      band: dead band: no change while ``budget * (1 - 2 band) <= measured
        <= budget * (1 + band)`` (default 0.03).
      aim: a change aims at ``budget * (1 - aim * band)`` (in ``[0, 2]``;
        default 0.5: the band's middle, so the next median lands inside
        it whichever way the noise moves it).
      max_change: largest rise of one layer's target per decision
        (default 0.15; a fall is limited to half of it).
      model: a :class:`StepModel` (default ``StepModel()``).
      rates: optional ``{name: RateKnob}``: the dropout rates to control
        (second tier, :func:`allocate`).
      max_rate_change: largest rise of one rate per decision (default
        0.1; a fall: half of it).
      min_gain: least predicted saving of a move, as a fraction of the
        measured step (default 0.01: a move that saves less than 1% of the
        step buys nothing the median can see, and costs accuracy).
      shift: a measured median more than ``1 + shift`` times off the step
        model's prediction at the settings in force (default 0.3) is taken
        as a change of the machine's speed: the model forgets its window
        (:meth:`StepModel.restart`).
      recheck: new steps measured before the next decision when the last
        one changed nothing (a hold in the dead band, or targets already
        where the allocation wants them; int >= 1, default 4). The median
        then still covers the last ``min_samples`` steps; deciding at
        every step would re-run the allocation (about a millisecond of
        Python on these machines) on a median that moved by one sample.
      test_falls: when the measured median sits under the dead band and
        the allocation keeps every setting (the step model predicts that
        any fall would break the budget), lower one knob by one level
        anyway (default True): the measurement, not the model's slope,
        decides whether there is room. The decision's action is ``"test
        fall"``. When the steps after it measure over the band, the next
        decision puts that knob back at least where it was (``"test fall
        undone"``; higher only as far as the allocation asks, with the
        model refitted on the new point): the steps then alternate around
        the budget between two neighbouring levels.
      bound_gain: when the budget is not reachable within the bounds, a
        layer is raised toward ``max_sparsity`` only if raising it alone
        from its natural sparsity to the bound is predicted to save at
        least this fraction of the measured step (default 0.05). The
        budget is missed either way; a layer that buys only a sliver of
        the step (a small output layer) would spend accuracy on a miss a
        few percent smaller.
      track_natural: at each decision, a layer whose target is at its
        floor (its cutoff off) takes the sparsity it measures there
        (:meth:`set_actual`) as its floor and target (default True). A
        ReLU layer's natural sparsity grows as it trains: a floor kept at
        the warm-up's value makes every prediction at the floor, and at
        the levels between it and the natural sparsity now, too slow, and
        the allocation then keeps sparsity the budget does not need.
      fine_step: grid of the trimming pass of :func:`allocate` (default
        ``step / 5``): the targets end just under the goal rather than up
        to one ``step`` below it.

    Raises:
      ValueError: bad arguments.
    """

    def __init__(self, layers, max_sparsity=0.95, step=0.05, min_samples=8,
                 settle=3, window=32, band=0.03, max_change=0.15, model=None,
                 rates=None, max_rate_change=0.1, min_gain=0.01, shift=0.3,
                 recheck=4, test_falls=True, bound_gain=0.05,
                 track_natural=True, fine_step=None, aim=0.5):
        self.layers = list(layers)
        self.rate_knobs = dict(rates or {})
        if not self.layers and not self.rate_knobs:
            raise ValueError("BudgetController needs at least one layer or "
                             "rate")
        self.max_sparsity = _fraction(max_sparsity, "max_sparsity")
        self.step = _fraction(step, "step", hi=0.5)
        if self.step <= 0:
            raise ValueError(f"`step` must be > 0. Received: step={step!r}")
        self.min_samples = int(min_samples)
        self.settle = int(settle)
        self.window = int(window)
        if self.min_samples < 1 or self.settle < 0 or \
                self.window < self.min_samples:
            raise ValueError("need min_samples >= 1, settle >= 0 and "
                             "window >= min_samples")
        self.band = _fraction(band, "band", hi=0.5)
        self.max_change = _fraction(max_change, "max_change", hi=1.0,
                                    hi_open=False)
        if self.max_change <= 0:
            raise ValueError("`max_change` must be > 0")
        self.max_rate_change = _fraction(max_rate_change, "max_rate_change",
                                         hi=1.0, hi_open=False)
        if self.max_rate_change <= 0:
            raise ValueError("`max_rate_change` must be > 0")
        self.min_gain = _fraction(min_gain, "min_gain", hi=0.5)
        self.shift = float(shift)
        if isinstance(recheck, bool) or not isinstance(
                recheck, (int, np.integer)) or recheck < 1:
            raise ValueError(f"`recheck` must be an int >= 1. Received: "
                             f"recheck={recheck!r}")
        self.recheck = int(recheck)
        self.test_falls = bool(test_falls)
        self.bound_gain = _fraction(bound_gain, "bound_gain", hi=1.0)
        try:
            self.aim = math.nan if isinstance(aim, bool) else float(aim)
        except (TypeError, ValueError):
            self.aim = math.nan
        if not 0.0 <= self.aim <= 2.0:
            raise ValueError(f"`aim` must be in [0, 2]. Received: aim={aim!r}")
        self.track_natural = bool(track_natural)
        self.fine_step = (self.step / 5 if fine_step is None else
                          _fraction(fine_step, "fine_step", hi=0.5))
        if self.fine_step <= 0:
            raise ValueError(f"`fine_step` must be > 0. Received: "
                             f"fine_step={fine_step!r}")
        if not math.isfinite(self.shift) or self.shift <= 0:
            raise ValueError(f"`shift` must be > 0. Received: shift={shift!r}")
        for name, knob in self.rate_knobs.items():
            lo = _fraction(knob.floor, f"floor of rate {name!r}")
            hi = _fraction(knob.upper, f"upper of rate {name!r}")
            if lo > hi:
                raise ValueError(f"rate {name!r}: floor {lo} above upper "
                                 f"{hi}")
        self.model = model if model is not None else StepModel()
        self.costs = {}
        self.floors = {n: 0.0 for n in self.layers}
        self.sensitivities = {}
        self.targets = dict(self.floors)
        self.rates = {r: float(k.floor) for r, k in self.rate_knobs.items()}
        self.actual = {}
        self.log = []
        self.steps = 0
        self._times = []        # steps since the last change
        self._fresh = 0         # samples since the last decision
        self._held = False      # the last decision changed nothing
        self._since_change = 0
        self._unreachable_logged = False
        self._test = None           # (knob, value before) of a test fall

    # -- inputs ------------------------------------------------------------
    def observe_step(self, seconds):
        """Records one step's seconds (non-finite or non-positive values
        are ignored)."""
        self.steps += 1
        self._since_change += 1
        s = float(seconds)
        if not math.isfinite(s) or s <= 0 or self._since_change <= \
                self.settle:
            return
        self._times.append(s)
        self._times = self._times[-self.window:]
        self._fresh += 1

    def set_cost(self, layer, cost):
        """The layer's :class:`LayerCost` (refresh it from new statistics,
        recorded at the rates in force)."""
        self.costs[layer] = cost
        for r, k in self.rate_knobs.items():
            if k.layer == layer:
                k.measured_at = self.rates[r]

    def set_rate_cost(self, name, cost):
        """The :class:`RateCost` of rate knob ``name`` (a component no
        layer cost covers)."""
        self.rate_knobs[name].cost = cost

    def set_floor(self, layer, sparsity):
        """The layer's natural sparsity (its activation's zeros with no
        cutoff)."""
        self.floors[layer] = min(max(float(sparsity), 0.0), self.max_sparsity)
        self.targets[layer] = max(self.targets[layer], self.floors[layer])

    def set_actual(self, layer, sparsity):
        """The sparsity the layer's activation measured at the settings in
        force (used for the model's observation instead of the target,
        which the cutoff follows with a lag)."""
        self.actual[layer] = min(max(float(sparsity), 0.0), 1.0)

    def set_sensitivity(self, layer, value, at=None):
        """The layer's loss increase per unit of sparsity (>= 0), measured
        at sparsity ``at`` (default: its natural sparsity). The allocation's
        loss model (:func:`marginal_loss`: the marginal rises linearly to
        twice its natural-sparsity value at the bound) turns a value
        measured above the natural sparsity back into the natural one."""
        v = float(value)
        if not math.isfinite(v):
            self.sensitivities[layer] = None
            return
        v = max(v, 0.0)
        floor = self.floors.get(layer, 0.0)
        if at is not None and math.isfinite(float(at)) and float(at) > floor:
            span = max(self.max_sparsity - floor, 1e-9)
            v /= 1.0 + min((float(at) - floor) / span, 1.0)
        self.sensitivities[layer] = v

    def layers_that_buy_time(self, measured_s):
        """The layers whose sparsity, raised alone from the natural level
        to ``max_sparsity`` (rates as in force), is predicted to save at
        least half of ``min_gain * measured_s`` step seconds (``factor``
        times the op seconds saved; a layer without a predicting cost is
        left out). The allocation weighs the layers against each other by
        their sensitivities only when two or more do: otherwise a
        sensitivity probe cannot change what it chooses.

        Args:
          measured_s: the step seconds the saving is compared with.
        """
        m = float(measured_s) if measured_s else 0.0
        return [n for n, saving in self._bound_savings().items()
                if saving > 0 and saving >= 0.5 * self.min_gain * m]

    def _bound_savings(self):
        """``{layer: predicted step seconds (before kappa) it saves raised
        alone from its natural sparsity to max_sparsity}`` (rates as in
        force), for the layers whose cost predicts."""
        out = {}
        for n in self.layers:
            cost = self.costs.get(n)
            if cost is None or not cost.predicts:
                continue
            knobs = {r: k for r, k in self.rate_knobs.items()
                     if k.layer == n}
            out[n] = self.model.factor * (
                _layer_seconds(cost, self.floors[n], knobs, self.rates) -
                _layer_seconds(cost, self.max_sparsity, knobs, self.rates))
        return out

    def _small_savers(self, kappa, m):
        """``{layer: reason}`` for the layers whose whole range saves less
        than ``bound_gain`` of the measured step ``m`` (kept at their
        natural sparsity while the budget is unreachable)."""
        out = {}
        for n, saving in self._bound_savings().items():
            saving *= kappa
            if 0 < saving < self.bound_gain * m:
                out[n] = (f"kept at its natural sparsity: the budget is not "
                          f"reachable, and raising it to the bound saves "
                          f"{saving * 1e3:.2f} ms/step, less than bound_gain"
                          f"={self.bound_gain:g} of the step "
                          f"({m * 1e3:.2f} ms)")
        return out

    @property
    def at_floors(self):
        """Whether every target and rate is at its floor (the natural
        sparsity and the user's rates: nothing bought yet)."""
        return all(self.targets[n] <= self.floors[n] + 1e-9
                   for n in self.layers) and all(
            self.rates[r] <= float(k.floor) + 1e-9
            for r, k in self.rate_knobs.items())

    @property
    def samples(self):
        """Steps measured at the settings in force (after settling)."""
        return len(self._times)

    def measured(self):
        """The robust step-time estimate (median), or None without
        samples."""
        return robust_step_time(self._times) if self._times else None

    def _x(self, targets, rates=None):
        rates = self.rates if rates is None else rates
        return sum(_layer_seconds(
            self.costs[n], targets[n],
            {r: k for r, k in self.rate_knobs.items() if k.layer == n},
            rates) for n in self.layers if n in self.costs)

    def _extra(self, rates=None):
        rates = self.rates if rates is None else rates
        return sum(k.cost.seconds(rates[r]) for r, k in
                   self.rate_knobs.items() if k.cost is not None)

    # -- decision ------------------------------------------------------------
    def decide(self, budget_s, jump=False, fall_budget_s=None):
        """Decides, if enough steps were measured since the last change.

        Args:
          budget_s: the step budget (seconds).
          jump: lift the limit on rises (``max_change``, ``max_rate_change``
            per decision): the targets go to the allocation at once. For a
            deadline or an epoch time, where the steps run short of the
            allocation while a ramp climbs to it are time lost for good
            (the steps after them have less time each); falls stay
            limited. ``TimeBudgetCallback`` jumps from the natural
            sparsity (:attr:`at_floors`) only: a jump at every burst of
            load would send the targets to the bounds each time, and they
            fall at half the rate.
          fall_budget_s: optional cautious step budget (seconds, at most
            ``budget_s``): under ``budget_s`` the targets fall only as far
            as this budget allows, and hold while the measured steps are
            within its dead band (a deadline whose budget rests on
            predicted epoch ends: sparsity given back on a prediction that
            turns out short cannot be bought back at the bounds). With it,
            a fall may be as large as a rise (``max_change``): the cautious
            budget keeps it short.

        Returns:
          ``{layer: sparsity}`` to apply (with :attr:`rates`), or None
          (waiting, or holding inside the dead band, or nothing changed).
          Every decision taken is appended to :attr:`log` (a
          :class:`Decision`).
        """
        if len(self._times) < self.min_samples or (
                self._held and self._fresh < self.recheck):
            return None
        self._fresh = 0
        self._held = True
        if self.track_natural:
            self._track_natural()
        budget_s = float(budget_s)
        m = self.measured()
        x_now = self._x({n: self.actual.get(n, self.targets[n])
                         for n in self.layers})
        extra_now = self._extra()
        prior = (self.model.predict(x_now, extra_now)
                 if self.model.observations else None)
        if prior and not (1 / (1 + self.shift) <= m / prior <=
                          1 + self.shift):
            # The machine changed speed (the settings' predicted effect
            # cannot explain the measurement): refit from here.
            self.model.restart(x_now, m, extra_now)
        else:
            self.model.observe(x_now, m, extra_now)
        pred_now = self.model.predict(x_now, extra_now)
        kappa = m / pred_now if pred_now > 0 else 1.0
        costs = {n: self.costs[n] for n in self.layers if n in self.costs}
        rate_knobs = {r: k for r, k in self.rate_knobs.items()
                      if (k.layer in costs) or
                      (k.cost is not None and k.cost.predicts)}
        if not costs and not rate_knobs:
            return None
        lo, hi = budget_s * (1 - 2 * self.band), budget_s * (1 + self.band)
        cautious = False
        if fall_budget_s is not None and m < lo and \
                float(fall_budget_s) < budget_s:
            # Under the budget the targets would fall: judged against the
            # cautious budget instead (no rise: m < lo of the plain one).
            budget_s = max(float(fall_budget_s), 0.0)
            lo = min(budget_s * (1 - 2 * self.band), lo)
            hi = max(budget_s * (1 + self.band), m)
            cautious = True
        test, self._test = self._test, None
        if lo <= m <= hi:
            why = ("within the dead band of the cautious budget"
                   if cautious else "within the dead band")
            self._record(budget_s, m, pred_now * kappa, kappa, "hold", True,
                         {n: why for n in self.layers},
                         self.targets, self.rates)
            self._times = self._times[-self.min_samples:]
            return None
        # Aim at the middle of the band (``aim``), so that the next
        # measurement lands in it whichever way the noise moves it (the
        # trimming pass on ``fine_step`` ends the prediction just under the
        # aim).
        goal = budget_s * (1 - self.aim * self.band)
        alloc = allocate(costs, self.floors, self.sensitivities,
                         self.max_sparsity, goal, self.model, kappa=kappa,
                         step=self.step, rates=rate_knobs,
                         min_saving_s=self.min_gain * m,
                         fine_step=self.fine_step)
        if not alloc.reachable and self.bound_gain > 0:
            small = self._small_savers(kappa, m)
            if small:
                alloc = allocate(costs, self.floors, self.sensitivities,
                                 self.max_sparsity, goal, self.model,
                                 kappa=kappa, step=self.step,
                                 rates=rate_knobs,
                                 min_saving_s=self.min_gain * m, fixed=small,
                                 fine_step=self.fine_step)
        # Rises are limited to max_change per decision (none with
        # ``jump``), falls to half of it (a fall that overshoots breaks the
        # budget; one that is short only leaves a little accuracy for the
        # next decision) -- to all of it under a cautious budget, which
        # already keeps the falls short of what the plain budget allows.
        rise = math.inf if jump else 1.0
        fall = 1.0 if fall_budget_s is not None else 0.5
        new, new_rates = {}, dict(self.rates)
        for n in self.layers:
            want = alloc.targets.get(n, self.floors[n])
            old = self.targets[n]
            delta = float(np.clip(want - old, -fall * self.max_change,
                                  rise * self.max_change))
            new[n] = float(np.clip(old + delta, self.floors[n],
                                   self.max_sparsity))
        act_rising = any(new[n] > self.targets[n] + 1e-9
                         for n in self.layers)
        act_short = any(new[n] < alloc.targets.get(n, self.floors[n]) - 1e-9
                        for n in self.layers)
        for r, k in rate_knobs.items():
            want = alloc.rates.get(r, k.floor)
            old = self.rates[r]
            delta = float(np.clip(want - old,
                                  -fall * self.max_rate_change,
                                  rise * self.max_rate_change))
            if delta > 0 and (act_short if jump else act_rising):
                # Second tier: a rate rises only once the activation
                # targets have reached their allocation (with ``jump`` in
                # the same decision).
                delta = 0.0
            new_rates[r] = float(np.clip(old + delta, k.floor, k.upper))
        if any(new_rates[r] < self.rates[r] - 1e-9 for r in new_rates):
            # ... and falls first: the activation targets wait for it.
            for n in self.layers:
                new[n] = max(new[n], self.targets[n])
        # Never move against the measurement: over the budget no target
        # falls, under it none rises (the prediction's shape can be off,
        # e.g. when load moves the ops' measured rates).
        held = {}
        for cur, nxt in ((self.targets, new), (self.rates, new_rates)):
            for n in nxt:
                if m > hi and nxt[n] < cur[n]:
                    nxt[n] = held[n] = cur[n]
                elif m < lo and nxt[n] > cur[n]:
                    nxt[n] = held[n] = cur[n]
        action = "reallocate" if alloc.reachable else "unreachable"
        reasons = dict(alloc.reasons)
        if not alloc.reachable:
            for n in list(self.layers) + list(rate_knobs):
                value = new.get(n, new_rates.get(n))
                if n in reasons and not reasons[n].startswith("kept"):
                    reasons[n] = (
                        f"budget not reachable within max_sparsity="
                        f"{self.max_sparsity} and the rate bounds "
                        f"(predicted {alloc.predicted_s * 1e3:.2f} ms at the "
                        f"best allocation, goal {goal * 1e3:.2f} ms): toward "
                        f"the bound, now {value:.2f}; allocation: "
                        f"{alloc.reasons[n]}")
        predicted = kappa * self.model.predict(self._x(new, new_rates),
                                               self._extra(new_rates))
        for n, v in held.items():
            if n in reasons:
                reasons[n] += (f" (held at {v:.2f}: the measured steps are "
                               f"{'over' if m > hi else 'under'} the budget)")
        undone = False
        if test is not None and m > hi:
            # The test fall broke the budget: at least back to where it
            # was, whatever the model's allocation says (the model has now
            # seen the point).
            n, before = test
            nxt = new if n in new else new_rates
            if nxt[n] < before - 1e-9:
                nxt[n] = before
                undone = True
                if n in reasons:
                    reasons[n] += (f" (test fall taken back to {before:.2f}: "
                                   f"the steps measured {m * 1e3:.2f} ms, "
                                   "over the budget's band)")
        for cur, nxt, want, limit in (
                (self.targets, new, alloc.targets, self.max_change),
                (self.rates, new_rates, alloc.rates, self.max_rate_change)):
            for n in nxt:
                aim = want.get(n)
                if n in held or n not in reasons or aim is None or \
                        abs(nxt[n] - aim) <= 1e-9:
                    continue
                if abs(nxt[n] - cur[n]) <= 1e-9:
                    how = "waits for the other knobs"
                elif nxt[n] < aim:
                    how = (f"a rise is limited to {rise * limit:.3g} per "
                           "decision" if math.isfinite(rise) else
                           "a rate waits for the activation targets")
                else:
                    how = f"a fall is limited to {fall * limit:.3g} per decision"
                reasons[n] += f" (now {nxt[n]:.2f}, aiming at {aim:.2f}: {how})"
        changed = any(abs(new[n] - self.targets[n]) > 1e-9
                      for n in self.layers) or any(
            abs(new_rates[r] - self.rates[r]) > 1e-9 for r in new_rates)
        if undone and action == "reallocate":
            action = "test fall undone"
        if not changed and alloc.reachable and m < lo and self.test_falls:
            probe = self._fall_probe(new, new_rates, m, lo)
            if probe is not None:
                n, v, why = probe
                self._test = (n, (new if n in new else new_rates)[n])
                (new if n in new else new_rates)[n] = v
                reasons[n] = why
                action = "test fall"
                changed = True
                predicted = kappa * self.model.predict(
                    self._x(new, new_rates), self._extra(new_rates))
        if not changed and alloc.reachable:
            action = "hold"
            reasons = {n: "allocation unchanged" for n in reasons}
        self._record(budget_s, m, predicted, kappa, action, alloc.reachable,
                     reasons, new, new_rates, best_s=alloc.predicted_s)
        self.targets = new
        self.rates = new_rates
        if changed:
            self._times = []
            self._since_change = 0
            self._held = False
            return dict(new)
        self._times = self._times[-self.min_samples:]
        return None

    def _fall_probe(self, targets, rates, m, lo):
        """One knob lowered by one level when the measured steps sit under
        the dead band while the allocation keeps every setting: the step
        model's slope is then off (it predicts the fall would break the
        budget, the measurement says there is room). Rates first, then
        the raised layer with the highest sensitivity (the order of
        :func:`allocate`'s trimming pass). Returns ``(name, value,
        reason)`` or None (everything at its floor)."""
        why = (f"lowered one level to test the prediction: the steps "
               f"measure {m * 1e3:.2f} ms, under the dead band "
               f"(< {lo * 1e3:.2f} ms), and the allocation kept it")
        for r, k in self.rate_knobs.items():
            if r in rates and rates[r] > float(k.floor) + 1e-9:
                below = [v for v in _levels(float(k.floor), float(k.upper),
                                            0.05) if v < rates[r] - 1e-9]
                return r, below[-1], why
        raised = [n for n in self.layers
                  if targets[n] > self.floors[n] + 1e-9]
        if not raised:
            return None
        n = max(raised, key=lambda n: (self.sensitivities.get(n) or 0.0))
        # One ``step`` down (the trimming pass leaves targets off the
        # greedy grid), not below the floor.
        return n, max(targets[n] - self.step, self.floors[n]), why

    def _track_natural(self):
        """Layers whose target is at the floor run with their cutoff
        off: the sparsity they measure (:meth:`set_actual`) is their
        natural sparsity now, which becomes their floor and target (it
        grows as a ReLU layer trains; a floor left at the warm-up's value
        would make the allocation keep sparsity that buys nothing)."""
        for n in self.layers:
            a = self.actual.get(n)
            if a is None:
                continue
            # Within 0.01 of the floor TimeBudgetCallback turns the cutoff
            # off too. (A raised layer's measured sparsity says nothing of
            # its natural one: after a fall it runs over its target for a
            # while, as the cutoff follows its target with a lag.)
            if self.targets[n] <= self.floors[n] + 0.01 + 1e-9:
                self.floors[n] = self.targets[n] = min(max(a, 0.0),
                                                       self.max_sparsity)

    def _record(self, budget, measured, predicted, kappa, action, reachable,
                reasons, targets, rates, best_s=math.nan):
        self.log.append(Decision(step=self.steps, budget_s=budget,
                                 measured_s=measured, predicted_s=predicted,
                                 kappa=kappa, targets=dict(targets),
                                 reachable=reachable, action=action,
                                 reasons=dict(reasons), rates=dict(rates),
                                 best_s=float(best_s)))
