"""``tf-sparse-split train --strategy {none,mirrored,multi-worker}``.

* ``none``: Keras ``fit`` on the default strategy.
* ``mirrored``: Keras ``fit`` with the model built and compiled under
  ``tf.distribute.MirroredStrategy`` (all local GPUs, or the CPU).
* ``multi-worker``: ``tf.distribute.MultiWorkerMirroredStrategy`` configured
  from the ``TF_CONFIG`` environment variable, trained by the custom loop
  :func:`run_multi_worker` (``strategy.run``), because Keras 3 ``fit`` does
  not run under that strategy (keras-team/keras#20585). The dataset is
  auto-sharded by data (each worker takes its share of every global batch of
  ``--batch-size`` examples), the
  :class:`~tf_sparse_split.tuning.tuner.ThresholdTuner` all-reduces the
  layers' statistics and broadcasts the chief's thresholds, and every worker
  prints the same per-epoch loss/accuracy, final test accuracy and weight
  fingerprint (SHA-256 of all weights, thresholds included). Only the chief
  (worker 0, or the task of type ``chief``) writes checkpoints, TensorBoard
  logs and plots.
"""

import contextlib
import hashlib
import json
import os
import time

import numpy as np

from tf_sparse_split.tuning.tuner import is_chief
from tf_sparse_split.utils.tracing import function_per_instance

__all__ = ["STRATEGIES", "make_strategy", "strategy_scope", "is_chief",
           "worker_label", "weights_fingerprint", "run_multi_worker"]

#: Values of ``train --strategy``.
STRATEGIES = ("none", "mirrored", "multi-worker")


def _check_tf_config():
    text = os.environ.get("TF_CONFIG")
    if not text:
        raise ValueError(
            "--strategy multi-worker needs the TF_CONFIG environment variable, "
            'e.g. TF_CONFIG=\'{"cluster": {"worker": ["host1:12345", '
            '"host2:12345"]}, "task": {"type": "worker", "index": 0}}\'')
    try:
        config = json.loads(text)
        workers = config["cluster"]["worker"]
        task = config["task"]
        kind, index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"TF_CONFIG is not valid ({e!r}): it needs "
                         '{"cluster": {"worker": [...]}, "task": {"type": '
                         '"worker", "index": i}}') from None
    members = config["cluster"].get(kind)
    if not isinstance(workers, list) or not workers or members is None or \
            not 0 <= index < len(members):
        raise ValueError(f"TF_CONFIG task {kind}:{index} is not in its cluster "
                         f"{config['cluster']}")


def make_strategy(name):
    """The ``tf.distribute`` strategy for ``train --strategy name`` (None for
    ``"none"``). Create it before any other TensorFlow work (the collective
    runtime of ``multi-worker`` must be set up first).

    Raises:
      ValueError: unknown ``name``, or ``multi-worker`` without a valid
        ``TF_CONFIG``.
    """
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {name!r}")
    if name == "none":
        return None
    import tensorflow as tf

    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    _check_tf_config()
    return tf.distribute.MultiWorkerMirroredStrategy()


def strategy_scope(strategy):
    """``strategy.scope()``, or a no-op context for None."""
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def worker_label(strategy):
    """``"worker i/n"`` (``"chief"``) for multi-worker runs, else ``""``."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not getattr(resolver, "task_type", None):
        return ""
    cluster = resolver.cluster_spec().as_dict()
    n = sum(len(v) for v in cluster.values())
    return f"{resolver.task_type} {resolver.task_id} of {n} tasks"


def _threshold_words(entry):
    """One tuner history entry's threshold for the per-epoch line: an
    automatic layer (the op decides per call) shows the op model's pick."""
    th = entry["threshold"]
    if entry.get("mode") == "auto":
        return "auto" if th < 0 else f"auto (op's model picks {th:.4f})"
    return "auto" if th < 0 else f"{th:.4f}"


def weights_fingerprint(model):
    """SHA-256 (hex, first 16 digits) of every weight of ``model`` in order
    (bytes and shapes): equal fingerprints mean bit-identical models."""
    h = hashlib.sha256()
    for w in model.get_weights():
        w = np.ascontiguousarray(w)
        h.update(str((w.dtype.str, w.shape)).encode())
        h.update(w.tobytes())
    return h.hexdigest()[:16]


def _evaluate(model, x, y, batch_size):
    """(mean loss, accuracy) of ``model`` on all of ``x``, computed locally
    (the same on every worker, whose weights are identical)."""
    import keras
    import tensorflow as tf

    predict = function_per_instance(lambda t: model(t, training=False))
    losses, correct = [], 0
    for i in range(0, len(x), batch_size):
        p = predict(tf.constant(x[i:i + batch_size]))
        yb = y[i:i + batch_size]
        losses.append(keras.ops.convert_to_numpy(
            keras.losses.sparse_categorical_crossentropy(yb, p)))
        correct += int(np.sum(np.argmax(p.numpy(), axis=-1) == yb))
    return float(np.mean(np.concatenate(losses))), correct / len(x)


