"""Tools around the library: the ``tf-sparse-split`` command line
(:mod:`~tf_sparse_split.tools.cli`: parsing and dispatch), the train command
(:mod:`~tf_sparse_split.tools.train`) and its model builders
(:mod:`~tf_sparse_split.tools.models`), the profile command
(:mod:`~tf_sparse_split.tools.profile`; whole-model latency with
``--end-to-end``: :mod:`~tf_sparse_split.tools.latency`; FATReLU cutoffs
for a latency budget with ``--latency-budget``:
:mod:`~tf_sparse_split.tools.latency_budget`), the datasets
(:mod:`~tf_sparse_split.tools.datasets`), ``train --strategy``
(:mod:`~tf_sparse_split.tools.distribute`) and ``train --plot``
(:mod:`~tf_sparse_split.tools.plots`).

Submodules are imported on use (``from tf_sparse_split.tools import models``)
so that ``tf-sparse-split --help`` does not import TensorFlow.
"""
