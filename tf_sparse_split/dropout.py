"""Deprecated location: the dropout layers moved to
:mod:`tf_sparse_split.layers.dropout`, the pattern search to
:mod:`tf_sparse_split.tuning.pattern_search` (this module re-exports both)."""

from tf_sparse_split.layers.dropout import (  # noqa: F401
    ApproximateRandomDropout, SensitivityAwareDropout)
from tf_sparse_split.tuning.pattern_search import (  # noqa: F401
    PatternDistribution, pattern_list, search_pattern_distribution)
