"""TimeBudgetCallback's sensitivity probe against a direct computation, and
the callback's own overhead accounting (nothing timed is asserted)."""

import numpy as np
import pytest


def _model():
    import keras

    import tf_sparse_split as tfss

    keras.utils.set_random_seed(5)
    model = keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(64, activation="relu", name="h1"),
        tfss.SparseSplitDense(48, activation="relu", name="h2"),
        tfss.SparseSplitDense(10, activation="softmax", name="out")])
    model.compile("adam", "sparse_categorical_crossentropy",
                  jit_compile=False)
    return model


def _fats(model):
    from tf_sparse_split.callbacks._discovery import (
        fatrelu_for, find_activation_producer)

    out = []
    for name in ("h2", "out"):
        owner, kind = find_activation_producer(model.get_layer(name))
        fat, _ = fatrelu_for(owner, kind)
        out.append((owner, fat))
    return out


def _loss(model, x, y):
    import keras

    pred = np.asarray(model(x, training=False), np.float64)
    return float(np.mean(keras.losses.sparse_categorical_crossentropy(
        y, pred)))


def test_probe_matches_a_direct_computation():
    import keras

    from tf_sparse_split.callbacks.time_budget import (SENSITIVITY_DELTA,
                                                       SensitivityProbe)

    model = _model()
    fats = _fats(model)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((96, 32)).astype(np.float32)
    y = rng.integers(0, 10, 96)
    probe = SensitivityProbe(model, fats)
    for _ in range(2):                       # traced once, then reused
        base, sens, zeros = probe.measure(x, y)
        assert base == pytest.approx(_loss(model, x, y), rel=1e-5)
        for (owner, fat), s, z in zip(fats, sens, zeros):
            act = np.asarray(keras.Model(model.inputs[0], owner.output)(
                x, training=False), np.float64).reshape(-1)
            # real zeros, not an all-zero or zero-free activation
            assert 0.05 < z < 0.95
            assert z == pytest.approx(np.mean(act == 0.0), abs=1e-9)
            cut = np.quantile(act, z + SENSITIVITY_DELTA)
            fat.cutoff_var.assign(cut)
            try:
                raised = _loss(model, x, y)
            finally:
                fat.cutoff_var.assign(0.0)
            assert base + s * SENSITIVITY_DELTA == pytest.approx(
                raised, rel=1e-4, abs=1e-6)
            assert fat.cutoff == 0.0            # restored
        assert probe.steady_s >= 0.0


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.01
        return self.t


def test_overhead_accounting_adds_up():
    import time

    import tf_sparse_split as tfss

    rng = np.random.default_rng(7)
    x = rng.standard_normal((128, 32)).astype(np.float32)
    y = rng.integers(0, 10, 128)
    model = _model()
    cb = tfss.TimeBudgetCallback(step_time=0.001, warmup_steps=3,
                                 min_samples=2, min_gain=0.0,
                                 sensitivity_data=(x[:32], y[:32]),
                                 clock=_Clock())
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    wall = time.perf_counter() - t0
    o = cb.overhead
    assert o["steps"] == 16
    # One probe at the warm-up's end, one at each epoch end after it (run,
    # or skipped when fewer than two layers' sparsity buys time).
    assert o["probes"] + o["probes_skipped"] == 3
    assert (o["probe_s"] > 0.0) == (o["probes"] > 0)
    for key in ("step_s", "epoch_end_s"):
        assert 0.0 < o[key] < wall
    assert o["step_s"] + o["probe_s"] + o["epoch_end_s"] < wall


def test_probe_skipped_when_one_layer_buys_time():
    """With a min_gain no layer's predicted saving reaches, the probe
    cannot change the allocation: never run, the log says why."""
    import tf_sparse_split as tfss

    rng = np.random.default_rng(8)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    y = rng.integers(0, 10, 64)
    cb = tfss.TimeBudgetCallback(step_time=0.001, warmup_steps=2,
                                 min_samples=2, min_gain=0.49,
                                 sensitivity_data=(x[:32], y[:32]),
                                 clock=_Clock())
    _model().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    assert cb.overhead["probes"] == 0 and cb.overhead["probe_s"] == 0.0
    assert cb.overhead["probes_skipped"] == 3
    assert "not probed" in cb._sens_note
    assert set(cb.controller.sensitivities) == {"h2", "out"}


def test_probe_skipped_with_one_controlled_layer():
    """One controlled layer: there is nothing to weigh its sensitivity
    against, so the probe never runs, whatever its sparsity buys."""
    import tf_sparse_split as tfss

    rng = np.random.default_rng(9)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    y = rng.integers(0, 10, 64)
    cb = tfss.TimeBudgetCallback(step_time=0.001, layers=["h2"],
                                 warmup_steps=2, min_samples=2, min_gain=0.0,
                                 sensitivity_data=(x[:32], y[:32]),
                                 clock=_Clock())
    _model().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[cb])
    assert [k.name for k in cb._knobs] == ["h2"]
    assert cb.overhead["probes"] == 0 and cb.overhead["probe_s"] == 0.0
    assert cb.overhead["probes_skipped"] == 3
