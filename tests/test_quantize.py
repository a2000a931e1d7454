"""Low-bit optimizer state (``state_bits``): the blockwise quantizer's error bounds and layout
(hypothesis), the transforms and optimizers that store their state with it, checkpoints across
widths, torch.optim.Muon export, and the state-bytes targets. FSDP: test_state_bits_fsdp.py."""

from __future__ import annotations

import pytest
import torch
from conftest import roundtrip
from hypothesis import given
from hypothesis import strategies as st

import muon_fn as mf
from muon_fn.core import quantize as Q
from muon_fn.core import tree as _tree
from muon_fn.optim import from_torch_state_dict, to_torch_state_dict

# (mantissa bits, octaves) of the small-float formats, as the module defines them.
FLOATS = {(Q.UNSIGNED, 16): (10, 31), (Q.UNSIGNED, 8): (3, 31), (Q.UNSIGNED, 4): (0, 14)}
FORMATS = [(Q.LINEAR, 8), (Q.LINEAR, 4), *FLOATS]


def sample(seed: int, rows: int, n: int, spread: float, kind: str) -> torch.Tensor:
    """Values over ``spread`` decades (signed, or non-negative for UNSIGNED), some exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen) * 10 ** (
        spread * torch.rand(rows, n, generator=gen) - spread / 2
    )
    x[torch.rand(rows, n, generator=gen) < 0.05] = 0.0
    return x.abs() if kind == Q.UNSIGNED else x


BLOCK = (
    256  # the documented block length (docs/api.md, "Low-bit state"): ⌈n/256⌉ equal blocks a row
)


def block_spans(n: int) -> list[tuple[int, int]]:
    """The documented blocks of a row of ``n`` elements, written out independently of the
    module: ``⌈n/256⌉`` blocks of ``⌈n/blocks⌉`` elements, the last one shorter."""
    count = max(1, -(-n // BLOCK))
    size = -(-n // count)
    return [(a, min(a + size, n)) for a in range(0, n, size)] or [(0, 0)]


def block_max(x: torch.Tensor) -> torch.Tensor:
    """Each element's block maximum |x| (the documented blocks within each row)."""
    out = torch.empty_like(x)
    for a, b in block_spans(x.shape[1]):
        out[:, a:b] = x[:, a:b].abs().amax(dim=1, keepdim=True) if b > a else 0.0
    return out


def roundtrip_q(x: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    storage = Q.Storage(bits, kind)
    codes, scales = Q.encode(x, storage)
    return Q.decode(codes, scales, tuple(x.shape), storage)


@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(0, 4),
    n=st.integers(1, 700),
    spread=st.floats(0.0, 12.0),
    fmt=st.sampled_from(FORMATS),
)
def test_error_bounds(seed, rows, n, spread, fmt):
    """Per block with maximum M: linear codes are within M/(2q) of x; small floats within
    2^-(m+1)·x for x ≥ 2^-R·M, and a positive x below it becomes 2^-R·M (never 0); signs are
    kept; zeros stay zero."""
    kind, bits = fmt
    x = sample(seed, rows, n, spread, kind)
    y = roundtrip_q(x, kind, bits)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))
    assert bool(((x * y) >= 0).all())
    big = block_max(x)
    tol = 1 + 1e-6
    if kind == Q.LINEAR:
        q = 127 if bits == 8 else 7
        assert bool(((y - x).abs() <= big / (2 * q) * tol + 1e-37).all())
        return
    m, octaves = FLOATS[fmt]
    floor = big * 2.0**-octaves
    inside = x.abs() >= floor
    assert bool(((y - x).abs()[inside] <= x.abs()[inside] * 2.0 ** -(m + 1) * tol).all())
    below = ~inside & (x != 0)
    assert bool((y[below] > 0).all()) and bool((y[below] <= floor[below] * tol).all())
    assert torch.equal(
        y.abs().amax(dim=1) if rows else y, x.abs().amax(dim=1) if rows else x
    )  # M is exact


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 255, 256, 257, 300, 512, 700])
def test_scales_are_the_documented_blocks_maxima(n, fmt):
    """One scale per documented block, its absolute maximum; and a block of small values next
    to a block of large ones keeps its own precision (a longer block would share the large one's
    scale and break the bound)."""
    kind, bits = fmt
    x = sample(n, 3, n, 6.0, kind)
    x[:, : n // 2] *= 1e-3
    _, scales = Q.encode(x, Q.Storage(bits, kind))
    spans = block_spans(n)
    assert scales.shape == (3, len(spans))
    want = torch.stack([x[:, a:b].abs().amax(dim=1) for a, b in spans], dim=1)
    torch.testing.assert_close(scales, want, rtol=0, atol=0)
    y = roundtrip_q(x, kind, bits)
    if kind == Q.LINEAR:
        q = 127 if bits == 8 else 7
        assert bool(((y - x).abs() <= block_max(x) / (2 * q) * (1 + 1e-6) + 1e-37).all())


@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 9),
    n=st.integers(1, 600),
    fmt=st.sampled_from(FORMATS),
    cut=st.integers(0, 9),
)
def test_rows_quantize_alone(seed, rows, n, fmt, cut):
    """Blocks lie within rows: any block of rows (a rank's FSDP shard, possibly empty) gets the
    codes and scales the whole tensor gives those rows, bit for bit."""
    kind, bits = fmt
    x = sample(seed, rows, n, 6.0, kind)
    storage = Q.Storage(bits, kind)
    codes, scales = Q.encode(x, storage)
    a = min(cut, rows)
    part_codes, part_scales = Q.encode(x[a:], storage)
    assert torch.equal(part_codes, codes[a:]) and torch.equal(part_scales, scales[a:])
    assert scales.shape == (rows, Q.blocks(n)) and scales.dtype == torch.float32
    assert codes.shape == storage.codes_shape((rows, n)) and codes.dtype == Q.CODE_DTYPES[bits]


