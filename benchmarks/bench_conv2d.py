"""Benchmark: SparseSplitConv2D vs tf.nn.conv2d, forward and filter gradient.

Times, in the same process, TensorFlow's op (``tf.nn.conv2d`` forward,
``tf.raw_ops.Conv2DBackpropFilter`` filter gradient; both run oneDNN on x86
CPUs) against ours (``sparse_split_conv2d`` with the automatic threshold, and
forced all-sparse with threshold 1.0), all inside ``tf.function``, on real
layer shapes and inputs with a given fraction of exact zeros (uniformly
scattered), or with half of the input channels all zero ("50% ch").
Prints a table of ratios (TF time / our time: > 1 means we are faster) and
writes it as markdown with ``--out``.

Usage: ``python benchmarks/bench_conv2d.py [--quick] [--out table.md]``
"""

import argparse
import sys
import time

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import testing as T

# name, N, H, W, C_in, C_out, K
SHAPES = [
    ("MNIST conv1 64x28x28 1->32 3x3", 64, 28, 28, 1, 32, 3),
    ("MNIST conv2 64x14x14 32->64 3x3", 64, 14, 14, 32, 64, 3),
    ("ResNet stage 32x56x56 64->64 3x3", 32, 56, 56, 64, 64, 3),
]
PATTERNS = [0.0, 0.5, 0.8, 0.9, 0.95, 0.99, "50% ch"]


def _time(fn, min_time, min_reps=3, max_reps=50):
    """Median seconds of fn() over repetitions (after 2 warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_time and
                                    len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def run(min_time, out=sys.stdout, shapes=SHAPES):
    lib = tfss.load_library()
    rows = []
    for name, n, h, w, ci, co, k in shapes:
        rng = np.random.default_rng(0)
        f = tf.constant(rng.normal(size=(k, k, ci, co)).astype(np.float32))
        dy = tf.constant(rng.normal(size=(n, h, w, co)).astype(np.float32))
        fsize = tf.constant([k, k, ci, co])
        strides = [1, 1, 1, 1]

        tf_fwd = tf.function(lambda x: tf.nn.conv2d(x, f, 1, "SAME"))
        ours_fwd = tf.function(lambda x, t: tfss.sparse_split_conv2d(
            x, f, 1, "SAME", threshold=t))
        tf_bwf = tf.function(lambda x: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=fsize, out_backprop=dy, strides=strides,
            padding="SAME"))
        ours_bwf = tf.function(lambda x, t: lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
            x, fsize, dy, t, strides=strides, padding="SAME")[0])
        for pat in PATTERNS:
            if pat == "50% ch":
                if ci < 2:
                    continue
                x = T.random_sparse_images((n, h, w, ci), 0.0, rng,
                                           zero_channels=0.5)
            else:
                x = T.random_sparse_images((n, h, w, ci), pat, rng)
            x = tf.constant(x)
            auto, sparse = tf.constant(-1.0), tf.constant(1.0)
            # Same answer check (cheap insurance for the numbers below).
            ref = tf_fwd(x).numpy()
            err = T.relative_error(ours_fwd(x, auto), ref)
            assert err < 1e-4, (name, pat, err)
            t_tf = _time(lambda: tf_fwd(x).numpy(), min_time)
            t_auto = _time(lambda: ours_fwd(x, auto).numpy(), min_time)
            t_sp = _time(lambda: ours_fwd(x, sparse).numpy(), min_time)
            b_tf = _time(lambda: tf_bwf(x).numpy(), min_time)
            b_auto = _time(lambda: ours_bwf(x, auto).numpy(), min_time)
            b_sp = _time(lambda: ours_bwf(x, sparse).numpy(), min_time)
            row = (name, pat if isinstance(pat, str) else f"{pat:.2f}",
                   t_tf * 1e3, t_tf / t_auto, t_tf / t_sp,
                   b_tf * 1e3, b_tf / b_auto, b_tf / b_sp)
            rows.append(row)
            print(f"{row[0]:<34} {row[1]:>7}  fwd tf {row[2]:8.2f} ms  "
                  f"auto {row[3]:5.2f}x  sparse {row[4]:5.2f}x | dF tf "
                  f"{row[5]:8.2f} ms  auto {row[6]:5.2f}x  sparse "
                  f"{row[7]:5.2f}x", file=out, flush=True)
    return rows


def markdown(rows):
    lines = [
        "| layer shape | input sparsity | tf.nn.conv2d fwd (ms) | fwd ratio, "
        "auto | fwd ratio, all sparse | Conv2DBackpropFilter (ms) | dF "
        "ratio, auto | dF ratio, all sparse |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | "
                     f"{r[4]:.2f} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.2f} |")
    lines.append("")
    lines.append("Ratios are TF time / our time (> 1: ours faster); median "
                 "of repeated calls inside tf.function, float32, SAME "
                 "padding, stride 1.")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the table as markdown to this path")
    p.add_argument("--quick", action="store_true",
                   help="shorter timing (0.15 s per measurement)")
    p.add_argument("--min-time", type=float, default=0.4,
                   help="seconds per measurement (default 0.4)")
    args = p.parse_args(argv)
    info = tfss._loader.build_info()
    print(f"tf {tf.__version__}, library built with {info['MARCH']} "
          f"({info['ISA']}), {tf.config.threading.get_intra_op_parallelism_threads() or 'default'} "
          "intra-op threads")
    rows = run(0.15 if args.quick else args.min_time)
    table = markdown(rows)
    print()
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
