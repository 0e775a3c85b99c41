#!/usr/bin/env bash
# Checks that the library's SONAME is libmoeblaze.so.<ABI> and that the build tree has the symlink
# chain libmoeblaze.so -> libmoeblaze.so.<ABI> -> libmoeblaze.so.<full version>.
# usage: check_soname.sh <real library file> <abi version> <full version>
set -euo pipefail
lib="$1" abi="$2" version="$3"
dir="$(dirname "$lib")"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

soname="$(readelf -d "$lib" | sed -nE 's/.*\(SONAME\).*\[(.*)\].*/\1/p')"
echo "SONAME of $(basename "$lib"): ${soname:-<none>}"
[[ "$soname" == "libmoeblaze.so.${abi}" ]] || fail "SONAME is '${soname}', expected libmoeblaze.so.${abi}"

[[ "$(basename "$lib")" == "libmoeblaze.so.${version}" ]] ||
  fail "real file is $(basename "$lib"), expected libmoeblaze.so.${version}"
for link in "libmoeblaze.so" "libmoeblaze.so.${abi}"; do
  if [[ ! -L "$dir/$link" ]]; then
    fail "$dir/$link is not a symlink"
  elif [[ "$(readlink -f "$dir/$link")" != "$(readlink -f "$lib")" ]]; then
    fail "$link does not resolve to $(basename "$lib")"
  else
    echo "$link -> $(readlink "$dir/$link")"
  fi
done
# Nothing but the C and C++ runtimes and libc should be needed at load time: no libcudart.so.
needed="$(readelf -d "$lib" | sed -nE 's/.*\(NEEDED\).*\[(.*)\].*/\1/p' | tr '\n' ' ')"
echo "NEEDED: $needed"
[[ "$needed" != *cudart* ]] || fail "links the CUDA runtime dynamically (expected cudart_static)"

if ((failures)); then echo "soname check FAILED"; exit 1; fi
echo "soname check passed"
