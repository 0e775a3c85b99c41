#!/usr/bin/env bash
# One device call for the patches in this folder (README.md here): the patches applied to the
# tree, then dev/cuda/run_b1_forms.sh with BEFORE_FORM=split AFTER_FORM=split2 (the build, the
# CUDA suite, the B1-forms case under memcheck and racecheck, B1's per-kernel times of the two
# forms on one library, same process per shape), then Nsight Compute on conf3 with the default
# policy (the split form): which side of B1 waits now. Summary and tables last; logs under $OUT.
#   bash dev/cuda/patches/run_patches.sh     (carry .deps; ~8 minutes)
#   NCU=0 bash dev/cuda/patches/run_patches.sh   (without the ncu step; ~5 minutes)
# The patches stay applied in the device's copy of the tree; land each here (git apply) only if
# its checks passed and it gains.
set -u -o pipefail
out="${OUT:-./patches_out}"
mkdir -p "$out"
here=dev/cuda/patches
for name in ${PATCHES-b1-split2}; do
  if command -v git >/dev/null 2>&1 && git apply --check "$here/$name.patch" 2>/dev/null; then
    git apply "$here/$name.patch"
  else
    patch -p1 -s <"$here/$name.patch" || { echo "$name: does not apply"; exit 1; }
  fi
  echo "applied: $name"
done
# 16 k-steps a B1 tile (conf2, conf3, conf6) and 32 (conf4, qwen3): the split form's range.
FORMS_SHAPES="${FORMS_SHAPES:-conf3 swiglu|--act swiglu
conf3 silu|--act silu
conf2 swiglu|--T 65536 --d 1024 --h 4096 --E 8 --k 2 --act swiglu
conf6 swiglu|--T 16384 --d 1024 --h 4096 --E 16 --k 4 --act swiglu
conf4 swiglu|--T 32768 --d 2048 --h 8192 --E 16 --k 4 --act swiglu
qwen3 swiglu|--T 32768 --d 2048 --h 768 --E 128 --k 8 --act swiglu}" \
  BEFORE_FORM=split AFTER_FORM=split2 OUT="$out/forms" timeout 420 bash dev/cuda/run_b1_forms.sh
if [ "${NCU:-1}" = 1 ]; then
  OUT="$out/ncu" NCU_TIMEOUT=150 MOEBLAZE_LIBRARY=build-device/src/libmoeblaze.so timeout 200 \
    bash tools/ncu_kernels.sh --act swiglu >"$out/ncu_table.txt" 2>&1
  echo "== Nsight Compute, conf3 SwiGLU, the default policy (B1 in the split form)"
  grep -E "^metric|gpu__time_duration|dram__bytes_(read|write).sum.per_second|sm__throughput" \
    "$out/ncu_table.txt"
  sed -n '/top stall locations/,$p' "$out/ncu_table.txt" | grep -A7 "sm90_rows_kernel<__nv_bfloat16, (int)2"
fi
