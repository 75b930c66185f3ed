"""Benchmark: the zero-skipping direct convolution kernels (SparseTrain,
Gong et al. 2019, arXiv 1911.10175; cc/core/direct_conv2d.h) against the
pixel-CSR kernels (cc/core/sparse_conv2d.h) and TensorFlow's oneDNN ops.

Forward: ``tf.nn.conv2d`` vs ``_kernels.direct_conv2d`` (direct) and
``direct_conv2d(pixel_csr=True)`` (count + pixel CSR + gather kernel).
Filter gradient: ``tf.raw_ops.Conv2DBackpropFilter`` vs
``direct_conv2d_backprop_filter`` (direct / pixel CSR). The kernels run
through the pybind11 module (no TensorFlow op overhead, both CPUs), TF's ops
inside ``tf.function``, timed without ``.numpy()``: on the CPU the call
returns once the result is computed, and a host copy of TF's output
(3.3 ms of 25 ms on the 32x56x56x64 layer) would be charged to TF alone,
the kernels writing their NumPy output in place. Each round times every
variant once, in alternating order; the table gives the median over rounds of TF time / kernel time (> 1:
the kernel is faster) and its min-max range. The arrays handed to the
kernels are 64-byte aligned, as TensorFlow's tensors are. Inputs: float32 NHWC, 3x3
filter, SAME padding, stride 1, with a given fraction of exact zeros either
i.i.d. uniform ("iid") or as the ReLU of a Gaussian shifted so that fraction
falls below zero ("relu").

Usage: ``python benchmarks/bench_direct_conv.py [--rounds 7]
[--layers main,28,b1,7] [--sparsities 0,0.5,0.7,0.9] [--dists iid,relu]
[--out benchmarks/results/bench_direct_conv.md]``
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
from tf_sparse_split._loader import kernels

import _common

# key: (name, N, H, W, C_in, C_out)
LAYERS = {
    "main": ("32x56x56x64->64 3x3", 32, 56, 56, 64, 64),
    "28": ("32x28x28x128->128 3x3", 32, 28, 28, 128, 128),
    "b1": ("1x14x14x256->256 3x3 (batch 1)", 1, 14, 14, 256, 256),
    "7": ("32x7x7x512->512 3x3", 32, 7, 7, 512, 512),
}
VARIANTS = ("tf_fwd", "direct_fwd", "csr_fwd", "tf_dF", "direct_dF", "csr_dF")


def make_input(shape, sparsity, dist, rng):
    """float32 NHWC input with about ``sparsity`` exact zeros."""
    if dist == "relu":
        z = rng.standard_normal(shape, dtype=np.float32)
        return np.maximum(z - np.quantile(z, sparsity), 0).astype(np.float32)
    vals = rng.standard_normal(shape, dtype=np.float32)
    return vals * (rng.random(shape, dtype=np.float32) >= sparsity)


def aligned(a, align=64):
    """A copy of ``a`` whose data start on an ``align``-byte boundary, as
    TensorFlow's CPU tensors do (numpy's own allocations are only 16-byte
    aligned, and a 64-byte vector load from them splits a cache line)."""
    buf = np.empty(a.nbytes + align, dtype=np.uint8)
    off = (-buf.ctypes.data) % align
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def run_layer(key, sparsities, dists, rounds):
    name, n, h, w, ci, co = LAYERS[key]
    K = kernels()
    threads = os.cpu_count()
    rng = np.random.default_rng(0)
    f = aligned(rng.standard_normal((3, 3, ci, co), dtype=np.float32))
    dy = aligned(rng.standard_normal((n, h, w, co), dtype=np.float32))
    ft, dyt = tf.constant(f), tf.constant(dy)
    tf_fwd = tf.function(lambda x: tf.nn.conv2d(x, ft, 1, "SAME"))
    tf_df = tf.function(lambda x: tf.raw_ops.Conv2DBackpropFilter(
        input=x, filter_sizes=[3, 3, ci, co], out_backprop=dyt,
        strides=[1, 1, 1, 1], padding="SAME"))
    rows = []
    for dist in dists:
        for sp in sparsities:
            x = aligned(make_input((n, h, w, ci), sp, dist, rng))
            xt = tf.constant(x)
            fns = {
                "tf_fwd": lambda: tf_fwd(xt),
                "direct_fwd": lambda: K.direct_conv2d(x, f, threads=threads),
                "csr_fwd": lambda: K.direct_conv2d(x, f, pixel_csr=True,
                                                   threads=threads),
                "tf_dF": lambda: tf_df(xt),
                "direct_dF": lambda: K.direct_conv2d_backprop_filter(
                    x, dy, 3, 3, threads=threads),
                "csr_dF": lambda: K.direct_conv2d_backprop_filter(
                    x, dy, 3, 3, pixel_csr=True, threads=threads),
            }
            # Same answers (cheap insurance for the numbers below).
            ref_y, ref_d = fns["tf_fwd"]().numpy(), fns["tf_dF"]().numpy()
            for v, ref in (("direct_fwd", ref_y), ("csr_fwd", ref_y),
                           ("direct_dF", ref_d), ("csr_dF", ref_d)):
                err = T.relative_error(fns[v](), ref)
                assert err < 1e-4, (name, dist, sp, v, err)
            times = {v: [] for v in VARIANTS}
            for r in range(rounds):
                for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                    t0 = time.perf_counter()
                    fns[v]()
                    times[v].append(time.perf_counter() - t0)
            row = dict(layer=name, dist=dist, sparsity=sp,
                       tf_fwd_ms=statistics.median(times["tf_fwd"]) * 1e3,
                       tf_dF_ms=statistics.median(times["tf_dF"]) * 1e3)
            for kind in ("fwd", "dF"):
                for v in ("direct", "csr"):
                    rat = [a / b for a, b in zip(times[f"tf_{kind}"],
                                                 times[f"{v}_{kind}"])]
                    row[f"{v}_{kind}"] = (statistics.median(rat), min(rat),
                                          max(rat))
            rows.append(row)
            print(f"{name:<32} {dist:4} {sp:4.2f} | fwd tf {row['tf_fwd_ms']:7.1f}"
                  f" ms direct {_fmt(row['direct_fwd'])} csr "
                  f"{_fmt(row['csr_fwd'])} | dF tf {row['tf_dF_ms']:7.1f} ms "
                  f"direct {_fmt(row['direct_dF'])} csr {_fmt(row['csr_dF'])}",
                  flush=True)
    return rows


def _fmt(r):
    return f"{r[0]:.2f}x [{r[1]:.2f}-{r[2]:.2f}]"


def markdown(rows, rounds, header):
    lines = [
        f"| layer | zeros | sparsity | tf.nn.conv2d (ms) | fwd direct | fwd "
        f"pixel CSR | Conv2DBackpropFilter (ms) | dF direct | dF pixel CSR |"]
    body = [f"| {r['layer']} | {r['dist']} | {r['sparsity']:.0%} | "
            f"{r['tf_fwd_ms']:.1f} | {_fmt(r['direct_fwd'])} | "
            f"{_fmt(r['csr_fwd'])} | {r['tf_dF_ms']:.1f} | "
            f"{_fmt(r['direct_dF'])} | {_fmt(r['csr_dF'])} |" for r in rows]
    note = (f"\nRatios: TF time / kernel time (> 1: the kernel is faster), "
            f"median [min-max] over {rounds} interleaved rounds, float32, "
            f"3x3 SAME stride 1. Kernels through the pybind11 module with "
            f"{os.cpu_count()} threads.\n")
    return _common.markdown_table(lines[0], body, title=header) + note


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layers", default="main,28,b1,7",
                   help="comma list of " + ",".join(LAYERS))
    p.add_argument("--sparsities", default="0,0.5,0.7,0.9")
    p.add_argument("--dists", default="iid,relu")
    p.add_argument("--out", default="",
                   help="markdown file to write (default: print only)")
    args = p.parse_args(argv)
    layers = args.layers.split(",")
    if args.rounds < 1 or any(k not in LAYERS for k in layers):
        p.error("--rounds must be >= 1 and --layers from " + ",".join(LAYERS))
    sps = [float(s) for s in args.sparsities.split(",")]
    if any(not 0 <= s < 1 for s in sps):
        p.error("--sparsities must be in [0, 1)")
    dists = args.dists.split(",")
    if any(d not in ("iid", "relu") for d in dists):
        p.error("--dists must be iid and/or relu")
    header = (_common.tf_machine_desc(tfss._loader.build_info()) +
              f"; direct kernels AVX-512: {kernels().direct_conv2d_uses_avx512()}")
    print(header)
    rows = []
    for key in layers:
        rows += run_layer(key, sps, dists, args.rounds)
    text = markdown(rows, args.rounds, header)
    print()
    print(text)
    _common.write_report(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
