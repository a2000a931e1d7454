"""Snapshots of things that must not drift silently: reprs, state structures, error messages.

Update with ``EXPECTTEST_ACCEPT=1 pytest tests/test_expect.py`` and review the diff. Every message
here was checked by hand to name the argument and its value (and to list the valid choices).
"""

from __future__ import annotations

from typing import ClassVar

import expecttest
import optree
import torch

import muon_fn as mf


def shapes_and_dtypes(tree):
    return optree.tree_map(
        lambda t: None if t is None else f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}",
        tree,
        none_is_leaf=True,
        namespace="muon_fn",
    )


class TestRepr(expecttest.TestCase):
    def test_chain_repr(self):
        tx = mf.chain(
            mf.momentum(0.95, nesterov=True),
            mf.orthogonalize(steps=5),
            mf.scale_by_shape("keller"),
            mf.add_decoupled_weight_decay(0.01),
            mf.scale_by_learning_rate(0.02),
        )
        self.assertExpectedInline(
            repr(tx),
            """\
chain(
  momentum(momentum=0.95, nesterov=True, kind='sgd'),
  orthogonalize(method='quintic', steps=5, dtype=None, eps=1e-07, stepsize=1.0, view='flatten'),
  scale_by_shape(rule='keller', view='flatten'),
  add_decoupled_weight_decay(weight_decay=0.01),
  scale_by_learning_rate(lr=0.02),
)""",
        )

    def test_nested_and_partition_repr(self):
        tx = mf.hybrid(0.02, adamw_lr=3e-4, method="quintic", ns_dtype=torch.bfloat16, kind="ema")
        self.assertExpectedInline(
            repr(tx),
            """\
partition({
  'muon': chain(
    momentum(momentum=0.95, nesterov=True, kind='ema'),
    orthogonalize(method='quintic', steps=5, dtype=torch.bfloat16, eps=1e-07, stepsize=1.0, view='flatten'),
    scale_by_shape(rule='keller', view='flatten'),
    add_decoupled_weight_decay(weight_decay=0.01),
    scale_by_learning_rate(lr=0.02),
  ),
  'adamw': chain(
    scale_by_adam(betas=(0.9, 0.95), eps=1e-08),
    add_decoupled_weight_decay(weight_decay=0.01, min_ndim=2),
    scale_by_learning_rate(lr=0.0003),
  ),
}, labels=matrix_labels)""",
        )

    def test_empty_chain_repr(self):
        self.assertExpectedInline(repr(mf.chain()), """chain()""")


class TestHybridSplit(expecttest.TestCase):
    """The printed split names each tensor's half, why, and the weight decay it gets."""

    @staticmethod
    def model():
        torch.manual_seed(0)
        model = torch.nn.Sequential()
        model.add_module("emb", torch.nn.Embedding(10, 4))
        model.add_module("hidden", torch.nn.Linear(4, 8))
        model.add_module("norm", torch.nn.LayerNorm(8))
        model.add_module("out", torch.nn.Linear(8, 10, bias=False))
        return model

    def test_no_decay_on_1d_by_default(self):
        opt = mf.create_hybrid_optimizer(
            self.model(), adamw_weight_decay=0.1, muon_weight_decay=0.01
        )
        self.assertExpectedInline(
            str(opt.split),
            """\
NorMuon: 1 tensors, 32 parameters; weight decay 0.01
  hidden.weight                            (8, 4)               hidden matrix
AdamW: 5 tensors, 144 parameters; weight decay 0.1 on ndim >= 2, none on 0-/1-D (adamw_decay_1d=True decays every tensor)
  emb.weight                               (10, 4)              embedding
  hidden.bias                              (8,)                 1-D, no weight decay
  norm.weight                              (8,)                 1-D, no weight decay
  norm.bias                                (8,)                 1-D, no weight decay
  out.weight                               (10, 8)              output head""",  # noqa: E501
        )

    def test_decay_on_every_parameter(self):
        opt = mf.create_hybrid_optimizer(self.model(), adamw_weight_decay=0.1, adamw_decay_1d=True)
        self.assertExpectedInline(
            str(opt.split),
            """\
NorMuon: 1 tensors, 32 parameters; weight decay 0.01
  hidden.weight                            (8, 4)               hidden matrix
AdamW: 5 tensors, 144 parameters; weight decay 0.1
  emb.weight                               (10, 4)              embedding
  hidden.bias                              (8,)                 1-D
  norm.weight                              (8,)                 1-D
  norm.bias                                (8,)                 1-D
  out.weight                               (10, 8)              output head""",
        )


