"""Time breakdown of one training step of the MLP 784-2048-2048-10.

Batch 128, Adam, sparse categorical cross-entropy; the model of
``tf-sparse-split train`` (:func:`tf_sparse_split.tools.models.build_mlp`:
ReLU hidden layers, softmax output) built twice with the same initial
weights: plain ``keras.layers.Dense`` and ``SparseSplitDense`` (automatic
threshold, ``masked_input_grad`` after a ReLU). Both models first train
``--warmup`` steps on the same batches (so the activations look like
training's), then every part below is timed for both, interleaved
(alternating order per round), each part its own ``tf.function`` called on
fixed tensors:

* ``step``: the whole custom training step (forward, loss, gradients, Adam);
* ``fwd <layer>``: the layer's forward call (``training=True``: our layers
  record their statistics, as in ``fit``);
* ``dW <layer>`` / ``dX <layer>``: the layer's kernel (with bias) gradient /
  input gradient from the gradient at its pre-activation, with the products
  the registered gradients run (see ``Variant.make_parts``); our products
  also return their statistics (not counted in full, as in the gradient),
  and a line under the table counts the plans they chose in the timed
  calls (all rows dense, split, all rows sparse);
* ``optimizer``: ``optimizer.apply`` of fixed gradients to all weights
  (the same Keras code in both models: a sentence under the table says
  whether the two graphs hold the same ops and get gradients of the same
  dtypes and shapes, and gives this part's per-round ratio, the run's
  noise for memory-bound work that costs the same in both);
* ``loss``: the loss (forward) on fixed probabilities;
* ``call overhead``: an empty ``tf.function`` call (paid once per part
  here, once per step in ``step``);
* ``other``: ``step`` minus the sum of the forward, gradient and optimizer
  parts (loss and its gradient, activation-gradient masks, the tape, host
  work, and our layers' statistics writes; negative when the separate
  calls, each paying a ``tf.function`` call, cost more than the one step).

Data: MNIST from ``--data`` (default ``$TFSS_MNIST_DIR``, else
``../shared/data/mnist`` beside the repository, else
``/work/shared/data/mnist``) when present; else scikit-learn's embedded 8x8
digits upsampled to 28x28; the table says which.

Prints a markdown table (medians over rounds in ms, min, spread = max/min of
the round medians) and the whole-step ratio, and writes it to
``benchmarks/results/bench_train_step.md`` (``--out``).

Dtype policies (``--what policies``, or ``all``): the same MLP's whole
``train_on_batch`` step under each Keras dtype policy of ``--policies``
(``float32``, ``mixed_bfloat16``, ``mixed_float16``: float32 variables,
compute in bfloat16/float16, Keras' ``LossScaleOptimizer`` under
``mixed_float16``), ours against plain ``keras.layers.Dense`` under the same
policy with the same initial weights, timed by interleaved blocks of steps
(:func:`tf_sparse_split.tools.train.train_step_times`; median and range of
the per-round ratios; ``--clock cpu`` times the process's CPU seconds, all
threads, instead of wall-clock seconds: far less disturbed by other jobs on
a loaded machine; written to
``benchmarks/results/bench_train_step_policies.md``), in two states: *natural* sparsity (after
``--warmup`` steps of plain training) and after ``--induce-epochs`` epochs
of ``SparsityTargetCallback(--target)`` on ``--induce-examples`` examples
(the plain model's step does not depend on its activations: it gets the
``--warmup`` steps). Each row also gives
where our step's time goes: per layer the dtype its op ran in and the op's
own seconds per path (analysis, dense, sparse) in the last recorded call,
from its statistics.

Op profile (``--what ops``): the same pair's ``train_on_batch`` step under
``--breakdown-policy``, natural and after the sparsity target as above,
traced with ``tf.profiler`` in ``--ops-rounds`` interleaved rounds of
``--ops-steps`` steps per model; per TensorFlow op type the median over
rounds of its milliseconds per step (summed over the threads that ran it,
so concurrent ops add up) and its executions per step, plain beside ours
(written to ``benchmarks/results/bench_train_step_ops_<policy>.md``). It
shows every op one step runs that the other does not (extra casts, the
FATReLU's passes, the ops' analysis inside their own op time).

Usage::

    python benchmarks/bench_train_step.py [--rounds 7] [--reps 5] [--warmup 20]
    python benchmarks/bench_train_step.py --what policies [--rounds 8] [--clock cpu]
    python benchmarks/bench_train_step.py --what ops --breakdown-policy mixed_bfloat16
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
import keras

import tf_sparse_split as tfss
from _common import (cpus_desc, format_median_min_spread, markdown_table,
                     median_min_spread_ms, median_time, rotated,
                     speedup_summary, write_report)
from tf_sparse_split._loader import build_info
from tf_sparse_split.tools.datasets import load_digits, load_mnist
from tf_sparse_split.ops.matmul import _dy_product
from tf_sparse_split.ops.sddmm import sparse_split_sddmm
from tf_sparse_split.tools.cli import (parse_nonnegative_int,
                                       parse_positive_int, parse_rate)
from tf_sparse_split.tools.models import build_mlp
from tf_sparse_split.tuning import stats as tfss_stats

HERE = Path(__file__).resolve().parent
BATCH = 128
HIDDEN = [2048, 2048]


def _mnist_dirs(explicit):
    if explicit:
        return [Path(explicit)]
    dirs = []
    if os.environ.get("TFSS_MNIST_DIR"):
        dirs.append(Path(os.environ["TFSS_MNIST_DIR"]))
    dirs += [HERE.parent.parent / "shared" / "data" / "mnist",
             Path("/work/shared/data/mnist")]
    return dirs


def load_data(explicit_dir):
    """``(x [n, 784] float32, y [n] int32, description)``."""
    for d in _mnist_dirs(explicit_dir):
        try:
            (x, y), _ = load_mnist(d)
            return x, y, f"MNIST from {d} ({x.shape[0]} training images)"
        except FileNotFoundError:
            continue
    (x, y), _ = load_digits()
    img = x.reshape(-1, 8, 8)
    # 8x8 -> 24x24 by pixel repetition, padded to 28x28 (MNIST's layout and
    # its border of zeros).
    up = np.kron(img, np.ones((3, 3), np.float32))
    x = np.pad(up, ((0, 0), (2, 2), (2, 2))).reshape(-1, 784).astype(np.float32)
    return x, y, ("scikit-learn digits upsampled 8x8 -> 28x28 (no MNIST found "
                  f"in {', '.join(str(d) for d in _mnist_dirs(explicit_dir))})")


class Variant:
    """One model with its optimizer and the timed tf.functions."""

    def __init__(self, name, sparse, weights=None):
        self.name = name
        self.model = build_mlp(784, HIDDEN, 10, sparse=sparse)
        if weights is not None:
            own = []
            it = iter(weights)
            # get_weights() is [kernel, bias] per layer for both layer types
            # (SparseSplitDense's threshold is not a Keras weight).
            for _ in self.model.layers:
                own += [next(it), next(it)]  # kernel, bias
            self.model.set_weights(own)
        self.optimizer = keras.optimizers.Adam(1e-3)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.optimizer.build(self.model.trainable_variables)
        self.parts = {}
        #: {part: [plan of each call]} of the parts whose product returns
        #: its statistics (ours): "dense", "split" or "sparse" rows.
        self.plans = {}

    def _recording(self, name, fn):
        """For ``fn`` returning a tuple whose last element is a product's
        statistics vector, a callable returning the other outputs that
        records each call's plan in ``self.plans[name]``."""
        def call(*args):
            out = fn(*args)
            st = out[-1].numpy()
            rd, rs = st[tfss_stats.ROWS_DENSE], st[tfss_stats.ROWS_SPARSE]
            self.plans.setdefault(name, []).append(
                "sparse" if rd == 0 and rs > 0 else
                "dense" if rs == 0 else "split")
            return out[:-1] if len(out) > 2 else out[0]
        return call

    def dense_weights(self):
        """kernel, bias of every layer (no thresholds)."""
        out = []
        for layer in self.model.layers:
            out += [layer.kernel.numpy(), layer.bias.numpy()]
        return out

    def make_step(self):
        model, opt, loss_fn = self.model, self.optimizer, self.loss_fn

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                probs = model(x, training=True)
                loss = loss_fn(y, probs)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss

        return step

    def make_parts(self, x, y):
        """The per-part tf.functions with their fixed arguments.

        The backward products are the ones the registered gradients run
        (TF's MatMul gradient for Dense; ``_sparse_split_matmul_grad`` for
        ours: dW through the sparse op with the input as its sparse operand,
        dX through the sparse op with dp as its sparse operand, or the SDDMM
        masked by the input with ``masked_input_grad``), applied to the
        gradient at the layer's pre-activation, so that no part recomputes
        the forward pass.
        """
        model, opt, loss_fn = self.model, self.optimizer, self.loss_fn
        layers = model.layers
        sparse = isinstance(layers[0], tfss.SparseSplitDense)
        # Layer inputs and the gradient at each pre-activation (same math
        # for both models: TF ops on each model's own weights).
        # In the layers' compute dtype (bfloat16/float16 under a mixed
        # policy: the kernels autocast as inside a Keras call).
        dt = layers[0].compute_dtype
        kernels = {layer.name: tf.cast(layer.kernel, dt) for layer in layers}
        with tf.GradientTape() as tape:
            hs, pres = [tf.cast(x, dt)], []
            for i, layer in enumerate(layers):
                pre = (tf.matmul(hs[-1], kernels[layer.name])
                       + tf.cast(layer.bias, dt))
                pres.append(pre)
                hs.append(tf.nn.softmax(pre) if i == len(layers) - 1
                          else tf.nn.relu(pre))
            loss = loss_fn(y, hs[-1])
        d_pres = tape.gradient(loss, pres)
        parts = {}
        for i, layer in enumerate(layers):
            h, dp = tf.identity(hs[i]), tf.identity(d_pres[i])
            short = layer.name.replace("hidden_", "h")

            def fwd(h, layer=layer):
                return layer(h, training=True)

            if sparse:
                thr = layer.threshold_var
                live_only = layer.masked_input_grad

                # The products return their statistics too (full_stats
                # False, as in the registered gradient) for the plans
                # they chose (``plans``).
                def d_w(h, dp, thr=thr):
                    prod, st = tfss.sparse_split_matmul(
                        h, dp, tf.convert_to_tensor(thr), transpose_a=True,
                        return_stats=True, full_stats=False)
                    return prod, tf.reduce_sum(dp, axis=0), st

                def d_x(h, dp, layer=layer, live_only=live_only):
                    w = tf.cast(layer.kernel, dt)
                    if live_only:  # SDDMM: (h != 0) * (dp @ w^T)
                        return sparse_split_sddmm(h, dp, w, -1.0,
                                                  return_stats=True,
                                                  full_stats=False)
                    return _dy_product(dp, w, True, False)
            else:
                def d_w(h, dp):
                    return (tf.matmul(h, dp, transpose_a=True),
                            tf.reduce_sum(dp, axis=0))

                def d_x(h, dp, layer=layer):
                    return tf.matmul(dp, tf.cast(layer.kernel, dt),
                                     transpose_b=True)

            d_w, d_x = tf.function(d_w), tf.function(d_x)
            if sparse:
                d_w = self._recording(f"dW {short}", d_w)
                if layer.masked_input_grad:
                    d_x = self._recording(f"dX {short}", d_x)
            parts[f"fwd {short}"] = (tf.function(fwd), (h,))
            parts[f"dW {short}"] = (d_w, (h, dp))
            if i > 0:  # the first layer's input gradient is never needed
                parts[f"dX {short}"] = (d_x, (h, dp))
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = [tf.identity(g) for g in tape.gradient(loss, variables)]

        @tf.function
        def apply(*g):
            opt.apply(list(g), variables)

        parts["optimizer"] = (apply, tuple(grads))
        probs = tf.identity(hs[-1])
        parts["loss"] = (tf.function(lambda p, y: loss_fn(y, p)), (probs, y))
        parts["call overhead"] = (tf.function(lambda v: v), (y,))
        parts["step"] = (self.make_step(), (x, y))
        self.parts = parts


