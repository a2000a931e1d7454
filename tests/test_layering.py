"""Layering (docs/design.md §2): imports point down only, no cycles; modules stay small.

The import graph is read from the source, not from ``sys.modules``: every ``import`` and
``from … import`` of a muon_fn module at any depth (module level, inside functions, under
``if TYPE_CHECKING``), and ``importlib.import_module`` of a literal name. A function-level import
that goes back up is a cycle all the same: it only defers the circle to the first call.

Edges go to the module named, not to the packages above it: Python imports a package's
``__init__`` before its submodules, but that is no dependency of the importer's. ``from pkg import
name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg`` (its ``__init__``).
"""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest

import muon_fn

ROOT = pathlib.Path(muon_fn.__file__).resolve().parent
PACKAGE = "muon_fn"

MAX_LINES = 600
# Modules over MAX_LINES, each with the most lines it may have: shrink this list, never grow it.
LONG_MODULES: dict[str, int] = {}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name ``from <level dots><module> import …`` in ``importer`` refers to."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]  # a package's own name is the base of its "."
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The muon_fn modules ``name`` imports, at any depth of its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        # the module itself, or its nearest enclosing muon_fn module (``import muon_fn.x.Y``)
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(name, is_package, node.level, node.module)
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in known else source)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.startswith(PACKAGE)
        ):
            add(node.args[0].value)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def elementary_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every elementary cycle of ``graph``, each written from its smallest node (a simple search
    from each node over larger nodes only: each cycle is found once, from its smallest node)."""
    cycles: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        stack = [(start, iter(sorted(graph[start])))]
        path, on_path = [start], {start}
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(path.pop())
            elif child == start:
                cycles.add(tuple(path))
            elif child > start and child not in on_path and child in graph:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return cycles


def _show(cycles) -> str:
    return "\n".join(" -> ".join(c + (c[0],)) for c in sorted(cycles)) or "(none)"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_function_level_and_relative_imports(graph):
    # a sanity check of the reader itself, on edges that exist for certain
    assert (
        "muon_fn.core.execution" in graph["muon_fn.core.newton_schulz.execution"]
    )  # from .. import execution as _execution
    assert (
        "muon_fn.core.newton_schulz.cpu" in graph["muon_fn.core.newton_schulz.execution"]
    )  # from . import cpu
    assert "muon_fn.core.newton_schulz.products" in graph["muon_fn.core.newton_schulz.iteration"]
    assert "muon_fn.core.newton_schulz" in graph["muon_fn"]
    toy = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"d"}}
    assert elementary_cycles(toy) == {("a", "b"), ("a", "b", "c"), ("d",)}
    src = "def f():\n    from .cpu import x\n"
    tree_edges = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)]
    assert (
        _resolve(
            "muon_fn.core.newton_schulz.products", False, tree_edges[0].level, tree_edges[0].module
        )
        == "muon_fn.core.newton_schulz.cpu"
    )


def test_no_import_cycle_in_newton_schulz(graph):
    """The Newton–Schulz math (schedules, iteration, products) imports no execution module; the
    execution side (cpu, batched, execution) picks the products: no cycle touches the package."""
    ns = "muon_fn.core.newton_schulz"
    touching = {
        c for c in elementary_cycles(graph) if any(m == ns or m.startswith(ns + ".") for m in c)
    }
    assert not touching, f"import cycles through {ns}:\n{_show(touching)}"


def test_newton_schulz_math_imports_no_execution(graph):
    ns = "muon_fn.core.newton_schulz"
    execution = {"muon_fn.core.execution", f"{ns}.cpu", f"{ns}.batched", f"{ns}.execution", ns}
    for math in ("schedules", "iteration", "products"):
        assert not graph[f"{ns}.{math}"] & execution, (
            f"{ns}.{math} imports {graph[f'{ns}.{math}'] & execution}"
        )


def test_no_import_cycles_in_muon_fn(graph):
    cycles = elementary_cycles(graph)
    assert not cycles, f"import cycles in muon_fn:\n{_show(cycles)}"


def part_of(module: str) -> str:
    """The top-level part of muon_fn that ``module`` belongs to: ``muon_fn.tools.bench._timing`` ->
    ``muon_fn.tools``; a top-level module is its own part (``muon_fn._base``), as is ``muon_fn``."""
    return ".".join(module.split(".")[:2])


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with each subpackage's modules merged into one node (edges inside a part dropped)."""
    parts: dict[str, set[str]] = {}
    for name, targets in graph.items():
        mine = part_of(name)
        parts.setdefault(mine, set()).update(part_of(t) for t in targets if part_of(t) != mine)
    return parts


