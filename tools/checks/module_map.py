#!/usr/bin/env python3
"""The project's import map: which module imports which, laid out in floors.

A room is a module of `spice_megatron/` directly, a subpackage of it (`bridge/`, `policy/`, ...),
`recipes/` or `tools/`. Every import counts, the lazy ones inside functions too. A room's floor is
one above the highest room it imports, so the ground floor imports nothing of the project and
`cli/` is at the top. An import that would run up the floors (a circle between rooms) is allowed
only where UPWARD names it with its reason. The rooms are grouped in LAYERS, and no import reaches
up a layer. tests/test_imports.py holds the project to both and to no circle between files, and
docs/architecture.md's module map is `python tools/docs_tables.py`'s rendering of the layers.

  python tools/checks/module_map.py          # the layers, each room with its floor, lines and what it is
"""
from __future__ import annotations

import ast
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("spice_megatron", "recipes")

# (from room, to room): an import allowed to run up the floors, and why (none today).
UPWARD: dict[tuple[str, str], str] = {}

# The package's layers, lowest first, each with its rooms: a room imports rooms of its own layer and
# of those below it, never one above (docs/architecture.md; each subpackage's docstring says it too).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("shared", ("spice_megatron/__init__.py", "spice_megatron/entry.py", "spice_megatron/config/",
                "spice_megatron/tasks.py", "spice_megatron/metric_names.py", "spice_megatron/torchrun.py",
                "spice_megatron/run_dir.py", "spice_megatron/families/", "spice_megatron/wire/")),
    ("data", ("spice_megatron/data/", "recipes/")),
    ("algorithm", ("spice_megatron/selfplay/",)),
    ("learner", ("spice_megatron/policy/",)),
    ("weights and engines", ("spice_megatron/bridge/", "spice_megatron/rollout/")),
    ("runs, plans, evaluation", ("spice_megatron/run/", "spice_megatron/plan/", "spice_megatron/eval/")),
    ("the loop", ("spice_megatron/trainer.py", "spice_megatron/loop/")),
    ("commands", ("spice_megatron/cli/",)),
    ("scripts", ("tools/",)),
)


def layer_of(room: str) -> int:
    """The room's layer (its index in LAYERS); KeyError names a room no layer holds."""
    for i, (_, rooms) in enumerate(LAYERS):
        if room in rooms:
            return i
    raise KeyError(f"{room} is in no layer: add it to module_map.LAYERS (and docs/architecture.md)")


def against_layers(arrows: dict[tuple[str, str], list[Import]] | None = None) -> list[str]:
    """Each import that reaches up a layer, as 'file:line imports module (layer -> layer)'."""
    arrows = room_arrows() if arrows is None else arrows
    wrong = []
    for (a, b), found in sorted(arrows.items()):
        if layer_of(b) > layer_of(a):
            wrong += [f"{i.source}:{i.line} imports {i.module} ({LAYERS[layer_of(a)][0]} -> "
                      f"{LAYERS[layer_of(b)][0]})" for i in found]
    return wrong


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing file, relative to ROOT
    line: int
    module: str  # the dotted module imported


