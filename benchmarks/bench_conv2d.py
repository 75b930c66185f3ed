"""Benchmark: SparseSplitConv2D (automatic threshold) vs tf.nn.conv2d.

Times, in one process and interleaved round by round, TensorFlow's ops
(``tf.nn.conv2d`` forward, ``tf.raw_ops.Conv2DBackpropFilter`` filter
gradient; oneDNN on x86 CPUs) against ours with the automatic threshold
(the cost model of cc/core/cost_model.h), forced all-sparse (threshold
1.0) and forced all-dense (threshold 0.0), all inside ``tf.function``, on inputs with a given fraction of exact
zeros scattered uniformly. Each round times every variant once (several
calls each); the table gives the median over rounds of TF time / our time
(> 1: ours faster) and the spread (min-max over rounds) of the auto ratio.
The automatic choice should never be below 0.95x of TF's op.

Writes ``<out>.md`` (markdown table) and ``<out>.png`` (ratio vs sparsity,
matplotlib) with ``--out`` (default ``benchmarks/results/bench_conv2d``).

``--fused`` times the fused case instead: a layer ``act(conv2d(x, w) + b)``
(32x28x28x32 -> 64, 3x3, SAME, relu) as TensorFlow runs it inside a
``tf.function`` (``tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(...), b))``,
which Grappler's remapper fuses into oneDNN's ``_MklNativeFusedConv2D``)
against ``sparse_split_conv2d(..., bias=b, activation="relu")`` forced
all-dense (threshold 0: the op then runs that same fused kernel) and
automatic, and the unfused form of ours (the op, then TF's BiasAdd and
Relu), interleaved; written to ``<out>_fused.md``.

``--record-family PATH`` records, for the two conv layers of the CLI's CNN
(28x28x1 -> 32 and 28x28x32 -> 64, 3x3 SAME, bias + relu) at batch 1 and
32, what the op's calibration times (split_runtime.h ``Calibrate``: the
dense and sparse paths on its sample of ``rows_full`` and ``rows_part``
images and on a copy thinned to every 8th nonzero) and the full batch's
all-dense and all-sparse times, as JSON: the recorded timings of
``tests/test_conv2d_family.py``, which checks the decisions on them
without timing anything.

``--dtypes float32,bfloat16`` (default ``float32``) runs every case in each
listed dtype (float32, bfloat16, float16), TensorFlow's op in the same
dtype; the tables gain a dtype column. In bfloat16 TensorFlow's oneDNN
kernels use AVX512_BF16 / AMX where the CPU has them, so the dense
baseline is far faster than in float32; ours widens the sparse images to
float32 for its sparse kernels. ``--sparsities`` overrides the list of
input sparsities; ``--shape`` picks one layer (``NxHxWxC_in->C_out``,
3x3 SAME) for the unfused table.

``--fused`` also times ``ours_auto_full``: the automatic call with
``full_stats=True``, which counts every value on every call (what every
automatic call did before the cheap analysis); ``ours_auto`` passes
``full_stats=False`` (the default without ``return_stats``, and what the
layers pass in ``predict``): a call the cost model keeps all-dense counts a
sample or nothing.

``--natural`` times the layers of ``NATURAL_SHAPES`` (32x56x56x64->64,
32x28x28x128->128, 1x14x14x256->256 at batch 1, 32x7x7x512->512) at 50%
and 70% zeros, i.i.d. and ReLU-like, all-sparse and automatic, with
wall-clock and process-CPU ratios; written to ``<out>_natural.md``.
``--layers 0,2`` picks some of them; ``--ab-kernel columns`` (or
``tiles``) adds, in the same interleaved rounds, the all-sparse forward with
another forward kernel of the direct convolution
(``TFSS_DIRECT_FWD_KERNEL=columns``: the sliding window one input column a
step instead of two; ``tiles``: the tiled kernel): the before/after of that
kernel in one process (``--ab-tiles`` = ``--ab-kernel tiles``).

Usage: ``python benchmarks/bench_conv2d.py [--rounds 7] [--all-shapes]
[--natural [--layers 0,1] [--ab-kernel columns|tiles]] [--fused] [--dtypes float32,bfloat16]
[--sparsities 0,0.5,0.9] [--record-family PATH]``
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from _common import write_report
from tf_sparse_split import testing as T

# name, N, H, W, C_in, C_out, K
MAIN_SHAPE = ("32x56x56x64->64 3x3", 32, 56, 56, 64, 64, 3)
MORE_SHAPES = [
    ("64x14x14x32->64 3x3", 64, 14, 14, 32, 64, 3),
    ("64x28x28x1->32 3x3", 64, 28, 28, 1, 32, 3),
]
SPARSITIES = [0.0, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99]
#: ``--natural``: layers of a ResNet-sized CNN at the sparsity ReLU networks
#: have (50-70% zeros), i.i.d. and ReLU-like zeros.
NATURAL_SHAPES = [
    MAIN_SHAPE,
    ("32x28x28x128->128 3x3", 32, 28, 28, 128, 128, 3),
    ("32x14x14x64->128 3x3", 32, 14, 14, 64, 128, 3),
    ("1x14x14x256->256 3x3 (batch 1)", 1, 14, 14, 256, 256, 3),
    ("32x7x7x512->512 3x3", 32, 7, 7, 512, 512, 3),
]
NATURAL_SPARSITIES = [0.5, 0.7]
VARIANTS = ("tf_fwd", "auto_fwd", "sparse_fwd", "dense_fwd", "tf_dF",
            "auto_dF", "sparse_dF", "dense_dF")


def _calls_per_round(fn, target_s=0.05):
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-5)
    return int(min(20, max(1, target_s / once)))


#: Relative error allowed against TF's op in the same dtype (a sanity check
#: of the timed results, not the accuracy test: tests/ hold those).
_CHECK_TOL = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 3e-2,
              "float16": 3e-3}


def _error_vs(got, want):
    return T.relative_error(tf.cast(got, tf.float64).numpy(),
                            tf.cast(want, tf.float64).numpy())


def make_input(shape, sparsity, rng, dist="iid"):
    """float32 NHWC input with about ``sparsity`` exact zeros: scattered
    uniformly ("iid", testing.random_sparse_images) or as the ReLU of a
    Gaussian shifted so that that fraction falls below zero ("relu")."""
    if dist == "relu":
        z = rng.standard_normal(shape, dtype=np.float32)
        return np.maximum(z - np.quantile(z, sparsity), 0).astype(np.float32)
    return T.random_sparse_images(shape, sparsity, rng)


def _with_forward_kernel(fn, kernel):
    """fn run with the direct forward kernel ``kernel`` (``columns`` or
    ``tiles``: TFSS_DIRECT_FWD_KERNEL, read by the kernel on every call)
    instead of the default paired sliding window: the before/after A/B of
    --ab-kernel in one process."""
    def run(x):
        old = os.environ.get("TFSS_DIRECT_FWD_KERNEL")
        os.environ["TFSS_DIRECT_FWD_KERNEL"] = kernel
        try:
            y = fn(x)
            y.numpy()
        finally:
            if old is None:
                del os.environ["TFSS_DIRECT_FWD_KERNEL"]
            else:
                os.environ["TFSS_DIRECT_FWD_KERNEL"] = old
        return y
    return run


def run_shape(shape, rounds, out=sys.stdout, dtype="float32",
              sparsities=SPARSITIES, dist="iid", ab_kernel=None):
    name, n, h, w, ci, co, k = shape
    lib = tfss.load_library()
    rng = np.random.default_rng(0)
    dt = tf.as_dtype(dtype)
    f = tf.cast(rng.normal(size=(k, k, ci, co)).astype(np.float32), dt)
    dy = tf.cast(rng.normal(size=(n, h, w, co)).astype(np.float32), dt)
    fsize = tf.constant([k, k, ci, co])
    strides = [1, 1, 1, 1]
    # New functions (new op instances: their plan memories start empty;
    # the families' calibrations are per process) for every sparsity: an
    # op carried from the previous row starts a row with that row's plan
    # and sample back-off, and a row of 10-20 calls then times mostly the
    # transition -- from 50% to 70% zeros the automatic forward stayed
    # all-dense for 8-9 calls (its samples 16 calls apart, the sparse plan
    # confirmed over 3 more) and read 0.92-1.00x where all-sparse ran 1.5x.
    def make_fns():
        return {
            "tf_fwd": tf.function(lambda x: tf.nn.conv2d(x, f, 1, "SAME")),
            "auto_fwd": tf.function(lambda x: tfss.sparse_split_conv2d(
                x, f, 1, "SAME", threshold=-1.0)),
            "sparse_fwd": tf.function(lambda x: tfss.sparse_split_conv2d(
                x, f, 1, "SAME", threshold=1.0)),
            "dense_fwd": tf.function(lambda x: tfss.sparse_split_conv2d(
                x, f, 1, "SAME", threshold=0.0)),
            "tf_dF": tf.function(lambda x: tf.raw_ops.Conv2DBackpropFilter(
                input=x, filter_sizes=fsize, out_backprop=dy, strides=strides,
                padding="SAME")),
            "auto_dF": tf.function(
                lambda x: lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
                    x, fsize, dy, -1.0, strides=strides, padding="SAME",
                    full_stats=False)[0]),
            "sparse_dF": tf.function(
                lambda x: lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
                    x, fsize, dy, 1.0, strides=strides, padding="SAME",
                    full_stats=False)[0]),
            "dense_dF": tf.function(
                lambda x: lib.tf_sparse_split_sparse_split_conv2d_backprop_filter(
                    x, fsize, dy, 0.0, strides=strides, padding="SAME",
                    full_stats=False)[0]),
        }
    variants = VARIANTS + (("ab_fwd",) if ab_kernel else ())
    rows = []
    for sp in sparsities:
        fns = make_fns()
        if ab_kernel:
            fns["ab_fwd"] = _with_forward_kernel(fns["sparse_fwd"], ab_kernel)
        x = tf.cast(make_input((n, h, w, ci), sp, rng, dist), dt)
        # Same answer (cheap insurance for the numbers below).
        for a, b in (("tf_fwd", "auto_fwd"), ("tf_dF", "auto_dF")):
            err = _error_vs(fns[b](x), fns[a](x))
            assert err < _CHECK_TOL[dtype], (name, dtype, sp, b, err)
        reps = {v: _calls_per_round(lambda v=v: fns[v](x).numpy())
                for v in variants}
        # Wall-clock and process CPU seconds per call (under load the CPU
        # time of this process is the steadier measure of the work).
        times = {v: [] for v in variants}
        cpu = {v: [] for v in variants}
        for r in range(rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(reps[v]):
                    y = fns[v](x)
                y.numpy()
                times[v].append((time.perf_counter() - t0) / reps[v])
                cpu[v].append((time.process_time() - c0) / reps[v])
        ratio = {}
        for kind in ("fwd", "dF"):
            for key, t in (("", times), ("cpu_", cpu)):
                tf_t = t[f"tf_{kind}"]
                for v in ("auto", "sparse", "dense", "ab"):
                    if f"{v}_{kind}" not in t:
                        continue
                    per_round = [a / b for a, b in zip(tf_t, t[f"{v}_{kind}"])]
                    ratio[f"{key}{v}_{kind}"] = (statistics.median(per_round),
                                                 min(per_round), max(per_round))
        row = dict(shape=name, sparsity=sp, dtype=dtype, dist=dist,
                   tf_fwd_ms=statistics.median(times["tf_fwd"]) * 1e3,
                   tf_dF_ms=statistics.median(times["tf_dF"]) * 1e3, **ratio)
        rows.append(row)
        print(f"{name:<22} {dtype:<8} {dist:4} {sp:5.2f}  fwd tf {row['tf_fwd_ms']:7.2f} ms auto "
              f"{ratio['auto_fwd'][0]:5.2f}x [{ratio['auto_fwd'][1]:.2f}-"
              f"{ratio['auto_fwd'][2]:.2f}] sparse {ratio['sparse_fwd'][0]:5.2f}x"
              f" (cpu {ratio['cpu_sparse_fwd'][0]:5.2f}x)"
              f" dense {ratio['dense_fwd'][0]:5.2f}x"
              f" | dF tf {row['tf_dF_ms']:7.2f} ms auto "
              f"{ratio['auto_dF'][0]:5.2f}x [{ratio['auto_dF'][1]:.2f}-"
              f"{ratio['auto_dF'][2]:.2f}] sparse {ratio['sparse_dF'][0]:5.2f}x"
              f" (cpu {ratio['cpu_sparse_dF'][0]:5.2f}x)"
              f" dense {ratio['dense_dF'][0]:5.2f}x" +
              (f" | fwd {ab_kernel} kernel {ratio['ab_fwd'][0]:5.2f}x (cpu "
               f"{ratio['cpu_ab_fwd'][0]:5.2f}x)" if ab_kernel else ""),
              file=out, flush=True)
    return rows


FUSED_SHAPE = ("32x28x28x32->64 3x3 relu", 32, 28, 28, 32, 64, 3)
FUSED_SPARSITIES = [0.0, 0.5]
FUSED_VARIANTS = ("tf_fused", "ours_dense", "ours_auto", "ours_auto_full",
                  "ours_unfused")


def run_fused(rounds, shape=FUSED_SHAPE, out=sys.stdout, dtype="float32",
              sparsities=FUSED_SPARSITIES):
    """Interleaved timings of the fused layer: per sparsity, the median over
    rounds of TF time / our time for each of our variants, and its
    min-max spread."""
    name, n, h, w, ci, co, k = shape
    rng = np.random.default_rng(1)
    dt = tf.as_dtype(dtype)
    f = tf.cast((rng.normal(size=(k, k, ci, co)) * 0.1).astype(np.float32), dt)
    b = tf.cast(rng.normal(size=co).astype(np.float32), dt)
    fns = {
        "tf_fused": tf.function(lambda x: tf.nn.relu(
            tf.nn.bias_add(tf.nn.conv2d(x, f, 1, "SAME"), b))),
        "ours_dense": tf.function(lambda x: tfss.sparse_split_conv2d(
            x, f, 1, "SAME", threshold=0.0, bias=b, activation="relu")),
        "ours_auto": tf.function(lambda x: tfss.sparse_split_conv2d(
            x, f, 1, "SAME", threshold=-1.0, bias=b, activation="relu",
            full_stats=False)),
        "ours_auto_full": tf.function(lambda x: tfss.sparse_split_conv2d(
            x, f, 1, "SAME", threshold=-1.0, bias=b, activation="relu",
            full_stats=True)),
        "ours_unfused": tf.function(lambda x: tf.nn.relu(tf.nn.bias_add(
            tfss.sparse_split_conv2d(x, f, 1, "SAME", threshold=0.0), b))),
    }
    rows = []
    for sp in sparsities:
        x = tf.cast(T.random_sparse_images((n, h, w, ci), sp, rng), dt)
        ref = fns["tf_fused"](x)
        for v in FUSED_VARIANTS[1:]:
            err = _error_vs(fns[v](x), ref)
            assert err < _CHECK_TOL[dtype], (name, dtype, sp, v, err)
        reps = {v: _calls_per_round(lambda v=v: fns[v](x).numpy())
                for v in FUSED_VARIANTS}
        # Wall-clock and process CPU seconds per call: under load (other
        # tenants on the cores) the CPU time of this process is the steadier
        # measure of the work each variant does.
        times = {v: [] for v in FUSED_VARIANTS}
        cpu = {v: [] for v in FUSED_VARIANTS}
        for r in range(rounds):
            order = FUSED_VARIANTS if r % 2 == 0 else FUSED_VARIANTS[::-1]
            for v in order:
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(reps[v]):
                    y = fns[v](x)
                y.numpy()
                times[v].append((time.perf_counter() - t0) / reps[v])
                cpu[v].append((time.process_time() - c0) / reps[v])
        row = dict(shape=name, sparsity=sp, dtype=dtype,
                   tf_ms=statistics.median(times["tf_fused"]) * 1e3,
                   tf_cpu_ms=statistics.median(cpu["tf_fused"]) * 1e3)
        for v in FUSED_VARIANTS[1:]:
            for key, t in (("", times), ("cpu_", cpu)):
                per_round = [a / c for a, c in zip(t["tf_fused"], t[v])]
                row[key + v] = (statistics.median(per_round), min(per_round),
                                max(per_round))
            row[v + "_ms"] = statistics.median(times[v]) * 1e3
        rows.append(row)
        print(f"{name:<26} {dtype:<8} {sp:4.2f}  tf fused {row['tf_ms']:6.2f} ms "
              f"(cpu {row['tf_cpu_ms']:6.2f} ms) | " +
              " | ".join(f"{v} {row[v + '_ms']:6.2f} ms {row[v][0]:.3f}x "
                         f"[{row[v][1]:.3f}-{row[v][2]:.3f}] cpu "
                         f"{row['cpu_' + v][0]:.3f}x"
                         for v in FUSED_VARIANTS[1:]), file=out, flush=True)
    return rows


def markdown_fused(rows, rounds, header):
    lines = [
        header, "",
        "| layer | dtype | input sparsity | measure | TF fused conv (ms) | "
        "ours all-dense | spread | ours auto | spread | ours auto, full "
        "count | spread | ours unfused | spread |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for key, label, ms in (("", "wall", r["tf_ms"]),
                               ("cpu_", "process CPU", r["tf_cpu_ms"])):
            d, a, af, u = (r[key + v] for v in FUSED_VARIANTS[1:])
            lines.append(
                f"| {r['shape']} | {r['dtype']} | {r['sparsity']:.0%} | "
                f"{label} | {ms:.2f} | "
                f"{d[0]:.3f} | {d[1]:.3f}-{d[2]:.3f} | {a[0]:.3f} | "
                f"{a[1]:.3f}-{a[2]:.3f} | {af[0]:.3f} | {af[1]:.3f}-"
                f"{af[2]:.3f} | {u[0]:.3f} | {u[1]:.3f}-{u[2]:.3f} |")
    lines += ["", f"Ratios are TF time / our time (> 1: ours faster): median "
              f"over {rounds} interleaved rounds (spread: min-max over "
              "rounds) of wall-clock and of process CPU seconds per call, "
              "NHWC, SAME, stride 1, TF in the same dtype. TF: "
              "tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w), b)) in a "
              "tf.function (Grappler fuses it into _MklNativeFusedConv2D); "
              "ours all-dense: sparse_split_conv2d(bias=b, activation='relu', "
              "threshold=0); auto: threshold=-1 (full_stats=False: a call "
              "kept all-dense counts a sample or nothing); auto, full count: "
              "threshold=-1, full_stats=True; unfused: the op without "
              "bias/activation followed by TF's BiasAdd and Relu."]
    return "\n".join(lines) + "\n"


def _digit_like(n, side, rng):
    """Images [n, side, side, 1] of a few thick random strokes on zeros
    (about 20% nonzero, as hand-written digits)."""
    x = np.zeros((n, side, side, 1), np.float32)
    for i in range(n):
        for _ in range(3):
            (r0, c0), (r1, c1) = rng.integers(4, side - 4, size=(2, 2))
            for t in np.linspace(0.0, 1.0, 2 * side):
                r, c = int(r0 + t * (r1 - r0)), int(c0 + t * (c1 - c0))
                x[i, r - 1:r + 2, c - 1:c + 2, 0] = rng.uniform(0.3, 1.0)
    return x


def _best_part_seconds(fn, x, part, reps):
    """Best over reps of the stats' dense (part 'dense') or sparse part
    seconds of fn(x) -> (y, stats)."""
    from tf_sparse_split.tuning import stats as S

    idx = S.TIME_DENSE if part == "dense" else S.TIME_SPARSE
    return min(float(fn(x)[1][idx]) for _ in range(reps))


def record_family(path, reps=7):
    """Writes the recorded calibration and full-batch timings (see the
    module docstring) of the CNN's two conv layers at batch 1 and 32."""
    import json

    rng = np.random.default_rng(2)
    side, (c1, c2) = 28, (32, 64)
    f1 = (rng.normal(size=(3, 3, 1, c1)) * 0.5).astype(np.float32)
    b1 = (rng.normal(size=c1) * 0.1).astype(np.float32)
    f2 = (rng.normal(size=(3, 3, c1, c2)) * 0.1).astype(np.float32)
    b2 = (rng.normal(size=c2) * 0.1).astype(np.float32)
    x1 = _digit_like(32, side, rng)
    x2 = tf.nn.relu(tf.nn.conv2d(x1, f1, 1, "SAME") + b1).numpy()
    out = dict(machine=f"tf {tf.__version__}, {os.cpu_count()} CPUs",
               note="seconds; best of %d; the op's stats part times" % reps,
               layers=[])
    for name, x_all, f, b in (("conv_1", x1, f1, b1), ("conv_2", x2, f2, b2)):
        fns = {thr_name: tf.function(
            lambda x, t=thr, f=f, b=b: tfss.sparse_split_conv2d(
                x, f, 1, "SAME", threshold=t, bias=b, activation="relu",
                return_stats=True))
            for thr_name, thr in (("dense", 0.0), ("sparse", 1.0))}
        for n in (1, 32):
            x = x_all[:n]
            k = x[0].size
            rows_full = max(1, min(n, -(-(1 << 20) // k)))
            rows_part = max(1, rows_full // 4)
            sample = x[:rows_full]
            flat = sample.reshape(rows_full, -1)
            thin = np.zeros_like(flat)
            for r in range(rows_full):
                nz = np.flatnonzero(flat[r])[::8]
                thin[r, nz] = flat[r, nz]
            thin = thin.reshape(sample.shape)
            half = max(1, k // 2)
            t0 = time.perf_counter()
            for _ in range(reps):
                np.ascontiguousarray(flat[:, ::2][:, :half])
            copy_s = (time.perf_counter() - t0) / reps

            def nnz(a):
                return float(np.count_nonzero(a))

            cal = dict(
                rows_full=rows_full, rows_part=rows_part,
                dense_full_s=_best_part_seconds(fns["dense"], sample, "dense", reps),
                dense_part_s=_best_part_seconds(fns["dense"], sample[:rows_part],
                                                "dense", reps),
                nnz_full=nnz(sample), nnz_thin=nnz(thin),
                nnz_part=nnz(sample[:rows_part]),
                sparse_full_s=_best_part_seconds(fns["sparse"], sample, "sparse", reps),
                sparse_thin_s=_best_part_seconds(fns["sparse"], thin, "sparse", reps),
                sparse_part_s=_best_part_seconds(fns["sparse"], sample[:rows_part],
                                                 "sparse", reps),
                copy_elems=float(rows_full * half), copy_s=copy_s)
            out["layers"].append(dict(
                layer=name, n=n, h=side, w=side, c_in=int(x.shape[3]),
                c_out=int(f.shape[3]), kh=3, kw=3, out_h=side, out_w=side,
                c_live=int(np.count_nonzero(x.reshape(-1, x.shape[3]).any(0))),
                image_nnz=[int(np.count_nonzero(im)) for im in x],
                calibration=cal,
                all_dense_s=_best_part_seconds(fns["dense"], x, "dense", reps),
                all_sparse_s=_best_part_seconds(fns["sparse"], x, "sparse", reps)))
            print(name, n, json.dumps(out["layers"][-1]["calibration"]),
                  out["layers"][-1]["all_dense_s"],
                  out["layers"][-1]["all_sparse_s"], flush=True)
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {path}")


def markdown(rows, rounds, header):
    lines = [
        header, "",
        "| layer | dtype | input sparsity | tf.nn.conv2d (ms) | fwd auto | "
        "fwd auto spread | fwd all-sparse | Conv2DBackpropFilter (ms) | dF "
        "auto | dF auto spread | dF all-sparse |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        a, s, ad, sd = r["auto_fwd"], r["sparse_fwd"], r["auto_dF"], r["sparse_dF"]
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['sparsity']:.0%} | "
            f"{r['tf_fwd_ms']:.2f} | "
            f"{a[0]:.2f} | {a[1]:.2f}-{a[2]:.2f} | {s[0]:.2f} | "
            f"{r['tf_dF_ms']:.2f} | {ad[0]:.2f} | {ad[1]:.2f}-{ad[2]:.2f} | "
            f"{sd[0]:.2f} |")
    lines += ["", f"Ratios are TF time / our time (> 1: ours faster): median "
              f"over {rounds} interleaved rounds (spread: min-max over rounds),"
              " NHWC, SAME padding, stride 1, zeros scattered "
              "uniformly. 'auto' is the automatic threshold (threshold=-1, "
              "calibrated on its first call), 'all-sparse' threshold=1; TF's "
              "op runs in the row's dtype."]
    return "\n".join(lines) + "\n"


def markdown_natural(rows, rounds, header, ab_kernel=None):
    """The --natural table: all-sparse and automatic calls against TF's
    ops, wall-clock and process-CPU ratios."""
    def f(r):
        return f"{r[0]:.2f} [{r[1]:.2f}-{r[2]:.2f}]"
    ab = bool(rows) and "ab_fwd" in rows[0]
    lines = [
        header, "",
        "| layer | zeros | sparsity | tf.nn.conv2d (ms) | fwd all-sparse | "
        "fwd all-sparse, CPU | fwd all-dense | fwd auto | "
        "Conv2DBackpropFilter (ms) | dF all-sparse | dF all-sparse, CPU | "
        "dF all-dense | dF auto |" +
        (f" fwd all-sparse, {ab_kernel} kernel | {ab_kernel}, CPU |"
         if ab else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" +
        ("---:|---:|" if ab else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['dist']} | {r['sparsity']:.0%} | "
            f"{r['tf_fwd_ms']:.2f} | {f(r['sparse_fwd'])} | "
            f"{f(r['cpu_sparse_fwd'])} | {f(r['dense_fwd'])} | "
            f"{f(r['auto_fwd'])} | "
            f"{r['tf_dF_ms']:.2f} | {f(r['sparse_dF'])} | "
            f"{f(r['cpu_sparse_dF'])} | {f(r['dense_dF'])} | "
            f"{f(r['auto_dF'])} |" +
            (f" {f(r['ab_fwd'])} | {f(r['cpu_ab_fwd'])} |" if ab else ""))
    lines += ["", f"Ratios are TF time / our time (> 1: ours faster), through "
              f"the ops with TF's thread pool: median [min-max] over {rounds} "
              "interleaved rounds of wall-clock seconds per call, and (CPU) "
              "of process CPU seconds per call, float32, NHWC, 3x3 SAME, "
              "stride 1. Zeros i.i.d. ('iid', testing.random_sparse_images) "
              "or ReLU-like ('relu': max(z - q, 0) of a Gaussian z, q its "
              "sparsity quantile). 'all-sparse': threshold=1 (every image "
              "through the sparse kernel the op picks); 'all-dense': "
              "threshold=0; 'auto': threshold=-1; every call with "
              "full_stats=False, as the layers and their gradients call "
              "the ops (an automatic or all-sparse call on the direct "
              "kernel counts a sample, not every value)."]
    if ab:
        lines[-1] += (f" '{ab_kernel} kernel': the all-sparse forward with "
                      f"TFSS_DIRECT_FWD_KERNEL={ab_kernel} (the direct "
                      "kernel's " + ("tiled forward" if ab_kernel == "tiles"
                                     else "one-column sliding window") +
                      " instead of its paired sliding window), in the same "
                      "rounds.")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind, title in ((axes[0], "fwd", "forward (tf.nn.conv2d)"),
                            (axes[1], "dF", "filter gradient")):
        for shape, dtype in dict.fromkeys((r["shape"], r["dtype"])
                                          for r in rows):
            rs = [r for r in rows
                  if r["shape"] == shape and r["dtype"] == dtype]
            shape = f"{shape} {dtype}"
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
    p.add_argument("--record-family", metavar="PATH", default=None,
                   help="record the CNN's calibration timings at batch 1 "
                        "and 32 as JSON (tests/data/conv_family_timings.json)")
    p.add_argument("--dtypes", default="float32",
                   help="comma-separated dtypes (float32, bfloat16, float16, "
                        "float64; default float32)")
    p.add_argument("--sparsities", default=None,
                   help="comma-separated input sparsities in [0, 1]")
    p.add_argument("--shape", default=None,
                   help="one layer NxHxWxC_in->C_out (3x3 SAME) instead of "
                        "the default shapes (with --fused: instead of "
                        "32x28x28x32->64)")
    p.add_argument("--natural", action="store_true",
                   help="time the layers of NATURAL_SHAPES at 50%% and 70%% "
                        "zeros, i.i.d. and ReLU-like (writes <out>_natural.md)")
    p.add_argument("--ab-kernel", choices=("columns", "tiles"), default=None,
                   help="with --natural: also time the all-sparse forward "
                        "with this forward kernel of the direct convolution "
                        "(TFSS_DIRECT_FWD_KERNEL), in the same rounds")
    p.add_argument("--ab-tiles", action="store_true",
                   help="the same as --ab-kernel tiles")
    p.add_argument("--layers", default=None,
                   help="with --natural: comma-separated indices into "
                        "NATURAL_SHAPES (default: all)")
    p.add_argument("--fused", action="store_true",
                   help="time the fused bias + relu layer instead (writes "
                        "<out>_fused.md)")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "results", "bench_conv2d"),
                   help="output path; .md and .png are written (a trailing "
                        ".md is dropped)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.out.endswith(".md"):
        args.out = args.out[:-3]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in _CHECK_TOL:
            p.error(f"--dtypes: unknown dtype {d!r}")
    sparsities = None
    if args.sparsities:
        try:
            sparsities = [float(v) for v in args.sparsities.split(",")]
        except ValueError:
            p.error(f"--sparsities: not numbers: {args.sparsities!r}")
        if not all(0.0 <= v <= 1.0 for v in sparsities):
            p.error("--sparsities must be in [0, 1]")
    shapes = [MAIN_SHAPE] + (MORE_SHAPES if args.all_shapes else [])
    if args.shape:
        try:
            lhs, cout = args.shape.split("->")
            n, h, w, ci = (int(v) for v in lhs.split("x"))
            shapes = [(f"{args.shape} 3x3", n, h, w, ci, int(cout), 3)]
        except ValueError:
            p.error(f"--shape must be NxHxWxC_in->C_out, got {args.shape!r}")
    info = tfss._loader.build_info()
    header = (f"tf {tf.__version__}, library built with {info['MARCH']} "
              f"({info['ISA']}), {os.cpu_count()} CPUs")
    print(header)
    if args.record_family:
        record_family(args.record_family)
        return 0
    ab_kernel = args.ab_kernel or ("tiles" if args.ab_tiles else None)
    if args.natural:
        rows = []
        layers = NATURAL_SHAPES
        if args.layers:
            layers = [NATURAL_SHAPES[int(i)] for i in args.layers.split(",")]
        for shape in ([shapes[0]] if args.shape else layers):
            for dist in ("iid", "relu"):
                rows += run_shape(shape, args.rounds, dist=dist,
                                  sparsities=sparsities or NATURAL_SPARSITIES,
                                  ab_kernel=ab_kernel)
        table = markdown_natural(rows, args.rounds, header, ab_kernel)
        print()
        print(table)
        write_report(args.out + "_natural.md", table)
        return 0
    if args.fused:
        rows = []
        for d in dtypes:
            rows += run_fused(args.rounds, dtype=d,
                              shape=shapes[0] if args.shape else FUSED_SHAPE,
                              sparsities=sparsities or FUSED_SPARSITIES)
        table = markdown_fused(rows, args.rounds, header)
        print()
        print(table)
        write_report(args.out + "_fused.md", table)
        return 0
    rows = []
    for shape in shapes:
        for d in dtypes:
            rows += run_shape(shape, args.rounds, dtype=d,
                              sparsities=sparsities or SPARSITIES)
    table = markdown(rows, args.rounds, header)
    print()
    print(table)
    def write_plot():
        plot(rows, args.out + ".png")
        return args.out + ".png"

    write_report(args.out + ".md", table, also=write_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
