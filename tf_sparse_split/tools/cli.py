"""The ``tf-sparse-split`` command line.

Subcommands:

``train``
    Trains a ReLU MLP (``Dense``-ReLU hidden layers, softmax output; default
    64-2048-2048-10, batch 256) on scikit-learn's embedded 8x8 digits or on MNIST IDX
    files, with :class:`~tf_sparse_split.layers.SparseSplitDense` layers,
    the :class:`~tf_sparse_split.callbacks.SplitThresholdCallback` (K.-Y.
    Peng, "Adaptive runtime exploiting sparsity in tensor of deep learning
    on heterogeneous systems", NTU 2017) and, by default, the
    :class:`~tf_sparse_split.callbacks.SparsityTargetCallback` at 90% zeros
    (``--target-sparsity``), or with plain ``keras.layers.Dense``
    (``--baseline``), or both in turn from the same initial weights
    (``--compare``). The layer on the model input and a softmax output of
    fewer than 64 units stay plain Keras layers (no gain there;
    ``--split-all-layers`` converts them too). Prints, per epoch, the time
    in seconds, loss and accuracy, and for each sparse-split layer its input
    sparsity and the path it takes next epoch in words (dense below
    break-even, split, sparse, auto); at the end the test accuracy and ONE
    speed-up figure: interleaved blocks of training steps
    (``train_on_batch``) of the sparse-split model and of plain Keras
    (``--compare``: the trained baseline; otherwise the same model with
    plain layers and the same initial weights), alternating which goes
    first, median of the per-block ratios with their range
    (:mod:`tf_sparse_split.tools.timing`; ``--timing-rounds``,
    ``--timing-steps``). ``--dropout {none,standard,row,tile}``
    puts a dropout layer after every hidden layer: ``keras.layers.Dropout``
    (``standard``) or :class:`~tf_sparse_split.layers.
    ApproximateRandomDropout` with row or tile patterns, whose dropped
    neurons the following sparse-split layer skips (Z. Song et al.,
    "Approximate Random Dropout", arXiv 1805.08939), at ``--dropout-rate``.
    Output paths (``--plot``, ``--tensorboard``, ``--checkpoint-dir``) are
    checked before training (exit code 2).

``profile MODEL_PATH``
    Loads a SavedModel directory or a ``.keras`` file, runs it on sample
    inputs (random with ReLU-like sparsity, or ``--input x.npy``) and prints,
    for every MatMul/Conv2D node, the activation sparsity and the op time of
    ``tf.matmul`` against ``sparse_split_matmul`` on the captured operands,
    and whether the graph-rewrite pass (:mod:`tf_sparse_split.rewrite`) would
    replace it. On GPU machines Keras needs ``jit_compile=False`` for the
    pass to apply.

``train --strategy {none,mirrored,multi-worker}`` trains under a
``tf.distribute`` strategy (multi-worker: ``TF_CONFIG``, a custom loop;
:mod:`tf_sparse_split.tools.distribute`); ``--tensorboard DIR`` writes
per-layer summaries, ``--plot FILE.png`` a training plot
(:mod:`tf_sparse_split.tools.plots`), ``--checkpoint-dir DIR`` the model
after every epoch. ``profile MODEL --end-to-end`` times whole-model inference
plain / with the rewrite pass / with sparse-split layers
(:mod:`tf_sparse_split.tools.latency`).

With ``--model cnn`` it trains a small CNN instead (conv-ReLU-conv-ReLU-
max-pool-dense on the images reshaped to ``side x side x 1``: 8x8 digits,
28x28 MNIST) with :class:`~tf_sparse_split.layers.SparseSplitConv2D`
layers (or ``keras.layers.Conv2D`` with ``--baseline``).

``--target-sparsity S`` (mlp, cnn) adds the
:class:`~tf_sparse_split.callbacks.SparsityTargetCallback`: the inputs of
the sparse-split layers fed by a ReLU are driven toward a fraction S of
zeros (FATReLU cutoffs + progressive L1; Kurtz et al., ICML 2020;
ProSparse, 2024; default 0.9 for mlp, 0.8 for cnn, ``none`` to switch it
off); ``--compare`` then also prints each layer's input sparsity in both
models. ``--step-budget MS`` / ``--time-budget SECONDS`` (mlp, cnn) train
within a step-time budget or a deadline for the whole run instead of a fixed
target: :class:`~tf_sparse_split.callbacks.TimeBudgetCallback` chooses each
layer's sparsity at run time (R. Sun and L. Zhang, 2019); ``profile MODEL
--latency-budget MS`` raises a trained model's FATReLU cutoffs until its
p50 latency meets MS (:mod:`tf_sparse_split.tools.latency_budget`).
``--model lstm`` trains image rows
as sequences with :class:`~tf_sparse_split.layers.SparseSplitLSTM`
(``--units``; ``--dropout row|tile|standard`` with ``--dropout-rate`` and
``--recurrent-dropout-rate``; Z. Song et al., arXiv 2203.05705) or
``keras.layers.LSTM`` with the same rates (``--baseline``).

This module only parses arguments and dispatches: the train command is
:func:`tf_sparse_split.tools.train.train_command` (models from
:mod:`tf_sparse_split.tools.models`), the profile command
:func:`tf_sparse_split.tools.profile.profile_command`.

Run as ``tf-sparse-split train ...`` or ``python -m tf_sparse_split train ...``.
:func:`main` returns the exit code (0 success, 1 runtime error such as
missing data or an unbuilt op library, 2 bad arguments).
"""

