"""torch.optim.Muon's math in fp32, for the tests that compare muon_fn against it (imported by those
test modules only, not by conftest: the shared fixtures take nothing from the demo trainer).

``ns_fp32_twin`` is torch.optim._muon._zeropower_via_newtonschulz line by line in fp32 instead of
bf16 (checked bit-identical to torch's function when run in bf16: test_muon_reference.py). A test
module makes :func:`fp32_torch_muon` its fixture with ``fp32_torch_muon =
pytest.fixture(_torch_muon.fp32_torch_muon)``."""

from __future__ import annotations

import torch

from muon_fn.tools.train.optimizers import torch_zeropower

ns_fp32_twin = torch_zeropower(torch.float32)


def fp32_torch_muon(monkeypatch) -> None:
    """torch.optim.Muon with its Newton–Schulz function run in fp32 (torch's math, no bf16)."""
    import torch.optim._muon as torch_muon_module

    monkeypatch.setattr(torch_muon_module, "_zeropower_via_newtonschulz", ns_fp32_twin)
