"""The fixed per-call cost of an all-dense SparseSplitMatMul or
SparseSplitConv2D call: its kernel time against TF's MatMul / (fused)
Conv2D kernel on the same inputs.

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

``--dtypes`` and ``--sparsities`` give the products' dtype and the fraction
of zeros in ``a`` (default float32 without zeros): a product whose count is
skipped runs all-dense whatever its zeros, so what it pays beyond TF's kernel
is the decision alone.

Convolutions (``--convs``, NxHxWxC_inxC_out, 3x3 filter, SAME padding,
stride 1; default: the two convolutions of ``bench_inference.py``'s
cnn-small at batch 1, 32 and 256, and a ResNet-sized 32x56x56x64x64): ``SparseSplitConv2D`` with bias + ReLU (the inference form
the converted layers call) against ``tf.nn.relu(tf.nn.conv2d(x, f) + b)``,
which Grappler's remapper fuses into TF's ``_FusedConv2D`` (oneDNN's
``_MklNativeFusedConv2D``), and without bias against ``tf.nn.conv2d``.

Usage::

    python benchmarks/bench_fixed_cost.py [--shapes 128x2048x10,512x2048x1]
        [--dtypes float32,bfloat16] [--sparsities 0,0.99]
        [--convs 32x28x28x1x16,32x14x14x16x32] [--epilogues bias_relu,none]
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
# bench_inference.py's cnn-small convolutions at batch 1, 32 and 256 (its
# cnn-wide ones: 28x28x1x64 and 14x14x64x128), and a ResNet50 stage-1 one.
DEFAULT_CONVS = ",".join(
    f"{n}x{h}x{h}x{ci}x{co}" for n in (1, 32, 256)
    for h, ci, co in ((28, 1, 16), (14, 16, 32))) + ",32x56x56x64x64"


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


def run_case(m, k, n, direction, rounds, calls, rng, dtype=tf.float32,
             sparsity=0.0):
    """One product op(a) [m, k] x [k, n] in `dtype` (a with about `sparsity`
    zeros; a^T dY for direction "grad"), ours against tf.matmul."""
    ta = direction == "grad"
    a = tf.cast(tf.constant(random_sparse((m, k), sparsity, rng, np.float32)),
                dtype)
    y = tf.cast(tf.constant(
        rng.standard_normal((m if ta else k, n)).astype(np.float32)), dtype)

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
    r = _interleaved(cols, ours_stats, (a, y), rounds, calls, rng)
    r.update({"shape": f"{m}x{k}x{n}", "direction": direction,
              "dtype": tf.as_dtype(dtype).name, "sparsity": sparsity})
    return r


def _interleaved(cols, ours_stats, args, rounds, calls, rng):
    """Median kernel times of cols["tf"] and cols["ours"] ((fn, event name
    part) each) over interleaved rounds, their per-round ratio, and the
    medians of ours' analysis / dense-part times from ours_stats."""
    for fn, _ in cols.values():
        for _ in range(5):  # trace, calibrate, warm up
            fn(*args)
    per_round = collections.defaultdict(list)
    names = list(cols)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            fn, part = cols[name]
            per_round[name].append(statistics.median(
                _kernel_times(fn, args, calls, part)))
    ratios = [t / o for t, o in zip(per_round["tf"], per_round["ours"])]
    st = [ours_stats(*args).numpy() for _ in range(max(calls, 20))]
    return {
        "tf_us": statistics.median(per_round["tf"]) * 1e6,
        "ours_us": statistics.median(per_round["ours"]) * 1e6,
        "ratio": statistics.median(ratios), "spread": (min(ratios), max(ratios)),
        "analyze_us": statistics.median(s[S.TIME_ANALYZE] for s in st) * 1e6,
        "dense_us": statistics.median(s[S.TIME_DENSE] for s in st) * 1e6,
        "dense_frac": statistics.median(s[S.ROWS_DENSE] / max(s[S.M], 1)
                                        for s in st),
        "mode": collections.Counter(
            {0.0: "full", 1.0: "sampled", 2.0: "skipped"}[s[S.ANALYSIS]]
            for s in st).most_common(1)[0][0],
    }