@given(
    rows=st.integers(0, 3), n=st.integers(1, 41), signed=st.booleans(), seed=st.integers(0, 2**16)
)
def test_pack4_roundtrip(rows, n, signed, seed):
    gen = torch.Generator().manual_seed(seed)
    lo = -7 if signed else 0
    codes = torch.randint(lo, 8 if signed else 16, (rows, n), generator=gen, dtype=torch.int32)
    packed = Q._pack4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, (n + 1) // 2)
    assert torch.equal(Q._unpack4(packed, n, signed=signed), codes)


def test_zero_blocks_and_extremes():
    """A zero block is zero codes and a zero scale; huge, tiny and subnormal values stay finite
    and keep their sign; a block's maximum comes back exactly (small floats)."""
    x = torch.tensor(
        [[0.0] * 6, [3e38, -1e-30, 1e-44, 0.0, -3e38, 1.0], [1e-40, -1e-41, 0.0, 0.0, 0.0, 1e-45]]
    )
    for kind, bits in FORMATS:
        if kind == Q.UNSIGNED:
            xx = x.abs()
        else:
            xx = x
        storage = Q.Storage(bits, kind)
        codes, scales = Q.encode(xx, storage)
        y = Q.decode(codes, scales, tuple(xx.shape), storage)
        assert bool(torch.isfinite(y).all()), (kind, bits, y)
        assert float(scales[0].abs().max()) == 0.0 and not bool(y[0].any())
        assert bool(((xx * y) >= 0).all())
        if kind != Q.LINEAR:
            assert float(y[1].abs().max()) == float(xx[1].abs().max())


