"""Keras callbacks: :class:`SplitThresholdCallback`
(:mod:`~tf_sparse_split.callbacks.split_threshold`) fits per-layer cost models
during training and sets the split thresholds; :func:`find_split_layers`
lists a model's :class:`~tf_sparse_split.layers.SparseSplitLayer` layers;
:class:`SparsityTargetCallback` (:mod:`~tf_sparse_split.callbacks.
sparsity_target`) drives their input sparsity to a target (FATReLU + L1);
:class:`TimeBudgetCallback` (:mod:`~tf_sparse_split.callbacks.time_budget`)
chooses it per layer to meet a step-time, epoch-time or deadline budget."""

from tf_sparse_split.callbacks.split_threshold import (SplitThresholdCallback,
                                                       find_split_layers)
from tf_sparse_split.callbacks.sparsity_target import SparsityTargetCallback
from tf_sparse_split.callbacks.time_budget import TimeBudgetCallback

__all__ = ["SplitThresholdCallback", "find_split_layers",
           "SparsityTargetCallback", "TimeBudgetCallback"]
