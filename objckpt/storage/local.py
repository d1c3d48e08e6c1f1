"""Atomic whole-object writes on a local (POSIX) filesystem.

An object store never shows a half-written object, and objckpt relies on that:
a manifest that exists must be complete. On disk that takes a temporary file
in the destination directory and one atomic step at the end:

* overwrite: ``os.replace(tmp, final)``;
* create-if-absent: ``os.link(tmp, final)``, which fails with ``EEXIST``
  atomically if ``final`` exists (two racing creators: exactly one wins, and
  the loser never touches the winner's bytes).

Temporary files are named ``.objckpt-tmp-<random>`` so listings can hide
them; one left behind by a killed writer is garbage, never an object.
"""

from __future__ import annotations

import errno
import os
import uuid

#: Prefix of in-flight temporary files; listings skip names starting with it.
TMP_PREFIX = ".objckpt-tmp-"

# Read once at import (os.umask can only be read by setting it, which is not
# thread-safe later): temp files are created 0600 and get the mode a plain
# ``open(path, "wb")`` would have given them.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK

# Errors from os.link meaning "this filesystem has no hard links".
_NO_HARDLINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK}


def is_temp_name(path: str) -> bool:
    """Whether ``path``'s last component is one of our in-flight temp files."""
    return path.rsplit("/", 1)[-1].startswith(TMP_PREFIX)


class ParentNotDirectoryError(OSError):
    """A parent "directory" of the key exists as a file (object stores allow
    ``a`` and ``a/b`` side by side; a filesystem cannot)."""


def _make_parent(path: str) -> str:
    parent = os.path.dirname(path) or "."
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ParentNotDirectoryError(errno.ENOTDIR, "a parent of the object exists as a file", parent) from exc
    return parent


def _write_temp(parent: str, data: bytes | bytearray | memoryview) -> str:
    tmp = os.path.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), _FILE_MODE)
    try:
        with os.fdopen(fd, "wb", closefd=True) as f:
            f.write(data)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_atomic(path: str, data: bytes | bytearray | memoryview, *, exclusive: bool) -> None:
    """Write ``data`` to ``path`` so no reader ever sees a partial file.

    Args:
        path: Absolute destination path; missing parent directories are made.
        data: The whole object.
        exclusive: Create-if-absent: raise :class:`FileExistsError` (and leave
            the existing file untouched) if ``path`` exists.

    Raises:
        FileExistsError: ``exclusive`` and the file exists.
        ParentNotDirectoryError: a parent path component is a regular file.
    """
    parent = _make_parent(path)
    tmp = _write_temp(parent, data)
    try:
        if not exclusive:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno not in _NO_HARDLINKS:
                raise
            _create_exclusive_fallback(path, data)
    finally:
        # After replace the name is gone already; after link it is a second name.
        _unlink_quietly(tmp)


def _create_exclusive_fallback(path: str, data: bytes | bytearray | memoryview) -> None:
    """O_EXCL create for filesystems without hard links.

    Still exactly-one-winner, but a reader racing the writer may see a short
    file for a moment; only used where ``os.link`` is unsupported.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), _FILE_MODE)
    try:
        with os.fdopen(fd, "wb", closefd=True) as f:
            f.write(data)
    except BaseException:
        _unlink_quietly(path)
        raise
