"""Keras callback that drives the activation sparsity of the inputs of the
sparse-split layers toward a target while training.

Natural ReLU sparsity is often too low for the sparse paths to pay (an MNIST
MLP's hidden activations are 36-72% zeros; the split op wins from ~90%).
Published work reaches ~90% zeros at near-equal accuracy by

* a forced activation threshold (FATReLU, whose cutoff is the threshold)
  plus an L1 activity penalty (M. Kurtz et al., "Inducing and Exploiting
  Activation Sparsity for Fast Inference on Deep Neural Networks", ICML
  2020);
* ReLU with an L1 penalty ramped up progressively, then a threshold shift
  (C. Song et al., "ProSparse: Introducing and Enhancing Intrinsic Activation
  Sparsity within Large Language Models", 2024);
* and it holds for ReLU networks in general (I. Mirzadeh et al., "ReLU
  Strikes Back", 2023).

:class:`SparsityTargetCallback` combines them (see its docstring for the
schedule). Wiring (:mod:`tf_sparse_split.callbacks._discovery`): for each
sparse-split layer the callback finds the ReLU-family activation that feeds
it (:func:`find_activation_producer`), across zero-preserving layers
(dropout, max-pooling, flatten, reshape, ...); a ``"relu"`` activation is
converted in place to a :class:`~tf_sparse_split.layers.FATReLU` (cutoff 0 =
the same ReLU) and the model's compiled functions are rebuilt. The converted
activation is part of the layer's config from then on, so the model saves
and reloads with it. A controlled ``SparseSplitDense`` gets
``masked_input_grad=True`` (its input gradient is then computed only at the
input's nonzeros, by the SDDMM op): the FATReLU's gradient is 0 wherever its
output is, so this is exact.
"""

import keras
import numpy as np

from tf_sparse_split.callbacks._discovery import (fatrelu_for,
                                                  find_activation_producer,
                                                  mask_input_grad,
                                                  no_control_message,
                                                  reset_compiled_functions,
                                                  select_split_layers)
from tf_sparse_split.tuning import stats as _stats
from tf_sparse_split.utils.validation import (validate_fraction, validate_int,
                                              validate_nonnegative_float,
                                              validate_positive_float)

__all__ = ["SparsityTargetCallback", "find_activation_producer"]


#: Sparsity above the goal by more than this (with the cutoff at 0)
#: lowers the L1 coefficient; never below this fraction of ``l1``.
_L1_BAND = 0.02
_L1_MIN_SCALE = 0.1


class _Control:
    """One controlled activation and the sparse-split layer it feeds."""

    def __init__(self, consumer, owner, fat):
        self.consumer = consumer
        self.owner = owner
        self.fat = fat
        self.offset = 0.0          # feedback correction of the quantile
        self.l1_scale = 1.0        # feedback scaling of the L1 coefficient
        self.seen_total = None
        self.seen_calls = 0
        self.window_zero = 0.0     # zeros / elements since the last update
        self.window_elems = 0.0
        self.epoch_zero = 0.0
        self.epoch_elems = 0.0
        self.applied = None        # (l1, target) last assigned to fat

    def read_new_stats(self):
        """Adds the consumer's statistics since the last read to the
        window and epoch counts."""
        total, calls = self.consumer.accumulated_stats_vector()
        if self.seen_total is None or calls < self.seen_calls:
            self.seen_total, self.seen_calls = np.zeros_like(total), 0
        if calls > self.seen_calls:
            d = total - self.seen_total
            elems = d[_stats.M] * (d[_stats.K] / (calls - self.seen_calls))
            zeros = elems - d[_stats.NNZ]
            self.window_zero += zeros
            self.window_elems += elems
            self.epoch_zero += zeros
            self.epoch_elems += elems
        self.seen_total, self.seen_calls = total, calls

    def skip_new_stats(self):
        """Moves the baseline past the calls since the last read without
        counting them."""
        self.seen_total, self.seen_calls = \
            self.consumer.accumulated_stats_vector()


