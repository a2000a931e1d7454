"""Elementwise transforms: momentum, learning rate, weight decay (cautious too), Adam, AdaMuon's sign
and second moment, NorMuon rows, and the per-tensor gradient normalization.

Every transform maps a ``None`` update (missing gradient) to ``None`` and leaves that leaf's
state unchanged, as torch.optim skips parameters without ``.grad``.
"""

from __future__ import annotations

import math

from typing import Any, NamedTuple

import torch

from . import checks as _checks, quantize as _quantize, tree as _tree, views as _views
from .base import (ELEMENTWISE, MATRIX, GradientTransformation, Params, Scalar, ScalarOrSchedule, Updates, identity,
                   init_empty_state, named, shown, with_info)
from .metrics import collector_of
from .storage import Layout, stored
from .views import View

MOMENTUM_KINDS = ("sgd", "ema")


def apply_updates(params: Params, updates: Updates) -> Params:
    """``p + u`` for every leaf (out of place); a ``None`` update leaves ``p`` as it is."""
    return _tree.tree_map(lambda p, u: p if u is None else p + u.to(p.dtype), params, updates)


class MomentumState(NamedTuple):
    """State of :func:`momentum`."""

    mu: Updates  # like params; dtype mu_dtype or the param's

    state_keys = {"mu": "momentum_buffer"}  # names in torch.optim state dicts  # noqa: RUF012  NamedTuple: annotated, it would be a field


class QuantizedMomentumState(NamedTuple):
    """State of :func:`momentum` with ``state_bits`` 8 or 4 (:func:`muon_fn.core.storage.stored` over
    :class:`MomentumState`): each matrix's buffer as codes and per-block scales
    (:mod:`muon_fn.core.quantize`); a leaf of ndim < 2 keeps its buffer in ``mu``.
    ``codes``: int8 ``(rows, n)``, or ``(rows, ⌈n/2⌉)`` uint8 with two 4-bit codes a byte;
    ``scales``: fp32 ``(rows, blocks)``, each block's absolute maximum. Keys in torch's state
    dicts: ``momentum_buffer_codes``, ``momentum_buffer_scales`` (``momentum_buffer`` for ``mu``)."""

    mu: Updates  # fp32 where a leaf is not quantized (ndim < 2), else None
    codes: Updates  # per matrix (rows, n) int8, or (rows, ⌈n/2⌉) uint8 at 4 bits; else None
    scales: Updates  # per matrix (rows, blocks) fp32: each block's absolute maximum; else None

    state_keys = {"mu": "momentum_buffer", "codes": "momentum_buffer_codes", "scales": "momentum_buffer_scales"}  # noqa: RUF012  NamedTuple: annotated, it would be a field


MOMENTUM_STORAGE = Layout(MomentumState, QuantizedMomentumState, {"mu": _quantize.LINEAR})


def _check_momentum(momentum: Any, nesterov: Any, kind: Any, mu_dtype: Any, state_bits: Any) -> None:
    _checks.in_unit_interval("momentum", momentum)
    _checks.one_of("kind", kind, MOMENTUM_KINDS)
    _checks.boolean("nesterov", nesterov)
    check_storage(mu_dtype, state_bits)


def check_storage(mu_dtype: Any, state_bits: Any) -> None:
    """:func:`momentum`'s buffer storage: ``state_bits`` one of 32, 16, 8, 4, and no ``mu_dtype`` with another."""
    _quantize.check_state_bits(state_bits)
    if mu_dtype is not None and state_bits != 32:
        raise ValueError(f"momentum: mu_dtype={mu_dtype} and state_bits={state_bits} both set the buffer's "
                         "storage; pass one of them")


