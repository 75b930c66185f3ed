"""Layout of the per-call statistics vector emitted by the sparse-split ops.

``sparse_split_matmul(..., return_stats=True)`` returns, beside the product, a
float64 vector of length :data:`NUM_STATS`. Its entries (indices below) are
the same as ``StatIndex`` in ``cc/core/stats.h``, the one source of the
layout (``tf_sparse_split._kernels.stats_layout()`` exports it; a test checks
that this module agrees):

==================  =====================================================
index               meaning
==================  =====================================================
ROWS_DENSE          rows of op(a) sent to the dense GEMM
ROWS_SPARSE         rows sent to the CSR SpMM (including all-zero rows)
NNZ                 nonzeros of op(a)
ZERO_COLS_SKIPPED   all-zero columns of op(a) compacted away
TIME_DENSE          seconds in the dense part (gather + GEMM + scatter)
TIME_SPARSE         seconds in the sparse part (CSR build + SpMM)
TIME_ANALYZE        seconds measuring densities and choosing the split
THRESHOLD           density threshold actually used, in [0, 1]
M, K, N             the problem size: op(a) is [M, K], op(b) is [K, N]
NNZ_SPARSE          nonzeros in the rows sent to the SpMM
HISTOGRAM           slice: rows of op(a) per row-density bin, DENSITY_BINS
                    equal bins over [0, 1] (a density of 1.0 is in the last)
HETEROGENEOUS       heterogeneous split: HETERO_OFF (not requested),
                    HETERO_RAN (GPU kernel: dense rows on the GPU, sparse
                    rows on the CPU) or HETERO_CPU_FALLBACK (requested, but
                    the CPU kernel ran the normal CPU split)
ANALYSIS            how the call counted op(a): ANALYSIS_FULL (every value:
                    exact), ANALYSIS_SAMPLED (a strided sample of its rows:
                    NNZ and HISTOGRAM are estimates scaled from it, the
                    histogram's row counts fractional) or ANALYSIS_SKIPPED
                    (nothing: NNZ is NaN, HISTOGRAM zeros). The last two
                    compact nothing (ZERO_COLS_SKIPPED 0) and run every row
                    dense (ROWS_SPARSE, NNZ_SPARSE 0) -- except a
                    convolution whose all-sparse plan decided on its sample
                    (the direct kernel needs no counts): its rows are split
                    by the estimate, NNZ_SPARSE estimated too. Callers that
                    want exact counts pass ``full_stats=True`` (the default
                    when ``return_stats`` is True)
K_LIVE              values per row of op(a) outside its all-zero columns
                    (K when the call did not count them)
DENSE_FLOPS_PER_    the call's cost problem as the op's cost model
ELEM ...            (``cc/core/cost_model.h``) saw it: ``SplitShape``'s
DENSE_ALLOWED       per-unit fields ``dense_flops_per_elem``,
                    ``sparse_flops_per_nnz``, ``row_copy_elems``,
                    ``weight_elems_per_col``, ``can_compact``,
                    ``dense_allowed`` (flags 1 or 0)
TERM_DENSE_FIXED    the op's problem family's ``CostTerms`` after the call:
... TERM_COPY       ``dense_fixed_s``, ``dense_rate`` (flop/s, 0 =
                    unknown), ``sparse_fixed_s``, ``convert_s_per_elem``,
                    ``sparse_rate`` (flop/s, 0 = unknown),
                    ``copy_s_per_elem`` (seconds)
CALIBRATED          1 when the family was calibrated (its first automatic
                    call timed both paths), 0 when its terms come from the
                    calls' observations only (or the call had no family)
==================  =====================================================

The entries ``COST_FIRST`` .. ``COST_LAST`` (``K_LIVE`` to ``CALIBRATED``)
are how the op library's cost model reaches Python: the pybind11 module
``tf_sparse_split._kernels`` is a separate shared object whose own
``FamilyFor`` registry the ops never fill, while this vector reaches the
:class:`~tf_sparse_split.tuning.ThresholdTuner` from graphs, under
``tf.distribute`` and across workers (``_kernels.cost_problem_from_stats``
reads them back). They are the same for every call of a family at one
moment, so a sum over calls divided by the calls is their mean.

Density of a row is ``nnz(row) / K``; sparsity is ``1 - density``.

Convolutions (``sparse_split_conv2d``, ``SparseSplitConv2DBackpropFilter``)
use the same layout with rows = images and columns = the ``H*W*C_in``
values of an image (an input channel is ``H*W`` columns):

==================  =====================================================
ROWS_DENSE/SPARSE   images sent to TF's convolution / the sparse kernel
NNZ, NNZ_SPARSE     nonzero input values (all images / sparse images)
ZERO_COLS_SKIPPED   ``H*W`` times the all-zero input channels skipped
M, K, N             ``batch``, ``H*W*C_in``, ``KH*KW*C_out``
HISTOGRAM           images per density bin, density = nnz / (H*W*C_in)
==================  =====================================================

so ``sparsity`` is the input's fraction of zeros and ``K - ZERO_COLS_SKIPPED``
the live values per image. The flop counts differ from a matmul's (dense:
``2*N_dense*OH*OW*KH*KW*C_in_live*C_out``; sparse: ``2*NNZ_SPARSE*N``):
the op writes its own per-unit flop into the cost entries
(``DENSE_FLOPS_PER_ELEM``, ``SPARSE_FLOPS_PER_NNZ``), and layers give the same
to :class:`~tf_sparse_split.tuning.CostModel` through
``split_work_coefficients``.
"""

