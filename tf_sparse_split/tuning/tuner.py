"""``ThresholdTuner``: per-layer split-threshold policy and reporting that
any training loop can drive (Keras ``fit`` through
:class:`~tf_sparse_split.callbacks.SplitThresholdCallback`, or a custom loop
with ``strategy.run`` under any ``tf.distribute`` strategy).

The sparsity of a ReLU network's activations differs between layers and
changes from epoch to epoch (R. Sun and L. Zhang, "Dynamic Sparse Method for
Deep Learning Execution", 2019), so one fixed threshold is not right for all
layers or all of training. The threshold never changes the results, only
the speed.

One estimator. The tuner fits no model of its own. The rates it decides
with are the ops' (K.-Y. Peng, NTU 2017: per path a fixed cost plus work
over a measured rate, with the CSR conversion and the copies;
``cc/core/cost_model.h``): each problem family's ``FamilyModel`` in the op
library, calibrated on the family's first automatic call and then scaled by
the median of the last calls' measured/predicted ratios. Every call writes
its shape and its family's current terms into the statistics vector it
returns (``stats.COST_FIRST`` .. ``stats.COST_LAST``); the tuner reads them
with the rest of the statistics and asks the ops' own decision
(``DecideSplit``, its margins and hysteresis) which threshold it picks for
the epoch's mean row-density histogram (:mod:`~tf_sparse_split.tuning.
op_model`, which says why the terms travel in the statistics rather than
through the pybind11 module).

Who decides when (the one rule; docs/ARCHITECTURE.md, "The cost model"):

* **The op decides per call** for every layer whose threshold is automatic
  (negative or ``'auto'``, the layers' default): it chooses the plan from
  its family's terms and the call's own row densities, as it would without
  a tuner.
* **The tuner sets policy and reports between epochs.** At the end of each
  epoch it computes the threshold the op's model picks for the epoch and
  then, by ``policy``:

  - ``"auto"`` (default): a layer that is automatic when training begins
    stays automatic -- nothing is written into its threshold variable, and
    the reported threshold is the op model's pick; a layer with a fixed
    threshold (a number in [0, 1]) is *tuned*: explored in the first epoch,
    then set (``layer.set_threshold``) to the pick for the next epoch.
  - ``"fixed"``: every layer is tuned; automatic layers are switched to a
    fixed threshold on purpose (e.g. for a reproducible speed).
  - ``"report"``: nothing is written; every layer keeps its threshold.

  The history entry's ``mode`` says which applied to each layer:
  ``"auto"`` (the op decides), ``"tuned"`` (the tuner wrote the threshold)
  or ``"kept"`` (a fixed threshold left as it was).

A tuned layer's family may never run automatically, and then is never
calibrated: its terms come from the calls' own times (``FamilyModel``
learns an unknown path's rate from its first observation, then follows the
measured/predicted ratios), which is why the first epoch explores both paths
and why a path's terms are used only after ``min_samples`` sampled calls ran
it (a calibrated family's terms are used at once).

Host synchronisation. The layers accumulate their statistics in variables
on the device at every call. The tuner reads them (one device-to-host copy of
all layers' statistics, :func:`_to_numpy`) only

* after each of the first epoch's ``explore_batches`` batches (both paths
  must be timed),
* after ``samples_per_epoch`` sampled batches per epoch, and
* at the beginning and the end of each epoch (the epoch's totals and its
  last call's terms),

so a steady-state step adds no host sync.

Distribution. Under a ``tf.distribute`` strategy every read is an
all-reduce (``SUM``) over all replicas of all workers, inside
``strategy.run``: every replica and worker then holds the same statistics and
makes the same decisions; the thresholds decided on replica 0 (the chief) are
then broadcast (an all-reduce of the chief's values and zeros elsewhere), so
all replicas and workers run with bit-identical thresholds. Every worker must
therefore call the tuner's methods at the same batches (they do when all run
the same loop over an auto-sharded dataset). Samples and terms are the mean
over replicas of one call; epoch totals are sums over all replicas' calls.

Layers. The tuner imports no layer module: it works with any object that
has what :func:`is_split_layer` checks (``statistics_variables()``,
``set_threshold``, ``reset_stats``, ``threshold``, ``name``), which
:class:`~tf_sparse_split.layers.SparseSplitLayer` provides.

Usage in a custom loop::

    tuner = ThresholdTuner(model, strategy=strategy, log_dir="tb")
    tuner.begin_training()
    for epoch in range(epochs):
        tuner.begin_epoch(epoch, steps=steps_per_epoch)
        for step in range(steps_per_epoch):
            tuner.before_batch(step)
            strategy.run(train_step, args=(next(iterator),))
        record = tuner.end_epoch(epoch)   # thresholds set for next epoch
    tuner.close()

Resuming. ``begin_training(resume=True)`` (what
:class:`~tf_sparse_split.callbacks.SplitThresholdCallback` calls at every
``fit`` after the first on the same model) keeps what was learned -- the
sample counts, the last plans, tuned thresholds, history, the epoch count,
so no exploration (the op library keeps its family terms for the process
anyway) -- when the model's sparse-split layers are the objects, with the
names and built shapes (batch dimension aside) and kernel shapes, that the
tuner had at its last :meth:`~ThresholdTuner.end_epoch`; otherwise it starts
over.
"""

