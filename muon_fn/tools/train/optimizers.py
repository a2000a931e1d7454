"""The optimizers ``muon-fn train`` compares, and the ``name[key=value,...]`` specs that configure them.

``muon`` is :func:`muon_fn.create_hybrid_optimizer` with its defaults (hidden matrices → NorMuon,
embeddings, the head and 1-D parameters → AdamW; ``muon[beta2=none]`` runs plain Muon on the
matrices, ``normuon`` is the same as ``muon``); ``torch-muon`` is the same split with ``torch.optim.Muon`` on the
matrices and ``torch.optim.AdamW`` on the rest; ``adamw`` is ``torch.optim.AdamW`` on everything.
A spec such as ``muon[method=quintic,ns_steps=5,lr=0.04]`` sets ``lr``/``adamw_lr`` of the run
and passes the other keys to the optimizer. In the Muon-family rows an MoE model's routers
(parameters named ``*router.weight``, hidden matrices ``(E, d)``) get Muon, as the hybrid gives
them; ``router=adamw`` in a spec moves them to the AdamW half. Expert stacks ``(E, out, in)`` get
Muon per expert (the hybrid reads them as ``matrix_view="experts"``); ``matrix_view=flatten`` in
a spec reads each stack as one matrix.

The Muon-family rows and ``torch-muon`` take the same keys for what they share, so two rows can
run with identical settings: ``weight_decay`` (Muon's decoupled decay), ``adamw_weight_decay``
(both default to ``--weight-decay``), ``adamw_beta2`` and ``adamw_decay_1d`` (``False``, the
library's default: AdamW decays only parameters of ndim ≥ 2; ``true``: every AdamW parameter, as
one torch.optim.AdamW group does). ``torch-muon[ns_dtype=fp32]`` runs torch.optim.Muon's own
iteration with its bf16 cast replaced by fp32 (:func:`torch_zeropower`), for a comparison with
muon_fn's fp32 iteration on a CPU without bf16 GEMMs; without it torch iterates in bf16 as shipped.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

OPTIMIZERS = ("muon", "torch-muon", "adamw", "normuon", "sso")

# Defaults per optimizer. Muon-family matrices use Keller's scale (lr 0.02 ≈ RMS-matched to
# AdamW at 1e-3..3e-3); embeddings, the head and 1-D params use AdamW at the AdamW lr, so the
# comparison changes only what happens to the hidden matrices. See docs/algorithms.md.
DEFAULT_LR = {"muon": 0.02, "torch-muon": 0.02, "normuon": 0.02, "sso": 0.02, "adamw": 3e-3}
DEFAULT_ADAMW_LR = 3e-3
# AdamW's betas: (0.9, 0.95) for the AdamW-only row (better than torch's (0.9, 0.999) there) and
# for the AdamW half of the Muon rows (create_hybrid_optimizer's default, better than 0.999 there).
# Measured: docs/performance.md, "Training quality".
ADAMW_BETAS = (0.9, 0.95)
HALF_BETAS = (0.9, 0.95)

# Where the Muon-family rows put an MoE router: "muon" (the default: it trained to a lower loss
# on moe-tiny on both seeds tried, docs/transformers.md) or "adamw" (spec option router=adamw).
ROUTER_HALVES = ("muon", "adamw")

_SPEC = re.compile(r"^([a-z][a-z-]*)(?:\[(.*)\])?$")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def split_specs(text: str) -> list[str]:
    """``"muon[a=1,b=2],adamw"`` → ``["muon[a=1,b=2]", "adamw"]`` (commas inside brackets kept)."""
    specs, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            specs.append(current.strip())
            current = ""
        else:
            current += ch
    specs.append(current.strip())
    return [s for s in specs if s]


def _value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if low in _DTYPES:
        return _DTYPES[low]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``(optimizer, options)`` of a spec; ``ValueError`` naming the spec if it is malformed."""
    m = _SPEC.match(spec.strip())
    if not m or m.group(1) not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {spec!r}; valid: {', '.join(OPTIMIZERS)} "
                         "(optionally with [key=value,...] options)")
    options: dict[str, Any] = {}
    for item in (m.group(2) or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"invalid option {item!r} in {spec!r} (expected key=value)")
        options[key.strip()] = _value(value)
    return m.group(1), options


