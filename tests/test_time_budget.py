"""The time-budget controller (tuning/budget.py) on synthetic and recorded
step times with a fake plant (deterministic, nothing timed), and the wiring
of TimeBudgetCallback into a short fit (log keys, bounds)."""


import numpy as np
import pytest

from tf_sparse_split.tuning import budget as B
from tf_sparse_split.tuning import stats as S


def _cost(m=256, k=2048, n=2048, dense_rate=2e11, sparse_rate=1e11,
          convert=2e-11):
    return B.LayerCost(m=m, k=k, k_live=k, dense_flops_per_elem=2 * n,
                       sparse_flops_per_nnz=2 * n, dense_fixed_s=1e-5,
                       dense_rate=dense_rate, sparse_fixed_s=2e-5,
                       convert_s_per_elem=convert, sparse_rate=sparse_rate)


class Plant:
    """A fake machine: step = speed * (fixed + 3 * sum of the layers' true
    op seconds) * (1 + noise), with occasional 2x outliers."""

    def __init__(self, true_costs, fixed=0.004, seed=0, noise=0.05,
                 outliers=0.05):
        self.true = true_costs
        self.fixed = fixed
        self.rng = np.random.default_rng(seed)
        self.noise, self.outliers = noise, outliers

    def step(self, sparsity, speed=1.0):
        t = speed * (self.fixed + 3 * sum(
            self.true[n].seconds(sparsity[n]) for n in self.true))
        t *= 1 + self.noise * self.rng.standard_normal()
        if self.rng.random() < self.outliers:
            t *= 2
        return t


def _setup(sens=(1.0, 3.0), floors=0.5, max_sparsity=0.95, model_err=0.8):
    names = ["a", "b"]
    predicted = {"a": _cost(), "b": _cost(n=1024)}
    # The plant's sparse path is slower than the model thinks (feedback must
    # correct it).
    true = {"a": _cost(sparse_rate=1e11 * model_err),
            "b": _cost(n=1024, sparse_rate=1e11 * model_err)}
    c = B.BudgetController(names, max_sparsity=max_sparsity)
    for n, s in zip(names, sens):
        c.set_cost(n, predicted[n])
        c.set_floor(n, floors)
        c.set_sensitivity(n, s)
    return c, Plant(true), {n: floors for n in names}


def _run(c, plant, cur, budget, steps, speed=lambda t: 1.0, t0=0):
    measured = []
    for t in range(t0, t0 + steps):
        st = plant.step(cur, speed(t))
        measured.append(st)
        c.observe_step(st)
        for n in cur:
            c.set_actual(n, cur[n])
        new = c.decide(budget)
        if new:
            assert all(0.0 <= v <= c.max_sparsity + 1e-12
                       for v in new.values())
            cur = new
    return cur, measured


def _plain(plant, floors=0.5):
    return plant.fixed + 3 * sum(p.seconds(floors) for p in plant.true.values())


def test_converges_and_allocates_by_sensitivity():
    c, plant, cur = _setup()
    budget = 0.65 * _plain(plant)
    cur, measured = _run(c, plant, cur, budget, 300)
    tail = np.median(measured[-100:])
    assert tail <= budget * 1.04
    assert tail >= budget * 0.75      # not far more sparsity than needed
    # "a" saves more time per unit of loss (3x less sensitive, larger n):
    # it is raised first and furthest.
    assert cur["a"] > cur["b"]
    reasons = [d for d in c.log if d.action == "reallocate"][0].reasons
    assert reasons["a"].startswith("raised")
    assert "ms/step" in reasons["a"]


def test_loose_budget_keeps_natural_sparsity():
    c, plant, cur = _setup()
    cur, _ = _run(c, plant, cur, 2.0 * _plain(plant), 100)
    assert cur == {"a": 0.5, "b": 0.5}


def test_unreachable_budget_runs_at_bounds_and_is_logged():
    c, plant, cur = _setup(max_sparsity=0.9)
    cur, _ = _run(c, plant, cur, 0.05 * _plain(plant), 200)
    assert all(abs(v - 0.9) < 1e-9 for v in cur.values())
    assert any(d.action == "unreachable" and not d.reachable for d in c.log)


def test_unreachable_leaves_a_layer_that_buys_no_time():
    c, plant, cur = _setup(max_sparsity=0.9)
    # "b" never gets faster: its op runs dense whatever its zeros.
    flat = _cost(n=1024, sparse_rate=1.0)
    c.set_cost("b", flat)
    plant.true["b"] = flat
    cur, _ = _run(c, plant, cur, 0.05 * _plain(plant), 200)
    assert cur["a"] == pytest.approx(0.9) and cur["b"] == pytest.approx(0.5)
    last = [d for d in c.log if d.action == "unreachable"][-1]
    assert "saves no predicted time" in last.reasons["b"]


def test_unreachable_keeps_a_layer_that_buys_a_sliver_of_the_step():
    """Under an unreachable budget a layer whose whole range saves less
    than ``bound_gain`` of the step stays at its natural sparsity (with
    the reason logged); with ``bound_gain=0`` it runs at the bound."""
    out = {}
    for bg in (0.05, 0.0):
        c, plant, cur = _setup(max_sparsity=0.9)
        c.bound_gain = bg
        # "b" is a 16-way output layer: its op is a few percent of "a"'s.
        small = _cost(n=16)
        c.set_cost("b", small)
        plant.true["b"] = small
        cur, _ = _run(c, plant, cur, 0.05 * _plain(plant), 200)
        out[bg] = (cur, [d for d in c.log if d.action == "unreachable"][-1])
    cur, last = out[0.05]
    assert cur["a"] == pytest.approx(0.9) and cur["b"] == pytest.approx(0.5)
    assert "less than bound_gain=0.05" in last.reasons["b"]
    assert not last.reachable
    cur, _ = out[0.0]
    assert cur["a"] == pytest.approx(0.9) and cur["b"] == pytest.approx(0.9)


@pytest.mark.parametrize("model_err,frac", [(0.8, 0.6), (1.0, 0.8),
                                            (1.5, 0.7), (2.0, 0.6),
                                            (2.0, 0.7)])
def test_fine_trim_aims_at_the_middle_of_the_band(model_err, frac):
    """With the targets trimmed on ``fine_step`` and no test falls, each
    reallocation's prediction ends just under the band's middle
    (``budget * (1 - band / 2)``), not up to a grid step below it, and the
    steps' median ends within +-5% of the budget whatever the model's
    error."""
    c, plant, cur = _setup(model_err=model_err)
    c.test_falls = False
    plant.outliers, plant.noise = 0.0, 0.03
    budget = frac * _plain(plant)
    cur, measured = _run(c, plant, cur, budget, 300)
    assert 0.95 <= np.median(measured[-150:]) / budget <= 1.05
    aims = [d.best_s / budget for d in c.log if d.action == "reallocate"]
    assert aims
    assert all(0.95 <= a <= 1 - c.aim * c.band + 1e-9 for a in aims), aims


def test_natural_sparsity_is_followed_at_the_floor():
    """The plant's natural sparsity grows from 0.5 to 0.7 over the first
    100 steps (a ReLU layer training); "b" is too sensitive to be raised
    and stays at its floor. With a floor left at the warm-up's 0.5 every
    prediction at "b"'s floor is too slow, and the controller keeps "a"
    so sparse that the steps end under the band; following the measured
    sparsity at the floor, it ends within +-5% of the budget."""
    out = {}
    for track in (False, True):
        c, plant, cur = _setup(sens=(1.0, 30.0))
        c.track_natural = track
        plant.outliers, plant.noise = 0.0, 0.03
        budget = 0.7 * _plain(plant)
        measured = []
        for t in range(300):
            natural = 0.5 + 0.2 * min(t / 100, 1.0)
            run = {n: max(cur[n], natural) for n in cur}
            measured.append(plant.step(run))
            c.observe_step(measured[-1])
            for n in cur:
                c.set_actual(n, run[n])
            new = c.decide(budget)
            if new:
                cur = new
        out[track] = (np.median(measured[-150:]) / budget, dict(c.floors))
    assert out[False][0] < 0.95 and out[False][1]["b"] == 0.5, out
    assert 0.95 <= out[True][0] <= 1.05, out
    assert out[True][1]["b"] == pytest.approx(0.7), out