import math
import os

import numpy as np
import tensorflow as tf

from tf_sparse_split.tuning import op_model as _op_model
from tf_sparse_split.tuning import stats as _stats
from tf_sparse_split.tuning.op_model import DENSE, SPARSE
from tf_sparse_split.utils.tracing import function_per_instance
from tf_sparse_split.utils.validation import validate_int

__all__ = ["ThresholdTuner", "find_split_layers", "is_split_layer",
           "layer_key", "is_chief", "POLICIES", "SCALAR_TAGS",
           "HISTOGRAM_TAG"]

#: Values of ``ThresholdTuner(policy=...)`` (see "Who decides when").
POLICIES = ("auto", "fixed", "report")

#: Per-layer scalar summaries written each epoch (tag ``<layer>/<name>``):
#: fraction of zeros of the layer's input, threshold for the next epoch
#: (for an automatic layer: the op model's pick), rows sent to each path
#: (summed over the epoch's calls), seconds in each path and in the
#: analysis (summed), all-zero columns skipped (mean per call).
SCALAR_TAGS = ("input_sparsity", "threshold", "rows_dense", "rows_sparse",
               "seconds_dense", "seconds_sparse", "seconds_analyze",
               "zero_columns_skipped")
#: Per-layer histogram summary (tag ``<layer>/<name>``): rows per row-density
#: bin over the epoch (``stats.DENSITY_BINS`` equal bins over [0, 1]).
HISTOGRAM_TAG = "row_density"

# One read of a layer: [latest | total | calls].
_WIDTH = 2 * _stats.NUM_STATS + 1

# What a layer must have for the tuner (see is_split_layer).
_PROTOCOL_METHODS = ("statistics_variables", "set_threshold", "reset_stats")


def is_split_layer(obj):
    """Whether ``obj`` is a layer the tuner can drive: it has the methods
    ``statistics_variables()`` (None before build, else the ``latest``,
    ``total``, ``calls`` variables), ``set_threshold(value)`` and
    ``reset_stats()``, and the attributes ``threshold`` (float, negative =
    automatic) and ``name`` -- what
    :class:`~tf_sparse_split.layers.SparseSplitLayer` provides."""
    return all(callable(getattr(obj, m, None)) for m in _PROTOCOL_METHODS) \
        and hasattr(obj, "threshold")