def run_conv_case(n, h, w, c_in, c_out, epilogue, rounds, calls, rng):
    """An all-dense 3x3 SAME convolution, ours (automatic threshold,
    full_stats=False) against TF's kernel; epilogue "bias_relu" or
    "none"."""
    x = tf.constant(random_sparse((n * h * w, c_in), 0.0, rng, np.float32)
                    .reshape(n, h, w, c_in))
    f = tf.constant((rng.standard_normal((3, 3, c_in, c_out))
                     / np.sqrt(9 * c_in)).astype(np.float32))
    b = tf.constant(rng.standard_normal(c_out).astype(np.float32))
    fused = epilogue == "bias_relu"

    @tf.function
    def dense(x, f, b):
        y = tf.nn.conv2d(x, f, 1, "SAME")
        return tf.nn.relu(tf.nn.bias_add(y, b)) if fused else y

    def _ours(x, f, b, return_stats):
        return tfss.sparse_split_conv2d(
            x, f, 1, "SAME", threshold=-1.0, full_stats=False,
            bias=b if fused else None, activation="relu" if fused else None,
            return_stats=return_stats)

    ours = tf.function(lambda x, f, b: _ours(x, f, b, False))
    ours_stats = tf.function(lambda x, f, b: _ours(x, f, b, True)[1])
    cols = {"tf": (dense, "Conv2D"), "ours": (ours, "SparseSplitConv2D")}
    r = _interleaved(cols, ours_stats, (x, f, b), rounds, calls, rng)
    r.update({"shape": f"{n}x{h}x{w}x{c_in}->{c_out}", "direction": epilogue})
    return r


CONV_HEADER = ("| N x H x W x C_in -> C_out (3x3) | epilogue | TF kernel (us) | "
               "ours kernel (us) | TF / ours (median) | spread | ours: analysis "
               "(us) | ours: dense part (us) | analysis (most calls) | "
               "images dense |")


def conv_row_markdown(r):
    lo, hi = r["spread"]
    ep = "bias + relu" if r["direction"] == "bias_relu" else "none"
    return (f"| {r['shape']} | {ep} | {r['tf_us']:.1f} | {r['ours_us']:.1f} | "
            f"**{r['ratio']:.3f}x** | {lo:.2f}..{hi:.2f} | {r['analyze_us']:.1f} | "
            f"{r['dense_us']:.1f} | {r['mode']} | {r['dense_frac']:.2f} |")


HEADER = ("| M x K x N | dtype | sparsity | direction | TF MatMul kernel (us) | ours kernel (us) | "
          "TF / ours (median) | spread | ours: analysis (us) | ours: dense "
          "part (us) | analysis (most calls) |")


