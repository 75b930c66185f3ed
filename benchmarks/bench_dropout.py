"""Training time and accuracy: structured dropout + SparseSplitDense vs
keras.layers.Dropout + keras.layers.Dense.

The same MLP (default 784-2048-2048-10, ReLU, a dropout layer after every
hidden layer, softmax output, Adam 1e-3, batch 128) is trained on MNIST
(``tf_sparse_split.tools.datasets.load_mnist``) with, for every rate:

* ``baseline``: ``keras.layers.Dense`` + ``keras.layers.Dropout`` -- the
  TensorFlow ops ours replace;
* ``standard+split``: ``SparseSplitDense`` + ``keras.layers.Dropout``
  (unstructured zeros: what the split op gets from ordinary dropout);
* ``row`` / ``tile``: ``SparseSplitDense`` + ``ApproximateRandomDropout``
  with row or tile patterns (the threshold callback as in
  ``tf-sparse-split train``).

Every configuration uses the same seed, data order and epochs, through the
same code path as ``tf-sparse-split train``
(``tf_sparse_split.tools.train.run``). Time per epoch is
the median over epochs 2..E (epoch 1 includes tracing the training function
and the op's first timings) -- or epoch 1 alone with ``--epochs 1``. The
ratio is baseline time / configuration time at the same rate (> 1 = faster).
Accuracy is on the held-out test split after the last epoch.

Few epochs by default (3) so that a default run takes a few minutes on 2
cores; accuracies are therefore those of a short run, not converged ones.

Usage::

    python3 benchmarks/bench_dropout.py [--data DIR] [--hidden 2048,2048]
        [--rates 0.3,0.5,0.7] [--epochs 3] [--out results.md]
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _common import markdown_table, write_report  # noqa: E402

CONFIGS = ("baseline", "standard+split", "row", "tile")


def _rates(text):
    out = [float(t) for t in text.split(",") if t.strip()]
    for r in out:
        if not 0.0 <= r < 1.0:
            raise argparse.ArgumentTypeError(f"rate must be in [0, 1): {r}")
    return out


def parse_args(argv=None):
    from tf_sparse_split.tools.cli import (parse_int_list, parse_positive_int,
                                           parse_tile_shape)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="/work/shared/data/mnist",
                   help="MNIST IDX directory (default /work/shared/data/mnist)")
    p.add_argument("--hidden", type=parse_int_list, default=[2048, 2048],
                   metavar="N,N", help="hidden sizes (default 2048,2048)")
    p.add_argument("--rates", type=_rates, default=[0.3, 0.5, 0.7],
                   help="dropout rates (default 0.3,0.5,0.7)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"subset of {','.join(CONFIGS)}")
    p.add_argument("--epochs", type=parse_positive_int, default=3)
    p.add_argument("--batch-size", type=parse_positive_int, default=128)
    p.add_argument("--tile-shape", type=parse_tile_shape, default=(32, 32),
                   metavar="ROWS,UNITS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write a markdown table here")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in args.configs:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}; choose from {CONFIGS}")
    if "baseline" not in args.configs:
        args.configs.insert(0, "baseline")
    return args


def run_one(config, rate, args, data):
    from tf_sparse_split.tools.train import run

    (x_train, y_train), (x_test, y_test) = data
    dropout = {"baseline": "standard", "standard+split": "standard",
               "row": "row", "tile": "tile"}[config]
    ns = argparse.Namespace(
        epochs=args.epochs, batch_size=args.batch_size, hidden=args.hidden,
        lr=1e-3, seed=args.seed, threshold=-1.0, quiet=True,
        dropout=dropout, dropout_rate=rate,
        tile_shape=args.tile_shape if dropout == "tile" else None)
    res = run(ns, config != "baseline", x_train, y_train, x_test,
              y_test, 10, None)
    times = res["epoch_times"]
    res["time"] = statistics.median(times[1:] if len(times) > 1 else times)
    return res


def main(argv=None):
    args = parse_args(argv)
    from tf_sparse_split.tools import datasets

    data = datasets.load_mnist(args.data)
    (x_train, _), (x_test, _) = data
    sizes = "-".join(str(s) for s in [784, *args.hidden, 10])
    print(f"MLP {sizes}, {x_train.shape[0]} train / {x_test.shape[0]} test "
          f"examples, batch {args.batch_size}, {args.epochs} epochs, seed "
          f"{args.seed}, tile {args.tile_shape}", flush=True)
    rows = []
    t_all = time.perf_counter()
    for rate in args.rates:
        base = None
        for config in args.configs:
            res = run_one(config, rate, args, data)
            if config == "baseline":
                base = res["time"]
            ratio = base / res["time"]
            rows.append((rate, config, res["time"], ratio,
                         res["test_accuracy"], res["accuracy"]))
            print(f"rate {rate:.1f} {config:<15} {res['time']:7.3f} s/epoch "
                  f"ratio {ratio:5.2f}x  test acc {res['test_accuracy']:.4f}",
                  flush=True)
    header = ("| rate | configuration | s/epoch | speed-up vs Dropout+Dense "
              "| test accuracy | train accuracy |")
    table = markdown_table(header, [
        f"| {rate:.1f} | {config} | {t:.3f} | {ratio:.2f}x | {acc:.4f} | "
        f"{tacc:.4f} |" for rate, config, t, ratio, acc, tacc in rows])
    print()
    print(table, end="")
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    write_report(args.out, (
        f"# bench_dropout: MLP {sizes} on {args.data}\n\n"
        f"{x_train.shape[0]} train / {x_test.shape[0]} test examples, batch "
        f"{args.batch_size}, {args.epochs} epochs, seed {args.seed}, tile "
        f"{args.tile_shape}. Time per epoch: median of epochs 2..E. Speed-up "
        "= baseline (keras Dropout + Dense) time / time.\n\n" + table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
