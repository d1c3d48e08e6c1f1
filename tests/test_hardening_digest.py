"""Issue 51 item 12: CRC-32C is linear, so a writer to a copy can forge bytes that keep every
crc32c; ``Options(digest="sha256")`` records each piece's SHA-256 in the index objects and pins
each index object by its SHA-256 in the root, and restore, verify and cp check them.

Every forgery here keeps the crc32c of what it changes (solved over GF(2), since CRC is linear),
so only the SHA-256 can catch it.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_manifest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import objckpt
from objckpt.core.checksum import crc32c, sha256_hex
from objckpt.core.format import MANIFEST_KEY
from objckpt.restoring import locations
from objckpt.transfer import runtime

DIGEST = objckpt.Options(digest="sha256")
DIGEST_V2 = objckpt.Options(digest="sha256", format_version=2)  # the tests that read JSON index objects


def _mesh():
    return jax.make_mesh((4, 2), ("x", "y"))


def _tree():
    w = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)
    return {
        "w": jax.device_put(jnp.asarray(w), NamedSharding(_mesh(), P("x", "y"))),  # 8 pieces of 64 KiB
        "b": np.linspace(0, 1, 50_000, dtype=np.float32),
        "step": 3,
    }


def _target():
    """Another sharding than the saved one, so every piece is copied (streamed where the store streams)."""
    return {
        "w": jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=NamedSharding(_mesh(), P("y", "x"))),
        "b": None,
        "step": None,
    }


def _url(target) -> str:
    """``file://`` for the local kind (the URL form a user writes), the store's own URL otherwise."""
    return f"file://{target.url}" if target.kind == "local" else target.url


def _solve(columns: list[int], want: int) -> int:
    """A mask of ``columns`` whose XOR is ``want`` (GF(2) elimination); raises if none."""
    basis: dict[int, tuple[int, int]] = {}  # pivot bit → (vector, mask of columns)
    for k, vector in enumerate(columns):
        mask = 1 << k
        for bit in sorted(basis, reverse=True):
            if vector >> bit & 1:
                vector, mask = vector ^ basis[bit][0], mask ^ basis[bit][1]
        if vector:
            basis[vector.bit_length() - 1] = (vector, mask)
    mask = 0
    for bit in sorted(basis, reverse=True):
        if want >> bit & 1:
            want, mask = want ^ basis[bit][0], mask ^ basis[bit][1]
    assert want == 0, "no solution"
    return mask


def _keep_crc(original: bytes, changed: bytearray, flips: list[tuple[int, int]]) -> bytearray:
    """``changed`` with some of the bit ``flips`` (position, bit) applied so its crc32c is the original's."""
    base = crc32c(changed)
    columns = []
    for at, bit in flips:
        probe = bytearray(changed)
        probe[at] ^= bit
        columns.append(crc32c(probe) ^ base)
    mask = _solve(columns, base ^ crc32c(original))
    for k, (at, bit) in enumerate(flips):
        if mask >> k & 1:
            changed[at] ^= bit
    assert crc32c(changed) == crc32c(original) and changed != bytearray(original)
    return changed