# Golden codes: what a checkpoint holds for fixed inputs, pinned so that no version decodes another's
# codes differently. Worked out by hand from the module's formulas: linear ``round(x·q/M)``
# (half to even; rows with M/q a power of two decode exactly); small floats ``1 + (R + log2 r)·2^m +
# mantissa`` minus the width's offset (8 bits: 128), the 4-bit ones two a byte, low nibble first.
UNSIGNED_ROWS = [
    [1.0, 0.5, 0.3, 0.0, 2.0**-31, 1e-12, 0.75, 0.1],
    [8.0, 3.0, 0.0, 1.0, 0.001, 6.0, 2.0**-11, 0.5],
]
GOLDEN = {  # (kind, bits): (input, codes, scales, decoded)
    (Q.LINEAR, 8): (
        [
            [127.0, -63.5, 0.0, 1.0, -0.4, 64.5, -127.0, 0.6],
            [0.9921875, -0.5, 0.25, 0.0, 0.00390625, -0.9921875, 0.1, 0.0],
        ],
        [[127, -64, 0, 1, 0, 64, -127, 1], [127, -64, 32, 0, 0, -127, 13, 0]],
        [[127.0], [0.9921875]],
        [
            [127.0, -64.0, 0.0, 1.0, 0.0, 64.0, -127.0, 1.0],
            [0.9921875, -0.5, 0.25, 0.0, 0.0, -0.9921875, 0.1015625, 0.0],
        ],
    ),
    (Q.LINEAR, 4): (
        [[7.0, -3.5, 2.5, -7.0, 1.49], [0.875, -0.4375, 0.0625, 0.1, -0.2]],
        [[199, 146, 1], [199, 16, 14]],  # (7, -4), (2, -7), (1, pad); (7, -4), (0, 1), (-2, pad)
        [[7.0], [0.875]],
        [[7.0, -4.0, 2.0, -7.0, 1.0], [0.875, -0.5, 0.0, 0.125, -0.25]],
    ),
    (Q.UNSIGNED, 16): (
        UNSIGNED_ROWS,
        [
            [31745, 30721, 29902, 0, 1, 1, 31233, 28263],
            [31745, 30209, 0, 28673, 18458, 31233, 17409, 27649],
        ],
        [[1.0], [8.0]],
        [
            [1.0, 0.5, 0.300048828125, 0.0, 2.0**-31, 2.0**-31, 0.75, 0.0999755859375],
            [8.0, 3.0, 0.0, 1.0, 0.0010004043579101562, 6.0, 2.0**-11, 0.5],
        ],
    ),
    (Q.UNSIGNED, 8): (
        UNSIGNED_ROWS,
        [[121, 113, 107, -128, -127, -127, 117, 94], [121, 109, -128, 97, 17, 117, 9, 89]],
        [[1.0], [8.0]],
        [
            [1.0, 0.5, 0.3125, 0.0, 2.0**-31, 2.0**-31, 0.75, 0.1015625],
            [8.0, 3.0, 0.0, 1.0, 2.0**-10, 6.0, 2.0**-11, 0.5],
        ],
    ),
    (Q.UNSIGNED, 4): (
        [[1.0, 0.5, 0.3, 0.0, 2.0**-14], [8.0, 6.0, 1e-9, 0.75, 3.0]],
        [[239, 13, 1], [255, 193, 14]],  # (15, 14), (13, 0), (1, pad); (15, 15), (1, 12), (14, pad)
        [[1.0], [8.0]],
        [[1.0, 0.5, 0.25, 0.0, 2.0**-14], [8.0, 8.0, 2.0**-11, 1.0, 4.0]],
    ),
}


@pytest.mark.parametrize("fmt", list(GOLDEN), ids=lambda f: f"{f[0]}{f[1]}")
def test_golden_codes(fmt):
    """Fixed inputs give exactly these codes (dtype included), scales and decoded values."""
    kind, bits = fmt
    x, codes, scales, decoded = GOLDEN[fmt]
    storage = Q.Storage(bits, kind)
    got_codes, got_scales = Q.encode(torch.tensor(x), storage)
    assert got_codes.dtype == Q.CODE_DTYPES[bits]
    assert (got_codes.tolist(), got_scales.tolist()) == (codes, scales)
    stored = torch.tensor(codes, dtype=Q.CODE_DTYPES[bits])
    assert Q.decode(stored, torch.tensor(scales), (2, len(x[0])), storage).tolist() == decoded


def test_golden_bf16_momentum():
    """16-bit linear state (a momentum) is stored as bf16, round to nearest even: its bits pinned."""
    storage = Q.Storage(16, Q.LINEAR)
    x = torch.tensor([[1.0, -0.3, 3.0e-3, 0.0, 65504.0]])
    plain, codes, scales = storage.store(x, storage.init(x))
    assert codes is None and scales is None and plain.dtype == torch.bfloat16
    assert plain.view(torch.int16).tolist() == [[16256, -16742, 15173, 0, 18304]]
    assert storage.load((plain, None, None), x.shape, torch.float32).tolist() == [
        [1.0, -0.30078125, 0.0030059814453125, 0.0, 65536.0]
    ]


