"""The house rules, checked on the source itself: no import circle among the project's
modules, the two roles in their own rooms, and no source file over MAX_LINES lines.

The import graph is read with ast (nothing is imported): every `import` and `from ...
import` anywhere in a module (at the top, in functions, under TYPE_CHECKING), absolute or
relative, that names a module of the project is an edge to that module. `from pkg import
name` is an edge to pkg.name where that is a module, else to pkg itself.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "config",
    "ipc",
    "acquisition",
    "distributed",
    "engine",
    "leader",
    "gateway",
    "launcher",
    "bench",
)
SCRIPTS = ("server.py", "api.py")
MAX_LINES = 400
SOURCE_SUFFIXES = (".py", ".sh", ".c")
# What a package must never import. engine/ is the compute every rank runs in lock-step:
# it meets rank 0's request side (leader/) only in the step plan and the step's result
# (engine/step_plan.py), and knows nothing of the socket protocol (ipc/). The API process
# and the launcher hold no model: neither imports the ranks' packages.
NEVER = {
    "engine": ("ipc", "leader", "gateway", "launcher", "bench", "server", "api"),
    "leader": ("gateway", "launcher", "bench", "server", "api"),
    "gateway": ("engine", "leader", "distributed", "server"),
    "distributed": ("engine", "leader", "ipc", "gateway", "server"),
    # below distributed/ (its loader resolves MODEL): the first host's sender, which plans
    # the shares, is the launcher's
    "acquisition": ("distributed", "engine", "leader", "gateway", "launcher", "server"),
}
# Files allowed over MAX_LINES, each with the reason (keep this empty where possible).
ALLOWED_LONG: dict[str, str] = {}


def project_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of PACKAGES and SCRIPTS under `root`."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    for script in SCRIPTS:
        if (root / script).is_file():
            modules[Path(script).stem] = root / script
    return modules


def _imported(node: ast.Import | ast.ImportFrom, module: str, path: Path) -> list[str]:
    """The module names one import statement names (with `from X import a`, both X.a and X)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = project_modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = _imported(node, name, path)
            if isinstance(node, ast.ImportFrom):
                # `from pkg import sub`: the submodule where it is one, else pkg itself.
                subs = [n for n in names[:-1] if n in modules]
                targets = subs if len(subs) == len(names) - 1 else [*subs, names[-1]]
            else:
                targets = names
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as one circle
    through its members: [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(_circle(graph, set(members)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _circle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """One path that leaves the smallest member and comes back to it, inside `members`."""
    start = min(members)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    return sorted(members)


def test_no_import_circle() -> None:
    graph = import_graph(PROJECT)
    assert len(graph) > 100, f"read only {len(graph)} modules: is PROJECT right?"
    found = cycles(graph)
    assert not found, "import circles (break each: move the shared piece down a layer):\n" + (
        "\n".join(" -> ".join(circle) for circle in found)
    )


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """Every import that NEVER forbids, as `module -> imported`."""
    found = []
    for module, imported in sorted(graph.items()):
        banned = NEVER.get(module.split(".")[0], ())
        found += [f"{module} -> {i}" for i in sorted(imported) if i.split(".")[0] in banned]
    return found


def test_the_roles_keep_their_rooms() -> None:
    graph = import_graph(PROJECT)
    assert any(m.startswith("engine.") for m in graph) and any(
        m.startswith("leader.") for m in graph
    )
    assert not crossings(graph), "imports across a boundary:\n" + "\n".join(crossings(graph))


def test_a_crossing_is_seen(tmp_path: Path) -> None:
    for package in ("engine", "ipc"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "ipc" / "protocol.py").write_text("x = 1\n")
    (tmp_path / "engine" / "step.py").write_text("def f():\n    from ipc.protocol import x\n")
    assert crossings(import_graph(tmp_path)) == ["engine.step -> ipc.protocol"]


def test_the_graph_sees_relative_lazy_and_package_imports(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "a.py").write_text("from . import b\n")
    (tmp_path / "engine" / "b.py").write_text("def f():\n    from engine.c import x\n")
    (tmp_path / "engine" / "c.py").write_text("import engine.a\nx = 1\n")
    (tmp_path / "server.py").write_text("from engine import c\n")
    graph = import_graph(tmp_path)
    assert graph["engine.a"] == {"engine.b"} and graph["server"] == {"engine.c"}
    assert cycles(graph) == [["engine.a", "engine.b", "engine.c", "engine.a"]]
    (tmp_path / "engine" / "c.py").write_text("x = 1\n")
    assert cycles(import_graph(tmp_path)) == []


def source_files(root: Path) -> list[Path]:
    """The repository's .py, .sh and .c files: tracked, or new and not ignored (.venv and
    the model caches are ignored)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot list the repository's files with git ({exc})")
    return [root / name for name in listed if name.endswith(SOURCE_SUFFIXES)]


def test_no_source_file_over_the_line_limit() -> None:
    files = [path for path in source_files(PROJECT) if path.is_file()]
    assert len(files) > 100, f"found only {len(files)} source files"
    long = {}
    for path in files:
        name = str(path.relative_to(PROJECT))
        lines = len(path.read_bytes().splitlines())
        if lines > MAX_LINES and name not in ALLOWED_LONG:
            long[name] = lines
    assert not long, (
        f"files over {MAX_LINES} lines (split each by job; or add it to ALLOWED_LONG with "
        f"the reason): {dict(sorted(long.items()))}"
    )
    for name in ALLOWED_LONG:
        path = PROJECT / name
        lines = len(path.read_bytes().splitlines()) if path.is_file() else 0
        assert lines > MAX_LINES, f"{name} has {lines} lines now: remove it from ALLOWED_LONG"
