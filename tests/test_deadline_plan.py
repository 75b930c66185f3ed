"""WallTimePlan's epoch-end prediction on a fake clock (tuning/deadline.py):
the step budget re-planned over a fit whose epoch ends differ, nothing
timed."""

import numpy as np
import pytest

from tf_sparse_split.tuning.deadline import WallTimePlan, typical_end

SPE, EPOCHS = 63, 5
FAST, NATURAL = 0.0255, 0.0328      # step seconds at the bounds / natural
GAP, COMPILE = 0.001, 1.0


def _fit(deadline, ends, steady=None, expect=0.0):
    """A deadline fit of SPE x EPOCHS steps on a fake clock, as
    TimeBudgetCallback drives the plan, with a controller that meets
    every step budget it can: each step takes the budget clipped to
    ``[FAST, NATURAL]`` (``steady`` fixes it instead). ``ends``: the
    seconds of each epoch end (the last one: last step -> on_train_end).
    Returns ``(end clock, budgets)``, ``budgets[i]`` the budget of the
    (i+1)-th step."""
    plan = WallTimePlan("deadline", deadline, SPE, EPOCHS, start=0.0)
    plan.expect_epoch_end(expect)
    t, budgets = 0.05, []
    for e in range(EPOCHS):
        plan.epoch_begin(t, e)
        for i in range(SPE):
            if i:
                t += GAP
            plan.step_begin(t)
            b = plan.budget(t)
            budgets.append(b)
            step = steady if steady is not None else \
                float(np.clip(b, FAST, NATURAL))
            t += step + (COMPILE if not budgets[:-1] else 0.0)
            plan.step_end(t)
        t += 0.3 * ends[e]
        plan.epoch_end(t)                  # validation / callbacks before
        t += 0.7 * ends[e]                 # on_epoch_end, the rest after
    return t, budgets


def _fit_s(step, ends):
    return COMPILE + 0.05 + SPE * EPOCHS * step + \
        EPOCHS * (SPE - 1) * GAP + sum(ends)


def _old_boundary_median(plan):
    """The estimate this replaced: the plain median of the measured ends
    (kept here to show the test tells the two apart)."""
    if plan.boundaries:
        return max(float(np.median(plan.boundaries)),
                   plan.expected_epoch_end_s)
    return plan.expected_epoch_end_s + plan.tail_s


def test_typical_end():
    assert typical_end([0.3]) == 0.3
    # Lower median: an even count does not average the outlier in.
    assert typical_end([0.2, 0.8]) == 0.2
    assert typical_end([0.2, 0.8, 0.25]) == 0.25
    assert typical_end([0.2, 0.8, 0.25, 0.8]) == 0.25
    # A first end above every later one carries one-off costs: left out.
    assert typical_end([2.0, 0.3]) == 0.3
    assert typical_end([2.0, 0.3, 0.4, 0.35]) == 0.35
    # ... but kept once a later end is as large (no longer an outlier).
    assert typical_end([0.5, 0.3, 0.6]) == 0.5
    with pytest.raises(ValueError):
        typical_end([])


# The recorded pattern of a quiet 5-epoch deadline run (MLP, 63 steps per
# epoch): every other epoch end ~0.5 s longer than the others. With the
# plain median the budget dropped at the second end (the median of two is
# their mean, projected onto the three ends left), jumped back at the third
# and fell to 0 after the fourth; the fit ended 7.5% late.
ALTERNATING = [0.20, 0.75, 0.20, 0.75, 0.20]


def _jumps(budgets):
    """Budget change at the first step of each epoch after the first
    (seconds), against the step before it."""
    return [budgets[e * SPE] - budgets[e * SPE - 1]
            for e in range(1, EPOCHS)]


def test_alternating_epoch_ends_no_drop_and_jump_back():
    ends = ALTERNATING
    deadline = 0.5 * (_fit_s(FAST, ends) + _fit_s(NATURAL, ends))
    end, budgets = _fit(deadline, ends)
    assert 0.95 <= end / deadline <= 1.05, (end, deadline)
    jumps = _jumps(budgets)
    # An end 0.55 s longer than predicted is paid by the steps left: at
    # most 0.55 s / 189 steps = 2.9 ms less each after the second end (the
    # plain median: ~6 ms, because it also expected 0.28 s more at each of
    # the three ends left) ...
    assert jumps[1] > -0.0035, jumps
    # ... and a cheap end after it gives back no more than a little (the
    # plain median: ~+5 ms, its own over-prediction handed back).
    assert jumps[2] < 0.001, jumps
    # After the fourth end: 0.55 s over the 63 steps of the last epoch,
    # ~9 ms less (the plain median: ~17 ms, to 9 ms per step, then 0).
    assert jumps[3] > -0.010 and budgets[4 * SPE] > 0.6 * FAST, jumps
    # Between epoch ends the budget moves smoothly (no step above 1 ms;
    # the last epoch's budget, under the fastest step, falls toward 0 as
    # its steps overrun it).
    inside = [abs(budgets[i] - budgets[i - 1])
              for i in range(2, (EPOCHS - 1) * SPE) if i % SPE]
    assert max(inside) < 0.001


