"""Argument validation used by every factory. Messages name the argument and its value."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, Protocol, TypeVar, cast

import torch

P = ParamSpec("P")
R = TypeVar("R")


# ----------------------------------------------------------------------------- checked factories
# Each value is checked once, where a user gives it: a public factory checks its arguments and
# builds; a recipe checks all of its own arguments under its names and builds its parts with
# their ``build``; an optimizer class checks its group (torch's wording) and builds its recipe
# with the recipe's ``build``.
class Checked(Protocol[P, R]):
    """A public factory split into its argument check and its builder (see :func:`checked`)."""

    check: Callable[P, None]
    build: Callable[P, R]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...


def checked(check: Callable[..., None]) -> Callable[[Callable[P, R]], Checked[P, R]]:
    """Decorator: a call of the factory below it runs ``check`` on every argument by name (the
    factory's parameters, defaults filled in; ``**kwargs`` as one dict), then the factory.
    ``factory.check`` takes the factory's arguments and only checks them (a recipe checking its
    arguments up front under its own names); ``factory.build`` takes them and only builds (a
    recipe or an optimizer class building from values it checked). Name, docstring and
    signature stay the factory's (``inspect.signature`` shows its parameters)."""

    def decorate(build: Callable[P, R]) -> Checked[P, R]:
        signature = inspect.signature(build)

        def check_call(*args: P.args, **kwargs: P.kwargs) -> None:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                build(*args, **kwargs)  # a call that does not fit: Python's own TypeError, naming the factory
                raise
            bound.apply_defaults()
            check(**bound.arguments)

        @functools.wraps(build)
        def factory(*args: P.args, **kwargs: P.kwargs) -> R:
            check_call(*args, **kwargs)
            return build(*args, **kwargs)

        factory.check = check_call  # type: ignore[attr-defined]
        factory.build = build  # type: ignore[attr-defined]
        return cast("Checked[P, R]", factory)

    return decorate


def _as_float(name: str, value: Any) -> float | None:
    """``value`` as a float; ``None`` for a meta tensor, which has no value to check (the adapters
    trace their transforms at construction with meta copies of the per-step scalars, whose real
    values were checked already)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        if value.device.type == "meta":
            return None
        return float(value.detach().reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or a 0-d tensor, got {type(value).__name__}")
    return float(value)


def non_negative(name: str, value: Any) -> None:
    """``value >= 0`` (and finite), e.g. a learning rate or weight decay."""
    v = _as_float(name, value)
    if v is None:
        return
    if not 0.0 <= v or math.isinf(v):
        raise ValueError(f"Invalid {name}: {value} (expected a finite value >= 0)")


def positive(name: str, value: Any) -> None:
    v = _as_float(name, value)
    if v is None:
        return
    if not v > 0.0 or math.isinf(v):
        raise ValueError(f"Invalid {name}: {value} (expected a finite value > 0)")


def in_unit_interval(name: str, value: Any) -> None:
    """``0 <= value < 1``, e.g. a momentum or beta."""
    v = _as_float(name, value)
    if v is None:
        return
    if not 0.0 <= v < 1.0:
        raise ValueError(f"Invalid {name}: {value} (expected 0 <= {name} < 1)")


def positive_int(name: str, value: Any, also: str = "") -> None:
    """``value`` is an int ≥ 1 (not a bool); ``also`` ends the message (what else is accepted)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer >= 1{also})")


def boolean(name: str, value: Any) -> None:
    """``value`` is ``True`` or ``False`` (not a truthy stand-in such as ``1`` or ``"yes"``)."""
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name}: {value!r} (expected True or False)")


def one_of(name: str, value: Any, valid: Iterable[Any]) -> None:
    valid = list(valid)
    if value not in valid:
        listed = ", ".join(repr(v) for v in valid)
        raise ValueError(f"Invalid {name}: {value!r} (valid: {listed})")


def scalar_or_schedule(name: str, value: Any) -> None:
    """A float, a 0-d tensor, or a callable schedule (a learning rate); floats and tensors must be >= 0."""
    if callable(value) and not isinstance(value, torch.Tensor):
        return
    non_negative(name, value)
    zero_dim(name, value)


def zero_dim(name: str, value: Any) -> None:
    """A tensor ``value`` (a learning rate) is 0-d, as documented: not ``torch.tensor([0.02])``."""
    if isinstance(value, torch.Tensor) and value.ndim != 0:
        raise ValueError(f"Invalid {name}: a tensor of shape {tuple(value.shape)} (expected a float or a 0-d "
                         f"tensor, e.g. torch.tensor(0.02), not torch.tensor([0.02]))")


def dtype(name: str, value: Any, valid: Iterable[torch.dtype]) -> None:
    """``value`` is one of the torch dtypes ``valid`` (a string such as ``"bf16"`` is a TypeError)."""
    valid = tuple(valid)
    listed = ", ".join(str(v) for v in valid)
    if not isinstance(value, torch.dtype):
        raise TypeError(f"Invalid {name}: {value!r} (expected a torch.dtype: {listed})")
    if value not in valid:
        raise ValueError(f"Invalid {name}: {value} (expected one of {listed})")