def torch_zeropower(dtype: torch.dtype):
    """``torch.optim._muon._zeropower_via_newtonschulz`` with its bf16 cast replaced by ``dtype``:
    the same code line for line (run in bf16 it is bit-identical to torch's)."""

    def zeropower(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        ortho_grad = grad.to(dtype, copy=True)  # torch's .bfloat16() copies; keep that
        if grad.size(0) > grad.size(1):
            ortho_grad = ortho_grad.T
        ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
        for _ in range(ns_steps):
            gram_matrix = ortho_grad @ ortho_grad.T
            gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
            ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
        if grad.size(0) > grad.size(1):
            ortho_grad = ortho_grad.T
        return ortho_grad

    return zeropower


@contextmanager
def torch_iteration(dtype: torch.dtype | None):
    """torch.optim.Muon iterates in ``dtype`` inside the block (``None``: as shipped, bf16)."""
    if dtype is None:
        yield
        return
    import torch.optim._muon as torch_muon

    shipped = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = torch_zeropower(dtype)
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = shipped


class TorchMuonHybrid:
    """``torch.optim.Muon`` on the hidden matrices and ``torch.optim.AdamW`` on the rest, stepped
    together (the ``torch-muon`` row); ``optimizers`` is what the LR schedulers wrap.
    ``ns_dtype``: the dtype of torch.optim.Muon's iteration (``None``: bf16, as shipped)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer,
                 ns_dtype: torch.dtype | None = None) -> None:
        self.optimizers = [muon, adamw]
        self.ns_dtype = ns_dtype

    def step(self) -> None:
        with torch_iteration(self.ns_dtype):
            for opt in self.optimizers:
                opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.optimizers[0].state_dict(), "adamw": self.optimizers[1].state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizers[0].load_state_dict(state_dict["muon"])
        self.optimizers[1].load_state_dict(state_dict["adamw"])


def _adamw_groups(params: list[nn.Parameter], weight_decay: float, decay_1d: bool = False) -> list[dict]:
    """torch.optim.AdamW groups: ``weight_decay`` on parameters of ndim ≥ 2 (all with ``decay_1d``),
    none on the rest; empty groups left out."""
    if decay_1d:
        return [{"params": list(params), "weight_decay": weight_decay}]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]]


def is_router(name: str, p: torch.Tensor) -> bool:
    """An MoE router weight (the demo GPT's ``blocks.N.mlp.router.weight``)."""
    return name == "router.weight" or name.endswith(".router.weight")


def _router_split(options: dict[str, Any]) -> dict[str, Any]:
    """Pops ``router`` from a spec's options: the keywords that put the routers in that half."""
    half = options.pop("router", "muon")
    if half not in ROUTER_HALVES:
        raise ValueError(f"invalid option router={half!r} (valid: {', '.join(ROUTER_HALVES)})")
    return {"adamw_predicate": is_router} if half == "adamw" else {}


def _betas(name: str, options: dict[str, Any]) -> tuple[float, float]:
    """AdamW's betas of a row: ``beta2=`` (adamw row) or ``adamw_beta2=`` (Muon rows) popped."""
    default = ADAMW_BETAS if name == "adamw" else HALF_BETAS
    return default[0], options.pop("beta2" if name == "adamw" else "adamw_beta2", default[1])


def _decays(options: dict[str, Any], wd: float) -> tuple[float, float, bool]:
    """``(weight_decay, adamw_weight_decay, adamw_decay_1d)`` of a Muon-family or torch-muon row,
    popped from its options (the decays default to ``--weight-decay``)."""
    decay_1d = options.pop("adamw_decay_1d", False)
    if not isinstance(decay_1d, bool):
        raise ValueError(f"invalid option adamw_decay_1d={decay_1d!r} (expected true or false)")
    return options.pop("weight_decay", wd), options.pop("adamw_weight_decay", wd), decay_1d


def _decay_text(muon_wd: float, adamw_wd: float, decay_1d: bool) -> str:
    return f"weight_decay={muon_wd}, adamw_weight_decay={adamw_wd}" + (" on every parameter" if decay_1d else
                                                                         " on ndim >= 2")


def build_single(name: str, options: dict[str, Any], model: nn.Module, lr: float, adamw_lr: float, wd: float,
                 compile: bool, metrics: int = 0) -> tuple[Any, str]:
    """One single-device optimizer and a one-line description of it. ``metrics``: the muon_fn
    rows' ``metrics=`` (0: off; a spec's own ``metrics=`` wins); the torch.optim rows have none."""
    import muon_fn as mf

    options = dict(options)
    betas = _betas(name, options)
    if name == "adamw":
        opt = torch.optim.AdamW(_adamw_groups(list(model.parameters()), wd), lr=lr, betas=betas, **options)
        return opt, f"torch.optim.AdamW(lr={lr}, betas={betas}, weight_decay={wd} on matrices)"
    split = _router_split(options)
    muon_wd, adamw_wd, decay_1d = _decays(options, wd)
    decays = _decay_text(muon_wd, adamw_wd, decay_1d)
    if name == "torch-muon":
        ns_dtype = options.pop("ns_dtype", None)
        muon_params, adamw_params = mf.split_parameters(model, **split)
        muon = torch.optim.Muon([p for _, p, _ in muon_params], lr=lr, weight_decay=muon_wd,
                                adjust_lr_fn="original", **options)
        adamw = torch.optim.AdamW(_adamw_groups([p for _, p, _ in adamw_params], adamw_wd, decay_1d), lr=adamw_lr,
                                  betas=betas)
        iteration = "bf16" if ns_dtype is None else str(ns_dtype).removeprefix("torch.")
        return TorchMuonHybrid(muon, adamw, ns_dtype), (
            f"torch.optim.Muon(lr={lr}, iteration in {iteration}) + torch.optim.AdamW(lr={adamw_lr}, "
            f"betas={betas}); {decays}")
    compile_opt = {} if compile else {"compile": False}
    if metrics and "metrics" not in options:
        compile_opt["metrics"] = metrics
    if name in ("muon", "normuon"):  # one recipe: the hybrid's default (NorMuon) unless beta2= is given
        opt = mf.create_hybrid_optimizer(model, muon_lr=lr, adamw_lr=adamw_lr, adamw_weight_decay=adamw_wd,
                                         muon_weight_decay=muon_wd, adamw_betas=betas, adamw_decay_1d=decay_1d,
                                         **split, **options, **compile_opt)
        shown = "".join(f", {k}={v}" for k, v in options.items())
        return opt, (f"muon_fn.create_hybrid_optimizer(muon_lr={lr}, adamw_lr={adamw_lr}, adamw_betas={betas}"
                     f"{shown}): {opt.split.algorithm}; {decays}")
    opt = mf.SpectralSphereOptimizer.from_model(model, lr=lr, adamw_lr=adamw_lr, adamw_weight_decay=adamw_wd,
                                                adamw_betas=betas, adamw_decay_1d=decay_1d, **split, **options,
                                                **compile_opt)
    return opt, f"muon_fn.SpectralSphereOptimizer.from_model(lr={lr}, adamw_lr={adamw_lr}); {decays}"


def build_fsdp(name: str, options: dict[str, Any], model: nn.Module, lr: float, adamw_lr: float, wd: float,
               world: int, compile: bool = True, metrics: int = 0) -> tuple[Any, str]:
    """The FSDP2 optimizer of one run, configured as :func:`build_single`'s (the same split,
    routers included, and the same AdamW betas): hidden matrices → Muon or SSO; embeddings, the
    head and 1-D params → AdamW, on local shards."""
    import muon_fn as mf

    if name in ("adamw", "torch-muon"):
        raise ValueError(f"--fsdp supports the muon_fn optimizers, not {name!r}")
    options = dict(options, **({} if compile else {"compile": False}))
    if metrics and "metrics" not in options:
        options["metrics"] = metrics
    betas = _betas(name, options)
    muon_wd, adamw_wd = options.pop("weight_decay", wd), options.pop("adamw_weight_decay", wd)  # a spec's own
    muon_params, adamw_params = mf.split_parameters(model, **_router_split(options))
    groups = [{"params": [p for _, p, _ in muon_params], "use_muon": True},
              {"params": [p for _, p, _ in adamw_params], "use_muon": False}]
    if name == "sso":
        opt = mf.FSDPSpectralSphereOptimizer(model, groups, lr=lr, adamw_lr=adamw_lr, adamw_betas=betas,
                                             adamw_weight_decay=adamw_wd, weight_decay=muon_wd, **options)
        return opt, f"muon_fn.FSDPSpectralSphereOptimizer(lr={lr}, adamw_lr={adamw_lr}, world={world})"
    from muon_fn.fsdp import FSDPMuonOptimizer

    from muon_fn.optim import NORMUON_BETA2

    # muon and normuon: the hybrid's default, NorMuon, unless the spec asks for AdaMuon (as the hybrid)
    beta2 = options.pop("beta2", None if options.get("adamuon_beta2") is not None else NORMUON_BETA2)
    opt = FSDPMuonOptimizer(model, groups, lr=lr, weight_decay=muon_wd, beta2=beta2, adamw_lr=adamw_lr,
                            adamw_betas=betas, adamw_weight_decay=adamw_wd, **options)
    return opt, f"muon_fn.fsdp.FSDPMuonOptimizer(lr={lr}, adamw_lr={adamw_lr}, world={world})"
