"""muon_fn: the Muon optimizer family for PyTorch."""

from ._orthogonalize import newton_schulz, polar_express, zeropower_via_newtonschulz5

__version__ = "0.1.0"
