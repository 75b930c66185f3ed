"""Interleaved timing on a shared machine (the ``train --compare`` speed-up
and the benchmarks in ``benchmarks/``).

On a machine shared with other jobs whole epochs jump between two speeds, so
one epoch (or one block of calls) of each model says little. Two callables
are compared here by *interleaved blocks*: round ``r`` runs a block of ``A``
then a block of ``B`` on even rounds and ``B`` then ``A`` on odd ones
(:func:`rotated`), so both see the same load; the figure is the median of
the per-round ratios ``t_B / t_A`` with their range
(:func:`interleaved_blocks`, :func:`speedup_summary`).

Every function takes the clock as an argument (default
``time.perf_counter``, seconds), so the logic is tested with a fake clock.
"""

import statistics
import time

__all__ = ["call_times", "median_time", "rotated", "interleaved_blocks",
           "speedup_summary", "format_speedup"]


def call_times(call, reps, clock=time.perf_counter):
    """Seconds of each of ``reps`` calls of ``call()`` (a list of floats)."""
    times = []
    for _ in range(reps):
        t0 = clock()
        call()
        times.append(clock() - t0)
    return times


def median_time(call, reps, clock=time.perf_counter):
    """Median seconds of ``reps`` calls of ``call()``."""
    return statistics.median(call_times(call, reps, clock))


def rotated(seq, r):
    """``seq`` (a list) rotated left by ``r`` places: round ``r`` of an
    interleaved run starts with a different item (for two items: the order
    alternates)."""
    s = r % len(seq)
    return seq[s:] + seq[:s]


def interleaved_blocks(steps, rounds, block, clock=time.perf_counter):
    """Times blocks of calls of several step functions, interleaved.

    Args:
      steps: dict ``{name: step}``; ``step(i)`` runs the ``i``-th call of a
        block (``i`` in ``range(block)``, e.g. the index of a fixed batch)
        and returns only when its work is done (e.g. ``train_on_batch``,
        which copies the loss to the host).
      rounds: number of rounds (int >= 1); round ``r`` runs one block of
        every step, in the order of ``steps`` rotated by ``r``.
      block: calls per block (int >= 1).
      clock: a function returning seconds.

    Returns:
      dict ``{name: [seconds per call in each round]}`` (mean of the block).

    Raises:
      ValueError: ``rounds`` or ``block`` < 1, or no steps.
    """
    from tf_sparse_split.utils.validation import validate_int

    rounds = validate_int(rounds, "rounds", 1)
    block = validate_int(block, "block", 1)
    if not steps:
        raise ValueError("interleaved_blocks needs at least one step function")
    names = list(steps)
    out = {n: [] for n in names}
    for r in range(rounds):
        for name in rotated(names, r):
            step = steps[name]
            t0 = clock()
            for i in range(block):
                step(i)
            out[name].append((clock() - t0) / block)
    return out


def speedup_summary(times, ours, reference):
    """Speed-up of ``ours`` over ``reference`` from
    :func:`interleaved_blocks`' times: per round ``t_reference / t_ours``
    (> 1 = ours faster).

    Returns:
      dict with ``"median"``, ``"min"``, ``"max"`` (of the per-round
      ratios), ``"ratios"`` (list), ``"rounds"``, and ``"ours_s"`` /
      ``"reference_s"`` (median seconds per call of each).

    Raises:
      ValueError: different numbers of rounds, no rounds, or a time <= 0.
    """
    a, b = list(times[ours]), list(times[reference])
    if not a or len(a) != len(b):
        raise ValueError(f"need the same number (>= 1) of rounds for both, got "
                         f"{len(a)} and {len(b)}")
    if min(a + b) <= 0:
        raise ValueError("block times must be > 0 seconds")
    ratios = [tb / ta for ta, tb in zip(a, b)]
    return {"median": statistics.median(ratios), "min": min(ratios),
            "max": max(ratios), "ratios": ratios, "rounds": len(ratios),
            "ours_s": statistics.median(a),
            "reference_s": statistics.median(b)}


def format_speedup(summary, block, against="plain Keras"):
    """The one speed-up line of ``train --compare``, e.g. ``speed-up vs plain
    Keras: 1.34x (median of 8 interleaved blocks of 8 steps, range
    1.21-1.46x; 12.3 ms vs 16.5 ms per step)``."""
    steps = "step" if block == 1 else "steps"
    return (f"speed-up vs {against}: {summary['median']:.2f}x (median of "
            f"{summary['rounds']} interleaved blocks of {block} {steps}, "
            f"range {summary['min']:.2f}-{summary['max']:.2f}x; "
            f"{summary['ours_s'] * 1e3:.1f} ms vs "
            f"{summary['reference_s'] * 1e3:.1f} ms per step)")