def _op_type_counts(fn, args):
    """``{op type: count}`` of the graph ``fn`` (a ``tf.function``) traces
    for ``args``."""
    graph = fn.get_concrete_function(*args).graph
    out = {}
    for op in graph.get_operations():
        out[op.type] = out.get(op.type, 0) + 1
    return out


def _grads_desc(grads):
    """``"6 float32 Tensor"``-style summary of a gradient list: count per
    (dtype, Python type)."""
    kinds = {}
    for g in grads:
        kind = type(g).__name__.replace("EagerTensor", "Tensor")
        key = f"{g.dtype.name} {kind}"
        kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))


def _optimizer_control(ref, ours, ref_times, our_times):
    """One sentence on the ``optimizer`` part: whether the two models'
    ``optimizer.apply`` graphs hold the same ops and get gradients of the
    same dtypes, types and shapes, and the part's per-round ratio
    keras/ours (median, range). Where both hold, that part runs the same
    code on the same sizes in both models, so its ratio is the run's noise
    floor for memory-bound work, not a property of the layers."""
    fn_r, g_r = ref.parts["optimizer"]
    fn_o, g_o = ours.parts["optimizer"]
    c_r, c_o = _op_type_counts(fn_r, g_r), _op_type_counts(fn_o, g_o)
    same_graph = c_r == c_o
    same_grads = ([(g.dtype, type(g), tuple(g.shape)) for g in g_r] ==
                  [(g.dtype, type(g), tuple(g.shape)) for g in g_o])
    ratios = [a / b for a, b in zip(ref_times, our_times)]
    ratio = (f"its per-round ratio keras/ours is {statistics.median(ratios):.2f}"
             f" (range {min(ratios):.2f}-{max(ratios):.2f})")
    if same_graph and same_grads:
        return (f"Optimizer part: both models' `optimizer.apply` graphs hold "
                f"the same ops ({sum(c_r.values())}, counted by type) and get "
                "the same gradients "
                f"({_grads_desc(g_r)}, same shapes): the same code on the same "
                f"sizes, so {ratio}: this run's noise for that part, not the "
                "layers'.")
    diff = sorted((t, (c_r.get(t, 0), c_o.get(t, 0)))
                  for t in set(c_r) | set(c_o)
                  if c_r.get(t, 0) != c_o.get(t, 0))
    graphs = ("hold the same ops" if same_graph
              else f"differ (op type: keras, ours) {diff}")
    grads = (f"gradients keras {_grads_desc(g_r)}, ours {_grads_desc(g_o)}"
             + ("" if same_grads else " (different dtypes, types or shapes)"))
    return (f"Optimizer part: the two models' `optimizer.apply` graphs "
            f"{graphs}; {grads}; {ratio}.")