def test_track_natural_moves_floors_both_ways_and_leaves_raised_layers():
    c = B.BudgetController(["a", "b", "c"], max_sparsity=0.9,
                           min_samples=4, settle=0)
    for n in c.layers:
        c.set_cost(n, _cost())
        c.set_floor(n, 0.5)
        c.set_sensitivity(n, 1.0)
    c.targets["b"] = c.targets["c"] = 0.8

    def decide(actual):
        for n, v in actual.items():
            c.set_actual(n, v)
        for _ in range(4):
            c.observe_step(0.01)
        c.decide(0.01)

    # "a" at its floor: follows its measured sparsity up; "b" raised,
    # measuring its target, and "c" raised, measuring more (as after a
    # fall, while the cutoff follows its target with a lag): unchanged.
    decide({"a": 0.62, "b": 0.8, "c": 0.88})
    assert c.floors["a"] == pytest.approx(0.62)
    assert c.floors["b"] == c.floors["c"] == 0.5
    assert c.log[-1].targets["a"] == pytest.approx(0.62)
    # ... and down (a natural sparsity may fall too), never past the
    # bound.
    decide({"a": 0.55, "b": 0.8, "c": 0.8})
    assert c.floors["a"] == pytest.approx(0.55)
    decide({"a": 0.97, "b": 0.8, "c": 0.8})
    assert c.floors["a"] == pytest.approx(0.9)
    # Off: the floors stay where set_floor put them.
    c.track_natural = False
    decide({"a": 0.7, "b": 0.8, "c": 0.9})
    assert c.floors["a"] == pytest.approx(0.9)


def test_a_test_fall_is_one_step_from_an_off_grid_target():
    c = B.BudgetController(["a"], max_sparsity=0.9)
    c.set_floor("a", 0.5)
    n, v, _ = c._fall_probe({"a": 0.83}, {}, 0.01, 0.02)
    assert n == "a" and v == pytest.approx(0.78)
    n, v, _ = c._fall_probe({"a": 0.52}, {}, 0.01, 0.02)
    assert v == pytest.approx(0.5)


@pytest.mark.parametrize("model_err,frac", [(0.8, 0.6), (1.0, 0.8),
                                            (2.0, 0.7)])
def test_test_falls_leave_a_setting_the_model_holds_under_the_band(
        model_err, frac):
    """A plant whose sparse path is ``model_err`` times as fast as the
    cost model says, the targets on the greedy grid (``fine_step`` =
    ``step``): without test falls the controller stays at a setting
    whose steps sit 5-10% under the budget (the model predicts that any
    fall would break it); with them, the steps' median ends within the
    +-5% of the budget."""
    ratios = {}
    for test_falls in (False, True):
        c, plant, cur = _setup(model_err=model_err)
        c.fine_step = c.step
        c.test_falls = test_falls
        plant.outliers, plant.noise = 0.0, 0.03
        budget = frac * _plain(plant)
        cur, measured = _run(c, plant, cur, budget, 300)
        ratios[test_falls] = np.median(measured[-150:]) / budget
        tests = [d for d in c.log if d.action == "test fall"]
        assert bool(tests) == test_falls
    assert ratios[False] < 0.95, ratios
    assert 0.95 <= ratios[True] <= 1.05, ratios
    assert all("lowered one level to test" in r
               for d in tests for r in d.reasons.values()
               if r.startswith("lowered"))


def test_a_test_fall_that_breaks_the_budget_is_taken_back():
    """After a test fall from 0.8 to 0.75, steps over the band send the
    knob back at least to 0.8, even where the model's allocation (here:
    no predicted saving at all) would not raise it."""
    c = B.BudgetController(["a"], max_sparsity=0.9, min_samples=4, settle=0)
    c.set_cost("a", _cost(sparse_rate=1.0))
    c.set_floor("a", 0.5)
    c.set_sensitivity("a", 1.0)
    c.targets["a"] = 0.75
    c._test = ("a", 0.8)
    for _ in range(4):
        c.observe_step(0.05)
    new = c.decide(0.02)
    assert new == {"a": pytest.approx(0.8)}
    # (The budget is unreachable for a layer that saves nothing: the action
    # says so; the reason says the test fall was taken back.)
    assert c.log[-1].action == "unreachable"
    assert "test fall taken back to 0.80" in c.log[-1].reasons["a"]


def test_never_moves_against_the_measurement():
    # The prediction says no layer buys time (the ops' rates moved), but
    # the steps are over the budget: no target may fall.
    c = B.BudgetController(["a"], max_sparsity=0.9, min_samples=4, settle=0)
    c.set_cost("a", _cost(sparse_rate=1.0))
    c.set_floor("a", 0.5)
    c.targets["a"] = 0.8
    for _ in range(4):
        c.observe_step(0.05)
    c.decide(0.02)
    assert c.targets["a"] >= 0.8
    # ... and under the budget none may rise.
    c2, plant, cur = _setup()
    c2.targets = {"a": 0.6, "b": 0.6}
    for _ in range(c2.settle + c2.min_samples):
        c2.observe_step(1e-4)
    new = c2.decide(1.0)
    assert new is None or all(v <= 0.6 for v in new.values())


def test_resource_drop_and_recovery():
    c, plant, cur = _setup()
    budget = 0.7 * _plain(plant)
    slow = lambda t: 1.6 if 200 <= t < 400 else 1.0  # noqa: E731
    cur1, _ = _run(c, plant, cur, budget, 200, slow, 0)
    before = sum(cur1.values())
    cur2, m2 = _run(c, plant, cur1, budget, 200, slow, 200)
    during = sum(cur2.values())
    cur3, m3 = _run(c, plant, cur2, budget, 200, slow, 400)
    after = sum(cur3.values())
    assert during > before + 0.05     # raised to hold the budget
    assert after < during - 0.05      # lowered when the machine is back
    assert np.median(m3[-80:]) <= budget * 1.04


def test_a_few_slow_steps_do_not_whipsaw():
    c, plant, cur = _setup()
    plant.outliers = 0.0
    budget = 0.7 * _plain(plant)
    cur, _ = _run(c, plant, cur, budget, 200)
    settled = dict(cur)
    n_changes = sum(1 for d in c.log if d.action != "hold")
    # Three isolated 3x steps: the median of the window ignores them.
    for t in range(60):
        st = plant.step(cur) * (3.0 if t in (5, 25, 45) else 1.0)
        c.observe_step(st)
        new = c.decide(budget)
        if new:
            cur = new
    assert max(abs(cur[n] - settled[n]) for n in cur) <= 0.05 + 1e-9
    assert n_changes >= 1


def test_recorded_step_times_two_speeds():
    """Step times recorded on the shared machine (two-speed epochs, seconds)
    replayed as the plant's speed factor."""
    recorded = [1.0] * 40 + [2.0] * 60 + [1.0] * 60 + [1.9, 1.0, 2.1, 1.0] * 10
    c, plant, cur = _setup()
    budget = 0.75 * _plain(plant)
    cur, measured = _run(c, plant, cur, budget, len(recorded),
                         lambda t: recorded[t])
    # Bounds always held; in the last quiet stretch the targets came back.
    assert all(0.5 - 1e-9 <= v <= 0.95 + 1e-9 for v in cur.values())


def test_step_model_fit_recovers_slope():
    m = B.StepModel(factor0=3.0, prior_weight=0.01)
    for x in (0.002, 0.004, 0.006, 0.008, 0.010):
        m.observe(x, 0.01 + 2.0 * x)
    assert m.factor == pytest.approx(2.0, rel=0.05)
    assert m.fixed == pytest.approx(0.01, rel=0.1)
    m2 = B.StepModel()
    m2.observe(0.01, 0.05)   # one observation: prior slope, fixed from it
    assert m2.factor == pytest.approx(3.0)
    assert m2.predict(0.01) == pytest.approx(0.05, rel=1e-6)


