"""Every operation on every kind of checkpoint: the cells where two features meet.

Each cell builds one kind of checkpoint in a fresh root (a plain save, format 2, an incremental
step whose base retention deleted, a compressed step, a step saved by two processes, a local-tier
step, a peer copy a two-process job restored from, a step a manager copied to a replica root, a
safetensors export, an Orbax checkpoint) and runs one operation on it (restore onto the saved and
onto another mesh, ``verify``, ``verify --no-read``, ``inspect`` through the API and the CLI,
``ls``, ``cp`` to another store then restore, ``export --format safetensors`` then load with the
``safetensors`` package, ``rm``, ``gc``, retention). A cell either works (bit-exact where it restores) or is refused with the
documented error that :data:`REFUSED` names; nothing else passes. Every store runs every kind it
can hold: local disk (the quick tier), S3 and GCS (the full suite). A kind is built once per store
(a module-scoped fixture) for the operations that leave it as it is, afresh for each of the others.
``python tests/test_matrix.py`` prints the table that docs/MATRIX.md holds.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_bit_exact
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.cli import main as cli_main

KINDS = (
    "plain",
    "format2",
    "incremental",
    "compressed",
    "two_process",
    "local",
    "peer",
    "replica",
    "safetensors",
    "orbax",
)
OPS = (
    "restore",
    "restore_other_mesh",
    "verify",
    "verify_no_read",
    "inspect",
    "inspect_cli",
    "ls",
    "cp",
    "export",
    "rm",
    "gc",
    "retention",
)
STORES = ("local", "s3", "gcs")
KEEP_1 = objckpt.Retention(keep_last=1)


class CommandFailed(Exception):
    """A command line that exited non-zero: its status and standard error."""


#: The cells refused on purpose: (store, kind, op; "*" for any) → (the error's type, the words
#: its message holds, why). Every other cell works.
REFUSED: dict[tuple[str, str, str], tuple[type[BaseException], str, str]] = {
    ("local", "*", "verify_no_read"): (
        objckpt.ChecksumsUnavailableError,
        "keeps no checksum",
        "a local file system keeps no checksum of its own to compare; `verify` reads every byte",
    ),
    ("*", "safetensors", "cp"): (
        CommandFailed,
        "is a safetensors checkpoint: objckpt cp converts Orbax's only",
        "cp copies objckpt checkpoints and converts Orbax's; safetensors files are copied as they are",
    ),
    ("*", "safetensors", "export"): (
        objckpt.FormatError,
        "safetensors checkpoint already",
        "it is safetensors already: its files are the export",
    ),
    ("*", "orbax", "export"): (
        objckpt.FormatError,
        "convert it first",
        "export reads objckpt checkpoints: `objckpt cp` converts an Orbax checkpoint, then export the copy",
    ),
    ("*", "orbax", "verify_no_read"): (
        objckpt.ChecksumsUnavailableError,
        "records no checksums",
        "Orbax records no checksum of its chunks to compare with the store's; `verify` reads every byte",
    ),
    ("*", "safetensors", "verify_no_read"): (
        objckpt.ChecksumsUnavailableError,
        "records no checksums",
        "safetensors files record no checksums to compare with the store's; `verify` reads every byte",
    ),
}


def refusal(store: str, kind: str, op: str) -> tuple[type[BaseException], str, str] | None:
    """The documented refusal of a cell, or None where it works."""
    for s in (store, "*"):
        for k in (kind, "*"):
            if (s, k, op) in REFUSED:
                return REFUSED[(s, k, op)]
    return None


#: The cells that do not apply, and why (no refusal to check: the operation has no such input).
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("local", "ls"): "a local tier is not a manager root: `ls` lists the store's steps",
    ("local", "gc"): "the local tier keeps its own steps (LocalCopies.keep_last); gc sweeps a store root",
    ("local", "retention"): "local retention is LocalCopies.keep_last, tried in test_tiers_local.py",
    ("local", "rm"): "a local step is removed by the tier's retention, not by `rm`",
    ("peer", "ls"): "a peer copy lives in its keeper's local tier, not in a manager root",
    ("peer", "gc"): "the keeper's local tier keeps one peer copy, the newest; gc sweeps a store root",
    ("peer", "retention"): "a keeper replaces its peer copy with the newer one it receives",
    ("peer", "rm"): "a peer copy is replaced by its keeper, not removed by `rm`",
    ("safetensors", "ls"): "a safetensors directory holds no steps",
    ("safetensors", "gc"): "a safetensors directory holds no steps",
    ("safetensors", "retention"): "a safetensors directory holds no steps",
    ("orbax", "retention"): "retention of Orbax steps is tried in test_dayone_orbax_roots.py",
}

#: The kinds a store does not have, and why.
NOT_ON_STORE: dict[tuple[str, str], str] = {
    (store, kind): "the recovery tier (its peer copies too) is a directory on each host, whatever the manager's store"
    for store in ("s3", "gcs")
    for kind in ("local", "peer")
}


def _mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[: shape[0] * shape[1]])


def _state(seed: int = 0) -> dict[str, Any]:
    """A small training state: a sharded f32 matrix, a replicated bf16 vector, a scalar."""
    rng = np.random.default_rng(seed)
    mesh = _mesh((4, 2))
    w = jax.device_put(rng.standard_normal((64, 32), dtype=np.float32), NamedSharding(mesh, P("data", "model")))
    b = jax.device_put(rng.standard_normal((32,)).astype(jnp.bfloat16), NamedSharding(mesh, P()))
    return {"params": {"w": w, "b": b}, "count": jnp.asarray(7 + seed, dtype=jnp.int32)}


def _target(mesh_shape: tuple[int, int], spec: P) -> dict[str, Any]:
    mesh = _mesh(mesh_shape)
    return {
        "params": {
            "w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, spec)),
            "b": jax.ShapeDtypeStruct((32,), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
        },
        "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    }


@dataclass
class Built:
    """One checkpoint of a kind: where it is, the root holding it, the state it holds."""

    kind: str
    url: str
    root: str
    state: dict[str, Any]
    storage_options: dict[str, Any]
    save_options: objckpt.Options | None = None
    shape: Callable[[dict[str, Any]], dict[str, Any]] = lambda tree: tree  # noqa: E731

    def target(self, mesh_shape: tuple[int, int], spec: P) -> dict[str, Any]:
        """The restore target on a mesh of ``mesh_shape`` with ``w`` laid out by ``spec``."""
        return self.shape(_target(mesh_shape, spec))

    def expected(self) -> dict[str, Any]:
        return _host(self.shape(self.state))


def _manager_kind(root: str, so: dict[str, Any], **kwargs: Any) -> tuple[str, dict[str, Any]]:
    """Steps 1 and 2 by a manager with ``kwargs``; step 2's URL and state."""
    with objckpt.CheckpointManager(root, storage_options=so, **kwargs) as mgr:
        mgr.save(1, _state(1))
        state = _state(2)
        mgr.save(2, state)
        mgr.wait()
        url = mgr.step_url(2)
    return url, state


