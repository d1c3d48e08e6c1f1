"""inspect: what a checkpoint holds, from its metadata alone (no array data read).

An incremental checkpoint's index objects are read too, to say how many bytes come from
which earlier checkpoint (``CheckpointInfo.bytes_from``).

What it returns (:class:`CheckpointInfo`, :class:`LeafInfo`) lives in
:mod:`objckpt.layouts.base`, beside the readers that make it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from objckpt.core.format import Manifest
from objckpt.core.format.bases import is_ref, split_ref
from objckpt.errors import CheckpointNotFoundError
from objckpt.layouts.base import CheckpointInfo, LeafInfo
from objckpt.layouts.native import NativeCheckpoint
from objckpt.layouts.registry import open_checkpoint
from objckpt.options import Options
from objckpt.roots.hints import explained
from objckpt.transfer import runtime
from objckpt.transfer.retries import opened_store

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
        info = checkpoint.info()
        if isinstance(checkpoint, NativeCheckpoint) and checkpoint.manifest.bases:
            whole = runtime.run_sync(checkpoint.read_every_index())
            return dataclasses.replace(info, bytes_from=bytes_from(whole))
        return info


def bytes_from(manifest: Manifest) -> dict[str, int]:
    """An incremental checkpoint's array bytes (its index objects read) by the checkpoint whose
    blobs hold them: ``""`` for its own, else the base's name."""
    out: dict[str, int] = defaultdict(int)
    for leaf in manifest.leaves:
        for piece in leaf.pieces:
            out[split_ref(piece.blob)[0] if is_ref(piece.blob) else ""] += piece.length
    return dict(out)
