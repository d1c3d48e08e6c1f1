"""Reading a save's shards off the devices: every copy started first, none cached on the user's arrays.

A save reads each shard it writes (a single-device ``jax.Array``, ``shard.data``) into a
staging buffer. Two things about how JAX does that matter on an accelerator:

- ``np.asarray(array)`` waits for its device→host copy, so reading shards one after another
  runs one copy at a time. :func:`start_host_copies` starts them all (``copy_to_host_async``)
  before the first is read, so the transfers overlap.
- ``np.asarray(array)`` goes through ``jax.Array._value``, which keeps the host copy on the
  array (``_npy_value``) whenever reading it copied: after a save the user's live training
  state would carry a second, host copy of itself until it is replaced. :func:`host_view`
  reads through ``_single_device_array_to_np_array_did_copy`` instead, the private method
  ``_value`` itself calls for a single-device array, which returns the host array without
  keeping it on the Python object. This is the one place objckpt uses a private JAX API;
  where a JAX lacks it, :func:`host_view` falls back to ``np.asarray``.

On CPU devices both are free: a CPU array's host view is its own memory (no copy, nothing
cached), and ``copy_to_host_async`` does nothing. numpy sources pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np


def start_host_copies(sources: Iterable[Any]) -> int:
    """Start the device→host copy of every ``jax.Array`` in ``sources``; how many were started."""
    started = 0
    for source in sources:
        if isinstance(source, jax.Array):
            source.copy_to_host_async()
            started += 1
    return started


def host_view(source: Any) -> np.ndarray:
    """The host bytes of ``source`` (a single-device ``jax.Array`` or a numpy array), read-only,
    waiting for its device→host copy; nothing is kept on ``source``."""
    if not isinstance(source, jax.Array):
        return np.asarray(source)
    read = getattr(source, "_single_device_array_to_np_array_did_copy", None)
    if read is None or len(source.devices()) != 1:
        return np.asarray(source)
    host, _ = read()
    return host  # type: ignore[no-any-return]