@_checks.checked(_check_momentum)
def momentum(
    momentum: Scalar = 0.95,
    *,
    nesterov: bool = True,
    kind: str = "sgd",
    mu_dtype: torch.dtype | None = None,
    state_bits: int = 32,
) -> GradientTransformation:
    """Heavy-ball momentum, optionally Nesterov.

    ``kind="sgd"``: ``b ← μb + g``; returns ``g + μb`` (Nesterov) or ``b``.
    ``kind="ema"`` (torch.optim.Muon / Keller): ``b ← lerp(b, g, 1 − μ)``; returns
    ``lerp(g, b, μ)`` (Nesterov) or ``b``. For constant μ the two differ by the factor (1 − μ),
    so they agree after any scale-invariant step such as orthogonalization.

    ``state_bits``: how the buffer is stored between steps. 32 (default): in ``mu_dtype`` (the
    parameter's by default), the arithmetic in that dtype. 16: bf16; 8 and 4: blockwise linear
    absmax codes within rows (:class:`QuantizedMomentumState`, :mod:`muon_fn.core.quantize`); the
    buffer is dequantized, updated in fp32 and requantized in the same update, and the output is
    fp32. Leaves of ndim < 2 keep an fp32 buffer at every width. ``mu_dtype`` only with 32.
    Below 32 bits this is :func:`muon_fn.core.storage.stored` around the 32-bit transform.
    """

    def init(params):
        return MomentumState(mu=_tree.zeros_like(params, dtype=mu_dtype))

    def step(b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, new buffer)``."""
        g = g.to(b.dtype)
        if kind == "ema":
            b = b.lerp(g, 1 - momentum)
            out = g.lerp(b, momentum) if nesterov else b
        else:
            b = scaled_add(g, b, momentum)
            out = scaled_add(g, b, momentum) if nesterov else b
        return out, b

    def update(updates, state, params=None, **extra):
        del params
        out, mu = _tree.map_step(lambda g, b: step(b, g), updates, state.mu)
        collector = collector_of(extra)
        if collector is not None:  # the new buffers of the leaves updated
            collector.sumsq("momentum_sumsq", _tree.tree_map(lambda g, b: None if g is None else b, updates, mu))
        return out, MomentumState(mu=mu)

    config = {"state_bits": state_bits} if state_bits != 32 else {}
    tx = with_info(GradientTransformation(init, update), leafwise=True, scope=ELEMENTWISE)
    return named(stored.build(tx, state_bits, MOMENTUM_STORAGE), "momentum", momentum=momentum, nesterov=nesterov,
                 kind=kind, **config)


def scaled_add(g: torch.Tensor, b: torch.Tensor, mu: Scalar, out: torch.Tensor | None = None) -> torch.Tensor:
    """``μ·b + g`` (into ``out`` if given; it may be ``b``), the heavy-ball arithmetic of
    :func:`momentum`. On CPU, fp32/fp64, one fused ``addcmul``
    pass (one rounding; on gpt2-small's 85 M parameters 107 instead of 151 ms for a step's two of
    them); on GPUs (and for half buffers) a multiply and an add, which accept a CPU 0-d ``μ`` next
    to device tensors (ATen builds ``addcmul`` as a ternary op, which does not allow CPU scalars);
    compiled, inductor fuses them into one kernel."""
    if b.device.type == "cpu" and b.dtype in (torch.float32, torch.float64):
        # Not for half buffers: addcmul computes in b's dtype and would round μ itself to it.
        m = mu if isinstance(mu, torch.Tensor) else torch.tensor(mu, dtype=b.dtype)
        return torch.addcmul(g, b, m) if out is None else torch.addcmul(g, b, m, out=out)
    if out is None:
        return b * mu + g
    return torch.mul(b, mu, out=out).add_(g)


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_learning_rate` with a schedule."""

    count: torch.Tensor  # shape=(), int64: number of updates so far

    state_keys = {"count": "lr_schedule_count"}  # noqa: RUF012  NamedTuple: annotated, it would be a field


def _check_learning_rate(lr: Any) -> None:
    _checks.scalar_or_schedule("lr", lr)


