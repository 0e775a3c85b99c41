#!/usr/bin/env bash
# The device call for the patch in this folder (README.md here); carry .deps. The summary and
# tables come last, the logs under $OUT. ~7-8 minutes on a warm machine (a cold one adds ~1).
#   BEFORE = the working tree (main); AFTER = it + b1-epilogue-warps-lean.patch. The AFTER library
#   and CUDA tests are built and checked while the BEFORE library builds beside them: the B1-forms
#   case in full (every form forced, SwiGLU and SiLU, SAVE_ALL included), the whole CUDA suite
#   (quick), then memcheck and racecheck over the forms case (quick); then every output's digest
#   under both libraries (tools/output_digest.py: the patch claims the same bits). Then B1's times of
#   both libraries under the default policy, same process per shape (run_library_ab.sh
#   AB_DIR=prebuilt): the split form at 16 k-steps (conf3 SwiGLU, SiLU, and SwiGLU under
#   save_all: the HAVE_U instantiation), 32 (conf4), split2 at 8 (conf5), the epilogue-warp form
#   at 64 (mixtral). Last, on the patched library with the forms forced, the split against the
#   epilogue-warp form at 16 and 32 k-steps: faster epilogue warps move the balance between them.
#   That is STAGE=lean (the default). STAGE=band (~7 minutes): sm90-band-knob.patch alone on
#   main: the tile-rasterisation case (every band keeps every bit) in full and under memcheck, then
#   on conf3 Nsight Compute's DRAM bytes and time per kernel for bands of 8, 1, 16 and 32 m-tiles
#   (dev/cuda/tile_order_dram_model.py's predictions are in the README), and back-to-back steps at
#   the power cap (profile_kernels.py --clocks 6) for bands 8, 1, 16, 32 and 8 again.
# The patch stays applied in the device's copy of the tree; land it here (git apply) only if its
# checks passed and it gains.
set -u -o pipefail
out="${OUT:-./patches_out}"
mkdir -p "$out"
here=dev/cuda/patches
apply() {
  if command -v git >/dev/null 2>&1 && git apply --check "$here/$1.patch" 2>/dev/null; then
    git apply "$here/$1.patch"
  else
    patch -p1 -s <"$here/$1.patch" || { echo "$1: does not apply"; exit 1; }
  fi
  echo "applied: $1"
}
doctest=""
[ -f .deps/doctest/doctest/doctest.h ] && doctest="-DMOEBLAZE_DOCTEST_DIR=$(pwd)/.deps/doctest"
# The patched library under two forced B1 forms, same process per shape (run_library_ab.sh
# AB_DIR=env): forms_ab NAME BEFORE_FORM AFTER_FORM TIMEOUT_S SHAPES.
forms_ab() {
  CHECK=0 AB_DIR=env BEFORE_ENV="MOEBLAZE_CUDA_B1_FORM=$2" AFTER_ENV="MOEBLAZE_CUDA_B1_FORM=$3" \
    OUT="$out/$1" PROFILE_SHAPES="$5" timeout "$4" bash dev/cuda/run_library_ab.sh \
    >"$out/$1.log" 2>&1
  echo "== patched, $1: before = MOEBLAZE_CUDA_B1_FORM=$2, after = $3"
  sed -n '/^== per-kernel/,$p' "$out/$1.log"
}
build_patched() {
  { cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEBLAZE_CUDA=ON \
      -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_WERROR=OFF -DMOEBLAZE_BUILD_EXAMPLES=OFF $doctest &&
    cmake --build build-device -j 16 --target moeblaze moeblaze_tests_cuda; } >"$out/build.log" 2>&1 ||
    { tail -30 "$out/build.log"; exit 1; }
  echo "after build: $(($(date +%s) - t0)) s"
}
t0=$(date +%s)
case "${STAGE:-lean}" in
  lean)
    rm -rf /tmp/moeblaze_before && mkdir -p /tmp/moeblaze_before
    tar --exclude=./build-device --exclude=./.git -cf - . | tar -xf - -C /tmp/moeblaze_before
    apply b1-epilogue-warps-lean
    build_patched
    (cd /tmp/moeblaze_before && cmake -S . -B build-before -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DMOEBLAZE_CUDA=ON -DMOEBLAZE_CUDA_ARCHS=90a -DMOEBLAZE_BUILD_EXAMPLES=OFF \
      -DMOEBLAZE_BUILD_TESTS=OFF >"$out/build_before.log" 2>&1 &&
      cmake --build build-before -j 12 --target moeblaze >>"$out/build_before.log" 2>&1) &
    before_pid=$!
    tests=build-device/tests/moeblaze_tests_cuda
    timeout 150 "$tests" --no-version=true -tc='*epilogue forms*' >"$out/forms_test.log" 2>&1
    echo "forms test (full): exit $? | $(grep -E '^\[doctest\] (test cases|assertions)' \
      "$out/forms_test.log" | tr -s ' ' | tr '\n' ' ')"
    MOEBLAZE_TEST_QUICK=1 timeout 150 "$tests" --no-version=true >"$out/suite.log" 2>&1
    echo "CUDA suite (quick): exit $? | $(grep -E '^\[doctest\] (test cases|assertions)' \
      "$out/suite.log" | tr -s ' ' | tr '\n' ' ')"
    for tool in memcheck racecheck; do
      MOEBLAZE_TEST_QUICK=1 timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 17 \
        "$tests" --no-version=true -tc='*epilogue forms*' >"$out/$tool.log" 2>&1
      echo "$tool (B1 forms, quick): exit $? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' \
        "$out/$tool.log" | tail -n 1) | $(grep -E '^\[doctest\] test cases' "$out/$tool.log")"
    done
    wait "$before_pid" || { tail -20 "$out/build_before.log"; exit 1; }
    echo "before build done at $(($(date +%s) - t0)) s"
    # The patch claims every output's bits: one fwd+bwd per shape x activation x policy with each
    # library, digests compared (tools/output_digest.py; B1 at 8-64 k-steps, partial tiles).
    for side in before after; do
      lib=build-device/src/libmoeblaze.so
      [ "$side" = before ] && lib=/tmp/moeblaze_before/build-before/src/libmoeblaze.so
      MOEBLAZE_LIBRARY="$lib" timeout 120 python3 tools/output_digest.py >"$out/digest_$side.txt" \
        2>&1
    done
    if diff "$out/digest_before.txt" "$out/digest_after.txt" >"$out/digest.diff"; then
      echo "digests: $(wc -l <"$out/digest_after.txt") runs, bitwise identical to main"
    else
      echo "digests: DIFFER from main ($(grep -c '^>' "$out/digest.diff") of" \
        "$(wc -l <"$out/digest_after.txt") runs; $out/digest.diff)"
    fi
    CHECK=0 AB_DIR=prebuilt OUT="$out/ab" PROFILE_SHAPES="conf3 swiglu|--act swiglu
    conf3 silu|--act silu
    conf3 save_all|--act swiglu --policy save_all
    conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
    conf5 swiglu|--T 32768 --d 512 --h 2048 --E 16 --k 4 --act swiglu
    mixtral swiglu|--T 16384 --d 4096 --h 14336 --E 8 --k 2 --act swiglu" \
      timeout 300 bash dev/cuda/run_library_ab.sh >"$out/ab.log" 2>&1
    echo "== B1: before = main, after = + b1-epilogue-warps-lean (the default policy)"
    sed -n '/^== per-kernel/,$p' "$out/ab.log"
    forms_ab k16 split warps 70 "conf3 swiglu|--act swiglu"
    forms_ab k32 split warps 90 "conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu"
    ;;
  band)
    apply sm90-band-knob
    build_patched
    tests=build-device/tests/moeblaze_tests_cuda
    timeout 120 "$tests" --no-version=true -tc='*rasterisation*' >"$out/band_test.log" 2>&1
    echo "rasterisation case (full): exit $? | $(grep -E '^\[doctest\] (test cases|assertions)' \
      "$out/band_test.log" | tr -s ' ' | tr '\n' ' ')"
    MOEBLAZE_TEST_QUICK=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 17 \
      "$tests" --no-version=true -tc='*rasterisation*' >"$out/band_memcheck.log" 2>&1
    echo "memcheck (rasterisation case): exit $? | $(grep -E 'ERROR SUMMARY' \
      "$out/band_memcheck.log" | tail -n 1)"
    echo "== Nsight Compute, conf3 SwiGLU: DRAM GB read / written and ms per kernel"
    for band in 8 1 16 32; do
      MOEBLAZE_CUDA_BAND_MTILES=$band MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so \
        timeout 90 ncu --clock-control none -k regex:sm90_ --launch-skip 18 --launch-count 6 \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        --export "$out/ncu_band$band" --force-overwrite \
        python3 tests/cuda/profile_kernels.py --rows 1 --act swiglu >"$out/ncu_band$band.log" 2>&1
      ncu --import "$out/ncu_band$band.ncu-rep" --page raw --csv >"$out/ncu_band$band.csv" 2>/dev/null
      python3 - "$out/ncu_band$band.csv" "$band" <<'PY'
