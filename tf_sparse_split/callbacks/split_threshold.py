"""Keras callback that sets and reports each layer's split threshold
between epochs from the ops' own cost model.

The sparsity of a ReLU network's activations differs between layers and
changes from epoch to epoch (R. Sun and L. Zhang, "Dynamic Sparse Method for
Deep Learning Execution", 2019), so one fixed threshold is not right for all
layers or all of training. The ops measure their dense and sparse paths on
this machine (K.-Y. Peng, "Adaptive runtime exploiting sparsity in tensor of
deep learning on heterogeneous systems", NTU 2017: the family model of
``cc/core/cost_model.h``, calibrated on a family's first automatic call and
then following the measured/predicted ratios of its calls) and write those
terms into the statistics they return. :class:`SplitThresholdCallback`
reads them and, between epochs, updates each layer's split threshold from
that cost model fitted to what the ops measured -- or, for a layer the op
decides per call, reports what that model picks (the rule, "Who decides
when", is :mod:`tf_sparse_split.tuning.tuner`'s). The threshold never
changes the results, only the speed. The work itself lives in
:class:`~tf_sparse_split.tuning.tuner.ThresholdTuner` (custom training loops
and ``tf.distribute`` strategies use it directly); this callback drives it
from ``fit``.
"""

import math
import warnings

import keras

from tf_sparse_split.tuning.tuner import ThresholdTuner, find_split_layers
from tf_sparse_split.utils.validation import validate_int

__all__ = ["SplitThresholdCallback", "find_split_layers"]