import argparse
import os
import sys

from tf_sparse_split.tools.models import DROPOUT_KINDS, PLAIN_WHERE_NO_GAIN
from tf_sparse_split.utils.validation import (validate_fraction, validate_int,
                                              threshold_from_text,
                                              validate_positive_float)

__all__ = ["main", "build_parser", "parse_positive_int",
           "parse_nonnegative_int", "parse_int_list",
           "parse_positive_float", "parse_seed", "parse_threshold",
           "parse_rate",
           "parse_tile_shape"]


def _checked(check, text, *args):
    try:
        return check(text, *args)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_int(text, minimum):
    """An integer >= ``minimum`` from command-line text (argparse errors)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    return _checked(validate_int, value, "value", minimum)


def parse_positive_int(text):
    """argparse type: an integer > 0."""
    return _parse_int(text, 1)


def parse_nonnegative_int(text):
    """argparse type: an integer >= 0."""
    return _parse_int(text, 0)


def parse_positive_float(text):
    """argparse type: a finite number > 0 (``--lr``; inf would train to
    NaN)."""
    import math

    value = _checked(validate_positive_float, text, "value")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"`value` must be a finite number > 0. Received: value={text!r}")
    return value


#: The largest ``--seed``: Keras' and numpy's seeds are 32-bit.
MAX_SEED = 2**32 - 1


def parse_seed(text):
    """argparse type: an integer in ``[0, 2^32 - 1]`` (what
    ``keras.utils.set_random_seed`` takes)."""
    value = _parse_int(text, 0)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"`value` must be <= 2**32 - 1 = {MAX_SEED}. Received: "
            f"value={value}")
    return value


def parse_int_list(text):
    """argparse type: comma-separated integers > 0 (e.g. ``512,512``); an
    empty entry (``8,,8``, ``8,``) is an error, not skipped."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError(
            "give at least one hidden size, e.g. 512,512")
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"empty entry in {text!r}: give comma-separated sizes, e.g. "
            "512,512")
    return [parse_positive_int(p) for p in parts]


def parse_threshold(text):
    """argparse type: a threshold in [0, 1], or ``auto`` (stored as -1.0)
    or a negative number for automatic (``threshold_from_text``)."""
    return _checked(threshold_from_text, text)


def parse_rate(text):
    """argparse type: a rate or fraction in [0, 1)."""
    return _checked(validate_fraction, text, "value")


def parse_target(text):
    """argparse type: a fraction of zeros in [0, 1), or ``none`` (no
    induced sparsity; stored as the string ``"none"``)."""
    if text.strip().lower() == "none":
        return "none"
    return parse_rate(text)


def parse_seconds(text):
    """argparse type: a finite number > 0 (a time budget, in the unit its
    flag names; NaN and inf refused)."""
    import math

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"a budget must be a finite number > 0, got {text!r}")
    return value


