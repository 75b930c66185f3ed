"""Training step of an unchanged Keras MLP with the rewrite pass, against the
same model plain and converted to ``SparseSplitDense`` layers.

MLP 784-2048-2048-10 (:func:`tf_sparse_split.tools.models.build_mlp`: ReLU
hidden layers, softmax output), batch 128, Adam, sparse categorical
cross-entropy, ``model.train_on_batch`` (Keras' own train function,
``jit_compile=False``). Four models start from the same weights:

* ``plain``: ``keras.layers.Dense``, pass off;
* ``rewrite``: the same plain model, its train function instantiated with
  ``tf_sparse_split.rewrite.enable()`` on (the pass replaces its
  MatMul/BiasAdd/Relu and gradient MatMuls, the first layer's too, whose
  input -- MNIST pixels, ~80% zeros -- is the graph's input, a default
  producer, as the converted model's first layer does; what it did is
  printed);
* ``rewrite, ReLU-fed only``: the same with ``"Input"`` left out of the
  producers, so the first layer stays TensorFlow's;
* ``converted``: ``SparseSplitDense`` layers (automatic threshold,
  ``masked_input_grad`` after a ReLU).

All four train ``--warmup`` steps on the same batches first (so the
activations look like training's and the ops' cost models are calibrated),
then ``--rounds`` rounds of one block of ``--steps`` steps per model, in an
order that rotates per round. Reported: per model the median block time
per step (ms) with min and spread, and per round the speed-up over plain
(plain block time / model block time): median and range over rounds;
and the process CPU time per step (all threads; includes the thread pools'
spinning), which other tenants disturb less than the wall time.
The block-ratio medians are robust to a machine whose speed changes
between blocks (other tenants).

Usage::

    python benchmarks/bench_rewrite_train.py [--rounds 9] [--steps 10] [--warmup 30]
"""

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
import keras

import tf_sparse_split as tfss
from _common import (markdown_table, median_min_spread_ms,
                     format_median_min_spread, rotated, tf_machine_desc,
                     write_report)
from bench_train_step import BATCH, HIDDEN, load_data
from tf_sparse_split import rewrite
from tf_sparse_split._loader import build_info
from tf_sparse_split.tools.models import build_mlp

HERE = Path(__file__).resolve().parent


def _compiled(sparse, weights):
    model = build_mlp(784, HIDDEN, 10, sparse=sparse)
    if weights is not None:
        own = []
        it = iter(weights)
        for _ in model.layers:
            own += [next(it), next(it)]  # kernel, bias (no thresholds)
        model.set_weights(own)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  jit_compile=False)
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--data", default=None)
    p.add_argument("--out", default=str(HERE / "results" / "bench_rewrite_train.md"))
    args = p.parse_args(argv)
    tfss.load_library()
    x, y, data_desc = load_data(args.data)
    n_batches = x.shape[0] // BATCH
    batches = [(tf.constant(x[i * BATCH:(i + 1) * BATCH]),
                tf.constant(y[i * BATCH:(i + 1) * BATCH]))
               for i in range(min(n_batches, 64))]

    plain = _compiled(False, None)
    weights = [w for layer in plain.layers
               for w in (layer.kernel.numpy(), layer.bias.numpy())]
    rewrite.disable()
    plain.train_on_batch(*batches[0])          # instantiated with the pass off
    models = {"plain": plain}
    summaries = {}
    for name, producers in (
            ("rewrite", rewrite.DEFAULT_PRODUCERS),
            ("rewrite, ReLU-fed only", tuple(
                p for p in rewrite.DEFAULT_PRODUCERS if p != "Input"))):
        m = _compiled(False, weights)
        rewrite.log(clear=True)
        rewrite.reset_counters()
        with rewrite.enabled(producers=producers):
            m.train_on_batch(*batches[0])  # instantiated with the pass on
        summary = {}
        for r in rewrite.log():
            if r["action"] == "rewritten":
                key = f"{r['kind']}:{r['fused'] or r['new_op'].split('>')[-1]}"
                summary[key] = summary.get(key, 0) + 1
        summaries[name] = summary
        print(f"{name}: pass rewrote {summary}", flush=True)
        models[name] = m
    converted = _compiled(True, weights)
    converted.train_on_batch(*batches[0])
    models["converted"] = converted

    for i in range(args.warmup):
        for m in models.values():
            m.train_on_batch(*batches[(i + 1) % len(batches)])

    times = {k: [] for k in models}
    cpu = {k: [] for k in models}
    ratios = {k: [] for k in models if k != "plain"}
    names = list(models)
    step = 0
    for r in range(args.rounds):
        block = {}
        for name in rotated(names, r):
            m = models[name]
            t0, c0 = time.perf_counter(), time.process_time()
            for s in range(args.steps):
                m.train_on_batch(*batches[(step + s) % len(batches)])
            block[name] = (time.perf_counter() - t0) / args.steps
            cpu[name].append((time.process_time() - c0) / args.steps)
        step += args.steps
        for k, t in block.items():
            times[k].append(t)
        for k in ratios:
            ratios[k].append(block["plain"] / block[k])
        print(f"round {r}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in
                                           block.items()), flush=True)

    rows = []
    for k in names:
        rat = ratios.get(k)
        rat_s = ("1 (baseline)" if rat is None else
                 f"{statistics.median(rat):.3f} ({min(rat):.3f}-{max(rat):.3f})")
        cpu_ratio = statistics.median(cpu["plain"]) / statistics.median(cpu[k])
        rows.append(f"| {k} | {format_median_min_spread(median_min_spread_ms(times[k]))}"
                    f" | {rat_s} | {statistics.median(cpu[k]) * 1e3:.1f} "
                    f"({cpu_ratio:.3f}) |")
    text = markdown_table(
        "| model | ms per step: median (min, spread) | speed-up over plain: "
        "median (range) | process CPU ms per step: median (plain / model) |",
        rows,
        title=(f"Training step, MLP 784-{'-'.join(map(str, HIDDEN))}-10, batch "
               f"{BATCH}, train_on_batch; {args.rounds} rounds x {args.steps} "
               f"steps per model, interleaved; {data_desc}; "
               f"{tf_machine_desc(build_info())}; under load; nodes the "
               f"pass rewrote: {summaries}"))
    print(text)
    write_report(args.out, text)


if __name__ == "__main__":
    main()