def find_split_layers(model):
    """Every sparse-split layer (:func:`is_split_layer`, e.g. each
    :class:`~tf_sparse_split.layers.SparseSplitLayer`) of ``model``
    (recursively through nested models and layers; ``model`` itself too), in
    model order, each once. ``model`` may also be a list of layers/models."""
    roots = model if isinstance(model, (list, tuple)) else [model]
    found, seen = [], set()
    for root in roots:
        candidates = [root]
        flatten = getattr(root, "_flatten_layers", None)
        if flatten is not None:
            candidates = list(flatten(include_self=True, recursive=True))
        for layer in candidates:
            if is_split_layer(layer) and id(layer) not in seen:
                seen.add(id(layer))
                found.append(layer)
    return found


def _shape_key(layer):
    """What of ``layer``'s shapes the cost model depends on: its built input
    shape without the batch dimension and its kernel's shape (None before
    ``build``)."""
    if not getattr(layer, "built", False):
        return None
    config = layer.get_build_config() or {}
    shape = config.get("input_shape")
    if isinstance(shape, (list, tuple)) and all(
            d is None or isinstance(d, int) for d in shape):
        shape = tuple(shape[1:])
    else:
        shape = repr(config)
    kernel = getattr(layer, "kernel", None)
    return shape, None if kernel is None else tuple(kernel.shape)


def layer_key(model):
    """The identity of ``model``'s tuning problem: for each sparse-split
    layer found in it (:func:`find_split_layers`, in order), the layer
    object's ``id``, its name and :func:`_shape_key`. A
    tuner resumes only while this key is unchanged."""
    return tuple((id(layer), layer.name, _shape_key(layer))
                 for layer in find_split_layers(model))