class SparsityTargetCallback(keras.callbacks.Callback):
    """Drives the input sparsity of sparse-split layers toward a target.

    For every controlled sparse-split layer ``L`` (see the module docstring
    for how its feeding activation is found and converted to
    :class:`~tf_sparse_split.layers.FATReLU`), with ``t`` the training step
    counted from ``on_train_begin``:

    1. Warm-up, ``t < warmup_steps``: plain ReLU (cutoff 0, no penalty).
    2. Progressive ramp (ProSparse): over the next ``ramp_steps`` the
       schedule ``r`` rises linearly from 0 to 1; the activation's L1
       coefficient is ``r * l1`` and its quantile target is
       ``r * target_sparsity + offset``. The FATReLU follows the quantile
       target in-graph at every step (FATReLU docstring), so the cutoff
       rises only once the target exceeds the natural ReLU sparsity.
    3. Feedback: every ``update_every`` steps the callback reads the zeros
       ``L`` actually saw (its op statistics) and moves ``offset`` by
       ``gain * (r * target_sparsity - measured)``, clipped so the quantile
       target stays in ``[0, 0.999]``. This corrects for layers between the
       activation and ``L`` that change the sparsity (max-pooling keeps a
       zero only where its whole window is zero). The penalty alone can
       push the natural ReLU sparsity past the goal, which no cutoff
       undoes: while the measured sparsity is more than 0.02 above the goal
       the L1 coefficient is lowered by 10% per update (to no less than
       ``0.1 * l1``), and it is raised back the same way while below.

    The schedule counts steps from the first ``fit`` of a model; a further
    ``fit`` of the same model with the same callback continues it (as the
    optimizer's step count does); another model starts it afresh.

    The cutoff stays in force at inference (the point of FATReLU:
    Kurtz et al.), and the model saves and reloads with it.

    Logs (``on_epoch_end``, so ``History``, the progress bar and TensorBoard
    see them), per controlled layer ``name``: ``name/sparsity`` (fraction of
    zeros of its input over the epoch), ``name/fat_cutoff`` (the FATReLU's
    cutoff), ``name/l1`` (the coefficient in force) and
    ``name/sparsity_target`` (the quantile target in force); also
    ``name/fat_threshold``, the same value under its deprecated name, until
    the next release. Only training batches count (validation calls are
    left out).

    Works together with
    :class:`~tf_sparse_split.callbacks.SplitThresholdCallback` (which sets
    the split thresholds from the same statistics); put either first.

    Args:
      target_sparsity: fraction of zeros wanted at each controlled layer's
        input, in ``[0, 1)``.
      layers: optional list of sparse-split layer names (or layers) to
        control; default every sparse-split layer whose input comes from a
        ReLU-family activation (layers fed by a model input are skipped).
      warmup_epochs: epochs (may be fractional, >= 0; default 0.5) of plain
        ReLU training first.
      ramp_epochs: epochs (> 0; default 1.0) of the progressive ramp.
      l1: final L1 activity-penalty coefficient (>= 0; default 2.0): the
        loss gains ``l1 * mean(|activation|)`` per controlled activation.
      gain: feedback gain (>= 0; default 0.5; 0 = no feedback).
      update_every: steps between feedback updates (int >= 1; default 10).
      momentum: cutoff EMA momentum of the FATReLUs (in ``[0, 1)``,
        default 0.9), per training step.
      track_every: steps between the FATReLUs' cutoff updates (int >= 1;
        default 4): their ``track_every``, the momentum raised to that
        power per update (same rate per step); the steps between skip the
        quantile estimate.
      verbose: 0 or 1 (one line per controlled layer per epoch).

    Attributes:
      controls: list of dicts ``{"layer", "activation_owner", "fatrelu"}``
        after ``on_train_begin``.
      history: one dict per epoch ``{layer name: {"sparsity",
        "fat_cutoff", "l1", "sparsity_target"}}`` (and the deprecated
        ``"fat_threshold"``, equal to ``"fat_cutoff"``).

    Raises:
      ValueError: bad arguments (here), or at ``on_train_begin`` a named
        layer that is not a sparse-split layer or has no ReLU-family
        activation feeding it, or no controllable layer at all.
    """

    def __init__(self, target_sparsity, layers=None, warmup_epochs=0.5,
                 ramp_epochs=1.0, l1=2.0, gain=0.5, update_every=10,
                 momentum=0.9, verbose=0, track_every=4):
        super().__init__()
        self.target_sparsity = validate_fraction(target_sparsity,
                                                 "target_sparsity")
        if layers is not None:
            if isinstance(layers, (str, bytes)) or not hasattr(
                    layers, "__iter__"):
                raise ValueError(
                    "`layers` must be a list of layer names or layers. "
                    f"Received: layers={layers!r}")
            layers = list(layers)
            if not layers:
                raise ValueError("`layers` must not be empty. "
                                 f"Received: layers={layers!r}")
        self.layer_selection = layers
        self.warmup_epochs = validate_nonnegative_float(warmup_epochs, "warmup_epochs")
        self.ramp_epochs = validate_positive_float(ramp_epochs, "ramp_epochs")
        self.l1 = validate_nonnegative_float(l1, "l1")
        self.gain = validate_nonnegative_float(gain, "gain")
        self.update_every = validate_int(update_every, "update_every", 1)
        self.momentum = validate_fraction(momentum, "momentum")
        self.track_every = validate_int(track_every, "track_every", 1)
        if verbose not in (0, 1) or isinstance(verbose, (bool, float)):
            raise ValueError(f"`verbose` must be 0 or 1. Received: "
                             f"verbose={verbose!r}")
        self.verbose = int(verbose)
        self.controls = []
        self.history = []
        self._controls = []
        self._step = 0
        self._steps_per_epoch = None
        self._model_id = None

    # -- discovery ---------------------------------------------------------
    def _selected_layers(self):
        return select_split_layers(self.model, self.layer_selection,
                                   "SparsityTargetCallback")

    def _discover(self):
        consumers, explicit = self._selected_layers()
        controls, converted, seen = [], False, set()
        for layer in consumers:
            owner, kind = find_activation_producer(layer)
            if owner is None:
                if explicit:
                    raise ValueError(
                        f"SparsityTargetCallback: layer {layer.name!r} cannot "
                        f"be controlled: {kind}")
                continue
            if id(owner) in seen:
                continue  # one activation feeding two layers: control once
            seen.add(id(owner))
            fat, changed = fatrelu_for(owner, kind)
            # Python values read when the train function is traced: a
            # change needs the function rebuilt.
            changed = changed or (fat.momentum, fat.track_every) != (
                self.momentum, self.track_every)
            fat.momentum = self.momentum
            fat.track_every = self.track_every
            changed = mask_input_grad(layer) or changed
            converted = converted or changed
            controls.append(_Control(layer, owner, fat))
        if not controls:
            raise ValueError(no_control_message("SparsityTargetCallback",
                                                self.model))
        if converted:
            # Rebuild the compiled functions so they trace the new activation.
            reset_compiled_functions(self.model)
        return controls

    # -- schedule ----------------------------------------------------------
    def _ramp(self):
        spe = self._steps_per_epoch or 1
        warm = self.warmup_epochs * spe
        ramp = self.ramp_epochs * spe
        return float(np.clip((self._step - warm) / ramp, 0.0, 1.0))

    def _apply(self, r):
        # Assigned only when they change (after the ramp they change only at
        # a feedback update): each assign is a host-side op between steps.
        for c in self._controls:
            q = float(np.clip(r * self.target_sparsity + c.offset, 0.0, 0.999))
            values = (r * self.l1 * c.l1_scale, q if r > 0 else 0.0)
            if values == c.applied:
                continue
            c.fat.l1_var.assign(values[0])
            c.fat.target_var.assign(values[1])
            c.applied = values

    # -- Keras hooks ---------------------------------------------------------
    def on_train_begin(self, logs=None):
        # A further fit() of the same model continues the schedule (like the
        # optimizer's step count); a new model starts it afresh.
        resume = self._model_id == id(self.model) and bool(self._controls)
        self._model_id = id(self.model)
        if not resume:
            self._controls = self._discover()
            self.controls = [{"layer": c.consumer,
                              "activation_owner": c.owner, "fatrelu": c.fat}
                             for c in self._controls]
            self.history = []
            self._step = 0
        self._steps_per_epoch = (self.params or {}).get("steps") or None
        for c in self._controls:
            if not resume:
                c.offset, c.l1_scale = 0.0, 1.0
            c.applied = None   # assign at the first _apply of every fit
            c.seen_total = None
            if c.consumer.threshold_var is not None:
                c.read_new_stats()  # baseline of the counters
            c.window_zero = c.window_elems = 0.0
        self._apply(self._ramp())

    def on_epoch_begin(self, epoch, logs=None):
        for c in self._controls:
            c.epoch_zero = c.epoch_elems = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        if self._steps_per_epoch is None:
            self._steps_per_epoch = (self.params or {}).get("steps") or None
        self._apply(self._ramp())

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._step % self.update_every:
            return
        self._feedback()

    def _feedback(self):
        r = self._ramp()
        for c in self._controls:
            c.read_new_stats()
            if c.window_elems > 0 and r > 0 and self.gain > 0:
                measured = c.window_zero / c.window_elems
                goal = r * self.target_sparsity
                c.offset += self.gain * (goal - measured)
                c.offset = float(np.clip(c.offset, -goal, 0.999 - goal))
                # The penalty alone can push the ReLU's natural sparsity past
                # the goal, which no cutoff can undo: ease it off then,
                # and restore it when the sparsity falls below the goal.
                if measured > goal + _L1_BAND:
                    c.l1_scale = max(c.l1_scale * 0.9, _L1_MIN_SCALE)
                elif measured < goal:
                    c.l1_scale = min(c.l1_scale * 1.1, 1.0)
            c.window_zero = c.window_elems = 0.0

    def on_test_begin(self, logs=None):
        # Validation calls the layers too: count the training calls so far,
        # then (on_test_end) skip what validation adds.
        for c in self._controls:
            c.read_new_stats()

    def on_test_end(self, logs=None):
        for c in self._controls:
            c.skip_new_stats()

    def on_epoch_end(self, epoch, logs=None):
        record = {}
        for c in self._controls:
            c.read_new_stats()
            c.window_zero = c.window_elems = 0.0
            sp = (c.epoch_zero / c.epoch_elems if c.epoch_elems > 0
                  else float("nan"))
            entry = {"sparsity": float(sp), "fat_cutoff": c.fat.cutoff,
                     "l1": c.fat.l1, "sparsity_target": c.fat.target}
            # The old key, for one release (same value).
            entry["fat_threshold"] = entry["fat_cutoff"]
            record[c.consumer.name] = entry
            if logs is not None:
                for key, value in entry.items():
                    logs[f"{c.consumer.name}/{key}"] = value
            if self.verbose:
                print(f"SparsityTargetCallback: {c.consumer.name}: sparsity "
                      f"{sp:.3f} (target {self.target_sparsity:.3f}), "
                      f"cutoff {entry['fat_cutoff']:.4g}, l1 "
                      f"{entry['l1']:.3g}", flush=True)
        self.history.append(record)

