"""User metadata and metrics → plain JSON values for the manifest.

A training loop's metrics are numpy or jax scalars (``loss`` out of a jitted
step is a 0-d ``jax.Array``), not Python floats, and a diverged loss is NaN,
which strict JSON cannot hold. Both are stored as plain JSON, so the manifest
stays readable by any JSON parser; a value that has no JSON form is refused
with its key path named (``metrics['loss']``), before anything is written.
A value nested deeper than :data:`MAX_DEPTH` (or one that contains itself) is
refused the same way, before Python's recursion limit is reached.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax

#: How a non-finite float is stored: the strings Python's ``float()`` reads back.
NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
#: How deep a JSON value may nest (dicts and lists inside each other); deeper is refused at
#: save, so that no reader (``json.loads`` recurses once per level) ever meets it.
MAX_DEPTH = 256


def to_json_value(value: Any, where: str, *, non_finite: bool = False) -> Any:
    """``value`` as plain JSON types (dict, list, str, int, float, bool, None).

    numpy and jax scalars and 0-d arrays become Python scalars; tuples become
    lists; NaN and infinities become the strings in :data:`NON_FINITE`, or stay
    floats with ``non_finite`` (a document whose writer records where they are:
    :func:`objckpt.core.items.stored_document`).
    ``where`` names the value in errors (``metrics``, ``metadata``).

    Raises:
        TypeError: a value with no JSON form, naming its key path.
        ValueError: a value nested deeper than :data:`MAX_DEPTH`, or containing itself.
    """
    return _convert(value, where, 0, non_finite)


def _convert(value: Any, where: str, depth: int, non_finite: bool) -> Any:
    if value is None or type(value) in (str, bool, int):
        return value
    if isinstance(value, (str, bool, int)):
        return _plain(value)
    if isinstance(value, float):
        return float(value) if non_finite else _float(float(value))
    if isinstance(value, (Mapping, list, tuple)) and depth >= MAX_DEPTH:
        raise ValueError(
            f"{where[:200]}{'...' if len(where) > 200 else ''} nests deeper than {MAX_DEPTH} levels"
            " (or contains itself): JSON values are refused past that depth"
        )
    if isinstance(value, Mapping):
        return {_key(k, where): _convert(v, f"{where}[{k!r}]", depth + 1, non_finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_convert(v, f"{where}[{i}]", depth + 1, non_finite) for i, v in enumerate(value)]
    if isinstance(value, _array_types()):
        item = _array_scalar(value, where)  # type: ignore[arg-type]  # the types are the annotation's
        return _float(item) if isinstance(item, float) and not non_finite else item
    raise TypeError(
        f"save metadata must be JSON-serialisable: {where} is of type {_type_name(value)}"
        " (allowed: dict, list, tuple, str, int, float, bool, None, numpy/jax scalars and 0-d arrays)"
    )


def _array_types() -> tuple[type, ...]:
    """numpy's scalar and array types, and ``jax.Array`` once JAX is imported: no value can
    be a ``jax.Array`` before, and the command line (``objckpt gc``) does without JAX."""
    jax = sys.modules.get("jax")
    return (np.generic, np.ndarray) if jax is None else (np.generic, np.ndarray, jax.Array)


def _plain(value: str | bool | int) -> str | bool | int:
    """A subclass of str/bool/int (``np.str_``, an ``IntEnum``) as the plain built-in."""
    if isinstance(value, str):
        return str(value)
    return bool(value) if isinstance(value, bool) else int(value)


def _float(value: float) -> float | str:
    return value if math.isfinite(value) else NON_FINITE[repr(value)]


def _key(key: Any, where: str) -> str | int:
    """A dict key JSON can hold (it writes int keys as strings, as ``json.dumps`` does)."""
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"save metadata must be JSON-serialisable: {where} has a key {key!r} (keys must be str or int)")
    return str(key) if isinstance(key, str) else int(key)


def _array_scalar(value: np.generic | np.ndarray | jax.Array, where: str) -> bool | int | float:
    """A numpy/jax scalar or 0-d array as a Python bool, int or float (NaN and infinities as they are)."""
    if value.ndim != 0:
        raise TypeError(
            f"save metadata must be JSON-serialisable: {where} is an array of shape {tuple(value.shape)}"
            " (only scalars and 0-d arrays; pass .tolist() to store its values)"
        )
    if not isinstance(value, (np.generic, np.ndarray)) and value.is_deleted():
        raise TypeError(f"save metadata must be JSON-serialisable: {where} is a deleted (donated) jax.Array")
    item = np.asarray(value).item()
    if isinstance(item, bool):
        return item
    if isinstance(item, int):
        return item
    if isinstance(item, float):
        return item
    raise TypeError(f"save metadata must be JSON-serialisable: {where} is a 0-d array of dtype {value.dtype}")


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
