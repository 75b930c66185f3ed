"""Keras callback that trains within a time budget by choosing, per layer,
how much activation sparsity to create and exploit (R. Sun and L. Zhang,
*Dynamic Sparse Method for Deep Learning Execution*, 2019).

The controller (prediction, allocation, feedback) is
:mod:`tf_sparse_split.tuning.budget`; this module is its wiring into
``fit``: it finds the knobs, measures the steps, the layers' statistics and
their sensitivities, and applies the controller's targets.

Knobs, per controlled sparse-split layer ``L`` (found as
:class:`~tf_sparse_split.callbacks.SparsityTargetCallback` finds them,
:mod:`~tf_sparse_split.callbacks._discovery`: the ReLU-family activation
feeding ``L``, converted in place to a
:class:`~tf_sparse_split.layers.FATReLU`):

* the FATReLU's quantile target (a non-trainable variable the compiled step
  reads, so a change takes effect at the next step without retracing): the
  fraction of zeros wanted at ``L``'s input, corrected by feedback on the
  zeros ``L`` measures (its op statistics) as the sparsity-target callback
  does;
* the rate of an :class:`~tf_sparse_split.layers.ApproximateRandomDropout`
  between the activation and ``L``, within ``[min_rate, max_rate]``: a
  variable the compiled step reads (:meth:`~tf_sparse_split.layers.
  ApproximateRandomDropout.set_rate`), so it moves between steps like the
  target. Its zeros add to ``L``'s input, so ``L``'s own cost predicts its
  effect (:func:`~tf_sparse_split.tuning.budget.combined_sparsity`); the
  activation target is then the activation's share of the zeros,
  ``1 - (1 - measured) / (1 - rate)``;
* likewise the rate of a :class:`~tf_sparse_split.layers.
  SensitivityAwareDropout` (channel dropout of NHWC feature maps, Song et
  al., arXiv 2203.05705) between the activation and a sparse-split
  convolution ``L``: its number of dropped channels is a variable the
  compiled step reads (:meth:`~tf_sparse_split.layers.
  SensitivityAwareDropout.set_rate`). Its dropped channels are all-zero
  input channels that ``L``'s dense path compacts away, so ``L``'s
  predicted dense part shrinks with the kept channels too
  (``RateKnob.compacts``), and the rate counted is the realized one,
  ``round(rate * channels) / channels``.

And per :class:`~tf_sparse_split.layers.SparseSplitLSTM` (every one, or
those named in ``layers``) with ``pattern`` ``"subset"`` or ``"row"``: its
recurrent dropout rate (and with ``"row"`` its input dropout rate, the
input product being compacted then too), within ``[min_rate, max_rate]``
(:meth:`~tf_sparse_split.layers.SparseSplitLSTM.set_rates`, variables the
compiled step reads; with ``compaction="auto"`` a rate that changes
whether the step compacts retraces it). No op statistics describe the
LSTM's own loop, so its cost is measured (a rate whose step multiplies by
the masks instead of compacting buys no time, and the probe measures
that): after the warm-up each LSTM rate runs ``probe_steps``
steps at a second rate (its floor + 0.2, or - 0.2 at the top), and the
step seconds per unit of kept work come from the two medians
(:class:`~tf_sparse_split.tuning.budget.RateCost`; kept work ``(1 -
rate) ** recurrent_group_share`` for the subsets' compacted units, ``1 -
rate`` for row patterns). A rate whose probe shows no saving is left at
its floor.

Rates are the second tier: a dropout rate is a regulariser whose effect on
accuracy a held batch does not show, so the allocation raises rates only
when the activation targets at ``max_sparsity`` cannot meet the budget,
and lowers them first when there is slack; each rate's floor is the
layer's own rate clipped to ``[min_rate, max_rate]``.

Sensitivity (Song et al., arXiv 2203.05705, measured here as the loss
response): with ``sensitivity_data=(x, y)`` the callback evaluates the loss
on that held batch (inference mode) with each controlled activation's
cutoff raised, one at a time, to the quantile that adds ``0.05`` to its
output's fraction of zeros; ``(loss - base loss) / 0.05`` is the layer's
sensitivity. It is measured when the warm-up ends and at every epoch end,
unless fewer than two controlled layers' sparsity is predicted to buy time
(``BudgetController.layers_that_buy_time``): the sensitivities only weigh
such layers against each other, so the probe could not change the
allocation (it is skipped, and the log says so).
Without a held batch every layer gets the same sensitivity (then the
allocation follows the time saved alone), which the log says.
"""

import math
import os
import time

import keras
import numpy as np

from tf_sparse_split.callbacks._discovery import (_parent, fatrelu_for,
                                                  find_activation_producer,
                                                  find_lstm_layers,
                                                  mask_input_grad,
                                                  no_control_message,
                                                  reset_compiled_functions,
                                                  select_split_layers)
from tf_sparse_split.callbacks.sparsity_target import _Control
from tf_sparse_split.tuning import budget as _budget
from tf_sparse_split.tuning.deadline import WallTimePlan, median_over_mean
from tf_sparse_split.utils.tracing import function_per_instance
from tf_sparse_split.utils.validation import (check_fits_model_input,
                                              check_labels_in_classes,
                                              model_classes, validate_int)

__all__ = ["TimeBudgetCallback", "SensitivityProbe", "layer_sensitivities"]

#: Sparsity added per layer by the sensitivity probe.
SENSITIVITY_DELTA = 0.05
#: Rate added (or taken off at the top) by the warm-up probe of an LSTM
#: rate.
PROBE_DELTA = 0.2
#: Recent timed steps whose median / mean ratio turns a wall-time step
#: budget (a mean) into the median the controller measures.
SKEW_WINDOW = 32
#: Timed steps whose median / mean ratio, where below the recent one's,
#: scales the budget the targets may fall to (bursts of load seen earlier
#: in the fit may come again).
LONG_SKEW_WINDOW = 1024

#: Consecutive decisions that must find an epoch time or deadline reachable
#: before it is announced as reachable again (a predicted end within a few
#: percent of the deadline would otherwise flip the message every few
#: steps); becoming unreachable is announced at once. Decisions at
#: unchanged settings come every ``BudgetController.recheck`` (4) steps:
#: about 20 steps.
DEADLINE_HOLD = 5

#: What ``TimeBudgetCallback`` leaves the model at after ``fit``:
#: ``"last_epoch"`` (each FATReLU's median cutoff and target, each dropout
#: layer's median rate over the last epoch) or ``"last"`` (the last step's).
FINAL_SETTINGS = ("last_epoch", "last")
#: Least statistics reads (``update_every`` steps apart) the last-epoch
#: median is taken over; a shorter last epoch takes the latest reads.
SETTLE_MIN_READS = 4


def _new_overhead():
    return {"step_s": 0.0, "steps": 0, "probe_s": 0.0, "probes": 0,
            "probes_skipped": 0, "epoch_end_s": 0.0}


class _Knob(_Control):
    """A controlled activation (+ optional dropout layers) and its
    consumer."""

    def __init__(self, consumer, owner, fat, dropouts):
        super().__init__(consumer, owner, fat)
        self.dropouts = dropouts
        # The user's rates: remembered on the layer the first time, so a
        # further fit starts from them, not from a rate a budget raised.
        for d in dropouts:
            if not hasattr(d, "_tfss_own_rate"):
                d._tfss_own_rate = d.rate
        self.own_rates = [d._tfss_own_rate for d in dropouts]
        self.name = consumer.name


