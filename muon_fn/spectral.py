"""Spectral utilities: top singular pair, spectral norm, the sphere's radius and retraction.

Pure tensor functions over a matrix ``(m, n)`` or a batch ``(B, m, n)``; fp32 math. Used by the
Spectral Sphere Optimizer (:func:`muon_fn.spectral_sphere`, docs/sso.md) and usable on
their own for monitoring (``compute_spectral_norm``). The λ model and solver of SSO live in
``muon_fn.core.sso_lambda_model`` and ``muon_fn.core.sso_lambda``.

**Batch invariance.** A batched function here computes each matrix's result with the same kernels
whatever else shares its batch. Products with a single vector (``W v``, ``uᵀ X v``) go through
:func:`matvec` and :func:`bilinear` (elementwise products and reductions) rather than a batched
GEMM: on the CPU a one-matrix batch of matrix–vector products runs a GEMV kernel and a larger
batch a batched GEMM, which round differently (measured: ~3e-8 in ``u`` of a 48×48 weight).
Products of two matrices use batched GEMMs, whose per-matrix results do not depend on the batch
size (checked for batch sizes 1–5 on this CPU, fp32 and fp64). :func:`power_iteration` and
:func:`top_singular` keep GEMV-based products: they run on one matrix at a time in SSO.
"""

from .core.spectral import *  # noqa: F403  defined in muon_fn.core.spectral (its __all__)
from .core.spectral import __all__  # noqa: F401
