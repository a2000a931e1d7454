"""Argument validation used by every factory. Messages name the argument and its value."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        return float(value.detach().reshape(()).item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or a 0-d tensor, got {type(value).__name__}")
    return float(value)


def non_negative(name: str, value: Any) -> None:
    """``value >= 0`` (and finite), e.g. a learning rate or weight decay."""
    v = _as_float(name, value)
    if not v >= 0.0 or math.isinf(v):
        raise ValueError(f"Invalid {name}: {value} (expected a finite value >= 0)")


def positive(name: str, value: Any) -> None:
    v = _as_float(name, value)
    if not v > 0.0 or math.isinf(v):
        raise ValueError(f"Invalid {name}: {value} (expected a finite value > 0)")


def in_unit_interval(name: str, value: Any) -> None:
    """``0 <= value < 1``, e.g. a momentum or beta."""
    v = _as_float(name, value)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"Invalid {name}: {value} (expected 0 <= {name} < 1)")


def positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Invalid {name}: {value!r} (expected an integer >= 1)")


def one_of(name: str, value: Any, valid: Iterable[Any]) -> None:
    valid = list(valid)
    if value not in valid:
        listed = ", ".join(repr(v) for v in valid)
        raise ValueError(f"Invalid {name}: {value!r} (valid: {listed})")


def scalar_or_schedule(name: str, value: Any) -> None:
    """A float, a 1-element tensor, or a callable schedule; floats and tensors must be >= 0."""
    if callable(value) and not isinstance(value, torch.Tensor):
        return
    non_negative(name, value)
