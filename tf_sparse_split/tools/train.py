"""The ``tf-sparse-split train`` command: trains a model built by
:mod:`tf_sparse_split.tools.models` on the digits or MNIST
(:mod:`tf_sparse_split.tools.datasets`), with the
:class:`~tf_sparse_split.callbacks.SplitThresholdCallback` for sparse-split
models, and prints per-epoch lines, the test accuracy and, with
``--compare``, a side-by-side summary against plain Keras layers.

:func:`run` trains one model from parsed arguments (the benchmarks call it
too); :func:`train_command` is the whole command.
"""

import time

from tf_sparse_split.tools.distribute import (make_strategy,
                                              run_multi_worker, strategy_scope)
from tf_sparse_split.tools.models import build_cnn, build_mlp

__all__ = ["run", "build_model", "train_command", "print_compare", "epoch_printer",
           "steady_epoch_time", "input_sparsity", "describe_split",
           "step_speedup", "train_step_times", "make_budget_callback",
           "budget_pacing",
           "budget_summary"]


def describe_split(sparsity, threshold, rows_sparse=None):
    """One layer's epoch line in words: what its input looked like and which
    path it takes next epoch (the threshold the callback chose), or, for an
    automatic layer, which path its rows took over the epoch.

    Args:
      sparsity: fraction of zeros of the layer's input over the epoch.
      threshold: the split threshold for the next epoch: negative =
        automatic (the op decides per call), 0 = every nonzero row on the
        dense GEMM, 1 = every row on the CSR kernel, in between = rows
        denser than it go dense.
      rows_sparse: for an automatic layer, the fraction of its rows (over
        the epoch's calls) the op sent to the sparse kernel, in ``[0, 1]``;
        None: unknown.

    Returns:
      e.g. ``"dense: 31% zeros, below break-even"``, ``"sparse: 92% zeros,
      every row on the CSR kernel"``, ``"split: 85% zeros, rows denser than
      0.120 dense, the rest CSR"``, ``"auto: 60% zeros, the op decides per
      call"``; automatic with ``rows_sparse``: ``"dense: 24% zeros, below
      break-even: every row on the dense GEMM (the op decides per call)"``,
      ``"split: 60% zeros, 45% of rows on the CSR kernel, the rest dense
      (the op decides per call)"``.
    """
    zeros = f"{100.0 * sparsity:.0f}% zeros"
    if threshold < 0:
        if rows_sparse is None or not 0.0 <= rows_sparse <= 1.0:
            return f"auto: {zeros}, the op decides per call"
        if rows_sparse <= 0.0:
            return (f"dense: {zeros}, below break-even: every row on the "
                    "dense GEMM (the op decides per call)")
        if rows_sparse >= 1.0:
            return (f"sparse: {zeros}, every row on the CSR kernel (the op "
                    "decides per call)")
        return (f"split: {zeros}, {100.0 * rows_sparse:.0f}% of rows on the "
                "CSR kernel, the rest dense (the op decides per call)")
    if threshold <= 0.0:
        return f"dense: {zeros}, below break-even"
    if threshold >= 1.0:
        return f"sparse: {zeros}, every row on the CSR kernel"
    return (f"split: {zeros}, rows denser than {threshold:.3f} dense, the "
            "rest CSR")


