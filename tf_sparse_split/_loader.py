"""Lazy loading of the compiled op library, with errors that say what to do."""

import glob
import os
import threading

_LOCK = threading.Lock()
_MODULE = None
_HERE = os.path.dirname(os.path.abspath(__file__))
_REBUILD = ("Rebuild it against the installed TensorFlow: "
            "`pip install --no-build-isolation --force-reinstall --no-deps .` "
            "from the tf_sparse_split source directory.")


class LibraryLoadError(ImportError):
    """The op library is missing, or was built for another TensorFlow."""


def library_path():
    """Path of the op library ``_sparse_split_ops*.so`` inside the package.

    Raises:
      LibraryLoadError: if it was not built.
    """
    found = sorted(glob.glob(os.path.join(_HERE, "_sparse_split_ops*.so")))
    if not found:
        raise LibraryLoadError(
            f"tf_sparse_split's op library is not built (no _sparse_split_ops*.so "
            f"in {_HERE}). {_REBUILD}")
    return found[0]


def build_info():
    """What the library was built against: dict with TF_VERSION, MARCH, ISA, CUDA.

    Raises:
      LibraryLoadError: if the build did not record it (library not built).
    """
    try:
        from tf_sparse_split import _build_info
    except ImportError as e:
        raise LibraryLoadError(
            f"tf_sparse_split was not built (no _build_info.py). {_REBUILD}") from e
    return {k: getattr(_build_info, k) for k in ("TF_VERSION", "MARCH", "ISA", "CUDA")}


def load_library():
    """Loads the op library once and returns its op module.

    The returned module has the generated op wrappers (e.g.
    ``sparse_split_mat_mul``). Loading it also registers the ops' kernels and
    the graph-rewrite pass with TensorFlow.

    Returns:
      The Python module returned by ``tf.load_op_library``.

    Raises:
      LibraryLoadError: if the library is not built, or was built against a
        different TensorFlow version than the one imported (its C++ ABI would
        not match), or TensorFlow refuses to load it.
    """
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    with _LOCK:
        if _MODULE is not None:
            return _MODULE
        import tensorflow as tf

        info = build_info()
        if info["TF_VERSION"] != tf.__version__:
            raise LibraryLoadError(
                f"tf_sparse_split was built against TensorFlow {info['TF_VERSION']} "
                f"but TensorFlow {tf.__version__} is imported. {_REBUILD}")
        path = library_path()
        try:
            _MODULE = tf.load_op_library(path)
        except (tf.errors.NotFoundError, OSError) as e:
            raise LibraryLoadError(
                f"TensorFlow {tf.__version__} could not load {path}: {e}. {_REBUILD}"
            ) from e
        return _MODULE


def kernels():
    """The pybind11 module ``tf_sparse_split._kernels`` (numpy kernels).

    Raises:
      LibraryLoadError: if it was not built.
    """
    try:
        from tf_sparse_split import _kernels
    except ImportError as e:
        raise LibraryLoadError(
            f"tf_sparse_split's pybind11 module is not built ({e}). {_REBUILD}") from e
    return _kernels
