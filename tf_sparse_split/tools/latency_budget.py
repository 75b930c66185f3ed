"""Inference within a latency budget: :func:`fit_latency_budget` and
``tf-sparse-split profile MODEL --latency-budget MS``.

A trained model's FATReLU cutoffs (M. Kurtz et al., ICML 2020) trade
accuracy for speed at inference: a higher cutoff zeroes more activations,
which the sparse-split layers after them skip. Meeting a user's latency
demand by choosing how much sparsity to execute with is R. Sun and L.
Zhang's dynamic sparse execution (2019) applied to inference.

The search: every ReLU-family activation feeding a sparse-split layer is
found (and a ``"relu"`` converted in place to a
:class:`~tf_sparse_split.layers.FATReLU`, cutoff 0: the same function), as
:class:`~tf_sparse_split.callbacks.SparsityTargetCallback` finds them. For
a ladder of target sparsities ``s`` the cutoff of each activation is set to
the ``s``-quantile of its output on the sample (computed with the cutoffs
the model came with; a layer already sparser keeps its cutoff), the model's
p50 latency on the sample is measured (whole-model calls of a
``tf.function`` of the point's own, whose sparse-split ops then see one
sparsity, as a model served at one setting does; the cutoffs are
variables; the calls alternate with calls of another function at the
model's original cutoffs so that both see the same load, and the ratio is
reported too; a few untimed calls precede each timed one), and with
``accuracy_data`` the
accuracy. The model is left at the least sparse point whose p50 meets the
budget, or, when none does, at its fastest point (``reachable`` False).
Each point is judged by its interleaved ratio to the original cutoffs,
scaled to the original cutoffs' median p50 over the whole search, not by
its own p50: on a shared machine the load moves between points, and the
ratio is what both arms of a point measured under the same load.
"""

import math
import time

import numpy as np

from tf_sparse_split.utils.tracing import function_per_instance

__all__ = ["fit_latency_budget", "format_latency_budget",
           "latency_budget_command", "DEFAULT_LEVELS"]

#: Target sparsities tried (those above the model's own are used).
DEFAULT_LEVELS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)


def _controls(model):
    from tf_sparse_split.callbacks._discovery import (fatrelu_for,
                                                      find_activation_producer)
    from tf_sparse_split.callbacks.split_threshold import find_split_layers

    out, seen = [], set()
    for layer in find_split_layers(model):
        owner, kind = find_activation_producer(layer)
        if owner is None or id(owner) in seen:
            continue
        seen.add(id(owner))
        fat, _ = fatrelu_for(owner, kind)
        out.append((layer, owner, fat))
    return out


#: Most untimed calls after a switch of the cutoffs.
MAX_SETTLE_CALLS = 100


def _accuracy(pred, y):
    pred = np.asarray(pred)
    y = np.asarray(y).reshape(-1)
    if pred.ndim >= 2 and pred.shape[-1] > 1:
        hit = np.argmax(pred.reshape(len(y), -1), axis=1) == y
    else:
        hit = (pred.reshape(-1) > 0.5).astype(y.dtype) == y
    return float(np.mean(hit))


