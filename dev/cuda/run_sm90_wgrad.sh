#!/usr/bin/env bash
# Round 4 device call: the MoE weight-gradient GEMMs B2 / B3 / B3n on the Hopper wgmma/TMA kernel
# of dev/cuda/sm90_wgrad_gemm.cu. From the repository root on an H200:
#   bash dev/cuda/run_sm90_wgrad.sh          (about 2-3 minutes; 4 logs under $OUT)
# 1. build (cuBLAS if it links, else -DNO_CUBLAS); ptxas facts and the HGMMA / UTMALDG /
#    LDGSTS / local-memory counts of the SASS, C75xx (wgmma serialisation) warnings;
# 2. the edge shape (M, N tails, the dw_gate/dw_up split inside an m-tile, a 7-row expert, an
#    empty expert, partial last stages; bf16 and f16; B2, B3, B3n; accumulate; Inf/NaN in the
#    neighbouring expert's rows) checked per version (1: LPT order + snake, 2: index order) in its
#    own process;
# 3. every shape checked, then timed against cuBLAS, with the versions that passed step 2
#    (none passed: v1 anyway, for the diagnostics);
# 4. compute-sanitizer memcheck on the edge shape (MEMCHECK=0 skips it); the tables print last.
# Logs: summary.txt (everything below), build.log, edge.log (edge checks + memcheck), full.log.
set -u -o pipefail
out="${OUT:-./sm90_wgrad_out}"
mkdir -p "$out"
sum="$out/summary.txt"
bindir=/tmp/sm90_wgrad
mkdir -p "$bindir"
bin="$bindir/sm90_wgrad_gemm"
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas -v)
: >"$sum"
say() { echo "$@" | tee -a "$sum"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv 2>&1 | tee -a "$sum"

log="$out/build.log"
if ! nvcc "${flags[@]}" -o "$bin" dev/cuda/sm90_wgrad_gemm.cu -lcublas >"$log" 2>&1; then
  echo "build with cuBLAS failed; building without it" >>"$log"
  nvcc "${flags[@]}" -DNO_CUBLAS -o "$bin" dev/cuda/sm90_wgrad_gemm.cu >>"$log" 2>&1
fi
if [ ! -x "$bin" ]; then
  say "BUILD FAILED"
  tail -30 "$log" | tee -a "$sum"
  exit 1
fi
# one line per kernel instantiation: name (T, GATHER_A, SCHED), stack / spills, registers
grep -A2 'Function properties for _Z17wgrad_sm90' "$log" | tr -s ' \n' ' ' | sed 's/ -- /\n/g' |
  sed -E 's/.*wgrad_sm90_kernelI[0-9]*([_a-z0-9]*)Lb([01])ELi([01])[^ ]* /\1 gatherA=\2 sched=\3: /; s/ptxas info : //g' |
  cut -c1-200 | tee -a "$sum"
echo >>"$sum"
sass=$(cuobjdump --dump-sass "$bin" 2>/dev/null)
say "SASS: HGMMA $(grep -c HGMMA <<<"$sass") (tnspA.tnspB $(grep -c 'HGMMA.*tnspA.tnspB' <<<"$sass")), UTMALDG $(grep -c UTMALDG <<<"$sass"), LDGSTS.128 $(grep -c 'LDGSTS.E.BYPASS.128' <<<"$sass"), LDL/STL $(grep -cE '\b(LDL|STL)\b' <<<"$sass"), WARPGROUP.DEPBAR $(grep -c 'WARPGROUP.DEPBAR' <<<"$sass"); C75xx warnings: $(grep -c 'C75' "$log")"

: >"$out/edge.log"
passed=""
for v in 1 2; do
  timeout 90 "$bin" --check-only --shape edge --versions "$v" >>"$out/edge.log" 2>&1
  rc=$?
  say "edge check v$v (bf16 + f16, B2 B3 B3n) rc=$rc"
  [ "$rc" = 0 ] && passed="$passed$v"
done
grep -E "FAIL|DIFFERENT|NO$|first|failures per|groups|error|requirement|CHECK" "$out/edge.log" |
  cut -c1-240 | head -60 | tee -a "$sum"

vs="${passed:-1}"
[ -n "$passed" ] || say "NO VERSION PASSED THE EDGE CHECK; full run of v1 for diagnostics"
timeout "${FULL_TIMEOUT:-200}" "$bin" --versions "$vs" >"$out/full.log" 2>&1
say "full run (versions $vs) rc=$?"
grep -E "^shape|FAIL|DIFFERENT|NO$|first|failures per|groups|error|requirement|CHECK FAILED|TFLOP/s$" \
  "$out/full.log" | cut -c1-240 | head -150 | tee -a "$sum"

if [ "${MEMCHECK:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  echo "=== memcheck" >>"$out/edge.log"
  timeout 120 compute-sanitizer --tool memcheck "$bin" --check-only --shape edge --versions 1 \
    --dtypes bf16 >>"$out/edge.log" 2>&1
  say "memcheck (edge, v1, bf16) rc=$? : $(grep -E 'ERROR SUMMARY' "$out/edge.log" | tail -1)"
fi
sed -n '/TFLOP\/s counted/,$p' "$out/full.log" | tee -a "$sum"
