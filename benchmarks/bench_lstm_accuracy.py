"""Test accuracy and step speed of ``SparseSplitLSTM`` against
``keras.layers.LSTM`` with the same arguments, over several seeds.

MNIST rows as sequences (28 steps of 28 pixels), the 10,000-image MNIST
set split 8,000 / 2,000 (``tools/datasets.load_mnist``), ``LSTM(units,
dropout=rate, recurrent_dropout=rate, seed=seed)`` -> ``Dense(10,
softmax)``, Adam 1e-3, batch 128. Per seed both models start from the
same weights (ours' kernels copied into Keras' layer: same shapes and gate
order), see the same batches in the same order (one permutation per epoch,
drawn from the seed; ``fit(shuffle=False)``) and train epoch by epoch in
turn; test accuracy is taken after every epoch. Then the step time is
measured by interleaved blocks of ``--block`` ``train_on_batch`` steps,
``--rounds`` times per seed (alternating which model goes first); the
speed-up is Keras' block time over ours (> 1: ours faster), reported as
median and range over all blocks of all seeds.

Writes a markdown table (``--out``, default
``benchmarks/results/bench_lstm_accuracy.md``).

  python benchmarks/bench_lstm_accuracy.py --data ../shared/data/mnist
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_sparse_split as tfss  # noqa: E402
from tf_sparse_split.tools import datasets  # noqa: E402
from _common import markdown_table, rotated, write_report  # noqa: E402
from tf_sparse_split.tools.train import train_step_times  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def build(sparse, args, seed, timesteps, features):
    kw = dict(dropout=args.rate, recurrent_dropout=args.rate, seed=seed,
              name="lstm")
    if sparse:
        extra = {}
        if args.pattern is not None:
            extra["pattern"] = args.pattern
        if args.groups is not None:
            extra["pattern_groups"] = args.groups
        if args.group_share is not None:
            extra["recurrent_group_share"] = args.group_share
        rnn = tfss.SparseSplitLSTM(args.units, **kw, **extra)
    else:
        rnn = keras.layers.LSTM(args.units, **kw)
    model = keras.Sequential(
        [keras.Input((timesteps, features)), rnn,
         keras.layers.Dense(10, activation="softmax", name="output")])
    model.compile(optimizer=keras.optimizers.Adam(args.lr),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    return model


def run_seed(seed, args, data):
    (x, y), (xt, yt) = data
    keras.utils.set_random_seed(seed)
    ours = build(True, args, seed, x.shape[1], x.shape[2])
    ref = build(False, args, seed, x.shape[1], x.shape[2])
    ref.set_weights(ours.get_weights())   # same shapes and layout
    rng = np.random.default_rng(seed)
    acc = {"ours": [], "keras": []}
    for epoch in range(args.epochs):
        perm = rng.permutation(len(x))
        xe, ye = x[perm], y[perm]
        line = [f"seed {seed} epoch {epoch + 1}:"]
        for name, m in rotated([("ours", ours), ("keras", ref)], epoch):
            if name == "keras" and args.skip_keras:
                acc[name].append(float("nan"))
                continue
            t0 = time.perf_counter()
            m.fit(xe, ye, epochs=1, batch_size=args.batch_size,
                  shuffle=False, verbose=0)
            dt = time.perf_counter() - t0
            acc[name].append(float(m.evaluate(xt, yt, verbose=0,
                                              batch_size=500)[1]))
            line.append(f"{name} {acc[name][-1]:.4f} ({dt:.1f} s)")
        print(" ".join(line), flush=True)
    if args.skip_keras:
        return acc, {"ours": [1.0], "keras": [1.0]}, [1.0], \
            ours.get_layer("lstm").get_config()
    # Step time: interleaved blocks of train_on_batch steps.
    times, _ = train_step_times({"ours": ours, "keras": ref}, x, y,
                                args.batch_size, rounds=args.rounds,
                                block=args.block, rng=rng,
                                distinct_batches=args.block)
    ratios = [k / o for k, o in zip(times["keras"], times["ours"])]
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(f"seed {seed}: step ours {med['ours']:.1f} ms, keras "
          f"{med['keras']:.1f} ms, "
          f"speed-up median {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    layer = ours.get_layer("lstm")
    return acc, times, ratios, layer.get_config()


def mean_std(values):
    values = np.asarray(values, dtype=float)
    return (float(values.mean()),
            float(values.std(ddof=1)) if len(values) > 1 else 0.0)


def report(args, results, config):
    seeds = [r[0] for r in results]
    acc = {n: np.array([r[1][n] for r in results]) for n in ("ours", "keras")}
    ratios = [q for r in results for q in r[3]]
    t_o = [t for r in results for t in r[2]["ours"]]
    t_k = [t for r in results for t in r[2]["keras"]]
    title = (f"# SparseSplitLSTM vs keras.layers.LSTM: test accuracy and "
             f"step speed\n\nMNIST rows (28 steps x 28 pixels), 8,000 train /"
             f" 2,000 test, LSTM({args.units}, dropout={args.rate}, "
             f"recurrent_dropout={args.rate}) -> Dense(10), Adam {args.lr}, "
             f"batch {args.batch_size}, {args.epochs} epochs, seeds "
             f"{', '.join(map(str, seeds))}; same initial weights and batch "
             f"order per seed. SparseSplitLSTM pattern="
             f"{config['pattern']!r}, pattern_groups="
             f"{config['pattern_groups']}, recurrent_group_share="
             f"{config.get('recurrent_group_share', 1.0)}. Measured on a shared 2-core "
             f"machine under load (`benchmarks/bench_lstm_accuracy.py`).")
    rows = []
    for i, seed in enumerate(seeds):
        o, k = acc["ours"][i], acc["keras"][i]
        rows.append(f"| {seed} | " + " | ".join(
            f"{a:.4f} / {b:.4f}" for a, b in zip(o, k))
            + f" | {o[-1] - k[-1]:+.4f} |")
    mo, mk = acc["ours"].mean(0), acc["keras"].mean(0)
    rows.append("| mean | " + " | ".join(
        f"{a:.4f} / {b:.4f}" for a, b in zip(mo, mk))
        + f" | {mo[-1] - mk[-1]:+.4f} |")
    so = acc["ours"].std(0, ddof=1) if len(seeds) > 1 else 0 * mo
    sk = acc["keras"].std(0, ddof=1) if len(seeds) > 1 else 0 * mk
    rows.append("| std | " + " | ".join(
        f"{a:.4f} / {b:.4f}" for a, b in zip(so, sk)) + " | |")
    header = ("| seed | " + " | ".join(f"epoch {e + 1} ours / Keras"
                                       for e in range(args.epochs))
              + " | final diff |")
    text = markdown_table(header, rows, title=title)
    fo, fk = mean_std(list(acc["ours"][:, -1])), \
        mean_std(list(acc["keras"][:, -1]))
    diffs = acc["ours"][:, -1] - acc["keras"][:, -1]
    text += (f"\nFinal test accuracy (after epoch {args.epochs}), mean +- "
             f"std over {len(seeds)} seeds: ours {fo[0]:.4f} +- {fo[1]:.4f},"
             f" Keras {fk[0]:.4f} +- {fk[1]:.4f}; difference "
             f"{100 * diffs.mean():+.2f} +- "
             f"{100 * (diffs.std(ddof=1) if len(seeds) > 1 else 0):.2f} "
             f"points.\n")
    text += (f"\nStep time ({args.rounds} interleaved blocks of {args.block}"
             f" `train_on_batch` steps per seed): ours median "
             f"{1e3 * statistics.median(t_o):.1f} ms, Keras "
             f"{1e3 * statistics.median(t_k):.1f} ms; speed-up Keras/ours "
             f"median **{statistics.median(ratios):.2f}x** (range "
             f"{min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} "
             f"blocks).\n")
    rows = []
    for seed, _, times, ratios in results:
        rows.append(f"| {seed} | {1e3 * statistics.median(times['ours']):.1f}"
                    f" | {1e3 * statistics.median(times['keras']):.1f} | "
                    f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-"
                    f"{max(ratios):.2f}x) |")
    text += "\n" + markdown_table(
        "| seed | step ms ours | step ms Keras | speed-up median (range) |",
        rows)
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.path.join(HERE, "..", "..", "shared",
                                                  "data", "mnist"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--units", type=int, default=256)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--train-size", type=int, default=None,
                   help="use only the first N training images (short runs)")
    p.add_argument("--pattern", default=None,
                   help="SparseSplitLSTM pattern (default: the layer's)")
    p.add_argument("--groups", type=int, default=None,
                   help="SparseSplitLSTM pattern_groups (default: the "
                        "layer's)")
    p.add_argument("--group-share", type=float, default=None,
                   help="SparseSplitLSTM recurrent_group_share (default: "
                        "the layer's)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--skip-keras", action="store_true",
                   help="train only SparseSplitLSTM (short exploratory runs;"
                        " no speed measurement)")
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--out", default=os.path.join(
        HERE, "results", "bench_lstm_accuracy.md"),
        help="markdown report ('' for none)")
    args = p.parse_args()
    try:
        (x, y), (xt, yt) = datasets.load_mnist(args.data)
    except FileNotFoundError as e:
        print(f"bench_lstm_accuracy: MNIST not available ({e}); nothing "
              "measured", file=sys.stderr)
        return 0
    side = int(round(x.shape[1] ** 0.5))
    x, xt = x.reshape(-1, side, side), xt.reshape(-1, side, side)
    if args.train_size:
        x, y = x[:args.train_size], y[:args.train_size]
    results, config = [], None
    for seed in args.seeds:
        acc, times, ratios, config = run_seed(seed, args, ((x, y), (xt, yt)))
        results.append((seed, acc, times, ratios))
    text = report(args, results, config)
    print(text)
    write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
