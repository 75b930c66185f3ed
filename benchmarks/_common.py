"""Timing, interleaving and report helpers shared by the benchmark scripts.

The scripts run as ``python benchmarks/bench_x.py``, so this directory is on
``sys.path`` and they import it as ``_common``.
"""

import os
import platform
import statistics
import time


def call_times(call, reps):
    """Seconds of each of ``reps`` calls of ``call()`` (a list)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def median_time(call, reps):
    """Median seconds of ``reps`` calls of ``call()``."""
    return statistics.median(call_times(call, reps))


def rotated(seq, r):
    """``seq`` rotated left by ``r`` places (round ``r`` of an interleaved
    run starts with a different item; for two items: alternating order)."""
    s = r % len(seq)
    return seq[s:] + seq[:s]


def median_min_spread_ms(times):
    """``(median ms, min ms, max/min)`` of a list of seconds."""
    return (statistics.median(times) * 1e3, min(times) * 1e3,
            max(times) / min(times))


def format_median_min_spread(stats):
    """``"median (min m, xspread)"`` of :func:`median_min_spread_ms`'s
    tuple."""
    med, lo, spread = stats
    return f"{med:.3f} (min {lo:.3f}, x{spread:.2f})"


def cpus_desc():
    """``"N CPUs (arch)"`` of this machine."""
    return f"{os.cpu_count()} CPUs ({platform.machine()})"


def tf_machine_desc(build_info):
    """``"TensorFlow v, N CPUs (arch), library built with MARCH (ISA)"``;
    ``build_info`` is the op library's ``build_info()`` dict."""
    import tensorflow as tf

    return (f"TensorFlow {tf.__version__}, {cpus_desc()}, library built with "
            f"{build_info['MARCH']} ({build_info['ISA']})")


def markdown_table(header, rows, title=None):
    """A markdown table: ``title`` and a blank line (if given), the
    ``header`` line (``"| a | b |"``), its separator and the ``rows`` (lines),
    newline-terminated."""
    ncols = header.count("|") - 1
    lines = [] if title is None else [title, ""]
    lines += [header, "|" + "---|" * ncols] + list(rows)
    return "\n".join(lines) + "\n"


def write_report(path, text, also=None):
    """Writes ``text`` to ``path`` (creating its directory) and prints
    ``wrote path``; does nothing when ``path`` is empty. ``also``: an
    optional function called after the write that writes another file and
    returns its path (named in the message) or None."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    other = also() if also is not None else None
    print(f"wrote {path}" + (f" and {other}" if other else ""))