def is_chief(strategy):
    """Whether this process is the chief of ``strategy``'s cluster: the task
    of type ``chief``, or worker 0 when there is none; True without a
    multi-worker cluster (or for None)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not getattr(resolver, "task_type", None):
        return True
    if resolver.task_type == "chief":
        return True
    cluster = resolver.cluster_spec().as_dict()
    return (resolver.task_type == "worker" and resolver.task_id == 0 and
            "chief" not in cluster)


def _to_numpy(tensor):
    """The one place where the tuner copies statistics to the host (tests
    count calls to it)."""
    return np.asarray(tensor.numpy(), dtype=np.float64)


class _LayerState:
    """Per-layer bookkeeping of the tuner.

    Attributes:
      layer: the layer.
      threshold: the layer's own threshold (restored after exploration, the
        last one written when tuned; kept here so that the tuner never reads
        the variable back).
      tuned: whether the tuner writes this layer's threshold (policy).
      problem: the :class:`~tf_sparse_split.tuning.op_model.OpCostProblem`
        of the layer's last call read at an epoch's end (None before).
      plan: the plan the op's model chose at the last epoch end (hysteresis).
    """

    def __init__(self, layer, tuned, warmup_samples):
        self.layer = layer
        self.threshold = layer.threshold
        self.tuned = tuned
        self.warmup_samples = warmup_samples
        self.epoch_start = None      # (total, calls) at the epoch's start
        self.epoch_end = None        # (total, calls) after its last batch
        self.latest_end = None       # latest vector after its last batch
        self.problem = None
        self.plan = None
        self._samples = {DENSE: 0, SPARSE: 0}
        self._skipped = {DENSE: 0, SPARSE: 0}

    def add_sample(self, latest):
        """Counts the paths one sampled call ran (rows, work and a measured
        time: what the op's FamilyModel records), after the first
        ``warmup_samples`` of each path."""
        ran = {
            DENSE: latest[_stats.ROWS_DENSE] > 0 and
            latest[_stats.TIME_DENSE] > 0,
            SPARSE: latest[_stats.ROWS_SPARSE] > 0 and
            latest[_stats.NNZ_SPARSE] > 0 and latest[_stats.TIME_SPARSE] > 0,
        }
        for path, did in ran.items():
            if not did:
                continue
            if self._skipped[path] < self.warmup_samples:
                self._skipped[path] += 1
            else:
                self._samples[path] += 1

    def num_samples(self, path):
        """Sampled calls (after warm-up) that ran ``path``."""
        return self._samples[path]


class ThresholdTuner:
    """Sets and reports the layers' split thresholds between epochs from the
    ops' own cost model (see "Who decides when" in the module docstring).

    Args:
      model: a Keras model or layer, or a list of them: the sparse-split
        layers found in it (:func:`find_split_layers`) are driven; layers
        built later (by the first step) are picked up at the next
        :meth:`before_batch`.
      strategy: the ``tf.distribute.Strategy`` the model was built under, or
        None for the current one (``tf.distribute.get_strategy()``).
      explore_batches: int >= 0, batches of the first epoch spent alternating
        every tuned layer's threshold between 1.0 (all rows sparse) and 0.0
        (all nonzero rows dense) so that both paths are timed; then the
        layers' own thresholds are restored (0 = no exploration). Automatic
        layers under ``policy="auto"`` are not explored: their op calibrates
        their family itself.
      samples_per_epoch: int >= 0, batches per epoch (after exploration)
        whose statistics are read as samples, spread over the epoch when its
        length is known.
      min_samples: int >= 1, sampled calls that must have run a path before
        the op's terms for it are used to tune, unless the family was
        calibrated.
      warmup_samples: int >= 0, first sampled calls of each path and layer
        that are not counted (first calls are slow: allocation, page faults;
        the op's ratio window absorbs them after a few calls).
      log_dir: directory for TensorBoard event files (``tf.summary``): per
        layer and epoch the scalars :data:`SCALAR_TAGS` and the histogram
        :data:`HISTOGRAM_TAG`; None (default) writes nothing. Only the chief
        (worker 0) writes.
      policy: one of :data:`POLICIES`: ``"auto"`` (default: automatic
        layers stay automatic, fixed ones are tuned), ``"fixed"`` (every
        layer tuned to a fixed threshold), ``"report"`` (nothing written).

    Attributes:
      layers: the layers being driven.
      history: one dict per epoch, ``{"epoch": int, "layers": {name: entry}}``
        with entry keys ``mode`` (``"auto"``, ``"tuned"`` or ``"kept"``),
        ``sparsity`` (fraction of zeros of the input), ``threshold`` (for
        the next epoch: the value written or kept; for an ``"auto"`` layer
        the op model's pick, or the mean threshold the op used while the
        model cannot decide), ``predicted_threshold`` (the op model's pick
        for the epoch's mean row-density histogram, None while a path's
        terms are unknown or untrusted), ``threshold_used`` (mean over the
        epoch's calls), ``predicted_s`` and ``all_dense_s`` (the pick's and
        the all-dense plan's predicted seconds per call, None without a
        pick), ``dense_rate``/``sparse_rate`` (flop/s of the family's
        terms, None while unknown), ``dense_overhead``/``sparse_overhead``
        (fixed seconds per call of the terms), ``terms`` (the family's
        ``CostTerms`` dict after the epoch's last call), ``calibrated``,
        ``time_in_op`` (dense + sparse + analysis seconds, summed),
        ``time_dense``, ``time_sparse``, ``time_analyze`` (s, summed),
        ``rows_dense``, ``rows_sparse`` (summed), ``zero_cols_skipped``
        (mean per call), ``histogram`` (rows per density bin, summed) and
        ``calls``. The record also has ``explore_batches``: the epoch's
        batches spent exploring (0 after the first epoch, in a resumed
        training, and when no layer is tuned).
      host_reads: number of statistics reads (device-to-host copies) so far
        (kept by a resumed training).
      resumed: whether the latest :meth:`begin_training` kept what was
        learned (see "Resuming" in the module docstring).

    Raises:
      ValueError: on invalid arguments.
    """

    def __init__(self, model, strategy=None, explore_batches=6,
                 samples_per_epoch=4, min_samples=2, warmup_samples=1,
                 log_dir=None, policy="auto"):
        self.model = model
        self.explore_batches = validate_int(explore_batches, "explore_batches",
                                            0)
        self.samples_per_epoch = validate_int(samples_per_epoch,
                                              "samples_per_epoch", 0)
        self.min_samples = validate_int(min_samples, "min_samples", 1)
        self.warmup_samples = validate_int(warmup_samples, "warmup_samples", 0)
        if log_dir is not None and not isinstance(log_dir, (str, bytes)) and \
                not hasattr(log_dir, "__fspath__"):
            raise ValueError(f"log_dir must be a path or None, got {log_dir!r}")
        self.log_dir = None if log_dir is None else \
            os.fsdecode(os.fspath(log_dir))
        if not isinstance(policy, str) or policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got "
                             f"{policy!r}")
        self.policy = policy
        self._strategy_arg = strategy
        self.strategy = None
        self.history = []
        self.layers = []
        self.states = []
        self.host_reads = 0
        self._writer = None
        self._read_fn = None
        self._read_key = None
        self._broadcast_fn = None
        self._reset_epoch_state()
        self._exploring = False
        self._epochs_done = 0
        self._learned_key = None
        self.resumed = False

    def _tunes(self, threshold):
        """Whether the policy has the tuner write a layer whose own threshold
        is ``threshold``."""
        if self.policy == "fixed":
            return True
        if self.policy == "report":
            return False
        return threshold >= 0.0

    # -- distribution -----------------------------------------------------
    def _resolve_strategy(self):
        s = self._strategy_arg
        self.strategy = s if s is not None else tf.distribute.get_strategy()

    @property
    def num_replicas(self):
        """Replicas in sync (all workers), 1 without distribution."""
        return int(self.strategy.num_replicas_in_sync) if self.strategy else 1

    @property
    def is_chief(self):
        """Whether this process writes the logs (:func:`is_chief`)."""
        return is_chief(self.strategy)

    def _replicated(self, fn):
        """Runs ``fn`` (replica context -> tensor) on every replica and
        returns the all-reduced (SUM) value seen by this worker."""
        def replica_fn():
            value = fn()
            ctx = tf.distribute.get_replica_context()
            return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)

        result = self.strategy.run(replica_fn)
        return self.strategy.experimental_local_results(result)[0]

    def _build_read_fn(self, states):
        layers = [s.layer for s in states]

        def local_stats():
            rows = []
            for layer in layers:
                sv = layer.statistics_variables()
                rows.append(tf.concat([
                    tf.convert_to_tensor(sv.latest),
                    tf.convert_to_tensor(sv.total),
                    tf.reshape(tf.cast(tf.convert_to_tensor(sv.calls),
                                       tf.float64), [1])], axis=0))
            return tf.stack(rows)

        if self.num_replicas == 1:
            return local_stats
        return function_per_instance(lambda: self._replicated(local_stats))

    def _read(self, states):
        """One host read of ``states``' statistics: dict state ->
        (latest sample averaged over replicas, total, calls)."""
        key = tuple(id(s.layer) for s in states)
        if self._read_key != key:
            self._read_fn, self._read_key = self._build_read_fn(states), key
        values = _to_numpy(self._read_fn())
        self.host_reads += 1
        n = _stats.NUM_STATS
        out = {}
        for s, row in zip(states, values):
            out[id(s)] = (row[:n] / self.num_replicas, row[n:2 * n],
                          int(round(row[2 * n])))
        return out

    def _broadcast_thresholds(self, values):
        """The chief's (replica 0's) ``values`` on every replica/worker."""
        values = np.asarray(values, dtype=np.float64)
        if self.num_replicas == 1:
            return values
        if self._broadcast_fn is None:
            def broadcast(v):
                def chief_only():
                    ctx = tf.distribute.get_replica_context()
                    return tf.where(
                        tf.equal(ctx.replica_id_in_sync_group, 0), v,
                        tf.zeros_like(v))

                return self._replicated(chief_only)

            self._broadcast_fn = tf.function(broadcast)
        self.host_reads += 1
        return _to_numpy(self._broadcast_fn(tf.constant(values)))

    # -- layer discovery --------------------------------------------------
    @staticmethod
    def _is_built(layer):
        return layer.statistics_variables() is not None

    def _built(self):
        return [s for s in self.states if self._is_built(s.layer)]

    def _discover(self):
        known = {id(s.layer) for s in self.states}
        new = []
        for layer in find_split_layers(self.model):
            if id(layer) not in known:
                state = _LayerState(layer, self._tunes(layer.threshold),
                                    self.warmup_samples)
                self.states.append(state)
                new.append(state)
        self.layers = [s.layer for s in self.states]
        return new

    def _needs_discovery(self, batch):
        if not self.states:
            # Layers appear at the latest with the first step's build.
            return self._epochs_done == 0 and batch <= 1
        return any(not self._is_built(s.layer) for s in self.states)

    # -- driving ----------------------------------------------------------
    def _reset_epoch_state(self):
        self._epoch = None
        self._steps = None
        self._sample_at = set()
        self._pending = False
        self._pending_sample = set()
        self._epoch_closed = False
        self._explored = 0

    def begin_training(self, resume=False):
        """Starts a training run: finds the layers, resets their statistics
        and, unless resuming, the sample counts, plans and :attr:`history`.

        Args:
          resume: if True, and the model's sparse-split layers are the ones
            (same objects, names and shapes: :func:`layer_key`) of the last
            :meth:`end_epoch`, keeps the sample counts, the last plans, the
            tuned thresholds (a threshold set on a layer since then is taken
            as its own, and decides under ``policy="auto"`` whether the
            layer is tuned or stays automatic), :attr:`history` and the
            epoch count, so that no batch explores again; otherwise (or if
            False, the default) starts over. :attr:`resumed` tells which
            happened.
        """
        self._resolve_strategy()
        self.resumed = bool(resume) and self._learned_key is not None and \
            self._learned_key == layer_key(self.model)
        if self.resumed:
            self._reset_epoch_state()
            self._exploring = False
            for s in self._built():
                s.threshold = s.layer.threshold  # once per run, not per batch
                s.tuned = self._tunes(s.threshold)
                s.layer.reset_stats()
            self._open_writer()
            return
        self._learned_key = None
        self.history = []
        self.states = []
        self.host_reads = 0
        self._read_fn = self._read_key = None
        self._exploring = False
        self._epochs_done = 0
        self._reset_epoch_state()
        for s in self._discover():
            if self._is_built(s.layer):
                s.layer.reset_stats()
        self._open_writer()

    def _open_writer(self):
        if self.log_dir is not None and self.is_chief and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def begin_epoch(self, epoch, steps=None):
        """Marks the start of an epoch (reads the statistics totals once).

        Args:
          epoch: int, the epoch index (the summaries' step).
          steps: batches in the epoch if known (spreads the sampled batches
            over it), else None (the first batches after exploration are
            sampled).
        """
        if self.strategy is None:
            self.begin_training()
        self._reset_epoch_state()
        self._epoch = int(epoch)
        self._steps = None if steps is None else int(steps)
        first = self._epochs_done == 0
        start = self.explore_batches if first else 0
        n = self.samples_per_epoch
        if n > 0:
            if self._steps is not None:
                if self._steps > start:
                    picks = np.linspace(start, self._steps - 1,
                                        min(n, self._steps - start))
                    self._sample_at = {int(round(p)) for p in picks}
            else:
                self._sample_at = set(range(start, start + n))
        built = self._built()
        if built:
            values = self._read(built)
            for s in built:
                s.epoch_start = values[id(s)][1:]
        for s in self.states:
            if not self._is_built(s.layer):
                s.epoch_start = None

    def before_batch(self, batch):
        """Call before running training batch ``batch`` (0-based within the
        epoch) on every worker: takes the sample of the previous batch if it
        was sampled, sets the tuned layers' exploration thresholds, and
        schedules this batch's sample. Reads from the device only after
        sampled and exploration batches."""
        if self._epoch is None:
            self.begin_epoch(self._epochs_done)
        batch = int(batch)
        self._take_pending_sample()
        if self._needs_discovery(batch):
            for s in self._discover():
                # Built by the step that just ran: its statistics so far are
                # this epoch's (epoch_start None counts from zero).
                s.epoch_start = None
        explore = self._epochs_done == 0 and batch < self.explore_batches
        explored = [s for s in self._built() if s.tuned] if explore else []
        if explored:
            value = 1.0 if batch % 2 == 0 else 0.0
            for s in explored:
                s.layer.set_threshold(value)
            self._exploring = True
            self._explored += 1
        elif self._exploring:
            self._restore_thresholds()
        if explored or batch in self._sample_at:
            self._pending = True
            self._pending_sample = {id(s) for s in self._built()}

    def _restore_thresholds(self):
        for s in self._built():
            if s.tuned:
                s.layer.set_threshold(s.threshold)
        self._exploring = False

    def _take_pending_sample(self, values=None):
        if not self._pending:
            return values
        built = self._built()
        if values is None and built:
            values = self._read(built)
        for s in built:
            if id(s) in self._pending_sample:
                s.add_sample(values[id(s)][0])
        self._pending = False
        self._pending_sample = set()
        return values

    def end_epoch_batches(self):
        """Call after the epoch's last training batch, before any validation
        calls: reads the epoch's totals and its last call's terms (and the
        last sample). Called by :meth:`end_epoch` if not called before;
        calling it twice in an epoch does nothing."""
        if self._epoch_closed:
            return
        built = self._built()
        values = self._read(built) if built else None
        self._take_pending_sample(values)
        if self._exploring:
            self._restore_thresholds()
        for s in built:
            s.epoch_end = values[id(s)][1:]
            s.latest_end = values[id(s)][0]
        self._epoch_closed = True

    def end_epoch(self, epoch=None):
        """Decides each layer's threshold with the op's model, writes it into
        the tuned layers (the same on every replica and worker), writes the
        summaries, and returns the epoch's record (also appended to
        :attr:`history`)."""
        if self._epoch is None:
            self.begin_epoch(self._epochs_done if epoch is None else epoch)
        epoch = self._epoch if epoch is None else int(epoch)
        self.end_epoch_batches()
        built = self._built()
        entries = [self._update_layer(s) for s in built]
        if built:
            chosen = self._broadcast_thresholds(
                [e.pop("_threshold") for e in entries])
            for s, entry, value in zip(built, entries, chosen):
                value = float(np.float32(value))
                if s.tuned:
                    s.layer.set_threshold(value)
                    s.threshold = value
                entry["threshold"] = value
        record = {"epoch": epoch,
                  "layers": {s.layer.name: e for s, e in zip(built, entries)},
                  "explore_batches": self._explored}
        self.history.append(record)
        self._write_summaries(record)
        self._epochs_done += 1
        self._learned_key = layer_key(self.model)
        self._reset_epoch_state()
        return record

    def close(self):
        """Flushes and closes the summary writer (if any)."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    # -- per-layer decision -------------------------------------------------
    def _update_layer(self, s):
        if s.epoch_end is None:
            v, calls = np.zeros(_stats.NUM_STATS), 0
        else:
            v, calls = s.epoch_end
            if s.epoch_start is not None:
                v = v - s.epoch_start[0]
                calls = calls - s.epoch_start[1]
        current = s.threshold
        mode = "tuned" if s.tuned else ("auto" if current < 0 else "kept")
        entry = {"mode": mode, "sparsity": float("nan"),
                 "threshold": current, "_threshold": current,
                 "predicted_threshold": None, "predicted_s": None,
                 "all_dense_s": None,
                 "threshold_used": (float(v[_stats.THRESHOLD]) / calls
                                    if calls > 0 else float("nan")),
                 "dense_rate": None, "sparse_rate": None,
                 "dense_overhead": None, "sparse_overhead": None,
                 "terms": None, "calibrated": False,
                 "time_dense": float(v[_stats.TIME_DENSE]),
                 "time_sparse": float(v[_stats.TIME_SPARSE]),
                 "time_analyze": float(v[_stats.TIME_ANALYZE]),
                 "time_in_op": float(v[_stats.TIME_DENSE] +
                                     v[_stats.TIME_SPARSE] +
                                     v[_stats.TIME_ANALYZE]),
                 "rows_dense": float(v[_stats.ROWS_DENSE]),
                 "rows_sparse": float(v[_stats.ROWS_SPARSE]),
                 "zero_cols_skipped": (float(v[_stats.ZERO_COLS_SKIPPED]) /
                                       calls if calls else 0.0),
                 "histogram": [float(h) for h in v[_stats.HISTOGRAM]],
                 "calls": int(calls)}
        if s.latest_end is not None:
            s.problem = _op_model.cost_problem(s.latest_end)
        if s.problem is not None:
            terms = s.problem.terms
            entry["terms"] = dict(terms)
            entry["calibrated"] = s.problem.calibrated
            for path in (DENSE, SPARSE):
                if s.problem.known(path):
                    entry[f"{path}_rate"] = float(terms[f"{path}_rate"])
                    entry[f"{path}_overhead"] = float(terms[f"{path}_fixed_s"])
        if calls <= 0:
            return entry
        k = v[_stats.K] / calls
        elems = v[_stats.M] / calls * k
        if elems > 0:
            entry["sparsity"] = float(1.0 - v[_stats.NNZ] / calls / elems)
        if mode == "auto":
            # What the op used, until its model can say what it picks.
            entry["threshold"] = entry["_threshold"] = entry["threshold_used"]
        trusted = s.problem is not None and (
            s.problem.calibrated or
            all(s.num_samples(p) >= self.min_samples for p in (DENSE, SPARSE)))
        if not trusted:
            return entry
        plan = _op_model.decide(
            _op_model.epoch_vector(s.latest_end, v, calls), previous=s.plan)
        if plan is None:
            return entry
        s.plan = plan
        pick = float(plan["threshold"])
        entry["predicted_threshold"] = pick
        entry["predicted_s"] = float(plan["predicted_s"])
        entry["all_dense_s"] = float(plan["all_dense_s"])
        if mode != "kept":
            entry["threshold"] = entry["_threshold"] = pick
        return entry

    # -- TensorBoard --------------------------------------------------------
    def _write_summaries(self, record):
        if self._writer is None:
            return
        from tensorflow.core.framework import summary_pb2

        # Written with tf.summary.write and the metadata of TensorBoard's
        # scalar and histogram plugins (what tf.summary.scalar/histogram
        # write), so that no tensorboard package is needed to log.
        hist_meta = summary_pb2.SummaryMetadata()
        hist_meta.plugin_data.plugin_name = "histograms"
        scalar_meta = summary_pb2.SummaryMetadata()
        scalar_meta.plugin_data.plugin_name = "scalars"
        step = int(record["epoch"])
        bins = _stats.DENSITY_BINS
        edges = np.arange(bins + 1, dtype=np.float64) / bins
        with self._writer.as_default():
            for name, e in record["layers"].items():
                scalars = {
                    "input_sparsity": e["sparsity"],
                    "threshold": e["threshold"],
                    "rows_dense": e["rows_dense"],
                    "rows_sparse": e["rows_sparse"],
                    "seconds_dense": e["time_dense"],
                    "seconds_sparse": e["time_sparse"],
                    "seconds_analyze": e["time_analyze"],
                    "zero_columns_skipped": e["zero_cols_skipped"],
                }
                for tag in SCALAR_TAGS:
                    value = scalars[tag]
                    if value is None or not math.isfinite(value):
                        continue
                    tf.summary.write(f"{name}/{tag}",
                                     tf.constant(value, tf.float32),
                                     step=step, metadata=scalar_meta)
                # TensorBoard's histogram format: [bins, 3] rows of
                # (left edge, right edge, count).
                hist = np.stack([edges[:-1], edges[1:],
                                 np.asarray(e["histogram"])], axis=1)
                tf.summary.write(f"{name}/{HISTOGRAM_TAG}",
                                 tf.constant(hist, tf.float64), step=step,
                                 metadata=hist_meta)
        self._writer.flush()
