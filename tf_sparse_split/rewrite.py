"""Switch for the sparse-split graph-rewrite pass.

The op library contains a TensorFlow graph-optimization pass (C++,
``cc/rewrite/``) that replaces, in the graphs TensorFlow optimizes, a
``MatMul`` or ``Conv2D`` (NHWC) whose
activation input can be sparse -- produced by ``Relu``, ``Relu6``, their
gradients ``ReluGrad``/``Relu6Grad``, the dropout pattern, or the graph's
own input (raw pixels: MNIST's are ~80% zeros) -- with the
sparse-split op (``SparseSplitMatMul``, ``SparseSplitConv2D``), which
computes the same product
while skipping the activation's zeros (K.-Y. Peng, *Adaptive runtime
exploiting sparsity in tensor of deep learning on heterogeneous systems*,
NTU 2017). Existing models -- Keras models of plain ``Dense`` layers,
SavedModels exported by plain TensorFlow -- then use it without changes::

    from tf_sparse_split import rewrite
    rewrite.enable()                 # graphs traced/instantiated from now on
    model.fit(...)                   # Keras: compile(jit_compile=False)
    print(rewrite.counters())        # {'MatMul': 6, 'Conv2D': 2}

What the pass does:

* It runs on every ``tf.function`` / SavedModel function graph when
  TensorFlow instantiates it (PRE_PLACEMENT, after control-flow lowering).
  The replacement keeps the node's name, requested and assigned device,
  attributes (``transpose_a``/``transpose_b``), control inputs and all
  consumers; its extra ``stats`` output is unused; the threshold is a new
  scalar ``Const`` named ``<node>/tfss_threshold/_N``. A fused replacement (below) takes
  the name and consumers of the last node it absorbs.
* Look-through: the activation counts as sparse when a listed producer
  reaches it through ops that keep zeros: identities, casts and layout
  changes (``Identity``, ``Reshape`` -- Keras ``Flatten`` --,
  ``Transpose``, ``ExpandDims``, ``Squeeze``, ...), ``Slice``,
  ``StridedSlice``, ``GatherV2``, ``Tile``, zero padding (``Pad``;
  ``PadV2`` with a zero constant: Keras ``ZeroPadding2D``), ``ConcatV2``
  /``Pack`` of sparse inputs only, and pooling (``MaxPool``, ``AvgPool``:
  on ReLU outputs, which are >= 0, both are 0 exactly where the whole
  window is 0, so they keep the all-zero regions of a feature map; the op
  measures what is left per call). :func:`log` records them in ``via``.
* Fused forms: a ``MatMul``/``Conv2D`` followed by its bias add
  (``BiasAdd`` NHWC, or ``Add``/``AddV2`` with a ``[N]`` or
  ``[1, ..., 1, N]`` operand, as Keras 3 writes it) and optionally
  ``Relu``/``Relu6``, each the only consumer of the value before it
  (``Shape`` readers aside), becomes one sparse-split op with ``bias`` and
  ``activation`` -- what Grappler's remapper would have fused into
  ``_FusedMatMul``/``_FusedConv2D``, which a replaced node no longer gets.
  The new node takes the last absorbed node's name (``new_name`` in
  :func:`log`, ``kind="fuse"``, ``fused="AddV2+Relu"``). ``Conv2D`` is
  fused only when the registered ``SparseSplitConv2D`` has a ``num_bias``
  attribute (checked on its OpDef when the pass runs).
* Gradients: the pass runs after ``tf.GradientTape`` / Keras built the
  gradient graph (a ``tf.function``'s gradient ops are in the function
  graph TensorFlow instantiates; Keras ``train_step`` included), so the
  backward ``MatMul`` ops are plain ``MatMul`` ops; those whose activation
  operand is known to be sparse are rewritten too:
  ``dW = x^T . dY`` (``transpose_a=True``, ``x`` a sparse activation) and
  ``dX = dY . W^T`` when ``dY`` is a ``ReluGrad`` output (zero wherever the
  ReLU output was). When every consumer of ``dX = dY . op(W)`` is
  ``ReluGrad(dX, F)`` (or ``Relu6Grad``) for one tensor ``F`` -- the input
  gradient of a layer whose input came from a ReLU -- it becomes
  ``SparseSplitSddmm(mask=F, dY, W)``, which computes it only where
  ``F != 0``: ``ReluGrad`` keeps the gradient only where ``F > 0``, so the
  values are the same (``kind="sddmm"``, ``mask`` in :func:`log`; what
  ``SparseSplitDense(masked_input_grad=True)`` gets from its registered
  gradient). Every replacement computes the same values, so gradients stay
  correct. A ``Conv2DBackpropFilter`` (the filter gradient of a
  ``Conv2D``) whose input ``x`` is a sparse activation becomes
  ``SparseSplitConv2DBackpropFilter`` (cost proportional to ``x``'s
  nonzeros on its sparse path), as ``SparseSplitConv2D``'s registered
  gradient does. With ``"Conv2DBackpropInput"`` in ``ops``, a stride-1
  input gradient whose ``dY`` is sparse (a ``ReluGrad`` output) becomes
  ``SparseSplitConv2DBackpropInput`` (explicit paddings only within the
  dilated filter's static extent).
* It leaves alone -- and says why at ``VLOG(1)``
  (``TF_CPP_VMODULE=sparse_split_rewrite=1``) and in :func:`log` -- what it
  cannot replace exactly: dtypes the replacement op has no kernel for
  (it takes float32, float64, bfloat16 and float16; not integer or
  complex products), grouped convolutions (input channels a multiple of
  the filter's), nodes on a
  device without a kernel of ours (GPU, TPU), nodes with no device on a
  machine with a GPU (the placer would put ``MatMul`` there), XLA-compiled
  functions (``jit_compile=True``, ``_XlaCompile``/``_xla*`` attributes),
  single eager ops, and activations not from a listed producer.
* Any error inside the pass is logged and the graph is left unchanged.

What the pass sees -- exactly:

* TensorFlow optimizes a function graph once, when it is first
  *instantiated* (first call), so :func:`enable`/:func:`disable` affect
  functions first *called* afterwards. A function (or Keras
  ``train_function``/``predict_function``) already called while the pass was
  off keeps its graph. The pass notices such graphs while it is off (once
  the op library is loaded, i.e. after ``import tf_sparse_split`` and
  TensorFlow): :func:`enable` warns once about them and :func:`log` has an
  ``action="missed"`` record per function graph. Re-trace to switch them: a
  new ``tf.function`` object, or for Keras
  ``model.make_train_function(force=True)`` / ``make_predict_function(
  force=True)`` or compile again. Functions called before the library was
  loaded are not seen at all. A loaded SavedModel's functions are
  instantiated on their first call after loading.
* XLA: the bodies of XLA-compiled functions (``jit_compile=True``, Keras'
  default ``jit_compile="auto"`` on GPU machines) are compiled by XLA,
  which does not run TensorFlow's graph-optimization passes: when such a
  function is called at top level (eagerly), the pass never sees it, and
  nothing is logged. When it is called from inside a function the pass does
  see, each MatMul/Conv2D of the XLA callee gets an ``action="declined"``
  record ("inside XLA-compiled function ...") and TensorFlow's log a warning
  once per process. Use ``jit_compile=False`` (Keras:
  ``model.compile(..., jit_compile=False)``) for the pass to apply.
* Single eager ops (``tf.matmul`` outside ``tf.function``) are never
  rewritten.

:func:`dry_run` asks the pass what it would do to a graph without changing
it; ``tf-sparse-split profile`` uses it.
"""

