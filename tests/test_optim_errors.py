"""Bad input to the stateful adapter: every message pinned with expecttest.

Update after an intentional wording change with ``EXPECTTEST_ACCEPT=1 pytest tests/test_optim_errors.py``.
"""

from __future__ import annotations

import io

import expecttest
import pytest
import torch
from torch import nn

import muon_fn as mf


def _linear(seed: int = 0, *shape: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(*(shape or (4, 3)))


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class TestHyperparameters(expecttest.TestCase):
    def message(self, exc_type, fn) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn()
        return str(ctx.exception)

    def test_negative_lr(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), lr=-0.1)),
            """Invalid learning rate: -0.1""",
        )

    def test_negative_tensor_lr(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: mf.MuonOptimizer(lin.parameters(), lr=torch.tensor(-0.5))
            ),
            """Invalid learning rate: -0.5""",
        )

    def test_one_element_1d_tensor_lr(self):
        """Found by a new user: ``lr=torch.tensor([0.02])`` was accepted (torch takes any 1-element
        tensor); muon_fn's lr is a float or a 0-d tensor, wherever it is given."""
        lin = _linear()
        lr = torch.tensor([0.02])
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), lr=lr)),
            """Invalid lr: a tensor of shape (1,) (expected a float or a 0-d tensor, e.g. torch.tensor(0.02), not torch.tensor([0.02]))""",  # noqa: E501
        )
        opt = mf.MuonOptimizer([lin.weight], compile=False)
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt.add_param_group({"params": [lin.bias], "lr": lr})),
            """Invalid lr: a tensor of shape (1,) (expected a float or a 0-d tensor, e.g. torch.tensor(0.02), not torch.tensor([0.02]))""",  # noqa: E501
        )
        assert len(opt.param_groups) == 1
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), adamw_lr=lr)),
            """Invalid adamw_lr: a tensor of shape (1,) (expected a float or a 0-d tensor, e.g. torch.tensor(0.02), not torch.tensor([0.02]))""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.create_hybrid_optimizer(lin, muon_lr=lr)),
            """Invalid muon_lr: a tensor of shape (1,) (expected a float or a 0-d tensor, e.g. torch.tensor(0.02), not torch.tensor([0.02]))""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.create_hybrid_optimizer(lin, adamw_lr=lr)),
            """Invalid adamw_lr: a tensor of shape (1,) (expected a float or a 0-d tensor, e.g. torch.tensor(0.02), not torch.tensor([0.02]))""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.TritonMuon(lin.parameters(), lr=lr)),
            """Invalid lr: a tensor of shape (1,) (expected a float or a 0-d tensor, e.g. torch.tensor(0.02), not torch.tensor([0.02]))""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.scale_by_learning_rate(lr)),
            """Invalid lr: a tensor of shape (1,) (expected a float or a 0-d tensor, e.g. torch.tensor(0.02), not torch.tensor([0.02]))""",  # noqa: E501
        )
        sd = opt.state_dict()
        sd["param_groups"][0]["lr"] = lr
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt.load_state_dict(sd)),
            """Invalid lr: a tensor of shape (1,) (expected a float or a 0-d tensor, e.g. torch.tensor(0.02), not torch.tensor([0.02]))""",  # noqa: E501
        )
        assert opt.param_groups[0]["lr"] == 0.02

    def test_hybrid_lr_named(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.create_hybrid_optimizer(lin, adamw_lr=-1.0)),
            """Invalid adamw_lr: -1.0""",
        )
        self.assertExpectedInline(
            self.message(
                ValueError,
                lambda: mf.create_hybrid_optimizer(lin, muon_lr=torch.tensor([0.1, 0.2])),
            ),
            """Tensor muon_lr must be 1-element""",
        )

    def test_nan_lr(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), lr=float("nan"))),
            """Invalid learning rate: nan""",
        )

    def test_momentum_one(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), momentum=1.0)),
            """Invalid momentum value: 1.0 (expected 0 <= momentum < 1)""",
        )

    def test_momentum_negative(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), momentum=-0.1)),
            """Invalid momentum value: -0.1 (expected 0 <= momentum < 1)""",
        )

    def test_negative_weight_decay(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: mf.MuonOptimizer(lin.parameters(), weight_decay=-0.01)
            ),
            """Invalid weight_decay value: -0.01""",
        )

    def test_negative_adamw_weight_decay(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: mf.MuonOptimizer(lin.parameters(), adamw_weight_decay=-1.0)
            ),
            """Invalid adamw_weight_decay value: -1.0""",
        )

    def test_ns_steps_zero(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), ns_steps=0)),
            """Invalid ns_steps value: 0 (expected an integer >= 1, or None)""",
        )

    def test_ns_steps_float(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), ns_steps=2.5)),
            """Invalid ns_steps value: 2.5 (expected an integer >= 1, or None)""",
        )

    def test_fsdp_bad_ns_coefficients_fail_at_construction(self):
        from muon_fn.fsdp import FSDPMuonOptimizer

        self.assertExpectedInline(
            self.message(
                ValueError, lambda: FSDPMuonOptimizer(_linear(), ns_coefficients=[(1.0,)])
            ),
            """Invalid ns_coefficients: [(1.0,)] (expected an (a, b, c) triple or a sequence of (a, b, c) triples)""",
        )

    def test_unknown_method(self):
        # The method list grows (other engineers add methods), so the list is spelled from the
        # registry; the wording and the design-contract methods are pinned.
        from muon_fn.core.newton_schulz import METHODS

        lin = _linear()
        msg = self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), method="newton"))
        self.assertEqual(
            msg, "Invalid method: 'newton' (valid: " + ", ".join(map(repr, METHODS)) + ")"
        )
        self.assertTrue(
            msg.startswith(
                "Invalid method: 'newton' (valid: 'polar_express', 'quintic', 'you', 'cubic'"
            )
        )
        for m in METHODS:  # every listed method is accepted (fp32: some methods reject bf16)
            mf.MuonOptimizer(lin.parameters(), method=m, ns_dtype=torch.float32)

    def test_unknown_adjust_lr_fn(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: mf.MuonOptimizer(lin.parameters(), adjust_lr_fn="sqrt")
            ),
            """Invalid adjust_lr_fn: 'sqrt' (valid: None, 'keller', 'original', 'match_rms_adamw', 'spectral', 'legacy', 'none')""",  # noqa: E501
        )

    def test_unknown_momentum_kind(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: mf.MuonOptimizer(lin.parameters(), momentum_kind="heavy")
            ),
            """Invalid momentum_kind: 'heavy' (valid: 'sgd', 'ema')""",
        )

    def test_bad_beta2(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), beta2=1.0)),
            """Invalid beta2 value: 1.0 (expected 0 <= beta2 < 1, or None for Muon)""",
        )

    def test_bad_adamw_betas(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: mf.MuonOptimizer(lin.parameters(), adamw_betas=(0.9, 1.5))
            ),
            """Invalid adamw_betas parameter at index 1: 1.5""",
        )

    def test_bad_eps(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), adamw_eps=0.0)),
            """Invalid adamw_eps value: 0.0 (expected > 0)""",
        )

    def test_bad_value_in_later_group(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError,
                lambda: mf.MuonOptimizer(
                    [{"params": [lin.weight]}, {"params": [lin.bias], "momentum": 2.0}]
                ),
            ),
            """Invalid momentum value: 2.0 (expected 0 <= momentum < 1)""",
        )

    def test_bad_accumulation_steps(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError,
                lambda: mf.MuonOptimizer(lin.parameters(), gradient_accumulation_steps=0),
            ),
            """Invalid gradient_accumulation_steps: 0 (expected an integer >= 1)""",
        )

    def test_bad_nonfinite_policy(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer(lin.parameters(), nonfinite="warn")),
            """Invalid nonfinite: 'warn' (valid: 'skip', 'error', None)""",
        )

    def test_bad_transform(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(TypeError, lambda: mf.Optimizer(lin.parameters(), 0.02)),
            """tx_or_factory must be a GradientTransformation or a function of the group's hyperparameters, got float""",  # noqa: E501
        )