def parse_tile_shape(text):
    """argparse type: ``ROWS,UNITS``, two integers > 0."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(
            f"give ROWS,UNITS (e.g. 32,32), got {text!r}")
    return tuple(parse_positive_int(p) for p in parts)


#: ``train --hidden`` default (mlp) and ``--target-sparsity`` defaults per
#: model: chosen by measurement so that the plain command trains a model the
#: sparse-split layers make faster (docs/guide/cli.md).
DEFAULT_HIDDEN = (2048, 2048)
DEFAULT_FILTERS = (32, 64)
#: ``train --batch-size`` defaults per model: the MLP's GEMMs are a larger
#: share of a step at 256 (optimizer and per-step costs stay the same), which
#: measured 1.7-2.6x against 1.0-1.5x at 128 under load; the LSTM 1.00-1.13x
#: against 0.93-1.02x; the CNN keeps 128 (at 256 its 5 epochs on the digits
#: lose 4 points of accuracy).
DEFAULT_BATCH = {"mlp": 256, "cnn": 128, "lstm": 256}
#: ``train --timing-rounds`` default: on a shared machine single block
#: ratios range over 2-3x; the median of 16 is stable to a few percent.
DEFAULT_TIMING_ROUNDS = 16
DEFAULT_TARGET = {"mlp": 0.9, "cnn": 0.8}


def build_parser():
    """The ``argparse`` parser of the ``tf-sparse-split`` command."""
    parser = argparse.ArgumentParser(
        prog="tf-sparse-split",
        description="Sparse-split matmul for Keras: exploit the zeros of "
                    "ReLU activations at run time.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    train = sub.add_parser(
        "train",
        help="train an MLP (or --model cnn|lstm) with sparse-split layers",
        description="Train a ReLU MLP with SparseSplitDense layers and the "
                    "threshold-tuning callback (or plain Dense with "
                    "--baseline, or both with --compare).")
    train.add_argument(
        "--data", metavar="DIR", default=None,
        help="directory with MNIST IDX files (t10k-images-idx3-ubyte[.gz], "
             "t10k-labels-idx1-ubyte[.gz], train-* optional); default: "
             "scikit-learn's embedded 8x8 digits")
    train.add_argument("--epochs", type=parse_positive_int, default=5,
                       help="epochs (default 5)")
    train.add_argument("--batch-size", type=parse_positive_int, default=None,
                       help="batch size (default "
                            + ", ".join(f"{v} for {k}" for k, v in
                                        DEFAULT_BATCH.items()) + ")")
    train.add_argument("--hidden", type=parse_int_list, default=None,
                       metavar="N,N,...",
                       help="hidden layer sizes of --model mlp (default "
                            + ",".join(map(str, DEFAULT_HIDDEN)) + ")")
    train.add_argument("--lr", type=parse_positive_float, default=1e-3,
                       help="Adam learning rate (default 1e-3)")
    train.add_argument("--seed", type=parse_seed, default=0,
                       help="random seed (default 0)")
    train.add_argument(
        "--threshold", type=parse_threshold, default=None, metavar="T|auto",
        help="initial split threshold of the sparse-split layers: a number "
             "in [0, 1], or 'auto' (default; the op chooses per call); the "
             "callback tunes it after each epoch for the next one")
    train.add_argument("--model", choices=("mlp", "cnn", "lstm"),
                       default="mlp",
                       help="mlp (default): Dense-ReLU layers; cnn: "
                            "conv-relu-conv-relu-pool-dense; lstm: image "
                            "rows as a sequence -> SparseSplitLSTM -> dense "
                            "(--dropout row|tile|standard patterns)")
    train.add_argument("--units", type=parse_positive_int, default=128,
                       help="LSTM units of --model lstm (default 128)")
    train.add_argument("--recurrent-dropout-rate", type=parse_rate,
                       default=None, metavar="R",
                       help="recurrent dropout of --model lstm in [0, 1) "
                            "(default: --dropout-rate)")
    train.add_argument("--filters", type=parse_int_list, default=None,
                       metavar="N,N",
                       help="filters of the two 3x3 conv layers of --model "
                            "cnn (default "
                            + ",".join(map(str, DEFAULT_FILTERS)) + ")")
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
    train.add_argument("--dropout-rate", type=parse_rate, default=None,
                       metavar="R",
                       help="dropout rate in [0, 1) (default 0.5; needs "
                            "--dropout)")
    train.add_argument("--tile-shape", type=parse_tile_shape, default=None,
                       metavar="ROWS,UNITS",
                       help="tile of --dropout tile (default 32,32 for "
                            "--model mlp, where UNITS must divide every "
                            "hidden size; --model lstm: per mask, 32 rows "
                            "by the largest divisor of its width up to 32 "
                            "that leaves two tiles across, e.g. 32,4 on the "
                            "digits' 8 features)")
    train.add_argument(
        "--target-sparsity", type=parse_target, default=None,
        metavar="S|none",
        help="induce activation sparsity: drive the input of every "
             "sparse-split layer fed by a ReLU toward a fraction S of zeros "
             "in [0, 1) (SparsityTargetCallback: FATReLU cutoffs + a "
             "progressive L1 penalty; --model mlp and cnn); default "
             f"{DEFAULT_TARGET['mlp']} for mlp, {DEFAULT_TARGET['cnn']} for "
             "cnn; 'none': plain ReLU sparsity")
    budget = train.add_mutually_exclusive_group()
    budget.add_argument(
        "--step-budget", type=parse_seconds, default=None, metavar="MS",
        help="train within MS milliseconds per step: the sparsity of every "
             "sparse-split layer fed by a ReLU is chosen at run time "
             "(TimeBudgetCallback; --model mlp and cnn; replaces "
             "--target-sparsity)")
    budget.add_argument(
        "--time-budget", type=parse_seconds, default=None,
        metavar="SECONDS",
        help="train the whole run (all epochs) within SECONDS, the same way")
    train.add_argument(
        "--split-all-layers", action="store_true",
        help="make every Dense/Conv2D a sparse-split layer; by default the "
             "layer on the model input (raw pixels) and a softmax output "
             "layer of fewer than 64 units stay plain Keras layers, where a "
             "sparse-split layer cannot win")
    train.add_argument(
        "--timing-rounds", type=parse_nonnegative_int, default=None,
        metavar="R",
        help="after training, time R interleaved blocks of training steps "
             "of the sparse-split model and plain Keras (alternating which "
             "goes first) and print the median speed-up with its range "
             f"(default {DEFAULT_TIMING_ROUNDS}; 0: no timing)")
    train.add_argument(
        "--timing-steps", type=parse_positive_int, default=None, metavar="B",
        help="training steps per timed block (default: enough for 0.2 s, "
             "8 to 64)")
    train.add_argument("--quiet", action="store_true",
                       help="no progress bar or per-epoch lines; only the "
                            "summary (the progress bar is also left out "
                            "when stdout is not a terminal)")
    # Distribution, TensorBoard, plots (tools/distribute.py, tools/plots.py).
    train.add_argument(
        "--strategy", choices=("none", "mirrored", "multi-worker"),
        default="none",
        help="none (default); mirrored: Keras fit under MirroredStrategy; "
             "multi-worker: MultiWorkerMirroredStrategy from TF_CONFIG in a "
             "custom training loop (run the same command on every worker)")
    train.add_argument(
        "--tensorboard", metavar="DIR", default=None,
        help="write TensorBoard event files (per-layer sparsity, threshold, "
             "rows and seconds per path, zero columns, row-density "
             "histogram per epoch) to DIR (chief only)")
    train.add_argument(
        "--plot", metavar="FILE.png", default=None,
        help="draw per-layer input sparsity and threshold and the epoch time "
             "per epoch (both models with --compare) to a PNG (chief only)")
    train.add_argument(
        "--checkpoint-dir", metavar="DIR", default=None,
        help="save DIR/model.keras after every epoch (with --strategy "
             "multi-worker only the chief writes)")
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
    prof.add_argument("--batch-size", type=parse_positive_int, default=None,
                      help="batch size of random inputs (default 128; not "
                           "with --input)")
    prof.add_argument("--input-sparsity", type=parse_rate, default=None,
                      help="fraction of zeros of random inputs (default 0.5, "
                           "as after a ReLU; not with --input)")
    prof.add_argument("--threshold", type=parse_threshold, default=-1.0,
                      metavar="T|auto",
                      help="split threshold: a number in [0, 1] or 'auto' "
                           "(default)")
    prof.add_argument("--repeats", type=parse_positive_int, default=10,
                      help="timed repetitions per op (median; default 10)")
    prof.add_argument("--signature", default=None,
                      help="SavedModel signature (default serving_default)")
    prof.add_argument("--seed", type=parse_seed, default=0,
                      help="seed of the random inputs (default 0)")
    # Whole-model latency (tools/latency.py).
    prof.add_argument(
        "--end-to-end", action="store_true",
        help="time whole-model inference instead: plain, with the rewrite "
             "pass, and converted to sparse-split layers (p50/p90 ms, "
             "interleaved, after warm-up)")
    prof.add_argument(
        "--latency-budget", type=parse_seconds, default=None, metavar="MS",
        help="raise the model's FATReLU cutoffs (ReLUs before sparse-split "
             "layers are converted) until its p50 latency on the input is "
             "at most MS milliseconds; prints the accuracy/latency points "
             "tried (.keras models; accuracy with --labels)")
    prof.add_argument(
        "--labels", metavar="Y.npy", default=None,
        help="--latency-budget: integer labels of --input, for the accuracy "
             "of each point")
    prof.add_argument(
        "--curve", metavar="FILE.png", default=None,
        help="--latency-budget: draw the accuracy/latency curve to a PNG")
    prof.add_argument(
        "--output", metavar="FILE.keras", default=None,
        help="--latency-budget: save the model with the chosen cutoffs")
    prof.add_argument(
        "--sparse-model", metavar="PATH", default=None,
        help="--end-to-end: a sparse-split version of the model (.keras) to "
             "time too (default: converted from a .keras model's Dense/"
             "Conv2D layers where possible)")
    # The subcommands' parsers, for errors found after parsing (their
    # usage line, not the top-level one).
    parser.command_parsers = {"train": train, "profile": prof}
    return parser


def _writable_dir_problem(path):
    """None if ``path`` is (or can be created as) a writable directory, else
    what is wrong with it."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return "is not writable"
        return None
    parent = os.path.dirname(path)
    missing = [path]
    while not os.path.exists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent!r} is not writable"
    # The permission bits can say yes where creation fails (root on /proc,
    # a read-only mount): create the directories and remove them again.
    try:
        os.makedirs(path)
    except OSError as e:
        return f"cannot be created: {e.strerror or e}"
    for d in missing:
        try:
            os.rmdir(d)
        except OSError:
            break
    return None