def test_layer_cost_from_stats_and_shape():
    v = np.zeros(S.NUM_STATS)
    v[S.M], v[S.K], v[S.N], v[S.K_LIVE] = 256, 2048, 2048, 2048
    v[S.DENSE_FLOPS_PER_ELEM] = v[S.SPARSE_FLOPS_PER_NNZ] = 4096
    v[S.TERM_DENSE_FIXED], v[S.TERM_DENSE_RATE] = 1e-5, 2e11
    v[S.TERM_SPARSE_FIXED], v[S.TERM_CONVERT] = 2e-5, 2e-11
    v[S.TERM_SPARSE_RATE] = 1e11
    v[S.TIME_DENSE] = 0.01
    c = B.LayerCost.from_stats(3 * v, calls=3)
    dense = 1e-5 + 256 * 2048 * 4096 / 2e11
    assert c.seconds(0.0) == pytest.approx(dense)
    assert c.seconds(0.5) == pytest.approx(dense)     # dense still wins
    sparse95 = 2e-5 + 2e-11 * 256 * 2048 + 0.05 * 256 * 2048 * 4096 / 1e11
    assert c.seconds(0.95) == pytest.approx(sparse95)
    assert c.seconds(0.95) < dense
    # non-increasing in sparsity
    s = [c.seconds(x) for x in np.linspace(0, 1, 21)]
    assert all(a >= b - 1e-15 for a, b in zip(s, s[1:]))
    # no rates: the measured seconds, whatever the sparsity
    v[S.TERM_DENSE_RATE] = v[S.TERM_SPARSE_RATE] = 0
    c = B.LayerCost.from_stats(v)
    assert not c.predicts and c.seconds(0.9) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        B.LayerCost.from_stats(np.zeros(3))
    with pytest.raises(ValueError):
        B.LayerCost.from_stats(v, calls=0)


def test_allocate_lookahead_past_break_even():
    # Gain starts only past the break-even: a one-step look would stall.
    costs = {"a": _cost()}
    model = B.StepModel()
    model.observe(costs["a"].seconds(0.3), 0.004 + 3 * costs["a"].seconds(0.3))
    goal = 0.8 * model.predict(costs["a"].seconds(0.3))
    al = B.allocate(costs, {"a": 0.3}, {"a": 1.0}, 0.95, goal, model)
    # The first move jumps from the floor past the break-even (0.5 here).
    assert al.reachable and al.moves[0][1] == pytest.approx(0.3)
    assert al.moves[0][2] > 0.5 and al.targets["a"] > 0.5
    al = B.allocate(costs, {"a": 0.3}, {"a": 1.0}, 0.95, 1e-6, model)
    assert not al.reachable and al.targets["a"] == pytest.approx(0.95)


def test_sensitivity_measured_above_floor_is_scaled_back():
    c = B.BudgetController(["a"], max_sparsity=0.9)
    c.set_floor("a", 0.5)
    c.set_sensitivity("a", 2.0)
    assert c.sensitivities["a"] == pytest.approx(2.0)
    c.set_sensitivity("a", 2.0, at=0.9)      # at the bound: twice the base
    assert c.sensitivities["a"] == pytest.approx(1.0)
    c.set_sensitivity("a", 3.0, at=0.7)      # halfway: 1.5 x the base
    assert c.sensitivities["a"] == pytest.approx(2.0)
    c.set_sensitivity("a", -1.0)
    assert c.sensitivities["a"] == 0.0
    c.set_sensitivity("a", float("nan"))
    assert c.sensitivities["a"] is None


def test_marginal_loss_convex():
    f = lambda a, b: B.marginal_loss(2.0, 0.5, 0.9, a, b)  # noqa: E731
    assert f(0.5, 0.6) < f(0.8, 0.9)
    assert f(0.5, 0.9) == pytest.approx(f(0.5, 0.7) + f(0.7, 0.9))
    assert f(0.5, 0.9) == pytest.approx(2.0 * 0.4 * 1.5)


def test_deadline_arithmetic():
    assert B.step_budget("step_time", 0.02) == 0.02
    # 10 s per epoch, 1 s overhead, 2 s and 20 steps spent of 100.
    assert B.step_budget("epoch_time", 10.0, steps_per_epoch=100,
                         elapsed_epoch=2.0, steps_done_epoch=20,
                         overhead_per_epoch=1.0) == pytest.approx(7.0 / 80)
    # 60 s for 3 epochs x 100 steps; 25 s and 150 steps done (epoch 2 of 3
    # under way): 2 epochs left with 1 s overhead each.
    assert B.step_budget("deadline", 60.0, steps_per_epoch=100, epochs=3,
                         elapsed_total=25.0, steps_done_total=150,
                         overhead_per_epoch=1.0) == pytest.approx(33.0 / 150)
    # spent budget: 0 (the controller then runs at the bounds)
    assert B.step_budget("deadline", 10.0, steps_per_epoch=10, epochs=1,
                         elapsed_total=20.0, steps_done_total=5) == 0.0
    with pytest.raises(ValueError):
        B.step_budget("epoch_time", 1.0)
    with pytest.raises(ValueError):
        B.step_budget("deadline", 1.0, steps_per_epoch=10)
    with pytest.raises(ValueError):
        B.step_budget("hours", 1.0)


# ---------------------------------------------------------------------------
# deadlines: the wall-time plan (tuning/deadline.py) on a fake clock
# ---------------------------------------------------------------------------
def test_wall_time_plan_arithmetic():
    from tf_sparse_split.tuning.deadline import WallTimePlan

    # 100 s for 2 epochs x 10 steps, from clock 0 (on_train_begin).
    p = WallTimePlan("deadline", 100.0, steps_per_epoch=10, epochs=2)
    p.epoch_begin(1.0, 0)
    p.step_begin(1.0)
    # Nothing outside the steps measured yet: the time left over 20 steps.
    assert p.budget(1.0) == pytest.approx(99.0 / 20)
    p.step_end(6.0)              # a slow first step (compilation): 5 s
    p.step_begin(6.5)            # a 0.5 s gap
    # 19 steps left (this one included), 8 gaps left in epoch 1 and 9 in
    # epoch 2, two epoch ends (none measured: 0 s).
    assert p.budget(6.5) == pytest.approx((93.5 - 17 * 0.5) / 19)
    p.expect_epoch_end(2.0)      # e.g. the sensitivity probe
    assert p.budget(6.5) == pytest.approx((93.5 - 17 * 0.5 - 2 * 2.0) / 19)
    assert p.predicted_elapsed(6.5, 1.0) == pytest.approx(
        6.5 + 19 + 17 * 0.5 + 2 * 2.0)
    t = 6.5
    for _ in range(8):           # the rest of epoch 1: 1 s steps, 0.5 gaps
        p.step_end(t + 1.0)
        t += 1.5
        p.step_begin(t)
    p.step_end(t + 1.0)
    p.epoch_end(t + 1.0 + 0.25)  # validation: 0.25 s
    assert p.tail_s == pytest.approx(0.25)
    p.epoch_begin(t + 4.0, 1)
    p.step_begin(t + 4.0)        # boundary: 3 s from the last step's end
    assert p.boundary_s == pytest.approx(3.0)
    assert p.gap_s == pytest.approx(0.5)
    # 10 steps, 9 gaps and one end (the fit's) left.
    left = 100.0 - (t + 4.0)
    assert p.budget(t + 4.0) == pytest.approx((left - 9 * 0.5 - 3.0) / 10)
    # Spent: 0.
    assert p.budget(200.0) == 0.0


def test_wall_time_plan_epoch_time_initial_epoch_and_errors():
    from tf_sparse_split.tuning.deadline import (WallTimePlan,
                                                 median_over_mean)

    p = WallTimePlan("epoch_time", 10.0, steps_per_epoch=5)
    p.epoch_begin(0.0)
    p.step_begin(0.5)
    assert p.budget(0.5) == pytest.approx(9.5 / 5)
    p.step_end(1.5)
    p.step_begin(1.6)
    assert p.budget(1.6) == pytest.approx((10.0 - 1.6 - 3 * 0.1) / 4)
    for i in range(3):
        p.step_end(2.0 + i)
        p.step_begin(2.1 + i)
    p.step_end(5.0)
    p.epoch_end(6.0)             # 1 s after the last step: the tail
    p.epoch_begin(7.0)
    p.step_begin(7.0)
    assert p.budget(7.0) == pytest.approx((10.0 - 0.0 - 4 * p.gap_s - 1.0)
                                          / 5)
    # A fit resumed at initial_epoch=3 of 5: two epochs left.
    d = WallTimePlan("deadline", 50.0, steps_per_epoch=4, epochs=5)
    d.epoch_begin(0.0, 3)
    d.step_begin(0.0)
    assert d.budget(0.0) == pytest.approx(50.0 / 8)
    with pytest.raises(ValueError):
        WallTimePlan("step_time", 1.0, 10, 1)
    with pytest.raises(ValueError):
        WallTimePlan("deadline", 0.0, 10, 1)
    with pytest.raises(ValueError):
        WallTimePlan("deadline", float("nan"), 10, 1)
    with pytest.raises(ValueError):
        WallTimePlan("deadline", 5.0, 10)
    with pytest.raises(ValueError):
        WallTimePlan("epoch_time", 5.0, 0)
    # One 1 s outlier among eight 10 ms steps: clipped at 0.5.
    assert median_over_mean([0.01] * 7 + [1.0]) == 0.5
    assert median_over_mean([0.01] * 5) == 1.0          # too few
    times = [0.01] * 10 + [0.02] * 2
    assert median_over_mean(times) == pytest.approx(0.01 / np.mean(times))