def _compiled_pair(seed):
    """``(plain, ours)``: the MLP under the current global dtype policy,
    plain Dense and SparseSplitDense with the same initial weights,
    compiled alike (Adam; Keras adds its LossScaleOptimizer under
    mixed_float16)."""
    keras.utils.set_random_seed(seed)
    plain = build_mlp(784, HIDDEN, 10, sparse=False)
    ours = build_mlp(784, HIDDEN, 10, sparse=True)
    ours.set_weights(plain.get_weights())
    for m in (plain, ours):
        m.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy", jit_compile=False)
    return plain, ours


def _op_breakdown(model):
    """Per SparseSplitDense layer of ``model``: ``name: dtype, input
    sparsity, analysis/dense/sparse ms`` of its last recorded call (the
    op's statistics), and the layer's op dtype."""
    from tf_sparse_split.layers.base import op_dtype_for

    out = []
    for layer in model.layers:
        if not isinstance(layer, tfss.SparseSplitDense):
            continue
        st = layer.latest_stats()
        out.append(
            f"{layer.name} {op_dtype_for('SparseSplitMatMul', layer.compute_dtype)}"
            f" sp {st['sparsity']:.2f}: {1e3 * st['time_analyze']:.2f}/"
            f"{1e3 * st['time_dense']:.2f}/{1e3 * st['time_sparse']:.2f} ms "
            f"({int(st['rows_sparse'])}/{int(st['m'])} rows sparse, "
            f"{int(st['zero_cols_skipped'])} cols skipped)")
    return "; ".join(out)


