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
the results, only the speed. The tuning itself lives in
:class:`~tf_sparse_split.tuning.tuner.ThresholdTuner` (custom training
loops and ``tf.distribute`` strategies use it directly); this callback drives
it from ``fit``.
"""

import math
import warnings

import keras

from tf_sparse_split.tuning.tuner import ThresholdTuner, find_split_layers
from tf_sparse_split.utils.validation import validate_int

__all__ = ["SplitThresholdCallback", "find_split_layers"]


class SplitThresholdCallback(keras.callbacks.Callback):
    """Fits per-layer cost models during training and sets the thresholds.

    A thin Keras driver of :class:`~tf_sparse_split.tuning.tuner.
    ThresholdTuner` (which custom training loops use directly):

    * ``on_train_begin``: finds every
      :class:`~tf_sparse_split.layers.SparseSplitLayer`
      (:class:`~tf_sparse_split.layers.SparseSplitDense`,
      :class:`~tf_sparse_split.layers.SparseSplitConv2D`, also inside
      nested models), resets their statistics and starts fresh cost models
      (each layer's ``split_work_coefficients`` gives its op's flop formulas).
      With ``resume`` (default), a later ``fit`` of the same model object
      whose sparse-split layers are the same, with the same names and shapes
      (:func:`~tf_sparse_split.tuning.tuner.layer_key`), keeps the cost
      models, thresholds and :attr:`history` instead, and explores no more:
      calling ``fit`` once per epoch (custom schedules, Keras Tuner,
      continual training) pays the exploration once. Another model, or
      layers replaced or rebuilt with other shapes, start over.
    * First epoch of a ``fit`` that starts over: for the first
      ``explore_batches`` batches it alternates every layer's threshold
      between 1.0 (all rows sparse) and 0.0 (all nonzero rows dense), so
      that both paths are timed; then it restores the layer's own threshold.
      Results are unaffected.
    * ``on_train_batch_begin``: takes the timing sample of the previous batch
      if it was an exploration batch or one of the ``samples_per_epoch``
      sampled batches of the epoch. Other batches cost no host sync: the
      layers accumulate their statistics on the device, and the callback
      reads the totals once at the start and once at the end of each epoch.
      (It defines no ``on_train_batch_end``, so Keras may dispatch batch-end
      hooks asynchronously.)
    * ``on_epoch_end``: fits each layer's cost model (all samples so far),
      sets the threshold to ``CostModel.best_threshold`` for the epoch's
      mean row-density histogram and nonzero count (kept unchanged while
      only one path has ``min_samples`` samples; for a layer with
      ``heterogeneous=True`` the threshold that balances the two devices),
      and writes ``logs[f"{layer.name}/sparsity"]`` (fraction of zeros in
      the layer's input over the epoch) and ``logs[f"{layer.name}/
      threshold"]`` (the threshold for the next epoch) so that ``History``,
      the progress bar and ``keras.callbacks.TensorBoard`` (as
      ``epoch_<layer>/sparsity``...) show them.
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
        (``sparsity``, ``threshold``, ``dense_rate``, ``sparse_rate`` in
        flop/s or None, ``dense_overhead``, ``sparse_overhead`` and
        ``time_in_op`` in seconds, ``rows_dense``, ``rows_sparse``,
        ``histogram``, ``calls``, ...).
      layers: the layers found at ``on_train_begin``.
      tuner: the :class:`ThresholdTuner` (None before ``fit``).

    Only training batches feed the model (validation calls are left out).
    With ``steps_per_execution > 1`` a batch begin sees only the latest of
    the calls since the previous one as a timing sample (all of them count
    in the epoch totals).

    Args:
      explore_batches: int >= 0, batches of the first epoch spent
        alternating thresholds 1.0 / 0.0 (0 = no exploration: then the cost
        model only learns the paths the layers' thresholds use).
      min_samples: int >= 1, timing samples a path needs before it is fitted.
      warmup_samples: int >= 0, the first samples of each path and layer
        that are discarded (first calls are slow: allocation, page faults).
      verbose: 0 (silent) or 1 (print one line per layer per epoch).
      samples_per_epoch: int >= 0 (default 4), batches per epoch (after
        exploration) read as timing samples, spread over the epoch.
      log_dir: directory for TensorBoard event files, or None (default).
      resume: bool (default True): a later ``fit`` of the same model keeps
        what was learned (see ``on_train_begin``); False: every ``fit``
        starts over.

    Raises:
      ValueError: on invalid arguments.
    """

    def __init__(self, explore_batches=6, min_samples=2, warmup_samples=1,
                 verbose=0, samples_per_epoch=4, log_dir=None, resume=True):
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
        # Validates log_dir too (the tuner is re-made at every fit).
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
            log_dir=log_dir)

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
            if self.verbose:
                print(
                    f"SplitThresholdCallback: {name}: sparsity "
                    f"{entry['sparsity']:.3f}, threshold "
                    f"{entry['threshold']:.4g}, dense rate "
                    f"{_fmt_rate(entry['dense_rate'])}, sparse rate "
                    f"{_fmt_rate(entry['sparse_rate'])}, time in op "
                    f"{entry['time_in_op']:.3f} s", flush=True)

    def on_train_end(self, logs=None):
        if self.tuner is not None:
            self.tuner.close()


def _fmt_rate(rate):
    if rate is None:
        return "n/a"
    if math.isinf(rate):
        # The fit found no growth of time with work: overhead-dominated.
        return "unbounded (time did not grow with work)"
    return f"{rate / 1e9:.2f} GFLOP/s"
