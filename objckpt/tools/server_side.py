"""The server-side half of one copy (:mod:`objckpt.tools.copy`): the copier, the first
blob copied alone, the fall back to streaming when the server refuses.

A blob is copied on the server only at a size the source's listing confirms (an
index object's size is a claim), and HEADed afterwards to check that size at the
destination; what the server says the two objects hash to decides whether a blob
already at the destination is kept.
"""

from __future__ import annotations

import asyncio
import logging

from objckpt.core.format import BlobEntry
from objckpt.errors import IntegrityError, StoreError
from objckpt.storage.copy import server as server_copy
from objckpt.transfer.engine import TransferEngine
from objckpt.transfer.handle import Handle

log = logging.getLogger("objckpt")


class ServerSide:
    """The server-side half of one copy: the copier, the first copy made alone, the fallback.

    ``active`` while blobs go server-side. The first blob to copy is copied alone
    (the others wait); a refusal (:func:`objckpt.storage.copy.server.refusal`) ends
    ``active`` for the whole checkpoint, with one warning. Once one copy has
    succeeded, every error is the copy's error.
    """

    def __init__(
        self,
        copier: server_copy.Copier | None,
        why_not: str,
        src: Handle,
        dst: Handle,
        target: TransferEngine,
        source_sizes: dict[str, int],
    ) -> None:
        self.copier = copier
        self.why_not = why_not
        self._sizes = source_sizes
        self._src, self._dst, self._target = src, dst, target
        self._confirmed = False
        self._first = asyncio.Lock()
        self._made = copier  # closed at the end: calls made before a fallback may still use it

    @property
    def active(self) -> bool:
        return self.copier is not None

    def close(self) -> None:
        if self._made is not None:
            self._made.close()

    def _fall_back(self, error: StoreError) -> bool:
        """Stop copying server-side if ``error`` is the server refusing to (one warning);
        False when it is another failure, which the caller raises."""
        reason = server_copy.refusal(error)
        if reason is None:
            return False
        if self.copier is None:
            return True
        self.copier = None
        self.why_not = f"the server refused to copy: {reason}"
        log.warning(
            "objckpt cp %s -> %s: server-side copy refused (%s); copying through this client instead",
            self._src.url,
            self._dst.url,
            reason,
        )
        return True

    async def copy(self, blob: BlobEntry) -> bool:
        """Copy ``blob`` on the server and check its size there; False when it must be streamed.

        The size an index object declares is a claim: the source's listing must hold the
        blob at that size before a copy (or a multipart plan) is built from it. A blob
        the listing lacks is streamed, and the streamed read says it is missing.
        """
        held = self._sizes.get(blob.key)
        if held is None:
            return False
        if held != blob.size:
            raise IntegrityError(
                f"server-side copy of {self._src.url}/{blob.key} is {held} bytes at the source, but its index"
                f" object declares {blob.size}: not copied, and nothing was committed at {self._dst.url}"
            )
        if not self._confirmed:
            async with self._first:
                if self.copier is None:
                    return False
                if not self._confirmed:
                    try:
                        await self._copy(self.copier, blob)
                    except StoreError as e:
                        if not self._fall_back(e):
                            raise
                        return False
                    self._confirmed = True
                    await self._check_size(blob)
                    return True
        if self.copier is None:
            return False
        await self._copy(self.copier, blob)
        await self._check_size(blob)
        return True

    async def _copy(self, copier: server_copy.Copier, blob: BlobEntry) -> None:
        source = server_copy.source_location(self._src.bulk, blob.key)
        await copier.copy(source, blob.key, blob.size, self._target.call)

    async def _check_size(self, blob: BlobEntry) -> None:
        info = await self._target.head(blob.key)
        if info.size != blob.size:
            raise IntegrityError(
                f"server-side copy of {self._src.url}/{blob.key} is {info.size} bytes at {self._dst.url},"
                f" the manifest says {blob.size}; nothing was committed"
            )

    async def same_object(self, key: str) -> bool | None:
        """Whether the server says ``key`` holds the same bytes at both ends; None when it
        says nothing comparable (then its size is trusted) or refused to say (then
        :attr:`active` is off)."""
        copier = self.copier
        if copier is None:
            return None
        try:
            theirs = await copier.checksum(server_copy.source_location(self._src.bulk, key), self._target.call)
            ours = await copier.checksum(server_copy.source_location(self._dst.bulk, key), self._target.call)
        except StoreError as e:
            if not self._fall_back(e):
                raise
            return None
        return None if theirs is None or ours is None else theirs == ours
