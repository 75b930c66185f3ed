"""tf_sparse_split: TensorFlow ops, Keras layers and a callback that exploit
the zeros appearing at run time in activations (ReLU outputs, dropout masks,
dead feature maps).

Public API:

* :func:`load_library` -- loads the compiled op library (lazily).
* :func:`sparse_split_matmul` -- the ``SparseSplitMatMul`` op.
* :func:`sparse_split_conv2d` -- the ``SparseSplitConv2D`` op (NHWC);
  :func:`sparse_split_conv2d_backprop_input` -- its stride-1 input gradient
  (``SparseSplitConv2DBackpropInput``).
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
* :class:`TimeBudgetCallback` -- trains within a step-time, epoch-time or
  deadline budget by choosing each layer's sparsity at run time;
  :func:`fit_latency_budget` -- raises a trained model's FATReLU cutoffs
  to meet an inference latency (Sun & Zhang 2019).
* :class:`ThresholdTuner` -- the threshold tuning of
  :class:`SplitThresholdCallback` for custom and distributed training loops.
* :func:`sparse_split_model` / :func:`strip_sparse_split` -- copy a Keras
  model with its ``Dense``/``Conv2D`` layers swapped for the sparse-split
  layers (weights copied), and back.

Importing the package is cheap (it does not import TensorFlow): the public
names above are loaded on first use (PEP 562).

Registration. A SavedModel or ``.keras`` file that uses the ops loads after
``import tf_sparse_split`` with no further call, whatever the order of the
imports of ``tf_sparse_split``, ``tensorflow`` and ``keras``. One mechanism
does it: :func:`_register` loads the op library once TensorFlow is imported
(the ops, their kernels and the rewrite pass) and imports
:mod:`tf_sparse_split.layers` once TensorFlow and Keras both are (its
``@keras.saving.register_keras_serializable(package="tf_sparse_split")``
decorators put ``tf_sparse_split>SparseSplitDense`` and the other layers in
Keras' global registry). It runs at the package's import, and again each
time the execution of the ``tensorflow`` or ``keras`` package finishes, seen
by the finder :class:`_RegisterAfterImport` at the front of
``sys.meta_path``. The finder finds nothing itself: it hands on the spec the
other finders return, with the loader's ``exec_module`` wrapped. A spec that
is only looked up (TensorFlow calls ``importlib.util.find_spec("keras")``
while importing, long before it imports Keras) is never executed and uses up
nothing; once both registrations are made the finder returns None at
once. ``import keras`` runs inside ``import tensorflow`` (and the reverse),
so the layers are imported only when neither package is still
initialising, nor any module of this package: the first use of
``tfss.sparse_split_matmul`` imports TensorFlow from inside
``tf_sparse_split.ops.matmul``, and the layers, which import that module,
are then registered when its execution ends (the finder watches this
package's modules until they are). Importing the layers directly (``tfss.SparseSplitDense``)
registers them too. If the op library is not built the import still
succeeds; the :class:`LibraryLoadError` (with the rebuild command) is kept
in ``library_error`` and raised by the first call that needs the library.

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
    "sparse_split_conv2d_backprop_input": "tf_sparse_split.ops",
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
    "TimeBudgetCallback": "tf_sparse_split.callbacks",
    "fit_latency_budget": "tf_sparse_split.tools.latency_budget",
    "ThresholdTuner": "tf_sparse_split.tuning",
    "sparse_split_model": "tf_sparse_split.convert",
    "strip_sparse_split": "tf_sparse_split.convert",
}
_SUBMODULES = ("rewrite", "ops", "layers", "callbacks", "tuning", "tools",
               "utils", "testing", "convert")

__all__ = ["__version__", "rewrite", *_PUBLIC]


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    # The package's names, without the standard-library modules this file
    # imports for itself (importlib, sys, threading, warnings).
    own = {k for k, v in globals().items()
           if not isinstance(v, type(sys))
           or v.__name__.startswith(f"{__name__}.")}
    return sorted(own | set(_PUBLIC) | set(_SUBMODULES))


# -- registration with TensorFlow and Keras --------------------------------
#: Why the op library could not be loaded (None: loaded, or TensorFlow not
#: imported yet). The same error is raised by the first use.
library_error = None

_LOCK = threading.Lock()
_PACKAGES = ("tensorflow", "keras")
_executed = set()   # of _PACKAGES: those whose execution finished
_done = set()       # "ops", "keras": registrations made (or under way)


def _ready(name):
    """Whether ``name`` (a top-level package) is fully imported: its
    execution finished (seen by the finder) or it is in ``sys.modules`` and
    not initialising."""
    if name in _executed:
        return True
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def _register(finished=None):
    """Makes the registrations whose packages are ready (idempotent): the
    op library once TensorFlow is imported, the Keras layers once TensorFlow
    and Keras are. An unbuilt or damaged library is remembered in
    :data:`library_error`, not raised; a failure to import the layers is a
    ``RuntimeWarning`` (it must not break the user's import). ``finished``:
    the module whose execution just ended (the finder's call), still
    flagged as initialising."""
    global library_error
    if _claim("ops", "tensorflow"):
        from tf_sparse_split._loader import LibraryLoadError, load_library
        try:
            load_library()
            library_error = None
        except LibraryLoadError as e:
            library_error = e
        except Exception as e:  # never break the user's import
            warnings.warn(f"tf_sparse_split could not load its op library: "
                          f"{e}", RuntimeWarning, stacklevel=2)
    if not _submodule_initializing(finished) and _claim("keras", "tensorflow",
                                                 "keras"):
        try:
            importlib.import_module("tf_sparse_split.layers")
        except Exception as e:  # never break the user's `import keras`
            warnings.warn(f"tf_sparse_split could not register its Keras "
                          f"layers: {e}", RuntimeWarning, stacklevel=2)


def _submodule_initializing(finished=None):
    """Whether a module of this package (not the package itself) is still
    executing: the first use of a public name (``tfss.sparse_split_matmul``)
    imports TensorFlow from inside ``tf_sparse_split.ops.matmul``, and the
    layers imported then would find that module half-initialised. The
    registration waits for the end of its execution (the finder calls
    :func:`_register` again)."""
    prefix = __name__ + "."
    for name, module in list(sys.modules.items()):
        if name.startswith(prefix) and name != finished and getattr(
                getattr(module, "__spec__", None), "_initializing", False):
            return True
    return False


def _claim(registration, *packages):
    """True, once, for the caller that is to make ``registration`` now that
    ``packages`` are ready. The lock is not held while registering (that
    imports modules, whose import locks another thread may hold while it
    waits here)."""
    with _LOCK:
        if registration in _done or not all(map(_ready, packages)):
            return False
        _done.add(registration)
        return True


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Calls :func:`_register` each time the execution of the
    ``tensorflow`` or ``keras`` package finishes, and, until the layers are
    registered, each time one of this package's modules finishes (a
    registration deferred by :func:`_submodule_initializing`). Finds
    nothing itself: it
    returns the spec the finders after it return, with the loader's
    ``exec_module`` wrapped. Looking a spec up without executing it
    (``importlib.util.find_spec``) changes nothing."""

    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        watched = fullname in _PACKAGES or (
            fullname.startswith(__name__ + ".") and "keras" not in _done)
        if not watched or len(_done) == 2 or \
                getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None or getattr(exec_module, "_tfss_wrapped", False):
            return spec

        def exec_then_register(module):
            try:
                exec_module(module)
            finally:
                if vars(loader).get("exec_module") is exec_then_register:
                    del loader.exec_module  # back to the class's method
            if fullname in _PACKAGES:
                _executed.add(fullname)
            _register(fullname)

        exec_then_register._tfss_wrapped = True
        try:
            loader.exec_module = exec_then_register
        except AttributeError:  # a loader that takes no attributes
            pass
        return spec


sys.meta_path.insert(0, _RegisterAfterImport())
_register()
