"""A URL with no checkpoint that is a manager root, or a step its root lacks, says so: the root's
latest steps, or the steps beside the missing one, with a URL to try (objckpt.roots.hints), from
``objckpt.inspect``/``verify`` and the ``objckpt inspect``/``verify`` commands alike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import objckpt
from objckpt.cli import main as cli_main

STEPS = (10, 20, 30, 40, 50, 60, 70)


def _root(url: str, storage_options: dict | None = None, steps: tuple[int, ...] = STEPS) -> None:
    mgr = objckpt.CheckpointManager(url, storage_options=storage_options)
    for step in steps:
        mgr.save(step, {"w": np.arange(4)}, force=True)
    mgr.wait()
    mgr.close()


def _not_found(call, url: str, **kwargs) -> str:
    with pytest.raises(objckpt.CheckpointNotFoundError) as e:
        call(url, **kwargs)
    return str(e.value)


CALLS = [objckpt.inspect, objckpt.verify]


@pytest.mark.s3
def test_a_manager_root_is_named_with_its_latest_steps(s3_store):
    url, so = s3_store.url, s3_store.storage_options
    _root(url, so)
    for call in CALLS:
        message = _not_found(call, url, storage_options=so)
        assert message == (
            f"no committed checkpoint at {url} (no manifest.json); it is a manager root with 7 committed steps,"
            f" the latest 30, 40, 50, 60, 70 (try {url}/step_0000000070)"
        ), message
    assert objckpt.inspect(f"{url}/step_0000000070", storage_options=so).leaves["['w']"].shape == (4,)


@pytest.mark.s3
def test_a_missing_step_names_the_steps_beside_it(s3_store):
    url, so = s3_store.url, s3_store.storage_options
    _root(url, so)
    for name in ("45", "step_45", "step_0000000045"):
        for call in CALLS:
            message = _not_found(call, f"{url}/{name}", storage_options=so)
            assert message.endswith(
                f"; the manager root {url} has no committed step 45: the steps nearest it are 30, 40, 50, 60"
                f" (7 in all, the latest 70; try {url}/step_0000000050)"
            ), message
    assert _not_found(objckpt.inspect, f"{url}/5", storage_options=so).endswith(
        f"the steps nearest it are 10, 20 (7 in all, the latest 70; try {url}/step_0000000010)"
    )
    # The Python API takes no short step names: the message names the step's own URL.
    message = _not_found(objckpt.inspect, f"{url}/40", storage_options=so)
    assert message.endswith(f"; the manager root {url} holds step 40 as {url}/step_0000000040"), message
    # Anywhere else, the message is as it was.
    elsewhere = f"{url}-elsewhere/45"
    assert _not_found(objckpt.inspect, elsewhere, storage_options=so) == (
        f"no committed checkpoint at {elsewhere} (no manifest.json)"
    )
    assert _not_found(objckpt.inspect, f"{url}/notastep", storage_options=so).endswith("(no manifest.json)")


@pytest.mark.s3
def test_the_command_line_says_the_same(s3_service, s3_store, monkeypatch, capsys):
    url = s3_store.url
    _root(url, s3_store.storage_options, steps=(10, 20, 30))
    for name, value in s3_service.env().items():
        monkeypatch.setenv(name, value)
    for args in (["inspect", url], ["verify", url], ["inspect", "--json", url]):
        assert cli_main(args) == 1
        err = capsys.readouterr().err
        assert f"it is a manager root with 3 committed steps: 10, 20, 30 (try {url}/step_0000000030)" in err, err
    assert cli_main(["inspect", f"{url}/25"]) == 1
    err = capsys.readouterr().err
    assert "has no committed step 25: the steps nearest it are 10, 20, 30 (3 in all, the latest 30;" in err, err
    assert cli_main(["inspect", f"{url}/30"]) == 0  # the command line takes the short name
    assert "['w']" in capsys.readouterr().out


def test_orbax_step_directories_count_as_steps(tmp_path):
    root = str(tmp_path / "root")
    _root(root, steps=(10, 20))
    orbax_step = Path(root) / "30"  # an Orbax manager's committed step (on local disk: its metadata)
    orbax_step.mkdir()
    (orbax_step / "_CHECKPOINT_METADATA").write_text(json.dumps({"init_timestamp_nsecs": 1}))
    (Path(root) / "40").mkdir()  # an Orbax step never committed: not a step
    (Path(root) / "40" / "d").write_text("partial")
    message = _not_found(objckpt.inspect, root)
    assert message.endswith(f"it is a manager root with 3 committed steps: 10, 20, 30 (try {root}/30)"), message
    message = _not_found(objckpt.inspect, f"{root}/26")
    assert message.endswith(f"the steps nearest it are 10, 20, 30 (3 in all, the latest 30; try {root}/30)"), message
