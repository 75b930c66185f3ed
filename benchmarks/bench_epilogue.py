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
import os
import platform
import statistics
import time

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
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
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for v in order:
            fn = fns[v]
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(a, b, c).numpy()
                times.append(time.perf_counter() - t0)
            per_round[v].append(statistics.median(times))
    out = {"case": f"{m}x{k}x{n}", "sparsity": sparsity, "threshold": threshold}
    for v in VARIANTS:
        ts = per_round[v]
        out[v] = (statistics.median(ts) * 1e3, min(ts) * 1e3,
                  max(ts) / min(ts))
    return out


def to_markdown(rows, title):
    head = "| M x K x N | sparsity | threshold | " + " | ".join(
        f"{v} ms" for v in VARIANTS) + " | ours fused / tf fused | ours fused / ours unfused | our epilogue (ms) | TF's epilogue (ms) |"
    lines = [title, "", head, "|" + "---|" * (3 + len(VARIANTS) + 4)]
    for r in rows:
        cells = [f"{r[v][0]:.3f} (min {r[v][1]:.3f}, x{r[v][2]:.2f})" for v in VARIANTS]
        lines.append(
            f"| {r['case']} | {r['sparsity']:.2f} | {r['threshold']:g} | "
            + " | ".join(cells)
            + f" | {r['ours fused'][0] / r['tf fused'][0]:.3f} | "
            f"{r['ours fused'][0] / r['ours unfused'][0]:.3f} | "
            f"{r['ours fused'][0] - r['ours product'][0]:+.3f} | "
            f"{r['tf fused'][0] - r['tf matmul'][0]:+.3f} |")
    return "\n".join(lines) + "\n"


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
    info = build_info()
    title = (
        f"Fused epilogue (bias + relu), float32: medians over {args.rounds} "
        f"interleaved rounds of {args.reps} calls (min, and max/min of the "
        f"round medians = spread); TensorFlow {tf.__version__}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}), library built with "
        f"{info['MARCH']} ({info['ISA']}). 'our epilogue' = ours fused - ours "
        "product; 'TF's epilogue' = tf fused - tf matmul.")
    md = to_markdown(rows, title)
    print()
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
