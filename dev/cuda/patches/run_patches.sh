#!/usr/bin/env bash
# The device calls for the patches in this folder (README.md here), one STAGE per call (each
# ~5-8 minutes; carry .deps). Every stage runs dev/cuda/run_b1_forms.sh on the patched tree: the
# build, the CUDA suite, the B1-forms test case under memcheck and racecheck, then B1's per-kernel
# times of two variants on the shapes below, same process per shape. Summary and tables last;
# logs under $OUT.
#   STAGE=split2 (the default): b1-split2.patch; the split form against split2, both forced by
#     MOEBLAZE_CUDA_B1_FORM on one library; the consumers' form against split2 at 8 k-steps
#     (conf5, conf1); then (NCU=0 skips it) Nsight Compute on conf3 with the default policy (the
#     split form): which side of B1 waits now.
#   STAGE=early: b1-split2.patch on both sides, b1-split-early-loads.patch on the AFTER side; both
#     in the form MOEBLAZE_CUDA_B1_FORM names if exported (e.g. split2 if call 1 adopted it),
#     else the policy.
# The patches stay applied in the device's copy of the tree; land each here (git apply) only if
# its checks passed and it gains.
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
# 16 k-steps a B1 tile (conf2, conf3, conf6) and 32 (conf4, qwen3): the split forms' range.
export FORMS_SHAPES="${FORMS_SHAPES:-conf3 swiglu|--act swiglu
conf3 silu|--act silu
conf2 swiglu|--T 65536 --d 1024 --h 4096 --E 8 --k 2 --act swiglu
conf6 swiglu|--T 16384 --d 1024 --h 4096 --E 16 --k 4 --act swiglu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
qwen3 swiglu|--T 32768 --d 2048 --h 768 --E 128 --k 8 --act swiglu}"
case "${STAGE:-split2}" in
  split2)
    apply b1-split2
    BEFORE_FORM=split AFTER_FORM=split2 OUT="$out/forms" timeout 360 \
      bash dev/cuda/run_b1_forms.sh
    # 8 k-steps (d = 512), where the policy runs the consumers' form: does split2 pay there too?
    CHECK=0 AB_DIR=env BEFORE_ENV=MOEBLAZE_CUDA_B1_FORM=consumers \
      AFTER_ENV=MOEBLAZE_CUDA_B1_FORM=split2 OUT="$out/short" \
      PROFILE_SHAPES="conf5 swiglu|--T 32768 --d 512 --h 2048 --E 16 --k 4 --act swiglu
conf1 swiglu|--T 65536 --d 512 --h 2048 --E 4 --k 1 --act swiglu" \
      timeout 90 bash dev/cuda/run_library_ab.sh >"$out/short.log" 2>&1
    echo "== B1, 8 k-steps: before = MOEBLAZE_CUDA_B1_FORM=consumers, after = split2"
    sed -n '/^== per-kernel/,$p' "$out/short.log"
    if [ "${NCU:-1}" = 1 ]; then
      OUT="$out/ncu" NCU_TIMEOUT=110 MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so \
        timeout 150 bash tools/ncu_kernels.sh --act swiglu >"$out/ncu_table.txt" 2>&1
      echo "== Nsight Compute, conf3 SwiGLU, the default policy (B1 in the split form)"
      grep -E "^metric|gpu__time_duration|dram__bytes_(read|write).sum.per_second|sm__throughput" \
        "$out/ncu_table.txt"
      sed -n '/top stall locations/,$p' "$out/ncu_table.txt" |
        grep -A7 "sm90_rows_kernel<__nv_bfloat16, (int)2"
    fi
    ;;
  early)
    apply b1-split2
    rm -rf .ab && mkdir -p .ab && cp src/cuda/sm90/rows_gemm.cu .ab/
    apply b1-split-early-loads
    AB_DIR=.ab OUT="$out/early" timeout 560 bash dev/cuda/run_b1_forms.sh
    ;;
  *) echo "unknown STAGE: ${STAGE}" >&2; exit 2 ;;
esac
