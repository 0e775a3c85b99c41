#!/usr/bin/env bash
# One device call for dev/cuda/sm90_gather_probe.cu (per-row TMA gather probe), from the repository
# root on an H200:
#   bash dev/cuda/run_sm90_gather_probe.sh     (about 1.5-2.5 minutes; 6 files under $OUT)
# 1. build (with -DWITH_CUBLAS -lcublas if it links, else without); ptxas registers / spills per
#    kernel; SASS counts per kernel (HGMMA, UTMALDG, ELECT, R2UR, LDGSTS, LDL/STL): v5/v6 should
#    show few ELECT and R2UR (uniform-datapath row TMAs), v3/v4 one ELECT loop per row TMA;
# 2. the edge shape checked for each version (1..6) in its own process under `timeout` (a hang
#    traps in the mbarrier watchdog); a row-TMA version (3..6) that fails with the default tail
#    policy (fully out-of-bounds row coordinate) is retried with --tail zero (an in-bounds zero
#    row); if any needed that, the rest of the run uses --tail zero;
# 3. the full run (edge checked, then conf3 / mixtral / qwen timed) with the versions that passed
#    (all of them, flagged, if none passed);
# 4. compute-sanitizer memcheck of the edge shape (MEMCHECK=0 skips it), and racecheck of it for
#    the versions in RACECHECK_VERSIONS (e.g. 12,13; unset: none); the table last.
# Files under ${OUT:-./probe_out}: summary.txt, build.log, sass_counts.txt, edge.log, full.log,
# memcheck.log.
# shellcheck disable=SC2054,SC2086  # the comma is -gencode's; $tail_opt splits on purpose
set -u -o pipefail
out="${OUT:-./probe_out}"
mkdir -p "$out"
bin=/tmp/sm90_gather_probe
src=dev/cuda/sm90_gather_probe.cu
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v -I src)
all_versions="${VERSIONS:-1 2 3 4 5 6 7 8 9}"
: >"$out/summary.txt"
say() { echo "$*" | tee -a "$out/summary.txt"; }
# Mangled kernel name -> version (probe_kernel<AMODE, WARPS>).
declare -A vname=(
  [_Z12probe_kernelILi0ELi1E]=v1 [_Z12probe_kernelILi1ELi4E]=v2 [_Z12probe_kernelILi2ELi1E]=v3
  [_Z12probe_kernelILi2ELi4E]=v4 [_Z12probe_kernelILi3ELi1E]=v5 [_Z12probe_kernelILi3ELi4E]=v6
  [_Z12probe_kernelILi4ELi4E]=v7 [_Z12probe_kernelILi5ELi2E]=v8 [_Z12probe_kernelILi5ELi3E]=v9
  [_Z12probe_kernelILi6ELi4E]=v10 [_Z12probe_kernelILi7ELi4E]=v11
  [_Z12probe_kernelILi8ELi4E]=v12 [_Z12probe_kernelILi9ELi4E]=v13)
version_of() {  # a mangled name (or a line holding one) -> v1..v6, or "" for helper kernels
  local key
  for key in "${!vname[@]}"; do
    case "$1" in *"$key"*) echo "${vname[$key]}"; return ;; esac
  done
}
start=$SECONDS
say "gpu: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv,noheader 2>&1 | head -1)"

# ---- 1. build, ptxas, SASS
if ! nvcc "${flags[@]}" -DWITH_CUBLAS -o "$bin" "$src" -lcublas >"$out/build.log" 2>&1; then
  say "build with cuBLAS failed; building without it"
  nvcc "${flags[@]}" -o "$bin" "$src" >>"$out/build.log" 2>&1 || {
    tail -30 "$out/build.log"
    exit 1
  }
fi
say "build ok ($((SECONDS - start)) s); ptxas per kernel (launch registers; the consumers run" \
  "at 232 after setmaxnreg):"
while read -r name regs spills; do
  v=$(version_of "$name")
  [ -n "$v" ] && echo "  $v: $regs registers, $spills"
