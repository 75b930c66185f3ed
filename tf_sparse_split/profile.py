"""Deprecated location: use :mod:`tf_sparse_split.tools.profile` (this module re-exports it)."""

from tf_sparse_split.tools.profile import *  # noqa: F401,F403
