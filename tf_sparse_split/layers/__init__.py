"""Keras layers.

* :class:`SparseSplitLayer` (:mod:`~tf_sparse_split.layers.base`) -- the base
  class of the layers computed by a sparse-split op (threshold, statistics,
  serialization, cost-model hook).
* :class:`SparseSplitDense` (:mod:`~tf_sparse_split.layers.dense`) -- drop-in
  for ``keras.layers.Dense``.
* :class:`SparseSplitConv2D` (:mod:`~tf_sparse_split.layers.conv2d`) --
  drop-in for ``keras.layers.Conv2D`` (NHWC).
* :class:`ApproximateRandomDropout`, :class:`SensitivityAwareDropout`
  (:mod:`~tf_sparse_split.layers.dropout`) -- structured dropout whose zeros
  the sparse-split layers skip.

* :class:`FATReLU` (:mod:`~tf_sparse_split.layers.activations`) -- the
  forced-activation-threshold ReLU whose thresholds
  :class:`~tf_sparse_split.callbacks.SparsityTargetCallback` drives.
* :class:`SparseSplitLSTM` (:mod:`~tf_sparse_split.layers.lstm`) -- drop-in
  for ``keras.layers.LSTM`` whose row-pattern dropout is compacted out of
  every per-step product.

Requires the TensorFlow backend of Keras 3.
"""

from tf_sparse_split.layers.base import SparseSplitLayer
from tf_sparse_split.layers.dense import SparseSplitDense
from tf_sparse_split.layers.conv2d import SparseSplitConv2D
from tf_sparse_split.layers.dropout import (ApproximateRandomDropout,
                                            SensitivityAwareDropout)
from tf_sparse_split.layers.activations import FATReLU
from tf_sparse_split.layers.lstm import SparseSplitLSTM, SparseSplitLSTMCell

__all__ = ["SparseSplitLayer", "SparseSplitDense", "SparseSplitConv2D",
           "ApproximateRandomDropout", "SensitivityAwareDropout", "FATReLU",
           "SparseSplitLSTM", "SparseSplitLSTMCell"]
