"""The rows of the Muon step benchmark: what each runs, which orthogonalization it uses (for the
quality measures), which replay has the same GEMMs (for the ratio to its own replay) and, for the
elementwise rows, which torch optimizers they are compared with (``peers``). The model rows
(:data:`MODEL_ROWS`: the hybrid and torch's Muon + AdamW on the same split) run on the set's GPT
model rather than on its matrices, in the memory table only."""

from __future__ import annotations

import functools

from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

import torch

from muon_fn import orthogonalization
from muon_fn.orthogonalization import DEFAULT_METHOD
from muon_fn.optim import MuonOptimizer, TritonMuon, TritonMuonW, create_hybrid_optimizer, split_parameters
from ._problem import SETS
from ._quality import TORCH, TORCH_ORTHO, Ortho
from ._replay import AUTO, replay

Built = tuple[Any, Callable[[], None]]  # (the optimizer, or None for a replay; one step)


class Row(NamedTuple):
    """A timed row."""

    build: Callable[[Any, float], Built]  # (params with .grad set, lr); a model row: (the model, lr)
    method: str | None  # orthogonalization method (TORCH: torch's own), None for AdamW
    steps: int | None  # None: the method's default count
    dtype: torch.dtype | None  # iteration dtype; None: the device's compute dtype
    own_replay: str | None  # the replay row running the same GEMMs
    compile: bool | None  # a muon_fn row's compile option (None: not a muon_fn row)
    peers: tuple[str, ...] = ()  # rows this one is compared with (ratio_to_peers), the first in the table
    model: bool = False  # built on the set's GPT model (gradients set), not on its matrices

    def ortho(self, device: torch.device) -> Ortho | None:
        """The orthogonalization this row runs on ``device``, for the quality measures."""
        if self.method is None:
            return None
        if self.method == TORCH:
            return TORCH_ORTHO
        steps = self.steps or orthogonalization.default_steps(self.method)
        schedule = orthogonalization.coefficient_schedule(self.method, steps)
        return Ortho(self.method, steps, self.dtype or orthogonalization.default_compute_dtype(device, schedule))

    def compiled(self) -> bool | None:
        """Whether the row runs compiled here (``MUON_FN_COMPILE=0`` turns the default off); None
        for rows that are not muon_fn optimizers."""
        return None if self.compile is None else orthogonalization.compiles(self.compile)


def _muon_fn(compile: Any = True, **kwargs: Any) -> Callable[[list[torch.Tensor], float], Built]:
    def build(params: list[torch.Tensor], lr: float) -> Built:
        view = {"matrix_view": "experts"} if any(p.ndim == 3 for p in params) else {}  # expert stacks
        opt = MuonOptimizer(params, lr=lr, compile=compile, **view, **kwargs)
        return opt, opt.step
    return build


