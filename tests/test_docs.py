"""The docs agree with the code: api.md's overview lists every public name (their signatures and
docstrings are rendered from the code: tests/test_reference.py), links resolve, the README's
commands are the ones CI runs, every python block runs and every ``muon-fn`` command parses.

Standalone blocks. A page's python blocks run in order in one namespace, as a reader pasting them
one after the other would run them. A block a reader copies alone (a ``train.py``, a checkpoint
recipe, a full example) must carry its own imports and definitions; an HTML comment on the line
before its fence marks it:

    <!-- standalone -->                 the block runs in a fresh namespace
    <!-- standalone: model, opt -->     a fresh namespace holding only these names: the objects
                                        of the reader's own script (here: of the page's earlier
                                        blocks), which the block does not define

The in-order runs below execute a marked block that way (what it defines then carries on to the
page's later blocks), and ``test_standalone_blocks_use_only_what_they_define`` checks statically
that it reads no other name.
"""

from __future__ import annotations

import builtins
import importlib
import re
import symtable
from pathlib import Path
from typing import NamedTuple

import pytest
from _ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _overview_names() -> set[str]:
    """The names api.md's table lists, in backticks (``[`name`][muon_fn.name]`` or ```name```)."""
    return set(re.findall(r"`([A-Za-z_][\w.]*)`", (DOCS / "api.md").read_text()))


def test_api_md_lists_every_public_name():
    """api.md is an overview: every public name appears in its table (the reference pages hold
    their docstrings: tests/test_reference.py)."""
    listed = _overview_names()
    for modname in (
        "muon_fn",
        "muon_fn.optim",
        "muon_fn.spectral",
        "muon_fn.orthogonalization",
        "muon_fn.fsdp",
    ):
        mod = importlib.import_module(modname)
        missing = sorted(n for n in mod.__all__ if n not in listed)
        assert not missing, f"docs/api.md's table does not list {modname}.{missing}"


def test_api_md_links_name_real_objects():
    """Each ``[text][identifier]`` cross-reference of api.md names an object that exists (the
    strict site build checks that it is rendered too)."""
    targets = re.findall(r"\]\[(muon_fn[\w.]*)\]", (DOCS / "api.md").read_text())
    assert targets
    for target in targets:
        modname, _, attr = target.rpartition(".")
        while True:  # a method: muon_fn.optim.Optimizer.state_dict
            try:
                obj = importlib.import_module(modname)
                break
            except ModuleNotFoundError:
                modname, _, outer = modname.rpartition(".")
                attr = f"{outer}.{attr}"
        for part in attr.split("."):
            assert hasattr(obj, part), f"docs/api.md links to {target}, which does not exist"
            obj = getattr(obj, part)


def test_train_synopses_list_every_preset_and_optimizer():
    """The ``muon-fn train`` synopsis of muon_fn.tools.cli's docstring (the reference's command page)
    and index.md's options table name every ``--model`` preset and every ``--optimizer``."""
    import muon_fn.tools.cli
    from muon_fn.tools.train.model import PRESETS
    from muon_fn.tools.train.optimizers import OPTIMIZERS

    doc = muon_fn.tools.cli.__doc__
    synopsis = doc[doc.index("muon-fn train [--quick]") :].split("muon-fn bench")[0]
    assert set(re.search(r"--model ([\w|-]+)", synopsis).group(1).split("|")) == set(PRESETS)
    assert set(re.search(r"--optimizer ([\w|-]+)", synopsis).group(1).split("|")) == set(OPTIMIZERS)
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(
            r"^\| `(--[\w-]+)`[^|]*\|[^|]*\|(.*)$", (DOCS / "index.md").read_text(), re.M
        )
    }
    for option, names in (("--model", PRESETS), ("--optimizer", OPTIMIZERS)):
        missing = [n for n in names if f"`{n}`" not in rows[option]]
        assert not missing, f"index.md's {option} row does not name {missing}"


