"""Argument validation shared by the ops, layers, callbacks, rewrite switch
and command line.

Every check raises ``ValueError`` with a Keras-style message that names the
argument and ends with ``Received: name=value``; callers that must raise
another type (the op wrappers raise ``tf.errors.InvalidArgumentError``, the
command line ``argparse.ArgumentTypeError``) convert it.
"""

import math
import numbers

import numpy as np

__all__ = [
    "AUTO_THRESHOLD",
    "validate_threshold",
    "threshold_from_text",
    "validate_fraction",
    "validate_int",
    "validate_positive_float",
    "validate_choice",
    "validate_nonnegative_float",
    "check_fits_model_input",
    "model_classes",
    "check_labels_in_classes",
]

#: The value an "automatic" threshold (``'auto'`` or any negative number) is
#: stored as: the op then chooses the split from the rates it measured.
AUTO_THRESHOLD = -1.0


def _received(name, value):
    return f"Received: {name}={value!r}"


def _parse_float(value, msg):
    """``float(value)``; ``ValueError(msg)`` for a bool or a value that does
    not convert."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(msg)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(msg) from None


def validate_threshold(threshold, name="threshold"):
    """Checks a dense/sparse split threshold and returns it as a float.

    The one place where every threshold argument is parsed: the op wrappers
    (``sparse_split_matmul``, ``sparse_split_conv2d``,
    ``sparse_split_sddmm``), the layers' ``threshold=`` and
    ``set_threshold``, ``sparse_split_model``, ``rewrite.enable`` and, through
    :func:`threshold_from_text`, the command line.

    Args:
      threshold: a real number in ``[0, 1]`` (rows or images whose density,
        the fraction of nonzeros, is above it go dense, the others sparse);
        or automatic (the op chooses the split per call from the rates it
        measured on this machine): the string ``'auto'`` (any case),
        returned as :data:`AUTO_THRESHOLD`, or any negative number, returned
        unchanged.
      name: the argument's name, for the message.

    Returns:
      the threshold as a Python float (negative: automatic).

    Raises:
      ValueError: a string other than ``'auto'`` (numeric strings too: use
        :func:`threshold_from_text` for text), bytes, a bool, ``None``, a
        non-numeric value, NaN, or a value above 1.
    """
    msg = (f"`{name}` must be a number in [0, 1], or 'auto' or a negative "
           f"number for automatic. {_received(name, threshold)}")
    if isinstance(threshold, str):
        if threshold.strip().lower() == "auto":
            return AUTO_THRESHOLD
        raise ValueError(msg)
    if threshold is None or isinstance(threshold, bytes):
        raise ValueError(msg)
    value = _parse_float(threshold, msg)  # also refuses bools
    if math.isnan(value) or value > 1.0:
        raise ValueError(msg)
    return value


def threshold_from_text(text, name="threshold"):
    """A threshold written as text (the command line's ``--threshold``):
    ``'auto'`` or a number, checked as :func:`validate_threshold` does.

    Returns:
      the threshold as a Python float (negative: automatic).

    Raises:
      ValueError: as :func:`validate_threshold`, or for text that is
        neither ``'auto'`` nor a number.
    """
    value = text
    if isinstance(text, str) and text.strip().lower() != "auto":
        try:
            value = float(text)
        except ValueError:
            pass  # validate_threshold refuses the string with its message
    return validate_threshold(value, name)


def validate_fraction(value, name, *, low_inclusive=True,
                      high_inclusive=False):
    """Checks a rate or fraction in ``[0, 1)`` (bounds configurable).

    Args:
      value: a real number (or numeric string).
      name: the argument's name, for the message.
      low_inclusive: whether 0 is allowed (default True).
      high_inclusive: whether 1 is allowed (default False).

    Returns:
      the value as a Python float.

    Raises:
      ValueError: a bool, a non-numeric value, NaN or a value out of range.
    """
    interval = (("[" if low_inclusive else "(") + "0, 1" +
                ("]" if high_inclusive else ")"))
    msg = f"`{name}` must be a number in {interval}. {_received(name, value)}"
    v = _parse_float(value, msg)
    low_ok = v >= 0.0 if low_inclusive else v > 0.0
    high_ok = v <= 1.0 if high_inclusive else v < 1.0
    if not (low_ok and high_ok):  # also rejects NaN
        raise ValueError(msg)
    return v


def validate_int(value, name, minimum=1):
    """Checks an integer argument ``>= minimum``.

    Args:
      value: a Python or numpy integer (bools are refused).
      name: the argument's name, for the message.
      minimum: the smallest allowed value (default 1: a positive integer).

    Returns:
      the value as a Python int.

    Raises:
      ValueError: not an integer, or below ``minimum``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (numbers.Integral, np.integer)):
        raise ValueError(f"`{name}` must be an integer >= {minimum}. "
                         f"{_received(name, value)}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}. "
                         f"{_received(name, value)}")
    return int(value)


