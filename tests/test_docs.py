"""The docs agree with the code: api.md covers every public name, links resolve, the README's
commands are the ones CI runs, and its ten-line example runs."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import muon_fn

from _ranks import free_port

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
    and every printed split is one the page shows."""
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


# --------------------------------------------------------------------------------------------
# every code block: python blocks run, muon-fn commands parse


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _fenced(path: Path) -> list[tuple[str, str]]:
    """``(language, text)`` of each fenced block of a page, in order."""
    blocks, lang, body = [], None, []
    for line in path.read_text().splitlines():
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence and lang is None:
            lang, body = fence.group(1), []
        elif fence:
            blocks.append((lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _python_blocks(path: Path) -> list[str]:
    return [text for lang, text in _fenced(path) if lang == "python"]


def _command_lines(path: Path) -> list[str]:
    """The shell lines of a page: fenced blocks that are not python, and indented code."""
    lines = [ln for lang, text in _fenced(path) if lang != "python" for ln in text.splitlines()]
    lines += re.findall(r"^    (\S.*)$", path.read_text(), re.M)
    return [ln.strip() for ln in lines]


def _muon_fn_commands(path: Path) -> list[list[str]]:
    """Each ``muon-fn ...`` command of a page as argv (env assignments and comments removed)."""
    import shlex

    commands = []
    for line in _command_lines(path):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words[:1] == ["muon-fn"] and "..." not in words:
            commands.append(words[1:])
    return commands


def _check_command(argv: list[str]) -> None:
    """Parse ``muon-fn argv`` as the CLI would, without running it (SystemExit on a bad option)."""
    if argv[0] == "train":
        from muon_fn._train.train import build_parser, resolve

        resolve(build_parser("muon-fn train").parse_args(argv[1:]))
    elif argv[0] in ("bench", "bench-sso"):
        from muon_fn.bench._cli import COMMANDS, parser

        rest = argv[1:] if argv[0] == "bench" else ["sso", *argv[1:]]
        command = rest.pop(0) if rest and rest[0] in COMMANDS else "muon"
        parser(command).parse_args(rest)
    elif argv[0] == "plan":
        from muon_fn.fsdp._plan_cli import _parser

        _parser("muon-fn plan").parse_args(argv[1:])
    else:
        raise AssertionError(f"unknown muon-fn command {argv[0]!r}")


@pytest.mark.parametrize("page", [p.name for p in _pages()])
def test_muon_fn_commands_parse(page):
    path = README if page == "README.md" else DOCS / page
    for argv in _muon_fn_commands(path):
        try:
            _check_command(argv)
        except SystemExit as e:
            raise AssertionError(f"{page}: `muon-fn {' '.join(argv)}` does not parse: {e}") from None


# transformers.md has its own test (above), which also checks what its blocks print.
@pytest.mark.parametrize("page", [p.name for p in _pages() if p.name != "transformers.md" and _python_blocks(p)])
def test_python_blocks_run(page, monkeypatch, tmp_path):
    """A page's python blocks run in order in one namespace, as a reader would paste them; the
    distributed ones as a one-process gloo job (the environment torchrun would set)."""
    import torch.distributed as dist

    path = README if page == "README.md" else DOCS / page
    monkeypatch.chdir(tmp_path)
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0", MUON_FN_COMPILE="0").items():  # eager: compiling is tested elsewhere
        monkeypatch.setenv(key, value)
    namespace: dict = {"__name__": "__docs__"}
    try:
        for i, block in enumerate(_python_blocks(path)):
            exec(compile(block, f"{page}[python block {i}]", "exec"), namespace)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
