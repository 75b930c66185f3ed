"""Training within a step-time budget (TimeBudgetCallback; R. Sun and L.
Zhang, *Dynamic Sparse Method for Deep Learning Execution*, 2019).

For the MLP 784-2048-2048-10 and the CNN of ``tools/models.py`` (MNIST from
``--data`` or the usual places, else the upsampled digits):

1. The plain step: the plain-Keras model's training step, timed by
   interleaved blocks of ``train_on_batch`` steps against the sparse-split
   model at its natural ReLU sparsity (``tools.train.train_step_times``),
   before the case's runs and again after them (the load drifts).
2. For each budget ``f x`` the plain step (default 0.8, 0.65, 0.5): the
   sparse-split model trained with ``TimeBudgetCallback(step_time=...)``;
   reported: the median measured step time after the first epoch and its
   10-90th percentile range, against the budget, the final test accuracy,
   the per-layer sparsity targets at the end and the allocation's logged
   reasons.
3. For each budget run, the fixed-sparsity run with the same step time:
   ``SparsityTargetCallback`` per layer (one callback per controlled
   layer; same warm-up, no L1 penalty, as the budget run has none) at each
   layer's mean target of the budget run after the first epoch -- the same
   per-layer sparsity, so the same work per step (a single target for all
   layers, the mean over layers, put the large layer far below its budget
   target and ran 20-30% slower). With ``--match-tries N`` > 1, when its
   median step time after the first epoch is more than ``--match-tol``
   (default 5%) off the budget run's, the targets are moved together
   toward ``max_sparsity`` (or toward the natural sparsity) and the run
   repeated, secant steps on that one parameter, at most N runs; the run
   closest in step time is reported. That search compares fits run one
   after the other, so on a shared machine it chases the other tenants'
   load (a fit slowed by load asks for targets the other run never had);
   the default is the matched sparsity alone (``--match-tries 1``).
   Reported: the fixed run's median and mean step time, its ratio to the
   budget run's, its test accuracy and the accuracy difference. With
   ``--seeds N`` both runs are repeated for N seeds (the same seed for a
   budget run and its reference) and a summary gives, per budget, the
   median / budget ratio's range, how many runs were within 5%, and the
   accuracy difference's mean +- sd over the seeds (one seed's accuracy
   moves by about +-1.4 points), with the callback's own per-step seconds
   and its probes' (``TimeBudgetCallback.overhead``). The CNN has a
   ``SensitivityAwareDropout`` (rate 0) in front of ``conv_2``, the
   controller's second tier (``--no-channel-dropout``: none); its fixed
   reference runs at the budget run's mean rate.
4. Load injection (MLP; budget ``--load-budget`` x the sparse-split
   model's own step at natural sparsity, default 0.85, so that it is
   reachable on a quiet machine): a busy process pinned to one core
   (``os.sched_setaffinity``) runs for a stretch of steps in the middle of
   training; reported: the median step time, the budget's share met and
   the mean sparsity target before, during and after it (the targets must
   rise during the load and fall after it), and the median step at the
   bounds in each stretch (every layer that reached ``max_sparsity`` there):
   when it is over the budget + 10% during the load, the budget was
   unreachable there (other tenants' load adds to the injected one), which
   tells "unreachable" from "the controller failed"; the steps until the
   running median is within 10% of the budget after the load began and
   after it ended; whether the targets came down after it.
5. Deadlines (MLP). Three reference fits are timed (wall seconds,
   compilation and epoch ends included): the plain-Keras model's, and the
   sparse-split model's under ``TimeBudgetCallback`` with a step budget
   that keeps the natural sparsity (``natural``) and with one no setting
   meets (``bounds``: every layer at ``max_sparsity`` after the warm-up,
   the fastest fit the controller can give, with the same warm-up, probe
   and compilation). Then the sparse-split model is trained with
   ``TimeBudgetCallback(deadline=...)`` for three deadlines: ``reachable``
   = halfway between the ``bounds`` and ``natural`` fits; ``x plain`` =
   ``--deadline-fraction`` (default 0.8) of the plain fit; ``unreachable``
   = 0.85 x the ``bounds`` fit. Reported: the fit's seconds from
   ``on_train_begin`` to ``on_train_end`` (what the deadline counts) and
   from the ``fit`` call, their ratio to the deadline, whether the callback
   logged the deadline unreachable (and its predicted end), the step
   budget's range and the test accuracy.

Writes ``benchmarks/results/bench_budget.md`` (``--quick``:
``bench_budget_quick.md``) and PNGs of the step time against the budget.
Every number is taken on a shared machine: the step times move with the other
tenants' load, which is what the controller answers.

  python benchmarks/bench_budget.py [--quick] [--data DIR]
      [--cases mlp,cnn,load,deadline] [--seeds N] [--match-tries N]
      [--match-tol F] [--no-channel-dropout] [--name REPORT.md]
      [--record FITS.json]

``--record``: the deadline case's fits (step seconds, epoch ends, the
layers' cost terms) as a replay record for ``tests/test_budget_replay.py``
(``tests/data/budget_deadline_fits.json`` is one, from a run under heavy
load).
"""

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

import _common  # noqa: E402


def _compile(model):
    import keras

    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    return model


def _build(case, sparse, seed, channel_dropout=False):
    import keras

    from tf_sparse_split.tools import models

    keras.utils.set_random_seed(seed)
    # The layer on the raw pixels stays plain Keras (its zeros are not a
    # ReLU's: nothing to control); the 10-unit output stays sparse-split,
    # so each model has two knobs to allocate between.
    if case == "mlp":
        return _compile(models.build_mlp(784, [2048, 2048], 10,
                                         sparse=sparse,
                                         keep_plain=("first",)))
    if not (sparse and channel_dropout):
        return _compile(models.build_cnn(28, [32, 64], 10, sparse=sparse,
                                         keep_plain=("first",)))
    # build_cnn's model (conv_1 plain, conv_2 and the output sparse-split)
    # with a SensitivityAwareDropout (rate 0: the identity) between
    # conv_1's ReLU and conv_2: the controller's second tier (a channel
    # rate, raised only when conv_2's input sparsity at max_sparsity
    # cannot meet the budget).
    import tf_sparse_split as tfss

    return _compile(keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu",
                            name="conv_1"),
        tfss.SensitivityAwareDropout(0.0, seed=seed, name="channel_dropout"),
        tfss.SparseSplitConv2D(64, 3, padding="same", activation="relu",
                               name="conv_2"),
        keras.layers.MaxPooling2D(2, name="pool"),
        keras.layers.Flatten(name="flatten"),
        tfss.SparseSplitDense(10, activation="softmax", name="output")],
        name="sparse_cnn_dropout"))


