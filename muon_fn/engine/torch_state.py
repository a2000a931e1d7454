"""The checkpoint format of ``torch.optim.Muon`` (+ ``torch.optim.AdamW`` for the rest): recognise
it, and convert between it and a :class:`~muon_fn.MuonOptimizer`'s state_dict, both ways.

The functions here take the optimizer as given: :class:`~muon_fn.MuonOptimizer` imports them to
load a torch checkpoint directly, and :mod:`muon_fn.optimizers._torch_compat` checks the optimizer in
the public :func:`~muon_fn.optim.from_torch_state_dict` and :func:`~muon_fn.optim.to_torch_state_dict`.

Which parameter is which. A torch user keeps two optimizers: ``torch.optim.Muon`` over the 2-D
matrices and ``torch.optim.AdamW`` over everything else, each numbering its parameters from 0.
A MuonOptimizer routes every parameter itself: all of an ``algorithm="muon"`` group, none of an
``"adamw"`` group, the ndim ≥ 2 ones of an ``"auto"`` group. The torch Muon's parameters are this
optimizer's Muon-routed parameters in order, group by group, and the AdamW's are the rest, in
order; when both sides carry ``param_names`` they are matched by name instead.

Hyperparameters travel with the state, as ``load_state_dict`` restores them: a torch checkpoint
sets torch's algorithm (``ns_coefficients``, ``eps``, ``ns_steps``, ``adjust_lr_fn``, EMA momentum,
no NorMuon); keys torch does not save (``ns_dtype``, ``momentum_dtype``, ``compile``, ...) keep
this optimizer's values. torch.optim.Muon iterates in bf16: pass ``ns_dtype=torch.bfloat16`` to
run its numerics too.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ..core import quantize as _quantize
from ..core.newton_schulz import DEFAULT_METHOD, KELLER_COEFFICIENTS, TORCH_NS_STEPS, validate_coefficients
from ..core.views import Heads
from . import layout as _layout

TORCH_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                   "adjust_lr_fn")
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
_MUON_STATE = ("momentum_buffer",)
_ADAMW_STATE = ("step", "exp_avg", "exp_avg_sq")
# Settings of a muon_fn group that make its Muon torch.optim.Muon's algorithm (set on load).
_TORCH_ALGORITHM = {"method": None, "momentum_kind": "ema", "beta2": None, "ns_stepsize": 1.0,
                    "layerwise_norm": False, "adamuon_beta2": None, "cautious_weight_decay": False}


class _Route(NamedTuple):
    group: int  # index of this optimizer's param group
    index: int  # the parameter's id in this optimizer's state_dict
    name: str | None
    shape: tuple[int, ...]


class _Entry(NamedTuple):
    pid: Any  # the parameter's id in the torch state_dict
    group: dict[str, Any]  # its torch param group
    name: str | None


# What muon_fn.optim.from_torch_checkpoint writes for a group key that a torch.optim.Muon group
# lacks: "not saved". A string, so that any unpickler (weights_only included) reads it.
UNSET = "<muon_fn: not in the torch.optim.Muon checkpoint>"
# Keys a torch.optim.Muon checkpoint sets on load besides its own (torch's algorithm, the AdamW
# scale's base) or that record no choice (the accumulation window, the layout, a scheduler's).
_SET_ON_LOAD = frozenset({*_TORCH_ALGORITHM, "base_lr", "initial_lr", "micro_step", _layout.KEY, _layout.STATELESS})


def drop_unset(state_dict: Any) -> tuple[Any, list[tuple[int, str]]]:
    """``state_dict`` without the group keys set to :data:`UNSET`, and those (group, key) pairs."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list):
        return state_dict, []
    dropped = [(i, k) for i, g in enumerate(groups) if isinstance(g, dict) for k, v in g.items()
               if isinstance(v, str) and v == UNSET]
    if not dropped:
        return state_dict, []
    kept = [{k: v for k, v in g.items() if not (isinstance(v, str) and v == UNSET)} if isinstance(g, dict) else g
            for g in groups]
    return {**state_dict, "param_groups": kept}, dropped


def kept_values(dropped: list[tuple[int, str]], groups: list[dict[str, Any]]) -> list[str]:
    """``"group i: key=value, ..."`` per group, of the dropped keys that a converted torch
    checkpoint leaves at the loading optimizer's values (``groups``: the converted state_dict's)."""
    kept: dict[int, list[str]] = {}
    for i, k in dropped:
        if k not in _SET_ON_LOAD and k in groups[i]:
            kept.setdefault(i, []).append(f"{k}={groups[i][k]!r}")
    return [f"group {i}: {', '.join(pairs)}" for i, pairs in kept.items()]