def _module_of(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def source_files() -> list[str]:
    """Every Python file of the package, recipes/ and tools/, relative to ROOT, sorted."""
    files = []
    for top in (*PACKAGES, "tools"):
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [os.path.relpath(os.path.join(folder, n), ROOT) for n in sorted(names) if n.endswith(".py")]
    return files


def _known_modules(files: list[str]) -> set[str]:
    return {_module_of(os.path.join(ROOT, f)) for f in files}


def imports(files: list[str] | None = None) -> list[Import]:
    """Each import of a project module by a project file (a `from pkg import name` of a submodule
    counts as importing the submodule)."""
    files = source_files() if files is None else files
    known = _known_modules(files)
    found = []
    for rel in files:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), rel)
        here = _module_of(os.path.join(ROOT, rel))
        package = here if rel.endswith("__init__.py") else here.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")
                    parent = parent[: len(parent) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                if package.startswith("tools") and f"{package}.{target.split('.')[0]}" in known:
                    target = f"{package}.{target}"  # tools/ scripts import each other by their bare names
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != here:
                    found.append(Import(rel, node.lineno, target))
    return found


def room_of(module_or_file: str) -> str:
    """`spice_megatron/x.py` for a module of the package, `spice_megatron/sub/` for one of a
    subpackage, `recipes/` and `tools/` for anything in those."""
    parts = module_or_file.removesuffix(".py").replace(os.sep, ".").split(".")
    if parts[0] != "spice_megatron":
        return parts[0] + "/"
    if len(parts) == 1 or parts[1] == "__init__":
        return "spice_megatron/__init__.py"
    if os.path.isdir(os.path.join(ROOT, "spice_megatron", parts[1])):
        return f"spice_megatron/{parts[1]}/"
    return f"spice_megatron/{parts[1]}.py"


def room_arrows(found: list[Import] | None = None) -> dict[tuple[str, str], list[Import]]:
    """(from room, to room) -> the imports behind that arrow."""
    arrows: dict[tuple[str, str], list[Import]] = {}
    for imp in imports() if found is None else found:
        a, b = room_of(imp.source), room_of(imp.module)
        if a != b:
            arrows.setdefault((a, b), []).append(imp)
    return arrows


def find_cycle(edges: set[tuple[str, str]]) -> list[str]:
    """One circle in the graph as [a, b, ..., a], or [] when there is none."""
    succ: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        succ.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in succ.get(node, []):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return []

    for node in sorted(succ):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def floors(arrows: dict[tuple[str, str], list[Import]] | None = None) -> dict[str, int]:
    """Each room's floor (0: imports no room), UPWARD's arrows left out; ValueError names a circle."""
    arrows = room_arrows() if arrows is None else arrows
    edges = {e for e in arrows if e not in UPWARD}
    if cycle := find_cycle(edges):
        steps = [f"{a} -> {b} ({arrows[(a, b)][0].source}:{arrows[(a, b)][0].line})"
                 for a, b in zip(cycle, cycle[1:])]
        raise ValueError("rooms import each other in a circle: " + "; ".join(steps))
    rooms = {room_of(f) for f in source_files()}
    succ = {r: sorted(b for a, b in edges if a == r) for r in rooms}
    floor: dict[str, int] = {}

    def height(room: str) -> int:
        if room not in floor:
            floor[room] = 1 + max((height(b) for b in succ.get(room, [])), default=-1)
        return floor[room]

    for room in sorted(rooms):
        height(room)
    return floor


def file_cycle(found: list[Import] | None = None) -> list[str]:
    """A circle of imports between files (modules), or []."""
    found = imports() if found is None else found
    return find_cycle({(_module_of(os.path.join(ROOT, i.source)), i.module) for i in found})


def room_lines(room: str) -> int:
    return sum(sum(1 for _ in open(os.path.join(ROOT, f), encoding="utf-8"))
               for f in source_files() if room_of(f) == room)


def room_summary(room: str) -> str:
    """The first sentence of the room's docstring (a subpackage's `__init__.py`)."""
    if room == "tools/":
        return ("the project's scripts: benchmarks (bench/), the GPU, learning and layout checks (checks/), the "
                "environment and the two commands (env/), and user commands")
    path = os.path.join(ROOT, room + "__init__.py" if room.endswith("/") else room)
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".:")


def main() -> int:
    floor = floors()
    for i in range(len(LAYERS) - 1, -1, -1):
        name, rooms = LAYERS[i]
        print(f"layer {i}: {name}")
        for room in sorted(rooms, key=lambda r: (-floor[r], r)):
            print(f"  {floor[room]:>2} {room:<44} {room_lines(room):>6}  {room_summary(room)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