def _forge_piece(blob: bytes, piece) -> bytes:
    """The blob with the piece's first element set to 1e6 and 4 bytes of its last row patched
    to keep the piece's crc32c (the blob's other bytes unchanged)."""
    raw = blob[piece.offset : piece.offset + piece.length]
    changed = bytearray(raw)
    changed[0:4] = np.float32(1e6).tobytes()
    patch = len(raw) - 8  # 4 bytes near the end of the piece
    forged = _keep_crc(raw, changed, [(patch + k // 8, 1 << k % 8) for k in range(32)])
    return blob[: piece.offset] + bytes(forged) + blob[piece.offset + piece.length :]


def _w_piece(store):
    """The first piece of leaf ``w`` in the checkpoint at ``store``, and the manifest."""
    manifest = full_manifest(store)
    leaf = next(leaf for leaf in manifest.leaves if leaf.path == "['w']")
    return min(leaf.pieces, key=lambda p: (p.blob, p.offset)), manifest


def _saved(target, options=DIGEST):
    url = _url(target)
    objckpt.save(url, _tree(), storage_options=target.storage_options, options=options)
    return url


# ----------------------------------------------------------------------------- the format


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_digest_save_records_sha256_and_root_pins_index_objects(kind, store_target_factory):
    target = store_target_factory(kind)
    url = _saved(target, DIGEST_V2)
    store = target.open()
    root = json.loads(runtime.run_sync(store.get(MANIFEST_KEY)))
    manifest = full_manifest(store)
    for ref in root["indexes"]:
        data = bytes(runtime.run_sync(store.get(ref["key"])))
        assert ref["sha256"] == sha256_hex(data)  # the root pins each index object
        doc = json.loads(data)
        assert len(doc["sha256"]) == len(doc["pieces"])
    for leaf in manifest.leaves:
        for piece in leaf.pieces:
            blob = bytes(
                runtime.run_sync(store.get_range(piece.blob, start=piece.offset, end=piece.offset + piece.length))
            )
            assert piece.sha256 == sha256_hex(blob), leaf.path
    assert sum(len(leaf.pieces) for leaf in manifest.leaves) >= 9
    restored = objckpt.restore(url, _target(), storage_options=target.storage_options, options=DIGEST)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(_tree()["w"]))
    np.testing.assert_array_equal(restored["b"], _tree()["b"])
    assert objckpt.verify(url, storage_options=target.storage_options, options=DIGEST).ok


def test_digest_off_writes_todays_format(store_target_factory):
    """No digest asked: no ``sha256`` field anywhere, and such a checkpoint still restores; asking
    for a digest when restoring or verifying it is refused (a copy's root could have dropped it)."""
    target = store_target_factory("local")
    url = _saved(target, objckpt.Options(format_version=2))
    store = target.open()
    root = json.loads(runtime.run_sync(store.get(MANIFEST_KEY)))
    assert all("sha256" not in ref for ref in root["indexes"])
    assert all("sha256" not in json.loads(runtime.run_sync(store.get(ref["key"]))) for ref in root["indexes"])
    assert objckpt.restore(url, None)["step"] == 3
    with pytest.raises(objckpt.FormatError, match="no sha256 digests"):
        objckpt.restore(url, None, options=DIGEST)
    with pytest.raises(objckpt.FormatError, match="no sha256 digests"):
        objckpt.verify(url, options=DIGEST)
    with pytest.raises(ValueError, match="Options.digest"):
        objckpt.Options(digest="md5")


def test_index_object_and_root_must_agree_on_digests(store_target_factory):
    """A root that pins its index objects by SHA-256 refuses an index object without digests
    (and a root without pins refuses one with them): neither half can be dropped alone."""
    target = store_target_factory("local")
    url = _saved(target, DIGEST_V2)
    store = target.open()
    root = json.loads(runtime.run_sync(store.get(MANIFEST_KEY)))
    ref = root["indexes"][0]
    doc = json.loads(runtime.run_sync(store.get(ref["key"])))
    del doc["sha256"]
    data = json.dumps(doc, separators=(",", ":")).encode()
    runtime.run_sync(store.put(ref["key"], data))
    ref.update(size=len(data), crc32c=crc32c(data), sha256=sha256_hex(data))
    runtime.run_sync(store.put(MANIFEST_KEY, json.dumps(root).encode()))
    with pytest.raises(objckpt.FormatError, match="'sha256'.*missing"):
        objckpt.restore(url, None)
    del ref["sha256"]
    for other in root["indexes"]:
        other.pop("sha256", None)
    doc["sha256"] = ["0" * 64] * len(doc["pieces"])
    data = json.dumps(doc, separators=(",", ":")).encode()
    runtime.run_sync(store.put(ref["key"], data))
    ref.update(size=len(data), crc32c=crc32c(data))
    runtime.run_sync(store.put(MANIFEST_KEY, json.dumps(root).encode()))
    with pytest.raises(objckpt.FormatError, match="'sha256'.*present without"):
        objckpt.restore(url, None)


# ----------------------------------------------------------------------------- forged pieces


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_forged_piece_keeping_crc32c_is_refused_by_restore_and_verify(kind, store_target_factory):
    """A replica writer changes a piece and 4 more bytes so its crc32c holds: without a digest
    the restore returns the forged value; with one, restore and verify name the leaf and blob."""
    plain, hashed = store_target_factory(kind), store_target_factory(kind)
    plain_url, hashed_url = _saved(plain, objckpt.Options()), _saved(hashed)
    for target in (plain, hashed):
        store = target.open()
        piece, _ = _w_piece(store)
        blob = bytes(runtime.run_sync(store.get(piece.blob)))
        runtime.run_sync(store.put(piece.blob, _forge_piece(blob, piece)))

    # crc32c alone: the forgery restores and verifies
    restored = objckpt.restore(plain_url, _target(), storage_options=plain.storage_options)
    assert 1e6 in np.asarray(restored["w"])
    assert objckpt.verify(plain_url, storage_options=plain.storage_options).ok

    piece, _ = _w_piece(hashed.open())
    where = f"bytes [{piece.offset}, {piece.offset + piece.length})"
    with pytest.raises(objckpt.IntegrityError, match=r"sha256 mismatch in leaf \['w'\]") as caught:
        objckpt.restore(hashed_url, _target(), storage_options=hashed.storage_options)
    assert piece.blob in str(caught.value) and where in str(caught.value)
    with pytest.raises(objckpt.IntegrityError, match="sha256 mismatch"):  # the saved grid: whole-piece reads
        objckpt.restore(hashed_url, None, storage_options=hashed.storage_options)

    report = objckpt.verify(hashed_url, storage_options=hashed.storage_options)
    assert not report.ok
    (problem,) = report.problems
    assert (problem.kind, problem.blob, problem.leaf) == ("sha256", piece.blob, "['w']")
    assert (problem.start, problem.end) == (piece.offset, piece.offset + piece.length)
    assert "sha256 mismatch in leaf ['w']: blob" in str(problem) and piece.blob in str(problem)


def test_forged_piece_read_in_spans_is_refused(s3_store):
    """A piece longer than ``read_chunk`` is never cut between parallel spans when it has a
    digest (a SHA-256 cannot be combined): the restore is bit-exact and the forgery still caught."""
    url = _saved(s3_store)
    small = objckpt.Options(read_chunk=16 * 1024, max_read_size=1 << 20)
    restored = objckpt.restore(url, _target(), storage_options=s3_store.storage_options, options=small)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(_tree()["w"]))
    store = s3_store.open()
    piece, _ = _w_piece(store)
    blob = bytes(runtime.run_sync(store.get(piece.blob)))
    runtime.run_sync(store.put(piece.blob, _forge_piece(blob, piece)))
    with pytest.raises(objckpt.IntegrityError, match=r"sha256 mismatch in leaf \['w'\]"):
        objckpt.restore(url, _target(), storage_options=s3_store.storage_options, options=small)


def test_forged_piece_at_a_replica_is_read_at_the_primary(store_target_factory, monkeypatch):
    """The root read at the primary (S3) pins the index objects; the nearest copy (``file://``)
    holds a forged piece, which persists over its re-reads: the restore reads it at the primary,
    whose bytes match, and returns the saved values."""
    primary, replica = store_target_factory("s3"), store_target_factory("local")
    probe = locations._probe

    async def replica_nearest(store, options):  # the timed HEADs decide by noise otherwise
        said = await probe(store, options)
        return dataclasses.replace(said, latency_s=1.0 if store.url.startswith("s3:") else 0.0)

    monkeypatch.setattr(locations, "_probe", replica_nearest)
    url = _saved(primary)
    replica_url = _url(replica)
    objckpt.copy(url, replica_url, src_storage_options=primary.storage_options)
    store = replica.open()
    piece, _ = _w_piece(store)
    blob = bytes(runtime.run_sync(store.get(piece.blob)))
    runtime.run_sync(store.put(piece.blob, _forge_piece(blob, piece)))
    stats = objckpt.TransferStats()
    restored = objckpt.restore(
        url, _target(), storage_options=primary.storage_options, replicas=[replica_url], options=DIGEST, stats=stats
    )
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(_tree()["w"]))
    assert stats.checksum_retries >= 4 and len(stats.bytes_by_location) == 2, stats.bytes_by_location


