"""``tf-sparse-split train --plot FILE.png``: training plots (matplotlib).

:func:`plot_training` draws, per epoch, each sparse-split layer's input
sparsity and split threshold (from the threshold tuner's history) and the
epoch time of every model trained (sparse-split and, with ``--compare``, the
plain-Keras baseline from the same initial weights). With a budget
(``--step-budget`` / ``--time-budget``), :func:`plot_budget` draws the
measured step time against the budget over the steps, with each layer's
sparsity target (:class:`~tf_sparse_split.callbacks.TimeBudgetCallback`'s
``trace``); :func:`plot_latency_curve` draws the accuracy/latency points of
:func:`~tf_sparse_split.tools.latency_budget.fit_latency_budget`.
"""

import math

__all__ = ["plot_training", "steady_mean", "check_plot_path", "plot_budget",
           "plot_latency_curve"]


def _layer_series(history, key):
    """{layer: [value per epoch]} from a tuner history (NaN where absent;
    thresholds < 0, i.e. automatic per call, also NaN)."""
    names = []
    for record in history:
        for name in record["layers"]:
            if name not in names:
                names.append(name)
    series = {}
    for name in names:
        values = []
        for record in history:
            v = record["layers"].get(name, {}).get(key)
            if v is None or (key == "threshold" and v < 0):
                v = math.nan
            values.append(float(v))
        series[name] = values
    return series


def check_plot_path(path, flag="--plot", suffix=".png", what="a PNG file"):
    """Checks, before any training, that ``path`` can take the plot: a name
    ending in ``suffix`` whose directory exists and is writable, and not a
    directory itself (``flag`` and ``what`` name it in the message; other
    output files are checked the same way).

    Raises:
      ValueError: saying what is wrong with ``path``.
    """
    import os

    path = str(path)
    if not path.lower().endswith(suffix):
        raise ValueError(f"{flag} writes {what}; give a name ending in "
                         f"{suffix}, got {path!r}")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path!r}: directory {parent!r} does not "
                         "exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path!r}: not writable")


def steady_mean(times):
    """Mean epoch time in seconds without the first epoch (which also traces
    and calibrates), as ``train`` prints it; the only epoch's time when
    there is one; NaN for none."""
    later = list(times)[1:] or list(times)
    return sum(later) / len(later) if later else math.nan


