"""The package's import graph: no module pair imports each other, and nothing imports upward.

Every ``import`` in ``objckpt/`` is read from the source (function-level ones included, since
hiding an import inside a function does not remove the dependency). Packages sit in layers; a
module may import its own package and the layers below it, never a layer above or a peer on
its own layer (``saving`` and ``restoring`` are two operations that share what lies below them).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from source_scan import parse_source

PACKAGE = Path(__file__).resolve().parents[1] / "objckpt"

# Lowest first. A module's layer is its first dotted component below ``objckpt``.
LAYERS: list[set[str]] = [
    {"errors"},
    {"core"},
    {"options", "logs", "multihost", "in_flight"},
    {"storage"},
    {"transfer"},
    {"progress", "layouts"},
    {"saving", "restoring"},
    {"roots"},
    {"locations"},
    {"peers"},
    {"orbax", "safetensors"},
    {"tools"},
    {"manager"},
    {"cli", "testing"},
    {"__init__", "__main__"},
]
# Peers on purpose: neither may import the other (checked below as "same layer, other package").
SEPARATE = [("saving", "restoring")]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    tree = parse_source(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("objckpt"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("objckpt"):
                continue
            found.add(mod)
            for a in node.names:  # `from objckpt.x import y` may name a submodule y
                found.add(f"{mod}.{a.name}")
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in files.items():
        for target in _imports(path, name):
            while target not in files and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in files and target != name and target != "objckpt":
                graph[name].add(target)
        graph.setdefault(name, set())
    return graph


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i, top
    raise AssertionError(f"{module}: its package {top!r} has no layer in tests/test_architecture.py")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        (ls, ps) = _layer(src)
        for dst in sorted(targets):
            (ld, pd) = _layer(dst)
            if ld > ls:
                bad.append(f"{src} -> {dst}")
            elif ld == ls and pd != ps and (ps, pd) in SEPARATE + [(b, a) for a, b in SEPARATE]:
                bad.append(f"{src} -> {dst} (peers)")
    return bad


def test_no_import_circles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "modules that import each other (directly or round a loop):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_upward_imports() -> None:
    bad = upward_imports(_graph())
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def private_imports(path: Path, name: str) -> list[str]:
    """``from objckpt.x import _private`` in ``path`` where ``objckpt.x`` is another module
    (function-level imports too; ``__dunder__`` names are public)."""
    tree = parse_source(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = name.split(".")
        mod = (
            ".".join(base[: len(base) - node.level + (1 if is_pkg else 0)] + ([node.module] if node.module else []))
            if node.level
            else node.module or ""
        )
        for a in node.names:
            if mod.startswith("objckpt") and mod != name and a.name.startswith("_") and not a.name.endswith("__"):
                found.append(f"{name} <- {mod}.{a.name}")
    return found


def test_no_private_names_imported_across_modules() -> None:
    found = [f for p in sorted(PACKAGE.rglob("*.py")) for f in private_imports(p, _module_name(p))]
    assert not found, "private names imported from another module (make them public or move them):\n" + "\n".join(found)


def test_the_checker_sees_a_private_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from .b import _x, __version__, y\n    from objckpt.core.a import _own\n")
    assert private_imports(src, "objckpt.core.a") == ["objckpt.core.a <- objckpt.core.b._x"]


def test_the_checker_sees_a_circle_and_an_upward_import() -> None:
    graph = {"objckpt.core.a": {"objckpt.storage.b"}, "objckpt.storage.b": {"objckpt.core.a"}}
    assert _cycles(graph) == [["objckpt.core.a", "objckpt.storage.b"]]
    assert upward_imports(graph) == ["objckpt.core.a -> objckpt.storage.b"]
    assert upward_imports({"objckpt.restoring.x": {"objckpt.saving.y"}, "objckpt.saving.y": set()}) == [
        "objckpt.restoring.x -> objckpt.saving.y (peers)"
    ]


# The calls that make a leaf's arrays from host bytes (put host data on devices, join boxes
# into a global array): restoring/ holds them, so every restore's arrays come from one place.
ARRAY_MAKERS = (
    "device_put",
    "make_array_from_single_device_arrays",
    "make_array_from_callback",
    "make_array_from_process_local_data",
)
# Modules outside restoring/ that call one, and why none of them restores a leaf from bytes.
MAKERS_ELSEWHERE = {
    # a save's snapshot of the live arrays: device → device (or host) copies of arrays, no bytes read
    "objckpt.saving.host_copies",
    # bytes carried between processes as uint8 device arrays; what they hold becomes arrays
    # through the one restore, once written to the keeper's local store
    "objckpt.peers.transfer",
}


def array_makers() -> dict[str, list[str]]:
    """Per module outside ``objckpt/restoring/``, the array-making calls it holds (by name)."""
    out: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name.startswith("objckpt.restoring"):
            continue
        tree = parse_source(path.read_text(), filename=str(path))
        calls = [
            node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in ARRAY_MAKERS
        ]
        if calls:
            out[name] = calls
    return out


def test_only_restoring_turns_bytes_into_arrays() -> None:
    """Orbax, safetensors and objckpt's own restore make their arrays through restoring/
    (``restoring.placement``, ``restoring.landing``); nothing else puts read bytes on devices."""
    found = array_makers()
    strays = {name: calls for name, calls in found.items() if name not in MAKERS_ELSEWHERE}
    assert not strays, f"modules outside objckpt/restoring/ that make arrays: {strays}"
    assert set(found) == MAKERS_ELSEWHERE, "an allowed module no longer makes arrays: drop it from MAKERS_ELSEWHERE"