def _data(case, x, xt):
    if case == "cnn":
        return x.reshape(-1, 28, 28, 1), xt.reshape(-1, 28, 28, 1)
    return x, xt


class StepTimer:
    """Keras callback: seconds of every training step and its epoch."""

    def __new__(cls):
        import keras

        class _T(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.steps, self.epochs = [], []
                self._e = 0

            def on_epoch_begin(self, epoch, logs=None):
                self._e = epoch

            def on_train_batch_begin(self, batch, logs=None):
                self._t = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.steps.append(time.perf_counter() - self._t)
                self.epochs.append(self._e)

        return _T()


class FitTimer:
    """Keras callback: seconds from on_train_begin to on_train_end (what a
    TimeBudgetCallback deadline counts), as ``seconds``."""

    def __new__(cls):
        import keras

        class _F(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self._t = time.perf_counter()

            def on_train_end(self, logs=None):
                self.seconds = time.perf_counter() - self._t

        return _F()


class Recorder:
    """Keras callback: the clock at each step's begin and end and at each
    epoch end; :meth:`entry` turns them into a replay record (step
    seconds, epoch-end seconds from an epoch's last step to the next
    epoch's first step or to on_train_end, seconds before the first
    step) in the layout of ``tests/data/budget_deadline_fits.json``."""

    def __new__(cls):
        import keras

        class _R(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.ev = []

            def on_train_begin(self, logs=None):
                self.ev = [("tb", time.perf_counter())]

            def on_train_batch_begin(self, batch, logs=None):
                self.ev.append(("sb", time.perf_counter()))

            def on_train_batch_end(self, batch, logs=None):
                self.ev.append(("se", time.perf_counter()))

            def on_epoch_end(self, epoch, logs=None):
                self.ev.append(("ee", time.perf_counter()))

            def on_train_end(self, logs=None):
                self.ev.append(("te", time.perf_counter()))

            def entry(self, cb):
                ev = self.ev
                sb = [t for k, t in ev if k == "sb"]
                se = [t for k, t in ev if k == "se"]
                ends = []
                for i, (k, t) in enumerate(ev):
                    if k == "ee":
                        last = max(u for kk, u in ev[:i] if kk == "se")
                        nxt = [u for kk, u in ev[i:] if kk in ("sb", "te")]
                        ends.append(round(nxt[0] - last, 4))
                names = list(cb.trace[0]["targets"]) if cb.trace else []
                return {"step_s": [round(b - a, 5) for a, b in zip(sb, se)],
                        "epoch_end_s": ends,
                        "head_s": round(sb[0] - ev[0][1], 4) if sb else 0.0,
                        "targets": [round(t["targets"][names[0]], 4)
                                    for t in cb.trace] if names else []}

        return _R()


class LoadInjector:
    """Keras callback: a busy process pinned to one core from step
    ``start`` to step ``stop`` (counted from the fit's first step)."""

    def __new__(cls, start, stop, core=0):
        import keras

        class _L(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.step, self.proc = 0, None

            def on_train_batch_begin(self, batch, logs=None):
                if self.step == start and self.proc is None:
                    self.proc = subprocess.Popen(
                        [sys.executable, "-c", "while True: pass"],
                        preexec_fn=lambda: os.sched_setaffinity(0, {core}))
                if self.step == stop:
                    self.kill()
                self.step += 1

            def on_train_end(self, logs=None):
                self.kill()

            def kill(self):
                if self.proc is not None:
                    self.proc.kill()
                    self.proc.wait()
                    self.proc = None

        return _L()


def plain_step(case, x, y, batch, rounds, seed):
    """Median seconds per step of the plain-Keras model (and the
    sparse-split one at natural sparsity), interleaved blocks."""
    from tf_sparse_split.tools.train import train_step_times

    times, block = train_step_times(
        {"plain": _build(case, False, seed),
         "sparse-split": _build(case, True, seed)}, x, y, batch,
        rounds=rounds, seed=seed)
    return ({k: (float(np.median(v)), float(np.min(v)), float(np.max(v)))
             for k, v in times.items()}, block)


def budget_run(case, x, y, xt, yt, budget, args, extra=None, kind="step_time",
               seed=None, record=None):
    """A fit under TimeBudgetCallback; ``record``: a name under which the
    fit's replay record goes into ``args.records`` (``--record``)."""
    import dataclasses

    import tf_sparse_split as tfss

    model = _build(case, True, args.seed if seed is None else seed,
                   channel_dropout=args.channel_dropout)
    cb = tfss.TimeBudgetCallback(**{kind: budget},
                                 warmup_steps=args.warmup,
                                 sensitivity_data=(x[:512], y[:512]))
    cbs = [cb, tfss.SplitThresholdCallback()] + list(extra or [])
    rec = Recorder() if record and args.record else None
    if rec is not None:
        cbs.append(rec)
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0,
              shuffle=True, callbacks=cbs)
    args.last_fit_s = time.perf_counter() - t0
    if rec is not None:
        args.records[record] = rec.entry(cb)
        if "costs" not in args.records and cb.controller.costs:
            args.records["costs"] = {
                n: dataclasses.asdict(c)
                for n, c in cb.controller.costs.items()}
            args.records["floors"] = dict(cb.controller.floors)
    _, acc = model.evaluate(xt, yt, batch_size=512, verbose=0)
    return model, cb, float(acc)


def fixed_run(case, x, y, xt, yt, targets, args, rates=None, seed=None):
    """A fit at fixed per-layer sparsity targets (``{layer: target}``, one
    SparsityTargetCallback each) and fixed dropout rates (``{dropout
    layer: rate}``: the budget run's mean rates, the same work). Returns
    (median, mean step seconds after the first epoch, test accuracy)."""
    import tf_sparse_split as tfss

    model = _build(case, True, args.seed if seed is None else seed,
                   channel_dropout=args.channel_dropout)
    for name, rate in (rates or {}).items():
        model.get_layer(name).set_rate(float(rate))
    spe = int(np.ceil(len(x) / args.batch))
    timer = StepTimer()
    cbs = [tfss.SparsityTargetCallback(
        float(np.clip(t, 0.0, 0.99)), layers=[name], l1=0.0,
        warmup_epochs=args.warmup / spe, ramp_epochs=0.25)
        for name, t in targets.items()]
    cbs += [tfss.SplitThresholdCallback(), timer]
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0,
              shuffle=True, callbacks=cbs)
    _, acc = model.evaluate(xt, yt, batch_size=512, verbose=0)
    later = [t for t, e in zip(timer.steps, timer.epochs) if e >= 1] or \
        timer.steps[1:]
    return float(np.median(later)), float(np.mean(later)), float(acc)


def _moved(mean, floors, upper, alpha):
    """The per-layer targets moved together: ``alpha`` in (0, 1] of the
    way from ``mean`` to ``upper``, ``alpha`` in [-1, 0) of the way to the
    layers' natural sparsity ``floors``."""
    out = {}
    for n, t in mean.items():
        lo = min(floors.get(n, 0.0), t)
        out[n] = t + alpha * ((upper - t) if alpha > 0 else (t - lo))
    return out


def matched_fixed_run(case, x, y, xt, yt, cb, spe, budget_med, args,
                      seed=None):
    """The fixed per-layer-target run whose median step time after the
    first epoch matches the budget run's ``budget_med`` (module docstring,
    3.). Returns a dict: targets, rates, median, mean, acc, tries,
    matched."""
    later = _after_first_epoch(cb, spe)
    mean = _mean_targets(later, _warmup_floors(cb))
    rates = _mean_rates(later)
    floors = _warmup_floors(cb) or dict(cb.controller.floors)
    upper = cb.max_sparsity
    tried = []                              # (alpha, median, mean, acc, t)
    alpha = 0.0
    for i in range(args.match_tries):
        targets = _moved(mean, floors, upper, alpha)
        med, avg, acc = fixed_run(case, x, y, xt, yt, targets, args,
                                  rates=rates, seed=seed)
        tried.append((alpha, med, avg, acc, targets))
        print(f"  fixed targets " + ", ".join(
            f"{n} {v:.2f}" for n, v in targets.items()) +
            f": median step {med * 1e3:.1f} ms (budget run "
            f"{budget_med * 1e3:.1f} ms)", flush=True)
        if abs(med / budget_med - 1.0) <= args.match_tol:
            break
        # Secant on alpha (step time falls as alpha rises); the first move
        # is half-way toward the side the measurement asks for.
        if len(tried) == 1:
            nxt = 0.5 if med > budget_med else -0.5
        else:
            (a0, m0), (a1, m1) = [(t[0], t[1]) for t in tried[-2:]]
            if abs(m1 - m0) < 1e-9:
                nxt = a1 + (0.5 if m1 > budget_med else -0.5)
            else:
                nxt = a1 + (budget_med - m1) * (a1 - a0) / (m1 - m0)
        nxt = float(np.clip(nxt, -1.0, 1.0))
        if any(abs(nxt - t[0]) < 0.05 for t in tried):
            break                           # at a bound: nothing new to try
        alpha = nxt
    best = min(tried, key=lambda t: abs(t[1] / budget_med - 1.0))
    return {"alpha": best[0], "median": best[1], "mean": best[2],
            "acc": best[3], "targets": best[4], "rates": rates,
            "tries": len(tried),
            "matched": abs(best[1] / budget_med - 1.0) <= args.match_tol}


def _after_first_epoch(cb, spe):
    return [t for t in cb.trace if t["step"] > spe] or cb.trace


def _mean_target(trace):
    """Mean sparsity target over the steps and layers of a trace (0 for an
    empty one: no step was controlled)."""
    if not trace:
        return 0.0
    return float(np.mean([np.mean(list(t["targets"].values()))
                          for t in trace]))


def _warmup_floors(cb):
    """The layers' natural sparsity measured in the warm-up (the floors
    of the first controlled step; the controller's floors follow the
    natural sparsity as the layers train)."""
    return dict(cb.trace[0].get("floors", {})) if cb.trace else {}


def _mean_targets(trace, base=None):
    """Each layer's mean sparsity target over the steps of a trace. With
    ``base`` (``{layer: sparsity}``, :func:`_warmup_floors`), a step whose
    target is at the floor in force (cutoff off: the layer at its natural
    sparsity, whatever it has grown to) counts as ``base``: a fixed-target
    run given that mean adds no zeros where the budget run added none,
    rather than the natural sparsity of the later epochs from the start."""
    if not trace:
        return {}
    base = base or {}

    def value(t, n):
        v = t["targets"][n]
        fl = t.get("floors", {})
        if n in base and n in fl and v <= fl[n] + 0.01:
            return base[n]
        return v

    return {n: float(np.mean([value(t, n) for t in trace]))
            for n in trace[0]["targets"]}


def _mean_rates(trace):
    """Each dropout layer's mean rate over the steps of a trace (the LSTM
    rate knobs, ``layer/attr``, left out: not a layer's set_rate)."""
    if not trace:
        return {}
    return {n: float(np.mean([t["rates"][n] for t in trace]))
            for n in trace[0].get("rates", {}) if "/" not in n}


def _describe(d):
    return (f"step {d.step} ({d.action}, measured {d.measured_s * 1e3:.1f} "
            f"ms, budget {d.budget_s * 1e3:.1f} ms): " + "; ".join(
                f"{n}: {why}" for n, why in d.reasons.items()))


def _reasons(cb):
    """The logged reasons of the decision that chose the most sparsity and
    of the last decision that changed the targets."""
    moves = [d for d in cb.decisions if d.action in ("reallocate",
                                                     "unreachable",
                                                     "test fall")]
    if not moves:
        return "no change decided"
    top = max(moves, key=lambda d: sum(d.targets.values()))
    text = "most sparsity: " + _describe(top)
    if moves[-1] is not top:
        text += "; last change: " + _describe(moves[-1])
    return text


def _fmt_range(values):
    """``median (min-max)`` of the finite values, or ``-``."""
    v = [x for x in values if np.isfinite(x)]
    if not v:
        return "-"
    return f"{np.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"


def _spread(values):
    """``mean +- sd (min..max)`` of a list (sd 0 for one value)."""
    v = np.asarray(values, np.float64)
    sd = float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
    return f"{np.mean(v):+.2f} +- {sd:.2f} ({np.min(v):+.2f}..{np.max(v):+.2f})"


def run_case(case, data, args, report, pngs):
    from tf_sparse_split.tools.plots import plot_budget

    (x, y), (xt, yt) = data
    x, xt = _data(case, x, xt)
    spe = int(np.ceil(len(x) / args.batch))
    before, block = plain_step(case, x, y, args.batch, args.rounds, args.seed)
    s0 = before["plain"][0]
    args.plain_step[case] = s0
    args.natural_step[case] = before["sparse-split"][0]
    print(f"{case}: plain step {s0 * 1e3:.1f} ms (interleaved, "
          f"{args.rounds} rounds of {block} steps; sparse-split at natural "
          f"sparsity {before['sparse-split'][0] * 1e3:.1f} ms)", flush=True)
    rows, notes, summary = [], [], []
    seeds = [args.seed + i for i in range(args.seeds)]
    for f in args.fractions:
        budget = f * s0
        ratios, diffs, overheads, kinds, bratios = [], [], [], [], []
        for seed in seeds:
            model, cb, acc = budget_run(case, x, y, xt, yt, budget, args,
                                        seed=seed)
            later = _after_first_epoch(cb, spe)
            st = np.array([t["seconds"] for t in later])
            mean_t = _mean_targets(later, _warmup_floors(cb))
            mean_r = _mean_rates(later)
            fx = matched_fixed_run(case, x, y, xt, yt, cb, spe,
                                   float(np.median(st)), args, seed=seed)
            final = cb.trace[-1]["targets"] if cb.trace else {}
            reach = [d.reachable for d in cb.decisions if d.step > spe]
            kind = _budget_kind(cb, later, budget)
            kinds.append(kind)
            ratios.append(float(np.median(st) / budget))
            bratios.append(_binding_ratio(cb, later, budget))
            diffs.append((acc - fx["acc"]) * 100)
            o = cb.overhead
            overheads.append((o["step_s"] / max(o["steps"], 1),
                              o["probe_s"], o["probes"]))
            rates = (" ; rates " + ", ".join(
                f"{n} {v:.2f}" for n, v in mean_r.items())) if mean_r else ""
            rows.append(
                f"| {case} | {f:.2f} | {seed} | {budget * 1e3:.1f} | "
                f"{np.median(st) * 1e3:.1f} ({np.percentile(st, 10) * 1e3:.1f}"
                f"-{np.percentile(st, 90) * 1e3:.1f}) / "
                f"{np.mean(st) * 1e3:.1f} | {np.median(st) / budget:.2f} | "
                f"{bratios[-1]:.2f} | {kind} | "
                f"{'yes' if reach and reach[-1] else 'no'} | {acc:.4f} | "
                + ", ".join(f"{n} {v:.2f}" for n, v in final.items()) + " | "
                + ", ".join(f"{n} {v:.2f}" for n, v in mean_t.items())
                + rates + " | "
                + ", ".join(f"{n} {v:.2f}" for n, v in fx["targets"].items())
                + f" | {fx['median'] * 1e3:.1f} / {fx['mean'] * 1e3:.1f} | "
                f"{fx['median'] / np.median(st):.2f}"
                f"{'' if fx['matched'] else ' (not matched)'} | "
                f"{fx['acc']:.4f} | {(acc - fx['acc']) * 100:+.2f} |")
            print(rows[-1], flush=True)
            if seed == seeds[0]:
                notes.append(f"- {case} {f:.2f}x: {_reasons(cb)}")
                png = os.path.join(args.out_dir, f"bench_budget_{case}_{f:.2f}"
                                   f"{'_quick' if args.quick else ''}.png")
                plot_budget(cb.trace, png, title=f"{case}, budget {f:.2f} x "
                            f"plain step ({budget * 1e3:.1f} ms), load "
                            f"average {os.getloadavg()[0]:.1f}")
                pngs.append(png)
        ok = [abs(r - 1) <= 0.05 for r, k in zip(ratios, kinds)
              if k == "binding"]
        bok = [abs(r - 1) <= 0.05 for r, k in zip(bratios, kinds)
               if k == "binding" and np.isfinite(r)]
        summary.append(
            f"| {case} | {f:.2f} | {len(seeds)} | "
            f"{np.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            f" | " + ", ".join(f"{k} {kinds.count(k)}" for k in
                               ("binding", "generous", "unreachable")
                               if k in kinds) +
            f" | {sum(ok)} of {len(ok)} | "
            f"{_fmt_range(bratios)} | {sum(bok)} of {len(bok)} | "
            f"{_spread(diffs)} | "
            f"{'yes' if np.mean(diffs) >= -0.3 else 'no'} | "
            f"{np.median([o[0] for o in overheads]) * 1e3:.2f} | "
            f"{np.median([o[1] for o in overheads]):.2f} "
            f"({overheads[0][2]}) |")
    after, _ = plain_step(case, x, y, args.batch, args.rounds, args.seed)
    report.append(
        f"\n### {case}\n\nplain-Keras step: {s0 * 1e3:.1f} ms before the runs "
        f"(range {before['plain'][1] * 1e3:.1f}-{before['plain'][2] * 1e3:.1f}"
        f"), {after['plain'][0] * 1e3:.1f} ms after (range "
        f"{after['plain'][1] * 1e3:.1f}-{after['plain'][2] * 1e3:.1f}); "
        f"sparse-split at natural sparsity "
        f"{before['sparse-split'][0] * 1e3:.1f} / "
        f"{after['sparse-split'][0] * 1e3:.1f} ms. {spe} steps per epoch, "
        f"{args.epochs} epochs, batch {args.batch}"
        + (", a SensitivityAwareDropout (rate 0, the controller's second "
           "tier) in front of conv_2" if case == "cnn" and
           args.channel_dropout else "") + ".\n")
    report.append(_common.markdown_table(
        "| model | budget x plain | seeds | median / budget: median "
        "(range) | runs | binding runs within +-5% | median / budget where "
        "it binds: median (range) | binding runs within +-5% where it binds "
        "| acc - fixed acc, points: mean +- sd "
        "(range) | mean >= -0.3 | callback's own ms per step (median over "
        "seeds) | probe s per fit (median; probes run, first seed) |",
        summary))
    report.append("\nPer run:\n")
    report.append(_common.markdown_table(
        "| model | budget x plain | seed | budget ms | step ms after epoch 1: "
        "median (p10-p90) / mean | median / budget | median / budget where "
        "it binds | budget | reachable "
        "(last decision) | test acc | final targets | mean targets (and rates) "
        "after epoch 1 | fixed targets (matched) | fixed step ms: median / "
        "mean | fixed / budget median | fixed test acc | acc - fixed acc "
        "(points) |", rows))
    report.append(
        "\nThe fixed-target run has the budget run's per-layer mean targets "
        "(and mean dropout rates) after epoch 1 (a step with a layer's "
        "target at its floor, the cutoff off, counts as the natural "
        "sparsity measured in the warm-up), with the same seed"
        + (f", then up to {args.match_tries} fits matching "
           "its median step" if args.match_tries > 1 else "") +
        f"; '(not matched)' marks a fixed run whose median step is more "
        f"than {args.match_tol:.0%} off the budget run's (fits run one "
        "after the other on a shared machine: load moves between them). "
        "The accuracy condition is on the mean difference over the seeds "
        "(one seed's accuracy moves by about +-1.4 points). A budget is "
        "'generous' when the natural sparsity met it (nine in ten steps "
        "after the first epoch at every layer's natural sparsity, median "
        "step within the budget: the controller spends no accuracy, and "
        "the steps end below the budget), 'unreachable' when most decisions "
        "after the first epoch (holds in the dead band aside) found the "
        "bounds too slow, else 'binding'; the +-5% "
        "condition is on the binding runs. 'Where it binds': the steps with "
        "a target or rate above its floor, or at the floors with a 9-step "
        "running median over the budget; the steps at the floors that run "
        "under it (the budget generous for a stretch, as when the machine "
        "speeds up) are left out.\n")
    report.append("\nAllocation (first seed: the decision that chose the "
                  "most sparsity and the last one that changed the targets, "
                  "with their logged reasons):\n\n" + "\n".join(notes) +
                  "\n")


def _budget_kind(cb, later, budget):
    """'generous', 'unreachable' or 'binding' (see run_case's report)."""
    floors = cb.controller.floors if cb.controller is not None else {}
    at_floor = [all(v <= t.get("floors", floors).get(n, 0.0) + 0.01
                    for n, v in t["targets"].items()) for t in later]
    st = [t["seconds"] for t in later]
    if at_floor and np.mean(at_floor) >= 0.9 and np.median(st) <= budget:
        return "generous"
    # Unreachable when most decisions after the first epoch that moved or
    # could have moved a knob found the bounds too slow (a hold inside the
    # dead band is recorded as reachable: the last decision alone can be
    # one while the run sat at the bounds).
    first = later[0]["step"] if later else 0
    moves = [d for d in cb.decisions if d.step >= first and
             d.action != "hold"]
    if moves and np.mean([not d.reachable for d in moves]) >= 0.5:
        return "unreachable"
    return "binding"


def _binding_ratio(cb, later, budget, window=9):
    """Median step / budget over the steps where the budget binds: a
    target or rate above its floor, or (at the floors) a 9-step running
    median over the budget (the natural sparsity too slow). Steps at the
    floors that run under the budget are left out: there the budget is
    generous and the controller rightly spends nothing (the machine's
    speed moves 20-40% within a case, so a budget can turn generous while
    it runs). NaN with fewer than 20 such steps."""
    if not later:
        return float("nan")
    c = cb.controller
    floors = c.floors if c is not None else {}
    rfloors = ({r: float(k.floor) for r, k in c.rate_knobs.items()}
               if c is not None else {})
    st = np.array([t["seconds"] for t in later])
    run = _running_median(st, window)
    keep = []
    for t, r in zip(later, run):
        bought = any(v > t.get("floors", floors).get(n, 0.0) + 0.01
                     for n, v in t["targets"].items()) or any(
            v > rfloors.get(n, v) + 0.01 for n, v in t["rates"].items()
            if n in rfloors)
        keep.append(bought or r > budget)
    sel = st[np.array(keep, bool)]
    return float(np.median(sel) / budget) if len(sel) >= 20 else float("nan")


def _running_median(values, window=9):
    v = np.asarray(values, np.float64)
    return np.array([np.median(v[max(0, i - window + 1):i + 1])
                     for i in range(len(v))])


def _at_bounds(trace, max_sparsity):
    """Per trace entry: whether every layer whose target reached
    ``max_sparsity`` somewhere in the run is there (the allocation the
    controller runs when the budget is unreachable: layers whose sparsity
    buys no time are left where they are)."""
    names = list(trace[0]["targets"]) if trace else []
    top = [n for n in names
           if any(t["targets"][n] >= max_sparsity - 1e-6 for t in trace)]
    return [bool(top) and all(t["targets"][n] >= max_sparsity - 1e-6
                              for n in top) for t in trace]


def _first_within(steps, times, budget, start, tol=0.10, window=9):
    """Steps from ``start`` to the first step at or after it whose running
    median (``window`` steps, from ``start`` on) is within ``tol`` of the
    budget, or None."""
    idx = [i for i, s in enumerate(steps) if s > start]
    if not idx:
        return None
    med = _running_median([times[i] for i in idx], window)
    for n, (j, m) in enumerate(zip(idx, med)):
        # at least 5 steps in the running median
        if n >= 4 and abs(m / budget - 1.0) <= tol:
            return steps[j] - start
    return None


def load_case(data, args, report, pngs):
    from tf_sparse_split.tools.plots import plot_budget

    (x, y), (xt, yt) = data
    spe = int(np.ceil(len(x) / args.batch))
    # The sparse-split model's natural step of the mlp case when it ran,
    # else one measured here.
    s0 = args.natural_step.get("mlp")
    if s0 is None:
        before, _ = plain_step("mlp", x, y, args.batch, args.rounds,
                               args.seed)
        s0 = before["sparse-split"][0]
    budget = args.load_budget * s0
    total = spe * args.epochs
    start, stop = int(total * 0.4), int(total * 0.7)
    inj = LoadInjector(start, stop)
    _, cb, acc = budget_run("mlp", x, y, xt, yt, budget, args, [inj])
    trace = cb.trace
    bounds = _at_bounds(trace, cb.max_sparsity)
    seg = {"before": [], "during": [], "after": []}
    for t, at in zip(trace, bounds):
        i = t["step"] - 1
        key = ("before" if i < start else "during" if i < stop
               else "after")
        seg[key].append((t, at))
    rows, reach = [], {}
    for key, items in seg.items():
        ts = [t for t, _ in items]
        if not ts:
            rows.append(f"| {key} | - | - | - | - | - | - |")
            continue
        st = np.array([t["seconds"] for t in ts])
        at = [t["seconds"] for t, a in items if a]
        b_med = float(np.median(at)) if len(at) >= 8 else float("nan")
        decs = [d for d in cb.decisions
                if (start if key != "before" else 0) < d.step
                <= (stop if key != "after" else total)]
        best = [d.best_s for d in decs if np.isfinite(d.best_s)]
        reach[key] = (b_med, float(np.median(best)) if best else float("nan"),
                      float(np.median(st)))
        rows.append(
            f"| {key} | {len(ts)} | {np.median(st) * 1e3:.1f} "
            f"({np.percentile(st, 10) * 1e3:.1f}-"
            f"{np.percentile(st, 90) * 1e3:.1f}) | "
            f"{np.median(st) / budget:.2f} | "
            + (f"{b_med * 1e3:.1f} over {len(at)} steps ({b_med / budget:.2f})"
               if np.isfinite(b_med) else f"- ({len(at)} steps)") + " | "
            + (f"{np.median(best) * 1e3:.1f}" if best else "-") + " | "
            f"{_mean_target(ts):.2f} | "
            f"{_mean_target(ts[-max(len(ts) // 3, 1):]):.2f} |")
    steps = [t["step"] for t in trace]
    times = [t["seconds"] for t in trace]
    on = _first_within(steps, times, budget, start)
    off = _first_within(steps, times, budget, stop)
    nan = float("nan")
    during_b, during_best, _ = reach.get("during", (nan, nan, nan))
    after_med = reach.get("after", (nan, nan, nan))[2]
    if np.isfinite(during_b) and during_b > budget * 1.10:
        verdict_on = (f"unreachable during the load: at the bounds the steps "
                      f"took {during_b * 1e3:.1f} ms, "
                      f"{during_b / budget:.2f} x the budget")
    elif not np.isfinite(during_b) and np.isfinite(during_best) and \
            during_best > budget * 1.10:
        verdict_on = (f"unreachable during the load by the controller's "
                      f"prediction at the bounds ({during_best * 1e3:.1f} ms, "
                      f"{during_best / budget:.2f} x the budget; the ops' "
                      f"measured rates under load leave little to buy)")
    else:
        verdict_on = ("reachable during the load: " + (
            f"within +-10% of the budget {on} steps after it began"
            if on is not None and on <= 100 else
            "not back within +-10% of the budget within 100 steps "
            "(controller failed)"))
    dur = [t for t, _ in seg["during"]]
    aft = [t for t, _ in seg["after"]]
    lowered = (bool(dur) and bool(aft) and
               _mean_target(aft[-max(len(aft) // 3, 1):]) <
               _mean_target(dur[-max(len(dur) // 3, 1):]) - 0.02)
    still = np.isfinite(after_med) and after_med > budget * 1.10
    verdict_off = (
        (f"within +-10% of the budget {off} steps after the load ended"
         if off is not None else "not within +-10% of the budget after the "
         "load ended") + "; sparsity " + (
             "lowered after the load" if lowered else
             "not lowered after the load (mean target, last third)") + (
             f" -- the steps after it were still {after_med / budget:.2f} x "
             "the budget (other tenants' load), so the targets could not "
             "fall" if still else ""))
    report.append(
        f"\n### load injection (mlp, budget {args.load_budget:.2f} x the "
        f"sparse-split step at natural sparsity = {budget * 1e3:.1f} ms)\n\n"
        f"A busy process pinned to core 0 from step {start} to step {stop} "
        f"of {total}; test accuracy {acc:.4f}. {verdict_on}; {verdict_off}."
        " 'At the bounds': the steps with every layer that reached "
        f"max_sparsity={cb.max_sparsity} there (the fastest the controller "
        "can run: when they are over the budget, it was unreachable, not "
        "missed); 'predicted best': the controller's prediction at the "
        "allocation it aimed for (the bounds' when unreachable).\n")
    report.append(_common.markdown_table(
        "| stretch | steps | median step ms (p10-p90) | median / budget | "
        "at the bounds: median step ms (/ budget) | predicted best ms | "
        "mean sparsity target | mean target, last third |", rows))
    png = os.path.join(args.out_dir, "bench_budget_load"
                       f"{'_quick' if args.quick else ''}.png")
    plot_budget(cb.trace, png, title=f"mlp, budget {budget * 1e3:.1f} ms, "
                f"busy core during steps {start}-{stop}, under load")
    pngs.append(png)
    for r in rows:
        print(r, flush=True)
    print(verdict_on + "; " + verdict_off, flush=True)


def deadline_case(data, args, report, pngs):
    from tf_sparse_split.tools.plots import plot_budget

    (x, y), (xt, yt) = data
    spe = int(np.ceil(len(x) / args.batch))
    total = spe * args.epochs
    plain = _build("mlp", False, args.seed)
    timer = FitTimer()
    t0 = time.perf_counter()
    plain.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0,
              shuffle=True, callbacks=[timer])
    plain_call = time.perf_counter() - t0
    plain_s = timer.seconds
    _, plain_acc = plain.evaluate(xt, yt, batch_size=512, verbose=0)

    def references(when):
        # The sparse-split fit's own range: at the natural sparsity (a step
        # budget nothing needs to be raised for) and at the bounds (one no
        # setting meets), with the callback's warm-up, probe and
        # compilation.
        out = {}
        for name, step in (("natural", 10.0), ("bounds", 1e-6)):
            _, cb, acc = budget_run(
                "mlp", x, y, xt, yt, step, args,
                record=name + ("" if when == "before" else "2"))
            out[name] = (cb.elapsed_s, args.last_fit_s, acc)
            o = cb.overhead
            print(f"deadline ({when}): sparse-split fit at the {name} "
                  f"setting: {cb.elapsed_s:.2f} s from on_train_begin "
                  f"({args.last_fit_s:.2f} s fit call), acc {acc:.4f}; the "
                  f"callback's own {o['step_s']:.2f} s in its per-step "
                  f"hooks, {o['probe_s']:.2f} s in {o['probes']} probes",
                  flush=True)
        return out

    # One untimed sparse-split fit first: the ops' calibration is per
    # process (the first fit pays it, later ones reuse it), so that every
    # timed fit below, references and deadline runs alike, starts from the
    # same calibrated state.
    budget_run("mlp", x, y, xt, yt, 10.0, args)
    refs = references("before")
    nat, fast = refs["natural"][0], refs["bounds"][0]
    deadlines = [("reachable", fast + 0.5 * (nat - fast),
                  "halfway between the bounds and natural fits"),
                 (f"{args.deadline_fraction:.2f} x plain",
                  args.deadline_fraction * plain_s,
                  f"{args.deadline_fraction:.2f} x the plain-Keras fit"),
                 ("unreachable", 0.85 * fast, "0.85 x the bounds fit")]
    rows, notes = [], []
    for label, deadline, how in deadlines:
        _, cb, acc = budget_run("mlp", x, y, xt, yt, deadline, args,
                                kind="deadline",
                                record="deadline " + label)
        wall = args.last_fit_s
        b = np.array([t["budget_s"] for t in cb.trace]) if cb.trace else \
            np.zeros(1)
        later = _after_first_epoch(cb, spe)
        st = np.array([t["seconds"] for t in later]) if later else \
            np.zeros(1)
        logged = cb.deadline_log[-1] if cb.deadline_log else None
        said = ("reachable throughout" if logged is None else
                ("unreachable (predicted end "
                 f"{logged[2]:.1f} s, step {logged[0]})" if not logged[1]
                 else f"reachable again at step {logged[0]}"))
        o = cb.overhead
        rows.append(
            f"| {label} | {deadline:.2f} |@WHERE@| {cb.elapsed_s:.2f} | "
            f"{cb.elapsed_s / deadline:.3f} | {wall:.2f} | "
            f"{wall / deadline:.3f} | {said} | {acc:.4f} | "
            f"{np.min(b) * 1e3:.1f}-{np.max(b) * 1e3:.1f} | "
            f"{np.median(st) * 1e3:.1f} | {_mean_target(later):.2f} | "
            f"{o['step_s']:.2f} / {o['probe_s']:.2f} ({o['probes']}) / "
            f"{o['epoch_end_s']:.2f} |")
        print(rows[-1].replace("|@WHERE@|", "|"), flush=True)
        notes.append(f"- {label} ({how}): " + (
            "; ".join(m for _, _, _, m in cb.deadline_log)
            if cb.deadline_log else "no deadline message (reachable)"))
        png = os.path.join(args.out_dir, "bench_budget_deadline_"
                           f"{label.split()[0]}"
                           f"{'_quick' if args.quick else ''}.png")
        if cb.trace:
            plot_budget(cb.trace, png, title=f"mlp, deadline {deadline:.1f} "
                        f"s ({label}), load average "
                        f"{os.getloadavg()[0]:.1f}")
            pngs.append(png)
    after = references("after")

    def where(deadline):
        """Where a deadline lay against the reference fits before and after
        the deadline runs (the machine's speed moves between fits)."""
        out = []
        for r in (refs, after):
            b, n = r["bounds"][0], r["natural"][0]
            out.append("binding" if b <= deadline <= n else
                       "generous" if deadline > n else "beyond the bounds")
        return " / ".join(out)

    rows = [r.replace(" |@WHERE@|", f" | {where(d)} |")
            for r, d in zip(rows, [d for _, d, _ in deadlines])]
    report.append(
        f"\n### deadlines (mlp, {total} steps, {args.epochs} epochs)\n\n"
        f"Reference fits (seconds from on_train_begin to on_train_end; the "
        f"fit call in brackets): plain Keras {plain_s:.2f} "
        f"({plain_call:.2f}), test acc {float(plain_acc):.4f}; sparse-split "
        f"under TimeBudgetCallback at the natural sparsity {nat:.2f} "
        f"({refs['natural'][1]:.2f}) before the deadline runs and "
        f"{after['natural'][0]:.2f} ({after['natural'][1]:.2f}) after, "
        f"acc {refs['natural'][2]:.4f}; at the bounds {fast:.2f} "
        f"({refs['bounds'][1]:.2f}) before and {after['bounds'][0]:.2f} "
        f"({after['bounds'][1]:.2f}) after, acc {refs['bounds'][2]:.4f}. "
        "The deadlines are set from the fits before (the machine's speed "
        "moves with the other tenants' load between fits: the after fits "
        "show by how much; 'binding': between the bounds and the natural "
        "fit, 'generous': the natural fit ends in time, 'beyond the "
        "bounds': not even the bounds fit does). A deadline counts from "
        "the callback's "
        "on_train_begin to on_train_end; the fit call adds Keras' data "
        "adapter and symbolic build before on_train_begin.\n")
    report.append(_common.markdown_table(
        "| deadline | s | against the reference fits before / after | "
        "fit s (on_train_begin..end) | / deadline | fit "
        "call s | / deadline | logged | test acc | step budget range ms | "
        "median step ms after epoch 1 | mean target | the callback's own "
        "s: per-step hooks / probes (count) / epoch ends |", rows))
    report.append("\nThe callback's deadline messages:\n\n" +
                  "\n".join(notes) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a short end-to-end run: fewer examples and epochs, "
                        "one budget, the CNN on 2000 examples")
    p.add_argument("--data", default=None, help="MNIST IDX directory")
    p.add_argument("--cases", default="mlp,cnn,load,deadline")
    p.add_argument("--load-budget", type=float, default=0.85,
                   help="load case: budget as a fraction of the sparse-split "
                        "model's step at natural sparsity (default 0.85)")
    p.add_argument("--deadline-fraction", type=float, default=0.8,
                   help="deadline case: the fit's deadline as a fraction of "
                        "the plain-Keras fit's wall time (default 0.8)")
    p.add_argument("--fractions", default=None,
                   help="budgets as fractions of the plain step "
                        "(default 0.8,0.65,0.5; --quick 0.65)")
    p.add_argument("--match-tries", type=int, default=1,
                   help="most fixed-target fits per budget to match its "
                        "step time (default 1: the budget run's per-layer "
                        "mean targets only)")
    p.add_argument("--match-tol", type=float, default=0.05,
                   help="step-time match of the fixed-target run, as a "
                        "fraction (default 0.05)")
    p.add_argument("--seeds", type=int, default=1,
                   help="mlp/cnn cases: seeds per budget; the budget run and "
                        "its fixed-target reference run for each, the "
                        "summary reports the accuracy difference's mean +- "
                        "sd (default 1)")
    p.add_argument("--no-channel-dropout", dest="channel_dropout",
                   action="store_false",
                   help="cnn case: no SensitivityAwareDropout in front of "
                        "conv_2 (default: one at rate 0, the controller's "
                        "second tier)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None,
                   help="TimeBudgetCallback warmup_steps (default 20; "
                        "--quick 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", default=None,
                   help="deadline case: write the reference and deadline "
                        "fits' step seconds, epoch ends and the layers' "
                        "cost terms to this JSON file (the layout of "
                        "tests/data/budget_deadline_fits.json, replayed by "
                        "tests/test_budget_replay.py)")
    p.add_argument("--name", default=None,
                   help="report file name in --out-dir (default "
                        "bench_budget.md, --quick bench_budget_quick.md)")
    p.add_argument("--out-dir", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    args.fractions = [float(v) for v in (args.fractions or (
        "0.65" if args.quick else "0.8,0.65,0.5")).split(",")]
    args.epochs = args.epochs or (3 if args.quick else 5)
    if args.warmup is None:
        args.warmup = 12 if args.quick else 20
    args.rounds = args.rounds or (4 if args.quick else 8)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    os.makedirs(args.out_dir, exist_ok=True)
    args.plain_step, args.natural_step = {}, {}
    args.records = {}
    train, test, desc = _common.load_mnist_or_digits(args.data)
    if "digits" in desc and not args.quick:
        print(f"skipped: the full benchmark needs MNIST ({desc})")
        return 0
    x, y = train
    xt, yt = test
    n = 4000 if args.quick else len(x)
    m = 2000 if args.quick else len(x)
    data = {"mlp": ((x[:n], y[:n]), (xt, yt)),
            "cnn": ((x[:m], y[:m]), (xt[:1000], yt[:1000]))}
    import tensorflow as tf

    import tf_sparse_split as tfss

    report = [f"# bench_budget{' (--quick)' if args.quick else ''}\n",
              f"{_common.tf_machine_desc(tfss._loader.build_info())}"
              f"; data: {desc}; load average {os.getloadavg()[0]:.1f} at "
              f"the start (other jobs on the machine move the step times "
              f"and widen the spread).\n"]
    pngs = []
    for case in cases:
        if case in ("mlp", "cnn"):
            run_case(case, data[case], args, report, pngs)
        elif case == "load":
            load_case(data["mlp"], args, report, pngs)
        elif case == "deadline":
            deadline_case(data["mlp"], args, report, pngs)
        else:
            raise SystemExit(f"unknown case {case!r}")
    name = args.name or ("bench_budget_quick.md" if args.quick
                         else "bench_budget.md")
    report.append("\nPlots: " + ", ".join(os.path.basename(p) for p in pngs)
                  + "\n")
    _common.write_report(os.path.join(args.out_dir, name), "\n".join(report))
    if args.record and args.records:
        import json

        spe = int(np.ceil(len(data["mlp"][0][0]) / args.batch))
        args.records.update(
            note=f"{desc}; batch {args.batch}; load average "
                 f"{os.getloadavg()[0]:.1f} at the end",
            steps_per_epoch=spe, epochs=args.epochs)
        with open(args.record, "w") as f:
            json.dump(args.records, f, separators=(",", ":"), default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
