"""Switch for the sparse-split graph-rewrite pass.

The op library contains a TensorFlow graph-optimization pass (C++,
``cc/rewrite/``) that replaces, in the graphs TensorFlow optimizes, a
``MatMul`` (and ``Conv2D`` once the ``SparseSplitConv2D`` op exists) whose
activation input can be sparse -- produced by ``Relu``, ``Relu6``, their
gradients ``ReluGrad``/``Relu6Grad``, or the dropout pattern -- with the
sparse-split op (``SparseSplitMatMul``), which computes the same product
while skipping the activation's zeros (K.-Y. Peng, *Adaptive runtime
exploiting sparsity in tensor of deep learning on heterogeneous systems*,
NTU 2017). Existing models -- Keras models of plain ``Dense`` layers,
SavedModels exported by plain TensorFlow -- then use it without changes::

    from tf_sparse_split import rewrite
    rewrite.enable()                 # graphs traced/instantiated from now on
    model.fit(...)                   # Keras: compile(jit_compile=False)
    print(rewrite.counters())        # {'MatMul': 6}

What the pass does:

* It runs on every ``tf.function`` / SavedModel function graph when
  TensorFlow instantiates it (PRE_PLACEMENT, after control-flow lowering).
  The replacement keeps the node's name, requested and assigned device,
  attributes (``transpose_a``/``transpose_b``), control inputs and all
  consumers; its extra ``stats`` output is unused; the threshold is a new
  scalar ``Const`` named ``<node>/tfss_threshold/_N``.
* Gradients: the pass runs after ``tf.GradientTape`` / Keras built the
  gradient graph, so the backward ``MatMul`` ops are plain ``MatMul`` ops;
  those whose activation operand is known to be sparse are rewritten too:
  ``dW = x^T . dY`` (``transpose_a=True``, ``x`` a ReLU/dropout output) and
  ``dX = dY . W^T`` when ``dY`` is a ``ReluGrad`` output (zero wherever the
  ReLU output was). Every replacement computes the same values, so
  gradients stay correct.
* It leaves alone -- and says why at ``VLOG(1)``
  (``TF_CPP_VMODULE=sparse_split_rewrite=1``) and in :func:`log` -- what it
  cannot replace exactly: dtypes other than float32/float64, nodes on a
  device without a kernel of ours (GPU, TPU), nodes with no device on a
  machine with a GPU (the placer would put ``MatMul`` there), XLA-compiled
  functions (``jit_compile=True``, ``_XlaCompile``/``_xla*`` attributes),
  single eager ops, and activations not from a listed producer.
* Any error inside the pass is logged and the graph is left unchanged.

Already-traced functions keep the graph they were optimized with: TensorFlow
optimizes a function graph once, when it is first instantiated (first call),
so :func:`enable`/:func:`disable` affect functions first *called* afterwards.
To switch an existing ``tf.function`` re-trace it (e.g. a new
``tf.function`` object, or for Keras ``model.make_train_function(force=True)``
/ re-``compile``); a loaded SavedModel's functions are instantiated on their
first call after loading.

On GPU machines Keras compiles with XLA by default (``jit_compile="auto"``);
the pass cannot act inside XLA clusters, so use
``model.compile(..., jit_compile=False)``.
"""

import contextlib
import threading

import tensorflow as tf

from tf_sparse_split._loader import load_library
from tf_sparse_split.utils.validation import validate_threshold

__all__ = ["enable", "disable", "enabled", "is_enabled", "config",
           "counters", "reset_counters", "log", "active_ops",
           "DEFAULT_PRODUCERS", "SUPPORTED_OPS"]

#: Producers whose outputs count as sparse by default. "Dropout" stands for
#: the dropout pattern (``SelectV2(mask, x * scale, 0)`` of ``tf.nn.dropout``
#: and Keras, or ``x * Cast(bool mask)``).
DEFAULT_PRODUCERS = ("Relu", "Relu6", "ReluGrad", "Relu6Grad", "Dropout")
#: Source op types the pass knows (Conv2D is active only when the
#: ``SparseSplitConv2D`` op is registered).
SUPPORTED_OPS = ("MatMul", "Conv2D")

_LOCK = threading.Lock()
_CONFIG = {"enabled": False, "threshold": "auto", "min_flops": 0.0,
           "ops": ("MatMul",), "producers": DEFAULT_PRODUCERS}


def _eager():
    return tf.init_scope()


def _threshold_value(threshold):
    # 'auto' -> -1.0 (the op chooses); numbers in [0, 1]; no negatives and
    # no numeric strings.
    auto = isinstance(threshold, str) and threshold.strip().lower() == "auto"
    return validate_threshold(threshold, allow_negative=False, allow_str=auto)


def _apply(cfg):
    lib = load_library()
    producers = cfg["producers"]
    producers = ["*"] if producers == "any" else list(producers)
    with _eager():
        active = lib.tf_sparse_split_sparse_split_rewrite_config(
            tf.constant(cfg["enabled"]),
            tf.constant(_threshold_value(cfg["threshold"]), tf.float32),
            tf.constant(float(cfg["min_flops"]), tf.float64),
            tf.constant(list(cfg["ops"]), tf.string, shape=[len(cfg["ops"])]),
            tf.constant(producers, tf.string, shape=[len(producers)]))
    return tuple(s.decode() for s in active.numpy())


