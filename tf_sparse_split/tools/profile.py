"""``tf-sparse-split profile``: will my model get faster with sparse-split ops?

Loads a SavedModel directory or a ``.keras`` file, runs it once on sample
inputs, captures the operands of every ``MatMul`` and ``Conv2D`` node (the
model's function graph with its variables frozen and nested functions
inlined), and for each reports the measured activation sparsity and the op
time of TensorFlow's dense op against ``sparse_split_matmul`` on the same
captured activation and weights, in the same run (K.-Y. Peng, NTU 2017:
split dense and sparse rows by run-time density).

Whether the rewrite pass (:mod:`tf_sparse_split.rewrite`) would replace a
node is asked of the pass itself (:func:`tf_sparse_split.rewrite.dry_run`
with :func:`~tf_sparse_split.rewrite.enable`'s defaults), with its reason
when it would not. The headline total covers only the nodes the pass would
replace; the whole model is also timed end to end, its graph instantiated
once with the pass off and once with it on (so ``rewrite.counters()`` and
``rewrite.log()`` of the calling process include that run). On GPU machines
Keras compiles with XLA by default; the pass applies only with
``model.compile(..., jit_compile=False)``.
"""

import time

import numpy as np

from tf_sparse_split.tools._model_io import (input_from_args, model_kind,
                                             random_input, restore_rewrite,
                                             select_signature,
                                             stop_recording_stats)
from tf_sparse_split.utils.tracing import function_per_instance

__all__ = ["profile_model", "load_model_function", "NodeProfile",
           "format_report", "profile_command"]

class NodeProfile(dict):
    """One row of the report (a dict): name, op, shape, sparsity,
    zero_columns, dense_s, split_s (None if not timed), producer,
    rewritable (True/False as the pass decided; None for nodes that already
    are sparse-split ops), reason (why the pass would not replace it)."""


# Node types profiled, and the dense op each computes.
_PROFILED = {"MatMul": "MatMul", "TfSparseSplit>SparseSplitMatMul": "MatMul",
             "Conv2D": "Conv2D", "TfSparseSplit>SparseSplitConv2D": "Conv2D"}


def load_model_function(path, signature=None):
    """A concrete function running the model at ``path``, and a description.

    Args:
      path: a SavedModel directory or a ``.keras`` file.
      signature: SavedModel signature key (default ``serving_default``, else
        the only/first one).

    Returns:
      ``(concrete_function, description, owner)``; keep ``owner`` (the
      loaded object) alive while using the function: it holds the variables.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: if it is neither a SavedModel nor a ``.keras`` file, or has
        no usable signature.
    """
    import tensorflow as tf

    if model_kind(path) == "keras":
        import keras

        model = keras.saving.load_model(path, compile=False)
        # Sparse-split layers record statistics in variables; a frozen graph
        # has no variables to update, so profiling runs them without it.
        stop_recording_stats(model)
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in model.inputs]
        fn = function_per_instance(
            lambda *xs: model(list(xs) if len(xs) > 1 else xs[0],
                              training=False))
        return (fn.get_concrete_function(*specs), f"Keras model {model.name!r}",
                model)
    loaded = tf.saved_model.load(path)
    key, fn = select_signature(loaded, path, signature)
    return fn, f"SavedModel, signature {key!r}", loaded


