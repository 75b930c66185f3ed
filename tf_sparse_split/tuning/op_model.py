"""The ops' own cost model, read from their statistics vectors.

There is one estimator of the dense and sparse paths' costs: the family
model of the op library (``FamilyModel`` in ``cc/core/cost_model.h``). Each
problem family (op, dtype, sizes, attrs) is calibrated on its first
automatic call -- its dense and sparse paths timed on the call's own rows --
and its terms are then scaled by the median of the last calls'
measured/predicted ratios; a family that never ran automatically learns
each path's rate from the calls' own times. The ops decide with those terms
(``DecideSplit``: margins, hysteresis) on every automatic call.

Python reads the same terms instead of fitting its own. They cannot be asked
for through the pybind11 module ``tf_sparse_split._kernels``: that module
is a separate shared object built from its own copy of ``cc/core``, so its
``FamilyFor`` registry is a different (and empty) one from the op
library's, which the ops fill. An extra op that returns a family's terms
would need the family key rebuilt in Python and one more call per layer.
Instead every call writes its cost problem into the statistics vector it
already returns (``stats.COST_FIRST`` .. ``stats.COST_LAST``: the call's
``SplitShape`` -- live values per row, flop per value and per nonzero,
copies -- and its family's ``CostTerms`` after the call, and whether the
family was calibrated). That vector is already recorded by the layers, read
by the tuner at its sampled batches, all-reduced under ``tf.distribute``
and summed over an epoch, so the terms arrive where the statistics do, with
no extra op and no extra host read. ``_kernels.cost_problem_from_stats``
(``ReadCostStats``) turns a vector back into the shape and terms, and
``_kernels.decide_split`` applies the ops' decision to them: the tuner and
the ops share one model and one rule.

Functions here are pure (numpy in, dicts out) and deterministic, so the
decision is tested on recorded statistics vectors.
"""

import dataclasses
import math

import numpy as np

from tf_sparse_split import _loader
from tf_sparse_split.tuning import stats as _stats

__all__ = ["OpCostProblem", "cost_problem", "epoch_vector", "decide",
           "DENSE", "SPARSE"]

DENSE = "dense"
SPARSE = "sparse"

# Entries of the cost tail that are per-family values (not K_LIVE, which
# varies with each call's zeros and is averaged over the epoch).
_FAMILY = np.zeros(_stats.NUM_STATS, dtype=bool)
_FAMILY[_stats.COST_FIRST + 1:_stats.COST_LAST + 1] = True


@dataclasses.dataclass(frozen=True)
class OpCostProblem:
    """The cost problem of one statistics vector, as the op's model sees it.

    Attributes:
      shape: the cost model's shape dict (``m``, ``k``, ``k_live``,
        ``dense_flops_per_elem``, ``sparse_flops_per_nnz`` in flop,
        ``row_copy_elems``, ``weight_elems_per_col`` in values,
        ``can_compact``, ``dense_allowed``).
      terms: the family's ``CostTerms`` dict (``dense_fixed_s``,
        ``sparse_fixed_s``, ``convert_s_per_elem``, ``copy_s_per_elem`` in
        seconds, ``dense_rate``, ``sparse_rate`` in flop/s with 0 meaning
        unknown, ``heterogeneous``).
      calibrated: whether the family was calibrated (its first automatic
        call timed both paths); False when its terms come from the calls'
        observations only.
    """

    shape: dict
    terms: dict
    calibrated: bool

    def known(self, path):
        """Whether the family has measured ``path`` (its rate is > 0)."""
        if path not in (DENSE, SPARSE):
            raise ValueError(f"path must be 'dense' or 'sparse', got {path!r}")
        return self.terms[f"{path}_rate"] > 0.0


def _vector(stats_vector):
    v = np.asarray(stats_vector, dtype=np.float64).reshape(-1)
    if v.shape[0] != _stats.NUM_STATS:
        raise ValueError(
            f"expected {_stats.NUM_STATS} statistics, got {v.shape[0]}")
    return v