def _validate(threshold, min_flops, ops, producers):
    _threshold_value(threshold)
    try:
        min_flops = float(min_flops)
    except (TypeError, ValueError):
        raise ValueError(f"min_flops must be a number >= 0, got {min_flops!r}") from None
    if not min_flops >= 0:
        raise ValueError(f"min_flops must be >= 0, got {min_flops}")
    if isinstance(ops, str):
        ops = (ops,)
    ops = tuple(ops)
    unknown = [o for o in ops if o not in SUPPORTED_OPS]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, "
                         f"got {ops!r}")
    if isinstance(producers, str):
        if producers != "any":
            raise ValueError("producers must be a sequence of op type names "
                             f"or 'any', got {producers!r}")
    else:
        producers = tuple(producers)
        if not producers or not all(isinstance(p, str) and p for p in producers):
            raise ValueError("producers must be a non-empty sequence of op "
                             f"type names or 'any', got {producers!r}")
    return min_flops, ops, producers


def enable(threshold="auto", min_flops=0.0, ops=("MatMul",),
           producers=DEFAULT_PRODUCERS):
    """Turns the rewrite pass on for graphs instantiated from now on.

    Args:
      threshold: ``"auto"`` (the op chooses from rates it measured on this
        machine) or a row-density threshold in ``[0, 1]`` given to every op
        the pass adds. The results do not depend on it, only the speed.
      min_flops: nodes whose statically known FLOP count (``2*M*K*N`` for
        MatMul) is below this are left alone; dimensions unknown at graph
        time never cause a skip.
      ops: source op types to rewrite, a subset of :data:`SUPPORTED_OPS`.
        ``"Conv2D"`` takes effect only when ``SparseSplitConv2D`` is
        registered (see :func:`active_ops`).
      producers: op types whose outputs count as sparse activations
        (default :data:`DEFAULT_PRODUCERS`; ``"Dropout"`` = the dropout
        pattern), or ``"any"`` to rewrite regardless of the producer.

    Returns:
      The tuple of source op types whose replacement op is registered.

    Raises:
      ValueError: for a threshold outside ``[0, 1]`` (other than ``"auto"``),
        a negative ``min_flops``, unknown ``ops`` or malformed ``producers``.
      tf_sparse_split.LibraryLoadError: if the op library cannot be loaded.
    """
    min_flops, ops, producers = _validate(threshold, min_flops, ops, producers)
    with _LOCK:
        cfg = {"enabled": True, "threshold": threshold, "min_flops": min_flops,
               "ops": ops, "producers": producers}
        active = _apply(cfg)
        _CONFIG.clear()
        _CONFIG.update(cfg)
    return active


def disable():
    """Turns the pass off for graphs instantiated from now on.

    Functions already instantiated keep their rewritten graphs.
    """
    with _LOCK:
        cfg = dict(_CONFIG, enabled=False)
        _apply(cfg)
        _CONFIG.clear()
        _CONFIG.update(cfg)


def is_enabled():
    """Whether the pass is on."""
    return bool(_CONFIG["enabled"])


def config():
    """The current configuration as a dict (a copy)."""
    return dict(_CONFIG)


@contextlib.contextmanager
def enabled(threshold="auto", min_flops=0.0, ops=("MatMul",),
            producers=DEFAULT_PRODUCERS):
    """Context manager: :func:`enable` inside, the previous configuration after.

    Only functions first instantiated (called) inside the block are rewritten.
    Arguments and errors as for :func:`enable`.
    """
    previous = config()
    enable(threshold=threshold, min_flops=min_flops, ops=ops,
           producers=producers)
    try:
        yield
    finally:
        with _LOCK:
            _apply(previous)
            _CONFIG.clear()
            _CONFIG.update(previous)


def counters(reset=False):
    """Nodes rewritten since the library was loaded (or the last reset).

    Args:
      reset: if True, zero the counters after reading them.

    Returns:
      dict ``{source op type: count}``, e.g. ``{"MatMul": 4}``; op types
      never rewritten are absent.
    """
    lib = load_library()
    with _eager():
        names, counts = lib.tf_sparse_split_sparse_split_rewrite_counters(tf.constant(bool(reset)))
    return {n.decode(): int(c) for n, c in zip(names.numpy(), counts.numpy())}


def reset_counters():
    """Zeroes :func:`counters`."""
    counters(reset=True)


def log(clear=False):
    """What the pass did, oldest first (at most the last 100000 records).

    Args:
      clear: if True, empty the log after reading it.

    Returns:
      list of dicts, one per node the pass rewrote or declined, with string
      values. Every record has ``action`` (``"rewritten"`` or
      ``"declined"``), ``op``, ``name`` and ``function`` (the function graph's
      name, e.g. ``__inference_f_42``); declined records have ``reason``;
      rewritten ones have ``new_op``, ``producer``, ``dtype``, ``device``,
      ``assigned_device``, ``transpose_a``/``transpose_b`` (``"0"``/``"1"``),
      ``threshold``, ``threshold_node``, and ``control_in``, ``control_out``,
      ``data_out`` (comma-separated node names; ``data_out`` as
      ``consumer:input_index``).
    """
    lib = load_library()
    with _eager():
        records = lib.tf_sparse_split_sparse_split_rewrite_log(tf.constant(bool(clear)))
    out = []
    for r in records.numpy():
        fields = {}
        for part in r.decode().split("\t"):
            key, _, value = part.partition("=")
            fields[key] = value
        out.append(fields)
    return out


def active_ops():
    """Source op types whose replacement op is registered now, e.g.
    ``("MatMul",)`` or ``("MatMul", "Conv2D")``; does not change the
    configuration."""
    with _LOCK:
        return _apply(_CONFIG)