def epoch_printer(epochs, layer_names, out, auto_layers=()):
    """The per-epoch lines of ``train``: a Keras callback printing each
    epoch's time, loss and accuracy to ``out`` (nothing when None), the
    budget line, and a line per layer of ``layer_names``
    (:func:`describe_split`; for the names in ``auto_layers``, automatic
    layers, the rows the op sent to each path, from
    ``logs["<layer>/rows_sparse"]``). Its ``times`` are the epochs'
    seconds."""
    import keras

    class EpochPrinter(keras.callbacks.Callback):
        """Prints one summary line per epoch plus one per layer."""

        def __init__(self):
            super().__init__()
            self.times = []
            self._start = None

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            elapsed = time.perf_counter() - self._start
            self.times.append(elapsed)
            logs = logs or {}
            if out is None:
                return
            print(f"epoch {epoch + 1}/{epochs}: time {elapsed:.2f} s, "
                  f"loss {logs.get('loss', float('nan')):.4f}, "
                  f"accuracy {logs.get('accuracy', float('nan')):.4f}",
                  file=out, flush=True)
            if "budget/step_time" in logs:
                left = logs["budget/step_budget"]
                print(f"  budget: median step "
                      f"{logs['budget/step_time'] * 1e3:.2f} ms, " +
                      (f"budget {left * 1e3:.2f} ms" if left > 0 else
                       "the time budget is spent") +
                      ("" if logs.get("budget/reachable", 1.0) else
                       " (not reachable within the bounds)"), file=out,
                      flush=True)
            for name in layer_names:
                sp = logs.get(f"{name}/sparsity")
                th = logs.get(f"{name}/threshold")
                if sp is None or th is None:
                    continue
                rows_sparse = None
                if name in auto_layers:
                    th, rows_sparse = -1.0, logs.get(f"{name}/rows_sparse")
                fat = logs.get(f"{name}/fat_cutoff")
                fat_text = ("" if fat is None else
                            f"; FATReLU cutoff {fat:.4f}, L1 activity "
                            f"penalty {logs.get(f'{name}/l1', 0.0):.3g} x "
                            "mean |activation|")
                print(f"  {name}: {describe_split(sp, th, rows_sparse)}"
                      f"{fat_text}",
                      file=out, flush=True)

    return EpochPrinter()


def build_model(args, sparse, x_train, x_test, num_classes):
    """The model of ``train`` for parsed arguments (``--model``, ``--hidden``,
    ``--filters``, ``--threshold``, ``--dropout`` ...), uncompiled.

    ``args.keep_plain`` (the CLI sets it to
    :data:`~tf_sparse_split.tools.models.PLAIN_WHERE_NO_GAIN` unless
    ``--split-all-layers``; default when absent: none) names the layers that
    stay plain Keras layers in the sparse-split model.

    Returns:
      ``(model, x_train, x_test, description)``; images are reshaped to
      ``side x side x 1`` for ``--model cnn``.

    Raises:
      ValueError: options that do not fit the model or data.
    """
    keep_plain = tuple(getattr(args, "keep_plain", None) or ())
    if getattr(args, "model", "mlp") == "lstm":
        model, desc, x_train, x_test = _lstm_model(
            args, sparse, x_train, x_test, num_classes)
    elif getattr(args, "model", "mlp") == "cnn":
        if args.dropout != "none":
            raise ValueError("--dropout applies to --model mlp and --model lstm")
        side = int(round(x_train.shape[1] ** 0.5))
        if side * side != x_train.shape[1]:
            raise ValueError(f"--model cnn needs square images, got "
                             f"{x_train.shape[1]} pixels")
        x_train = x_train.reshape(-1, side, side, 1)
        x_test = x_test.reshape(-1, side, side, 1)
        model = build_cnn(side, args.filters, num_classes, sparse=sparse,
                          threshold=args.threshold, keep_plain=keep_plain)
        desc = (f"CNN {side}x{side}x1 conv3x3({args.filters[0]})-relu-"
                f"conv3x3({args.filters[1]})-relu-maxpool2-dense"
                f"({num_classes}) "
                f"({'SparseSplitConv2D' if sparse else 'keras.layers.Conv2D'}"
                f"{_plain_note(model) if sparse else ''})")
    else:
        model = build_mlp(x_train.shape[1], args.hidden, num_classes,
                          sparse=sparse, threshold=args.threshold,
                          dropout=args.dropout,
                          dropout_rate=args.dropout_rate, seed=args.seed,
                          tile_shape=args.tile_shape,
                          pattern_groups=getattr(args, "pattern_groups", None),
                          keep_plain=keep_plain)
        sizes = "-".join(str(s) for s in
                         [x_train.shape[1], *args.hidden, num_classes])
        desc = (f"MLP {sizes} "
                f"({'SparseSplitDense' if sparse else 'keras.layers.Dense'}"
                f"{_plain_note(model) if sparse else ''})")
    return model, x_train, x_test, desc


