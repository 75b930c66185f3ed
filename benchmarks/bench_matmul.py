"""Times SparseSplitMatMul against TensorFlow's own matmuls in the same run.

For each shape ``M x K x N`` and sparsity of the activation ``a`` (zeros
uniformly at random), it times, inside ``tf.function``s and interleaved
round by round in a fresh random order (so that machine noise, and the
cache state a column leaves behind, hit every column alike):

* ``tf.matmul``                       -- the dense GEMM (oneDNN), ratio 1 by definition;
* ``tf.matmul(..., a_is_sparse=True)`` -- TF's SparseMatMul kernel;
* ours with the automatic threshold (``-1``), as the gradients and
  inference graphs call it (``full_stats=False``: a call that stays dense
  counts a sample of ``a`` or nothing);
* ours automatic with ``full_stats=True`` (every value counted on every
  call: what a layer recording its statistics asks for);
* ours forced sparse (threshold ``1.0``: every row goes to the CSR SpMM);
* ``tf.nn.relu(tf.matmul(a, b) + bias)`` -- which Grappler fuses into
  TF's ``_FusedMatMul`` (oneDNN) -- and ours with the same bias and ReLU
  (automatic, ``full_stats=False``): the "all-dense fused" comparison,
  ratio ``t(TF fused) / t(ours fused)``.

Each case runs in one dtype (``--dtypes``, default float32, bfloat16 and
float16): every column computes in that dtype, the ratios are against
``tf.matmul`` in the same dtype (in bfloat16 oneDNN runs it on AMX-BF16 or
AVX512_BF16 where the CPU has them), and ``a_is_sparse`` is TF's
SparseMatMul in that dtype (float32 and bfloat16 only: it has no float16
kernel, shown as ``--``; nor are the fused columns in float16, where
TF's fused CPU kernel did not finish a call in 100 s). The title names the instruction-set path the
16-bit sparse kernels took (``_kernels.low_precision_isa()``).

Both directions are timed by default: the forward product ``a @ b`` (``b`` is
``[K, N]``) and the weight gradient ``a^T @ dY`` (``transpose_a=True``, ``dY``
is ``[M, N]``; the product is ``[K, N]``; no fused columns). ``--directions
dx`` adds the input gradient ``dY W^T`` as ``a @ b^T`` (``transpose_b=True``,
``a`` the ReLU-masked ``dY`` [M, K], ``b`` the weights [N, K]; no fused
columns), where TF's oneDNN kernel runs the transposed ``b`` far below its
rate and the op may run the product swapped. Ratios are
``t(tf.matmul) / t(column)`` (> 1: faster than the dense GEMM), the median of
the per-round ratios, with the spread (min..max of the per-round ratios of
our automatic column). The last columns give the op's own analysis time
(statistics ``TIME_ANALYZE``, median over the timed calls) with
``full_stats=True`` and ``False``: the analysis time saved per call.

Writes a markdown table (``--out``, default
``benchmarks/results/bench_matmul.md``) and a PNG plot of speed-up against
sparsity beside it (same name, ``.png``).

Usage::

    python benchmarks/bench_matmul.py [--quick | --small] [--reps 7] [--out FILE]
        [--dtypes float32,bfloat16,float16]
"""

import argparse
import os
import statistics
import time

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from _common import (call_times, markdown_table, median_time,
                     tf_machine_desc, write_report)
from tf_sparse_split._loader import build_info
from tf_sparse_split.testing import random_sparse

BIG_SHAPES = [(1024, 4096, 1024)]
BIG_SPARSITIES = [0.0, 0.5, 0.9]
# The output layer of an MLP (its forward and weight-gradient products) and
# small N, where the counting pass is largest against the GEMM.
SMALL_N_SHAPES = [(128, 2048, 10)] + [(512, 2048, n) for n in (1, 4, 16, 64)]
SMALL_SPARSITIES = [0.0, 0.5]
# --small: the small-N shapes above and held-out N (not bucket boundaries)
# that nothing was tuned on.
HELD_OUT_SMALL_N = [(512, 2048, n) for n in (3, 7, 12)]
# The 16-bit dtypes: the big shape at more sparsities (the small-N shapes
# run in float32 only).
LOW_PRECISION_SPARSITIES = [0.0, 0.5, 0.7, 0.9, 0.99]
COLUMNS = ["tf.matmul", "a_is_sparse", "ours auto", "ours auto full stats",
           "ours sparse", "tf fused", "ours fused"]
