"""Times the fused bias + activation epilogue of SparseSplitMatMul.

For each (M, K, N) and sparsity of the activation operand ``a`` it times,
interleaved in the same run (each variant a ``tf.function``):

* ``tf fused``: ``tf.nn.relu(tf.matmul(a, b) + bias)`` -- grappler fuses it
  into TF's ``_FusedMatMul`` (on the CPU with oneDNN: the
  ``_MklNativeFusedMatMul`` kernel; float32 only);
* ``tf matmul``: ``tf.matmul(a, b)`` alone (what the epilogue costs TF);
* ``ours fused``: ``sparse_split_matmul(a, b, bias=bias, activation='relu')``;
* ``ours unfused``: ``tf.nn.relu(sparse_split_matmul(a, b) + bias)``;
* ``ours product``: ``sparse_split_matmul(a, b)`` alone.

Medians and minima over rounds (each round runs every variant ``--reps``
times, in rotating order) and the spread (max/min of the round medians).

Usage::

    python benchmarks/bench_epilogue.py [--rounds 7] [--reps 10] [--out FILE]
"""

import argparse

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from _common import (format_median_min_spread, markdown_table,
                     median_min_spread_ms, median_time, rotated,
                     tf_machine_desc, write_report)
from tf_sparse_split._loader import build_info
from tf_sparse_split.testing import random_sparse

# (M, K, N, sparsity, threshold): the MLP 784-2048-2048-10's layers at batch
# 128 (all rows dense at threshold 0), a larger layer, and a sparse input.
CASES = [
    (128, 784, 2048, 0.5, 0.0),
    (128, 2048, 2048, 0.5, 0.0),
    (128, 2048, 10, 0.5, 0.0),
    (1024, 1024, 1024, 0.5, 0.0),
    (1024, 1024, 1024, 0.95, -1.0),
]
VARIANTS = ("tf fused", "tf matmul", "ours fused", "ours unfused",
            "ours product")


def _variants(threshold):
    thr = tf.constant(threshold, tf.float32)
    return {
        "tf fused": tf.function(lambda a, b, c: tf.nn.relu(tf.matmul(a, b) + c)),
        "tf matmul": tf.function(lambda a, b, c: tf.matmul(a, b)),
        "ours fused": tf.function(lambda a, b, c: tfss.sparse_split_matmul(
            a, b, thr, bias=c, activation="relu")),
        "ours unfused": tf.function(lambda a, b, c: tf.nn.relu(
            tfss.sparse_split_matmul(a, b, thr) + c)),
        "ours product": tf.function(lambda a, b, c: tfss.sparse_split_matmul(
            a, b, thr)),
    }


def run_case(m, k, n, sparsity, threshold, rounds, reps, rng):
    a = tf.constant(random_sparse((m, k), sparsity, rng, np.float32, "uniform"))
    b = tf.constant(rng.standard_normal((k, n)).astype(np.float32))
    c = tf.constant(rng.standard_normal(n).astype(np.float32))
    fns = _variants(threshold)
    ref = fns["tf fused"](a, b, c).numpy()
    got = fns["ours fused"](a, b, c).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    for fn in fns.values():  # warm-up (tracing, calibration)
        for _ in range(3):
            fn(a, b, c).numpy()
    per_round = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in rotated(VARIANTS, r):
            fn = fns[v]
            per_round[v].append(median_time(lambda: fn(a, b, c).numpy(), reps))
    out = {"case": f"{m}x{k}x{n}", "sparsity": sparsity, "threshold": threshold}
    for v in VARIANTS:
        out[v] = median_min_spread_ms(per_round[v])
    return out


def to_markdown(rows, title):
    head = "| M x K x N | sparsity | threshold | " + " | ".join(
        f"{v} ms" for v in VARIANTS) + " | ours fused / tf fused | ours fused / ours unfused | our epilogue (ms) | TF's epilogue (ms) |"
    lines = []
    for r in rows:
        cells = [format_median_min_spread(r[v]) for v in VARIANTS]
        lines.append(
            f"| {r['case']} | {r['sparsity']:.2f} | {r['threshold']:g} | "
            + " | ".join(cells)
            + f" | {r['ours fused'][0] / r['tf fused'][0]:.3f} | "
            f"{r['ours fused'][0] / r['ours unfused'][0]:.3f} | "
            f"{r['ours fused'][0] - r['ours product'][0]:+.3f} | "
            f"{r['tf fused'][0] - r['tf matmul'][0]:+.3f} |")
    return markdown_table(head, lines, title)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None, help="also write the markdown here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tfss.load_library()
    rng = np.random.default_rng(args.seed)
    rows = []
    for case in CASES:
        rows.append(run_case(*case, args.rounds, args.reps, rng))
        print(rows[-1], flush=True)
    title = (
        f"Fused epilogue (bias + relu), float32: medians over {args.rounds} "
        f"interleaved rounds of {args.reps} calls (min, and max/min of the "
        f"round medians = spread); {tf_machine_desc(build_info())}. "
        "'our epilogue' = ours fused - ours product; 'TF's epilogue' = "
        "tf fused - tf matmul.")
    md = to_markdown(rows, title)
    print()
    print(md)
    write_report(args.out, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