def test_storage_layout_and_bytes():
    """What each width stores for a matrix and for a 1-D tensor, and nbytes equals it."""
    p = torch.empty(10, 3, 100)  # rows of 300: blocks(300) of 150 at BLOCK 256
    one = torch.empty(7)
    shapes = {}
    for bits in Q.STATE_BITS:
        for kind in Q.KINDS:
            storage = Q.Storage(bits, kind)
            stored = storage.init(p)
            shapes[bits, kind] = [None if t is None else (tuple(t.shape), t.dtype) for t in stored]
            assert sum(t.numel() * t.element_size() for t in stored if t is not None) == Q.nbytes(
                p.shape, bits, kind
            )
            flat = storage.init(one)
            assert flat[0].dtype == torch.float32 and flat[1] is None  # ndim < 2: full precision
    assert shapes[8, Q.LINEAR] == [None, ((10, 300), torch.int8), ((10, 2), torch.float32)]
    assert shapes[4, Q.UNSIGNED] == [None, ((10, 150), torch.uint8), ((10, 2), torch.float32)]
    assert shapes[16, Q.LINEAR] == [((10, 3, 100), torch.bfloat16), None, None]
    assert shapes[16, Q.UNSIGNED] == [None, ((10, 300), torch.int16), ((10, 2), torch.float32)]
    assert shapes[32, Q.UNSIGNED] == [((10, 3, 100), torch.float32), None, None]


# ------------------------------------------------------------------------------ transforms
def tree(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 300, generator=gen),
        "conv": torch.randn(4, 2, 3, 3, generator=gen),
        "b": torch.randn(8, generator=gen),
    }


@pytest.mark.parametrize("bits", (16, 8, 4))
@pytest.mark.parametrize(
    "make",
    (lambda b: mf.momentum(0.9, state_bits=b), lambda b: mf.scale_by_adam(state_bits=b)),
    ids=("momentum", "adam"),
)
def test_transform_close_to_fp32(make, bits):
    """Ten steps at ``bits`` stay near the fp32 state's (a relative tolerance per width); 1-D
    leaves are exact (full precision)."""
    params = tree()
    tx, ref = make(bits), make(32)
    st_q, st_r = tx.init(params), ref.init(params)
    for t in range(10):
        grads = {k: v * (1 + t % 3) for k, v in tree(t + 1).items()}
        out, st_q = tx.update(grads, st_q, params)
        want, st_r = ref.update(grads, st_r, params)
    tol = {16: 0.01, 8: 0.06, 4: 0.5}[bits]
    for k in ("w", "conv"):
        assert float((out[k] - want[k]).norm() / want[k].norm()) < tol, k
    assert torch.equal(out["b"], want["b"].float())


def test_state_structure():
    """The quantized states' classes, keys (torch's names with _codes / _scales) and leaves."""
    params = tree()
    mom = mf.momentum(state_bits=8).init(params)
    assert isinstance(mom, mf.QuantizedMomentumState)
    assert mom.mu["w"] is None and mom.mu["b"].dtype == torch.float32
    assert (
        mom.codes["w"].shape == (8, 300)
        and mom.codes["conv"].shape == (4, 18)
        and mom.codes["b"] is None
    )
    assert mf.QuantizedMomentumState.state_keys["codes"] == "momentum_buffer_codes"
    assert isinstance(mf.momentum(state_bits=16).init(params), mf.MomentumState)
    adam = mf.scale_by_adam(state_bits=4).init(params)
    assert isinstance(adam, mf.QuantizedAdamState)
    assert adam.nu_codes["w"].shape == (8, 150) and adam.nu_codes["w"].dtype == torch.uint8
    assert "state_bits=8" in repr(mf.muon(state_bits=8)) and "state_bits" not in repr(mf.muon())
    with pytest.raises(
        ValueError, match=r"Invalid state_bits: 12 \(expected one of 32, 16, 8, 4\)"
    ):
        mf.momentum(state_bits=12)
    with pytest.raises(ValueError, match=r"mu_dtype=torch\.bfloat16 and state_bits=8"):
        mf.momentum(mu_dtype=torch.bfloat16, state_bits=8)