def _simulate_fit(deadline, spe=60, epochs=5, compile_s=2.0, calib=(5, 0.05),
                  head=0.3, gap=0.0015, tail=0.1, probe_s=0.2, warmup=20,
                  seed=0, max_sparsity=0.95):
    """A fit on a fake clock: a first step with the compilation
    (``compile_s``), ``calib`` = (steps, extra seconds each) of
    calibration after it, ``warmup`` steps at the natural sparsity, gaps
    between steps (twice as long every 4th, the statistics reads), an
    epoch end with validation (``tail``) and a sensitivity probe
    (``probe_s``); the controller and the plan as TimeBudgetCallback
    wires them. Returns ``(end clock, controller, plan, checks)``, checks
    = ``(predicted elapsed at the fastest allocation, decision)`` per
    decision."""
    from tf_sparse_split.tuning.deadline import (WallTimePlan,
                                                 median_over_mean)

    c, plant, cur = _setup(max_sparsity=max_sparsity)
    plant.rng = np.random.default_rng(seed)
    plan = WallTimePlan("deadline", deadline, spe, epochs, start=0.0)
    t, step, recent, checks = head, 0, [], []
    for e in range(epochs):
        plan.epoch_begin(t, e)
        for i in range(spe):
            if i:
                t += gap * (2 if step % 4 == 0 else 1)
            plan.step_begin(t)
            b = plan.budget(t) * median_over_mean(recent[-32:])
            st = plant.step(cur)
            t += st + (compile_s if step == 0 else
                       calib[1] if step <= calib[0] else 0.0)
            plan.step_end(t)
            step += 1
            if step == 1:
                continue
            recent.append(st)
            if step <= warmup:
                continue
            c.observe_step(st)
            for n in cur:
                c.set_actual(n, cur[n])
            logged = len(c.log)
            new = c.decide(b if b > 0 else 1e-12)
            if len(c.log) > logged:
                d = c.log[-1]
                best = d.best_s if np.isfinite(d.best_s) else d.measured_s
                checks.append((plan.predicted_elapsed(
                    t, best / median_over_mean(recent[-32:])), d))
            if new:
                cur = new
        t += tail
        plan.epoch_end(t)
        t += probe_s
        plan.expect_epoch_end(probe_s)
    return t, c, plan, checks


def _fit_bounds(**kw):
    """Wall seconds of the simulated fit at a budget that keeps the natural
    sparsity and at one that runs at the bounds."""
    natural, _, _, _ = _simulate_fit(1e6, **kw)
    fastest, _, _, _ = _simulate_fit(1e-3, **kw)
    return natural, fastest


@pytest.mark.parametrize("compile_s,calib", [(2.0, (5, 0.05)),
                                             (6.0, (20, 0.1))])
@pytest.mark.parametrize("where", [0.25, 0.5, 0.75])
def test_deadline_met_within_5_percent_with_a_slow_first_epoch(
        compile_s, calib, where):
    """A reachable deadline (between the fit at the bounds and at the
    natural sparsity) is met within 5% either way, also when the first
    epoch's compilation and calibration take a third of it."""
    natural, fastest = _fit_bounds(compile_s=compile_s, calib=calib)
    assert fastest < 0.7 * natural
    deadline = fastest + where * (natural - fastest)
    for seed in range(2):
        end, c, _, checks = _simulate_fit(deadline, compile_s=compile_s,
                                          calib=calib, seed=seed)
        assert 0.95 <= end / deadline <= 1.05, (end, deadline)
        # Reachable at every decision after the first epoch, and then
        # predicted to end in time.
        later = [(p, d) for p, d in checks if d.step > 60]
        assert later and all(d.reachable for _, d in later)
        assert all(p <= deadline * 1.03 for p, _ in later)


def test_unreachable_deadline_is_reported_and_runs_at_the_bounds():
    natural, fastest = _fit_bounds()
    deadline = 0.85 * fastest
    end, c, plan, checks = _simulate_fit(deadline)
    # Found unreachable in the first epoch (once the step model has seen
    # the bounds' effect), then at every decision predicted (at the
    # fastest allocation) to end late, and within a few percent of where
    # it did end.
    assert any(not d.reachable for _, d in checks if d.step <= 60)
    later = [(p, d) for p, d in checks if d.step > 60]
    assert later and all(not d.reachable and p > deadline
                         for p, d in later)
    assert abs(checks[-1][0] - end) / end < 0.05
    assert all(abs(v - 0.95) < 1e-9 for v in c.targets.values())
    assert end == pytest.approx(fastest, rel=0.05)
    assert plan.budget(end) == 0.0


def test_generous_deadline_keeps_the_natural_sparsity():
    natural, _ = _fit_bounds()
    end, c, _, _ = _simulate_fit(1.2 * natural)
    assert c.targets == {"a": 0.5, "b": 0.5}
    assert end == pytest.approx(natural, rel=0.02)


def test_compacting_rate_shrinks_the_dense_part():
    """A channel dropout in front of a layer whose dense path wins: its
    rate is predicted to save time only through the compaction of the
    dropped channels (RateKnob.compacts)."""
    cost = _cost(sparse_rate=1e9)          # the sparse path never wins
    model = B.StepModel()
    model.observe(cost.seconds(0.5), 3 * cost.seconds(0.5) + 0.004)
    for compacts, saves in ((False, False), (True, True)):
        knob = B.RateKnob(floor=0.0, upper=0.5, layer="a", compacts=compacts)
        alloc = B.allocate({"a": cost}, {"a": 0.5}, {"a": 1.0}, 0.95,
                           0.5 * (3 * cost.seconds(0.5) + 0.004), model,
                           rates={"d": knob})
        assert (alloc.rates["d"] > 0) == saves
    assert cost.dense_seconds(0.5) < cost.dense_seconds()
    assert cost.dense_seconds(10.0) == cost.dense_seconds()   # at most k
    # The fixed term scales with the live columns, as the op's model does.
    flops = cost.m * 0.5 * cost.k * cost.dense_flops_per_elem
    assert cost.dense_seconds(0.5) == pytest.approx(
        0.5 * cost.dense_fixed_s + flops / cost.dense_rate, rel=1e-12)
    c = B.BudgetController(["a"], rates={"d": B.RateKnob(
        floor=0.2, upper=0.5, layer="a", compacts=True)})
    c.rates["d"] = 0.4
    c.set_cost("a", cost)
    assert c.rate_knobs["d"].measured_at == 0.4


@pytest.mark.parametrize("kwargs", [
    {}, {"step_time": 0.1, "epoch_time": 2.0},
    {"step_time": 0.0}, {"step_time": -1.0}, {"step_time": float("nan")},
    {"deadline": float("inf")}, {"epoch_time": "soon"},
    {"step_time": True},
    {"step_time": 0.1, "max_sparsity": 1.0},
    {"step_time": 0.1, "max_sparsity": -0.1},
    {"step_time": 0.1, "min_rate": 0.5, "max_rate": 0.4},
    {"step_time": 0.1, "max_rate": 1.0},
    {"step_time": 0.1, "min_rate": float("nan")},
])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        B.validate_budget_args(**kwargs)


def test_validate_returns_kind():
    assert B.validate_budget_args(epoch_time=3) == ("epoch_time", 3.0)


def test_controller_bad_arguments():
    with pytest.raises(ValueError):
        B.BudgetController([])
    with pytest.raises(ValueError):
        B.BudgetController(["a"], max_sparsity=1.5)
    with pytest.raises(ValueError):
        B.BudgetController(["a"], min_samples=10, window=5)
    for bad in (0, 1.5, True, "4"):
        with pytest.raises(ValueError, match="recheck"):
            B.BudgetController(["a"], recheck=bad)
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="bound_gain"):
            B.BudgetController(["a"], bound_gain=bad)
    for bad in (-0.1, 2.5, float("nan"), True, "x"):
        with pytest.raises(ValueError, match="aim"):
            B.BudgetController(["a"], aim=bad)
    for bad in (0.0, -0.01, 0.6):
        with pytest.raises(ValueError, match="fine_step"):
            B.BudgetController(["a"], fine_step=bad)
    with pytest.raises(ValueError):
        B.robust_step_time([])


