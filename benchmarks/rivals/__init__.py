"""The systems compared by ``benchmarks/bench_rivals.py``, one module each.

Every system module defines:

- ``NAME``: its label in the tables;
- ``env(ctx) -> dict``: environment variables its process needs (set before any import);
- ``supports(ctx) -> str | None``: ``None`` when it can run against this store, else why not;
- ``prepare_save(ctx, workload)`` / ``save(ctx, workload, state) -> dict``;
- ``prepare_restore(ctx, workload, resharded)`` / ``restore(ctx, workload, target) -> (arrays, dict)``,
  where ``arrays`` are the restored global values (for the fingerprint check) or ``None``.

``ctx`` is the measurement's context (:class:`benchmarks.rivals.common.Context`). Only the
``save``/``restore`` calls are timed; ``prepare_*`` (building the tree or the target,
mounting a filesystem) is not. Each phase runs in a fresh process
(:mod:`benchmarks.rivals.worker`), so peak RSS and CPU time belong to that phase alone.
"""

SYSTEMS = ("raw", "objckpt", "orbax", "dcp", "naive", "from_orbax")
#: Systems a plain run leaves out unless ``--systems`` names them.
OPTIONAL_SYSTEMS = ("from_orbax",)

MODULES = {
    "raw": "benchmarks.rivals.raw",
    "objckpt": "benchmarks.rivals.objckpt_engine",
    "orbax": "benchmarks.rivals.orbax_ckpt",
    "dcp": "benchmarks.rivals.torch_dcp",
    "naive": "benchmarks.rivals.naive",
    "from_orbax": "benchmarks.rivals.from_orbax",
}
