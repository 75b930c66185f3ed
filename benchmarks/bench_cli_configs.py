"""``tf-sparse-split train --compare`` in every configuration the CLI
offers, several runs each, in one table.

Each run is one subprocess ``python -m tf_sparse_split train --compare
FLAGS`` (the CLI's defaults otherwise: the embedded digits, 5 epochs,
batch 256 for mlp and lstm, 128 for cnn). The speed-up is the CLI's own
line: the median over interleaved blocks of training steps of
t(plain Keras) / t(sparse-split), with the range of the blocks; this
script only collects it. The runs go round-robin over the configurations
(run 1 of every configuration, then run 2, ...), so a slow phase of the
machine lands on several configurations instead of on all runs of one.

Reported per configuration: the speed-up of each run (range of its
blocks), the ms per step of both models in the last run, both test
accuracies, and the median over runs. Writes a markdown table to
``benchmarks/results/bench_cli_configs.md`` (``--out``).

Usage::

    python benchmarks/bench_cli_configs.py [--runs 3] [--only cnn,lstm]
        [--data ../shared/data/mnist]

``--only`` keeps the configurations whose flags contain one of the given
words (``default`` selects the configuration without flags).
``--quick``: one run of two configurations with one epoch, nothing
written unless ``--out`` is given (a smoke test of the script).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import cpus_desc, markdown_table, mnist_dirs, write_report

HERE = Path(__file__).resolve().parent

#: (label, flags): every configuration of ``train --compare`` the CLI
#: offers, its model kinds, dropouts and sparsity targets. ``{mnist}`` is
#: replaced by the MNIST directory (configurations needing it are dropped
#: when there is none).
CONFIGS = (
    ("default", ()),
    ("--target-sparsity none", ("--target-sparsity", "none")),
    ("--target-sparsity 0.5", ("--target-sparsity", "0.5")),
    ("--dropout standard", ("--dropout", "standard")),
    ("--dropout row", ("--dropout", "row")),
    ("--dropout tile", ("--dropout", "tile")),
    ("--model cnn", ("--model", "cnn")),
    ("--model cnn --target-sparsity none",
     ("--model", "cnn", "--target-sparsity", "none")),
    ("--model cnn --filters 64,128", ("--model", "cnn", "--filters", "64,128")),
    ("--model lstm", ("--model", "lstm")),
    ("--model lstm --dropout row", ("--model", "lstm", "--dropout", "row")),
    ("--model lstm --dropout tile", ("--model", "lstm", "--dropout", "tile")),
    ("--model lstm --dropout standard",
     ("--model", "lstm", "--dropout", "standard")),
    ("--data MNIST", ("--data", "{mnist}")),
)

SPEEDUP = re.compile(
    r"speed-up vs plain Keras: ([0-9.]+)x \(median of (\d+) interleaved "
    r"blocks of (\d+) steps?, range ([0-9.]+)-([0-9.]+)x; ([0-9.]+) ms vs "
    r"([0-9.]+) ms per step\)")
ACCURACY = re.compile(r"^test accuracy\s+([0-9.]+)\s+([0-9.]+)\s*$", re.M)


def parse(output):
    """``{speedup, blocks, steps, lo, hi, ours_ms, plain_ms, acc_ours,
    acc_plain}`` from the CLI's output; raises ``ValueError`` when the
    speed-up line is missing."""
    m = SPEEDUP.search(output)
    if m is None:
        raise ValueError("no speed-up line in the CLI's output")
    r = {"speedup": float(m.group(1)), "blocks": int(m.group(2)),
         "steps": int(m.group(3)), "lo": float(m.group(4)),
         "hi": float(m.group(5)), "ours_ms": float(m.group(6)),
         "plain_ms": float(m.group(7))}
    a = ACCURACY.search(output)
    r["acc_ours"], r["acc_plain"] = ((float(a.group(1)), float(a.group(2)))
                                     if a else (float("nan"),) * 2)
    return r


def run_config(flags, extra, timeout):
    """One ``train --compare`` subprocess; (parsed result, seconds)."""
    cmd = [sys.executable, "-m", "tf_sparse_split", "train", "--compare",
           *flags, *extra]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                       timeout=timeout)
    secs = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n"
                           f"{p.stderr[-2000:]}")
    return parse(p.stdout), secs


def selected(only, mnist):
    """The configurations to run: ``(label, flags)`` with ``{mnist}``
    filled in, filtered by ``only`` (comma-separated words)."""
    out = []
    for label, flags in CONFIGS:
        if "{mnist}" in flags:
            if mnist is None:
                print(f"skipping {label}: no MNIST directory found")
                continue
            flags = tuple(str(mnist) if f == "{mnist}" else f for f in flags)
        if only:
            words = [w.strip() for w in only.split(",") if w.strip()]
            if not any(w in label for w in words):
                continue
        out.append((label, flags))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--only", default="",
                   help="comma-separated words; keep configurations whose "
                        "flags contain one")
    p.add_argument("--data", default=None,
                   help="MNIST IDX directory for the MNIST configuration")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds per CLI run")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    mnist = next((d for d in mnist_dirs(args.data)
                  if (d / "t10k-images-idx3-ubyte").exists()
                  or (d / "t10k-images-idx3-ubyte.gz").exists()), None)
    configs = selected(args.only, mnist)
    extra, runs = (), args.runs
    if args.quick:
        configs, extra, runs = configs[:2], ("--epochs", "1"), 1
    if not configs:
        p.error("no configuration selected")
    out = args.out if args.out is not None else (
        None if args.quick else str(HERE / "results" / "bench_cli_configs.md"))

    results = {label: [] for label, _ in configs}
    for r in range(runs):
        for label, flags in configs:
            res, secs = run_config(flags, extra, args.timeout)
            results[label].append(res)
            print(f"run {r + 1}/{runs} {label}: {res['speedup']:.2f}x "
                  f"({res['lo']:.2f}-{res['hi']:.2f}), {res['ours_ms']:.1f} "
                  f"vs {res['plain_ms']:.1f} ms per step, {secs:.0f} s",
                  flush=True)

    rows = []
    for label, _ in configs:
        rs = results[label]
        med = statistics.median(x["speedup"] for x in rs)
        per_run = "; ".join(f"{x['speedup']:.2f}x ({x['lo']:.2f}-{x['hi']:.2f})"
                            for x in rs)
        last = rs[-1]
        flag = "**" if med < 1.0 else ""
        rows.append(
            f"| `{label}` | {flag}{med:.2f}x{flag} | {per_run} | "
            f"{last['ours_ms']:.1f} vs {last['plain_ms']:.1f} | "
            f"{last['acc_ours']:.4f} / {last['acc_plain']:.4f} |")
    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "n/a"
    title = (f"`tf-sparse-split train --compare` per configuration, {runs} "
             f"run(s) each, round-robin; {cpus_desc()}; load average {load} "
             "at the end. Speed-up: the CLI's median over interleaved "
             "blocks of steps of t(plain Keras) / t(sparse-split), range "
             "of the blocks in brackets; bold: median below 1.0.")
    text = markdown_table(
        "| configuration | median speed-up | per run (range of blocks) | "
        "ms per step, ours vs plain (last run) | test accuracy, ours / plain |",
        rows, title=title)
    print(text)
    write_report(out, text)


if __name__ == "__main__":
    main()
