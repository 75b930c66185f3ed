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

Every configuration is built as ``tf-sparse-split train`` builds it
(``tf_sparse_split.tools.train.build_model``, the threshold callback for the
split layers), with the same seed, initial weights and data order. The
machine is shared, so the configurations of a rate are interleaved: they
train epoch by epoch in rotated order (the epoch time is the median of
epochs 2..E: epoch 1 also traces and calibrates), then the steady-state step
time is measured in ``--rounds`` rounds of ``--block`` training steps per
model, again in rotated order. Speed-ups are baseline time / configuration
time (> 1 = faster): per round for steps (median and range over rounds),
and fastest round against fastest round. Accuracy is on the held-out test
split after the last epoch.

Few epochs by default (3) so that a default run takes a few minutes on 2
cores; accuracies are therefore those of a short run, not converged ones.

Usage::

    python3 benchmarks/bench_dropout.py [--data DIR] [--hidden 2048,2048]
        [--rates 0.3,0.5,0.7] [--epochs 3] [--out results.md]
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from _common import (cpus_desc, markdown_table, rotated,  # noqa: E402
                     write_report)

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
    p.add_argument("--rounds", type=parse_positive_int, default=8,
                   help="interleaved rounds of step timing (default 8)")
    p.add_argument("--block", type=parse_positive_int, default=8,
                   help="training steps per round and model (default 8)")
    p.add_argument("--groups", type=parse_positive_int, default=None,
                   help="pattern_groups of the row configuration's "
                        "ApproximateRandomDropout (default: the layer's, 8)")
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


def _build(config, rate, args, data):
    """Compiled model and callbacks of one configuration (same seed: every
    configuration starts from the same weights and data order)."""
    import keras

    from tf_sparse_split.callbacks import SplitThresholdCallback
    from tf_sparse_split.tools.train import build_model

    (x_train, _), (x_test, _) = data
    dropout = {"baseline": "standard", "standard+split": "standard",
               "row": "row", "tile": "tile"}[config]
    ns = argparse.Namespace(
        model="mlp", hidden=args.hidden, threshold=-1.0, seed=args.seed,
        dropout=dropout, dropout_rate=rate,
        tile_shape=args.tile_shape if dropout == "tile" else None,
        pattern_groups=args.groups)
    sparse = config != "baseline"
    keras.utils.set_random_seed(args.seed)
    model = build_model(ns, sparse, x_train, x_test, 10)[0]
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    return model, [SplitThresholdCallback()] if sparse else []


def _step_block_times(models, x, y, args):
    """Seconds per training step of each model, measured in alternating
    blocks of ``args.block`` steps, ``args.rounds`` rounds (rotated order);
    ``{config: [seconds per step of each round]}``."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    batches = [rng.choice(len(x), args.batch_size, replace=False)
               for _ in range(args.block)]
    for model, _ in models.values():   # trace every step function first
        model.train_on_batch(x[batches[0]], y[batches[0]])
    names = list(models)
    out = {name: [] for name in names}
    for r in range(args.rounds):
        for name in rotated(names, r):
            model = models[name][0]
            t0 = time.perf_counter()
            for b in batches:
                model.train_on_batch(x[b], y[b])
            out[name].append((time.perf_counter() - t0) / len(batches))
    return out


def main(argv=None):
    args = parse_args(argv)
    from tf_sparse_split.tools import datasets

    data = datasets.load_mnist(args.data)
    (x_train, y_train), (x_test, y_test) = data
    sizes = "-".join(str(s) for s in [784, *args.hidden, 10])
    print(f"MLP {sizes}, {x_train.shape[0]} train / {x_test.shape[0]} test "
          f"examples, batch {args.batch_size}, {args.epochs} epochs "
          f"(interleaved), then {args.rounds} rounds of {args.block} "
          f"interleaved steps; seed {args.seed}, tile {args.tile_shape}, row "
          f"pattern_groups {args.groups or 'default (8)'}",
          flush=True)
    rows = []
    t_all = time.perf_counter()
    for rate in args.rates:
        models = {c: _build(c, rate, args, data) for c in args.configs}
        epochs = {c: [] for c in args.configs}
        for epoch in range(args.epochs):
            # Same data order for every configuration in an epoch.
            order = np.random.default_rng(args.seed + epoch).permutation(
                len(x_train))
            for c in rotated(args.configs, epoch):
                model, cbs = models[c]
                t0 = time.perf_counter()
                model.fit(x_train[order], y_train[order], epochs=1,
                          batch_size=args.batch_size, shuffle=False,
                          callbacks=cbs, verbose=0)
                epochs[c].append(time.perf_counter() - t0)
            print(f"rate {rate:.1f} epoch {epoch + 1}: " + ", ".join(
                f"{c} {epochs[c][-1]:.2f} s" for c in args.configs),
                flush=True)
        steps = _step_block_times(models, x_train, y_train, args)
        base_steps = np.array(steps["baseline"])
        steady = slice(1, None) if args.epochs > 1 else slice(None)
        base_epoch = np.array(epochs["baseline"][steady])
        for c in args.configs:
            model = models[c][0]
            acc = model.evaluate(x_test, y_test, batch_size=args.batch_size,
                                 verbose=0)[1]
            ep = np.array(epochs[c][steady])
            st = np.array(steps[c])
            ratio = base_steps / st            # same round, same load
            rows.append((rate, c, float(np.median(ep)),
                         float(np.median(base_epoch) / np.median(ep)),
                         1e3 * float(np.median(st)), float(np.median(ratio)),
                         float(ratio.min()), float(ratio.max()),
                         float(base_steps.min() / st.min()), float(acc)))
            print(f"rate {rate:.1f} {c:<15} epoch {np.median(ep):6.3f} s "
                  f"(x{np.median(base_epoch) / np.median(ep):.2f}); step "
                  f"{1e3 * np.median(st):6.2f} ms, speed-up median "
                  f"{np.median(ratio):.2f}x ({ratio.min():.2f}-"
                  f"{ratio.max():.2f}), fastest/fastest "
                  f"{base_steps.min() / st.min():.2f}x; test acc {acc:.4f}",
                  flush=True)
    header = ("| rate | configuration | s/epoch (median 2..E) | epoch speed-up "
              "| ms/step (median) | step speed-up median (range) "
              "| fastest/fastest | test accuracy |")
    table = markdown_table(header, [
        f"| {rate:.1f} | {c} | {ep:.3f} | {eratio:.2f}x | {st:.2f} | "
        f"{med:.2f}x ({lo:.2f}-{hi:.2f}) | {best:.2f}x | {acc:.4f} |"
        for rate, c, ep, eratio, st, med, lo, hi, best, acc in rows])
    print()
    print(table, end="")
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    write_report(args.out, (
        f"# bench_dropout: MLP {sizes} on {args.data}\n\n"
        f"{x_train.shape[0]} train / {x_test.shape[0]} test examples, batch "
        f"{args.batch_size}, seed {args.seed}, tile {args.tile_shape}, row "
        f"pattern_groups {args.groups or 'default (8)'}, "
        f"{cpus_desc()}. All configurations of a rate train together, epoch "
        f"by epoch in rotated order ({args.epochs} epochs, same data order); "
        f"then {args.rounds} rounds of {args.block} training steps each, in "
        "rotated order. Speed-up = baseline (keras Dropout + Dense) time / "
        "time, per round for the step figures (median and range over "
        "rounds) and fastest round against fastest round. Test accuracy "
        "after the last epoch.\n\n" + table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