@pytest.mark.inductor
@pytest.mark.slow
def test_compiled_matches_eager():
    """A 4-bit momentum and 8-bit Adam moments in one partition, compiled (inductor, fullgraph)
    and eager: the same state codes up to one step of a code, the same update to fp tolerance."""
    params = {"w": torch.randn(16, 300), "e": torch.randn(40, 24), "b": torch.randn(16)}
    labels = {"w": "muon", "e": "adamw", "b": "adamw"}
    for tx in [
        mf.partition(
            {"muon": mf.momentum(state_bits=4), "adamw": mf.scale_by_adam(state_bits=8)}, labels
        )
    ]:
        step = mf.compile_update(tx, backend="inductor").update
        st_e = st_c = tx.init(params)
        for _ in range(3):
            grads = {k: torch.randn_like(v) for k, v in params.items()}
            ue, st_e = tx.update(grads, st_e, params)
            uc, st_c = step(grads, st_c, params)
            for k in params:
                torch.testing.assert_close(uc[k], ue[k], rtol=1e-4, atol=1e-5)
        for a, b in zip(_tree.tree_leaves(st_c), _tree.tree_leaves(st_e)):
            if a is not None and not a.is_floating_point():
                assert int((a.int() - b.int()).abs().max()) <= 1


# ------------------------------------------------------------------------------ optimizers
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 300)
        self.fc1 = torch.nn.Linear(300, 40)
        self.fc2 = torch.nn.Linear(40, 32, bias=False)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(self.emb(x))))


def step(model, opt, t):
    gen = torch.Generator().manual_seed(t)
    x = torch.randint(0, 32, (16,), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 32, (16,), generator=gen))
    opt.zero_grad()
    loss.backward()
    opt.step()


def hybrid(bits, **kw):
    model = Net()
    return model, mf.create_hybrid_optimizer(model, state_bits=bits, **kw)


@pytest.mark.parametrize("bits", (8, 4))
def test_state_dict_roundtrip(bits):
    """Save after 2 steps, load into a fresh optimizer (through torch.save): the next steps equal
    the uninterrupted run's bit for bit; the codes stay integers."""
    model, opt = hybrid(bits)
    for t in range(2):
        step(model, opt, t)
    saved, weights = (
        roundtrip(opt.state_dict()),
        {k: v.clone() for k, v in model.state_dict().items()},
    )
    for t in range(2, 4):
        step(model, opt, t)
    model2, opt2 = hybrid(bits)
    model2.load_state_dict(weights)
    opt2.load_state_dict(saved)
    codes = opt2.state[model2.fc1.weight]["momentum_buffer_codes"]
    assert codes.dtype == Q.CODE_DTYPES[bits]
    for t in range(2, 4):
        step(model2, opt2, t)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def entry(opt, key, shape):
    """The state dict of ``opt``'s parameter whose ``key`` has ``shape``."""
    return next(st for st in opt.state.values() if key in st and tuple(st[key].shape) == shape)


