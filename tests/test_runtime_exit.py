"""A process that used the native client exits with its own status, never SIGABRT.

obstore completes futures from its Rust threads through the loop's
``call_soon_threadsafe``. The CLI once died with -6 after printing its answer:
the Rust thread was still inside the wake-up write (GIL released) when the main
thread, already holding its result, finalized Python; taking the GIL back then
ends the thread with ``pthread_exit``, which aborts a Rust thread. Here the
wake-up write is slowed on foreign threads (1 s, within the hook's 2 s grace),
and finalization made slower still (3 s), so that window is always hit. The
control once exited cleanly in CI: its slow finalizer was a global of the script,
whose namespace the loop keeps alive (through the patched method), so it was never
deleted and finalization took ~0.1 s, less than the 0.2 s slow-down then used.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("obstore")

_CHILD = textwrap.dedent(
    """
    import atexit, sys, threading, time, types
    import obstore as obs
    from obstore.store import MemoryStore
    from objckpt.transfer import runtime

    loop = runtime.get_loop()
    original = loop._write_to_self
    slowed = []

    def slow_on_foreign_threads():
        original()
        if threading.current_thread() not in (threading.main_thread(), runtime._thread):
            slowed.append(1)
            # the Rust thread is descheduled after waking the loop, for longer than the main
            # thread takes to reach finalization (JAX's atexit work included) on a loaded machine
            time.sleep(1.0)


    class SlowFinalization:
        # finalization that takes a while, as with JAX's large heap: the window stays open

        def __del__(self, sleep=time.sleep):  # bound now: module globals may be None by then
            sleep(3.0)


    # Held by a module of its own, which only finalization frees. Not a global of this
    # script: the loop keeps slow_on_foreign_threads, so __main__'s namespace outlives
    # finalization uncleared and a keeper there is never deleted (the window then shuts
    # before the Rust thread wakes, and the control exits cleanly).
    holder = types.ModuleType("slow_finalization")
    holder.keeper = SlowFinalization()
    sys.modules[holder.__name__] = holder
    del holder

    loop._write_to_self = slow_on_foreign_threads
    if sys.argv[1] == "without-hook":
        atexit.unregister(runtime._settle_at_exit)
    store = MemoryStore()

    async def round_trip():
        await obs.put_async(store, "k", b"x")
        return bytes(await (await obs.get_async(store, "k")).bytes_async())

    for _ in range(20):  # a round trip may complete on the loop's own thread: try until one does not
        assert runtime.run_sync(round_trip()) == b"x"
        if slowed:
            break
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
