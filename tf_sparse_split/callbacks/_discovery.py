"""Which activation feeds a sparse-split layer, and its conversion to a
:class:`~tf_sparse_split.layers.FATReLU` (the discovery and model surgery
behind :class:`~tf_sparse_split.callbacks.SparsityTargetCallback`).

A sparse-split layer measures the sparsity of its *input* (its statistics),
but the activation that produces the zeros belongs to the layer before.
:func:`find_activation_producer` walks back through the model graph --
across zero-preserving layers (dropout, max-pooling, flatten, reshape, ...)
-- to the activation that feeds it: a ``FATReLU`` layer, a layer whose
``activation`` is a ``FATReLU``, or a layer whose ``activation`` is
``"relu"``. :func:`fatrelu_for` returns that ``FATReLU``, converting a
``"relu"`` activation in place to one (cutoff 0 = the same ReLU); the
converted activation is part of the layer's config from then on, so the
model saves and reloads with it. :func:`mask_input_grad` sets
``masked_input_grad=True`` on a ``SparseSplitDense`` fed that way (exact:
the FATReLU's gradient is 0 wherever its output is).
:func:`reset_compiled_functions` makes Keras retrace after such changes.
"""

import keras

from tf_sparse_split.layers.activations import FATReLU, is_relu_activation

__all__ = ["find_activation_producer", "fatrelu_for", "mask_input_grad",
           "find_lstm_layers", "reset_compiled_functions"]

# Layers between an activation and the sparse-split layer that keep every
# zero a zero (so the consumer's sparsity is driven by the activation's).
_PASSTHROUGH = (
    keras.layers.Dropout, keras.layers.SpatialDropout1D,
    keras.layers.SpatialDropout2D, keras.layers.SpatialDropout3D,
    keras.layers.MaxPooling1D, keras.layers.MaxPooling2D,
    keras.layers.MaxPooling3D, keras.layers.Flatten, keras.layers.Reshape,
    keras.layers.Permute, keras.layers.Identity, keras.layers.ZeroPadding1D,
    keras.layers.ZeroPadding2D, keras.layers.ZeroPadding3D,
    keras.layers.Cropping1D, keras.layers.Cropping2D, keras.layers.Cropping3D,
    keras.layers.ActivityRegularization,
)


def _is_passthrough(layer):
    from tf_sparse_split.layers.dropout import (ApproximateRandomDropout,
                                                SensitivityAwareDropout)

    return isinstance(layer, _PASSTHROUGH + (ApproximateRandomDropout,
                                             SensitivityAwareDropout))


def is_plain_relu_layer(layer):
    """Whether ``layer`` is a ``keras.layers.ReLU`` computing ``max(x, 0)``
    (no ``max_value``, ``negative_slope`` 0, ``threshold`` 0)."""
    if not isinstance(layer, keras.layers.ReLU):
        return False
    cfg = layer.get_config()
    return (cfg.get("max_value") is None and
            not cfg.get("negative_slope") and not cfg.get("threshold"))


def _parent(layer):
    """The layer whose output is ``layer``'s (single) input, or None."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    if not nodes:
        return None
    tensors = nodes[0].input_tensors
    if len(tensors) != 1:
        return None
    history = getattr(tensors[0], "_keras_history", None)
    return history[0] if history else None


def find_activation_producer(layer):
    """The ReLU-family activation that produces a layer's input.

    Walks back from ``layer`` through the model graph, across zero-preserving
    layers (dropout, max-pooling, flatten, reshape, padding, cropping, ...).

    Args:
      layer: a layer that has been called in a Functional or Sequential model.

    Returns:
      ``(owner, kind)``: ``owner`` is the :class:`FATReLU` layer (``kind
      "layer"``) or the layer whose ``activation`` produces the input
      (``kind "fatrelu"`` if that activation is a :class:`FATReLU`,
      ``"relu"`` if it is ``keras.activations.relu``); ``(None, reason)``
      when there is none (``reason`` says why: a model input, another
      activation, a layer that does not preserve zeros, ...).
    """
    node = _parent(layer)
    while node is not None:
        if isinstance(node, keras.layers.InputLayer):
            return None, "its input is a model input"
        if isinstance(node, FATReLU):
            return node, "layer"
        act = getattr(node, "activation", None)
        if isinstance(act, FATReLU):
            return node, "fatrelu"
        if act is not None and is_relu_activation(act):
            return node, "relu"
        if act is not None and not _is_passthrough(node):
            name = getattr(act, "__name__", type(act).__name__)
            return None, (f"it is fed by layer {node.name!r} with activation "
                          f"{name!r}, not a ReLU or FATReLU")
        if isinstance(node, keras.layers.ReLU):
            plain = is_plain_relu_layer(node)
            return None, (
                f"it is fed by a keras.layers.ReLU layer {node.name!r}"
                + (", which has no cutoff to raise: use "
                   "tf_sparse_split.layers.FATReLU() there (the same "
                   "function at cutoff 0; sparse_split_model converts it), "
                   "or activation='relu' on the layer before it"
                   if plain else
                   " with max_value, negative_slope or threshold set: only "
                   "a plain ReLU (or a FATReLU) keeps the zeros a cutoff "
                   "controls"))
        if not _is_passthrough(node):
            return None, (f"it is fed by layer {node.name!r} "
                          f"({type(node).__name__}), which is neither a "
                          "ReLU-family activation (activation='relu', "
                          "Activation('relu') or FATReLU) nor a "
                          "zero-preserving layer")
        node = _parent(node)
    return None, "no inbound node (call the layer in a model first)"


def no_control_message(who, model, what="is fed by a ReLU-family "
                       "activation (activation='relu', Activation('relu') or "
                       "FATReLU)"):
    """The ValueError text for a model none of whose sparse-split layers
    has an activation to control: ``"<who>: no sparse-split layer of the
    model <what>"`` and why, per layer (at most 6 named)."""
    from tf_sparse_split.callbacks.split_threshold import find_split_layers

    layers = find_split_layers(model)
    if not layers:
        why = ("the model has no sparse-split layer (convert it with "
               "tf_sparse_split.sparse_split_model first)")
    else:
        whys = [f"{layer.name}: {find_activation_producer(layer)[1]}"
                for layer in layers[:6]]
        more = len(layers) - len(whys)
        why = "; ".join(whys) + (f"; and {more} more" if more > 0 else "")
    return f"{who}: no sparse-split layer of the model {what} ({why})"


