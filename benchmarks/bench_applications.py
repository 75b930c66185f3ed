"""Standard BatchNorm architectures from ``keras.applications``: training
step and inference, plain Keras against the same model converted whole with
``tfss.sparse_split_model``.

Models (``weights=None``: nothing is downloaded; ``--size`` x ``--size`` x 3
inputs, 10 classes): ``resnet50`` (ResNet50, BatchNorm then ReLU before
every 3x3 and 1x1 convolution but the first), ``mobilenetv2`` (MobileNetV2:
its 1x1 expansion/projection convolutions are replaced; the depthwise ones
stay TF's), ``densenet121`` (DenseNet121: BN-ReLU-conv blocks).

Data: MNIST test images (``--data``, default ``$TFSS_MNIST_DIR``,
``../shared/data/mnist`` beside the repository or
``/work/shared/data/mnist``; else scikit-learn's digits upsampled; the report
says which) resized to ``--size`` and repeated over 3 channels.

Both models start from the same weights; the plain one is first trained for
``--pretrain`` steps so that the activations are those of a network in
training, not of a fresh initialisation. Training: ``--rounds`` interleaved
rounds of ``--block`` ``train_on_batch`` steps per model (the order rotated
every round, :func:`tf_sparse_split.tools.timing.interleaved_blocks`), on
the same batches. Inference: a ``tf.function`` of ``model(x,
training=False)`` at ``--batch``, interleaved the same way. Reported:
median seconds per step of each, the speed-up ``plain / converted`` (> 1:
converted faster) as the median of the per-round ratios with their range,
process CPU time per step, and the largest absolute difference of the
inference outputs. The per-layer table gives, for every converted
convolution and dense layer, the fraction of zeros its input had in the
timed training steps, the images (rows) it sent to the sparse kernel, and
its op's seconds per call in the dense part, the sparse part and the
analysis (from the op's statistics).

Usage::

    python benchmarks/bench_applications.py [--models resnet50,mobilenetv2]
        [--size 64] [--batch 16] [--rounds 9] [--block 2] [--quick]

``--quick``: ResNet50 at 32x32, batch 4, 2 rounds of 1 step, nothing
written unless ``--out`` is given (a smoke test of the script).

``--profile STEPS``: also traces ``STEPS`` training steps of each model
with ``tf.profiler`` (after the timed rounds, plain then converted) and
reports the host time per op type of each (milliseconds per step, summed
over the op's executions; nested events, such as a function call and the
ops inside it, each count) -- where the converted step gains and loses.

``--filter-grads REPS``: per convolution of the plain model, its filter and
bias gradient on the layer's real input (a training-mode forward pass of
the plain model) and a dense random dY (as BatchNorm's backward pass makes
it): ``SparseSplitConv2DBackpropFilterWithBias`` with the automatic
threshold, as the converted model's gradient calls it, against
TensorFlow's ``Conv2DBackpropFilter + BiasAddGrad`` (fused into oneDNN's
``_MklNativeConv2DBackpropFilterWithBias`` as in the plain model's graph),
``REPS`` interleaved calls each, medians.
"""

import argparse
import collections
import glob
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import tf_sparse_split as tfss  # noqa: E402
from _common import (load_mnist_or_digits, markdown_table,  # noqa: E402
                     tf_machine_desc, write_report)
from tf_sparse_split._loader import build_info  # noqa: E402
from tf_sparse_split.tools.timing import (interleaved_blocks,  # noqa: E402
                                          speedup_summary)

HERE = Path(__file__).resolve().parent
MODELS = {
    "resnet50": keras.applications.ResNet50,
    "mobilenetv2": keras.applications.MobileNetV2,
    "densenet121": keras.applications.DenseNet121,
}


def images(x, size, n):
    """``n`` MNIST rows ``[n, 784]`` as ``[n, size, size, 3]`` float32."""
    img = tf.reshape(tf.constant(x[:n]), [-1, 28, 28, 1])
    img = tf.image.resize(img, [size, size])
    return tf.repeat(img, 3, axis=-1).numpy().astype(np.float32)


