#!/usr/bin/env bash
# Round 6 device call: B2 / B3 / B3n with 2-CTA clusters sharing the TMA-loaded operand by
# multicast (dev/cuda/sm90_wgrad_cluster.cu, version 3) against round 4's version 2. From the
# repository root on an H200:
#   bash dev/cuda/run_sm90_wgrad_cluster.sh      (target < 3 minutes; 5 logs under $OUT)
# 1. build (cuBLAS if it links, else -DNO_CUBLAS); ptxas facts per instantiation, SASS counts
#    (HGMMA, UTMALDG, multicast UTMALDG, LDL/STL), C75xx warnings;
# 2. edge shapes, each version (2, 3) and each shape (edge: B3's rank-1 CTA idle on every pair;
#    edge2: B2 pairs with an idle CTA, B3 pairs with a 40-column tail) in its own process: bf16 +
#    f16, B2 B3 B3n, accumulate, bitwise rerun, Inf/NaN in the neighbouring expert's rows;
# 3. SHAPES (default conf3,qwen,skew,conf4,mixtral) checked, then timed vs cuBLAS, with the
#    versions that passed step 2 (none: v2 for the diagnostics);
# 4. compute-sanitizer memcheck of version 3 on both edge shapes, bf16 (MEMCHECK=0 skips it);
#    the timing table prints last.
# Logs: summary.txt (everything below), build.log, edge.log, full.log, memcheck.log.
set -u -o pipefail
out="${OUT:-./sm90_wgrad_cluster_out}"
mkdir -p "$out"
sum="$out/summary.txt"
bindir=/tmp/sm90_wgrad_cluster
mkdir -p "$bindir"
bin="$bindir/wgc"
src=dev/cuda/sm90_wgrad_cluster.cu
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v)
: >"$sum"
say() { echo "$@" | tee -a "$sum"; }
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv 2>&1 | tee -a "$sum"

log="$out/build.log"
if ! nvcc "${flags[@]}" -o "$bin" "$src" -lcublas >"$log" 2>&1; then
  echo "build with cuBLAS failed; building without it" >>"$log"
  nvcc "${flags[@]}" -DNO_CUBLAS -o "$bin" "$src" >>"$log" 2>&1
fi
if [ ! -x "$bin" ]; then
  say "BUILD FAILED"
  tail -30 "$log" | tee -a "$sum"
  exit 1
fi
# one line per kernel instantiation: (T, GATHER_A, SCHED, CLUSTER), stack / spills, registers
grep -A2 'Function properties for _Z17wgrad_sm90' "$log" | tr -s ' \n' ' ' | sed 's/ -- /\n/g' |
  sed -E 's/.*wgrad_sm90_kernelI[0-9]*([_a-z0-9]*)Lb([01])ELi([01])ELi([12])[^ ]* /\1 gatherA=\2 sched=\3 cluster=\4: /; s/ptxas info : //g' |
  cut -c1-200 | tee -a "$sum"
echo >>"$sum"
sass=$(cuobjdump --dump-sass "$bin" 2>/dev/null)
say "SASS: HGMMA $(grep -c HGMMA <<<"$sass") (tnspA.tnspB $(grep -c 'HGMMA.*tnspA.tnspB' <<<"$sass")), UTMALDG $(grep -c UTMALDG <<<"$sass") (MULTICAST $(grep -c 'UTMALDG.*MULTICAST' <<<"$sass")), LDGSTS.128 $(grep -c 'LDGSTS.E.BYPASS.128' <<<"$sass"), LDL/STL $(grep -cE '\b(LDL|STL)\b' <<<"$sass"), UCGABAR $(grep -c UCGABAR <<<"$sass"); C75xx warnings: $(grep -c 'C75' "$log")"

: >"$out/edge.log"
passed=""
for v in 2 3; do
  vok=1
  for shape in edge edge2; do
    timeout 60 "$bin" --check-only --shape "$shape" --versions "$v" >>"$out/edge.log" 2>&1
    rc=$?
    say "edge check v$v $shape (bf16 + f16, B2 B3 B3n) rc=$rc"
    [ "$rc" = 0 ] || vok=0
  done
  [ "$vok" = 1 ] && passed="$passed$v"
done
grep -E "cluster 2:|FAIL|DIFFERENT|NO$|first|failures per|groups|error|requirement|CHECK" \
  "$out/edge.log" | cut -c1-240 | head -60 | tee -a "$sum"

vs="${passed:-2}"
[ -n "$passed" ] || say "NO VERSION PASSED THE EDGE CHECKS; full run of v2 for diagnostics"
shapes="${SHAPES:-conf3,qwen,skew,conf4,mixtral}"
timeout "${FULL_TIMEOUT:-110}" "$bin" --versions "$vs" --shape "$shapes" >"$out/full.log" 2>&1
say "full run (versions $vs, shapes $shapes) rc=$? after $(($(date +%s) - t0)) s"
grep -E "^shape|cluster 2:|FAIL|DIFFERENT|NO$|first|failures per|groups|error|requirement|CHECK FAILED|TFLOP/s$" \
  "$out/full.log" | cut -c1-240 | head -150 | tee -a "$sum"

if [ "${MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  : >"$out/memcheck.log"
  for shape in edge edge2; do
    echo "=== memcheck v3 $shape" >>"$out/memcheck.log"
    timeout 30 compute-sanitizer --tool memcheck "$bin" --check-only --shape "$shape" \
      --versions 3 --dtypes bf16 >>"$out/memcheck.log" 2>&1
    say "memcheck ($shape, v3, bf16) rc=$? : $(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1)"
  done
fi
say "total $(($(date +%s) - t0)) s"
sed -n '/TFLOP\/s counted/,$p' "$out/full.log" | tee -a "$sum"
