"""Wall-time accounting of a ``fit`` for epoch-time and whole-fit deadline
budgets: the arithmetic behind
:class:`~tf_sparse_split.callbacks.TimeBudgetCallback`'s ``epoch_time`` and
``deadline`` (R. Sun and L. Zhang, *Dynamic Sparse Method for Deep Learning
Execution*, 2019: the user's demand is a time, the controller chooses the
sparsity that meets it). Free of Keras and of any clock: the caller passes
the clock readings, so it runs (and is tested) on a fake clock.

A fit's wall time, from ``on_train_begin``, is

    head (on_train_begin -> first step: whatever the other callbacks'
          on_train_begin and the first epoch's begin cost)
    + the steps (the first one with the tracing and compilation, the
      sparse-split ops' first calls with their calibration)
    + the gaps between one step's end and the next one's begin inside an
      epoch (the callbacks' per-step work, the controller's statistics
      reads)
    + the epoch boundaries (an epoch's last step -> the next epoch's first
      step: validation, epoch-end callbacks, the sensitivity probe), the
      last one up to ``on_train_end``.

Everything already spent is measured (``elapsed``), whatever it was: a slow
first epoch (compilation, calibration, warm-up at the natural sparsity)
only leaves less time to the steps after it. What is still to come is
predicted from what the fit has shown so far: gaps by a trimmed mean of the
recent ones (a one-off gap, such as the probe's first tracing, is not
repeated), boundaries by the typical measured one (:func:`typical_end`: the
lower median, the first epoch end left out while it is larger than every
later one; before the first has been seen, what the caller knows it will
spend at each epoch end, :meth:`WallTimePlan.expect_epoch_end`). An epoch
end that costs more than predicted is paid once, where it happened (it is
in the elapsed time), and not projected onto the ends still to come:
projecting it made the step budget drop at one epoch end and jump back at
the next (a plain median of two ends is their mean). The step budget is
then re-planned at every step from the time left over the steps left:

    deadline:   (deadline - elapsed - gaps_left * gap - ends_left * boundary)
                / steps_left
    epoch_time: (epoch_time - elapsed in the epoch - gaps_left_in_epoch *
                gap - epoch_tail) / steps_left_in_epoch

(``ends_left``: epoch ends still to come, the current one's included;
``epoch_tail``: the part of an epoch after its last step, up to
``on_epoch_end``). A budget that comes out <= 0 means the time is spent:
the caller then runs at its bounds. :meth:`WallTimePlan.predicted_end`
says when the fit (or the epoch) ends if the remaining steps take a given
time, which tells whether a deadline is still reachable at the fastest
setting; both can count the first steps left at another time (``lag_steps``
at ``lag_step_s``: the steps a change decided now takes to act run at the
settings in force). A cautious budget (``budget(..., cautious=True)``)
predicts each epoch end still to come at the mean of every measured one
(:attr:`WallTimePlan.cautious_boundary_s`), for a controller to judge
falls by: on a shared machine an epoch end can stall for seconds (the next
epoch's first batch waiting on the input pipeline), such stalls come
again, and sparsity given back on a short prediction cannot be bought back
at the bounds.

Units: seconds (clock readings in seconds of any origin).
"""

import math

import numpy as np

from tf_sparse_split.utils.validation import validate_int

__all__ = ["WallTimePlan", "median_over_mean", "typical_end"]

#: Gaps kept for the mean (the most recent ones).
GAP_WINDOW = 64
#: Share of the largest gaps left out of the mean (one-off work).
GAP_TRIM = 0.05


def _finite(value, name):
    """``float(value)`` for a finite real number (not a bool), else a
    ``ValueError`` naming ``name``."""
    msg = (f"`{name}` must be a finite number of seconds. "
           f"Received: {name}={value!r}")
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(msg)
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(msg) from None
    if not math.isfinite(v):
        raise ValueError(msg)
    return v