def _prepared_pair(state, x_all, y_all, args):
    """``(plain, ours, rng)`` under the current policy: both after
    ``--warmup`` steps (``state`` "natural"), or ours after the sparsity
    target's induction and plain after the warm-up steps."""
    plain, ours = _compiled_pair(args.seed)
    rng = np.random.default_rng(args.seed)
    if state == "natural":
        for _ in range(args.warmup):
            idx = rng.integers(0, len(x_all), BATCH)
            for m in (plain, ours):
                m.train_on_batch(x_all[idx], y_all[idx])
        return plain, ours, rng
    # Only ours is induced: the plain model's dense GEMMs cost the same
    # whatever its activations, so it gets the natural row's warm-up steps.
    n = min(args.induce_examples, len(x_all))
    cb = tfss.SparsityTargetCallback(
        args.target, warmup_epochs=0.0,
        ramp_epochs=max(args.induce_epochs - 1, 1) / 2)
    ours.fit(x_all[:n], y_all[:n], epochs=args.induce_epochs,
             batch_size=BATCH, callbacks=[cb], verbose=0)
    for _ in range(args.warmup):
        idx = rng.integers(0, len(x_all), BATCH)
        plain.train_on_batch(x_all[idx], y_all[idx])
    return plain, ours, rng


def _op_profile(model, xs, ys, steps, logdir):
    """``{op type: (ms per step summed over threads, executions per
    step)}`` of ``steps`` ``train_on_batch`` steps of ``model`` on the
    batches ``xs``/``ys`` (cycled), from a ``tf.profiler`` trace (the host
    plane's TensorFlow op events, named ``"node:type"``)."""
    import glob
    import shutil

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    for i in range(2):
        model.train_on_batch(xs[i % len(xs)], ys[i % len(ys)])
    shutil.rmtree(logdir, ignore_errors=True)
    tf.profiler.experimental.start(logdir)
    try:
        for i in range(steps):
            model.train_on_batch(xs[i % len(xs)], ys[i % len(ys)])
    finally:
        tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    path = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0]
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    out = {}
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        meta = plane.event_metadata
        for line in plane.lines:
            for ev in line.events:
                name = meta[ev.metadata_id].name
                if ":" not in name or name.startswith("$"):
                    continue
                typ = name.rsplit(":", 1)[1]
                # Executor and runtime scopes ("ExecutorState::Process")
                # are not ops; op types have no spaces.
                if not typ or " " in typ or name.count("::"):
                    continue
                ms, n = out.get(typ, (0.0, 0))
                out[typ] = (ms + ev.duration_ps / 1e9 / steps, n + 1)
    return {k: (ms, n / steps) for k, (ms, n) in out.items()}


