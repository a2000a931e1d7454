"""The docs agree with the code: api.md covers every public name and writes each signature as the
code has it, links resolve, the README's commands are the ones CI runs, every python block runs
and every ``muon-fn`` command parses.

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

import ast
import builtins
import importlib
import inspect
import re
import symtable
from pathlib import Path
from typing import NamedTuple

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


# Signatures: the first line of an api.md section, `name(a, b=1, *, c=None, …)`, against the code.
# Parameters api.md leaves out although its line has no "…": the former ``split=``, which only
# raises a TypeError pointing to ``heads`` (its sections say so).
_UNWRITTEN = {"split"}
# Every optimizer class and builder: their signatures must be among those checked.
_MUST_CHECK = {"Optimizer", "MuonOptimizer", "TritonMuon", "TritonMuonW", "SpectralSphereOptimizer",
               "create_hybrid_optimizer", "muon_fn.fsdp.FSDPMuonOptimizer",
               "muon_fn.fsdp.FSDPSpectralSphereOptimizer", "muon_fn.fsdp.plan_model", "muon", "hybrid"}


def _api_sections() -> list[tuple[str, str]]:
    """``(name, body)`` of each ``### `name` `` section of api.md."""
    sections = []
    for section in re.split(r"^### ", (DOCS / "api.md").read_text(), flags=re.M)[1:]:
        head, _, body = section.partition("\n")
        m = re.match(r"`([^`(\s]+)", head)
        if m:
            sections.append((m.group(1), body))
    return sections


def _public(name: str):
    if name.startswith("muon_fn."):
        modname, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(modname), attr)
    return getattr(muon_fn, name)


def _written_signature(name: str, body: str) -> tuple[ast.arguments, bool] | None:
    """The parameters a section's opening `name(...)` writes, and whether it ends the list with
    "…" (some left out); None if the section does not open with a signature."""
    m = re.match(r"\s*`([^`]+)`", body)
    text = " ".join(m.group(1).split()) if m else ""
    if not text.startswith(name.rpartition(".")[2] + "("):
        return None
    text = re.sub(r"\)\s*->.*$", ")", text)
    elided = bool(re.search(r"…|\.\.\.", text))
    text = re.sub(r",\s*(?:…|\.\.\.)", "", text)
    try:
        return ast.parse(f"def {text}: pass").body[0].args, elided
    except SyntaxError:  # an example call, e.g. parse_mesh("replicate=2,dp=64")
        return None


def _signature_problems(name: str, written: ast.arguments, elided: bool) -> list[str]:
    import torch

    real = inspect.signature(_public(name)).parameters
    named = [p for p in real.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in real.values())
    positional = written.posonlyargs + written.args
    defaults = [None] * (len(positional) - len(written.defaults)) + list(written.defaults)
    params = [(a, d, False) for a, d in zip(positional, defaults)]
    params += [(a, d, True) for a, d in zip(written.kwonlyargs, written.kw_defaults)]
    problems = []
    for arg, default, keyword_only in params:
        p = real.get(arg.arg)
        if p is None:
            if not takes_kwargs:
                problems.append(f"{name}: api.md writes {arg.arg}=, which the code does not take")
            continue
        if keyword_only != (p.kind == p.KEYWORD_ONLY):
            problems.append(f"{name}: api.md writes {arg.arg} as {'keyword-only' if keyword_only else 'positional'}, "
                            f"the code has it {p.kind.description}")
        if default is None:
            continue
        value = eval(ast.unparse(default), {"torch": torch, **vars(muon_fn)})  # noqa: S307 (our own docs)
        same = (p.default is not p.empty and value == p.default
                and isinstance(value, bool) == isinstance(p.default, bool))
        if not same:
            real_default = "none" if p.default is p.empty else repr(p.default)
            problems.append(f"{name}: api.md writes {arg.arg}={ast.unparse(default)}, "
                            f"the code's default is {real_default}")
    order = [a.arg for a, _, _ in params if a.arg in real]
    if order != [p.name for p in named if p.name in order]:
        problems.append(f"{name}: api.md writes the parameters in the order {order}, the code has {list(real)}")
    if not elided:
        missing = [p.name for p in named if p.name not in order and p.name not in _UNWRITTEN]
        if missing:
            problems.append(f"{name}: api.md leaves out {missing} (end the list with '…' if on purpose)")
    return problems


def test_api_md_signatures_match_the_code():
    """Each section that opens with `name(...)` writes the code's parameters: names, order,
    keyword-only marks and defaults (``inspect.signature``)."""
    checked, problems = set(), []
    for name, body in _api_sections():
        written = _written_signature(name, body)
        if written is not None:
            checked.add(name)
            problems += _signature_problems(name, *written)
    assert not problems, "\n".join(problems)
    assert _MUST_CHECK <= checked, f"api.md sections without a checkable signature: {sorted(_MUST_CHECK - checked)}"