def _median_time(fn, repeats):
    """Median seconds of ``fn().numpy()`` with ``fn`` run as a tf.function
    (as in a model's graph: no eager Python overhead on either side)."""
    graph_fn = function_per_instance(fn)
    # Trace, warm-up (and the op's calibration for 'auto'); a few calls, as
    # the first op of a process stays slow for more than one (seen: 8x on
    # the first node with --repeats 3).
    for _ in range(3):
        graph_fn().numpy()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        graph_fn().numpy()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _end_to_end(frozen, inputs, repeats):
    """Median seconds of one call of the whole (frozen) model, instantiated
    with the rewrite pass off and on: ``(off_s, on_s)``, timed interleaved
    (``max(3 * repeats, 30)`` rounds).
    The pass configuration is restored afterwards."""
    import tensorflow as tf

    from tf_sparse_split import rewrite

    args = [tf.constant(x) for x in inputs]
    previous = rewrite.config()
    # The graphs this profile ran with the pass off (the captures, the op
    # timings) are not the user's: no "instantiated while off" warning.
    rewrite._take_missed()
    with rewrite.enabled(threshold=previous["threshold"]):
        split = function_per_instance(lambda: frozen(*args))
        split()  # first call: instantiated (and rewritten) now
    if previous["enabled"]:
        rewrite.disable()
    try:
        plain = function_per_instance(lambda: frozen(*args))
        plain()
    finally:
        restore_rewrite(previous)

    def once(fn):
        t0 = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), fn())
        return time.perf_counter() - t0

    once(plain), once(split)  # warm-up (and the op's calibration)
    off, on = [], []
    # One call is short and noisy: at least 30 interleaved rounds.
    for _ in range(max(3 * repeats, 30)):
        off.append(once(plain))
        on.append(once(split))
    return float(np.median(off)), float(np.median(on))


