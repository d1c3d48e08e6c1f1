"""Issue #54 at 512 forced devices in one process: what a params-only restore onto one 8-device
host reads of the index objects, and which rows it touches.

The 405B-shaped state (unstacked, a few layers) is saved from fsdp=64 × tensor=8 by 128
processes with ``bench_scale``'s save side (the library's grid pieces, blob packing and
format version 3 index objects); one inference host (devices 0..7) restores the params with
``bench_scale``'s ``restore_plan`` (restore's own steps: root, read shardings, leaf plans,
``read_needed_indexes``, read plan, coverage). It reads every process's index object, but
only the frames of the params' rows: the metadata it reads is bounded by arithmetic from the
params' row count, and the pieces it builds are exactly the params' pieces.

A few layers make index objects of ~10 KiB, which the library reads whole with their head (one
GET: ``index3_io.WHOLE_BELOW``) and whose rows fit one frame (``index3_encode.FRAME_TARGET``). The
child scales both down (frames of 4 KiB, no whole reads) so the objects have the proportions of
the 405B state's (~600 KiB, ~20 frames each) and the partial reads are what is counted.

The child Python runs with ``--xla_force_host_platform_device_count=512`` (the device count is
fixed when JAX starts) and is killed, with its process group, past its timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
DEVICES = 512
LAYERS = 6
FRAME_TARGET = 4 << 10  # the child's: ~80 rows a frame, ~9 frames an index object


def child(layers: int) -> dict[str, Any]:
    """The counts, in a process with ``DEVICES`` forced CPU devices."""
    import jax

    from benchmarks.scale.hosts import IndexStore, host_devices, restore_plan
    from benchmarks.scale.save import SAVE_ID, Saver
    from benchmarks.scale.state import make_mesh, state_tree, target_leaves, targets_at
    from objckpt.core.format import index3, index3_bounds, index3_encode, manifest_to_json, parse_manifest
    from objckpt.core.format.index import index_key
    from objckpt.core.format.index3 import ROW_FIXED
    from objckpt.core.format.index3_frames import parse_index3
    from objckpt.core.tree import flatten
    from objckpt.layouts import index3_io

    assert len(jax.devices()) == DEVICES, len(jax.devices())
    index3_encode.FRAME_TARGET = FRAME_TARGET  # read at call time by index3_encode()
    index3_bounds.FRAME_FLOOR = FRAME_TARGET // 4  # and by parse_head: readers allow frames that small
    index3_io.WHOLE_BELOW = 0  # and by read_index3: every object read in part
    by_id = {d.id: d for d in jax.devices()}
    leaves, skeleton = flatten(state_tree(make_mesh((DEVICES // 8, 8)), "unstacked", layers))
    processes = DEVICES // 4
    saver = Saver(leaves, processes)
    for p in range(processes):
        saver.plan(p)
    root = manifest_to_json(saver.manifest(skeleton, {p: saver.report_of(p) for p in range(processes)}))
    objects = {index_key(SAVE_ID, p): plan["index"] for p, plan in saver.plans.items()}

    target = targets_at(DEVICES)["params_1x8"]
    assert target is not None
    wanted = target_leaves(target, "unstacked", layers)
    store = IndexStore(objects)
    got = restore_plan(root, wanted, host_devices(by_id, 0, 8), store, per_host=8)
    assert not got["gaps"], got["gaps"]

    # Ground truth, with the library's full parse of every index object (untimed, uncounted).
    manifest = parse_manifest(root, size_limit=1 << 30)
    rows = {"all": 0, "params": 0, "params_bytes": 0}
    for p in range(processes):
        doc = parse_index3(objects[index_key(SAVE_ID, p)], manifest, p)
        for leaf, pieces in doc.pieces.items():
            rows["all"] += len(pieces)
            if leaf in wanted:
                rows["params"] += len(pieces)
                rows["params_bytes"] += len(pieces) * (ROW_FIXED + 16 * len(manifest.leaves[leaf].shape or ()))
    return {
        "root_bytes": len(root),
        "heads_bytes": sum(ref.head for ref in manifest.indexes),
        "index_bytes": sum(map(len, objects.values())),
        "frames": sum(
            len(index3.parse_head(objects[ref.key], manifest, p).frames) for p, ref in enumerate(manifest.indexes)
        ),
        "rows_decompressed": sum(  # the rows of the frames the host reads
            sum(head.frames[k].rows for k in head.frames_for(wanted))
            for head in (index3.parse_head(objects[ref.key], manifest, p) for p, ref in enumerate(manifest.indexes))
        ),
        "processes": processes,
        "index_objects_read": len(got["processes"]),
        "metadata_bytes": len(root) + store.bytes_read,
        "pieces_built": sum(len(entry.pieces) for entry in got["manifest"].leaves),
        "leaves_with_pieces": sorted(i for i, e in enumerate(got["manifest"].leaves) if e.pieces),
        "params_leaves": sorted(wanted),
        "rows": rows,
        "resharded_leaves": len(got["reads"]),
    }


@pytest.fixture(scope="module")
def counts() -> dict[str, Any]:
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(LAYERS)]
    proc = subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the {DEVICES}-device child ran past 240 s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"child failed (exit {proc.returncode}):\n{err[-4000:]}"
    return dict(json.loads(lines[-1][len("RESULT ") :]))


@pytest.mark.timeout(300)
def test_an_inference_host_reads_only_the_params_frames(counts: dict[str, Any]) -> None:
    """Every process wrote params, so all 128 index objects are read, each in part: the heads,
    the params' frames (compressed: at most 1.5 × their rows' uncompressed bytes, which holds
    the frame each object's params would share with the leaves before them). Of the frames, at
    most half the bytes are read (params: a quarter of the rows)."""
    assert counts["index_objects_read"] == counts["processes"]
    assert counts["frames"] >= 6 * counts["processes"]  # each object in several frames
    assert counts["resharded_leaves"] == 0  # one host needs whole leaves: read directly
    root, heads = counts["root_bytes"], counts["heads_bytes"]
    assert counts["metadata_bytes"] <= root + heads + 1.5 * counts["rows"]["params_bytes"], counts
    frames_read = counts["metadata_bytes"] - root - heads
    assert 0 < frames_read <= 0.5 * (counts["index_bytes"] - heads), counts


def test_an_inference_host_builds_pieces_of_the_params_rows_only(counts: dict[str, Any]) -> None:
    assert counts["rows"]["params"] * 4 <= counts["rows"]["all"]  # params: a quarter of the state's rows or less
    assert counts["pieces_built"] == counts["rows"]["params"]
    # Frames start at each item (index3_encode's breaks): the frames read hold params rows alone.
    assert counts["rows_decompressed"] == counts["rows"]["params"]
    assert counts["leaves_with_pieces"] == counts["params_leaves"]


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    print("RESULT " + json.dumps(child(int(sys.argv[2]))), flush=True)