class TestParameters(expecttest.TestCase):
    def message(self, exc_type, fn) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn()
        return str(ctx.exception)

    def test_empty_parameter_list(self):
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer([])),
            """optimizer got an empty parameter list""",
        )

    def test_empty_parameter_list_generic(self):
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.Optimizer([], mf.adamw())),
            """optimizer got an empty parameter list""",
        )

    def test_empty_parameter_list_hybrid(self):
        """A model without parameters (a frozen one keeps its parameters, as in torch.optim)."""
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.create_hybrid_optimizer(nn.Sequential(nn.ReLU()))),
            """optimizer got an empty parameter list""",
        )

    def test_a_module_as_params(self):
        """Found by a new user (was torch's "'Linear' object is not iterable")."""
        lin = _linear()
        self.assertExpectedInline(
            self.message(TypeError, lambda: mf.MuonOptimizer(lin)),
            """params argument given to the optimizer should be an iterable of Tensors or dicts, but got torch.nn.modules.linear.Linear (a module): pass model.parameters() (or model.named_parameters()), and model=model to name them in messages and checkpoints and give conv and expert weights their module's matrix view""",  # noqa: E501
        )
        seq = nn.Sequential(
            lin
        )  # iterable: torch said "optimizer can only optimize Tensors, but one of the params is ..."
        self.assertExpectedInline(
            self.message(TypeError, lambda: mf.TritonMuonW(seq)),
            """params argument given to the optimizer should be an iterable of Tensors or dicts, but got torch.nn.modules.container.Sequential (a module): pass model.parameters() (or model.named_parameters()), and model=model to name them in messages and checkpoints and give conv and expert weights their module's matrix view""",  # noqa: E501
        )

    def test_parameter_in_two_groups(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError,
                lambda: mf.MuonOptimizer(
                    [{"params": [lin.weight]}, {"params": [lin.bias, lin.weight]}]
                ),
            ),
            """some parameters appear in more than one parameter group: the new group's parameter #1 of shape (3, 4) is in group 0 already""",  # noqa: E501
        )

    def test_parameter_in_two_groups_via_add_param_group(self):
        lin = _linear()
        opt = mf.MuonOptimizer(lin.parameters())
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt.add_param_group({"params": [lin.bias]})),
            """some parameters appear in more than one parameter group: the new group's parameter #0 of shape (3,) is in group 0 already""",  # noqa: E501
        )

    def test_sparse_gradient(self):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4, sparse=True)
        opt = mf.MuonOptimizer(emb.named_parameters())
        emb(torch.tensor([1, 2])).sum().backward()
        before = emb.weight.detach().clone()
        self.assertExpectedInline(
            self.message(RuntimeError, opt.step),
            """muon_fn does not support sparse gradients (parameter 'weight')""",
        )
        self.assertTrue(torch.equal(emb.weight, before))

    def test_sparse_gradient_unnamed(self):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4, sparse=True)
        opt = mf.MuonOptimizer(emb.parameters())
        emb(torch.tensor([1, 2])).sum().backward()
        self.assertExpectedInline(
            self.message(RuntimeError, opt.step),
            """muon_fn does not support sparse gradients (parameter #0 of shape (10, 4))""",
        )

    def test_complex_parameter(self):
        w = nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer([w])),
            """muon_fn does not support complex parameters, got #0 of shape (3, 3)""",
        )

    def test_complex_parameter_named(self):
        w = nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.MuonOptimizer([("rotation", w)])),
            """muon_fn does not support complex parameters, got 'rotation'""",
        )

    def test_one_d_parameter_reaching_muon_only_transform(self):
        lin = _linear()
        msg = self.message(
            ValueError,
            lambda: mf.Optimizer(lin.parameters(), lambda h: mf.muon(h["lr"]), {"lr": 0.02}),
        )
        self.assertExpectedInline(
            msg,
            """parameter #1 of shape (3,): orthogonalize only supports matrices (ndim >= 2) whereas we found a leaf at [1] with size: (3,). Route 0-/1-D parameters (biases, norms) to another transform with muon_fn.partition, e.g. muon_fn.hybrid(...), or use muon_fn.MuonOptimizer / muon_fn.create_hybrid_optimizer, which do this for you.""",  # noqa: E501
        )
        self.assertIn("MuonOptimizer", msg)
        self.assertIn("create_hybrid_optimizer", msg)

    def test_one_d_parameter_reaching_muon_only_transform_as_plain_tx(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(ValueError, lambda: mf.Optimizer(lin.parameters(), mf.muon())),
            """parameter #1 of shape (3,): orthogonalize only supports matrices (ndim >= 2) whereas we found a leaf at [1] with size: (3,). Route 0-/1-D parameters (biases, norms) to another transform with muon_fn.partition, e.g. muon_fn.hybrid(...), or use muon_fn.MuonOptimizer / muon_fn.create_hybrid_optimizer, which do this for you.""",  # noqa: E501
        )

    def test_nonfinite_error_message(self):
        lin = _linear()
        opt = mf.MuonOptimizer(lin.named_parameters(), nonfinite="error")
        lin.weight.grad = torch.ones(3, 4)
        lin.bias.grad = torch.tensor([0.0, float("nan"), 1.0])
        self.assertExpectedInline(
            self.message(RuntimeError, opt.step),
            """non-finite gradient (inf or nan) in 'bias'; parameters and optimizer state were left unchanged. Pass nonfinite='skip' to skip such steps, or use torch.amp.GradScaler.""",  # noqa: E501
        )


