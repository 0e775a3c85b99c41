#!/usr/bin/env bash
# Checks the dynamic symbol table of libmoeblaze.so against the public header:
#   1. every defined dynamic symbol is moeblaze_* (the version script hides libstdc++, cudart, ...);
#   2. every function the header declares with MOEBLAZE_API is exported, as a function;
#   3. every exported symbol is declared in the header (no undocumented exports);
#   4. the exports carry the version node moeblaze_<ABI> of the version script.
# usage: check_exports.sh <libmoeblaze.so> <moeblaze.h> <abi version>
set -euo pipefail
lib="$1" header="$2" abi="$3"
nm_bin="${NM:-nm}"

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# "0000000000012340 T moeblaze_get_version@@moeblaze_0" (binutils >= 2.35 print the version).
table="$("$nm_bin" -D --defined-only "$lib")"
echo "== nm -D --defined-only $(basename "$lib"): $(wc -l <<<"$table") symbols"

declare -A exported=()
while read -r _addr type name; do
  [[ -z "${name:-}" ]] && continue
  bare="${name%%@*}"
  # The version node itself shows up as an absolute symbol (type A) named after the node.
  if [[ "$type" == "A" && "$bare" == "moeblaze_${abi}" ]]; then continue; fi
  if [[ "$bare" != moeblaze_* ]]; then
    fail "exported symbol outside the moeblaze_ namespace: $type $name"
    continue
  fi
  if [[ "$name" == *@* && "$name" != *"@@moeblaze_${abi}" && "$name" != *"@moeblaze_${abi}" ]]; then
    fail "$bare has symbol version ${name#*@}, expected moeblaze_${abi}"
  fi
  [[ "$type" == "T" ]] || fail "$bare is exported with type $type, expected T (a function)"
  exported["$bare"]=1
done <<<"$table"

# Declarations: MOEBLAZE_API <return type> moeblaze_name(  — one per line in the header.
mapfile -t declared < <(grep -E '^[[:space:]]*MOEBLAZE_API[[:space:]]' "$header" |
  sed -nE 's/.*[[:space:]*](moeblaze_[a-z0-9_]+)[[:space:]]*\(.*/\1/p' | sort -u)
echo "== $(basename "$header"): ${#declared[@]} MOEBLAZE_API functions"
[[ ${#declared[@]} -gt 0 ]] || fail "found no MOEBLAZE_API declarations in $header"

declare -A in_header=()
for fn in "${declared[@]}"; do
  in_header["$fn"]=1
  [[ -n "${exported[$fn]:-}" ]] || fail "declared in the header but not exported: $fn"
done
for sym in "${!exported[@]}"; do
  [[ -n "${in_header[$sym]:-}" ]] || fail "exported but not declared in the header: $sym"
done

if ((failures)); then
  echo "export check FAILED ($failures problems)"
  exit 1
fi
echo "export check passed: ${#exported[@]} symbols, all moeblaze_*, all declared, all versioned moeblaze_${abi}"
