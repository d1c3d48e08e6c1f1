"""Every code block of README.md and docs/*.md runs as written (issue 52, item 2).

A reader runs a doc top to bottom, so one subprocess per doc runs its ``python`` and
``bash`` blocks in order: the Python blocks share one namespace, the shell blocks see the
environment the Python blocks leave (a setup block exports ``RUN``...). The subprocess gets
what ``python -m backends.launcher`` tells a reader to export: the local S3 server's
``AWS_*`` variables and the GCS emulator's ``STORAGE_EMULATOR_HOST``. A block that cannot
run here (a real cloud bucket, ``pip install``, the whole test suite) is marked in the
markdown, visibly, by ``<!-- not run: reason -->`` on the line before it; every other
block must pass. Blocks tagged ``text`` are sample output and diagrams; an untagged block
is an error, so nothing is skipped by accident.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from backends.gcs import GCSService
from backends.s3 import S3Service

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash"}
SHOWN = {"text"}
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
FENCE = re.compile(r"^```(\S*)\s*$")


@dataclass
class Block:
    """One fenced code block of a markdown file."""

    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    not_run: str | None  # the reason given by a `<!-- not run: ... -->` line just before it


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, in order (fences at the start of a line)."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, lang = i, match.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: code block never closed")
        before = [line.strip() for line in lines[:start] if line.strip()]
        marker = NOT_RUN.match(before[-1]) if before else None
        found.append(
            Block(
                path.name, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n", marker.group(1) if marker else None
            )
        )
        i = j + 1
    return found


# Runs in the subprocess: a doc's blocks in order, as a reader would; stops at the first failure.
DRIVER = r"""
import json, os, subprocess, sys, traceback
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for block in blocks:
    where = f"{block['doc']}:{block['line']} ({block['lang']} block)"
    print(f"=== {where}", flush=True)
    if block["lang"] == "python":
        try:
            exec(compile(block["source"], where, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED: {where}", flush=True)
            sys.exit(1)
    else:
        sys.stdout.flush()
        rc = subprocess.run(["bash", "-e", "-u", "-o", "pipefail", "-c", block["source"]]).returncode
        if rc != 0:
            print(f"FAILED: {where}: exit status {rc}", flush=True)
            sys.exit(1)
print("ALL PASSED", flush=True)
"""


def test_every_block_is_tagged_and_every_skip_says_why() -> None:
    """An untagged block would be skipped silently; a `not run` marker must give its reason."""
    problems = []
    for path in DOCS:
        for block in blocks(path):
            if block.lang not in RUNNABLE | SHOWN:
                problems.append(f"{block.doc}:{block.line}: tag {block.lang!r} is none of {sorted(RUNNABLE | SHOWN)}")
            if block.not_run is not None and block.lang not in RUNNABLE:
                problems.append(f"{block.doc}:{block.line}: a `not run` marker on a {block.lang!r} block")
    assert not problems, "\n".join(problems)


def test_every_python_block_compiles() -> None:
    """A cheap first check, with line numbers, before the docs run."""
    for path in DOCS:
        for block in blocks(path):
            if block.lang == "python":
                compile(block.source, f"{block.doc}:{block.line}", "exec")


def test_the_skipped_set_stays_small() -> None:
    """Only blocks that need something this machine lacks are marked; every Python block runs."""
    skipped = [b for path in DOCS for b in blocks(path) if b.not_run is not None]
    assert all(b.lang == "bash" for b in skipped), [f"{b.doc}:{b.line}" for b in skipped if b.lang != "bash"]
    assert len(skipped) <= 6, [f"{b.doc}:{b.line}: {b.not_run}" for b in skipped]


def _runnable_docs() -> list[Path]:
    return [p for p in DOCS if any(b.lang in RUNNABLE and b.not_run is None for b in blocks(p))]


@pytest.mark.parametrize("path", _runnable_docs(), ids=lambda p: p.name)
def test_doc_runs_as_written(path: Path, s3_service: S3Service, gcs_service: GCSService, tmp_path: Path) -> None:
    """The doc's blocks run top to bottom against the local servers; twice, as a reader reruns them."""
    todo = [asdict(b) for b in blocks(path) if b.lang in RUNNABLE and b.not_run is None]
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(todo))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "GOOGLE_", "TENSORSTORE_"))}
    env.update(s3_service.env())
    env.update(gcs_service.env())
    env["TENSORSTORE_GCS_HTTP_URL"] = gcs_service.endpoint_url
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    env["HOME"] = str(tmp_path)  # no ~/.aws of the machine's
    for attempt in ("first run", "second run"):
        result = subprocess.run(
            [sys.executable, "-c", DRIVER, str(spec)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        output = result.stdout[-6000:] + result.stderr[-6000:]
        assert result.returncode == 0 and "ALL PASSED" in result.stdout, f"{path.name}, {attempt}:\n{output}"


def test_install_says_how_from_a_checkout_and_where_the_local_servers_come_from() -> None:
    """Item 1: objckpt is on no index; the docs install it from a checkout and name the launcher."""
    readme = (REPO / "README.md").read_text()
    assert 'pip install -e ".[s3,gcs]"' in readme
    assert "orbax" in readme.split("## Save and restore")[0]
    assert "python -m backends.launcher" in readme and '".[dev]"' in readme
    for path in DOCS:
        assert 'pip install "objckpt[' not in path.read_text(), f"{path.name} installs from an index"


def test_readme_is_short_and_starts_with_the_shortest_save_and_restore() -> None:
    """Item 3: at most 150 lines; the first Python block is a few lines that save and restore."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    first = next(b for b in blocks(REPO / "README.md") if b.lang == "python")
    code = [line for line in first.source.splitlines() if line.strip()]
    assert len(code) <= 8, first.source
    assert "objckpt.save(" in first.source and "objckpt.restore(" in first.source
    assert "ShapeDtypeStruct" not in first.source and "CheckpointManager" not in first.source


def test_the_suite_command_says_how_long_it_takes() -> None:
    """Item 4: the line that gives ./tests/run.sh gives its duration on 2 cores."""
    readme = (REPO / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("./tests/run.sh"))
    assert re.search(r"\d+(–\d+)? min(utes)? on 2 cores", line), line


def test_the_readme_manager_example_writes_only_steps_under_its_root() -> None:
    """Issue 66, item 17: users copy the README's layout, so its manager root holds the manager's steps
    alone: items go into the steps (``mgr.save(step, {..., "config": objckpt.Json(...)})``), never into a
    checkpoint of their own beside them, which ``objckpt ls ROOT`` would list among the steps."""
    readme = blocks(REPO / "README.md")
    example = next(b for b in readme if b.lang == "python" and "CheckpointManager(" in b.source)
    root = re.search(r"CheckpointManager\((\w+)", example.source).group(1)
    writes = re.findall(r"objckpt\.(?:save|save_async|copy)\(f\"\{" + root + r"\}[^\"]*\"", example.source)
    assert not writes, f"the README writes beside the manager's steps under {root}: {writes}"
    assert re.search(r"mgr\.save\(step, \{[^}]*objckpt\.|mgr\.save\(step, \{[^}]*\"config\"", example.source)
