"""Reading one step of a manager's root: its URL, whose step it is, and restore, inspect and metrics of it.

A step under a manager's root is either objckpt's (``<root>/step_0000000042``, copied to every
replica) or one Orbax committed there (``<root>/42``, read through :mod:`objckpt.orbax`, never
replicated). :class:`StepReads` answers which, and reads it accordingly, so that
:class:`~objckpt.manager.checkpoint_manager.CheckpointManager` keeps to when to save and what
to keep.
"""

from __future__ import annotations

from typing import Any

from objckpt.core.format import MANIFEST_KEY
from objckpt.options import Options
from objckpt.restoring.locations import Location
from objckpt.roots.metrics import step_metrics
from objckpt.roots.orbax_steps import orbax_metrics, orbax_step_at
from objckpt.roots.step_names import step_dir
from objckpt.storage import Store
from objckpt.tools.inspect import CheckpointInfo, inspect
from objckpt.transfer import runtime


class StepReads:
    """The steps of one root (``store`` at ``root_url``, with ``replicas``), read one at a time.

    ``metrics_seen`` is the manager's own record of the metrics each step was saved with,
    filled by its saves; :meth:`metrics` reads a step's manifest only for a step not there.
    """

    def __init__(
        self,
        store: Store,
        root_url: str,
        *,
        storage_options: dict[str, Any],
        options: Options,
        replicas: list[Location],
        metrics_seen: dict[int, dict[str, Any]],
    ) -> None:
        self.store, self.root_url = store, root_url
        self.storage_options, self.options, self.replicas = storage_options, options, replicas
        self.metrics_seen = metrics_seen

    def step_url(self, step: int) -> str:
        """``<root_url>/step_0000000042``: where objckpt saves ``step``."""
        return f"{self.root_url}/{step_dir(step)}"

    def is_orbax(self, step: int) -> bool:
        """Whether ``step`` is Orbax's: committed by Orbax under the root, not by objckpt (HEADs)."""
        return orbax_step_at(
            self.store, step, f"{step_dir(step)}/{MANIFEST_KEY}", self.options, replicas=bool(self.replicas)
        )

    def url_of(self, step: int) -> str:
        """Where ``step``'s checkpoint is: objckpt's step directory, or Orbax's ``<root>/<step>``."""
        return f"{self.root_url}/{step}" if self.is_orbax(step) else self.step_url(step)

    def restore(self, step: int, target: Any, *, partial: bool, cast: str) -> Any:
        """:func:`objckpt.restore` of ``step`` from the root, failing over to its copies at the replicas."""
        from objckpt.restoring.api import restore

        if self.is_orbax(step):  # through objckpt.orbax; Orbax steps are not replicated
            url, replicas = f"{self.root_url}/{step}", []
        else:
            url, replicas = self.step_url(step), [location.child(step_dir(step)) for location in self.replicas]
        return restore(
            url,
            target,
            storage_options=self.storage_options,
            partial=partial,
            replicas=replicas,
            options=self.options,
            cast=cast,
        )

    def inspect(self, step: int) -> CheckpointInfo:
        """:func:`objckpt.inspect` of ``step``: what it holds, from its manifest alone."""
        return inspect(self.url_of(step), storage_options=self.storage_options, options=self.options)

    def metrics(self, step: int) -> dict[str, Any]:
        """The metrics ``step`` was saved with: seen by this manager, else read from its manifest
        (for an Orbax step, what Orbax saved: :func:`~objckpt.roots.orbax_steps.orbax_metrics`)."""
        seen = self.metrics_seen
        if step not in seen and self.is_orbax(step):
            seen[step] = runtime.run_sync(orbax_metrics(self.store, step))
        if step not in seen:
            limit = self.options.manifest_size_limit
            seen[step] = runtime.run_sync(step_metrics(self.store.child(step_dir(step)), size_limit=limit))
        return seen[step]
