"""The ``tf-sparse-split`` command line.

Subcommands:

``train``
    Trains a ReLU MLP (``Dense``-ReLU hidden layers, softmax output) on
    scikit-learn's embedded 8x8 digits or on MNIST IDX files, with
    :class:`~tf_sparse_split.layers.SparseSplitDense` layers and the
    :class:`~tf_sparse_split.callbacks.SplitThresholdCallback` (K.-Y. Peng,
    "Adaptive runtime exploiting sparsity in tensor of deep learning on
    heterogeneous systems", NTU 2017), or with plain ``keras.layers.Dense``
    (``--baseline``), or both in turn from the same initial weights
    (``--compare``). Prints, per epoch, the time in seconds, loss and
    accuracy, and each sparse-split layer's input sparsity and threshold;
    at the end the test accuracy. ``--dropout {none,standard,row,tile}``
    puts a dropout layer after every hidden layer: ``keras.layers.Dropout``
    (``standard``) or :class:`~tf_sparse_split.dropout.
    ApproximateRandomDropout` with row or tile patterns, whose dropped
    neurons the following sparse-split layer skips (Z. Song et al.,
    "Approximate Random Dropout", arXiv 1805.08939), at ``--dropout-rate``.

``profile MODEL_PATH``
    Loads a SavedModel directory or a ``.keras`` file, runs it on sample
    inputs (random with ReLU-like sparsity, or ``--input x.npy``) and prints,
    for every MatMul/Conv2D node, the activation sparsity and the op time of
    ``tf.matmul`` against ``sparse_split_matmul`` on the captured operands,
    and whether the graph-rewrite pass (:mod:`tf_sparse_split.rewrite`) would
    replace it. On GPU machines Keras needs ``jit_compile=False`` for the
    pass to apply.

With ``--model cnn`` it trains a small CNN instead (conv-ReLU-conv-ReLU-
max-pool-dense on the images reshaped to ``side x side x 1``: 8x8 digits,
28x28 MNIST) with :class:`~tf_sparse_split.conv_layers.SparseSplitConv2D`
layers (or ``keras.layers.Conv2D`` with ``--baseline``).

Run as ``tf-sparse-split train ...`` or ``python -m tf_sparse_split train ...``.
:func:`main` returns the exit code (0 success, 1 runtime error such as
missing data or an unbuilt op library, 2 bad arguments).
"""

import argparse
import sys
import time

__all__ = ["main", "build_parser", "build_mlp", "build_cnn"]


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _hidden_sizes(text):
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(
            "give at least one hidden size, e.g. 512,512")
    return [_positive_int(p) for p in parts]


