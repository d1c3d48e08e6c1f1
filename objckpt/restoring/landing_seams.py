"""What a restore's landing calls to make host memory and to put arrays on devices.

:class:`~objckpt.restoring.landing.Landing` takes both as arguments: by default objckpt's own
memory (:mod:`objckpt.transfer.buffers`, :class:`~objckpt.restoring.arena.AssemblyArena`) and
JAX's calls; a test passes its own to count, poison or delay what the landing does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from objckpt.core.boxes import Box
from objckpt.restoring.arena import AssemblyArena
from objckpt.restoring.copies_in_flight import copies_ended
from objckpt.transfer.buffers import aligned_arrays, fault_in


@dataclass(frozen=True)
class HostMemory:
    """How a landing makes host memory: aligned arrays, faulting pages in, the arena for assembled leaves.

    The defaults are :mod:`objckpt.transfer.buffers`' and
    :class:`~objckpt.restoring.arena.AssemblyArena`; a test passes its own to
    count or poison what the landing makes.
    """

    arrays: Callable[..., list[np.ndarray]] = aligned_arrays  # (shapes, dtype, *, zeroed)
    fault_in: Callable[[np.ndarray], object] = fault_in
    arena: Callable[[list[tuple[int, list[Box], np.dtype]]], AssemblyArena] = AssemblyArena


@dataclass(frozen=True)
class Devices:
    """How a landing puts finished host arrays on devices (JAX's calls by default; a test counts them)."""

    put: Callable[..., Any] = jax.device_put
    from_callback: Callable[..., jax.Array] = jax.make_array_from_callback
    from_single_arrays: Callable[..., jax.Array] = jax.make_array_from_single_device_arrays
    wait: Callable[[Any], Any] = jax.block_until_ready  # until arrays' copies to their devices end
    ended: Callable[[Any], bool] = copies_ended  # whether they have ended, without waiting
