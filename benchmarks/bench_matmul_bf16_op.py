"""The bfloat16 SparseSplitMatMul op against TF's bfloat16 kernels, at kernel
level: where the op's sparse path stands against its own CSR SpMM kernel.

For each sparsity (fraction of zeros of ``a``) of an ``M x K x N`` product in
bfloat16 (``a [M, K] @ b [K, N]``, or the weight gradient ``a^T @ dY`` with
``--direction grad``), TensorFlow's profiler (``tf.profiler.experimental``,
as ``bench_fixed_cost.py``) records the executor time of each kernel, so the
``tf.function`` call overhead is left out:

* ``tf.matmul`` in bfloat16 (oneDNN ``_MklMatMul``, AMX where the CPU has it);
* ``sparse_split_matmul`` forced sparse (``threshold=1.0``: every row to the
  CSR SpMM) and automatic (``threshold=-1``: the cost model's plan, after
  its calibration), both ``full_stats=False``;
* ``tf.matmul(..., a_is_sparse=True)`` (TF's ``SparseMatMul``) in bfloat16;

each in its own ``tf.function``, in a fresh random order every round. Also,
same run: the kernel binding ``_kernels.lowp_spmm`` (count + CSR build +
CsrSpmm, one thread, wall-clock seconds) and the forced op's own phase times
from its statistics (``TIME_ANALYZE``: counting; ``TIME_SPARSE``: CSR build
and SpMM; the rest of the kernel time is the op's own bookkeeping).
Speed-ups are medians of the per-round ratios ``t(tf.matmul) / t(column)``
with their range.

``--clock cpu`` columns: the process's CPU seconds per whole call (all
threads) of ``tf.matmul`` and of the one-thread kernel, the clock of
``bench_matmul.py --bf16-kernels``: on a loaded machine TF's CPU seconds
include its pool threads' spinning, so CPU-second ratios against a
one-thread kernel overstate what the op gains in wall time.

Usage::

    python benchmarks/bench_matmul_bf16_op.py [--shape 128x2048x2048]
        [--sparsities 0.9,0.95,0.98] [--direction fwd|grad] [--rounds 7]
        [--calls 20] [--out FILE]
"""

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from _common import markdown_table, tf_machine_desc, write_report
from bench_fixed_cost import _kernel_times
from tf_sparse_split import _kernels
from tf_sparse_split._loader import build_info
from tf_sparse_split.testing import random_sparse
from tf_sparse_split.tools.cli import parse_positive_int, parse_rate
from tf_sparse_split.tuning import stats as S

HEADER = ("| sparsity | kernel | tf.matmul bf16 (ms) | op forced sparse | "
          "op automatic (rows sparse) | a_is_sparse=True | kernel binding "
          "(1 thread) | op analysis / sparse part (ms) | CPU s: tf.matmul / "
          "kernel |")


def _cpu_per_call(fn, calls):
    t0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls


