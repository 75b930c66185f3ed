"""Renamed keyword arguments and attributes: the old name keeps working for
one release and emits a ``DeprecationWarning`` naming the new one.

Saved configurations (``.keras`` files, ``get_config`` dicts) are data, not
code a user can edit: layers map their old keys silently in ``from_config``
(:func:`rename_config_key`); only code that passes an old keyword, or reads
or sets an old attribute, is warned.
"""

import warnings

__all__ = ["renamed_kwarg", "warn_renamed", "rename_config_key",
           "RenamedAttributes"]


def warn_renamed(owner, old, new, stacklevel=3):
    """Emits the ``DeprecationWarning`` for ``owner``'s ``old`` name,
    renamed ``new`` (``stacklevel`` as for :func:`warnings.warn` called by
    the caller of this function: 2 blames that caller's caller)."""
    warnings.warn(
        f"{owner}: `{old}` is deprecated and will be removed in the next "
        f"release; use `{new}` (same meaning).",
        DeprecationWarning, stacklevel=stacklevel + 1)


def renamed_kwarg(owner, old, new, old_value, new_value, new_default,
                  stacklevel=3):
    """The value of a keyword argument renamed from ``old`` to ``new``.

    Args:
      owner: what takes the argument, for the message (e.g.
        ``"SparseSplitDense"``).
      old, new: the old and the new keyword.
      old_value: the value passed as ``old``; ``None`` = not passed.
      new_value: the value passed as ``new`` (or its default).
      new_default: ``new``'s default.
      stacklevel: as for :func:`warnings.warn` called here (default 3:
        the warning blames the caller of the function that takes the
        keyword).

    Returns:
      ``new_value`` when ``old`` was not passed, else ``old_value`` (after a
      ``DeprecationWarning``).

    Raises:
      TypeError: both ``old`` and ``new`` were passed (``new`` with a value
        other than its default).
    """
    if old_value is None:
        return new_value
    if new_value is None or new_value is new_default:
        both = False
    else:
        try:
            both = bool(new_value != new_default)
        except (TypeError, ValueError):  # e.g. a symbolic tensor
            both = True
    if both:
        raise TypeError(
            f"{owner}: got both `{new}` and its deprecated alias `{old}`; "
            f"pass `{new}` only")
    warn_renamed(owner, old, new, stacklevel=stacklevel)
    return old_value


def rename_config_key(config, old, new):
    """A copy of ``config`` with key ``old`` renamed ``new`` (for loading a
    configuration saved before the rename; no warning). A config holding
    both keeps ``new``'s value. ``config`` itself is not changed."""
    if old not in config:
        return config
    config = dict(config)
    value = config.pop(old)
    config.setdefault(new, value)
    return config


class RenamedAttributes:
    """Mixin: old attribute names of a class, kept as deprecated aliases.

    A subclass lists ``_RENAMED_ATTRIBUTES = {"old": "new", ...}`` and puts
    this class first among its bases. Reading or setting ``obj.old`` warns
    (``DeprecationWarning``) and reads or sets ``obj.new``. The aliases are
    served by ``__getattr__`` (only consulted when normal lookup fails), so
    they are not in ``dir(obj)``: Keras' saving, which reads every attribute
    that ``dir`` lists, does not trip the warning.
    """

    _RENAMED_ATTRIBUTES = {}

    def __getattr__(self, name):
        new = type(self)._RENAMED_ATTRIBUTES.get(name)
        if new is None:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}")
        warn_renamed(type(self).__name__, name, new, stacklevel=2)
        return getattr(self, new)

    def __setattr__(self, name, value):
        new = type(self)._RENAMED_ATTRIBUTES.get(name)
        if new is not None:
            warn_renamed(type(self).__name__, name, new, stacklevel=2)
            name = new
        super().__setattr__(name, value)
