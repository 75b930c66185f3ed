"""``tf-sparse-split profile MODEL --end-to-end``: whole-model inference
latency.

Times the whole model on one input batch in up to three variants, in the same
run, interleaved round by round (variant order rotated every round) after a
warm-up:

* ``plain``: the model's function as TensorFlow runs it, the rewrite pass off;
* ``rewrite``: the same model loaded again and first called with the graph
  rewrite pass on (:mod:`tf_sparse_split.rewrite`, ``MatMul`` and, when
  registered, ``Conv2D``), so its products fed by a ReLU or the model
  input run as sparse-split ops;
* ``sparse-split``: a model with sparse-split layers: the one given with
  ``--sparse-model``, or for a ``.keras`` model of ``Dense``/``Conv2D``
  layers (Sequential or functional) a copy converted layer by layer
  (:func:`convert_to_sparse_split`, same weights, threshold automatic).

Reported per variant: p50 and p90 latency in milliseconds, the ratio of the
plain p50 to the variant's p50 (> 1 = faster), and the largest absolute
difference of its output from the plain output (the variants compute the
same function; differences are float rounding). Sparse-split layers run
without recording statistics (inference). On GPU machines Keras models need
``jit_compile=False`` for the rewrite pass (it cannot act inside XLA).
"""

import time

import numpy as np

from tf_sparse_split.tools._model_io import (input_from_args, model_kind,
                                             random_input, restore_rewrite,
                                             select_signature,
                                             stop_recording_stats)
from tf_sparse_split.utils.tracing import function_per_instance

__all__ = ["convert_to_sparse_split", "end_to_end_latency", "format_latency",
           "latency_command"]


def convert_to_sparse_split(model, threshold=-1.0):
    """A copy of a Sequential or functional Keras ``model`` whose
    ``keras.layers.Dense`` layers are :class:`~tf_sparse_split.layers.
    SparseSplitDense` and whose ``keras.layers.Conv2D`` layers (NHWC,
    grouped ones included) are :class:`~tf_sparse_split.layers.
    SparseSplitConv2D`,
    with the same weights; other layers are cloned unchanged.

    Args:
      model: a built Sequential or functional ``keras.Model``.
      threshold: threshold of the new layers (negative = automatic).

    Returns:
      ``(converted_model, names)``: ``names`` lists the converted layers
      (empty when nothing could be converted).

    Raises:
      ValueError: for a subclassed model (``keras.models.clone_model`` cannot
        rebuild it).
    """
    import keras

    from tf_sparse_split.layers import SparseSplitConv2D, SparseSplitDense

    converted = []

    def clone(layer):
        config = layer.get_config()
        new = None
        if type(layer) is keras.layers.Dense:
            new = SparseSplitDense.from_config({**config,
                                                "threshold": threshold})
        elif type(layer) is keras.layers.Conv2D:
            try:
                new = SparseSplitConv2D.from_config({**config,
                                                     "threshold": threshold})
            except ValueError:  # channels_first
                new = None
        if new is None:
            return layer.__class__.from_config(config)
        converted.append(layer.name)
        return new

    try:
        new_model = keras.models.clone_model(model, clone_function=clone)
    except (ValueError, TypeError) as e:
        raise ValueError(f"cannot convert model {model.name!r} to sparse-split "
                         f"layers ({e})") from e
    by_name = {l.name: l for l in new_model._flatten_layers(
        include_self=False, recursive=True)}
    for old in model._flatten_layers(include_self=False, recursive=True):
        new = by_name.get(old.name)
        if new is None or not old.weights:
            continue
        weights = old.get_weights()
        if old.name in converted:
            weights = weights + [np.float32(new.threshold)]
        new.set_weights(weights)
    return new_model, converted


def _keras_fn(model):
    stop_recording_stats(model)
    return function_per_instance(lambda x: model(x, training=False))


def _saved_model_fn(path, signature):
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    key, fn = select_signature(loaded, path, signature)
    specs = [t for t in fn.structured_input_signature[1].values()]
    if len(specs) != 1:
        raise ValueError(f"--end-to-end needs a single-input model; signature "
                         f"{key!r} takes {len(specs)} inputs")
    name = next(iter(fn.structured_input_signature[1]))

    def call(x):
        out = fn(**{name: x})
        return next(iter(out.values())) if isinstance(out, dict) else out

    return call, loaded, specs[0]


