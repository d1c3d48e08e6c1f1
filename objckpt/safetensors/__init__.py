"""Safetensors in and out: export a checkpoint as Hugging Face's sharded layout; read one as a layout.

:func:`export_safetensors` (:mod:`objckpt.safetensors.export`) writes ``model.safetensors``
or ``model-0000k-of-0000n.safetensors`` files with ``model.safetensors.index.json``
to any store; the ``safetensors`` layout (:mod:`objckpt.safetensors.reader`) lets
:func:`objckpt.restore`, ``inspect`` and ``verify`` read such files in place, with
ranged reads of the bytes each device needs. Headers are held to the spec
(:mod:`objckpt.safetensors.header`). See docs/SAFETENSORS.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from objckpt.safetensors.export import ExportStats, export_safetensors
    from objckpt.safetensors.reader import restore_safetensors

__all__ = ["ExportStats", "export_safetensors", "restore_safetensors"]


def __getattr__(name: str) -> Any:
    if name == "restore_safetensors":
        from objckpt.safetensors import reader

        return reader.restore_safetensors
    if name in __all__:
        from objckpt.safetensors import export

        return getattr(export, name)
    raise AttributeError(f"module 'objckpt.safetensors' has no attribute {name!r}")
