"""Stores over fsspec filesystems (s3fs, gcsfs, local disk, memory, any other protocol).

:mod:`.store` holds the adapter every filesystem shares, one module per filesystem that
differs adds its subclass, and :mod:`.factory` picks the class for a filesystem.
"""
