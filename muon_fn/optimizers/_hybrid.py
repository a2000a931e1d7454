"""``create_hybrid_optimizer``: one optimizer with Muon for hidden matrices and AdamW for the rest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..core import checks as _checks, defaults as _defaults
from ..core.views import Heads, count, matrix_shape, unit_shapes
from ..engine import Optimizer
from ._muon import MuonOptimizer
from ..engine.views import check_spec, fits, given, module_views, refuse_unmatched


def _head_names(model: nn.Module, embedding_params: set[int]) -> set[str]:
    """Output heads: Linear weights tied to an embedding, else the last Linear whose
    ``out_features`` is an embedding's vocabulary size (one head, as in a language model)."""
    vocab_sizes = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    tied, vocab_producers = set(), []
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        name = f"{mod_name}.weight" if mod_name else "weight"
        if id(mod.weight) in embedding_params:
            tied.add(name)
        elif mod.out_features in vocab_sizes:
            vocab_producers.append(name)
    return tied or set(vocab_producers[-1:])


def split_parameters(
    model: nn.Module,
    *,
    adamw_names: Sequence[str] = (),
    adamw_predicate: Callable[[str, nn.Parameter], bool] | None = None,
    muon_names: Sequence[str] = (),
) -> tuple[list[tuple[str, nn.Parameter, str]], list[tuple[str, nn.Parameter, str]]]:
    """Sort ``model``'s parameters into (muon, adamw) lists of ``(name, param, reason)``.

    AdamW gets: ``nn.Embedding`` weights, the output head (a Linear tied to an embedding, else the
    last Linear whose ``out_features`` equals an embedding's vocabulary size), parameters named in
    ``adamw_names`` or accepted by ``adamw_predicate``, and every 0-/1-D parameter. Muon gets the
    other ≥ 2-D parameters (hidden Linear and conv weights, expert stacks) and any ≥ 2-D parameter
    named in ``muon_names`` (which overrides the head rule). Tied parameters appear once. A Muon
    parameter of ndim ≥ 3 is a conv weight (flattened) if a conv module owns it, else a stack
    of matrices (``matrix_view="experts"``, see :func:`create_hybrid_optimizer`). Frozen
    parameters (``requires_grad=False``) are sorted like the others, as torch.optim keeps them:
    a step skips them while they have no gradient, and they train once unfrozen.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = _head_names(model, embedding_params)
    forced, to_muon = set(adamw_names), set(muon_names)
    all_names = {name for name, _ in model.named_parameters()}
    for arg, names in (("adamw_names", forced), ("muon_names", to_muon)):
        unknown = names - all_names
        if unknown:
            raise ValueError(f"{arg} {sorted(unknown)} are not parameters of the model")
    both = forced & to_muon
    if both:
        raise ValueError(f"parameters {sorted(both)} are in both adamw_names and muon_names")
    params = dict(model.named_parameters())
    flat = sorted(n for n in to_muon if params[n].ndim < 2)
    if flat:
        raise ValueError(f"muon_names {flat} are 0-/1-D; Muon needs matrices")
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in embedding_params}
    by_module = module_views(model)
    muon_params, adamw_params = [], []
    for name, p in model.named_parameters():
        if name in to_muon:
            muon_params.append((name, p, "muon_names"))
            continue
        if id(p) in embedding_params:
            reason = "embedding, tied to the output head" if id(p) in tied else "embedding"
        elif name in heads:
            reason = "output head"
        elif name in forced:
            reason = "adamw_names"
        elif adamw_predicate is not None and adamw_predicate(name, p):
            reason = "adamw_predicate"
        elif p.ndim < 2:
            reason = f"{p.ndim}-D"
        else:
            muon_params.append((name, p, matrix_reason(p, by_module.get(id(p), "flatten"), by_module)))
            continue
        adamw_params.append((name, p, reason))
    return muon_params, adamw_params


def matrix_reason(p: torch.Tensor, view: str | Heads, by_module: dict[int, str]) -> str:
    """Why (and as what) a parameter of ndim ≥ 2 gets Muon, for :class:`HybridSplit`."""
    if isinstance(view, Heads):
        shapes = unit_shapes(p.shape, view)
        listed = "x".join(map(str, shapes[0])) if len(set(shapes)) == 1 else ", ".join(
            f"{m}x{n}" for m, n in dict.fromkeys(shapes))
        return f"{view!r}: {len(shapes)} blocks {listed}"
    if p.ndim == 2:
        return "hidden matrix"
    out, inp = matrix_shape(p.shape, view)
    if view == "experts":
        return f"expert stack: {count(p.shape, view)} matrices {out}x{inp}"
    what = "conv weight" if by_module.get(id(p)) == "flatten" else f"{p.ndim}-D weight"
    return f"{what}, flattened to {out}x{inp}"


class HybridSplit:
    """Which parameter went where and the weight decay each gets, printable
    (``print(optimizer.split)``). ``muon_weight_decay``, ``adamw_weight_decay`` and
    ``adamw_decay_1d`` are those of :func:`create_hybrid_optimizer` (``None``: not shown);
    ``algorithm`` names the matrix half's recipe (``"Muon"``, ``"NorMuon"``, ``"AdaMuon"``,
    ``"AdaMuon (no sign)"``): read
    from ``optimizer``'s Muon group when given, so it follows a loaded checkpoint's rule (and a
    copy's), else the name passed. ``cautious`` says that both halves' decay is cautious.
    ``frozen``: the names of the parameters that were frozen (``requires_grad=False``) when it
    was made, marked ``frozen`` in the print (a step skips them until they get gradients)."""

    frozen: frozenset[str] = frozenset()  # (a copy pickled before it existed has none)

    def __init__(self, muon_params, adamw_params, *, muon_weight_decay: float | None = None,
                 adamw_weight_decay: float | None = None, adamw_decay_1d: bool = False,
                 algorithm: str = "Muon", cautious: bool = False, optimizer: Optimizer | None = None) -> None:
        self.muon = [(n, tuple(p.shape), r) for n, p, r in muon_params]
        self.adamw = [(n, tuple(p.shape), r) for n, p, r in adamw_params]
        self.frozen = frozenset(n for n, p, _ in (*muon_params, *adamw_params) if not p.requires_grad)
        self.muon_weight_decay, self.adamw_weight_decay = muon_weight_decay, adamw_weight_decay
        self.adamw_decay_1d = adamw_decay_1d
        self._algorithm, self.cautious, self.optimizer = algorithm, cautious, optimizer

    @property
    def algorithm(self) -> str:
        return self._algorithm if self.optimizer is None else _recipe(self.optimizer)

    def adamw_decays(self, shape: tuple[int, ...]) -> bool:
        """Whether an AdamW parameter of this shape gets ``adamw_weight_decay``."""
        return bool(self.adamw_weight_decay) and (self.adamw_decay_1d or len(shape) >= 2)

    def __str__(self) -> str:
        def count(rows):
            return sum(int(torch.Size(s).numel()) for _, s, _ in rows)

        def rows(entries, note=lambda s: ""):
            return [f"  {n:<40} {s!s:<20} {r}{note(s)}{', frozen' if n in self.frozen else ''}"
                    for n, s, r in entries]

        muon_wd, adamw_wd = self.muon_weight_decay, self.adamw_weight_decay
        decay = "cautious weight decay" if self.cautious else "weight decay"
        muon_head = f"{self.algorithm}: {len(self.muon)} tensors, {count(self.muon):,} parameters"
        adamw_head = f"AdamW: {len(self.adamw)} tensors, {count(self.adamw):,} parameters"
        if muon_wd is not None:
            muon_head += f"; {decay} {muon_wd:g}" if muon_wd else "; no weight decay"
        spared = [s for _, s, _ in self.adamw if not self.adamw_decays(s)]
        if adamw_wd is not None:
            if not adamw_wd:
                adamw_head += "; no weight decay"
            elif not spared:
                adamw_head += f"; {decay} {adamw_wd:g}"
            else:
                adamw_head += (f"; {decay} {adamw_wd:g} on ndim >= 2, none on 0-/1-D "
                               "(adamw_decay_1d=True decays every tensor)")
        return "\n".join([muon_head, *rows(self.muon), adamw_head,
                          *rows(self.adamw, lambda s: ", no weight decay" if adamw_wd and not self.adamw_decays(s)
                                else "")])

    __repr__ = __str__


def _recipe(optimizer: Optimizer) -> str:
    """The name of the rule the Muon group runs: ``"AdaMuon"``, ``"AdaMuon (no sign)"``
    (``adamuon_sign=False``), ``"NorMuon"`` or ``"Muon"``."""
    group: dict[str, Any] = next(
        (g for g in optimizer.param_groups if g.get("algorithm") in ("muon", "auto")), {})
    if group.get("adamuon_beta2") is not None:
        return "AdaMuon" if group.get("adamuon_sign", True) else "AdaMuon (no sign)"
    return "NorMuon" if group.get("beta2") is not None else "Muon"


def _matrix_views(model: nn.Module, muon_params: list, user_view: Any,
                  adamw_params: list = ()) -> tuple[dict[str, Any], list]:
    """The matrix view of each Muon parameter that needs one (ndim ≥ 3, or a head view): the
    user's, else its module's; and the Muon parameters with the split's reason for each."""
    refuse_unmatched(user_view, [n for n, _, _ in muon_params], "Muon parameter of the model",
                     {n: f"AdamW ({r})" for n, _, r in adamw_params})
    by_module = module_views(model)
    chosen = {name: given(user_view, name, p) or by_module.get(id(p), "flatten") for name, p, _ in muon_params}
    chosen = {name: view for (name, p, _), view in zip(muon_params, chosen.values())
              if p.ndim >= 3 or isinstance(view, Heads)}
    for name, p, _ in muon_params:
        if isinstance(chosen.get(name), Heads):
            fits(chosen[name], p, repr(name))
    return chosen, [(n, p, r if n not in chosen or r == "muon_names" else matrix_reason(p, chosen[n], by_module))
                    for n, p, r in muon_params]


# Keywords of torch optimizers that the hybrid spells per half (passed on, they would collide
# with or be overridden by each group's own value): what to pass instead.
_PER_HALF = {
    "lr": "muon_lr= for the Muon half (default 0.02) and adamw_lr= for the AdamW half (default 1e-3)",
    "weight_decay": "muon_weight_decay= and adamw_weight_decay= (default 0.01 each)",
}


def refuse_torch_style(owner: str, model: Any, kwargs: dict[str, Any]) -> None:
    """``TypeError`` for the calls a torch.optim user tries first: parameters instead of the
    model, and a keyword the hybrid spells per half (``lr``, ``weight_decay``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{owner}() takes the model (an nn.Module), to split its parameters by role (embeddings, "
            f"output head, hidden matrices), got {type(model).__name__}; for an iterable of parameters use "
            "muon_fn.MuonOptimizer(params) (Muon for ndim >= 2, AdamW for the rest)")
    for key, use in _PER_HALF.items():
        if key in kwargs:
            raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}: use {use}")


# The hybrid's matrix half runs NorMuon (arXiv:2510.05491) with this β₂: it trained to a lower
# loss than torch.optim.Muon at its best lr on every seed of both sizes measured, at most 1.10x
# the step (docs/performance.md, "Variants against torch.optim.Muon").
NORMUON_BETA2 = 0.95
"""The hybrid's default ``beta2``: NorMuon's neuron-wise second moment (``beta2=None``: plain Muon)."""


def create_hybrid_optimizer(
    model: nn.Module,
    muon_lr: float = _defaults.LR,
    adamw_lr: float = _defaults.ADAMW_LR,
    adamw_weight_decay: float = _defaults.ADAMW_WEIGHT_DECAY,
    *,
    muon_weight_decay: float = _defaults.WEIGHT_DECAY,
    momentum: float = _defaults.MOMENTUM,
    adamw_betas: tuple[float, float] = _defaults.ADAMW_BETAS,
    adamw_eps: float = _defaults.ADAMW_EPS,
    adamw_decay_1d: bool = False,
    cautious_weight_decay: bool = False,
    adamw_names: Sequence[str] = (),
    adamw_predicate: Callable[[str, nn.Parameter], bool] | None = None,
    muon_names: Sequence[str] = (),
    verbose: bool = False,
    optimizer_cls: type[Optimizer] = MuonOptimizer,
    **muon_kwargs: Any,
) -> Optimizer:
    """One :class:`MuonOptimizer` with two groups: ``algorithm="muon"`` and ``algorithm="adamw"``.

    Hidden 2-D (and conv) weights get NorMuon with ``muon_lr`` (Muon, then rows normalized by
    their second moment: ``beta2=0.95``; it beat torch.optim.Muon + AdamW on every seed measured,
    docs/performance.md "Variants against torch.optim.Muon"). ``beta2=None`` is plain Muon (equal
    to torch.optim.Muon + AdamW), ``adamuon_beta2=`` AdaMuon (the authors' β: ``adamuon_beta2=0.95``,
    the momentum; ``adamuon_sign=False`` without the sign); a checkpoint loads with the rule it
    ran with (an older one: Muon). Embeddings, the
    output head and 0-/1-D parameters get AdamW with ``adamw_lr``, ``adamw_betas`` and
    ``adamw_eps`` (see :func:`split_parameters` for the rules and overrides).
    ``adamw_weight_decay`` decays the AdamW parameters of ndim ≥ 2 (embeddings, the head); biases
    and norm gains get no weight decay unless ``adamw_decay_1d=True`` (nanoGPT's and the Hugging
    Face Trainer's rule). ``cautious_weight_decay=True`` makes both groups' decay cautious
    (arXiv:2510.12402: only where the update and the weight agree in sign; see
    :class:`MuonOptimizer`). The defaults ``muon_weight_decay=0.01`` and ``adamw_betas=(0.9,
    0.95)`` (torch.optim.Muon + AdamW's usual configuration) beat weight decay 0 and β₂ = 0.999 on
    every seed measured. One ``state_dict``; schedulers scale each group's ``lr``. The split,
    with the recipe and each tensor's decay, is ``optimizer.split`` (printed when ``verbose``).
    ``optimizer_cls`` (default :class:`MuonOptimizer`; :class:`muon_fn.SpectralSphereOptimizer`
    gets no ``beta2``) gets the groups and the other keyword arguments.

    Each Muon parameter of ndim ≥ 3 gets a matrix view by its module: a conv weight
    (``nn.Conv1d/2d/3d``) is one flattened matrix, any other is a stack of matrices (MoE experts
    ``(E, out, in)``: E matrices, each orthogonalized and scaled by its own shape). A
    ``matrix_view`` keyword (a view, a mapping ``{name or glob pattern: view}``, or a function
    ``param -> view``; see :class:`MuonOptimizer`) overrides that for the parameters it names,
    and gives head views (:func:`muon_fn.heads`) to the parameters it names. The Muon group's
    ``matrix_view`` holds the result, one entry per parameter of ndim ≥ 3 or with a head view.
    A ``matrix_view`` key that names no Muon parameter of the model is refused, naming it.

    It takes the model, not its parameters: ``create_hybrid_optimizer(model.parameters())``
    raises a ``TypeError`` pointing to :class:`MuonOptimizer`, and ``lr=``/``weight_decay=`` one
    pointing to the per-half keywords. Frozen parameters (``requires_grad=False``) are kept, as
    torch.optim keeps them, in the half their shape and module give them (marked ``frozen`` in
    ``optimizer.split``): a step skips a parameter without a gradient, and it trains once
    unfrozen, its first update that of fresh state. ``optimizer.split``'s first line names the
    matrix half's recipe (``Muon``, ``NorMuon``, ``AdaMuon``), for example::

        NorMuon: 1 tensors, 32 parameters; weight decay 0.01
          hidden.weight                            (8, 4)               hidden matrix
        AdamW: 5 tensors, 144 parameters; weight decay 0.1 on ndim >= 2, none on 0-/1-D (adamw_decay_1d=True decays every tensor)
          emb.weight                               (10, 4)              embedding
          hidden.bias                              (8,)                 1-D, no weight decay
          out.weight                               (10, 8)              output head

    Example: ``examples/mixed_adamw.py``.
    """  # noqa: E501  (the split's output, verbatim)
    refuse_torch_style("create_hybrid_optimizer", model, muon_kwargs)
    _checks.learning_rate(muon_lr, "muon_lr")
    _checks.learning_rate(adamw_lr, "adamw_lr")
    user_view = muon_kwargs.pop("matrix_view", None)
    check_spec(user_view)
    muon_params, adamw_params = split_parameters(
        model, adamw_names=adamw_names, adamw_predicate=adamw_predicate, muon_names=muon_names
    )
    chosen, muon_params = _matrix_views(model, muon_params, user_view, adamw_params)
    groups = []
    if muon_params:
        groups.append({"params": [p for _, p, _ in muon_params],
                       "param_names": [n for n, _, _ in muon_params],
                       "lr": muon_lr, "weight_decay": muon_weight_decay, "algorithm": "muon",
                       "matrix_view": chosen or None})
    if adamw_params:
        groups.append({"params": [p for _, p, _ in adamw_params],
                       "param_names": [n for n, _, _ in adamw_params],
                       "lr": adamw_lr, "weight_decay": adamw_weight_decay, "algorithm": "adamw"})
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if cautious_weight_decay:  # only then: optimizer classes without the key keep working
        muon_kwargs["cautious_weight_decay"] = True
    if issubclass(optimizer_cls, MuonOptimizer) and muon_kwargs.get("adamuon_beta2") is None:
        muon_kwargs.setdefault("beta2", NORMUON_BETA2)  # NorMuon unless beta2=None or AdaMuon
    muon_kwargs.setdefault("model", model)  # on DTensors, accumulation pauses its gradient sync
    optimizer = optimizer_cls(groups, lr=muon_lr, momentum=momentum, adamw_betas=adamw_betas,
                              adamw_eps=adamw_eps, adamw_decay_1d=adamw_decay_1d, **muon_kwargs)
    optimizer.split = HybridSplit(muon_params, adamw_params, muon_weight_decay=muon_weight_decay,
                                  adamw_weight_decay=adamw_weight_decay, adamw_decay_1d=adamw_decay_1d,
                                  cautious=cautious_weight_decay, optimizer=optimizer)
    if verbose:
        print(optimizer.split)
    return optimizer