def _plain_note(model):
    """``"; plain Keras: hidden_1 (on the model input), output (10 units)"``
    for the plain Dense/Conv2D layers of a sparse-split model, else ``""``."""
    import keras

    from tf_sparse_split.layers import SparseSplitLayer

    layers = [l for l in model.layers
              if isinstance(l, (keras.layers.Dense, keras.layers.Conv2D,
                                SparseSplitLayer))]
    notes = []
    for i, l in enumerate(layers):
        if isinstance(l, SparseSplitLayer):
            continue
        if i == 0:
            notes.append(f"{l.name} (on the model input)")
        elif i == len(layers) - 1 and isinstance(l, keras.layers.Dense):
            notes.append(f"{l.name} ({l.units} units)")
        else:
            notes.append(l.name)
    if not notes:
        return ""
    return ("; plain Keras where a sparse-split layer cannot win: "
            + ", ".join(notes))


def run(args, sparse, x_train, y_train, x_test, y_test, num_classes, out):
    """Trains one model; returns a dict of results (``"model"``: the
    trained, compiled Keras model, ``"x_train"``: its training inputs as it
    takes them)."""
    import keras

    from tf_sparse_split.callbacks import SplitThresholdCallback
    from tf_sparse_split.layers import SparseSplitLayer

    keras.utils.set_random_seed(args.seed)
    kind = "sparse-split" if sparse else "baseline"
    strategy = getattr(args, "distribute_strategy", None)
    with strategy_scope(strategy):
        model, x_train, x_test, desc = build_model(args, sparse, x_train,
                                                   x_test, num_classes)
        model.compile(optimizer=keras.optimizers.Adam(args.lr),
                      loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=False)
    if out is not None:
        print(f"model: {kind} {desc}", file=out, flush=True)
        if args.dropout != "none" and getattr(args, "model", "mlp") != "lstm":
            what = {"standard": "keras.layers.Dropout",
                    "row": "ApproximateRandomDropout row patterns",
                    "tile": "ApproximateRandomDropout tile patterns "
                            f"{args.tile_shape or (32, 32)}"}[args.dropout]
            print(f"dropout: {what}, rate {args.dropout_rate}, after every "
                  "hidden layer", file=out, flush=True)
    layer_names = [l.name for l in model.layers
                   if isinstance(l, SparseSplitLayer)] if sparse else []
    auto_layers = {l.name for l in model.layers
                   if isinstance(l, SparseSplitLayer) and l.threshold < 0} \
        if sparse else set()
    printer = epoch_printer(args.epochs, layer_names,
                            None if args.quiet else out, auto_layers)
    callbacks = []
    split_cb = None
    target = getattr(args, "target_sparsity", None)
    if sparse and target is not None:
        from tf_sparse_split.callbacks import SparsityTargetCallback

        callbacks.append(SparsityTargetCallback(target))
    budget_cb = make_budget_callback(args, x_train, y_train, out) \
        if sparse else None
    if budget_cb is not None:
        callbacks.append(budget_cb)
    if sparse:
        split_cb = SplitThresholdCallback(
            log_dir=getattr(args, "tensorboard", None))
        callbacks.append(split_cb)
    if getattr(args, "checkpoint_dir", None):
        import os

        os.makedirs(args.checkpoint_dir, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(args.checkpoint_dir, "model.keras")))
    # The progress bar rewrites its line with control characters: only on a
    # terminal (plain per-epoch lines otherwise, e.g. into a log file).
    progress_bar = (not args.quiet and out is not None
                    and getattr(out, "isatty", lambda: False)())
    if progress_bar:
        # Our printer must run after the progress bar finishes its line.
        callbacks.append(keras.callbacks.ProgbarLogger())
    callbacks.append(printer)
    history = model.fit(
        x_train, y_train, epochs=args.epochs, batch_size=args.batch_size,
        shuffle=True, callbacks=callbacks, verbose=1 if progress_bar else 0)
    test_loss, test_acc = model.evaluate(x_test, y_test,
                                         batch_size=args.batch_size,
                                         verbose=0)
    result = {
        "kind": kind,
        "dropout": args.dropout,
        "dropout_rate": args.dropout_rate,
        "epoch_times": list(printer.times),
        # Steady state: epochs after the first (which also traces and
        # calibrates); the first epoch's time when there is only one.
        "time_per_epoch": _steady(printer.times),
        "steady_state": len(printer.times) > 1,
        "loss": float(history.history["loss"][-1]),
        "accuracy": float(history.history["accuracy"][-1]),
        "test_loss": float(test_loss),
        "test_accuracy": float(test_acc),
        "thresholds": ({l.name: l.threshold for l in model.layers
                        if isinstance(l, SparseSplitLayer)} if sparse else {}),
        "tuning_history": list(split_cb.history) if split_cb else [],
        "steady_time_per_epoch": steady_epoch_time(printer.times),
        "input_sparsity": input_sparsity(model, x_test[:1000]),
        "budget": budget_summary(budget_cb),
        "model": model,
        "x_train": x_train,
    }
    if out is not None:
        print(f"{kind}: test accuracy {result['test_accuracy']:.4f}, test "
              f"loss {result['test_loss']:.4f}, time/epoch "
              f"{result['time_per_epoch']:.2f} s ({_time_label(result)})",
              file=out, flush=True)
    return result