def test_cp_refuses_a_forged_piece(store_target_factory):
    """``objckpt cp`` from a copy holding a forged piece checks each piece's SHA-256 and commits nothing."""
    source, destination = store_target_factory("s3"), store_target_factory("local")
    url = _saved(source)
    store = source.open()
    piece, _ = _w_piece(store)
    blob = bytes(runtime.run_sync(store.get(piece.blob)))
    runtime.run_sync(store.put(piece.blob, _forge_piece(blob, piece)))
    with pytest.raises(objckpt.IntegrityError, match=r"sha256 mismatch in leaf \['w'\]"):
        objckpt.copy(url, destination.url, src_storage_options=source.storage_options, server_side=False)
    assert MANIFEST_KEY not in {o.key for o in runtime.run_sync(destination.open().list())}


# ----------------------------------------------------------------------------- forged index objects


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_forged_index_object_keeping_size_and_crc32c_is_refused(kind, store_target_factory):
    """The replica writer forges a piece, writes the forged piece's SHA-256 into the index object,
    and toggles hex digits of other pieces' digests until the index object's crc32c (and size)
    match the root's again: only the root's SHA-256 of the index object tells."""
    target = store_target_factory(kind)
    url = _saved(target, DIGEST_V2)
    store = target.open()
    piece, _ = _w_piece(store)
    blob = bytes(runtime.run_sync(store.get(piece.blob)))
    forged_blob = _forge_piece(blob, piece)
    runtime.run_sync(store.put(piece.blob, forged_blob))

    root = json.loads(runtime.run_sync(store.get(MANIFEST_KEY)))
    ref = next(r for r in root["indexes"] if piece.sha256.encode() in runtime.run_sync(store.get(r["key"])))
    original = bytes(runtime.run_sync(store.get(ref["key"])))
    new_digest = sha256_hex(forged_blob[piece.offset : piece.offset + piece.length]).encode()
    at = original.index(piece.sha256.encode())
    changed = bytearray(original)
    changed[at : at + 64] = new_digest
    digests = original.index(b'"sha256":[')
    toggles = [
        (k, 1)
        for k in range(digests + 10, len(original))
        if not at <= k < at + 64 and chr(original[k]) in "0123456789bcde"
    ][:96]
    forged = bytes(_keep_crc(original, changed, toggles))
    assert len(forged) == ref["size"] and crc32c(forged) == ref["crc32c"]
    json.loads(forged)  # still a well-formed index object
    runtime.run_sync(store.put(ref["key"], forged))

    with pytest.raises(objckpt.FormatError, match="does not match its sha256 in the manifest") as caught:
        objckpt.restore(url, _target(), storage_options=target.storage_options)
    assert ref["key"] in str(caught.value)
    with pytest.raises(objckpt.FormatError, match="does not match its sha256"):
        objckpt.verify(url, storage_options=target.storage_options)


