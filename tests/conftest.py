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
    """The loaded op library (fails loudly if it is not built)."""
    import tf_sparse_split as tfss

    return tfss.load_library()


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
