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

from tf_sparse_split.tools.models import build_cnn, build_mlp

__all__ = ["run", "train_command", "print_compare", "epoch_printer"]


def epoch_printer(epochs, layer_names, out):
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
            for name in layer_names:
                sp = logs.get(f"{name}/sparsity")
                th = logs.get(f"{name}/threshold")
                if sp is None or th is None:
                    continue
                th_text = "auto" if th < 0 else f"{th:.4f}"
                print(f"  {name}: input sparsity {sp:.3f}, threshold for "
                      f"next epoch {th_text}", file=out, flush=True)

    return EpochPrinter()


def run(args, sparse, x_train, y_train, x_test, y_test, num_classes, out):
    """Trains one model; returns a dict of results."""
    import keras

    from tf_sparse_split.callbacks import SplitThresholdCallback
    from tf_sparse_split.layers import SparseSplitLayer

    keras.utils.set_random_seed(args.seed)
    kind = "sparse-split" if sparse else "baseline"
    if getattr(args, "model", "mlp") == "cnn":
        if args.dropout != "none":
            raise ValueError("--dropout applies to --model mlp only")
        side = int(round(x_train.shape[1] ** 0.5))
        if side * side != x_train.shape[1]:
            raise ValueError(f"--model cnn needs square images, got "
                             f"{x_train.shape[1]} pixels")
        x_train = x_train.reshape(-1, side, side, 1)
        x_test = x_test.reshape(-1, side, side, 1)
        model = build_cnn(side, args.filters, num_classes, sparse=sparse,
                          threshold=args.threshold)
        desc = (f"CNN {side}x{side}x1 conv3x3({args.filters[0]})-relu-"
                f"conv3x3({args.filters[1]})-relu-maxpool2-dense"
                f"({num_classes}) "
                f"({'SparseSplitConv2D' if sparse else 'keras.layers.Conv2D'})")
    else:
        model = build_mlp(x_train.shape[1], args.hidden, num_classes,
                          sparse=sparse, threshold=args.threshold,
                          dropout=args.dropout,
                          dropout_rate=args.dropout_rate, seed=args.seed,
                          tile_shape=args.tile_shape)
        sizes = "-".join(str(s) for s in
                         [x_train.shape[1], *args.hidden, num_classes])
        desc = (f"MLP {sizes} "
                f"({'SparseSplitDense' if sparse else 'keras.layers.Dense'})")
    model.compile(optimizer=keras.optimizers.Adam(args.lr),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    if out is not None:
        print(f"model: {kind} {desc}", file=out, flush=True)
        if args.dropout != "none":
            what = {"standard": "keras.layers.Dropout",
                    "row": "ApproximateRandomDropout row patterns",
                    "tile": "ApproximateRandomDropout tile patterns "
                            f"{args.tile_shape or (32, 32)}"}[args.dropout]
            print(f"dropout: {what}, rate {args.dropout_rate}, after every "
                  "hidden layer", file=out, flush=True)
    layer_names = [l.name for l in model.layers
                   if isinstance(l, SparseSplitLayer)] if sparse else []
    printer = epoch_printer(args.epochs, layer_names,
                             None if args.quiet else out)
    callbacks = []
    split_cb = None
    if sparse:
        split_cb = SplitThresholdCallback()
        callbacks.append(split_cb)
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
    }
    if out is not None:
        print(f"{kind}: test accuracy {result['test_accuracy']:.4f}, test "
              f"loss {result['test_loss']:.4f}, time/epoch "
              f"{result['time_per_epoch']:.2f} s ({_time_label(result)})",
              file=out, flush=True)
    return result


def _steady(times):
    later = times[1:] or times
    return sum(later) / max(len(later), 1)


def _time_label(result):
    n = len(result["epoch_times"])
    if result.get("steady_state"):
        return (f"steady state: mean of epochs 2-{n}; epoch 1, with tracing: "
                f"{result['epoch_times'][0]:.2f} s")
    return "1 epoch, includes tracing; use --epochs 2+ for a steady-state time"


def print_compare(sparse_res, base_res, out):
    steady = sparse_res.get("steady_state") and base_res.get("steady_state")
    rows = [
        ("time/epoch, steady state (s)" if steady else
         "time/epoch, 1 epoch with tracing (s)", "time_per_epoch", "{:.2f}"),
        ("final loss", "loss", "{:.4f}"),
        ("final accuracy", "accuracy", "{:.4f}"),
        ("test accuracy", "test_accuracy", "{:.4f}"),
    ]
    print("", file=out)
    w = max(len(r[0]) for r in rows) + 2
    print(f"{'':<{w}}{'sparse-split':>14}{'baseline':>14}", file=out)
    for label, key, fmt in rows:
        print(f"{label:<{w}}{fmt.format(sparse_res[key]):>14}"
              f"{fmt.format(base_res[key]):>14}", file=out)
    if sparse_res["time_per_epoch"] > 0:
        ratio = base_res["time_per_epoch"] / sparse_res["time_per_epoch"]
        what = "steady state" if steady else "1 epoch, includes tracing"
        print(f"speed-up (baseline time / sparse-split time, {what}): "
              f"{ratio:.2f}x", file=out, flush=True)


def train_command(args, out):
    from tf_sparse_split.tools import datasets

    if args.dropout == "none":
        if args.dropout_rate is not None or args.tile_shape is not None:
            raise ValueError("--dropout-rate and --tile-shape need --dropout")
    else:
        if args.dropout_rate is None:
            args.dropout_rate = 0.5
        if args.tile_shape is not None and args.dropout != "tile":
            raise ValueError("--tile-shape needs --dropout tile")

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
    if args.compare:
        sparse_res = run(args, True, x_train, y_train, x_test, y_test,
                          num_classes, out)
        base_res = run(args, False, x_train, y_train, x_test, y_test,
                        num_classes, out)
        print_compare(sparse_res, base_res, out)
    else:
        run(args, not args.baseline, x_train, y_train, x_test, y_test,
             num_classes, out)
    return 0
