"""``torch.distributed.checkpoint`` (DCP) directories between ``torch.optim.Muon`` and
:class:`~muon_fn.MuonOptimizer`, both ways: :func:`~muon_fn.optim.from_torch_checkpoint` and
:func:`~muon_fn.optim.to_torch_checkpoint`.

DCP plans a load from the *loading* optimizer's state_dict: every key of it must be in the
checkpoint (Lightning's ``ModelParallelStrategy`` and torchtitan load strictly). A MuonOptimizer's
param groups hold keys that torch.optim.Muon's lack (``base_lr``, ``method``, ``ns_dtype``, ...),
so the load stops at the first one. The conversion writes a copy of the checkpoint in which each
torch.optim.Muon group also holds those keys, each set to a mark that says "not saved". A MuonOptimizer drops
them on load and converts the rest as it converts any torch.optim.Muon state_dict
(:func:`muon_fn.optim.from_torch_state_dict`): torch's hyperparameters and algorithm, the
momentum buffers as they are, and the keys torch does not save at the loading optimizer's values,
named in one warning. torch.optim.Muon itself still loads the copy (DCP ignores keys that its
template lacks), so the copy serves both optimizers. The other way, torch.optim.Muon loads only
its own keys from a muon_fn checkpoint, some of which muon_fn writes in its own terms; the copy
:func:`~muon_fn.optim.to_torch_checkpoint` writes has torch's values for them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch

from ..engine import torch_state as _torch_state

# The group keys a DCP template may hold that torch.optim.Muon's groups never carry by themselves.
_NEVER_ADDED = frozenset({"params", "param_names"})
_GROUP_KEY = re.compile(r"^(?P<group>(?:.+\.)?param_groups\.\d+)\.(?P<key>[^.]+)$")


def muon_group_keys() -> list[str]:
    """Every key of a :class:`~muon_fn.MuonOptimizer`'s saved param group, and ``initial_lr`` (an
    LR scheduler's), except the parameters: the keys a converted group may be asked for."""
    from ._muon import MuonOptimizer

    probe = MuonOptimizer([torch.nn.Parameter(torch.zeros(2, 2))], compile=False)
    saved = probe.state_dict()["param_groups"][0]
    return sorted((set(saved) | {"initial_lr"}) - _NEVER_ADDED)


def param_groups(metadata: Any, *, muon_fn: bool) -> dict[str, set[str]]:
    """The param groups in a DCP checkpoint's metadata that torch.optim.Muon wrote (all of its
    group keys, not muon_fn's ``algorithm``) or, ``muon_fn=True``, that muon_fn wrote (with
    ``algorithm``), each as its flat key prefix → its keys."""
    groups: dict[str, set[str]] = {}
    for flat in metadata.state_dict_metadata:
        match = _GROUP_KEY.match(flat)
        if match:
            groups.setdefault(match["group"], set()).add(match["key"])
    return {g: keys for g, keys in groups.items() if set(_torch_state.TORCH_MUON_KEYS) <= keys
            and ("algorithm" in keys) == muon_fn}


def _read_metadata(checkpoint: Path, caller: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    if not (checkpoint / ".metadata").is_file():
        raise ValueError(f"{caller}: {str(checkpoint)!r} is not a torch.distributed.checkpoint "
                         "directory (it has no .metadata file)")
    return FileSystemReader(str(checkpoint)).read_metadata()


def _load_whole(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's whole state dict, in this process (DCP's own ``dcp_to_torch_save``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp, _one_process():
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(checkpoint), str(whole))
        return torch.load(whole, weights_only=False)


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to load/save in a single process": it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*in a single process", category=UserWarning)
        yield


def _group_at(state: dict[str, Any], path: tuple[Any, ...]) -> dict[str, Any]:
    node: Any = state
    for part in path:
        node = node[part]
    return node