import contextlib
import threading
import warnings

import numpy as np
import tensorflow as tf

from tf_sparse_split._loader import load_library
from tf_sparse_split.utils.validation import validate_threshold

__all__ = ["enable", "disable", "enabled", "is_enabled", "config",
           "counters", "reset_counters", "log", "active_ops", "dry_run",
           "DEFAULT_PRODUCERS", "DEFAULT_OPS", "SUPPORTED_OPS"]

#: Producers whose outputs count as sparse by default. "Dropout" stands for
#: the dropout pattern (``SelectV2(mask, x * scale, 0)`` of ``tf.nn.dropout``
#: and Keras, or ``x * Cast(bool mask)``), "Input" for the graph's inputs
#: (``_Arg``, ``Placeholder``, ``IteratorGetNext``): a model's first layer,
#: as :func:`tf_sparse_split.sparse_split_model` converts it too. On inputs
#: without zeros the op's sampled analysis sends every call to TensorFlow's
#: kernel (whole models on random inputs without zeros, 2-core Xeon: 0.96-
#: 1.02x the time of the same graph rewritten without "Input").
DEFAULT_PRODUCERS = ("Relu", "Relu6", "ReluGrad", "Relu6Grad", "Dropout",
                     "Input")
#: Producer names that stand for a pattern, not an op type.
_PATTERN_PRODUCERS = ("Dropout", "Input", "*")
#: Source op types the pass knows (Conv2D and Conv2DBackpropFilter are
#: active only when ``SparseSplitConv2D`` / ``SparseSplitConv2DBackpropFilter``
#: are registered). ``Conv2DBackpropFilter`` is the filter gradient of a
#: ``Conv2D`` in a training graph; its input ``x`` is the sparse operand.
#: ``Conv2DBackpropInput`` (opt-in, not in :data:`DEFAULT_OPS`) is the input
#: gradient; at stride 1 it becomes ``SparseSplitConv2DBackpropInput`` when
#: its output gradient ``dY`` is sparse (a ``ReluGrad`` output).
SUPPORTED_OPS = ("MatMul", "Conv2D", "Conv2DBackpropFilter",
                 "Conv2DBackpropInput")
