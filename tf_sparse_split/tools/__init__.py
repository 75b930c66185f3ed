"""Tools around the library: the ``tf-sparse-split`` command line
(:mod:`~tf_sparse_split.tools.cli`: parsing and dispatch), the train command
(:mod:`~tf_sparse_split.tools.train`) and its model builders
(:mod:`~tf_sparse_split.tools.models`), the profile command
(:mod:`~tf_sparse_split.tools.profile`) and the datasets
(:mod:`~tf_sparse_split.tools.datasets`).

Submodules are imported on use (``from tf_sparse_split.tools import models``)
so that ``tf-sparse-split --help`` does not import TensorFlow.
"""
