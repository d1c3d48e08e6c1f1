"""Preemption notices: the step at which every process of a job saves before it is evicted.

A scheduler that preempts a job sends its processes SIGTERM some seconds before it kills
them. In a multi-process job JAX's preemption service (started by
``jax.distributed.initialize``, which installs its own SIGTERM handler) spreads a notice
that reached one process to all of them and picks the step every process will reach
next; :func:`jax.experimental.multihost_utils.reached_preemption_sync_point` is true at
that step on every process, so they all save the same step. The loop must ask at every
step, on every process.

In a single process there is no such service. A library is a guest in its user's
process and changes no signal handler on its own, so :class:`Preemption` installs a
SIGTERM handler only when asked (``catch_sigterm=True``), and puts the previous handler
back on :meth:`Preemption.close`. The handler only records the notice; the first step
asked about afterwards is the sync point.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

log = logging.getLogger("objckpt")


class Preemption:
    """Answers "is this the step to save before the job is preempted?".

    Args:
        catch_sigterm: in a single process, install a SIGTERM handler that
            records the notice instead of letting the signal end the process
            (from the main thread only, as Python requires). In a multi-process
            job JAX's preemption service receives SIGTERM and this does nothing.
        process_count: the job's number of processes.
    """

    def __init__(self, *, catch_sigterm: bool, process_count: int) -> None:
        from objckpt.multihost import preemption_service_running  # imports JAX: see checkpoint_manager

        self._jax = preemption_service_running()
        self._multiprocess = process_count > 1
        self._noticed = threading.Event()
        self._sync_step: int | None = None
        self._previous: Any = None
        self._installed = False
        if self._multiprocess and not self._jax:
            log.warning(
                "objckpt: %d processes but JAX's preemption service is off "
                "(jax_enable_preemption_service): reached_preemption is never true",
                process_count,
            )
        if catch_sigterm and not self._jax and not self._multiprocess:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError("catch_sigterm=True: Python installs signal handlers from the main thread only")
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Runs between two bytecodes of the main thread: record, never log or lock.
        self._noticed.set()

    @property
    def catching_sigterm(self) -> bool:
        """Whether this object's SIGTERM handler is installed."""
        return self._installed

    def reached(self, step: int) -> bool:
        """Whether ``step`` is the preemption sync point (the same step on every process)."""
        if self._jax:
            from jax.experimental import multihost_utils

            try:
                return bool(multihost_utils.reached_preemption_sync_point(step))
            except RuntimeError:  # the service was shut down (jax.distributed.shutdown)
                return False
        if not self._noticed.is_set():
            return False
        if self._sync_step is None:
            self._sync_step = step
            log.warning("objckpt: SIGTERM received; step %d is the preemption sync point", step)
        return step == self._sync_step

    def close(self) -> None:
        """Put back the SIGTERM handler that was there before, unless someone has replaced ours since."""
        if not self._installed:
            return
        self._installed = False
        if signal.getsignal(signal.SIGTERM) != self._on_sigterm:
            return
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
        except ValueError:  # not the main thread
            log.warning("objckpt: the manager was closed outside the main thread; its SIGTERM handler stays")