HERE = os.path.dirname(os.path.abspath(__file__))


#: The product each --directions entry times (a: the sparse operand).
_DIRECTION_LABELS = {"fwd": "a @ b", "grad": "a^T @ dY", "dx": "a @ b^T"}


def _functions(direction, dtype=tf.float32):
    """The tf.functions of one direction, each (x, y, bias) -> product; the
    a_is_sparse entry is None where TF's SparseMatMul lacks the dtype."""
    ta = direction == "grad"
    tb = direction == "dx"

    @tf.function
    def dense(x, y, bias):
        return tf.matmul(x, y, transpose_a=ta, transpose_b=tb)

    @tf.function
    def a_is_sparse(x, y, bias):
        return tf.matmul(x, y, transpose_a=ta, transpose_b=tb,
                         a_is_sparse=True)

    @tf.function
    def ours_auto(x, y, bias):
        return tfss.sparse_split_matmul(x, y, -1.0, transpose_a=ta,
                                        transpose_b=tb, full_stats=False)

    @tf.function
    def ours_auto_full(x, y, bias):
        return tfss.sparse_split_matmul(x, y, -1.0, transpose_a=ta,
                                        transpose_b=tb, full_stats=True)

    @tf.function
    def ours_sparse(x, y, bias):
        return tfss.sparse_split_matmul(x, y, 1.0, transpose_a=ta,
                                        transpose_b=tb)

    fns = [dense, a_is_sparse if dtype in (tf.float32, tf.bfloat16) else None,
           ours_auto, ours_auto_full, ours_sparse]
    # TF's fused MatMul + BiasAdd + Relu in float16 did not finish one
    # 1024x4096x1024 call in 100 s here (no oneDNN kernel for it): not timed.
    if direction == "fwd" and dtype != tf.float16:
        @tf.function
        def tf_fused(x, y, bias):
            return tf.nn.relu(tf.matmul(x, y) + bias)

        @tf.function
        def ours_fused(x, y, bias):
            return tfss.sparse_split_matmul(x, y, -1.0, bias=bias,
                                            activation="relu",
                                            full_stats=False)

        fns += [tf_fused, ours_fused]
    return fns


def _analysis_seconds(a, y, ta, full_stats, reps, tb=False):
    """Median TIME_ANALYZE of the op (automatic threshold) over reps calls."""
    from tf_sparse_split.tuning import stats as S

    @tf.function
    def f(x, w):
        return tfss.sparse_split_matmul(x, w, -1.0, transpose_a=ta,
                                        transpose_b=tb, return_stats=True,
                                        full_stats=full_stats)[1]

    for _ in range(2):
        f(a, y)
    v = [f(a, y).numpy() for _ in range(max(reps, 5))]
    return (statistics.median(s[S.TIME_ANALYZE] for s in v),
            statistics.median(s[S.ANALYSIS] for s in v))