def test_the_part_graph_merges_subpackages():
    toy = {
        "muon_fn.a.x": {"muon_fn.b.y", "muon_fn.a.z"},
        "muon_fn.a.z": set(),
        "muon_fn.b.y": {"muon_fn._c"},
        "muon_fn._c": set(),
        "muon_fn": {"muon_fn.a.x"},
    }
    assert part_graph(toy) == {
        "muon_fn.a": {"muon_fn.b"},
        "muon_fn.b": {"muon_fn._c"},
        "muon_fn._c": set(),
        "muon_fn": {"muon_fn.a"},
    }


def test_no_import_cycles_between_subpackages(graph):
    """Imports point down between muon_fn's parts too: a subpackage never imports a module of one
    that imports it (e.g. the FSDP adapter runs muon_fn.optim's engine, so muon_fn.optim takes
    nothing from muon_fn.fsdp; what both need lives below both)."""
    cycles = elementary_cycles(part_graph(graph))
    edges = {
        c: [
            (a, b)
            for a, targets in graph.items()
            for b in targets
            if (part_of(a), part_of(b)) in set(zip(c, c[1:] + c[:1]))
        ]
        for c in cycles
    }
    assert not cycles, "import cycles between muon_fn's subpackages:\n" + "\n".join(
        f"{' -> '.join(c + (c[0],))}: {sorted(e)}" for c, e in sorted(edges.items())
    )


# The layers, bottom up (docs/design.md §2): a module imports only from its own part or a lower
# layer. The public facades (muon_fn.optim, muon_fn.fsdp, muon_fn.spectral,
# muon_fn.orthogonalization) sit above what they re-export.
LAYERS = (
    ("muon_fn.core",),
    ("muon_fn.engine",),
    ("muon_fn.distributed",),
    ("muon_fn.optimizers",),
    ("muon_fn.optim", "muon_fn.fsdp", "muon_fn.spectral", "muon_fn.orthogonalization"),
    ("muon_fn",),
    ("muon_fn.integrations",),
    ("muon_fn.tools",),
    ("muon_fn.__main__",),
)


def layer_of(module: str) -> int:
    part = part_of(module)
    for i, parts in enumerate(LAYERS):
        if part in parts:
            return i
    raise AssertionError(f"{module} belongs to no layer of LAYERS (add its part, {part}, to one)")


def test_imports_point_down_the_layers(graph):
    up = [
        f"{a} imports {b}"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if part_of(a) != part_of(b) and layer_of(b) >= layer_of(a)
    ]
    assert not up, "imports that do not point down the layers:\n" + "\n".join(up)


def test_modules_are_at_most_600_lines():
    lengths = {
        p.relative_to(ROOT.parent).as_posix(): len(p.read_text().splitlines())
        for p in ROOT.rglob("*.py")
    }
    over = {p: n for p, n in lengths.items() if n > LONG_MODULES.get(p, MAX_LINES)}
    assert not over, f"modules over {MAX_LINES} lines (or over their LONG_MODULES ceiling): {over}"
    stale = sorted(p for p in LONG_MODULES if lengths.get(p, 0) <= MAX_LINES)
    if stale:
        warnings.warn(
            f"now at most {MAX_LINES} lines or gone (remove from LONG_MODULES): {stale}",
            stacklevel=1,
        )


