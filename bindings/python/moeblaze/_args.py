"""Strict conversions of Python arguments to the C types of the API.

ctypes and int() are lenient where a wrong value should be an error: int(8.5) and int('8') give
8, a ctypes int64 field silently keeps the low 64 bits of 2**64 + 8, and numpy's same-kind cast
narrows int64 ids beyond int32, float64 arrays to float32 and takes bool arrays as integers. Every
integer argument goes through integer() (an int, or an object with __index__ such as a numpy
integer, in the C type's range), every coefficient through real(), every on/off option through
flag() (bool('no') is True) and every numpy array through array_as() (only conversions that keep
every value); a failure names the argument.
"""

from __future__ import annotations

import numbers
import operator

_RANGES = {
    "int32": (-(1 << 31), (1 << 31) - 1),
    "uint32": (0, (1 << 32) - 1),
    "int64": (-(1 << 63), (1 << 63) - 1),
    "size_t": (0, (1 << 64) - 1),
}


def integer(value, name: str, ctype: str = "int64") -> int:
    """`value` as a Python int that fits `ctype`; TypeError or OverflowError naming `name`."""
    if _is_bool(value) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    result = operator.index(value)
    low, high = _RANGES[ctype]
    if not low <= result <= high:
        raise OverflowError(f"{name} = {result} does not fit the C type {ctype} "
                            f"([{low}, {high}])")
    return result


def real(value, name: str) -> float:
    """`value` as a float: a real number (int, float, numpy scalar), never a string."""
    if _is_bool(value) or not _is_real(value):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def flag(value, name: str) -> bool:
    """`value` as a bool: a Python or numpy bool only (not 0/1, not a string such as 'no')."""
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def _is_bool(value) -> bool:
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")


def _is_real(value) -> bool:
    # numpy's floating and integer scalars register as numbers.Real; complex ones do not.
    return isinstance(value, numbers.Real)


def fits(array, dtype, name: str) -> None:
    """Raises OverflowError naming `name` when an integer array holds values that `dtype` (an
    integer dtype it is about to be cast to) cannot represent: the cast would wrap them."""
    import numpy as np  # the ctypes layer itself does not need numpy

    dtype = np.dtype(dtype)
    if array.dtype.kind not in "iu" or dtype.kind not in "iu" or array.size == 0:
        return
    info = np.iinfo(dtype)
    low, high = int(array.min()), int(array.max())
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise OverflowError(f"{name}: value {bad} does not fit {dtype} "
                            f"([{info.min}, {info.max}]); a cast would change it")


def array_as(array, dtype, name: str):
    """`array` (a numpy array) converted to `dtype` where no value changes: an integer array whose
    values fit an integer `dtype` (fits() checks them), or a floating array that widens losslessly
    to a floating `dtype` (float16 -> float32 -> float64). Anything else raises TypeError naming
    `name`: float64 to float32 would round silently, and bools are not ids or activations."""
    import numpy as np

    dtype = np.dtype(dtype)
    source = array.dtype
    if source == dtype:
        return array
    if dtype.kind in "iu" and source.kind in "iu":
        fits(array, dtype, name)  # int64 ids beyond int32 are refused, not wrapped
        return array.astype(dtype)
    if dtype.kind == "f" and source.kind == "f" and np.can_cast(source, dtype, casting="safe"):
        return array.astype(dtype)
    if dtype.kind in "iu":
        raise TypeError(f"{name}: expected an integer array ({dtype}), got dtype {source}")
    if dtype.kind == "f" and source.kind == "f":
        raise TypeError(f"{name}: expected dtype {dtype}, got {source} (a cast would round it; "
                        f"convert it explicitly with .astype(numpy.{dtype}))")
    raise TypeError(f"{name}: expected dtype {dtype}, got {source}")