def build(kind: str, root: str, so: dict[str, Any], tmp: Path) -> Built:
    """A checkpoint of ``kind`` under ``root`` (``tmp``: local scratch, for the local tier)."""
    if kind == "plain":
        return Built(kind, *_with_root(_manager_kind(root, so), root), so)
    if kind == "format2":
        options = objckpt.Options(format_version=2)
        return Built(kind, *_with_root(_manager_kind(root, so, options=options), root), so, options)
    if kind == "incremental":
        # keep_last=1: retention deletes step 1, whose blobs step 2 references.
        url, state = _manager_kind(root, so, incremental=True, retention=KEEP_1)
        return Built(kind, url, root, state, so)
    if kind == "compressed":
        options = objckpt.Options(compression="zstd")
        return Built(kind, *_with_root(_manager_kind(root, so, options=options), root), so, options)
    if kind == "two_process":
        from multiprocess import run_processes

        leaves = {
            "w": [[64, 32], "float32", ["data", "model"]],
            "b": [[32], "bfloat16", [None]],
        }
        url = f"{root}/step_0000000002"
        job = {"kind": "save", "url": url, "storage_options": so, "mesh": [2, 4], "axes": ["data", "model"]}
        job.update(leaves=leaves, extras=False, options={"blob_size": 1 << 12, "barrier_timeout": 60})
        errors: list[str] = []
        results = run_processes(2, job, timeout=120, stderr=errors)
        assert all(r is not None for r in results), errors

        state = _worker_values(leaves)
        return Built(kind, url, root, state, so, shape=lambda t: {"params": t["params"]})
    if kind == "local":
        local = tmp / "local-tier"
        _manager_kind(root, so, local=str(local), save_rules=objckpt.SavePolicy(save_interval_steps=1000))
        manifests = sorted(local.glob("**/step_*/manifest.json"))
        step2 = [m for m in manifests if m.parent.name.endswith("2") and "peer" not in m.parts]
        assert step2, f"no local step 2 under {local}: {manifests}"
        return Built(kind, str(step2[-1].parent), str(local), _state(2), {})
    if kind == "peer":
        return _peer_kind(root, so, tmp)
    if kind == "replica":
        url, state = _manager_kind(f"{root}/primary", so, replicas=[f"{root}/replica"])
        return Built(kind, url.replace("/primary/", "/replica/"), f"{root}/replica", state, so)
    if kind == "safetensors":
        src = f"{root}/src"
        state = _state(2)
        objckpt.save(src, state, storage_options=so)
        dest = f"{root}/exported"
        objckpt.export_safetensors(src, dest, **_options_pair(so, so))
        return Built(kind, dest, root, state, so)
    if kind == "orbax":
        ocp = pytest.importorskip("orbax.checkpoint")
        state = _state(2)
        if "://" not in root:
            ocp.PyTreeCheckpointer().save(Path(root) / "7", state)
            return Built(kind, f"{root}/7", root, state, {})
        # Orbax writes to local disk here (DESIGN.md): its files go to the bucket as a user's sync would
        from helpers import upload_dir

        ocp.PyTreeCheckpointer().save(tmp / "orbax" / "7", state)
        upload_dir(tmp / "orbax", root, so)
        return Built(kind, f"{root}/7", root, state, so)
    raise ValueError(kind)


