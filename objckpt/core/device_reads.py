"""Reading a save's shards off the devices: every copy started first, none kept on the user's arrays.

A save reads each shard it writes (a single-device ``jax.Array``, ``shard.data``) into a
staging buffer. Two things about how JAX does that matter on an accelerator:

- ``np.asarray(array)`` waits for its device→host copy, so reading shards one after another
  runs one copy at a time. The copies are all started (``copy_to_host_async``) before the
  first is read, so the transfers overlap.
- jaxlib keeps the host copy on the array object that was copied: in its C++ storage (the
  array's host value, which ``copy_to_host_async`` allocates and every later read returns)
  and, through ``jax.Array._value`` (what ``np.asarray`` calls), in ``_npy_value``. Read
  through the user's arrays, a save would leave a second, host copy of the live training
  state attached to it until the arrays are replaced.

So each shard is copied and read through an alias (:func:`host_alias`): a new array object
over the same device buffer, made by ``_rewrap_with_aval_and_sharding`` (no device copy),
whose host copy is freed when the save drops the alias; its bytes are read with
``_single_device_array_to_np_array_did_copy`` (what ``_value`` calls, without caching). These
are the private JAX calls objckpt makes, all here; where a JAX lacks them the shard itself is
copied and read (the host copy then stays on it, as it would with ``np.asarray``).

On CPU devices none of this costs anything: a CPU array's host view is its own memory, and
``copy_to_host_async`` does nothing. numpy sources pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def host_alias(source: Any) -> Any:
    """An array object over ``source``'s device buffer that holds its own host copy, or ``source``
    itself (a numpy array, an array of several devices, or a JAX without the call)."""
    if not isinstance(source, jax.Array) or len(source.sharding.device_set) != 1:
        return source
    rewrap = getattr(source, "_rewrap_with_aval_and_sharding", None)
    return source if rewrap is None else rewrap(source.aval, source.sharding)


def start_host_copy(array: Any) -> None:
    """Start the device→host copy of ``array`` (a ``jax.Array``; anything else needs none)."""
    if isinstance(array, jax.Array):
        array.copy_to_host_async()


def host_view(array: Any) -> np.ndarray:
    """The host bytes of ``array`` (a single-device ``jax.Array`` or a numpy array), read-only,
    waiting for its device→host copy; nothing is cached in ``_npy_value``."""
    return host_copy(array)[0]


class HeldBytes(np.ndarray):
    """Host bytes objckpt owns and nothing else writes (a local snapshot's, which a store save of
    the same step reads): :func:`host_copy` takes them as it takes an accelerator's host copy."""


def host_copy(array: Any) -> tuple[np.ndarray, bool]:
    """:func:`host_view`, and whether those bytes are a copy of the device buffer that nothing
    else writes (True on an accelerator and for :class:`HeldBytes`; False for a CPU device's own
    memory, which training may donate and overwrite, and for a numpy array, which its owner may
    change)."""
    if isinstance(array, HeldBytes):
        return array.view(np.ndarray), True
    if not isinstance(array, jax.Array):
        return np.asarray(array), False
    read = getattr(array, "_single_device_array_to_np_array_did_copy", None)
    if read is None or len(array.sharding.device_set) != 1:
        return np.asarray(array), False
    host, copied = read()
    return host, bool(copied)