class TestStateDict(expecttest.TestCase):
    def message(self, exc_type, fn) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn()
        return str(ctx.exception)

    def test_state_shapes_from_another_model(self):
        src = _linear(0, 4, 3)
        opt = mf.MuonOptimizer(src.named_parameters())
        src(torch.randn(2, 4)).sum().backward()
        opt.step()
        dst = _linear(1, 3, 4)
        opt2 = mf.MuonOptimizer(dst.named_parameters())
        sd = _roundtrip(opt.state_dict())
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt2.load_state_dict(sd)),
            """loaded state dict contains a parameter group that doesn't match optimizer's group 0: parameter 0 is 'weight' of shape (3, 4) in the state dict but 'weight' of shape (4, 3) in this optimizer; the state_dict comes from a different model layout""",  # noqa: E501
        )

    def test_group_count_mismatch(self):
        lin = _linear()
        opt = mf.MuonOptimizer(lin.parameters())
        opt2 = mf.MuonOptimizer([{"params": [lin.weight]}, {"params": [lin.bias]}])
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt2.load_state_dict(opt.state_dict())),
            """loaded state dict has a different number of parameter groups""",
        )

    def test_state_keys_of_muon_optimizer(self):
        lin = _linear()
        opt = mf.MuonOptimizer(lin.parameters(), beta2=0.95)
        lin(torch.randn(2, 4)).sum().backward()
        opt.step()
        sd = opt.state_dict()
        self.assertExpectedInline(
            repr(
                {
                    i: {k: (tuple(v.shape), str(v.dtype)) for k, v in sorted(st.items())}
                    for i, st in sd["state"].items()
                }
            ),
            """{0: {'momentum_buffer': ((3, 4), 'torch.float32'), 'row_variance': ((3, 1), 'torch.float32')}, 1: {'exp_avg': ((3,), 'torch.float32'), 'exp_avg_sq': ((3,), 'torch.float32'), 'step': ((), 'torch.float32')}}""",  # noqa: E501
        )


