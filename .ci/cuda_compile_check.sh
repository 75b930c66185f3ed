#!/usr/bin/env bash
# CUDA compile check (no GPU needed), all in a temporary directory:
#  1. compiles every cc/**/*.cu.cc with nvcc (-x cu -c) for Hopper SASS
#     (-gencode arch=compute_90,code=sm_90) and a portable PTX target
#     (-gencode arch=compute_80,code=compute_80) and checks that each object
#     is not empty (the GOOGLE_CUDA/__CUDACC__ guard must not hide the code
#     from nvcc);
#  2. checks that the kernels file and its header are harmless to a plain C++
#     compiler;
#  3. compiles the GPU OpKernel (cc/kernels/*_gpu.cc) with g++ -c
#     -DGOOGLE_CUDA=1, TensorFlow's compile flags and the CUDA runtime headers,
#     as a CUDA build of the op library compiles it (the CPU-only TensorFlow
#     cannot build it into the library), checks that the guard does not hide
#     the kernel class, and that every symbol it needs is defined by
#     libtensorflow_framework, the CUDA runtime, the C/C++ runtimes or our
#     nvcc objects (so the library would load on a GPU machine);
#  4. links the standalone harness (with cuBLAS and an rpath where found).
#
#   bash .ci/cuda_compile_check.sh               # 1-4
#   bash .ci/cuda_compile_check.sh --gpu-op-only # 3 only (after pip install;
#                                                # builds the cc/core nvcc objects)
#
# Step 3 needs a python with TensorFlow: TFSS_PYTHON, else python3. Without
# one it prints a note and skips step 3, unless TFSS_REQUIRE_GPU_OP_CHECK=1
# (then it fails). Exits nonzero if anything fails; where no nvcc exists it
# prints 'CUDA compile check skipped: nvcc not found' and exits 0.
# About 1 minute on a 2-core machine.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=../cc/tests/cuda/find_cuda.sh
source "${root}/cc/tests/cuda/find_cuda.sh"

gpu_op_only=0
for arg in "$@"; do
  case "${arg}" in
    --gpu-op-only) gpu_op_only=1 ;;
    *) echo "usage: $0 [--gpu-op-only]" >&2; exit 2 ;;
  esac
done

if ! tfss_find_nvcc; then
  echo "CUDA compile check skipped: nvcc not found"
  exit 0
fi

start=${SECONDS}
tmp="$(mktemp -d "${TMPDIR:-/tmp}/tfss_cuda_check.XXXXXX")"
trap 'rm -rf "${tmp}"' EXIT
echo "nvcc: ${TFSS_NVCC} ($("${TFSS_NVCC}" --version | grep -o 'release [0-9.]*' | head -n 1))"
# nvcc's own include directory, as its driver reports it.
cuda_inc="$("${TFSS_NVCC}" --dryrun -x cu -c /dev/null 2>&1 |
            sed -n 's/.*INCLUDES="-I\([^" ]*\).*/\1/p' | head -n 1)"
failed=0

