"""Benchmark: how long the layer *after* a SparseSplitMatMul takes.

A model's time is not the sum of its layers timed alone: the converted
MLP's input layer (784 -> 2048 at batch 32, ~82% zeros) ran 1.08x faster
than Keras' ``Dense`` in a sub-model that ends at it, yet the whole model
with only that layer converted ran 0.99x, because the next layer took
longer. This script measures that effect in one process, interleaved.

For each first op -- TensorFlow's ``relu(x @ w0 + b0)`` (fused by Grappler),
the same with ``a_is_sparse=True`` (the alternative a user has), and
``sparse_split_matmul`` with the same bias and ReLU, automatic
(threshold -1), forced all-sparse (threshold 1) and forced all-dense
(threshold 0) -- it times two ``tf.function``s: the first op alone, and the
first op followed by the next layer ``relu(h @ w1 + b1)`` (TensorFlow's
op). In every round the variants run in turn, ``--reps`` calls each, the
order rotated from round to round (``interleaved_blocks``); the next
layer's time after a first op is the round's chain time minus
its first-op time, and the table gives the median over rounds, its
interquartile range, and its ratio to the next layer's time after
TensorFlow's first op in the same rounds (> 1: the next layer is slower).

The input is ReLU-like (``max(z - q, 0)`` of a Gaussian z, q its
``--sparsity`` quantile), or with ``--mnist`` real MNIST test images
(pixel / 255, ~81% zeros; K = 784; scikit-learn's embedded digits in MNIST's
layout where the MNIST files are absent).

Usage: ``python benchmarks/bench_downstream.py [--batch 32] [--k 784]
[--n 2048] [--next-n 2048,256] [--sparsity 0.82] [--mnist] [--rounds 30]
[--reps 20] [--out benchmarks/results/bench_downstream.md]``
"""

import argparse
import os

import numpy as np

from _common import (interleaved_blocks, load_mnist_or_digits, markdown_table,
                     tf_machine_desc, write_report)

FIRSTS = (("tf", None), ("tf a_is_sparse", "a_is_sparse"),
          ("ours auto", -1.0), ("ours all-sparse", 1.0),
          ("ours all-dense", 0.0))


def _input(args, rng):
    if args.mnist:
        (_, _), (xt, _), desc = load_mnist_or_digits()
        return xt[: args.batch].astype(np.float32), f"test images of {desc}"
    z = rng.standard_normal((args.batch, args.k)).astype(np.float32)
    q = np.quantile(z, args.sparsity)
    return np.maximum(z - q, 0.0).astype(np.float32), "ReLU-like synthetic input"


def run(args):
    import tensorflow as tf

    import tf_sparse_split as tfss
    from tf_sparse_split._loader import build_info

    rng = np.random.default_rng(args.seed)
    x_np, x_desc = _input(args, rng)
    k = x_np.shape[1]
    x = tf.constant(x_np)
    zeros = float(np.mean(x_np == 0))
    w0 = tf.constant(rng.standard_normal((k, args.n)).astype(np.float32) * 0.05)
    b0 = tf.constant(np.zeros(args.n, np.float32))
    lines = []
    for next_n in args.next_n:
        w1 = tf.constant(
            rng.standard_normal((args.n, next_n)).astype(np.float32) * 0.05)
        b1 = tf.constant(np.zeros(next_n, np.float32))

        def first_fn(threshold):
            if threshold is None:
                return lambda: tf.nn.relu(tf.matmul(x, w0) + b0)
            if threshold == "a_is_sparse":
                return lambda: tf.nn.relu(
                    tf.matmul(x, w0, a_is_sparse=True) + b0)
            return lambda: tfss.sparse_split_matmul(
                x, w0, threshold=threshold, bias=b0, activation="relu")

        fns = {}
        for name, th in FIRSTS:
            first = first_fn(th)
            fns[(name, "alone")] = tf.function(first)
            fns[(name, "chain")] = tf.function(
                lambda first=first: tf.nn.relu(tf.matmul(first(), w1) + b1))
        for f in fns.values():
            for _ in range(args.warmup):
                f()
        times = interleaved_blocks(
            {key: (lambda i, f=f: f()) for key, f in fns.items()},
            args.rounds, args.reps)
        nxt = {name: np.array(times[(name, "chain")]) - np.array(times[(name, "alone")])
               for name, _ in FIRSTS}
        for name, _ in FIRSTS:
            d = nxt[name] * 1e3
            ratio = nxt[name] / nxt["tf"]
            lines.append(
                f"| {args.batch}x{k}x{args.n} -> {next_n} | {name} | "
                f"{np.median(times[(name, 'alone')]) * 1e3:.3f} | "
                f"{np.median(d):.3f} ({np.percentile(d, 25):.3f}-"
                f"{np.percentile(d, 75):.3f}) | {np.median(ratio):.3f} "
                f"({np.percentile(ratio, 25):.2f}-{np.percentile(ratio, 75):.2f}) |")
            print(lines[-1], flush=True)
    title = (f"Time of the next layer after the first op: {x_desc}, "
             f"{zeros:.0%} zeros, float32; {args.rounds} interleaved rounds x "
             f"{args.reps} calls; next = chain - first alone per round, median "
             f"(interquartile range); ratio = next after this first op / next "
             f"after TensorFlow's in the same round (> 1: slower); "
             f"{tf_machine_desc(build_info())}.")
    return markdown_table(
        "| first -> next | first op | first alone p50 ms | next layer ms | "
        "next / next after tf |", lines, title=title)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--k", type=int, default=784)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--next-n", default="2048,256",
                   help="comma-separated widths of the next layer")
    p.add_argument("--sparsity", type=float, default=0.82)
    p.add_argument("--mnist", action="store_true",
                   help="real MNIST test images as the first op's input")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(
        os.path.dirname(__file__), "results", "bench_downstream.md"))
    args = p.parse_args(argv)
    args.next_n = [int(v) for v in args.next_n.split(",")]
    write_report(args.out, run(args))


if __name__ == "__main__":
    main()
