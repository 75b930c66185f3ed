"""Inference latency of trained models: plain Keras, converted to
sparse-split layers, and the graph-rewrite pass.

Models (trained briefly with plain Keras layers on MNIST from ``--data``,
default ``$TFSS_MNIST_DIR``, ``../shared/data/mnist`` beside the repository
or ``/work/shared/data/mnist``; else scikit-learn's digits upsampled to
28x28; the report says which):

* ``mlp``: MLP 784-2048-2048-10 (ReLU, softmax);
* ``cnn-small``: conv3x3(16)-ReLU-maxpool2-conv3x3(32)-ReLU-maxpool2-dense(10);
* ``cnn-wide``: conv3x3(64)-ReLU-maxpool2-conv3x3(128)-ReLU-maxpool2-dense(10).

For each model and batch size (1, 32, 256; examples of the test set) three
variants compute the same function (checked: largest absolute difference of
the outputs):

* ``plain``: ``tf.function(lambda x: model(x, training=False))``, as
  ``predict`` runs it;
* ``converted``: the same on ``tfss.sparse_split_model(model)`` (same
  weight values, automatic threshold, statistics off as in ``predict``);
* ``rewrite``: a copy of the plain model in a new ``tf.function`` first
  called inside ``tfss.rewrite.enabled()``, so the pass replaces its
  ReLU-fed ``MatMul``/``Conv2D`` nodes (the number replaced is reported);
* ``plain again``: another copy of the plain model, made and called like
  ``plain`` -- an A/A control: its ratio is this harness's own bias and
  noise on this machine, the floor under which a difference of the other
  two variants means nothing.

Each variant reads weights of its own (the copies are
``keras.models.clone_model`` with the same values): in the rotated order
every variant then follows one that read other weight buffers. Sharing
them biased the comparison -- ``plain`` and ``plain again`` each ran right
after a variant that had just read the same weights, and found them in
the cache, while ``converted`` and ``rewrite`` did not (MLP at batch 32 on
the 2-core Xeon: the first call of a block 2.9 ms warm against 4.3 ms
cold; with shared weights the converted MLP read 0.80-0.92 and the
control 0.99, a copy of the plain model timed in the same position as
the converted one 0.82-0.85).

Timing: after warm-up, ``--rounds`` interleaved rounds (the order of the
variants rotated every round); each round times ``--reps`` calls of each
variant (the output copied to the host). Reported: p50 over all calls in ms,
and ``plain p50 / variant p50`` (> 1 = faster than plain) with the range of
the per-round ratios of medians. Writes a markdown table to
``benchmarks/results/bench_inference.md`` (``--out``) and a bar chart of the
ratios beside it (``.png``).

Usage::

    python benchmarks/bench_inference.py [--rounds 15] [--reps 5] [--quick]

``--quick``: a few training steps, batches 1 and 32, 3 rounds of 2 calls,
nothing written unless ``--out`` is given (a smoke test of the script).
"""

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import tf_sparse_split as tfss  # noqa: E402
from _common import (cpus_desc, load_mnist_or_digits, markdown_table,  # noqa: E402
                     rotated, write_report)
from tf_sparse_split._loader import build_info  # noqa: E402

HERE = Path(__file__).resolve().parent
VARIANTS = ("plain", "converted", "rewrite", "plain again")


def build(name):
    """The uncompiled plain Keras model ``name`` (see the module docstring)."""
    L = keras.layers
    if name == "mlp":
        return keras.Sequential([
            keras.Input((784,)), L.Dense(2048, activation="relu"),
            L.Dense(2048, activation="relu"),
            L.Dense(10, activation="softmax")], name="mlp")
    c1, c2 = {"cnn-small": (16, 32), "cnn-wide": (64, 128)}[name]
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        L.Conv2D(c1, 3, padding="same", activation="relu"), L.MaxPooling2D(2),
        L.Conv2D(c2, 3, padding="same", activation="relu"), L.MaxPooling2D(2),
        L.Flatten(), L.Dense(10, activation="softmax")],
        name=name.replace("-", "_"))


def shaped(name, x):
    return x if name == "mlp" else x.reshape(-1, 28, 28, 1)


def train(name, x, y, xt, yt, steps, batch, seed):
    """The plain model trained ``steps`` Adam steps; (model, test accuracy)."""
    keras.utils.set_random_seed(seed)
    model = build(name)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=False)
    n = min(len(x), steps * batch)
    model.fit(shaped(name, x[:n]), y[:n], batch_size=batch, epochs=1,
              verbose=0)
    acc = model.evaluate(shaped(name, xt), yt, batch_size=256, verbose=0)[1]
    return model, float(acc)


