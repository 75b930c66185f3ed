"""Lazy loading of the compiled op library, with errors that say what to do."""

import glob
import hashlib
import os
import sys
import threading

_LOCK = threading.Lock()
_MODULE = None
_HERE = os.path.dirname(os.path.abspath(__file__))
_REBUILD = ("Rebuild it against the installed TensorFlow: "
            "`pip install --no-build-isolation --force-reinstall --no-deps .` "
            "from the tf_sparse_split source directory.")


class LibraryLoadError(ImportError):
    """The op library is missing, damaged, or was built for another
    TensorFlow."""


def _source_tree_advice():
    """If the package imported is a source checkout (``setup.py`` beside it)
    that shadows an installed copy, the advice to give instead of a rebuild;
    else None."""
    root = os.path.dirname(_HERE)
    if not os.path.isfile(os.path.join(root, "setup.py")):
        return None
    for entry in sys.path:
        entry = os.path.abspath(entry or os.curdir)
        if entry == root:
            continue
        other = os.path.join(entry, "tf_sparse_split", "__init__.py")
        if os.path.isfile(other):
            return (f"Python imported the unbuilt source tree {_HERE} (the "
                    f"current directory or sys.path puts it before the "
                    f"installed package in {os.path.dirname(os.path.dirname(other))}). "
                    "Run Python from another directory, or install the "
                    "checkout in editable mode so that it is built where it "
                    "is: `pip install --no-build-isolation -e .`")
    return None


def _not_built(what):
    advice = _source_tree_advice()
    return LibraryLoadError(f"{what}. {advice or _REBUILD}")


def library_path():
    """Path of the op library ``_sparse_split_ops*.so`` inside the package.

    Raises:
      LibraryLoadError: if it was not built.
    """
    found = sorted(glob.glob(os.path.join(_HERE, "_sparse_split_ops*.so")))
    if not found:
        raise _not_built(
            f"tf_sparse_split's op library is not built (no _sparse_split_ops*.so "
            f"in {_HERE})")
    return found[0]


def build_info():
    """What the library was built against: dict with TF_VERSION, MARCH, ISA,
    CUDA, and the op library's LIB_SIZE (bytes) and LIB_SHA256 (hex), which
    are None for builds that did not record them.

    Raises:
      LibraryLoadError: if the build did not record it (library not built).
    """
    try:
        from tf_sparse_split import _build_info
    except ImportError as e:
        raise _not_built("tf_sparse_split was not built (no _build_info.py)") from e
    info = {k: getattr(_build_info, k) for k in ("TF_VERSION", "MARCH", "ISA", "CUDA")}
    for k in ("LIB_SIZE", "LIB_SHA256"):
        info[k] = getattr(_build_info, k, None)
    return info


def check_library_file(path, info=None):
    """Checks the op library file before it is handed to the dynamic loader
    (a truncated or overwritten shared object can crash the process inside
    ``dlopen``, with no Python error).

    Checks that it is a readable ELF shared object and, when the build
    recorded them (``_build_info.py``: LIB_SIZE, LIB_SHA256), that its size
    and SHA-256 match.

    Raises:
      LibraryLoadError: naming what is wrong, with the rebuild command.
    """
    info = build_info() if info is None else info
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != b"\x7fELF":
                raise LibraryLoadError(
                    f"tf_sparse_split's op library {path} is damaged: not an "
                    f"ELF shared object (starts with {magic!r}). {_REBUILD}")
            if info.get("LIB_SIZE") is not None and size != info["LIB_SIZE"]:
                raise LibraryLoadError(
                    f"tf_sparse_split's op library {path} is damaged or was "
                    f"replaced: {size} bytes, the build wrote "
                    f"{info['LIB_SIZE']}. {_REBUILD}")
            if info.get("LIB_SHA256") is not None:
                f.seek(0)
                digest = hashlib.sha256()
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                if digest.hexdigest() != info["LIB_SHA256"]:
                    raise LibraryLoadError(
                        f"tf_sparse_split's op library {path} is damaged or "
                        f"was replaced: its SHA-256 {digest.hexdigest()} is "
                        f"not the one the build recorded "
                        f"({info['LIB_SHA256']}). {_REBUILD}")
    except OSError as e:
        raise LibraryLoadError(
            f"cannot read tf_sparse_split's op library {path}: {e}. "
            f"{_REBUILD}") from e


def load_library():
    """Loads the op library once and returns its op module.

    The returned module has the generated op wrappers (e.g.
    ``sparse_split_mat_mul``). Loading it also registers the ops' kernels and
    the graph-rewrite pass with TensorFlow.

    Returns:
      The Python module returned by ``tf.load_op_library``.

    Raises:
      LibraryLoadError: if the library is not built, is damaged (not an ELF
        file, or size/SHA-256 not those recorded at build time), was built
        against a different TensorFlow version than the one imported (its
        C++ ABI would not match), or TensorFlow refuses to load it.
    """
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    # Imported before taking the lock: importing TensorFlow runs the
    # package's after-import hook, which calls this function.
    import tensorflow as tf

    with _LOCK:
        if _MODULE is not None:
            return _MODULE

        info = build_info()
        if info["TF_VERSION"] != tf.__version__:
            raise LibraryLoadError(
                f"tf_sparse_split was built against TensorFlow {info['TF_VERSION']} "
                f"but TensorFlow {tf.__version__} is imported. {_REBUILD}")
        path = library_path()
        check_library_file(path, info)
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
        raise _not_built(
            f"tf_sparse_split's pybind11 module is not built ({e})") from e
    return _kernels
