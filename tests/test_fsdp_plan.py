"""The FSDP2 owner-computes planner: pure, no processes."""

from __future__ import annotations

import pytest
import torch

from muon_fn.distributed import _plan
from muon_fn.distributed._plan import chunk_rows, lpt_owners, make_buckets, make_plan, ns_cost

GPT2_SMALL = [(768, 768)] * 4 + [(3072, 768), (768, 3072)]


@pytest.mark.parametrize("m", [0, 1, 2, 3, 5, 10, 17, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_chunk_rows_matches_torch_chunk_and_tensor_split_of_dtensor(m, world_size):
    chunks = torch.arange(m).chunk(world_size) if m else ()
    expected = [(int(c[0]), int(c[-1]) + 1) if c.numel() else None for c in chunks]
    rows = chunk_rows(m, world_size)
    assert len(rows) == world_size
    for r, (start, stop) in enumerate(rows):
        if r < len(expected) and expected[r] is not None:
            assert (start, stop) == expected[r]
        else:
            assert start == stop  # empty shard (torch.chunk returned fewer chunks)
    # Contiguous tiling of [0, m).
    assert rows[0][0] == 0 and rows[-1][1] == m
    assert all(rows[r][1] == rows[r + 1][0] for r in range(world_size - 1))


def test_chunk_rows_fsdp2_figures():
    # FSDP2's row layout (torch.chunk), as docs/distributed.md states it ("How a step works").
    sizes = lambda m, w: [b - a for a, b in chunk_rows(m, w)]  # noqa: E731
    assert sizes(10, 4) == [3, 3, 3, 1]
    assert sizes(10, 2) == [5, 5]
    assert sizes(3, 4) == [1, 1, 1, 0]
    assert sizes(5, 4) == [2, 2, 1, 0]
    assert sizes(1, 4) == [1, 0, 0, 0]


def test_chunk_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size: 0"):
        chunk_rows(3, 0)
    with pytest.raises(ValueError, match="rows: -1"):
        chunk_rows(-1, 2)


def test_lpt_is_deterministic_and_balances():
    costs = [5, 5, 4, 4, 3, 3, 2, 2, 1, 1]
    owners = lpt_owners(costs, 2)
    assert owners == lpt_owners(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert loads == [15, 15]
    # Ties: equal costs go to the lowest rank first, in index order.
    assert lpt_owners([1, 1, 1], 4) == [0, 1, 2]


def test_make_buckets_contiguous_reverse_and_balanced():
    buckets = make_buckets([1] * 12, 4)
    assert buckets == [[11, 10, 9], [8, 7, 6], [5, 4, 3], [2, 1, 0]]
    assert make_buckets([1, 1], 4) == [[1], [0]]
    assert make_buckets([], 3) == []
    with pytest.raises(ValueError, match="num_buckets: 0"):
        make_buckets([1], 0)


def _check_plan_consistency(plan, shapes):
    w = plan.world_size
    assert sorted(j for b in plan.buckets for j in b.matrices) == list(range(len(shapes)))
    for mp in plan.matrices:
        assert 0 <= mp.owner < w
        # Contributions tile [0, m) exactly once.
        covered = sorted(r for r in mp.contrib if r[1] > r[0])
        assert sum(b - a for a, b in covered) == mp.rows
    for b in plan.buckets:
        for r in range(w):
            # What r sends equals what the others expect from r, both directions.
            assert sum(b.gather_send(r)) == sum(
                plan.matrices[j].contrib_numel(r) for j in b.matrices
            )
            assert sum(b.scatter_recv(r)) == sum(
                plan.matrices[j].receive_numel(r) for j in b.matrices
            )
            owned = [j for j in b.matrices if plan.matrices[j].owner == r]
            assert sum(b.gather_recv(r)) == sum(plan.matrices[j].numel for j in owned)
        total_gather = sum(map(sum, b.gather))
        assert total_gather == sum(plan.matrices[j].numel for j in b.matrices)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_plan_uneven_and_empty_shards(world_size):
    shapes = [(10, 6), (3, 6), (6, 10), (1, 5), (5, 1), (7, 7), (50, 17), (17, 50), (4, 3, 2, 2)]
    plan = make_plan(shapes, world_size, num_buckets=3)
    _check_plan_consistency(plan, shapes)
    assert plan == make_plan(shapes, world_size, num_buckets=3)  # deterministic
    conv = plan.matrices[8]
    assert (conv.rows, conv.cols) == (4, 12)
    if world_size == 4:
        assert [b - a for a, b in plan.matrices[0].contrib] == [3, 3, 3, 1]
        assert [b - a for a, b in plan.matrices[1].contrib] == [1, 1, 1, 0]


def test_plan_split_sizes_by_hand():
    # Two matrices on 2 ranks, one bucket: LPT gives the costlier 3x2 to rank 0, the 2x2 to rank 1.
    plan = make_plan([(3, 2), (2, 2)], 2, num_buckets=1)
    a, b = plan.matrices
    assert ns_cost((3, 2)) == 4 * 2 * 2 * 3 + 2 * 2**3 == 64 and ns_cost((2, 2)) == 48  # 4s²l + 2s³
    assert (a.owner, b.owner) == (0, 1)
    (bucket,) = plan.buckets
    # 3x2 rows: rank 0 has 2 rows (4 elems), rank 1 has 1 row (2 elems); 2x2: one row each.
    assert bucket.gather == ((4, 2), (2, 2))
    assert bucket.scatter == ((4, 2), (2, 2))
    assert bucket.gather_recv(0) == [4, 2] and bucket.gather_recv(1) == [2, 2]


def test_an_expert_stack_travels_as_rows_of_whole_experts_and_costs_its_matrices():
    """(E, out, in) sharded by fully_shard: rows are experts (each row out*in elements); the
    owner gets the whole stack. Under "experts" it costs E matrices out x in, not one E x out*in."""
    plan = make_plan([(5, 8, 6), (40, 6)], 2, num_buckets=1, views=["experts", "flatten"])
    stack, flat = plan.matrices
    assert (stack.rows, stack.cols, stack.contrib) == (5, 48, ((0, 3), (3, 5)))
    assert (
        stack.cost
        == ns_cost((5, 8, 6), "experts")
        == 5 * ns_cost((8, 6))
        == 5 * (4 * 6 * 6 * 8 + 2 * 6**3)
    )
    assert ns_cost((5, 8, 6)) == 4 * 5 * 5 * 48 + 2 * 5**3  # flattened: one 5x48 matrix
    assert flat.cost == ns_cost((40, 6)) and stack.owner != flat.owner
    loads = plan.load()
    assert (loads[stack.owner], loads[flat.owner]) == (stack.cost, flat.cost)


def test_plan_replicated_matrix_comes_back_whole():
    plan = make_plan([(4, 3)], 3, replicated=[True])
    (mp,) = plan.matrices
    (bucket,) = plan.buckets
    o = mp.owner
    assert [mp.contrib_numel(r) for r in range(3)] == [12 if r == o else 0 for r in range(3)]
    assert all(mp.receive_numel(r) == 12 for r in range(3))
    assert bucket.gather[o][o] == 12 and sum(map(sum, bucket.gather)) == 12
    assert bucket.scatter[o] == (12, 12, 12)
    assert plan.sent_elements(o) == 24 and plan.sent_elements((o + 1) % 3) == 0


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_gpt2_small_balance_and_bytes_formula(world_size):
    shapes = GPT2_SMALL * 12
    plan = make_plan(shapes, world_size, num_buckets=4)
    loads = plan.load()
    assert max(loads) / (sum(loads) / world_size) <= 1.10
    total = sum(mp.numel for mp in plan.matrices)
    # Owner computes: every shard not owned travels to the owner and back.
    expected = 2 * (world_size - 1) * total / world_size**2
    sent = [plan.sent_elements(r) for r in range(world_size)]
    assert sum(sent) / world_size == pytest.approx(expected, rel=1e-12)
    assert max(sent) / expected < 1.05
    # Every bucket gives every rank work.
    for b in plan.buckets:
        assert {plan.matrices[j].owner for j in b.matrices} == set(range(world_size))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_units_share_an_owner_and_a_bucket_and_keep_their_order(world_size):
    """The FSDP adapter's units are single-device buckets (same shape, at most 4): their matrices
    are computed together by one owner. On gpt2-small: the best any assignment of these units can
    do (FLOPs 192/180 at W = 4: 6 units of 72 and 12 of 24 in units of 768³ FLOPs per step)."""
    from muon_fn.core.muon import group_by

    shapes = GPT2_SMALL * 12
    units = group_by(shapes, 4)
    plan = make_plan(shapes, world_size, num_buckets=4, units=units)
    for unit in units:
        assert len({(plan.matrices[j].owner, plan.matrices[j].bucket) for j in unit}) == 1
        members = plan.buckets[plan.matrices[unit[0]].bucket].matrices
        start = members.index(unit[0])
        assert list(members[start : start + len(unit)]) == unit
    loads = plan.load()
    assert (
        max(loads) / (sum(loads) / world_size) <= {2: 1.0, 3: 1.0, 4: 192 / 180}[world_size] + 1e-12
    )
    total = sum(mp.numel for mp in plan.matrices)
    assert sum(plan.sent_elements(r) for r in range(world_size)) / world_size == pytest.approx(
        2 * (world_size - 1) * total / world_size**2, rel=1e-12
    )


def test_units_must_cover_every_matrix_once():
    with pytest.raises(ValueError, match=r"units must hold every matrix index 0\.\.2 once"):
        make_plan([(2, 2)] * 3, 2, units=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="units must hold"):
        make_plan([(2, 2)] * 2, 2, units=[[0, 1], []])


def test_plan_extra_cols_per_matrix():
    plan = make_plan([(6, 4), (4, 4)], 2, extra_cols=[5, 0])
    assert [mp.cols for mp in plan.matrices] == [9, 4]
    with pytest.raises(ValueError, match="extra_cols has 1 entries for 2 shapes"):
        make_plan([(6, 4), (4, 4)], 2, extra_cols=[1])


def test_plan_extra_cols_travel_but_do_not_cost():
    base = make_plan([(6, 4), (4, 4)], 2)
    extra = make_plan([(6, 4), (4, 4)], 2, extra_cols=1)
    assert [mp.owner for mp in base.matrices] == [mp.owner for mp in extra.matrices]
    assert [mp.cols for mp in extra.matrices] == [5, 5]
    mp = extra.matrices[0]  # 6 rows on 2 ranks: 3 + 3, each row 4 + 1 elements on the wire
    assert [mp.contrib_numel(r) for r in range(2)] == [15, 15]
    assert sum(map(sum, extra.buckets[0].gather)) == 6 * 5 + 4 * 5
    assert [base_mp.cols for base_mp in base.matrices] == [4, 4]
    with pytest.raises(ValueError, match="extra_cols: -1"):
        make_plan([(2, 2)], 2, extra_cols=-1)


def test_plan_world_size_one_owns_everything_and_sends_nothing():
    plan = make_plan([(3, 4), (5, 2)], 1)
    assert [mp.owner for mp in plan.matrices] == [0, 0]
    assert plan.sent_elements(0) == 0


def test_plan_errors_name_the_value():
    with pytest.raises(ValueError, match="world_size: 0"):
        make_plan([(2, 2)], 0)
    with pytest.raises(ValueError, match=r"at least 2 dims, got \(5,\)"):
        make_plan([(5,)], 2)
    with pytest.raises(ValueError, match="replicated has 2 entries for 1 shapes"):
        make_plan([(2, 2)], 2, replicated=[True, False])


def test_ns_flops_quintic_count():
    # 768x3072, one iteration: 4·768²·3072 + 2·768³.
    assert _plan.ns_flops((768, 3072), 1) == 4 * 768**2 * 3072 + 2 * 768**3
    assert _plan.ns_flops((3072, 768), 5) == _plan.ns_flops((768, 3072), 5)


def test_planner_does_not_import_torch_distributed():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(_plan))
    names = [
        a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    ]
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not any("distributed" in (x or "") for x in names + modules)
    assert "torch" not in names


# ---------------------------------------------------------------------------- per-expert planning
EXPERT_COST = 4 * 12**2 * 16 + 2 * 12**3  # one (16, 12) expert's quintic FLOPs 4s²l + 2s³


def test_an_evenly_sharded_expert_stack_exchanges_nothing():
    """Shard(0) on the expert dim gives every rank whole experts: each computes its own, so no
    element travels and each rank's load is its experts'."""
    plan = make_plan([(8, 16, 12), (8, 12, 16)], 4, views=["experts"] * 2, local=True)
    assert all(mp.local and mp.owner == _plan.LOCAL for mp in plan.matrices)
    assert [plan.sent_elements(r) for r in range(4)] == [0, 0, 0, 0]
    assert all(sum(b.gather[r]) == sum(b.scatter[r]) == 0 for b in plan.buckets for r in range(4))
    assert plan.load() == [2 * 2 * EXPERT_COST] * 4
    assert plan.owned(0) == []


def test_local_stacks_seed_the_owners_of_the_other_matrices():
    """E = 5 on W = 4 (2, 2, 1, 0 experts): the 10x6 matrix goes to the rank without experts, and
    only its rows travel."""
    plan = make_plan([(5, 16, 12), (10, 6)], 4, views=["experts", "flatten"], local=[True, False])
    stack, plain = plan.matrices
    assert stack.local and [b - a for a, b in stack.receive] == [2, 2, 1, 0]
    assert plain.owner == 3
    assert plan.load() == [2 * EXPERT_COST, 2 * EXPERT_COST, EXPERT_COST, 4 * 6**2 * 10 + 2 * 6**3]
    # Rank 0 sends its 3 rows of the 10x6 matrix and gets them back from rank 3: 18 elements.
    assert plan.sent_elements(0) == 3 * 6 and plan.sent_elements(3) == 3 * (3 * 6)


def test_plan_describe():
    plan = make_plan([(5, 16, 12), (10, 6)], 4, views=["experts", "flatten"], local=[True, False])
    assert (
        plan.describe(["experts.w_up", "router.weight"])
        == """\
Plan(world_size=4, matrices=2, buckets=2)
  experts.w_up (5, 16, 12) bucket=1 local rows per rank=[2, 2, 1, 0]
  router.weight (10, 6) bucket=0 owner=3 rows per rank=[3, 3, 3, 1]
  load per rank=[25344, 25344, 12672, 1872]
  elements sent per rank=[18, 18, 18, 54]"""
    )


def test_head_views_set_the_cost_of_their_blocks():
    from muon_fn import heads

    def flops(m, n):  # one quintic iteration of an (m, n) block: 4s²l + 2s³
        s, l = min(m, n), max(m, n)  # noqa: E741  the formula's s and l
        return 4 * s * s * l + 2 * s**3

    assert ns_cost((18, 6), heads(rows=3)) == 3 * flops(6, 6)
    assert ns_cost((7, 12), heads(cols=3)) == 3 * flops(7, 4)
    assert ns_cost((4, 10, 6), heads(rows=2, experts=True)) == 8 * flops(5, 6)


def test_local_errors():
    with pytest.raises(ValueError, match="matrix 0 is replicated"):
        make_plan([(4, 3, 3)], 2, replicated=[True], local=True)
    with pytest.raises(ValueError, match="disagree on local"):
        make_plan([(4, 3, 3), (4, 3, 3)], 2, units=[[0, 1]], local=[True, False])
