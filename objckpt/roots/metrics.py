"""The metrics a manager saved a step with, from the step's manifest alone.

``CheckpointManager.save(step, tree, metrics=...)`` stores them in the manifest's
metadata under ``"objckpt.manager"``; ``keep_best`` and ``CheckpointManager.metrics``
read them back for steps this process did not save. Orbax's steps keep theirs
elsewhere (:func:`objckpt.roots.orbax_steps.orbax_metrics`).
"""

from __future__ import annotations

from typing import Any

from objckpt.layouts.manifest_io import read_manifest
from objckpt.storage import Store


async def step_metrics(step_store: Store, *, size_limit: int) -> dict[str, Any]:
    """The metrics in the manifest under ``step_store`` (a step's prefix); empty when it has none."""
    manifest = await read_manifest(step_store, size_limit=size_limit)
    info = manifest.metadata.get("objckpt.manager", {})
    return dict(info.get("metrics", {})) if isinstance(info, dict) else {}