class TestDescribe(expecttest.TestCase):
    """describe() shows each hyperparameter as given (a float32 0-d tensor 0.95 as 0.95)."""

    def test_muon_optimizer(self):
        opt = mf.MuonOptimizer(
            TestHybridSplit.model().parameters(), lr=0.03, momentum=0.9, weight_decay=0.1
        )
        self.assertExpectedInline(
            opt.describe(),
            """\
group 0: 6 params in 4 buckets, partition({
  'muon': chain(
    momentum(momentum=0.9, nesterov=True, kind='ema'),
    orthogonalize(method='quintic', steps=5, dtype=None, eps=1e-07, stepsize=1.0, view='flatten'),
    scale_by_shape(rule='original', view='flatten'),
    add_decoupled_weight_decay(weight_decay=0.1),
    scale_by_learning_rate(lr=0.03),
  ),
  'adamw': chain(
    scale_by_adam(betas=(0.9, 0.95), eps=1e-08),
    add_decoupled_weight_decay(weight_decay=0.01, min_ndim=2),
    scale_by_learning_rate(lr=0.001),
  ),
}, labels=matrix_labels)""",
        )

    def test_hybrid(self):
        opt = mf.create_hybrid_optimizer(TestHybridSplit.model(), muon_lr=0.02, adamw_lr=3e-4)
        self.assertExpectedInline(
            opt.describe(),
            """\
group 0: 1 params in 1 buckets, chain(
  momentum(momentum=0.95, nesterov=True, kind='ema'),
  orthogonalize(method='quintic', steps=5, dtype=None, eps=1e-07, stepsize=1.0, view='flatten'),
  normalize_rows(beta2=0.95, eps=1e-08, view='flatten'),
  scale_by_shape(rule='original', view='flatten'),
  add_decoupled_weight_decay(weight_decay=0.01),
  scale_by_learning_rate(lr=0.02),
)
group 1: 5 params in 3 buckets, chain(
  scale_by_adam(betas=(0.9, 0.95), eps=1e-08),
  add_decoupled_weight_decay(weight_decay=0.01, min_ndim=2),
  scale_by_learning_rate(lr=0.0003),
)""",
        )


class TestStateStructure(expecttest.TestCase):
    params: ClassVar[dict[str, torch.Tensor]] = {
        "w_in": torch.zeros(8, 4),
        "w_out": torch.zeros(4, 8),
        "conv": torch.zeros(4, 2, 3, 3),
    }

    def test_muon_state_structure(self):
        state = mf.muon().init(self.params)
        self.assertExpectedInline(
            str(optree.tree_structure(state, none_is_leaf=True, namespace="muon_fn")),
            """PyTreeSpec((MomentumState(mu={'conv': *, 'w_in': *, 'w_out': *}), EmptyState(), EmptyState(), EmptyState(), EmptyState()), NoneIsLeaf)""",  # noqa: E501
        )
        self.assertExpectedInline(
            str(shapes_and_dtypes(state)),
            """(MomentumState(mu={'w_in': '(8, 4) float32', 'w_out': '(4, 8) float32', 'conv': '(4, 2, 3, 3) float32'}), EmptyState(), EmptyState(), EmptyState(), EmptyState())""",  # noqa: E501
        )

    def test_muon_state_after_update_is_the_same(self):
        tx = mf.muon(mu_dtype=torch.float32)
        params = {k: v.bfloat16() for k, v in self.params.items()}
        state = tx.init(params)
        _, state = tx.update(params, state, params)
        self.assertExpectedInline(
            str(shapes_and_dtypes(state)),
            """(MomentumState(mu={'w_in': '(8, 4) float32', 'w_out': '(4, 8) float32', 'conv': '(4, 2, 3, 3) float32'}), EmptyState(), EmptyState(), EmptyState(), EmptyState())""",  # noqa: E501
        )

    def test_hybrid_and_normuon_state(self):
        params = {"w": torch.zeros(8, 4), "b": torch.zeros(8), "missing": None}
        self.assertExpectedInline(
            str(shapes_and_dtypes(mf.hybrid().init(params))),
            """PartitionState(inner_states={'muon': (MomentumState(mu={'w': '(8, 4) float32', 'b': None, 'missing': None}), EmptyState(), EmptyState(), EmptyState(), EmptyState()), 'adamw': (ScaleByAdamState(count={'w': None, 'b': '() float32', 'missing': None}, mu={'w': None, 'b': '(8,) float32', 'missing': None}, nu={'w': None, 'b': '(8,) float32', 'missing': None}), EmptyState(), EmptyState())})""",  # noqa: E501
        )
        self.assertExpectedInline(
            str(shapes_and_dtypes(mf.normuon().init({"w": params["w"]}))),
            """(MomentumState(mu={'w': '(8, 4) float32'}), EmptyState(), NormalizeRowsState(nu={'w': '(8, 1) float32'}), EmptyState(), EmptyState(), EmptyState())""",  # noqa: E501
        )
        sched = mf.scale_by_learning_rate(lambda c: 0.1).init(params)
        self.assertExpectedInline(
            str(shapes_and_dtypes(sched)), """ScaleByScheduleState(count='() int64')"""
        )


