"""The functional core: transforms and combinators over pytrees, their checks and views, the Muon
math (Newton–Schulz, orthogonalization, shape scaling), QK-Clip, SSO, metrics, low-bit storage
and compilation. Imports torch and optree only, never another part of muon_fn.

The package exports nothing itself: :mod:`muon_fn` is the public face of these modules.
"""
