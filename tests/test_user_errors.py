"""A new user's mistakes, one row each: the call → the exact message (expecttest).

The mistakes users met first with the library (the CLI's are in tests/test_cli_errors.py): a
torch-style call to the hybrid, a parameter listed twice, a misspelled key, a gradient of the
wrong shape or tree, a state_dict that lost a parameter's state, a skipped non-finite step.
Each gets an early error (or, for the skip, one warning) naming the argument, the value and what
is allowed. Update after an intentional wording change with
``EXPECTTEST_ACCEPT=1 pytest tests/test_user_errors.py``.
"""

from __future__ import annotations

import warnings

import expecttest
import pytest
import torch
from torch import nn

import muon_fn as mf


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16))


def matrix() -> nn.Parameter:
    torch.manual_seed(0)
    return nn.Parameter(torch.randn(4, 6))


def stepped(net: nn.Module) -> mf.MuonOptimizer:
    opt = mf.MuonOptimizer(net.named_parameters(), compile=False)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def without_state_of(sd: dict, pid: int) -> dict:
    return {**sd, "state": {k: v for k, v in sd["state"].items() if k != pid}}


def first_skip_warning() -> str:
    w = matrix()
    opt = mf.MuonOptimizer([("w", w)], compile=False)
    w.grad = torch.full_like(w, float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return "\n".join(str(x.message) for x in caught)


def update(grads: dict) -> None:
    params = {"a": torch.zeros(4, 6)}
    tx = mf.muon()
    tx.update(grads, tx.init(params), params)


class TestFirstHour(expecttest.TestCase):
    def error(self, exc_type, fn) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn()
        return str(ctx.exception)

    def test_torch_style_calls_to_the_hybrid(self):
        e = self.error
        self.assertExpectedInline(
            e(TypeError, lambda: mf.create_hybrid_optimizer(model().parameters())),
            """create_hybrid_optimizer() takes the model (an nn.Module), to split its parameters by role (embeddings, output head, hidden matrices), got generator; for an iterable of parameters use muon_fn.MuonOptimizer(params) (Muon for ndim >= 2, AdamW for the rest)""",  # noqa: E501
        )
        self.assertExpectedInline(
            e(TypeError, lambda: mf.create_hybrid_optimizer(model(), lr=0.02)),
            """create_hybrid_optimizer() got an unexpected keyword argument 'lr': use muon_lr= for the Muon half (default 0.02) and adamw_lr= for the AdamW half (default 1e-3)""",  # noqa: E501
        )
        self.assertExpectedInline(
            e(TypeError, lambda: mf.create_hybrid_optimizer(model(), weight_decay=0.1)),
            """create_hybrid_optimizer() got an unexpected keyword argument 'weight_decay': use muon_weight_decay= and adamw_weight_decay= (default 0.01 each)""",  # noqa: E501
        )
        self.assertExpectedInline(
            e(TypeError, lambda: mf.SpectralSphereOptimizer.from_model(list(model().parameters()))),
            """create_hybrid_optimizer() takes the model (an nn.Module), to split its parameters by role (embeddings, output head, hidden matrices), got list; for an iterable of parameters use muon_fn.MuonOptimizer(params) (Muon for ndim >= 2, AdamW for the rest)""",  # noqa: E501
        )

    def test_a_parameter_listed_twice(self):
        e, w = self.error, matrix()
        self.assertExpectedInline(
            e(ValueError, lambda: mf.MuonOptimizer([w, w])),
            """parameter #1 of shape (4, 6) appears twice in one parameter group (positions 0 and 1); it would be updated twice per step: list each parameter once""",  # noqa: E501
        )
        self.assertExpectedInline(
            e(ValueError, lambda: mf.MuonOptimizer([("a", w), ("b", w)])),
            """parameter 'b' appears twice in one parameter group (positions 0 and 1); it would be updated twice per step: list each parameter once""",  # noqa: E501
        )
        self.assertExpectedInline(
            e(ValueError, lambda: mf.MuonOptimizer([{"params": [w]}, {"params": [w]}])),
            """some parameters appear in more than one parameter group: the new group's parameter #0 of shape (4, 6) is in group 0 already""",  # noqa: E501
        )

    def test_misspelled_keys(self):
        e = self.error
        self.assertExpectedInline(
            e(ValueError, lambda: mf.MuonOptimizer([{"params": [matrix()], "lrr": 0.1}])),
            """Invalid param group key 'lrr': MuonOptimizer has no hyperparameter 'lrr' (it would be kept and never used); did you mean 'lr'?""",  # noqa: E501
        )
        self.assertExpectedInline(
            e(
                ValueError,
                lambda: mf.create_hybrid_optimizer(model(), matrix_view={"1.wieght": "experts"}),
            ),
            """Invalid matrix_view: key '1.wieght' matches no Muon parameter of the model; they are: '1.weight'""",
        )
        self.assertExpectedInline(
            e(
                ValueError,
                lambda: mf.create_hybrid_optimizer(model(), matrix_view={"0.weight": "experts"}),
            ),
            """Invalid matrix_view: key '0.weight' matches no Muon parameter of the model ('0.weight' gets AdamW (embedding), which reads no matrix view); they are: '1.weight'""",  # noqa: E501
        )
        self.assertExpectedInline(
            e(
                ValueError,
                lambda: mf.MuonOptimizer(
                    model().named_parameters(), matrix_view={"1.wieght": "experts"}
                ),
            ),
            """Invalid matrix_view: key '1.wieght' matches no parameter of its groups; they are: '0.weight', '1.weight', '1.bias', '2.weight', '2.bias'""",  # noqa: E501
        )

    def test_gradients_that_do_not_fit_the_parameters(self):
        e = self.error
        self.assertExpectedInline(
            e(ValueError, lambda: update({"a": torch.zeros(6, 4)})),
            """the updates (gradients) do not match the parameters: the update at ['a'] has shape (6, 4) but its parameter has shape (4, 6) (transposed?)""",  # noqa: E501
        )
        self.assertExpectedInline(
            e(ValueError, lambda: update({"b": torch.zeros(4, 6)})),
            """the updates (gradients) do not match the parameters: no update for ['a']; updates for ['b'], which are not parameters""",  # noqa: E501
        )

    def test_a_state_dict_that_lost_a_parameters_state(self):
        e, net = self.error, model()
        sd = stepped(net).state_dict()
        fresh = mf.MuonOptimizer(net.named_parameters(), compile=False)
        self.assertExpectedInline(
            e(ValueError, lambda: fresh.load_state_dict(without_state_of(sd, 1))),
            """loaded state dict has no state for parameter '1.weight' of group 0, which had state when the state_dict was saved: it would restart from zero momentum. Load the complete state_dict, or pass allow_missing_state=True to start the state of such parameters afresh""",  # noqa: E501
        )
        fresh.load_state_dict(without_state_of(sd, 1), allow_missing_state=True)
        assert "momentum_buffer" not in fresh.state[net[1].weight]

    def test_non_finite_gradients(self):
        w = matrix()
        opt = mf.MuonOptimizer([("w", w)], nonfinite="error", compile=False)
        w.grad = torch.full_like(w, float("inf"))
        self.assertExpectedInline(
            self.error(RuntimeError, opt.step),
            """non-finite gradient (inf or nan) in 'w'; parameters and optimizer state were left unchanged. Pass nonfinite='skip' to skip such steps, or use torch.amp.GradScaler.""",  # noqa: E501
        )
        self.assertExpectedInline(
            first_skip_warning(),
            """MuonOptimizer: skipped a step: non-finite gradient (inf or nan) in 'w'; parameters and optimizer state were left unchanged (nonfinite='skip', the default). Later skipped steps are counted in optimizer.nonfinite_steps without a warning; pass nonfinite='error' to raise instead, or use torch.amp.GradScaler for fp16 training.""",  # noqa: E501
        )


def test_a_state_dict_saved_before_some_parameters_had_state_loads():
    """A parameter that had no state when saved (it never got a gradient) is not 'missing'."""
    net = model()
    opt = mf.MuonOptimizer(net.named_parameters(), compile=False)
    for name, p in net.named_parameters():
        p.grad = None if name == "1.weight" else torch.ones_like(p)  # (8, 8): a bucket of its own
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["params_without_state"] == [1]
    fresh = mf.MuonOptimizer(net.named_parameters(), compile=False)
    fresh.load_state_dict(sd)
    assert not fresh.state.get(net[1].weight)


def test_a_refused_group_is_not_added():
    opt = mf.MuonOptimizer([matrix()], compile=False)
    with pytest.raises(
        ValueError, match=r"muon_fn does not support complex parameters, got #0 of shape \(3,\)"
    ):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.complex64))]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 3))]})
    assert len(opt.param_groups) == 2


