"""Launch N JAX processes on this machine (4 CPU devices each) and collect their results.

Each process runs ``tests/mp_worker.py`` with ``jax.distributed.initialize`` on a
free loopback port. Every process is killed by PID when the deadline passes, so a
hung test never leaves JAX processes behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("mp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_env(
    process: int, count: int, port: int, devices: int, *, prefix: str = "OBJCKPT_MP", **extra: str
) -> dict[str, str]:
    """This process's environment plus what one worker needs: its rank, the process count and the
    coordinator's port (``<prefix>_PROCESS``, ``_COUNT``, ``_PORT``), ``devices`` CPU devices, the
    repository on PYTHONPATH, and ``extra`` (the job, under the name its worker reads)."""
    return dict(
        os.environ,
        **{f"{prefix}_PROCESS": str(process), f"{prefix}_COUNT": str(count), f"{prefix}_PORT": str(port)},
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        PYTHONPATH=str(WORKER.parents[1]),
        **extra,
    )


def run_processes(
    n: int,
    job: dict[str, Any],
    *,
    timeout: float = 180,
    devices_per_process: int = 4,
    stderr: list[str] | None = None,
    returncodes: list[int] | None = None,
    stdout: list[str] | None = None,
    worker: Path | None = None,
    env_prefix: str = "OBJCKPT_MP",
) -> list[dict[str, Any] | None]:
    """Run ``job`` in ``n`` processes; each one's parsed RESULT line (None if it printed none).

    ``stderr``: a list to fill with each process's standard error, in process order;
    ``returncodes``: likewise with their exit statuses (negative: the signal that ended one);
    ``stdout``: likewise with their standard output. ``worker``: the script each process runs
    (unless one is named, this module's ``WORKER``, read at call time: tests monkeypatch it),
    reading its job, rank, process count and port from ``<env_prefix>_JOB``, ``_PROCESS``,
    ``_COUNT`` and ``_PORT``.
    """
    port = free_port()
    procs = []
    for pid in range(n):
        env = process_env(
            pid, n, port, devices_per_process, prefix=env_prefix, **{f"{env_prefix}_JOB": json.dumps(job)}
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker or WORKER)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                outputs.append(proc.communicate(timeout=remaining))
            except subprocess.TimeoutExpired:
                _kill_all(procs)
                outputs.append(proc.communicate())
    finally:
        _kill_all(procs)
    results: list[dict[str, Any] | None] = []
    if stderr is not None:
        stderr.extend(err for _, err in outputs)
    if stdout is not None:
        stdout.extend(out for out, _ in outputs)
    if returncodes is not None:
        returncodes.extend(proc.wait() for proc in procs)
    for out, err in outputs:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(lines[-1][len("RESULT ") :]) if lines else None)
        if not lines:
            sys.stderr.write(f"--- a worker printed no result; its stderr tail:\n{err[-3000:]}\n")
    return results


def _kill_all(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
