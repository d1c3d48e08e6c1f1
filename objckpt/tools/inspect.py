"""inspect: what a checkpoint holds, from its metadata alone (no array data read).

What it returns (:class:`CheckpointInfo`, :class:`LeafInfo`) lives in
:mod:`objckpt.layouts.base`, beside the readers that make it.
"""

from __future__ import annotations

from typing import Any

from objckpt.errors import CheckpointNotFoundError
from objckpt.layouts.base import CheckpointInfo, LeafInfo
from objckpt.layouts.registry import open_checkpoint
from objckpt.options import Options
from objckpt.roots.hints import explained
from objckpt.transfer.engine import opened_store

__all__ = ["CheckpointInfo", "LeafInfo", "inspect"]


def inspect(
    url: str, *, storage_options: dict[str, Any] | None = None, options: Options | None = None
) -> CheckpointInfo:
    """Describe a committed checkpoint without reading any array data.

    The checkpoint's reader describes it (:func:`objckpt.layouts.registry.open_checkpoint`):
    an objckpt checkpoint from its root manifest, an Orbax one from its metadata and
    its arrays' zarr headers.

    Raises:
        CheckpointNotFoundError: nothing committed at ``url``; when ``url`` is a manager root,
            or a step its root lacks, the message lists its steps (:mod:`objckpt.roots.hints`).
    """
    options = options or Options()
    with opened_store(url, storage_options, options) as store:
        try:
            checkpoint = open_checkpoint(store, options=options, storage_options=storage_options)
        except CheckpointNotFoundError as e:  # a manager root, a step its root lacks: said so
            raise explained(e, store, storage_options, options) from None
        return checkpoint.info()
