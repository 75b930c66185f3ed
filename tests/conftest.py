"""Shared pytest fixtures of the tf_sparse_split tests."""

import pathlib

import numpy as np
import pytest
import tensorflow as tf

#: Committed test data (tests/data).
DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"


@pytest.fixture(params=["CPU", "GPU"])
def device(request):
    """A TensorFlow device name (``/device:CPU:0``, ``/device:GPU:0``) to run
    an op under ``tf.device(device)``; the GPU case is skipped when
    TensorFlow sees no GPU."""
    if request.param == "GPU" and not tf.config.list_physical_devices("GPU"):
        pytest.skip("no GPU visible to TensorFlow")
    return f"/device:{request.param}:0"


@pytest.fixture
def rng():
    """A numpy Generator with a fixed seed (fresh for every test)."""
    return np.random.default_rng(1234)


@pytest.fixture
def data_dir():
    """Path of the committed test data (``tests/data``)."""
    return DATA_DIR


@pytest.fixture(scope="session")
def op_library():
    """The loaded op library. Tests that need it ask for this fixture (or
    a module's ``pytestmark = pytest.mark.usefixtures("op_library")``), so a
    checkout without the built library still collects; their setup then
    fails with the :class:`~tf_sparse_split.LibraryLoadError` message (the
    rebuild command)."""
    import tf_sparse_split as tfss

    try:
        return tfss.load_library()
    except tfss.LibraryLoadError as e:
        error = str(e)
    pytest.fail(f"op library not loaded: {error}", pytrace=False)


@pytest.fixture
def run_cli(capsys):
    """Runs the ``tf-sparse-split`` command in-process: a function
    ``run_cli(argv) -> (exit code, stdout, stderr)``."""
    from tf_sparse_split.tools import cli

    def run(argv):
        rc = cli.main(argv)
        captured = capsys.readouterr()
        return rc, captured.out, captured.err

    return run


@pytest.fixture
def rw():
    """The rewrite switch (``tf_sparse_split.rewrite``) with the pass off and
    its counters, log and missed-function records cleared before and after
    the test."""
    from tf_sparse_split import rewrite
    rewrite.disable()
    rewrite.reset_counters()
    rewrite.log(clear=True)
    rewrite._take_missed()
    yield rewrite
    rewrite.disable()
    rewrite.reset_counters()
    rewrite.log(clear=True)
    rewrite._take_missed()


@pytest.fixture
def mixed_bfloat16_policy():
    """Keras' global dtype policy set to ``mixed_bfloat16`` for the test,
    the previous one restored after it."""
    import keras
    old = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy(old)