def validate_positive_float(value, name):
    """Checks a real number ``> 0`` (e.g. a learning rate).

    Returns:
      the value as a Python float.

    Raises:
      ValueError: a bool, a non-numeric value, NaN, or a value ``<= 0``.
    """
    msg = f"`{name}` must be a number > 0. {_received(name, value)}"
    v = _parse_float(value, msg)
    if not v > 0:
        raise ValueError(msg)
    return v


def validate_choice(value, name, choices):
    """Checks that ``value`` is one of ``choices`` (e.g. an activation name).

    Args:
      value: the argument.
      name: the argument's name, for the message.
      choices: the allowed values (compared with ``==``; strings exactly).

    Returns:
      the value, unchanged.

    Raises:
      ValueError: ``value`` is not one of ``choices``.
    """
    if isinstance(value, (bool, np.bool_)) or not any(
            type(value) is type(c) and value == c for c in choices):
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {allowed}. "
                         f"{_received(name, value)}")
    return value


def validate_nonnegative_float(value, name):
    """Checks a finite real number ``>= 0`` (e.g. a penalty coefficient or
    an activation threshold).

    Returns:
      the value as a Python float.

    Raises:
      ValueError: a bool, a non-numeric value, NaN, infinity, or a value
        ``< 0``.
    """
    msg = f"`{name}` must be a finite number >= 0. {_received(name, value)}"
    v = _parse_float(value, msg)
    if not 0.0 <= v < math.inf:
        raise ValueError(msg)
    return v


def check_fits_model_input(model, shape, what):
    """ValueError unless a batch of ``shape`` fits a single-input model:
    the same rank and the same size wherever the model fixes one (the
    batch dimension aside). Models with several inputs are not checked.

    ``what`` names the data in the message (e.g. ``"fit_latency_budget:
    `sample`"``)."""
    inputs = getattr(model, "inputs", None) or []
    if len(inputs) != 1 or shape is None:
        return
    want = tuple(inputs[0].shape)
    got = tuple(shape)
    if len(got) != len(want) or any(
            w is not None and g is not None and int(w) != int(g)
            for w, g in zip(want[1:], got[1:])):
        raise ValueError(f"{what} of shape {got} does not fit the model's "
                         f"input {want}")


def model_classes(model):
    """The classes a single-output model scores (its output's last
    dimension) when above 1, else None (several outputs, an unknown or a
    single output)."""
    outputs = getattr(model, "outputs", None) or []
    if len(outputs) != 1:
        return None
    shape = tuple(outputs[0].shape)
    last = shape[-1] if shape else None
    return int(last) if last is not None and int(last) > 1 else None


def check_labels_in_classes(y, classes, what):
    """ValueError when integer class labels ``y`` ([n] or [n, 1]) fall
    outside ``[0, classes)``; other labels (one-hot, float targets) and
    ``classes`` None are not checked. ``what`` names them in the message."""
    arr = np.asarray(y)
    if classes is None or arr.size == 0 or not np.issubdtype(
            arr.dtype, np.integer) or arr.ndim > 2 or (
                arr.ndim == 2 and arr.shape[1] != 1):
        return
    if arr.min() < 0 or arr.max() >= classes:
        raise ValueError(
            f"{what} must be classes in [0, {classes}) for this model's "
            f"output; got labels from {arr.min()} to {arr.max()}")
