"""The docs agree with the code: api.md covers every public name, links resolve, the README's
commands are the ones CI runs, and its ten-line example runs."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import muon_fn

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _headings() -> set[str]:
    names = set()
    for line in (DOCS / "api.md").read_text().splitlines():
        m = re.match(r"^###\s+`([^`(\s]+)", line)
        if m:
            names.add(m.group(1))
    return names


def test_api_md_documents_every_public_name():
    documented = _headings()
    missing = sorted(set(muon_fn.__all__) - documented)
    assert not missing, f"docs/api.md lacks a '### `name`' section for muon_fn.{missing}"
    for modname in ("muon_fn.spectral", "muon_fn.fsdp"):
        mod = importlib.import_module(modname)
        missing = sorted(n for n in mod.__all__ if f"{modname}.{n}" not in documented)
        assert not missing, f"docs/api.md lacks sections for {modname}.{missing}"


def test_api_md_documents_only_real_names():
    for name in sorted(_headings()):
        if name.startswith("muon-fn"):
            continue  # CLI commands
        if name.startswith("muon_fn."):
            modname, _, attr = name.rpartition(".")
            mod = importlib.import_module(modname)
            assert hasattr(mod, attr), f"docs/api.md documents {name}, which does not exist"
        else:
            assert name in muon_fn.__all__, f"docs/api.md documents muon_fn.{name}, which is not exported"


def test_bench_entry_points_exist():
    from muon_fn import bench

    assert callable(bench.main)
    assert callable(bench.benchmark_muon_optimizers)


def _links(path: Path) -> list[str]:
    text = path.read_text()
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", t)]


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in DOCS.glob("*.md"))])
def test_relative_links_resolve(page):
    path = README if page == "README.md" else DOCS / page
    for target in _links(path):
        file = target.split("#", 1)[0]
        if not file:
            continue
        resolved = (path.parent / file).resolve()
        assert resolved.exists(), f"{page}: broken link {target}"


def test_readme_commands_match_ci():
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[dev]"' in readme
    # CI installs the dev set-up plus the extras the HF and Lightning example tests need.
    assert 'pip install -e ".[dev,hf,lightning]"' in ci and "MUON_FN_REQUIRE_EXTRAS=1" in ci
    assert "muon-fn train --quick" in readme
    assert "OMP_NUM_THREADS=1 python -m pytest -q" in readme
    # .ci/run: `export OMP_NUM_THREADS=1` then `"$PY" -m pytest -q` as the last command.
    commands = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert "export OMP_NUM_THREADS=1" in commands
    assert re.fullmatch(r'"\$PY" -m pytest -q', commands[-1]), commands[-1]


def test_readme_ten_line_example_runs(capsys):
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert len(block.strip().splitlines()) <= 10
    exec(compile(block, "README.md", "exec"), {})
    assert "Muon: 2 tensors" in capsys.readouterr().out


def test_transformers_md_examples_run_and_print_what_it_shows(capsys):
    """docs/transformers.md: its python blocks run in order, in one namespace, without a warning,
    and the printed split is the one the page shows."""
    import warnings

    text = (DOCS / "transformers.md").read_text()
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for block in re.findall(r"```python\n(.*?)```", text, re.S):
            exec(compile(block, "transformers.md", "exec"), namespace)
    out = capsys.readouterr().out
    shown = re.findall(r"prints\n\n```\n(.*?)```", text, re.S)
    assert len(shown) >= 2  # the toy MoE block's split and the demo GPT's
    for line in "".join(shown).splitlines():
        if line.strip() != "...":
            assert line in out.splitlines(), f"transformers.md shows {line!r}, the example printed:\n{out}"
