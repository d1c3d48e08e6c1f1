"""A process that used the native client exits with its own status, never SIGABRT.

obstore completes futures from its Rust threads through the loop's
``call_soon_threadsafe``. The CLI once died with -6 after printing its answer:
the Rust thread was still inside the wake-up write (GIL released) when the main
thread, already holding its result, finalized Python; taking the GIL back then
ends the thread with ``pthread_exit``, which aborts a Rust thread. Here the
wake-up write is slowed on foreign threads, and finalization made slow, so that
window is always hit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("obstore")

_CHILD = textwrap.dedent(
    """
    import atexit, sys, threading, time
    import obstore as obs
    from obstore.store import MemoryStore
    from objckpt import _runtime

    loop = _runtime.get_loop()
    original = loop._write_to_self
    slowed = []

    def slow_on_foreign_threads():
        original()
        if threading.current_thread() not in (threading.main_thread(), _runtime._thread):
            slowed.append(1)
            time.sleep(0.2)  # the Rust thread is descheduled after waking the loop


    class SlowFinalization:
        # finalization that takes a while, as with JAX's large heap: the window stays open

        def __del__(self, sleep=time.sleep):  # bound now: module globals may be None by then
            sleep(1.0)


    keeper = SlowFinalization()  # a module global: deleted only once Python is finalizing

    loop._write_to_self = slow_on_foreign_threads
    if sys.argv[1] == "without-hook":
        atexit.unregister(_runtime._settle_at_exit)
    store = MemoryStore()

    async def round_trip():
        await obs.put_async(store, "k", b"x")
        return bytes(await (await obs.get_async(store, "k")).bytes_async())

    assert _runtime.run_sync(round_trip()) == b"x"
    assert slowed, "the native client did not complete through call_soon_threadsafe"
    print("done", flush=True)
    sys.exit(3)  # a status of the program's own, which must survive exit
    """
)


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=120, check=False
    )


def test_exit_waits_for_native_threads_inside_the_loop():
    done = _run("with-hook")
    assert (done.returncode, done.stdout) == (3, "done\n"), done.stderr


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14 parks such threads instead of ending them")
def test_without_the_exit_hook_the_same_program_aborts():
    """The scenario above is the real hazard: without the hook it dies by SIGABRT."""
    done = _run("without-hook")
    assert done.stdout == "done\n" and done.returncode == -6, (done.returncode, done.stderr)