#: Source op types :func:`enable` rewrites by default (what ``profile``
#: reports as ``pass=yes``).
DEFAULT_OPS = ("MatMul", "Conv2D", "Conv2DBackpropFilter")

_LOCK = threading.Lock()
_CONFIG = {"enabled": False, "threshold": "auto", "min_flops": 0.0,
           "ops": DEFAULT_OPS, "producers": DEFAULT_PRODUCERS}


def _eager():
    return tf.init_scope()


def _threshold_value(threshold):
    # 'auto' or a negative number -> automatic (the op chooses); [0, 1].
    return validate_threshold(threshold)


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


def _names_tuple(value, name):
    """``value`` (a string or an iterable of them) as a tuple; a clear
    ``ValueError`` naming the argument for None or a non-iterable."""
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of op type names, got "
                         f"{value!r}") from None


def _validate(threshold, min_flops, ops, producers):
    _threshold_value(threshold)
    # A number, not a bool or numeric text (float(True) and float("10")
    # would pass).
    if isinstance(min_flops, (bool, np.bool_, str, bytes)):
        raise ValueError(f"min_flops must be a number >= 0, got {min_flops!r}")
    try:
        min_flops = float(min_flops)
    except (TypeError, ValueError):
        raise ValueError(f"min_flops must be a number >= 0, got {min_flops!r}") from None
    if not min_flops >= 0:
        raise ValueError(f"min_flops must be >= 0, got {min_flops}")
    ops = _names_tuple(ops, "ops")
    unknown = [o for o in ops if o not in SUPPORTED_OPS]
    if unknown or not ops:
        raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, "
                         f"got {ops!r}")
    if isinstance(producers, str):
        if producers != "any":
            raise ValueError("producers must be a sequence of op type names "
                             f"or 'any', got {producers!r}")
    else:
        producers = _names_tuple(producers, "producers")
        # Names are op types: no tab (the pass's log is tab-separated).
        if not producers or not all(isinstance(p, str) and p and "\t" not in p
                                    for p in producers):
            raise ValueError("producers must be a non-empty sequence of op "
                             f"type names or 'any', got {producers!r}")
        _warn_unregistered(producers)
    return min_flops, ops, producers


def _warn_unregistered(producers):
    """Warns (``UserWarning``) about producer names that are neither the
    pass's own ("Dropout", "Input", "*") nor an op type registered in this
    process (a typo, or ``"relu"`` for ``"Relu"``): the pass compares them
    with the graphs' op types, so such a name matches nothing. Not an
    error: an op library loaded later may register it."""
    from tensorflow.python.framework import op_def_registry

    unknown = [p for p in producers if p not in _PATTERN_PRODUCERS
               and op_def_registry.get(p) is None]
    if unknown:
        warnings.warn(
            f"rewrite producers {unknown} are not op types registered in "
            "this process (op type names are case-sensitive, e.g. 'Relu'); "
            "they match no node until an op library registers them",
            UserWarning, stacklevel=4)