@pytest.mark.slow
def test_the_first_compile_says_what_it_does(monkeypatch, capsys, caplog):
    """One line at the first compile of the process, naming what compiles and the cache; through
    the 'muon_fn' logger where logging is configured, else on stderr; silenced by its level."""
    import logging

    from muon_fn.core import compile as _compile
    from muon_fn.core import log as _log

    def first_steps():
        monkeypatch.setattr(_compile, "_ANNOUNCED", False)
        w = matrix()
        opt = mf.MuonOptimizer([w], compile={"backend": "eager"})
        for _ in range(2):
            w.grad = torch.ones_like(w)
            opt.step()

    caplog.set_level(logging.INFO, logger="muon_fn")
    first_steps()
    lines = [r.getMessage() for r in caplog.records if r.name == "muon_fn"]
    assert len(lines) == 1 and lines[0].startswith(
        "compiling MuonOptimizer's step with torch.compile (eager)"
    )
    assert "on-disk cache" in lines[0]
    monkeypatch.setattr(_log.logger, "hasHandlers", lambda: False)  # logging not configured
    first_steps()
    assert capsys.readouterr().err.count("muon_fn: compiling MuonOptimizer's step") == 1
    monkeypatch.setattr(_log.logger, "level", logging.WARNING)  # setLevel, undone by monkeypatch
    first_steps()
    assert "compiling" not in capsys.readouterr().err
