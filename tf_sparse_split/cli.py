"""Deprecated location: use :mod:`tf_sparse_split.tools.cli` (parsing and
dispatch) and :mod:`tf_sparse_split.tools.models` (model builders); this
module re-exports their public names."""

import sys

from tf_sparse_split.tools.cli import build_parser, main  # noqa: F401
from tf_sparse_split.tools.models import build_cnn, build_mlp  # noqa: F401

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