def enable(threshold="auto", min_flops=0.0, ops=DEFAULT_OPS,
           producers=DEFAULT_PRODUCERS):
    """Turns the rewrite pass on for graphs instantiated from now on.

    Args:
      threshold: ``"auto"`` or a negative number (the op chooses from rates
        it measured on this machine), or a row-density threshold in
        ``[0, 1]`` given to every op
        the pass adds. The results do not depend on it, only the speed.
      min_flops: nodes whose statically known FLOP count (``2*M*K*N`` for
        MatMul) is below this are left alone; dimensions unknown at graph
        time never cause a skip.
      ops: source op types to rewrite, a subset of :data:`SUPPORTED_OPS`
        (default :data:`DEFAULT_OPS`: ``MatMul``, ``Conv2D`` and the
        filter gradient ``Conv2DBackpropFilter``). The convolutions take
        effect only when their sparse-split ops are registered (see
        :func:`active_ops`).
      producers: op types whose outputs count as sparse activations
        (default :data:`DEFAULT_PRODUCERS`; ``"Dropout"`` = the dropout
        pattern; ``"Input"`` = the graph's inputs -- ``_Arg``,
        ``Placeholder``, ``IteratorGetNext`` -- e.g. MNIST pixels (~80%
        zeros) or bag-of-words features; leave it out,
        ``tuple(p for p in DEFAULT_PRODUCERS if p != "Input")``, to keep
        the layers on a model's input TensorFlow's), or ``"any"`` to
        rewrite regardless of the producer. The ops measure the density per
        call and keep the dense kernel where the zeros do not pay.

    Returns:
      The tuple of source op types whose replacement op is registered.

    Warns:
      RuntimeWarning: once for the function graphs with MatMul/Conv2D nodes
        that TensorFlow instantiated while the pass was off (they keep their
        graphs; see the module docstring), naming a few.

    Raises:
      ValueError: for a threshold above 1, NaN or a string other than
        ``"auto"``,
        a negative, NaN, bool or text ``min_flops``, unknown ``ops`` or
        malformed ``producers`` (None, not a sequence of op type names).
      tf_sparse_split.LibraryLoadError: if the op library cannot be loaded.
    """
    min_flops, ops, producers = _validate(threshold, min_flops, ops, producers)
    with _LOCK:
        cfg = {"enabled": True, "threshold": threshold, "min_flops": min_flops,
               "ops": ops, "producers": producers}
        active = _apply(cfg)
        _CONFIG.clear()
        _CONFIG.update(cfg)
    _warn_missed()
    return active


def _take_missed():
    """The "missed" records since the last call (see :func:`_warn_missed`),
    emptying that list (the log keeps them)."""
    lib = load_library()
    with _eager():
        return _parse(lib.tf_sparse_split_sparse_split_rewrite_missed())


def _warn_missed():
    missed = _take_missed()
    if not missed:
        return
    names = [r.get("function", "?") for r in missed]
    shown = ", ".join(f"{n} ({r.get('op', '')})" for n, r in
                      zip(names[:4], missed[:4]))
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    warnings.warn(
        f"tf_sparse_split.rewrite: {len(names)} function graph(s) with "
        f"MatMul/Conv2D nodes were already instantiated while the pass was "
        f"off and keep their graphs: {shown}{more}. TensorFlow optimizes a "
        "function once; re-trace it to rewrite it (a new tf.function, or for "
        "Keras model.make_train_function(force=True) / "
        "make_predict_function(force=True) or compile again). "
        "rewrite.log() lists them (action='missed').",
        RuntimeWarning, stacklevel=3)


def _parse(records):
    out = []
    for r in records.numpy():
        fields = {}
        for part in r.decode().split("\t"):
            key, _, value = part.partition("=")
            fields[key] = value
        out.append(fields)
    return out


