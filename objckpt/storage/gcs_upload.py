"""One-request GCS uploads through gcsfs's own authenticated session.

gcsfs's ``pipe_file`` sends objects under 50 MiB as a ``multipart/related``
body that it builds by concatenating the metadata and the payload: a fresh
copy of every byte saved. Measured on the GCS emulator (1 GiB, one run each):
save went from 0.195 to 0.277 GiB/s and from 3.9 to 2.7 client CPU-seconds. The JSON
API's ``uploadType=media`` takes the payload as the body itself, so the
staging buffer goes to the socket as is. Same endpoint, same auth, same
errors. Only for overwrites: create-if-absent (the manifest, small) stays on
``pipe_file``, because fake-gcs-server ignores ``ifGenerationMatch=0`` on
media uploads (measured: a second create succeeded) though GCS honours it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote


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
        data=data,
        json_out=True,
    )
    fs.invalidate_cache(fs._parent(path))