# ----------------------------------------------------------------------------- optimizer groups
# The adapters' hyperparameter checks, in torch.optim's wording, shared by every optimizer class
# (constructor, add_param_group and load_state_dict alike).
def learning_rate(lr: Any, name: str = "lr") -> None:
    """The optimizers' learning rate (``name``: the argument, e.g. the hybrid's ``muon_lr``), in
    torch's wording: a float or a 0-d tensor, >= 0 and finite."""
    what = "learning rate" if name == "lr" else name
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element")
    zero_dim(name, lr)
    if isinstance(lr, bool) or not isinstance(lr, (int, float, torch.Tensor)):
        raise TypeError(f"Invalid {what}: {lr!r} (expected a float or a 0-d tensor)")
    v = _as_float(name, lr)
    if v is None:
        return
    if not 0.0 <= v or math.isinf(v):
        raise ValueError(f"Invalid {what}: {lr}")


def momentum_value(momentum: Any, name: str = "momentum", hint: str = "") -> None:
    v = _as_float(name, momentum)
    if v is None:
        return
    if not 0.0 <= v < 1.0:
        raise ValueError(f"Invalid {name} value: {momentum} (expected 0 <= {name} < 1{hint})")


def decay_value(name: str, value: Any) -> None:
    v = _as_float(name, value)
    if v is None:
        return
    if not 0.0 <= v or math.isinf(v):
        raise ValueError(f"Invalid {name} value: {value}")


def scheduled_value(name: str, value: Any) -> None:
    """A per-step scalar other than ``lr`` (``adamw_lr``): as :func:`decay_value`, and 0-d."""
    decay_value(name, value)
    zero_dim(name, value)


def eps_value(name: str, value: Any) -> None:
    v = _as_float(name, value)
    if v is None:
        return
    if not v > 0.0 or math.isinf(v):
        raise ValueError(f"Invalid {name} value: {value} (expected > 0)")


def betas_value(name: str, betas: Any) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid {name}: {betas!r} (expected a pair (beta1, beta2))")
    for i, b in enumerate(betas):
        v = _as_float(f"{name}[{i}]", b)
        if v is None:
            continue
        if not 0.0 <= v < 1.0:
            raise ValueError(f"Invalid {name} parameter at index {i}: {b}")


def adamw_half(group: dict[str, Any]) -> None:
    """The AdamW half of a hybrid group (``adamw_lr``, ``adamw_betas``, ``adamw_eps``,
    ``adamw_weight_decay``, ``adamw_decay_1d``) and its ``weight_decay``."""
    for key in ("weight_decay", "adamw_weight_decay"):
        decay_value(key, group[key])
    scheduled_value("adamw_lr", group["adamw_lr"])
    eps_value("adamw_eps", group["adamw_eps"])
    betas_value("adamw_betas", group["adamw_betas"])
    boolean("adamw_decay_1d", group["adamw_decay_1d"])


# ----------------------------------------------------------------------------- foreign keywords
# Keywords of other torch optimizers, and former muon_fn names, that the optimizers refuse with a
# pointer to what to use (instead of accepting them and doing nothing).
FOREIGN_KEYWORDS = {
    "ns_eps": "use eps: it is the Newton-Schulz epsilon, as in torch.optim.Muon "
              "(NorMuon's epsilon is normuon_eps)",
    "betas": "use momentum for the matrices and adamw_betas for the AdamW half",
    "split": "removed: row blocks are a head view, given per parameter: "
             "matrix_view={name: muon_fn.heads(rows=...)} (cols= for column blocks)",
}


# torch.optim's implementation keys, which trainers pass to every optimizer (torchtitan puts
# ``fused`` and ``foreach`` in every param group): accepted, as keywords and as group keys, where
# their meaning holds, refused where it does not. muon_fn's step is its own batched one, compiled
# by default, whatever ``foreach`` and ``fused`` say: both are accepted (True, False or None).
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable", "maximize")
_ONLY_FALSE = {
    "capturable": "the step compiles its own graphs and cannot be captured in a user's CUDA graph; "
                  "compile={'mode': 'reduce-overhead'} runs it as CUDA graphs",
    "differentiable": "the step runs under torch.no_grad(); differentiating through it is not supported",
    "maximize": "muon_fn optimizers minimize; to maximize f, minimize -f",
}


def implementation_key(key: str, value: Any, where: str = "") -> None:
    """``ValueError`` for an :data:`IMPLEMENTATION_KEYS` value whose meaning muon_fn cannot give."""
    allowed = (None, True, False) if key in ("foreach", "fused") else (False, None)
    if isinstance(value, bool) or value is None:
        if value in allowed:
            return
        raise ValueError(f"{key}={value!r}{where} is not supported: {_ONLY_FALSE[key]}")
    raise ValueError(f"Invalid {key} value{where}: {value!r} (expected True, False or None)")


