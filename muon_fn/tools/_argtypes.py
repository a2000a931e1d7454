"""The argparse types of the ``muon-fn`` commands (``train``, ``bench``, ``plan``): a bad number or
device stops a command with status 2 and one ``muon-fn <command>: error: argument --x: ...`` line
naming the option, the value and what is allowed (argparse's error path, never a traceback)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_arg(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer ``>= low`` (and ``<= high`` if given)."""
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text}")
        return value

    return parse


def float_arg(low: float, high: float | None = None, *, strict: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number ``>= low`` (``> low`` if ``strict``; ``<= high`` if given)."""
    allowed = (f"a finite number {'>' if strict else '>='} {low:g}" if high is None
               else f"a number from {low:g} to {high:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if not (math.isfinite(value) and (value > low if strict else value >= low)
                and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text}")
        return value

    return parse


def device_arg(text: str) -> str:
    """An argparse type: a device a command can run on here (``cpu``, ``cuda``, ``cuda:N``, or
    this machine's other torch accelerator), refused with the reason when it is not usable."""
    import torch

    accelerator = torch.accelerator.current_accelerator()
    other = [accelerator.type] if accelerator is not None and accelerator.type != "cuda" else []
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", *other):
        valid = ", ".join(["cpu", "cuda", "cuda:N", *other])
        raise argparse.ArgumentTypeError(f"invalid device {text!r} (valid: {valid})")
    if device.type == "cuda":
        _check_cuda(text, device)
    return text


def _check_cuda(text: str, device) -> None:
    import torch

    if torch.version.cuda is None and torch.version.hip is None:
        raise argparse.ArgumentTypeError(f"{text!r}: this torch build ({torch.__version__}) has no CUDA; "
                                         "use --device cpu, or install a CUDA build of torch")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU is visible (check the driver and "
                                         "CUDA_VISIBLE_DEVICES); use --device cpu")
    if device.index is not None and device.index >= count:
        visible = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise argparse.ArgumentTypeError(f"{text!r}: no such CUDA device (visible: {visible})")
