"""Internal utilities: :mod:`tf_sparse_split.utils.validation` (argument
checks shared by the ops, layers, callbacks and command line) and
:mod:`tf_sparse_split.utils.deprecation` (renamed keywords and attributes
kept as deprecated aliases for one release)."""