ROWS_DENSE = 0
ROWS_SPARSE = 1
NNZ = 2
ZERO_COLS_SKIPPED = 3
TIME_DENSE = 4
TIME_SPARSE = 5
TIME_ANALYZE = 6
THRESHOLD = 7
M = 8
K = 9
N = 10
NNZ_SPARSE = 11
DENSITY_BINS = 16
HISTOGRAM = slice(12, 12 + DENSITY_BINS)
HETEROGENEOUS = 12 + DENSITY_BINS
ANALYSIS = 13 + DENSITY_BINS
K_LIVE = 14 + DENSITY_BINS
DENSE_FLOPS_PER_ELEM = 15 + DENSITY_BINS
SPARSE_FLOPS_PER_NNZ = 16 + DENSITY_BINS
ROW_COPY_ELEMS = 17 + DENSITY_BINS
WEIGHT_ELEMS_PER_COL = 18 + DENSITY_BINS
CAN_COMPACT = 19 + DENSITY_BINS
DENSE_ALLOWED = 20 + DENSITY_BINS
TERM_DENSE_FIXED = 21 + DENSITY_BINS
TERM_DENSE_RATE = 22 + DENSITY_BINS
TERM_SPARSE_FIXED = 23 + DENSITY_BINS
TERM_CONVERT = 24 + DENSITY_BINS
TERM_SPARSE_RATE = 25 + DENSITY_BINS
TERM_COPY = 26 + DENSITY_BINS
CALIBRATED = 27 + DENSITY_BINS
COST_FIRST = K_LIVE
COST_LAST = CALIBRATED
NUM_STATS = 28 + DENSITY_BINS

HETERO_OFF = 0.0
HETERO_RAN = 1.0
HETERO_CPU_FALLBACK = 2.0

ANALYSIS_FULL = 0.0
ANALYSIS_SAMPLED = 1.0
ANALYSIS_SKIPPED = 2.0

NAMES = (
    "rows_dense", "rows_sparse", "nnz", "zero_cols_skipped", "time_dense",
    "time_sparse", "time_analyze", "threshold", "m", "k", "n", "nnz_sparse",
) + tuple(f"hist_{i}" for i in range(DENSITY_BINS)) + (
    "heterogeneous", "analysis",
    # The cost entries COST_FIRST .. COST_LAST:
    "k_live", "dense_flops_per_elem", "sparse_flops_per_nnz",
    "row_copy_elems", "weight_elems_per_col", "can_compact", "dense_allowed",
    "term_dense_fixed", "term_dense_rate", "term_sparse_fixed",
    "term_convert", "term_sparse_rate", "term_copy", "calibrated")


def as_dict(stats):
    """Returns the named scalar entries of one statistics vector as floats.

    Args:
      stats: array-like of length ``NUM_STATS`` (numpy or eager tensor), or
        a dict this function returned (e.g. ``layer.latest_stats()``, which
        is already converted): returned as a copy.

    Returns:
      dict from the names in :data:`NAMES` (without the histogram) to floats,
      including ``"heterogeneous"``, ``"analysis"`` and the cost entries
      (``NAMES[COST_FIRST:]``: ``"k_live"`` ... ``"calibrated"``),
      plus ``"histogram"``: a list of ``DENSITY_BINS`` row counts and
      ``"sparsity"``: the fraction of zeros in op(a) (``nan`` if it is empty).

    Raises:
      ValueError: if ``stats`` does not have ``NUM_STATS`` entries.
    """
    import numpy as np

    if isinstance(stats, dict):
        missing = [k for k in ("histogram", "sparsity") if k not in stats]
        if missing:
            raise ValueError(f"expected a statistics vector or a dict from "
                             f"as_dict(); the dict lacks {missing}")
        return {k: (list(v) if k == "histogram" else v)
                for k, v in stats.items()}
    v = np.asarray(stats, dtype=np.float64).reshape(-1)
    if v.shape[0] != NUM_STATS:
        raise ValueError(f"expected {NUM_STATS} statistics, got {v.shape[0]}")
    out = {name: float(v[i]) for i, name in enumerate(NAMES[:12])}
    out["histogram"] = [float(x) for x in v[HISTOGRAM]]
    out["heterogeneous"] = float(v[HETEROGENEOUS])
    out["analysis"] = float(v[ANALYSIS])
    for i in range(COST_FIRST, COST_LAST + 1):
        out[NAMES[i]] = float(v[i])
    elems = v[M] * v[K]
    out["sparsity"] = float(1.0 - v[NNZ] / elems) if elems > 0 else float("nan")
    return out
