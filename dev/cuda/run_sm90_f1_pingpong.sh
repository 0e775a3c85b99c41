#!/usr/bin/env bash
# One device call for dev/cuda/sm90_f1_pingpong.cu (round 5), from the repository root on an H200:
#   bash dev/cuda/run_sm90_f1_pingpong.sh        (about 2 minutes; 7 logs under $OUT)
# 1. build (with cuBLAS if it links, else -DNO_CUBLAS), ptxas report, HGMMA count in the SASS;
# 2. the edge and tiny shapes checked for each checked version (1, 2, 4) in its own process (a hang
#    traps in the mbarrier watchdog after a second or so and kills only that process);
# 3. every shape checked, then timed, with the versions that passed step 2 (the main-loop probes
#    v3 and v5 are timed only if v2, resp. v4, passed);
# 4. compute-sanitizer memcheck of the edge and tiny shapes (MEMCHECK=0 skips it); the table last.
set -u -o pipefail
out="${OUT:-./sm90_out}"
mkdir -p "$out"
bin=/tmp/sm90_f1_pingpong
src=dev/cuda/sm90_f1_pingpong.cu
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv 2>&1 | tee "$out/gpu.txt"
if ! nvcc "${flags[@]}" -o "$bin" "$src" -lcublas >"$out/build.log" 2>&1; then
  echo "build with cuBLAS failed; building without it" | tee -a "$out/build.log"
  nvcc "${flags[@]}" -DNO_CUBLAS -o "$bin" "$src" >>"$out/build.log" 2>&1 || {
    tail -30 "$out/build.log"; exit 1; }
fi
grep -A2 -E "Function properties for _Z1[48]f1_(sm90|pingpong)" "$out/build.log"
grep C75 "$out/build.log"
echo "HGMMA instructions in SASS: $(cuobjdump --dump-sass "$bin" 2>/dev/null | grep -c HGMMA)"
passed=""
for v in 1 2 4; do
  rc=0
  for shape in edge tiny; do
    timeout 60 "$bin" --check-only --shape "$shape" --versions "$v" >>"$out/edge_v$v.log" 2>&1 \
      || rc=$?
  done
  grep -E "rel_l2|checksum|CHECK|error|grid|requirement" "$out/edge_v$v.log" | cut -c1-200
  echo "edge+tiny check v$v rc=$rc"
  [ "$rc" = 0 ] && passed="$passed,$v"
done
passed="${passed#,}"
[ -n "$passed" ] || passed="1,2,4"  # none passed: still time them, and say so
checked="$passed"
case ",$passed," in *,2,*) passed="$passed,3" ;; esac  # v3: v2's main loop alone (probe)
case ",$passed," in *,4,*) passed="$passed,5" ;; esac  # v5: v4's main loop alone (probe)
echo "full run with versions $passed"
timeout "${FULL_TIMEOUT:-170}" "$bin" --versions "$passed" >"$out/full.log" 2>&1
rc=$?
grep -vE "^\s*$" "$out/full.log" \
  | grep -E "shape|rows per|rel_l2|checksum|CHECK|error|grid|f1_sm90|cuBLAS|requirement" \
  | cut -c1-200
echo "full run rc=$rc"
if [ "${MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for shape in edge tiny; do
    timeout 60 compute-sanitizer --tool memcheck "$bin" --check-only --shape "$shape" \
      --versions "$checked" >/tmp/sm90_f1pp_memcheck_one.log 2>&1
    mrc=$?
    cat /tmp/sm90_f1pp_memcheck_one.log >>"$out/memcheck.log"
    echo "memcheck $shape (versions $checked) rc=$mrc :" \
      "$(grep -E 'ERROR SUMMARY|CHECK' /tmp/sm90_f1pp_memcheck_one.log | tr '\n' ' ')"
  done
fi
echo "== summary =="
echo "edge+tiny passed: versions $checked (of 1,2,4)"
echo "full run: $(grep -c 'CHECK PASSED' "$out/full.log") version x shape checks passed," \
  "$(grep -c 'CHECK FAILED' "$out/full.log") failed; $(grep -E 'CHECKS (PASSED|FAILED)' "$out/full.log")"
sed -n '/^F1 TFLOP/,$p' "$out/full.log"
