"""A least-squares cost model of the split, fitted to recorded statistics.

Not the estimator the ops and the tuner use: that is the ops' own family
model (``cc/core/cost_model.h``), whose terms every call writes into its
statistics and which :class:`~tf_sparse_split.tuning.ThresholdTuner` reads
(:mod:`tf_sparse_split.tuning.op_model`). :class:`CostModel` stays for
offline analysis of recorded statistics (and the tests and notebooks that
fit lines to them): it fits two lines and hands them to the ops' decision.

``SparseSplitMatMul`` sends rows of its activation operand whose density
(nonzeros / K) is above a threshold to a dense GEMM and the rest to a CSR
SpMM. Which threshold is fastest depends on the machine, the problem size and
the sparsity pattern, so it is fitted at run time from the timings the op
itself records (K.-Y. Peng, "Adaptive runtime exploiting sparsity in tensor
of deep learning on heterogeneous systems", NTU 2017): each path is modelled
as

    time = overhead + work / rate

with ``time`` in seconds, ``work`` in floating-point operations (flop) and
``rate`` in flop/s, where

* dense path:  ``work = 2 * rows_dense * (K - zero_cols_skipped) * N``
  against ``TIME_DENSE``;
* sparse path: ``work = 2 * nnz_sparse * N`` against ``TIME_SPARSE``.

Those are a matmul's formulas. Other ops give their own per-unit
coefficients (``coefficients=(dense_coef, sparse_coef)``, work =
``rows_dense * k_live * dense_coef`` and ``nnz_sparse * sparse_coef``); a
layer exposes them as ``split_work_coefficients(stats_vector)`` -- for a
convolution ``sparse_coef = 2*KH*KW*C_out`` and ``dense_coef = sparse_coef *
OH*OW / (H*W)``, so the dense work is ``2*N_dense*OH*OW*KH*KW*C_in_live*C_out``.

The two parameters are fitted by least squares (numpy) with both kept
nonnegative: a negative coefficient is clipped to zero and the other one
refitted. When the samples' work values span less than a factor of two the
overhead cannot be told from the rate, and the line goes through the origin. A path that did no work in a call (``work == 0``) is not a sample
for that path: the op spends nothing there, and the model predicts 0 s for
zero work. Nothing is hard-coded about the break-even point; it follows from
the two measured rates (see docs/ARCHITECTURE.md, "Performance notes").

In a heterogeneous split (``heterogeneous=True`` on the op: dense rows on the
GPU, sparse rows on the CPU, at the same time) the two paths overlap, so the
predicted time of a threshold is ``max(T_dense, T_sparse)`` -- the later of
the two devices' finishing times -- instead of their sum, and the best
threshold balances the devices rather than minimising total work.

One definition. This class only *fits* the two paths' terms from the
statistics; the prediction and the decision are the ops' own cost model,
``cc/core/cost_model.h``, reached through the pybind11 module
(``tf_sparse_split._kernels.predict_plan_seconds`` / ``decide_split``): the
fitted overheads and rates are handed over as its ``CostTerms`` (per-call
fixed seconds and flop/s of each path). :meth:`CostModel.best_threshold`
therefore applies the ops' margins (:data:`DEFAULT_POLICY`): a threshold
that sends rows sparse is chosen only when predicted at least 10% (and 100
us) faster than all-dense, and among thresholds within 2% of the fastest the
one with the most dense rows wins. ``policy=ARGMIN_POLICY`` gives the plain
argmin.
"""

import dataclasses
import math

import numpy as np

from tf_sparse_split import _loader
from tf_sparse_split.tuning import stats as _stats

__all__ = ["CostModel", "PathFit", "DENSE", "SPARSE", "candidate_thresholds",
           "DEFAULT_POLICY", "ARGMIN_POLICY"]