def _worker_values(leaves: dict[str, Any]) -> dict[str, Any]:
    """The values tests/mp_worker.py's processes save for ``leaves``, computed here with its
    ``LEAVES`` set to them only meanwhile (a module global other tests of this process read)."""
    import mp_worker

    kept = mp_worker.LEAVES
    mp_worker.LEAVES = {name: (tuple(shape), dtype, spec) for name, (shape, dtype, spec) in leaves.items()}
    try:
        return {"params": {"w": mp_worker.global_value("w"), "b": mp_worker.global_value("b")}}
    finally:
        mp_worker.LEAVES = kept


#: The leaves the peer-copy job saves (tests/mp_worker.py): ``w`` is split over the devices of a
#: process and replicated over the processes, so each process's part (and so its peer copy) holds
#: every value and restores whole in this one process.
PEER_LEAVES = {"w": [[64, 32], "float32", [None, "model"]], "b": [[32], "bfloat16", [None]]}


def _peer_kind(root: str, so: dict[str, Any], tmp: Path) -> Built:
    """Steps 1 and 2 saved by a 2-process manager with ``local=`` and ``peers=1``; process 1's own
    local step 2 deleted; a new manager restores step 2 on every process, process 1's part from the
    copy process 0 keeps (onto the saved grid and another, bit-exact). That copy is the kind."""
    from multiprocess import run_processes

    local = tmp / "peer-tier"
    job = {"kind": "peer_copy_restore", "url": root, "storage_options": so, "local": str(local), "victim": 1}
    job.update(mesh=[2, 4], axes=["data", "model"], leaves=PEER_LEAVES, extras=False, other_remap={"model": "data"})
    job["options"] = {"barrier_timeout": 60}
    errors: list[str] = []
    results = run_processes(2, job, timeout=150, stderr=errors)
    assert all(r is not None for r in results), errors
    for r in results:
        assert r is not None and (r["step"], r["tier"]) == (2, "peer"), results
        assert not r["mismatches"] and not r["other_mismatches"], results
    state = _worker_values(PEER_LEAVES)
    copy = local / "process_0" / "peer" / "process_1" / "step_0000000002"
    assert (copy / "manifest.json").is_file(), sorted(str(p) for p in local.rglob("manifest.json"))
    return Built("peer", str(copy), str(local), state, {}, shape=lambda t: {"params": t["params"]})


def _with_root(pair: tuple[str, dict[str, Any]], root: str) -> tuple[str, str, dict[str, Any]]:
    return pair[0], root, pair[1]


