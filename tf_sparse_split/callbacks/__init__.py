"""Keras callbacks: :class:`SplitThresholdCallback`
(:mod:`~tf_sparse_split.callbacks.split_threshold`) fits per-layer cost models
during training and sets the split thresholds; :func:`find_split_layers`
lists a model's :class:`~tf_sparse_split.layers.SparseSplitLayer` layers."""

from tf_sparse_split.callbacks.split_threshold import (SplitThresholdCallback,
                                                       find_split_layers)

__all__ = ["SplitThresholdCallback", "find_split_layers"]