def test_layers_that_buy_time():
    c, plant, cur = _setup()
    # Both layers' sparse paths win at high sparsity: both buy time (at a
    # least gain of 1% of a 20 ms step).
    assert c.layers_that_buy_time(0.02) == ["a", "b"]
    # A sparse path 100x slower never wins: that layer buys nothing.
    c.set_cost("b", _cost(n=1024, sparse_rate=1e9))
    assert c.layers_that_buy_time(0.02) == ["a"]
    # A least gain larger than any saving: none.
    c.min_gain = 0.49
    assert c.layers_that_buy_time(10.0) == []


def test_unchanged_settings_are_rechecked_every_few_steps():
    """After a decision that changes nothing (a hold in the dead band),
    the next one waits for ``recheck`` new steps, not one."""
    c, plant, cur = _setup()
    c.recheck = 4
    for _ in range(c.settle + c.min_samples):
        c.observe_step(0.05)
    assert c.decide(0.05) is None and len(c.log) == 1
    assert c.log[-1].action == "hold"
    steps = []
    for i in range(12):
        c.observe_step(0.05)
        c.decide(0.05)
        steps.append(len(c.log))
    assert steps == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    # Steps far over the budget are still acted on, once the median of
    # the recent ones has moved (robust: a few slow steps do not move it).
    acted = []
    for _ in range(12):
        c.observe_step(0.2)
        acted.append(c.decide(0.05) is not None)
    assert any(acted) and not any(acted[:3])


def test_waits_for_samples_and_ignores_bad_times():
    c, plant, cur = _setup()
    for _ in range(c.settle + c.min_samples - 1):
        c.observe_step(0.05)
    c.observe_step(float("nan"))
    c.observe_step(-1.0)
    assert c.decide(0.01) is None and not c.log
    c.observe_step(0.05)
    assert c.decide(0.01) is not None


def _first_step_back(c, t_end, level, tol=0.05):
    """The first step after ``t_end`` whose decision's summed targets are
    within ``tol`` of ``level``."""
    for d in c.log:
        if d.step > t_end and sum(d.targets.values()) <= level + tol:
            return d.step
    return None


@pytest.mark.parametrize("kind", ["slower", "added", "unreachable"])
def test_load_on_then_off_lowers_sparsity_within_bounded_steps(kind):
    """Load for a stretch (every step 1.6x slower; or a fixed 40% of the
    budget added to every step, which the step model's fixed part absorbs
    while it lasts; or 5x slower, which no allowed sparsity can meet: the
    targets then sit at their bounds, over the budget, the case of the
    shared machine), then off: the targets rise under the load and come
    back down within 100 steps of its end, and the budget is held within
    10% before and after (and during, where it is reachable)."""
    c, plant, cur = _setup()
    plant.outliers = 0.0
    budget = 0.7 * _plain(plant)
    on, off = 200, 400

    class Loaded:
        def step(self, sp, speed):
            t = plant.step(sp)
            if on <= speed < off:
                t = (t + 0.4 * budget if kind == "added" else
                     t * (5.0 if kind == "unreachable" else 1.6))
            return t

    cur, m1 = _run(c, Loaded(), cur, budget, on, lambda t: t, 0)
    level = sum(cur.values())
    cur, m2 = _run(c, Loaded(), cur, budget, off - on, lambda t: t, on)
    during = max(sum(d.targets.values()) for d in c.log
                 if on < d.step <= off)
    cur, m3 = _run(c, Loaded(), cur, budget, 200, lambda t: t, off)
    assert during > level + 0.1                      # raised under load
    # ... and lowered after, to the level before or one a little above it
    # (falls stop at the first median inside the dead band, rises at the
    # band's middle).
    back = _first_step_back(c, off, level, tol=0.1)
    assert back is not None and back - off <= 100
    # The steps' 9-step running median within 10% of the budget again
    # within 100 steps of the load's end.
    run = [np.median(m3[max(0, i - 8):i + 1]) for i in range(len(m3))]
    assert any(abs(r / budget - 1) <= 0.10 for r in run[4:100])
    # ... to stay there (a noisy median may ask for one more grid step).
    assert all(sum(d.targets.values()) <= level + 0.1 + 1e-9
               for d in c.log if d.step >= back)
    if kind == "unreachable":
        assert any(not d.reachable for d in c.log if on < d.step <= off)
        assert all(abs(v - c.max_sparsity) < 1e-9 for v in
                   [d for d in c.log if d.step <= off][-1].targets.values())
        # The step model forgot the loaded window at the level shift: the
        # first change after the load is predicted at the new level.
        first = [d for d in c.log if d.step > off and
                 d.action != "unreachable"][0]
        assert 0.75 <= first.kappa <= 1.33
    for m in (m1[100:], m3[100:]) + ((m2[100:],) if kind != "unreachable"
                                     else ()):
        assert abs(np.median(m) / budget - 1) <= 0.10


def test_allocation_trims_an_overshoot():
    # One layer whose gain starts only past the op's break-even: the greedy
    # jump past it can overshoot; the trimming pass lowers the target to
    # the lowest level that still meets the goal.
    costs = {"a": _cost()}
    model = B.StepModel()
    x0 = costs["a"].seconds(0.3)
    model.observe(x0, 0.004 + 3 * x0)
    goal = 0.9 * model.predict(x0)
    al = B.allocate(costs, {"a": 0.3}, {"a": 1.0}, 0.95, goal, model)
    assert al.reachable
    lower = al.targets["a"] - 0.05
    assert model.predict(costs["a"].seconds(lower)) > goal


def test_min_gain_spends_no_sparsity_on_a_negligible_saving():
    # Over the budget and unreachable, but the layer's predicted saving at
    # the bound is 0.1% of the step: it stays at its natural sparsity.
    c = B.BudgetController(["a"], max_sparsity=0.9, min_samples=4, settle=0)
    c.set_cost("a", _cost(m=4, k=64, n=16))
    c.set_floor("a", 0.5)
    c.set_sensitivity("a", 1.0)
    for _ in range(4):
        c.observe_step(0.05)
    c.decide(0.01)
    assert c.targets["a"] == pytest.approx(0.5)
    assert not c.log[-1].reachable
    assert "less than" in c.log[-1].reasons["a"]


def test_combined_and_activation_sparsity():
    assert B.combined_sparsity(0.5, [0.2]) == pytest.approx(0.6)
    assert B.combined_sparsity(0.5) == pytest.approx(0.5)
    assert B.activation_sparsity(0.6, [0.2]) == pytest.approx(0.5)
    assert B.activation_sparsity(0.1, [0.5]) == 0.0


def test_dropout_rate_is_the_second_tier():
    # A dropout in front of "a": its rate rises only once the activations
    # are at their bound and the budget is still not met, and it is the
    # first to come back down when the machine is fast again.
    c, plant, cur = _setup(max_sparsity=0.8)
    c.rate_knobs["drop"] = B.RateKnob(floor=0.1, upper=0.6, layer="a")
    c.rates = {"drop": 0.1}
    budget = 0.55 * _plain(plant)
    slow = lambda t: 1.4 if t < 300 else 0.8  # noqa: E731
    rates = []
    for t in range(500):
        eff = {n: B.combined_sparsity(cur[n], [c.rates["drop"]] if n == "a"
                                      else []) for n in cur}
        st = plant.step(eff, slow(t))
        c.observe_step(st)
        for n in cur:
            c.set_actual(n, cur[n])
        new = c.decide(budget)
        if new:
            cur = new
            before = {n: v for n, v in c.log[-1].targets.items()}
            if c.rates["drop"] > 0.1 + 1e-9:
                # raised only with every activation at its bound
                assert all(v >= 0.8 - 1e-9 for v in before.values())
        rates.append(c.rates["drop"])
    assert max(rates[:300]) > 0.1 + 1e-9
    assert all(0.1 - 1e-9 <= r <= 0.6 + 1e-9 for r in rates)
    assert rates[-1] == pytest.approx(0.1)


