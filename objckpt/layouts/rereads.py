"""Reading a metadata document again when it fails its checks, before calling it malformed.

A byte flipped in flight spoils one read, not the next: a manifest or index
object that does not parse, or does not match the checksums its root gives, is
fetched again, up to :data:`MANIFEST_READS` reads in all, and the first read
that passes wins. Damage that persists over every read is a :class:`FormatError`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from objckpt.errors import FormatError

#: Reads of a document that fails its checks, the first included, before it is called malformed.
MANIFEST_READS = 5

T = TypeVar("T")


async def until_checked(read: Callable[[], Awaitable[T]], store: Any, *, reads: int = MANIFEST_READS) -> T:
    """``await read()`` again while it raises :class:`FormatError`, at most ``reads`` times in all.

    Each re-read counts in ``store.stats.checksum_retries`` (a
    :class:`~objckpt.transfer.retries.RetryingStore`'s). Other errors (a missing
    object) pass through at once.

    Raises:
        FormatError: the last read's, "(the same over N reads)" added when there were several.
    """
    for attempt in range(1, reads + 1):
        try:
            return await read()
        except FormatError as e:
            if attempt >= reads:
                raise FormatError(f"{e} (the same over {reads} reads)" if reads > 1 else str(e)) from None
            stats = getattr(store, "stats", None)
            if stats is not None:
                stats.add(checksum_retries=1)
    raise AssertionError("unreachable")  # reads >= 1
