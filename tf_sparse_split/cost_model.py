"""Deprecated location: use :mod:`tf_sparse_split.tuning.cost_model` (this module re-exports it)."""

from tf_sparse_split.tuning.cost_model import *  # noqa: F401,F403
