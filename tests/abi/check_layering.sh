#!/usr/bin/env bash
# The source tree's layering (CONTRIBUTING.md, "Layering"): which folders of src/ may include
# which. api/ -> ep/ -> common/ <- cpu/, cuda/; common/ includes only itself; ep/ includes only
# common/ and itself (it reaches the backends through common/backend.hpp); cpu/ and cuda/ never
# include each other, api/ or ep/. Quoted includes only; system headers are not restricted.
# usage: check_layering.sh <repository root>
set -euo pipefail
root="$1/src"
failures=0

# check <folder> <allowed prefixes...>: every '#include "a/b"' of the folder starts with one of
# them ("" allows a header of the same folder, written without a folder).
check() {
  local folder="$1"
  shift
  local file target allowed ok
  while IFS= read -r -d '' file; do
    while IFS= read -r target; do
      ok=0
      for allowed in "$@"; do
        if [[ -z "$allowed" && "$target" != */* ]] || [[ -n "$allowed" && "$target" == "$allowed"* ]]; then
          ok=1
        fi
      done
      [[ "$target" == "moeblaze.h" ]] && ok=1
      if ((ok == 0)); then
        echo "FAIL: ${file#"$root/"} includes \"$target\" (src/$folder may include its own headers and:${*})"
        failures=$((failures + 1))
      fi
    done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]+"([^"]+)".*/\1/p' "$file")
  done < <(find "$root/$folder" -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' \) -print0)
}

check common "" common/
check ep "" common/ ep/
check cpu "" common/ cpu/
check cuda "" common/ cuda/
check cuda_absent "" common/
check api "" api/ common/ ep/

if ((failures)); then echo "layering check FAILED ($failures includes)"; exit 1; fi
echo "layering check passed: api -> ep -> common <- cpu, cuda; cpu and cuda independent"