def test_convert_orbax_rerun_keeps_blobs_with_their_digests(tmp_path):
    """A rerun conversion keeps the blobs an earlier run left; with a digest, their pieces
    get their SHA-256 too, and the committed checkpoint verifies with the digest required."""
    ocp = pytest.importorskip("orbax.checkpoint")
    state = {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64), "b": np.arange(3000, dtype=np.int32)}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "orbax", state)
    checkpointer.wait_until_finished()
    options = objckpt.Options(memory_budget=32 << 10, blob_size=8 << 10, digest="sha256")
    src, dst = str(tmp_path / "orbax"), tmp_path / "native"
    objckpt.convert_orbax(src, str(dst), options=options)
    blobs = sorted(dst.rglob("*.blob"))
    for path in dst.rglob("*"):  # as if killed before the commit: only the blobs are there
        if path.is_file() and path.suffix != ".blob":
            path.unlink()
    again = objckpt.convert_orbax(src, str(dst), options=options)
    assert again.blobs_kept == len(blobs) >= 2, again
    assert objckpt.verify(str(dst), options=DIGEST).ok
    restored = objckpt.restore(str(dst), None, options=DIGEST)
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_cli_verify_names_a_forged_piece_and_requires_a_digest(store_target_factory):
    """``objckpt verify`` prints the ``sha256`` problem naming leaf and blob (exit 1); with
    ``--digest sha256`` it refuses a checkpoint saved without digests."""
    import subprocess
    import sys

    hashed, plain = store_target_factory("local"), store_target_factory("local")
    url, plain_url = _saved(hashed), _saved(plain, objckpt.Options())
    store = hashed.open()
    piece, _ = _w_piece(store)
    blob = bytes(runtime.run_sync(store.get(piece.blob)))
    runtime.run_sync(store.put(piece.blob, _forge_piece(blob, piece)))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "objckpt.cli", *args, "--no-progress"]
        return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)

    found = cli("verify", url)
    assert found.returncode == 1, found.stderr
    assert f"PROBLEM sha256: sha256 mismatch in leaf ['w']: blob {url}/{piece.blob}" in found.stdout
    assert cli("verify", plain_url).returncode == 0
    refused = cli("verify", plain_url, "--digest", "sha256")
    assert refused.returncode == 1 and "has no sha256 digests" in refused.stderr, refused.stderr
