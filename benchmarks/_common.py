"""Timing, interleaving and report helpers shared by the benchmark scripts.

The scripts run as ``python benchmarks/bench_x.py``, so this directory is on
``sys.path`` and they import it as ``_common``.
"""

import os
import platform
import statistics

# The interleaving and timing helpers live in the package (the CLI's
# ``train --compare`` uses them too); re-exported for the scripts.
from tf_sparse_split.tools.timing import (call_times, interleaved_blocks,  # noqa: F401
                                          median_time, rotated,
                                          speedup_summary)


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


def mnist_dirs(explicit=None):
    """Directories to look for MNIST IDX files in, in order: ``explicit``
    alone if given; else ``$TFSS_MNIST_DIR``, ``../shared/data/mnist``
    beside the repository, ``/work/shared/data/mnist``."""
    from pathlib import Path

    if explicit:
        return [Path(explicit)]
    dirs = []
    if os.environ.get("TFSS_MNIST_DIR"):
        dirs.append(Path(os.environ["TFSS_MNIST_DIR"]))
    here = Path(__file__).resolve().parent
    dirs += [here.parent.parent / "shared" / "data" / "mnist",
             Path("/work/shared/data/mnist")]
    return dirs


def load_mnist_or_digits(explicit=None):
    """``((x_train, y_train), (x_test, y_test), description)``: MNIST
    (``x`` float32 ``[n, 784]`` in [0, 1], ``y`` int32) from the first of
    :func:`mnist_dirs` that holds it, else scikit-learn's embedded 8x8
    digits upsampled to 28x28 (3x3 pixel repetition, padded by 2: MNIST's
    layout and its border of zeros)."""
    import numpy as np

    from tf_sparse_split.tools.datasets import load_digits, load_mnist

    for d in mnist_dirs(explicit):
        try:
            train, test = load_mnist(d)
        except FileNotFoundError:
            continue
        return train, test, (f"MNIST from {d} ({train[0].shape[0]} training "
                             "images)")

    def up(x):
        img = np.kron(x.reshape(-1, 8, 8), np.ones((3, 3), np.float32))
        return np.pad(img, ((0, 0), (2, 2), (2, 2))).reshape(-1, 784).astype(
            np.float32)

    (x, y), (xt, yt) = load_digits()
    return (up(x), y), (up(xt), yt), (
        "scikit-learn digits upsampled 8x8 -> 28x28 (no MNIST found in "
        f"{', '.join(str(d) for d in mnist_dirs(explicit))})")