def fit_latency_budget(model, seconds, sample, accuracy_data=None,
                       levels=DEFAULT_LEVELS, rounds=15, warmup=3,
                       out=None, clock=time.perf_counter, settle_calls=3):
    """Raises the FATReLU cutoffs of a trained model until its p50 latency
    on ``sample`` is at most ``seconds`` (module docstring).

    Args:
      model: a built Keras model (Sequential or functional) with
        sparse-split layers fed by ReLU-family activations (convert a plain
        model first with :func:`tf_sparse_split.sparse_split_model`).
      seconds: the latency budget of one call on ``sample``, seconds
        (finite, > 0).
      sample: one input batch (numpy or tensor) for the timing and the
        quantiles.
      accuracy_data: optional ``(x, y)`` with integer labels ``y``; each
        point's accuracy is measured on it (argmax of the output; a single
        output is thresholded at 0.5).
      levels: target sparsities to try, in ``(0, 1)`` (sorted, repeats
        dropped).
      rounds: timed calls per point (>= 1; each alternates with a call at
        the original cutoffs).
      warmup: untimed calls per point (>= 1).
      out: a file to print the table to, or None.
      clock: a function returning seconds.
      settle_calls: untimed calls of each arm after each switch between
        the point's and the original cutoffs, before its timed call (0 to
        ``MAX_SETTLE_CALLS`` = 100; default 3). Each arm is a
        ``tf.function`` of its own (a new one per point), so its
        sparse-split op instances keep one sparsity: an op follows a
        change of its input's sparsity only within 1-16 calls (its
        decision memory and the back-off of its analysis are per op
        instance), and one function alternating between the settings
        timed each with decisions made for the other (on a converted MLP
        784-2048-2048-10 at batch 32, a product whose input went from 62%
        to 99% zeros ran at TF's dense speed for 0-4 calls, then 2x
        faster).

    Returns:
      dict: ``points`` (list of dicts ``sparsity`` (target; the first point
      is the model as given, ``target`` None), ``measured_sparsity`` (mean
      fraction of zeros of the activations on the sample), ``p50_ms``,
      ``p90_ms``, ``ratio`` (original p50 / this p50, interleaved),
      ``est_p50_ms`` (the original cutoffs' median p50 over the whole
      search divided by ``ratio``: the point's p50 at the search's typical
      load; the budget is checked on it and the fastest point is the one
      with the least),
      ``accuracy`` (NaN without data), ``cutoffs`` ({activation: cutoff})),
      ``chosen`` (index into ``points``), ``reachable``, ``budget_ms``.

    Raises:
      ValueError: a bad budget, level, rounds, warm-up, settle_calls
        (more than ``MAX_SETTLE_CALLS``), clock or out; a missing or empty
        sample, one holding NaN/Inf or not of the model's input shape;
        ``accuracy_data`` not a pair of as many ``x`` (finite, of the
        input's shape) as integer labels ``y`` within the model's classes;
        or no activation to control.
    """
    import keras
    import tensorflow as tf

    from tf_sparse_split.callbacks._discovery import no_control_message
    from tf_sparse_split.tools._model_io import stop_recording_stats
    from tf_sparse_split.tuning.budget import _finite_positive
    from tf_sparse_split.utils.validation import (check_fits_model_input,
                                                  check_labels_in_classes,
                                                  model_classes, validate_int)

    budget = _finite_positive(seconds, "seconds")
    rounds = validate_int(rounds, "rounds", 1)
    warmup = validate_int(warmup, "warmup", 1)
    settle_calls = validate_int(settle_calls, "settle_calls", 0)
    if settle_calls > MAX_SETTLE_CALLS:
        raise ValueError(f"`settle_calls` must be at most {MAX_SETTLE_CALLS}"
                         f". Received: settle_calls={settle_calls}")
    if not callable(clock):
        raise ValueError(f"`clock` must be a function returning seconds. "
                         f"Received: clock={clock!r}")
    if out is not None and not callable(getattr(out, "write", None)):
        raise ValueError(f"`out` must be a file (with a write method) or "
                         f"None. Received: out={out!r}")
    try:
        if isinstance(levels, (str, bytes)):
            raise TypeError
        levels = sorted({float(v) for v in levels})
    except (TypeError, ValueError):
        raise ValueError("levels must be a sequence of fractions in (0, 1), "
                         f"got {levels!r}") from None
    if not levels or any(not (0.0 < v < 1.0) for v in levels):
        raise ValueError(f"levels must be fractions in (0, 1), got {levels}")
    if sample is None:
        raise ValueError("fit_latency_budget needs a `sample` batch (got "
                         "None)")
    x = tf.convert_to_tensor(sample)
    if x.shape.rank is None or x.shape.rank == 0 or int(tf.size(x)) == 0:
        raise ValueError("fit_latency_budget needs a non-empty sample batch")
    check_fits_model_input(model, x.shape, "fit_latency_budget: `sample`")
    # The cutoffs are quantiles of the activations on the sample: a NaN
    # there would make every cutoff NaN (a FATReLU that zeroes everything).
    if x.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(x))):
        raise ValueError("fit_latency_budget: `sample` holds NaN or Inf "
                         "values; the cutoffs are quantiles of the "
                         "activations on it")
    if accuracy_data is not None:   # checked before any cutoff moves
        try:
            ax, ay = accuracy_data
        except (TypeError, ValueError):
            raise ValueError("`accuracy_data` must be a pair (x, y)") from None
        nx, ny = np.shape(ax)[:1], np.shape(ay)[:1]
        if not nx or not ny or nx != ny or nx[0] == 0:
            raise ValueError(
                "`accuracy_data` (x, y) must hold the same non-zero number "
                f"of examples; got x of shape {np.shape(ax)} and y of shape "
                f"{np.shape(ay)}")
        y_arr = np.asarray(ay)
        if y_arr.size != nx[0] or not (
                np.issubdtype(y_arr.dtype, np.integer) or
                np.issubdtype(y_arr.dtype, np.bool_)):
            raise ValueError(
                "`accuracy_data` labels y must be one integer class per "
                f"example ([n] or [n, 1]); got shape {y_arr.shape}, dtype "
                f"{y_arr.dtype}")
        check_fits_model_input(model, np.shape(ax),
                               "fit_latency_budget: `accuracy_data` x")
        ax_arr = np.asarray(ax)
        if np.issubdtype(ax_arr.dtype, np.floating) and \
                not np.all(np.isfinite(ax_arr)):
            raise ValueError("`accuracy_data` x holds NaN or Inf values")
        # A single output is thresholded at 0.5 (_accuracy): classes 0, 1.
        check_labels_in_classes(y_arr, model_classes(model) or 2,
                                "`accuracy_data` labels y")
    controls = _controls(model)
    if not controls:
        raise ValueError(no_control_message("fit_latency_budget", model))
    stop_recording_stats(model)
    fats = [fat for _, _, fat in controls]
    names = [owner.name for _, owner, _ in controls]
    original = [fat.cutoff for fat in fats]
    fwd = function_per_instance(lambda t: model(t, training=False))
    feats = keras.Model(model.inputs, [o.output for _, o, _ in controls])
    act = function_per_instance(lambda t: feats(t, training=False))

    def activations():
        ys = act(x)
        ys = ys if isinstance(ys, (list, tuple)) else [ys]
        return [np.asarray(a, np.float64).reshape(-1) for a in ys]

    def set_cutoffs(values):
        for fat, v in zip(fats, values):
            fat.cutoff_var.assign(float(v))

    def measure(values):
        # The point's calls go through a function of their own: its
        # sparse-split op instances (their decision memory, the back-off
        # of their analysis) see only this point's sparsity, and ``fwd``'s
        # only the original cutoffs', as a model served at one setting.
        # Through one function, an op whose all-dense back-off samples its
        # zeros only every 16 calls kept the other setting's plan: at
        # batch 32, 92% zeros timed 0.93x the original cutoffs.
        fwd_point = function_per_instance(
            lambda t: model(t, training=False))
        set_cutoffs(values)
        for _ in range(warmup):
            fwd_point(x).numpy()
        mine, base = [], []
        for r in range(rounds):
            order = ((values, mine, fwd_point), (original, base, fwd))
            for vals, into, f in (order if r % 2 == 0 else order[::-1]):
                set_cutoffs(vals)
                for _ in range(settle_calls):
                    f(x).numpy()
                t0 = clock()
                f(x).numpy()
                into.append(clock() - t0)
        set_cutoffs(values)
        acts = activations()
        acc = math.nan
        if accuracy_data is not None:
            ax, ay = accuracy_data
            acc = _accuracy(fwd_point(tf.convert_to_tensor(ax)).numpy(),
                            ay)
        p50 = float(np.percentile(mine, 50))
        return {"p50_ms": p50 * 1e3,
                "p90_ms": float(np.percentile(mine, 90)) * 1e3,
                "ratio": float(np.percentile(base, 50)) / p50 if p50 > 0
                else math.nan,
                "accuracy": acc,
                "measured_sparsity": float(np.mean(
                    [np.mean(a == 0.0) for a in acts])),
                "cutoffs": dict(zip(names, map(float, values)))}

    base_acts = activations()
    zeros = [float(np.mean(a == 0.0)) for a in base_acts]
    points = [dict(sparsity=None, **measure(original))]
    for s in levels:
        if s <= min(zeros) + 1e-6:
            continue
        values = [max(float(np.quantile(a, s)), c) if s > z else c
                  for a, z, c in zip(base_acts, zeros, original)]
        points.append(dict(sparsity=s, **measure(values)))
    # Each point's p50 as it would be at the load of the whole search: the
    # median p50 of the original cutoffs over all points divided by the
    # point's interleaved ratio (its own p50 was taken at whatever load its
    # rounds met; the ratio is the figure both arms shared).
    base_ms = float(np.median([p["p50_ms"] * p["ratio"] for p in points
                               if math.isfinite(p["ratio"])] or [math.nan]))
    for p in points:
        p["est_p50_ms"] = (base_ms / p["ratio"] if math.isfinite(base_ms)
                           and p["ratio"] > 0 else p["p50_ms"])
    meeting = [i for i, p in enumerate(points)
               if p["est_p50_ms"] <= budget * 1e3]
    reachable = bool(meeting)
    chosen = meeting[0] if meeting else int(np.argmin(
        [p["est_p50_ms"] for p in points]))
    set_cutoffs(list(points[chosen]["cutoffs"].values()))
    result = {"points": points, "chosen": chosen, "reachable": reachable,
              "budget_ms": budget * 1e3, "activations": names}
    if out is not None:
        format_latency_budget(result, out)
    return result