def test_bench_entry_points_exist():
    from muon_fn.tools import bench

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
    # CI installs the dev set-up plus the docs extra and the extras the HF and Lightning example tests need.
    assert 'pip install -e ".[dev,docs,hf,lightning]"' in ci and "MUON_FN_REQUIRE_EXTRAS=1" in ci
    assert "muon-fn train --quick" in readme
    assert (
        "OMP_NUM_THREADS=1 python -m pytest -q  " in readme
    )  # the fast tier, as the README's test command
    assert "OMP_NUM_THREADS=1 python -m pytest -q --tier full" in readme
    # .ci/run: lint, types and the docs build, `export OMP_NUM_THREADS=1`, then the README's command
    # exactly, `"$PY" -m pytest -q`, then the rest of the full tier (then the oldest-torch tests).
    commands = [
        ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.strip().startswith("#")
    ]
    order = [
        '"$PY" -m ruff check .',
        '"$PY" -m ruff format --check .',
        '"$PY" -m mypy',
        "export OMP_NUM_THREADS=1",
        '"$PY" -m pytest -q',
        '"$PY" -m pytest -q --tier slow',
    ]
    assert all(c in commands for c in order), commands
    assert [commands.index(c) for c in order] == sorted(commands.index(c) for c in order), commands
    assert any(
        c.endswith('mkdocs build --strict --quiet --site-dir "$(mktemp -d)"') for c in commands
    ), commands


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
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run_blocks(DOCS / "transformers.md", {"__name__": "__docs__"})
    out = capsys.readouterr().out
    shown = re.findall(r"prints\n\n```\n(.*?)```", text, re.S)
    assert len(shown) >= 2  # the toy MoE block's split and the demo GPT's
    for line in "".join(shown).splitlines():
        if line.strip() != "...":
            assert line in out.splitlines(), (
                f"transformers.md shows {line!r}, the example printed:\n{out}"
            )


# --------------------------------------------------------------------------------------------
# every code block: python blocks run, muon-fn commands parse


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


class Block(NamedTuple):
    lang: str  # the fence's language ("" for none)
    text: str
    line: int  # the line of the opening fence
    given: (
        tuple[str, ...] | None
    )  # standalone: the names it may take from the page; None: not marked


_STANDALONE = re.compile(r"^\s*<!--\s*standalone(?:\s*:\s*([\w\s,]*?))?\s*-->\s*$")