def from_torch_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Copy the DCP checkpoint directory ``checkpoint`` to ``out`` (which must not exist) so that a
    :class:`~muon_fn.MuonOptimizer` resumes from its ``torch.optim.Muon`` state under DCP.

    Every param group that torch.optim.Muon wrote gains the keys a MuonOptimizer's groups hold,
    each marked as not saved: DCP loads strictly from the loading optimizer's keys, and torch's groups
    lack them. On load, a MuonOptimizer takes torch's hyperparameters and algorithm as
    :func:`from_torch_state_dict` does and keeps its own values for the rest, naming them in one
    warning. Everything else is copied unchanged (the tensors as whole, unsharded tensors, which
    DCP reshards on load; files that DCP did not write, such as Lightning's ``meta.pt``).
    torch.optim.Muon resumes from the copy too. Run it in one process, with no process group
    needed. Returns the converted groups' flat key prefixes (``"optimizer_0.param_groups.0"``).
    Raises ``ValueError`` if ``checkpoint`` is not a DCP directory or holds no torch.optim.Muon
    group, ``FileExistsError`` if ``out`` exists.
    """
    src, dst, keys = Path(checkpoint), Path(out), muon_group_keys()
    metadata, groups, state = _open(src, dst, "from_torch_checkpoint", muon_fn=False)
    for prefix, present in groups.items():
        _group_at(state, metadata.planner_data[f"{prefix}.lr"][:-1]).update(
            {k: _torch_state.UNSET for k in keys if k not in present})
    _save(state, src, dst)
    return sorted(groups)


def to_torch_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Copy the DCP checkpoint directory ``checkpoint`` of a :class:`~muon_fn.MuonOptimizer` to
    ``out`` (which must not exist) so that ``torch.optim.Muon`` resumes from it under DCP.

    torch.optim.Muon loads only its own group keys from a muon_fn checkpoint, and muon_fn writes
    some of them in its own terms (``ns_steps=None``, ``ns_coefficients=None``: the method's own).
    Each muon_fn param group gets torch's values for them, as :func:`to_torch_state_dict` writes
    them; its other keys stay, so a MuonOptimizer still loads the copy. The same settings convert
    (one quintic triple: ``ns_coefficients`` or ``method="quintic"``; EMA momentum; no NorMuon,
    ...), and only groups of 2-D parameters with a momentum buffer each (fp32 state,
    ``state_bits=32``): otherwise ``ValueError`` says what differs, before anything is written.
    Returns the converted groups' flat key prefixes; raises as :func:`from_torch_checkpoint` does.
    """
    src, dst = Path(checkpoint), Path(out)
    metadata, groups, state = _open(src, dst, "to_torch_checkpoint", muon_fn=True)
    for prefix in groups:
        path = metadata.planner_data[f"{prefix}.lr"][:-1]
        group, owner = _group_at(state, path), _group_at(state, path[:-2])
        _check_torch_params(prefix, group, owner.get("state", {}))
        group.update(_torch_state.torch_muon_hyper(int(path[-1]), group))
    _save(state, src, dst)
    return sorted(groups)


def _open(src: Path, dst: Path, caller: str, *, muon_fn: bool) -> tuple[Any, dict[str, set[str]], dict[str, Any]]:
    """(metadata, the groups to convert, the whole state) of ``src``, checked."""
    metadata = _read_metadata(src, caller)
    groups = param_groups(metadata, muon_fn=muon_fn)
    if not groups:
        which = "muon_fn" if muon_fn else "torch.optim.Muon"
        raise ValueError(f"{caller}: {str(src)!r} holds no {which} param group (a group with "
                         f"{', '.join(_torch_state.TORCH_MUON_KEYS)} and {'' if muon_fn else 'no '}'algorithm')")
    if dst.exists():
        raise FileExistsError(f"{caller}: out={str(dst)!r} exists; give a new directory")
    return metadata, groups, _load_whole(src)


def _check_torch_params(prefix: str, group: dict[str, Any], state: dict[str, Any]) -> None:
    """Refuse a group whose parameters torch.optim.Muon cannot hold, or whose state it cannot read."""
    if group["algorithm"] == "adamw" or group.get("state_bits", 32) != 32:
        raise ValueError(f"to_torch_checkpoint: {prefix} has algorithm={group['algorithm']!r}, "
                         f"state_bits={group.get('state_bits', 32)!r}: torch.optim.Muon holds Muon parameters "
                         "with fp32 momentum only (algorithm 'auto' or 'muon', state_bits=32)")
    for name in group["params"]:
        entry = state.get(name, {})
        buffer = entry.get("momentum_buffer")
        if set(entry) - {"momentum_buffer"} or (buffer is not None and buffer.ndim != 2):
            what = f"state {sorted(entry)}" if set(entry) - {"momentum_buffer"} else f"a {buffer.ndim}-D momentum"
            raise ValueError(f"to_torch_checkpoint: {prefix} holds parameter {name!r} with {what}: "
                             "torch.optim.Muon takes 2-D parameters with a momentum buffer only")


def _save(state: dict[str, Any], src: Path, dst: Path) -> None:
    """``state`` as a DCP checkpoint at ``dst``, with the files of ``src`` that DCP did not write."""
    import torch.distributed.checkpoint as dcp

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        with _one_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
        for item in src.iterdir():
            if item.name == ".metadata" or item.suffix == ".distcp":
                continue
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, tmp / item.name)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
