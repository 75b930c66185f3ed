"""Training-step time of the drop-in features against Keras' own layers.

Three choices are measured, each against the Keras layer it replaces, all
variants interleaved in the same run (alternating order per round):

* **LoRA on** ``SparseSplitDense`` (ReLU, bias): ``branch`` (the layer: the
  frozen kernel and the low-rank branch ``(x @ A) @ B`` as two
  ``SparseSplitMatMul`` products of the same sparse ``x``, no gradient for
  the frozen kernel) against ``merged`` (one op with Keras' merged kernel
  ``W + alpha/r * A @ B``, whose kernel gradient ``x^T dY`` is then
  computed in full and pushed to ``A`` and ``B``) and
  ``keras.layers.Dense`` with LoRA.
* **Grouped** ``SparseSplitConv2D``: one sparse-split convolution per group
  (the layer) against ``keras.layers.Conv2D(groups=...)`` (which Keras 3
  compiles with XLA on CPUs), TensorFlow's own grouped kernel
  (``tf.nn.conv2d`` with the grouped kernel, no XLA) and one dense
  ``tf.nn.conv2d`` per group.
* **``tf.SparseTensor`` inputs** to ``SparseSplitDense``: the layer (kernel
  rows of the live columns gathered, the op on the compacted dense input)
  against ``keras.layers.Dense`` (``tf.nn.embedding_lookup_sparse``); the
  step is the forward call and the weights' gradients.

A step (LoRA, grouped) is the forward call and the gradients of ``sum(y)``
for the trainable weights and the input (no optimizer), one
``tf.function``, on a fixed input with the given fraction of zeros. Prints
a markdown table (median ms over rounds, min, spread = max/min of the round
medians; Keras / variant of the medians and of the minima) and writes it to
``benchmarks/results/bench_dropins.md`` (``--out``).

Usage::

    python benchmarks/bench_dropins.py [--rounds 7] [--reps 5]
"""

import argparse
import os
import statistics

import keras
import numpy as np
import tensorflow as tf

import tf_sparse_split as tfss
from _common import (cpus_desc, format_median_min_spread, markdown_table,
                     median_min_spread_ms, median_time, rotated, write_report)
from tf_sparse_split.ops.matmul import sparse_split_matmul

HERE = os.path.dirname(os.path.abspath(__file__))


class _MergedLoraDense(tfss.SparseSplitDense):
    """The alternative LoRA formulation: one op with the merged kernel."""

    def call(self, inputs, training=None):
        x, kernel, _ = self._op_operands(inputs, self.kernel)
        y = sparse_split_matmul(x, kernel, threshold=self.threshold_var,
                                bias=tf.cast(self.bias, x.dtype),
                                activation="relu")
        return y


class _PerGroupDenseConv2D(keras.layers.Conv2D):
    """Grouped Conv2D as one ``tf.nn.conv2d`` per group (dense): separates
    what the split-per-group gains from what the zeros gain."""

    def convolution_op(self, inputs, kernel):
        xs = tf.split(inputs, self.groups, axis=-1)
        ks = tf.split(kernel, self.groups, axis=-1)
        return tf.concat([tf.nn.conv2d(xi, ki, list(self.strides),
                                       self.padding.upper())
                          for xi, ki in zip(xs, ks)], axis=-1)


class _TfGroupedConv2D(keras.layers.Conv2D):
    """Grouped Conv2D as one ``tf.nn.conv2d`` with the ``[KH, KW, C_in /
    groups, filters]`` kernel: TensorFlow's own grouped kernel (oneDNN),
    without the XLA compilation Keras wraps grouped convolutions in on
    CPUs."""

    def convolution_op(self, inputs, kernel):
        return tf.nn.conv2d(inputs, kernel, list(self.strides),
                            self.padding.upper())


def _build_alike(layers, k):
    """Builds each layer for ``[None, k]`` inputs with the first one's
    weights."""
    weights = None
    for layer in layers:
        layer.build((None, k))
        if weights is None:
            weights = layer.get_weights()
        layer.set_weights(weights)

def _sparse_input(rng, shape, sparsity):
    x = np.abs(rng.standard_normal(shape)).astype(np.float32)
    x[rng.random(shape) < sparsity] = 0.0
    return tf.constant(x)


def _step_fn(layer, x):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, layer.trainable_weights + [x])
    return step


def _time_variants(variants, rounds, reps, slow=()):
    """{name: [round medians]} of interleaved rounds; the variants named in
    ``slow`` run one call per round."""
    for name, fn in variants.items():  # trace, calibrate, warm up
        for _ in range(1 if name in slow else 3):
            fn()
    times = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in rotated(names, r):
            times[name].append(median_time(
                variants[name], 1 if name in slow else reps))
    return times