def run_case(m, k, n, sparsity, direction, reps, rng, dtype=tf.float32):
    """Median times (s) per column, per-round auto ratios, analysis times."""
    a = tf.cast(tf.constant(random_sparse((m, k), sparsity, rng, np.float32)),
                dtype)
    other_shape = {"grad": (m, n), "dx": (n, k)}.get(direction, (k, n))
    other = rng.standard_normal(other_shape).astype(np.float32)
    y = tf.cast(tf.constant(other), dtype)
    bias = tf.cast(tf.constant(rng.standard_normal(n).astype(np.float32)), dtype)
    fns = _functions(direction, dtype)
    live = [i for i, f in enumerate(fns) if f is not None]
    for i in live:  # trace, calibrate, warm up
        for _ in range(3):
            fns[i](a, y, bias).numpy()
    # Each round times a block of calls per column, enough for ~5 ms of
    # tf.matmul (1 call for the big shapes): a single sub-millisecond call
    # on a loaded machine ranged over 100x between rounds.
    block = max(1, min(32, int(5e-3 / median_time(lambda: fns[0](a, y, bias), 5))))
    times = [[] for _ in fns]
    for _ in range(reps):
        # A fresh random order every round: a rotation keeps each column's
        # predecessor, and the call right after TF's SparseMatMul (a large
        # cache and allocator footprint) ran ~0.1 ms slower at 128x2048x10,
        # a third of the product, whatever the column.
        for i in rng.permutation(live):
            # CPU execution is synchronous: the result is ready.
            times[i].append(statistics.mean(
                call_times(lambda: fns[i](a, y, bias), block)))
    med = [statistics.median(t) if t else float("nan") for t in times]
    # Ratios are medians of the per-round ratios (each round times every
    # column back to back, in a random order): robust to load bursts that
    # hit a round, which a ratio of separate medians is not.
    def round_ratio(base, col):
        if not times[col]:
            return float("nan")
        return statistics.median(b / c for b, c in zip(times[base], times[col]))

    per_round = [d / s for d, s in zip(times[0], times[2])]
    ta, tb = direction == "grad", direction == "dx"
    full_an, _ = _analysis_seconds(a, y, ta, True, reps, tb)
    cheap_an, mode = _analysis_seconds(a, y, ta, False, reps, tb)
    ratio = [round_ratio(0, i) for i in range(5)]
    if len(med) > 5:
        ratio += [1.0, round_ratio(5, 6)]
    return {
        "shape": f"{m}x{k}x{n}", "m": m, "k": k, "n": n, "sparsity": sparsity,
        "dtype": dtype.name,
        # ours auto vs TF's SparseMatMul in the same dtype (per round)
        "vs_a_is_sparse": round_ratio(1, 2) if times[1] else float("nan"),
        "direction": direction, "ms": [t * 1e3 for t in med],
        "ratio": ratio, "spread": (min(per_round), max(per_round)),
        "analysis_us": (full_an * 1e6, cheap_an * 1e6), "mode": mode,
    }


KERNEL_HEADER = ("| M x K x N | direction | sparsity | nnz / k | tf.matmul bf16 (ms) | "
                 "packed kernel | direct kernel | dot kernel | dot packed kernel | "
                 "per-call choice (kernel) | choice vs packed | choice vs direct |")

_KERNEL_PATHS = {"packed": 0, "direct": 1, "dot": 2, "dot_packed": 3}


def kernel_row(m, k, n, sparsity, reps, rng, direction="fwd",
               clock=time.perf_counter, threads=1):
    """The bfloat16 CSR SpMM kernels against tf.matmul in bfloat16, same
    run: ``_kernels.lowp_spmm`` (count, CSR build and CsrSpmm of the op's
    sparse part; uint16 bit patterns in and out) with the packed kernel
    (path 0), the direct one (path 1), the AVX512_BF16 dot kernels (path 2:
    B in place, path 3: B copied to L1 per block; '--' where the CPU lacks
    AVX512_BF16) and the per-call choice (path -1, with the kernel it
    took); ``direction`` "fwd": ``a [m, k] @ b [k, n]``, "grad": the weight
    gradient ``a^T @ dY`` with ``dY [m, n]``; ``clock`` the timer
    (``time.process_time``: CPU seconds of the process, all threads);
    ``threads`` the kernels' threads (TF's matmul runs on its own pool).
    Returns the markdown row: tf.matmul's median ms and each kernel's
    speed-up over it (median of the per-round ratios, columns in a random
    order each round). The kernels' times include allocating their numpy
    output; TF's reuse its allocator's memory."""
    from tf_sparse_split import _kernels

    ta = direction == "grad"
    a = random_sparse((m, k), sparsity, rng, np.float32)
    b = rng.standard_normal((m if ta else k, n)).astype(np.float32)
    a_bits = _kernels.lowp_round(a, "bfloat16")
    b_bits = _kernels.lowp_round(b, "bfloat16")
    a_tf = tf.bitcast(tf.constant(a_bits), tf.bfloat16)
    b_tf = tf.bitcast(tf.constant(b_bits), tf.bfloat16)
    dense = tf.function(lambda: tf.matmul(a_tf, b_tf, transpose_a=ta))
    dot = bool(_kernels.bf16_dot_available())
    paths = [0, 1] + ([2, 3] if dot else []) + [-1]
    # tf.matmul's result stays a tensor (CPU execution is synchronous): a
    # copy to numpy would add ~1 ms per 8 MB output to TF's column only.
    fns = [dense] + [
        (lambda p=p: _kernels.lowp_spmm(a_bits, b_bits, "bfloat16", ta,
                                        threads=threads, path=p))
        for p in paths]
    outs = [f() for f in fns[1:]]
    for o in outs[1:]:
        # identical bits (the dot kernels' flush of denormals cannot act:
        # normal-range inputs)
        np.testing.assert_array_equal(o, outs[0])
    for f in fns:
        f()
    block = max(1, min(32, int(5e-3 / median_time(fns[0], 5))))
    times = [[] for _ in fns]
    for _ in range(reps):
        for i in rng.permutation(len(fns)):
            times[i].append(statistics.mean(call_times(fns[i], block, clock)))

    def ratio(base, col):
        return statistics.median(x / y for x, y in zip(times[base], times[col]))

    nnz = int(np.count_nonzero(a_bits & 0x7fff))
    inner = m if ta else k
    rows_ = k if ta else m
    choice = _kernels.bf16_spmm_kernel(rows_, inner, n, nnz)
    col = {p: 1 + i for i, p in enumerate(paths)}
    dots = (f"{ratio(0, col[2]):.2f}x | {ratio(0, col[3]):.2f}x" if dot
            else "-- | --")
    return (f"| {m}x{k}x{n} | {'a^T @ dY' if ta else 'a @ b'} | "
            f"{sparsity:.2f} | {nnz / inner:.1f} | "
            f"{1e3 * statistics.median(times[0]):.3f} | {ratio(0, col[0]):.2f}x | "
            f"{ratio(0, col[1]):.2f}x | {dots} | **{ratio(0, col[-1]):.2f}x** "
            f"({choice}) | {ratio(col[0], col[-1]):.2f}x | "
            f"{ratio(col[1], col[-1]):.2f}x |")