def _adamw_state_dict(params):
    lin_params = list(params)
    topt = torch.optim.AdamW(lin_params)
    for p in lin_params:
        p.grad = torch.ones_like(p)
    topt.step()
    return _roundtrip(topt.state_dict())


class TestForeignStateDict(expecttest.TestCase):
    """Found by these tests (were KeyError: 'adamw_lr', a half-loaded optimizer, RuntimeError from
    .item(), and an unnamed 1-D error); fixed in 7941b33."""

    def message(self, exc_type, fn) -> str:
        with self.assertRaises(exc_type) as ctx:
            fn()
        return str(ctx.exception)

    def test_adamw_state_dict_into_muon_optimizer(self):
        lin = _linear()
        sd = _adamw_state_dict(lin.parameters())
        opt = mf.MuonOptimizer(lin.named_parameters())
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt.load_state_dict(sd)),
            """loaded param group 0 lacks this optimizer's hyperparameters ['adamw_betas', 'adamw_eps', 'adamw_lr', 'adamw_weight_decay', 'adjust_lr_fn', 'algorithm', 'beta2', 'method', 'momentum', 'momentum_dtype', 'momentum_kind', 'nesterov', 'normuon_eps', 'ns_coefficients', 'ns_dtype', 'ns_steps', 'ns_stepsize']: the state_dict comes from a different optimizer layout; it is a torch.optim.AdamW state_dict (its state holds exp_avg and exp_avg_sq), not a muon_fn optimizer's: start this optimizer afresh and load the model's weights only (one optimizer's moments are not another's state), or convert torch.optim.Muon and torch.optim.AdamW state_dicts with muon_fn.optim.from_torch_state_dict(optimizer, muon_state_dict, adamw_state_dict)""",  # noqa: E501
        )

    def test_torch_muon_state_dict_into_optimizer_with_adamw_parameters(self):
        """A torch.optim.Muon state_dict loads directly only when the parameters are its matrices;
        with AdamW parameters too the error names the converter."""
        lin = _linear()
        topt = torch.optim.Muon([lin.weight])
        lin.weight.grad = torch.ones_like(lin.weight)
        topt.step()
        sd = _roundtrip(topt.state_dict())
        opt = mf.MuonOptimizer(lin.parameters())
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt.load_state_dict(sd)),
            """this optimizer runs AdamW on 1 parameter(s) (0-/1-D, or algorithm='adamw') that a torch.optim.Muon state_dict does not cover: convert it with torch.optim.AdamW's, muon_fn.optim.from_torch_state_dict(optimizer, muon_sd, adamw_sd)""",  # noqa: E501
        )

    def test_tensor_lr_not_one_element(self):
        lin = _linear()
        self.assertExpectedInline(
            self.message(
                ValueError, lambda: mf.MuonOptimizer(lin.parameters(), lr=torch.tensor([0.1, 0.2]))
            ),
            """Tensor lr must be 1-element""",
        )

    def test_adamw_state_dict_into_hybrid(self):
        """Found by a new user: a torch.optim.AdamW checkpoint over model.parameters() (one
        group; the hybrid has two) got torch's bare group-count error."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10))
        sd = _adamw_state_dict(model.parameters())
        opt = mf.create_hybrid_optimizer(model, compile=False)
        before = (
            {k: v.clone() for k, v in opt.state_dict()["state"].items()},
            opt.param_groups[0]["lr"],
        )
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt.load_state_dict(sd)),
            """loaded state dict has a different number of parameter groups; it is a torch.optim.AdamW state_dict (its state holds exp_avg and exp_avg_sq), not a muon_fn optimizer's: start this optimizer afresh and load the model's weights only (one optimizer's moments are not another's state), or convert torch.optim.Muon and torch.optim.AdamW state_dicts with muon_fn.optim.from_torch_state_dict(optimizer, muon_state_dict, adamw_state_dict)""",  # noqa: E501
        )
        assert not before[0] and not opt.state and opt.param_groups[0]["lr"] == before[1]

    def test_sgd_state_dict_into_triton_muon(self):
        """Another class: no converter to name."""
        lin = _linear()
        topt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
        for p in lin.parameters():
            p.grad = torch.ones_like(p)
        topt.step()
        opt = mf.TritonMuon([{"params": [lin.weight]}, {"params": [lin.bias]}], compile=False)
        self.assertExpectedInline(
            self.message(ValueError, lambda: opt.load_state_dict(topt.state_dict())),
            """loaded state dict has a different number of parameter groups; it is a torch.optim.SGD state_dict (its state holds momentum_buffer, its groups dampening), not a muon_fn optimizer's: start this optimizer afresh and load the model's weights only (one optimizer's moments are not another's state)""",  # noqa: E501
        )

    def test_one_d_error_names_the_parameter(self):
        lin = _linear()
        msg = self.message(
            ValueError,
            lambda: mf.Optimizer(lin.named_parameters(), lambda h: mf.muon(h["lr"]), {"lr": 0.02}),
        )
        self.assertExpectedInline(
            msg,
            """parameter 'bias': orthogonalize only supports matrices (ndim >= 2) whereas we found a leaf at [1] with size: (3,). Route 0-/1-D parameters (biases, norms) to another transform with muon_fn.partition, e.g. muon_fn.hybrid(...), or use muon_fn.MuonOptimizer / muon_fn.create_hybrid_optimizer, which do this for you.""",  # noqa: E501
        )
        self.assertIn("'bias'", msg)


def test_failed_load_leaves_optimizer_usable():
    """After a rejected state_dict the optimizer keeps its own state and still steps."""
    src, dst = _linear(0, 4, 3), _linear(1, 3, 4)
    opt = mf.MuonOptimizer(src.parameters())
    src(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt2 = mf.MuonOptimizer(dst.parameters())
    dst.weight.grad, dst.bias.grad = torch.ones(4, 3), torch.ones(4)
    opt2.step()
    own = {k: v.clone() for k, v in opt2.state[dst.weight].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups]
    with pytest.raises(ValueError, match="different model layout"):
        opt2.load_state_dict(_roundtrip(opt.state_dict()))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups] == groups
    assert opt2.param_groups[0]["params"][0] is dst.weight
    for k, v in own.items():
        assert torch.equal(opt2.state[dst.weight][k], v), k
    opt2.step()
    assert float(opt2.state[dst.bias]["step"]) == 2.0


def test_failed_foreign_load_leaves_optimizer_usable():
    lin = _linear()
    opt = mf.MuonOptimizer(lin.parameters())
    lin.weight.grad, lin.bias.grad = torch.ones(3, 4), torch.ones(3)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[lin.bias].items()}
    with pytest.raises(ValueError):
        opt.load_state_dict(_adamw_state_dict(_linear().parameters()))
    for k, v in before.items():
        assert torch.equal(opt.state[lin.bias][k], v), k
    assert "adamw_lr" in opt.param_groups[0]
    opt.step()


# ----------------------------------------------------------------------------- each value checked once
# A value is checked where a user gives it, once: a public transform or recipe checks its
# arguments (a recipe all of its own, up front, then builds its parts unchecked); an optimizer
# class checks its groups in torch's wording and builds its recipe unchecked. The fixture counts
# the outermost call of every check that names the value it checks, by that name.
# Names checked by the Schedule and fit constructors: the library's own constants (resolution).
_LIBRARY_CONSTANTS = {"form", "precondition", "poles"}


@pytest.fixture
def checked_names(monkeypatch):
    import collections
    import functools
    import inspect
    import sys

    from muon_fn.core import checks

    counts: collections.Counter[str] = collections.Counter()
    depth = [0]

    def counting(f):
        signature = inspect.signature(f)

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                counts[bound.arguments["name"]] += 1
            depth[0] += 1
            try:
                return f(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    for attr, f in vars(checks).copy().items():
        if (
            inspect.isfunction(f)
            and f.__module__ == checks.__name__
            and "name" in inspect.signature(f).parameters
        ):
            monkeypatch.setattr(checks, attr, counting(f))
    # checks of other modules, patched where they are looked up (a module's name or an import)
    elsewhere = {
        "check_state_bits": ["muon_fn.core.quantize", "muon_fn.optimizers._elementwise"],
        "check_state_bits_value": ["muon_fn.optimizers._muon"],
        "check_view": ["muon_fn.core.views"],
        "_check_flag": ["muon_fn.core.sso"],
        "validate_coefficients": [
            "muon_fn.core.newton_schulz",
            "muon_fn.core.newton_schulz.schedules",
            "muon_fn.core.alias",
            "muon_fn.optimizers._muon",
        ],
    }
    for attr, modules in elsewhere.items():
        for module in modules:
            monkeypatch.setattr(
                sys.modules[module], attr, counting(getattr(sys.modules[module], attr))
            )
    counts.clear()
    return counts


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def _names(spaced: str) -> set[str]:
    return set(spaced.split())


_MUON = _names(
    "lr momentum nesterov kind eps ns_stepsize normuon_eps adjust_lr_fn weight_decay "
    "cautious_weight_decay layerwise_norm adamuon_eps adamuon_sign state_bits view"
)
_ADAMW = _names("lr beta1 beta2 eps weight_decay decay_1d cautious_weight_decay state_bits")
_SPHERE = _names(
    "lr momentum radius_scale power_block msign_steps msign_method scale_mode "
    "retract_mode retract_alpha tol bracket_step solver model_steps direction "
    "msign_dtype state_bits view"
)
_GROUP = _names(
    "lr momentum weight_decay adamw_weight_decay adamw_lr adamw_eps adamw_betas "
    "adamw_decay_1d algorithm state_bits"
)
_MUON_GROUP = _GROUP | _names(
    "adjust_lr_fn momentum_kind nesterov layerwise_norm adamuon_sign "
    "cautious_weight_decay eps normuon_eps adamuon_eps ns_stepsize"
)

_CONSTRUCTIONS = {
    "muon": (lambda: mf.muon(), _MUON),
    "muon, every part": (
        lambda: mf.muon(
            beta2=0.9,
            layerwise_norm=True,
            ns_steps=5,
            method="quintic",
            ns_coefficients=(3.4445, -4.775, 2.0315),
            ns_dtype=torch.float32,
            state_bits=8,
            cautious_weight_decay=True,
        ),
        _MUON | _names("beta2 ns_steps method ns_coefficients dtype"),
    ),
    "muon, AdaMuon": (
        lambda: mf.muon(adamuon_beta2=0.95, mu_dtype=torch.float32),
        _MUON | {"adamuon_beta2"},
    ),
    "adamw": (lambda: mf.adamw(), _ADAMW),
    "triton_muon": (
        lambda: mf.triton_muon(layerwise_norm=True),
        _names(
            "lr momentum velocity weight_decay eps decoupled nesterov layerwise_norm state_bits"
        ),
    ),
    "hybrid": (lambda: mf.hybrid(), _MUON | {"adamw_lr", "beta1", "beta2", "decay_1d"}),
    "sso": (
        lambda: mf.sso(),
        _SPHERE | _names("nesterov cold_start warm_lambda lambda_model muon_sphere"),
    ),
    "MuonOptimizer": (lambda: mf.MuonOptimizer(_model().parameters(), compile=False), _MUON_GROUP),
    "MuonOptimizer, NorMuon": (
        lambda: mf.MuonOptimizer(
            _model().parameters(),
            beta2=0.95,
            method="quintic",
            ns_coefficients=(3.4445, -4.775, 2.0315),
            ns_steps=5,
            ns_dtype=torch.float32,
            compile=False,
        ),
        _MUON_GROUP | {"beta2", "method", "ns_coefficients", "ns_dtype"},
    ),
    "MuonOptimizer, one group per algorithm": (
        lambda: mf.create_hybrid_optimizer(_model(), compile=False),
        _MUON_GROUP | {"muon_lr"},
    ),
    "SpectralSphereOptimizer": (
        lambda: mf.SpectralSphereOptimizer(_model().parameters(), compile=False),
        (_GROUP | _SPHERE | {"nesterov", "cold_start", "muon_sphere"}) - {"view"},
    ),
    "TritonMuonW": (
        lambda: mf.TritonMuonW(_model().parameters(), layerwise_norm=True, compile=False),
        _names("lr momentum velocity weight_decay eps nesterov layerwise_norm state_bits"),
    ),
}


@pytest.mark.parametrize("construct", list(_CONSTRUCTIONS))
def test_each_value_is_checked_once(checked_names, construct):
    build, expected = _CONSTRUCTIONS[construct]
    build()
    counts = {name: n for name, n in checked_names.items() if name not in _LIBRARY_CONSTANTS}
    assert expected - counts.keys() == set()
    once = dict.fromkeys(counts, 1)
    if construct == "hybrid":  # each half's, in its part's words: two values of each name
        once.update(eps=2, weight_decay=2)
    if construct == "MuonOptimizer, one group per algorithm":
        # two groups, each checked once; create_hybrid_optimizer checks the learning rates it takes
        # first (its messages name muon_lr and adamw_lr), then gives them to the groups
        # (beta2: create_hybrid_optimizer's NorMuon default, in both groups)
        once.update(dict.fromkeys(_MUON_GROUP | {"beta2"}, 2), adamw_lr=3)
    assert counts == once


def test_a_checked_factory_keeps_its_name_docstring_and_signature():
    import inspect

    assert mf.momentum.__name__ == "momentum" and mf.momentum.__doc__.startswith(
        "Heavy-ball momentum"
    )
    assert list(inspect.signature(mf.momentum).parameters) == [
        "momentum",
        "nesterov",
        "kind",
        "mu_dtype",
        "state_bits",
    ]
    assert inspect.signature(mf.muon) == inspect.signature(mf.muon.build)
    assert inspect.isfunction(mf.orthogonalize)
    # the builder builds what the checked factory builds, without the check
    assert repr(mf.muon.build()) == repr(mf.muon())
    assert "momentum=1.5" in repr(mf.momentum.build(1.5))


_CALLABLE_COEFFICIENTS = (
    "Invalid coefficients: a callable method runs its own iteration; pass coefficients with "
    "method=None (or a named method) instead"
)
_GRAM_BF16 = (
    "Invalid dtype for method 'gram': torch.bfloat16 (Gram Newton-Schulz loses orthogonality in bf16; use "
    "torch.float32, or torch.float16 on GPUs)"
)
_DTYPES = "torch.bfloat16, torch.float16, torch.float32, torch.float64"

# Each public part and recipe still refuses a bad value itself, in the words it always used.
_REFUSED = [
    (ValueError, lambda: mf.momentum(2.0), "Invalid momentum: 2.0 (expected 0 <= momentum < 1)"),
    (TypeError, lambda: mf.momentum(foo=1), "momentum() got an unexpected keyword argument 'foo'"),
    (ValueError, lambda: mf.orthogonalize(steps=0), "Invalid steps: 0 (expected an integer >= 1)"),
    (
        ValueError,
        lambda: mf.orthogonalize(lambda x: x, coefficients=(3.0, -4.0, 2.0)),
        _CALLABLE_COEFFICIENTS,
    ),
    (ValueError, lambda: mf.orthogonalize("gram", dtype=torch.bfloat16), _GRAM_BF16),
    (
        ValueError,
        lambda: mf.orthogonalize(steps=3, coefficients=[(1.0, float("nan"), 2.0)]),
        "Invalid coefficients: [(1.0, nan, 2.0)] (values must be finite)",
    ),
    (
        ValueError,
        lambda: mf.scale_by_shape("x"),
        "Invalid rule: 'x' (valid: 'keller', 'original', 'match_rms_adamw', 'spectral', 'legacy', 'none')",
    ),
    (ValueError, lambda: mf.align_rms(-1.0), "Invalid eps: -1.0 (expected a finite value > 0)"),
    (ValueError, lambda: mf.normalize_rows(1.5), "Invalid beta2: 1.5 (expected 0 <= beta2 < 1)"),
    (
        ValueError,
        lambda: mf.scale_by_second_moment(eps=0.0),
        "Invalid eps: 0.0 (expected a finite value > 0)",
    ),
    (
        ValueError,
        lambda: mf.scale_by_adam((0.9,)),
        "Invalid betas: (0.9,) (expected a pair (beta1, beta2))",
    ),
    (
        ValueError,
        lambda: mf.add_decoupled_weight_decay(min_ndim=-1),
        "Invalid min_ndim: -1 (expected an integer >= 0)",
    ),
    (
        ValueError,
        lambda: mf.scale_by_learning_rate(-1.0),
        "Invalid lr: -1.0 (expected a finite value >= 0)",
    ),
    (
        TypeError,
        lambda: mf.normalize_layerwise(add_eps=1),
        "Invalid add_eps: 1 (expected True or False)",
    ),
    (
        TypeError,
        lambda: mf.spectral_sphere(msign_dtype="bf16"),
        f"Invalid msign_dtype: 'bf16' (expected a torch.dtype: {_DTYPES})",
    ),
    (
        ValueError,
        lambda: mf.spectral_sphere(solver="newton"),
        "Invalid solver: 'newton' (valid: 'bisection', 'illinois')",
    ),
    # the recipes: their parts' values, checked up front in the parts' words
    (
        ValueError,
        lambda: mf.muon(momentum=2.0),
        "Invalid momentum: 2.0 (expected 0 <= momentum < 1)",
    ),
    (ValueError, lambda: mf.muon(lr=-1.0), "Invalid lr: -1.0 (expected a finite value >= 0)"),
    (
        ValueError,
        lambda: mf.muon(weight_decay=-1.0),
        "Invalid weight_decay: -1.0 (expected a finite value >= 0)",
    ),
    (ValueError, lambda: mf.muon(beta2=1.0), "Invalid beta2: 1.0 (expected 0 <= beta2 < 1)"),
    (
        ValueError,
        lambda: mf.muon(method="x"),
        "Invalid method: 'x' (valid: 'polar_express', 'quintic', 'you', 'cubic', 'aol', 'aol9', 'gram')",
    ),
    (ValueError, lambda: mf.muon(method="gram", ns_dtype=torch.bfloat16), _GRAM_BF16),
    (
        ValueError,
        lambda: mf.muon(method=lambda x: x, ns_coefficients=(3.0, -4.0, 2.0)),
        _CALLABLE_COEFFICIENTS,
    ),
    (
        ValueError,
        lambda: mf.muon(ns_coefficients="abc"),
        "Invalid ns_coefficients: 'abc' (expected an (a, b, c) triple or a sequence of (a, b, c) triples)",
    ),
    (TypeError, lambda: mf.muon(foo=1), "muon() got an unexpected keyword argument 'foo'"),
    (
        ValueError,
        lambda: mf.adamw(betas=(2.0, 0.9)),
        "Invalid beta1: 2.0 (expected 0 <= beta1 < 1)",
    ),
    (
        ValueError,
        lambda: mf.adamw(state_bits=5),
        "Invalid state_bits: 5 (expected one of 32, 16, 8, 4)",
    ),
    (
        ValueError,
        lambda: mf.hybrid(adamw_lr=-1.0),
        "Invalid adamw_lr: -1.0 (expected a finite value >= 0)",
    ),
    (
        ValueError,
        lambda: mf.hybrid(adamw_eps=-1.0),
        "Invalid eps: -1.0 (expected a finite value >= 0)",
    ),
    (TypeError, lambda: mf.hybrid(foo=1), "muon() got an unexpected keyword argument 'foo'"),
    (
        ValueError,
        lambda: mf.triton_muon(state_bits=3),
        "Invalid state_bits: 3 (expected one of 32, 16, 8, 4)",
    ),
    (
        ValueError,
        lambda: mf.sso(momentum=1.0),
        "Invalid momentum: 1.0 (expected 0 <= momentum < 1)",
    ),
    (ValueError, lambda: mf.sso(lr=-1.0), "Invalid lr: -1.0 (expected a finite value >= 0)"),
    (
        TypeError,
        lambda: mf.sso(foo=1),
        "spectral_sphere() got an unexpected keyword argument 'foo'",
    ),
    # the classes: what only their recipe's parts checked before, at the group, in the same words
    (
        ValueError,
        lambda: mf.MuonOptimizer(
            _linear().parameters(), method=lambda x: x, ns_coefficients=(3.0, -4.0, 2.0)
        ),
        _CALLABLE_COEFFICIENTS,
    ),
    (
        ValueError,
        lambda: mf.MuonOptimizer(_linear().parameters(), method="gram", ns_dtype=torch.bfloat16),
        _GRAM_BF16,
    ),
    (
        TypeError,
        lambda: mf.SpectralSphereOptimizer(_linear().parameters(), msign_dtype="bf16"),
        f"Invalid msign_dtype: 'bf16' (expected a torch.dtype: {_DTYPES})",
    ),
    (
        TypeError,
        lambda: mf.MuonOptimizer(_linear().parameters(), lr="x"),
        "Invalid learning rate: 'x' (expected a float or a 0-d tensor)",
    ),
]


@pytest.mark.parametrize("case", range(len(_REFUSED)))
def test_each_boundary_refuses_bad_values_in_its_words(case):
    exc_type, call, message = _REFUSED[case]
    with pytest.raises(exc_type) as info:
        call()
    assert str(info.value) == message


def test_an_adamw_group_still_takes_matrix_settings_it_does_not_use():
    # an "adamw" group builds no matrix recipe: as before, settings only the recipe refused pass
    mf.MuonOptimizer(
        [{"params": _linear().parameters(), "algorithm": "adamw"}],
        method="gram",
        ns_dtype=torch.bfloat16,
        compile=False,
    )
    mf.SpectralSphereOptimizer(
        [{"params": _linear().parameters(), "algorithm": "adamw"}],
        msign_dtype="bf16",
        compile=False,
    )