def is_torch_muon_state_dict(state_dict: Any) -> bool:
    """Whether ``state_dict`` looks like ``torch.optim.Muon``'s (its keys, no muon_fn ``algorithm``)."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    return bool(groups) and isinstance(groups, list) and all(
        isinstance(g, dict) and set(TORCH_MUON_KEYS) <= set(g) and "algorithm" not in g for g in groups)


# Group keys that every muon_fn optimizer's state_dict holds (and no torch optimizer's).
_OWN_GROUP_KEYS = ("gradient_accumulation_steps", "micro_step", _layout.KEY, "algorithm")


def foreign_optimizer(state_dict: dict[str, Any]) -> str | None:
    """What optimizer wrote ``state_dict`` if not muon_fn (no param group holds muon_fn's group
    keys), told by its state's and groups' keys, for a refused load's message; None if muon_fn."""
    groups = [g for g in state_dict["param_groups"] if isinstance(g, dict)]
    if any(k in g for g in groups for k in _OWN_GROUP_KEYS):
        return None
    entries = [e for e in state_dict["state"].values() if isinstance(e, dict) and e]
    moments = all({"exp_avg", "exp_avg_sq"} <= set(e) for e in entries)
    if (entries and moments) or (not entries and groups and all("betas" in g for g in groups)):
        coupled = any(g.get("decoupled_weight_decay") is False for g in groups)
        return f"a torch.optim.{'Adam' if coupled else 'AdamW'} state_dict (its state holds exp_avg and exp_avg_sq)"
    if groups and all(set(TORCH_MUON_KEYS) <= set(g) for g in groups):
        return "a torch.optim.Muon state_dict"
    if entries and all(set(e) == {"momentum_buffer"} for e in entries) and all("dampening" in g for g in groups):
        return "a torch.optim.SGD state_dict (its state holds momentum_buffer, its groups dampening)"
    keys = sorted({k for g in groups for k in g if k not in ("params", "param_names")})
    return f"another optimizer's state_dict (its param groups hold {keys}, none of muon_fn's keys)"


def foreign_hint(state_dict: dict[str, Any], optimizer: Any) -> str:
    """For a refused load into ``optimizer``: what wrote ``state_dict`` if another optimizer did,
    and what to do instead ("" for a muon_fn state_dict)."""
    what = foreign_optimizer(state_dict)
    if what is None:
        return ""
    hint = (f"; it is {what}, not a muon_fn optimizer's: start this optimizer afresh and load the model's "
            "weights only (one optimizer's moments are not another's state)")
    if getattr(optimizer, "_converts_torch_state", False):  # a MuonOptimizer
        hint += (", or convert torch.optim.Muon and torch.optim.AdamW state_dicts with "
                 "muon_fn.optim.from_torch_state_dict(optimizer, muon_state_dict, adamw_state_dict)")
    return hint


def upgrade_eps_keys(state_dict: Any) -> Any:
    """Older muon_fn checkpoints stored NorMuon's epsilon as ``eps`` and the Newton–Schulz one as
    ``ns_eps``: rename them to ``normuon_eps`` and ``eps`` (anything else passes through)."""
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or not any(isinstance(g, dict) and "ns_eps" in g for g in groups):
        return state_dict
    upgraded = []
    for g in groups:
        g = dict(g)
        if "ns_eps" in g:
            g["normuon_eps"] = g.get("eps", 1e-8)
            g["eps"] = g.pop("ns_eps")
        upgraded.append(g)
    return {**state_dict, "param_groups": upgraded}


def _routes(optimizer: Any) -> tuple[list[_Route], list[_Route]]:
    """(Muon-routed, AdamW-routed) parameters of ``optimizer`` (a MuonOptimizer), in state_dict order."""
    muon, adamw, index = [], [], 0
    for g, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        for j, p in enumerate(group["params"]):
            route = _Route(g, index, names[j] if names else None, tuple(p.shape))
            to_muon = group["algorithm"] == "muon" or (group["algorithm"] == "auto" and p.ndim >= 2)
            (muon if to_muon else adamw).append(route)
            index += 1
    return muon, adamw


def _entries(state_dict: dict[str, Any]) -> list[_Entry]:
    out = []
    for group in state_dict["param_groups"]:
        names = group.get("param_names")
        out += [_Entry(pid, group, names[j] if names else None) for j, pid in enumerate(group["params"])]
    return out


