#!/usr/bin/env bash
# Builds the standalone CUDA harness (tests + benchmark of the kernels in
# cc/core/cuda/, against a CPU float64 reference and cuBLAS) for Hopper
# (sm_90) and runs it.
#
#   bash cc/tests/cuda/run_harness.sh [--tests-only|--bench-only] [--quick]
#
# Exit status: 1 if nvcc is missing, the build fails, a test fails or the run
# times out; 0 with 'no GPU: built only' when it builds but no GPU is present.
# Environment: NVCC, CUBLAS_ROOT (see find_cuda.sh), TFSS_HARNESS_BUILD_DIR
# (default: a fresh temporary directory), TFSS_HARNESS_TIMEOUT (seconds, 540),
# TFSS_REQUIRE_CUBLAS=1 to fail instead of building without the baseline.
# On an H200 the whole run takes well under 10 minutes (the CPU float64
# references of the two large shapes dominate).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=find_cuda.sh
source "${here}/find_cuda.sh"

if ! tfss_find_nvcc; then
  echo "run_harness.sh: nvcc not found (looked at \$NVCC, PATH, /usr/local/cuda/bin/nvcc);" \
       "cannot build the CUDA harness" >&2
  exit 1
fi
echo "nvcc: ${TFSS_NVCC} ($("${TFSS_NVCC}" --version | grep -o 'release [0-9.]*' | head -n 1))"

build="${TFSS_HARNESS_BUILD_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/tfss_cuda_harness.XXXXXX")}"
mkdir -p "${build}"

if tfss_find_cublas "${build}"; then
  echo "cuBLAS: ${TFSS_CUBLAS_WHERE}"
else
  if [[ "${TFSS_REQUIRE_CUBLAS:-0}" == 1 ]]; then
    echo "run_harness.sh: cuBLAS (cublas_v2.h + libcublas) not found; set CUBLAS_ROOT" >&2
    exit 1
  fi
  echo "WARNING: cuBLAS not found (set CUBLAS_ROOT); building without the cuBLAS baseline"
fi

start=${SECONDS}
if ! tfss_build_harness "${build}" -gencode arch=compute_90,code=sm_90; then
  echo "run_harness.sh: build FAILED" >&2
  exit 1
fi
bin="${build}/tfss_cuda_harness"
echo "built ${bin} in $((SECONDS - start)) s"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no GPU: built only (${bin}); nvidia-smi absent or found no device"
  exit 0
fi
nvidia-smi -L

timeout "${TFSS_HARNESS_TIMEOUT:-540}" "${bin}" "$@"
rc=$?
case ${rc} in
  0) echo "run_harness.sh: all CUDA harness tests passed" ;;
  77) echo "no GPU: built only (${bin}); the CUDA runtime found no usable device"; exit 0 ;;
  124) echo "run_harness.sh: harness TIMED OUT" >&2 ;;
  *) echo "run_harness.sh: harness FAILED (exit ${rc})" >&2 ;;
esac
exit ${rc}