def _wall_per_call(fn, calls):
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run_row(m, k, n, sparsity, direction, rounds, calls, rng):
    """One markdown row: see the module docstring."""
    ta = direction == "grad"
    a = random_sparse((m, k), sparsity, rng, np.float32)
    b = rng.standard_normal((m if ta else k, n)).astype(np.float32)
    a_bits = _kernels.lowp_round(a, "bfloat16")
    b_bits = _kernels.lowp_round(b, "bfloat16")
    at = tf.bitcast(tf.constant(a_bits), tf.bfloat16)
    bt = tf.bitcast(tf.constant(b_bits), tf.bfloat16)

    def op(threshold):
        return tf.function(lambda x, w: tfss.sparse_split_matmul(
            x, w, threshold, transpose_a=ta, full_stats=False))

    cols = {
        "tf": (tf.function(lambda x, w: tf.matmul(x, w, transpose_a=ta)),
               "MatMul"),
        "forced": (op(1.0), "SparseSplitMatMul"),
        "auto": (op(-1.0), "SparseSplitMatMul"),
        "is_sparse": (tf.function(lambda x, w: tf.matmul(
            x, w, transpose_a=ta, a_is_sparse=True)), "MatMul"),
    }
    stats_fn = tf.function(lambda x, w: tfss.sparse_split_matmul(
        x, w, 1.0, transpose_a=ta, return_stats=True)[1])
    auto_stats = tf.function(lambda x, w: tfss.sparse_split_matmul(
        x, w, -1.0, transpose_a=ta, return_stats=True)[1])

    def kernel():
        return _kernels.lowp_spmm(a_bits, b_bits, "bfloat16", ta, threads=1)

    # Same bits: the forced op runs the kernel the binding runs.
    ours = tf.bitcast(cols["forced"][0](at, bt), tf.uint16).numpy()
    np.testing.assert_array_equal(ours, kernel())
    for fn, _ in cols.values():
        for _ in range(5):  # trace, calibrate, warm up
            fn(at, bt)
    per = {c: [] for c in list(cols) + ["kernel", "tf_cpu", "kernel_cpu"]}
    names = list(per)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            if name in cols:
                fn, part = cols[name]
                per[name].append(statistics.median(
                    _kernel_times(fn, (at, bt), calls, part)))
            elif name == "kernel":
                per[name].append(_wall_per_call(kernel, calls))
            elif name == "tf_cpu":
                per[name].append(_cpu_per_call(
                    lambda: cols["tf"][0](at, bt), calls))
            else:
                per[name].append(_cpu_per_call(kernel, calls))

    def speedup(col, base="tf"):
        r = [x / y for x, y in zip(per[base], per[col])]
        return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"

    st = np.array([stats_fn(at, bt).numpy() for _ in range(calls)])
    ast = np.array([auto_stats(at, bt).numpy() for _ in range(calls)])
    rows_sparse = statistics.median(ast[:, S.ROWS_SPARSE])
    rows = k if ta else m
    nnz = int(np.count_nonzero(a_bits & 0x7FFF))
    choice = _kernels.bf16_spmm_kernel(rows, m if ta else k, n, nnz)
    return (f"| {sparsity:.2f} | {choice} | "
            f"{statistics.median(per['tf']) * 1e3:.3f} | {speedup('forced')} | "
            f"{speedup('auto')} ({rows_sparse:.0f}/{rows}) | "
            f"{speedup('is_sparse')} | {speedup('kernel')} | "
            f"{np.median(st[:, S.TIME_ANALYZE]) * 1e3:.3f} / "
            f"{np.median(st[:, S.TIME_SPARSE]) * 1e3:.3f} | "
            f"{speedup('kernel_cpu', 'tf_cpu')} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="128x2048x2048", help="MxKxN")
    p.add_argument("--sparsities", default="0.9,0.95,0.98",
                   help="fractions of zeros of a, comma-separated, in [0, 1)")
    p.add_argument("--direction", choices=("fwd", "grad"), default="fwd")
    p.add_argument("--rounds", type=parse_positive_int, default=7)
    p.add_argument("--calls", type=parse_positive_int, default=20,
                   help="calls per column per round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="report file ('': none)")
    args = p.parse_args(argv)
    try:
        m, k, n = (parse_positive_int(x) for x in args.shape.split("x"))
        sparsities = [parse_rate(x) for x in args.sparsities.split(",")]
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(f"--shape MxKxN of positive integers, --sparsities in [0, 1): {e}")
    rng = np.random.default_rng(args.seed)
    rows = []
    for s in sparsities:
        rows.append(run_row(m, k, n, s, args.direction, args.rounds,
                            args.calls, rng))
        print(rows[-1], flush=True)
    title = (f"{args.shape} {'a^T @ dY' if args.direction == 'grad' else 'a @ b'}"
             f" in bfloat16, kernel times from TF's profiler: speed-up "
             f"t(tf.matmul) / t(column), median of {args.rounds} interleaved "
             f"rounds (range); {tf_machine_desc(build_info())}")
    text = markdown_table(HEADER, rows, title)
    print(text)
    write_report(args.out, text)


if __name__ == "__main__":
    main()
