"""The package's layering rule as a test (issue #28), checked on every import statement of `relax_gym/`.

Floors, lowest first: records -> tools/models -> engines -> env API -> rollout -> trainer -> (face) -> cli. A module
imports its own floor and those below, never one above; no module imports itself back through others (no cycles);
and the core never imports `relax_gym.trainer`, so the gym works without the trainer. Imports inside functions
count: they run, only later. A cycle or a wrong-way import is fixed in the source, not allowed here.
"""

from __future__ import annotations

import ast
from collections import deque
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

from support.layout import package_modules

REPO = Path(__file__).resolve().parents[2]
PKG = "relax_gym"

FLOORS = ("cpu", "records", "tools/models", "engines", "env API", "rollout", "trainer", "face", "cli")

# Every module's floor: the longest dotted prefix of its name in this table wins. A new module no prefix covers
# fails the test until it is placed here.
FLOOR_OF: dict[str, str] = {
    # cpu: the CPU speed work (process settings, thread placement, glibc's heap, oneDNN linears, the decode
    # attention kernel); torch and transformers only, nothing of relax_gym's.
    "relax_gym.cpu": "cpu",
    # records: the data every floor hands around (trajectories, messages, media, errors) and leaf helpers;
    # they import nothing of relax_gym but each other.
    "relax_gym.trajectory": "records",
    "relax_gym.messages": "records",
    "relax_gym.video": "records",
    "relax_gym.errors": "records",
    "relax_gym.version": "records",
    # the HTTP foundation under the four servers and their clients (guard, error shape, in-loop server, keys,
    # client helpers): it imports nothing of relax_gym but the errors, so every floor that serves or calls stands on it
    "relax_gym.web": "records",
    # tools/models: messages to tokens and back with no engine: tool schemas and call parsers, model loading and
    # inputs, the code sandbox.
    "relax_gym.tools": "tools/models",
    "relax_gym.models": "tools/models",
    "relax_gym.sandbox": "tools/models",
    # engines: token ids in, token ids out: the `Engine` protocol, its implementations, `relax-gym serve`.
    "relax_gym.engines": "engines",
    # env API: what an env is and how it is built, graded (rewards: the judge asks an engine), registered,
    # checked and served (relax_gym.env); the bundled envs.
    "relax_gym.env": "env API",
    "relax_gym.rewards": "env API",
    "relax_gym.envs": "env API",
    # rollout: episodes of envs against an engine: the rollout manager, its runs and checks, agent episodes and
    # the proxy they are recorded through.
    "relax_gym.rollout": "rollout",
    # trainer: the RL trainer (algorithms, backends, loop, cluster, the control API and its client).
    "relax_gym.trainer": "trainer",
    # face: `relax_gym/__init__.py`, the public API (exact match only, not a prefix). It re-exports from any floor
    # below the CLI, so it sits just under it: a module inside the package imports the module that defines a
    # name, never the face, which would run the env registration and pull in every env API module with it.
    "relax_gym": "face",
    # cli: the `relax-gym` command line and what only it uses (the trajectory viewer).
    "relax_gym.cli": "cli",
    "relax_gym.viewer": "cli",
}

# The core is everything outside relax_gym.trainer and relax_gym.envs, but the CLI: it sits above the trainer and
# its `train` command must reach it (lazily). This rule adds to the floors' for the face.
TRAINER = "relax_gym.trainer"
MAY_IMPORT_TRAINER = ("relax_gym.trainer", "relax_gym.envs", "relax_gym.cli")


