"""Object storage for objckpt: one small async protocol, many backends.

``from_url("s3://bucket/ckpts")`` returns a :class:`Store` for S3, GCS, local
disk, memory, any fsspec filesystem, or a third-party plugin (entry-point
group ``objckpt.stores``). Backends are imported only when a URL needs them.
"""

from objckpt.storage.base import ByteRange, ObjectInfo, PutMode, Store
from objckpt.storage.registry import from_url, register_store

__all__ = ["ByteRange", "ObjectInfo", "PutMode", "Store", "from_url", "register_store"]
