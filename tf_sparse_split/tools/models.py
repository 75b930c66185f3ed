"""Model builders of the ``tf-sparse-split train`` command (and the
benchmarks): :func:`build_mlp` (ReLU MLP, optional structured dropout),
:func:`build_cnn` (small ReLU CNN) and :func:`build_lstm` (LSTM classifier),
with sparse-split layers or their plain Keras counterparts."""

__all__ = ["build_mlp", "build_cnn", "build_lstm", "DROPOUT_KINDS",
           "PLAIN_WHERE_NO_GAIN", "plain_layer_names"]

#: Values of ``build_mlp(dropout=...)`` (and ``train --dropout``).
DROPOUT_KINDS = ("none", "standard", "row", "tile")

#: ``keep_plain`` of the ``train`` command: the layers that stay plain Keras
#: layers in the sparse-split model because a sparse-split layer cannot win
#: there. ``"first"``: the layer on the model input (raw pixels: their zeros
#: are not a ReLU's, no input gradient is needed, and K is small: 64 for the
#: digits, 1 channel x 9 taps for the CNN); ``"output"``: a softmax output
#: layer with fewer than 64 units (each of its three products is a few
#: MFLOP, below the op's fixed per-call cost of counting its input).
PLAIN_WHERE_NO_GAIN = ("first", "output")


def plain_layer_names(names, keep_plain):
    """Which of the candidate layers ``names`` (ordered, first = the layer on
    the model input, last = the output layer) stay plain for
    ``keep_plain`` (a collection of ``"first"``/``"output"``). At least one
    layer is always left sparse-split: with one hidden layer the output
    layer (fed by a ReLU) stays sparse-split.

    Raises:
      ValueError: for an unknown entry of ``keep_plain``.
    """
    keep_plain = tuple(keep_plain or ())
    bad = [k for k in keep_plain if k not in PLAIN_WHERE_NO_GAIN]
    if bad:
        raise ValueError(f"keep_plain entries must be in "
                         f"{PLAIN_WHERE_NO_GAIN}, got {bad}")
    names = list(names)
    plain = set()
    if "first" in keep_plain and len(names) > 1:
        plain.add(names[0])
    if "output" in keep_plain and len(names) - len(plain) > 1:
        plain.add(names[-1])
    return plain


def build_mlp(input_dim, hidden, num_classes, sparse=True, threshold=-1.0,
              dropout="none", dropout_rate=0.5, seed=None, tile_shape=None,
              pattern_groups=None, keep_plain=()):
    """An MLP ``input -> [hidden ReLU [dropout]]* -> softmax``.

    Args:
      input_dim: features per example.
      hidden: list of hidden layer widths.
      num_classes: output classes.
      sparse: SparseSplitDense layers (True) or keras.layers.Dense (False).
      threshold: initial threshold of the SparseSplitDense layers.
      dropout: ``"none"``, ``"standard"`` (``keras.layers.Dropout``),
        ``"row"`` or ``"tile"`` (``ApproximateRandomDropout``): a dropout
        layer after every hidden layer, named ``dropout_1``, ...
      dropout_rate: its rate in ``[0, 1)``.
      seed: seed of the dropout layers (layer ``i`` gets ``seed + i``).
      tile_shape: tile of the ``"tile"`` pattern (default ``(32, 32)``).
      pattern_groups: ``ApproximateRandomDropout``'s ``pattern_groups`` for
        ``dropout="row"`` (default None: the layer's default, 8).
      keep_plain: with ``sparse``, layers that stay ``keras.layers.Dense``
        (see :data:`PLAIN_WHERE_NO_GAIN` and :func:`plain_layer_names`;
        ``"output"`` only when ``num_classes < 64``). Default: none.

    Returns:
      an uncompiled ``keras.Sequential``; layers are named ``hidden_1``, ...,
      ``output``.

    Raises:
      ValueError: unknown ``dropout`` or ``keep_plain`` entry, bad rate, or a
        tile not dividing a hidden size.
    """
    import keras

    from tf_sparse_split.layers import SparseSplitDense

    names = [f"hidden_{i + 1}" for i in range(len(hidden))] + ["output"]
    if num_classes >= 64:
        keep_plain = tuple(k for k in (keep_plain or ()) if k != "output")
    plain = plain_layer_names(names, keep_plain) if sparse else set(names)

    def dense(units, activation, name, after_relu=False):
        if name not in plain:
            # After a ReLU (optionally through row/tile dropout) the input
            # gradient is needed only for units alive in the batch.
            return SparseSplitDense(units, activation=activation,
                                    threshold=threshold, name=name,
                                    masked_input_grad=after_relu)
        return keras.layers.Dense(units, activation=activation, name=name)

    if dropout not in DROPOUT_KINDS:
        raise ValueError(f"dropout must be one of {DROPOUT_KINDS}, got "
                         f"{dropout!r}")

    def drop(i):
        from tf_sparse_split.layers import ApproximateRandomDropout

        s = None if seed is None else seed + i
        name = f"dropout_{i + 1}"
        if dropout == "standard":
            return keras.layers.Dropout(dropout_rate, seed=s, name=name)
        return ApproximateRandomDropout(
            dropout_rate, pattern=dropout, seed=s, name=name,
            tile_shape=tile_shape if dropout == "tile" else None,
            pattern_groups=pattern_groups if dropout == "row" else None)

    layers = [keras.Input((input_dim,))]
    for i, width in enumerate(hidden):
        layers.append(dense(width, "relu", f"hidden_{i + 1}", after_relu=i > 0))
        if dropout != "none":
            layers.append(drop(i))
    layers.append(dense(num_classes, "softmax", "output", after_relu=True))
    return keras.Sequential(layers, name="sparse_mlp" if sparse else "mlp")