def format_latency_budget(result, out):
    """Prints the points of :func:`fit_latency_budget` as a table."""
    print(f"latency budget {result['budget_ms']:.3f} ms (p50); "
          f"activations: {', '.join(result['activations'])}", file=out)
    print(f"{'target':>8}{'zeros':>8}{'p50 ms':>10}{'p90 ms':>10}"
          f"{'orig/this':>11}{'est. p50':>10}{'accuracy':>10}", file=out)
    for i, p in enumerate(result["points"]):
        t = "model" if p["sparsity"] is None else f"{p['sparsity']:.2f}"
        mark = "  <- chosen" if i == result["chosen"] else ""
        # No accuracy without labels: "-", not nan.
        acc = (f"{p['accuracy']:>10.4f}" if math.isfinite(p["accuracy"])
               else f"{'-':>10}")
        print(f"{t:>8}{p['measured_sparsity']:>8.3f}{p['p50_ms']:>10.3f}"
              f"{p['p90_ms']:>10.3f}{p['ratio']:>10.2f}x"
              f"{p['est_p50_ms']:>10.3f}{acc}{mark}",
              file=out)
    if not result["reachable"]:
        pts = result["points"]
        ch = pts[result["chosen"]]
        acc = ""
        if math.isfinite(ch["accuracy"]) and math.isfinite(
                pts[0]["accuracy"]):
            acc = (f" (accuracy {ch['accuracy']:.4f}, against "
                   f"{pts[0]['accuracy']:.4f} as given)")
        print("warning: the budget is not reachable with these cutoffs: the "
              f"model is left at its fastest point{acc}", file=out)
    print("orig/this = p50 at the model's own cutoffs / p50 here, "
          "interleaved calls (> 1: faster); est. p50 = the own cutoffs' "
          "median p50 over the search / orig/this (the budget is checked "
          "on it)", file=out, flush=True)