def convert(model):
    """``tfss.sparse_split_model(model)`` with statistics off (as in
    ``predict``)."""
    converted = tfss.sparse_split_model(model)
    for layer in converted._flatten_layers(include_self=False,
                                           recursive=True):
        if isinstance(layer, tfss.SparseSplitLayer):
            layer.record_stats = False
    return converted


def copy_of(model):
    """A plain Keras model computing what ``model`` does, with weights of
    its own (not shared variables)."""
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    return twin


def variants(model, converted):
    """``{variant: new tf.function(x)}`` (not yet called). Every variant
    reads weights of its own: a variant run right after one that read the
    same weight buffers finds them in the cache, one run after another
    model's does not (the MLP at batch 32 on the 2-core Xeon: 2.9 ms
    against 4.3 ms for the first call of a round's block, the next calls
    converging over about five), so shared weights favour the variants
    the rotation puts after their twins."""
    rewrite_model, again_model = copy_of(model), copy_of(model)
    return {"plain": tf.function(lambda x: model(x, training=False)),
            "converted": tf.function(lambda x: converted(x, training=False)),
            "rewrite": tf.function(lambda x: rewrite_model(x, training=False)),
            "plain again": tf.function(
                lambda x: again_model(x, training=False))}


def instantiate(fns, x):
    """First call of every variant (the rewrite one with the pass on);
    returns (outputs, {op: nodes rewritten})."""
    from tf_sparse_split import rewrite

    outs = {}
    for name in ("plain", "converted", "plain again"):
        outs[name] = fns[name](x).numpy()
    # The plain graphs above were instantiated with the pass off on purpose.
    rewrite._take_missed()
    before = rewrite.counters()
    with rewrite.enabled(ops=rewrite.active_ops()):
        outs["rewrite"] = fns["rewrite"](x).numpy()
    after = rewrite.counters()
    return outs, {k: after[k] - before.get(k, 0) for k in after
                  if after[k] - before.get(k, 0) > 0}


def time_variants(fns, x, rounds, reps, warmup):
    """``{variant: {"calls": [s], "round_medians": [s]}}``, interleaved."""
    for fn in fns.values():
        for _ in range(warmup):
            fn(x).numpy()
    res = {v: {"calls": [], "round_medians": []} for v in fns}
    names = list(fns)
    for r in range(rounds):
        for v in rotated(names, r):
            fn, ts = fns[v], []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(x).numpy()
                ts.append(time.perf_counter() - t0)
            res[v]["calls"] += ts
            res[v]["round_medians"].append(statistics.median(ts))
    return res