def test_checkpoints_across_widths():
    """A checkpoint loads at another width, converted (the loading optimizer keeps its
    state_bits): fp32 → 8-bit quantizes, 8-bit → fp32 dequantizes exactly, 8 → 4 → 8 requantizes."""
    model, opt32 = hybrid(32)
    for t in range(2):
        step(model, opt32, t)
    p = model.fc1.weight
    fp32 = opt32.state[p]["momentum_buffer"].clone()
    _, opt8 = hybrid(8)
    opt8.load_state_dict(opt32.state_dict())
    assert (
        opt8.param_groups[0]["state_bits"] == 8
        and "momentum_buffer" not in opt8.state[next(iter(opt8.state))]
    )
    q8 = entry(opt8, "momentum_buffer_codes", (40, 300))
    value8 = Q.decode(
        q8["momentum_buffer_codes"], q8["momentum_buffer_scales"], (40, 300), Q.Storage(8, Q.LINEAR)
    )
    assert float((value8 - fp32).abs().max()) <= float(fp32.abs().max()) / 254 * 1.01
    _, back = hybrid(32)
    back.load_state_dict(opt8.state_dict())
    restored = entry(back, "momentum_buffer", (40, 300))["momentum_buffer"]
    assert torch.equal(restored, value8)  # dequantized exactly as the 8-bit step would
    emb = entry(back, "exp_avg_sq", (32, 300))
    assert emb["exp_avg_sq"].dtype == torch.float32 and bool((emb["exp_avg_sq"] >= 0).all())
    model4, opt4 = hybrid(4)
    opt4.load_state_dict(opt8.state_dict())
    model8, again = hybrid(8)
    again.load_state_dict(opt4.state_dict())
    q4 = entry(opt4, "momentum_buffer_codes", (40, 150))
    value4 = Q.decode(
        q4["momentum_buffer_codes"], q4["momentum_buffer_scales"], (40, 300), Q.Storage(4, Q.LINEAR)
    )
    assert float((value4 - value8).abs().max()) <= float(value8.abs().max()) / 14 * 1.01
    for m, o in ((model4, opt4), (model8, again)):  # the converted optimizers step
        step(m, o, 2)
        assert all(bool(torch.isfinite(q).all()) for q in m.parameters())


def test_state_bits_changed_between_steps():
    """Setting a group's state_bits between steps converts its state (no restart from zero): the
    next step's momentum is the fp32 run's, up to the 8-bit error."""
    (model, opt), (ref, ref_opt) = hybrid(32), hybrid(32)
    for t in range(2):
        step(model, opt, t)
        step(ref, ref_opt, t)
    for group in opt.param_groups:
        group["state_bits"] = 8
    step(model, opt, 2)
    step(ref, ref_opt, 2)
    st = entry(opt, "momentum_buffer_codes", (40, 300))
    assert "momentum_buffer" not in st
    got = Q.decode(
        st["momentum_buffer_codes"], st["momentum_buffer_scales"], (40, 300), Q.Storage(8, Q.LINEAR)
    )
    want = entry(ref_opt, "momentum_buffer", (40, 300))["momentum_buffer"]
    assert float((got - want).norm() / want.norm()) < 0.02


def test_torch_muon_export_and_import():
    """An 8-bit MuonOptimizer exports a torch.optim.Muon state_dict with the dequantized
    momentum (fp32), which torch.optim.Muon loads; importing it into a 4-bit optimizer quantizes it."""
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(24, 300)), torch.nn.Parameter(torch.randn(300, 24))]
    opt = mf.MuonOptimizer(ws, state_bits=8)
    for _ in range(2):
        for w in ws:
            w.grad = torch.randn_like(w)
        opt.step()
    muon_sd, adamw_sd = to_torch_state_dict(opt)
    assert adamw_sd is None
    buf = muon_sd["state"][0]["momentum_buffer"]
    st = opt.state[ws[0]]
    want = Q.decode(
        st["momentum_buffer_codes"], st["momentum_buffer_scales"], (24, 300), Q.Storage(8, Q.LINEAR)
    )
    assert buf.dtype == torch.float32 and torch.equal(buf, want)
    torch_opt = torch.optim.Muon(ws)
    torch_opt.load_state_dict(muon_sd)
    opt4 = mf.MuonOptimizer(ws, state_bits=4)
    opt4.load_state_dict(from_torch_state_dict(opt4, torch_opt.state_dict()))
    assert sorted(opt4.state[ws[0]]) == ["momentum_buffer_codes", "momentum_buffer_scales"]
    assert opt4.param_groups[0]["state_bits"] == 4


