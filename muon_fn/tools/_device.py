"""Device helpers shared by the benchmarks and the training command: wait for a device's work."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU), so a clock read covers it."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