import csv, sys
sys.path.insert(0, "tools")
from kernel_tags import kernel_tag
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3:
    sys.exit(f"band {sys.argv[2]}: no metrics (see ncu_band{sys.argv[2]}.log)")
head, units, data = rows[0], rows[1], rows[2:]
scale = {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "Tbyte": 1e3,
         "nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}
def value(r, name):
    i = head.index(name)
    return float(r[i].replace(",", "")) * scale.get(units[i], 1.0)
print(f"band {sys.argv[2]:>3}: " + "  ".join(
    f"{kernel_tag(r[head.index('Kernel Name')]) or '?'} "
    f"{value(r, 'dram__bytes_read.sum'):.2f}/{value(r, 'dram__bytes_write.sum'):.2f} GB "
    f"{value(r, 'gpu__time_duration.sum'):.2f} ms" for r in data))
PY
    done
    echo "== back-to-back conf3 SwiGLU steps at the power cap (profile_kernels.py --clocks 6)"
    for band in 8 1 16 32 8; do
      MOEBLAZE_CUDA_BAND_MTILES=$band MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so \
        timeout 60 python3 tests/cuda/profile_kernels.py --rows 1 --act swiglu --clocks 6 \
        >"$out/clocks_band$band.log" 2>&1
      echo "band $band: $(grep -E '^clocks:' "$out/clocks_band$band.log")"
    done
    ;;
  *) echo "unknown STAGE: ${STAGE}" >&2; exit 2 ;;
esac
echo "total: $(($(date +%s) - t0)) s"
