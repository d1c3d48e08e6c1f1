"""Child-process plumbing shared by the local storage servers.

The servers are test fixtures, so three things matter more than anything
else: they must never collide on a port (two test sessions may run at once),
they must never outlive the Python process that started them (a leaked
SeaweedFS keeps gigabytes of sparse volume files and eight ports), and when
they fail to start the error must show *why* (the tail of their log).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

#: Ports are drawn below the kernel's ephemeral range (32768+ on Linux), so a
#: port we picked is not handed out moments later to some outgoing connection.
#: SeaweedFS also binds ``port + 10000`` for gRPC, so the upper bound keeps
#: that second port below the ephemeral range too.
_PORT_LOW, _PORT_HIGH = 10000, 22700


class ServerStartError(RuntimeError):
    """A storage server did not come up; the message carries its log tail."""


def _bindable(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def pick_ports(count: int, *, companion_offset: int | None = None) -> list[int]:
    """Free loopback ports, distinct, none of them fixed.

    Args:
        count: How many ports.
        companion_offset: When set, ``port + companion_offset`` must be free
            as well (SeaweedFS puts each gRPC listener at ``port + 10000``).

    The probe sockets stay bound until every port is chosen, so the ports
    returned are distinct from each other and from their companions.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    rng = random.Random()
    try:
        for _ in range(2000):
            if len(ports) == count:
                return ports
            port = rng.randrange(_PORT_LOW, _PORT_HIGH)
            first = _bindable(port)
            if first is None:
                continue
            if companion_offset is None:
                held.append(first)
                ports.append(port)
                continue
            second = _bindable(port + companion_offset)
            if second is None:
                first.close()
                continue
            held += [first, second]
            ports.append(port)
        raise ServerStartError(f"could not find {count} free loopback ports")
    finally:
        for sock in held:
            sock.close()


def _pdeathsig_prefix() -> list[str]:
    """``setpriv --pdeathsig KILL --`` when it is available and meaningful.

    Linux delivers the parent-death signal when the *thread* that forked the
    child exits, so it is only safe from the main thread (whose exit is the
    process's). It covers the case ``atexit`` cannot: the parent being
    SIGKILLed.
    """
    if threading.current_thread() is not threading.main_thread():
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


class ManagedProcess:
    """One server process in its own session, with its output in a log file."""

    def __init__(self, argv: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._log = open(log_path, "ab")  # closed in stop()
        self.popen = subprocess.Popen(
            [*_pdeathsig_prefix(), *argv],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            close_fds=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, limit: int = 4000) -> str:
        """The last ``limit`` characters of the server's output."""
        try:
            data = self.log_path.read_bytes()
        except OSError as exc:
            return f"<log unreadable: {exc}>"
        return data[-limit:].decode("utf-8", errors="replace")

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM the whole process group, then SIGKILL it after ``grace_s``.

        SeaweedFS can take far longer than a few seconds to shut down
        gracefully (measured: still running 50 s after SIGTERM), and these are
        disposable test servers, so the grace period is short.
        """
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Kill the group even if the leader is gone: nothing of it may survive.
        self._signal_group(signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - kernel trouble
            pass
        self._log.close()

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_until(
    probe: Callable[[], bool],
    *,
    process: ManagedProcess,
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
) -> None:
    """Poll ``probe`` until it returns True, the process dies, or time runs out.

    Raises:
        ServerStartError: with the server's log tail, so a failed start says why.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if not process.alive():
            raise ServerStartError(
                f"{what} exited with code {process.popen.returncode} before answering; "
                f"log tail ({process.log_path}):\n{process.log_tail()}"
            )
        if probe():
            return
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"{what} did not answer within {timeout_s:.0f} s; log tail ({process.log_path}):\n{process.log_tail()}"
            )
        time.sleep(interval_s)
