#!/usr/bin/env bash
# Builds the standalone CUDA harness (tests + benchmark of the kernels in
# cc/core/cuda/, against a CPU float64 reference and cuBLAS) for Hopper
# (sm_90) and runs it.
#
#   bash cc/tests/cuda/run_harness.sh [--tests-only|--bench-only] [--quick]
#
# Exit status:
#   0  the harness ran and every test passed; or, when no GPU is visible at
#      all (nvidia-smi absent or listing none, AND the harness reports
#      "no CUDA device"), 'no GPU: built only' -- unless TFSS_REQUIRE_GPU=1.
#   1  nvcc missing, build failed, a test failed, the run timed out, or a GPU
#      is listed by nvidia-smi but the harness cannot use it (exit 77 from the
#      harness after nvidia-smi listed a device, or a CUDA runtime error such
#      as a driver too old for the runtime).
# Environment: NVCC, CUBLAS_ROOT (see find_cuda.sh), TFSS_HARNESS_BUILD_DIR
# (default: a fresh temporary directory), TFSS_HARNESS_TIMEOUT (seconds, 540),
# TFSS_REQUIRE_CUBLAS=1 to fail instead of building without the baseline,
# TFSS_REQUIRE_GPU=1 to fail when no GPU is found, TFSS_HARNESS_BIN to run an
# already built harness instead of building one (used by the tests of this
# script). On an H200 the whole run takes a few minutes (the CPU float64
# references of the large shapes dominate).
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=find_cuda.sh
source "${here}/find_cuda.sh"

if [[ -n "${TFSS_HARNESS_BIN:-}" ]]; then
  bin="${TFSS_HARNESS_BIN}"
  echo "using the prebuilt harness ${bin}"
else
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
fi

gpu_listed=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q 'GPU'; then
  gpu_listed=1
  nvidia-smi -L
  nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null |
    sed 's/^/driver: /' | head -n 1
fi

# The harness runs even when nvidia-smi is absent (some containers lack it):
# only its own "no CUDA device" (77) decides "built only", and only when
# nvidia-smi did not list a GPU.
timeout "${TFSS_HARNESS_TIMEOUT:-540}" "${bin}" "$@"
rc=$?
case ${rc} in
  0) echo "run_harness.sh: all CUDA harness tests passed" ;;
  77)
    if [[ ${gpu_listed} == 1 ]]; then
      echo "run_harness.sh: FAILED: nvidia-smi lists a GPU but the CUDA runtime found no" \
           "usable device (driver/runtime mismatch, CUDA_VISIBLE_DEVICES, permissions?)" >&2
      exit 1
    fi
    if [[ "${TFSS_REQUIRE_GPU:-0}" == 1 ]]; then
      echo "run_harness.sh: FAILED: no GPU (TFSS_REQUIRE_GPU=1)" >&2
      exit 1
    fi
    echo "no GPU: built only (${bin}); no test ran"
    exit 0 ;;
  124) echo "run_harness.sh: harness TIMED OUT" >&2 ;;
  *) echo "run_harness.sh: harness FAILED (exit ${rc})" >&2 ;;
esac
exit ${rc}