def op_rows(x_all, y_all, args):
    """The rows of the op-profile table (see the module docstring)."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for state in ("natural", f"target {args.target:g}"):
            plain, ours, rng = _prepared_pair(state, x_all, y_all, args)
            batches = [rng.choice(len(x_all), BATCH, replace=False)
                       for _ in range(4)]
            xs = [tf.constant(x_all[b]) for b in batches]
            ys = [tf.constant(y_all[b]) for b in batches]
            runs = {"plain": [], "ours": []}
            models = [("plain", plain), ("ours", ours)]
            for r in range(args.ops_rounds):
                for name, m in rotated(models, r):
                    runs[name].append(_op_profile(m, xs, ys, args.ops_steps,
                                                  f"{tmp}/{name}"))
            med = {}
            for name, profiles in runs.items():
                types = set().union(*profiles)
                med[name] = {t: (statistics.median(p.get(t, (0.0, 0))[0]
                                                   for p in profiles),
                                 statistics.median(p.get(t, (0.0, 0))[1]
                                                   for p in profiles))
                             for t in types}
            types = sorted(set(med["plain"]) | set(med["ours"]),
                           key=lambda t: -max(med["plain"].get(t, (0, 0))[0],
                                              med["ours"].get(t, (0, 0))[0]))
            totals = {k: sum(v[0] for v in med[k].values()) for k in med}
            for t in types:
                (pm, pn), (om, on) = (med["plain"].get(t, (0.0, 0)),
                                      med["ours"].get(t, (0.0, 0)))
                if max(pm, om) < 0.005:
                    continue
                rows.append(f"| {state} | {t} | {pm:.3f} | {pn:g} | "
                            f"{om:.3f} | {on:g} |")
            rows.append(f"| {state} | **all ops** | **{totals['plain']:.2f}**"
                        f" | | **{totals['ours']:.2f}** | |")
            print("\n".join(rows[-3:]), flush=True)
    return rows


#: ``--clock``: wall-clock seconds, or the process's CPU seconds (all its
#: threads: the work a step does, far less disturbed than its wall time
#: by other jobs on a loaded machine; includes the thread pools' spinning).
_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def policy_rows(policies, x_all, y_all, args):
    """The rows of the dtype-policy table (see the module docstring)."""
    from tf_sparse_split.tools.train import train_step_times

    rows = []
    old = keras.mixed_precision.global_policy()
    try:
        for policy in policies:
            keras.mixed_precision.set_global_policy(policy)
            for state in ("natural", f"target {args.target:g}"):
                plain, ours, rng = _prepared_pair(state, x_all, y_all, args)
                times, block = train_step_times(
                    {"plain": plain, "ours": ours}, x_all, y_all, BATCH,
                    rounds=args.policy_rounds, block=args.policy_block,
                    rng=rng, clock=_CLOCKS[args.clock])
                summ = speedup_summary(times, "ours", "plain")
                rows.append(
                    f"| {policy} | {state} | "
                    f"{1e3 * summ['reference_s']:.1f} | "
                    f"{1e3 * summ['ours_s']:.1f} | "
                    f"**{summ['median']:.2f}x** ({summ['min']:.2f}-"
                    f"{summ['max']:.2f}, {summ['rounds']} x {block}) | "
                    f"{_op_breakdown(ours)} |")
                print(rows[-1], flush=True)
    finally:
        keras.mixed_precision.set_global_policy(old)
    return rows


def _time(fn, args, reps):
    """Median seconds of ``fn(*args)`` with its outputs copied to the host."""
    return median_time(lambda: tf.nest.map_structure(
        lambda t: t.numpy() if hasattr(t, "numpy") else t, fn(*args)), reps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=parse_positive_int, default=7)
    p.add_argument("--reps", type=parse_positive_int, default=5, help="calls per part per round")
    p.add_argument("--warmup", type=parse_nonnegative_int, default=20, help="training steps first")
    p.add_argument("--data", default=None, help="MNIST IDX directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="report file (default: benchmarks/results/"
                   "bench_train_step.md, bench_train_step_policies.md for "
                   "--what policies; '' writes none)")
    p.add_argument("--breakdown-policy", default="float32",
                   help="Keras dtype policy of the part breakdown")
    p.add_argument("--what", choices=("breakdown", "policies", "ops", "all"),
                   default="all", help="the part breakdown, the "
                   "dtype-policy table, both ('all'), or the op profile of "
                   "--breakdown-policy ('ops', not part of 'all')")
    p.add_argument("--ops-rounds", type=parse_positive_int, default=4,
                   help="interleaved traced rounds per model (--what ops)")
    p.add_argument("--ops-steps", type=parse_positive_int, default=15,
                   help="traced steps per round (--what ops)")
    p.add_argument("--policies", default="float32,mixed_bfloat16,mixed_float16",
                   help="comma-separated Keras dtype policies")
    p.add_argument("--policy-rounds", type=parse_positive_int, default=8,
                   help="interleaved rounds per policy table row")
    p.add_argument("--policy-block", type=parse_positive_int, default=None,
                   help="steps per timed block (default: sized from the "
                   "faster model's step)")
    p.add_argument("--clock", choices=sorted(_CLOCKS), default="wall",
                   help="what the policy table times: wall-clock seconds or "
                   "the process's CPU seconds (under load)")
    p.add_argument("--target", type=parse_rate, default=0.9,
                   help="SparsityTargetCallback target of the induced rows")
    p.add_argument("--induce-epochs", type=parse_positive_int, default=3)
    p.add_argument("--induce-examples", type=parse_positive_int, default=6400)
    args = p.parse_args(argv)
    policies = [q.strip() for q in args.policies.split(",") if q.strip()]
    if not policies:
        p.error("--policies: give at least one Keras dtype policy")
    for flag, name in [("--breakdown-policy", args.breakdown_policy)] + [
            ("--policies", q) for q in policies]:
        try:
            keras.DTypePolicy(name)
        except ValueError as e:
            p.error(f"{flag}: {e}")
    if args.out is None:
        args.out = str(HERE / "results" / (
            "bench_train_step_policies.md" if args.what == "policies"
            else f"bench_train_step_ops_{args.breakdown_policy}.md"
            if args.what == "ops" else "bench_train_step.md"))
    tfss.load_library()
    tf.get_logger().setLevel("ERROR")  # one tf.function per part: no retracing notes
    keras.utils.set_random_seed(args.seed)
    x_all, y_all, data_desc = load_data(args.data)
    reports = []
    if args.what == "ops":
        old = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy(args.breakdown_policy)
        try:
            rows = op_rows(x_all, y_all, args)
        finally:
            keras.mixed_precision.set_global_policy(old)
        md = markdown_table(
            "| sparsity | op type | keras Dense: ms/step | runs/step | "
            "SparseSplitDense: ms/step | runs/step |", rows,
            f"Op profile of the training step (train_on_batch, "
            f"{args.breakdown_policy}), MLP 784-2048-2048-10, batch {BATCH}, "
            f"Adam, {data_desc}; natural sparsity after {args.warmup} steps "
            f"and after {args.induce_epochs} epochs of "
            f"SparsityTargetCallback({args.target:g}) (ours); tf.profiler "
            f"traces of {args.ops_steps} steps per model in "
            f"{args.ops_rounds} interleaved rounds, medians over rounds of "
            "the milliseconds per step each op type ran, summed over the "
            "threads (concurrent ops add up: the totals exceed the step's "
            f"wall time); TensorFlow {tf.__version__}, {cpus_desc()}, library "
            f"built with {build_info()['MARCH']}; load average "
            f"{os.getloadavg()[0]:.1f} at the end (other jobs on the machine "
            "inflate every time).")
        print(md)
        write_report(args.out, md)
        return 0
    if args.what in ("policies", "all"):
        policies = [q.strip() for q in args.policies.split(",") if q.strip()]
        rows = policy_rows(policies, x_all, y_all, args)
        reports.append(markdown_table(
            "| policy | sparsity | keras Dense step (ms) | SparseSplitDense "
            "step (ms) | ratio keras/ours (range, rounds x steps) | our ops: "
            "layer dtype, input sparsity: analysis/dense/sparse ms of the last "
            "call |", rows,
            f"Training step (train_on_batch) by dtype policy, MLP 784-2048-"
            f"2048-10, batch {BATCH}, Adam, {data_desc}; natural sparsity "
            f"after {args.warmup} steps, and after {args.induce_epochs} "
            f"epochs of SparsityTargetCallback({args.target:g}) on "
            f"{args.induce_examples} examples (ours); interleaved blocks "
            f"(tools.train.train_step_times), medians of "
            f"{'CPU seconds of the process (all threads)' if args.clock == 'cpu' else 'wall-clock seconds'}; TensorFlow "
            f"{tf.__version__}, {cpus_desc()}, library built with "
            f"{build_info()['MARCH']}; load average {os.getloadavg()[0]:.1f} "
            "at the end (other jobs on the machine widen the range)."))
    if args.what == "policies":
        print(reports[0])
        write_report(args.out, reports[0])
        return 0
    rng = np.random.default_rng(args.seed)
    keras.mixed_precision.set_global_policy(args.breakdown_policy)

    ref = Variant("keras Dense", sparse=False)
    ours = Variant("SparseSplitDense", sparse=True, weights=ref.dense_weights())
    variants = [ref, ours]

    def batch():
        idx = rng.integers(0, x_all.shape[0], BATCH)
        return tf.constant(x_all[idx]), tf.constant(y_all[idx])

    steps = {v.name: v.make_step() for v in variants}
    for _ in range(args.warmup):
        xb, yb = batch()
        for v in variants:
            steps[v.name](xb, yb)
    xb, yb = batch()
    for v in variants:
        v.make_parts(xb, yb)
        for fn, a in v.parts.values():  # trace + warm up every part
            _time(fn, a, 2)
    for v in variants:
        v.plans.clear()  # the timed calls' plans only
    names = list(ref.parts)
    res = {v.name: {n: [] for n in names} for v in variants}
    for r in range(args.rounds):
        for n in names:
            for v in rotated(variants, r):  # alternating order
                fn, a = v.parts[n]
                res[v.name][n].append(_time(fn, a, args.reps))

    def med(v, n):
        return statistics.median(res[v][n]) * 1e3

    lines = []
    title = (f"Training-step breakdown ({args.breakdown_policy}), MLP "
             f"784-2048-2048-10, batch {BATCH}, "
             f"Adam, {data_desc}, after {args.warmup} warm-up steps; medians "
             f"over {args.rounds} interleaved rounds of {args.reps} calls (ms; "
             f"min; spread = max/min of round medians); TensorFlow "
             f"{tf.__version__}, {cpus_desc()}, "
             f"library built with {build_info()['MARCH']}; load average "
             f"{os.getloadavg()[0]:.1f} at the end (other jobs on the machine "
             "widen the spread).")
    for n in names:
        cells = [format_median_min_spread(median_min_spread_ms(res[v.name][n]))
                 for v in variants]
        ratio = med(ref.name, n) / max(med(ours.name, n), 1e-9)
        lines.append(f"| {n} | {cells[0]} | {cells[1]} | {ratio:.2f} |")
    summed = {}
    for v in variants:
        s = sum(med(v.name, n) for n in names
                if n.split()[0] in ("fwd", "dW", "dX") or n == "optimizer")
        summed[v.name] = s
    lines.append(f"| sum of fwd + dW + dX + optimizer | {summed[ref.name]:.3f} | "
                 f"{summed[ours.name]:.3f} | "
                 f"{summed[ref.name] / summed[ours.name]:.2f} |")
    other = {v.name: med(v.name, "step") - summed[v.name] for v in variants}
    lines.append(f"| other = step - sum | {other[ref.name]:+.3f} | "
                 f"{other[ours.name]:+.3f} | |")
    step_ratio = med(ref.name, "step") / med(ours.name, "step")
    lines += ["", f"Whole-step ratio t(keras Dense) / t(SparseSplitDense) = "
              f"**{step_ratio:.2f}x** (median step {med(ref.name, 'step'):.2f} ms "
              f"vs {med(ours.name, 'step'):.2f} ms)."]
    dens = []
    for layer in ours.model.layers:
        s = layer.latest_stats()
        dens.append(f"{layer.name}: input sparsity {s['sparsity']:.2f}, "
                    f"threshold {s['threshold']:.3f}, rows dense "
                    f"{int(s['rows_dense'])}/{int(s['m'])}, zero columns "
                    f"skipped {int(s['zero_cols_skipped'])}/{int(s['k'])}")
    lines += ["", "SparseSplitDense statistics of the last call: " +
              "; ".join(dens) + "."]
    if ours.plans:
        lines += ["", "Plans of our backward products in the timed calls "
                  "(all rows dense / split / all rows sparse): " + "; ".join(
                      f"{n} {p.count('dense')}/{p.count('split')}/"
                      f"{p.count('sparse')}" for n, p in ours.plans.items())
                  + "."]
    lines += ["", _optimizer_control(ref, ours, res["keras Dense"]["optimizer"],
                                     res["SparseSplitDense"]["optimizer"])]
    md = markdown_table(
        "| part | keras Dense (ms) | SparseSplitDense (ms) | ratio keras/ours |",
        lines, title)
    md = "\n".join([md] + reports)
    print(md)
    write_report(args.out, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