class Import(NamedTuple):
    src: str  # the importing module
    dst: str  # the module imported: the deepest module of the package the statement names
    path: str  # the importing file, relative to the repo
    line: int


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def floor_of(module: str) -> str | None:
    keys = [k for k in FLOOR_OF if module == k or (k != PKG and _within(module, k))]
    return FLOOR_OF[max(keys, key=len)] if keys else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_statements(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Import statements at any depth (module level, functions, methods, try blocks), except the body of an
    `if TYPE_CHECKING:`: it never runs, so it can make no cycle and no wrong-way dependency at run time."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        for stmt in child.orelse if isinstance(child, ast.If) and _is_type_checking(child.test) else [child]:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                found.append(stmt)
            found += _import_statements(stmt)
    return found


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """The package modules `module` imports. `import a.b.c` also runs a's and a.b's `__init__`, as any import of a
    submodule runs the face's: those implicit parent imports are no edges, or everything would import the face."""
    found: list[Import] = []
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    for stmt in _import_statements(ast.parse(path.read_text(), str(path))):
        if isinstance(stmt, ast.Import):
            names = [alias.name for alias in stmt.names]
        else:
            base = stmt.module or ""
            if stmt.level:  # relative: from the package holding this module, up level - 1 more
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(package[: len(package) - stmt.level + 1] + ([base] if base else []))
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in stmt.names]
        for name in dict.fromkeys(n for n in names if _within(n, PKG)):
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name != module:
                found.append(Import(module, name, str(shown), stmt.lineno))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """For every edge that closes a loop, the shortest loop through it, each loop once (starting at its least
    name), so every edge to cut shows up in some chain."""
    loops: set[tuple[str, ...]] = set()
    for u in sorted(graph):
        for v in sorted(graph[u]):
            parent = {v: v}
            queue = deque([v])
            while queue and u not in parent:  # breadth first from v, back to u
                x = queue.popleft()
                for y in sorted(graph.get(x, ())):
                    if y not in parent:
                        parent[y] = x
                        queue.append(y)
            if u in parent:
                back = [u]
                while back[-1] != v:
                    back.append(parent[back[-1]])
                loop = back[::-1]  # v -> ... -> u, and u -> v closes it
                first = loop.index(min(loop))
                loops.add(tuple(loop[first:] + loop[:first]))
    return [[*loop, loop[0]] for loop in sorted(loops, key=lambda loop: (len(loop), loop))]


def test_imports_respect_the_floors() -> None:
    modules = package_modules()
    edges = [e for m, path in sorted(modules.items()) for e in imports_of(m, path, modules)]
    graph: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], list[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        lines.setdefault((e.src, e.dst), []).append(str(e.line))

    unplaced = [
        f"place {path.relative_to(REPO)} on a floor in tests/themes/test_layers.py"
        for m, path in sorted(modules.items())
        if floor_of(m) is None
    ]
    chains = [
        "\n    ".join(
            [" -> ".join(loop)]
            + [f"{modules[a].relative_to(REPO)}:{','.join(lines[a, b])} imports {b}" for a, b in pairwise(loop)]
        )
        for loop in cycles(graph)
    ]
    upward = []
    for e in edges:
        src, dst = floor_of(e.src), floor_of(e.dst)
        if src is not None and dst is not None and FLOORS.index(dst) > FLOORS.index(src):
            upward.append(f"{e.path}:{e.line}: {e.src} ({src}) imports {e.dst} ({dst})")
    core_to_trainer = [
        f"{e.path}:{e.line}: {e.src} imports {e.dst}"
        for e in edges
        if _within(e.dst, TRAINER) and not any(_within(e.src, p) for p in MAY_IMPORT_TRAINER)
    ]

    report = [
        f"{len(group)} {title}:\n" + "\n".join(f"  {line}" for line in group)
        for title, group in (
            ("modules on no floor", unplaced),
            ("import cycles (each edge's file:lines below its chain)", chains),
            ("imports up the floors (" + " -> ".join(FLOORS) + ")", upward),
            ("imports of relax_gym.trainer from the core", core_to_trainer),
        )
        if group
    ]
    assert not report, (
        "layering broken (tests/themes/test_layers.py says where each module belongs):\n" + "\n".join(report))


def test_the_checker_sees_function_level_imports_and_cycles_but_not_type_checking_ones(tmp_path: Path) -> None:
    """A layer test that found nothing because it read nothing would pass: this one shows it reads."""
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from relax_gym.trainer import loop\n"
                      "def f():\n    from relax_gym.rollout import manager\n")
    modules = {"relax_gym.rollout.manager": source, "relax_gym.trainer.loop": source, "relax_gym.mod": source}
    assert [i.dst for i in imports_of("relax_gym.mod", source, modules)] == ["relax_gym.rollout.manager"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