def profile_model(path, inputs=None, batch_size=128, input_sparsity=0.5,
                  threshold=-1.0, repeats=10, seed=0, signature=None,
                  end_to_end=False):
    """Profiles the MatMul/Conv2D nodes of a model.

    Args:
      path: SavedModel directory or ``.keras`` file.
      inputs: list of numpy arrays (one per model input), or None for random
        inputs: ``relu(normal)`` with ``input_sparsity`` of zeros, unknown
        dimensions set to ``batch_size``.
      batch_size: size of unknown dimensions of random inputs.
      input_sparsity: fraction of zeros of random inputs, in ``[0, 1)``.
      threshold: threshold given to ``sparse_split_matmul`` (negative: auto).
      repeats: timed repetitions per op (median reported).
      seed: seed of the random inputs.
      signature: SavedModel signature key.
      end_to_end: also time the whole model with the rewrite pass off and
        on (see :func:`_end_to_end`); the result is in the attribute
        ``end_to_end`` of the returned row list, ``(off_s, on_s)``.

    Returns:
      ``(description, list of NodeProfile, input shapes)``.

    Raises:
      FileNotFoundError, ValueError: see :func:`load_model_function`; also
        ValueError for inputs that do not match the model's inputs.
    """
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import (
        convert_variables_to_constants_v2)

    from tf_sparse_split import rewrite
    from tf_sparse_split.ops import sparse_split_conv2d, sparse_split_matmul

    fn, desc, owner = load_model_function(path, signature)
    try:
        frozen = convert_variables_to_constants_v2(fn)
    except (ValueError, TypeError, tf.errors.OpError) as e:
        raise ValueError(
            f"cannot freeze {path} for profiling ({e}); a SavedModel whose "
            "signature updates variables (e.g. sparse-split layers recording "
            "statistics) cannot be frozen: profile the .keras file instead"
        ) from e
    graph = frozen.graph
    placeholders = [t for t in frozen.inputs if t.dtype != tf.resource]
    rng = np.random.default_rng(seed)
    if inputs is None:
        inputs = []
        for t in placeholders:
            inputs.append(random_input(t.shape.as_list(), t.dtype, batch_size,
                                       input_sparsity, rng))
    if len(inputs) != len(placeholders):
        raise ValueError(f"the model takes {len(placeholders)} inputs, got "
                         f"{len(inputs)}")
    feeds = {}
    for t, x in zip(placeholders, inputs):
        if not t.shape.is_compatible_with(x.shape):
            raise ValueError(f"input of shape {x.shape} does not fit the "
                             f"model input {t.name} of shape {t.shape}")
        feeds[t.name] = x
    decisions = {r["name"]: r for r in rewrite.dry_run(graph)}
    nodes = [op for op in graph.get_operations() if op.type in _PROFILED]
    fetches = [[op.inputs[0], op.inputs[1]] for op in nodes]
    with tf.compat.v1.Session(graph=graph) as sess:
        values = sess.run(fetches, feed_dict=feeds)
    rows = _ProfileRows()
    for op, (a, b) in zip(nodes, values):
        decision = decisions.get(op.name)
        if decision is None:  # already a sparse-split op
            producer, rewritable, reason = op.inputs[0].op.type, None, ""
        else:
            producer = decision.get("producer") or "?"
            rewritable = decision["action"] == "would_rewrite"
            reason = decision.get("reason", "")
        row = NodeProfile(name=op.name, op=op.type, producer=producer,
                          rewritable=rewritable, reason=reason,
                          dtype=a.dtype.name,
                          sparsity=float(np.mean(a == 0)) if a.size else 0.0,
                          dense_s=None, split_s=None, zero_columns=None)
        kind = _PROFILED[op.type]
        if kind == "MatMul" and a.dtype in (np.float32, np.float64):
            ta = op.get_attr("transpose_a")
            tb = op.get_attr("transpose_b")
            ea = a.T if ta else a
            row["shape"] = f"{ea.shape[0]}x{ea.shape[1]}x{b.shape[0] if tb else b.shape[1]}"
            row["zero_columns"] = float(np.mean(~ea.any(axis=0)))
            at, bt = tf.constant(a), tf.constant(b)
            row["dense_s"] = _median_time(
                lambda: tf.matmul(at, bt, transpose_a=ta, transpose_b=tb),
                repeats)
            row["split_s"] = _median_time(
                lambda: sparse_split_matmul(at, bt, threshold, transpose_a=ta,
                                            transpose_b=tb), repeats)
        elif kind == "Conv2D":
            row["shape"] = "x".join(map(str, a.shape)) + " * " + "x".join(map(str, b.shape))
            strides = list(op.get_attr("strides"))
            padding = op.get_attr("padding").decode()
            fmt = (op.get_attr("data_format").decode()
                   if op.type == "Conv2D" else "NHWC")
            dil = list(op.get_attr("dilations"))
            pads = list(op.get_attr("explicit_paddings")) if padding == "EXPLICIT" else []
            conv_padding = (padding if padding != "EXPLICIT" else
                            [pads[i:i + 2] for i in range(0, 8, 2)])
            at, bt = tf.constant(a), tf.constant(b)
            try:
                row["dense_s"] = _median_time(
                    lambda: tf.nn.conv2d(at, bt, strides, conv_padding,
                                         data_format=fmt,
                                         dilations=dil), repeats)
            except tf.errors.OpError:
                pass  # e.g. NCHW on CPU
            if fmt == "NHWC" and a.dtype in (np.float32, np.float64):
                row["zero_columns"] = float(np.mean(~a.any(axis=(0, 1, 2))))
                row["split_s"] = _median_time(
                    lambda: sparse_split_conv2d(
                        at, bt, strides, padding, dilations=dil,
                        explicit_paddings=pads or None,
                        threshold=threshold), repeats)
        else:
            row["shape"] = f"{a.shape}x{b.shape}"
        rows.append(row)
    if end_to_end:
        rows.end_to_end = _end_to_end(frozen, inputs, repeats)
    del owner  # the variables were needed until the graph was frozen and run
    return desc, rows, [x.shape for x in inputs]


class _ProfileRows(list):
    """The rows of :func:`profile_model`; ``end_to_end`` is ``(off_s,
    on_s)`` when measured, else None."""

    end_to_end = None