def _first_output(y):
    if isinstance(y, dict):
        y = next(iter(y.values()))
    if isinstance(y, (list, tuple)):
        y = y[0]
    return y


def _load(path, signature):
    """(callable, owner, input spec (shape, dtype), keras model or None)."""
    import keras
    import tensorflow as tf

    if model_kind(path) == "keras":
        model = keras.saving.load_model(path, compile=False)
        if len(model.inputs) != 1:
            raise ValueError("--end-to-end needs a single-input model")
        t = model.inputs[0]
        return (_keras_fn(model), model,
                (tuple(t.shape), tf.as_dtype(t.dtype)), model)
    fn, owner, spec = _saved_model_fn(path, signature)
    return fn, owner, (tuple(spec.shape.as_list()), spec.dtype), None


def end_to_end_latency(path, inputs=None, batch_size=128, input_sparsity=0.5,
                       rounds=30, warmup=3, seed=0, signature=None,
                       sparse_model=None, threshold=-1.0):
    """Whole-model latency of the variants described in the module docstring.

    Args:
      path: ``.keras`` file or SavedModel directory (single input).
      inputs: numpy array for the model input, or None for random
        ``relu(normal)`` inputs with ``input_sparsity`` zeros and unknown
        dimensions set to ``batch_size``.
      batch_size, input_sparsity, seed: of random inputs.
      rounds: timed rounds (each runs every variant once), >= 1.
      warmup: untimed calls per variant first (>= 1: the first call
        instantiates the graph, which is when the rewrite pass acts).
      signature: SavedModel signature key.
      sparse_model: optional ``.keras`` file of the model with sparse-split
        layers (same input).
      threshold: threshold of the rewrite pass and of converted layers.

    Returns:
      dict with ``"input_shape"``, ``"rewritten"`` ({op type: nodes the pass
      replaced}), ``"notes"`` (list of str) and ``"variants"``: list of dicts
      ``{"name", "p50_ms", "p90_ms", "ratio", "max_abs_diff", "times_ms"}``.

    Raises:
      FileNotFoundError: missing model.
      ValueError: unusable model or input, ``rounds < 1``, ``warmup < 1``.
    """
    import tensorflow as tf

    from tf_sparse_split import rewrite
    from tf_sparse_split.utils.validation import validate_int

    rounds = validate_int(rounds, "rounds", 1)
    warmup = validate_int(warmup, "warmup", 1)
    notes = []
    plain_fn, plain_owner, (shape, dtype), keras_model = _load(path, signature)
    if inputs is None:
        inputs = random_input(shape, dtype, batch_size, input_sparsity,
                              np.random.default_rng(seed))
    inputs = np.asarray(inputs)
    if len(inputs.shape) != len(shape) or any(
            d is not None and d != s for d, s in zip(shape, inputs.shape)):
        raise ValueError(f"input of shape {inputs.shape} does not fit the "
                         f"model input of shape {list(shape)}")
    x = tf.constant(inputs.astype(dtype.as_numpy_dtype))
    variants = []
    previous = rewrite.config()
    rewrite.disable()
    try:
        reference = _first_output(plain_fn(x)).numpy()  # instantiated: plain
    finally:
        restore_rewrite(previous)
    variants.append(["plain", plain_fn])
    # The rewrite pass acts when a function is first instantiated: a fresh
    # copy of the model, first called with the pass on.
    rw_fn, rw_owner, _, _ = _load(path, signature)
    # The plain variant's graph was instantiated with the pass off on
    # purpose: it is ours, not the user's, so no "instantiated while the
    # pass was off" warning for it.
    rewrite._take_missed()
    before = rewrite.counters()
    with rewrite.enabled(threshold="auto" if threshold < 0 else threshold,
                         ops=rewrite.active_ops()):
        _first_output(rw_fn(x)).numpy()
    after = rewrite.counters()
    rewritten = {k: after.get(k, 0) - before.get(k, 0) for k in after
                 if after.get(k, 0) - before.get(k, 0) > 0}
    if not rewritten:
        notes.append("the rewrite pass replaced no node (no ReLU/dropout-fed "
                     "MatMul/Conv2D it can handle)")
    variants.append(["rewrite", rw_fn])
    owners = [plain_owner, rw_owner]
    if sparse_model is not None:
        fn, owner, _, _ = _load(sparse_model, None)
        owners.append(owner)
        variants.append(["sparse-split", fn])
    elif keras_model is not None:
        from tf_sparse_split.layers import SparseSplitLayer

        has_split = any(isinstance(l, SparseSplitLayer) for l in
                        keras_model._flatten_layers(include_self=False))
        if has_split:
            notes.append("the model already has sparse-split layers: "
                         "'plain' is the model as given")
        else:
            try:
                converted, names = convert_to_sparse_split(keras_model,
                                                           threshold)
            except ValueError as e:
                notes.append(str(e))
            else:
                if names:
                    owners.append(converted)
                    variants.append(["sparse-split", _keras_fn(converted)])
                    notes.append("sparse-split: converted layers " +
                                 ", ".join(names))
                else:
                    notes.append("no Dense/Conv2D layer to convert")
    else:
        notes.append("SavedModel: give --sparse-model to time a sparse-split "
                     "version")
    results = {}
    for name, fn in variants:
        for _ in range(warmup):
            y = _first_output(fn(x)).numpy()
        diff = float(np.max(np.abs(y.astype(np.float64) - reference))) \
            if y.shape == reference.shape else float("nan")
        results[name] = {"name": name, "times_ms": [], "max_abs_diff": diff}
    for r in range(rounds):
        shift = r % len(variants)
        for name, fn in variants[shift:] + variants[:shift]:
            t0 = time.perf_counter()
            _first_output(fn(x)).numpy()
            results[name]["times_ms"].append((time.perf_counter() - t0) * 1e3)
    out = []
    base_p50 = float(np.percentile(results["plain"]["times_ms"], 50))
    for name, _ in variants:
        res = results[name]
        t = np.asarray(res["times_ms"])
        res["p50_ms"] = float(np.percentile(t, 50))
        res["p90_ms"] = float(np.percentile(t, 90))
        res["ratio"] = base_p50 / res["p50_ms"] if res["p50_ms"] > 0 else \
            float("nan")
        out.append(res)
    del owners
    return {"input_shape": tuple(x.shape), "rewritten": rewritten,
            "notes": notes, "variants": out, "rounds": rounds}


