"""Small helpers the conformance suites share: run a coroutine, make test bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one coroutine to completion on a fresh event loop."""
    return asyncio.run(coro)


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` bytes covering every byte value (no text-only transports here)."""
    return bytes((i * 131 + seed * 7 + (i >> 8)) % 256 for i in range(n))