def _threshold(text):
    if text.strip().lower() == "auto":
        return -1.0
    from tf_sparse_split.layers import validate_threshold

    try:
        return validate_threshold(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{e} (or 'auto')") from None


def _dropout_rate(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _tile_shape(text):
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(
            f"give ROWS,UNITS (e.g. 32,32), got {text!r}")
    return tuple(_positive_int(p) for p in parts)


DROPOUT_KINDS = ("none", "standard", "row", "tile")


def build_parser():
    """The ``argparse`` parser of the ``tf-sparse-split`` command."""
    parser = argparse.ArgumentParser(
        prog="tf-sparse-split",
        description="Sparse-split matmul for Keras: exploit the zeros of "
                    "ReLU activations at run time.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    train = sub.add_parser(
        "train", help="train an MLP (or --model cnn) with sparse-split layers",
        description="Train a ReLU MLP with SparseSplitDense layers and the "
                    "threshold-tuning callback (or plain Dense with "
                    "--baseline, or both with --compare).")
    train.add_argument(
        "--data", metavar="DIR", default=None,
        help="directory with MNIST IDX files (t10k-images-idx3-ubyte[.gz], "
             "t10k-labels-idx1-ubyte[.gz], train-* optional); default: "
             "scikit-learn's embedded 8x8 digits")
    train.add_argument("--epochs", type=_positive_int, default=5,
                       help="epochs (default 5)")
    train.add_argument("--batch-size", type=_positive_int, default=128,
                       help="batch size (default 128)")
    train.add_argument("--hidden", type=_hidden_sizes, default=[512, 512],
                       metavar="N,N,...",
                       help="hidden layer sizes (default 512,512)")
    train.add_argument("--lr", type=_positive_float, default=1e-3,
                       help="Adam learning rate (default 1e-3)")
    train.add_argument("--seed", type=int, default=0,
                       help="random seed (default 0)")
    train.add_argument(
        "--threshold", type=_threshold, default=-1.0, metavar="T|auto",
        help="initial split threshold in [0, 1], or 'auto' (default): the "
             "callback tunes it after each epoch")
    train.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                       help="mlp (default): Dense-ReLU layers; cnn: "
                            "conv-relu-conv-relu-pool-dense")
    train.add_argument("--filters", type=_hidden_sizes, default=[16, 32],
                       metavar="N,N",
                       help="filters of the two 3x3 conv layers of --model "
                            "cnn (default 16,32)")
    mode = train.add_mutually_exclusive_group()
    mode.add_argument("--baseline", action="store_true",
                      help="use plain keras.layers.Dense instead")
    mode.add_argument("--compare", action="store_true",
                      help="train both (same seed) and print a side-by-side "
                           "summary")
    train.add_argument(
        "--dropout", choices=DROPOUT_KINDS, default="none",
        help="dropout after every hidden layer: none (default), standard "
             "(keras.layers.Dropout), row or tile (ApproximateRandomDropout "
             "patterns the sparse-split layers skip)")
    train.add_argument("--dropout-rate", type=_dropout_rate, default=None,
                       metavar="R",
                       help="dropout rate in [0, 1) (default 0.5; needs "
                            "--dropout)")
    train.add_argument("--tile-shape", type=_tile_shape, default=None,
                       metavar="ROWS,UNITS",
                       help="tile of --dropout tile (default 32,32; UNITS "
                            "must divide every hidden size)")
    train.add_argument("--quiet", action="store_true",
                       help="no progress bar or per-epoch lines; only the "
                            "summary")
    prof = sub.add_parser(
        "profile", help="measure activation sparsity and dense vs split op "
                        "time for each MatMul/Conv2D of a model",
        description="Load a SavedModel directory or .keras file, run it on "
                    "sample inputs and time tf.matmul against "
                    "sparse_split_matmul on every MatMul's captured operands. "
                    "On GPU machines compile Keras models with "
                    "jit_compile=False for the rewrite pass to apply.")
    prof.add_argument("model", metavar="MODEL_PATH",
                      help="SavedModel directory or .keras file")
    prof.add_argument("--input", metavar="X.npy", default=None,
                      help="input array (.npy) for a single-input model; "
                           "default: random inputs")
    prof.add_argument("--batch-size", type=_positive_int, default=128,
                      help="batch size of random inputs (default 128)")
    prof.add_argument("--input-sparsity", type=_fraction, default=0.5,
                      help="fraction of zeros of random inputs (default 0.5, "
                           "as after a ReLU)")
    prof.add_argument("--threshold", type=_threshold, default=-1.0,
                      metavar="T|auto", help="split threshold (default auto)")
    prof.add_argument("--repeats", type=_positive_int, default=10,
                      help="timed repetitions per op (median; default 10)")
    prof.add_argument("--signature", default=None,
                      help="SavedModel signature (default serving_default)")
    prof.add_argument("--seed", type=int, default=0,
                      help="seed of the random inputs (default 0)")
    return parser


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _cmd_profile(args, out):
    import numpy as np

    from tf_sparse_split import profile
    from tf_sparse_split._loader import load_library

    load_library()
    inputs = None
    input_desc = (f"random, relu(normal) with {args.input_sparsity:.2f} zeros, "
                  f"seed {args.seed}")
    if args.input is not None:
        if not __import__("os").path.isfile(args.input):
            raise FileNotFoundError(f"no such input file: {args.input}")
        inputs = [np.load(args.input)]
        input_desc = f"from {args.input}, {float(np.mean(inputs[0] == 0)):.3f} zeros"
    desc, rows, shapes = profile.profile_model(
        args.model, inputs=inputs, batch_size=args.batch_size,
        input_sparsity=args.input_sparsity, threshold=args.threshold,
        repeats=args.repeats, seed=args.seed, signature=args.signature)
    profile.format_report(args.model, desc, rows, shapes, input_desc, out)
    return 0


def build_mlp(input_dim, hidden, num_classes, sparse=True, threshold=-1.0,
              dropout="none", dropout_rate=0.5, seed=None, tile_shape=None):
    """An MLP ``input -> [hidden ReLU [dropout]]* -> softmax``.

    Args:
      input_dim: features per example.
      hidden: list of hidden layer widths.
      num_classes: output classes.
      sparse: SparseSplitDense layers (True) or keras.layers.Dense (False).
      threshold: initial threshold of the SparseSplitDense layers.
      dropout: ``"none"``, ``"standard"`` (``keras.layers.Dropout``),
        ``"row"`` or ``"tile"`` (``ApproximateRandomDropout``): a dropout
        layer after every hidden layer, named ``dropout_1``, ...
      dropout_rate: its rate in ``[0, 1)``.
      seed: seed of the dropout layers (layer ``i`` gets ``seed + i``).
      tile_shape: tile of the ``"tile"`` pattern (default ``(32, 32)``).

    Returns:
      an uncompiled ``keras.Sequential``; layers are named ``hidden_1``, ...,
      ``output``.

    Raises:
      ValueError: unknown ``dropout``, bad rate, or a tile not dividing a
        hidden size.
    """
    import keras

    from tf_sparse_split.layers import SparseSplitDense

    def dense(units, activation, name, after_relu=False):
        if sparse:
            # After a ReLU (optionally through row/tile dropout) the input
            # gradient is needed only for units alive in the batch.
            return SparseSplitDense(units, activation=activation,
                                    threshold=threshold, name=name,
                                    skip_dead_input_grad=after_relu)
        return keras.layers.Dense(units, activation=activation, name=name)

    if dropout not in DROPOUT_KINDS:
        raise ValueError(f"dropout must be one of {DROPOUT_KINDS}, got "
                         f"{dropout!r}")

    def drop(i):
        from tf_sparse_split.dropout import ApproximateRandomDropout

        s = None if seed is None else seed + i
        name = f"dropout_{i + 1}"
        if dropout == "standard":
            return keras.layers.Dropout(dropout_rate, seed=s, name=name)
        return ApproximateRandomDropout(
            dropout_rate, pattern=dropout, seed=s, name=name,
            tile_shape=tile_shape if dropout == "tile" else None)

    layers = [keras.Input((input_dim,))]
    for i, width in enumerate(hidden):
        layers.append(dense(width, "relu", f"hidden_{i + 1}", after_relu=i > 0))
        if dropout != "none":
            layers.append(drop(i))
    layers.append(dense(num_classes, "softmax", "output", after_relu=True))
    return keras.Sequential(layers, name="sparse_mlp" if sparse else "mlp")


def build_cnn(side, filters, num_classes, sparse=True, threshold=-1.0):
    """A small CNN ``[side, side, 1] -> conv 3x3 ReLU -> conv 3x3 ReLU ->
    2x2 max-pool -> flatten -> softmax``.

    Args:
      side: image height = width.
      filters: two ints, the filters of the two conv layers.
      num_classes: output classes.
      sparse: SparseSplitConv2D / SparseSplitDense (True) or keras Conv2D /
        Dense (False).
      threshold: initial threshold of the sparse-split layers.

    Returns:
      an uncompiled ``keras.Sequential``; layers named ``conv_1``,
      ``conv_2``, ``pool``, ``flatten``, ``output``.

    Raises:
      ValueError: if ``filters`` does not have two entries.
    """
    import keras

    from tf_sparse_split.conv_layers import SparseSplitConv2D
    from tf_sparse_split.layers import SparseSplitDense

    if len(filters) != 2:
        raise ValueError(f"--filters needs two sizes for the two conv "
                         f"layers, got {filters}")

    def conv(n, name):
        if sparse:
            return SparseSplitConv2D(n, 3, padding="same", activation="relu",
                                     threshold=threshold, name=name)
        return keras.layers.Conv2D(n, 3, padding="same", activation="relu",
                                   name=name)

    out = (SparseSplitDense(num_classes, activation="softmax",
                            threshold=threshold, name="output") if sparse
           else keras.layers.Dense(num_classes, activation="softmax",
                                   name="output"))
    return keras.Sequential(
        [keras.Input((side, side, 1)), conv(filters[0], "conv_1"),
         conv(filters[1], "conv_2"), keras.layers.MaxPooling2D(2, name="pool"),
         keras.layers.Flatten(name="flatten"), out],
        name="sparse_cnn" if sparse else "cnn")


def _epoch_printer(epochs, layer_names, out):
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
                print(f"  {name}: input sparsity {sp:.3f}, threshold "
                      f"{th_text}", file=out, flush=True)

    return EpochPrinter()


def _run(args, sparse, x_train, y_train, x_test, y_test, num_classes, out):
    """Trains one model; returns a dict of results."""
    import keras

    from tf_sparse_split.callbacks import SplitThresholdCallback

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
                   if hasattr(l, "threshold_var")] if sparse else []
    printer = _epoch_printer(args.epochs, layer_names,
                             None if args.quiet else out)
    callbacks = []
    split_cb = None
    if sparse:
        split_cb = SplitThresholdCallback()
        callbacks.append(split_cb)
    if not args.quiet:
        # Our printer must run after the progress bar finishes its line.
        callbacks.append(keras.callbacks.ProgbarLogger())
    callbacks.append(printer)
    history = model.fit(
        x_train, y_train, epochs=args.epochs, batch_size=args.batch_size,
        shuffle=True, callbacks=callbacks, verbose=0 if args.quiet else 1)
    test_loss, test_acc = model.evaluate(x_test, y_test,
                                         batch_size=args.batch_size,
                                         verbose=0)
    result = {
        "kind": kind,
        "dropout": args.dropout,
        "dropout_rate": args.dropout_rate,
        "epoch_times": list(printer.times),
        "time_per_epoch": sum(printer.times) / max(len(printer.times), 1),
        "loss": float(history.history["loss"][-1]),
        "accuracy": float(history.history["accuracy"][-1]),
        "test_loss": float(test_loss),
        "test_accuracy": float(test_acc),
        "thresholds": ({l.name: l.threshold for l in model.layers
                        if hasattr(l, "threshold_var")} if sparse else {}),
    }
    if out is not None:
        print(f"{kind}: test accuracy {result['test_accuracy']:.4f}, test "
              f"loss {result['test_loss']:.4f}, time/epoch "
              f"{result['time_per_epoch']:.2f} s", file=out, flush=True)
    return result


