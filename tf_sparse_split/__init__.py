"""tf_sparse_split: TensorFlow ops, Keras layers and a callback that exploit
the zeros appearing at run time in activations (ReLU outputs, dropout masks,
dead feature maps).

Public API:

* :func:`load_library` -- loads the compiled op library (lazily).
* :func:`sparse_split_matmul` -- the ``SparseSplitMatMul`` op.
* :func:`sparse_split_conv2d` -- the ``SparseSplitConv2D`` op (NHWC).
* :class:`SparseSplitLayer` -- base class of the sparse-split layers
  (threshold, statistics, serialization).
* :class:`SparseSplitDense` -- drop-in for ``keras.layers.Dense``.
* :class:`SparseSplitConv2D` -- drop-in for ``keras.layers.Conv2D``.
* :class:`SplitThresholdCallback` -- fits the cost model and tunes thresholds.
* :mod:`tf_sparse_split.rewrite` -- graph-rewrite pass switch: existing
  ``MatMul`` graphs use the sparse-split op (``rewrite.enable()``).
* :class:`ApproximateRandomDropout` -- row/tile-pattern dropout whose zeros
  the ops skip; :func:`search_pattern_distribution` -- its pattern search.
* :class:`SensitivityAwareDropout` -- channel dropout for CNNs (NHWC).
* :class:`FATReLU`, :class:`SparsityTargetCallback` -- induce activation
  sparsity to a target (Kurtz et al., ICML 2020; ProSparse, 2024).
* :class:`SparseSplitLSTM` -- ``keras.layers.LSTM`` with row-pattern
  dropout compacted out of the per-step products (Song et al., 2203.05705).

Subpackages by role: :mod:`~tf_sparse_split.ops` (op wrappers and
gradients), :mod:`~tf_sparse_split.layers` (Keras layers),
:mod:`~tf_sparse_split.callbacks`, :mod:`~tf_sparse_split.tuning` (statistics
layout, cost model, dropout pattern search), :mod:`~tf_sparse_split.tools`
(command line, train/profile commands, model builders, datasets) and
:mod:`~tf_sparse_split.utils` (argument validation).

Sources: K.-Y. Peng, *Adaptive runtime exploiting sparsity in tensor of deep
learning on heterogeneous systems*, NTU 2017; R. Sun and L. Zhang, *Dynamic
Sparse Method for Deep Learning Execution*, 2019; Z. Song et al., *DNN
Training Acceleration via Exploring GPGPU Friendly Sparsity*, arXiv 2203.05705.
"""

import sys

from tf_sparse_split._version import __version__
from tf_sparse_split._loader import load_library, LibraryLoadError
from tf_sparse_split.ops import sparse_split_matmul, sparse_split_conv2d
from tf_sparse_split.layers import (
    SparseSplitLayer,
    SparseSplitDense,
    SparseSplitConv2D,
    ApproximateRandomDropout,
    SensitivityAwareDropout,
)
from tf_sparse_split.layers.activations import FATReLU
from tf_sparse_split.layers.lstm import SparseSplitLSTM
from tf_sparse_split.callbacks import SplitThresholdCallback
from tf_sparse_split.callbacks.sparsity_target import SparsityTargetCallback
from tf_sparse_split.tuning import (
    CostModel,
    PatternDistribution,
    search_pattern_distribution,
)
from tf_sparse_split import rewrite

# Old module paths (before issue 13): tf_sparse_split.stats, .cost_model,
# .conv_layers, .dropout, .datasets, .profile, .cli still import.
from tf_sparse_split import _compat  # noqa: E402

_compat.install(sys.modules[__name__])
del _compat

__all__ = [
    "__version__",
    "load_library",
    "LibraryLoadError",
    "sparse_split_matmul",
    "sparse_split_conv2d",
    "SparseSplitLayer",
    "SparseSplitDense",
    "SparseSplitConv2D",
    "SplitThresholdCallback",
    "CostModel",
    "rewrite",
    "ApproximateRandomDropout",
    "SensitivityAwareDropout",
    "search_pattern_distribution",
    "PatternDistribution",
    "FATReLU",
    "SparsityTargetCallback",
    "SparseSplitLSTM",
]