@_checks.checked(_check_learning_rate)
def scale_by_learning_rate(lr: ScalarOrSchedule) -> GradientTransformation:
    """``u ← −lr·u``; ``lr`` is a float, a 0-d tensor, or a schedule ``count -> lr``."""
    if callable(lr) and not isinstance(lr, torch.Tensor):
        schedule = lr

        def init(params):
            del params
            return ScaleByScheduleState(count=torch.zeros((), dtype=torch.int64))

        def update(updates, state, params=None, **extra):
            del params
            step_lr = schedule(state.count)
            out = _tree.tree_map(lambda u: None if u is None else u * -step_lr, updates)
            _record_lr(extra, updates, step_lr)
            return out, ScaleByScheduleState(count=state.count + 1)

        # Not leafwise: the count is one per tree, so updating the tree in parts would count twice.
        tx = named(GradientTransformation(init, update), "scale_by_learning_rate",
                   lr=getattr(schedule, "__name__", schedule))
        return with_info(tx, leafwise=False, scope=ELEMENTWISE)

    def update_const(updates, state, params=None, **extra):
        del params
        _record_lr(extra, updates, lr)
        return _tree.tree_map(lambda u: None if u is None else u * -lr, updates), state

    tx = named(GradientTransformation(init_empty_state, update_const), "scale_by_learning_rate", lr=lr)
    return with_info(tx, leafwise=True, scope=ELEMENTWISE)


def _record_lr(extra: dict[str, Any], updates: Updates, lr: Scalar) -> None:
    collector = collector_of(extra)
    if collector is not None:
        collector.scalar("lr", updates, lr)


def _check_weight_decay(weight_decay: Any, min_ndim: Any, cautious: Any) -> None:
    _checks.non_negative("weight_decay", weight_decay)
    if isinstance(min_ndim, bool) or not isinstance(min_ndim, int) or min_ndim < 0:
        raise ValueError(f"Invalid min_ndim: {min_ndim!r} (expected an integer >= 0)")
    _checks.boolean("cautious", cautious)


@_checks.checked(_check_weight_decay)
def add_decoupled_weight_decay(weight_decay: Scalar = 0.0, *, min_ndim: int = 0,
                               cautious: bool = False) -> GradientTransformation:
    """``u ← u + wd·p``. Followed by ``scale_by_learning_rate(lr)`` this is ``p ← p(1 − lr·wd) − lr·u``
    (decoupled decay). Placed before a preconditioner such as :func:`scale_by_adam` the same sum is
    L2 regularization instead: the gradient of ``wd/2·‖p‖²`` added to the gradient.

    ``min_ndim``: only leaves with ``ndim ≥ min_ndim`` decay (``2``: matrices, embeddings and conv
    weights decay, biases and norm gains do not, as in nanoGPT and the Hugging Face Trainer);
    ``0`` (default) decays every leaf. The rule reads each leaf's own ``ndim``, so it stays leafwise.

    ``cautious``: Cautious Weight Decay (Chen et al., arXiv:2510.12402, Algorithm 1): decay only
    the coordinates where the update and the parameter agree in sign,
    ``u ← u + wd·𝟙[u ⊙ p ≥ 0] ⊙ p``, so with the learning rate
    ``p ← p − lr·(u + wd·𝟙[u ⊙ p ≥ 0] ⊙ p)`` with ``u`` the step direction before the learning
    rate (Muon's scaled ``msign(M)``, Adam's ``m̂/(√v̂ + eps)``): place it after them. A
    coordinate where ``u`` or ``p`` is zero decays (``0 ≥ 0``). The mask compares signs, so it is
    exact in any dtype (a product ``u·p`` could underflow to 0). Elementwise with the parameter,
    so it runs on any shard.
    """
    config = {"weight_decay": weight_decay, **({"min_ndim": min_ndim} if min_ndim else {}),
              **({"cautious": True} if cautious else {})}

    if not isinstance(weight_decay, torch.Tensor) and weight_decay == 0:
        return with_info(named(identity(), "add_decoupled_weight_decay", **config),
                         leafwise=True, scope=ELEMENTWISE)

    def decay(u, p, collector=None, index=None):
        if u is None or p.ndim < min_ndim:
            return u
        p = p.to(u.dtype)
        if cautious:
            agree = torch.sign(u) * torch.sign(p) >= 0  # 𝟙[u ⊙ p ≥ 0]
            p = torch.where(agree, p, 0)
            if collector is not None:  # the decay applied: wd on the fraction that decays
                collector.put("weight_decay", index, weight_decay * agree.float().mean())
        elif collector is not None:
            collector.put("weight_decay", index, torch.as_tensor(weight_decay, dtype=torch.float32, device=u.device))
        return u + weight_decay * p

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("add_decoupled_weight_decay needs params: call update(updates, state, params)")
        collector = collector_of(extra)
        if collector is None:
            return _tree.tree_map(decay, updates, params), state
        leaves, spec = _tree.tree_flatten(updates)
        out = [decay(u, p, collector, i) for i, (u, p) in enumerate(zip(leaves, spec.flatten_up_to(params)))]
        return _tree.tree_unflatten(spec, out), state

    tx = named(GradientTransformation(init_empty_state, update), "add_decoupled_weight_decay", **config)
    return with_info(tx, leafwise=True, scope=ELEMENTWISE, needs_params=True)