def make_budget_callback(args, x_train, y_train, out):
    """The :class:`~tf_sparse_split.callbacks.TimeBudgetCallback` of
    ``--step-budget MS`` / ``--time-budget SECONDS`` (None without either):
    the first 512 training examples are its held batch for the
    sensitivities; TensorBoard scalars go to ``<--tensorboard>/budget``.
    A short run gets a shorter warm-up and fewer steps per decision
    (:func:`budget_pacing`), so that it is steered within the run."""
    import os

    step_ms = getattr(args, "step_budget", None)
    deadline = getattr(args, "time_budget", None)
    if step_ms is None and deadline is None:
        return None
    from tf_sparse_split.callbacks import TimeBudgetCallback

    tb = getattr(args, "tensorboard", None)
    steps = args.epochs * -(-len(x_train) // (args.batch_size or 32))
    warmup, samples = budget_pacing(steps)
    return TimeBudgetCallback(
        step_time=None if step_ms is None else step_ms / 1e3,
        deadline=deadline, sensitivity_data=(x_train[:512], y_train[:512]),
        log_dir=os.path.join(tb, "budget") if tb else None,
        warmup_steps=warmup, min_samples=samples,
        verbose=0 if (args.quiet or out is None) else 1)


def budget_pacing(total_steps):
    """``(warmup_steps, min_samples)`` of the CLI's
    :class:`~tf_sparse_split.callbacks.TimeBudgetCallback` for a run of
    ``total_steps`` training steps: the callback's defaults (20 and 8) from
    160 steps on, a sixth and a tenth of the run below (at least 2 each).
    With the defaults, the first decision comes after about 31 steps: after
    the last step of the default run on the embedded digits (5 epochs of 6
    steps), which the budget then never steered."""
    total_steps = int(total_steps)
    return (max(2, min(20, total_steps // 6)),
            max(2, min(8, total_steps // 10)))


def budget_summary(cb):
    """What ``train`` keeps of a budget run (None without one): the
    callback's per-step ``trace``, per-epoch ``history`` and its decisions
    (as dicts)."""
    if cb is None:
        return None
    import dataclasses

    return {"kind": cb.kind, "seconds": cb.seconds, "trace": list(cb.trace),
            "history": list(cb.history),
            "decisions": [dataclasses.asdict(d) for d in cb.decisions]}


def _lstm_model(args, sparse, x_train, x_test, num_classes):
    """``--model lstm``: images as sequences of rows."""
    from tf_sparse_split.tools.models import build_lstm

    if getattr(args, "target_sparsity", None) is not None:
        raise ValueError("--target-sparsity applies to --model mlp and cnn")
    side = int(round(x_train.shape[1] ** 0.5))
    if side * side != x_train.shape[1]:
        raise ValueError(f"--model lstm needs square images, got "
                         f"{x_train.shape[1]} pixels")
    rate = args.dropout_rate or 0.0
    rec = args.recurrent_dropout_rate
    rec = rate if rec is None else rec
    model = build_lstm(side, side, args.units, num_classes, sparse=sparse,
                       dropout=args.dropout, dropout_rate=rate,
                       recurrent_dropout_rate=rec, seed=args.seed,
                       tile_shape=args.tile_shape)
    lstm = model.get_layer("lstm")
    what = (f"SparseSplitLSTM pattern={lstm.pattern}" if sparse
            else "keras.layers.LSTM")
    desc = (f"LSTM {side} steps x {side} features -> LSTM({args.units}, "
            f"dropout={lstm.dropout}, recurrent_dropout="
            f"{lstm.recurrent_dropout}) -> dense({num_classes}) ({what})")
    return (model, desc, x_train.reshape(-1, side, side),
            x_test.reshape(-1, side, side))


def steady_epoch_time(times):
    """Median epoch time without the first epoch (tracing, warm-up); the
    only epoch's time if there is one."""
    import numpy as np

    times = list(times)
    if not times:
        return float("nan")
    return float(np.median(times[1:] if len(times) > 1 else times))


def input_sparsity(model, x, batch_size=256):
    """Fraction of zeros of the input of every ``Dense``/``Conv2D`` layer
    (plain or sparse-split) of ``model`` on ``x``, in inference mode:
    ``{layer name: fraction}``. Empty for models without such layers or
    without a symbolic graph."""
    import keras
    import numpy as np

    names = [l.name for l in model.layers
             if isinstance(l, (keras.layers.Dense, keras.layers.Conv2D))]
    if not names:
        return {}
    try:
        inputs = model.inputs
        probe = keras.Model(inputs[0] if len(inputs) == 1 else inputs,
                            [model.get_layer(n).input for n in names])
    except (AttributeError, ValueError):
        return {}
    # Eager calls: ``predict`` would trace a new function for every probe
    # (TF's retracing warning when this runs once per epoch).
    zeros, total = np.zeros(len(names)), np.zeros(len(names))
    for start in range(0, len(x), batch_size):
        outs = probe(x[start:start + batch_size], training=False)
        if len(names) == 1:
            outs = [outs]
        for i, o in enumerate(outs):
            o = np.asarray(o)
            zeros[i] += np.count_nonzero(o == 0)
            total[i] += o.size
    return {n: float(z / t) if t else float("nan")
            for n, z, t in zip(names, zeros, total)}


def _steady(times):
    """The steady-state epoch time the text prints and the plot's legend
    shows (one definition: :func:`tf_sparse_split.tools.plots.steady_mean`)."""
    from tf_sparse_split.tools.plots import steady_mean

    return steady_mean(times)


def _time_label(result):
    n = len(result["epoch_times"])
    if result.get("steady_state"):
        which = "epoch 2" if n == 2 else f"mean of epochs 2-{n}"
        return (f"steady state: {which}; epoch 1, with tracing: "
                f"{result['epoch_times'][0]:.2f} s")
    return "1 epoch, includes tracing; use --epochs 2+ for a steady-state time"


#: ``step_speedup(block=None)``: blocks last at least this long (seconds),
#: so that a scheduler hiccup of a shared machine is a small part of one.
MIN_BLOCK_SECONDS = 0.2
#: ... with at least / at most this many steps per block.
BLOCK_STEPS_RANGE = (8, 64)


def auto_block(step_seconds, min_block_seconds=MIN_BLOCK_SECONDS,
               steps_range=BLOCK_STEPS_RANGE):
    """Steps per timed block for a step of ``step_seconds`` (the faster
    model's): enough for ``min_block_seconds``, within ``steps_range``."""
    import math

    lo, hi = steps_range
    if not step_seconds > 0:
        return lo
    return int(min(hi, max(lo, math.ceil(min_block_seconds / step_seconds))))


def train_step_times(models, x, y, batch_size, rounds=8, block=None, seed=0,
                     clock=None, distinct_batches=8, rng=None):
    """Seconds per training step of compiled Keras models, by interleaved
    blocks of ``train_on_batch`` steps
    (:func:`tf_sparse_split.tools.timing.interleaved_blocks`: round ``r``
    runs a block of ``block`` steps of each model, the order rotating every
    round, cycling through the same ``distinct_batches`` fixed batches of
    ``batch_size`` examples drawn from ``x``/``y``). The models keep
    training (their weights change).

    Args:
      models: dict ``{name: compiled Keras model taking x}``.
      x, y: training inputs and labels (numpy arrays, same first dimension).
      batch_size: examples per step (at most ``len(x)``).
      rounds: int >= 1.
      block: steps per block (int >= 1), or None: :func:`auto_block` of the
        fastest model's warm-up step time.
      seed: seed of the batch choice (when ``rng`` is None).
      clock: function returning seconds (default ``time.perf_counter``).
      distinct_batches: how many fixed batches the steps cycle through.
      rng: a ``numpy.random.Generator`` for the batch choice, or None.

    Returns:
      ``(times, block)``: ``{name: [seconds per step in each round]}`` and
      the steps per block used.
    """
    import numpy as np
    import tensorflow as tf

    from tf_sparse_split.tools import timing

    clock = clock or time.perf_counter
    rng = rng if rng is not None else np.random.default_rng(seed)
    n = min(int(batch_size), len(x))
    batches = [rng.choice(len(x), n, replace=False)
               for _ in range(distinct_batches)]
    xs = [tf.constant(x[b]) for b in batches]
    ys = [tf.constant(y[b]) for b in batches]
    steps = {name: (lambda i, m=m: m.train_on_batch(
        xs[i % len(xs)], ys[i % len(ys)])) for name, m in models.items()}
    # Trace and warm up every step function; the last calls give the step
    # time that sizes the blocks.
    warm = {}
    for name, step in steps.items():
        step(0)
        warm[name] = timing.median_time(lambda: step(1), 3, clock)
    if block is None:
        block = auto_block(min(warm.values()))
    return timing.interleaved_blocks(steps, rounds, block, clock=clock), block


def step_speedup(ours, reference, x, y, batch_size, rounds=8, block=None,
                 seed=0, clock=None, distinct_batches=8):
    """Steady-state training speed of two compiled Keras models:
    :func:`train_step_times` of both (same arguments).

    Returns:
      :func:`tf_sparse_split.tools.timing.speedup_summary`'s dict
      (``"median"`` = median over rounds of ``t_reference / t_ours``), plus
      ``"block"``.
    """
    from tf_sparse_split.tools import timing

    times, block = train_step_times(
        {"ours": ours, "reference": reference}, x, y, batch_size,
        rounds=rounds, block=block, seed=seed, clock=clock,
        distinct_batches=distinct_batches)
    summary = timing.speedup_summary(times, "ours", "reference")
    summary["block"] = block
    return summary


def print_compare(sparse_res, base_res, out, speedup=None):
    """The side-by-side summary of ``train --compare``: final loss and
    accuracy, test accuracy and per-layer input sparsity of both models, then
    the one speed-up line (``speedup``: :func:`step_speedup`'s dict, or
    None)."""
    from tf_sparse_split.tools.timing import format_speedup

    rows = [
        ("final loss", "loss", "{:.4f}"),
        ("final accuracy", "accuracy", "{:.4f}"),
        ("test accuracy", "test_accuracy", "{:.4f}"),
    ]
    print("", file=out)
    w = max([len(r[0]) for r in rows] +
            [len(f"{n} in. sparsity") for n in
             sparse_res.get("input_sparsity", {})]) + 2
    print(f"{'':<{w}}{'sparse-split':>14}{'baseline':>14}", file=out)
    for label, key, fmt in rows:
        print(f"{label:<{w}}{fmt.format(sparse_res[key]):>14}"
              f"{fmt.format(base_res[key]):>14}", file=out)
    for name, sp in sparse_res.get("input_sparsity", {}).items():
        bsp = base_res.get("input_sparsity", {}).get(name)
        label = f"{name} in. sparsity"
        print(f"{label:<{w}}{sp:>14.3f}"
              f"{(f'{bsp:.3f}' if bsp is not None else 'n/a'):>14}",
              file=out)
    if speedup is not None:
        print(format_speedup(speedup, speedup["block"]), file=out, flush=True)


def _print_speedup(args, ours, reference, out):
    """Measures and prints the one speed-up line (or why there is none);
    returns the summary or None."""
    from tf_sparse_split.tools.timing import format_speedup

    rounds = getattr(args, "timing_rounds", 16)
    if not rounds:
        return None
    summary = step_speedup(ours["model"], reference["model"], ours["x_train"],
                           ours["y_train"], args.batch_size, rounds=rounds,
                           block=getattr(args, "timing_steps", None),
                           seed=args.seed)
    block = summary["block"]
    ours["speedup"] = summary
    if not args.compare:
        print(format_speedup(summary, block, against="plain Keras (same "
                             "layers and initial weights)"),
              file=out, flush=True)
    return summary


def _plain_reference(args, x_train, y_train, x_test, num_classes):
    """The plain Keras model of the same architecture and initial weights
    (not trained: a dense model's step time does not depend on its weights),
    compiled like :func:`run`'s."""
    import keras

    keras.utils.set_random_seed(args.seed)
    with strategy_scope(getattr(args, "distribute_strategy", None)):
        model, x_train, _, _ = build_model(args, False, x_train, x_test,
                                           num_classes)
        model.compile(optimizer=keras.optimizers.Adam(args.lr),
                      loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], jit_compile=False)
    return {"model": model, "x_train": x_train, "y_train": y_train}


def train_command(args, out):
    from tf_sparse_split.tools import datasets

    # The strategy first: multi-worker collectives must be set up before any
    # other TensorFlow work.
    strategy_name = getattr(args, "strategy", "none")
    args.distribute_strategy = make_strategy(strategy_name)
    if strategy_name == "multi-worker":
        def runner(*a):
            return run_multi_worker(*a, args.distribute_strategy)
    else:
        runner = run

    # Flag combinations, defaults and output paths were settled by tools.cli.
    if args.data is None:
        (x_train, y_train), (x_test, y_test) = datasets.load_digits()  # fixed split
        data_name = "scikit-learn digits (8x8, embedded)"
    else:
        (x_train, y_train), (x_test, y_test) = datasets.load_mnist(args.data)
        data_name = f"MNIST IDX files in {args.data}"
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    print(f"data: {data_name}: {x_train.shape[0]} train / {x_test.shape[0]} "
          f"test examples, {x_train.shape[1]} features, {num_classes} "
          f"classes, input sparsity {float((x_train == 0).mean()):.3f}",
          file=out, flush=True)
    speedup = None
    if args.compare:
        sparse_res = runner(args, True, x_train, y_train, x_test, y_test,
                            num_classes, out)
        base_res = runner(args, False, x_train, y_train, x_test, y_test,
                          num_classes, out)
        if "model" in sparse_res and "model" in base_res:
            sparse_res["y_train"] = y_train
            speedup = _print_speedup(args, sparse_res, base_res, out)
        print_compare(sparse_res, base_res, out, speedup)
        results = [sparse_res, base_res]
    else:
        results = [runner(args, not args.baseline, x_train, y_train, x_test,
                          y_test, num_classes, out)]
        if not args.baseline and "model" in results[0] and \
                getattr(args, "timing_rounds", 16):
            # The reference: plain Keras layers, same initial weights, not
            # trained (a dense model's step time does not depend on its
            # weights).
            results[0]["y_train"] = y_train
            reference = _plain_reference(args, x_train, y_train, x_test,
                                         num_classes)
            speedup = _print_speedup(args, results[0], reference, out)
    if strategy_name == "multi-worker" and not args.baseline and \
            getattr(args, "timing_rounds", 16):
        print("speed-up: not measured under --strategy multi-worker (each "
              "step is a collective across workers)", file=out, flush=True)
    if getattr(args, "plot", None):
        from tf_sparse_split.tools.distribute import is_chief
        from tf_sparse_split.tools.plots import plot_training

        if is_chief(args.distribute_strategy):
            plot_training(results, args.plot, title=f"tf-sparse-split train "
                          f"({data_name}, {getattr(args, 'model', 'mlp')})",
                          speedup=speedup)
            print(f"plot: {args.plot}", file=out, flush=True)
            budget = results[0].get("budget")
            if budget and budget["trace"]:
                from tf_sparse_split.tools.plots import plot_budget

                path = args.plot[:-4] + "_budget.png"
                plot_budget(budget["trace"], path,
                            title="tf-sparse-split train: step time against "
                                  "the budget")
                print(f"budget plot: {path}", file=out, flush=True)
    return 0
