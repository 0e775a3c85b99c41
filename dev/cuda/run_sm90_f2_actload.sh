#!/usr/bin/env bash
# One device call for dev/cuda/sm90_f2_actload.cu (round 9: F2 with u formed on load from a|b),
# from the repository root on an H200:
#   bash dev/cuda/run_sm90_f2_actload.sh        (about 2 minutes; 5 logs under $OUT)
# 1. build (with cuBLAS if it links, else -DNO_CUBLAS); ptxas registers / spills per kernel, C75xx
#    warnings; SASS counts per kernel (HGMMA, UTMALDG, MUFU, LDL/STL) from cuobjdump;
# 2. edge and tiny checked for each version (1..6) in its own process under `timeout` (a hang
#    traps in the mbarrier watchdog after a second or so and kills only that process); every
#    process also runs the exhaustive lean-transform check and v1 (the bitwise reference);
# 3. every shape checked, then timed, with the versions that passed step 2 (all, if none did);
# 4. compute-sanitizer memcheck of edge for the versions that passed (MEMCHECK=0 skips it);
#    the table last.
set -u -o pipefail
out="${OUT:-./f2_actload_out}"
mkdir -p "$out"
bin=/tmp/sm90_f2_actload
src=dev/cuda/sm90_f2_actload.cu
flags=(-O3 -std=c++17 "-gencode=arch=compute_90a,code=sm_90a" -lineinfo -Xptxas -v -I include -I src)
all_versions="1 2 3 4 5 6"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv 2>&1 | tee "$out/gpu.txt"
if ! nvcc "${flags[@]}" -o "$bin" "$src" -lcublas >"$out/build.log" 2>&1; then
  echo "build with cuBLAS failed; building without it" | tee -a "$out/build.log"
  nvcc "${flags[@]}" -DNO_CUBLAS -o "$bin" "$src" >>"$out/build.log" 2>&1 || {
    tail -30 "$out/build.log"; exit 1; }
fi
demangle() { if command -v c++filt >/dev/null; then c++filt; else cat; fi; }
echo "== ptxas: registers / spills per GEMM kernel (consumers must not spill) =="
awk '/Function properties for/ { fn = $NF; next }
     fn != "" && /spill stores/ { st = $5; ld = $9; next }
     fn != "" && /Used [0-9]+ registers/ {
       for (i = 1; i <= NF; ++i) if ($i == "Used") r = $(i + 1);
       print fn "  regs " r "  spill stores " st " loads " ld; fn = "" }' "$out/build.log" \
  | grep -E "f2_(v1|onload|xform)" | demangle | sed 's/(CUtensorMap_st.*)//' | sort
grep -E "C75[0-9][0-9]|warning" "$out/build.log" | sort -u | head -5
echo "== SASS per GEMM kernel (cuobjdump) =="
cuobjdump -sass "$bin" 2>/dev/null | awk '
  /Function :/ { fn = $3; next }
  fn ~ /f2_(v1|onload|xform)/ && /\/\*[0-9a-f]+\*\// {
    n[fn]++
    if ($0 ~ /HGMMA/) h[fn]++
    if ($0 ~ /UTMALDG/) t[fn]++
    if ($0 ~ /MUFU\.EX2/) x[fn]++
    if ($0 ~ /MUFU\.RCP/) rc[fn]++
    if ($0 ~ /[^A-Z](LDL|STL)[ .]/) l[fn]++
  }
  END { for (f in n) printf "%s  HGMMA %d UTMALDG %d MUFU.EX2 %d MUFU.RCP %d LDL/STL %d instr %d\n",
                             f, h[f], t[f], x[f], rc[f], l[f], n[f] }' \
  | demangle | sed 's/(CUtensorMap_st.*)//' | sort
passed=""
for v in $all_versions; do
  rc=0
  for shape in edge tiny; do
    timeout 60 "$bin" --check-only --shape "$shape" --versions "$v" >>"$out/edge.log" 2>&1 || rc=$?
  done
  grep -E "\[(edge|tiny) v$v\].*(FAIL|first)|requirement|error|lean transform.*FAIL" \
    "$out/edge.log" | sort -u | cut -c1-200 | head -8
  echo "edge+tiny check v$v rc=$rc"
  [ "$rc" = 0 ] && passed="$passed,$v"
done
checked="${passed#,}"
case ",$checked," in *,1,*) ;; *) checked="" ;; esac  # v1 is every check's reference
[ -n "$checked" ] || { checked="1,2,3,4,5,6"; echo "v1 failed or nothing passed: timing all"; }
echo "full run with versions $checked"
timeout "${FULL_TIMEOUT:-150}" "$bin" --versions "$checked" >"$out/full.log" 2>&1
rc=$?
grep -E "^shape|rows per|lean transform|\[[a-z0-9]+ (ref|v[0-9])\].*(FAIL|CHECK)|error|requirement" \
  "$out/full.log" | cut -c1-200
echo "full run rc=$rc"
if [ "${MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  timeout 150 compute-sanitizer --tool memcheck "$bin" --check-only --shape edge \
    --versions "$checked" >"$out/memcheck.log" 2>&1
  mrc=$?
  echo "memcheck edge (versions $checked) rc=$mrc:" \
    "$(grep -cE 'CHECK PASSED' "$out/memcheck.log") passed," \
    "$(grep -cE 'CHECK FAILED' "$out/memcheck.log") failed; $(grep -E 'ERROR SUMMARY' \
    "$out/memcheck.log")"
fi
echo "== summary =="
echo "edge+tiny passed: versions ${passed#,} (of ${all_versions// /,})"
echo "full run: $(grep -c 'CHECK PASSED' "$out/full.log") version x shape checks passed," \
  "$(grep -c 'CHECK FAILED' "$out/full.log") failed; $(grep -E 'CHECKS (PASSED|FAILED)' \
  "$out/full.log")"
echo "v2 = consumers transform (act_math), v3 = transform warpgroup, v4 = v2 with ab 2 / B 4," \
  "v5 / v6 = v2 / v3 with the lean transform (same bits); vN/v1 = time ratio"
sed -n '/^F2 TFLOP/,$p' "$out/full.log"
