"""Times SparseSplitMatMul against tf.matmul in the same run.

For each (M, K, N) and sparsity of the activation ``a`` (zeros uniformly at
random, plus one row-structured case), it times the forward product and the
gradient for ``b`` (``a^T @ dY``) of both, and prints ratios
``t(tf.matmul) / t(ours)`` (> 1: ours is faster). Our op runs with the
automatic threshold (``-1``) unless ``--threshold`` is given.

Usage::

    python benchmarks/bench_matmul.py [--reps 10] [--out bench_matmul.md]
"""

import argparse
import os
import platform
import statistics
import time

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split.tuning import stats as S
from tf_sparse_split._loader import build_info
from tf_sparse_split.testing import random_sparse

SHAPES = [(256, 1024, 1024), (1024, 4096, 1024)]
SPARSITIES = [0.0, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99]


def _median_time(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_case(m, k, n, sparsity, structure, reps, threshold, rng):
    a = tf.constant(random_sparse((m, k), sparsity, rng, np.float32, structure))
    b = tf.constant(rng.standard_normal((k, n)).astype(np.float32))
    dy = tf.constant(rng.standard_normal((m, n)).astype(np.float32))
    # .numpy() waits for the result; both sides pay the same copy.
    t_tf_fwd = _median_time(lambda: tf.matmul(a, b).numpy(), reps)
    t_ours_fwd = _median_time(lambda: tfss.sparse_split_matmul(a, b, threshold).numpy(), reps)
    t_tf_grad = _median_time(lambda: tf.matmul(a, dy, transpose_a=True).numpy(), reps)
    t_ours_grad = _median_time(
        lambda: tfss.sparse_split_matmul(a, dy, threshold, transpose_a=True).numpy(), reps)
    _, st = tfss.sparse_split_matmul(a, b, threshold, return_stats=True)
    st = st.numpy()
    return {
        "shape": f"{m}x{k}x{n}", "sparsity": sparsity, "structure": structure,
        "tf_fwd_ms": t_tf_fwd * 1e3, "ours_fwd_ms": t_ours_fwd * 1e3,
        "fwd_ratio": t_tf_fwd / t_ours_fwd,
        "tf_grad_ms": t_tf_grad * 1e3, "ours_grad_ms": t_ours_grad * 1e3,
        "grad_ratio": t_tf_grad / t_ours_grad,
        "threshold": st[S.THRESHOLD], "rows_dense": int(st[S.ROWS_DENSE]),
    }


HEADER = ("| M x K x N | sparsity | zeros | tf.matmul fwd (ms) | ours fwd (ms) | "
          "fwd ratio | tf grad_b (ms) | ours grad_b (ms) | grad_b ratio | "
          "threshold used | rows dense |")


def to_markdown(rows, title):
    lines = [title, "", HEADER, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['sparsity']:.2f} | {r['structure']} | "
            f"{r['tf_fwd_ms']:.2f} | {r['ours_fwd_ms']:.2f} | **{r['fwd_ratio']:.2f}x** | "
            f"{r['tf_grad_ms']:.2f} | {r['ours_grad_ms']:.2f} | **{r['grad_ratio']:.2f}x** | "
            f"{r['threshold']:.3f} | {r['rows_dense']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (median)")
    p.add_argument("--threshold", type=float, default=-1.0,
                   help="our op's density threshold (negative: automatic)")
    p.add_argument("--quick", action="store_true", help="small shape only")
    p.add_argument("--out", default=None, help="also write the table as markdown here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tfss.load_library()
    rng = np.random.default_rng(args.seed)
    shapes = SHAPES[:1] if args.quick else SHAPES
    cases = [(s, sp, "uniform") for s in shapes for sp in SPARSITIES]
    cases += [(s, 0.9, "rows") for s in shapes]
    rows = []
    print(HEADER)
    for (m, k, n), sp, structure in cases:
        r = run_case(m, k, n, sp, structure, args.reps, args.threshold, rng)
        rows.append(r)
        print(to_markdown([r], "").splitlines()[-1], flush=True)
    info = build_info()
    title = (f"SparseSplitMatMul vs tf.matmul, float32, ratio = t(tf) / t(ours), "
             f"median of {args.reps}; TensorFlow {tf.__version__}, {os.cpu_count()} "
             f"CPUs ({platform.machine()}), library built with {info['MARCH']} "
             f"({info['ISA']}); threshold "
             f"{'automatic' if args.threshold < 0 else args.threshold}.")
    md = to_markdown(rows, title)
    print()
    print(title)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
