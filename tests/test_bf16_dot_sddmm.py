"""The bfloat16 SDDMM's ``vdpbf16ps`` dots (AVX512_BF16).

Where ``_kernels.bf16_dot_available()`` is true, ``CsrSddmm`` in bfloat16
runs its dots on the bfloat16 rows as stored (``cc/core/sddmm.cc``,
``CsrSddmmBf16Dot``): each lane adds the products of a pair of values, the
odd one first, each rounded once, and the lanes are summed by a fixed tree.
The contract: within float32 accumulation of the dot's products plus one
bfloat16 rounding of a float64 reference, the same bits whatever the thread
count, and denormal inputs, products and partial sums flushed to zero
(``vdpbf16ps``'s DAZ/FTZ). With the instruction set forced below AVX-512
(``isa=0|1``) the float32 FMA dots run (identical bits on both).
Tests of the kernel itself skip on CPUs without AVX512_BF16.
"""

import numpy as np
import pytest

from test_bf16_dot_spmm import (_bits, _values, dot_kernels,  # noqa: F401
                                needs_dot)
from tf_sparse_split.testing import random_sparse

pytestmark = pytest.mark.usefixtures("op_library")

U_BF16 = 2.0 ** -8
U_F32 = 2.0 ** -24


def _kernels():
    from tf_sparse_split import _kernels as k
    return k


def _sddmm(mask, x, y, isa=-1, threads=0):
    return _kernels().lowp_sddmm(mask, x, y, "bfloat16", isa=isa,
                                 threads=threads)


@needs_dot
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 33), (33, 70, 64),
                                   (5, 300, 100), (40, 257, 2048),
                                   (130, 31, 96)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_dot_sddmm_matches_float64(shape, sparsity):
    m, k, n = shape
    rng = np.random.default_rng(m * 131 + k * 7 + n + int(sparsity * 100))
    mask = _bits(random_sparse((m, k), sparsity, rng))
    x = _bits(rng.standard_normal((m, n)) * 3.0)
    y = _bits(rng.standard_normal((k, n)))
    got = _sddmm(mask, x, y)
    assert got.dtype == np.uint16 and got.shape == (m, k)
    x64, y64 = _values(x), _values(y)
    live = _values(mask) != 0
    ref = np.where(live, x64 @ y64.T, 0.0)
    gamma = n * U_F32 / (1.0 - n * U_F32)
    tol = 2.0 * (U_BF16 * np.abs(ref) + gamma * (np.abs(x64) @ np.abs(y64).T))
    g = _values(got)
    assert np.all(np.abs(g - ref) <= tol + 1e-300)
    assert not g[~live].any()
    # one and two threads: the same bits
    np.testing.assert_array_equal(_sddmm(mask, x, y, threads=1), got)
    np.testing.assert_array_equal(_sddmm(mask, x, y, threads=2), got)
    # the FMA dots (forced lower instruction sets) meet the same bound
    for isa in (0, 1):
        f = _values(_sddmm(mask, x, y, isa=isa))
        assert np.all(np.abs(f - ref) <= tol + 1e-300)


@needs_dot
def test_dot_sddmm_nan_inf_and_denormals():
    """NaN/Inf in x or y propagate into the dots that read them (not into
    masked-out entries); denormal products are flushed to zero."""
    m, k, n = 4, 5, 40
    mask = np.ones((m, k))
    mask[3, 4] = 0.0
    x = np.ones((m, n))
    y = np.ones((k, n))
    x[0, 7] = np.inf
    y[1, 39] = np.nan
    x[3, :] = np.inf            # row 3 meets column 4 only where masked out
    y[4, :] = 0.0
    mask[3, :4] = 0.0
    x[2, :] = 2.0 ** -70
    y[2, :] = 2.0 ** -60        # x[2] . y[2]: denormal products
    got = _values(_sddmm(_bits(mask), _bits(x), _bits(y)))
    assert np.isposinf(got[0, 0]) and np.isnan(got[0, 1])
    assert np.isnan(got[:3, 1]).all()
    assert got[1, 0] == n
    assert got[2, 2] == 0.0
    assert not got[3].any()
    fma = _values(_sddmm(_bits(mask), _bits(x), _bits(y), isa=0))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(fma))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(fma))
