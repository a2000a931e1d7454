"""A griffe extension for the API reference: muon_fn's docstrings are written for Sphinx-style
readers (``:func:`name``` roles, ``text::`` literal blocks); mkdocstrings renders Markdown.

- ``:role:`target``` becomes an optional cross-reference to ``target`` (a link when the
  reference documents it, its name in code otherwise); ``~`` keeps only the last component.
- a paragraph ending in ``::`` ends in ``:`` (the indented block after it is a code block in
  Markdown too).
- a module attribute bound to a function built at import time (``matrix_labels =
  leafwise_labels(...)``, its ``__doc__`` set after) gets that function's docstring, which
  static analysis cannot see;
- an ``Args:`` entry naming several parameters (``lr, momentum: see ...``) becomes one entry per
  parameter, each with the shared description, as the Google style that mkdocstrings parses
  expects.
"""

from __future__ import annotations

import importlib
import inspect
import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|obj|exc|const):`(~?)([^`<>]+?)`")
_LITERAL = re.compile(r"(\S)::[ \t]*$", re.M)
_GROUP = re.compile(r"([\w*]+(?:\s*,\s*[\w*]+)+)\s*:(\s.*|$)", re.S)


def _split_groups(text: str) -> str:
    """One ``name: description`` entry per parameter in each ``Args:`` section."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        if lines[i].strip() not in ("Args:", "Arguments:", "Parameters:") or i + 1 >= len(lines):
            i += 1
            continue
        indent = len(lines[i + 1]) - len(lines[i + 1].lstrip())
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) >= indent):
            if not lines[i].strip():
                out.append(lines[i])
                i += 1
                if i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) < indent:
                    break
                continue
            entry = [lines[i]]
            i += 1
            while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > indent:
                entry.append(lines[i])
                i += 1
            m = _GROUP.match("\n".join(entry).strip())
            if m is None:
                out.extend(entry)
                continue
            names = [n.strip() for n in m.group(1).split(",")]
            body = m.group(2).strip()
            for name in names:
                out.append(" " * indent + f"{name}: {body}")
    return "\n".join(out)


def _identifier(obj: griffe.Object, target: str) -> str:
    if target.startswith("muon_fn"):
        return target
    head = target.split(".")[0]
    scope: griffe.Object | None = obj if obj.is_module or obj.is_class else obj.parent
    while scope is not None:  # the name as the docstring's own module (or class) sees it
        if head in scope.members:
            return f"{scope.path}.{target}"
        scope = scope.parent
    return f"muon_fn.{target}"


def _runtime_docstring(obj: griffe.Object) -> str | None:
    if not obj.is_attribute or obj.parent is None or not obj.parent.is_module:
        return None
    try:
        value = getattr(importlib.import_module(obj.parent.path), obj.name)
    except (ImportError, AttributeError):
        return None
    return inspect.getdoc(value) if inspect.isfunction(value) else None


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is None:
            doc = _runtime_docstring(obj)
            if doc is None:
                return
            obj.docstring = griffe.Docstring(doc, parent=obj)

        def role(m: re.Match[str]) -> str:
            tilde, target = m.groups()
            target = target.strip().removesuffix("()")
            shown = target.rsplit(".", 1)[-1] if tilde else target
            return f'<autoref identifier="{_identifier(obj, target)}" optional><code>{shown}</code></autoref>'

        text = _split_groups(_ROLE.sub(role, obj.docstring.value))
        obj.docstring.value = _LITERAL.sub(r"\1:", text)