HEADER = ("| M x K x N | dtype | direction | sparsity | tf.matmul (ms) | a_is_sparse | "
          "ours auto | ours auto (spread) | ours auto vs a_is_sparse | ours auto, full stats | "
          "ours forced sparse | all-dense fused: TF fused (ms) | ours fused vs TF fused | "
          "analysis us: full stats -> cheap (mode) |")

_MODES = {0.0: "full", 1.0: "sampled", 2.0: "skipped"}


def row_markdown(r):
    ms, ratio = r["ms"], r["ratio"]
    lo, hi = r["spread"]
    fused = (f"{ms[5]:.3f} | **{ratio[6]:.2f}x**" if len(ratio) > 5
             else "-- | --")
    full_an, cheap_an = r["analysis_us"]
    mode = _MODES.get(r["mode"], f"{r['mode']:.1f}")
    def x(v):
        return "--" if v != v else f"{v:.2f}x"  # NaN: column not run

    return (f"| {r['shape']} | {r.get('dtype', 'float32')} | "
            f"{_DIRECTION_LABELS[r['direction']]} | "
            f"{r['sparsity']:.2f} | {ms[0]:.3f} | {x(ratio[1])} | **{ratio[2]:.2f}x** | "
            f"{lo:.2f}..{hi:.2f} | {x(r.get('vs_a_is_sparse', float('nan')))} | "
            f"{ratio[3]:.2f}x | {ratio[4]:.2f}x | {fused} | "
            f"{full_an:.0f} -> {cheap_an:.0f} ({mode}) |")


def to_markdown(rows, title):
    return markdown_table(HEADER, [row_markdown(r) for r in rows], title)