def test_train_synopses_list_every_preset_and_optimizer():
    """api.md's `muon-fn train` synopsis and index.md's options table name every ``--model``
    preset and every ``--optimizer``."""
    from muon_fn._train.model import PRESETS
    from muon_fn._train.optimizers import OPTIMIZERS

    synopsis = next(body for name, body in _api_sections() if body.lstrip().startswith("`muon-fn train "))
    assert set(re.search(r"--model ([\w|-]+)", synopsis).group(1).split("|")) == set(PRESETS)
    assert set(re.search(r"--optimizer ([\w|-]+)", synopsis).group(1).split("|")) == set(OPTIMIZERS)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(--[\w-]+)`[^|]*\|[^|]*\|(.*)$",
                                                        (DOCS / "index.md").read_text(), re.M)}
    for option, names in (("--model", PRESETS), ("--optimizer", OPTIMIZERS)):
        missing = [n for n in names if f"`{n}`" not in rows[option]]
        assert not missing, f"index.md's {option} row does not name {missing}"


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
    # .ci/run: `export OMP_NUM_THREADS=1`, then the README's command exactly, `"$PY" -m pytest -q`
    # (then, after it, the oldest-torch tests in a venv of their own).
    commands = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert "export OMP_NUM_THREADS=1" in commands and '"$PY" -m pytest -q' in commands, commands
    assert commands.index("export OMP_NUM_THREADS=1") < commands.index('"$PY" -m pytest -q')


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
            assert line in out.splitlines(), f"transformers.md shows {line!r}, the example printed:\n{out}"


# --------------------------------------------------------------------------------------------
# every code block: python blocks run, muon-fn commands parse


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


class Block(NamedTuple):
    lang: str  # the fence's language ("" for none)
    text: str
    line: int  # the line of the opening fence
    given: tuple[str, ...] | None  # standalone: the names it may take from the page; None: not marked


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
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
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
        assert not missing, f"{path.name}:{block.line}: no earlier block defines the given {missing}"
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
        from muon_fn._train.train import build_parser, resolve

        parser = build_parser("muon-fn train")
        resolve(parser.parse_args(argv[1:]), parser)
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
def test_muon_fn_commands_parse(page, monkeypatch):
    from muon_fn import _argtypes

    # The docs show GPU commands (--device cuda): whether this machine has a GPU is not theirs to pass.
    monkeypatch.setattr(_argtypes, "_check_cuda", lambda *args: None)
    path = README if page == "README.md" else DOCS / page
    for argv in _muon_fn_commands(path):
        try:
            _check_command(argv)
        except SystemExit as e:
            raise AssertionError(f"{page}: `muon-fn {' '.join(argv)}` does not parse: {e}") from None


# transformers.md has its own test (above), which also checks what its blocks print.
@pytest.mark.parametrize("page", [p.name for p in _pages() if p.name != "transformers.md" and _python_blocks(p)])
def test_python_blocks_run(page, monkeypatch, tmp_path):
    """A page's python blocks run in order in one namespace, as a reader would paste them, and
    each standalone block in a namespace of its own (see the top of this file); the distributed
    ones as a one-process gloo job (the environment torchrun would set)."""
    import torch.distributed as dist

    path = README if page == "README.md" else DOCS / page
    monkeypatch.chdir(tmp_path)
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0", MUON_FN_COMPILE="0").items():  # eager: compiling is tested elsewhere
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
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    read: set[str] = set()

    def visit(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            if s.is_referenced() and (table is top or s.is_global()) and not (
                    s.is_assigned() or s.is_imported() or s.is_parameter()):
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
                    problems.append(f"{path.name}:{block.line}: a standalone block reads {extra} without "
                                    "importing or defining them (or naming them: <!-- standalone: name, ... -->)")
    assert not problems, "\n".join(problems)


def test_standalone_markers_sit_on_python_blocks_and_mark_every_script():
    """A marker is the line just before a ```python fence; a block that opens with a script's
    name (``# train.py: ...``) is marked."""
    marked = 0
    for path in _pages():
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if re.match(r"\s*<!--\s*standalone", line):
                assert _STANDALONE.match(line), f"{path.name}:{number}: malformed marker {line.strip()!r}"
                after = lines[number] if number < len(lines) else ""
                assert re.match(r"^\s*```python\s*$", after), \
                    f"{path.name}:{number}: marker not on the line before a ```python fence"
                marked += 1
        for block in _python_blocks(path):
            first = (block.text.strip().splitlines() or [""])[0]
            if re.match(r"#\s*[\w./-]+\.py\b", first):
                assert block.given is not None, f"{path.name}:{block.line}: {first!r} is not marked <!-- standalone -->"
    assert marked >= 10
