"""Model loading, sample inputs and rewrite-pass bookkeeping shared by
``tf-sparse-split profile`` (:mod:`.profile`) and its ``--end-to-end``
variant (:mod:`.latency`)."""

import os
import zipfile

import numpy as np


def model_kind(path):
    """``"keras"`` for a ``.keras`` file, ``"saved_model"`` for a SavedModel
    directory.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      ValueError: if it is neither, or a ``.keras`` file that is not a zip
        archive (what Keras writes; Keras' own error for such a file says
        the file was not found).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such model: {path}")
    if path.endswith(".keras") and os.path.isfile(path):
        if not zipfile.is_zipfile(path):
            raise ValueError(f"{path} is not a valid .keras file (not a zip "
                             "archive: a .keras model is what "
                             "model.save('name.keras') writes)")
        return "keras"
    if os.path.isdir(path) and os.path.exists(
            os.path.join(path, "saved_model.pb")):
        return "saved_model"
    raise ValueError(f"{path} is neither a SavedModel directory nor a .keras "
                     "file")


def stop_recording_stats(model):
    """Sets ``record_stats = False`` on every sparse-split layer of the Keras
    ``model`` (inference and frozen graphs update no statistics)."""
    from tf_sparse_split.layers import SparseSplitLayer

    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, SparseSplitLayer):
            layer.record_stats = False


def select_signature(loaded, path, signature):
    """``(key, concrete_function)`` of the SavedModel ``loaded`` (from
    ``path``): ``signature``, else ``serving_default``, else the first by
    name.

    Raises:
      ValueError: no signatures, or no signature ``signature``.
    """
    sigs = dict(loaded.signatures)
    if not sigs:
        raise ValueError(f"SavedModel {path} has no signatures")
    key = signature or ("serving_default" if "serving_default" in sigs
                        else sorted(sigs)[0])
    if key not in sigs:
        raise ValueError(f"SavedModel {path} has no signature {key!r} (has "
                         f"{sorted(sigs)})")
    return key, sigs[key]


def random_input(shape, dtype, batch_size, sparsity, rng):
    """A ``relu(normal)`` array drawn from the numpy Generator ``rng`` with
    about ``sparsity`` zeros (at least 0.5), of ``shape`` with unknown (None)
    dimensions set to ``batch_size``, as the numpy type of the TensorFlow
    ``dtype``."""
    shape = [batch_size if d is None else int(d) for d in shape]
    x = np.maximum(rng.standard_normal(shape), 0.0)
    # relu(normal) has 50% zeros; zero more to reach the requested sparsity.
    x[rng.random(shape) < max(0.0, (sparsity - 0.5) / 0.5)] = 0.0
    return x.astype(dtype.as_numpy_dtype)


def input_from_args(args):
    """``(array or None, description)`` for the parsed ``--input``,
    ``--input-sparsity`` and ``--seed`` arguments: the loaded ``.npy`` file,
    or None for random inputs.

    Raises:
      FileNotFoundError: a missing input file.
      ValueError: an input that is not a non-empty array of floats (an
        integer array would fail inside the model's graph).
    """
    if args.input is None:
        return None, (f"random, relu(normal) with {args.input_sparsity:.2f} "
                      f"zeros, seed {args.seed}")
    if not os.path.isfile(args.input):
        raise FileNotFoundError(f"no such input file: {args.input}")
    x = np.load(args.input)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"--input {args.input}: the array has dtype "
                         f"{x.dtype}; give the model's float inputs (e.g. "
                         "x.astype('float32'))")
    if x.ndim == 0 or x.shape[0] == 0:
        raise ValueError(f"--input {args.input}: no examples (shape "
                         f"{x.shape})")
    return x, f"from {args.input}, {float(np.mean(x == 0)):.3f} zeros"


def restore_rewrite(previous):
    """Re-enables the rewrite pass with the configuration ``previous`` (from
    :func:`tf_sparse_split.rewrite.config`) if it was enabled."""
    from tf_sparse_split import rewrite

    if previous["enabled"]:
        rewrite.enable(threshold=previous["threshold"],
                       min_flops=previous["min_flops"], ops=previous["ops"],
                       producers=previous["producers"])