def build_cnn(side, filters, num_classes, sparse=True, threshold=-1.0,
              keep_plain=()):
    """A small CNN ``[side, side, 1] -> conv 3x3 ReLU -> conv 3x3 ReLU ->
    2x2 max-pool -> flatten -> softmax``.

    Args:
      side: image height = width.
      filters: two ints, the filters of the two conv layers.
      num_classes: output classes.
      sparse: SparseSplitConv2D / SparseSplitDense (True) or keras Conv2D /
        Dense (False).
      threshold: initial threshold of the sparse-split layers.
      keep_plain: with ``sparse``, layers that stay plain Keras layers (see
        :data:`PLAIN_WHERE_NO_GAIN`: ``"first"`` = ``conv_1`` on the
        1-channel image, ``"output"`` = the dense layer when
        ``num_classes < 64``). Default: none.

    Returns:
      an uncompiled ``keras.Sequential``; layers named ``conv_1``,
      ``conv_2``, ``pool``, ``flatten``, ``output``.

    Raises:
      ValueError: if ``filters`` does not have two entries, or an unknown
        ``keep_plain`` entry.
    """
    import keras

    from tf_sparse_split.layers import SparseSplitConv2D, SparseSplitDense

    if len(filters) != 2:
        raise ValueError(f"--filters needs two sizes for the two conv "
                         f"layers, got {filters}")

    names = ["conv_1", "conv_2", "output"]
    if num_classes >= 64:
        keep_plain = tuple(k for k in (keep_plain or ()) if k != "output")
    plain = plain_layer_names(names, keep_plain) if sparse else set(names)

    def conv(n, name):
        if name not in plain:
            return SparseSplitConv2D(n, 3, padding="same", activation="relu",
                                     threshold=threshold, name=name)
        return keras.layers.Conv2D(n, 3, padding="same", activation="relu",
                                   name=name)

    out = (SparseSplitDense(num_classes, activation="softmax",
                            threshold=threshold, name="output")
           if "output" not in plain
           else keras.layers.Dense(num_classes, activation="softmax",
                                   name="output"))
    return keras.Sequential(
        [keras.Input((side, side, 1)), conv(filters[0], "conv_1"),
         conv(filters[1], "conv_2"), keras.layers.MaxPooling2D(2, name="pool"),
         keras.layers.Flatten(name="flatten"), out],
        name="sparse_cnn" if sparse else "cnn")


def build_lstm(timesteps, features, units, num_classes, sparse=True,
               dropout="row", dropout_rate=0.0, recurrent_dropout_rate=0.0,
               seed=None, tile_shape=None, pattern_groups=None):
    """An LSTM classifier ``[timesteps, features] -> LSTM(units) -> softmax``
    (e.g. MNIST rows as sequences: 28 steps x 28 features).

    Args:
      timesteps, features: the input sequence shape.
      units: LSTM units.
      num_classes: output classes.
      sparse: :class:`~tf_sparse_split.layers.SparseSplitLSTM` (True) or
        ``keras.layers.LSTM`` (False; Keras' random dropout masks).
      dropout: pattern of the sparse layer's dropout: ``"row"``, ``"tile"``,
        ``"standard"`` (Keras' masks: ``pattern="random"``) or ``"none"``
        (rates forced to 0).
      dropout_rate, recurrent_dropout_rate: the LSTM's ``dropout`` and
        ``recurrent_dropout`` in ``[0, 1)``.
      seed: dropout seed.
      tile_shape: tile of the ``"tile"`` pattern.
      pattern_groups: ``SparseSplitLSTM``'s ``pattern_groups`` for the
        ``"row"`` pattern (None: its default).

    Returns:
      an uncompiled ``keras.Sequential`` with layers ``lstm`` and ``output``
      (a plain ``keras.layers.Dense`` in both variants).

    Raises:
      ValueError: unknown ``dropout`` or bad rates/tile.
    """
    import keras

    from tf_sparse_split.layers import SparseSplitLSTM

    if dropout not in DROPOUT_KINDS:
        raise ValueError(f"dropout must be one of {DROPOUT_KINDS}, got "
                         f"{dropout!r}")
    if dropout == "none":
        dropout_rate = recurrent_dropout_rate = 0.0
    kwargs = dict(dropout=dropout_rate, recurrent_dropout=recurrent_dropout_rate,
                  seed=seed, name="lstm")
    if sparse:
        pattern = {"standard": "random", "none": "row"}.get(dropout, dropout)
        rnn = SparseSplitLSTM(units, pattern=pattern,
                              tile_shape=tile_shape if pattern == "tile"
                              else None,
                              pattern_groups=(pattern_groups
                                              if pattern == "row" else None),
                              **kwargs)
    else:
        rnn = keras.layers.LSTM(units, **kwargs)
    return keras.Sequential(
        [keras.Input((timesteps, features)), rnn,
         keras.layers.Dense(num_classes, activation="softmax", name="output")],
        name="sparse_lstm" if sparse else "lstm")