def build(name, size, seed):
    keras.utils.set_random_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[name](weights=None, input_shape=(size, size, 3),
                            classes=10)


def compile_model(model):
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy", jit_compile=False)
    return model


def split_layers(model):
    return [layer for layer in model._flatten_layers(include_self=False,
                                                     recursive=True)
            if isinstance(layer, tfss.SparseSplitLayer)]


def cpu_per_step(step, n):
    t0 = time.process_time()
    for i in range(n):
        step(i)
    return (time.process_time() - t0) / n


def layer_rows(model):
    rows = []
    for layer in split_layers(model):
        try:
            s = layer.accumulated_stats()
        except RuntimeError:
            continue
        calls = s.get("calls", 0)
        if not calls:
            continue
        images_total = s["rows_dense"] + s["rows_sparse"]
        rows.append([layer.name, type(layer).__name__, f"{s['sparsity']:.2f}",
                     f"{s['rows_sparse'] / max(images_total, 1):.2f}",
                     f"{s['time_dense'] / calls * 1e3:.2f}",
                     f"{s['time_sparse'] / calls * 1e3:.2f}",
                     f"{s['time_analyze'] / calls * 1e3:.3f}", str(calls)])
    return rows


def op_type_ms(step, steps):
    """Host milliseconds per step by op type over ``steps`` calls of
    ``step(i)``, from a ``tf.profiler`` trace (its XPlane: events named
    ``name:type`` on the host plane's threads)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for i in range(steps):
            step(i)
        tf.profiler.experimental.stop()
        paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"),
                          recursive=True)
        space = xplane_pb2.XSpace()
        with open(paths[0], "rb") as f:
            space.ParseFromString(f.read())
    total = collections.Counter()
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                name = names.get(ev.metadata_id, "")
                if ":" not in name:
                    continue
                total[name.rsplit(":", 1)[1]] += ev.duration_ps * 1e-9
    return {k: v / steps for k, v in total.items()}


def profile_rows(prof, top=40):
    """Rows (op type, plain ms, converted ms, converted - plain) for the op
    types with the most time in either step, largest first."""
    plain, ours = prof["plain"], prof["converted"]
    keys = sorted(set(plain) | set(ours),
                  key=lambda k: -max(plain.get(k, 0.0), ours.get(k, 0.0)))
    return [[k, f"{plain.get(k, 0.0):.2f}", f"{ours.get(k, 0.0):.2f}",
             f"{ours.get(k, 0.0) - plain.get(k, 0.0):+.2f}"]
            for k in keys[:top]]


def filter_grad_rows(model, x, reps):
    """Rows (layer, input shape, filter, stride, input zeros, TF ms, ours ms,
    TF / ours, share of images sparse) of every Conv2D of ``model`` (see
    ``--filter-grads``) and the totals."""
    from tf_sparse_split._loader import load_library
    from tf_sparse_split.tuning import stats as S

    lib = load_library()
    convs = [layer for layer in model._flatten_layers(include_self=False,
                                                      recursive=True)
             if type(layer) is keras.layers.Conv2D and layer.use_bias]
    if not convs:
        return None
    acts = keras.Model(model.input, [c.input for c in convs])(
        x, training=True)
    acts = acts if isinstance(acts, (list, tuple)) else [acts]
    rng = np.random.default_rng(0)
    rows, tot = [], [0.0, 0.0]
    for layer, a in zip(convs, acts):
        a = tf.constant(np.asarray(a))
        k = layer.kernel
        st = [1, layer.strides[0], layer.strides[1], 1]
        pad = layer.padding.upper()
        dy = tf.constant(rng.normal(size=tf.nn.conv2d(a, k, st, pad).shape)
                         .astype(np.float32))
        fs = tf.constant(list(k.shape), tf.int32)

        @tf.function
        def theirs(a, dy, fs=fs, st=st, pad=pad):
            return (tf.raw_ops.Conv2DBackpropFilter(
                input=a, filter_sizes=fs, out_backprop=dy, strides=st,
                padding=pad), tf.raw_ops.BiasAddGrad(out_backprop=dy))

        @tf.function
        def ours(a, dy, fs=fs, st=st, pad=pad):
            return lib.tf_sparse_split_sparse_split_conv2d_backprop_filter_with_bias(
                a, fs, dy, tf.constant(-1.0), strides=st, padding=pad,
                full_stats=False)

        last = {}

        def run_ours(i):
            out = ours(a, dy)
            out[0].numpy()
            last["stats"] = out[2].numpy()

        fns = {"tf": lambda i: theirs(a, dy)[0].numpy(), "ours": run_ours}
        for f in fns.values():
            for i in range(3):
                f(i)
        r = interleaved_blocks(fns, rounds=reps, block=1)
        sp = speedup_summary(r, "ours", "tf")
        st_ = last["stats"]
        images = max(st_[S.ROWS_DENSE] + st_[S.ROWS_SPARSE], 1)
        tot[0] += sp["reference_s"]
        tot[1] += sp["ours_s"]
        rows.append([layer.name, "x".join(str(d) for d in a.shape[1:]),
                     f"{k.shape[0]}x{k.shape[1]}->{k.shape[3]}",
                     str(layer.strides[0]),
                     f"{float(np.mean(a.numpy() == 0)):.2f}",
                     f"{sp['reference_s'] * 1e3:.2f}",
                     f"{sp['ours_s'] * 1e3:.2f}", f"{sp['median']:.2f}",
                     f"{st_[S.ROWS_SPARSE] / images:.2f}"])
    rows.append(["total", "", "", "", "", f"{tot[0] * 1e3:.1f}",
                 f"{tot[1] * 1e3:.1f}", f"{tot[0] / max(tot[1], 1e-12):.2f}",
                 ""])
    return rows


def run_model(name, args, x_all, y_all):
    size, batch = args.size, args.batch
    xs = images(x_all, size, batch * args.batches)
    ys = y_all[:batch * args.batches].astype(np.int32)
    batches = [(xs[i * batch:(i + 1) * batch], ys[i * batch:(i + 1) * batch])
               for i in range(args.batches)]
    plain = compile_model(build(name, size, args.seed))
    for i in range(args.pretrain):
        plain.train_on_batch(*batches[i % len(batches)])
    ours = compile_model(tfss.sparse_split_model(plain))
    n_split = len(split_layers(ours))
    n_conv = sum(isinstance(layer, keras.layers.Conv2D)
                 for layer in plain._flatten_layers(include_self=False,
                                                    recursive=True))

    # Inference first (outputs compared on the same weights).
    fns = {"plain": tf.function(lambda x: plain(x, training=False)),
           "converted": tf.function(lambda x: ours(x, training=False))}
    xb = tf.constant(batches[0][0])
    out = {k: f(xb).numpy() for k, f in fns.items()}
    diff = float(np.max(np.abs(out["plain"] - out["converted"])))
    for f in fns.values():
        for _ in range(args.warmup):
            f(xb).numpy()
    inf = interleaved_blocks(
        {k: (lambda i, f=f: f(xb).numpy()) for k, f in fns.items()},
        rounds=args.rounds, block=args.block)
    inf_s = speedup_summary(inf, "converted", "plain")

    steps = {"plain": lambda i: plain.train_on_batch(
                 *batches[i % len(batches)]),
             "converted": lambda i: ours.train_on_batch(
                 *batches[i % len(batches)])}
    for step in steps.values():
        for i in range(args.warmup):
            step(i)
    for layer in split_layers(ours):
        layer.reset_stats()
    tr = interleaved_blocks(steps, rounds=args.rounds, block=args.block)
    tr_s = speedup_summary(tr, "converted", "plain")
    cpu = {k: cpu_per_step(s, args.block) for k, s in steps.items()}
    layers = layer_rows(ours)
    fg = None
    if args.filter_grads:
        fg = filter_grad_rows(plain, tf.constant(batches[0][0]),
                              args.filter_grads)
    prof = None
    if args.profile:
        prof = profile_rows({k: op_type_ms(s, args.profile)
                             for k, s in steps.items()})
    return {"name": name, "train": tr_s, "infer": inf_s, "diff": diff,
            "cpu": cpu, "layers": layers, "n_split": n_split,
            "n_conv": n_conv, "profile": prof, "filter_grads": fg}


def fmt(s):
    return (f"{s['reference_s'] * 1e3:.1f} / {s['ours_s'] * 1e3:.1f}",
            f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})")


def table(head, rows):
    return markdown_table("| " + " | ".join(head) + " |",
                          ["| " + " | ".join(r) + " |" for r in rows])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,mobilenetv2",
                   help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--size", type=int, default=64, help="input height/width")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=4,
                   help="distinct batches cycled through")
    p.add_argument("--pretrain", type=int, default=20,
                   help="plain training steps before converting")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--block", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="MNIST directory")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--note", default="",
                   help="a line added to the report (e.g. the load)")
    p.add_argument("--filter-grads", type=int, default=0, metavar="REPS",
                   help="time every convolution's filter + bias gradient, "
                        "ours against TF's, REPS interleaved calls")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="trace STEPS training steps per model with "
                        "tf.profiler and report host ms per op type")
    p.add_argument("--out", default=None,
                   help="markdown report (default "
                        "benchmarks/results/bench_applications.md; "
                        "--quick: none)")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.size, args.batch = "resnet50", 32, 4
        args.rounds, args.block, args.warmup = 2, 1, 1
        args.pretrain, args.batches = 1, 2
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for n in names:
        if n not in MODELS:
            p.error(f"unknown model {n!r}; choose from {', '.join(MODELS)}")
    out_path = args.out
    if out_path is None and not args.quick:
        out_path = str(HERE / "results" / "bench_applications.md")

    (_, _), (xt, yt), data_desc = load_mnist_or_digits(args.data)
    results = []
    for n in names:
        r = run_model(n, args, xt, yt)
        results.append(r)
        print(f"{n}: train {fmt(r['train'])[1]}x, infer "
              f"{fmt(r['infer'])[1]}x, max |diff| {r['diff']:.2e}",
              flush=True)

    head = ["model", "convs / layers converted",
            "train ms/step plain / converted", "train speed-up (range)",
            "CPU ms/step plain / converted",
            "infer ms plain / converted", "infer speed-up (range)",
            "max abs diff"]
    rows = []
    for r in results:
        tr_ms, tr_x = fmt(r["train"])
        in_ms, in_x = fmt(r["infer"])
        rows.append([r["name"], f"{r['n_conv']} / {r['n_split']}", tr_ms,
                     tr_x, f"{r['cpu']['plain'] * 1e3:.1f} / "
                     f"{r['cpu']['converted'] * 1e3:.1f}", in_ms, in_x,
                     f"{r['diff']:.1e}"])
    text = [f"Standard BatchNorm architectures (keras.applications, "
            f"weights=None, {args.size}x{args.size}x3, batch {args.batch}), "
            f"float32; {tf_machine_desc(build_info())}; {data_desc}; "
            f"{args.rounds} interleaved rounds x {args.block} steps."
            + (f" {args.note}" if args.note else ""), "",
            table(head, rows), ""]
    for r in results:
        text += [f"Per layer, {r['name']} (timed training steps; op "
                 "seconds per call from its statistics):", "",
                 table(["layer", "class", "input zeros",
                        "share of images sparse", "dense ms", "sparse ms",
                        "analysis ms", "calls"], r["layers"]), ""]
        if r["filter_grads"]:
            text += [f"Filter + bias gradient per convolution, {r['name']} "
                     f"(real layer inputs, dense random dY; "
                     f"{args.filter_grads} interleaved calls, medians):", "",
                     table(["layer", "input HxWxC", "filter", "stride",
                            "input zeros", "TF ms", "ours ms",
                            "TF / ours", "share of images sparse"],
                           r["filter_grads"]), ""]
        if r["profile"]:
            text += [f"Host ms per training step by op type, {r['name']} "
                     f"(tf.profiler, {args.profile} steps each; nested "
                     "events each count):", "",
                     table(["op type", "plain ms", "converted ms",
                            "converted - plain"], r["profile"]), ""]
    report = "\n".join(text)
    print(report)
    write_report(out_path, report)


if __name__ == "__main__":
    main()