def format_latency(path, result, input_desc, out):
    """Prints the table of :func:`end_to_end_latency` to the file ``out``."""
    print(f"model: {path}", file=out)
    print(f"input: {list(result['input_shape'])} ({input_desc}); "
          f"{result['rounds']} interleaved rounds after warm-up", file=out)
    rw = result["rewritten"]
    print("rewrite pass replaced: " + (", ".join(
        f"{k} x{v}" for k, v in sorted(rw.items())) or "nothing"), file=out)
    print(f"{'variant':<14}{'p50 ms':>10}{'p90 ms':>10}{'plain/variant':>15}"
          f"{'max |diff|':>12}", file=out)
    for v in result["variants"]:
        print(f"{v['name']:<14}{v['p50_ms']:>10.3f}{v['p90_ms']:>10.3f}"
              f"{v['ratio']:>14.2f}x{v['max_abs_diff']:>12.2e}", file=out)
    for note in result["notes"]:
        print(f"note: {note}", file=out)
    print("ratio = plain p50 / variant p50 (> 1: faster). On GPU machines "
          "compile Keras models with jit_compile=False for the rewrite pass "
          "to apply.", file=out)


def latency_command(args, out):
    """``tf-sparse-split profile MODEL --end-to-end`` on parsed arguments
    (``model``, ``input``, ``batch_size``, ``input_sparsity``, ``threshold``,
    ``repeats`` (timed rounds), ``signature``, ``seed``, ``sparse_model``);
    prints the table and returns 0.

    Raises:
      FileNotFoundError, ValueError: see :func:`end_to_end_latency`.
      ImportError: the op library cannot be loaded.
    """
    from tf_sparse_split._loader import load_library

    load_library()
    inputs, input_desc = input_from_args(args)
    result = end_to_end_latency(
        args.model, inputs=inputs, batch_size=args.batch_size,
        input_sparsity=args.input_sparsity, rounds=args.repeats,
        seed=args.seed, signature=args.signature,
        sparse_model=getattr(args, "sparse_model", None),
        threshold=args.threshold)
    format_latency(args.model, result, input_desc, out)
    return 0
