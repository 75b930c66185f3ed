"""Deprecated location: use :mod:`tf_sparse_split.layers.conv2d` (this module re-exports it)."""

from tf_sparse_split.layers.conv2d import *  # noqa: F401,F403
