"""One-request GCS uploads through gcsfs's own authenticated session.

gcsfs's ``pipe_file`` sends objects under 50 MiB as a ``multipart/related``
body that it builds by concatenating the metadata and the payload: a fresh
copy of every byte saved. The JSON
API's ``uploadType=media`` takes the payload as the body itself, so the
staging buffer goes to the socket as is. Same endpoint, same auth, same
errors. Only for overwrites: create-if-absent (the manifest, small) stays on
``pipe_file``, because fake-gcs-server ignores ``ifGenerationMatch=0`` on
media uploads (a second create succeeds there) though GCS honours it.

The body goes to aiohttp as :class:`SlicedBody`, not as one buffer: on Python
before 3.12.9 aiohttp joins the headers and the whole body into a new
``bytes`` before writing (a copy of every byte), and the socket transport then
copies what the kernel did not take at once into its own growing buffer (a
second). Written in 1 MiB slices, each awaited until the socket drains, both
copies shrink to a slice that stays in warm memory (the figures for both
choices are in docs/PERFORMANCE.md).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import aiohttp.payload

SLICE = 1 << 20


class SlicedBody(aiohttp.payload.Payload):
    """A request body that aiohttp writes slice by slice (replayable: each write starts over)."""

    def __init__(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        super().__init__(view, content_type="application/octet-stream")
        self._size = view.nbytes

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        view = self._value if content_length is None else self._value[:content_length]
        for start in range(0, len(view), SLICE):
            await writer.write(view[start : start + SLICE])

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a binary upload body has no text form")


async def media_upload(fs: Any, path: str, data: bytes | memoryview) -> None:
    """Write ``data`` as object ``path`` (``bucket/key``) of a ``gcsfs.GCSFileSystem``, replacing it.

    Runs on gcsfs's event loop; raises what gcsfs's requests raise (an
    ``HttpError`` carrying the status).
    """
    bucket, key, _ = fs.split_path(path)
    url = f"{fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
    await fs._call(
        "POST",
        url,
        uploadType="media",
        name=key,
        headers={"Content-Type": "application/octet-stream"},
        data=SlicedBody(data),
        json_out=True,
    )
    fs.invalidate_cache(fs._parent(path))
