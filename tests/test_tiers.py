"""The test tiers: ``./tests/run.sh --quick`` selects what it promises, and run.sh's xdist
schedule keeps a module's shared fixture on one worker.

Test modules get renamed and split; a name in ``conftest.QUICK_MODULES``, ``QUICK_TESTS``,
``SERIAL_TESTS``, ``SPREAD_MODULES`` or ``LONG_MODULES`` that no longer names a test would
change a tier silently, so each one is checked here, and the quick tier's selection is
collected the way run.sh makes it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import (
    LONG_MODULES,
    QUICK_MODULES,
    QUICK_TESTS,
    SERIAL_TESTS,
    SPREAD_MODULES,
    STORE_KINDS,
    modules_sharing_a_fixture,
)

TESTS = Path(__file__).resolve().parent


def _test_functions(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    tree = ast.parse(path.read_text(), filename=str(path))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_name_in_the_tiers_names_a_test() -> None:
    missing = [
        name for name in sorted(QUICK_MODULES | SPREAD_MODULES | LONG_MODULES) if not _test_functions(TESTS / name)
    ]
    for entry in sorted(QUICK_TESTS | SERIAL_TESTS):
        module, function = entry.split("::")
        if function not in _test_functions(TESTS / module):
            missing.append(entry)
    assert not missing, f"tests/conftest.py's tiers name tests that are gone: {missing}"


# A pytest plugin that prints each selected test with the server markers it carries.
_SHOW_MARKERS = """
def pytest_collection_finish(session):
    for item in session.items:
        servers = [m for m in ("s3", "gcs") if item.get_closest_marker(m)]
        print("ITEM", item.nodeid, ",".join(servers) or "-")
"""


def test_the_quick_tier_is_server_free_tests_plus_one_round_trip_per_store(tmp_path: Path) -> None:
    (tmp_path / "show_markers.py").write_text(_SHOW_MARKERS)
    files = sorted({*QUICK_MODULES, *(entry.split("::")[0] for entry in QUICK_TESTS)})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "show_markers"]
        + ["-m", "quick", *(f"tests/{name}" for name in files)],
        cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    items = dict(line[5:].rsplit(" ", 1) for line in done.stdout.splitlines() if line.startswith("ITEM "))
    end_to_end = {f"tests/{entry}[{kind}]" for entry in QUICK_TESTS for kind in STORE_KINDS}
    assert end_to_end <= set(items), f"missing from the quick tier: {sorted(end_to_end - set(items))}"
    on_servers = sorted(i for i, servers in items.items() if servers != "-" and i not in end_to_end)
    assert not on_servers, f"the quick tier starts servers beyond its round trips: {on_servers}"
    assert len(items) > 100, sorted(items)  # the planning and format tests, not only the round trips


def test_a_module_sharing_a_module_fixture_runs_on_one_xdist_worker() -> None:
    """run.sh's ``--dist loadgroup`` (conftest.pytest_xdist_make_scheduler): test_proxy.py's tests
    share a module-scoped upstream server, so they all go to one worker."""
    assert "test_proxy.py" in modules_sharing_a_fixture()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v"]
        + ["tests/test_proxy.py", "tests/test_tree.py"],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("[gw") and " PASSED " in line:
            worker, module = line.split("]")[0][1:], line.split(" PASSED ")[1].split("::")[0]
            workers.setdefault(module, set()).add(worker)
    assert len(workers["tests/test_proxy.py"]) == 1, workers
    assert len(set().union(*workers.values())) == 2, workers  # both workers had work
