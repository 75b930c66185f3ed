"""The stride-1 input gradient of a convolution: ``SparseSplitConv2DBackpropInput``
(automatic threshold, and forced all-sparse) against TensorFlow's
``Conv2DBackpropInput`` on the same filter, and against the formulation it
replaced (a forward ``SparseSplitConv2D`` of ``dY`` with the filter rotated
in the graph by reverse + transpose).

Each ``tf.function`` takes ``(filter, dY)``; the calls are interleaved
(:func:`tf_sparse_split.tools.timing.interleaved_blocks`) and reported as
median milliseconds per call with their range, and the speed-up of each
against TensorFlow's kernel as the median of the per-round ratios.

Usage::

    python benchmarks/bench_conv2d_input_grad.py [--shape 32,56,56,64,64]
        [--sparsities 0,0.5,0.9] [--rounds 15] [--block 3] [--out FILE]
"""

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from _common import (interleaved_blocks, markdown_table,  # noqa: E402
                     speedup_summary, tf_machine_desc, write_report)
from tf_sparse_split._loader import build_info, load_library  # noqa: E402
from tf_sparse_split.ops.conv2d import (  # noqa: E402
    sparse_split_conv2d_backprop_input)
from tf_sparse_split.testing import random_sparse_images  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="32,56,56,64,64",
                   help="N,H,W,C_in,C_out (3x3 filter, SAME, stride 1)")
    p.add_argument("--sparsities", default="0,0.5,0.9",
                   help="fractions of zeros in dY")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--block", type=int, default=3)
    p.add_argument("--out", default=None, help="markdown report path")
    args = p.parse_args(argv)
    n, h, w, ci, co = (int(v) for v in args.shape.split(","))
    rng = np.random.default_rng(0)
    f = tf.constant(rng.normal(size=(3, 3, ci, co)).astype(np.float32) * 0.1)
    sizes = tf.constant([n, h, w, ci], tf.int32)
    lib = load_library()

    @tf.function
    def tf_op(f, dy):
        return tf.raw_ops.Conv2DBackpropInput(
            input_sizes=sizes, filter=f, out_backprop=dy,
            strides=[1, 1, 1, 1], padding="SAME")

    @tf.function
    def ours(f, dy):
        return sparse_split_conv2d_backprop_input(sizes, f, dy, "SAME")

    @tf.function
    def ours_sparse(f, dy):
        return sparse_split_conv2d_backprop_input(sizes, f, dy, "SAME",
                                                  threshold=1.0)

    @tf.function
    def rotated(f, dy):
        fr = tf.transpose(tf.reverse(f, axis=[0, 1]), [0, 1, 3, 2])
        return lib.tf_sparse_split_sparse_split_conv2d(
            dy, fr, tf.constant(-1.0), [], strides=[1, 1, 1, 1],
            padding="SAME", full_stats=False)[0]

    fns = {"TF Conv2DBackpropInput": tf_op, "ours (auto)": ours,
           "ours (all sparse)": ours_sparse,
           "rotated filter + SparseSplitConv2D (auto)": rotated}
    rows = []
    for s in (float(v) for v in args.sparsities.split(",")):
        dy = tf.constant(random_sparse_images((n, h, w, co), s, rng))
        want = tf_op(f, dy).numpy()
        for name, fn in fns.items():
            got = fn(f, dy).numpy()
            err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
            assert err < 1e-4, (name, s, err)
        times = interleaved_blocks(
            {k: (lambda i, fn=fn: fn(f, dy).numpy()) for k, fn in fns.items()},
            args.rounds, args.block)
        base = "TF Conv2DBackpropInput"
        for name in fns:
            med = statistics.median(times[name]) * 1e3
            lo, hi = min(times[name]) * 1e3, max(times[name]) * 1e3
            if name == base:
                ratio = "1"
            else:
                su = speedup_summary(times, name, base)
                ratio = f"{su['median']:.2f}x ({su['min']:.2f}-{su['max']:.2f})"
            rows.append(f"| {s:.2f} | {name} | {med:.1f} ({lo:.1f}-{hi:.1f}) "
                        f"| {ratio} |")
    text = markdown_table(
        "| zeros in dY | op | ms per call, median (range) | speed-up vs TF, "
        "median (range) |", rows,
        title=(f"Stride-1 input gradient, dY {n}x{h}x{w}x{co} -> dX "
               f"{n}x{h}x{w}x{ci}, 3x3 SAME, float32; {tf_machine_desc(build_info())}; "
               f"{args.rounds} interleaved rounds of {args.block} calls"))
    print(text)
    write_report(args.out, text)


if __name__ == "__main__":
    main()
