"""Import cost: ``import muon_fn`` and the ``muon-fn`` command's help load no compiler stack.

Dynamo and inductor (``torch._dynamo``, ``torch._inductor``: about 2 s on a CPU, sympy included)
are imported when something compiles, never by importing muon_fn; nor is DTensor
(``torch.distributed.tensor``) before a distributed optimizer is built. Each check runs in a fresh
interpreter, so what the test process has already imported does not hide an import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.tensor",
    "sympy",
    "matplotlib",
    "transformers",
)


def _run(code: str) -> str:
    """The last line ``code`` prints in a fresh interpreter."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_import_muon_fn_and_cli_help_load_no_compiler():
    """``import muon_fn``, then ``muon-fn --help`` and each command's ``--help``, one after the
    other in one interpreter (what is loaded only grows, so each check covers those before it)."""
    steps = [[], ["--help"], ["train", "--help"], ["bench", "--help"], ["plan", "--help"]]
    code = [
        "import muon_fn, contextlib, io, json, sys",
        "from muon_fn.tools.cli import main",
        "seen = {}",
    ]
    for argv in steps:
        if argv:
            code += [
                "with contextlib.redirect_stdout(io.StringIO()):",
                "    try:",
                f"        main({argv!r})",
                "    except SystemExit:",
                "        pass",
            ]
        code.append(
            f"seen[{' '.join(argv) or 'import muon_fn'!r}] = [m for m in {HEAVY!r} if m in sys.modules]"
        )
    code.append("print(json.dumps(seen))")
    seen = json.loads(_run("\n".join(code)))
    assert seen == {(" ".join(a) or "import muon_fn"): [] for a in steps}


@pytest.mark.slow
def test_a_compile_loads_dynamo_and_a_fullgraph_compile_of_the_step_names_the_reason():
    """The lazy ``torch.compiler.disable`` still disables: an outer ``fullgraph=True`` compile of
    ``opt.step`` fails with the adapters' reason, the first time and after a step has run."""
    code = (
        "import torch, muon_fn as mf\n"
        "m = torch.nn.Linear(4, 4)\nopt = mf.MuonOptimizer(m.parameters(), compile=False)\n"
        "m(torch.ones(2, 4)).sum().backward()\n"
        "for _ in range(2):\n"
        "    try:\n        torch.compile(opt.step, fullgraph=True, backend='eager')()\n"
        "    except Exception as e:\n        assert 'compile their own step' in str(e), e\n"
        "    else:\n        raise AssertionError('traced')\n"
        "    opt.step()\n"
        "import sys\nprint('torch._dynamo' in sys.modules)"
    )
    assert _run(code) == "True"