def _check_output_paths(parser, args):
    """Output paths are checked before any training (``parser.error``: exit
    code 2, one line), so that a run is never lost to a bad path at its
    end."""
    from tf_sparse_split.tools.plots import check_plot_path

    if args.plot is not None:
        try:
            check_plot_path(args.plot)
        except ValueError as e:
            parser.error(str(e))
    for flag, path in (("--tensorboard", args.tensorboard),
                       ("--checkpoint-dir", args.checkpoint_dir)):
        if path is not None:
            problem = _writable_dir_problem(path)
            if problem:
                parser.error(f"{flag} {path!r} {problem}")


def _check_combinations(parser, args):
    """Refuses flags that conflict or would be ignored (``parser.error``:
    exit code 2), then fills in the defaults of the flags left unset."""
    given = lambda name: getattr(args, name, None) is not None  # noqa: E731
    if args.command == "train":
        if args.model == "cnn":
            if given("hidden"):
                parser.error("--hidden applies to --model mlp; --model cnn "
                             "takes --filters")
            if args.dropout != "none":
                parser.error("--dropout applies to --model mlp and --model lstm")
        elif given("filters"):
            parser.error("--filters applies to --model cnn")
        if args.model == "lstm":
            if given("hidden"):
                parser.error("--hidden applies to --model mlp; --model lstm "
                             "takes --units")
            if given("target_sparsity") and args.target_sparsity != "none":
                parser.error("--target-sparsity applies to --model mlp and "
                             "cnn")
        elif given("recurrent_dropout_rate"):
            parser.error("--recurrent-dropout-rate applies to --model lstm")
        if args.baseline and given("threshold"):
            parser.error("--threshold sets the sparse-split layers; "
                         "--baseline trains plain Keras layers")
        if args.dropout == "none":
            if given("dropout_rate") or given("tile_shape"):
                parser.error("--dropout-rate and --tile-shape need --dropout")
            if given("recurrent_dropout_rate"):
                parser.error("--recurrent-dropout-rate needs --model lstm and "
                             "--dropout")
        elif given("tile_shape") and args.dropout != "tile":
            parser.error("--tile-shape needs --dropout tile")
        if args.dropout == "tile" and args.model == "mlp":
            units = (args.tile_shape or (32, 32))[1]
            bad = [h for h in (args.hidden or DEFAULT_HIDDEN) if h % units]
            if bad:
                parser.error(f"--tile-shape: {units} units per tile "
                             "does not divide the hidden size(s) "
                             + ",".join(map(str, bad)) + " (it must divide "
                             "every one)")
        if given("step_budget") or given("time_budget"):
            flag = "--step-budget" if given("step_budget") else \
                "--time-budget"
            if args.baseline:
                parser.error(f"{flag} sets the sparse-split layers; "
                             "--baseline trains plain Keras layers")
            if args.model == "lstm":
                parser.error(f"{flag} applies to --model mlp and cnn")
            if given("target_sparsity") and args.target_sparsity != "none":
                parser.error(f"{flag} chooses the sparsity at run time; it "
                             "cannot be used with --target-sparsity")
            if getattr(args, "strategy", "none") == "multi-worker":
                parser.error(f"{flag} needs Keras fit (not --strategy "
                             "multi-worker)")
        if args.baseline and (args.split_all_layers
                              or args.timing_rounds is not None
                              or args.timing_steps is not None):
            parser.error("--split-all-layers, --timing-rounds and "
                         "--timing-steps apply to the sparse-split model; "
                         "--baseline trains plain Keras layers")
        _check_output_paths(parser, args)
        if args.dropout != "none" and args.dropout_rate is None:
            args.dropout_rate = 0.5
        args.keep_plain = (() if args.split_all_layers
                           else PLAIN_WHERE_NO_GAIN)
        if given("step_budget") or given("time_budget"):
            args.target_sparsity = "none"   # the budget chooses it
        if args.target_sparsity is None:
            args.target_sparsity = DEFAULT_TARGET.get(args.model)
        elif args.target_sparsity == "none":
            args.target_sparsity = None
        args.hidden = args.hidden or list(DEFAULT_HIDDEN)
        args.filters = args.filters or list(DEFAULT_FILTERS)
        if args.timing_rounds is None:
            args.timing_rounds = DEFAULT_TIMING_ROUNDS
        if args.batch_size is None:
            args.batch_size = DEFAULT_BATCH[args.model]
        args.threshold = -1.0 if args.threshold is None else args.threshold
    elif args.command == "profile":
        if args.input is not None and (given("batch_size")
                                       or given("input_sparsity")):
            parser.error("--batch-size and --input-sparsity describe random "
                         "inputs; they cannot be used with --input")
        lb = getattr(args, "latency_budget", None)
        if lb is None and any(getattr(args, a, None) is not None for a in
                              ("labels", "curve", "output")):
            parser.error("--labels, --curve and --output need "
                         "--latency-budget")
        if lb is not None:
            if args.end_to_end:
                parser.error("--latency-budget and --end-to-end are "
                             "separate measurements; give one")
            if args.labels is not None and args.input is None:
                parser.error("--labels needs --input (the examples they "
                             "label)")
            if args.output is not None and \
                    not args.output.endswith(".keras"):
                parser.error(f"--output writes a .keras file, got "
                             f"{args.output!r}")
            if args.curve is not None:
                from tf_sparse_split.tools.plots import check_plot_path
                try:
                    check_plot_path(args.curve)
                except ValueError as e:
                    parser.error(str(e).replace("--plot", "--curve"))
        args.batch_size = args.batch_size or 128
        args.input_sparsity = (0.5 if args.input_sparsity is None
                               else args.input_sparsity)


