"""The host-memory check every restore makes before its first read (objckpt and Orbax checkpoints).

The sizes come from a checkpoint's own headers (a root manifest, a zarr header),
which can declare a leaf of petabytes: failing at once, naming the leaf, beats
failing an allocation (or the machine) midway.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from objckpt.errors import HostMemoryError
from objckpt.progress import human_bytes


def physical_memory() -> int | None:
    """The machine's physical memory in bytes (``SC_PHYS_PAGES`` × ``SC_PAGE_SIZE``), None where
    the OS does not say. Not what is free now: a restore larger than the machine cannot succeed,
    while one larger than what is free may still fit once the page cache gives way."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def refuse_over_limit(needs: Iterable[tuple[str, str, int, bool]], limit: int | None, *, of: str = "") -> None:
    """Refuse leaves that need more host memory than ``limit`` bytes, each or together.

    Args:
        needs: ``(leaf path, its dtype and shape, bytes it needs on this process, whether
            it stays in host memory)``: each must fit, and those staying in host memory together.
        limit: The machine's physical memory; None: no check.
        of: What the leaves belong to, for the message (``" of the Orbax checkpoint URL"``).

    Raises:
        HostMemoryError: naming the leaf (or the largest leaves) and both sizes.
    """
    if limit is None:
        return
    held: list[tuple[int, str]] = []
    for path, kind, need, on_host in needs:
        if need > limit:
            raise HostMemoryError(
                f"leaf {path} ({kind}){of}: restoring it needs {human_bytes(need)} of host memory on this process,"
                f" more than this machine's {human_bytes(limit)} of physical memory"
            )
        if on_host:
            held.append((need, path))
    total = sum(need for need, _ in held)
    if total > limit:
        largest = ", ".join(f"{path} ({human_bytes(need)})" for need, path in sorted(held, reverse=True)[:3])
        raise HostMemoryError(
            f"restoring these leaves{of} to host memory needs {human_bytes(total)} together, more than this"
            f" machine's {human_bytes(limit)} of physical memory; the largest: {largest}"
        )