def _print_compare(sparse_res, base_res, out):
    rows = [
        ("time/epoch (s)", "time_per_epoch", "{:.2f}"),
        ("final loss", "loss", "{:.4f}"),
        ("final accuracy", "accuracy", "{:.4f}"),
        ("test accuracy", "test_accuracy", "{:.4f}"),
    ]
    print("", file=out)
    print(f"{'':<18}{'sparse-split':>14}{'baseline':>14}", file=out)
    for label, key, fmt in rows:
        print(f"{label:<18}{fmt.format(sparse_res[key]):>14}"
              f"{fmt.format(base_res[key]):>14}", file=out)
    if sparse_res["time_per_epoch"] > 0:
        ratio = base_res["time_per_epoch"] / sparse_res["time_per_epoch"]
        print(f"speed-up (baseline time / sparse-split time): {ratio:.2f}x",
              file=out, flush=True)


def _cmd_train(args, out):
    from tf_sparse_split import datasets

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
        sparse_res = _run(args, True, x_train, y_train, x_test, y_test,
                          num_classes, out)
        base_res = _run(args, False, x_train, y_train, x_test, y_test,
                        num_classes, out)
        _print_compare(sparse_res, base_res, out)
    else:
        _run(args, not args.baseline, x_train, y_train, x_test, y_test,
             num_classes, out)
    return 0


def main(argv=None):
    """Entry point of ``tf-sparse-split``; returns the exit code.

    Args:
      argv: argument list without the program name (default ``sys.argv[1:]``).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or bad arguments (2)
        return int(e.code) if isinstance(e.code, int) else 2
    out = sys.stdout
    try:
        if args.command == "train":
            return _cmd_train(args, out)
        if args.command == "profile":
            return _cmd_profile(args, out)
    except (FileNotFoundError, ValueError) as e:
        print(f"tf-sparse-split: error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:  # includes LibraryLoadError
        print(f"tf-sparse-split: error: {e}", file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