class SplitThresholdCallback(keras.callbacks.Callback):
    """Sets and reports the layers' split thresholds between epochs.

    A thin Keras driver of :class:`~tf_sparse_split.tuning.tuner.
    ThresholdTuner` (which custom training loops use directly). Who decides
    when:

    * **The op decides per call** for every layer whose threshold is
      automatic (negative or ``'auto'``, the layers' default). Under the
      default ``policy="auto"`` such a layer stays automatic for the whole
      training: the callback writes nothing into its threshold variable, so
      the op's per-call decision is never switched off; its
      ``logs[f"{layer.name}/threshold"]`` is the threshold the op's model
      picks for the epoch's mean row-density histogram (a report).
    * **The callback tunes fixed thresholds between epochs.** A layer with
      a fixed threshold (a number in [0, 1]) is explored in the first epoch
      and then set, with ``layer.set_threshold``, to the threshold the op's
      model picks for the epoch (the terms the op measured; its margins and
      hysteresis). ``policy="fixed"`` tunes every layer this way (automatic
      layers are switched to fixed thresholds on purpose);
      ``policy="report"`` writes nothing at all.

    Hooks:

    * ``on_train_begin``: finds every sparse-split layer
      (:class:`~tf_sparse_split.layers.SparseSplitDense`,
      :class:`~tf_sparse_split.layers.SparseSplitConv2D`, also inside
      nested models) and resets their statistics.
      With ``resume`` (default), a later ``fit`` of the same model object
      whose sparse-split layers are the same, with the same names and shapes
      (:func:`~tf_sparse_split.tuning.tuner.layer_key`), keeps the tuned
      thresholds, sample counts and :attr:`history` instead, and explores
      no more: calling ``fit`` once per epoch (custom schedules, Keras Tuner,
      continual training) pays the exploration once. Another model, or
      layers replaced or rebuilt with other shapes, start over.
    * First epoch of a ``fit`` that starts over: for the first
      ``explore_batches`` batches it alternates every tuned layer's
      threshold between 1.0 (all rows sparse) and 0.0 (all nonzero rows
      dense), so that the op times both paths; then it restores the layer's
      own threshold. Results are unaffected.
    * ``on_train_batch_begin``: takes the sample of the previous batch if
      it was an exploration batch or one of the ``samples_per_epoch``
      sampled batches of the epoch. Other batches cost no host sync: the
      layers accumulate their statistics on the device, and the callback
      reads the totals once at the start and once at the end of each epoch.
      (It defines no ``on_train_batch_end``, so Keras may dispatch batch-end
      hooks asynchronously.)
    * ``on_epoch_end``: asks the op's model (``tuning.op_model.decide``) for
      each layer's threshold for the epoch's mean row-density histogram and
      nonzero count (none while a tuned layer's path has fewer than
      ``min_samples`` samples and its family is not calibrated: the
      threshold is kept; a heterogeneous split that ran balances the two
      devices), sets it on the tuned layers, and writes
      ``logs[f"{layer.name}/sparsity"]`` (fraction of zeros in the layer's
      input over the epoch) and ``logs[f"{layer.name}/threshold"]`` (the
      threshold for the next epoch; for an automatic layer the op model's
      pick) and, after an epoch with calls, ``logs[f"{layer.name}/
      rows_sparse"]`` (the fraction of its rows the op sent to the sparse
      kernel over the epoch), so that ``History``, the progress bar and
      ``keras.callbacks.TensorBoard`` (as ``epoch_<layer>/sparsity``...)
      show them.
    * With ``log_dir``: per layer and epoch, TensorBoard scalars
      ``<layer>/input_sparsity``, ``threshold``, ``rows_dense``,
      ``rows_sparse``, ``seconds_dense``, ``seconds_sparse``,
      ``seconds_analyze``, ``zero_columns_skipped`` and the histogram
      ``<layer>/row_density`` (rows per density bin), written with
      ``tf.summary`` (:data:`~tf_sparse_split.tuning.tuner.SCALAR_TAGS`).

    Under ``tf.distribute.MirroredStrategy`` (``model.distribute_strategy``)
    the statistics of all replicas are all-reduced and every replica gets
    the same thresholds.

    Attributes:
      history: list with one dict per epoch: ``{"epoch": int, "layers":
        {layer_name: entry}, "explore_batches": int}`` (the epoch's
        exploration batches; with ``resume``, the epochs of every ``fit`` of
        the model, ``epoch`` as Keras numbered it), entries as in
        ``ThresholdTuner.history``
        (``mode``, ``sparsity``, ``threshold``, ``predicted_threshold``,
        ``threshold_used``, ``dense_rate``, ``sparse_rate`` in flop/s or
        None, ``dense_overhead``, ``sparse_overhead`` and ``time_in_op`` in
        seconds, ``terms``, ``rows_dense``, ``rows_sparse``, ``histogram``,
        ``calls``, ...).
      layers: the layers found at ``on_train_begin``.
      tuner: the :class:`ThresholdTuner` (None before ``fit``).

    Only training batches feed the model (validation calls are left out).
    With ``steps_per_execution > 1`` a batch begin sees only the latest of
    the calls since the previous one as a sample (all of them count in the
    epoch totals).

    Args:
      explore_batches: int >= 0, batches of the first epoch spent
        alternating the tuned layers' thresholds 1.0 / 0.0 (0 = no
        exploration: then a tuned layer's family only learns the paths its
        threshold uses, unless an automatic call calibrated it).
      min_samples: int >= 1, sampled calls that must have run a path before
        a tuned layer's threshold is decided from the op's terms for it
        (not needed once the family is calibrated).
      warmup_samples: int >= 0, the first sampled calls of each path and
        layer that are not counted (first calls are slow: allocation, page
        faults).
      verbose: 0 (silent) or 1 (print one line per layer per epoch).
      samples_per_epoch: int >= 0 (default 4), batches per epoch (after
        exploration) read as samples, spread over the epoch.
      log_dir: directory for TensorBoard event files, or None (default).
      resume: bool (default True): a later ``fit`` of the same model keeps
        what was learned (see ``on_train_begin``); False: every ``fit``
        starts over.
      policy: ``"auto"`` (default), ``"fixed"`` or ``"report"`` (see above
        and :data:`~tf_sparse_split.tuning.tuner.POLICIES`).

    Raises:
      ValueError: on invalid arguments.
    """

    def __init__(self, explore_batches=6, min_samples=2, warmup_samples=1,
                 verbose=0, samples_per_epoch=4, log_dir=None, resume=True,
                 policy="auto"):
        super().__init__()
        if not isinstance(resume, bool):
            raise ValueError(f"`resume` must be True or False. Received: "
                             f"resume={resume!r}")
        self.resume = resume
        if verbose not in (0, 1) or isinstance(verbose, float):
            raise ValueError(f"verbose must be 0 or 1, got {verbose!r}")
        self.verbose = int(verbose)
        self.explore_batches = validate_int(explore_batches, "explore_batches",
                                            0)
        self.min_samples = validate_int(min_samples, "min_samples", 1)
        self.warmup_samples = validate_int(warmup_samples, "warmup_samples", 0)
        self.samples_per_epoch = validate_int(samples_per_epoch,
                                              "samples_per_epoch", 0)
        self.policy = policy
        # Validates log_dir and policy too (the tuner is re-made per model).
        self._make_tuner(None, log_dir)
        self.log_dir = log_dir
        self.tuner = None
        self._in_epoch = False

    def _make_tuner(self, model, log_dir):
        return ThresholdTuner(
            model, strategy=getattr(model, "distribute_strategy", None),
            explore_batches=self.explore_batches,
            samples_per_epoch=self.samples_per_epoch,
            min_samples=self.min_samples, warmup_samples=self.warmup_samples,
            log_dir=log_dir, policy=self.policy)

    @property
    def history(self):
        return self.tuner.history if self.tuner is not None else []

    @property
    def layers(self):
        return self.tuner.layers if self.tuner is not None else []

    @property
    def _states(self):
        return self.tuner.states if self.tuner is not None else []

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
        if self.tuner is not None and self.tuner.model is self.model:
            # Same model: the tuner itself checks its layers and shapes.
            self.tuner.begin_training(resume=self.resume)
        else:
            if self.tuner is not None:
                self.tuner.close()
            self.tuner = self._make_tuner(self.model, self.log_dir)
            self.tuner.begin_training()
        if self.verbose and self.tuner.resumed:
            print("SplitThresholdCallback: same model and layer shapes as the "
                  "previous fit: cost models and thresholds kept, no "
                  "exploration", flush=True)
        self._in_epoch = False

    def on_epoch_begin(self, epoch, logs=None):
        steps = (self.params or {}).get("steps")
        self.tuner.begin_epoch(epoch, steps=steps)
        self._in_epoch = True

    def on_train_batch_begin(self, batch, logs=None):
        self.tuner.before_batch(batch)

    def on_test_begin(self, logs=None):
        # Validation inside fit: the epoch's training calls are over.
        if self._in_epoch and self.tuner is not None:
            self.tuner.end_epoch_batches()

    def on_epoch_end(self, epoch, logs=None):
        self._in_epoch = False
        record = self.tuner.end_epoch(epoch)
        for name, entry in record["layers"].items():
            if logs is not None:
                logs[f"{name}/sparsity"] = entry["sparsity"]
                logs[f"{name}/threshold"] = entry["threshold"]
                rows = entry["rows_dense"] + entry["rows_sparse"]
                if rows > 0:
                    logs[f"{name}/rows_sparse"] = entry["rows_sparse"] / rows
            if self.verbose:
                print(
                    f"SplitThresholdCallback: {name}: sparsity "
                    f"{entry['sparsity']:.3f}, threshold "
                    f"{entry['threshold']:.4g} ({_MODE_WORDS[entry['mode']]})"
                    f", dense rate "
                    f"{_fmt_rate(entry['dense_rate'])}, sparse rate "
                    f"{_fmt_rate(entry['sparse_rate'])}, time in op "
                    f"{entry['time_in_op']:.3f} s", flush=True)

    def on_train_end(self, logs=None):
        if self.tuner is not None:
            self.tuner.close()


_MODE_WORDS = {"auto": "op decides per call; its model's pick",
               "tuned": "set for the next epoch",
               "kept": "the layer's own, kept"}


def _fmt_rate(rate):
    if rate is None:
        return "n/a"
    if math.isinf(rate):
        # Time did not grow with the work: overhead-dominated.
        return "unbounded (time did not grow with work)"
    return f"{rate / 1e9:.2f} GFLOP/s"