def scale_by_sign() -> GradientTransformation:
    """``u ← sign(u)`` elementwise (``−1``, ``0`` or ``1``); stateless.

    AdaMuon's sign-stabilized orthogonal update (Si et al., arXiv:2507.11005, v2 onwards): the
    momentum is sign-transformed before the orthogonalization, ``O = msign(Sign(M))``, so every
    entry enters the iteration with the same magnitude. Placed between :func:`momentum` and
    :func:`muon_fn.orthogonalize` (``adamuon_sign=True`` of :func:`muon_fn.muon`).
    """

    def update(updates, state, params=None, **extra):
        del params, extra
        return _tree.tree_map(lambda u: None if u is None else torch.sign(u), updates), state

    tx = named(GradientTransformation(init_empty_state, update), "scale_by_sign")
    return with_info(tx, leafwise=True, scope=ELEMENTWISE)


class ScaleBySecondMomentState(NamedTuple):
    """State of :func:`scale_by_second_moment`."""

    nu: Updates  # like params, float32 (float64 for float64 params): EMA of the squared update

    state_keys = {"nu": "update_exp_avg_sq"}  # not AdamW's exp_avg_sq: the square of the update  # noqa: RUF012  NamedTuple: annotated, it would be a field


def _check_second_moment(beta2: Any, eps: Any) -> None:
    _checks.in_unit_interval("beta2", beta2)
    _checks.positive("eps", eps)


