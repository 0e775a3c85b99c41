#!/usr/bin/env python3
"""src/common/activations.def (the library's one list of activations) against include/moeblaze.h:
the same codes, in code order, named alike (SwiGLU <-> MOEBLAZE_ACTIVATION_SWIGLU), and GATED true
exactly for the *GLU activations, as the header documents. The C++ build checks the order
(static_assert in layer_desc.hpp) but cannot see a header code that the list lacks; this can.

    python3 tests/api/check_activation_list.py [--root DIR]
"""
import argparse
import os
import re
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    root = parser.parse_args().root
    with open(os.path.join(root, "include", "moeblaze.h")) as f:
        header = f.read()
    with open(os.path.join(root, "src", "common", "activations.def")) as f:
        listed = re.findall(r"^MOEBLAZE_ACTIVATION\((\w+), (\w+), (true|false), (\w+)\)\s*$",
                            f.read(), re.M)
    enum = re.search(r"enum moeblaze_activation_code \{(.*?)\};", header, re.S)
    codes = re.findall(r"\b(MOEBLAZE_ACTIVATION_\w+) = (\d+)", enum.group(1))
    errors = []
    if [c for c, _ in codes] != [code for _, code, _, _ in listed]:
        errors.append(f"codes differ: header {[c for c, _ in codes]}, "
                      f"activations.def {[code for _, code, _, _ in listed]}")
    if [int(v) for _, v in codes] != list(range(len(codes))):
        errors.append(f"header codes are not 0..{len(codes) - 1} in order: {codes}")
    for name, code, gated, _ in listed:
        if code != "MOEBLAZE_ACTIVATION_" + name.upper():
            errors.append(f"{name} is listed with {code}")
        if (gated == "true") != name.upper().endswith("GLU"):
            errors.append(f"{name}: GATED = {gated}, but the header's gated activations are *GLU")
    for e in errors:
        print("check_activation_list:", e)
    print(f"check_activation_list: {len(listed)} activations,",
          "FAILED" if errors else "the list matches the header")
    return 1 if errors or not listed else 0


if __name__ == "__main__":
    sys.exit(main())