def test_the_plain_median_shows_the_recorded_jumps():
    """The same fit planned with the plain median reproduces the recorded
    pattern (a drop at the second end, a jump back at the third): the
    assertions above tell the two estimates apart."""
    ends = ALTERNATING
    deadline = 0.5 * (_fit_s(FAST, ends) + _fit_s(NATURAL, ends))
    orig = WallTimePlan.boundary_s
    try:
        WallTimePlan.boundary_s = property(_old_boundary_median)
        _, budgets = _fit(deadline, ends)
    finally:
        WallTimePlan.boundary_s = orig
    jumps = _jumps(budgets)
    assert jumps[1] < -0.004 and jumps[2] > 0.003, jumps


def test_one_off_first_end_is_paid_once():
    """A first epoch end with 1.5 s of one-off work (the first
    validation's tracing): projected onto the four ends left only until a
    second end shows it was one-off; then the budget rises back and the
    fit ends within 5% of the deadline."""
    ends = [1.7, 0.2, 0.2, 0.2, 0.2]
    deadline = 0.5 * (_fit_s(FAST, ends) + _fit_s(NATURAL, ends))
    end, budgets = _fit(deadline, ends)
    assert 0.95 <= end / deadline <= 1.05, (end, deadline)
    # The epochs after the second end run at a steady budget.
    late = budgets[2 * SPE:]
    assert max(late) - min(late) < 0.002


@pytest.mark.parametrize("ends", [[0.2] * 5, ALTERNATING,
                                  [0.2, 0.2, 2.5, 0.2, 0.2]])
def test_steady_steps_predicted_end_is_the_real_end(ends):
    """At constant steps the predicted end after the last epoch end but
    one is within the last end's misprediction of the real end; a burst
    of load at one end (2.5 s) is paid once, not expected again."""
    deadline = 100.0
    plan = WallTimePlan("deadline", deadline, SPE, EPOCHS, start=0.0)
    t = 0.0
    for e in range(EPOCHS):
        plan.epoch_begin(t, e)
        for i in range(SPE):
            if i:
                t += GAP
            plan.step_begin(t)
            if e == EPOCHS - 1 and i == 0:
                predicted = plan.predicted_end(t, 0.03)
            t += 0.03
            plan.step_end(t)
        plan.epoch_end(t + 0.3 * ends[e])
        t += ends[e]
    assert abs(predicted - t) <= abs(ends[-1] - min(ends)) + 1e-9


def _plan_with_ends(ends, step=0.03):
    """A plan after ``len(ends)`` epochs of constant steps whose epoch ends
    took ``ends`` seconds; returns ``(plan, clock)`` at the next epoch's
    first step."""
    plan = WallTimePlan("deadline", 100.0, SPE, EPOCHS, start=0.0)
    t = 0.0
    for e, end in enumerate(ends):
        plan.epoch_begin(t, e)
        for i in range(SPE):
            if i:
                t += GAP
            plan.step_begin(t)
            t += step
            plan.step_end(t)
        plan.epoch_end(t)
        t += end
    plan.epoch_begin(t, len(ends))
    plan.step_begin(t)                 # the last end is measured here
    return plan, t


def test_cautious_boundary_is_the_mean_of_every_end():
    # A first end that stalled (the input pipeline under load): the lower
    # median leaves it out, the cautious estimate expects it again.
    plan, t = _plan_with_ends([2.0, 0.1])
    assert plan.boundary_s == pytest.approx(0.1)
    assert plan.cautious_boundary_s == pytest.approx(1.05)
    plain, cautious = plan.budget(t), plan.budget(t, cautious=True)
    # Three ends to come: 3 * 0.95 s less over the 189 steps left.
    assert plain - cautious == pytest.approx(3 * 0.95 / (3 * SPE), rel=1e-6)
    # Never below the plain estimate.
    plan, _ = _plan_with_ends([0.3, 0.3, 0.0])
    assert plan.cautious_boundary_s == pytest.approx(plan.boundary_s)


def test_lagging_steps_in_the_budget_and_predicted_end():
    plan, t = _plan_with_ends([0.2])
    steps = (EPOCHS - 1) * SPE
    plain = plan.budget(t)
    # Ten steps at the plain budget: the same budget.
    assert plan.budget(t, 10, plain) == pytest.approx(plain)
    # Ten slow steps first: the steps after them have less each.
    slow = plan.budget(t, 10, 2 * plain)
    assert slow == pytest.approx((plain * steps - 10 * 2 * plain) /
                                 (steps - 10))
    end = plan.predicted_end(t, 0.02)
    assert plan.predicted_end(t, 0.02, 10, 0.05) == pytest.approx(
        end + 10 * 0.03)
    # At most a quarter of the steps left lag; no lag without a time.
    assert plan.predicted_end(t, 0.02, 10 ** 6, 0.05) == pytest.approx(
        end + (steps // 4) * 0.03)
    assert plan.budget(t, 10, 0.0) == pytest.approx(plain)