def fatrelu_for(owner, kind):
    """The :class:`FATReLU` of a producer found by
    :func:`find_activation_producer`, converting a ReLU to one in place.

    Args:
      owner, kind: :func:`find_activation_producer`'s result (``kind`` is
        ``"layer"``, ``"fatrelu"`` or ``"relu"``).

    Returns:
      ``(fat, converted)``: the ``FATReLU`` (``owner`` itself, its
      ``activation``, or a new one with cutoff 0, named
      ``"<owner>_fatrelu"``, with ``owner``'s dtype policy (e.g.
      ``mixed_bfloat16``), installed as ``owner.activation``), and whether
      the model changed (the compiled functions must then be rebuilt:
      :func:`reset_compiled_functions`).
    """
    if kind == "layer":
        return owner, False
    if kind == "fatrelu":
        return owner.activation, False
    fat = FATReLU(name=f"{owner.name}_fatrelu", dtype=owner.dtype_policy)
    # The layer is built (state locked): track the new sublayer the way
    # Keras itself does for late changes.
    locked = owner._tracker.locked
    owner._tracker.unlock()
    try:
        owner.activation = fat
    finally:
        if locked:
            owner._tracker.lock()
    return fat, True


def mask_input_grad(layer):
    """Sets ``masked_input_grad=True`` on a sparse-split layer whose input
    comes through a ReLU-family activation (across zero-preserving layers):
    that activation's gradient is 0 wherever the input is, so the input
    gradient is needed only at its nonzeros. Layers without the option
    (``SparseSplitConv2D``) are left alone.

    Returns:
      True if the layer changed (the compiled functions must be rebuilt).
    """
    if getattr(layer, "masked_input_grad", None) is False:
        layer.masked_input_grad = True
        return True
    return False



def select_split_layers(model, selection, caller):
    """``(layers, explicit)``: the sparse-split layers of ``model`` named or
    given in ``selection`` (layers or layer names), or all of them when
    ``selection`` is None (``explicit`` False).

    Raises:
      ValueError: an item of ``selection`` that is not a sparse-split layer
        of ``model`` (the message starts with ``caller``).
    """
    from tf_sparse_split.layers.base import SparseSplitLayer
    from tf_sparse_split.tuning.tuner import find_split_layers

    found = find_split_layers(model)
    if selection is None:
        return found, False
    by_name = {l.name: l for l in found}
    out = []
    for item in selection:
        if isinstance(item, SparseSplitLayer) and any(
                item is l for l in found):
            out.append(item)
        elif isinstance(item, SparseSplitLayer):
            # A layer of another model: its statistics would never move.
            raise ValueError(
                f"{caller}: layer {item.name!r} is not in the model (a layer "
                "of another model?); the model's sparse-split layers are "
                f"{sorted(by_name)}")
        elif isinstance(item, str) and item in by_name:
            out.append(by_name[item])
        else:
            raise ValueError(
                f"{caller}: {item!r} is not a sparse-split layer of the model "
                f"(SparseSplitDense/SparseSplitConv2D); the model has "
                f"{sorted(by_name)}")
    return out, True

def find_lstm_layers(model, selection=None):
    """``(lstms, rest)``: the :class:`~tf_sparse_split.layers.SparseSplitLSTM`
    layers of ``model`` (recursively, in model order) and, with a
    ``selection`` (layers or layer names), only those it names, ``rest``
    being the selection's other items (None without a selection)."""
    from tf_sparse_split.layers.lstm import SparseSplitLSTM

    flatten = getattr(model, "_flatten_layers", None)
    layers = (list(flatten(include_self=True, recursive=True))
              if flatten is not None else [model])
    found, seen = [], set()
    for layer in layers:
        if isinstance(layer, SparseSplitLSTM) and id(layer) not in seen:
            seen.add(id(layer))
            found.append(layer)
    if selection is None:
        return found, None
    by_name = {l.name: l for l in found}
    picked, rest = [], []
    for item in selection:
        if isinstance(item, SparseSplitLSTM):
            picked.append(item)
        elif isinstance(item, str) and item in by_name:
            picked.append(by_name[item])
        else:
            rest.append(item)
    return picked, rest


def reset_compiled_functions(model):
    """Drops ``model``'s compiled train/test/predict functions and rebuilds
    the train function, so that they trace the model as it is now."""
    for attr in ("train_function", "test_function", "predict_function"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    model.make_train_function(force=True)
