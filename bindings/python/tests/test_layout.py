"""The ctypes mirrors match the C header: field names/order, sizes, offsets and constants.

Needs no libmoeblaze: the C side is measured by compiling a probe against include/moeblaze.h."""

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from conftest import HEADER
from moeblaze import _lib

STRUCTS = _lib.STRUCTS


def _header_text():
    return HEADER.read_text()


def _header_fields(typedef_name):
    text = _header_text()
    tag = typedef_name[:-2]  # moeblaze_forward_args_t -> moeblaze_forward_args
    match = re.search(r"typedef struct %s \{(.*?)\} %s;" % (tag, typedef_name), text, re.S)
    assert match, f"{typedef_name} not found in {HEADER}"
    body = re.sub(r"/\*.*?\*/", "", match.group(1), flags=re.S)
    return re.findall(r"(\w+)\s*;", body)


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_field_names_and_order_match_header(name):
    assert [f[0] for f in STRUCTS[name]._fields_] == _header_fields(name)


def _compile_probe(tmp_path):
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        pytest.skip("no C compiler to measure the C layout")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "moeblaze.h"',
             "int main(void) {"]
    for name, struct in STRUCTS.items():
        lines.append(f'  printf("{name} sizeof %zu\\n", sizeof({name}));')
        lines.append(f'  printf("{name} alignof %zu\\n", (size_t)_Alignof({name}));')
        for field, _ in struct._fields_:
            lines.append(f'  printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
    lines += ["  return 0;", "}"]
    source = tmp_path / "layout_probe.c"
    source.write_text("\n".join(lines) + "\n")
    binary = tmp_path / "layout_probe"
    subprocess.run([compiler, "-std=c11", "-I", str(HEADER.parent), str(source), "-o",
                    str(binary)], check=True)
    output = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    measured = {}
    for line in output.splitlines():
        struct, key, value = line.split()
        measured[(struct, key)] = int(value)
    return measured


def test_sizes_and_offsets_match_c(tmp_path):
    measured = _compile_probe(tmp_path)
    for name, struct in STRUCTS.items():
        assert ctypes.sizeof(struct) == measured[(name, "sizeof")], name
        assert ctypes.alignment(struct) == measured[(name, "alignof")], name
        for field, _ in struct._fields_:
            assert getattr(struct, field).offset == measured[(name, field)], f"{name}.{field}"


def test_constants_match_header():
    text = _header_text()
    defines = dict(re.findall(r"#define (MOEBLAZE_\w+) (\d+)u?\b", text))
    enums = dict(re.findall(r"\b(MOEBLAZE_\w+) = (\d+)", text))
    assert int(defines["MOEBLAZE_ABI_VERSION"]) == _lib.EXPECTED_ABI_VERSION
    assert int(defines["MOEBLAZE_MAX_EXPERTS"]) == _lib.MAX_EXPERTS
    assert int(defines["MOEBLAZE_MAX_TOP_K"]) == _lib.MAX_TOP_K
    assert int(defines["MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD"]) == _lib.BACKWARD_ACCUMULATE_WGRAD
    checked = 0
    for c_name, value in enums.items():
        py_name = c_name[len("MOEBLAZE_"):]
        assert hasattr(_lib, py_name), f"_lib lacks {py_name} (header has {c_name})"
        assert getattr(_lib, py_name) == int(value), c_name
        checked += 1
    assert checked >= 35  # every enumerator of the header, not a lucky subset


def test_every_header_function_has_a_signature():
    declared = set(re.findall(r"MOEBLAZE_API [^;]*?\b(moeblaze_\w+)\s*\(", _header_text()))
    assert declared == set(_lib.SIGNATURES)


# C field types -> the ctypes type the mirror must use. Pointers to data are c_void_p (tensors,
# buffers) or POINTER(c_int32) (int32 index arrays); either way one pointer wide.
_C_TO_CTYPES = {
    "uint32_t": ctypes.c_uint32,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "size_t": ctypes.c_size_t,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}


def _header_field_types(typedef_name):
    tag = typedef_name[:-2]
    match = re.search(r"typedef struct %s \{(.*?)\} %s;" % (tag, typedef_name), _header_text(), re.S)
    body = re.sub(r"/\*.*?\*/", "", match.group(1), flags=re.S)
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if decl:
            ctype, name = decl.rsplit(" ", 1)
            fields.append((name.lstrip("*"), (ctype + "*" * name.count("*")).replace("const ", "")))
    return fields


@pytest.mark.parametrize("name", sorted(STRUCTS))
def test_field_types_match_header(name):
    py_fields = dict(STRUCTS[name]._fields_)
    for field, ctype in _header_field_types(name):
        py_type = py_fields[field]
        if ctype.endswith("*"):
            allowed = {ctypes.c_void_p}
            if ctype.rstrip("*") in _C_TO_CTYPES:
                allowed.add(ctypes.POINTER(_C_TO_CTYPES[ctype.rstrip("*")]))
            assert py_type in allowed, f"{name}.{field}: {ctype} mirrored as {py_type}"
        else:
            assert ctype in _C_TO_CTYPES, f"{name}.{field}: unknown C type {ctype}"
            assert py_type is _C_TO_CTYPES[ctype], f"{name}.{field}: {ctype} mirrored as {py_type}"


def _header_enum(prefix):
    """{suffix: code} of the header's enumerators MOEBLAZE_<prefix>_<suffix>."""
    return {name: int(value) for name, value in
            re.findall(r"\bMOEBLAZE_%s_(\w+) = (\d+)" % prefix, _header_text())}


def _activation_list():
    """(Name, CODE, GATED) of src/common/activations.def, the library's one list."""
    text = (HEADER.parent.parent / "src" / "common" / "activations.def").read_text()
    return [(name, code, gated == "true") for name, code, gated in
            re.findall(r"^MOEBLAZE_ACTIVATION\((\w+), (\w+), (true|false), \w+\)", text, re.M)]


@pytest.mark.parametrize("table, prefix", [
    ("ACTIVATIONS", "ACTIVATION"), ("CHECKPOINTS", "CHECKPOINT"),
    ("SCORE_FUNCTIONS", "SCORE"), ("BACKENDS", "BACKEND")])
def test_name_tables_match_header(table, prefix):
    header = {name.lower(): code for name, code in _header_enum(prefix).items()}
    assert header, prefix
    assert getattr(_lib, table) == header


def test_dtype_table_matches_header():
    assert sorted(_lib.DTYPES.values()) == sorted(_header_enum("DTYPE").values())


def test_gated_activations_match_the_library_list():
    listed = _activation_list()
    header = _header_enum("ACTIVATION")
    # the list and the header agree (as the C++ build and api_activation_list also check) ...
    assert [code for _, code, _ in listed] == [f"MOEBLAZE_ACTIVATION_{n}" for n in header]
    assert [name.upper() for name, _, _ in listed] == list(header)
    # ... and the binding's gated set is the list's
    assert _lib.GATED_ACTIVATIONS == {name.lower() for name, _, gated in listed if gated}
