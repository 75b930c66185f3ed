"""The fixed per-call cost of an all-dense SparseSplitMatMul call: its
kernel time against TF's MatMul kernel on the same inputs.

A small product (an output layer, N <= 64) is a few tens of microseconds of
GEMM inside a ``tf.function`` call of a few hundred; what the op adds to
TF's kernel (the decision, the statistics, running TF's kernel) is lost in
the call's noise when whole calls are timed (``bench_matmul.py``). Here
TensorFlow's profiler (``tf.profiler.experimental``) records the executor's
time of each kernel: ``tf.matmul`` (oneDNN's ``_MklMatMul``) and ours with
the automatic threshold and ``full_stats=False`` (as the gradient products
and inference graphs call it), each alone in a ``tf.function``, called
round after round in a fresh random order. Reported per product: the
median kernel times (microseconds), their median per-round ratio
``t(TF MatMul) / t(ours)`` with its range, and the op's own analysis time
(statistics ``TIME_ANALYZE``, from a separate function that reads them).

Usage::

    python benchmarks/bench_fixed_cost.py [--shapes 128x2048x10,512x2048x1]
        [--rounds 9] [--calls 60] [--out FILE]
"""

import argparse
import collections
import glob
import os
import shutil
import statistics
import tempfile

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from _common import markdown_table, tf_machine_desc, write_report
from tf_sparse_split._loader import build_info
from tf_sparse_split.testing import random_sparse
from tf_sparse_split.tuning import stats as S

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SHAPES = "128x2048x10,512x2048x1,512x2048x4,512x2048x16,512x2048x64"


def _kernel_times(fn, args, calls, name_part):
    """Executor times (s) of the kernels whose event name holds name_part
    over `calls` calls of fn(*args), from one profiler session."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    logdir = tempfile.mkdtemp(prefix="tfss_fixed_cost_")
    try:
        tf.profiler.experimental.start(logdir)
        for _ in range(calls):
            fn(*args)
        tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        pb = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"),
                       recursive=True)[0]
        with open(pb, "rb") as f:
            space.ParseFromString(f.read())
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    out = []
    for plane in space.planes:
        meta = plane.event_metadata
        for line in plane.lines:
            for ev in line.events:
                if name_part in meta[ev.metadata_id].name:
                    out.append(ev.duration_ps * 1e-12)
    return out


def run_case(m, k, n, direction, rounds, calls, rng):
    ta = direction == "grad"
    a = tf.constant(random_sparse((m, k), 0.0, rng, np.float32))
    y = tf.constant(rng.standard_normal((m if ta else k, n)).astype(np.float32))

    @tf.function
    def dense(x, w):
        return tf.matmul(x, w, transpose_a=ta)

    @tf.function
    def ours(x, w):
        return tfss.sparse_split_matmul(x, w, -1.0, transpose_a=ta,
                                        full_stats=False)

    @tf.function
    def ours_stats(x, w):
        return tfss.sparse_split_matmul(x, w, -1.0, transpose_a=ta,
                                        full_stats=False,
                                        return_stats=True)[1]

    cols = {"tf": (dense, "MatMul"), "ours": (ours, "SparseSplitMatMul")}
    for fn, _ in cols.values():
        for _ in range(5):  # trace, calibrate, warm up
            fn(a, y)
    per_round = collections.defaultdict(list)
    names = list(cols)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            fn, part = cols[name]
            per_round[name].append(statistics.median(
                _kernel_times(fn, (a, y), calls, part)))
    ratios = [t / o for t, o in zip(per_round["tf"], per_round["ours"])]
    st = [ours_stats(a, y).numpy() for _ in range(max(calls, 20))]
    return {
        "shape": f"{m}x{k}x{n}", "direction": direction,
        "tf_us": statistics.median(per_round["tf"]) * 1e6,
        "ours_us": statistics.median(per_round["ours"]) * 1e6,
        "ratio": statistics.median(ratios), "spread": (min(ratios), max(ratios)),
        "analyze_us": statistics.median(s[S.TIME_ANALYZE] for s in st) * 1e6,
        "dense_us": statistics.median(s[S.TIME_DENSE] for s in st) * 1e6,
        "mode": collections.Counter(
            {0.0: "full", 1.0: "sampled", 2.0: "skipped"}[s[S.ANALYSIS]]
            for s in st).most_common(1)[0][0],
    }


HEADER = ("| M x K x N | direction | TF MatMul kernel (us) | ours kernel (us) | "
          "TF / ours (median) | spread | ours: analysis (us) | ours: dense "
          "part (us) | analysis (most calls) |")


def row_markdown(r):
    lo, hi = r["spread"]
    return (f"| {r['shape']} | {'a @ b' if r['direction'] == 'fwd' else 'a^T @ dY'} | "
            f"{r['tf_us']:.1f} | {r['ours_us']:.1f} | **{r['ratio']:.3f}x** | "
            f"{lo:.2f}..{hi:.2f} | {r['analyze_us']:.1f} | {r['dense_us']:.1f} | "
            f"{r['mode']} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="comma-separated MxKxN products (default %(default)s)")
    p.add_argument("--directions", default="fwd,grad",
                   help="fwd (a @ b), grad (a^T @ dY) or both")
    p.add_argument("--rounds", type=int, default=9,
                   help="interleaved rounds (median of the per-round ratios)")
    p.add_argument("--calls", type=int, default=60,
                   help="calls per column per round (median kernel time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results",
                                                 "bench_fixed_cost.md"))
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.strip().split("x"))
                  for s in args.shapes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--shapes: not MxKxN: {args.shapes!r}")
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        p.error(f"--shapes: not MxKxN with sizes >= 1: {args.shapes!r}")
    directions = [d.strip() for d in args.directions.split(",") if d.strip()]
    if not directions or not set(directions) <= {"fwd", "grad"}:
        p.error("--directions: fwd and/or grad")
    if args.rounds < 1 or args.calls < 1:
        p.error("--rounds and --calls must be >= 1")
    tfss.load_library()
    rng = np.random.default_rng(args.seed)
    rows = []
    print(HEADER, flush=True)
    for m, k, n in shapes:
        for d in directions:
            r = run_case(m, k, n, d, args.rounds, args.calls, rng)
            rows.append(r)
            print(row_markdown(r), flush=True)
    title = (f"Kernel time of an all-dense SparseSplitMatMul call (automatic "
             f"threshold, full_stats=False) against TF's MatMul kernel on the "
             f"same inputs, from TF's profiler (executor time per kernel): "
             f"median of {args.calls} calls per column and round, {args.rounds} "
             f"interleaved rounds in a random order; ratio = median of the "
             f"per-round ratios t(TF) / t(ours), spread = their min..max; "
             f"{tf_machine_desc(build_info())}.")
    print()
    print(title)
    write_report(args.out, markdown_table(HEADER, [row_markdown(r) for r in rows],
                                          title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
