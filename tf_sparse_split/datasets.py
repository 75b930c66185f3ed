"""Deprecated location: use :mod:`tf_sparse_split.tools.datasets` (this module re-exports it)."""

from tf_sparse_split.tools.datasets import *  # noqa: F401,F403
