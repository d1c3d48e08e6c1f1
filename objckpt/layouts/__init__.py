"""Checkpoint layouts: what a prefix holds, opened once, read through one reader.

:func:`~objckpt.layouts.registry.open_checkpoint` decides (objckpt v1/v2 by the
root manifest's version, else each registered layout: Orbax's among them);
:mod:`objckpt.layouts.base` holds the reader protocol and what readers return;
:mod:`objckpt.layouts.native` reads objckpt's own format and
:mod:`objckpt.layouts.manifest_io` its manifest and index objects.
"""

from objckpt.layouts.base import (
    CheckpointInfo,
    CheckpointReader,
    ForeignReader,
    LeafInfo,
    OpenRequest,
    VerifyProblem,
    VerifyReport,
)
from objckpt.layouts.native import NativeCheckpoint
from objckpt.layouts.registry import open_checkpoint, register_layout

__all__ = [
    "CheckpointInfo",
    "CheckpointReader",
    "ForeignReader",
    "LeafInfo",
    "NativeCheckpoint",
    "OpenRequest",
    "VerifyProblem",
    "VerifyReport",
    "open_checkpoint",
    "register_layout",
]