def plot_training(results, path, title=None, speedup=None):
    """Writes the training plot of ``results`` to the PNG file ``path``.

    Args:
      results: list of result dicts of :func:`tf_sparse_split.tools.train.run`
        (keys ``"kind"``, ``"epoch_times"`` in seconds and
        ``"tuning_history"``, the per-epoch records of
        :class:`~tf_sparse_split.tuning.tuner.ThresholdTuner`).
      path: output file name (``.png``).
      title: optional figure title.
      speedup: optional summary of
        :func:`tf_sparse_split.tools.train.step_speedup` (interleaved
        training-step blocks), shown in the epoch-time panel's title.

    Returns:
      ``path``.

    Raises:
      ValueError: if ``results`` is empty or ``path`` does not end in
        ``.png``.
    """
    if not results:
        raise ValueError("plot_training needs at least one result")
    check_plot_path(path)
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_sp, ax_th, ax_t = axes
    tuned = [r for r in results if r.get("tuning_history")]
    for r in tuned:
        epochs = [rec["epoch"] + 1 for rec in r["tuning_history"]]
        for name, ys in _layer_series(r["tuning_history"], "sparsity").items():
            ax_sp.plot(epochs, ys, marker="o", label=name)
        for name, ys in _layer_series(r["tuning_history"], "threshold").items():
            ax_th.plot(epochs, ys, marker="s", drawstyle="steps-post",
                       label=name)
    if not tuned:
        for ax in (ax_sp, ax_th):
            ax.text(0.5, 0.5, "no sparse-split layers\n(baseline only)",
                    ha="center", va="center", transform=ax.transAxes)
    ax_sp.set(title="input sparsity per layer (sparse-split model)",
              xlabel="epoch", ylabel="fraction of zeros", ylim=(0, 1))
    ax_th.set(title="split threshold for the next epoch",
              xlabel="epoch", ylabel="row-density threshold", ylim=(-0.05, 1.05))
    for r in results:
        times = r.get("epoch_times") or []
        what = (f"mean of epochs 2-{len(times)}" if len(times) > 1
                else "1 epoch, with tracing")
        ax_t.plot(range(1, len(times) + 1), times, marker="o",
                  label=f"{r.get('kind', '?')} "
                        f"({what}: {steady_mean(times):.2f} s)")
    t_title = "epoch time (not a speed measure on a shared machine)"
    if speedup is not None:
        t_title = (f"epoch time; step speed-up {speedup['median']:.2f}x\n"
                   f"(interleaved blocks, range {speedup['min']:.2f}-"
                   f"{speedup['max']:.2f}x)")
    ax_t.set(title=t_title, xlabel="epoch", ylabel="seconds")
    ax_t.set_ylim(bottom=0)
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_budget(trace, path, title=None, window=9):
    """Writes the step time against the budget over the training steps, and
    each controlled layer's sparsity target (and dropout rates), to the PNG
    file ``path``.

    Args:
      trace: :attr:`TimeBudgetCallback.trace` (dicts with ``step``,
        ``seconds``, ``budget_s``, ``targets``, ``rates``).
      path: output file name (``.png``).
      title: optional figure title.
      window: steps of the running median drawn over the raw step times.

    Returns:
      ``path``.

    Raises:
      ValueError: an empty trace or a bad ``path``.
    """
    import numpy as np

    if not trace:
        raise ValueError("plot_budget needs a non-empty trace (no step was "
                         "controlled: more steps than warmup_steps?)")
    check_plot_path(path)
    plt = _pyplot()
    steps = np.array([t["step"] for t in trace])
    ms = np.array([t["seconds"] for t in trace]) * 1e3
    budget = np.array([t["budget_s"] for t in trace]) * 1e3
    med = np.array([np.median(ms[max(0, i - window + 1):i + 1])
                    for i in range(len(ms))])
    fig, (ax_t, ax_s) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    ax_t.plot(steps, ms, ".", ms=3, alpha=0.35, color="tab:gray",
              label="step time")
    ax_t.plot(steps, med, color="tab:blue",
              label=f"running median ({window} steps)")
    ax_t.plot(steps, budget, color="tab:red", drawstyle="steps-post",
              label="budget")
    top = float(np.percentile(ms, 99)) if len(ms) else 1.0
    ax_t.set(ylabel="ms per step", title="step time against the budget",
             ylim=(0, max(top, float(np.max(budget))) * 1.15))
    names = list(trace[-1]["targets"])
    for n in names:
        ax_s.plot(steps, [t["targets"].get(n, np.nan) for t in trace],
                  drawstyle="steps-post", label=f"{n} sparsity target")
    rates = list(trace[-1].get("rates") or {})
    for n in rates:
        ax_s.plot(steps, [t["rates"].get(n, np.nan) for t in trace],
                  "--", drawstyle="steps-post", label=f"{n} dropout rate")
    ax_s.set(xlabel="training step", ylabel="fraction", ylim=(0, 1),
             title="per-layer sparsity chosen by the controller")
    for ax in (ax_t, ax_s):
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_latency_curve(points, path, budget_ms=None, title=None,
                       chosen=None):
    """Writes accuracy against p50 latency of the points
    :func:`~tf_sparse_split.tools.latency_budget.fit_latency_budget` tried
    to the PNG file ``path``.

    Args:
      points: list of dicts with ``sparsity`` (target, None for the model
        as given), ``measured_sparsity``, ``p50_ms`` (or ``est_p50_ms``,
        drawn where present: the p50 the search judged the point by) and
        ``accuracy`` (NaN without accuracy data: the measured sparsity is
        drawn instead).
      path: output file name (``.png``).
      budget_ms: the latency budget (a vertical line), or None.
      title: optional figure title.
      chosen: index of the point the search chose (ringed), or None.

    Returns:
      ``path``.

    Raises:
      ValueError: no points or a bad ``path``.
    """
    if not points:
        raise ValueError("plot_latency_curve needs at least one point")
    check_plot_path(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xs = [p.get("est_p50_ms", p["p50_ms"]) for p in points]
    have_acc = not all(math.isnan(p.get("accuracy", math.nan))
                       for p in points)
    ys = [p["accuracy"] if have_acc else p["measured_sparsity"]
          for p in points]
    ax.plot(xs, ys, marker="o")
    for i, (p, x, y) in enumerate(zip(points, xs, ys)):
        label = ("as given" if p["sparsity"] is None
                 else f"{p['sparsity']:.2f}")
        # Labels alternate above and below the line: neighbouring points
        # are often a few hundredths of a millisecond apart.
        ax.annotate(label, (x, y), fontsize=7, textcoords="offset points",
                    xytext=(4, 4) if i % 2 == 0 else (4, -11))
    legend = False
    if chosen is not None and 0 <= chosen < len(points):
        ax.plot([xs[chosen]], [ys[chosen]], "o", markersize=13,
                markerfacecolor="none", markeredgecolor="tab:green",
                markeredgewidth=2, label="chosen")
        legend = True
    if budget_ms is not None:
        ax.axvline(budget_ms, color="tab:red", label="latency budget")
        legend = True
    if legend:
        ax.legend(fontsize=8)
    ax.set(xlabel="p50 latency (ms)",
           ylabel="accuracy" if have_acc else "measured sparsity",
           title="FATReLU cutoffs: accuracy against latency\n(labels: "
                 "target sparsity)")
    ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
