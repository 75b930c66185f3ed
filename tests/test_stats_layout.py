"""Compatibility of saved files and layouts: a ``.keras`` file saved by
version 0.1 still loads with identical predictions, and the Python
statistics layout agrees with cc/core/stats.h."""

import re

import keras
import numpy as np
import pytest

import tf_sparse_split as tfss
from tf_sparse_split.tuning import stats as S


def test_legacy_keras_file_loads_with_identical_predictions(data_dir,
                                                            op_library):
    """tests/data/legacy_v0_1.keras was saved by the pre-reorganisation code
    (tests/data/make_legacy_v0_1.py, run in the old layout) with its
    predictions in legacy_v0_1_expected.npz."""
    model = keras.saving.load_model(data_dir / "legacy_v0_1.keras")
    expected = np.load(data_dir / "legacy_v0_1_expected.npz")
    kinds = {type(layer) for layer in model.layers}
    assert {tfss.SparseSplitDense, tfss.SparseSplitConv2D,
            tfss.ApproximateRandomDropout,
            tfss.SensitivityAwareDropout} <= kinds
    assert model.get_layer("conv").threshold == pytest.approx(0.3)
    assert model.get_layer("dense_1").threshold == pytest.approx(0.6)
    assert model.get_layer("dense_2").skip_dead_input_grad is True
    np.testing.assert_array_equal(model.predict(expected["x"], verbose=0),
                                  expected["y"])


def _python_name(cc_name):
    """kStatZeroColsSkipped -> ZERO_COLS_SKIPPED, kNumStats -> NUM_STATS."""
    base = re.sub(r"^k(Stat)?", "", cc_name)
    return re.sub(r"(?<!^)(?=[A-Z])", "_", base).upper()


def test_stats_layout_matches_cc_core_stats_h():
    from tf_sparse_split._loader import kernels

    layout = kernels().stats_layout()
    assert layout["kNumStats"] == S.NUM_STATS
    assert layout["kDensityBins"] == S.DENSITY_BINS
    seen = set()
    for cc_name, value in layout.items():
        name = _python_name(cc_name)
        ours = getattr(S, name)
        if isinstance(ours, slice):  # the histogram
            assert (ours.start, ours.stop) == (value, value + S.DENSITY_BINS)
        else:
            assert ours == value, (cc_name, name)
        seen.add(name)
    # Every index the Python module names comes from the C++ layout.
    indices = {n for n in dir(S) if n.isupper() and n not in ("NAMES",)}
    assert indices == seen
    assert len(S.NAMES) == S.NUM_STATS
