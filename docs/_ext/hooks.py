"""MkDocs hooks for the docs site.

The pages are written to read on GitHub too, where a link that says ``[faq.md](faq.md#install)``
names the file it opens. On the site the file names mean nothing, so a link whose text is the
name of the page it points to (``faq.md``, ``algorithms.md §3``) shows the page's short title
instead, and the heading it points to (``FAQ: Install``). Nothing else is rewritten.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

_LINK = re.compile(r"\[(?P<name>[\w./-]+\.md)(?P<section> §\d+)?\]\((?P<target>[^)#\s]+\.md)(?P<anchor>#[^)\s]*)?\)")
_FENCE = re.compile(r"^(\s*)(```|~~~)")
_TITLES: dict[str, str] = {}
# Short titles where the navigation's are long.
_SHORT = {"index.md": "Home", "guide.md": "Guide", "trainers.md": "Trainers", "distributed.md": "Distributed",
          "sso.md": "SSO", "faq.md": "FAQ", "design.md": "Design", "api.md": "API overview"}
_HEADINGS: dict[str, dict[str, str]] = {}


def _headings(path: str, docs_dir: str) -> dict[str, str]:
    """``{anchor: heading text}`` of a page, anchors as the toc extension makes them."""
    if path not in _HEADINGS:
        from pymdownx.slugs import slugify

        slug, found, fenced = slugify(case="lower"), {}, False
        for line in (Path(docs_dir) / path).read_text().splitlines():
            if _FENCE.match(line):
                fenced = not fenced
            m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
            if m:
                found.setdefault(slug(m[1], "-"), re.sub(r"[`*]", "", m[1]))
        _HEADINGS[path] = found
    return _HEADINGS[path]


def _walk(nav: Any) -> None:
    for item in nav or []:
        if isinstance(item, dict):
            for title, value in item.items():
                if isinstance(value, str):
                    _TITLES[value] = title
                else:
                    _walk(value)


def on_config(config: Any) -> Any:
    global _DOCS_DIR
    _TITLES.clear()
    _HEADINGS.clear()
    _walk(config["nav"])
    _TITLES.update(_SHORT)
    _DOCS_DIR = config["docs_dir"]
    return config


_DOCS_DIR = "docs"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    here = posixpath.dirname(page.file.src_uri)
    out, fenced = [], False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        if not fenced:
            line = _LINK.sub(lambda m: _retitle(m, here), line)
        out.append(line)
    return "\n".join(out)


def _retitle(m: re.Match[str], here: str) -> str:
    target = posixpath.normpath(posixpath.join(here, m["target"]))
    title = _TITLES.get(target)
    if title is None or posixpath.basename(m["name"]) != posixpath.basename(target):
        return m[0]
    heading = _headings(target, _DOCS_DIR).get((m["anchor"] or "#")[1:]) if not m["section"] else None
    text = f"{title}: {heading}" if heading else f"{title}{m['section'] or ''}"
    return f"[{text}]({m['target']}{m['anchor'] or ''})"