def _trimmed_mean(values, trim=GAP_TRIM):
    v = np.sort(np.asarray(values, np.float64))
    drop = int(math.floor(trim * len(v) + 0.5)) if len(v) >= 8 else 0
    v = v[:len(v) - drop] if drop else v
    return float(np.mean(v)) if len(v) else 0.0


def typical_end(seconds):
    """The seconds predicted for each epoch end still to come from the ends
    measured so far (seconds, in the order they happened; non-empty).

    The lower median (an even count does not average in an outlier), of
    all the measured ends, except that the first is left out while it is
    larger than every later one: the first epoch end of a fit carries
    one-off costs (the first validation's tracing, first calls of
    epoch-end work) that are paid once and must not be projected onto the
    later ends. Robust to one slow end in either direction: an end slowed
    by a burst of load is paid where it happened, not expected again.

    Raises:
      ValueError: an empty sequence.
    """
    v = [max(float(b), 0.0) for b in seconds]
    if not v:
        raise ValueError("typical_end needs at least one measured end")
    if len(v) > 1 and v[0] > max(v[1:]):
        v = v[1:]
    v.sort()
    return v[(len(v) - 1) // 2]


def median_over_mean(times, least=8):
    """Median / mean of step times, clipped to ``[0.5, 1]`` (1 with fewer
    than ``least`` finite positive values): a wall-time budget is met by
    the steps' mean, a controller that measures their median (robust to
    the two-speed noise of a shared machine) meets it when given the
    budget times this ratio (under load the mean is the larger)."""
    v = np.asarray([t for t in times if math.isfinite(t) and t > 0],
                   np.float64)
    if len(v) < least:
        return 1.0
    return float(np.clip(np.median(v) / np.mean(v), 0.5, 1.0))


class WallTimePlan:
    """Step budgets for an epoch time or a whole-fit deadline from the
    fit's measured wall time (module docstring).

    Call :meth:`epoch_begin`, :meth:`step_begin`, :meth:`step_end` and
    :meth:`epoch_end` with the clock readings of those events (seconds),
    and :meth:`budget` (at a step's begin) for the step budget in force.

    Args:
      kind: ``"epoch_time"`` or ``"deadline"``.
      seconds: the epoch time, or the deadline counted from ``start``
        (finite, > 0).
      steps_per_epoch: steps per epoch (int >= 1).
      epochs: epochs of the fit (int >= 1; needed for ``"deadline"``).
      start: clock reading at ``on_train_begin`` (seconds, finite).

    Raises:
      ValueError: unknown ``kind``; a ``seconds`` that is not a finite
        number > 0 (a bool, None or text included); ``steps_per_epoch`` or
        (for a deadline) ``epochs`` missing, not an integer or < 1; a
        non-finite ``start``.
    """

    def __init__(self, kind, seconds, steps_per_epoch, epochs=None,
                 start=0.0):
        if kind not in ("epoch_time", "deadline"):
            raise ValueError(f"unknown budget kind {kind!r} (epoch_time or "
                             "deadline)")
        s = _finite(seconds, kind)
        if s <= 0:
            raise ValueError(f"`{kind}` must be a finite number of seconds "
                             f"> 0. Received: {kind}={seconds!r}")
        if steps_per_epoch is None:
            raise ValueError(f"a {kind} budget needs the steps per epoch "
                             "(a dataset of known length, or "
                             "steps_per_epoch)")
        steps_per_epoch = validate_int(steps_per_epoch, "steps_per_epoch")
        if kind == "deadline" and epochs is None:
            raise ValueError("a deadline needs the number of epochs")
        if epochs is not None:
            epochs = validate_int(epochs, "epochs")
        start = _finite(start, "start")
        self.kind, self.seconds = kind, s
        self.steps_per_epoch = int(steps_per_epoch)
        self.epochs = int(epochs) if epochs else None
        self.start = float(start)
        self.steps_done = 0         # steps ended in the fit
        self.epoch_steps = 0        # steps begun in the current epoch
        self.epochs_ended = 0
        self.epoch_start = self.start
        self.gaps = []              # in-epoch gaps (recent)
        self.boundaries = []        # last step end -> next epoch's first step
        self.tails = []             # last step end -> on_epoch_end
        self.expected_epoch_end_s = 0.0
        self._last_end = None       # clock at the latest step's end
        self._in_step = False
        self._epoch_open = False
        self._seen_epoch = False

    # -- events ------------------------------------------------------------
    def epoch_begin(self, t, epoch=None):
        """An epoch begins at clock ``t``; ``epoch`` (its index, optional)
        counts the epochs before the fit's first one (``initial_epoch``)
        as done."""
        if epoch is not None and not self._seen_epoch:
            self.epochs_ended = max(int(epoch), self.epochs_ended)
        self._seen_epoch = True
        self.epoch_start = float(t)
        self.epoch_steps = 0
        self._epoch_open = True

    def step_begin(self, t):
        """A step begins at clock ``t`` (its gap or boundary is measured)."""
        t = float(t)
        self._epoch_open = True
        if self._last_end is not None:
            if self.epoch_steps == 0:
                self.boundaries.append(max(t - self._last_end, 0.0))
            else:
                self.gaps.append(max(t - self._last_end, 0.0))
                self.gaps = self.gaps[-GAP_WINDOW:]
        self.epoch_steps += 1
        self._in_step = True

    def step_end(self, t):
        """The step ends at clock ``t``."""
        self._last_end = float(t)
        self.steps_done += 1
        self._in_step = False

    def epoch_end(self, t):
        """``on_epoch_end`` is reached at clock ``t``."""
        if self._last_end is not None and self.epoch_steps:
            self.tails.append(max(float(t) - self._last_end, 0.0))
        self.epochs_ended += 1
        self._epoch_open = False

    def expect_epoch_end(self, seconds):
        """Seconds the caller knows it will spend at every epoch end (e.g.
        its sensitivity probe), the boundary's estimate until one has been
        measured (and its floor after)."""
        s = float(seconds)
        self.expected_epoch_end_s = s if math.isfinite(s) and s > 0 else 0.0

    # -- estimates -----------------------------------------------------------
    @property
    def gap_s(self):
        """Predicted seconds between two steps of an epoch."""
        return _trimmed_mean(self.gaps) if self.gaps else 0.0

    @property
    def tail_s(self):
        """Predicted seconds from an epoch's last step to ``on_epoch_end``
        (:func:`typical_end` of the measured ones)."""
        return typical_end(self.tails) if self.tails else 0.0

    @property
    def boundary_s(self):
        """Predicted seconds from an epoch's last step to the next epoch's
        first step (or, for the last epoch, to the end of the fit):
        :func:`typical_end` of the measured ones, at least what the caller
        expects (:meth:`expect_epoch_end`)."""
        if self.boundaries:
            return max(typical_end(self.boundaries),
                       self.expected_epoch_end_s)
        return self.expected_epoch_end_s + self.tail_s

    @property
    def cautious_boundary_s(self):
        """A cautious prediction of each epoch end still to come: the mean
        of every measured end (the first one included), at least
        :attr:`boundary_s`. On a shared machine an epoch end can stall for
        seconds (the next epoch's first batch waits on the input pipeline
        under load), and such stalls come again: the lower median then
        predicts the cheap ends only. What a controller gives back on the
        strength of a prediction (sparsity lowered because the budget looks
        generous) cannot be bought back at the bounds when the prediction
        was short, so falls are planned on this estimate, rises on
        :attr:`boundary_s`."""
        if not self.boundaries:
            return self.boundary_s
        return max(float(np.mean(self.boundaries)), self.boundary_s)

    def _counts(self):
        """``(steps_left, gaps_left, ends_left)`` of the fit (deadline) or
        of the current epoch (epoch time); a step begun and not ended is
        counted as left (its gap is spent)."""
        spe = self.steps_per_epoch
        if self._epoch_open:
            if self._in_step:
                steps = spe - self.epoch_steps + 1
                gaps = spe - self.epoch_steps
            else:
                steps = spe - self.epoch_steps
                gaps = steps - (1 if self.epoch_steps == 0 else 0)
            steps, gaps, ends = max(steps, 0), max(gaps, 0), 1
            later = self.epochs - self.epochs_ended - 1 if self.epochs \
                else 0
        else:
            steps = gaps = ends = 0
            later = self.epochs - self.epochs_ended if self.epochs else 0
        if self.kind == "epoch_time":
            return steps, gaps, ends
        later = max(later, 0)
        return steps + later * spe, gaps + later * (spe - 1), ends + later

    def remaining_s(self, t):
        """Seconds left (deadline or epoch time minus the elapsed) at clock
        ``t`` (may be < 0)."""
        t = float(t)
        if self.kind == "deadline":
            return self.seconds - (t - self.start)
        return self.seconds - (t - self.epoch_start)

    def _lag(self, steps, lag_steps, lag_step_s):
        """The lagging steps counted (at most a quarter of ``steps``: near
        the end a lag over most of the steps left would hand all their
        slack to the last few) and their seconds (``(0, 0.0)`` without a
        usable lag)."""
        try:
            n = int(lag_steps)
            s = float(lag_step_s)
        except (TypeError, ValueError):
            return 0, 0.0
        if n <= 0 or not math.isfinite(s) or s <= 0:
            return 0, 0.0
        n = min(n, steps // 4)
        return (n, n * s) if n > 0 else (0, 0.0)

    def budget(self, t, lag_steps=0, lag_step_s=0.0, cautious=False):
        """The step budget (seconds, >= 0; 0 when the time is spent) at
        clock ``t`` for the step now beginning and the ones after it.

        With ``lag_steps`` > 0 the next ``lag_steps`` steps are taken to
        run at ``lag_step_s`` seconds each (what the settings in force
        give: a change decided now takes that long to act, e.g. a FATReLU
        cutoff following its target with a moving average), and the
        budget is that of the steps after them: a ramp's cost is planned
        for, not found later as a deadline missed. At ``lag_step_s`` equal
        to the plain budget it is the plain budget. ``cautious``: the epoch
        ends still to come at :attr:`cautious_boundary_s` (a deadline)."""
        steps, gaps, ends = self._counts()
        if steps <= 0:
            return max(self.remaining_s(t), 0.0)
        end_s = self.boundary_s if self.kind == "deadline" else self.tail_s
        if cautious and self.kind == "deadline":
            end_s = self.cautious_boundary_s
        left = self.remaining_s(t) - gaps * self.gap_s - ends * end_s
        n, spent = self._lag(steps, lag_steps, lag_step_s)
        return max((left - spent) / (steps - n), 0.0)

    def predicted_end(self, t, step_s, lag_steps=0, lag_step_s=0.0):
        """The clock reading at which the fit (deadline) or the current
        epoch (epoch time) is predicted to end when every remaining step
        takes ``step_s`` seconds (the first ``lag_steps`` of them
        ``lag_step_s``, as in :meth:`budget`)."""
        steps, gaps, ends = self._counts()
        end_s = self.boundary_s if self.kind == "deadline" else self.tail_s
        n, spent = self._lag(steps, lag_steps, lag_step_s)
        return float(t) + spent + (steps - n) * float(step_s) + \
            gaps * self.gap_s + ends * end_s

    def predicted_elapsed(self, t, step_s, lag_steps=0, lag_step_s=0.0):
        """:meth:`predicted_end` as seconds from ``start`` (deadline) or
        from the epoch's begin (epoch time), to compare with ``seconds``."""
        origin = self.start if self.kind == "deadline" else self.epoch_start
        return self.predicted_end(t, step_s, lag_steps, lag_step_s) - origin
