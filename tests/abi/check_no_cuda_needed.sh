#!/usr/bin/env bash
# libmoeblaze must load, and run its CPU backend, on a machine without the CUDA libraries: the CUDA
# runtime is linked statically and cuBLASLt is loaded when a CUDA context is created
# (src/cuda/cublaslt_api.hpp), so no CUDA library may be among its NEEDED entries and no cublas*
# symbol among its imports. (NCCL has its own check: tests/ep/check_no_nccl_needed.sh.)
# usage: check_no_cuda_needed.sh <library file>
set -euo pipefail
lib="$1"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

needed="$(readelf -d "$lib" | sed -nE 's/.*\(NEEDED\).*\[(.*)\].*/\1/p' | tr '\n' ' ')"
echo "NEEDED of $(basename "$lib"): $needed"
[[ -n "$needed" ]] || fail "readelf -d listed no NEEDED entry at all (is $lib a shared library?)"
for pattern in libcublas libcudart libcuda. libnvrtc libnvJitLink; do
  [[ "$needed" != *"$pattern"* ]] || fail "libmoeblaze needs a CUDA library ($pattern*): $needed"
done
imports="$(readelf --dyn-syms -W "$lib" | awk '$7 == "UND" && $8 ~ /^(cublas|cudart|cuda[A-Z])/ { print $8 }' |
  tr '\n' ' ')"
[[ -z "$imports" ]] || fail "libmoeblaze imports CUDA library symbols: $imports"

if ((failures)); then echo "no-CUDA-library check FAILED"; exit 1; fi
echo "no-CUDA-library check passed (no NEEDED CUDA library, no cublas/cuda runtime imports)"
