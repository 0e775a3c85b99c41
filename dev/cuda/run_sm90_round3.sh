#!/usr/bin/env bash
# Round 3 device call: F2, B4 and B1 (main loop) on the Hopper wgmma/TMA kernel of
# dev/cuda/sm90_rows_gemm.cuh. From the repository root on an H200:
#   bash dev/cuda/run_sm90_round3.sh          (about 2-4 minutes; 6 logs under $OUT)
# 1. build the three programs in parallel (cuBLAS if it links, else -DNO_CUBLAS); ptxas facts and
#    the HGMMA / UTMALDG / local-memory counts of the SASS;
# 2. the edge shape (k and n tails, ragged experts, an empty expert) checked per program and per
#    version (1: no cluster, 2: 2-CTA cluster with B multicast) in its own process; for B4 and B1
#    (MN-major B), if v1 fails with the default descriptor, the swapped LBO/SBO form is tried and,
#    if it passes, used from then on (say so in the README if that happens);
# 3. every shape checked, then timed against cuBLAS, with the versions that passed step 2;
# 4. compute-sanitizer memcheck on the edge shape (MEMCHECK=0 skips it); the tables print last.
# Logs: summary.txt (everything below), build.log, edge.log (edge checks + memcheck), b4.log,
# f2.log, b1.log.
set -u -o pipefail
out="${OUT:-./sm90_round3_out}"
mkdir -p "$out"
sum="$out/summary.txt"
bindir=/tmp/sm90_round3
mkdir -p "$bindir"
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v)
: >"$sum"
say() { echo "$@" | tee -a "$sum"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv 2>&1 | tee -a "$sum"
: >"$out/build.log"
build() {  # $1 = b4 | f2 | b1
  local log="$bindir/build_$1.log"
  if ! nvcc "${flags[@]}" -o "$bindir/sm90_$1_gemm" "dev/cuda/sm90_$1_gemm.cu" -lcublas >"$log" 2>&1; then
    echo "build $1 with cuBLAS failed; building without it" >>"$log"
    nvcc "${flags[@]}" -DNO_CUBLAS -o "$bindir/sm90_$1_gemm" "dev/cuda/sm90_$1_gemm.cu" >>"$log" 2>&1
  fi
}
build b4 & build f2 & build b1 & wait
for n in b4 f2 b1; do
  cat "$bindir/build_$n.log" >>"$out/build.log"
  if [ -x "$bindir/sm90_${n}_gemm" ]; then
    sass=$(cuobjdump --dump-sass "$bindir/sm90_${n}_gemm" 2>/dev/null)
    say "$n: $(grep -A2 'properties for _Z16rows_sm90' "$bindir/build_$n.log" | tr -s ' \n' ' ')"
    say "$n: SASS HGMMA $(grep -c HGMMA <<<"$sass") (tnspB $(grep -c 'HGMMA.*tnspB' <<<"$sass")), UTMALDG $(grep -c UTMALDG <<<"$sass"), LDGSTS.128 $(grep -c 'LDGSTS.E.BYPASS.128' <<<"$sass"), LDL/STL $(grep -cE '\b(LDL|STL)\b' <<<"$sass"); C7510: $(grep -c C75 "$bindir/build_$n.log")"
  else
    say "$n: BUILD FAILED"; tail -20 "$bindir/build_$n.log" | tee -a "$sum"
  fi
done

: >"$out/edge.log"
declare -A mode passed
for n in b4 f2 b1; do
  bin="$bindir/sm90_${n}_gemm"
  [ -x "$bin" ] || continue
  mode[$n]=default
  passed[$n]=""
  for v in 1 2; do
    timeout 60 "$bin" --check-only --shape edge --versions "$v" --mn-desc "${mode[$n]}" \
      >>"$out/edge.log" 2>&1
    rc=$?
    say "$n v$v edge check (descriptor ${mode[$n]}) rc=$rc"
    if [ "$rc" != 0 ] && [ "$n" != f2 ] && [ "$v" = 1 ]; then
      timeout 60 "$bin" --check-only --shape edge --versions 1 --mn-desc swapped \
        >>"$out/edge.log" 2>&1
      rc=$?
      say "$n v1 edge check (SWAPPED MN-major descriptor) rc=$rc"
      [ "$rc" = 0 ] && mode[$n]=swapped
    fi
    [ "$rc" = 0 ] && passed[$n]="${passed[$n]},$v"
  done
  passed[$n]="${passed[$n]#,}"
done
grep -E "rel_l2|checksum|bitwise|CHECK|error|failed|grid" "$out/edge.log" | cut -c1-220 | tee -a "$sum"

for n in b4 f2 b1; do
  bin="$bindir/sm90_${n}_gemm"
  [ -x "$bin" ] || continue
  vs="${passed[$n]:-1}"  # none passed: still run v1 for the full diagnostics, and say so
  [ -n "${passed[$n]}" ] || say "$n: NO VERSION PASSED THE EDGE CHECK; full run of v1 for diagnostics"
  timeout "${FULL_TIMEOUT:-150}" "$bin" --versions "$vs" --mn-desc "${mode[$n]}" >"$out/$n.log" 2>&1
  say "$n full run (versions $vs, descriptor ${mode[$n]}) rc=$?"
  grep -E "^shape|rel_l2|checksum|bitwise|CHECK|error|failed|TFLOP/s$" "$out/$n.log" | cut -c1-220 | tee -a "$sum"
done

if [ "${MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for n in b4 f2 b1; do
    bin="$bindir/sm90_${n}_gemm"
    [ -x "$bin" ] || continue
    echo "=== memcheck $n" >>"$out/edge.log"
    timeout 60 compute-sanitizer --tool memcheck "$bin" --check-only --shape edge \
      --versions "${passed[$n]:-1}" --mn-desc "${mode[$n]}" >>"$out/edge.log" 2>&1
    say "$n memcheck rc=$? : $(grep -E 'ERROR SUMMARY' "$out/edge.log" | tail -1)"
  done
fi
for n in b4 f2 b1; do
  [ -f "$out/$n.log" ] && sed -n '/TFLOP\/s counted/,$p' "$out/$n.log" | tee -a "$sum"
done
