"""The import graph of `inferengine/`: no circles, and each room imports only what DESIGN.md's
Rooms table says.

Every module is parsed with `ast` (nothing is imported). An edge is any import of another
`inferengine` module, of three kinds: at module level, under `if TYPE_CHECKING:` (a circle of
types is still a circle of design) and inside a function (a lazy import is still a dependency).
`from pkg import name` points at `pkg.name` when that is a module, else at `pkg`. A package's
implicit import of its parent `__init__` is not an edge.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "inferengine"

# Circles still being cut, each a set of modules (without the "inferengine." prefix). A circle
# found inside one of these sets passes; an entry that no longer matches anything is harmless,
# but delete it when its circle is gone: this list should be empty.
ALLOWED_CYCLES: list[frozenset[str]] = []

# The bottom room: typed configs, request params, errors, env vars, logging, outputs.
BASE = {"config", "envs", "errors", "logger", "outputs", "retention", "sampling_params"}
BASE |= {"tokenizer", "version", "pooling_params"}

# DESIGN.md's Rooms table, "imports" column: the rooms each room may import (besides itself and
# the bottom room, which every room may import). "root" is the package facade,
# `inferengine/__init__.py` (lazy re-exports for users).
ALLOWED_ROOMS: dict[str, set[str]] = {
    "base": set(),
    "checkpoint": set(),
    "core": {"lora"},  # LoRARequest rides the engine I/O; the per-step adapter cap
    "lora": set(),  # Multi-LoRA requests, PEFT folder checks (no torch)
    "kernels": set(),
    "distributed": set(),
    "structured_output": {"core"},
    "metrics": {"core"},
    "sample": set(),
    "attention": {"kernels"},
    "spec_decode": {"attention", "core"},
    "model": {"checkpoint", "attention", "kernels", "distributed"},
    "kv_transfer": {"core"},  # disaggregated prefill/decode: the transports
    "worker": {
        "model",
        "attention",
        "kernels",
        "sample",
        "distributed",
        "core",
        "spec_decode",
        "kv_transfer",
        "lora",
    },
    "executor": {"worker", "core", "distributed"},
    "engine": {
        "checkpoint",
        "core",
        "executor",
        "spec_decode",
        "structured_output",
        "metrics",
        "lora",
    },
    "dp": {"engine", "core", "metrics", "executor"},  # executor/ray_cluster: one Ray join
    "entrypoints": {"engine", "structured_output", "metrics", "dp", "root", "lora"},
    "bench": {"checkpoint"},
    "root": {"entrypoints", "model"},
}

# Single imports that break the table (DESIGN.md's Known debts), (importer, imported room). None
# left: keep it empty.
ALLOWED_EXCEPTIONS: set[tuple[str, str]] = set()

# What the rooms below the model never import, at any level (DESIGN.md: core/ "No torch").
NO_TORCH_ROOMS = {"base", "core", "lora"}
TORCH_MODULES = {"torch", "triton", "numpy"}
# Rooms below the model that may use numpy (checkpoint/ converts GGUF tensors with it), never
# torch or triton: they run before anything loads.
NO_TORCH_BUT_NUMPY_ROOMS = {"checkpoint"}


@dataclass(frozen=True)
class Edge:
    source: str  # module, without the "inferengine." prefix
    target: str
    kind: str  # "module", "type" (under TYPE_CHECKING) or "local" (in a function)
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.kind}, line {self.line})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["inferengine", *parts])


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _short(module: str) -> str:
    return module.removeprefix("inferengine").removeprefix(".") or "root"


def room(module: str) -> str:
    """`core/request` -> core; the bottom room's files -> base; the package facade -> root."""
    short = _short(module)
    first = short.split(".")[0]
    return "root" if short == "root" else "base" if first in BASE else first


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with its kind."""

    def walk(nodes: list[ast.stmt] | Iterator[ast.AST], kind: str) -> Iterator:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node, kind
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, "type" if kind == "module" else kind)
                yield from walk(node.orelse, kind)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(ast.iter_child_nodes(node), "local")
            else:
                yield from walk(ast.iter_child_nodes(node), kind)

    yield from walk(tree.body, "module")


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The imported names, as dotted paths (a module, or a name inside one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{alias.name}" for alias in node.names] + [prefix]


def _resolve(name: str) -> str | None:
    """The `inferengine` module `name` is or lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges_and_externals() -> tuple[list[Edge], dict[str, set[str]]]:
    edges: list[Edge] = []
    externals: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, kind in _imports(tree):
            names = _targets(module, path.name == "__init__.py", node)
            if isinstance(node, ast.ImportFrom):
                # `from pkg import sub`: the submodule where there is one, else pkg itself.
                *members, prefix = names
                submodules = [m for m in members if m in MODULES]
                names = submodules + ([prefix] if len(submodules) < len(members) else [])
            for name in names:
                top = name.split(".")[0]
                if top != "inferengine":
                    externals.setdefault(module, set()).add(top)
                    continue
                target = _resolve(name)
                if target is not None and target != module:
                    edges.append(Edge(_short(module), _short(target), kind, node.lineno))
    return edges, externals


