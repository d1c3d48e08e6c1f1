"""Run a benchmark's ``--worker`` mode in N local JAX processes and collect their RESULT lines.

``run_workers`` is the driver's side, ``worker_main`` each process's.

A multi-process benchmark (bench_tiers, bench_reads) starts ``python -m benchmarks.<name> --worker``
once per process, each in its own session, with the job as JSON in ``<PREFIX>_JOB`` and its rank
in ``<PREFIX>_PROCESS``; every process is SIGKILLed at the end, so a hung one never outlives the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.multiprocess import _kill_all

ROOT = Path(__file__).parents[1]


def run_workers(
    module: str, job: dict[str, Any], *, processes: int, devices: int, env_prefix: str, timeout: float
) -> list[dict[str, Any]]:
    """Each worker's last ``RESULT <json>``, in process order; SystemExit with its stderr tail if one printed none.

    ``module``: e.g. ``benchmarks.bench_tiers``; ``devices``: CPU devices per process;
    ``timeout``: seconds each process is waited for.
    """
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["PYTHONPATH"] = str(ROOT)
    env[f"{env_prefix}_JOB"] = json.dumps(job)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--worker"],
            env={**env, f"{env_prefix}_PROCESS": str(p)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for p in range(processes)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        _kill_all(procs)
    results = []
    for out, err in outputs:
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"a worker failed:\n{err[-4000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return results


def worker_main(env_prefix: str, processes: int, work: Callable[[dict[str, Any], int], dict[str, Any]]) -> None:
    """One worker process: join the others with jax.distributed (CPU collectives: gloo, the benchmark's
    choice), print ``RESULT <json>`` of ``work(job, process)``, wait at a barrier for every process, exit."""
    import jax

    job = json.loads(os.environ[f"{env_prefix}_JOB"])
    process = int(os.environ[f"{env_prefix}_PROCESS"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the benchmark's choice
    jax.distributed.initialize(
        f"127.0.0.1:{job['port']}", num_processes=processes, process_id=process, initialization_timeout=120
    )
    result = work(job, process)
    print("RESULT " + json.dumps(result), flush=True)
    from objckpt.multihost import get_coordinator

    get_coordinator().barrier(f"{env_prefix.lower()}/exit", timeout=120)
    os._exit(0)
