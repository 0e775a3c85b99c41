#!/usr/bin/env bash
# Round 8c, one device call: WHY the gathered A operand costs the Hopper main loop ~26 % (round 8:
# contiguous TMA v1 729 TFLOP/s, the library's cp.async gather v2 539, one TMA per row v4 472 on
# conf3; round 8b ruled out the proxy fence, the barrier arrivals and the L2 prefetch size).
# Nsight Compute's full set on one launch of each version, conf3 shape, main loop only:
#   bash dev/cuda/run_sm90_gather_ncu.sh    (about 3-4 minutes; the table last; the reports, their
#   details pages, the raw metrics and the logs in ${OUT:-./ncu_out}/ncu_all.tgz)
# Versions: v1 (bound), v2 (library), v4 (row TMA), v7 (v2 without fence); override: VERSIONS="1 2".
# What to read first, v2 against v1 (the table printed last):
#   - sm__throughput / tensor pipe active: how far each is from the wgmma rate;
#   - l1tex__t_requests / sectors for global loads (LDGSTS) and lsu stalls: is the LSU/L1TEX
#     request path saturated by 16-byte cp.async (v2) where v1 uses none?
#   - lts__t_sectors_srcunit_tex (L2 sectors to the SMs), lts hit rate, dram bytes: the same bytes
#     should move in both; a difference here points at L2 locality of the gathered rows;
#   - warp stall reasons of the consumer warps (long scoreboard / barrier = waiting on data).
# shellcheck disable=SC2086  # ${VERSIONS} splits into version numbers on purpose
set -u -o pipefail
out="${OUT:-./ncu_out}"
mkdir -p "$out"
bin=/tmp/sm90_gather_probe_ncu
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -lineinfo -I src \
  -o "$bin" dev/cuda/sm90_gather_probe.cu >"$out/build.log" 2>&1 || {
  tail -20 "$out/build.log"
  exit 1
}
# Substrings of the metrics to tabulate from the full set (names differ between ncu versions, so
# nothing is requested by name: an unknown name would fail the whole profile).
patterns="gpu__time_duration.sum sm__throughput.avg.pct pipe_tensor l1tex__t_requests_pipe_lsu_mem_global
l1tex__t_sectors_pipe_lsu_mem_global l1tex__throughput.avg.pct l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
lts__t_sectors_srcunit_tex.sum lts__t_sector_hit_rate lts__throughput.avg.pct dram__bytes_read.sum
dram__throughput.avg.pct smsp__average_warp_latency_issue_stalled smsp__pcsamp_warps_issue_stalled"
for v in ${VERSIONS:-1 2 4 7}; do
  # Skip the warm-up launches of the timed loop; profile one steady-state launch.
  timeout 150 ncu --clock-control none -k regex:probe_kernel --launch-skip 3 --launch-count 1 \
    --set full --export "$out/v$v" --force-overwrite \
    "$bin" --shape conf3 --versions "$v" >"$out/ncu_v$v.log" 2>&1
  echo "v$v: ncu rc=$? ($(grep -cE '==PROF==|==ERROR==' "$out/ncu_v$v.log") ncu lines)"
  ncu --import "$out/v$v.ncu-rep" --page raw --csv >"$out/metrics_v$v.csv" 2>/dev/null
  ncu --import "$out/v$v.ncu-rep" --page details >"$out/details_v$v.txt" 2>/dev/null
done
echo "== metric per version (conf3, one launch each)"
PATTERNS="$patterns" python3 - "$out" ${VERSIONS:-1 2 4 7} <<'EOF'
import csv, sys, os
out, versions = sys.argv[1], sys.argv[2:]
patterns = os.environ["PATTERNS"].split()
cols = {}
for v in versions:
    path = os.path.join(out, f"metrics_v{v}.csv")
    if not os.path.exists(path):
        continue
    rows = list(csv.reader(open(path)))
    if len(rows) < 3:
        continue
    header, units, values = rows[0], rows[1], rows[-1]
    cols[v] = {h: (val, u) for h, u, val in zip(header, units, values)}
names = sorted({h for c in cols.values() for h in c if any(p in h for p in patterns)})
print("%-75s %s" % ("metric", "  ".join("v%-14s" % v for v in cols)))
for n in names:
    print("%-75s %s" % (n[:75], "  ".join("%-15s" % cols[v].get(n, ("-", ""))[0] for v in cols)))
EOF
# One file back from the device (it returns 8 at most): reports, details, raw metrics and logs.
(cd "$out" && tar czf ncu_all.tgz --remove-files ./*.ncu-rep ./details_*.txt ./metrics_*.csv \
  ./ncu_*.log ./build.log 2>/dev/null)
