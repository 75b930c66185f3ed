"""One-call conversion of Keras models to sparse-split layers and back.

:func:`sparse_split_model` returns a copy of a Keras model in which every
eligible ``keras.layers.Dense`` / ``keras.layers.Conv2D`` is a
:class:`~tf_sparse_split.layers.SparseSplitDense` /
:class:`~tf_sparse_split.layers.SparseSplitConv2D` with the same
configuration and weights, so the copy predicts the same values (to float
rounding). :func:`strip_sparse_split` is the inverse: plain Keras layers with
the same weights, e.g. to export a model for an environment without
``tf_sparse_split``.

Both work on ``Sequential`` and functional models, including models nested in
them (cloned recursively with ``keras.models.clone_model``); shared layers
stay shared. Subclassed models (a custom ``call``) cannot be rebuilt layer
by layer and raise ``ValueError``. A copy of a compiled model is compiled
the same way (Keras' ``clone_model`` applies the source's compile
configuration): loss, metrics and a new optimizer of the same class and
hyper-parameters, with no optimizer state (slots, iteration count); a copy
of an uncompiled model is uncompiled.

Dtype policies are kept: every layer of the copy has the policy of the
layer it copies (e.g. ``mixed_bfloat16`` with float32 variables, or a
float32 output layer in a mixed model), and the copy has the model's own,
whatever the global policy is when converting (a ``mixed_float16`` copy is
compiled with Keras' ``LossScaleOptimizer`` as the source is).

Requires the TensorFlow backend of Keras 3.
"""

import contextlib

import keras

from tf_sparse_split.callbacks._discovery import is_plain_relu_layer
from tf_sparse_split.layers.activations import FATReLU
from tf_sparse_split.layers.base import SparseSplitLayer
from tf_sparse_split.layers.conv2d import SparseSplitConv2D
from tf_sparse_split.layers.dense import SparseSplitDense
from tf_sparse_split.utils.validation import validate_threshold

__all__ = ["sparse_split_model", "strip_sparse_split", "eligible_reason"]

# Config keys of the sparse-split layers that plain Keras layers lack.
_SPLIT_ONLY_KEYS = ("threshold", "heterogeneous", "masked_input_grad",
                    "skip_dead_input_grad")


def eligible_reason(layer):
    """Why ``layer`` cannot be swapped for a sparse-split layer, or None if
    it can.

    Eligible: exactly ``keras.layers.Dense`` (not a subclass; not
    quantized) or exactly ``keras.layers.Conv2D`` with
    ``data_format="channels_last"``, LoRA-enabled and grouped ones included.

    Returns:
      None, or a string (e.g. ``"data_format='channels_first'"``).
    """
    cls = type(layer)
    if cls is keras.layers.Dense:
        if getattr(layer, "quantization_mode", None) is not None:
            return f"quantized ({layer.quantization_mode})"
        return None
    if cls is keras.layers.Conv2D:
        if layer.data_format != "channels_last":
            return f"data_format={layer.data_format!r}"
        return None
    return f"{cls.__name__} is not keras.layers.Dense or keras.layers.Conv2D"


def _is_rebuildable(model):
    return isinstance(model, (keras.Sequential,
                              keras.src.models.functional.Functional))


def _check_model(model, what):
    if not isinstance(model, keras.Model):
        raise ValueError(f"{what} takes a keras.Model, got {type(model).__name__}")
    # The model itself and every model nested in it (clone_model rebuilds
    # nested models from their configs, which a subclassed one cannot
    # give back: Keras' TypeError "Unable to revive model from config").
    for m in [model] + [l for l in model._flatten_layers(include_self=False)
                        if isinstance(l, keras.Model)]:
        if not _is_rebuildable(m):
            where = "" if m is model else f" (nested in {model.name!r})"
            raise ValueError(
                f"{what} supports Sequential and functional Keras models (and "
                f"models nested in them); {type(m).__name__}{where} is a "
                "subclassed model whose layers cannot be rebuilt one by one. "
                "Build it as a functional model, or use SparseSplitDense/"
                "SparseSplitConv2D in its code directly")
    if not model.built:
        raise ValueError(
            f"{what}: the model {model.name!r} is not built; give it an "
            "Input (or call it once) before converting it")


def _filter(layer_filter, model):
    if layer_filter is None:
        return lambda layer: True
    if callable(layer_filter):
        return layer_filter
    if isinstance(layer_filter, str):
        layer_filter = (layer_filter,)
    try:
        names = frozenset(layer_filter)
    except TypeError:
        raise ValueError("layer_filter must be None, a callable taking a "
                         "layer, or a collection of layer names, got "
                         f"{layer_filter!r}") from None
    # A misspelt name would otherwise convert nothing, silently.
    known = {l.name for l in model._flatten_layers(include_self=False)}
    unknown = sorted(str(n) for n in names - known)
    if unknown:
        raise ValueError(f"layer_filter names layers the model "
                         f"{model.name!r} does not have: {unknown}")
    return lambda layer: layer.name in names


@contextlib.contextmanager
def _global_policy(policy):
    """Keras' global dtype policy set to ``policy`` inside the block (and
    restored after); a policy that cannot be global (quantized) leaves it
    unchanged."""
    old = keras.mixed_precision.global_policy()
    try:
        keras.mixed_precision.set_global_policy(policy)
    except (ValueError, TypeError):
        yield
        return
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(old)


