"""``python -m tf_sparse_split``: the ``tf-sparse-split`` command line."""

import sys

from tf_sparse_split.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
