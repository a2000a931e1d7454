"""The API reference (docs/reference/*.md, rendered by mkdocstrings: ``mkdocs build --strict``)
documents every public name, and every public name has a docstring to render.

A name is public when it is in the ``__all__`` of ``muon_fn``, ``muon_fn.optim``, ``muon_fn.fsdp``,
``muon_fn.spectral``, ``muon_fn.orthogonalization`` or a module of ``muon_fn.integrations``. A page
documents an object with a ``::: dotted.path`` line; the path may be the object's defining module
(``muon_fn.fsdp`` loads its optimizers lazily, so the reference names them where they are defined).
A constant's docstring is the string literal on the line after its assignment, which is what
mkdocstrings renders.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
MODULES = (
    "muon_fn",
    "muon_fn.optim",
    "muon_fn.fsdp",
    "muon_fn.spectral",
    "muon_fn.orthogonalization",
    "muon_fn.integrations.hf",
    "muon_fn.integrations.lightning",
    "muon_fn.integrations.torchtitan",
)


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return ".".join(parts[:cut]), parts[cut:], obj
    raise ImportError(path)


def _directives() -> dict[str, str]:
    """``{dotted path: page}`` of every ``::: path`` line of the reference pages."""
    found = {}
    for page in sorted(REFERENCE.glob("*.md")):
        for m in re.finditer(r"^::: ([\w.]+)\s*$", page.read_text(), re.M):
            found[m.group(1)] = page.name
    return found


def _attribute_docstring(modname: str, name: str) -> str | None:
    """The string literal after ``name = ...`` at the top of ``modname``, following
    ``from .x import name`` re-exports."""
    mod = importlib.import_module(modname)
    body = ast.parse(Path(inspect.getfile(mod)).read_text()).body
    for i, node in enumerate(body):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            nxt = body[i + 1] if i + 1 < len(body) else None
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                return nxt.value.value
            return None
        if isinstance(node, ast.ImportFrom) and any(
            (a.asname or a.name) == name for a in node.names
        ):
            source = importlib.util.resolve_name(
                "." * node.level + (node.module or ""), mod.__package__
            )
            return _attribute_docstring(
                source, next(a.name for a in node.names if (a.asname or a.name) == name)
            )
    return None


def _own_docstring(obj) -> str:
    doc = obj.__doc__ if inspect.isclass(obj) else inspect.getdoc(obj)
    if (
        inspect.isclass(obj)
        and doc
        and issubclass(obj, tuple)
        and hasattr(obj, "_fields")
        and doc == f"{obj.__name__}({', '.join(obj._fields)})"  # NamedTuple's generated one
    ):
        return ""
    return (doc or "").strip()


def _public() -> list[tuple[str, str]]:
    return [(m, n) for m in MODULES for n in importlib.import_module(m).__all__]


def test_reference_pages_resolve():
    for path, page in _directives().items():
        try:
            _resolve(path)
        except (ImportError, AttributeError) as e:
            pytest.fail(f"docs/reference/{page}: '::: {path}' does not resolve ({e})")


@pytest.mark.parametrize("modname", MODULES)
def test_every_public_name_is_in_the_reference(modname):
    documented = {}
    for path in _directives():
        _, _, obj = _resolve(path)
        documented.setdefault(id(obj), path)
    mod = importlib.import_module(modname)
    missing = [n for n in mod.__all__ if id(getattr(mod, n)) not in documented]
    assert not missing, f"docs/reference/ has no '::: {modname}.<name>' line for {missing}"


@pytest.mark.parametrize("modname", MODULES)
def test_every_public_name_has_a_docstring(modname):
    paths = {}
    for path in _directives():
        modpath, attrs, obj = _resolve(path)
        paths.setdefault(id(obj), (modpath, attrs))
    mod = importlib.import_module(modname)
    undocumented = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if (
            inspect.isclass(obj)
            or inspect.isfunction(obj)
            or inspect.ismodule(obj)
            or inspect.ismethod(obj)
        ):
            doc = _own_docstring(obj)
        elif callable(obj) and not isinstance(obj, (dict, tuple, int, str)):
            doc = (getattr(obj, "__doc__", None) or "").strip()
        else:  # a constant: the docstring after its assignment, where the reference takes it from
            modpath, attrs = paths.get(id(obj), (modname, [name]))
            doc = (
                (_attribute_docstring(modpath, attrs[-1]) or "").strip() if len(attrs) == 1 else ""
            )
        if not doc:
            undocumented.append(name)
    assert not undocumented, f"{modname}: public names without a docstring: {undocumented}"