def _clone(model, convert):
    """clone_model with ``convert(layer)`` (None: plain copy) for every
    layer, recursively; then copies every layer's weights."""
    pairs = []

    def clone_function(layer):
        new = convert(layer)
        if new is None:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    # Cloned under the source's dtype policy: the copied layers keep their
    # own (it is in their configs), and the new model objects -- the copy
    # itself, its InputLayers -- get the source's rather than whatever the
    # global policy is now, so ``compile`` (run by clone_model for a
    # compiled source) wraps the optimizer in a LossScaleOptimizer exactly
    # when the source's is (``mixed_float16``).
    with _global_policy(model.dtype_policy):
        clone = keras.models.clone_model(model, clone_function=clone_function,
                                         recursive=True)
    for old, new in pairs:
        if not old.built:
            continue
        if not new.built:
            raise ValueError(
                f"layer {old.name!r} was not built in the copy; give the "
                "model an Input (or call it once) before converting it")
        if isinstance(old, FATReLU) != isinstance(new, FATReLU):
            continue        # ReLU <-> FATReLU: the cutoff is in the config
        new.set_weights(old.get_weights())
        if getattr(old, "lora_enabled", False):
            # keras.layers.Dense.build enables LoRA with alpha = rank.
            new.lora_alpha = old.lora_alpha
        if isinstance(old, SparseSplitLayer) and isinstance(new, SparseSplitLayer):
            new.set_threshold(old.threshold)
    return clone


def sparse_split_model(model, layer_filter=None, threshold="auto"):
    """A copy of ``model`` with its ``Dense``/``Conv2D`` layers computed by
    the sparse-split ops.

    Every layer for which :func:`eligible_reason` is None and
    ``layer_filter`` accepts is replaced by a ``SparseSplitDense`` /
    ``SparseSplitConv2D`` with the same configuration (name, units/filters,
    ``groups``, activation, initializers, regularizers, constraints, dtype
    policy, LoRA rank and alpha) and weights (``lora_kernel_a``/``_b``
    included, the kernel frozen as in the original); every other layer is
    copied unchanged with its weights, except that a plain
    ``keras.layers.ReLU`` (no ``max_value``, ``negative_slope`` or
    ``threshold``) becomes a :class:`~tf_sparse_split.layers.FATReLU` of
    the same name at cutoff 0 (the same function, with a cutoff that
    :class:`~tf_sparse_split.callbacks.SparsityTargetCallback`,
    :class:`~tf_sparse_split.TimeBudgetCallback` and
    :func:`~tf_sparse_split.fit_latency_budget` can raise). The copy
    computes the same values as ``model`` to float rounding (the threshold
    changes speed only).

    Args:
      model: a built ``Sequential`` or functional ``keras.Model`` (nested
        ones included).
      layer_filter: which eligible layers to swap: None (all), a callable
        ``layer -> bool``, or a collection of layer names (nested models'
        layers included).
      threshold: initial split threshold of the new layers: ``"auto"``
        (default; the op chooses per call) or a number in ``[0, 1]``.

    Returns:
      A new ``keras.Model`` of the same class, compiled like ``model`` (a
      new optimizer, no optimizer state) when ``model`` is compiled.

    Raises:
      ValueError: a subclassed model (or one nested in ``model``), an
        unbuilt model, a bad threshold or ``layer_filter`` (not a callable
        or a collection of names, or naming a layer the model does not
        have).
    """
    _check_model(model, "sparse_split_model")
    threshold = validate_threshold(threshold)
    accept = _filter(layer_filter, model)

    def convert(layer):
        if is_plain_relu_layer(layer):
            # The same function (cutoff 0), with a cutoff the callbacks and
            # fit_latency_budget can raise.
            return FATReLU(name=layer.name, dtype=layer.dtype_policy)
        if eligible_reason(layer) is not None or not accept(layer):
            return None
        config = layer.get_config()
        config.pop("quantization_config", None)
        config["threshold"] = threshold
        cls = (SparseSplitDense if type(layer) is keras.layers.Dense
               else SparseSplitConv2D)
        return cls.from_config(config)

    return _clone(model, convert)


def strip_sparse_split(model):
    """A copy of ``model`` with every ``SparseSplitDense``/``SparseSplitConv2D``
    replaced by ``keras.layers.Dense``/``keras.layers.Conv2D`` with the same
    configuration and weights (``groups`` and LoRA included; the threshold is
    dropped), and every :class:`~tf_sparse_split.layers.FATReLU` layer by
    ``keras.layers.ReLU(threshold=cutoff)`` at its current cutoff (the same
    function except at ``x == cutoff`` exactly, which Keras' ReLU keeps; its
    target and L1 penalty, which act in training only, are dropped). Other
    layers, the structured dropout layers included, are copied unchanged.

    Args:
      model: a built ``Sequential`` or functional ``keras.Model``.

    Returns:
      A new ``keras.Model``, compiled like ``model`` (a new optimizer, no
      optimizer state) when ``model`` is compiled.

    Raises:
      ValueError: a subclassed or unbuilt model.
    """
    _check_model(model, "strip_sparse_split")

    def convert(layer):
        if isinstance(layer, FATReLU):
            # where(x > c, x, 0) as Keras' ReLU(threshold=c) (which keeps an
            # x equal to c).
            return keras.layers.ReLU(threshold=layer.cutoff, name=layer.name,
                                     dtype=layer.dtype_policy)
        if isinstance(layer, SparseSplitDense):
            cls = keras.layers.Dense
        elif isinstance(layer, SparseSplitConv2D):
            cls = keras.layers.Conv2D
        else:
            return None
        config = layer.get_config()
        for key in _SPLIT_ONLY_KEYS:
            config.pop(key, None)
        return cls.from_config(config)

    return _clone(model, convert)