def cost_problem(stats_vector):
    """The shape and family terms one statistics vector carries.

    Args:
      stats_vector: array-like of ``stats.NUM_STATS`` float64 values (one
        call's, or :func:`epoch_vector`'s).

    Returns:
      :class:`OpCostProblem`. A vector written before the cost tail existed,
      or by a call without a problem family (an empty product), gives terms
      with both rates 0 (unknown).

    Raises:
      ValueError: if the vector does not have ``stats.NUM_STATS`` entries.
    """
    d = _loader.kernels().cost_problem_from_stats(_vector(stats_vector))
    return OpCostProblem(shape=dict(d["shape"]), terms=dict(d["terms"]),
                         calibrated=bool(d["calibrated"]))


def epoch_vector(latest, total, calls):
    """One statistics vector for an epoch: the mean of its calls' vectors
    (``total / calls``) with the family's terms and per-unit shape taken from
    ``latest`` (the terms as they stand after the epoch's last call, not their
    average over the epoch).

    Args:
      latest: float64 ``[stats.NUM_STATS]``, the epoch's last call.
      total: float64 ``[stats.NUM_STATS]``, the sum over the epoch's calls.
      calls: int >= 1, the number of calls summed.

    Returns:
      float64 numpy ``[stats.NUM_STATS]``.

    Raises:
      ValueError: on a wrong length or ``calls < 1``.
    """
    latest, total = _vector(latest), _vector(total)
    if int(calls) < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    v = total / float(calls)
    v[_FAMILY] = latest[_FAMILY]
    return v


def decide(stats_vector, previous=None, policy=None):
    """The plan the op's cost model chooses for the row-density profile of a
    statistics vector (``_kernels.decide_split`` on the vector's shape,
    histogram and family terms).

    The profile is the vector's ``stats.HISTOGRAM`` (``DENSITY_BINS`` equal
    bins; each bin's rows at their bin's upper edge, nonzeros at its centre
    scaled to add up to ``stats.NNZ`` when that is finite), so the chosen
    threshold is a bin edge ``j / DENSITY_BINS``. The margins are the ops'
    (``DecisionPolicy``: enter 10%, stay 5%, switch 5%, ties to the plan
    with the most dense rows, at least ``min_gain_s`` = 100 us saved, or
    ``min_gain_fraction`` = 30% of the all-dense time where that is less,
    never under ``min_gain_floor_s`` = 20 us)
    unless ``policy`` gives others.

    Args:
      stats_vector: one call's statistics, or :func:`epoch_vector`'s.
      previous: the plan dict this function returned last for the same
        layer (hysteresis, as the op's ``PlanMemory``), or None.
      policy: None (the ops' margins) or a dict of ``enter_margin``,
        ``stay_margin``, ``switch_margin``, ``tie_margin``,
        ``min_gain_fraction`` (fractions), ``min_gain_s`` and
        ``min_gain_floor_s`` (seconds).

    Returns:
      the plan dict (``kind``, ``bucket``, ``threshold`` in [0, 1],
      ``compact``, ``predicted_s``, ``all_dense_s``, ``best_sparse_s`` in
      seconds), or None when there is nothing to decide: no rows in the
      histogram, or either path's rate unknown to the family (the op itself
      would then stay all-dense; a caller keeps its current threshold).

    Raises:
      ValueError: on a wrong length or a bad policy.
    """
    v = _vector(stats_vector)
    problem = cost_problem(v)
    if not (problem.known(DENSE) and problem.known(SPARSE)):
        return None
    hist = np.maximum(np.nan_to_num(v[_stats.HISTOGRAM]), 0.0)
    if hist.sum() <= 0.0:
        return None
    nnz = float(v[_stats.NNZ])
    kern = _loader.kernels()
    profile = kern.profile_from_histogram(
        hist, problem.shape["k"], nnz if math.isfinite(nnz) and nnz >= 0 else -1.0)
    return dict(kern.decide_split(problem.shape, profile, problem.terms,
                                  previous, policy))