#: The ops' decision margins (cc/core/cost_model.h DecisionPolicy): None
#: selects them.
DEFAULT_POLICY = None
#: No margins: best_threshold returns the argmin of the predicted time (ties
#: to the smaller threshold).
ARGMIN_POLICY = {"enter_margin": 0.0, "stay_margin": 0.0,
                 "switch_margin": 0.0, "tie_margin": 0.0, "min_gain_s": 0.0}

# A rate of inf (time not growing with the work) as the C++ model's finite
# flop/s.
_HUGE_RATE = 1e300

DENSE = "dense"
SPARSE = "sparse"
_PATHS = (DENSE, SPARSE)


@dataclasses.dataclass(frozen=True)
class PathFit:
    """Fitted ``time = overhead + work / rate`` of one path.

    Attributes:
      overhead: seconds per call, >= 0.
      rate: flop/s, > 0 (``inf`` when the time did not grow with the work).
      num_samples: samples the fit used.
      rms_error: root-mean-square residual of the fit, in seconds.
    """

    overhead: float
    rate: float
    num_samples: int
    rms_error: float

    def predict(self, work):
        """Predicted seconds for ``work`` flop (0 s when ``work`` is 0)."""
        work = np.asarray(work, dtype=np.float64)
        per_flop = 0.0 if math.isinf(self.rate) else 1.0 / self.rate
        t = self.overhead + work * per_flop
        return np.where(work > 0, t, 0.0)


# Below this spread of the work values, (max - min) / max, a path is fitted
# through the origin (rate only): a call's work hardly varies within one
# layer unless its threshold changes, and a two-parameter fit to nearly
# equal abscissae would take its slope from timing noise.
_MIN_RELATIVE_SPREAD = 0.5


def _fit_line(work, time):
    """Nonnegative least-squares fit of time = c0 + c1 * work.

    Returns (c0, c1) with both >= 0: solve the unconstrained problem; if a
    coefficient comes out negative, set it to zero and refit the other alone.
    With too little spread in ``work`` (see _MIN_RELATIVE_SPREAD) it fits
    c1 alone (c0 = 0).
    """
    w = np.asarray(work, dtype=np.float64)
    t = np.asarray(time, dtype=np.float64)
    if w.size == 1 or np.ptp(w) < _MIN_RELATIVE_SPREAD * w.max():
        # Too little spread in work: the overhead cannot be told apart from
        # the rate (timing noise would decide the slope), so attribute all
        # time to the work (line through the origin).
        c0, c1 = 0.0, float(np.dot(w, t) / np.dot(w, w))
    else:
        design = np.stack([np.ones_like(w), w], axis=1)
        (c0, c1), *_ = np.linalg.lstsq(design, t, rcond=None)
        c0, c1 = float(c0), float(c1)
    if c0 < 0.0:
        c0, c1 = 0.0, float(np.dot(w, t) / np.dot(w, w))
    if c1 < 0.0:
        c0, c1 = float(np.mean(t)), 0.0
    return max(c0, 0.0), max(c1, 0.0)


def candidate_thresholds(bins=_stats.DENSITY_BINS):
    """The thresholds :meth:`CostModel.best_threshold` compares: the density
    bin edges ``0, 1/bins, ..., 1`` (floats)."""
    return [j / bins for j in range(bins + 1)]


def _coefficients(coefficients, n):
    """(dense_coef, sparse_coef): flop per dense row-column element and per
    sparse nonzero; default 2 n each (a matmul with n output columns)."""
    if coefficients is None:
        return 2.0 * float(n), 2.0 * float(n)
    dense_coef, sparse_coef = (float(c) for c in coefficients)
    if not (math.isfinite(dense_coef) and math.isfinite(sparse_coef)) or \
            dense_coef < 0 or sparse_coef < 0:
        raise ValueError(f"coefficients must be finite and >= 0, got {coefficients!r}")
    return dense_coef, sparse_coef