def format_report(path, desc, rows, input_shapes, input_desc, out):
    """Prints the report of :func:`profile_model` to the file ``out``."""
    print(f"model: {path} ({desc})", file=out)
    print(f"inputs: {', '.join(str(list(s)) for s in input_shapes)} ({input_desc})",
          file=out)
    if not rows:
        print("no MatMul or Conv2D nodes found", file=out)
        return
    width = max(28, max(len(r["name"]) for r in rows) + 2)
    opw = max(8, max(len(r["op"]) for r in rows) + 2)
    shw = max(18, max(len(r["shape"]) for r in rows) + 2)
    prw = max(12, max(len(r["producer"]) for r in rows) + 2)
    head = (f"{'node':<{width}}{'op':<{opw}}{'M x K x N':<{shw}}{'input from':<{prw}}"
            f"{'pass':<6}{'sparsity':>9}{'zero cols':>10}{'dense ms':>10}"
            f"{'split ms':>10}{'speed-up':>10}")
    print(head, file=out)
    for r in rows:
        d, s = r["dense_s"], r["split_s"]
        zc = "" if r["zero_columns"] is None else f"{r['zero_columns']:.3f}"
        dt = "" if d is None else f"{d * 1e3:.3f}"
        st = "n/a" if s is None else f"{s * 1e3:.3f}"
        sp = "" if (d is None or s is None or s <= 0) else f"{d / s:.2f}x"
        verdict = {True: "yes", False: "no", None: "ours"}[r["rewritable"]]
        print(f"{r['name']:<{width}}{r['op']:<{opw}}{r['shape']:<{shw}}"
              f"{r['producer']:<{prw}}{verdict:<6}"
              f"{r['sparsity']:>9.3f}{zc:>10}{dt:>10}{st:>10}{sp:>10}", file=out)
    rw = [r for r in rows if r["rewritable"] and r["split_s"] is not None
          and r["dense_s"] is not None]
    if rw:
        d = sum(r["dense_s"] for r in rw)
        s = sum(r["split_s"] for r in rw)
        label = "total (pass=yes nodes)"
        print(f"{label:<{width}}{'':<{opw + shw + prw + 25}}{d * 1e3:>10.3f}"
              f"{s * 1e3:>10.3f}{d / s:>9.2f}x", file=out)
        print(f"headline: the {len(rw)} node(s) the rewrite pass would "
              f"replace take {d * 1e3:.3f} ms with TensorFlow's op and "
              f"{s * 1e3:.3f} ms split: {d / s:.2f}x on those nodes",
              file=out)
    else:
        print("headline: the rewrite pass would replace none of these nodes",
              file=out)
    declined = [r for r in rows if r["rewritable"] is False]
    for r in declined:
        print(f"  not replaced: {r['name']}: {r['reason']}", file=out)
    e2e = getattr(rows, "end_to_end", None)
    if e2e is not None:
        off, on = e2e
        print(f"whole model, end to end (one call, rewrite pass off vs on): "
              f"{off * 1e3:.3f} ms vs {on * 1e3:.3f} ms, "
              f"{off / on if on > 0 else float('nan'):.2f}x", file=out)
    print("'pass': whether tf_sparse_split.rewrite.enable() (defaults) "
          "replaces the node, as the pass itself answers (rewrite.dry_run); "
          "'ours': already a sparse-split op. Times: median op time on the "
          "captured operands (TensorFlow's op vs the sparse-split op, same "
          "run). On GPU machines, compile Keras models with "
          "jit_compile=False for the pass to apply.", file=out)


def profile_command(args, out):
    """The ``tf-sparse-split profile`` command on parsed arguments (``model``,
    ``input``, ``batch_size``, ``input_sparsity``, ``threshold``,
    ``repeats``, ``signature``, ``seed``); prints the report to ``out`` and
    returns the exit code 0.

    Raises:
      FileNotFoundError: a missing model or input file.
      ValueError: a model or input that cannot be used.
      ImportError: the op library cannot be loaded (``LibraryLoadError``).
    """
    from tf_sparse_split._loader import load_library

    load_library()
    x, input_desc = input_from_args(args)
    inputs = None if x is None else [x]
    desc, rows, shapes = profile_model(
        args.model, inputs=inputs, batch_size=args.batch_size,
        input_sparsity=args.input_sparsity, threshold=args.threshold,
        repeats=args.repeats, seed=args.seed, signature=args.signature,
        end_to_end=True)
    format_report(args.model, desc, rows, shapes, input_desc, out)
    return 0
