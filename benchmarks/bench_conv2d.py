"""Benchmark: SparseSplitConv2D (automatic threshold) vs tf.nn.conv2d.

Times, in one process and interleaved round by round, TensorFlow's ops
(``tf.nn.conv2d`` forward, ``tf.raw_ops.Conv2DBackpropFilter`` filter
gradient; oneDNN on x86 CPUs) against ours with the automatic threshold
(the cost model of cc/core/cost_model.h) and forced all-sparse (threshold
1.0), all inside ``tf.function``, on inputs with a given fraction of exact
zeros scattered uniformly. Each round times every variant once (several
calls each); the table gives the median over rounds of TF time / our time
(> 1: ours faster) and the spread (min-max over rounds) of the auto ratio.
The automatic choice should never be below 0.95x of TF's op.

Writes ``<out>.md`` (markdown table) and ``<out>.png`` (ratio vs sparsity,
matplotlib) with ``--out`` (default ``benchmarks/results/bench_conv2d``).

Usage: ``python benchmarks/bench_conv2d.py [--rounds 7] [--all-shapes]``
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from tf_sparse_split import testing as T

# name, N, H, W, C_in, C_out, K
MAIN_SHAPE = ("32x56x56x64->64 3x3", 32, 56, 56, 64, 64, 3)
MORE_SHAPES = [
    ("64x14x14x32->64 3x3", 64, 14, 14, 32, 64, 3),
    ("64x28x28x1->32 3x3", 64, 28, 28, 1, 32, 3),
]
SPARSITIES = [0.0, 0.5, 0.8, 0.9, 0.95, 0.99]
VARIANTS = ("tf_fwd", "auto_fwd", "sparse_fwd", "tf_dF", "auto_dF", "sparse_dF")


def _calls_per_round(fn, target_s=0.05):
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-5)
    return int(min(20, max(1, target_s / once)))


def run_shape(shape, rounds, out=sys.stdout):
    name, n, h, w, ci, co, k = shape
    lib = tfss.load_library()
    rng = np.random.default_rng(0)
    f = tf.constant(rng.normal(size=(k, k, ci, co)).astype(np.float32))
    dy = tf.constant(rng.normal(size=(n, h, w, co)).astype(np.float32))
    fsize = tf.constant([k, k, ci, co])
    strides = [1, 1, 1, 1]
    fns = {
        "tf_fwd": tf.function(lambda x: tf.nn.conv2d(x, f, 1, "SAME")),
        "auto_fwd": tf.function(lambda x: tfss.sparse_split_conv2d(
            x, f, 1, "SAME", threshold=-1.0)),
        "sparse_fwd": tf.function(lambda x: tfss.sparse_split_conv2d(
            x, f, 1, "SAME", threshold=1.0)),
        "tf_dF": tf.function(lambda x: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=fsize, out_backprop=dy, strides=strides,
            padding="SAME")),
        "auto_dF": tf.function(
            lambda x: lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
                x, fsize, dy, -1.0, strides=strides, padding="SAME")[0]),
        "sparse_dF": tf.function(
            lambda x: lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
                x, fsize, dy, 1.0, strides=strides, padding="SAME")[0]),
    }
    rows = []
    for sp in SPARSITIES:
        x = tf.constant(T.random_sparse_images((n, h, w, ci), sp, rng))
        # Same answer (cheap insurance for the numbers below).
        for a, b in (("tf_fwd", "auto_fwd"), ("tf_dF", "auto_dF")):
            err = T.relative_error(fns[b](x), fns[a](x).numpy())
            assert err < 1e-4, (name, sp, b, err)
        reps = {v: _calls_per_round(lambda v=v: fns[v](x).numpy())
                for v in VARIANTS}
        times = {v: [] for v in VARIANTS}
        for r in range(rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for v in order:
                t0 = time.perf_counter()
                for _ in range(reps[v]):
                    y = fns[v](x)
                y.numpy()
                times[v].append((time.perf_counter() - t0) / reps[v])
        ratio = {}
        for kind in ("fwd", "dF"):
            tf_t = times[f"tf_{kind}"]
            for v in ("auto", "sparse"):
                per_round = [a / b for a, b in zip(tf_t, times[f"{v}_{kind}"])]
                ratio[f"{v}_{kind}"] = (statistics.median(per_round),
                                        min(per_round), max(per_round))
        row = dict(shape=name, sparsity=sp,
                   tf_fwd_ms=statistics.median(times["tf_fwd"]) * 1e3,
                   tf_dF_ms=statistics.median(times["tf_dF"]) * 1e3, **ratio)
        rows.append(row)
        print(f"{name:<22} {sp:5.2f}  fwd tf {row['tf_fwd_ms']:7.2f} ms auto "
              f"{ratio['auto_fwd'][0]:5.2f}x [{ratio['auto_fwd'][1]:.2f}-"
              f"{ratio['auto_fwd'][2]:.2f}] sparse {ratio['sparse_fwd'][0]:5.2f}x"
              f" | dF tf {row['tf_dF_ms']:7.2f} ms auto "
              f"{ratio['auto_dF'][0]:5.2f}x [{ratio['auto_dF'][1]:.2f}-"
              f"{ratio['auto_dF'][2]:.2f}] sparse {ratio['sparse_dF'][0]:5.2f}x",
              file=out, flush=True)
    return rows


def markdown(rows, rounds, header):
    lines = [
        header, "",
        "| layer | input sparsity | tf.nn.conv2d (ms) | fwd auto | fwd auto "
        "spread | fwd all-sparse | Conv2DBackpropFilter (ms) | dF auto | dF "
        "auto spread | dF all-sparse |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, s, ad, sd = r["auto_fwd"], r["sparse_fwd"], r["auto_dF"], r["sparse_dF"]
        lines.append(
            f"| {r['shape']} | {r['sparsity']:.0%} | {r['tf_fwd_ms']:.2f} | "
            f"{a[0]:.2f} | {a[1]:.2f}-{a[2]:.2f} | {s[0]:.2f} | "
            f"{r['tf_dF_ms']:.2f} | {ad[0]:.2f} | {ad[1]:.2f}-{ad[2]:.2f} | "
            f"{sd[0]:.2f} |")
    lines += ["", f"Ratios are TF time / our time (> 1: ours faster): median "
              f"over {rounds} interleaved rounds (spread: min-max over rounds),"
              " float32, NHWC, SAME padding, stride 1, zeros scattered "
              "uniformly. 'auto' is the automatic threshold (threshold=-1, "
              "calibrated on its first call), 'all-sparse' threshold=1."]
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind, title in ((axes[0], "fwd", "forward (tf.nn.conv2d)"),
                            (axes[1], "dF", "filter gradient")):
        for shape in dict.fromkeys(r["shape"] for r in rows):
            rs = [r for r in rows if r["shape"] == shape]
            xs = [r["sparsity"] * 100 for r in rs]
            auto = [r[f"auto_{kind}"] for r in rs]
            ax.plot(xs, [a[0] for a in auto], "o-", label=f"auto {shape}")
            ax.fill_between(xs, [a[1] for a in auto], [a[2] for a in auto],
                            alpha=0.2)
            ax.plot(xs, [r[f"sparse_{kind}"][0] for r in rs], "x--",
                    label=f"all-sparse {shape}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.95, color="r", lw=0.8, ls=":", label="0.95x")
        ax.set_title(title)
        ax.set_xlabel("input sparsity (%)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TF time / our time")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7,
                   help="interleaved timing rounds (default 7)")
    p.add_argument("--all-shapes", action="store_true",
                   help="also time two smaller (MNIST-sized) layers")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "results", "bench_conv2d"),
                   help="output path; .md and .png are written (a trailing "
                        ".md is dropped)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.out.endswith(".md"):
        args.out = args.out[:-3]
    info = tfss._loader.build_info()
    header = (f"tf {tf.__version__}, library built with {info['MARCH']} "
              f"({info['ISA']}), {os.cpu_count()} CPUs")
    print(header)
    rows = []
    for shape in [MAIN_SHAPE] + (MORE_SHAPES if args.all_shapes else []):
        rows += run_shape(shape, args.rounds)
    table = markdown(rows, args.rounds, header)
    print()
    print(table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as fh:
        fh.write(table)
    plot(rows, args.out + ".png")
    print(f"wrote {args.out}.md and {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
