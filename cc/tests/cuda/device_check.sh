#!/usr/bin/env bash
# One-shot device check for a machine with an NVIDIA GPU (written for an
# H200, sm_90; about 3-8 minutes): builds the standalone CUDA harness once,
# runs its tests (every kernel in float32, float64, bfloat16 and float16 vs
# a CPU float64 reference, the epilogue, and the cuBLAS + CSR split), then its
# benchmark (SpMM, SpMM^T, SDDMM and the transposed CSR fill vs cuBLAS SGEMM
# with FP32 math and with TF32 tensor cores, at 0/50/90/99/100% sparsity;
# the bfloat16 SpMM and SDDMM vs cublasGemmEx in bfloat16; achieved
# bandwidth vs a device-to-device memcpy), then -- only where a CUDA
# TensorFlow with this package's GPU kernels is importable -- the GPU pytest
# tests. Prints a compact summary at the end.
#
#   bash cc/tests/cuda/device_check.sh
#
# Exit status: nonzero if anything fails: no GPU, no cuBLAS, build, any test
# case, a CUDA error, a timeout, or (when they run) the GPU pytest tests.
# Logs go to $OUT (if set, e.g. by the device runner) or a temporary
# directory: harness_tests.log, harness_bench.log, pytest_gpu.log.
# Environment: TFSS_DEVICE_PYTHON (python for the pytest step; default
# python3), NVCC/CUBLAS_ROOT as in find_cuda.sh.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../../.." && pwd)"
logs="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/tfss_device_check.XXXXXX")}"
mkdir -p "${logs}"
build="$(mktemp -d "${TMPDIR:-/tmp}/tfss_device_build.XXXXXX")"
t0=${SECONDS}
status=0
summary=()
note() { summary+=("$*"); echo "== $*"; }

# 1. Build + tests (the build is kept for the benchmark).
TFSS_REQUIRE_GPU=1 TFSS_REQUIRE_CUBLAS=1 TFSS_HARNESS_BUILD_DIR="${build}" \
  TFSS_HARNESS_TIMEOUT=330 \
  bash "${here}/run_harness.sh" --tests-only 2>&1 | tee "${logs}/harness_tests.log"
rc=${PIPESTATUS[0]}
tests_line="$(grep -E '^[0-9]+ passed, [0-9]+ failed' "${logs}/harness_tests.log" | tail -n 1)"
if [[ ${rc} != 0 ]]; then
  status=1
  note "harness tests: FAILED (exit ${rc}) ${tests_line}"
else
  note "harness tests: ok, ${tests_line}"
fi

# 2. Benchmark with the same binary.
bin="${build}/tfss_cuda_harness"
if [[ -x "${bin}" ]]; then
  TFSS_REQUIRE_GPU=1 TFSS_HARNESS_BIN="${bin}" TFSS_HARNESS_TIMEOUT=200 \
    bash "${here}/run_harness.sh" --bench-only 2>&1 | tee "${logs}/harness_bench.log"
  rc=${PIPESTATUS[0]}
  if [[ ${rc} != 0 ]]; then
    status=1
    note "harness benchmark: FAILED (exit ${rc})"
  else
    note "harness benchmark: ok"
  fi
else
  status=1
  note "harness benchmark: not run (no binary)"
fi

# 3. GPU pytest tests, where a CUDA TensorFlow and our GPU kernels exist.
py="${TFSS_DEVICE_PYTHON:-python3}"
if "${py}" - <<'PYEOF' >/dev/null 2>&1
import tensorflow as tf
import tf_sparse_split as tfss
assert tf.config.list_physical_devices("GPU")
tfss.load_library()
PYEOF
then
  (cd "${root}" && timeout 240 "${py}" -m pytest -q -rs tests/test_heterogeneous.py \
     tests/test_gpu_low_precision.py -k "gpu or GPU" 2>&1) | tee "${logs}/pytest_gpu.log"
  rc=${PIPESTATUS[0]}
  if [[ ${rc} != 0 ]]; then
    status=1
    note "GPU pytest: FAILED (exit ${rc}) $(tail -n 1 "${logs}/pytest_gpu.log")"
  else
    note "GPU pytest: ok, $(tail -n 1 "${logs}/pytest_gpu.log")"
  fi
else
  note "GPU pytest: skipped (no CUDA TensorFlow with a GPU and tf_sparse_split for ${py})"
fi

# Compact summary.
echo
echo "================ device check summary ($((SECONDS - t0)) s) ================"
grep -E '^device 0:|^driver:' "${logs}/harness_tests.log" | head -n 2
for line in "${summary[@]}"; do echo "${line}"; done
grep -E '^(FAIL|    FAIL)' "${logs}/harness_tests.log" | head -n 20
if [[ -s "${logs}/harness_bench.log" ]]; then
  echo
  echo "Benchmark at 90% and 99% sparsity (x FP32 / x TF32 / x GEMM > 1: ours faster):"
  grep -E '^## Benchmark|^\| shape|^\|---|^\| [0-9]+x[0-9]+x[0-9]+ \| 0\.(90|99) \|' \
    "${logs}/harness_bench.log"
fi
echo "logs: ${logs}"
if [[ ${status} != 0 ]]; then
  echo "DEVICE CHECK FAILED"
else
  echo "DEVICE CHECK PASSED"
fi
exit ${status}
