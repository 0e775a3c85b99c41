#!/usr/bin/env bash
# One device call for dev/cuda/sm90_gather_gemm.cu, from the repository root on an H200:
#   bash dev/cuda/run_sm90_gather_gemm.sh        (about 1-2 minutes; logs under $OUT)
# 1. build (with cuBLAS if it links, else -DNO_CUBLAS), ptxas report, HGMMA count in the SASS;
# 2. the edge shape checked for each kernel version (1-4) in its own process (a hang traps after about
#    a second and kills only that process; a wrong result shows in a few seconds);
# 3. every shape checked, then timed, with the versions that passed step 2;
# 4. compute-sanitizer memcheck on the edge shape (MEMCHECK=0 skips it); the table prints last.
set -u -o pipefail
out="${OUT:-./sm90_out}"
mkdir -p "$out"
bin=/tmp/sm90_gather_gemm
src=dev/cuda/sm90_gather_gemm.cu
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv 2>&1 | tee "$out/gpu.txt"
if ! nvcc "${flags[@]}" -o "$bin" "$src" -lcublas >"$out/build.log" 2>&1; then
  echo "build with cuBLAS failed; building without it" | tee -a "$out/build.log"
  nvcc "${flags[@]}" -DNO_CUBLAS -o "$bin" "$src" >>"$out/build.log" 2>&1 || {
    tail -30 "$out/build.log"; exit 1; }
fi
grep -A2 "Function properties for _Z14f1_sm90" "$out/build.log"; grep C75 "$out/build.log"
echo "HGMMA instructions in SASS: $(cuobjdump --dump-sass "$bin" 2>/dev/null | grep -c HGMMA)"
passed=""
for v in 1 2 3 4; do
  timeout 60 "$bin" --check-only --shape edge --versions "$v" >"$out/edge_v$v.log" 2>&1
  rc=$?
  grep -E "rel_l2|checksum|CHECK|error|grid" "$out/edge_v$v.log"
  echo "edge check v$v rc=$rc"
  [ "$rc" = 0 ] && passed="$passed,$v"
done
passed="${passed#,}"
[ -n "$passed" ] || passed="1,2"  # none passed: still time them, and say so
case ",$passed," in *,3,*) passed="$passed,5" ;; esac  # v5: v3's main loop alone (timing probe)
echo "full run with versions $passed"
timeout "${FULL_TIMEOUT:-200}" "$bin" --versions "$passed" >"$out/full.log" 2>&1
rc=$?
grep -vE "^\s*$" "$out/full.log" | grep -E "shape|rows per|rel_l2|checksum|CHECK|error|grid|f1_sm90|cuBLAS" \
  | cut -c1-200
echo "full run rc=$rc"
# 4. memory checker on the edge shape (out-of-bounds global/shared accesses), when time allows
if [ "${MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  timeout 90 compute-sanitizer --tool memcheck "$bin" --check-only --shape edge \
    --versions "${passed%,5}" >"$out/memcheck.log" 2>&1
  echo "memcheck rc=$? : $(grep -E 'ERROR SUMMARY|CHECK' "$out/memcheck.log" | tr '\n' ' ')"
fi
sed -n '/^F1 TFLOP/,$p' "$out/full.log"
