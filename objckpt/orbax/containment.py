"""What an Orbax reader opens stays inside the checkpoint, and what it reads whole stays small.

An Orbax checkpoint names paths in its own files: its step's items
(``_CHECKPOINT_METADATA``'s ``item_handlers``) and its arrays (the parameter
names of ``_METADATA``, a directory each without OCDBT). Nothing here trusts
them. A name that leads out of the directory holding it (``..``, ``.``, an
empty component, an absolute path; ``\\`` counts as a separator, as
tensorstore's ``file`` driver takes it) is a
:class:`~objckpt.errors.FormatError` naming the file that holds it, before
any store or tensorstore sees it.

On local disk a symbolic link can lead out just as well. objckpt's local store
keeps its own reads inside its root, but an item directory's store is rooted
at the item, so an item that is a link is checked against its step
(:func:`check_local_item`); and tensorstore opens files itself, following
links, so the directory it is told to open is walked first
(:func:`check_local_tree`): a link inside it that resolves outside it, or a
FIFO, socket or device (an ``open`` of which may block or act), is refused.
A link made after the walk is not seen: the check guards against a hostile
checkpoint, not against a concurrent writer on the same disk.

:func:`read_small` reads a metadata file only after its size is known to be
within a limit, and never more than the limit's bytes: a huge (or sparse)
file costs one ``head``.
"""

from __future__ import annotations

import os
import re
import stat
import urllib.parse
from typing import Any

from objckpt.errors import FormatError, ObjectNotFoundError

_SEPARATORS = re.compile(r"[/\\]")


def escapes(name: str) -> bool:
    """Whether ``name``, taken as a relative path, leads anywhere but below its directory
    (an absolute path, or a ``..``, ``.`` or empty component; ``\\`` separates too)."""
    return any(part in ("", ".", "..") for part in _SEPARATORS.split(name)) or "\0" in name


def check_item_name(url: str, name: str) -> None:
    """An item name of the step at ``url`` (from its ``_CHECKPOINT_METADATA``) is one directory name.

    Raises:
        FormatError: the name is empty, ``.``/``..``, absolute, or has a separator.
    """
    if escapes(name) or _SEPARATORS.search(name):
        raise FormatError(
            f"{url}/_CHECKPOINT_METADATA names the item {name[:80]!r}: an item is one directory of the step"
            " (no '/', '..' or absolute path); refused"
        )


def check_array_name(url: str, leaf_path: str, name: str) -> None:
    """The parameter ``name`` of a leaf of the item at ``url`` is a directory below the item
    (it is one without OCDBT: tensorstore is told to open ``<item>/<name>/``).

    Raises:
        FormatError: the name leads out of the item (``..``, absolute, an empty component).
    """
    if escapes(name):
        raise FormatError(
            f"{url}/_METADATA: leaf {leaf_path} names its array {name[:80]!r}, a path that leads out of"
            " the item (arrays are directories below it); refused"
        )


def local_dir(url: str) -> str | None:
    """The local directory of a ``file://`` URL or a plain path; None for any other scheme."""
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme.lower()
    if scheme == "":
        return url
    if scheme == "file":
        return urllib.parse.unquote(parsed.path)
    return None


def _inside(real_root: str, resolved: str) -> bool:
    return resolved == real_root or resolved.startswith(real_root.rstrip(os.sep) + os.sep)


def check_local_item(step_url: str, name: str) -> None:
    """On local disk, the item ``name`` of the step at ``step_url`` resolves inside the step.

    Raises:
        FormatError: the item's directory is a link leading out of the step.
    """
    step = local_dir(step_url)
    if step is None:
        return
    real_step = os.path.realpath(step)
    resolved = os.path.realpath(os.path.join(real_step, name))
    if not _inside(real_step, resolved):
        raise FormatError(
            f"Orbax item {step_url.rstrip('/')}/{name} is a symbolic link to {resolved}, outside the"
            " checkpoint; refused"
        )


def check_local_tree(url: str) -> None:
    """On local disk, everything under the item directory at ``url`` (what tensorstore will
    open, following links) is a directory or regular file inside it, or a link that resolves
    inside it. The directory itself may be a link: it is what the caller named.

    Raises:
        FormatError: naming the first link leading out of the item, or a FIFO, socket or device.
    """
    top = local_dir(url)
    if top is None:
        return
    real_top = os.path.realpath(top)
    pending = [real_top]
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue  # tensorstore reports what it cannot open
        for entry in entries:
            where = f"Orbax checkpoint {url}: {entry.path}"
            if entry.is_symlink():
                resolved = os.path.realpath(entry.path)
                if not _inside(real_top, resolved):
                    raise FormatError(f"{where} is a symbolic link to {resolved}, outside the checkpoint; refused")
            elif entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
            elif not entry.is_file(follow_symlinks=False):
                mode = entry.stat(follow_symlinks=False).st_mode
                kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
                raise FormatError(f"{where} is {kind}, not a file; refused")


async def read_small(store: Any, key: str, limit: int, what: str) -> bytes | None:
    """The object ``key`` of ``store``, or None where absent, read only once its size
    (a ``head``) is within ``limit``, and never more than one byte past that size.

    Raises:
        FormatError: the object is larger than ``limit``, or its size changed between
            the ``head`` and the read (``what`` names it).
    """
    try:
        size = (await store.head(key)).size
    except (ObjectNotFoundError, FileNotFoundError):
        return None
    if size > limit:
        raise FormatError(f"{what} is {size} bytes: over the {limit}-byte limit for Orbax metadata")
    if size == 0:
        return b""
    data = bytes(await store.get_range(key, start=0, end=size + 1))  # one byte more shows growth
    if len(data) != size:
        raise FormatError(f"{what} changed size while it was read ({size} bytes, then {len(data)}); refused")
    return data