def main(argv=None):
    """Entry point of ``tf-sparse-split``; returns the exit code.

    Args:
      argv: argument list without the program name (default ``sys.argv[1:]``).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _check_combinations(
            parser.command_parsers.get(args.command, parser), args)
    except SystemExit as e:  # argparse: --help (0) or bad arguments (2)
        return int(e.code) if isinstance(e.code, int) else 2
    out = sys.stdout
    # TensorFlow's C++ INFO lines (oneDNN, CPU features) are noise here;
    # warnings and errors still show. An explicit setting wins.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    try:
        if args.command == "train":
            from tf_sparse_split.tools.train import train_command

            return train_command(args, out)
        if args.command == "profile" and \
                getattr(args, "latency_budget", None) is not None:
            from tf_sparse_split.tools.latency_budget import \
                latency_budget_command

            return latency_budget_command(args, out)
        if args.command == "profile" and getattr(args, "end_to_end", False):
            from tf_sparse_split.tools.latency import latency_command

            return latency_command(args, out)
        if args.command == "profile":
            from tf_sparse_split.tools.profile import profile_command

            return profile_command(args, out)
    # ImportError includes LibraryLoadError.
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"tf-sparse-split: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        # TensorFlow's run-time errors (out of memory for a huge --hidden,
        # a model refusing the input) end the run with one line, not a
        # traceback.
        tf = sys.modules.get("tensorflow")
        if tf is None or not isinstance(e, tf.errors.OpError):
            raise
        print(f"tf-sparse-split: error: {type(e).__name__}: "
              f"{e.message.splitlines()[0] if e.message else e}",
              file=sys.stderr)
        return 1
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