class TestValidationMessages(expecttest.TestCase):
    def msg(self, fn, *args, **kwargs):
        with self.assertRaises(ValueError) as cm:
            fn(*args, **kwargs)
        return str(cm.exception)

    def test_momentum(self):
        self.assertExpectedInline(
            self.msg(mf.momentum, 1.0), """Invalid momentum: 1.0 (expected 0 <= momentum < 1)"""
        )
        self.assertExpectedInline(
            self.msg(mf.momentum, -0.1), """Invalid momentum: -0.1 (expected 0 <= momentum < 1)"""
        )
        self.assertExpectedInline(
            self.msg(mf.momentum, torch.tensor(1.5)),
            """Invalid momentum: 1.5 (expected 0 <= momentum < 1)""",
        )
        self.assertExpectedInline(
            self.msg(mf.momentum, 0.9, kind="adam"),
            """Invalid kind: 'adam' (valid: 'sgd', 'ema')""",
        )
        self.assertExpectedInline(
            self.msg(mf.muon, momentum=1.0),
            """Invalid momentum: 1.0 (expected 0 <= momentum < 1)""",
        )

    def test_orthogonalize_steps_eps_stepsize(self):
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, steps=0), """Invalid steps: 0 (expected an integer >= 1)"""
        )
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, steps=2.0),
            """Invalid steps: 2.0 (expected an integer >= 1)""",
        )
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, eps=0.0),
            """Invalid eps: 0.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, eps=-1e-7),
            """Invalid eps: -1e-07 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, stepsize=0.0),
            """Invalid stepsize: 0.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, stepsize=-1.0),
            """Invalid stepsize: -1.0 (expected a finite value > 0)""",
        )

    def test_unknown_method_lists_valid_ones(self):
        # The valid list may grow (other methods can be added); check the prefix and each name.
        for fn, kw in [(mf.orthogonalize, {"method": "newton"}), (mf.muon, {"method": "newton"})]:
            m = self.msg(fn, **kw)
            self.assertTrue(m.startswith("Invalid method: 'newton' (valid: "), m)
            for name in ("polar_express", "quintic", "you", "cubic"):
                self.assertIn(repr(name), m)

    def test_unknown_rule_lists_valid_ones(self):
        self.assertExpectedInline(
            self.msg(mf.scale_by_shape, "kelller"),
            """Invalid rule: 'kelller' (valid: 'keller', 'original', 'match_rms_adamw', 'spectral', 'legacy', 'none')""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.msg(mf.shape_scale, "nope", (4, 4)),
            """Invalid rule: 'nope' (valid: 'keller', 'original', 'match_rms_adamw', 'spectral', 'legacy', 'none')""",
        )

    def test_malformed_schedules(self):
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, coefficients=[]),
            """Invalid coefficients: [] (expected an (a, b, c) triple or a sequence of (a, b, c) triples)""",
        )
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, coefficients=[(3.4, -4.7)]),
            """Invalid coefficients: [(3.4, -4.7)] (expected an (a, b, c) triple or a sequence of (a, b, c) triples)""",
        )
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, coefficients=[(3.4, -4.7, float("nan"))]),
            """Invalid coefficients: [(3.4, -4.7, nan)] (values must be finite)""",
        )
        self.assertExpectedInline(
            self.msg(mf.orthogonalize, coefficients=3.4),
            """Invalid coefficients: 3.4 (expected an (a, b, c) triple or a sequence of (a, b, c) triples)""",
        )

    def test_other_factories(self):
        self.assertExpectedInline(
            self.msg(mf.scale_by_learning_rate, -0.1),
            """Invalid lr: -0.1 (expected a finite value >= 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.scale_by_learning_rate, float("inf")),
            """Invalid lr: inf (expected a finite value >= 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.scale_by_learning_rate, torch.tensor([0.1, 0.2])),
            """Tensor lr must be 1-element, got shape (2,)""",
        )
        self.assertExpectedInline(
            self.msg(mf.add_decoupled_weight_decay, -0.01),
            """Invalid weight_decay: -0.01 (expected a finite value >= 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.scale_by_adam, (0.9, 1.0)),
            """Invalid beta2: 1.0 (expected 0 <= beta2 < 1)""",
        )
        self.assertExpectedInline(
            self.msg(mf.scale_by_adam, (0.9,)),
            """Invalid betas: (0.9,) (expected a pair (beta1, beta2))""",
        )
        self.assertExpectedInline(
            self.msg(mf.scale_by_adam, eps=-1.0),
            """Invalid eps: -1.0 (expected a finite value >= 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.normalize_rows, 1.0), """Invalid beta2: 1.0 (expected 0 <= beta2 < 1)"""
        )
        self.assertExpectedInline(
            self.msg(mf.normalize_rows, 0.95, 0.0),
            """Invalid eps: 0.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.heads, rows=[0, 4]),
            """Invalid rows: [0, 4] (expected a number of blocks >= 1 or positive block sizes)""",
        )
        self.assertExpectedInline(
            self.msg(mf.hybrid, adamw_lr=-1.0),
            """Invalid adamw_lr: -1.0 (expected a finite value >= 0)""",
        )

    def test_orthogonalize_on_0d_and_1d_leaves(self):
        tx = mf.orthogonalize()
        self.assertExpectedInline(
            self.msg(tx.update, {"b": torch.zeros(5)}, ()),
            """orthogonalize only supports matrices (ndim >= 2) whereas we found a leaf at ['b'] with size: (5,). Route 0-/1-D parameters (biases, norms) to another transform with muon_fn.partition, e.g. muon_fn.hybrid(...), or use muon_fn.MuonOptimizer / muon_fn.create_hybrid_optimizer, which do this for you.""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.msg(tx.update, {"s": torch.tensor(1.0)}, ()),
            """orthogonalize only supports matrices (ndim >= 2) whereas we found a leaf at ['s'] with size: (). Route 0-/1-D parameters (biases, norms) to another transform with muon_fn.partition, e.g. muon_fn.hybrid(...), or use muon_fn.MuonOptimizer / muon_fn.create_hybrid_optimizer, which do this for you.""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.msg(mf.scale_by_shape().update, [torch.zeros(3)], ()),
            """scale_by_shape only supports matrices (ndim >= 2) whereas we found a leaf with size: (3,). Route 0-/1-D parameters (biases, norms) to another transform with muon_fn.partition, e.g. muon_fn.hybrid(...), or use muon_fn.MuonOptimizer / muon_fn.create_hybrid_optimizer, which do this for you.""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.msg(mf.normalize_rows().init, [torch.zeros(3)]),
            """normalize_rows expects matrices (ndim >= 2), got a leaf of shape (3,)""",
        )
        # ... unless partition routes the vector elsewhere:
        params = {"w": torch.randn(4, 4), "b": torch.zeros(5)}
        tx = mf.hybrid()
        updates, _ = tx.update(params, tx.init(params), params)
        self.assertEqual(updates["b"].shape, (5,))

    def test_recipe_messages_name_the_recipe_argument(self):
        # Regression: at 235b064 these named the inner transform's arguments (steps, rule, eps).
        self.assertExpectedInline(
            self.msg(mf.muon, ns_steps=0), """Invalid ns_steps: 0 (expected an integer >= 1)"""
        )
        self.assertExpectedInline(
            self.msg(mf.muon, adjust_lr_fn="x"),
            """Invalid adjust_lr_fn: 'x' (valid: None, 'keller', 'original', 'match_rms_adamw', 'spectral', 'legacy', 'none')""",  # noqa: E501
        )
        self.assertExpectedInline(
            self.msg(mf.muon, eps=0.0), """Invalid eps: 0.0 (expected a finite value > 0)"""
        )
        self.assertExpectedInline(
            self.msg(mf.muon, beta2=0.9, normuon_eps=-1.0),
            """Invalid normuon_eps: -1.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.muon, ns_stepsize=-1.0),
            """Invalid ns_stepsize: -1.0 (expected a finite value > 0)""",
        )
        self.assertExpectedInline(
            self.msg(mf.normuon, beta2=1.0), """Invalid beta2: 1.0 (expected 0 <= beta2 < 1)"""
        )

    def test_recipe_coefficients_message_names_ns_coefficients(self):
        self.assertExpectedInline(
            self.msg(mf.muon, ns_coefficients=[()]),
            """Invalid ns_coefficients: [()] (expected an (a, b, c) triple or a sequence of (a, b, c) triples)""",
        )