def _match(routes: list[_Route], entries: list[_Entry], source: str, role: str) -> list[tuple[_Route, _Entry]]:
    """Pair this optimizer's ``role`` parameters with the torch state_dict's, by name where both
    sides have names, else by position."""
    if len(routes) != len(entries):
        raise ValueError(
            f"the {source} state_dict has {len(entries)} parameters, but this optimizer has {len(routes)} "
            f"{role} parameters (its {role} parameters, in order, are the {source}'s)")
    if all(r.name for r in routes) and all(e.name for e in entries):
        by_name = {e.name: e for e in entries}
        missing = sorted(r.name for r in routes if r.name not in by_name)
        if missing:
            raise ValueError(f"the {source} state_dict has no parameters named {missing}")
        return [(r, by_name[r.name]) for r in routes]
    return list(zip(routes, entries))


def _check_torch_state_dict(state_dict: Any, source: str, keys: tuple[str, ...]) -> None:
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError(f"expected a {source} state_dict (with 'state' and 'param_groups'), "
                         f"got {type(state_dict).__name__}")
    for i, group in enumerate(groups):
        missing = [k for k in keys if k not in group]
        if missing or "algorithm" in group:
            raise ValueError(f"not a {source} state_dict: its param group {i} "
                             + (f"lacks {missing}" if missing else "is a muon_fn group"))
    if source == "torch.optim.AdamW":
        for i, group in enumerate(groups):
            for key in ("amsgrad", "maximize"):
                if group.get(key):
                    raise ValueError(f"the torch.optim.AdamW state_dict's param group {i} has {key}=True, which "
                                     "muon_fn's AdamW does not offer")
            if group.get("decoupled_weight_decay") is False and group["weight_decay"] != 0:
                raise ValueError(f"param group {i} is torch.optim.Adam's coupled (L2) weight decay; muon_fn's "
                                 "AdamW decays decoupled (torch.optim.AdamW)")


def _source_group(pairs: list[tuple[_Route, _Entry]], g: int, source: str) -> dict[str, Any] | None:
    """The torch param group that the parameters of this optimizer's group ``g`` come from."""
    groups = {id(e.group): e.group for r, e in pairs if r.group == g}
    if len(groups) > 1:
        raise ValueError(f"the parameters of param group {g} come from {len(groups)} {source} param groups; "
                         "build this optimizer with one param group per torch group")
    return next(iter(groups.values()), None)


def _adamw_source(pairs: list[tuple[_Route, _Entry]], g: int) -> tuple[dict[str, Any] | None, bool]:
    """The torch.optim.AdamW group of this optimizer's group ``g`` and the ``adamw_decay_1d``
    that reproduces it: ``True`` for one group (torch decays every parameter of a group);
    ``False`` for the pair :func:`to_torch_state_dict` writes when 0-/1-D parameters get no decay
    (a decaying group of ndim ≥ 2 parameters and an otherwise equal one with weight_decay 0)."""
    mine = [(r, e) for r, e in pairs if r.group == g]
    groups = {id(e.group): e.group for _, e in mine}
    if len(groups) == 2:
        decaying = [grp for grp in groups.values() if grp["weight_decay"]]
        flat = [grp for grp in groups.values() if not grp["weight_decay"]]
        same = len(decaying) == len(flat) == 1 and all(
            decaying[0][k] == flat[0][k] for k in _ADAMW_KEYS + ("initial_lr",)
            if k != "weight_decay" and (k in decaying[0] or k in flat[0]))
        if same and all((len(r.shape) >= 2) == (e.group is decaying[0]) for r, e in mine):
            return decaying[0], False
    return _source_group(pairs, g, "torch.optim.AdamW"), True


