"""The adapter's checkpoints: ``state_dict`` with each group's layout record, and a
``load_state_dict`` that checks a state_dict against the optimizer before anything changes.

:class:`Checkpointing` is a base of :class:`~muon_fn.engine._adapter.Optimizer`, first among its
bases, so these methods resolve right after the class's own (as when the class defined them).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import checks as _checks
from . import layout as _layout, _state
from .torch_state import foreign_hint

# Group keys the adapter itself uses; they never reach the factory.
ADAPTER_KEYS = frozenset({"params", "param_names", "gradient_accumulation_steps", "micro_step",
                          "initial_lr", "base_lr", _layout.KEY, _layout.STATELESS, *_checks.IMPLEMENTATION_KEYS})


class Checkpointing:
    """``state_dict``/``load_state_dict`` of the adapter (see :class:`~muon_fn.optim.Optimizer`)."""

    param_groups: list[dict[str, Any]]  # torch.optim.Optimizer's, as the class it is mixed into has them
    state: Any
    _executor: Any

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict``; every param group also records its parameters' layout under
        ``"param_layout"``: one ``(name, global shape, matrix view)`` per parameter, in order
        (see :meth:`load_state_dict`), and dtype hyperparameters by name (``"torch.float32"``), as
        ``torch.distributed.checkpoint``'s full state dicts require, and under
        ``"params_without_state"`` the positions of the parameters that have no state yet."""
        self._follow_params()
        state_dict = super().state_dict()
        state_dict["param_groups"] = [
            {**_layout.dtypes_by_name(saved), _layout.KEY: [tuple(p) for p in self._layout(group)],
             _layout.STATELESS: _layout.stateless_positions(group["params"], self.state)}
            for group, saved in zip(self.param_groups, state_dict["param_groups"])]
        return state_dict

    def _layout(self, group: dict[str, Any]) -> list[_layout.ParamLayout]:
        """The layout of ``group``'s parameters: names, global shapes and matrix views."""
        options = self._param_options(group)
        return [_layout.ParamLayout(name, tuple(p.shape), opts.get("matrix_view"))
                for name, p, opts in zip(self._param_names(group), group["params"], options)]

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_missing_state: bool = False) -> None:
        """torch's ``load_state_dict``, with every state tensor in the dtype its transform uses
        (torch would cast all tensor state to the parameter's dtype, e.g. fp32 momentum of a bf16
        parameter, or integer counters), the loaded hyperparameters checked as the constructor
        checks them, and a check that the state_dict has this optimizer's layout: the recorded
        ``param_layout`` (names, global shapes, matrix views; or, in a checkpoint without it,
        the ``param_names`` where both sides have them) and the state's keys and shapes. State
        tensors are copied (never shared with the state_dict, which may be another optimizer's
        live state), dtype names read back as dtypes. A parameter whose state the state_dict
        lacks is refused, naming it, unless it had none when saved or ``allow_missing_state=True``
        (its state then starts afresh). A rejected state_dict leaves the optimizer as it was.

        The checks, in order, all before anything changes: the number of groups; the group
        hyperparameters (a state_dict another optimizer wrote is named by its keys, e.g. "it is a
        torch.optim.AdamW state_dict", with what to do: start afresh, or convert with
        :func:`muon_fn.optim.from_torch_state_dict`); the size of every group, in torch's words;
        the recorded layout against this optimizer's, parameter by parameter (a ``ValueError``
        naming the first difference); every parameter's state present; the keys and shapes of the
        state and the hyperparameters' values. The layout comparison depends on what both sides
        know: with names on both sides names count, so renamed or reordered parameters are
        refused even where every shape matches (state is matched by position, and a reordered
        model would take another layer's momentum); without names, shapes and views are compared
        by position; a state_dict whose group ``params`` are names (what
        ``torch.distributed.checkpoint``'s ``set_optimizer_state_dict`` loads) is compared name by
        name. Checkpoints without the record (torch.optim's, older muon_fn's) load when their
        sizes match. To load by position into a model renamed on purpose, delete
        ``"param_layout"`` and ``"param_names"`` from the saved groups first.

        Names are recorded relative to the module the optimizer was given;
        ``get/set_optimizer_state_dict`` may be called with that module, a parent (Lightning's
        ``LightningModule``, accelerate's wrapper) or a child: loaded names match when all of them
        are the recorded ones with one module prefix added or removed, one to one (wrapper
        segments such as ``_checkpoint_wrapped_module`` and ``_orig_mod`` ignored). DCP writes the
        loaded state into the tensors ``get_optimizer_state_dict`` returned before the optimizer
        sees it, so after such a refusal the state is not as it was, and the error says so:
        build the optimizer again.

        ``state_bits`` belongs to the loading optimizer: a state_dict saved at another width is
        converted (an fp32 buffer quantized, codes dequantized exactly as the step would, codes
        of another width decoded and encoded again; each FSDP rank converts its own rows). DCP
        loads the keys of the optimizer it loads into, so to change the width of a DCP
        checkpoint, load it at its own width, then ``load_state_dict(opt.state_dict())`` into an
        optimizer of the new width. Setting a group's ``state_bits`` between steps converts its
        state the same way."""
        self._executor.before_load()  # the distributed one drains an exchange in flight
        self._follow_params()
        try:
            self._check_saved_groups(state_dict)
            for index, (group, saved_group) in enumerate(zip(self.param_groups, state_dict["param_groups"])):
                _layout.check_group(index, saved_group, self._layout(group))
                if not allow_missing_state:
                    _layout.check_state_present(index, saved_group, state_dict["state"],
                                                lambda i, g=group: self._name(g, g["params"][i]))
        except ValueError as err:
            if _layout.loaded_in_place(self.state, state_dict.get("state", {})):
                raise ValueError(f"{err}. {_layout.OVERWRITTEN}") from err
            raise
        state_dict = {**state_dict, "param_groups": [_layout.dtypes_from_names(
            {k: v for k, v in g.items() if k not in (_layout.KEY, _layout.STATELESS)})
            for g in state_dict["param_groups"]]}
        saved = state_dict["state"]
        backup_state, backup_groups = self.state, self.param_groups
        try:
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                self._validate_group(group)
            params = [p for g in self.param_groups for p in g["params"]]
            saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]  # or names
            for pid, p in zip(saved_ids, params):
                entry = saved.get(pid, saved.get(str(pid)))
                for key, value in (entry or {}).items():
                    if isinstance(value, torch.Tensor):
                        self.state[p][key] = value.detach().to(device=p.device, copy=True)
            for index in range(len(self.param_groups)):
                self._check_window(index)
                self._check_loaded_state(index)
        except Exception:
            self.state, self.param_groups = backup_state, backup_groups
            for index in range(len(self.param_groups)):
                self._runtime(index)
            raise
        self._executor.after_load()

    def _check_window(self, index: int) -> None:
        """A group loaded inside an accumulation window holds the window's accumulated gradients
        (a window's first micro-batch with a gradient creates them)."""
        group = self.param_groups[index]
        if group.get("micro_step", 0) and not any("grad_accumulator" in self.state.get(p, {})
                                                  for p in group["params"]):
            raise ValueError(
                f"loaded param group {index} is inside a gradient accumulation window (micro_step "
                f"{group['micro_step']} of {group['gradient_accumulation_steps']}) but the state_dict holds no "
                "'grad_accumulator': the gradients accumulated so far are missing (torch.distributed."
                "checkpoint loads only the keys of the optimizer it loads into). Save at a window "
                "boundary, or save and load this optimizer's own state_dict()")

    def _check_loaded_state(self, index: int) -> None:
        group = self.param_groups[index]
        rt = self._runtime(index)
        for bucket in rt.buckets:
            params = [group["params"][i] for i in bucket.indices]
            # read, never create: an entry made here would be an empty one that outlives a swap
            # (torch's state_dict() then fails on its stale key) and keeps the old parameter alive
            states = [self.state.get(p, {}) for p in params]
            names = [self._name(group, p) for p in params]
            _state.drop_legacy_keys(bucket.layout, states)
            _state.cast_to_layout(bucket.layout, states)
            _state.check(bucket.layout, states, names)

    def _check_saved_groups(self, state_dict: dict[str, Any]) -> None:
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or "state" not in state_dict:
            raise ValueError("state_dict must have 'state' and 'param_groups' entries")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups"
                             + foreign_hint(state_dict, self))
        for i, (ours, theirs) in enumerate(zip(self.param_groups, saved_groups)):
            missing = sorted(set(ours) - set(theirs) - {"params", "param_names"} - ADAPTER_KEYS)
            if missing:
                raise ValueError(
                    f"loaded param group {i} lacks this optimizer's hyperparameters {missing}: the "
                    "state_dict comes from a different optimizer layout" + foreign_hint(state_dict, self)
                )
