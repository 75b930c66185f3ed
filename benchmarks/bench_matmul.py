"""Times SparseSplitMatMul against TensorFlow's own matmuls in the same run.

For each shape ``M x K x N`` and sparsity of the activation ``a`` (zeros
uniformly at random), it times, inside ``tf.function``s and interleaved
round by round (so that machine noise hits every column alike):

* ``tf.matmul``                       -- the dense GEMM (oneDNN), ratio 1 by definition;
* ``tf.matmul(..., a_is_sparse=True)`` -- TF's SparseMatMul kernel;
* ours with the automatic threshold (``-1``);
* ours forced sparse (threshold ``1.0``: every row goes to the CSR SpMM).

Both directions are timed: the forward product ``a @ b`` (``b`` is
``[K, N]``) and the weight gradient ``a^T @ dY`` (``transpose_a=True``, ``dY``
is ``[M, N]``; the product is ``[K, N]``). Ratios are
``t(tf.matmul) / t(column)`` (> 1: faster than the dense GEMM); the median of
the rounds is reported, with the spread (min..max of the per-round ratios of
our forced-sparse column).

Writes a markdown table (``--out``, default
``benchmarks/results/bench_matmul.md``) and a PNG plot of speed-up against
sparsity beside it (same name, ``.png``).

Usage::

    python benchmarks/bench_matmul.py [--quick] [--reps 7] [--out FILE]
"""

import argparse
import os
import statistics

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from _common import call_times, markdown_table, tf_machine_desc, write_report
from tf_sparse_split._loader import build_info
from tf_sparse_split.testing import random_sparse

BIG_SHAPES = [(1024, 4096, 1024), (256, 1024, 1024)]
SMALL_N_SHAPES = [(m, k, n) for (m, k) in [(256, 1024), (512, 2048)] for n in (1, 10, 64)]
SPARSITIES = [0.0, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99]
COLUMNS = ["tf.matmul", "a_is_sparse", "ours auto", "ours sparse"]
HERE = os.path.dirname(os.path.abspath(__file__))


def _functions(direction):
    """The four tf.functions of one direction, each (x, y) -> product."""
    ta = direction == "grad"

    @tf.function
    def dense(x, y):
        return tf.matmul(x, y, transpose_a=ta)

    @tf.function
    def a_is_sparse(x, y):
        return tf.matmul(x, y, transpose_a=ta, a_is_sparse=True)

    @tf.function
    def ours_auto(x, y):
        return tfss.sparse_split_matmul(x, y, -1.0, transpose_a=ta)

    @tf.function
    def ours_sparse(x, y):
        return tfss.sparse_split_matmul(x, y, 1.0, transpose_a=ta)

    return [dense, a_is_sparse, ours_auto, ours_sparse]


def run_case(m, k, n, sparsity, direction, reps, rng):
    """Median times (s) per column and per-round forced-sparse ratios."""
    a = tf.constant(random_sparse((m, k), sparsity, rng, np.float32))
    other = rng.standard_normal((m if direction == "grad" else k, n)).astype(np.float32)
    y = tf.constant(other)
    fns = _functions(direction)
    for f in fns:  # trace, calibrate, warm up
        for _ in range(2):
            f(a, y).numpy()
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            # CPU execution is synchronous: the result is ready.
            times[i] += call_times(lambda: f(a, y), 1)
    med = [statistics.median(t) for t in times]
    per_round = [d / s for d, s in zip(times[0], times[3])]
    return {
        "shape": f"{m}x{k}x{n}", "m": m, "k": k, "n": n, "sparsity": sparsity,
        "direction": direction, "ms": [t * 1e3 for t in med],
        "ratio": [med[0] / t for t in med],
        "spread": (min(per_round), max(per_round)),
    }


HEADER = ("| M x K x N | direction | sparsity | tf.matmul (ms) | a_is_sparse | "
          "ours auto | ours forced sparse | forced sparse (spread) | "
          "forced sparse vs a_is_sparse |")


def row_markdown(r):
    ms, ratio = r["ms"], r["ratio"]
    lo, hi = r["spread"]
    return (f"| {r['shape']} | {'a @ b' if r['direction'] == 'fwd' else 'a^T @ dY'} | "
            f"{r['sparsity']:.2f} | {ms[0]:.3f} | {ratio[1]:.2f}x | {ratio[2]:.2f}x | "
            f"**{ratio[3]:.2f}x** | {lo:.2f}..{hi:.2f} | {ratio[3] / ratio[1]:.2f}x |")


def to_markdown(rows, title):
    return markdown_table(HEADER, [row_markdown(r) for r in rows], title)


def plot(rows, path, title):
    """Speed-up vs sparsity: one panel per (shape, direction) of the big shapes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = []
    for r in rows:
        key = (r["shape"], r["direction"])
        if r["n"] >= 256 and key not in keys:
            keys.append(key)
    if not keys:
        return False
    cols = min(2, len(keys))
    nrows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4 * nrows), squeeze=False)
    for ax, (shape, direction) in zip(axes.flat, keys):
        sel = [r for r in rows if (r["shape"], r["direction"]) == (shape, direction)]
        sp = [r["sparsity"] * 100 for r in sel]
        ax.axhline(1.0, color="gray", lw=1, label="tf.matmul = 1")
        ax.plot(sp, [r["ratio"][1] for r in sel], "s--", label="tf.matmul(a_is_sparse=True)")
        ax.plot(sp, [r["ratio"][2] for r in sel], "^:", label="ours, automatic threshold")
        ax.plot(sp, [r["ratio"][3] for r in sel], "o-", label="ours, forced sparse")
        ax.set_yscale("log")
        ax.set_xlabel("sparsity of a (%)")
        ax.set_ylabel("speed-up vs tf.matmul")
        ax.set_title(f"{shape}, {'a @ b' if direction == 'fwd' else 'a^T @ dY'}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    import textwrap
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7, help="interleaved timed rounds (median)")
    p.add_argument("--quick", action="store_true",
                   help="256x1024x1024 and 512x2048x10 only, 4 sparsities, 3 rounds")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_matmul.md"),
                   help="markdown table to write (the PNG plot goes beside it)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tfss.load_library()
    rng = np.random.default_rng(args.seed)
    if args.quick:
        shapes, sparsities, reps = [(256, 1024, 1024), (512, 2048, 10)], [0.0, 0.5, 0.9, 0.99], min(args.reps, 3)
    else:
        shapes, sparsities, reps = BIG_SHAPES + SMALL_N_SHAPES, SPARSITIES, args.reps
    rows = []
    print(HEADER, flush=True)
    for (m, k, n) in shapes:
        for direction in ("fwd", "grad"):
            for sp in sparsities:
                r = run_case(m, k, n, sp, direction, reps, rng)
                rows.append(r)
                print(row_markdown(r), flush=True)
    title = (f"Speed-up t(tf.matmul) / t(column), float32, median of {reps} interleaved "
             f"rounds; {tf_machine_desc(build_info())}. "
             f"'ours sparse' = threshold 1.0 (every row through the CSR SpMM); "
             f"spread = min..max of its per-round ratios.")
    print()
    print(title)
    png = os.path.splitext(args.out)[0] + ".png"
    write_report(args.out, to_markdown(rows, title),
                 also=lambda: png if plot(rows, png, title) else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