def run_multi_worker(args, sparse, x_train, y_train, x_test, y_test,
                     num_classes, out, strategy):
    """Trains one model with ``strategy`` (a ``MultiWorkerMirroredStrategy``,
    or any strategy) in a custom loop; returns the result dict of
    :func:`tf_sparse_split.tools.train.run` (plus ``"fingerprint"``).

    Every worker must call it with the same arguments and data.
    """
    import keras
    import tensorflow as tf

    from tf_sparse_split.tools.train import build_model
    from tf_sparse_split.tuning.tuner import ThresholdTuner

    keras.utils.set_random_seed(args.seed)
    chief = is_chief(strategy)
    kind = "sparse-split" if sparse else "baseline"
    with strategy.scope():
        model, x_train, x_test, desc = build_model(
            args, sparse, x_train, x_test, num_classes)
        optimizer = keras.optimizers.Adam(args.lr)
        optimizer.build(model.trainable_variables)
    global_batch = int(args.batch_size)
    steps = len(x_train) // global_batch
    if steps < 1:
        raise ValueError(f"--batch-size {global_batch} is larger than the "
                         f"{len(x_train)} training examples")
    label = worker_label(strategy)
    if out is not None:
        print(f"model: {kind} {desc}", file=out, flush=True)
        print(f"strategy: {type(strategy).__name__}, "
              f"{strategy.num_replicas_in_sync} replica(s) in sync"
              f"{', ' + label if label else ''}; global batch {global_batch}, "
              f"{steps} steps/epoch", file=out, flush=True)
    ds = tf.data.Dataset.from_tensor_slices((x_train, y_train.astype(np.int64)))
    ds = ds.shuffle(len(x_train), seed=args.seed,
                    reshuffle_each_iteration=True)
    # One iterator over all epochs (``repeat``): a new distributed iterator
    # per epoch would make the step function trace again.
    ds = ds.batch(global_batch, drop_remainder=True).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = \
        tf.data.experimental.AutoShardPolicy.DATA
    dist_ds = strategy.experimental_distribute_dataset(ds.with_options(options))

    @tf.function
    def train_step(batch):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                p = model(x, training=True)
                per_example = keras.losses.sparse_categorical_crossentropy(y, p)
                loss = tf.nn.compute_average_loss(
                    per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            correct = tf.reduce_sum(tf.cast(
                tf.equal(tf.argmax(p, axis=-1), y), tf.float32))
            return loss, correct

        loss, correct = strategy.run(step_fn, args=batch)
        return (strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None),
                strategy.reduce(tf.distribute.ReduceOp.SUM, correct, axis=None))

    iterator = iter(dist_ds)
    tuner = None
    if sparse:
        tuner = ThresholdTuner(model, strategy=strategy,
                               log_dir=getattr(args, "tensorboard", None))
        tuner.begin_training()
    times, losses, accs = [], [], []
    checkpoint_dir = getattr(args, "checkpoint_dir", None)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        if tuner is not None:
            tuner.begin_epoch(epoch, steps=steps)
        loss_sum = correct_sum = tf.constant(0.0)
        for step in range(steps):
            if tuner is not None:
                tuner.before_batch(step)
            loss, correct = train_step(next(iterator))
            # Accumulated on the device: no host sync per step.
            loss_sum += loss
            correct_sum += correct
        record = tuner.end_epoch(epoch) if tuner is not None else None
        losses.append(float(loss_sum) / steps)
        accs.append(float(correct_sum) / (steps * global_batch))
        times.append(time.perf_counter() - start)
        if out is not None and not args.quiet:
            print(f"epoch {epoch + 1}/{args.epochs}: time {times[-1]:.2f} s, "
                  f"loss {losses[-1]:.4f}, accuracy {accs[-1]:.4f}",
                  file=out, flush=True)
            for name, e in (record or {"layers": {}})["layers"].items():
                print(f"  {name}: input sparsity {e['sparsity']:.3f}, "
                      f"threshold {_threshold_words(e)}", file=out, flush=True)
        if checkpoint_dir and chief:
            os.makedirs(checkpoint_dir, exist_ok=True)
            model.save(os.path.join(checkpoint_dir, "model.keras"))
    if tuner is not None:
        tuner.close()
    test_loss, test_acc = _evaluate(model, x_test, y_test, global_batch)
    from tf_sparse_split.tuning.tuner import find_split_layers

    split_layers = find_split_layers(model)
    result = {
        "kind": kind,
        "dropout": args.dropout,
        "dropout_rate": args.dropout_rate,
        "epoch_times": times,
        "time_per_epoch": sum(times) / max(len(times), 1),
        "loss": losses[-1],
        "accuracy": accs[-1],
        "test_loss": test_loss,
        "test_accuracy": test_acc,
        "thresholds": {l.name: l.threshold for l in split_layers},
        "tuning_history": list(tuner.history) if tuner is not None else [],
        "fingerprint": weights_fingerprint(model),
    }
    if out is not None:
        print(f"{kind}: final loss {result['loss']:.6f}, test accuracy "
              f"{result['test_accuracy']:.4f}, test loss "
              f"{result['test_loss']:.6f}, time/epoch "
              f"{result['time_per_epoch']:.2f} s", file=out, flush=True)
        if result["thresholds"]:
            print("thresholds: " + ", ".join(
                f"{k}={'auto' if v < 0 else f'{v:.4f}'}"
                for k, v in result["thresholds"].items()),
                file=out, flush=True)
        print(f"weights sha256: {result['fingerprint']}", file=out, flush=True)
    return result
