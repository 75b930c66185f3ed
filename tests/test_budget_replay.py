"""Deadline fits replayed on a fake clock (tuning/budget.py and
tuning/deadline.py wired as TimeBudgetCallback wires them), with the load
pattern, first step and epoch ends of recorded fits
(``data/budget_deadline_fits.json``: the sparse-split MLP
784-2048-2048-10 under TimeBudgetCallback on a shared 2-core machine) and
the layers' recorded op cost terms; nothing timed.

The plant: step ``i`` takes ``load_i * (fixed + slope * sum_l cost_l(s_l))``
with ``load_i`` the recorded natural-sparsity fit's step ``i`` over its
median (its bursts of load), ``cost_l`` the recorded cost terms at the
batch's 128 rows, and ``fixed``, ``slope`` set so that the natural
sparsity takes 32.8 ms and the bounds 25.5 ms (the medians measured on a
quiet machine). The activation follows its target with the FATReLU
cutoff's moving average (momentum 0.9)."""

import json
import os

import numpy as np
import pytest

from tf_sparse_split.tuning import budget as B
from tf_sparse_split.tuning.deadline import WallTimePlan, median_over_mean

DATA = os.path.join(os.path.dirname(__file__), "data",
                    "budget_deadline_fits.json")
NATURAL_S, BOUNDS_S = 0.0328, 0.0255
MOMENTUM = 0.9


def _record():
    with open(DATA) as f:
        return json.load(f)


def _costs(rec):
    out = {}
    for n, c in rec["costs"].items():
        c = dict(c)
        c["m"] = 128.0          # the recording ends on the last, short batch
        out[n] = B.LayerCost(**c)
    return out


class ReplayPlant:
    def __init__(self, rec, run="natural2"):
        self.costs = _costs(rec)
        self.floors = {n: float(v) for n, v in rec["floors"].items()}
        steps = np.asarray(rec[run]["step_s"], np.float64)
        self.first_s = float(steps[0])
        later = steps[1:]
        self.load = later / np.median(later[62:])
        speed = NATURAL_S / np.median(later[62:])
        self.ends = [e * speed for e in rec[run]["epoch_end_s"]]
        self.first_s *= speed
        x_nat = self._x(self.floors)
        x_top = self._x({n: 0.95 for n in self.floors})
        self.slope = (NATURAL_S - BOUNDS_S) / (x_nat - x_top)
        self.fixed = NATURAL_S - self.slope * x_nat

    def _x(self, sp):
        return sum(c.seconds(sp[n]) for n, c in self.costs.items())

    def step(self, i, sp):
        return self.load[(i - 1) % len(self.load)] * (
            self.fixed + self.slope * self._x(sp))


def replay(deadline, rec, jump=True, lag=False, cautious=True, spe=63,
           epochs=5, warmup=20, gap=0.001, run="natural2"):
    """One fit; returns ``(wall seconds, controller, deadline verdicts)``."""
    plant = ReplayPlant(rec, run)
    c = B.BudgetController(list(plant.costs), max_sparsity=0.95)
    for n, cost in plant.costs.items():
        c.set_cost(n, cost)
        c.set_floor(n, plant.floors[n])
        c.set_sensitivity(n, 1.0)
    plan = WallTimePlan("deadline", deadline, spe, epochs, start=0.0)
    lag_steps = int(round(MOMENTUM / (1 - MOMENTUM))) if lag else 0
    target = dict(plant.floors)
    act = dict(plant.floors)
    t, step, recent = 0.05, 0, []
    for e in range(epochs):
        plan.epoch_begin(t, e)
        for i in range(spe):
            if i:
                t += gap
            plan.step_begin(t)
            lag_s = float(np.mean(recent[-8:])) if recent else 0.0
            skew = median_over_mean(recent[-32:])
            b = plan.budget(t, lag_steps, lag_s) * skew
            fb = plan.budget(t, lag_steps, lag_s, cautious=True) * min(
                skew, median_over_mean(recent)) if cautious else None
            st = plant.first_s if step == 0 else plant.step(step, act)
            t += st
            plan.step_end(t)
            step += 1
            for n in act:
                act[n] = MOMENTUM * act[n] + (1 - MOMENTUM) * target[n]
            if step == 1:
                continue
            recent.append(st)
            if step <= warmup:
                continue
            c.observe_step(st)
            for n in act:
                c.set_actual(n, act[n])
            new = c.decide(b if b > 0 else 1e-12, jump=jump and c.at_floors,
                           fall_budget_s=fb)
            if new:
                target = new
        t += plant.ends[e]
        plan.epoch_end(t)
    return t, c


@pytest.fixture(scope="module")
def rec():
    return _record()


def test_replay_plant_matches_the_recorded_medians(rec):
    plant = ReplayPlant(rec)
    assert plant.fixed > 0 and plant.slope > 0
    top = {n: 0.95 for n in plant.floors}
    nat = [plant.step(i, plant.floors) for i in range(64, 315)]
    fast = [plant.step(i, top) for i in range(64, 315)]
    assert np.median(nat) == pytest.approx(NATURAL_S, rel=0.02)
    assert np.median(fast) == pytest.approx(BOUNDS_S, rel=0.02)
    # The recorded load: bursts well above the median.
    assert np.mean(nat) > 1.1 * np.median(nat)


def _where(rec, run, where, **kw):
    """End / deadline of a deadline ``where`` of the way from the replayed
    fit at the bounds to the one at the natural sparsity."""
    natural, _ = replay(1e6, rec, run=run)
    fastest, _ = replay(1e-4, rec, run=run)
    deadline = fastest + where * (natural - fastest)
    end, _ = replay(deadline, rec, run=run, **kw)
    return end / deadline


OLD = dict(jump=False, cautious=False)


@pytest.mark.parametrize("run", ["natural", "natural2"])
@pytest.mark.parametrize("where", [0.25, 0.5])
def test_replayed_deadline_met_within_3_5_percent(rec, run, where):
    """Deadlines a quarter and half of the way from the bounds fit to the
    natural one, under the recorded load: the fit ends within -5%..+3.5%
    of the deadline. The old wiring (targets ramping up from the natural
    sparsity, falls judged on the lower-median epoch ends and the recent
    steps' skew alone) ended 4.6% late at a quarter of the way under the
    heavier of the two recorded loads."""
    ratio = _where(rec, run, where)
    assert 0.95 <= ratio <= 1.035, ratio


def test_old_wiring_misses_the_tight_replayed_deadline(rec):
    """The replay tells the two apart: the old wiring misses the bound
    above."""
    assert _where(rec, "natural2", 0.25, **OLD) > 1.035


@pytest.mark.parametrize("run", ["natural", "natural2"])
@pytest.mark.parametrize("where", [0.1, 0.25])
def test_tight_deadlines_end_earlier_than_with_the_old_wiring(rec, run,
                                                             where):
    """Near the bounds (a tenth and a quarter of the way to the natural
    fit) the fit ends earlier than with the old wiring, and each piece
    helps: the jump from the natural sparsity, then the cautious falls."""
    old = _where(rec, run, where, **OLD)
    jump = _where(rec, run, where, cautious=False)
    new = _where(rec, run, where)
    assert new < old and jump < old, (old, jump, new)


def test_unreachable_replayed_deadline_runs_at_the_bounds(rec):
    end, c = replay(1.0, rec)
    assert all(not d.reachable for d in c.log)
    assert c.targets["hidden_2"] == pytest.approx(0.95)