def _options_pair(src: dict[str, Any], dst: dict[str, Any]) -> dict[str, Any]:
    """``export_safetensors``'s keywords for the source's and the destination's store options."""
    import inspect as pyinspect

    names = pyinspect.signature(objckpt.export_safetensors).parameters
    if "src_storage_options" in names:
        return {"src_storage_options": src, "dst_storage_options": dst}
    return {"storage_options": src, "dest_storage_options": dst}


def _host(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x), tree)


def _cli_ok(*args: str) -> str:
    """The standard output of a command line that must succeed; :class:`CommandFailed` else."""
    rc, out, err = _cli(*args)
    if rc != 0:
        raise CommandFailed(f"`objckpt {' '.join(args)}` exited {rc}: {err}")
    return out


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["--no-progress", *args])
    return rc, out.getvalue(), err.getvalue()


def _restore(b: Built, url: str, target: Any, so: dict[str, Any] | None = None) -> Any:
    return objckpt.restore(url, target, storage_options=b.storage_options if so is None else so)


def op_restore(b: Built, env: Env) -> None:
    got = _restore(b, b.url, b.target((4, 2), P("data", "model")))
    assert_tree_bit_exact(b.expected(), _host(got))


def op_restore_other_mesh(b: Built, env: Env) -> None:
    target = b.target((2, 4), P("model", "data"))
    got = _restore(b, b.url, target)
    assert got["params"]["w"].sharding == target["params"]["w"].sharding
    assert_tree_bit_exact(b.expected(), _host(got))


def op_verify(b: Built, env: Env) -> None:
    report = objckpt.verify(b.url, storage_options=b.storage_options)
    assert report.ok, report.problems


def op_verify_no_read(b: Built, env: Env) -> None:
    report = objckpt.verify(b.url, read_data=False, storage_options=b.storage_options)
    assert report.ok, report.problems
    assert report.bytes_read < sum(np.asarray(x).nbytes for x in jax.tree.leaves(b.state)), report


def op_inspect(b: Built, env: Env) -> None:
    info = objckpt.inspect(b.url, storage_options=b.storage_options)
    text = str(info)
    for name in ("w", "b"):
        assert name in text, text


def op_inspect_cli(b: Built, env: Env) -> None:
    rc, out, err = _cli("inspect", b.url)
    assert rc == 0, err
    assert "params" in out and "64" in out and "32" in out, out


def op_ls(b: Built, env: Env) -> None:
    rc, out, err = _cli("--json", "ls", b.root)
    assert rc == 0, err
    import json

    rows = json.loads(out)
    step = int(Path(b.url).name.split("_")[-1]) if "_" in Path(b.url).name else int(Path(b.url).name)
    mine = [r for r in rows if r["step"] == step]
    assert mine and mine[0]["committed"], rows
    assert all(r["committed"] for r in rows), f"a step listed as uncommitted: {rows}"


def op_cp(b: Built, env: Env) -> None:
    """``objckpt cp`` to another store (:data:`COPY_TO`), then a restore and a verify there."""
    dest = env.fresh_url("copy")
    _cli_ok("cp", b.url, dest)  # as a user runs it: an Orbax checkpoint is converted
    got = _restore(b, dest, b.target((2, 4), P("model", "data")), env.so)
    assert_tree_bit_exact(b.expected(), _host(got))
    assert objckpt.verify(dest, storage_options=env.so).ok


