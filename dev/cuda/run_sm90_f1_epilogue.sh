#!/usr/bin/env bash
# One device call for dev/cuda/sm90_f1_epilogue.cu (round 7), from the repository root on an H200:
#   bash dev/cuda/run_sm90_f1_epilogue.sh        (about 2-3 minutes; <= 7 logs under $OUT)
# 1. build (with cuBLAS if it links, else -DNO_CUBLAS), ptxas report, HGMMA count in the SASS;
# 2. edge and tiny shapes checked for each checked version (1, 6) in its own process (a hang traps
#    in the mbarrier watchdog after a second or so and kills only that process); the probes
#    (2, 3, 4, 5, 7) smoke-run on edge and tiny in one more process;
# 3. every shape checked, then timed, with the versions that passed step 2 (probe 2-5 only if v1
#    passed, 7 only if v6 passed);
# 4. compute-sanitizer memcheck of edge and tiny for the checked versions (MEMCHECK=0 skips it);
#    the table last.
set -u -o pipefail
out="${OUT:-./sm90_out}"
mkdir -p "$out"
bin=/tmp/sm90_f1_epilogue
src=dev/cuda/sm90_f1_epilogue.cu
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv 2>&1 | tee "$out/gpu.txt"
if ! nvcc "${flags[@]}" -o "$bin" "$src" -lcublas >"$out/build.log" 2>&1; then
  echo "build with cuBLAS failed; building without it" | tee -a "$out/build.log"
  nvcc "${flags[@]}" -DNO_CUBLAS -o "$bin" "$src" >>"$out/build.log" 2>&1 || {
    tail -30 "$out/build.log"; exit 1; }
fi
grep -A2 -E "Function properties for _Z(14f1_sm90|18f1_deferred)" "$out/build.log" | grep -v "^--"
grep C75 "$out/build.log"
echo "HGMMA instructions in SASS: $(cuobjdump --dump-sass "$bin" 2>/dev/null | grep -o 'HGMMA\.[0-9x]*' \
  | sort | uniq -c | tr '\n' ' ')"
passed=""
for v in 1 6; do
  rc=0
  for shape in edge tiny; do
    timeout 60 "$bin" --check-only --shape "$shape" --versions "$v" >>"$out/edge.log" 2>&1 || rc=$?
  done
  grep -E "\] |error|grid|requirement" "$out/edge.log" | grep -E " v$v\]|error|requirement|grid" \
    | grep -vE "timing probe" | cut -c1-200 | sort -u
  echo "edge+tiny check v$v rc=$rc"
  [ "$rc" = 0 ] && passed="$passed,$v"
done
probes=""
case ",$passed," in *,1,*) probes="2,3,4,5" ;; esac
case ",$passed," in *,6,*) probes="${probes:+$probes,}7" ;; esac
if [ -n "$probes" ]; then
  prc=0
  for shape in edge tiny; do
    timeout 60 "$bin" --check-only --shape "$shape" --versions "$probes" >>"$out/probes_smoke.log" \
      2>&1 || prc=$?
  done
  echo "probe smoke run (versions $probes) on edge+tiny rc=$prc:" \
    "$(grep -c 'timing probe ran' "$out/probes_smoke.log") runs ok"
  [ "$prc" = 0 ] || { grep -E "error|requirement" "$out/probes_smoke.log" | head -5; probes=""; }
fi
checked="${passed#,}"
[ -n "$checked" ] || checked="1,6"  # none passed: still time them, and say so
all="$checked${probes:+,$probes}"
echo "full run with versions $all"
timeout "${FULL_TIMEOUT:-150}" "$bin" --versions "$all" >"$out/full.log" 2>&1
rc=$?
grep -vE "^\s*$" "$out/full.log" \
  | grep -E "shape|rows per|rel_l2|checksum|CHECK|error|grid|f1_sm90|cuBLAS|requirement|probe" \
  | cut -c1-200
echo "full run rc=$rc"
if [ "${MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for shape in edge tiny; do
    timeout 60 compute-sanitizer --tool memcheck "$bin" --check-only --shape "$shape" \
      --versions "$checked" >/tmp/sm90_f1e_memcheck_one.log 2>&1
    mrc=$?
    cat /tmp/sm90_f1e_memcheck_one.log >>"$out/memcheck.log"
    echo "memcheck $shape (versions $checked) rc=$mrc :" \
      "$(grep -E 'ERROR SUMMARY|CHECK' /tmp/sm90_f1e_memcheck_one.log | tr '\n' ' ')"
  done
fi
echo "== summary =="
echo "edge+tiny passed: versions ${passed#,} (of 1,6); probes smoke-run ok: ${probes:-none}"
echo "full run: $(grep -c 'CHECK PASSED' "$out/full.log") version x shape checks passed," \
  "$(grep -c 'CHECK FAILED' "$out/full.log") failed; $(grep -E 'CHECKS (PASSED|FAILED)' "$out/full.log")"
echo "epilogue parts (conf3 etc.): v1-v2 = whole epilogue, v1-v3 = silu, v1-v4 = a,b passes," \
  "v1-v5 = global stores; v6 vs v7 = deferred epilogue's remaining cost"
sed -n '/^F1 TFLOP/,$p' "$out/full.log"
