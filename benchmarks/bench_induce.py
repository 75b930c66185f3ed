"""Induced sparsity and SparseSplitLSTM against plain Keras.

For each case -- MLP 784-2048-2048-10 with ``SparsityTargetCallback(0.9)``
vs plain ``keras.layers.Dense``; the CLI's CNN with target 0.8 vs plain
``keras.layers.Conv2D``; ``SparseSplitLSTM`` with row-pattern dropout vs
``keras.layers.LSTM`` with the same rates -- both models train the same
epochs on the same data, epoch by epoch in turn (same seed and initial
weights), then the steady-state step time is measured by alternating blocks
of ``--block`` training steps of the two models, ``--rounds`` times (the
machine is shared: interleaving exposes both to the same load). Prints test
accuracy, per-layer input sparsity (inference, test set) and the step-time
ratio (median, min, max over rounds; > 1 = ours faster).

  python benchmarks/bench_induce.py --data ../shared/data/mnist --case mlp
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_sparse_split as tfss  # noqa: E402
from tf_sparse_split.tools import datasets, models  # noqa: E402
from tf_sparse_split.tools.train import (input_sparsity,  # noqa: E402
                                          train_step_times)


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    return model


def build_pair(case, args, side):
    keras.utils.set_random_seed(args.seed)
    if case == "mlp":
        ours = models.build_mlp(side * side, [2048, 2048], 10, sparse=True)
        keras.utils.set_random_seed(args.seed)
        ref = models.build_mlp(side * side, [2048, 2048], 10, sparse=False)
        cbs = [tfss.SparsityTargetCallback(args.mlp_target, l1=args.l1),
               tfss.SplitThresholdCallback()]
    elif case == "cnn":
        ours = models.build_cnn(side, [16, 32], 10, sparse=True)
        keras.utils.set_random_seed(args.seed)
        ref = models.build_cnn(side, [16, 32], 10, sparse=False)
        cbs = [tfss.SparsityTargetCallback(args.cnn_target, l1=args.l1),
               tfss.SplitThresholdCallback()]
    else:
        kw = dict(dropout=args.pattern, dropout_rate=args.rate,
                  recurrent_dropout_rate=args.rate, seed=args.seed)
        ours = models.build_lstm(side, side, args.units, 10, sparse=True,
                                 pattern_groups=args.groups, **kw)
        keras.utils.set_random_seed(args.seed)
        ref = models.build_lstm(side, side, args.units, 10, sparse=False,
                                **kw)
        cbs = []
        ref.set_weights(ours.get_weights())  # same weights, same layout
    return _compile(ours), _compile(ref), cbs


def reshape(case, x, side):
    if case == "cnn":
        return x.reshape(-1, side, side, 1)
    if case == "lstm":
        return x.reshape(-1, side, side)
    return x


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=None)
    p.add_argument("--case", choices=("mlp", "cnn", "lstm"), required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mlp-target", type=float, default=0.9)
    p.add_argument("--cnn-target", type=float, default=0.8)
    p.add_argument("--l1", type=float, default=2.0,
                   help="SparsityTargetCallback l1 (mlp, cnn)")
    p.add_argument("--units", type=int, default=256)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--pattern", default="row")
    p.add_argument("--groups", type=int, default=None,
                   help="SparseSplitLSTM pattern_groups (lstm; default: "
                        "the layer's default)")
    args = p.parse_args()

    if args.data:
        (x, y), (xt, yt) = datasets.load_mnist(args.data)
    else:
        (x, y), (xt, yt) = datasets.load_digits()
    side = int(round(x.shape[1] ** 0.5))
    x, xt = reshape(args.case, x, side), reshape(args.case, xt, side)
    ours, ref, cbs = build_pair(args.case, args, side)
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        ours.fit(x, y, epochs=1, batch_size=args.batch_size, verbose=0,
                 callbacks=cbs)
        t1 = time.perf_counter()
        ref.fit(x, y, epochs=1, batch_size=args.batch_size, verbose=0)
        t2 = time.perf_counter()
        print(f"epoch {epoch + 1}: ours {t1 - t0:.2f} s, plain {t2 - t1:.2f}"
              f" s; test acc ours {ours.evaluate(xt, yt, verbose=0)[1]:.4f}"
              f" plain {ref.evaluate(xt, yt, verbose=0)[1]:.4f}", flush=True)
        if args.case != "lstm":   # per-layer sparsity curve over epochs
            sp_o = input_sparsity(ours, xt[:1000])
            sp_r = input_sparsity(ref, xt[:1000])
            print("  input sparsity ours/plain: " + ", ".join(
                f"{name} {sp_o[name]:.3f}/{sp_r.get(name, float('nan')):.3f}"
                for name in sp_o), flush=True)
    acc_o = ours.evaluate(xt, yt, verbose=0)[1]
    acc_r = ref.evaluate(xt, yt, verbose=0)[1]
    sp_o, sp_r = input_sparsity(ours, xt), input_sparsity(ref, xt)

    # Steady state: alternate blocks of training steps (the induction keeps
    # running: the FATReLUs track their targets in-graph).
    rng = np.random.default_rng(args.seed)
    times, _ = train_step_times({"ours": ours, "plain": ref}, x, y,
                                args.batch_size, rounds=args.rounds,
                                block=args.block, rng=rng,
                                distinct_batches=args.block)
    t_o, t_r = np.array(times["ours"]), np.array(times["plain"])
    ratio = t_r / t_o
    if args.case == "lstm":
        print(f"\nSparseSplitLSTM pattern={args.pattern} pattern_groups="
              f"{ours.get_layer('lstm').cell.pattern_groups}", end="")
    print(f"\ncase {args.case}: test accuracy ours {acc_o:.4f}, plain "
          f"{acc_r:.4f} (diff {acc_o - acc_r:+.4f})")
    for layer in ours.layers:
        if isinstance(layer, tfss.SparseSplitLayer):
            st = layer.latest_stats()
            print(f"  {layer.name}: latest training call: all-zero input "
                  f"columns {int(st['zero_cols_skipped'])}/{int(st['k'])}, "
                  f"rows dense/sparse {int(st['rows_dense'])}/"
                  f"{int(st['rows_sparse'])}")
    for name in sp_o:
        print(f"  {name} input sparsity: ours {sp_o[name]:.3f}, plain "
              f"{sp_r.get(name, float('nan')):.3f}")
    print(f"  step time ours median {1e3 * np.median(t_o):.1f} ms "
          f"({1e3 * t_o.min():.1f}-{1e3 * t_o.max():.1f}), plain median "
          f"{1e3 * np.median(t_r):.1f} ms ({1e3 * t_r.min():.1f}-"
          f"{1e3 * t_r.max():.1f})")
    print(f"  speed-up plain/ours: median {np.median(ratio):.2f}x, range "
          f"{ratio.min():.2f}-{ratio.max():.2f}x over {args.rounds} rounds, "
          f"min/min {t_r.min() / t_o.min():.2f}x")


if __name__ == "__main__":
    main()
