"""One-request GCS uploads that send the caller's buffer as the body, with no copy.

gcsfs's ``pipe_file`` sends objects under 50 MiB as a ``multipart/related``
body that it builds by concatenating the metadata and the payload: a fresh
copy of every byte saved. The JSON API's ``uploadType=media`` takes the
payload as the body itself, so the staging buffer goes to the socket as is.
Same endpoint and errors as gcsfs's; the same credential
(:class:`objckpt.storage.auth.gcs.GoogleToken`, shared with gcsfs). Only for
overwrites: create-if-absent (the manifest, small) stays on ``pipe_file``,
because fake-gcs-server ignores ``ifGenerationMatch=0`` on media uploads (a
second create succeeds there) though GCS honours it.

The request is aiohttp's (the HTTP protocol, proxies through ``HTTPS_PROXY``/
``NO_PROXY`` with ``trust_env``, TLS with the store's CA context); this module
only builds the request, owns the session and maps the response status to
objckpt's errors (:func:`objckpt.storage.http.reader.status_error`). Uploads
make one attempt each: the transfer engine is the one retry layer.

The body goes to aiohttp as :class:`SlicedBody`, not as one buffer: on Python
before 3.12.9 aiohttp joins the headers and the whole body into a new
``bytes`` before writing (a copy of every byte), and the socket transport then
copies what the kernel did not take at once into its own growing buffer (a
second). Written in 1 MiB slices, each awaited until the socket drains, both
copies shrink to a slice that stays in warm memory (the figures for both
choices are in docs/PERFORMANCE.md).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any
from urllib.parse import quote

import aiohttp
import aiohttp.payload

from objckpt.storage.auth.gcs import GoogleToken
from objckpt.storage.http.gcs import error_reason
from objckpt.storage.http.reader import status_error

SLICE = 1 << 20
_ERROR_BODY_LIMIT = 2048  # bytes of an error response kept for its reason


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


class MediaUploader:
    """``uploadType=media`` POSTs to one GCS endpoint, over a session per event loop.

    A session is made on first use on the loop the upload runs on (for a gcsfs
    store, fsspec's I/O thread) and closed by :meth:`close`.

    Args:
        endpoint: ``http(s)://host[:port]`` (GCS's, or an emulator's).
        token: The store's credential; an anonymous one sends no ``Authorization``.
        timeout: Seconds allowed to each upload, start to finish.
        ssl_context: Verifies an ``https://`` endpoint; aiohttp's default (the system roots) when None.
    """

    def __init__(
        self, *, endpoint: str, token: GoogleToken, timeout: float, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self._endpoint = endpoint.rstrip("/")
        self._token = token
        self._timeout = float(timeout)
        self._ssl = ssl_context
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def __repr__(self) -> str:
        return f"MediaUploader({self._endpoint})"

    async def upload(self, bucket: str, name: str, data: bytes | memoryview, what: str) -> None:
        """Write ``data`` as object ``name`` of ``bucket``, replacing it.

        Raises:
            StoreError: by status as :func:`~objckpt.storage.http.reader.status_error` maps it
                (``what`` names the object); aiohttp's connection errors and timeouts pass
                through, for the store to map.
        """
        headers = {"Content-Type": "application/octet-stream", **await self._auth_headers()}
        url = f"{self._endpoint}/upload/storage/v1/b/{quote(bucket, safe='')}/o"
        params = {"uploadType": "media", "name": name}
        session = self._session()
        async with session.post(url, params=params, headers=headers, data=SlicedBody(data)) as response:
            if not 200 <= response.status < 300:
                body = await response.content.read(_ERROR_BODY_LIMIT)
                raise status_error(response.status, error_reason(body), what)
            await response.read()  # the new object's metadata (small); frees the connection

    async def _auth_headers(self) -> dict[str, str]:
        fresh = self._token.fresh_headers()
        if fresh is not None:
            return fresh
        return await asyncio.to_thread(self._token.headers)  # a refresh blocks: off the loop

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            session = aiohttp.ClientSession(
                connector=connector, trust_env=True, timeout=aiohttp.ClientTimeout(total=self._timeout)
            )
            self._sessions[loop] = session
        return session

    async def close(self) -> None:
        """Close every session, each on its own loop (one that has stopped is dropped).
        The uploader stays usable: a later upload opens a new session."""
        sessions, self._sessions = self._sessions, {}
        running = asyncio.get_running_loop()
        for loop, session in sessions.items():
            if loop is running:
                await session.close()
            elif loop.is_running():
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(session.close(), loop))
