"""Where a training step of the CLI's CNN spends its time, per op, for both
models of ``bench_induce.py --case cnn``.

The sparse-split CNN (``SparseSplitConv2D``/``SparseSplitDense`` trained with
``SparsityTargetCallback(--target)``, which turns the ReLUs into FATReLUs) and
the plain Keras one are trained ``--epochs`` epochs on ``--train`` MNIST
images, then ``--steps`` ``train_on_batch`` steps of each are traced with
``tf.profiler`` and the host trace (``*.xplane.pb``) is read directly: the
time of every TensorFlow op per step (summed over the executor threads, so
on a loaded machine it includes waiting for a core), largest first. Then
both step times are measured interleaved (``--rounds`` blocks of 8 steps;
median, min, max).

  python benchmarks/profile_cnn_step.py --data /work/shared/data/mnist
"""

import argparse
import collections
import glob
import os
import re
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

import tf_sparse_split as tfss  # noqa: E402
from tf_sparse_split.tools import datasets, models  # noqa: E402


def _compile(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy", jit_compile=False)
    return model


def op_times(logdir):
    """``{op name: microseconds}`` summed over the host trace of logdir
    (TensorFlow ops are the events named ``name:Type``)."""
    path = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"),
                     recursive=True)[0]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as fh:
        space.ParseFromString(fh.read())
    total = collections.Counter()
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                name = plane.event_metadata[ev.metadata_id].name
                if ":" in name and not name.startswith((
                        "EagerLocalExecute", "KernelAndDevice", "Executor")):
                    total[name] += ev.duration_ps / 1e6
    return total


def short(name):
    """``scope/.../op:Type`` -> ``layer op:Type`` (the gradient and cond
    scopes shortened)."""
    op, _, typ = name.rpartition(":")
    parts = [p for p in op.split("/") if p and not p.startswith(
        ("cond", "then", "else", "_"))]
    grad = "grad " if parts and parts[0] == "gradient_tape" else ""
    layer = next((re.sub(r"_1$", "", p) for p in parts if p.startswith(
        ("conv_", "output", "pool", "flatten"))), parts[0] if parts else "")
    return f"{grad}{layer} {parts[-1] if parts else op}:{typ.split('>')[-1]}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/work/shared/data/mnist")
    p.add_argument("--train", type=int, default=30000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()

    (x, y), _ = datasets.load_mnist(args.data)
    x = x.reshape(-1, 28, 28, 1)
    keras.utils.set_random_seed(0)
    ours = _compile(models.build_cnn(28, [16, 32], 10, sparse=True))
    keras.utils.set_random_seed(0)
    plain = _compile(models.build_cnn(28, [16, 32], 10, sparse=False))
    cbs = [tfss.SparsityTargetCallback(args.target, l1=2.0),
           tfss.SplitThresholdCallback()]
    xs, ys = x[:args.train], y[:args.train]
    for _ in range(args.epochs):
        ours.fit(xs, ys, epochs=1, batch_size=128, verbose=0, callbacks=cbs)
        plain.fit(xs, ys, epochs=1, batch_size=128, verbose=0)
    rng = np.random.default_rng(0)
    batches = [rng.choice(len(x), 128, replace=False) for _ in range(8)]

    def run(model, steps):
        for i in range(steps):
            b = batches[i % len(batches)]
            model.train_on_batch(x[b], y[b])

    for name, model in (("ours", ours), ("plain", plain)):
        run(model, 8)  # warm
        logdir = tempfile.mkdtemp(prefix=f"cnn_{name}_")
        tf.profiler.experimental.start(logdir)
        run(model, args.steps)
        tf.profiler.experimental.stop()
        times = op_times(logdir)
        shutil.rmtree(logdir, ignore_errors=True)
        print(f"\n== {name}: {sum(times.values()) / args.steps / 1e3:.1f} ms "
              "of op time per step (summed over threads)")
        for op, us in times.most_common(args.top):
            print(f"  {us / args.steps / 1e3:7.2f} ms  {short(op)}")

    t = {"ours": [], "plain": []}
    for _ in range(args.rounds):
        for name, model in (("ours", ours), ("plain", plain)):
            t0 = time.perf_counter()
            run(model, 8)
            t[name].append((time.perf_counter() - t0) / 8 * 1e3)
    for name, v in t.items():
        print(f"{name} step: median {np.median(v):.1f} ms (min {min(v):.1f},"
              f" max {max(v):.1f})")
    ratio = np.array(t["plain"]) / np.array(t["ours"])
    print(f"plain/ours: median {np.median(ratio):.2f}x, range "
          f"{ratio.min():.2f}-{ratio.max():.2f}x")


if __name__ == "__main__":
    main()