def private_reach(graph: dict[str, set[str]], names: dict[str, set[tuple[str, str]]]) -> list[str]:
    """Imports that reach into another part's privates: a private module of another subpackage
    (``muon_fn.engine._state`` from ``muon_fn.distributed``), or a private name from one of its
    modules (``from muon_fn.engine import _x``). Top-level modules (``muon_fn._x``) and a
    subpackage's public modules are open to every part. ``names``: per module, the ``(module,
    name)`` pairs of its ``from module import name`` where ``name`` is not a module."""
    seen = set(graph).union(*graph.values(), *({s for s, _ in pairs} for pairs in names.values()))
    packages = {part_of(m) for m in seen if m.count(".") >= 2}
    found = []
    for importer, targets in graph.items():
        mine = part_of(importer)
        for target in sorted(targets):
            inner = target.split(".")[2:]
            if part_of(target) != mine and any(part.startswith("_") for part in inner):
                found.append(f"{importer} imports {target}")
        for source, name in sorted(names.get(importer, ())):
            theirs = part_of(source)
            if (
                theirs != mine
                and theirs in packages
                and name.startswith("_")
                and not name.startswith("__")
            ):
                found.append(f"{importer} imports {name} from {source}")
    return found


def imported_names() -> dict[str, set[tuple[str, str]]]:
    mods = modules()
    out: dict[str, set[tuple[str, str]]] = {}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(name, path.name == "__init__.py", node.level, node.module)
                if source in mods:
                    out.setdefault(name, set()).update(
                        (source, a.name) for a in node.names if f"{source}.{a.name}" not in mods
                    )
    return out


def test_private_reach_sees_modules_and_names():
    toy = {
        "muon_fn.fsdp._step": {"muon_fn.optim._state", "muon_fn.optim.engine", "muon_fn._quantize"},
        "muon_fn.fsdp._rows": {"muon_fn.fsdp._plan", "muon_fn._newton_schulz.execution"},
        "muon_fn.tools.cli": {"muon_fn.fsdp._plan"},
        "muon_fn._sso": {"muon_fn._muon"},
    }
    names = {
        "muon_fn.fsdp._step": {
            ("muon_fn.optim.engine", "_secret"),
            ("muon_fn.optim.engine", "commit"),
        },
        "muon_fn._sso": {("muon_fn._muon", "_not_matrix")},  # a top-level module's: open to all
    }
    assert private_reach(toy, names) == [
        "muon_fn.fsdp._step imports muon_fn.optim._state",
        "muon_fn.fsdp._step imports _secret from muon_fn.optim.engine",
        "muon_fn.tools.cli imports muon_fn.fsdp._plan",
    ]


def test_no_part_imports_another_subpackages_privates(graph):
    """design.md §2: the distributed executor uses the engine's public interface
    (``muon_fn.engine``), never the engine's private modules; no module of one part imports
    a private module or name of another subpackage."""
    reach = private_reach(graph, imported_names())
    assert not reach, "imports of another subpackage's privates:\n" + "\n".join(reach)


# ----------------------------------------------------------------------------- tools apart
TOOLS = "muon_fn.tools"
# Entry points, as the console script in pyproject.toml is: run, never imported by the library.
ENTRY_POINTS = {"muon_fn.__main__"}  # python -m muon_fn


def in_tools(module: str) -> bool:
    return module == TOOLS or module.startswith(TOOLS + ".")


def is_private(module: str) -> bool:
    """Whether ``module`` is private to the library: a component after ``muon_fn`` starts with ``_``
    (``muon_fn._newton_schulz``, ``muon_fn.optim._state``; ``muon_fn.__main__`` too)."""
    return any(part.startswith("_") for part in module.split(".")[1:])