def plot(rows, path):
    """Bar chart of the ratios (converted, rewrite, the A/A control) per
    model and batch."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\nbatch {r['batch']}" for r in rows]
    xs = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    shown = ("converted", "rewrite", "plain again")
    width = 0.8 / len(shown)
    for k, v in enumerate(shown):
        ratios = [r[v]["ratio"] for r in rows]
        # The p50 ratio (over all calls) can lie outside the range of the
        # per-round ratios of medians: clip the bars at the bar's height.
        lo = [max(0.0, r[v]["ratio"] - r[v]["lo"]) for r in rows]
        hi = [max(0.0, r[v]["hi"] - r[v]["ratio"]) for r in rows]
        ax.bar(xs + (k - (len(shown) - 1) / 2) * width, ratios, width,
               yerr=[lo, hi], capsize=3,
               label=v + (" (A/A control)" if v == "plain again" else ""))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("plain p50 / variant p50 (> 1: faster)")
    ax.set_title("Inference latency vs plain Keras (bars: range of "
                 "per-round ratios)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="MNIST IDX directory")
    p.add_argument("--models", default="mlp,cnn-small,cnn-wide")
    p.add_argument("--batches", default=None,
                   help="comma-separated batch sizes (default 1,32,256)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds (default 15)")
    p.add_argument("--reps", type=int, default=None,
                   help="calls per variant per round (default 5)")
    p.add_argument("--train-steps", type=int, default=None,
                   help="Adam steps of batch 128 per model (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny training, batches 1,32, 3 rounds "
                        "of 2 calls, nothing written unless --out")
    p.add_argument("--out", default=None,
                   help="markdown report (default benchmarks/results/"
                        "bench_inference.md; a .png beside it)")
    args = p.parse_args(argv)
    quick = args.quick
    batches = [int(b) for b in (args.batches or
                                ("1,32" if quick else "1,32,256")).split(",")]
    rounds = args.rounds or (3 if quick else 15)
    reps = args.reps or (2 if quick else 5)
    steps = args.train_steps or (2 if quick else 60)
    out = args.out if args.out is not None else (
        "" if quick else str(HERE / "results" / "bench_inference.md"))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in ("mlp", "cnn-small", "cnn-wide"):
            p.error(f"unknown model {m!r}")
    tfss.load_library()
    tf.get_logger().setLevel("ERROR")
    warnings.filterwarnings("ignore", message=".*retracing.*")
    (x, y), (xt, yt), data_desc = load_mnist_or_digits(args.data)
    rng = np.random.default_rng(args.seed)
    rows, lines = [], []
    for name in models:
        model, acc = train(name, x, y, xt, yt, steps, 128, args.seed)
        converted = convert(model)
        for b in batches:
            idx = rng.choice(len(xt), b, replace=len(xt) < b)
            xb = tf.constant(shaped(name, xt[idx]))
            # A fresh set of functions per batch size: each is instantiated
            # (and the rewrite one rewritten) for its own shapes.
            fns = variants(model, converted)
            outs, rewritten = instantiate(fns, xb)
            diff = {v: float(np.max(np.abs(outs[v].astype(np.float64)
                                           - outs["plain"])))
                    for v in VARIANTS}
            res = time_variants(fns, xb, rounds, reps, warmup=2)
            p50 = {v: float(np.percentile(res[v]["calls"], 50)) * 1e3
                   for v in VARIANTS}
            row = {"model": name, "batch": b, "acc": acc,
                   "rewritten": rewritten}
            for v in VARIANTS:
                per_round = [pr / vr for pr, vr in zip(
                    res["plain"]["round_medians"], res[v]["round_medians"])]
                row[v] = {"p50": p50[v], "ratio": p50["plain"] / p50[v],
                          "lo": min(per_round), "hi": max(per_round),
                          "diff": diff[v]}
            rows.append(row)
            rw = ", ".join(f"{k} x{c}" for k, c in sorted(rewritten.items())) \
                or "none"
            cells = [f"{row['plain']['p50']:.3f}"]
            for v in ("converted", "rewrite"):
                r = row[v]
                cells.append(f"{r['p50']:.3f} | **{r['ratio']:.2f}** "
                             f"({r['lo']:.2f}-{r['hi']:.2f})")
            r = row["plain again"]
            cells.append(f"{r['ratio']:.2f} ({r['lo']:.2f}-{r['hi']:.2f})")
            lines.append(f"| {name} | {b} | {' | '.join(cells)} | {rw} | "
                         f"{max(row['converted']['diff'], row['rewrite']['diff']):.1e} |")
            print(lines[-1], flush=True)
    accs = ", ".join(f"{n} {r['acc']:.3f}" for n, r in
                     {r["model"]: r for r in rows}.items())
    title = (f"Inference latency (`tf.function(training=False)` calls), "
             f"{data_desc}; models trained {steps} Adam steps of batch 128 "
             f"(test accuracy: {accs}); p50 of {rounds} interleaved rounds x "
             f"{reps} calls (ms); ratio = plain p50 / variant p50 (> 1: "
             f"faster), in brackets the range of the per-round ratios; "
             f"'plain again' is a copy of the plain model (weights of its "
             f"own, as every variant's), timed in the same rounds (an A/A "
             f"control: the harness's own bias); "
             f"TensorFlow {tf.__version__}, {cpus_desc()}, library built with "
             f"{build_info()['MARCH']}; load average "
             f"{os.getloadavg()[0]:.1f} at the end (other jobs on the machine "
             "widen the spread).")
    if any(not r["rewritten"] for r in rows):
        lines += ["", "Where no node was rewritten (the pass takes MatMul/"
                  "Conv2D fed by a ReLU-family op or dropout; these CNNs' "
                  "second Conv2D is fed by MaxPool, the first by the model "
                  "input) the rewrite variant runs the plain graph: its ratio "
                  "and range show this run's noise."]
    md = markdown_table(
        "| model | batch | plain p50 ms | converted p50 ms | converted ratio "
        "| rewrite p50 ms | rewrite ratio | plain again ratio (A/A) "
        "| nodes rewritten | max abs diff |",
        lines, title)
    print(md)
    if out:
        png = str(Path(out).with_suffix(".png"))
        write_report(out, md, also=lambda: plot(rows, png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
