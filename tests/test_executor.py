"""The optimizer's executor: one class whatever its parameters are, the step run by an executor
(``muon_fn.optim.engine.Executor``) that DTensors switch; no class is made at run time.

The distributed flows (construction on DTensors, a swap, copies) are tested with one rank in
tests/test_layouts.py and with W = 2, 3 in tests/test_layouts_dist.py.
"""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import muon_fn as mf
from muon_fn.optim import engine

PACKAGE = Path(mf.__file__).parent


def test_no_module_changes_an_objects_class_or_makes_one():
    """Nothing in muon_fn assigns ``__class__`` or builds a class with ``type(name, bases, ns)``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for pattern in (r"\.__class__\s*=[^=]", r"\btype\(\s*[\w.]+\s*,\s*\(", r"__reduce_ex__"):
            found += [
                f"{path.relative_to(PACKAGE)}: {m.group(0)!r}" for m in re.finditer(pattern, text)
            ]
    assert not found, found


@pytest.mark.parametrize(
    "build",
    [
        lambda m: mf.MuonOptimizer(m.parameters(), compile=False),
        lambda m: mf.create_hybrid_optimizer(m, compile=False),
        lambda m: mf.SpectralSphereOptimizer(m.parameters(), compile=False),
        lambda m: mf.Optimizer(m.parameters(), mf.adamw(1e-3), compile=False),
    ],
    ids=["muon", "hybrid", "sso", "generic"],
)
def test_local_tensors_run_the_local_executor(build):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    opt = build(model)
    assert type(opt._executor) is engine.LocalExecutor and not opt._executor.distributed
    assert opt._executor.opt is opt
    clones = [copy.deepcopy(opt)]
    if (
        type(opt) is not mf.Optimizer
    ):  # the generic one holds its tx in a lambda, which does not pickle
        clones.append(pickle.loads(pickle.dumps(opt)))
    for clone in clones:
        assert type(clone) is type(opt) and type(clone._executor) is engine.LocalExecutor
        assert clone._executor.opt is clone


def test_distributed_attributes_on_local_tensors():
    """The distributed options read back from the options; what only the distributed step has
    is an AttributeError naming it; ``overlap`` set before a DTensor arrives is kept for it."""
    opt = mf.MuonOptimizer(nn.Linear(4, 4).parameters(), compile=False, wire_dtype=torch.bfloat16)
    assert (opt.strategy, opt.wire_dtype, opt.overlap) == ("owner", torch.bfloat16, False)
    opt.overlap = True
    assert opt.distributed_options.overlap is True
    with pytest.raises(ValueError, match="overlap"):
        opt.overlap = "yes"
    for name in ("topology", "plan"):
        with pytest.raises(
            AttributeError, match=f"MuonOptimizer.{name}: the optimizer holds no DTensor"
        ):
            getattr(opt, name)
    assert not hasattr(opt, "topology")
    with pytest.raises(ValueError, match="unshard_params"):
        opt.unshard_params()


def test_executor_holds_its_optimizer_weakly():
    """No reference cycle: an optimizer is freed when its last reference goes."""
    import weakref

    opt = mf.MuonOptimizer(nn.Linear(4, 4).parameters(), compile=False)
    ref = weakref.ref(opt)
    del opt
    assert ref() is None
