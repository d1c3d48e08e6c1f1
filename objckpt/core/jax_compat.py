"""JAX's public calls that moved between the versions objckpt supports (JAX 0.4.30 onwards).

objckpt runs in its user's process beside whatever JAX they train with, so it calls the newer
spelling where it exists and the older one elsewhere, and raises no deprecation warning of its own
making in their logs.
"""

from __future__ import annotations

from typing import Any

import jax


def single_device_sharding(device: Any) -> jax.sharding.Sharding:
    """The sharding that places a whole array on ``device``.

    ``jax.sharding.make_single_device_sharding`` where JAX has it (0.10 onwards; JAX 0.12 warns
    that constructing ``SingleDeviceSharding`` directly is deprecated); the class itself before.
    """
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is not None:
        return make(device)  # type: ignore[no-any-return]
    return jax.sharding.SingleDeviceSharding(device)
