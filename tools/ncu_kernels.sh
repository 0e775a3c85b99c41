#!/usr/bin/env bash
# Nsight Compute on the library's six Hopper GEMM kernels (F1, F2, B1, B4, B2, B3) of one experts
# forward + backward, for one configuration: what limits each (tensor pipe, L2, DRAM, stalls).
# Run from the repository root on a GPU machine with a built library:
#   MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so bash tools/ncu_kernels.sh \
#       [tests/cuda/profile_kernels.py arguments, e.g. $(python3 tools/shape_args.py mixtral)]
# (about 1-2 minutes per configuration). profile_kernels.py runs 3 warm-up steps (18 sm90 kernel
# launches, 24 where F2 and B4 run in two column chunks), then the steps ncu profiles: the next 8
# sm90 launches, which hold each of the six kernels at least once whichever the step's launch
# count. The table of the metrics below is printed last; the report, its details page and the raw
# metrics are in ${OUT:-./ncu_kernels_out}/ncu_kernels.tgz.
set -u -o pipefail
out="${OUT:-./ncu_kernels_out}"
mkdir -p "$out"
: "${MOEBLAZE_LIBRARY:?set MOEBLAZE_LIBRARY to the built libmoeblaze.so}"
timeout "${NCU_TIMEOUT:-400}" ncu --clock-control none -k regex:sm90_ --launch-skip 18 \
  --launch-count 8 --set full --export "$out/kernels" --force-overwrite \
  python3 tests/cuda/profile_kernels.py --rows 1 --steps 1 "$@" >"$out/ncu.log" 2>&1
echo "ncu rc=$? ($(grep -c '==PROF==' "$out/ncu.log") profiler lines; the run's own output:" \
  "$(grep -E '^fwd\+bwd' "$out/ncu.log"))"
ncu --import "$out/kernels.ncu-rep" --page raw --csv >"$out/metrics.csv" 2>/dev/null
ncu --import "$out/kernels.ncu-rep" --page details >"$out/details.txt" 2>/dev/null
# Substrings of the metrics to tabulate (nothing is requested by name: an unknown name would fail
# the whole profile, and names differ between ncu versions).
PATTERNS="gpu__time_duration.sum sm__throughput.avg.pct pipe_tensor_op_gmma l1tex__throughput.avg.pct
lts__t_sector_hit_rate.pct lts__throughput.avg.pct dram__throughput.avg.pct dram__bytes_read.sum
dram__bytes_write.sum launch__registers_per_thread launch__grid_size" python3 - "$out" <<'EOF'
import csv, os, sys
out = sys.argv[1]
patterns = os.environ["PATTERNS"].split()
rows = list(csv.reader(open(os.path.join(out, "metrics.csv"))))
if len(rows) < 3:
    sys.exit("no metrics (see ncu.log)")
header, units, data = rows[0], rows[1], rows[2:]
name_col = header.index("Kernel Name") if "Kernel Name" in header else None
sys.path.insert(0, "tools")
from kernel_tags import kernel_tag
def short(name):
    return kernel_tag(name) or name[:12]
tags = [short(r[name_col]) if name_col is not None else str(i) for i, r in enumerate(data)]
cols = [i for i, h in enumerate(header) if any(p in h for p in patterns)]
print("%-62s %s" % ("metric (unit)", " ".join("%12s" % t for t in tags)))
for i in sorted(cols, key=lambda i: header[i]):
    label = "%s (%s)" % (header[i], units[i]) if units[i] else header[i]
    print("%-62s %s" % (label[:62], " ".join("%12s" % r[i][:12] for r in data)))
EOF
# Where each kernel's warps stall, by SASS instruction (the source page with its sampling columns:
# e.g. the consumers' full-barrier wait loop in a gathered kernel).
ncu --import "$out/kernels.ncu-rep" --page source --csv --print-source sass >"$out/source.csv" \
  2>/dev/null
echo "== top stall locations per kernel (warp-state samples, SASS)"
python3 - "$out/source.csv" <<'EOF2'
import csv, sys
kernel, rows, header = None, [], None
def flush():
    if kernel is None or header is None or not rows:
        return
    i_s = header.index("Warp Stall Sampling (All Samples)")
    total = sum(int(r[i_s]) for r in rows if len(r) > i_s and r[i_s].isdigit())
    print("%s: %d samples" % (kernel[:90], total))
    top = sorted((r for r in rows if len(r) > i_s and r[i_s].isdigit()), key=lambda r: -int(r[i_s]))
    for r in top[:6]:
        reasons = sorted(((int(r[i]), header[i]) for i in range(len(header))
                          if header[i].startswith("stall_") and "Not Issued" not in header[i]
                          and i < len(r) and r[i].isdigit() and int(r[i]) > 0), reverse=True)[:2]
        print("  %7d  %-52s %s" % (int(r[i_s]), r[1].strip()[:52],
                                   ", ".join("%s %d" % (n, c) for c, n in reasons)))
for r in csv.reader(open(sys.argv[1])):
    if r and r[0] == "Kernel Name":
        flush()
        kernel, rows, header = (r[1] if len(r) > 1 else "?"), [], None
    elif r and r[0] == "Address":
        header = r
    elif header is not None and r:
        rows.append(r)
flush()
EOF2
# The same samples by code region (k-step loop, the MUFU epilogue loop, each mbarrier wait loop):
# which role waits, and on what (tools/ncu_regions.py).
echo "== stall samples by code region"
python3 tools/ncu_regions.py "$out/source.csv"
(cd "$out" && tar czf ncu_kernels.tgz --remove-files ./kernels.ncu-rep ./details.txt \
  ./metrics.csv ./source.csv ./ncu.log 2>/dev/null)
