"""The package layers of DESIGN.md, checked on the source: `app → trainer → simulate → serving →
{ingest, kernels}`; nothing imports upward, ingest and kernels not each other, and no two
files import each other in a circle (imports inside functions count: they only defer one); only
ingest/ imports the Kafka client. Inside trainer/ and app/, the core imports none of the
package's rooms, and a room only the rooms below it (`ROOMS`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# each package with the packages it may import
LAYERS = {
    "app": {"trainer", "simulate", "serving", "ingest", "kernels"},
    "trainer": {"simulate", "serving", "ingest", "kernels"},
    "simulate": {"serving", "ingest", "kernels"},
    "serving": {"ingest", "kernels"},
    "ingest": set(),
    "kernels": set(),
}


def modules() -> dict[str, Path]:
    """Every module of the service packages by dotted name (`pkg/__init__.py` as `pkg`)."""
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports, anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from pkg import module` names a module; `from module import name` does not
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                     else node.module for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def test_no_package_imports_upward() -> None:
    known = modules()
    wrong = []
    for name, path in known.items():
        package = name.split(".")[0]
        for target in imports(path, known) - {name}:
            other = target.split(".")[0]
            if other != package and other not in LAYERS[package]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


# The rooms of a package, with the rooms each may import; a module in no room is the package's
# core, which imports no room. trainer/: one room per process, around the core every trainer
# shares (the online trainer imports releases, its sink). app/: the command line starts the
# API, which enqueues Celery jobs, and the agent rollout workers, which serve the API's model
# routes to their agents; settings and the SQL tables are the core.
ROOMS = {
    "trainer": {"trainer.online": {"trainer.release"}, "trainer.bootstrap": set(),
                "trainer.release": set()},
    "app": {"app.cli": {"app.api", "app.jobs", "app.rollouts"}, "app.api": {"app.jobs"},
            "app.rollouts": {"app.api"}, "app.jobs": set()},
}


def room_of(name: str) -> str:
    """The room a module belongs to, or its package (the core)."""
    package = name.split(".")[0]
    return next((r for r in ROOMS.get(package, {}) if name == r or name.startswith(r + ".")),
                package)


def test_each_packages_core_and_rooms_import_only_downward() -> None:
    known = modules()
    for package, rooms in ROOMS.items():
        assert set(rooms) <= set(known), f"a room of {package}/ is missing"
    wrong = []
    for name, path in known.items():
        package = name.split(".")[0]
        if package not in ROOMS:
            continue
        room = room_of(name)
        allowed = {room, package} | ROOMS[package].get(room, set())
        wrong += [f"{name} imports {target}" for target in imports(path, known)
                  if target.split(".")[0] == package and room_of(target) not in allowed]
    assert not wrong, "\n".join(wrong)


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def test_only_ingest_holds_the_kafka_client() -> None:
    """Kafka is reached through ingest/log.py's classes (and ingest/offsets.py's probe):
    one seam, so a change of client or of delivery rules is made in one package."""
    wrong = [name for name, path in modules().items()
             if not name.startswith("ingest") and "kafka" in third_party_imports(path)]
    assert not wrong, f"import the Kafka client outside ingest/: {wrong}"


def test_no_two_files_import_each_other_in_a_circle() -> None:
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    circles = [component for component in _strongly_connected(graph) if len(component) > 1]
    assert not circles, "import circles: " + "; ".join(" ↔ ".join(sorted(c)) for c in circles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of `graph`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return components