def op_export(b: Built, env: Env) -> None:
    from safetensors.numpy import load_file

    dest = env.tmp / "exported-again"
    objckpt.export_safetensors(b.url, str(dest), **_options_pair(b.storage_options, {}))
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(dest.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    want = {"params.w": b.state["params"]["w"], "params.b": b.state["params"]["b"]}
    for name, value in want.items():
        match = [k for k in tensors if k.replace("/", ".").endswith(name)]
        assert match, f"{name} not in {sorted(tensors)}"
        got = tensors[match[0]]
        np.testing.assert_array_equal(got.view(np.uint8), np.asarray(value).view(np.uint8))


def op_rm(b: Built, env: Env) -> None:
    rc, out, err = _cli("rm", b.url)
    assert rc == 0, (out, err)
    with pytest.raises(objckpt.CheckpointNotFoundError):
        _restore(b, b.url, b.target((4, 2), P("data", "model")))
    # rm leaves nothing of the checkpoint behind that a later command counts as a step
    rc, out, err = _cli("--json", "ls", b.root)
    if rc == 0:
        import json

        assert all(r["committed"] for r in json.loads(out)), out


def op_gc(b: Built, env: Env) -> None:
    rc, out, err = _cli("gc", "--grace-seconds", "0", b.root)
    assert rc == 0, (out, err)
    op_restore(b, env)
    op_verify(b, env)


def op_retention(b: Built, env: Env) -> None:
    """A manager continued on the root with keep_last=1 and the kind's options: the newest step
    restores and verifies, whatever retention deleted."""
    kwargs: dict[str, Any] = {"retention": KEEP_1}
    if b.save_options is not None:
        kwargs["options"] = b.save_options
    if b.kind == "incremental":
        kwargs["incremental"] = True
    state = _state(3)
    with objckpt.CheckpointManager(b.root, storage_options=b.storage_options, **kwargs) as mgr:
        mgr.save(3, state)
        mgr.wait()
        url = mgr.step_url(3)
        assert mgr.steps() == [3], mgr.steps()
    got = _restore(b, url, _target((2, 4), P("model", "data")))
    assert_tree_bit_exact(_host(state), _host(got))
    assert objckpt.verify(url, storage_options=b.storage_options).ok


def _shell_env(store: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line finds the store's credentials and endpoint where a user's shell has them."""
    if store == "s3":
        for name, value in request.getfixturevalue("s3_service").env().items():
            monkeypatch.setenv(name, value)
    if store == "gcs":
        service = request.getfixturevalue("gcs_service")
        for name, value in service.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", service.endpoint_url)  # how Orbax's reader reaches it
        monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")


#: The operations that change nothing of the checkpoint they run on.
READ_ONLY = frozenset(OPS) - {"rm", "gc", "retention"}

OPERATIONS: dict[str, Callable[[Built, Env], None]] = {op: globals()[f"op_{op}"] for op in OPS}


@dataclass
class Env:
    """Where a cell may write: a fresh URL on the cell's store, local scratch."""

    base: str
    so: dict[str, Any]
    tmp: Path
    counter: int = 0

    def fresh_url(self, name: str) -> str:
        self.counter += 1
        return f"{self.base}/{name}-{self.counter}"


MARKS = {"local": [pytest.mark.quick], "s3": [pytest.mark.s3], "gcs": [pytest.mark.gcs]}
#: Where ``cp`` copies a checkpoint of each store: another provider's bucket (another directory on
#: local disk).
COPY_TO = {"local": "local", "s3": "gcs", "gcs": "s3"}


@pytest.fixture(scope="module")
def built(module_store_target_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Built]:
    """``built(store, kind)``: the module's one checkpoint of ``kind`` on ``store``, built when a
    cell first asks; every operation that leaves it as it is runs on it."""
    cache: dict[tuple[str, str], Built] = {}

    def get(store: str, kind: str) -> Built:
        if (store, kind) not in cache:
            target = module_store_target_factory(store)
            cache[(store, kind)] = build(kind, target.url, target.storage_options, tmp_path_factory.mktemp(kind))
        return cache[(store, kind)]

    return get


def _cell_params() -> list[Any]:
    out = []
    for store in STORES:
        for kind in KINDS:
            for op in OPS:
                marks = MARKS[store] + (MARKS[COPY_TO[store]] if op == "cp" and COPY_TO[store] != store else [])
                out.append(pytest.param(store, kind, op, id=f"{store}-{kind}-{op}", marks=marks))
    return out


@pytest.mark.parametrize(("store", "kind", "op"), _cell_params())
def test_cell(
    store: str,
    kind: str,
    op: str,
    store_target_factory: Any,
    built: Callable[[str, str], Built],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if (kind, op) in NOT_APPLICABLE:
        pytest.skip(NOT_APPLICABLE[(kind, op)])
    if (store, kind) in NOT_ON_STORE:
        pytest.skip(NOT_ON_STORE[(store, kind)])
    _shell_env(store, request, monkeypatch)
    target = store_target_factory(store)
    env = Env(target.url + "-scratch", target.storage_options, tmp_path)
    if op == "cp":  # the copy goes to another store
        _shell_env(COPY_TO[store], request, monkeypatch)
        other = store_target_factory(COPY_TO[store])
        env = Env(other.url, other.storage_options, tmp_path)
    # one checkpoint of the kind serves every operation that leaves it as it is
    b = built(store, kind) if op in READ_ONLY else build(kind, target.url, target.storage_options, tmp_path)
    refused = refusal(store, kind, op)
    if refused is None:
        OPERATIONS[op](b, env)
        return
    error, words, _why = refused
    with pytest.raises(error, match=words):
        OPERATIONS[op](b, env)


# ------------------------------------------------------------------ pairs of kinds


def _frozen_state(step: int) -> dict[str, Any]:
    """A state whose ``frozen`` leaf never changes and whose ``adapter`` does: what an
    incremental save references and uploads."""
    frozen = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    adapter = np.full((64,), step, dtype=np.float32)
    return {"frozen": frozen, "adapter": adapter}


def _check_step(url: str, state: dict[str, Any], so: dict[str, Any]) -> None:
    """The step restores bit-exact, verifies, and inspects."""
    got = objckpt.restore(url, jax.tree.map(lambda _: None, state), storage_options=so)
    assert_tree_bit_exact(state, _host(got))
    assert objckpt.verify(url, storage_options=so).ok
    objckpt.inspect(url, storage_options=so)


def pair_incremental_over_copy(root: str, so: dict[str, Any], tmp: Path) -> None:
    """An incremental save over a cp of an incremental step (a manager continued on a copy)."""
    with objckpt.CheckpointManager(f"{root}/a", storage_options=so, incremental=True) as mgr:
        for step in (1, 2):
            mgr.save(step, _frozen_state(step), force=True, wait=True)
    objckpt.copy(
        f"{root}/a/step_0000000002", f"{root}/b/step_0000000002", src_storage_options=so, dst_storage_options=so
    )
    with objckpt.CheckpointManager(f"{root}/b", storage_options=so, incremental=True, retention=KEEP_1) as mgr:
        mgr.save(3, _frozen_state(3), force=True, wait=True)
        url = mgr.step_url(3)
    _check_step(url, _frozen_state(3), so)


def pair_compression_on_over_raw_base(root: str, so: dict[str, Any], tmp: Path) -> None:
    """Compression turned on in a later run over a raw base."""
    with objckpt.CheckpointManager(root, storage_options=so, incremental=True) as mgr:
        mgr.save(1, _frozen_state(1), force=True, wait=True)
    zstd = objckpt.Options(compression="zstd")
    with objckpt.CheckpointManager(root, storage_options=so, incremental=True, retention=KEEP_1, options=zstd) as mgr:
        mgr.save(2, _frozen_state(2), force=True, wait=True)
        url = mgr.step_url(2)
    _check_step(url, _frozen_state(2), so)


def pair_compression_off_over_compressed_base(root: str, so: dict[str, Any], tmp: Path) -> None:
    """Compression turned off in a later run over a compressed base."""
    zstd = objckpt.Options(compression="zstd")
    with objckpt.CheckpointManager(root, storage_options=so, incremental=True, options=zstd) as mgr:
        mgr.save(1, _frozen_state(1), force=True, wait=True)
    with objckpt.CheckpointManager(root, storage_options=so, incremental=True, retention=KEEP_1) as mgr:
        mgr.save(2, _frozen_state(2), force=True, wait=True)
        url = mgr.step_url(2)
    _check_step(url, _frozen_state(2), so)


def pair_local_tier_of_incremental_run(root: str, so: dict[str, Any], tmp: Path) -> None:
    """A local-tier step of an incremental run: a restart restores it from the local tier."""
    local = str(tmp / "tier")
    with objckpt.CheckpointManager(root, storage_options=so, incremental=True, local=local) as mgr:
        for step in (1, 2):
            mgr.save(step, _frozen_state(step), force=True, wait=True)
    with objckpt.CheckpointManager(root, storage_options=so, local=local) as mgr:
        assert mgr.latest_step() == 2
        got = mgr.restore(2, jax.tree.map(lambda _: None, _frozen_state(2)))
        assert mgr.tier_status().last_restore.tier == "local"
    assert_tree_bit_exact(_frozen_state(2), _host(got))
    _check_step(f"{root}/step_0000000002", _frozen_state(2), so)


def pair_continued_on_copied_root(root: str, so: dict[str, Any], tmp: Path) -> None:
    """A manager continued on a copied root (a failover), with retention."""
    with objckpt.CheckpointManager(f"{root}/a", storage_options=so) as mgr:
        for step in (1, 2):
            mgr.save(step, _frozen_state(step), force=True, wait=True)
    for step in (1, 2):
        name = f"step_{step:010d}"
        objckpt.copy(f"{root}/a/{name}", f"{root}/b/{name}", src_storage_options=so, dst_storage_options=so)
    with objckpt.CheckpointManager(f"{root}/b", storage_options=so, retention=KEEP_1) as mgr:
        assert mgr.latest_step() == 2
        mgr.save(3, _frozen_state(3), force=True, wait=True)
        assert mgr.steps() == [3]
        url = mgr.step_url(3)
    _check_step(url, _frozen_state(3), so)


def pair_continued_on_replica_root(root: str, so: dict[str, Any], tmp: Path) -> None:
    """A manager continued on the replica root a first run's manager kept (a failover to the
    replica), with retention and replicas of its own pointing back at the first root."""
    with objckpt.CheckpointManager(f"{root}/a", storage_options=so, replicas=[f"{root}/b"]) as mgr:
        for step in (1, 2):
            mgr.save(step, _frozen_state(step), force=True, wait=True)
    with objckpt.CheckpointManager(f"{root}/b", storage_options=so, retention=KEEP_1, replicas=[f"{root}/a"]) as mgr:
        assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
        assert_tree_bit_exact(_frozen_state(2), _host(mgr.restore(2, jax.tree.map(lambda _: None, _frozen_state(2)))))
        mgr.save(3, _frozen_state(3), force=True, wait=True)
        assert mgr.steps() == [3]
    for side in ("a", "b"):  # the new step reached the first root too, and retention ran there
        with objckpt.CheckpointManager(f"{root}/{side}", storage_options=so) as mgr:
            assert mgr.steps() == [3], (side, mgr.steps())
        _check_step(f"{root}/{side}/step_0000000003", _frozen_state(3), so)


def pair_export_over_export_of_another_layout(root: str, so: dict[str, Any], tmp: Path) -> None:
    """An export into a destination on the store holding an export of another layout (one file,
    then files with an index, then one file again): refused without ``overwrite``; with it only
    the new export is left, and it loads with the ``safetensors`` package and restores."""
    from safetensors.numpy import load

    from objckpt.storage import from_url
    from objckpt.transfer import runtime

    for step in (1, 2):
        objckpt.save(f"{root}/{step}", _frozen_state(step), storage_options=so)
    dest, keys = f"{root}/export", _options_pair(so, so)
    sharded = {"max_shard_bytes": 40_000}  # frozen (64 KiB) and adapter in two files
    objckpt.export_safetensors(f"{root}/1", dest, **keys)
    with pytest.raises(objckpt.ObjectExistsError, match="holds an export"):
        objckpt.export_safetensors(f"{root}/2", dest, **sharded, **keys)
    store = from_url(dest, **so)
    for step, layout in ((2, sharded), (1, {})):
        objckpt.export_safetensors(f"{root}/{step}", dest, overwrite=True, **layout, **keys)
        names = sorted(runtime.run_sync(store.list_names()))
        files = [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)] + ["model.safetensors.index.json"]
        assert names == (files if layout else ["model.safetensors"]), names
        tensors: dict[str, np.ndarray] = {}
        for name in names:
            if name.endswith(".safetensors"):
                tensors.update(load(runtime.run_sync(store.get(name))))
        assert_tree_bit_exact(_frozen_state(step), tensors)
        assert_tree_bit_exact(_frozen_state(step), objckpt.restore(dest, storage_options=so))
    runtime.run_sync(store.close())


def pair_resumed_from_older_step(root: str, so: dict[str, Any], tmp: Path) -> None:
    """A run resumed from an older step after the user deleted the newer ones from the store:
    the deleted branch never comes back from the local tier (issue 77, item 4)."""
    local = str(tmp / "tier")
    with objckpt.CheckpointManager(root, storage_options=so, local=local) as mgr:
        for step in range(1, 6):
            mgr.save(step, _frozen_state(step), force=True, wait=True)  # local keeps 4 and 5
    for step in (3, 4, 5):
        rc, out, err = _cli("rm", f"{root}/step_{step:010d}")
        assert rc == 0, err
    new = {"frozen": _frozen_state(0)["frozen"], "adapter": np.full((64,), -3.0, np.float32)}
    with objckpt.CheckpointManager(root, storage_options=so, local=local) as mgr:
        assert mgr.latest_step() == 2, mgr.tier_status()
        mgr.restore(2, jax.tree.map(lambda _: None, _frozen_state(2)))
        mgr.save(3, new, force=True, wait=True)
    with objckpt.CheckpointManager(root, storage_options=so, local=local) as mgr:
        assert mgr.latest_step() == 3, mgr.tier_status()
        got = mgr.restore(3, jax.tree.map(lambda _: None, new))
        with pytest.raises(objckpt.CheckpointNotFoundError):
            mgr.restore(5, jax.tree.map(lambda _: None, new))
    assert_tree_bit_exact(new, _host(got))


def pair_options_changed_between_runs(root: str, so: dict[str, Any], tmp: Path) -> None:
    """Format 2, then format 3 with digests, then compression: every step restores."""
    runs = [objckpt.Options(format_version=2), objckpt.Options(digest="sha256"), objckpt.Options(compression="zstd")]
    for step, options in enumerate(runs, start=1):
        with objckpt.CheckpointManager(root, storage_options=so, options=options, incremental=step > 1) as mgr:
            mgr.save(step, _frozen_state(step), force=True, wait=True)
    for step in range(1, len(runs) + 1):
        _check_step(f"{root}/step_{step:010d}", _frozen_state(step), so)


PAIRS = {name[len("pair_") :]: fn for name, fn in list(globals().items()) if name.startswith("pair_")}


@pytest.mark.parametrize(
    ("store", "pair"),
    [pytest.param(store, pair, id=f"{store}-{pair}", marks=MARKS[store]) for store in STORES for pair in PAIRS],
)
def test_pair(
    store: str,
    pair: str,
    store_target_factory: Any,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _shell_env(store, request, monkeypatch)
    target = store_target_factory(store)
    PAIRS[pair](target.url, target.storage_options, tmp_path)


def table() -> str:
    """The cells as docs/MATRIX.md shows them: one table per store, then every refusal and
    every cell that does not apply, with the reason."""
    lines = []
    for store in STORES:
        lines += [
            "",
            f"**{STORE_NAMES[store]}**",
            "",
            "| kind | " + " | ".join(OPS) + " |",
            "|---" * (len(OPS) + 1) + "|",
        ]
        for kind in KINDS:
            cells = []
            for op in OPS:
                refused = refusal(store, kind, op)
                if (kind, op) in NOT_APPLICABLE or (store, kind) in NOT_ON_STORE:
                    cells.append("n/a")
                elif refused is not None:
                    cells.append(f"refused: {_shown(refused[0])}")
                else:
                    cells.append("works")
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", "Refusals:", ""]
    for (store, kind, op), (error, _words, why) in REFUSED.items():
        where = "any store" if store == "*" else STORE_NAMES[store]
        lines.append(f"- {kind if kind != '*' else 'every kind'}, `{op}`, {where}: {_shown(error)}: {why}.")
    lines += ["", "Not applicable:", ""]
    lines += [f"- {kind}, `{op}`: {why}." for (kind, op), why in NOT_APPLICABLE.items()]
    lines += [f"- {kind}, every operation, {STORE_NAMES[store]}: {why}." for (store, kind), why in NOT_ON_STORE.items()]
    return "\n".join(lines).strip() + "\n"


def _shown(error: type[BaseException]) -> str:
    return "`objckpt` exits 2" if error is CommandFailed else f"`{error.__name__}`"


STORE_NAMES = {"local": "local disk (`file://`)", "s3": "S3 (SeaweedFS)", "gcs": "GCS (fake-gcs-server)"}
MATRIX_DOC = Path(__file__).resolve().parents[1] / "docs" / "MATRIX.md"
BEGIN, END = "<!-- generated by tests/test_matrix.py: begin -->", "<!-- generated by tests/test_matrix.py: end -->"


@pytest.mark.quick
def test_the_docs_table_is_the_one_this_file_checks() -> None:
    text = MATRIX_DOC.read_text()
    shown = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip() + "\n"
    assert shown == table(), "docs/MATRIX.md is stale: python tests/test_matrix.py --write"


if __name__ == "__main__":  # python tests/test_matrix.py [--write]: the table, or docs/MATRIX.md rewritten
    if "--write" in sys.argv:
        text = MATRIX_DOC.read_text()
        head, tail = text[: text.index(BEGIN) + len(BEGIN)], text[text.index(END) :]
        MATRIX_DOC.write_text(f"{head}\n{table()}{tail}")
    else:
        print(table())