class _LSTMRate:
    """One dropout rate (``attr`` "dropout" or "recurrent_dropout") of a
    SparseSplitLSTM, as a rate knob named ``layer/attr``."""

    def __init__(self, layer, attr):
        self.layer, self.attr = layer, attr
        self.name = f"{layer.name}/{attr}"
        own = getattr(layer, "_tfss_own_rates", None)
        if own is None:
            own = layer._tfss_own_rates = {
                "dropout": float(layer.cell.dropout),
                "recurrent_dropout": float(layer.cell.recurrent_dropout)}
        self.own_rate = own[attr]
        share = float(layer.cell.recurrent_group_share)
        if attr == "recurrent_dropout" and layer.cell.pattern == "subset":
            self.kept = lambda r, s=share: (1.0 - r) ** s
        else:
            self.kept = lambda r: 1.0 - r

    @property
    def rate(self):
        return float(getattr(self.layer.cell, self.attr))

    def set(self, rate):
        """Sets the rate; True if the compiled step must be retraced."""
        return self.layer.set_rates(**{self.attr: float(rate)})


def _lstm_rates(lstm):
    """The rate knobs of a SparseSplitLSTM: the recurrent rate with
    ``pattern`` subset or row, the input rate with row (the patterns whose
    dropped units are compacted out of the products)."""
    pattern = lstm.cell.pattern
    out = []
    if pattern in ("subset", "row"):
        out.append(_LSTMRate(lstm, "recurrent_dropout"))
    if pattern == "row":
        out.append(_LSTMRate(lstm, "dropout"))
    return out


def _dropouts_between(consumer, owner):
    """The rate-knob dropouts (ApproximateRandomDropout,
    SensitivityAwareDropout) between an activation and its consumer."""
    from tf_sparse_split.layers.dropout import (ApproximateRandomDropout,
                                                SensitivityAwareDropout)

    out, node = [], _parent(consumer)
    while node is not None and node is not owner:
        if isinstance(node, (ApproximateRandomDropout,
                             SensitivityAwareDropout)):
            out.append(node)
        node = _parent(node)
    return out


def _compacts(dropout):
    """Whether a dropout's zeros are whole input channels of the next
    layer (compacted out of its dense path)."""
    from tf_sparse_split.layers.dropout import SensitivityAwareDropout

    return isinstance(dropout, SensitivityAwareDropout)


def _realized(dropout, rate):
    """The drop rate a dropout runs at when set to ``rate`` (a
    SensitivityAwareDropout drops a whole number of channels)."""
    channels = getattr(dropout, "channels", None)
    if _compacts(dropout) and channels:
        return min(int(round(rate * channels)), channels - 1) / channels
    return rate


def _batch_len(a):
    """The leading dimension of an array or tensor (None when unknown or
    not array-like, e.g. a dict of inputs)."""
    shape = getattr(a, "shape", None)
    if shape is None and isinstance(a, (list, tuple)):
        shape = np.shape(a)
    try:
        n = shape[0] if shape is not None and len(shape) else None
    except TypeError:
        return None
    return None if n is None else int(n)


def _loss_fn(model):
    loss = getattr(model, "loss", None)
    if loss is None:
        raise ValueError("the model has no loss (compile it first)")
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    if not callable(fn):
        raise ValueError(f"cannot use the model's loss {loss!r} for the "
                         "sensitivity probe (give a callable loss)")
    return fn


class SensitivityProbe:
    """The loss response of a model to more zeros at each of its FATReLUs
    (the functions traced once, reused on every measurement).

    Args:
      model: a compiled Keras model (its ``loss``) with symbolic inputs.
      fats: list of ``(owner, fatrelu)`` pairs: ``owner`` is the layer whose
        output the FATReLU produces (the FATReLU itself, or the layer it is
        the activation of).

      clock: a function returning seconds (default ``time.perf_counter``),
        for :attr:`steady_s`.

    Attributes:
      steady_s: seconds the latest :meth:`measure` took, less the tracing
        of its functions on the first one (what each further measurement
        costs; the deadline planning of :class:`TimeBudgetCallback` counts
        it at every epoch end).

    Raises:
      ValueError: a model without a usable loss.
    """

    def __init__(self, model, fats, clock=time.perf_counter):
        self.loss_fn = _loss_fn(model)
        self.clock = clock
        self.steady_s = 0.0
        self._traced = False
        self.fats = list(fats)
        loss_fn = self.loss_fn
        outs = list(getattr(model, "outputs", None) or [])
        ins = model.inputs[0] if len(model.inputs) == 1 else model.inputs
        if len(outs) == 1:
            # One pass gives the base loss and the activations.
            both = keras.Model(ins,
                               outs + [o.output for o, _ in self.fats])
            self._base = function_per_instance(lambda t, y: self._split(
                loss_fn, both(t, training=False), y))
        else:
            feats = keras.Model(ins, [o.output for o, _ in self.fats])
            self._base = function_per_instance(lambda t, y: (
                _mean_loss(loss_fn, y, model(t, training=False)),
                _as_list(feats(t, training=False))))
        self._loss = function_per_instance(lambda t, y: _mean_loss(
            loss_fn, y, model(t, training=False)))

    @staticmethod
    def _split(loss_fn, outs, y):
        outs = _as_list(outs)
        return _mean_loss(loss_fn, y, outs[0]), outs[1:]

    def measure(self, x, y, delta=SENSITIVITY_DELTA):
        """For each FATReLU in turn, the loss on ``(x, y)`` (inference
        mode) with its cutoff raised to the quantile of its output that
        adds ``delta`` to its fraction of zeros, the others unchanged; then
        restored.

        Args:
          x, y: a held batch (numpy or tensors).
          delta: sparsity added (fraction, in (0, 0.5]).

        Returns:
          ``(base_loss, [sensitivity per pair], [zeros fraction per
          pair])``; a sensitivity is ``(loss - base_loss) / delta``, loss
          units per unit of sparsity (may be < 0 on a noisy batch; the
          controller clips it).
        """
        import tensorflow as tf

        x = tf.convert_to_tensor(x)
        y = tf.convert_to_tensor(y)
        calls = []

        def loss():
            t = self.clock()
            v = float(self._loss(x, y))
            calls.append(self.clock() - t)
            return v

        t_start = self.clock()
        base, ys = self._base(x, y)
        base = float(base)
        base_s = self.clock() - t_start
        try:
            sens, zeros = self._each(x, y, ys, base, loss, delta)
        finally:
            total = self.clock() - t_start
            if not self._traced:
                # The first measurement traces both functions: count their
                # first calls at the later calls' median instead (the base
                # pass also returns the activations: about one call).
                typical = float(np.median(calls[1:])) if len(calls) > 1 \
                    else (calls[0] if calls else base_s)
                total -= max(base_s - typical, 0.0)
                if calls:
                    total -= max(calls[0] - typical, 0.0)
                self._traced = True
            self.steady_s = max(total, 0.0)
        return base, sens, zeros

    def _each(self, x, y, ys, base, loss, delta):
        if not isinstance(ys, (list, tuple)):
            ys = [ys]
        sens, zeros = [], []
        for (owner, fat), a in zip(self.fats, ys):
            # float32, as computed (a float64 copy doubled the quantile's
            # cost on these 10^5-10^6 values).
            a = np.asarray(a).reshape(-1)
            z = float(np.count_nonzero(a == 0.0)) / max(a.size, 1)
            zeros.append(z)
            cut = float(np.quantile(a, min(z + delta, 0.999)))
            old = fat.cutoff
            if cut <= old:
                sens.append(0.0)
                continue
            fat.cutoff_var.assign(cut)
            try:
                sens.append((loss() - base) / delta)
            finally:
                fat.cutoff_var.assign(old)
        return sens, zeros


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _mean_loss(loss_fn, y, pred):
    import tensorflow as tf

    return tf.reduce_mean(tf.cast(loss_fn(y, pred), tf.float32))