def _fenced(path: Path) -> list[Block]:
    """Each fenced block of a page, in order; a fence may be indented (inside a list item), and
    its indent is removed from the block's lines."""
    blocks, lang, body, indent, start, given, previous = [], None, [], "", 0, None, ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^(\s*)```(\w*)\s*$", line)
        if fence and lang is None:
            indent, lang, body, start = fence.group(1), fence.group(2), [], number
            marker = _STANDALONE.match(previous)
            given = None if marker is None else tuple(re.findall(r"\w+", marker.group(1) or ""))
        elif fence:
            blocks.append(Block(lang, "\n".join(body) + "\n", start, given))
            lang = None
        elif lang is not None:
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
        previous = line
    return blocks


def _python_blocks(path: Path) -> list[Block]:
    return [b for b in _fenced(path) if b.lang == "python"]


def _run_blocks(path: Path, namespace: dict) -> None:
    """Run a page's python blocks in order in ``namespace``; a standalone block in a fresh
    namespace holding only its given names, whose definitions then join ``namespace``."""
    for i, block in enumerate(_python_blocks(path)):
        code = compile(block.text, f"{path.name}[python block {i}, line {block.line}]", "exec")
        if block.given is None:
            exec(code, namespace)
            continue
        missing = [name for name in block.given if name not in namespace]
        assert not missing, (
            f"{path.name}:{block.line}: no earlier block defines the given {missing}"
        )
        alone = {"__name__": namespace.get("__name__", "__main__")}
        alone.update({name: namespace[name] for name in block.given})
        exec(code, alone)
        namespace.update(alone)


def _command_lines(path: Path) -> list[str]:
    """The shell lines of a page: fenced blocks that are not python, and indented code."""
    lines = [ln for b in _fenced(path) if b.lang != "python" for ln in b.text.splitlines()]
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
        from muon_fn.tools.train.train import build_parser, resolve

        parser = build_parser("muon-fn train")
        resolve(parser.parse_args(argv[1:]), parser)
    elif argv[0] in ("bench", "bench-sso"):
        from muon_fn.tools.bench._cli import COMMANDS, parser

        rest = argv[1:] if argv[0] == "bench" else ["sso", *argv[1:]]
        command = rest.pop(0) if rest and rest[0] in COMMANDS else "muon"
        parser(command).parse_args(rest)
    elif argv[0] == "plan":
        from muon_fn.tools.plan import _parser

        _parser("muon-fn plan").parse_args(argv[1:])
    else:
        raise AssertionError(f"unknown muon-fn command {argv[0]!r}")


@pytest.mark.parametrize("page", [p.name for p in _pages()])
def test_muon_fn_commands_parse(page, monkeypatch):
    from muon_fn.tools import _argtypes

    # The docs show GPU commands (--device cuda): whether this machine has a GPU is not theirs to pass.
    monkeypatch.setattr(_argtypes, "_check_cuda", lambda *args: None)
    path = README if page == "README.md" else DOCS / page
    for argv in _muon_fn_commands(path):
        try:
            _check_command(argv)
        except SystemExit as e:
            raise AssertionError(
                f"{page}: `muon-fn {' '.join(argv)}` does not parse: {e}"
            ) from None


# transformers.md has its own test (above), which also checks what its blocks print.
@pytest.mark.parametrize(
    "page", [p.name for p in _pages() if p.name != "transformers.md" and _python_blocks(p)]
)
@pytest.mark.slow
def test_python_blocks_run(page, monkeypatch, tmp_path):
    """A page's python blocks run in order in one namespace, as a reader would paste them, and
    each standalone block in a namespace of its own (see the top of this file); the distributed
    ones as a one-process gloo job (the environment torchrun would set)."""
    import torch.distributed as dist

    path = README if page == "README.md" else DOCS / page
    monkeypatch.chdir(tmp_path)
    for key, value in dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MUON_FN_COMPILE="0",
    ).items():  # eager: compiling is tested elsewhere
        monkeypatch.setenv(key, value)
    try:
        _run_blocks(path, {"__name__": "__docs__"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# standalone blocks (see the top of this file)


def _free_names(text: str) -> set[str]:
    """The global names a block reads without importing, assigning or defining them anywhere in
    it (builtins aside)."""
    top = symtable.symtable(text, "block", "exec")
    defined = {
        s.get_name()
        for s in top.get_symbols()
        if s.is_assigned() or s.is_imported() or s.is_namespace()
    }
    read: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if (
                s.is_referenced()
                and (table is top or s.is_global())
                and not (s.is_assigned() or s.is_imported() or s.is_parameter())
            ):
                read.add(s.get_name())
        for child in table.get_children():
            visit(child)

    visit(top)
    return read - defined - set(dir(builtins))


def test_standalone_blocks_use_only_what_they_define():
    problems = []
    for path in _pages():
        for block in _python_blocks(path):
            if block.given is not None:
                extra = sorted(_free_names(block.text) - set(block.given))
                if extra:
                    problems.append(
                        f"{path.name}:{block.line}: a standalone block reads {extra} without "
                        "importing or defining them (or naming them: <!-- standalone: name, ... -->)"
                    )
    assert not problems, "\n".join(problems)


def test_standalone_markers_sit_on_python_blocks_and_mark_every_script():
    """A marker is the line just before a ```python fence; a block that opens with a script's
    name (``# train.py: ...``) is marked."""
    marked = 0
    for path in _pages():
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if re.match(r"\s*<!--\s*standalone", line):
                assert _STANDALONE.match(line), (
                    f"{path.name}:{number}: malformed marker {line.strip()!r}"
                )
                after = lines[number] if number < len(lines) else ""
                assert re.match(r"^\s*```python\s*$", after), (
                    f"{path.name}:{number}: marker not on the line before a ```python fence"
                )
                marked += 1
        for block in _python_blocks(path):
            first = (block.text.strip().splitlines() or [""])[0]
            if re.match(r"#\s*[\w./-]+\.py\b", first):
                assert block.given is not None, (
                    f"{path.name}:{block.line}: {first!r} is not marked <!-- standalone -->"
                )
    assert marked >= 10