def matrices(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` with each expert stack ``(E, out, in)`` as its E matrices: views of its storage
    (so a step on them updates the stack), each with its slice of the gradient as ``.grad``; how
    a model that keeps one ``nn.Linear`` per expert presents them to a 2-D-only optimizer."""
    out = []
    for p in params:
        if p.ndim == 2:
            out.append(p)
            continue
        for w, g in zip(p.detach().unbind(0), p.grad.unbind(0)):
            w.grad = g
            out.append(w)
    return out


def _torch_muon(params: list[torch.Tensor], lr: float) -> Built:
    opt = torch.optim.Muon(matrices(params), lr=lr, weight_decay=0.0, adjust_lr_fn="original")
    return opt, opt.step


def _torch_adamw(params: list[torch.Tensor], lr: float, **impl: Any) -> Built:
    """torch.optim.AdamW at the elementwise rows' lr, fused, or (``impl={}``) torch's default
    implementation for the device (a loop over parameters on the CPU, foreach on CUDA)."""
    opt = torch.optim.AdamW(params, lr=lr * 0.05, weight_decay=0.0, **impl)
    return opt, opt.step


# The elementwise rows run at the AdamW row's learning rate (lr/20: 1e-3 at the default 0.02),
# with the same hyperparameters on both sides of each comparison (β₁ 0.9, β₂ 0.999, ε 1e-8).
def _triton(cls: type, compile: bool = True, **kwargs: Any) -> Callable[[list[torch.Tensor], float], Built]:
    def build(params: list[torch.Tensor], lr: float) -> Built:
        opt = cls(params, lr=lr * 0.05, compile=compile, **kwargs)
        return opt, opt.step
    return build


def _torch_adam(params: list[torch.Tensor], lr: float) -> Built:
    opt = torch.optim.Adam(params, lr=lr * 0.05, fused=True)
    return opt, opt.step


def _torch_adamw_decay(params: list[torch.Tensor], lr: float) -> Built:
    opt = torch.optim.AdamW(params, lr=lr * 0.05, weight_decay=0.01, fused=True)
    return opt, opt.step


def _torch_sgd(params: list[torch.Tensor], lr: float) -> Built:
    opt = torch.optim.SGD(params, lr=lr * 0.05, momentum=0.9, fused=True)
    return opt, opt.step


def _hybrid(model: torch.nn.Module, lr: float) -> Built:
    opt = create_hybrid_optimizer(model, muon_lr=lr)
    return opt, opt.step


class _MuonAdamW(NamedTuple):
    """torch.optim.Muon and torch.optim.AdamW over one split, as one row (their states together)."""

    muon: torch.optim.Optimizer
    adamw: torch.optim.Optimizer

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {**self.muon.state, **self.adamw.state}

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()


def _torch_muon_adamw(model: torch.nn.Module, lr: float) -> Built:
    """torch's pair on the split :func:`_hybrid` makes, at its defaults (weight decay 0.01 on the
    matrices, embeddings and head; none on 0-/1-D parameters; AdamW lr/20, betas (0.9, 0.95))."""
    muon, adamw = ([p for _, p, _ in half] for half in split_parameters(model))
    groups = [{"params": [p for p in adamw if p.ndim >= 2]}, {"params": [p for p in adamw if p.ndim < 2],
                                                               "weight_decay": 0.0}]
    pair = _MuonAdamW(torch.optim.Muon(muon, lr=lr, weight_decay=0.01, adjust_lr_fn="original"),
                      torch.optim.AdamW([g for g in groups if g["params"]], lr=lr * 0.05, betas=(0.9, 0.95),
                                        weight_decay=0.01, fused=True))
    return pair, pair.step


def _replay(method: str, steps: int | None, bucket_size: int | str | None = AUTO,
            dtype: torch.dtype | None = None) -> Callable[[list[torch.Tensor], float], Built]:
    def build(params: list[torch.Tensor], lr: float) -> Built:
        return None, replay(params, method, steps, bucket_size=bucket_size, dtype=dtype)
    return build


_BF16 = torch.bfloat16
_DEFAULT_REPLAY = "replay[quintic5]"  # the GEMMs of DEFAULT_METHOD's schedule, in the default dtype
_LIKE_TORCH = dict(method="quintic", ns_steps=5, momentum_kind="ema", adjust_lr_fn="original", ns_dtype=_BF16)

ROW_SPECS: dict[str, Row] = {
    # The default MuonOptimizer: compiled (inductor) on its first step.
    "muon_fn": Row(_muon_fn(), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY, True),
    "muon_fn[eager]": Row(_muon_fn(compile=False), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY, False),
    # torch.optim.Muon's math (quintic ×5 in bf16, EMA momentum, its shape rule) through muon_fn.
    "muon_fn[like_torch]": Row(_muon_fn(**_LIKE_TORCH), "quintic", 5, _BF16, "replay[torch_quintic5]", True),
    "torch.optim.Muon": Row(_torch_muon, TORCH, 5, _BF16, "replay[torch_quintic5]", None),
    "torch.optim.AdamW[fused]": Row(functools.partial(_torch_adamw, fused=True), None, None, None, None, None),
    "torch.optim.AdamW": Row(_torch_adamw, None, None, None, None, None),
    "replay[quintic5]": Row(_replay("quintic", 5), "quintic", 5, None, "replay[quintic5]", None),
    "replay[aol9]": Row(_replay("aol9", None), "aol9", None, None, "replay[aol9]", None),
    "replay[polar_express5]": Row(_replay("polar_express", 5), "polar_express", 5, None,
                                  "replay[polar_express5]", None),
    # torch.optim.Muon orthogonalizes one matrix at a time, in bf16.
    "replay[torch_quintic5]": Row(_replay("quintic", 5, None, _BF16), "quintic", 5, _BF16,
                                  "replay[torch_quintic5]", None),
    # Opt-in rows.
    "muon_fn[polar_express5]": Row(_muon_fn(method="polar_express", ns_steps=5), "polar_express", 5, None,
                                   "replay[polar_express5]", True),
    "muon_fn[aol9]": Row(_muon_fn(method="aol9"), "aol9", None, None, "replay[aol9]", True),
    "muon_fn[aol4]": Row(_muon_fn(method="aol", ns_steps=4), "aol", 4, None, "replay[aol4]", True),
    "muon_fn[nonfinite=None]": Row(_muon_fn(nonfinite=None), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY, True),
    # Telemetry: every step's figures, every 10th step's; the step written bucket by bucket.
    "muon_fn[metrics]": Row(_muon_fn(metrics=True), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY, True),
    "muon_fn[metrics=10]": Row(_muon_fn(metrics=10), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY, True),
    "muon_fn[normuon,metrics]": Row(_muon_fn(beta2=0.95, metrics=True), DEFAULT_METHOD, None, None,
                                    _DEFAULT_REPLAY, True),
    "muon_fn[atomic=False]": Row(_muon_fn(atomic=False), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY, True),
    "muon_fn[atomic=True]": Row(_muon_fn(atomic=True), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY, True),
    # Buckets of four same-shape matrices whatever their bytes (the CPU's byte bound lifted).
    "muon_fn[bucket_size=4]": Row(_muon_fn(bucket_size=4), DEFAULT_METHOD, None, None, None, True),
    # Gram Newton–Schulz in its device default dtype (fp16 on GPUs, fp32 on the CPU).
    "muon_fn[gram]": Row(_muon_fn(method="gram"), "gram", None, None, None, True),
    # The default step captured as CUDA graphs (on the CPU: inductor's reduce-overhead mode, no graphs).
    "muon_fn[cuda_graphs]": Row(_muon_fn(compile={"mode": "reduce-overhead"}), DEFAULT_METHOD, None, None,
                                _DEFAULT_REPLAY, True),
    "replay[aol4]": Row(_replay("aol", 4), "aol", 4, None, "replay[aol4]", None),
    # The training-quality candidates (docs/performance.md, "Muon variants"): the default's
    # iteration plus NorMuon's rows, cautious weight decay, AdaMuon's moment and RMS alignment.
    "muon_fn[normuon]": Row(_muon_fn(beta2=0.95), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY, True),
    "muon_fn[cautious]": Row(_muon_fn(weight_decay=0.01, cautious_weight_decay=True), DEFAULT_METHOD, None, None,
                             _DEFAULT_REPLAY, True),
    "muon_fn[wd=0.01]": Row(_muon_fn(weight_decay=0.01), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY, True),
    # AdaMuon at the authors' settings: one β (the momentum's, 0.95) for both moments, the sign.
    "muon_fn[adamuon]": Row(_muon_fn(adamuon_beta2=0.95, adjust_lr_fn="match_rms_adamw"), DEFAULT_METHOD, None,
                            None, _DEFAULT_REPLAY, True),
    # Low-bit state: the default step with its momentum stored in 16, 8 or 4 bits (state MiB and
    # the step's cost against the fp32 state's; docs/performance.md, "Low-bit state").
    **{f"muon_fn[state_bits={bits}]": Row(_muon_fn(state_bits=bits), DEFAULT_METHOD, None, None, _DEFAULT_REPLAY,
                                          True, ("muon_fn",)) for bits in (16, 8, 4)},
    **{f"muon_fn[state_bits=8,atomic={a}]": Row(_muon_fn(state_bits=8, atomic=a), DEFAULT_METHOD, None, None,
                                                _DEFAULT_REPLAY, True, (f"muon_fn[atomic={a}]",))
       for a in (True, False)},
    "TritonMuonW[state_bits=8]": Row(_triton(TritonMuonW, state_bits=8), None, None, None, None, True,
                                     ("TritonMuonW", "torch.optim.AdamW[fused,wd=0.01]")),
    # The elementwise family (it does not orthogonalize) against torch's fused Adam, AdamW and SGD.
    "TritonMuon": Row(_triton(TritonMuon), None, None, None, None, True,
                      ("torch.optim.Adam[fused]", "torch.optim.SGD[fused]")),
    "TritonMuonW": Row(_triton(TritonMuonW), None, None, None, None, True,
                       ("torch.optim.AdamW[fused,wd=0.01]", "torch.optim.SGD[fused]")),
    "TritonMuonW[eager]": Row(_triton(TritonMuonW, compile=False), None, None, None, None, False,
                              ("torch.optim.AdamW[fused,wd=0.01]", "TritonMuonW")),
    "TritonMuonW[nonfinite=None]": Row(_triton(TritonMuonW, nonfinite=None), None, None, None, None, True,
                                       ("torch.optim.AdamW[fused,wd=0.01]", "TritonMuonW")),
    "TritonMuonW[atomic=False]": Row(_triton(TritonMuonW, atomic=False), None, None, None, None, True,
                                     ("torch.optim.AdamW[fused,wd=0.01]", "TritonMuonW")),
    "TritonMuonW[atomic=True]": Row(_triton(TritonMuonW, atomic=True), None, None, None, None, True,
                                    ("torch.optim.AdamW[fused,wd=0.01]", "TritonMuonW")),
    "torch.optim.Adam[fused]": Row(_torch_adam, None, None, None, None, None),
    "torch.optim.AdamW[fused,wd=0.01]": Row(_torch_adamw_decay, None, None, None, None, None),
    "torch.optim.SGD[fused]": Row(_torch_sgd, None, None, None, None, None),
    # The model rows: create_hybrid_optimizer(model) (NorMuon on the hidden matrices, AdamW on the
    # embeddings, head and 0-/1-D parameters) and torch.optim.Muon + fused AdamW on the same split.
    "hybrid": Row(_hybrid, DEFAULT_METHOD, None, None, None, True, model=True),
    "torch.optim.Muon+AdamW[fused]": Row(_torch_muon_adamw, TORCH, 5, _BF16, None, None, model=True),
}
ROWS = ("muon_fn", "muon_fn[eager]", "muon_fn[like_torch]", "torch.optim.Muon", "torch.optim.AdamW[fused]",
        "replay[quintic5]", "replay[polar_express5]", "replay[torch_quintic5]")
MODEL_ROWS = tuple(r for r, spec in ROW_SPECS.items() if spec.model)
OPTIONAL_ROWS = tuple(r for r in ROW_SPECS if r not in ROWS and r not in MODEL_ROWS)
# `muon-fn bench --elementwise`: the elementwise family and its torch peers.
ELEMENTWISE_ROWS = ("TritonMuon", "TritonMuonW", "TritonMuonW[eager]", "TritonMuonW[nonfinite=None]",
                    "torch.optim.Adam[fused]", "torch.optim.AdamW[fused,wd=0.01]", "torch.optim.SGD[fused]")
REFERENCE = "torch.optim.Muon"
MODEL_REFERENCE = "torch.optim.Muon+AdamW[fused]"  # the model rows' reference
# `muon-fn bench --memory`: state and step peak against torch's, each pair on the same parameters;
# the default step and both of its forms (staged whole, atomic=True; written bucket by bucket).
MEMORY_ROWS = ("torch.optim.Muon", "muon_fn", "muon_fn[atomic=True]", "muon_fn[atomic=False]",
               "muon_fn[state_bits=8]", "muon_fn[state_bits=8,atomic=True]", "muon_fn[state_bits=8,atomic=False]",
               "TritonMuonW", "torch.optim.AdamW", "torch.optim.AdamW[fused]", "torch.optim.Muon+AdamW[fused]",
               "hybrid")
# Rows iterating in bf16 whatever the device: emulated (slow) on CPUs without bf16 instructions.
BF16_ROWS = tuple(r for r, spec in ROW_SPECS.items() if spec.dtype == _BF16)


def check_rows(rows: Sequence[str], *, models: bool = False) -> list[str]:
    """``rows`` as a list, or ``ValueError`` naming an unknown one (or a model row, unless
    ``models``: the timed benchmark runs every row on the same matrices)."""
    for r in rows:
        if r not in ROW_SPECS:
            raise ValueError(f"Invalid row: {r!r} (expected one of {list(ROW_SPECS)})")
        if ROW_SPECS[r].model and not models:
            raise ValueError(f"Invalid row: {r!r} (it runs on the set's GPT model, not on its matrices: the memory "
                             "table only, muon-fn bench --memory)")
    return list(rows)


def _left_out(row: str, model_size: str, device: torch.device) -> bool:
    """Whether ``row`` iterates in bf16 where bf16 GEMMs are emulated (a CPU without bf16
    instructions), except torch.optim.Muon on the tiny set: there it takes about 10 s a tiny
    step, over 15 minutes a gpt2-small step."""
    emulated = device.type == "cpu" and not orthogonalization.CPU_HAS_BF16_GEMM
    return emulated and row in BF16_ROWS and not (row == REFERENCE and model_size == "tiny")


def default_rows(model_size: str, device: torch.device) -> list[str]:
    """:data:`ROWS`, less the rows :func:`_left_out` of this set and device."""
    return [r for r in ROWS if not _left_out(r, model_size, device)]


def memory_rows(model_size: str, device: torch.device) -> list[str]:
    """:data:`MEMORY_ROWS`, less the model rows on a set that is no GPT and the rows
    :func:`_left_out` of this set and device."""
    return [r for r in MEMORY_ROWS if (SETS[model_size].kind == "gpt" or not ROW_SPECS[r].model)
            and not _left_out(r, model_size, device)]
