"""Deprecated location: use :mod:`tf_sparse_split.tuning.stats` (this module
re-exports it)."""

from tf_sparse_split.tuning.stats import *  # noqa: F401,F403
from tf_sparse_split.tuning.stats import as_dict  # noqa: F401
