"""Registration in every import order: in a fresh process, ``tf_sparse_split``,
``tensorflow`` and ``keras`` imported in each of the six orders (with
``importlib.util.find_spec`` look-ups of both packages between the imports,
as TensorFlow makes one of ``keras`` while importing) reload a ``.keras``
file with sparse-split layers, a ``tf.saved_model.save`` SavedModel calling
the op, and a ``model.export`` archive; ``tf-sparse-split profile`` reads a
sparse-split ``.keras`` file. The artifacts are saved once; each process
reloads all three formats."""

import itertools
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import conv_dense_model
import tensorflow as tf

import tf_sparse_split as tfss

#: Each order runs fresh interpreters (about a minute in all).
pytestmark = pytest.mark.slow

ORDERS = list(itertools.permutations(("tf_sparse_split", "tensorflow",
                                      "keras")))
REPO = Path(__file__).resolve().parents[1]

RELOAD = textwrap.dedent("""
    import importlib, importlib.util, sys
    order, d = sys.argv[1].split(","), sys.argv[2]
    for name in order:
        importlib.import_module(name)
        if name == "tf_sparse_split" and order[0] == name:
            # The package's own import is cheap: no TensorFlow, no Keras.
            assert "tensorflow" not in sys.modules, "imported tensorflow"
            assert "keras" not in sys.modules, "imported keras"
        for probe in ("keras", "tensorflow"):  # look-ups without import
            assert importlib.util.find_spec(probe) is not None
    import numpy as np
    import keras, tensorflow as tf
    x, y = np.load(d + "/x.npy"), np.load(d + "/y.npy")
    m = keras.saving.load_model(d + "/m.keras")
    assert [type(l).__name__ for l in m.layers][::2] == \\
        ["SparseSplitConv2D", "SparseSplitDense"], m.layers
    assert [l.threshold for l in m.layers if hasattr(l, "threshold")] == \\
        [0.25, 0.5]
    np.testing.assert_array_equal(m.predict(x, verbose=0), y)
    e = tf.saved_model.load(d + "/exported")
    np.testing.assert_allclose(e.serve(x).numpy(), y, rtol=1e-6, atol=1e-6)
    mod = tf.saved_model.load(d + "/module")
    a = np.load(d + "/a.npy")
    np.testing.assert_allclose(mod(a).numpy(), np.load(d + "/ab.npy"),
                               rtol=1e-6, atol=1e-6)
    print("RELOADED")
    """)


def _run(argv, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(argv, cwd=str(REPO), env=env, capture_output=True,
                          text=True, timeout=timeout)


def _cli():
    """The console script next to this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name("tf-sparse-split")
    return [str(script)] if script.exists() else \
        [sys.executable, "-m", "tf_sparse_split"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, op_library):
    """Saves the three artifacts once, then runs one fresh process per
    import order and one ``profile`` (three at a time); returns
    ``{key: CompletedProcess}``."""
    d = tmp_path_factory.mktemp("import_order")
    keras.utils.set_random_seed(5)
    model = conv_dense_model()
    rng = np.random.default_rng(4)
    x = np.maximum(rng.standard_normal((4, 6, 6, 2)), 0).astype(np.float32)
    assert 0 < np.count_nonzero(x) < x.size
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", model.predict(x, verbose=0))
    model.save(d / "m.keras")
    model.export(str(d / "exported"), verbose=False)

    w = rng.standard_normal((7, 3)).astype(np.float32)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    a[rng.random(a.shape) < 0.6] = 0.0
    np.save(d / "a.npy", a)
    np.save(d / "ab.npy", (a.astype(np.float64) @ w).astype(np.float32))

    class Module(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(w)

        @tf.function(input_signature=[tf.TensorSpec([None, 7], tf.float32)])
        def __call__(self, a):
            return tfss.sparse_split_matmul(a, self.w, threshold="auto")

    tf.saved_model.save(Module(), str(d / "module"))

    jobs = {",".join(o): [sys.executable, "-c", RELOAD, ",".join(o), str(d)]
            for o in ORDERS}
    jobs["profile"] = _cli() + ["profile", str(d / "m.keras"),
                                "--repeats", "1", "--batch-size", "4"]
    with ThreadPoolExecutor(3) as pool:
        done = {k: pool.submit(_run, argv) for k, argv in jobs.items()}
        return {k: f.result() for k, f in done.items()}


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
def test_every_import_order_reloads_all_three_formats(runs, order):
    r = runs[",".join(order)]
    assert r.returncode == 0 and "RELOADED" in r.stdout, r.stderr[-3000:]
    assert "could not register" not in r.stderr


def test_profile_command_reads_a_sparse_split_keras_file(runs):
    r = runs["profile"]
    assert r.returncode == 0, r.stderr[-3000:]
    split_nodes = [ln for ln in r.stdout.splitlines()
                   if "TfSparseSplit>SparseSplit" in ln]
    assert len(split_nodes) == 2, r.stdout


#: First uses of the lazy public names that import TensorFlow from inside a
#: module of the package (``tf_sparse_split.ops.matmul`` imports it at its
#: top): the layers must still be registered, once that module is complete.
FIRST_USES = ["tfss.sparse_split_matmul", "tfss.sparse_split_conv2d",
              "tfss.testing", "tfss.rewrite", "tfss.load_library()",
              "tfss.sparse_split_model", "tfss.SparseSplitDense"]

FIRST_USE = textwrap.dedent("""
    import sys
    import tf_sparse_split as tfss
    assert "tensorflow" not in sys.modules
    {use}
    assert "tensorflow" in sys.modules
    # Registered by the import that brought TensorFlow in, before any
    # explicit import of keras or of the layers.
    assert "tf_sparse_split.layers" in sys.modules, "layers not imported"
    import keras
    for name in ("SparseSplitDense", "SparseSplitConv2D", "FATReLU"):
        cls = keras.saving.get_registered_object("tf_sparse_split>" + name)
        assert cls is not None and cls.__name__ == name, name
    assert tfss.library_error is None, tfss.library_error
    print("REGISTERED")
    """)


@pytest.mark.parametrize("use", FIRST_USES)
def test_first_use_of_a_public_name_registers_the_layers(use):
    # -W error: a failed registration is a RuntimeWarning, here an error.
    r = _run([sys.executable, "-W", "error::RuntimeWarning", "-c",
              FIRST_USE.format(use=use)])
    assert r.returncode == 0 and "REGISTERED" in r.stdout, r.stderr[-3000:]
    assert "could not register" not in r.stderr