# Step 3 (see the header). $@: the nvcc objects of cc/core/cuda (they define
# the CUDA entry points the op calls). Sets gpu_op_note; returns 1 on failure.
check_gpu_ops() {
  local py="${TFSS_PYTHON:-python3}" tf_flags tf_lib
  if ! command -v g++ >/dev/null 2>&1; then
    gpu_op_note="GPU op file NOT checked (no g++)"
  elif ! tf_flags="$("${py}" -c 'import tensorflow as tf; print(" ".join(tf.sysconfig.get_compile_flags()))' 2>/dev/null)" ||
       [[ -z "${tf_flags}" ]]; then
    gpu_op_note="GPU op file NOT checked (no TensorFlow for ${py}; set TFSS_PYTHON)"
  else
    tf_lib="$("${py}" -c 'import glob, os, tensorflow as tf; d = tf.sysconfig.get_lib(); print((glob.glob(os.path.join(d, "libtensorflow_framework.so*")) or [""])[0])' 2>/dev/null)"
    local gpu_ops src rc=0
    mapfile -t gpu_ops < <(cd "${root}" && find cc/kernels -name '*_gpu.cc' -type f | LC_ALL=C sort)
    if [[ ${#gpu_ops[@]} == 0 ]]; then
      echo "FAILED: no cc/kernels/*_gpu.cc found"
      return 1
    fi
    # Symbols the op library may take from elsewhere: TensorFlow's framework
    # library (all a custom op links against), the CUDA runtime, the C/C++
    # runtimes, and our nvcc objects.
    local provided="${tmp}/provided_symbols.txt" lib
    {
      for lib in "${tf_lib}" $(for d in $(tfss_nvcc_lib_dirs); do echo "${d}/libcudart.so"; done) \
                 "$(g++ -print-file-name=libstdc++.so.6)" "$(g++ -print-file-name=libc.so.6)" \
                 "$(g++ -print-file-name=libm.so.6)" "$(g++ -print-file-name=libgcc_s.so.1)"; do
        [[ -f "${lib}" ]] && nm -D --defined-only "${lib}" 2>/dev/null | awk '{print $3}'
      done
      for lib in "$@"; do nm --defined-only "${lib}" 2>/dev/null | awk '{print $3}'; done
      echo _GLOBAL_OFFSET_TABLE_; echo __dso_handle  # from the linker / crtbegin
    } | sed 's/@.*//' | LC_ALL=C sort -u > "${provided}"
    for src in "${gpu_ops[@]}"; do
      # shellcheck disable=SC2206  # tf_flags is a list of flags
      local flags=(-std=c++17 -DGOOGLE_CUDA=1 ${tf_flags} -I"${root}" -I"${cuda_inc}" -x c++)
      local obj="${tmp}/$(basename "${src}").o"
      echo "+ g++ -c -O0 -fPIC -Wall -Werror ${flags[*]} ${src}"
      if ! g++ -c -O0 -fPIC -Wall -Werror -Wno-deprecated-declarations -Wno-interference-size \
           -Wno-sign-compare "${flags[@]}" "${root}/${src}" -o "${obj}" > "${tmp}/gpu_op.log" 2>&1; then
        grep -v -e '^In file included' -e '^ *from ' "${tmp}/gpu_op.log" | head -n 60
        echo "FAILED: ${src} does not compile with -DGOOGLE_CUDA=1"
        rc=1
        continue
      fi
      if ! g++ -E -P "${flags[@]}" "${root}/${src}" 2>/dev/null |
           grep 'class SparseSplit[A-Za-z0-9]*GpuOp' >/dev/null; then
        echo "FAILED: ${src}: no *GpuOp class visible with -DGOOGLE_CUDA=1 (guard?)"
        rc=1
      fi
      # Every undefined symbol must come from the list above (a TF symbol
      # that only exists outside libtensorflow_framework would make the op
      # library fail to load on a GPU machine). Our own non-CUDA
      # tf_sparse_split symbols are defined by the op library's other files.
      if [[ -n "${tf_lib}" ]]; then
        local missing
        # (CUDA entry points are named *Gpu / *WorkspaceBytes; any other
        # tf_sparse_split symbol is left to the op library's CPU objects.)
        missing="$(nm -u "${obj}" | awk '{print $2}' | sed 's/@.*//' | LC_ALL=C sort -u |
                   LC_ALL=C comm -23 - "${provided}" | c++filt |
                   grep -v -E '^([a-zA-Z_:]+ )?tf_sparse_split::[A-Za-z_:]*\b' |
                   grep -v '^$' || true)"
        missing+="$(nm -u "${obj}" | awk '{print $2}' | sed 's/@.*//' | LC_ALL=C sort -u |
                    LC_ALL=C comm -23 - "${provided}" | c++filt |
                    grep -E 'tf_sparse_split::[A-Za-z_]*(Gpu|WorkspaceBytes)\b' || true)"
        if [[ -n "${missing}" ]]; then
          echo "FAILED: ${src} needs symbols that neither ${tf_lib##*/}, the CUDA runtime," \
               "the C/C++ runtime nor our CUDA objects define:"
          echo "${missing}" | head -n 30
          rc=1
        fi
      else
        echo "note: libtensorflow_framework not found; undefined-symbol check skipped"
      fi
    done
    gpu_op_note="${#gpu_ops[@]} GPU op file(s) compiled with -DGOOGLE_CUDA=1, symbols checked"
    return ${rc}
  fi
  echo "note: ${gpu_op_note}"
  [[ "${TFSS_REQUIRE_GPU_OP_CHECK:-0}" == 1 ]] && return 1
  return 0
}

if [[ ${gpu_op_only} == 1 ]]; then
  # The CUDA entry points the op calls, for the symbol check (sm_90 only).
  core_objs=()
  while read -r src; do
    obj="${tmp}/$(echo "${src}" | tr '/' '_').o"
    echo "+ nvcc -x cu -c ${src} (sm_90)"
    if ! "${TFSS_NVCC}" -std=c++17 -O1 -gencode arch=compute_90,code=sm_90 -I"${root}" \
         -x cu -c "${root}/${src}" -o "${obj}"; then
      echo "FAILED: ${src}"; failed=1
    fi
    core_objs+=("${obj}")
  done < <(cd "${root}" && find cc/core -name '*.cu.cc' -type f | LC_ALL=C sort)
  check_gpu_ops "${core_objs[@]}" || failed=1
  if [[ ${failed} != 0 ]]; then
    echo "GPU op check FAILED ($((SECONDS - start)) s)"
    exit 1
  fi
  echo "GPU op check passed: ${gpu_op_note} ($((SECONDS - start)) s)"
  exit 0
fi

mapfile -t srcs < <(cd "${root}" && find cc -name '*.cu.cc' -type f | LC_ALL=C sort)
if [[ ${#srcs[@]} == 0 ]]; then
  echo "CUDA compile check FAILED: no cc/**/*.cu.cc files found"
  exit 1
fi

if tfss_find_cublas "${tmp}"; then
  echo "cuBLAS: ${TFSS_CUBLAS_WHERE}"
  harness_defs=()
else
  echo "note: cuBLAS not found (set CUBLAS_ROOT); the harness is compiled and linked with" \
       "-DTFSS_HARNESS_NO_CUBLAS (its cuBLAS baseline code is not checked)"
  harness_defs=(-DTFSS_HARNESS_NO_CUBLAS)
fi

gencode=(-gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=compute_80)
jobs="$(nproc 2>/dev/null || echo 2)"
declare -a objs=()

# One nvcc per file (both targets in one object); up to $jobs files at once.
compile() {  # $1 = source relative to root, $2 = object
  local extra=()
  [[ "$1" == cc/tests/cuda/* ]] && extra=("${TFSS_CUBLAS_CFLAGS[@]}" "${harness_defs[@]}")
  local cmd=("${TFSS_NVCC}" -std=c++17 -O3 "${gencode[@]}" "${extra[@]}" -I"${root}"
             -x cu -c "${root}/$1" -o "$2")
  echo "+ ${cmd[*]}"
  if ! "${cmd[@]}" > "$2.log" 2>&1; then
    echo "FAILED: $1"
    cat "$2.log"
    return 1
  fi
  [[ -s "$2.log" ]] && cat "$2.log"  # warnings
  # (grep without -q: an early exit would SIGPIPE nm and fail under pipefail)
  if ! nm --defined-only "$2" 2>/dev/null | grep ' [TW] ' >/dev/null; then
    echo "FAILED: $1 compiled to an object with no code (guard hid it from nvcc?)"
    return 1
  fi
  return 0
}

declare -a pids=()
for src in "${srcs[@]}"; do
  obj="${tmp}/$(echo "${src}" | tr '/' '_').o"
  objs+=("${obj}")
  compile "${src}" "${obj}" &
  pids+=($!)
  while (( $(jobs -rp | wc -l) >= jobs )); do wait -n || true; done
done

# Without a real cuBLAS the harness's baseline code is still compiled (not
# linked) against a declarations-only stub of cublas_v2.h.
cublas_note="cuBLAS code linked against ${TFSS_CUBLAS_WHERE:-?}"
if [[ "${TFSS_HAVE_CUBLAS}" != 1 ]]; then
  stub=("${TFSS_NVCC}" -std=c++17 -O3 -gencode arch=compute_90,code=sm_90
        -I"${root}/cc/tests/cuda/cublas_stub" -I"${root}" -x cu -c
        "${root}/cc/tests/cuda/harness.cu.cc" -o "${tmp}/harness_cublas_stub.o")
  echo "+ ${stub[*]}"
  if ! "${stub[@]}"; then
    echo "FAILED: the harness's cuBLAS code does not compile (against the stub header)"
    failed=1
  fi
  cublas_note="cuBLAS code compiled against the stub header only"
fi

for pid in "${pids[@]}"; do
  if ! wait "${pid}"; then failed=1; fi
done

# Step 3, against the nvcc objects of cc/core just built.
core_objs=()
for src in "${srcs[@]}"; do
  [[ "${src}" == cc/core/* ]] && core_objs+=("${tmp}/$(echo "${src}" | tr '/' '_').o")
done
check_gpu_ops "${core_objs[@]}" || failed=1

# A plain C++ compiler must see the kernels file as an empty unit and accept
# the header (it only needs the CUDA runtime headers).
if command -v g++ >/dev/null 2>&1; then
  for src in "${srcs[@]}"; do
    [[ "${src}" == cc/core/* ]] || continue
    if ! g++ -std=c++17 -fsyntax-only -x c++ "${root}/${src}"; then
      echo "FAILED: g++ does not accept ${src} as an (empty) C++ unit"; failed=1
    fi
  done
  for hdr in "${root}"/cc/core/cuda/*.h; do
    if ! g++ -std=c++17 -fsyntax-only -I"${cuda_inc}" -x c++ "${hdr}"; then
      echo "FAILED: g++ cannot compile ${hdr#"${root}"/} as plain C++"; failed=1
    fi
  done
fi

# Link the harness from the objects just built (both targets embedded).
if [[ ${failed} == 0 ]]; then
  link=("${TFSS_NVCC}" "${gencode[@]}" "${tmp}/cc_tests_cuda_harness.cu.cc.o"
        "${tmp}/cc_core_cuda_sparse_matmul.cu.cc.o" "${tmp}/cc_core_cuda_epilogue.cu.cc.o"
        -o "${tmp}/tfss_cuda_harness"
        "${TFSS_CUBLAS_LDFLAGS[@]}")
  echo "+ ${link[*]}"
  if ! "${link[@]}"; then
    echo "FAILED: linking the harness"; failed=1
  fi
fi

elapsed=$((SECONDS - start))
if [[ ${failed} != 0 ]]; then
  echo "CUDA compile check FAILED (${elapsed} s)"
  exit 1
fi
echo "CUDA compile check passed: ${#srcs[@]} file(s) for sm_90 + compute_80 PTX, harness" \
     "linked; ${cublas_note}; ${gpu_op_note} (${elapsed} s)"
exit 0
