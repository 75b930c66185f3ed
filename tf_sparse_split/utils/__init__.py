"""Internal utilities: :mod:`tf_sparse_split.utils.validation` (argument
checks shared by the ops, layers, callbacks and command line)."""