class Pair(torch.nn.Module):
    """An embedding and a bias-free linear layer: few buckets, for the compiled check."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 300)
        self.fc = torch.nn.Linear(300, 40, bias=False)


@pytest.mark.parametrize(
    "build",
    [
        lambda m, bits, **kw: mf.MuonOptimizer(m.parameters(), state_bits=bits, **kw),
        lambda m, bits, **kw: mf.create_hybrid_optimizer(m, state_bits=bits, **kw),
        lambda m, bits, **kw: mf.SpectralSphereOptimizer(m.parameters(), state_bits=bits, **kw),
        lambda m, bits, **kw: mf.TritonMuonW(m.parameters(), state_bits=bits, **kw),
        lambda m, bits, **kw: mf.TritonMuon(m.parameters(), state_bits=bits, **kw),
    ],
    ids=("MuonOptimizer", "hybrid", "SpectralSphereOptimizer", "TritonMuonW", "TritonMuon"),
)
def test_every_class(build):
    """Every optimizer class takes state_bits and steps with it, eager and traced whole by dynamo
    (``fullgraph``, the eager backend: no graph break), and refuses a bad value naming it."""
    for bits, kw, model in (
        (16, {}, Net()),
        (8, {}, Net()),
        (4, {}, Net()),
        (8, {"compile": {"backend": "eager"}}, Pair()),
    ):
        opt = build(model, bits, **kw)
        model_params = [p for g in opt.param_groups for p in g["params"]]
        for _ in range(2):
            for p in model_params:
                p.grad = torch.randn_like(p)
            opt.step()
        assert all(torch.isfinite(p).all() for p in model_params)
    for bad in (7, True, "8"):
        with pytest.raises(ValueError, match=f"Invalid state_bits: {bad!r}"):
            build(Net(), bad)


def test_momentum_dtype_with_state_bits_refused():
    with pytest.raises(ValueError, match=r"momentum_dtype=torch\.float32 and state_bits=8"):
        mf.MuonOptimizer(Net().parameters(), state_bits=8, momentum_dtype=torch.float32)


# ------------------------------------------------------------------------------ targets
def state_bytes(opt) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def test_state_bytes_targets():
    """8-bit: Muon momentum ≤ 0.27× fp32 (scales included) on gpt2-small's matrices, the hybrid's
    whole state ≤ 0.30× on gpt2-small with its 50257-token embedding (shapes only, nbytes), and
    what an optimizer allocates equals nbytes."""
    d, f, vocab = 768, 3072, 50257
    matrices = [(d, d)] * 4 + [(f, d), (d, f)]
    muon = lambda bits: 12 * sum(Q.nbytes(s, bits, Q.LINEAR) for s in matrices)  # noqa: E731
    assert muon(8) / muon(32) <= 0.27 and muon(4) / muon(32) <= 0.15
    adamw_shapes = [(vocab, d), (1024, d)] + [(d,)] * (12 * 13 + 2)
    adam = lambda bits: sum(  # noqa: E731
        Q.nbytes(s, bits, Q.LINEAR) + Q.nbytes(s, bits, Q.UNSIGNED) + 4 for s in adamw_shapes
    )
    assert (muon(8) + adam(8)) / (muon(32) + adam(32)) <= 0.30
    model, opt = hybrid(8)
    step(model, opt, 0)
    expected = sum(Q.nbytes(p.shape, 8, Q.LINEAR) for p in opt.param_groups[0]["params"])
    expected += sum(
        Q.nbytes(p.shape, 8, Q.LINEAR) + Q.nbytes(p.shape, 8, Q.UNSIGNED) + 4
        for p in opt.param_groups[1]["params"]
    )
    rows = sum(
        4 * p.shape[0] for p in opt.param_groups[0]["params"]
    )  # NorMuon's fp32 row statistics
    assert state_bytes(opt) == expected + rows


def test_planner_counts_the_state():
    """plan_model and `muon-fn plan --state-bits` count the smaller state (Muon momentum and AdamW
    moments of every rank's rows): 8-bit is about a quarter of fp32 on every rank."""
    from muon_fn.fsdp import format_plan, plan_model

    full, low = (plan_model("llama3-8b", "dp=8", state_bits=b) for b in (32, 8))
    assert len(full.state) == 8 and all(
        0.25 <= q / f <= 0.26 for q, f in zip(low.state, full.state)
    )
    adamw = (
        2 * 128256 * 4096 + 65 * 4096
    )  # embedding, head, 65 norms: two fp32 moments, a step per rank each
    assert sum(full.state) == 4 * sum(p.numel for p in full.plan.matrices) + 8 * adamw + 8 * 4 * 67
    assert "state/rank max (8-bit)" in format_plan([low]) and "state/rank" not in format_plan(
        [plan_model("tiny", 2)]
    )