def dry_run(graph, ops=DEFAULT_OPS, producers=DEFAULT_PRODUCERS,
            min_flops=0.0):
    """Asks the pass what it would do to ``graph``, without changing it or
    the configuration.

    The graph is treated as a plain graph placed on this process's CPU (the
    device checks of a real run, e.g. a GPU the placer could pick, are not
    made); nodes inside functions the graph calls are looked at only for
    XLA callees.

    Args:
      graph: a ``tf.Graph``, a ``tf.compat.v1.GraphDef``, or a concrete
        function (its graph).
      ops, producers, min_flops: as for :func:`enable`.

    Returns:
      list of dicts, one per MatMul/Conv2D node, with string values:
      ``action`` (``"would_rewrite"`` or ``"declined"``), ``op``, ``name``,
      ``producer`` (the activation's producer op type, or the dropout
      pattern ``"Dropout"``, joined by ``"+"`` for a concat of several; for
      declined nodes the op type found, or empty if the pass declined
      before looking), ``via`` (the zero-preserving ops passed on the way,
      comma-separated, e.g. ``"Reshape,MaxPool"``) and, when declined,
      ``reason``; ``would_rewrite`` records also have ``new_op``, ``kind``,
      ``new_name``, ``fused``, ``activation`` and ``unfused`` as in
      :func:`log`.

    Raises:
      ValueError: bad ``ops``/``producers``/``min_flops``.
      TypeError: ``graph`` of another type.
      tf_sparse_split.LibraryLoadError: if the op library cannot be loaded.
    """
    min_flops, ops, producers = _validate("auto", min_flops, ops, producers)
    if hasattr(graph, "graph") and hasattr(graph.graph, "as_graph_def"):
        graph = graph.graph
    if hasattr(graph, "as_graph_def"):
        graph = graph.as_graph_def()
    if not hasattr(graph, "SerializeToString"):
        raise TypeError(f"dry_run takes a tf.Graph, GraphDef or concrete "
                        f"function, got {type(graph).__name__}")
    producers = ["*"] if producers == "any" else list(producers)
    lib = load_library()
    with _eager():
        records = lib.tf_sparse_split_sparse_split_rewrite_dry_run(
            tf.constant(graph.SerializeToString()),
            tf.constant(float(min_flops), tf.float64),
            tf.constant(list(ops), tf.string, shape=[len(ops)]),
            tf.constant(producers, tf.string, shape=[len(producers)]))
    return _parse(records)


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
def enabled(threshold="auto", min_flops=0.0, ops=DEFAULT_OPS,
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
      values. Every record has ``action`` (``"rewritten"``, ``"declined"``
      or ``"missed"``), ``op``, ``name`` and ``function`` (the function
      graph's name, e.g. ``__inference_f_42``); declined and missed records
      have ``reason``; a ``"missed"`` record stands for a whole function
      graph instantiated while the pass was off (``op`` lists its counts,
      e.g. ``"MatMul:3"``, ``name`` is empty);
      rewritten ones have ``new_op``, ``producer``, ``via`` (look-through
      ops between producer and node), ``kind`` (``"replace"``: the node
      alone; ``"fuse"``: with its bias add and activation, ``fused`` their
      op types joined by ``"+"``, ``activation`` ``"none"``/``"relu"``/
      ``"relu6"``, ``new_name`` the absorbed last node's name, which the new
      node takes; ``"sddmm"``: an input gradient feeding only ``ReluGrad``,
      ``mask`` the node masking it), ``unfused`` (why a following bias add
      or activation was not absorbed, or empty), ``dtype``, ``device``,
      ``assigned_device``, ``transpose_a``/``transpose_b`` (``"0"``/``"1"``),
      ``threshold``, ``threshold_node``, ``threshold_anchor`` (the node
      whose control edge keeps the new Consts in a while loop's frame; empty
      in graphs without loops, where a control edge on the activation's
      producer would stop Grappler from fusing it into its MatMul/Conv2D),
      and ``control_in``, ``control_out``,
      ``data_out`` (comma-separated node names; ``data_out`` as
      ``consumer:input_index``).
    """
    lib = load_library()
    with _eager():
        records = lib.tf_sparse_split_sparse_split_rewrite_log(tf.constant(bool(clear)))
    return _parse(records)


def active_ops():
    """Source op types whose replacement op is registered now, e.g.
    ``("MatMul",)`` or ``("MatMul", "Conv2D")``; does not change the
    configuration."""
    with _LOCK:
        return _apply(_CONFIG)
