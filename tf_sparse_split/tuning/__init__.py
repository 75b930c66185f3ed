"""Tuning: what picks the dense/sparse split and the dropout patterns.

* :mod:`tf_sparse_split.tuning.stats` -- layout of the per-call statistics
  vector the ops emit (mirrors ``cc/core/stats.h``).
* :mod:`tf_sparse_split.tuning.cost_model` -- :class:`CostModel`, the run-time
  cost model that picks the split threshold.
* :mod:`tf_sparse_split.tuning.tuner` -- :class:`ThresholdTuner`, the
  per-layer threshold tuning driven by the Keras callback or a custom
  (distributed) training loop.
* :mod:`tf_sparse_split.tuning.pattern_search` --
  :func:`search_pattern_distribution` and :class:`PatternDistribution`, the
  pattern search of :class:`~tf_sparse_split.layers.ApproximateRandomDropout`.
"""

from tf_sparse_split.tuning import stats
from tf_sparse_split.tuning.cost_model import CostModel
from tf_sparse_split.tuning.pattern_search import (PatternDistribution,
                                                   pattern_list,
                                                   search_pattern_distribution)

__all__ = ["stats", "CostModel", "PatternDistribution", "pattern_list",
           "search_pattern_distribution", "ThresholdTuner"]


def __getattr__(name):
    # Lazy: tuner imports the layers, which import tuning.stats.
    if name == "ThresholdTuner":
        from tf_sparse_split.tuning.tuner import ThresholdTuner

        return ThresholdTuner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
