"""Keras callback that tunes the dense/sparse split threshold of each layer.

The sparsity of a ReLU network's activations differs between layers and
changes from epoch to epoch (R. Sun and L. Zhang, "Dynamic Sparse Method for
Deep Learning Execution", 2019), so one fixed threshold is not right for all
layers or all of training. :class:`SplitThresholdCallback` measures, per
layer, how fast the op's dense and sparse paths run on this machine from the
statistics the op records at every call, fits a
:class:`~tf_sparse_split.tuning.CostModel` (time = overhead + work /
rate per path, after K.-Y. Peng, "Adaptive runtime exploiting sparsity in
tensor of deep learning on heterogeneous systems", NTU 2017), and at the end
of every epoch sets each layer's threshold to the one the model predicts
fastest for that epoch's row-density histogram. The threshold never changes
the results, only the speed.
"""

import math
import warnings

import keras
import numpy as np

from tf_sparse_split.layers.base import SparseSplitLayer
from tf_sparse_split.tuning import stats as _stats
from tf_sparse_split.tuning.cost_model import CostModel, DENSE, SPARSE
from tf_sparse_split.utils.validation import validate_int

__all__ = ["SplitThresholdCallback", "find_split_layers"]


def find_split_layers(model):
    """Every :class:`~tf_sparse_split.layers.SparseSplitLayer` of ``model``
    (recursively through nested models and layers; ``model`` itself too), in
    model order, each once."""
    found, seen = [], set()
    candidates = [model]
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is not None:
        candidates = list(flatten(include_self=True, recursive=True))
    for layer in candidates:
        if isinstance(layer, SparseSplitLayer) and id(layer) not in seen:
            seen.add(id(layer))
            found.append(layer)
    return found


class _LayerState:
    """Per-layer bookkeeping of the callback."""

    def __init__(self, layer, warmup_samples):
        self.layer = layer
        self.cost_model = CostModel(warmup_samples=warmup_samples)
        self.initial_threshold = layer.threshold
        self.epoch_sum = np.zeros(_stats.NUM_STATS)
        self.epoch_calls = 0
        self.seen_total = None
        self.seen_calls = 0

    def snapshot(self):
        if self.layer.threshold_var is None:
            self.seen_total, self.seen_calls = None, 0
            return
        self.seen_total, self.seen_calls = \
            self.layer.accumulated_stats_vector()


