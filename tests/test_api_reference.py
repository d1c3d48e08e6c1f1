"""The documentation site builds without a warning, and its API reference covers the public API.

``mkdocs build --strict`` (mkdocs.yml: README.md and docs/*.md as pages, docs/reference/ rendered
from the docstrings by mkdocstrings) fails on any warning: a broken link or anchor, a page
left out of the nav, a docstring griffe cannot parse (an ``Args:`` entry naming no
parameter...). Then every public name (``objckpt.__all__``, ``objckpt.storage.__all__``,
``objckpt.testing.__all__``, every error class of ``objckpt.errors``) must be in the built
reference's inventory with a docstring, and so must every public method, property and
attribute of the classes among them (an attribute may be documented in its class's
``Attributes:`` or ``Args:`` section instead). A name exported later fails here until it is
documented and placed on a reference page.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import zlib
from pathlib import Path

import griffe
import pytest

import objckpt
import objckpt.errors
import objckpt.storage

REPO = Path(__file__).resolve().parent.parent
# Packages whose `__all__` is public API; objckpt.testing needs pytest, which is here.
PUBLIC_PACKAGES = ("objckpt", "objckpt.storage", "objckpt.testing")
# Classes the public API returns or takes that are documented on a reference page as well.
ALSO_DOCUMENTED = (
    "objckpt.manager.retention.StepRecord",
    "objckpt.manager.replication.ReplicaStatus",
    "objckpt.manager.tiers.TierStatus",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once into a temporary directory by ``mkdocs build --strict``."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about MkDocs 2.0
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output[-8000:]}"
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert not warnings, "\n".join(warnings)
    return out


def inventory(site: Path) -> set[str]:
    """The object names in the site's ``objects.inv`` (Sphinx inventory v2, written by mkdocstrings)."""
    data = (site / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):  # four header lines, then the zlib-compressed entries
        header_end = data.index(b"\n", header_end) + 1
    lines = zlib.decompress(data[header_end:]).decode().splitlines()
    return {line.split(" ", 1)[0] for line in lines if line.strip()}


def public_names() -> list[tuple[str, object]]:
    """(how a user names it, the object) for every public name of the documented packages."""
    found: list[tuple[str, object]] = []
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        found += [(f"{package}.{name}", getattr(module, name)) for name in module.__all__]
    for name, value in vars(objckpt.errors).items():
        if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == "objckpt.errors":
            found.append((f"objckpt.errors.{name}", value))
    for path in ALSO_DOCUMENTED:
        module, _, name = path.rpartition(".")
        found.append((path, getattr(importlib.import_module(module), name)))
    return found


def canonical(name: str, value: object) -> str:
    """The path a value is defined at (``objckpt.errors.StoreError`` for ``objckpt.StoreError``)."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not (isinstance(module, str) and module.startswith("objckpt.") and qualname):
        return name  # a type alias (objckpt.storage.PutMode): documented where it is exported
    return f"{module}.{qualname}"


def test_the_docs_build_strict_into_a_site_with_every_page(site: Path) -> None:
    """Every docs/*.md page, the README as the home page, and each reference page are in the site."""
    home = (site / "index.html").read_text()
    assert 'href="MANAGER/"' in home, "the README is not the home page, or its docs/ links were not rewritten"
    for page in sorted((REPO / "docs").glob("*.md")):
        assert (site / page.stem / "index.html").is_file(), f"{page.name} is not a page of the site"
    for page in sorted((REPO / "docs" / "reference").glob("*.md")):
        built = site / "reference" / ("" if page.stem == "index" else page.stem) / "index.html"
        assert built.is_file(), f"reference/{page.name} is not a page of the site"


def test_every_public_name_is_in_the_reference(site: Path) -> None:
    """Each public name is rendered: as ``objckpt.X``, or where it is defined (``objckpt.errors.X``)."""
    rendered = inventory(site)
    missing = [
        name for name, value in public_names() if name not in rendered and canonical(name, value) not in rendered
    ]
    assert not missing, f"public names on no page of docs/reference/: {missing}"


def _documented_in_sections(cls: griffe.Class) -> set[str]:
    """Names the class docstring documents in its Attributes/Args sections (and its __init__'s Args)."""
    names: set[str] = set()
    for holder in (cls, cls.members.get("__init__")):
        if holder is None or holder.docstring is None:
            continue
        for section in holder.docstring.parse("google", warnings=False):
            if section.kind.value in ("attributes", "parameters"):
                # one name an entry: griffe reads "src, dst: ..." as a name "src," of type "dst"
                names.update(item.name for item in section.value)
    return names


def undocumented(obj: griffe.Object | griffe.Alias, name: str) -> list[str]:
    """``name`` and its public members (for a class) that have no docstring."""
    target = obj.final_target if isinstance(obj, griffe.Alias) else obj
    problems = [] if target.docstring and target.docstring.value.strip() else [name]
    if isinstance(target, griffe.Class):
        in_sections = _documented_in_sections(target)
        for member_name, member in target.members.items():
            if member_name.startswith("_") or member.is_alias:
                continue
            if member_name.startswith("test_") and target.path.startswith("objckpt.testing."):
                continue  # a conformance suite's tests: pytest's to run, not the reader's to call
            if member.docstring and member.docstring.value.strip():
                continue
            if member.is_attribute and member_name in in_sections:
                continue
            problems.append(f"{name}.{member_name}")
    return problems


def test_every_public_name_and_member_has_a_docstring() -> None:
    """What the reference renders says something: no name, method or attribute without a docstring."""
    # The reference's griffe extension: it gives an attribute the `#:` comment above it as its docstring.
    extensions = griffe.load_extensions(str(REPO / "docs" / "_mkdocs" / "griffe_roles.py"))
    loader = griffe.GriffeLoader(search_paths=[str(REPO)], docstring_parser=griffe.Parser.google, extensions=extensions)
    package = loader.load("objckpt")
    loader.resolve_aliases(implicit=True, external=False)
    problems = []
    for name, value in public_names():
        path = canonical(name, value)
        obj = package.get_member(path.removeprefix("objckpt."))
        problems += undocumented(obj, name)
    assert not problems, f"public names without a docstring: {problems}"


def test_the_readme_links_the_guides_and_says_how_to_browse_the_docs() -> None:
    """Item 17: the manager guide and the tiers page are reachable from the README; `mkdocs serve` is named."""
    readme = (REPO / "README.md").read_text()
    for page in ("docs/MANAGER.md", "docs/TIERS.md"):
        assert f"]({page}" in readme, page
    assert "mkdocs serve" in readme