def test_rate_cost_from_two_rates():
    kept = lambda r: (1 - r) ** 0.5  # noqa: E731
    rc = B.RateCost.from_two_rates(kept, 0.2, 0.030, 0.6, 0.022)
    assert rc.predicts
    assert rc.seconds(0.2) - rc.seconds(0.6) == pytest.approx(0.008)
    # slower with less work: no slope (no prediction)
    assert not B.RateCost.from_two_rates(kept, 0.2, 0.02, 0.6, 0.03).predicts
    assert not B.RateCost.from_two_rates(kept, 0.3, 0.02, 0.3, 0.03).predicts


def test_lstm_rate_under_load_and_after():
    """A model whose only knob is an LSTM's recurrent rate (no op
    statistics: a RateCost measured at two rates): raised within its
    bounds under load to hold the budget, lowered when the load ends."""
    kept = lambda r: (1 - r) ** 0.5  # noqa: E731
    rng = np.random.default_rng(3)

    def step(rate, loaded):
        t = 0.010 + 0.030 * kept(rate)
        t *= 1.3 if loaded else 1.0
        return t * (1 + 0.03 * rng.standard_normal())

    rc = B.RateCost.from_two_rates(kept, 0.2, step(0.2, False), 0.5,
                                   step(0.5, False))
    c = B.BudgetController([], rates={"lstm/recurrent_dropout": B.RateKnob(
        floor=0.2, upper=0.7, cost=rc)})
    budget = 1.02 * (0.010 + 0.030 * kept(0.2))
    name = "lstm/recurrent_dropout"
    seen = []
    for t in range(600):
        loaded = 150 <= t < 350
        c.observe_step(step(c.rates[name], loaded))
        c.decide(budget)
        seen.append((t, c.rates[name]))
    during = [r for t, r in seen if 250 <= t < 350]
    after = [r for t, r in seen if t >= 450]
    assert min(during) > 0.3 and max(during) <= 0.7 + 1e-9
    assert max(after) <= 0.25
    assert all(0.2 - 1e-9 <= r <= 0.7 + 1e-9 for _, r in seen)


# ---------------------------------------------------------------------------
# wiring: a short real fit (nothing timed is asserted)
# ---------------------------------------------------------------------------
class FakeClock:
    """Advances by ``seconds`` at every call: the callback reads it once at
    a step's begin and once at its end, so every step measures
    ``seconds``."""

    def __init__(self, seconds):
        self.t = 0.0
        self.seconds = seconds

    def __call__(self):
        self.t += self.seconds
        return self.t


def _mlp(dropout=False):
    import keras

    from tf_sparse_split.layers import ApproximateRandomDropout, \
        SparseSplitDense

    layers = [keras.Input((32,)), keras.layers.Dense(64, activation="relu",
                                                     name="h1")]
    if dropout:
        layers.append(ApproximateRandomDropout(0.2, seed=1, name="drop1"))
    layers += [SparseSplitDense(64, activation="relu", name="h2"),
               SparseSplitDense(10, activation="softmax", name="out")]
    model = keras.Sequential(layers)
    model.compile("adam", "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def test_fit_wiring_log_keys_and_bounds(tmp_path):
    import keras

    import tf_sparse_split as tfss

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 32)).astype("float32")
    y = rng.integers(0, 10, 256)
    model = _mlp(dropout=True)
    # A fake clock that says every step takes 10 ms against a 1 ms budget:
    # the controller must raise the targets, and never past the bounds.
    # (min_gain=0: the fake step is 10 ms, the toy layers' ops take
    # microseconds; every predicted saving counts.)
    cb = tfss.TimeBudgetCallback(step_time=0.001, max_sparsity=0.8,
                                 max_rate=0.4, warmup_steps=4, min_samples=3,
                                 min_gain=0.0,
                                 sensitivity_data=(x[:64], y[:64]),
                                 log_dir=str(tmp_path / "tb"),
                                 clock=FakeClock(0.01))
    functions = []

    class Functions(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            functions.append(id(self.model.train_function))

    hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                     callbacks=[cb, Functions()])
    import tensorflow as tf

    # The dropout rate moved between steps (not only at epoch ends), and
    # nothing was retraced for it.
    trace = cb.trace
    changes = [b["step"] for a, b in zip(trace, trace[1:])
               if a["rates"] != b["rates"]]
    # Whether the rate moves depends on the ops' measured seconds (real
    # timings); where it moved, it moved between steps, without a retrace.
    if changes:
        assert any(st % 16 != 1 for st in changes)
    assert len(set(functions)) == 1
    tags = {v.tag for f in (tmp_path / "tb").iterdir()
            for e in tf.compat.v1.train.summary_iterator(str(f))
            for v in e.summary.value}
    assert {"budget/step_budget", "budget/step_time", "h2/budget_target",
            "drop1/budget_rate"} <= tags
    keys = set(hist.history)
    for k in ("budget/step_budget", "budget/step_time", "budget/reachable",
              "h2/budget_target", "h2/budget_sparsity", "out/budget_target",
              "drop1/budget_rate"):
        assert k in keys, k
    assert hist.history["budget/step_budget"][0] == pytest.approx(0.001)
    assert hist.history["budget/step_time"][0] == pytest.approx(0.01)
    assert cb.decisions and not cb.decisions[-1].reachable
    for entry in cb.trace:
        assert all(0 <= v <= 0.8 + 1e-9 for v in entry["targets"].values())
        assert all(0 <= v <= 0.4 + 1e-9 for v in entry["rates"].values())
    assert max(cb.trace[-1]["targets"].values()) > 0.0
    # The FATReLUs' own targets (the controller's plus the correction for
    # the cutoff's shortfall) never pass max_sparsity either.
    assert cb._settings_trace
    for _, reads in cb._settings_trace:
        assert all(0.0 <= t <= 0.8 + 1e-9 for _, t in reads.values())
    for k in cb._knobs:
        assert 0.0 <= k.fat.target <= 0.8 + 1e-9
    # ... also when the cutoff has fallen short of a target near the bound
    # (a large correction).
    k = cb._knobs[0]
    k.offset = 0.3
    cb._set_fat(k, 0.75)
    assert k.fat.target == pytest.approx(0.8)
    # A further fit with the same callback starts afresh from the user's
    # dropout rate (0.2), within the bounds again.
    hist = model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                     callbacks=[cb])
    assert "h2/budget_target" in hist.history
    assert cb.trace and cb.trace[0]["rates"] == {"drop1": pytest.approx(0.2)}


def test_callback_rejects_bad_arguments_and_unknown_steps():
    import tf_sparse_split as tfss

    with pytest.raises(ValueError):
        tfss.TimeBudgetCallback()
    with pytest.raises(ValueError):
        tfss.TimeBudgetCallback(step_time=1, deadline=2)
    with pytest.raises(ValueError):
        tfss.TimeBudgetCallback(step_time=1, layers="h2")
    with pytest.raises(ValueError):
        tfss.TimeBudgetCallback(step_time=1, warmup_steps=1)
    with pytest.raises(ValueError):
        tfss.TimeBudgetCallback(step_time=1, sensitivity_data=[1, 2, 3])
    with pytest.raises(ValueError):
        tfss.TimeBudgetCallback(step_time=1, gain=float("nan"))
    with pytest.raises(ValueError):
        tfss.TimeBudgetCallback(step_time=1, min_gain=0.5)
    for bad in (1.0, -0.01, True, "x"):
        with pytest.raises(ValueError, match="bound_gain"):
            tfss.TimeBudgetCallback(step_time=1, bound_gain=bad)
    with pytest.raises(ValueError):
        tfss.TimeBudgetCallback(step_time=1, probe_steps=1)
    model = _mlp()
    cb = tfss.TimeBudgetCallback(step_time=1, layers=["nope"])
    x = np.zeros((8, 32), "float32")
    with pytest.raises(ValueError, match="not a sparse-split layer"):
        model.fit(x, np.zeros(8), epochs=1, verbose=0, callbacks=[cb])


