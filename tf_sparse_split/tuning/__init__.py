"""Tuning: what picks the dense/sparse split and the dropout patterns.

* :mod:`tf_sparse_split.tuning.stats` -- layout of the per-call statistics
  vector the ops emit (mirrors ``cc/core/stats.h``), including the cost tail
  that carries each call's shape and its family's cost terms.
* :mod:`tf_sparse_split.tuning.op_model` -- the ops' own cost model read
  from those statistics (the one estimator: ``cc/core/cost_model.h``).
* :mod:`tf_sparse_split.tuning.tuner` -- :class:`ThresholdTuner`, the
  per-layer threshold policy and reporting driven by the Keras callback or a
  custom (distributed) training loop.
* :mod:`tf_sparse_split.tuning.cost_model` -- :class:`CostModel`, a
  least-squares fit of the two paths' lines to recorded statistics, for
  offline analysis (the tuner and the ops do not use it).
* :mod:`tf_sparse_split.tuning.budget` -- the time-budget controller
  behind :class:`~tf_sparse_split.callbacks.TimeBudgetCallback` (Sun &
  Zhang 2019), and :mod:`tf_sparse_split.tuning.deadline` --
  :class:`~tf_sparse_split.tuning.deadline.WallTimePlan`, its epoch-time
  and deadline arithmetic on the fit's measured wall time.
* :mod:`tf_sparse_split.tuning.pattern_search` --
  :func:`search_pattern_distribution` and :class:`PatternDistribution`, the
  pattern search of :class:`~tf_sparse_split.layers.ApproximateRandomDropout`.

This package imports no layer module (layers import
:mod:`~tf_sparse_split.tuning.stats`; the tuner drives any object with the
methods :func:`~tf_sparse_split.tuning.tuner.is_split_layer` names), and
importing it does not import TensorFlow.
"""

from tf_sparse_split.tuning import stats
from tf_sparse_split.tuning.cost_model import CostModel
from tf_sparse_split.tuning.pattern_search import (PatternDistribution,
                                                   pattern_list,
                                                   search_pattern_distribution)

__all__ = ["stats", "CostModel", "PatternDistribution", "pattern_list",
           "search_pattern_distribution", "ThresholdTuner"]


def __getattr__(name):
    # Lazy: the tuner imports TensorFlow, which this package otherwise does
    # not (the CLI and ``import tf_sparse_split`` stay free of it).
    if name == "ThresholdTuner":
        from tf_sparse_split.tuning.tuner import ThresholdTuner

        return ThresholdTuner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