# ----------------------------------------------------------------------------- torch -> muon_fn
def from_torch(optimizer: Any, muon_state_dict: dict[str, Any],
               adamw_state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`muon_fn.optim.from_torch_state_dict` for ``optimizer``, a MuonOptimizer (not checked)."""
    _check_torch_state_dict(muon_state_dict, "torch.optim.Muon", TORCH_MUON_KEYS)
    muon_routes, adamw_routes = _routes(optimizer)
    muon = _match(muon_routes, _entries(muon_state_dict), "torch.optim.Muon", "Muon")
    adamw: list[tuple[_Route, _Entry]] = []
    if adamw_routes and adamw_state_dict is None:
        raise ValueError(
            f"this optimizer runs AdamW on {len(adamw_routes)} parameter(s) (0-/1-D, or algorithm='adamw') that "
            "a torch.optim.Muon state_dict does not cover: convert it with torch.optim.AdamW's, "
            "muon_fn.optim.from_torch_state_dict(optimizer, muon_sd, adamw_sd)")
    if adamw_state_dict is not None:
        _check_torch_state_dict(adamw_state_dict, "torch.optim.AdamW", _ADAMW_KEYS)
        adamw = _match(adamw_routes, _entries(adamw_state_dict), "torch.optim.AdamW", "AdamW")
    ours = optimizer.state_dict()
    groups = [dict(g) for g in ours["param_groups"]]
    for g, group in enumerate(groups):
        muon_src = _source_group(muon, g, "torch.optim.Muon")
        adamw_src, decay_1d = _adamw_source(adamw, g)
        if muon_src is not None:
            _take_muon_hyper(group, muon_src)
        if adamw_src is not None:
            _take_adamw_hyper(g, group, adamw_src, muon_src is not None)
            if adamw_src["weight_decay"]:
                group["adamw_decay_1d"] = decay_1d
    state: dict[int, dict[str, Any]] = {}
    for pairs, source, keys in ((muon, muon_state_dict, _MUON_STATE), (adamw, adamw_state_dict, _ADAMW_STATE)):
        for route, entry in pairs:
            saved = source["state"].get(entry.pid, {})
            taken = {k: saved[k] for k in keys if k in saved}
            if taken:
                state[route.index] = taken
    return {"state": state, "param_groups": groups}


def _take_muon_hyper(group: dict[str, Any], src: dict[str, Any]) -> None:
    group.update({k: src[k] for k in TORCH_MUON_KEYS})
    group.update(_TORCH_ALGORITHM)
    if "initial_lr" in src:
        group["initial_lr"] = src["initial_lr"]
    group["base_lr"] = float(src.get("initial_lr", src["lr"]))


def _take_adamw_hyper(g: int, group: dict[str, Any], src: dict[str, Any], has_muon: bool) -> None:
    betas, eps = tuple(float(b) for b in src["betas"]), src["eps"]
    group["cautious_weight_decay"] = False  # torch.optim.AdamW decays every coordinate
    if group["algorithm"] == "adamw":
        group.update(lr=src["lr"], weight_decay=src["weight_decay"], adamw_betas=betas, adamw_eps=eps)
        if "initial_lr" in src:
            group["initial_lr"] = src["initial_lr"]
        return
    # "auto": AdamW runs at adamw_lr·lr/base_lr, one scale for both halves.
    group.update(adamw_betas=betas, adamw_eps=eps, adamw_weight_decay=src["weight_decay"])
    if not has_muon:
        group["base_lr"] = float(group["lr"])
    group["adamw_lr"] = float(src.get("initial_lr", src["lr"])) if has_muon else float(src["lr"])
    effective = group["adamw_lr"] * float(group["lr"]) / group["base_lr"] if group["base_lr"] else group["adamw_lr"]
    if not math.isclose(effective, float(src["lr"]), rel_tol=1e-6, abs_tol=1e-12):
        raise ValueError(
            f"param group {g} (algorithm='auto') runs AdamW at adamw_lr*lr/base_lr = {effective:g}, but "
            f"torch.optim.AdamW's lr is {float(src['lr']):g}: its schedule did not follow Muon's; use separate "
            "'muon' and 'adamw' groups (muon_fn.create_hybrid_optimizer)")


# ----------------------------------------------------------------------------- muon_fn -> torch
def to_torch(optimizer: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """:func:`muon_fn.optim.to_torch_state_dict` of ``optimizer``, a MuonOptimizer (not checked)."""
    muon_routes, adamw_routes = _routes(optimizer)
    for r in muon_routes:
        if len(r.shape) != 2:
            raise ValueError(f"parameter {repr(r.name) if r.name else '#' + str(r.index)} has shape {r.shape}: "
                             "torch.optim.Muon takes 2-D parameters only")
    ours = optimizer.state_dict()
    muon_sd = _torch_side(ours, muon_routes, _MUON_STATE, _torch_muon_group)
    adamw_sd = _torch_side(ours, adamw_routes, _ADAMW_STATE, _torch_adamw_group) if adamw_routes else None
    return muon_sd, adamw_sd


def _torch_side(ours: dict[str, Any], routes: list[_Route], keys: tuple[str, ...], make_group) -> dict[str, Any]:
    state, groups, first = {}, [], 0
    for g in sorted({r.group for r in routes}):
        for members, group in make_group(g, ours["param_groups"][g], [r for r in routes if r.group == g]):
            group["params"] = list(range(first, first + len(members)))
            first += len(members)
            if all(r.name for r in members):
                group["param_names"] = [r.name for r in members]
            groups.append(group)
            for new, r in zip(group["params"], members):
                saved = _quantize.dequantized(ours["state"].get(r.index, {}), r.shape)  # state_bits < 32: fp32
                if any(k in saved for k in keys):
                    state[new] = {k: saved[k] for k in keys if k in saved}
    return {"state": state, "param_groups": groups}


def _torch_muon_group(g: int, group: dict[str, Any], members: list[_Route]) -> list[tuple[list[_Route], dict]]:
    return [(members, torch_muon_hyper(g, group))]


def torch_muon_hyper(g: int, group: dict[str, Any]) -> dict[str, Any]:
    problems, rows = [], KELLER_COEFFICIENTS
    if group["ns_coefficients"] is not None:
        rows = validate_coefficients(group["ns_coefficients"])
        if len(set(rows)) > 1:
            problems.append("ns_coefficients has several triples (torch.optim.Muon repeats one)")
    default = group["method"] is None and group["ns_coefficients"] is None
    if (DEFAULT_METHOD if default else group["method"]) not in (None, "quintic"):
        method = f"None (the default, {DEFAULT_METHOD!r})" if default else repr(group["method"])
        problems.append(f"method={method} (torch.optim.Muon runs one quintic: pass "
                        "ns_coefficients=(a, b, c) or method='quintic')")
    for key, want in _TORCH_ALGORITHM.items():
        if key != "method" and group[key] != want:
            problems.append(f"{key}={group[key]!r} (torch.optim.Muon's is {want!r})")
    views = group.get("matrix_view")
    if isinstance(views, dict) and any(isinstance(v, Heads) for v in views.values()):
        problems.append("matrix_view has head views (torch.optim.Muon orthogonalizes whole matrices)")
    if group["adjust_lr_fn"] not in (None, "original", "keller", "match_rms_adamw"):
        problems.append(f"adjust_lr_fn={group['adjust_lr_fn']!r} (torch.optim.Muon knows None, 'original' "
                        "and 'match_rms_adamw')")
    if problems:
        raise ValueError(f"param group {g} cannot be written as torch.optim.Muon: " + "; ".join(problems))
    out = {k: group[k] for k in ("lr", "weight_decay", "momentum", "nesterov", "eps")}
    out.update(ns_coefficients=tuple(rows[0]), ns_steps=group["ns_steps"] or TORCH_NS_STEPS,
               adjust_lr_fn="original" if group["adjust_lr_fn"] == "keller" else group["adjust_lr_fn"])
    if "initial_lr" in group:
        out["initial_lr"] = group["initial_lr"]
    return out


def _torch_adamw_group(g: int, group: dict[str, Any], members: list[_Route]) -> list[tuple[list[_Route], dict]]:
    """One torch.optim.AdamW group, or two where only the ndim ≥ 2 parameters decay."""
    out = _torch_adamw_hyper(g, group)
    if group.get("adamw_decay_1d", True) or not out["weight_decay"]:
        return [(members, out)]
    decaying = [r for r in members if len(r.shape) >= 2]
    flat = [r for r in members if len(r.shape) < 2]
    return [(rs, {**out, "weight_decay": wd}) for rs, wd in ((decaying, out["weight_decay"]), (flat, 0.0)) if rs]


def _torch_adamw_hyper(g: int, group: dict[str, Any]) -> dict[str, Any]:
    if group.get("cautious_weight_decay"):
        raise ValueError(f"param group {g} cannot be written as torch.optim.AdamW: cautious_weight_decay=True "
                         "(torch.optim.AdamW decays every coordinate)")
    out = dict(torch.optim.AdamW([torch.zeros(1)]).defaults)  # every key torch's step reads
    out.update(betas=tuple(group["adamw_betas"]), eps=group["adamw_eps"])
    if group["algorithm"] == "adamw":
        out.update(lr=group["lr"], weight_decay=group["weight_decay"])
        if "initial_lr" in group:
            out["initial_lr"] = group["initial_lr"]
        return out
    base = float(group.get("base_lr") or 0.0)
    scale = ((lambda lr: float(group["adamw_lr"]) * float(lr) / base) if base > 0
             else (lambda lr: float(group["adamw_lr"])))
    out.update(lr=scale(group["lr"]), weight_decay=group["adamw_weight_decay"])
    if "initial_lr" in group:
        out["initial_lr"] = scale(group["initial_lr"])
    return out