def latency_budget_command(args, out):
    """``tf-sparse-split profile MODEL --latency-budget MS`` on parsed
    arguments (``model`` a ``.keras`` file, ``latency_budget`` in ms,
    ``input``/``labels``/``batch_size``/``input_sparsity``/``seed``,
    ``repeats`` (timed rounds), ``curve``, ``output``); returns 0.

    Raises:
      FileNotFoundError, ValueError: a missing or unusable model or input.
      ImportError: the op library cannot be loaded.
    """
    import os

    import keras

    from tf_sparse_split._loader import load_library
    from tf_sparse_split.tools._model_io import (input_from_args, model_kind,
                                                 random_input)
    from tf_sparse_split.tools.latency import convert_to_sparse_split
    from tf_sparse_split.tools.plots import check_plot_path

    # Output paths first: a search is never lost to a bad path at its end.
    if getattr(args, "curve", None):
        check_plot_path(args.curve, flag="--curve")
    if getattr(args, "output", None):
        check_plot_path(args.output, flag="--output", suffix=".keras",
                        what="a .keras model")
    load_library()
    if model_kind(args.model) != "keras":
        raise ValueError("--latency-budget needs a .keras model (its "
                         "activations are changed in place)")
    model = keras.saving.load_model(args.model)
    from tf_sparse_split.callbacks.split_threshold import find_split_layers
    if not find_split_layers(model):
        model, converted = convert_to_sparse_split(model, args.threshold)
        print("converted to sparse-split layers: " +
              (", ".join(converted) or "none"), file=out)
    x, desc = input_from_args(args)
    if x is None:
        import tensorflow as tf

        shape = model.inputs[0].shape
        x = random_input(shape, tf.as_dtype(model.inputs[0].dtype),
                         args.batch_size, args.input_sparsity,
                         np.random.default_rng(args.seed))
    data = None
    if getattr(args, "labels", None) is not None:
        if not os.path.isfile(args.labels):
            raise FileNotFoundError(f"no such labels file: {args.labels}")
        y = np.load(args.labels)
        if len(y) != len(x):
            raise ValueError(f"--labels has {len(y)} entries for {len(x)} "
                             "inputs")
        data = (x, y)
    print(f"model: {args.model}; input {list(np.shape(x))} ({desc})",
          file=out)
    result = fit_latency_budget(model, args.latency_budget / 1e3, x,
                                accuracy_data=data, rounds=args.repeats,
                                out=out)
    if getattr(args, "curve", None):
        from tf_sparse_split.tools.plots import plot_latency_curve

        plot_latency_curve(result["points"], args.curve,
                           budget_ms=result["budget_ms"],
                           chosen=result["chosen"])
        print(f"curve: {args.curve}", file=out)
    if getattr(args, "output", None):
        model.save(args.output)
        print(f"saved with the chosen cutoffs: {args.output}", file=out)
    return 0