done < <(awk '/Function properties for/ {name = $NF}
  /spill stores/ {sp = $5 " B spill stores, " $9 " B spill loads"}
  /Used [0-9]+ registers/ {for (i = 1; i <= NF; ++i) if ($i == "Used") r = $(i + 1);
    print name, r, sp}' "$out/build.log") | sort | tee -a "$out/summary.txt"
c75=$(grep -c C75 "$out/build.log")
say "  C75xx (wgmma serialisation) warnings: $c75"
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass "$bin" 2>/dev/null | awk '
    /Function :/ {f = $3}
    /HGMMA/ {h[f]++} /UTMALDG/ {u[f]++} /ELECT/ {e[f]++} /R2UR/ {r[f]++}
    /LDGSTS/ {l[f]++} /[^A-Z](LDL|STL)[. ]/ {ls[f]++}
    END {for (k in h) printf "%s HGMMA %d UTMALDG %d ELECT %d R2UR %d LDGSTS %d LDL/STL %d\n",
      k, h[k], u[k], e[k], r[k], l[k], ls[k]}' >"$out/sass_counts.txt"
  while read -r line; do
    v=$(version_of "$line")
    [ -n "$v" ] && echo "$v ${line#* }"
  done <"$out/sass_counts.txt" | sort | sed 's/^/  SASS /' | tee -a "$out/summary.txt"
else
  say "  cuobjdump not found: no SASS counts" | tee "$out/sass_counts.txt"
fi

# ---- 2. edge check per version, each in its own process
passed=""
tail_opt=""  # "" (default: --tail oob) or "--tail zero"
for v in $all_versions; do
  rc=0
  timeout 30 "$bin" --check-only --shape edge --versions "$v" >>"$out/edge.log" 2>&1 || rc=$?
  note=""
  if [ "$rc" != 0 ] && [ "$v" -ge 3 ]; then
    rc2=0
    timeout 30 "$bin" --check-only --shape edge --versions "$v" --tail zero >>"$out/edge.log" \
      2>&1 || rc2=$?
    if [ "$rc2" = 0 ]; then
      note=" (oob tail FAILED; passed with --tail zero)"
      tail_opt="--tail zero"
      rc=0
    else
      note=" (also failed with --tail zero, rc=$rc2)"
    fi
  fi
  [ "$rc" = 0 ] && passed="$passed,$v"
  detail=$(grep -E "\[edge v$v\]|CUDA error|requirement failed" "$out/edge.log" | tail -1 |
    cut -c1-170)
  say "edge check v$v rc=$rc$note: $detail"
done
passed="${passed#,}"
run_versions="$passed"
if [ -z "$run_versions" ]; then
  run_versions="${all_versions// /,}"
  say "NO VERSION PASSED the edge check: timing all of them anyway (results unverified)"
fi
say "edge checks done ($((SECONDS - start)) s): passed ${passed:-none}; tail policy for the rest:" \
  "${tail_opt:---tail oob}"

# ---- 3. full run: edge checked, conf3 / mixtral / qwen timed
rc=0
timeout "${FULL_TIMEOUT:-100}" "$bin" --versions "$run_versions" $tail_opt \
  >"$out/full.log" 2>&1 || rc=$?
grep -E "CHECK FAILED|MISMATCH|CUDA error|requirement|CHECKS" "$out/full.log" | cut -c1-200 |
  tee -a "$out/summary.txt"
say "full run rc=$rc ($((SECONDS - start)) s)"

# ---- 4. memcheck of the edge shape
if [ "${MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  mrc=0
  timeout "${MEMCHECK_TIMEOUT:-60}" compute-sanitizer --tool memcheck "$bin" --check-only \
    --shape edge --versions "$run_versions" $tail_opt >"$out/memcheck.log" 2>&1 || mrc=$?
  say "memcheck edge (versions $run_versions) rc=$mrc: $(grep -E 'ERROR SUMMARY' \
    "$out/memcheck.log" | tr '\n' ' ') $(grep -c 'CHECK PASSED' "$out/memcheck.log") checks passed"
else
  say "memcheck skipped" | tee "$out/memcheck.log"
fi

# ---- 4b. racecheck of the edge shape for RACECHECK_VERSIONS (e.g. "12,13"; unset: skipped)
if [ -n "${RACECHECK_VERSIONS:-}" ] && command -v compute-sanitizer >/dev/null; then
  rrc=0
  timeout "${RACECHECK_TIMEOUT:-120}" compute-sanitizer --tool racecheck "$bin" --check-only \
    --shape edge --versions "$RACECHECK_VERSIONS" $tail_opt >"$out/racecheck.log" 2>&1 || rrc=$?
  say "racecheck edge (versions $RACECHECK_VERSIONS) rc=$rrc: $(grep -E 'RACECHECK SUMMARY' \
    "$out/racecheck.log" | tr '\n' ' ') $(grep -c 'CHECK PASSED' "$out/racecheck.log") checks passed"
fi

echo "== summary ($((SECONDS - start)) s) ==" | tee -a "$out/summary.txt"
say "edge passed: ${passed:-none} (of 1..6); tail policy ${tail_opt:---tail oob}; full run rc=$rc"
say "v1 contiguous TMA (upper bound) | v2 cp.async (library) | row TMA: v3 32 lanes x 4 rows," \
  "v4 128 lanes x 1 row (per-lane issue), v5 1 warp x 128 rows, v6 4 warps x 32 rows" \
  "(warp-uniform issue)"
sed -n '/^GATHER PROBE/,$p' "$out/full.log" | tee -a "$out/summary.txt"
