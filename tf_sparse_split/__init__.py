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
* :class:`ThresholdTuner` -- the threshold tuning of
  :class:`SplitThresholdCallback` for custom and distributed training loops.
* :func:`sparse_split_model` / :func:`strip_sparse_split` -- copy a Keras
  model with its ``Dense``/``Conv2D`` layers swapped for the sparse-split
  layers (weights copied), and back.

Importing the package is cheap (it does not import TensorFlow): the public
names above are loaded on first use (PEP 562). The op library and the Keras
classes are registered as soon as TensorFlow (and Keras) are imported --
right away when they already are, else the moment they finish importing --
so a SavedModel or ``.keras`` file that uses the ops loads after
``import tf_sparse_split`` with no further call. If the op library is not
built the import still succeeds; the :class:`LibraryLoadError` (with the
rebuild command) comes from the first call that needs the library.

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

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import warnings

from tf_sparse_split._version import __version__

# Public name -> module defining it (imported on first access).
_PUBLIC = {
    "load_library": "tf_sparse_split._loader",
    "LibraryLoadError": "tf_sparse_split._loader",
    "sparse_split_matmul": "tf_sparse_split.ops",
    "sparse_split_conv2d": "tf_sparse_split.ops",
    "SparseSplitLayer": "tf_sparse_split.layers",
    "SparseSplitDense": "tf_sparse_split.layers",
    "SparseSplitConv2D": "tf_sparse_split.layers",
    "ApproximateRandomDropout": "tf_sparse_split.layers",
    "SensitivityAwareDropout": "tf_sparse_split.layers",
    "SplitThresholdCallback": "tf_sparse_split.callbacks",
    "CostModel": "tf_sparse_split.tuning",
    "PatternDistribution": "tf_sparse_split.tuning",
    "search_pattern_distribution": "tf_sparse_split.tuning",
    "FATReLU": "tf_sparse_split.layers",
    "SparseSplitLSTM": "tf_sparse_split.layers",
    "SparsityTargetCallback": "tf_sparse_split.callbacks",
    "ThresholdTuner": "tf_sparse_split.tuning",
    "sparse_split_model": "tf_sparse_split.convert",
    "strip_sparse_split": "tf_sparse_split.convert",
}
_SUBMODULES = ("rewrite", "ops", "layers", "callbacks", "tuning", "tools",
               "utils", "testing", "convert")

__all__ = ["__version__", "rewrite", *_PUBLIC]


def __getattr__(name):
    if name.startswith("_"):  # private modules are imported, not looked up
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _old_paths():
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC) | set(_SUBMODULES)
                  | set(_old_paths()))


# -- old module paths (before issue 13), imported on demand ---------------
def _old_paths():
    _compat = importlib.import_module("tf_sparse_split._compat")
    return {**_compat._ALIASES, **_compat._SPLIT}


class _OldPathLoader(importlib.abc.Loader):
    """Loads ``tf_sparse_split.<old>`` as the module that replaced it (or a
    module re-exporting the names of the modules it was split into)."""

    def create_module(self, spec):
        _compat = importlib.import_module("tf_sparse_split._compat")
        old = spec.name.rpartition(".")[2]
        if old in _compat._ALIASES:
            module = importlib.import_module(_compat._ALIASES[old])
        else:
            package = sys.modules[__name__]
            _compat.install(package)  # builds the re-exporting modules
            module = sys.modules[spec.name]
        self._spec = getattr(module, "__spec__", None)
        return module

    def exec_module(self, module):
        # The import system set __spec__ to the alias's: restore it.
        if self._spec is not None and module.__spec__ is not self._spec:
            module.__spec__ = self._spec


class _OldPathFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.rpartition(".")
        if prefix != __name__ or old not in _old_paths():
            return None
        return importlib.util.spec_from_loader(fullname, _OldPathLoader())


# -- registration with TensorFlow and Keras --------------------------------
_REGISTER_LOCK = threading.RLock()
#: Why the op library could not be loaded at import (None: loaded, or
#: TensorFlow not imported yet). The same error is raised on use.
library_error = None


def _register_ops():
    """Loads the op library (registers the ops, kernels and rewrite pass);
    an unbuilt or damaged library is remembered, not raised: the error
    comes, with the rebuild command, from the first use."""
    global library_error
    from tf_sparse_split._loader import LibraryLoadError, load_library

    with _REGISTER_LOCK:
        try:
            load_library()
            library_error = None
        except LibraryLoadError as e:
            library_error = e


def _register_keras():
    """Imports the layers, which registers them as Keras serializables
    (package ``tf_sparse_split``)."""
    with _REGISTER_LOCK:
        try:
            importlib.import_module("tf_sparse_split.layers")
        except Exception as e:  # never break the user's `import keras`
            warnings.warn(f"tf_sparse_split could not register its Keras "
                          f"layers: {e}", RuntimeWarning, stacklevel=2)


def _imported(name):
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after a top-level module (``tensorflow``,
    ``keras``) finishes importing, by wrapping its loader's
    ``exec_module``; finds nothing itself."""

    def __init__(self, callbacks):
        self._callbacks = dict(callbacks)
        self._busy = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._callbacks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or \
                not hasattr(spec.loader, "exec_module"):
            return spec
        callback = self._callbacks.pop(fullname)
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                del loader.exec_module  # back to the class's method
            except AttributeError:
                pass
            callback()

        loader.exec_module = exec_then_register
        return spec


def _install():
    sys.meta_path.append(_OldPathFinder())
    pending = {}
    if _imported("tensorflow"):
        _register_ops()
    else:
        pending["tensorflow"] = _register_ops
    if _imported("keras"):
        _register_keras()
    else:
        pending["keras"] = _register_keras
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))


_install()
