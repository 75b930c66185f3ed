# Shared by cc/tests/cuda/run_harness.sh and .ci/cuda_compile_check.sh; source
# it (bash), do not run it. Finds nvcc and cuBLAS and builds the CUDA harness.
#
# Environment overrides:
#   NVCC         path of nvcc (else PATH, then /usr/local/cuda/bin/nvcc)
#   CUBLAS_ROOT  a directory with include/cublas_v2.h and lib/ or lib64/
#                holding libcublas.so[.N] (else the nvcc toolkit, then the
#                nvidia-cublas Python wheel of python3, if any)

# Sets TFSS_NVCC; returns 1 if no nvcc is found.
tfss_find_nvcc() {
  TFSS_NVCC=""
  if [[ -n "${NVCC:-}" && -x "${NVCC}" ]]; then
    TFSS_NVCC="${NVCC}"
  elif command -v nvcc >/dev/null 2>&1; then
    TFSS_NVCC="$(command -v nvcc)"
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    TFSS_NVCC=/usr/local/cuda/bin/nvcc
  fi
  [[ -n "${TFSS_NVCC}" ]]
}

# nvcc's library directories (as its driver reports them, so that wrapper
# scripts and symlinks resolve), one per line, stubs excluded.
tfss_nvcc_lib_dirs() {
  "${TFSS_NVCC}" --dryrun -x cu -c /dev/null 2>&1 |
    sed -n 's/.*LIBRARIES=//p' | head -n 1 | tr ' ' '\n' |
    sed -n 's/^"*-L\([^"]*\)"*$/\1/p' | grep -v '/stubs$'
}

# Can nvcc compile `#include <cublas_v2.h>` with the given flags?
_tfss_cublas_header_ok() {
  local dir="$1"; shift
  printf '#include <cublas_v2.h>\nint main() { return 0; }\n' > "${dir}/cublas_probe.cu"
  "${TFSS_NVCC}" -E "$@" "${dir}/cublas_probe.cu" -o /dev/null >/dev/null 2>&1
}

# Candidate CUBLAS_ROOT-like directories from the environment and python3.
_tfss_cublas_roots() {
  [[ -n "${CUBLAS_ROOT:-}" ]] && echo "${CUBLAS_ROOT}"
  if command -v python3 >/dev/null 2>&1; then
    python3 - <<'EOF' 2>/dev/null
import importlib.util, os
spec = importlib.util.find_spec("nvidia")
for base in (list(spec.submodule_search_locations) if spec else []):
    for sub in ("cu13", "cublas", "cu12"):
        d = os.path.join(base, sub)
        if os.path.isfile(os.path.join(d, "include", "cublas_v2.h")):
            print(d)
EOF
  fi
}

# Sets TFSS_HAVE_CUBLAS (1/0), TFSS_CUBLAS_CFLAGS and TFSS_CUBLAS_LDFLAGS (arrays).
# $1: a scratch/build directory (a link dir is made there when only a
# versioned libcublas.so.N exists).
tfss_find_cublas() {
  local build="$1"
  TFSS_HAVE_CUBLAS=0
  TFSS_CUBLAS_CFLAGS=()
  TFSS_CUBLAS_LDFLAGS=()
  local root
  while read -r root; do
    [[ -z "${root}" ]] && continue
    local lib=""
    for l in "${root}/lib64" "${root}/lib"; do
      if compgen -G "${l}/libcublas.so*" >/dev/null; then lib="${l}"; break; fi
    done
    [[ -z "${lib}" ]] && continue
    _tfss_cublas_header_ok "${build}" -I"${root}/include" || continue
    local linkdir="${lib}"
    if [[ ! -e "${lib}/libcublas.so" ]]; then
      linkdir="${build}/cublas_link"
      mkdir -p "${linkdir}"
      local so
      so="$(ls "${lib}"/libcublas.so.* 2>/dev/null | grep -E 'libcublas\.so\.[0-9]+$' | head -n 1)"
      [[ -z "${so}" ]] && continue
      ln -sf "${so}" "${linkdir}/libcublas.so"
    fi
    TFSS_CUBLAS_CFLAGS=(-I"${root}/include")
    TFSS_CUBLAS_LDFLAGS=(-L"${linkdir}" -Xlinker -rpath,"${lib}" -lcublas)
    TFSS_HAVE_CUBLAS=1
    TFSS_CUBLAS_WHERE="${root}"
    return 0
  done < <(_tfss_cublas_roots)
  # The toolkit nvcc belongs to (its default include and library paths),
  # with an rpath to its library directory so that the binary finds
  # libcublas without LD_LIBRARY_PATH.
  if _tfss_cublas_header_ok "${build}"; then
    local lib_dirs=() d
    for d in $(tfss_nvcc_lib_dirs); do
      compgen -G "${d}/libcublas.so*" >/dev/null && lib_dirs+=(-Xlinker -rpath,"${d}")
    done
    TFSS_CUBLAS_LDFLAGS=("${lib_dirs[@]}" -lcublas)
    TFSS_HAVE_CUBLAS=1
    TFSS_CUBLAS_WHERE="the CUDA toolkit of ${TFSS_NVCC}"
    return 0
  fi
  TFSS_CUBLAS_WHERE=""
  return 1
}

# Builds the harness into $1/tfss_cuda_harness from its source and the
# kernels it tests (cc/core/cuda/sparse_matmul.cu.cc, epilogue.cu.cc), with
# the -gencode flags given after $1. Needs tfss_find_nvcc and tfss_find_cublas
# first; without cuBLAS it builds with -DTFSS_HARNESS_NO_CUBLAS (no baseline).
# Prints each command. Returns nonzero on a failed compile or link.
tfss_build_harness() {
  local out="$1"; shift
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
  local defs=()
  [[ "${TFSS_HAVE_CUBLAS}" == 1 ]] || defs=(-DTFSS_HARNESS_NO_CUBLAS)
  local common=(-std=c++17 -O3 "$@")
  local c1=("${TFSS_NVCC}" "${common[@]}" -x cu -c "${root}/cc/core/cuda/sparse_matmul.cu.cc"
            -o "${out}/sparse_matmul.o")
  local c2=("${TFSS_NVCC}" "${common[@]}" "${TFSS_CUBLAS_CFLAGS[@]}" "${defs[@]}" -x cu -c
            "${root}/cc/tests/cuda/harness.cu.cc" -o "${out}/harness.o")
  local c4=("${TFSS_NVCC}" "${common[@]}" -x cu -c "${root}/cc/core/cuda/epilogue.cu.cc"
            -o "${out}/epilogue.o")
  local c3=("${TFSS_NVCC}" "$@" "${out}/harness.o" "${out}/sparse_matmul.o" "${out}/epilogue.o"
            -o "${out}/tfss_cuda_harness" "${TFSS_CUBLAS_LDFLAGS[@]}")
  echo "+ ${c1[*]}"
  echo "+ ${c2[*]}"
  echo "+ ${c4[*]}"
  "${c1[@]}" & local p1=$!
  "${c2[@]}" & local p2=$!
  "${c4[@]}" & local p4=$!
  local rc=0
  wait "${p1}" || rc=1
  wait "${p2}" || rc=1
  wait "${p4}" || rc=1
  [[ ${rc} == 0 ]] || return 1
  echo "+ ${c3[*]}"
  "${c3[@]}"
}