def private_attributes(name: str, path: pathlib.Path, known: set[str]) -> list[str]:
    """``alias._x`` in ``name``'s source where ``alias`` is a library module it imported (``import
    muon_fn as mf`` ... ``mf._engine``; ``from muon_fn import optim`` ... ``optim._step``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else PACKAGE
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(name, path.name == "__init__.py", node.level, node.module)
            for a in node.names:
                if f"{source}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
    return [
        f"{name} reads {aliases[node.value.id]}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and not in_tools(aliases[node.value.id])
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]


def tools_reach(graph: dict[str, set[str]], names: dict[str, set[tuple[str, str]]]) -> list[str]:
    """What a module of muon_fn.tools takes from the library other than its public API: a private
    module (any part of its name after ``muon_fn`` starting with ``_``) or a private name
    (``from muon_fn.optim.engine import _x``). The tools' own modules are theirs to share."""
    found = [
        f"{importer} imports {target}"
        for importer, targets in graph.items()
        if in_tools(importer)
        for target in sorted(targets)
        if not in_tools(target) and is_private(target)
    ]
    found += [
        f"{importer} imports {name} from {source}"
        for importer, pairs in names.items()
        if in_tools(importer)
        for source, name in sorted(pairs)
        if not in_tools(source) and name.startswith("_") and not name.startswith("__")
    ]
    return found


def library_reach(graph: dict[str, set[str]]) -> list[str]:
    """Imports of muon_fn.tools from outside it (entry points aside)."""
    return [
        f"{importer} imports {target}"
        for importer, targets in sorted(graph.items())
        if not in_tools(importer) and importer not in ENTRY_POINTS
        for target in sorted(targets)
        if in_tools(target)
    ]


def test_the_tools_checks_see_private_modules_names_and_attributes(tmp_path):
    toy = {
        "muon_fn.tools.bench._replay": {
            "muon_fn._newton_schulz",  # a private module of the library
            "muon_fn.optim._adapter",  # a private module of a subpackage
            "muon_fn.optim.engine",
            "muon_fn.orthogonalization",
            "muon_fn.tools._device",  # the tools' own private module: theirs
        },
        "muon_fn.tools.train.train": {"muon_fn", "muon_fn.tools.train.model"},
        "muon_fn.optim._muon": {"muon_fn.tools.train.optimizers", "muon_fn._base"},
        "muon_fn.__main__": {"muon_fn.tools.cli"},
    }
    names = {
        "muon_fn.tools.bench._replay": {
            ("muon_fn.optim.engine", "_secret"),
            ("muon_fn.optim.engine", "buckets"),
            ("muon_fn.tools.bench._timing", "_helper"),
        },
        "muon_fn.tools.cli": {("muon_fn", "__version__")},
    }
    assert tools_reach(toy, names) == [
        "muon_fn.tools.bench._replay imports muon_fn._newton_schulz",
        "muon_fn.tools.bench._replay imports muon_fn.optim._adapter",
        "muon_fn.tools.bench._replay imports _secret from muon_fn.optim.engine",
    ]
    assert library_reach(toy) == ["muon_fn.optim._muon imports muon_fn.tools.train.optimizers"]
    src = tmp_path / "x.py"
    src.write_text(
        "import muon_fn as mf\nfrom muon_fn import optim\nfrom . import _own\n"
        "mf._engine; optim._step; optim.engine; mf.__version__; _own._x\n"
    )
    known = {"muon_fn", "muon_fn.optim", "muon_fn.tools.bench._own"}
    assert private_attributes("muon_fn.tools.bench.x", src, known) == [
        "muon_fn.tools.bench.x reads muon_fn._engine",
        "muon_fn.tools.bench.x reads muon_fn.optim._step",
    ]


def test_tools_import_only_the_public_api(graph):
    """design.md §2: the benchmark, the demo trainer and the planner CLI (muon_fn.tools) use
    muon_fn as a user does, through its public API: no private module, no ``_name`` of a public
    one, no ``module._attribute``."""
    mods = modules()
    reach = tools_reach(graph, imported_names())
    reach += [
        line
        for name, path in mods.items()
        if in_tools(name)
        for line in private_attributes(name, path, set(mods))
    ]
    assert not reach, "muon_fn.tools reaches past the public API:\n" + "\n".join(reach)


def test_the_library_never_imports_the_tools(graph):
    """Nothing outside muon_fn.tools imports it (the console script of pyproject.toml and
    ``python -m muon_fn`` are entry points that run it)."""
    reach = library_reach(graph)
    assert not reach, "the library imports muon_fn.tools:\n" + "\n".join(reach)
    assert any(in_tools(m) for m in graph), "no muon_fn.tools modules found"
