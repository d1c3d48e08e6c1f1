"""One measured phase in a fresh process: ``python -m benchmarks.rivals.worker`` with the
:class:`~benchmarks.rivals.common.Context` as JSON on stdin.

Prints one line ``RESULT {json}``: wall seconds of the timed call, client CPU seconds
(all threads), RSS before the call and the peak during it (VmHWM reset just before),
the system's own counters, and crc32 fingerprints of what a restore returned.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main() -> None:
    from benchmarks.rivals.common import Context

    ctx = Context(**json.loads(sys.stdin.read()))
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.update(ctx.base_env())

    import importlib

    from benchmarks.rivals import MODULES

    system = importlib.import_module(MODULES[ctx.system])
    os.environ.update(system.env(ctx))
    result: dict = {"system": ctx.system, "phase": ctx.phase, "store": ctx.store, "workload": ctx.workload}
    why_not = system.supports(ctx)  # phases other than save call prepare_restore/restore (also "convert")
    if why_not:
        print("RESULT " + json.dumps({**result, "skipped": why_not}), flush=True)
        return

    import gc

    from benchmarks.rivals import common, workloads

    workload = workloads.get(ctx.workload)
    try:
        if ctx.phase == "save":
            arg = system.prepare_save(ctx, workload)
            call = lambda: system.save(ctx, workload, arg)  # noqa: E731
        else:
            arg = system.prepare_restore(ctx, workload, ctx.phase == "restore_resharded")
            call = lambda: system.restore(ctx, workload, arg)  # noqa: E731
        gc.collect()
        common.recycle_fresh_memory(workload.nbytes * 3 // 2 + (256 << 20))
        rss_before = common.rss()
        peak_reset = common.reset_peak_rss()
        cpu0, t0 = common.cpu_seconds(), time.perf_counter()
        if ctx.profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            out = profiler.runcall(call)
            os.makedirs(ctx.profile_dir, exist_ok=True)
            profiler.dump_stats(
                os.path.join(ctx.profile_dir, f"{ctx.system}-{ctx.store}-{ctx.workload}-{ctx.phase}.prof")
            )
        else:
            out = call()
        seconds = time.perf_counter() - t0
        cpu = common.cpu_seconds() - cpu0
        peak = common.peak_rss() if peak_reset else 0
        extra = out if ctx.phase == "save" else out[1]
        arrays = None if ctx.phase == "save" else out[0]
        result.update(
            seconds=seconds,
            cpu_s=cpu + float(extra.pop("helper_cpu_s", 0.0)),
            rss_before=rss_before,
            peak_rss=peak,
            bytes=workload.nbytes,
            **extra,
        )
        if arrays is not None:
            import numpy as np

            result["fingerprint"] = workloads.fingerprint([np.asarray(a) for a in arrays])
    except Exception as exc:
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        finish = getattr(system, "finish", None)
        if finish is not None:
            finish(ctx)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no waiting on library threads at interpreter exit