EDGES, EXTERNALS = _edges_and_externals()


def strongly_connected(edges: list[Edge]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (iterative)."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e.target)
        graph.setdefault(e.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_graph_sees_the_package():
    """A guard against a parser that finds nothing: known edges of each kind are there."""
    found = {(e.source, e.target, e.kind) for e in EDGES}
    assert ("core.request", "core.hashing", "module") in found
    assert ("model.registry", "model.transformers_fallback", "local") in found
    assert any(e.kind == "type" for e in EDGES)
    assert len(MODULES) > 100


def test_no_import_cycles():
    cycles = [c for c in strongly_connected(EDGES) if not any(set(c) <= a for a in ALLOWED_CYCLES)]
    report = []
    for cycle in cycles:
        members = set(cycle)
        inner = [str(e) for e in EDGES if e.source in members and e.target in members]
        report.append(" <-> ".join(cycle) + "\n    " + "\n    ".join(sorted(set(inner))))
    assert not cycles, "import cycles in inferengine/:\n" + "\n".join(report)


def test_rooms_import_what_design_md_says():
    broken = []
    for e in EDGES:
        source_room, target_room = room(e.source), room(e.target)
        if source_room == target_room or target_room == "base":
            continue
        if target_room in ALLOWED_ROOMS[source_room]:
            continue
        if (e.source, target_room) in ALLOWED_EXCEPTIONS:
            continue
        broken.append(f"{source_room} -> {target_room}: {e}")
    assert not broken, "imports against DESIGN.md's Rooms table:\n" + "\n".join(sorted(broken))


def test_every_room_is_in_the_table():
    assert {room(m) for m in MODULES} <= set(ALLOWED_ROOMS)


def _importing(rooms: set[str], banned: set[str]) -> list[str]:
    """Modules of `rooms` that import any of `banned`, with what they import."""
    return [
        f"{_short(m)}: {sorted(names & banned)}"
        for m, names in EXTERNALS.items()
        if room(m) in rooms and names & banned
    ]


def test_core_and_the_bottom_room_import_no_torch():
    heavy = _importing(NO_TORCH_ROOMS, TORCH_MODULES)
    assert not heavy, "torch-free rooms import torch, triton or numpy:\n" + "\n".join(heavy)


def test_checkpoint_inspection_imports_no_torch():
    heavy = _importing(NO_TORCH_BUT_NUMPY_ROOMS, TORCH_MODULES - {"numpy"})
    assert not heavy, "checkpoint/ imports torch or triton:\n" + "\n".join(heavy)


def test_sampling_params_imports_only_the_bottom_room():
    imported = {e.target for e in EDGES if e.source == "sampling_params"}
    assert all(room(m) == "base" for m in imported), imported
