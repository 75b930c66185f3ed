"""Kernel-level rates through the pybind11 module (no TensorFlow op overhead).

For an activation ``a`` of ``M x K`` float32 at several sparsities it times,
interleaved round by round in one process:

* a multi-threaded ``memcpy`` of ``a`` (the bandwidth baseline);
* the nonzero count of ``a`` (``row_col_nnz``) and count + CSR build
  (``CsrMatrix.rebuild``: into arrays kept from the previous call, as an op
  that keeps its buffers would), for ``a`` and for ``a^T`` (the
  weight-gradient layout);
* the CSR SpMM ``a @ b`` (``b`` is ``K x N``) and the transposed one
  ``a^T @ dY`` (``dY`` is ``M x N``) from the prebuilt CSRs;
* the dense GEMMs ``a @ b`` and ``a^T @ dY`` (numpy, and ``tf.matmul`` when
  TensorFlow is importable) for the dense rate.

Reported: GB/s of ``a``'s bytes (``M*K*4`` per pass) for copy, count and
conversion, and their fraction of the copy rate; useful GFLOP/s of the SpMMs
(``2 * nnz * N`` per second) and their fraction of the dense GEMM's rate
(``2 * M * K * N`` per second). Medians over the rounds, with min..max.

Usage::

    python benchmarks/bench_kernels.py [--m 1024 --k 4096 --n 1024] [--reps 7]
"""

import argparse
import os
import statistics

import numpy as np

from _common import call_times, cpus_desc, markdown_table, write_report
from tf_sparse_split._loader import kernels
from tf_sparse_split.testing import random_sparse

HERE = os.path.dirname(os.path.abspath(__file__))
SPARSITIES = [0.0, 0.5, 0.7, 0.9, 0.99]


def _dense_gemm():
    """(name, f(x, y, transpose_a)) of the fastest dense GEMM available."""
    try:
        import tensorflow as tf

        def f(x, y, ta):
            return tf.matmul(x, y, transpose_a=ta).numpy()
        return "tf.matmul", f
    except ImportError:  # pragma: no cover - TF is a dependency
        return "numpy", lambda x, y, ta: (x.T if ta else x) @ y


def measure(m, k, n, sparsity, reps, threads, rng, gemm):
    K = kernels()
    a = random_sparse((m, k), sparsity, rng, np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    if gemm[0] == "tf.matmul":
        import tensorflow as tf
        a_d, b_d, dy_d = tf.constant(a), tf.constant(b), tf.constant(dy)
    else:
        a_d, b_d, dy_d = a, b, dy
    h = K.csr_matrix(a, threads=threads)
    ht = K.csr_matrix(a, transpose=True, threads=threads)
    jobs = {
        "copy": lambda: K.parallel_copy(a, threads=threads),
        "count": lambda: K.row_col_nnz(a, threads=threads),
        # Rebuilt into the same arrays: the steady state of an op that keeps
        # its CSR buffers (a fresh allocation adds page faults, ~0.2 ms/MB).
        "count+build": lambda: h.rebuild(a, threads=threads),
        "count+build T": lambda: ht.rebuild(a, transpose=True, threads=threads),
        "spmm": lambda: h.spmm(b, threads=threads),
        "spmm T": lambda: ht.spmm(dy, threads=threads),
        "gemm": lambda: gemm[1](a_d, b_d, False),
        "gemm T": lambda: gemm[1](a_d, dy_d, True),
    }
    for f in jobs.values():
        f()
    times = {name: [] for name in jobs}
    for _ in range(reps):
        for name, f in jobs.items():
            times[name] += call_times(f, 1)
    # Correctness guard: a benchmark of a wrong kernel is worthless.
    ref = a.astype(np.float64) @ b.astype(np.float64)
    got = h.spmm(b, threads=threads)
    assert np.max(np.abs(got - ref)) <= 1e-4 * max(1.0, np.max(np.abs(ref)))
    nnz = h.nnz
    assert nnz == ht.nnz == np.count_nonzero(a)
    mb = a.nbytes / 1e9
    out = {"sparsity": sparsity, "nnz": nnz}
    for name, t in times.items():
        med, lo, hi = statistics.median(t), min(t), max(t)
        if name in ("copy", "count", "count+build", "count+build T"):
            out[name] = (mb / med, mb / hi, mb / lo)  # GB/s (median, worst, best)
        elif name.startswith("spmm"):
            fl = 2.0 * nnz * n / 1e9
            out[name] = (fl / med, fl / hi, fl / lo)  # useful GFLOP/s
        else:
            fl = 2.0 * m * k * n / 1e9
            out[name] = (fl / med, fl / hi, fl / lo)
    return out


def fmt(v):
    med, lo, hi = v
    return f"{med:.1f} ({lo:.1f}..{hi:.1f})"


def to_markdown(rows, title):
    header = ("| sparsity | nnz | copy GB/s | count GB/s | count+CSR GB/s (% of copy) | "
              "count+CSR of a^T GB/s (% of copy) | SpMM useful GFLOP/s (% of dense) | "
              "SpMM^T useful GFLOP/s (% of dense) | dense GEMM GFLOP/s | dense a^T GEMM GFLOP/s |")
    lines = []
    for r in rows:
        c = r["copy"][0]
        lines.append(
            f"| {r['sparsity']:.2f} | {r['nnz']} | {fmt(r['copy'])} | {fmt(r['count'])} | "
            f"{fmt(r['count+build'])} ({100 * r['count+build'][0] / c:.0f}%) | "
            f"{fmt(r['count+build T'])} ({100 * r['count+build T'][0] / c:.0f}%) | "
            f"{fmt(r['spmm'])} ({100 * r['spmm'][0] / r['gemm'][0]:.0f}%) | "
            f"{fmt(r['spmm T'])} ({100 * r['spmm T'][0] / r['gemm T'][0]:.0f}%) | "
            f"{fmt(r['gemm'])} | {fmt(r['gemm T'])} |")
    return markdown_table(header, lines, title)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=1024)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=os.path.join(HERE, "results", "bench_kernels.md"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    gemm = _dense_gemm()
    rows = []
    for sp in SPARSITIES:
        r = measure(args.m, args.k, args.n, sp, args.reps, args.threads, rng, gemm)
        rows.append(r)
        print(to_markdown([r], "").splitlines()[-1], flush=True)
    title = (f"Kernel rates, a: {args.m}x{args.k} float32, N = {args.n}, {args.threads} "
             f"threads, {cpus_desc()}; median (min..max) of "
             f"{args.reps} interleaved rounds. GB/s count a's bytes once per pass; "
             f"useful GFLOP/s = 2*nnz*N/s; dense = {gemm[0]} (2*M*K*N/s).")
    md = to_markdown(rows, title)
    print()
    print(title)
    write_report(args.out, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