def plot(rows, path, title):
    """Speed-up vs sparsity: one panel per (shape, direction) of the big shapes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = []
    for r in rows:
        key = (r["shape"], r["direction"], r.get("dtype", "float32"))
        if r["n"] >= 256 and key not in keys:
            keys.append(key)
    if not keys:
        return False
    cols = min(2, len(keys))
    nrows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4 * nrows), squeeze=False)
    for ax, (shape, direction, dtype) in zip(axes.flat, keys):
        sel = [r for r in rows if (r["shape"], r["direction"],
                                   r.get("dtype", "float32")) == (shape, direction, dtype)]
        sp = [r["sparsity"] * 100 for r in sel]
        ax.axhline(1.0, color="gray", lw=1, label="tf.matmul = 1")
        ax.plot(sp, [r["ratio"][1] for r in sel], "s--", label="tf.matmul(a_is_sparse=True)")
        ax.plot(sp, [r["ratio"][2] for r in sel], "^:", label="ours, automatic threshold")
        ax.plot(sp, [r["ratio"][4] for r in sel], "o-", label="ours, forced sparse")
        ax.set_yscale("log")
        ax.set_xlabel("sparsity of a (%)")
        ax.set_ylabel("speed-up vs tf.matmul")
        ax.set_title(f"{shape} {dtype}, {_DIRECTION_LABELS[direction]}")
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
                   help="256x1024x1024 and 128x2048x10 only, 2 sparsities, 3 rounds")
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_matmul.md"),
                   help="markdown table to write (the PNG plot goes beside it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true",
                   help="the small-N shapes only (output layers, N <= 64, "
                        "and held-out N 3, 7, 12), where the op's fixed "
                        "per-call cost shows")
    p.add_argument("--dtypes", default="float32,bfloat16,float16",
                   help="comma-separated dtypes of the cases (float32, "
                        "bfloat16, float16); each against tf.matmul in it")
    p.add_argument("--directions", default="fwd,grad",
                   help="comma-separated: fwd (a @ b), grad (a^T @ dY), dx "
                        "(a @ b^T, b [N, K]: the input gradient dY W^T); "
                        "--bf16-kernels takes fwd and grad")
    p.add_argument("--no-small-n", action="store_true",
                   help="skip the float32 small-N shapes")
    p.add_argument("--sparsities", default=None,
                   help="comma-separated sparsities of the bfloat16/float16 "
                        "cases (default " +
                        ",".join(str(x) for x in LOW_PRECISION_SPARSITIES) + ")")
    p.add_argument("--shapes", default=None,
                   help="comma-separated MxKxN products to time instead of "
                        "the default shapes (e.g. 1x2048x10,32x2048x2048: "
                        "the small-batch inference layers), each at the "
                        "--sparsities given (default 0 and 0.5)")
    p.add_argument("--bf16-kernels", action="store_true",
                   help="instead of the op table: the bfloat16 CSR SpMM "
                        "kernels (packed, direct, the AVX512_BF16 dot "
                        "kernels where the CPU has them, the per-call "
                        "choice; "
                        "_kernels.lowp_spmm) against tf.matmul in "
                        "bfloat16 on the --directions products of --shapes "
                        "(default 128x2048x2048,1024x4096x1024) at "
                        "--sparsities (default 0.9,0.95,0.98,0.99)")
    p.add_argument("--kernel-threads", type=int, default=1,
                   help="--bf16-kernels: threads of the kernels (default 1; "
                        "TF's matmul uses its intra-op pool)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="--bf16-kernels: time wall-clock seconds or the "
                        "process's CPU seconds (all threads; less disturbed "
                        "by other jobs on a loaded machine)")
    args = p.parse_args(argv)
    tfss.load_library()
    from tf_sparse_split import _kernels

    custom = []
    if args.shapes:
        try:
            custom = [tuple(int(v) for v in sh.strip().split("x"))
                      for sh in args.shapes.split(",") if sh.strip()]
        except ValueError:
            p.error(f"--shapes: not MxKxN: {args.shapes!r}")
        if not custom or any(len(sh) != 3 or min(sh) < 1 for sh in custom):
            p.error(f"--shapes: not MxKxN with sizes >= 1: {args.shapes!r}")

    if args.bf16_kernels:
        if args.kernel_threads < 1:
            p.error("--kernel-threads must be >= 1")
        if not set(d.strip() for d in args.directions.split(",")
                   if d.strip()) <= {"fwd", "grad"}:
            p.error("--directions: fwd and/or grad")
        return kernel_main(args, custom or [(128, 2048, 2048),
                                            (1024, 4096, 1024)])
    dtypes = [tf.as_dtype(d.strip()) for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in (tf.float32, tf.bfloat16, tf.float16):
            p.error(f"--dtypes: {d.name} is not float32, bfloat16 or float16")
    directions = [d.strip() for d in args.directions.split(",") if d.strip()]
    if not set(directions) <= set(_DIRECTION_LABELS):
        p.error("--directions: fwd, grad and/or dx")
    rng = np.random.default_rng(args.seed)
    cases = []
    for dt in dtypes:
        if custom:
            sps = (SMALL_SPARSITIES if args.sparsities is None else
                   [float(x) for x in args.sparsities.split(",") if x.strip()])
            cases += [(sh, sps, dt) for sh in custom]
        elif args.quick:
            cases += [((256, 1024, 1024), [0.0, 0.9], dt)]
            if dt == tf.float32:
                cases += [((128, 2048, 10), [0.0, 0.5], dt)]
        elif args.small:
            cases += [(sh, SMALL_SPARSITIES, dt)
                      for sh in SMALL_N_SHAPES + HELD_OUT_SMALL_N]
        elif dt == tf.float32:
            cases += [(sh, BIG_SPARSITIES, dt) for sh in BIG_SHAPES]
            if not args.no_small_n:
                cases += [(sh, SMALL_SPARSITIES, dt) for sh in SMALL_N_SHAPES]
        else:
            sps = (LOW_PRECISION_SPARSITIES if args.sparsities is None else
                   [float(x) for x in args.sparsities.split(",") if x.strip()])
            cases += [(sh, sps, dt) for sh in BIG_SHAPES]
    reps = min(args.reps, 3) if args.quick else args.reps
    rows = []
    print(HEADER, flush=True)
    for (m, k, n), sparsities, dt in cases:
        for direction in directions:
            for sp in sparsities:
                r = run_case(m, k, n, sp, direction, reps, rng, dt)
                rows.append(r)
                print(row_markdown(r), flush=True)
    isa = _kernels.low_precision_isa()
    title = (f"Speed-up t(tf.matmul) / t(column), each row in its dtype (tf.matmul and "
             f"a_is_sparse in that dtype), median of {reps} interleaved "
             f"rounds' ratios (columns in a random order each round, each timed "
             f"over a block of calls worth ~5 ms of tf.matmul); "
             f"{tf_machine_desc(build_info())}; 16-bit sparse "
             f"kernels: {isa['active']} (bf16 conversions {isa['bf16_conversion']}, "
             f"f16 {isa['f16_conversion']}; CPU avx512bf16={isa['avx512bf16']}, "
             f"amx_bf16={isa['amx_bf16']}). "
             f"'ours auto' = threshold -1, full_stats=False; 'ours forced sparse' = "
             f"threshold 1.0 (every row through the CSR SpMM); spread = min..max of "
             f"the per-round ratios of 'ours auto'; fused = relu(a @ b + bias), ours "
             f"automatic vs TF's graph (Grappler's _FusedMatMul).")
    print()
    print(title)
    png = os.path.splitext(args.out)[0] + ".png"
    write_report(args.out, to_markdown(rows, title),
                 also=lambda: png if plot(rows, png, title) else None)
    return 0


def kernel_main(args, shapes):
    """``--bf16-kernels``: the kernel table (see :func:`kernel_row`)."""
    from tf_sparse_split import _kernels

    sps = ([0.9, 0.95, 0.98, 0.99] if args.sparsities is None else
           [float(x) for x in args.sparsities.split(",") if x.strip()])
    rng = np.random.default_rng(args.seed)
    rows = []
    print(KERNEL_HEADER, flush=True)
    directions = [d.strip() for d in args.directions.split(",") if d.strip()]
    for m, k, n in shapes:
        for direction in directions:
            for sp in sps:
                rows.append(kernel_row(
                    m, k, n, sp, args.reps, rng, direction,
                    time.process_time if args.clock == "cpu"
                    else time.perf_counter, args.kernel_threads))
                print(rows[-1], flush=True)
    isa = _kernels.low_precision_isa()
    title = (f"bfloat16 CSR SpMM kernels (count + CSR build + CsrSpmm, "
             f"_kernels.lowp_spmm) against tf.matmul in bfloat16 (oneDNN; "
             f"amx_bf16={isa['amx_bf16']}; vdpbf16ps / FMA products per "
             f"second {_kernels.bf16_dot_rate_ratio():.2f}), kernels on "
             f"{args.kernel_threads} thread(s), same run, "
             f"{'CPU' if args.clock == 'cpu' else 'wall-clock'} seconds: speed-up "
             f"t(tf.matmul) / t(kernel), median of {args.reps} interleaved "
             f"rounds' ratios; nnz / k: nonzeros per column of op(a) (per "
             f"row of b); 'choice vs packed' = t(packed) / t(choice), "
             f"'choice vs direct' = t(direct) / t(choice); instruction sets: "
             f"packed and direct kernels {isa['active']}, dot kernels "
             f"{'avx512bf16 (vdpbf16ps)' if isa['bf16_spmm_dot'] else 'not available (no AVX512_BF16)'}; "
             f"{tf_machine_desc(build_info())}.")
    print()
    print(title)
    write_report(args.out, markdown_table(KERNEL_HEADER, rows, title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