class CostModel:
    """Per-path linear timing model fitted to the op's statistics.

    Usage::

        model = CostModel()
        for s in stats_vectors:          # each a float64 [NUM_STATS] vector
            model.add_stats(s)
        model.fit()
        t = model.best_threshold(hist, m, k, k_live, n)   # or None

    Samples accumulate until :meth:`reset`; :meth:`fit` uses all of them.
    """

    def __init__(self, warmup_samples=0):
        """Args:
          warmup_samples: int >= 0, the first samples of each path to
            discard: the first calls of a path are slow for reasons the model
            does not describe (allocation, page faults, thread-pool start).

        Raises:
          ValueError: if ``warmup_samples`` is not an int >= 0.
        """
        if isinstance(warmup_samples, bool) or \
                not isinstance(warmup_samples, int) or warmup_samples < 0:
            raise ValueError(
                f"warmup_samples must be an int >= 0, got {warmup_samples!r}")
        self.warmup_samples = warmup_samples
        self._skipped = {p: 0 for p in _PATHS}
        self._samples = {p: ([], []) for p in _PATHS}
        self._fits = {}

    # -- samples ----------------------------------------------------------
    def reset(self):
        """Drops all samples and fits (the warm-up count starts over)."""
        self._skipped = {p: 0 for p in _PATHS}
        self._samples = {p: ([], []) for p in _PATHS}
        self._fits = {}

    def add_sample(self, path, work, seconds):
        """Adds one timing sample.

        Args:
          path: ``"dense"`` or ``"sparse"``.
          work: flop done by that path in the call (samples with work <= 0
            are ignored, see the module docstring; the first
            ``warmup_samples`` ones with work > 0 are discarded).
          seconds: wall-clock seconds that path took.

        Raises:
          ValueError: on an unknown path, or a negative / non-finite time or
            work.
        """
        if path not in _PATHS:
            raise ValueError(f"path must be 'dense' or 'sparse', got {path!r}")
        work, seconds = float(work), float(seconds)
        if not (math.isfinite(work) and math.isfinite(seconds)) or \
                seconds < 0 or work < 0:
            raise ValueError(
                f"work and seconds must be finite and >= 0, got work={work}, "
                f"seconds={seconds}")
        if work <= 0:
            return
        if self._skipped[path] < self.warmup_samples:
            self._skipped[path] += 1
            return
        self._samples[path][0].append(work)
        self._samples[path][1].append(seconds)

    def add_stats(self, stats_vector, coefficients=None):
        """Adds the dense and sparse samples of one op call.

        Args:
          stats_vector: array-like of length ``stats.NUM_STATS`` as returned
            by ``sparse_split_matmul(..., return_stats=True)`` (or
            ``sparse_split_conv2d``).
          coefficients: optional ``(dense_coef, sparse_coef)`` in flop: the
            dense work is ``ROWS_DENSE * (K - ZERO_COLS_SKIPPED) *
            dense_coef`` and the sparse work ``NNZ_SPARSE * sparse_coef``.
            Default ``(2 N, 2 N)``, a matmul's; layers give theirs with
            ``split_work_coefficients`` (a convolution's differ).

        Raises:
          ValueError: if it has the wrong length.
        """
        v = np.asarray(stats_vector, dtype=np.float64).reshape(-1)
        if v.shape[0] != _stats.NUM_STATS:
            raise ValueError(
                f"expected {_stats.NUM_STATS} statistics, got {v.shape[0]}")
        dense_coef, sparse_coef = _coefficients(coefficients, v[_stats.N])
        k_live = v[_stats.K] - v[_stats.ZERO_COLS_SKIPPED]
        dense_work = v[_stats.ROWS_DENSE] * k_live * dense_coef
        sparse_work = v[_stats.NNZ_SPARSE] * sparse_coef
        self.add_sample(DENSE, dense_work, v[_stats.TIME_DENSE])
        self.add_sample(SPARSE, sparse_work, v[_stats.TIME_SPARSE])

    def num_samples(self, path):
        """Number of samples held for ``path``."""
        return len(self._samples[path][0])

    # -- fitting ----------------------------------------------------------
    def fit(self, min_samples=1):
        """Fits every path that has at least ``min_samples`` samples.

        A path with fewer samples has no fit afterwards (see :meth:`fitted`).

        Returns:
          dict ``{path: PathFit}`` of the paths that were fitted.

        Raises:
          ValueError: if ``min_samples`` < 1.
        """
        if int(min_samples) < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self._fits = {}
        for path in _PATHS:
            work, time = self._samples[path]
            if len(work) < min_samples:
                continue
            c0, c1 = _fit_line(work, time)
            w, t = np.asarray(work), np.asarray(time)
            rms = float(np.sqrt(np.mean((c0 + c1 * w - t) ** 2)))
            rate = math.inf if c1 == 0.0 else 1.0 / c1
            self._fits[path] = PathFit(c0, rate, len(work), rms)
        return dict(self._fits)

    def fitted(self, path):
        """The :class:`PathFit` of ``path``, or None if it is not fitted."""
        return self._fits.get(path)

    def rate(self, path):
        """Fitted rate of ``path`` in flop/s, or None if not fitted."""
        f = self._fits.get(path)
        return None if f is None else f.rate

    def overhead(self, path):
        """Fitted per-call overhead of ``path`` in seconds, or None."""
        f = self._fits.get(path)
        return None if f is None else f.overhead

    # -- prediction -------------------------------------------------------
    @staticmethod
    def _check_problem(histogram, m, k, k_live, n):
        hist = np.asarray(histogram, dtype=np.float64).reshape(-1)
        if hist.size < 1 or np.any(hist < 0) or not np.all(np.isfinite(hist)):
            raise ValueError("histogram must be a nonempty vector of finite "
                             "counts >= 0")
        if m < 0 or k < 0 or n < 0 or not 0 <= k_live <= k:
            raise ValueError(
                f"need m, k, n >= 0 and 0 <= k_live <= k, got m={m}, k={k}, "
                f"k_live={k_live}, n={n}")
        return hist

    def _problem(self, hist, k, k_live, n, nnz, heterogeneous, coefficients):
        """The C++ model's (shape, profile, terms) for one call: rows are the
        histogram's, the dense path multiplies k_live values per row
        (``dense_coef`` flop each), the sparse path ``sparse_coef`` flop per
        nonzero; the terms are the two fitted lines."""
        kern = _loader.kernels()
        dense_coef, sparse_coef = _coefficients(coefficients, n)
        if nnz is not None and (nnz < 0 or not math.isfinite(nnz)):
            raise ValueError(f"nnz must be finite and >= 0, got {nnz}")
        rows, nnz_b = kern.profile_from_histogram(
            hist, 1, -1.0 if nnz is None else float(nnz))
        if nnz is None:
            nnz_b = nnz_b * float(k)   # bin centers times k
        m_rows = int(math.ceil(float(hist.sum())))
        shape = {"m": m_rows, "k": 1, "k_live": 1, "can_compact": False,
                 "dense_flops_per_elem": float(k_live) * dense_coef,
                 "sparse_flops_per_nnz": sparse_coef}
        terms = {"heterogeneous": bool(heterogeneous)}
        for path, fixed_key, rate_key in ((DENSE, "dense_fixed_s", "dense_rate"),
                                          (SPARSE, "sparse_fixed_s", "sparse_rate")):
            fit = self._fits[path]
            terms[fixed_key] = float(fit.overhead)
            terms[rate_key] = _HUGE_RATE if math.isinf(fit.rate) else float(fit.rate)
        return kern, shape, (rows, nnz_b), terms

    def predicted_time(self, histogram, m, k, k_live, n, threshold,
                       nnz=None, heterogeneous=False, coefficients=None):
        """Predicted seconds of one call at ``threshold`` (the ops' cost
        model, ``_kernels.predict_plan_seconds``).

        Rows in density bins whose upper edge is <= ``threshold`` go sparse
        with ``nnz ~= bin_center_density * k`` each; the other rows go dense
        over ``k_live`` columns. When the call's total ``nnz`` is given, the
        bin-center estimates are scaled so that they add up to it (the
        centers alone overestimate very sparse rows: a row of density 0.01
        sits in bin 0, whose center is 1/32). ``m`` is accepted for symmetry
        with the statistics (the rows are those counted in ``histogram``).
        The two paths' times are added, or with ``heterogeneous=True`` (they
        run concurrently on two devices) their maximum is taken.

        Raises:
          RuntimeError: if either path is not fitted.
          ValueError: on inconsistent sizes.
        """
        hist = self._check_problem(histogram, m, k, k_live, n)
        if DENSE not in self._fits or SPARSE not in self._fits:
            raise RuntimeError(
                "both paths must be fitted to predict a split (have: "
                f"{sorted(self._fits)})")
        kern, shape, profile, terms = self._problem(
            hist, k, k_live, n, nnz, heterogeneous, coefficients)
        bucket = int(math.floor(float(threshold) * hist.size + 1e-9))
        bucket = min(max(bucket, 0), hist.size)
        return float(kern.predict_plan_seconds(shape, profile, terms, bucket))

    def best_threshold(self, histogram, m, k, k_live, n, nnz=None,
                       heterogeneous=False, coefficients=None,
                       policy=DEFAULT_POLICY):
        """The threshold the ops' cost model chooses
        (``_kernels.decide_split``) among the density-bin edges.

        Args:
          histogram: rows per row-density bin for one call (the
            ``stats.HISTOGRAM`` slice; an average over calls, fractional, is
            fine).
          m: rows of the activation operand in one call.
          k: its columns (K).
          k_live: K minus the all-zero columns the op skips.
          n: columns of the weight operand (N).
          nnz: optional nonzeros of the activation operand in one call; when
            given, the per-bin nonzero estimates are scaled to add up to it
            (see :meth:`predicted_time`).
          heterogeneous: if True, the dense path (GPU) and the sparse path
            (CPU) run concurrently: a threshold's predicted time is
            ``max(T_dense, T_sparse)`` instead of ``T_dense + T_sparse``.
          coefficients: optional ``(dense_coef, sparse_coef)`` as in
            :meth:`add_stats` (default ``(2 n, 2 n)``, a matmul's).
          policy: the decision margins: :data:`DEFAULT_POLICY` (the ops'),
            :data:`ARGMIN_POLICY` (none), or a dict of ``enter_margin``,
            ``stay_margin``, ``switch_margin``, ``tie_margin`` (fractions)
            and ``min_gain_s`` (seconds).

        Returns:
          a threshold in ``candidate_thresholds()`` as a Python float: 0.0
          when all-dense is chosen (rows with any nonzero go dense); or
          **None** when only one path (or no path) has been fitted: with no
          measurement of the other path there is nothing to compare, and the
          caller should keep its current threshold.

        Raises:
          ValueError: on inconsistent sizes, a bad histogram or policy.
        """
        hist = self._check_problem(histogram, m, k, k_live, n)
        if DENSE not in self._fits or SPARSE not in self._fits:
            return None
        kern, shape, profile, terms = self._problem(
            hist, k, k_live, n, nnz, heterogeneous, coefficients)
        plan = kern.decide_split(shape, profile, terms, None, policy)
        return float(plan["threshold"])

    def summary(self):
        """dict: ``{path: {"overhead_s", "rate_flops", "samples"}}``."""
        return {
            p: {"overhead_s": f.overhead, "rate_flops": f.rate,
                "samples": f.num_samples}
            for p, f in self._fits.items()
        }