def row_markdown(r):
    lo, hi = r["spread"]
    return (f"| {r['shape']} | {r['dtype']} | {r['sparsity']:.2f} | "
            f"{'a @ b' if r['direction'] == 'fwd' else 'a^T @ dY'} | "
            f"{r['tf_us']:.1f} | {r['ours_us']:.1f} | **{r['ratio']:.3f}x** | "
            f"{lo:.2f}..{hi:.2f} | {r['analyze_us']:.1f} | {r['dense_us']:.1f} | "
            f"{r['mode']} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="comma-separated MxKxN products (default %(default)s)")
    p.add_argument("--directions", default="fwd,grad",
                   help="fwd (a @ b), grad (a^T @ dY) or both")
    p.add_argument("--dtypes", default="float32",
                   help="comma-separated dtypes of the products (float32, "
                        "bfloat16, float16, float64; default %(default)s)")
    p.add_argument("--sparsities", default="0",
                   help="comma-separated fractions of zeros in a, each in "
                        "[0, 1) (default %(default)s: no zeros)")
    p.add_argument("--convs", default=DEFAULT_CONVS,
                   help="comma-separated NxHxWxC_inxC_out convolutions (3x3, "
                        "SAME, stride 1); empty for none (default %(default)s)")
    p.add_argument("--epilogues", default="bias_relu,none",
                   help="conv epilogues: bias_relu and/or none")
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
    if any(len(s) != 3 or min(s) < 1 for s in shapes):
        p.error(f"--shapes: not MxKxN with sizes >= 1: {args.shapes!r}")
    try:
        convs = [tuple(int(v) for v in s.strip().split("x"))
                 for s in args.convs.split(",") if s.strip()]
    except ValueError:
        p.error(f"--convs: not NxHxWxC_inxC_out: {args.convs!r}")
    if any(len(c) != 5 or min(c) < 1 for c in convs):
        p.error(f"--convs: not NxHxWxC_inxC_out with sizes >= 1: {args.convs!r}")
    epilogues = [e.strip() for e in args.epilogues.split(",") if e.strip()]
    if not set(epilogues) <= {"bias_relu", "none"}:
        p.error("--epilogues: bias_relu and/or none")
    directions = [d.strip() for d in args.directions.split(",") if d.strip()]
    if not directions or not set(directions) <= {"fwd", "grad"}:
        p.error("--directions: fwd and/or grad")
    try:
        dtypes = [tf.as_dtype(d.strip()) for d in args.dtypes.split(",")
                  if d.strip()]
    except TypeError:
        p.error(f"--dtypes: unknown dtype in {args.dtypes!r}")
    if not dtypes or not set(dtypes) <= {tf.float32, tf.bfloat16, tf.float16,
                                         tf.float64}:
        p.error("--dtypes: float32, bfloat16, float16 and/or float64")
    try:
        sparsities = [float(v) for v in args.sparsities.split(",") if v.strip()]
    except ValueError:
        p.error(f"--sparsities: not numbers: {args.sparsities!r}")
    if not sparsities or not all(0.0 <= v < 1.0 for v in sparsities):
        p.error("--sparsities: fractions in [0, 1)")
    if args.rounds < 1 or args.calls < 1:
        p.error("--rounds and --calls must be >= 1")
    tfss.load_library()
    rng = np.random.default_rng(args.seed)
    if not shapes and not convs:
        p.error("nothing to measure: --shapes and --convs both empty")
    rows, conv_rows = [], []
    if shapes:
        print(HEADER, flush=True)
    for m, k, n in shapes:
        for dt in dtypes:
            for sp in sparsities:
                for d in directions:
                    r = run_case(m, k, n, d, args.rounds, args.calls, rng,
                                 dt, sp)
                    rows.append(r)
                    print(row_markdown(r), flush=True)
    if convs:
        print(CONV_HEADER, flush=True)
    for c in convs:
        for e in epilogues:
            r = run_conv_case(*c, e, args.rounds, args.calls, rng)
            conv_rows.append(r)
            print(conv_row_markdown(r), flush=True)
    title = (f"Kernel time of a SparseSplitMatMul / SparseSplitConv2D call "
             f"on operands without zeros (products: with the 'sparsity' "
             f"column's fraction of zeros in a; automatic threshold, "
             f"full_stats=False; all-dense unless the cost model predicts the "
             f"sparse kernel faster: column 'images dense') against TF's "
             f"MatMul / (fused) Conv2D kernel on the same inputs, "
             f"from TF's profiler (executor time per kernel): "
             f"median of {args.calls} calls per column and round, {args.rounds} "
             f"interleaved rounds in a random order; ratio = median of the "
             f"per-round ratios t(TF) / t(ours), spread = their min..max; "
             f"{tf_machine_desc(build_info())}.")
    print()
    print(title)
    text = ""
    if rows:
        text = markdown_table(HEADER, [row_markdown(r) for r in rows], title)
    if conv_rows:
        text += ("\n" if text else "") + markdown_table(
            CONV_HEADER, [conv_row_markdown(r) for r in conv_rows],
            None if rows else title)
    write_report(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
