"""``tf.function`` of a closure that is built anew per model.

TensorFlow warns "N out of the last N calls to <function> triggered
tf.function retracing" when the functions it traces share one code object
(its retracing detector keys a Python function by ``__code__``): a closure
such as ``lambda t: model(t, training=False)``, made once per model by a
library, counts every model's first trace as a retrace of the same
function. Each of those traces is the one a new model needs, so the
warning tells the user of a loop over models, fits or budgets about a
problem they do not have. :func:`function_per_instance` wraps the closure
in an object (no ``__code__``), which the detector keys by identity:
repeated calls of the same closure with new shapes still warn as usual.
"""

import inspect

__all__ = ["function_per_instance"]


class _Closure:
    """A callable with no ``__code__`` of its own (see the module)."""

    __slots__ = ("_fn", "__weakref__")

    def __init__(self, fn):
        self._fn = fn

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    def __repr__(self):
        return repr(self._fn)

    @property
    def __signature__(self):
        # tf.function binds arguments (and names them) by this signature.
        return inspect.signature(self._fn)


def function_per_instance(fn, **kwargs):
    """``tf.function(fn, **kwargs)`` whose tracing is counted for this
    instance alone (see the module).

    Args:
      fn: a Python callable (typically a closure over one model).
      **kwargs: passed to ``tf.function`` (``input_signature``,
        ``reduce_retracing``, ...).

    Returns:
      a ``tf.types.experimental.PolymorphicFunction``; its arguments are
      ``fn``'s, taken positionally or by keyword.

    Raises:
      TypeError: ``fn`` is not callable.
    """
    import tensorflow as tf

    if not callable(fn):
        raise TypeError(f"function_per_instance: expected a callable, got "
                        f"{type(fn).__name__}")
    return tf.function(_Closure(fn), **kwargs)