@_checks.checked(_check_second_moment)
def scale_by_second_moment(beta2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """AdaMuon's element-wise second moment of the (orthogonalized) update ``O``:

    ``V ← β₂·V + (1 − β₂)·O ⊙ O``,  ``Ô = O ⊘ (√V + eps)``

    without bias correction, as in the paper (Si et al., *AdaMuon: Adaptive Muon Optimizer*,
    arXiv:2507.11005; its first reference code divided ``V`` by ``1 − β₂ᵗ``): the RMS alignment
    that follows (:func:`muon_fn.align_rms`) removes any uniform scale, so ``1 − β₂ᵗ`` would only
    move ``eps``'s weight. ``beta2`` defaults to Adam's 0.999; AdaMuon (:func:`muon_fn.adamuon`)
    passes the momentum's β (0.95), as the paper does. ``V`` is kept in float32 (float64 for
    float64 parameters) and the arithmetic runs in that dtype; ``Ô`` comes back in the update's
    dtype. Elementwise: each entry from the same entry of ``O`` and ``V``.
    """

    def init(params):
        return ScaleBySecondMomentState(_tree.tree_map(
            lambda p: None if p is None else torch.zeros(
                p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device),
            params,
        ))

    def step(o, v):
        o_hi = o.to(v.dtype)
        v = beta2 * v + (1 - beta2) * o_hi * o_hi
        return (o_hi / (v.sqrt() + eps)).to(o.dtype), v

    def update(updates, state, params=None, **extra):
        del params, extra
        out, nu = _tree.map_step(step, updates, state.nu)
        return out, ScaleBySecondMomentState(nu)

    tx = named(GradientTransformation(init, update), "scale_by_second_moment", beta2=beta2, eps=eps)
    return with_info(tx, leafwise=True, scope=ELEMENTWISE)


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam` (torch.optim.AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``)."""

    count: Updates  # per leaf: shape=(), float32, on the param's device
    mu: Updates  # like params: first moment
    nu: Updates  # like params: second moment

    state_keys = {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq"}  # noqa: RUF012  NamedTuple: annotated, it would be a field


class QuantizedAdamState(NamedTuple):
    """State of :func:`scale_by_adam` with ``state_bits`` 16, 8 or 4: each moment of a matrix as
    codes and per-block scales (:mod:`muon_fn.core.quantize`; the first moment at 16 bits: bf16 in
    ``mu``); leaves of ndim < 2 keep fp32 moments in ``mu`` and ``nu``. Keys in torch's state
    dicts: ``exp_avg_codes``, ``exp_avg_scales``, ``exp_avg_sq_codes``, ``exp_avg_sq_scales``
    (``exp_avg``, ``exp_avg_sq`` for ``mu``, ``nu``; ``step`` for ``count``)."""

    count: Updates  # per leaf: shape=(), float32
    mu: Updates  # first moment where not quantized (ndim < 2: fp32; 16 bits: bf16), else None
    mu_codes: Updates  # linear absmax codes (as QuantizedMomentumState.codes), else None
    mu_scales: Updates  # (rows, blocks) fp32, else None
    nu: Updates  # second moment where not quantized (ndim < 2: fp32), else None
    nu_codes: Updates  # codes of v relative to each block's maximum (int16, int8 or two a byte)
    nu_scales: Updates  # (rows, blocks) fp32, else None

    state_keys = {"count": "step", "mu": "exp_avg", "mu_codes": "exp_avg_codes", "mu_scales": "exp_avg_scales",  # noqa: RUF012  NamedTuple: annotated, it would be a field
                  "nu": "exp_avg_sq", "nu_codes": "exp_avg_sq_codes", "nu_scales": "exp_avg_sq_scales"}


ADAM_STORAGE = Layout(ScaleByAdamState, QuantizedAdamState, {"mu": _quantize.LINEAR, "nu": _quantize.UNSIGNED})


def check_moments(betas: Any, eps: Any) -> None:
    """:func:`scale_by_adam`'s ``betas`` and ``eps`` (also the recipes' that pass them on)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair (beta1, beta2))")
    _checks.in_unit_interval("beta1", betas[0])
    _checks.in_unit_interval("beta2", betas[1])
    _checks.non_negative("eps", eps)


def _check_adam(betas: Any, eps: Any, bias_correction: Any, nesterov: Any, state_bits: Any) -> None:
    _quantize.check_state_bits(state_bits)
    check_moments(betas, eps)
    _checks.boolean("bias_correction", bias_correction)
    _checks.boolean("nesterov", nesterov)


@_checks.checked(_check_adam)
def scale_by_adam(
    betas: tuple[Scalar, Scalar] = (0.9, 0.999),
    eps: float = 1e-8,
    *,
    bias_correction: bool = True,
    nesterov: bool = False,
    state_bits: int = 32,
) -> GradientTransformation:
    """Adam's direction ``m̂ / (√v̂ + eps)``, with torch.optim.Adam's arithmetic by default.

    ``m ← lerp(m, g, 1 − β₁)``, ``v ← β₂v + (1 − β₂)g²``; ``m̂ = m / (1 − β₁ᵗ)`` and
    ``v̂ = v / (1 − β₂ᵗ)`` with ``bias_correction`` (default), else ``m̂ = m``, ``v̂ = v``.
    ``nesterov`` looks one step ahead in the numerator: ``β₁m + (1 − β₁)g`` with ``m`` the
    updated moment; with bias correction optax's form,
    ``β₁m / (1 − β₁ᵗ⁺¹) + (1 − β₁)g / (1 − β₁ᵗ)``.

    ``state_bits``: how the moments are stored between steps. 32 (default): the parameter's
    dtype, the arithmetic in it (torch.optim.AdamW's). 16, 8, 4: :class:`QuantizedAdamState`,
    blockwise within rows (:mod:`muon_fn.core.quantize`): ``m`` linear absmax (bf16 at 16 bits),
    ``v`` as a small float relative to each block's maximum (no ``v > 0`` is stored as 0); the
    moments are dequantized, updated in fp32 and requantized in the same update, and the
    direction is fp32. Leaves of ndim < 2 keep fp32 moments at every width. Below 32 bits this
    is :func:`muon_fn.core.storage.stored` around the 32-bit transform.
    """
    b1, b2 = betas

    def init(params):
        count = _tree.tree_map(
            lambda p: None if p is None else torch.zeros((), dtype=torch.float32, device=p.device), params
        )
        return ScaleByAdamState(count, _tree.zeros_like(params), _tree.zeros_like(params))

    def moments(g, count, m, v):
        """``(direction, count, new m, new v)``."""
        g = g.to(m.dtype)
        count = count + 1
        m = m.lerp(g, 1 - b1)
        v = v * b2 + (1 - b2) * g * g
        if not bias_correction:
            numerator = b1 * m + (1 - b1) * g if nesterov else m
            return numerator / (v.sqrt() + eps), count, m, v
        if nesterov:
            numerator = b1 * m / (1 - b1 ** (count + 1)) + (1 - b1) * g / (1 - b1**count)
        else:
            numerator = m / (1 - b1**count)
        bias2_sqrt = (1 - b2**count).sqrt()
        return numerator / (v.sqrt() / bias2_sqrt + eps), count, m, v

    def update(updates, state, params=None, **extra):
        del params
        res = _tree.tree_map(
            lambda g, c, m, v: (None, c, m, v) if g is None else moments(g, c, m, v),
            updates, state.count, state.mu, state.nu,
        )
        pick = lambda i: _tree.tree_map(lambda _, r: r[i], updates, res)  # noqa: E731
        collector = collector_of(extra)
        if collector is not None:  # the first moment is Adam's momentum (of the leaves updated)
            collector.sumsq("momentum_sumsq", _tree.tree_map(lambda g, r: None if g is None else r[2], updates, res))
        return pick(0), ScaleByAdamState(pick(1), pick(2), pick(3))

    options = {} if bias_correction and not nesterov else {"bias_correction": bias_correction, "nesterov": nesterov}
    options.update({"state_bits": state_bits} if state_bits != 32 else {})
    shown_betas = tuple(shown(b) for b in betas)
    tx = with_info(GradientTransformation(init, update), leafwise=True, scope=ELEMENTWISE)
    return named(stored.build(tx, state_bits, ADAM_STORAGE), "scale_by_adam", betas=shown_betas, eps=eps, **options)


def _check_layerwise(eps: Any, add_eps: Any) -> None:
    _checks.positive("eps", eps)
    _checks.boolean("add_eps", add_eps)


@_checks.checked(_check_layerwise)
def normalize_layerwise(eps: float = 1e-8, *, add_eps: bool = False) -> GradientTransformation:
    """Layer-wise gradient normalization: every tensor divided by its own norm, ``g ← g / max(‖g‖, eps)``.

    ``‖g‖`` is the L2 (Frobenius) norm of the whole leaf — one parameter's gradient, an expert
    stack included — computed in fp32 for half-precision gradients. A tensor with ``‖g‖ ≥ eps``
    comes out with norm 1 whatever its scale; zero stays zero. Stateless. Used first in a chain,
    before momentum (``layerwise_norm=True`` of :func:`muon` and :func:`triton_muon`), it gives
    every step and every layer the same weight in the moments. ``add_eps``: divide by
    ``‖g‖ + eps`` instead (the original TritonMuon kernel's form, :func:`triton_muon`).
    """

    def normalize(g: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32))
        return (g.to(norm.dtype) / (norm + eps if add_eps else norm.clamp_min(eps))).to(g.dtype)

    def update(updates, state, params=None, **extra):
        del params, extra
        return _tree.tree_map(lambda g: None if g is None else normalize(g), updates), state

    # MATRIX: the norm is over the whole leaf, so a shard alone cannot compute it.
    config = {"eps": eps, "add_eps": True} if add_eps else {"eps": eps}
    tx = named(GradientTransformation(init_empty_state, update), "normalize_layerwise", **config)
    return with_info(tx, leafwise=True, scope=MATRIX)


class NormalizeRowsState(NamedTuple):
    """State of :func:`normalize_rows`."""

    nu: Updates  # per leaf, float32: EMA of the mean square of each row; shape (out, 1, ...), or
    #              (..., out, 1) under the "experts" view; C instead of 1 for C column blocks

    state_keys = {"nu": "row_variance"}  # noqa: RUF012  NamedTuple: annotated, it would be a field


def _check_rows(beta2: Any, eps: Any, view: Any) -> None:
    _checks.in_unit_interval("beta2", beta2)
    _checks.positive("eps", eps)
    _views.check_view(view)


@_checks.checked(_check_rows)
def normalize_rows(beta2: float = 0.95, eps: float = 1e-8, *, view: View = "flatten") -> GradientTransformation:
    """NorMuon's neuron-wise normalization of an orthogonalized update ``U`` (rows = outputs).

    ``v ← lerp(v, mean_row(U²), 1 − β₂)``, ``Û = U / (√v + eps)``, then ``Û`` is rescaled to
    ``‖U‖_F`` so the update's overall size is unchanged (Li et al., arXiv:2510.05491). ``view``
    (:func:`muon_fn.orthogonalize`'s) says what a matrix is: under ``"experts"`` every matrix of a
    stack has its own rows and its own ``‖U‖_F``; under a head view every block.
    """

    def experts(p: torch.Tensor) -> bool:
        return p.ndim > 2 and _views.base(_views.view_of(view, p)) == "experts"

    def row_shape(p: torch.Tensor) -> tuple[int, ...]:
        """One entry per row of each unit: ``(out, C, 1, …)``, or ``(…, out, C)`` for a stack, with
        ``C`` column blocks (1 unless a head view cuts columns)."""
        if p.ndim < 2:
            raise ValueError(f"normalize_rows expects matrices (ndim >= 2), got a leaf of shape {tuple(p.shape)}")
        cols = _views.column_blocks(p.shape, _views.view_of(view, p))
        if experts(p):
            return tuple(p.shape[:-1]) + (cols,)
        return (p.shape[0], cols) + (1,) * (p.ndim - 2)

    def init(params):
        return NormalizeRowsState(_tree.tree_map(
            lambda p: None if p is None else torch.zeros(row_shape(p), dtype=torch.float32, device=p.device),
            params,
        ))

    def step(u, v):
        leaf_view = _views.view_of(view, u)
        if isinstance(leaf_view, _views.Heads):
            return _rows_of_units(u, v, leaf_view, experts(u), beta2, eps)
        if experts(u):
            return _rows_of_experts(u, v, beta2, eps)
        return _rows_of_matrix(u, v, beta2, eps)

    def update(updates, state, params=None, **extra):
        del params
        out, nu = _tree.map_step(step, updates, state.nu)
        collector = collector_of(extra)
        if collector is not None:
            _record_row_scales(collector, updates, nu, view, eps)
        return out, NormalizeRowsState(nu)

    # MATRIX: the rows are normalized and then rescaled to the matrix's Frobenius norm.
    tx = named(GradientTransformation(init, update), "normalize_rows", beta2=beta2, eps=eps,
               view=_views.label(view))
    # Not per_matrix: compiled, inductor generates the row sums for each tensor shape, so a part
    # of a stack rounds differently from the whole (7.5e-9 after 4 FSDP steps with 1-2 of 5
    # experts per rank); eager it is per matrix.
    return with_info(tx, leafwise=True, scope=MATRIX)


def _record_row_scales(collector, updates: Updates, nu: Updates, view: View, eps: float) -> None:
    """Each unit's smallest and largest row divisor ``√v + eps`` (telemetry: their ratio is the
    range of NorMuon's row scales, ``muon_fn.core.metrics``)."""
    leaves, spec = _tree.tree_flatten(updates)
    for i, (u, v) in enumerate(zip(leaves, spec.flatten_up_to(nu))):
        if u is None:
            continue
        leaf_view = _views.view_of(view, u)
        k = _views.column_blocks(u.shape, leaf_view)
        rows = v.reshape(-1, k).sqrt() + eps  # (count·out, column blocks)
        if not isinstance(leaf_view, _views.Heads):
            per = rows.reshape(_views.count(u.shape, leaf_view), -1)
            collector.put("row_scale_min", i, per.amin(dim=1))
            collector.put("row_scale_max", i, per.amax(dim=1))
            continue
        blocks = [rows[r, j % k] for j, (r, _) in enumerate(_views.units(u.shape, leaf_view))]
        collector.put("row_scale_min", i, torch.stack([b.min() for b in blocks]))
        collector.put("row_scale_max", i, torch.stack([b.max() for b in blocks]))


# NorMuon's row step. The sums run over contiguous fp32 copies, so a matrix's result does not
# depend on the layout its update arrives in (orthogonalize returns a tall matrix transposed; an
# expert of a stack is a contiguous slice): a reduction's rounding follows the memory order.
def _rows_of_matrix(u: torch.Tensor, v: torch.Tensor, beta2: float, eps: float):
    """``U``'s rows normalized and rescaled to ``‖U‖_F``, both norms from its row sums of squares
    (``‖Û‖² = Σ_i ‖U_i‖² / d_i²``), so the update is one pass over ``U`` after one reduction: no
    normalized copy of ``U`` has to be kept for a norm of its own."""
    dims = tuple(range(1, u.ndim))
    u32 = u.float()
    rows = u32.square().sum(dim=dims, keepdim=True)
    v = v.lerp(rows / math.prod(u.shape[1:]), 1 - beta2)
    d = v.sqrt() + eps
    scale = rows.sum().sqrt() / (rows / d.square()).sum().sqrt().clamp_min(1e-8)
    return (u32 * (scale / d)).to(u.dtype), v


def _rows_of_experts(u: torch.Tensor, v: torch.Tensor, beta2: float, eps: float):
    """:func:`_rows_of_matrix` for each matrix of an expert stack, the same formulas batched."""
    u32 = _views.matrices(u.float(), "experts")  # (E, out, in)
    rows = u32.square().sum(dim=-1, keepdim=True)  # (E, out, 1)
    v = v.lerp((rows / u32.shape[-1]).reshape(v.shape), 1 - beta2)
    d = v.reshape(rows.shape).sqrt() + eps
    scale = rows.sum(dim=(-2, -1), keepdim=True).sqrt() / (rows / d.square()).sum(
        dim=(-2, -1), keepdim=True).sqrt().clamp_min(1e-8)
    return (u32 * (scale / d)).reshape(u.shape).to(u.dtype), v


def _rows_of_units(u: torch.Tensor, v: torch.Tensor, view: _views.Heads, experts: bool, beta2: float,
                   eps: float):
    """Each unit of a head view as a matrix alone (its rows, its ``‖U‖_F``); ``v`` holds one
    column per column block."""
    cols = v.shape[-1] if experts else v.shape[1]
    v2 = v.reshape(-1, cols)  # (rows of the leaf's rows view, column blocks)
    outs, nus = [], []
    for k, (block, unit) in enumerate(zip(_views.split(u, view), _views.units(u.shape, view))):
        o, nu = _rows_of_matrix(block, v2[unit[0], k % cols:k % cols + 1], beta2, eps)
        outs.append(o)
        nus.append(nu)
    if not nus:
        return u.new_zeros(u.shape), v
    bands = [torch.cat(nus[i:i + cols], dim=1) for i in range(0, len(nus), cols)]
    return _views.join(outs, u, view), torch.cat(bands).reshape(v.shape)
