"""The dtypes a checkpoint may hold, by name.

A manifest names dtypes as strings; resolving them through a fixed table (not
``np.dtype(untrusted_string)``) keeps hostile manifests from asking numpy for
object or structured dtypes. ml_dtypes (a JAX dependency) provides bfloat16,
the float8 family and the sub-byte integers, which numpy stores one per byte.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

_NUMPY_NAMES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip
_ML_NAMES = [
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float4_e2m1fn",
    "float6_e2m3fn", "float6_e3m2fn", "int2", "int4", "uint2", "uint4",
]  # fmt: skip

if TYPE_CHECKING:
    DTYPES: dict[str, np.dtype]  # the table, by name: made on first use


@functools.cache
def _table() -> dict[str, np.dtype]:
    """The table, made on first use: importing ml_dtypes costs about a CPU-second, which
    the commands that never read a dtype (``objckpt ls``, ``gc``, ``rm``) do without."""
    import ml_dtypes

    table = {name: np.dtype(name) for name in _NUMPY_NAMES}
    for name in _ML_NAMES:
        if hasattr(ml_dtypes, name):
            table[name] = np.dtype(getattr(ml_dtypes, name))
    return table


def __getattr__(name: str) -> dict[str, np.dtype]:
    if name == "DTYPES":
        return _table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: np.dtype) -> str:
    """The manifest name of a dtype; raises TypeError for dtypes we cannot store."""
    dtype = np.dtype(dtype)
    name = dtype.name
    if _table().get(name) != dtype:
        raise TypeError(f"dtype {dtype!r} cannot be checkpointed")
    return name


def dtype_from_name(name: str) -> np.dtype | None:
    """The dtype for a manifest name, or None when it is not one we know."""
    return _table().get(name)