def test_epoch_budget_in_fit_and_unknown_steps():
    import tensorflow as tf

    import tf_sparse_split as tfss

    rng = np.random.default_rng(1)
    x = rng.standard_normal((128, 32)).astype("float32")
    y = rng.integers(0, 10, 128)
    model = _mlp()
    cb = tfss.TimeBudgetCallback(epoch_time=5.0, warmup_steps=2,
                                 min_samples=2, clock=FakeClock(0.01))
    hist = model.fit(x, y, batch_size=16, epochs=1, verbose=0,
                     callbacks=[cb])
    assert hist.history["budget/step_budget"][0] > 5.0 / 8
    # 8 steps per epoch in 5 s, each step measured at 10 ms: the time left
    # over the steps left, which grows as the fast steps leave slack.
    budgets = [t["budget_s"] for t in cb.trace]
    assert budgets and all(b > 5.0 / 8 for b in budgets)
    assert all(a < b for a, b in zip(budgets, budgets[1:]))
    last = cb.trace[-1]
    assert last["budget_s"] < 5.0 / (8 - last["step"] + 1) + 1e-12

    def gen():
        for i in range(4):
            yield x[i * 16:(i + 1) * 16], y[i * 16:(i + 1) * 16]

    ds = tf.data.Dataset.from_generator(gen, output_signature=(
        tf.TensorSpec((None, 32), tf.float32),
        tf.TensorSpec((None,), tf.int64)))
    cb = tfss.TimeBudgetCallback(deadline=10.0)
    with pytest.raises(ValueError, match="steps per epoch"):
        _mlp().fit(ds, epochs=1, verbose=0, callbacks=[cb])


class RateClock:
    """A fake clock whose steps take ``fixed + work * kept(rate)`` seconds
    (times ``load`` while ``loaded()``), ``rate`` read from the layer when
    the step ends: the plant of an LSTM whose own loop shrinks with
    its recurrent dropout. Every call advances it by a step, so the
    interval the callback measures (from the read at a step's begin to the
    one at its end) is one step."""

    def __init__(self, lstm, fixed=0.004, work=0.012, load=1.5):
        self.lstm, self.fixed, self.work, self.load = lstm, fixed, work, load
        self.t, self.calls, self.loaded = 0.0, 0, (lambda: False)

    def step_s(self):
        kept = (1 - self.lstm.cell.recurrent_dropout) ** \
            self.lstm.cell.recurrent_group_share
        s = self.fixed + self.work * kept
        return s * (self.load if self.loaded() else 1.0)

    def __call__(self):
        self.calls += 1
        self.t += self.step_s()
        return self.t


