"""The statistics layout: the Python indices (tf_sparse_split.tuning.stats)
agree with cc/core/stats.h, and ``stats.as_dict`` accepts a layer's
latest statistics (dict or vector)."""

import re

import numpy as np
import pytest

import tf_sparse_split as tfss
from tf_sparse_split.tuning import stats as S


def _python_name(cc_name):
    """kStatZeroColsSkipped -> ZERO_COLS_SKIPPED, kNumStats -> NUM_STATS."""
    base = re.sub(r"^k(Stat)?", "", cc_name)
    return re.sub(r"(?<!^)(?=[A-Z])", "_", base).upper()


def test_stats_layout_matches_cc_core_stats_h(op_library):
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


def test_as_dict_accepts_latest_stats(op_library):
    layer = tfss.SparseSplitDense(3)
    layer(np.eye(4, dtype=np.float32))
    d = layer.latest_stats()
    assert tfss.tuning.stats.as_dict(d) == d
    assert tfss.tuning.stats.as_dict(layer.latest_stats_vector()) == d
    with pytest.raises(ValueError, match="lacks"):
        tfss.tuning.stats.as_dict({"m": 1.0})
