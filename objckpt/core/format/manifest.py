"""A root manifest to and from bytes: the ``version`` field picks the format version's module.

A new format version is one new module beside :mod:`objckpt.core.format.v1` and
:mod:`objckpt.core.format.v2`, named in the two tables below. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from objckpt.core.format.schema import FORMAT_NAME, READ_VERSIONS, Manifest
from objckpt.core.format.v1 import root_from_doc as v1_from_doc
from objckpt.core.format.v1 import root_to_json as v1_to_json
from objckpt.core.format.v2 import root_from_doc as v2_from_doc
from objckpt.core.format.v2 import root_to_json as v2_to_json
from objckpt.core.strict import is_int, need, strict_json
from objckpt.errors import FormatError

# Version 3 is version 2's root with each index object's head length; version 4 is version 3
# with compressed leaves (their ``codec``; index rows with stored lengths). v2 reads and writes all three.
_READERS: dict[int, Callable[[dict[str, Any]], Manifest]] = {
    1: v1_from_doc,
    2: v2_from_doc,
    3: v2_from_doc,
    4: v2_from_doc,
}
_WRITERS: dict[int, Callable[[Manifest], bytes]] = {1: v1_to_json, 2: v2_to_json, 3: v2_to_json, 4: v2_to_json}


def parse_manifest(data: bytes, *, size_limit: int) -> Manifest:
    """Parse and validate manifest bytes.

    Raises:
        FormatError: naming the first field that is wrong.
    """
    if len(data) > size_limit:
        raise FormatError(f"manifest is {len(data)} bytes, over the limit of {size_limit}")
    return manifest_from_doc(strict_json(data))


def manifest_from_doc(doc: Any) -> Manifest:
    """A parsed manifest document, checked by the rules of its version."""
    need(isinstance(doc, dict), "(top level)", "must be an object")
    need(doc.get("format") == FORMAT_NAME, "'format'", f"must be {FORMAT_NAME!r}")
    version = doc.get("version")
    need(is_int(version), "'version'", "must be an integer")
    if version not in READ_VERSIONS:
        raise FormatError(
            f"manifest field 'version': {version} is not supported (this objckpt reads"
            f" {', '.join(map(str, READ_VERSIONS))})"
        )
    return _READERS[version](doc)


def manifest_to_json(manifest: Manifest) -> bytes:
    """The bytes of ``manifest.json`` for ``manifest``, in its version's form."""
    return _WRITERS[manifest.version](manifest)