def test_fit_controls_an_lstm_rate_measured_by_its_probe():
    import keras

    import tf_sparse_split as tfss

    rng = np.random.default_rng(2)
    x = rng.standard_normal((192, 5, 4)).astype("float32")
    y = rng.integers(0, 3, 192)
    model = keras.Sequential([
        keras.Input((5, 4)),
        tfss.SparseSplitLSTM(16, recurrent_dropout=0.2, seed=1,
                             recurrent_group_share=1.0, name="lstm"),
        keras.layers.Dense(3, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    lstm = model.get_layer("lstm")
    clock = RateClock(lstm)
    cb = tfss.TimeBudgetCallback(step_time=0.0125, max_rate=0.6,
                                 warmup_steps=4, probe_steps=4,
                                 min_samples=4, clock=clock)
    steps = {"n": 0}

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps["n"] += 1

    clock.loaded = lambda: 40 <= steps["n"] < 70
    hist = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                     callbacks=[Count(), cb])
    name = "lstm/recurrent_dropout"
    assert name in cb.controller.rate_knobs
    # the probe measured the slope: fixed + work * kept at two rates
    assert cb.controller.rate_knobs[name].cost.slope_s == \
        pytest.approx(0.012, rel=0.05)
    rates = [t["rates"][name] for t in cb.trace]
    assert all(0.2 - 1e-9 <= r <= 0.6 + 1e-9 for r in rates)
    # 0.0125 s needs kept <= 0.708 (rate >= 0.29): raised from 0.2 ...
    quiet = [t for t in cb.trace if t["step"] < 40]
    assert quiet[-1]["rates"][name] > 0.25
    assert max(rates) == pytest.approx(0.6)         # ... to the bound under
    after = [t["rates"][name] for t in cb.trace if t["step"] > 90]
    assert after and after[-1] < 0.45               # load, back after it
    assert f"{name}/budget_rate" in hist.history


class CompileClock(FakeClock):
    """FakeClock whose first training step also takes ``compile_s`` (the
    tracing and the ops' calibration): a callback placed before
    TimeBudgetCallback advances it at the first step's end."""

    def __init__(self, seconds, compile_s):
        super().__init__(seconds)
        self.compile_s = compile_s

    def callback(self):
        import keras

        clock = self

        class _Compile(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if clock.compile_s:
                    clock.t += clock.compile_s
                    clock.compile_s = 0.0

        return _Compile()


@pytest.mark.parametrize("deadline, reachable", [(1.5, True), (0.9, False)])
def test_fit_deadline_counts_the_first_step_and_logs_unreachable(
        deadline, reachable):
    import tf_sparse_split as tfss

    rng = np.random.default_rng(3)
    x = rng.standard_normal((128, 32)).astype("float32")
    y = rng.integers(0, 10, 128)
    # 8 steps per epoch, 2 epochs; every clock read advances 10 ms (a step
    # measures 10 ms, the gap to the next one 10 ms), the first step 1 s
    # more.
    clock = CompileClock(0.01, 1.0)
    cb = tfss.TimeBudgetCallback(deadline=deadline, warmup_steps=2,
                                 min_samples=2, min_gain=0.0, clock=clock)
    hist = _mlp().fit(x, y, batch_size=16, epochs=2, verbose=0,
                      callbacks=[clock.callback(), cb])
    budgets = [t["budget_s"] for t in cb.trace]
    assert len(budgets) == 14          # steps after the warm-up
    # The third step's budget: what is left of the deadline after the 1 s
    # first step and two 10 ms steps with their reads (clock at
    # on_train_begin, epoch begin, ...) over the 14 steps left, less the
    # 13 gaps (10 ms, measured) before them.
    first = cb.trace[0]
    spent = 1.0 + 0.01 * 7             # 7 reads up to the third step's begin
    assert first["budget_s"] == pytest.approx(
        max((deadline - spent - 13 * 0.01) / 14, 0.0), abs=2e-3)
    assert cb.elapsed_s == pytest.approx(clock.t - cb._t_begin, abs=0.011)
    for key in ("budget/deadline_reachable", "budget/predicted_end_s"):
        assert key in hist.history
    if reachable:
        # ~0.45 s for 14 steps of 10 ms and 13 gaps of 10 ms: slack, and
        # the budget grows as the fast steps leave it.
        assert all(b > 0.01 for b in budgets)
        assert not cb.deadline_log
        assert hist.history["budget/deadline_reachable"] == [1.0, 1.0]
        assert cb.elapsed_s < deadline
        # No sparsity spent: every target at its natural level.
        assert cb.controller.targets == cb.controller.floors
    else:
        # Spent by the first step: budget 0, logged as unreachable once,
        # with its predicted end, and the targets at the bounds' side.
        assert all(b == 0.0 for b in budgets)
        (step, ok, end, msg), = cb.deadline_log
        assert not ok and end > deadline
        assert "not reachable within max_sparsity=0.95" in msg
        assert hist.history["budget/deadline_reachable"][-1] == 0.0
        assert hist.history["budget/predicted_end_s"][0] > deadline
        assert max(cb.controller.targets.values()) > 0.0


def _cnn_with_channel_dropout():
    import keras

    import tf_sparse_split as tfss

    model = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu",
                            name="c1"),
        tfss.SensitivityAwareDropout(0.125, seed=3, name="sad"),
        tfss.SparseSplitConv2D(8, 3, padding="same", activation="relu",
                               name="c2"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(3, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def test_fit_moves_a_channel_dropout_rate_without_retracing():
    import keras

    import tf_sparse_split as tfss

    rng = np.random.default_rng(4)
    x = rng.standard_normal((96, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, 96)
    model = _cnn_with_channel_dropout()
    # 10 ms measured against a 1 ms budget: unreachable, the activation
    # target goes to its bound and then the channel rate rises (second
    # tier), within [its floor 0.125, max_rate 0.5].
    cb = tfss.TimeBudgetCallback(step_time=0.001, max_sparsity=0.8,
                                 max_rate=0.5, warmup_steps=4, min_samples=3,
                                 min_gain=0.0, clock=FakeClock(0.01))
    functions = []

    class Functions(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            functions.append(id(self.model.train_function))

    hist = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                     callbacks=[cb, Functions()])
    sad = model.get_layer("sad")
    knob = cb.controller.rate_knobs["sad"]
    assert knob.layer == "c2" and knob.compacts
    rates = [t["rates"]["sad"] for t in cb.trace]
    assert all(0.125 - 1e-9 <= r <= 0.5 + 1e-9 for r in rates)
    assert max(rates) > 0.125 + 0.05
    assert sad.num_drop == round(sad.rate * 16)
    assert len(set(functions)) == 1          # moved without a retrace
    assert "sad/budget_rate" in hist.history
    # The zeros the layer measured include the dropped channels: the
    # activation's share is taken out with the realized rate.
    assert cb._knobs[0].dropouts == [sad]


def test_deadline_reachable_again_is_announced_only_once_it_holds():
    """Becoming unreachable is logged at once; reachable again only after
    DEADLINE_HOLD decisions in a row, so a predicted end hovering at the
    deadline does not flip the message every few steps."""
    import types

    import tf_sparse_split as tfss
    from tf_sparse_split.callbacks import time_budget as tb

    cb = tfss.TimeBudgetCallback(deadline=10.0, verbose=0)

    class Plan:
        def predicted_elapsed(self, now, step_s, *lag):
            return 10.0 + step_s

    cb._plan, cb._skew = Plan(), lambda: 1.0
    cb._recent, cb._lag_steps = [], 0
    cb._deadline_ok, cb._deadline_flips, cb.deadline_log = True, 0, []
    cb._step, cb._epoch = 0, 0
    hold = tb.DEADLINE_HOLD
    pattern = ([True] * 5 + [False] + [True] * (hold - 1) + [False]
               + [True] * 4 + [False] * 2 + [True] * hold + [True] * 5)
    for ok in pattern:
        cb._step += 1
        cb._check_deadline(types.SimpleNamespace(
            reachable=ok, best_s=0.02, measured_s=0.02), 0.0)
    assert [entry[1] for entry in cb.deadline_log] == [False, True]
    assert cb.deadline_log[0][0] == 6
    assert cb.deadline_log[1][0] == len(pattern) - 5
    assert "reachable again" in cb.deadline_log[1][3]
    assert cb._deadline_ok


def _at_natural(budget_frac=0.4):
    """A controller at the natural sparsity after enough steps, and the
    budget it is asked to meet (a fraction of the measured step)."""
    c, plant, cur = _setup()
    plant.noise = plant.outliers = 0.0
    for _ in range(12):
        c.observe_step(plant.step(cur))
    return c, plant, budget_frac * plant.step(cur)


def test_jump_moves_from_the_natural_sparsity_to_the_allocation_at_once():
    c, _, budget = _at_natural()
    assert c.at_floors
    new = c.decide(budget)
    assert max(v - 0.5 for v in new.values()) <= c.max_change + 1e-9
    c2, _, budget = _at_natural()
    new2 = c2.decide(budget, jump=True)
    assert max(v - 0.5 for v in new2.values()) > c2.max_change + 0.1
    assert not c2.at_floors
    # The targets where the allocation aimed (unreachable: the bounds of
    # the layers that buy time).
    assert new2 == pytest.approx(c2.log[-1].targets)


def test_falls_are_judged_on_the_cautious_budget():
    c, plant, _ = _at_natural()
    top = {n: 0.95 for n in c.layers}
    c.targets = dict(top)
    c._times = []
    for _ in range(12):
        c.observe_step(plant.step(top))
    m = plant.step(top)
    # Far under the plain budget, within the dead band of the cautious
    # one: held.
    assert c.decide(2 * m, fall_budget_s=1.02 * m) is None
    assert c.log[-1].action == "hold"
    assert "cautious" in next(iter(c.log[-1].reasons.values()))
    assert c.targets == top
    # Under the cautious budget too: the targets fall, as far as that
    # budget allows and no further than the plain one would have them.
    c2, plant, _ = _at_natural()
    c2.targets = dict(top)
    for _ in range(12):
        c2.observe_step(m)
    c3, _, _ = _at_natural()
    # (Its falls unlimited: the allocations are compared, not the limit
    # on a plain budget's fall per decision.)
    c3.max_change = 1.0
    c3.targets = dict(top)
    for _ in range(12):
        c3.observe_step(m)
    cautious = c2.decide(2 * m, fall_budget_s=1.3 * m)
    plain = c3.decide(2 * m)
    assert cautious is not None and plain is not None
    assert all(plain[n] <= cautious[n] + 1e-9 <= top[n] + 2e-9
               for n in top)
    assert sum(plain.values()) < sum(cautious.values()) < sum(top.values())


def test_deadline_verdict_counts_the_fastest_allocation_end():
    """An allocation that misses the dead band's aim (``reachable`` False)
    while the fastest allocation still ends before the deadline is not
    announced as unreachable; one that ends after it is."""
    import types

    import tf_sparse_split as tfss

    cb = tfss.TimeBudgetCallback(deadline=10.0, verbose=0)

    class Plan:
        def predicted_elapsed(self, now, step_s, *lag):
            return 9.0 + 100 * step_s

    cb._plan, cb._skew = Plan(), lambda: 1.0
    cb._deadline_ok, cb._deadline_flips, cb.deadline_log = True, 0, []
    cb._step, cb._epoch = 1, 0
    cb._recent, cb._lag_steps = [], 0
    cb._check_deadline(types.SimpleNamespace(
        reachable=False, best_s=0.009, measured_s=0.02), 0.0)
    assert cb._deadline_ok and not cb.deadline_log      # ends at 9.9 s
    cb._check_deadline(types.SimpleNamespace(
        reachable=False, best_s=0.011, measured_s=0.02), 0.0)
    assert not cb._deadline_ok                          # ends at 10.1 s
    assert cb.deadline_log[-1][2] == pytest.approx(10.1)


class PhaseClock(FakeClock):
    """A FakeClock whose reads advance ``slow`` seconds from training step
    ``slow_from`` on (counted by :meth:`callback`, placed before the
    TimeBudgetCallback), ``seconds`` before it."""

    def __init__(self, seconds, slow, slow_from):
        super().__init__(seconds)
        self.fast, self.slow, self.slow_from = seconds, slow, slow_from
        self.steps = 0

    def callback(self):
        import keras

        clock = self

        class _Count(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                clock.steps += 1
                clock.seconds = (clock.slow if clock.steps >= clock.slow_from
                                 else clock.fast)

        return _Count()


@pytest.mark.parametrize("final_settings", ["last_epoch", "last"])
def test_a_burst_in_the_last_steps_does_not_set_the_trained_cutoffs(
        final_settings):
    import tf_sparse_split as tfss

    rng = np.random.default_rng(4)
    x = rng.standard_normal((256, 32)).astype("float32")
    y = rng.integers(0, 10, 256)
    model = _mlp()
    # 3 epochs x 16 steps; 1 ms steps against a 5 ms budget (natural
    # sparsity) until the last 8 steps, which take 50 ms: the targets rise
    # there, after most of the last epoch ran at the natural sparsity.
    clock = PhaseClock(0.001, 0.05, slow_from=41)
    cb = tfss.TimeBudgetCallback(step_time=0.005, warmup_steps=4,
                                 min_samples=2, update_every=1, min_gain=0.0,
                                 bound_gain=0.0,
                                 final_settings=final_settings, clock=clock)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0,
              callbacks=[clock.callback(), cb])
    def above(t):
        # The floors in force at that step: the controller's floors follow
        # a layer's measured sparsity while its target is at the floor.
        return any(v > t["floors"][n] + 0.01
                   for n, v in t["targets"].items())

    assert any(above(t) for t in cb.trace if t["step"] >= 41), \
        "the burst must raise a target"
    assert not any(above(t) for t in cb.trace if t["step"] < 41)
    if final_settings == "last":
        assert cb.settled == {}
        assert any(k.fat.target > 0.0 for k in cb._knobs)
        return
    reads = [r for st, r in cb._settings_trace if st > 32]
    assert len(reads) >= 16
    for k in cb._knobs:
        cuts = sorted(r[k.name][0] for r in reads)
        assert cb.settled[k.name]["cutoff"] == pytest.approx(
            cuts[(len(cuts) - 1) // 2])
        assert k.fat.cutoff == pytest.approx(cb.settled[k.name]["cutoff"])
        # most of the last epoch ran at the natural sparsity (cutoff 0)
        assert k.fat.cutoff == 0.0 and k.fat.target == 0.0
    assert any(cb.settled[k.name]["last_target"] > 0.0 for k in cb._knobs)


def test_final_settings_is_checked():
    import tf_sparse_split as tfss

    with pytest.raises(ValueError, match="final_settings"):
        tfss.TimeBudgetCallback(step_time=1, final_settings="median")