def implementation_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove the :data:`IMPLEMENTATION_KEYS` from a constructor's ``kwargs``, checked; returns them."""
    found = {k: kwargs.pop(k) for k in IMPLEMENTATION_KEYS if k in kwargs}
    for key, value in found.items():
        implementation_key(key, value)
    return found


def unexpected_keywords(owner: str, kwargs: dict[str, Any]) -> None:
    """Refuse ``kwargs`` (keywords ``owner`` does not take) with Python's wording, plus what to use
    for the ones in :data:`FOREIGN_KEYWORDS`."""
    for key in kwargs:
        hint = FOREIGN_KEYWORDS.get(key)
        raise TypeError(f"{owner}() got an unexpected keyword argument {key!r}" + (f": {hint}" if hint else ""))


def implementation_group_keys(group: dict[str, Any]) -> None:
    """Refuse a param group's :data:`IMPLEMENTATION_KEYS` value that muon_fn cannot honour."""
    for key in IMPLEMENTATION_KEYS:
        if key in group:
            implementation_key(key, group[key], " in a param group")


def foreign_group_keys(group: dict[str, Any]) -> None:
    """Refuse a param group holding a key of :data:`FOREIGN_KEYWORDS` (it would be ignored)."""
    for key in group:
        if key in FOREIGN_KEYWORDS:
            raise ValueError(f"Invalid param group key {key!r} (this optimizer does not use it): "
                             f"{FOREIGN_KEYWORDS[key]}")


# ----------------------------------------------------------------------------- parameter groups
def not_a_module(params: Any, takes_model: bool) -> None:
    """``TypeError`` for a model given where its parameters belong (``MuonOptimizer(model)``),
    in torch's wording plus what to pass; ``takes_model``: the optimizer also takes ``model=``."""
    if isinstance(params, torch.nn.Module):
        hint = (", and model=model to name them in messages and checkpoints and give conv and expert weights "
                "their module's matrix view") if takes_model else ""
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                        f"{torch.typename(params)} (a module): pass model.parameters() (or model.named_parameters())"
                        + hint)


def _param_label(names: list[Any] | None, i: int, p: torch.Tensor) -> str:
    return repr(names[i]) if names and names[i] is not None else f"#{i} of shape {tuple(p.shape)}"


def listed_once(new: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """``ValueError`` naming a parameter that ``new`` (a param group about to be added, its
    ``params`` a list of tensors or ``(name, tensor)`` pairs) lists twice, or that an earlier
    group of ``groups`` holds already: it would be updated twice per step."""
    entries = new["params"]
    if isinstance(entries, (torch.Tensor, set)):
        return  # torch's add_param_group takes (or refuses) these
    entries = list(entries)
    pairs = [(e[0], e[1]) if isinstance(e, tuple) and len(e) == 2 else (None, e) for e in entries]
    names = [n for n, _ in pairs] if any(n is not None for n, _ in pairs) else new.get("param_names")
    seen: dict[int, int] = {}
    for i, (_, p) in enumerate(pairs):
        j = seen.setdefault(id(p), i)
        if j != i:
            raise ValueError(f"parameter {_param_label(names, i, p)} appears twice in one parameter group "
                             f"(positions {j} and {i}); it would be updated twice per step: list each "
                             "parameter once")
    for g, group in enumerate(groups):
        held = {id(q) for q in group["params"]}
        for i, (_, p) in enumerate(pairs):
            if id(p) in held:
                raise ValueError(f"some parameters appear in more than one parameter group: the new group's "
                                 f"parameter {_param_label(names, i, p)} is in group {g} already")
    new["params"] = entries  # a generator has been read


def misspelled_keys(group: dict[str, Any], hyperparameters: Iterable[str], owner: str,
                    internal: Iterable[str] = ()) -> None:
    """``ValueError`` for a key of a user's param group that looks like a misspelled
    hyperparameter of ``owner`` (``lrr`` for ``lr``): it would be kept and never used. Other
    unknown keys (``"name"``, a scheduler's own) are kept, as torch.optim keeps them;
    ``internal``: keys the optimizer keeps in its groups that are not hyperparameters."""
    import difflib

    hyper = sorted(set(hyperparameters))
    for key in group:
        if not isinstance(key, str) or key in hyper or key in internal or key in FOREIGN_KEYWORDS:
            continue  # a foreign keyword gets its own message (foreign_group_keys)
        close = [k for k in difflib.get_close_matches(key, hyper, n=3, cutoff=0.8)
                 if not (key.startswith(k + "_") or key.endswith("_" + k))]  # lr_scale: a key of its own
        if close:
            raise ValueError(f"Invalid param group key {key!r}: {owner} has no hyperparameter {key!r} (it would "
                             f"be kept and never used); did you mean {close[0]!r}?")