def _rows(label, times, baseline):
    rows = []
    base = statistics.median(times[baseline])
    base_min = min(times[baseline])
    for name, t in times.items():
        ratio = base / statistics.median(t)
        rows.append(f"| {label} | {name} | "
                    f"{format_median_min_spread(median_min_spread_ms(t))} | "
                    f"{ratio:.2f} | {base_min / min(t):.2f} |")
    return rows


def lora_rows(rounds, reps, m=256, k=1024, n=1024, rank=8):
    rows = []
    rng = np.random.default_rng(0)
    for sparsity in (0.5, 0.9):
        x = _sparse_input(rng, (m, k), sparsity)
        layers = {"keras Dense": keras.layers.Dense(n, activation="relu"),
                  "branch (layer)": tfss.SparseSplitDense(
                      n, activation="relu"),
                  "merged": _MergedLoraDense(n, activation="relu",
                                             name="merged_lora")}
        _build_alike(layers.values(), k)
        for layer in layers.values():
            layer.enable_lora(rank)
        fns = {name: _step_fn(layer, x) for name, layer in layers.items()}
        times = _time_variants(fns, rounds, reps)
        rows += _rows(f"LoRA Dense {m}x{k}x{n} r={rank}, {sparsity:.0%} zeros",
                      times, "keras Dense")
    return rows


def grouped_rows(rounds, reps, batch=16, hw=32, c=128, f=128):
    rows = []
    rng = np.random.default_rng(1)
    for groups in (2, 4):
        for sparsity in (0.5, 0.9):
            x = _sparse_input(rng, (batch, hw, hw, c), sparsity)
            kw = dict(padding="same", groups=groups, activation="relu")
            layers = {"keras Conv2D": keras.layers.Conv2D(f, 3, **kw),
                      "tf.nn.conv2d grouped": _TfGroupedConv2D(
                          f, 3, name="tf_grouped", **kw),
                      "per-group tf.nn.conv2d": _PerGroupDenseConv2D(
                          f, 3, name="per_group_dense", **kw),
                      "per-group (layer)": tfss.SparseSplitConv2D(f, 3, **kw)}
            weights = None
            for layer in layers.values():
                layer.build((None, hw, hw, c))
                if weights is None:
                    weights = layer.get_weights()
                layer.set_weights(weights)
            fns = {name: _step_fn(layer, x) for name, layer in layers.items()}
            times = _time_variants(fns, rounds, reps,
                                   slow=("keras Conv2D",))
            rows += _rows(
                f"Conv2D {batch}x{hw}x{hw}x{c}->{f} 3x3 groups={groups}, "
                f"{sparsity:.0%} zeros", times, "keras Conv2D")
    return rows


def sparse_tensor_rows(rounds, reps, m=256, k=4096, n=512):
    rows = []
    rng = np.random.default_rng(2)
    for density in (0.01, 0.1, 0.3):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[rng.random(x.shape) >= density] = 0.0
        x = tf.sparse.from_dense(x)
        layers = {"keras Dense": keras.layers.Dense(n, activation="relu"),
                  "live columns + op (layer)": tfss.SparseSplitDense(
                      n, activation="relu")}
        _build_alike(layers.values(), k)
        fns = {}
        for name, layer in layers.items():
            def step(layer=layer):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(layer(x, training=True))
                return tape.gradient(loss, layer.trainable_weights)
            fns[name] = tf.function(step)
        times = _time_variants(fns, rounds, reps, slow=("keras Dense",))
        rows += _rows(f"SparseTensor {m}x{k} ({density:.0%} stored) x {n}",
                      times, "keras Dense")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", choices=("lora", "grouped", "sparse"),
                   default=None)
    p.add_argument("--out", default=os.path.join(HERE, "results",
                                                 "bench_dropins.md"))
    args = p.parse_args(argv)
    rows = []
    if args.only in (None, "lora"):
        rows += lora_rows(args.rounds, args.reps)
    if args.only in (None, "grouped"):
        rows += grouped_rows(args.rounds, args.reps)
    if args.only in (None, "sparse"):
        rows += sparse_tensor_rows(args.rounds, args.reps)
    text = markdown_table(
        "| problem | variant | step ms: median (min, spread) | "
        "Keras / variant (medians) | Keras / variant (mins) |",
        rows,
        title=(f"Training step (forward + gradients), {cpus_desc()}, "
               f"TensorFlow {tf.__version__}, {args.rounds} interleaved "
               f"rounds of {args.reps} calls (Keras' grouped Conv2D: 1 call "
               f"per round); load average {os.getloadavg()[0]:.1f} at the "
               "end (other jobs on the machine widen the spread)"))
    print(text)
    write_report(args.out, text)


if __name__ == "__main__":
    main()