class SplitThresholdCallback(keras.callbacks.Callback):
    """Fits per-layer cost models during training and sets the thresholds.

    What it does:

    * ``on_train_begin``: finds every
      :class:`~tf_sparse_split.layers.SparseSplitLayer`
      (:class:`~tf_sparse_split.layers.SparseSplitDense`,
      :class:`~tf_sparse_split.layers.SparseSplitConv2D`, also inside
      nested models); each layer's ``split_work_coefficients`` gives the
      flop formulas of its op to the cost model, resets their statistics and starts fresh cost models.
    * First epoch of each ``fit``: for the first ``explore_batches`` batches
      it alternates every layer's threshold between 1.0 (all rows sparse) and
      0.0 (all nonzero rows dense), so that both paths are timed; then it
      restores the layer's own threshold. Results are unaffected.
    * ``on_train_batch_end``: reads each layer's latest statistics vector as
      one timing sample per path and adds it to the epoch's totals.
    * ``on_epoch_end``: fits each layer's cost model (all samples so far),
      sets the threshold to ``CostModel.best_threshold`` for the epoch's
      mean row-density histogram and nonzero count (kept unchanged while only one path has
      ``min_samples`` samples; for a layer with ``heterogeneous=True`` the
      threshold that balances the two devices, ``max`` instead of sum of
      the paths' times), and writes ``logs[f"{layer.name}/sparsity"]``
      (fraction of zeros in the layer's input over the epoch) and
      ``logs[f"{layer.name}/threshold"]`` (the threshold for the next epoch)
      so that ``History`` and the progress bar show them.

    Attributes:
      history: list with one dict per epoch: ``{"epoch": int, "layers":
        {layer_name: {"sparsity", "threshold", "dense_rate",
        "sparse_rate", "dense_overhead", "sparse_overhead",
        "time_in_op", "calls"}}}``; rates in flop/s (None while a path is
        not fitted), overheads and ``time_in_op`` (dense + sparse + analysis,
        forward calls only, summed over the epoch) in seconds.
      layers: the layers found at ``on_train_begin``.

    Only training batches feed the model (validation calls are left out).
    With ``steps_per_execution > 1`` a batch end sees only the latest of the
    calls since the previous one as a timing sample (all of them count in
    the epoch totals).

    Args:
      explore_batches: int >= 0, batches of the first epoch spent
        alternating thresholds 1.0 / 0.0 (0 = no exploration: then the cost
        model only learns the paths the layers' thresholds use).
      min_samples: int >= 1, timing samples a path needs before it is fitted.
      warmup_samples: int >= 0, the first samples of each path and layer
        that are discarded (first calls are slow: allocation, page faults).
      verbose: 0 (silent) or 1 (print one line per layer per epoch).

    Raises:
      ValueError: on invalid arguments.
    """

    def __init__(self, explore_batches=6, min_samples=2, warmup_samples=1,
                 verbose=0):
        super().__init__()
        self.explore_batches = validate_int(explore_batches, "explore_batches",
                                            0)
        self.min_samples = validate_int(min_samples, "min_samples", 1)
        self.warmup_samples = validate_int(warmup_samples, "warmup_samples", 0)
        if verbose not in (0, 1) or isinstance(verbose, float):
            raise ValueError(f"verbose must be 0 or 1, got {verbose!r}")
        self.verbose = int(verbose)
        self.history = []
        self.layers = []
        self._states = []
        self._explore_epoch = None
        self._exploring = False

    # -- helpers ----------------------------------------------------------
    def _built_states(self):
        return [s for s in self._states if s.layer.threshold_var is not None]

    def _discover(self):
        known = {id(s.layer) for s in self._states}
        for layer in find_split_layers(self.model):
            if id(layer) not in known:
                state = _LayerState(layer, self.warmup_samples)
                if layer.threshold_var is not None:
                    layer.reset_stats()
                    state.snapshot()
                self._states.append(state)
        self.layers = [s.layer for s in self._states]

    # -- Keras hooks ------------------------------------------------------
    def on_train_begin(self, logs=None):
        spe = getattr(self.model, "steps_per_execution", 1)
        try:
            spe = int(spe.numpy() if hasattr(spe, "numpy") else spe)
        except (TypeError, ValueError):
            spe = 1
        if spe > 1:
            warnings.warn(
                f"SplitThresholdCallback: steps_per_execution={spe} lets it see "
                f"only one timing sample per {spe} steps, so exploration and "
                "the cost-model fit need more batches and thresholds may stay "
                "unchanged for a while; compile with steps_per_execution=1 "
                "for tuning", RuntimeWarning, stacklevel=2)
        self.history = []
        self._states = []
        self._explore_epoch = None
        self._exploring = False
        self._discover()

    def on_epoch_begin(self, epoch, logs=None):
        if self._explore_epoch is None:
            self._explore_epoch = epoch
        for s in self._states:
            s.epoch_sum = np.zeros(_stats.NUM_STATS)
            s.epoch_calls = 0
            s.snapshot()

    def on_train_batch_begin(self, batch, logs=None):
        if self._explore_epoch is None or self.explore_batches == 0:
            return
        in_explore_epoch = len(self.history) == 0
        if in_explore_epoch and batch < self.explore_batches:
            value = 1.0 if batch % 2 == 0 else 0.0
            for s in self._built_states():
                s.layer.threshold_var.assign(value)
            self._exploring = True
        elif self._exploring:
            self._restore_thresholds()

    def _restore_thresholds(self):
        for s in self._built_states():
            s.layer.threshold_var.assign(s.initial_threshold)
        self._exploring = False

    def on_train_batch_end(self, batch, logs=None):
        if any(s.layer.threshold_var is None for s in self._states) or \
                not self._states:
            # Layers built lazily by the first step: pick them up now.
            self._discover()
        for s in self._built_states():
            total, calls = s.layer.accumulated_stats_vector()
            if s.seen_total is None:
                s.seen_total, s.seen_calls = np.zeros_like(total), 0
            new_calls = calls - s.seen_calls
            if new_calls > 0:
                s.epoch_sum += total - s.seen_total
                s.epoch_calls += new_calls
                latest = s.layer.latest_stats_vector()
                s.cost_model.add_stats(latest,
                                       coefficients=_coefficients(s.layer, latest))
            s.seen_total, s.seen_calls = total, calls

    def on_epoch_end(self, epoch, logs=None):
        if self._exploring:
            self._restore_thresholds()
        record = {"epoch": int(epoch), "layers": {}}
        for s in self._built_states():
            layer = s.layer
            entry = self._update_layer(s)
            record["layers"][layer.name] = entry
            if logs is not None:
                logs[f"{layer.name}/sparsity"] = entry["sparsity"]
                logs[f"{layer.name}/threshold"] = entry["threshold"]
            if self.verbose:
                print(
                    f"SplitThresholdCallback: {layer.name}: sparsity "
                    f"{entry['sparsity']:.3f}, threshold "
                    f"{entry['threshold']:.4g}, dense rate "
                    f"{_fmt_rate(entry['dense_rate'])}, sparse rate "
                    f"{_fmt_rate(entry['sparse_rate'])}, time in op "
                    f"{entry['time_in_op']:.3f} s", flush=True)
        self.history.append(record)

    def _update_layer(self, s):
        v, calls = s.epoch_sum, s.epoch_calls
        cm = s.cost_model
        entry = {"sparsity": float("nan"), "threshold": s.layer.threshold,
                 "dense_rate": None, "sparse_rate": None,
                 "dense_overhead": None, "sparse_overhead": None,
                 "time_in_op": float(v[_stats.TIME_DENSE] +
                                     v[_stats.TIME_SPARSE] +
                                     v[_stats.TIME_ANALYZE]),
                 "calls": int(calls)}
        if calls == 0:
            return entry
        k = v[_stats.K] / calls
        elems = v[_stats.M] * k
        if elems > 0:
            entry["sparsity"] = float(1.0 - v[_stats.NNZ] / elems)
        cm.fit(min_samples=self.min_samples)
        for path in (DENSE, SPARSE):
            entry[f"{path}_rate"] = cm.rate(path)
            entry[f"{path}_overhead"] = cm.overhead(path)
        hist = v[_stats.HISTOGRAM] / calls
        m = v[_stats.M] / calls
        n = v[_stats.N] / calls
        k_live = min(max(k - v[_stats.ZERO_COLS_SKIPPED] / calls, 0.0), k)
        nnz = v[_stats.NNZ] / calls
        best = cm.best_threshold(
            hist, m, k, k_live, n, nnz=nnz,
            heterogeneous=bool(getattr(s.layer, "heterogeneous", False)),
            coefficients=_coefficients(s.layer, v / calls))
        if best is not None:
            s.layer.set_threshold(best)
        entry["threshold"] = s.layer.threshold
        return entry


def _coefficients(layer, stats_vector):
    """The layer's work coefficients for the cost model."""
    return layer.split_work_coefficients(stats_vector)


def _fmt_rate(rate):
    if rate is None:
        return "n/a"
    if math.isinf(rate):
        # The fit found no growth of time with work: overhead-dominated.
        return "unbounded (time did not grow with work)"
    return f"{rate / 1e9:.2f} GFLOP/s"