def layer_sensitivities(model, fats, x, y, delta=SENSITIVITY_DELTA):
    """``SensitivityProbe(model, fats).measure(x, y, delta)`` (one
    measurement; see :class:`SensitivityProbe`).

    Raises:
      ValueError: a model without a usable loss.
    """
    return SensitivityProbe(model, fats).measure(x, y, delta)


class TimeBudgetCallback(keras.callbacks.Callback):
    """Meets a step-time, epoch-time or whole-fit deadline by choosing the
    activation sparsity (and structured dropout rate) of each sparse-split
    layer at run time (Sun & Zhang 2019; module docstring).

    Every training step is timed (``clock``, seconds). After
    ``warmup_steps`` steps of plain ReLU training (which measure each
    layer's natural sparsity) the controller
    (:class:`~tf_sparse_split.tuning.budget.BudgetController`) decides
    whenever ``min_samples`` steps were measured at the settings in force:
    from the median of those steps, the layers' predicted op seconds
    (:class:`~tf_sparse_split.tuning.budget.LayerCost`, from their op
    statistics: the cost problem and the family's terms) and their
    sensitivities, it allocates sparsity where it saves the most time per
    unit of loss, moves each target by at most ``max_change`` per decision,
    and holds inside a dead band of 3% around the budget. So when steps
    slow down (another process takes a core) the targets rise, and when the
    machine is fast again they fall. A budget that the bounds cannot meet is
    logged (``verbose``; :attr:`decisions` ``action="unreachable"``) and the
    layers then run at ``max_sparsity`` -- those whose predicted time falls
    with sparsity by at least ``bound_gain`` of the step over their whole
    range; a layer whose prediction stays flat up to the bound is
    left where it is (more zeros there would cost accuracy and buy no
    time).

    Budgets (exactly one, seconds): ``step_time`` per training step;
    ``epoch_time`` per epoch (``on_epoch_begin`` to ``on_epoch_end``);
    ``deadline`` for the whole ``fit``, counted from the start of this
    callback's ``on_train_begin`` to ``on_train_end``. For the last two the
    step budget is re-planned at every step from the wall time left over
    the steps left (:class:`~tf_sparse_split.tuning.deadline.WallTimePlan`):
    everything already spent is measured -- the compilation and the
    sparse-split ops' calibration in the first steps, the warm-up at the
    natural sparsity -- so a slow first epoch leaves a smaller budget to
    the steps after it; what is still to come outside the steps (the gaps
    between steps, the epoch ends with validation and this callback's
    sensitivity probe) is predicted from what the fit has measured so far.
    The wall time is met by the steps' mean, the controller measures their
    median: the budget it is given is scaled by the recent steps' median /
    mean. A step short of the allocation is time lost for good, so the
    first move from the natural sparsity goes to the allocation at once
    (``BudgetController.decide(jump=True)``; later rises stay limited to
    ``max_change`` per decision, so that a burst of load does not send the
    targets to the bounds each time). When even the fastest allocation
    within the bounds (``Decision.best_s``) cannot end in time -- its
    predicted end, with the steps a change takes to act (the FATReLU
    cutoff's moving average, about ``momentum / (1 - momentum)`` steps) at
    the recent steps' time, is after the deadline -- the callback logs it
    once (``verbose``; :attr:`deadline_log`) and runs at the bounds; as
    long as the deadline is reachable, steps faster than needed raise the
    budget of the remaining ones, so sparsity falls again and the fit ends
    near the deadline rather than well before it. Falls are judged against
    a cautious budget (``fall_budget_s``): the epoch ends still to come at
    the mean of the measured ones (``WallTimePlan.cautious_boundary_s``;
    an end can stall for seconds when the next epoch's first batch waits
    on the input pipeline under load, and such stalls come again), the
    steps' median / mean of the whole fit where it is below the recent
    one's (sparsity given back on a prediction that turns out short
    cannot be bought back at the bounds), and may then be as large as
    rises. ``epoch_time`` and ``deadline``
    need a known number of steps per epoch.

    Logs (``on_epoch_end``, for ``History``, the progress bar and
    ``keras.callbacks.TensorBoard`` placed after this callback):
    ``budget/step_budget`` (seconds; the median over the epoch's steps of
    the step budget in force), ``budget/step_time`` (median measured
    step seconds of the epoch, warm-up and compilation steps left out),
    ``budget/reachable`` (1/0, last decision), for ``epoch_time`` and
    ``deadline`` also ``budget/deadline_reachable`` (1/0: whether the
    latest decision's allocation meets the step budget re-planned from
    the time left, i.e. whether the fit can still end in time) and
    ``budget/predicted_end_s`` (``deadline``: the fit's predicted seconds
    from ``on_train_begin`` at the epoch's median step; ``epoch_time``: the
    epoch's measured seconds), per layer ``name``:
    ``name/budget_target`` (sparsity target) and ``name/budget_sparsity``
    (zeros measured at its input over the epoch), and per rate knob
    ``name/budget_rate`` (a dropout layer's name, or ``lstm_name/dropout``
    and ``lstm_name/recurrent_dropout``). With ``log_dir`` the budget, the
    measured and predicted step time (``budget/predicted_step_time``), the
    targets and rates are written at every decision (step = training step)
    as TensorBoard scalars (``tf.summary.write``; no tensorboard package
    needed).

    Args:
      step_time, epoch_time, deadline: the budget (exactly one; seconds).
      layers: optional list of sparse-split layer and SparseSplitLSTM
        names (or layers) to control; default every sparse-split layer fed
        by a ReLU-family activation and every SparseSplitLSTM with a
        compacted pattern.
      max_sparsity: largest sparsity target, in ``[0, 1)`` (default 0.95).
      min_rate, max_rate: bounds of the dropout rates, ``0 <= min_rate <=
        max_rate < 1`` (defaults 0 and 0.7).
      warmup_steps: steps before control (int >= 2; default 20; the first
        step, with the compilation, is never timed), at the natural
        sparsity and the floor rates; then ``probe_steps`` steps per LSTM
        rate at a second rate.
      probe_steps: timed steps of each LSTM rate's probe (int >= 2;
        default 8).
      min_gain: least predicted saving of a move, as a fraction of the
        measured step, in ``[0, 0.5)`` (default 0.01: sparsity that saves
        less than 1% of the step is not worth its accuracy).
      bound_gain: while the budget is not reachable within the bounds, a
        layer is raised toward ``max_sparsity`` only if its whole range is
        predicted to save at least this fraction of the measured step, in
        ``[0, 1)`` (default 0.05; the other layers stay at their natural
        sparsity, since a budget missed anyway is not worth their
        accuracy). 0 runs every layer that buys any time at the bound.
      sensitivity_data: optional held batch ``(x, y)`` for the sensitivity
        probe (module docstring): as many targets as examples, at least
        one, numbers without NaN/Inf; ``x`` of the model's input shape and
        integer labels ``y`` within its output's classes (checked at
        ``on_train_begin``).
      min_samples: steps measured per decision (int >= 2; default 8).
      update_every: steps between reads of the layers' statistics (int >= 1;
        default 4; each read is a host read of three small variables per
        layer).
      gain: feedback gain of the sparsity correction (>= 0; default 0.5).
      log_dir: optional TensorBoard directory for per-decision scalars.
      verbose: 0 or 1 (a line per decision that changes targets, and the
        allocation's reasons).
      clock: a function returning seconds (default ``time.perf_counter``).
      final_settings: what the model is left at after ``fit`` (the
        cutoffs are part of the trained model: they act in inference
        too). ``"last_epoch"`` (default): each controlled FATReLU at the
        median of the cutoffs (and targets) it had over the last epoch,
        each controlled dropout layer at its median rate there, so that a
        burst of load in the last steps, which sends the targets toward
        the bounds, does not decide the sparsity the trained model infers
        with (seen: 4.5 points of test accuracy on the benchmark CNN).
        ``"last"``: the settings of the last step. ``SparseSplitLSTM``
        rates keep the last step's either way.

    Attributes:
      controller: the :class:`~tf_sparse_split.tuning.budget.BudgetController`
        (after ``on_train_begin``).
      decisions: its log (list of
        :class:`~tf_sparse_split.tuning.budget.Decision`).
      trace: one dict per timed step: ``step``, ``seconds``, ``budget_s``,
        ``targets`` (``{layer: sparsity}``), ``rates`` (``{layer: rate}``),
        ``floors`` (``{layer: sparsity}``: the natural sparsity the
        controller holds for each layer then; it follows the layer's
        measured sparsity while its target is at the floor).
      history: one dict per epoch with the logged values.
      elapsed_s: seconds from ``on_train_begin`` to ``on_train_end`` (after
        the fit).
      overhead: the callback's own wall seconds in the fit (what it adds
        to the fit besides the steps it times), ``time.perf_counter``:
        ``step_s`` in its per-step hooks over ``steps`` steps (statistics
        reads, decisions, the trace; the probe excluded), ``probe_s`` in
        ``probes`` sensitivity probes (the first one with their tracing),
        ``probes_skipped`` probes not run because fewer than two layers'
        sparsity is predicted to buy time (then the sensitivities cannot
        change the allocation), ``epoch_end_s`` in ``on_epoch_end`` (the
        probe excluded).
      settled: after a ``fit`` with ``final_settings="last_epoch"``,
        ``{layer: {"cutoff", "target", "last_cutoff", "last_target"}}``
        per FATReLU owner and ``{dropout: {"rate", "last_rate"}}`` per
        dropout layer: what the model was left at and what the last step
        had.
      deadline_log: ``(step, reachable, predicted seconds, message)`` each
        time the epoch time or deadline became unreachable at the fastest
        allocation (at once), or reachable again (after ``DEADLINE_HOLD``
        decisions in a row found it so).

    Raises:
      ValueError: bad arguments (none or several budgets, non-positive/NaN
        seconds, bounds out of range, a ``gain`` that is not a finite
        number >= 0, a ``clock`` that is not callable, an unknown
        ``final_settings``, a ``log_dir`` that is not a path); at ``on_train_begin`` no controllable
        layer, a named layer that cannot be controlled, an epoch/deadline
        budget without a known number of steps per epoch, or a model
        compiled with ``steps_per_execution`` > 1 (the callback times and
        steers every single step).
    """

    def __init__(self, step_time=None, epoch_time=None, deadline=None,
                 layers=None, max_sparsity=0.95, min_rate=0.0, max_rate=0.7,
                 warmup_steps=20, sensitivity_data=None, min_samples=8,
                 update_every=4, gain=0.5, probe_steps=8, min_gain=0.01,
                 log_dir=None, verbose=0, clock=time.perf_counter,
                 final_settings="last_epoch", bound_gain=0.05):
        super().__init__()
        self.kind, self.seconds = _budget.validate_budget_args(
            step_time, epoch_time, deadline, max_sparsity, min_rate,
            max_rate)
        self.max_sparsity = float(max_sparsity)
        self.min_rate, self.max_rate = float(min_rate), float(max_rate)
        if layers is not None:
            if isinstance(layers, (str, bytes)) or not hasattr(
                    layers, "__iter__"):
                raise ValueError("`layers` must be a list of layer names or "
                                 f"layers. Received: layers={layers!r}")
            layers = list(layers)
            if not layers:
                raise ValueError("`layers` must not be empty")
        self.layer_selection = layers
        self.warmup_steps = validate_int(warmup_steps, "warmup_steps", 2)
        self.min_samples = validate_int(min_samples, "min_samples", 2)
        self.update_every = validate_int(update_every, "update_every", 1)
        self.probe_steps = validate_int(probe_steps, "probe_steps", 2)
        self.min_gain = _budget._fraction(min_gain, "min_gain", hi=0.5)
        self.bound_gain = _budget._fraction(bound_gain, "bound_gain")
        try:
            g = float(gain) if not isinstance(gain, bool) else float("nan")
        except (TypeError, ValueError):
            g = float("nan")
        if not math.isfinite(g) or g < 0:
            raise ValueError(f"`gain` must be >= 0. Received: gain={gain!r}")
        self.gain = g
        if sensitivity_data is not None:
            try:
                sx, sy = sensitivity_data
            except (TypeError, ValueError):
                raise ValueError("`sensitivity_data` must be a pair (x, y)"
                                 ) from None
            for what, v in (("x", sx), ("y", sy)):
                arr = v if hasattr(v, "dtype") else np.asarray(v)
                kind = getattr(getattr(arr, "dtype", None), "kind", None)
                if kind is None and hasattr(arr, "dtype"):
                    kind = "f" if arr.dtype.is_floating else (
                        "i" if arr.dtype.is_integer else "O")
                if kind not in ("f", "i", "u", "b"):
                    raise ValueError(
                        f"`sensitivity_data` {what} must be numbers. "
                        f"Received dtype {getattr(arr, 'dtype', None)}")
                if kind == "f" and not bool(np.all(np.isfinite(
                        np.asarray(arr, np.float64)))):
                    raise ValueError(f"`sensitivity_data` {what} holds NaN "
                                     "or Inf values")
            sensitivity_data = (sx, sy)
            nx, ny = _batch_len(sx), _batch_len(sy)
            if nx == 0 or ny == 0 or (nx is not None and ny is not None
                                      and nx != ny):
                raise ValueError(
                    "`sensitivity_data` must be a non-empty batch (x, y) "
                    f"with as many targets as examples. Received: {nx} "
                    f"example(s) and {ny} target(s)")
        self.sensitivity_data = sensitivity_data
        if verbose not in (0, 1) or isinstance(verbose, float):
            raise ValueError(f"`verbose` must be 0 or 1. Received: "
                             f"verbose={verbose!r}")
        self.verbose = int(verbose)
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError("`log_dir` must be a directory path or None. "
                             f"Received: log_dir={log_dir!r}")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        if not callable(clock):
            raise ValueError("`clock` must be a function returning seconds. "
                             f"Received: clock={clock!r}")
        self.clock = clock
        if final_settings not in FINAL_SETTINGS:
            raise ValueError("`final_settings` must be one of "
                             f"{FINAL_SETTINGS}. Received: "
                             f"final_settings={final_settings!r}")
        self.final_settings = final_settings
        self.settled = {}
        self.controller = None
        self.decisions = []
        self.trace = []
        self.history = []
        self.elapsed_s = None
        self.deadline_log = []
        self._plan = None
        self._knobs = []
        self._lstm = []
        self._writer = None
        self.overhead = _new_overhead()

    # -- discovery -----------------------------------------------------------
    def _discover(self):
        lstms, rest = find_lstm_layers(self.model, self.layer_selection)
        lstm_rates = [r for l in lstms for r in _lstm_rates(l)]
        if rest is not None and lstms and not rest:
            consumers, explicit = [], True
        else:
            try:
                consumers, explicit = select_split_layers(
                    self.model, rest, "TimeBudgetCallback")
            except ValueError:
                if rest is None and lstm_rates:
                    consumers, explicit = [], False
                else:
                    raise
        knobs, changed, seen = [], False, set()
        for layer in consumers:
            owner, kind = find_activation_producer(layer)
            if owner is None:
                if explicit:
                    raise ValueError(f"TimeBudgetCallback: layer "
                                     f"{layer.name!r} cannot be controlled: "
                                     f"{kind}")
                continue
            if id(owner) in seen:
                continue
            seen.add(id(owner))
            fat, conv = fatrelu_for(owner, kind)
            changed = mask_input_grad(layer) or conv or changed
            knobs.append(_Knob(layer, owner, fat,
                               _dropouts_between(layer, owner)))
        if not knobs and not lstm_rates:
            raise ValueError(
                no_control_message("TimeBudgetCallback", self.model) +
                ", and no SparseSplitLSTM has a compacted dropout pattern")
        if changed:
            reset_compiled_functions(self.model)
        return knobs, lstm_rates

    def _floor_rate(self, own):
        return min(max(self.min_rate, own), self.max_rate)

    # -- Keras hooks -------------------------------------------------------
    def on_train_begin(self, logs=None):
        # The deadline counts from here: discovery, conversion and the
        # recompilation it causes are part of the fit's time.
        self._t_begin = self.clock()
        spe = getattr(self.model, "steps_per_execution", 1)
        try:
            spe = int(spe.numpy() if hasattr(spe, "numpy") else spe)
        except (TypeError, ValueError):
            spe = 1
        if spe > 1:
            # Keras calls the batch hooks once per execution: every "step"
            # timed here would be spe steps, so a step budget would be
            # compared with spe steps' time and a plan would count spe
            # times too few steps.
            raise ValueError(
                f"TimeBudgetCallback: the model is compiled with "
                f"steps_per_execution={spe}; the callback times every step "
                "and moves the sparsity between steps, so compile with "
                "steps_per_execution=1")
        params = self.params or {}
        self._spe = params.get("steps") or None
        self._epochs = params.get("epochs") or None
        if self.kind != "step_time" and not self._spe:
            raise ValueError(f"TimeBudgetCallback: the {self.kind} budget "
                             "needs a known number of steps per epoch")
        if self.sensitivity_data is not None:
            # Checked here, not after the warm-up, where the probe would
            # fail deep inside its traced call without naming the data.
            sx, sy = self.sensitivity_data
            check_fits_model_input(
                self.model, getattr(sx, "shape", None),
                "TimeBudgetCallback: `sensitivity_data` x")
            check_labels_in_classes(
                sy, model_classes(self.model),
                "TimeBudgetCallback: `sensitivity_data` labels y")
        self._knobs, self._lstm = self._discover()
        self._retraced = False
        rate_knobs = {}
        for k in self._knobs:
            k.fat.target_var.assign(0.0)
            k.fat.cutoff_var.assign(0.0)
            k.offset = 0.0
            k.seen_total = None
            k.read_new_stats()
            k.window_zero = k.window_elems = 0.0
            k.rate_floor = [self._floor_rate(r) for r in k.own_rates]
            for d, r in zip(k.dropouts, k.rate_floor):
                d.set_rate(r)
                rate_knobs[d.name] = _budget.RateKnob(
                    floor=r, upper=self.max_rate, layer=k.name,
                    compacts=_compacts(d), measured_at=r)
        retrace = False
        for lr in self._lstm:
            lr.floor = self._floor_rate(lr.own_rate)
            retrace = lr.set(lr.floor) or retrace
            rate_knobs[lr.name] = _budget.RateKnob(floor=lr.floor,
                                                   upper=self.max_rate)
        if retrace:
            reset_compiled_functions(self.model)
        self.controller = _budget.BudgetController(
            [k.name for k in self._knobs], max_sparsity=self.max_sparsity,
            min_samples=self.min_samples, rates=rate_knobs,
            min_gain=self.min_gain, bound_gain=self.bound_gain)
        self.decisions = self.controller.log
        self.trace, self.history = [], []
        self._step = 0
        self._plan = (None if self.kind == "step_time" else WallTimePlan(
            self.kind, self.seconds, self._spe, self._epochs,
            start=self._t_begin))
        self._recent = []           # recent timed steps (skew)
        self._all_times = []        # timed steps (cautious skew)
        self._fall_budget_now = None
        moms = [float(k.fat.momentum) for k in self._knobs]
        self._lag_steps = int(round(max(
            [m / (1.0 - m) for m in moms if 0.0 <= m < 1.0] or [0.0])))
        self._deadline_ok = True
        self._deadline_flips = 0    # decisions disagreeing with it in a row
        self.elapsed_s = None
        self.deadline_log = []
        self.overhead = _new_overhead()
        self._warm = False
        self._floor_sum = {k.name: [0.0, 0.0] for k in self._knobs}
        self._phase = None          # None: natural sparsity; else a probe
        self._phase_times = []
        self._probes = [lr for lr in self._lstm]
        self._base_s = None
        self._last_reachable = True
        self._probe = None
        self._settings_trace = []   # (step, {layer: (cutoff, target)})
        self._last_epoch_from = 0   # steps before the current epoch
        self.settled = {}
        if self.log_dir and self._writer is None:
            import tensorflow as tf
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._t_epoch = self.clock()
        if self.controller is not None:
            self._last_epoch_from = self._step
            # Only the last epoch's reads (and the latest few before it,
            # for a short last epoch) are ever used.
            self._settings_trace = self._settings_trace[-SETTLE_MIN_READS:]
        if self._plan is not None:
            self._plan.epoch_begin(self._t_epoch, epoch)
        self._epoch_steps = 0
        self._epoch_times = []
        for k in self._knobs:
            k.epoch_zero = k.epoch_elems = 0.0

    def on_train_batch_begin(self, batch, logs=None):
        w = time.perf_counter()
        self._t0 = self.clock()
        # The budget in force for this step (for an epoch time or a
        # deadline: the time left over the steps left, this one included).
        if self._plan is not None:
            self._plan.step_begin(self._t0)
        self._budget_now = self._step_budget(self._t0) \
            if self.controller else 0.0
        self._fall_budget_now = self._step_budget(self._t0, cautious=True) \
            if self.controller and self._plan is not None else None
        self._own("step_s", w)

    def _own(self, key, since, probe_before=None):
        """Adds the wall seconds since ``since`` (``time.perf_counter``)
        to :attr:`overhead` ``[key]``, less the probe's seconds spent
        since ``probe_before`` (counted under ``probe_s``)."""
        o = self.overhead
        spent = time.perf_counter() - since
        if probe_before is not None:
            spent -= o["probe_s"] - probe_before
        o[key] += max(spent, 0.0)

    def on_train_batch_end(self, batch, logs=None):
        w, probe = time.perf_counter(), self.overhead["probe_s"]
        try:
            self._batch_end()
        finally:
            self.overhead["steps"] += 1
            self._own("step_s", w, probe)

    def _batch_end(self):
        t_end = self.clock()
        dt = t_end - self._t0
        if self._plan is not None:
            self._plan.step_end(t_end)
        self._step += 1
        self._epoch_steps += 1
        # The first step after a (re)trace includes the compilation.
        first = self._step == 1 or self._retraced
        self._retraced = False
        if not first:
            self._epoch_times.append(dt)
            self._recent.append(dt)
            self._recent = self._recent[-SKEW_WINDOW:]
            self._all_times.append(dt)
            self._all_times = self._all_times[-LONG_SKEW_WINDOW:]
        c = self.controller
        if self._step % self.update_every == 0:
            self._read_stats()
        if not self._warm:
            if not first:
                self._phase_times.append(dt)
            self._warmup_step()
            return
        if not first:
            c.observe_step(dt)
        budget = self._budget_now
        logged = len(c.log)
        # A deadline's or an epoch time's steps short of the allocation
        # are time lost for good: from the natural sparsity the targets
        # go to the allocation at once (later rises stay limited: a burst
        # of load would otherwise send them to the bounds each time, and
        # falls are slower).
        new = c.decide(budget if budget > 0 else 1e-12,
                       jump=self._plan is not None and c.at_floors,
                       fall_budget_s=self._fall_budget_now)
        if len(c.log) > logged:
            # The fit's step (the controller counts only the steps it
            # observed, after the warm-up).
            c.log[-1].step = self._step
            self._on_decision(c.log[-1], new)
            self._check_deadline(c.log[-1], t_end)
        if new is not None:
            self._apply(new)
        self.trace.append({"step": self._step, "seconds": dt,
                           "budget_s": budget,
                           "targets": dict(c.targets),
                           "rates": self._rates(),
                           "floors": dict(c.floors)})

    # -- warm-up: natural sparsity, then one probe per LSTM rate -------------
    def _warmup_step(self):
        if self._phase is None:
            if self._step < self.warmup_steps:
                return
            self._end_natural()
        elif len(self._phase_times) >= self.probe_steps:
            self._end_probe()
        else:
            return
        self._next_probe()

    def _end_natural(self):
        self._read_stats()
        c = self.controller
        for k in self._knobs:
            z, n = self._floor_sum[k.name]
            if n > 0:
                c.set_floor(k.name, _budget.activation_sparsity(
                    z / n, [_realized(d, r) for d, r in
                            zip(k.dropouts, k.rate_floor)]))
        # The natural phase's later half: the steps at the floor rates.
        t = self._phase_times[len(self._phase_times) // 2:]
        self._base_s = _budget.robust_step_time(t) if t else None
        self._measure_sensitivity()
        self._phase = "natural-done"

    def _next_probe(self):
        while self._probes:
            lr = self._probes.pop(0)
            up = lr.floor + PROBE_DELTA
            rate = up if up <= self.max_rate + 1e-9 else \
                lr.floor - PROBE_DELTA
            rate = min(max(rate, self.min_rate), self.max_rate)
            if abs(rate - lr.floor) < 0.05 or self._base_s is None:
                continue      # bounds too narrow to move it: no knob
            self._phase = (lr, rate)
            self._phase_times = []
            if lr.set(rate):
                reset_compiled_functions(self.model)
            # The first step at the new rate is left out (settling).
            self._retraced = True
            return
        self._warm = True
        self._phase = None

    def _end_probe(self):
        lr, rate = self._phase
        med = _budget.robust_step_time(self._phase_times)
        cost = _budget.RateCost.from_two_rates(lr.kept, lr.floor,
                                               self._base_s, rate, med)
        self.controller.set_rate_cost(lr.name, cost)
        self._probe_log = getattr(self, "_probe_log", [])
        self._probe_log.append((lr.name, lr.floor, self._base_s, rate, med,
                                cost.slope_s))
        if self.verbose:
            print(f"TimeBudgetCallback: {lr.name}: median step "
                  f"{self._base_s * 1e3:.2f} ms at rate {lr.floor:.2f}, "
                  f"{med * 1e3:.2f} ms at {rate:.2f}: "
                  + (f"{cost.slope_s * 1e3:.2f} ms per unit of kept work"
                     if cost.predicts else "no saving measured, left at "
                     "its floor"), flush=True)
        if lr.set(lr.floor):
            reset_compiled_functions(self.model)
        self._retraced = True

    def _read_stats(self):
        c = self.controller
        for k in self._knobs:
            before_z, before_e = k.window_zero, k.window_elems
            k.read_new_stats()
            dz, de = k.window_zero - before_z, k.window_elems - before_e
            if not self._warm and self._phase is None:
                self._floor_sum[k.name][0] += dz
                self._floor_sum[k.name][1] += de
            # read_new_stats has just read the totals: no second host read.
            if k.seen_calls > 0:
                c.set_cost(k.name, _budget.LayerCost.from_stats(
                    k.consumer.latest_stats_vector()))
            if k.window_elems > 0:
                # The activation's share of the zeros the layer saw (its
                # dropouts' zeros taken out).
                measured = _budget.activation_sparsity(
                    k.window_zero / k.window_elems,
                    [_realized(d, c.rates.get(d.name, d.rate))
                     for d in k.dropouts])
                c.set_actual(k.name, measured)
                target = c.targets[k.name]
                if self._warm and self.gain > 0 and \
                        target > c.floors[k.name] + 0.01:
                    k.offset += self.gain * (target - measured)
                    k.offset = float(np.clip(k.offset, -target,
                                             self.max_sparsity - target))
                    self._set_fat(k, target)
            k.window_zero = k.window_elems = 0.0
        if self._warm and self.final_settings == "last_epoch":
            self._settings_trace.append((self._step, {
                k.name: (k.fat.cutoff, k.fat.target) for k in self._knobs}))

    def _set_fat(self, k, target):
        floor = self.controller.floors[k.name]
        if target <= floor + 0.01:
            k.offset = 0.0
            k.fat.target_var.assign(0.0)
            k.fat.cutoff_var.assign(0.0)
        else:
            # The offset corrects the cutoff's measured shortfall, but the
            # FATReLU's own target never passes the bound either.
            k.fat.target_var.assign(float(np.clip(target + k.offset, 0.0,
                                                  self.max_sparsity)))

    def _apply(self, targets):
        c = self.controller
        for k in self._knobs:
            self._set_fat(k, targets[k.name])
            for d in k.dropouts:
                d.set_rate(c.rates[d.name])
        retrace = False
        for lr in self._lstm:
            retrace = lr.set(c.rates[lr.name]) or retrace
        if retrace:
            reset_compiled_functions(self.model)
            self._retraced = True

    def _measure_sensitivity(self):
        c = self.controller
        if self.sensitivity_data is None:
            for k in self._knobs:
                c.set_sensitivity(k.name, 1.0)
            self._sens_note = ("no sensitivity_data: every layer taken as "
                               "equally sensitive")
            return
        x, y = self.sensitivity_data
        step = c.measured() or self._base_s or 0.0
        buy = c.layers_that_buy_time(step)
        if len(buy) < 2:
            # The allocation weighs layers by sensitivity only between
            # layers whose sparsity buys time: with one (or none) the
            # probe cannot change its choice. Not probed (it costs a few
            # steps' worth of forward passes at every epoch end).
            for k in self._knobs:
                if c.sensitivities.get(k.name) is None:
                    c.set_sensitivity(k.name, 1.0)
            if self._plan is not None:
                self._plan.expect_epoch_end(0.0)
            self.overhead["probes_skipped"] += 1
            self._sens_note = (
                "sensitivity not probed: " + (
                    f"only {buy[0]}'s sparsity buys time"
                    if buy else "no layer's sparsity buys time") +
                " (predicted)")
            return
        w = time.perf_counter()
        if self._probe is None:
            self._probe = SensitivityProbe(
                self.model, [(k.owner, k.fat) for k in self._knobs],
                clock=self.clock)
        try:
            base, sens, zeros = self._probe.measure(x, y)
        finally:
            self.overhead["probe_s"] += time.perf_counter() - w
            self.overhead["probes"] += 1
        if self._plan is not None:
            # Repeated at every epoch end: part of each epoch boundary.
            self._plan.expect_epoch_end(self._probe.steady_s)
        floor = max(1e-4 * abs(base), 1e-6)
        for k, s, z in zip(self._knobs, sens, zeros):
            # Measured where the layer is now (its output's zeros on the
            # held batch).
            c.set_sensitivity(k.name, max(s, floor), at=z)
        self._sens_note = (f"held-batch loss {base:.4g}; sensitivity per "
                           "unit sparsity " + ", ".join(
                               f"{k.name} {max(s, floor):.3g}"
                               for k, s in zip(self._knobs, sens)))

    def _skew(self):
        """:func:`~tf_sparse_split.tuning.deadline.median_over_mean` of the
        recent timed steps."""
        return median_over_mean(self._recent)

    def _lag(self):
        """``(steps, seconds per step)``: the steps a change decided now
        takes to act (the FATReLU cutoffs follow their targets with a
        moving average of momentum ``mu``: about ``mu / (1 - mu)`` steps'
        worth of the change is missing) and the recent steps' mean, what
        those steps are predicted to take (``(0, 0.0)`` before any timed
        step)."""
        if not self._recent or not self._lag_steps:
            return 0, 0.0
        return self._lag_steps, float(np.mean(
            self._recent[-self.min_samples:]))

    def _step_budget(self, now, cautious=False):
        """The step budget in force at clock ``now`` (seconds; for an
        epoch time or a deadline re-planned from the wall time left,
        :class:`~tf_sparse_split.tuning.deadline.WallTimePlan`, as the
        median step time that meets it). ``cautious``:
        the budget the targets may fall to (the epoch ends still to come at
        the mean of the measured ones, ``WallTimePlan.cautious_boundary_s``,
        and the steps' median / mean of the whole fit where it is below the
        recent one's: bursts of load seen earlier may come again)."""
        if self._plan is None:
            return self.seconds
        skew = self._skew()
        if cautious:
            skew = min(skew, median_over_mean(self._all_times))
        return self._plan.budget(now, cautious=cautious) * skew

    def _check_deadline(self, d, now):
        """Whether the epoch time or deadline can still be met: the
        decision's allocation meets the re-planned step budget (when it
        cannot, ``d.best_s`` is the fastest the bounds allow, and the
        predicted end is taken there); logged when that changes."""
        if self._plan is None:
            return
        best = d.best_s if math.isfinite(d.best_s) else d.measured_s
        end = self._plan.predicted_elapsed(now, best / self._skew(),
                                           *self._lag())
        # The step budget is the time left over the steps left: when no
        # allocation within the bounds meets it, the deadline is missed --
        # unless the fastest allocation still ends in time (the allocation
        # aims a dead band inside the budget; the time the sparsity already
        # bought is in the elapsed seconds).
        ok = bool(d.reachable) or end <= self.seconds
        if ok == self._deadline_ok:
            self._deadline_flips = 0
            return
        self._deadline_flips += 1
        if ok and self._deadline_flips < DEADLINE_HOLD:
            return
        self._deadline_flips = 0
        self._deadline_ok = ok
        what = ("deadline" if self.kind == "deadline" else
                f"epoch time (epoch {self._epoch + 1})")
        if ok:
            msg = (f"TimeBudgetCallback: step {self._step}: the {what} of "
                   f"{self.seconds:.3g} s is reachable again (predicted "
                   f"{end:.2f} s at the fastest allocation)")
        else:
            msg = (f"TimeBudgetCallback: step {self._step}: the {what} of "
                   f"{self.seconds:.3g} s is not reachable within "
                   f"max_sparsity={self.max_sparsity} and max_rate="
                   f"{self.max_rate}: at the fastest allocation "
                   f"(predicted {best * 1e3:.2f} ms/step) it ends at about "
                   f"{end:.2f} s; running at the bounds")
        self.deadline_log.append((self._step, ok, end, msg))
        if self.verbose:
            print(msg, flush=True)

    def _rates(self):
        out = {d.name: d.rate for k in self._knobs for d in k.dropouts}
        out.update({lr.name: lr.rate for lr in self._lstm})
        return out

    def _on_decision(self, d, new):
        if self._writer is not None:
            import tensorflow as tf
            from tensorflow.core.framework import summary_pb2

            # tf.summary.write with the scalar plugin's metadata (what
            # tf.summary.scalar writes), as ThresholdTuner does: no
            # tensorboard package needed to log.
            meta = summary_pb2.SummaryMetadata()
            meta.plugin_data.plugin_name = "scalars"
            values = {"budget/step_budget": d.budget_s,
                      "budget/step_time": d.measured_s,
                      "budget/predicted_step_time": d.predicted_s}
            values.update({f"{n}/budget_target": t
                           for n, t in d.targets.items()})
            values.update({f"{n}/budget_rate": r
                           for n, r in self._rates().items()})
            with self._writer.as_default():
                for tag, v in values.items():
                    if math.isfinite(v):
                        tf.summary.write(tag, tf.constant(v, tf.float32),
                                         step=self._step, metadata=meta)
            self._writer.flush()
        if d.reachable != self._last_reachable and d.action != "hold":
            # Said once each time the budget becomes unreachable.
            self._last_reachable = d.reachable
            if not d.reachable and self.verbose:
                floors = self.controller.floors
                moving = [n for n, t in d.targets.items()
                          if t > floors.get(n, 0.0) + 1e-9] + [
                    r for r, v in d.rates.items()
                    if v > self.controller.rate_knobs[r].floor + 1e-9]
                what = ("running " + ", ".join(moving) + " toward the bounds"
                        if moving else
                        "no layer's sparsity is predicted to save enough "
                        f"of the step to spend accuracy on (min_gain="
                        f"{self.min_gain:g} per move, bound_gain="
                        f"{self.bound_gain:g} per layer while unreachable): "
                        "all stay at their natural sparsity")
                if self.kind != "step_time" and d.budget_s <= 0.0:
                    # A wall-time budget already spent: no step budget is
                    # left to state.
                    print(f"TimeBudgetCallback: the {self.kind} budget of "
                          f"{self.seconds:.3g} s is spent (measured step "
                          f"{d.measured_s * 1e3:.2f} ms); {what}",
                          flush=True)
                else:
                    print(f"TimeBudgetCallback: step budget "
                          f"{d.budget_s * 1e3:.2f} ms is not reachable "
                          f"within max_sparsity={self.max_sparsity} and "
                          f"max_rate={self.max_rate} (measured "
                          f"{d.measured_s * 1e3:.2f} ms); {what}",
                          flush=True)
        if new is not None and self.verbose:
            print(f"TimeBudgetCallback: step {self._step}: measured "
                  f"{d.measured_s * 1e3:.2f} ms, budget "
                  f"{d.budget_s * 1e3:.2f} ms, predicted "
                  f"{d.predicted_s * 1e3:.2f} ms -> " + ", ".join(
                      [f"{n} {t:.2f}" for n, t in new.items()] +
                      [f"{n} rate {r:.2f}" for n, r in d.rates.items()]),
                  flush=True)
            for n, why in d.reasons.items():
                print(f"  {n}: {why}", flush=True)

    def on_train_end(self, logs=None):
        if self.controller is None:
            return
        self.elapsed_s = self.clock() - self._t_begin
        self._settle()
        if self.kind == "deadline" and self.verbose:
            print(f"TimeBudgetCallback: fit took {self.elapsed_s:.2f} s "
                  f"from on_train_begin, deadline {self.seconds:.3g} s "
                  f"({self.elapsed_s / self.seconds:.3f})", flush=True)

    def _settle(self):
        """``final_settings="last_epoch"``: leaves each FATReLU at the
        median of the cutoffs (and targets) read over the last epoch's
        steps, and each dropout layer at the median of its rates there
        (:attr:`settled`)."""
        if self.final_settings != "last_epoch" or not self._settings_trace:
            return
        window = [r for st, r in self._settings_trace
                  if st > self._last_epoch_from]
        if len(window) < SETTLE_MIN_READS:
            window = [r for _, r in self._settings_trace[-SETTLE_MIN_READS:]]
        steps = [t for t in self.trace if t["step"] > self._last_epoch_from]
        if len(steps) < SETTLE_MIN_READS:
            steps = self.trace[-SETTLE_MIN_READS:]
        for k in self._knobs:
            # The lower median: a value the layer really ran at.
            cut = float(np.percentile([r[k.name][0] for r in window], 50,
                                      method="lower"))
            tgt = float(np.percentile([r[k.name][1] for r in window], 50,
                                      method="lower"))
            last = (k.fat.cutoff, k.fat.target)
            k.fat.cutoff_var.assign(cut)
            k.fat.target_var.assign(tgt)
            self.settled[k.name] = {"cutoff": cut, "target": tgt,
                                    "last_cutoff": last[0],
                                    "last_target": last[1]}
            for d in k.dropouts:
                rates = [t["rates"][d.name] for t in steps
                         if d.name in t["rates"]]
                if rates:
                    rate = float(np.percentile(rates, 50, method="lower"))
                    d.set_rate(rate)
                    self.settled[d.name] = {"rate": rate,
                                            "last_rate": rates[-1]}
        if self.verbose and self.settled:
            parts = [f"{n} cutoff {v['cutoff']:.4g} (last step "
                     f"{v['last_cutoff']:.4g})" if "cutoff" in v else
                     f"{n} rate {v['rate']:.2f} (last step "
                     f"{v['last_rate']:.2f})"
                     for n, v in self.settled.items()]
            print("TimeBudgetCallback: leaving the model at its last "
                  "epoch's median settings: " + ", ".join(parts), flush=True)

    def on_test_begin(self, logs=None):
        if self._knobs and self.controller is not None:
            self._read_stats()

    def on_test_end(self, logs=None):
        for k in self._knobs:
            k.skip_new_stats()

    def on_epoch_end(self, epoch, logs=None):
        w, probe = time.perf_counter(), self.overhead["probe_s"]
        try:
            self._epoch_end(epoch, logs)
        finally:
            self._own("epoch_end_s", w, probe)

    def _epoch_end(self, epoch, logs):
        c = self.controller
        now = self.clock()
        if self._plan is not None:
            self._plan.epoch_end(now)
        self._read_stats()
        if self._warm:
            self._measure_sensitivity()
        step_time = (float(np.median(self._epoch_times))
                     if self._epoch_times else float("nan"))
        # The budget in force during the epoch: the median of its steps'
        # (an epoch-time or deadline budget is recomputed at every step).
        first = self._step - self._epoch_steps
        mine = [t["budget_s"] for t in self.trace if t["step"] > first]
        budget = float(np.median(mine)) if mine else self._step_budget(now)
        entry = {"budget/step_budget": budget,
                 "budget/step_time": step_time,
                 "budget/reachable": float(c.log[-1].reachable
                                           if c.log else True)}
        if self._plan is not None:
            step = step_time if math.isfinite(step_time) else 0.0
            if self.kind == "deadline":
                # The fit's predicted wall time from on_train_begin at the
                # epoch's median step (the epochs after this one included).
                entry["budget/predicted_end_s"] = \
                    self._plan.predicted_elapsed(now, step / self._skew())
            else:
                entry["budget/predicted_end_s"] = now - self._t_epoch
            entry["budget/deadline_reachable"] = float(self._deadline_ok)
        for k in self._knobs:
            sp = (k.epoch_zero / k.epoch_elems if k.epoch_elems > 0
                  else float("nan"))
            entry[f"{k.name}/budget_target"] = c.targets[k.name]
            entry[f"{k.name}/budget_sparsity"] = float(sp)
        for name, rate in self._rates().items():
            entry[f"{name}/budget_rate"] = rate
        if logs is not None:
            logs.update(entry)
        self.history.append(dict(entry))
        if self.verbose:
            notes = [getattr(self, "_sens_note", "")]
            if not self._warm:      # say why nothing has moved yet
                notes.append(
                    f"warm-up, step {self._step} of {self.warmup_steps}"
                    if self._phase is None else "warm-up, probing a rate")
            print(f"TimeBudgetCallback: epoch {epoch + 1}: median step "
                  f"{step_time * 1e3:.2f} ms, budget {budget * 1e3:.2f} ms"
                  + "".join("; " + n for n in notes if n), flush=True)
