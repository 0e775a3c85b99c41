#!/usr/bin/env bash
# libmoeblaze must load where NCCL is absent: it resolves NCCL at run time (src/ep/nccl/nccl_api.hpp)
# and so must neither list libnccl among its NEEDED libraries nor import any nccl* symbol.
# usage: check_no_nccl_needed.sh <library file>
set -euo pipefail
lib="$1"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

needed="$(readelf -d "$lib" | sed -nE 's/.*\(NEEDED\).*\[(.*)\].*/\1/p' | tr '\n' ' ')"
echo "NEEDED of $(basename "$lib"): $needed"
[[ -n "$needed" ]] || fail "readelf -d listed no NEEDED entry at all (is $lib a shared library?)"
[[ "$needed" != *nccl* ]] || fail "libmoeblaze links NCCL (NEEDED: $needed)"

# Undefined dynamic symbols (section index UND) named nccl*: they would need NCCL at load time.
imports="$(readelf --dyn-syms -W "$lib" | awk '$7 == "UND" && $8 ~ /^p?nccl/ { print $8 }' |
  tr '\n' ' ')"
[[ -z "$imports" ]] || fail "libmoeblaze imports NCCL symbols: $imports"

if ((failures)); then echo "no-NCCL check FAILED"; exit 1; fi
echo "no-NCCL check passed (no NEEDED libnccl, no nccl* imports)"
