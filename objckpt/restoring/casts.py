"""Dtype casts on restore: which are allowed as asked, and the check of their values.

A target whose dtype differs from the saved one asks for a cast. Casts that keep
every value (widening, int → float, float precision downcasts) go ahead; those
that can change a value's kind or range are refused from the dtypes alone,
before anything is read, unless ``restore(..., cast="unsafe")``; a float
downcast whose finite value overflows to inf fails once its bytes are in.
"""

from __future__ import annotations

import jax
import numpy as np

from objckpt.errors import TargetMismatchError

#: What ``restore(..., cast=...)`` accepts: "checked" refuses casts that lose
#: values (:func:`check_cast`, :func:`cast_values`); "unsafe" is numpy's astype.
CASTS = ("checked", "unsafe")


def _category(dtype: np.dtype) -> str:
    """bool, int, uint, float or complex (ml_dtypes' bfloat16, float8 and int4 included)."""
    for name, kind in (
        ("bool", jax.numpy.bool_),
        ("uint", jax.numpy.unsignedinteger),
        ("int", jax.numpy.signedinteger),
        ("float", jax.numpy.floating),
        ("complex", jax.numpy.complexfloating),
    ):
        if jax.numpy.issubdtype(dtype, kind):
            return name
    return "other"


def _range_fits(saved: np.dtype, target: np.dtype) -> bool:
    """Whether every value of integer (or bool) dtype ``saved`` is a value of integer dtype ``target``."""
    if _category(saved) == "bool":
        return True
    small, large = jax.numpy.iinfo(saved), jax.numpy.iinfo(target)
    return large.min <= small.min and small.max <= large.max


def check_cast(path: str, saved: np.dtype, target: np.dtype) -> None:
    """Refuse, from the dtypes alone, a cast that can change a value beyond precision.

    Allowed: numpy's safe casts, integer casts whose range holds the saved one,
    and anything into a float or complex dtype (from bool, int or float; complex
    only into complex): a float precision downcast, for which
    :func:`cast_values` then checks that no finite value overflowed.

    Raises:
        TargetMismatchError: naming the leaf, both dtypes and ``cast="unsafe"``.
    """
    if saved == target or np.can_cast(saved, target, "safe"):
        return
    source, dest = _category(saved), _category(target)
    if dest in ("int", "uint") and source in ("bool", "int", "uint") and _range_fits(saved, target):
        return
    if dest == "float" and source in ("bool", "int", "uint", "float"):
        return
    if dest == "complex" and source != "other":
        return
    raise TargetMismatchError(
        f"leaf {path}: casting saved dtype {saved.name} to target dtype {target.name} would change values"
        f" ({source} → {dest}{'' if source != dest else ', narrower range'}); restore into {saved.name}"
        ' or a wider dtype, or pass cast="unsafe" for numpy\'s cast'
    )


def cast_values(path: str, host: np.ndarray, target: np.dtype | None, *, unsafe: bool) -> np.ndarray:
    """``host`` cast to ``target``; a finite value that became inf or NaN fails (unless ``unsafe``).

    numpy's overflow warnings are silenced: the check reports overflow as an
    error, and ``cast="unsafe"`` asked for numpy's result as is.
    """
    assert target is not None
    with np.errstate(all="ignore"):
        out = host.astype(target)
    if unsafe or _category(target) not in ("float", "complex"):
        return out
    with np.errstate(all="ignore"):
        overflowed = ~np.isfinite(out) & np.isfinite(host)
    if overflowed.any():
        where = np.argwhere(overflowed)[0]
        value = host[tuple(where)]
        raise TargetMismatchError(
            f"leaf {path}: saved {host.dtype.name} value {value.item()!r} overflows target dtype"
            f" {target.name} (becomes {out[tuple(where)].item()!r}); restore into a wider dtype,"
            ' or pass cast="unsafe" to keep numpy\'s result'
        )
    return out
