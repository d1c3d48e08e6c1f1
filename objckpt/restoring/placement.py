"""Host boxes → a leaf's value on the target: where every restore, of any format, makes its arrays.

objckpt's own restore lands its bytes through :class:`~objckpt.restoring.landing.Landing`;
the readers of other formats (Orbax's tensorstore reads, safetensors files) land theirs in
host boxes of their own. Either way, what turns a host box into a device array, and a
leaf's boxes into the global array on the target's sharding, is here, so a restore's
arrays come from one place: the same calls, the same rules (a box on each device that
holds it; a whole leaf put on a fully addressable sharding at once, JAX cutting the
boxes; a target with no sharding on the default device). A reader of another format
only casts and cuts its host boxes (:mod:`objckpt.restoring.casts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np


def is_array_target(target: Any) -> bool:
    """Whether ``target`` asks for a ``jax.Array`` (a ``ShapeDtypeStruct`` or an array), not a host value."""
    return isinstance(target, (jax.ShapeDtypeStruct, jax.Array))


def sharding_of(target: Any) -> jax.sharding.Sharding | None:
    """The sharding an array target asks for, or None (a host value, or no sharding: the default device)."""
    return getattr(target, "sharding", None) if is_array_target(target) else None


def boxes_of(target: Any, shape: tuple[int, ...]) -> list[tuple[tuple[slice, ...], list[Any]]]:
    """The distinct boxes (slices) the target's addressable devices hold, each with its devices;
    one whole box on ``[None]`` for a target with no sharding (a host value, the default device)."""
    sharding = sharding_of(target)
    if sharding is None:
        return [(tuple(slice(0, n) for n in shape), [None])]
    by_box: dict[tuple[tuple[int, int], ...], tuple[tuple[slice, ...], list[Any]]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        assert index is not None  # a device of the sharding holds an index of the shape
        norm = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
        by_box.setdefault(tuple((s.start, s.stop) for s in norm), (norm, []))[1].append(device)
    return list(by_box.values())


def box_on_devices(host: np.ndarray, devices: Sequence[Any]) -> list[jax.Array]:
    """One host box put on each of ``devices`` (its copies under the target's sharding)."""
    return [jax.device_put(host, device) for device in devices]


def on_default_device(host: np.ndarray) -> jax.Array:
    """A whole leaf for a target with no sharding: one array on JAX's default device."""
    return jax.device_put(host)


def whole_on(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A whole leaf held on this host, put on a fully addressable ``sharding`` in one call (JAX
    slices the boxes out and places them: no Python per box)."""
    return jax.device_put(host, sharding)


def joined(shape: tuple[int, ...], sharding: jax.sharding.Sharding, shards: Iterable[jax.Array]) -> jax.Array:
    """The global array of ``shape`` on ``sharding`` from its boxes already on their devices."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, list(shards))


def boxes_joined(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, boxes: Iterable[tuple[np.ndarray, Sequence[Any]]]
) -> jax.Array:
    """The global array from host boxes, each put on its devices (``(host box, devices)`` pairs)."""
    return joined(shape, sharding, (a for host, devices in boxes for a in box_on_devices(host, devices)))
