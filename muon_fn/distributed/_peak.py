"""The per-rank step transient of the owner-computes FSDP step, predicted from its plan.

:func:`step_transient` walks the schedule :func:`~muon_fn.distributed._stream.stream` runs (the same
buckets, the same decision to gather the next bucket while one is computed) and sums, at each
moment, the bytes a rank allocates during the step and still holds then; the prediction is the
largest sum. It counts tensors only: what the step allocates besides them (the backend's and
Python's own buffers, the compiled graphs' small temporaries) is left out. A model, read off
the code, not fitted to a measurement; docs/performance.md compares it with the resident set
``muon-fn bench fsdp`` measures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..core import views as _views
from ._pieces import in_row_order, pieces_of
from ._plan import BucketPlan, Plan
from ._budget import in_rounds, travels_ahead

# The Newton–Schulz scratch roles of m × m products (the others are m × n): the CPU products keep
# one buffer per role between calls (muon_fn.core.newton_schulz.cpu.CPUProducts.scratch).
GRAM_ROLES = ("gram", "poly")

# The post phase's tensors of the rank's rows: the final update (the compiled post step's
# output), which the guarded write (muon_fn.engine._apply.commit) masks in place before adding
# it to p.
POST_COPIES = 1

Loops = Callable[[int], bool]  # whether matrices whose smaller side is m iterate one at a time


@dataclass
class _Live:
    """The bytes held at each moment: named blocks, and the largest sum seen (with a temporary)."""

    held: dict[object, int] = field(default_factory=dict)
    peak: int = 0

    def add(self, key: object, nbytes: int) -> None:
        self.held[key] = self.held.get(key, 0) + nbytes
        self.note()

    def drop(self, key: object) -> None:
        self.held.pop(key, None)

    def note(self, extra: int = 0) -> None:
        self.peak = max(self.peak, sum(self.held.values()) + extra)


@dataclass
class _Scratch:
    """The CPU products' scratch (elements per role), kept from one call to the next as
    ``CPUProducts`` keeps it: a role's buffer is made anew when too small or more than twice too
    large, and before a call every buffer more than twice what it can use is freed; ``kept`` is
    False where the policy keeps none (each call's buffers are freed after it)."""

    kept: bool
    roles: dict[str, int] = field(default_factory=dict)

    def run(self, batch: int, m: int, n: int, in_place: bool = False) -> None:
        """One call iterating ``batch`` wide ``m × n`` matrices at once; ``in_place``: the
        iterate alternates with the inputs' own memory (donated), so no ``x`` is asked for."""
        if not self.kept:
            self.roles = {}
        need = {"x": batch * m * n, **dict.fromkeys(GRAM_ROLES, batch * m * m)}
        for role in list(self.roles):  # release_oversized
            if self.roles[role] > 2 * need[role]:
                del self.roles[role]
        for role, numel in need.items():
            if not (in_place and role == "x") and not numel <= self.roles.get(role, 0) <= 2 * numel:
                self.roles[role] = numel

    def total(self) -> int:
        return sum(self.roles.values())


@dataclass(frozen=True)
class _Round:
    """One round of a bucket exchanged alone (:meth:`~muon_fn.distributed._stream._Run.alone`)
    on one rank, in elements: the rows of the units whose pre phase runs just before it (in
    unit order), the rows it sends in the gather (0 in round 0: copied into place), the rows of
    its results it sends in the return (0 where the receive buffer travels back), the rows it
    gets back, and the rows of the units whose post phase then runs."""

    made: tuple[int, ...] = ()
    sent: int = 0
    returned: int = 0
    back: int = 0
    posted: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Sizes:
    """One bucket on one rank, in elements: the rows it holds of the bucket's matrices per unit
    (in unit order), the rows it sends in the gather, the whole matrices it receives (owns), of
    them those assembled by a copy (the others are computed in the receive buffer), the rows of
    its results it returns to other ranks, the rows it gets back from other owners, its own rows
    of its results (kept, never sent), its owned units as ``(matrices, m, n)`` (wide shapes),
    its largest owned matrix, and whether the return sends the receive buffer its results were
    computed in (every owned matrix computed there, every rank getting back the rows it sent)."""

    unit_rows: tuple[int, ...]
    sent: int
    gathered: int
    copied: int
    returned: int
    back: int
    own: int
    units: tuple[tuple[int, int, int], ...]
    largest: int
    in_place: bool = False  # its results are returned in the gather's receive buffer (_pieces.returns_in_place)
    in_rounds: bool = False  # exchanged in rounds (_budget.in_rounds)
    rounds: tuple[tuple[int, _Round], ...] = ()  # then: (t, round) that move or make anything, local units at t = -1

    def pre(self) -> int:
        return _pre_peak(self.unit_rows)

    def post(self) -> int:
        return _post_peak(self.unit_rows)


def _pre_peak(h: Sequence[int]) -> int:
    """The pre phase's most elements at once over units of ``h`` rows, unit by unit: the updates
    of the units before, the previous unit's new momentum (still bound), this unit's new momentum
    and update."""
    return max((sum(h[:k]) + (h[k - 1] if k else 0) + 2 * h[k] for k in range(len(h))), default=0)


def _post_peak(h: Sequence[int]) -> int:
    """The post phase's most elements at once over units of ``h`` rows, unit by unit: while a
    unit's final update is computed the previous unit's is still bound; then, the previous freed,
    this unit's :data:`POST_COPIES` as it is written."""
    return max((max((h[k - 1] if k else 0) + h[k], POST_COPIES * h[k]) for k in range(len(h))), default=0)


def _copied(plan: Plan, owned: Sequence[int], same_dtype: bool, item_bytes: int) -> int:
    """Elements of the ``owned`` matrices (in bucket order) that ``_pieces.assemble`` copies out of
    the gather's receive buffer: all unless the wire is the parameters' dtype and a matrix's
    pieces lie one after the other in row order from a 64-byte aligned offset (then a view)."""
    total = 0
    for j, ps in pieces_of(plan, owned).items():
        if not in_row_order(ps, ps[0][1] if ps else 0, same_dtype, item_bytes):
            total += plan.matrices[j].numel
    return total


def _sizes(plan: Plan, b: BucketPlan, rank: int, unit_of: Sequence[int], views: Sequence,
           copies: dict[int, int], same_dtype: bool = True, item_bytes: int = 4, alone: bool = False) -> _Sizes:
    """``b``'s sizes on ``rank``, from its matrices (the plan's split sizes summed, without
    reading the W × W tables: fast at W = 1,024). ``copies``: rows returned per row layout;
    ``alone``: with its rounds (:func:`_rounds`)."""
    rows: dict[int, int] = {}
    owned: dict[int, list[int]] = {}
    sent = gathered = returned = back = own = 0
    for j in b.matrices:
        mp = plan.matrices[j]
        rows[unit_of[j]] = rows.get(unit_of[j], 0) + mp.receive_numel(rank)
        if mp.local:  # computed where it lies: nothing travels
            continue
        sent += mp.contrib_numel(rank)
        if mp.owner != rank:
            back += mp.receive_numel(rank)
            continue
        owned.setdefault(unit_of[j], []).append(j)
        gathered += mp.numel
        own += mp.receive_numel(rank)
        if id(mp.receive) not in copies:  # m rows (sharded) or W·m (replicated)
            copies[id(mp.receive)] = sum(stop - start for start, stop in mp.receive)
        returned += copies[id(mp.receive)] * mp.cols - mp.receive_numel(rank)
    units = []
    for u in owned:  # in the bucket's order, as the owner computes them (not the units' order)
        first = owned[u][0]
        m, n = _views.matrix_shape(plan.matrices[first].shape, views[first])
        count = sum(_views.count(plan.matrices[j].shape, views[j]) for j in owned[u])
        units.append((count, min(m, n), max(m, n)))
    largest = max((plan.matrices[j].numel for js in owned.values() for j in js), default=0)
    mine = [j for j in b.matrices if plan.matrices[j].owner == rank and not plan.matrices[j].local]
    copied = _copied(plan, mine, same_dtype, item_bytes)
    in_place = gathered > 0 and not copied and all(plan.matrices[j].contrib == plan.matrices[j].receive for j in mine)
    return _Sizes(tuple(rows[u] for u in sorted(rows)), sent, gathered, copied, returned, back, own, tuple(units),
                  largest, in_place, alone, _rounds(plan, b, rank, unit_of, rows, in_place) if alone else ())


def _rounds(plan: Plan, b: BucketPlan, rank: int, unit_of: Sequence[int], rows: dict[int, int],
            in_place: bool) -> tuple[tuple[int, _Round], ...]:
    """``b``'s rounds on ``rank`` that move or make anything, as ``(t, round)`` (``t = -1``: the
    local units, made first). Round ``t`` sends to and gets back from rank ``rank + t`` in the
    gather, and returns to rank ``rank - t``; a unit's pre phase runs in the first round that
    sends one of its matrices, its post phase in the round its last matrix's rows come back."""
    w = plan.world_size
    made: dict[int, int] = {}  # unit -> the round of its pre phase
    posted: dict[int, int] = {}  # unit -> the round of its post phase
    sent: dict[int, int] = {}
    back: dict[int, int] = {}
    for j in b.matrices:
        mp, u = plan.matrices[j], unit_of[j]
        t = -1 if mp.local else (mp.owner - rank) % w
        made[u] = min(made.get(u, t), t)
        posted[u] = max(posted.get(u, 0), max(t, 0))
        if not mp.local:
            sent[t] = sent.get(t, 0) + (mp.contrib_numel(rank) if t else 0)
            back[t] = back.get(t, 0) + mp.receive_numel(rank)
    returned: dict[int, int] = {}
    if not in_place:
        for j in b.matrices:
            mp = plan.matrices[j]
            if mp.owner == rank and not mp.local:
                for d, (start, stop) in enumerate(mp.receive):
                    if d != rank and stop > start:
                        t = (rank - d) % w
                        returned[t] = returned.get(t, 0) + (stop - start) * mp.cols
    ts = sorted(set(made.values()) | set(posted.values()) | set(sent) | set(returned))
    return tuple((t, _Round(tuple(rows[u] for u in sorted(made) if made[u] == t), sent.get(t, 0),
                            returned.get(t, 0), back.get(t, 0) if t else 0,
                            tuple(rows[u] for u in sorted(posted) if posted[u] == t))) for t in ts)


@dataclass
class _Walk:
    """One rank's step, phase by phase (:func:`step_transient`): what each step of the stream
    allocates and frees, in bytes, into ``live`` (keys: the block and its bucket)."""

    sizes: list[_Sizes]
    param_bytes: int
    wire_bytes: int
    ns_bytes: int
    loops: Loops
    scratch: _Scratch
    release: bool = False  # the scratch freed after each owner's compute (under a byte bound)
    each: Loops | None = None  # whether a donated batch iterates one matrix at a time (default: loops)
    live: _Live = field(default_factory=_Live)

    @property
    def cast(self) -> bool:
        return self.wire_bytes != self.param_bytes

    def in_place(self, count: int, m: int, n: int) -> bool:
        """Whether the CPU's iteration of a unit of ``count`` gathered ``m × n`` matrices runs in
        their memory (donated: :meth:`~muon_fn.core.newton_schulz.cpu.CPUProducts.orthogonalize_batch`):
        one matrix at a time (:meth:`~muon_fn.core.newton_schulz.cpu.CPUProducts.consumes_each`),
        or a batch of one, on aligned slots (a fresh tensor's alignment is assumed for each
        matrix, as a receive buffer of such shapes gives)."""
        if not self.scratch.kept:  # the batched policy (GPUs): traced, the cast fuses with its producer
            return False
        from ..core.newton_schulz.cpu import slots_align

        each = self.loops if self.each is None else self.each
        return slots_align(m, n, self.ns_bytes) and (each(m) or count == 1)

    def start(self, i: int) -> None:
        """The pre phase, then the gather posted: the send buffer is made while the packed rows
        are held, the rows are freed as they are copied, then the receive buffer is made."""
        s, p, w, live = self.sizes[i], self.param_bytes, self.wire_bytes, self.live
        live.note(s.pre() * p)
        live.add(("rows", i), sum(s.unit_rows) * p)
        live.add(("gather send", i), s.sent * w)
        live.drop(("rows", i))
        live.add(("gather recv", i), s.gathered * w)

    def compute_and_return(self, i: int, previous: int | None) -> None:
        """The gather waited for (its send buffer freed), the owned matrices assembled (copies,
        or views of the receive buffer) and computed unit by unit, the owner's own rows kept,
        ``previous`` bucket finished, then the results' rows posted back."""
        s, p, w, live = self.sizes[i], self.param_bytes, self.wire_bytes, self.live
        live.drop(("gather send", i))
        self.compute(i)
        if s.in_place:  # the results travel back in the receive buffer, the own rows with them
            live.held[("return send", i)] = live.held.pop(("gather recv", i))
            if previous is not None:
                self.finish(previous)
            live.add(("return recv", i), (s.back + s.own) * w)
            return
        live.drop(("gather recv", i))
        live.held[("whole", i)] = s.gathered * p  # the results
        live.note(s.own * w if self.cast else 0)  # the own rows rounded as the wire rounds them
        live.add(("mine", i), s.own * p)
        if previous is not None:
            self.finish(previous)
        live.add(("return send", i), s.returned * w)
        live.drop(("whole", i))  # each result freed as its rows are copied
        live.add(("return recv", i), s.back * w)  # a spare of the previous return's, or new

    def compute(self, i: int) -> None:
        """The owned matrices assembled (copies, or views of the receive buffer) and computed
        unit by unit; the results replace the inputs."""
        s, p, w, live = self.sizes[i], self.param_bytes, self.wire_bytes, self.live
        live.add(("whole", i), s.copied * p)
        # with a narrower wire each matrix is concatenated in W, then cast into its whole copy in P:
        # the concatenation is alive while the copy is made (counted for the largest, with every copy)
        live.note(s.largest * w if self.cast and s.copied else 0)
        if s.copied == s.gathered:
            live.drop(("gather recv", i))
        for count, m, n in s.units:  # the results replace the inputs as each unit finishes
            in_place = self.in_place(count, m, n)
            self.scratch.run(1 if self.loops(m) or in_place else count, m, n, in_place)
            live.held["scratch"] = self.scratch.total() * self.ns_bytes
            # the input cast to N where N is narrower (the iteration reads it) unless it is cast
            # in its own memory, the result in N; then the result in P, written into its input
            live.note(count * m * n * self.ns_bytes * (2 if self.ns_bytes < p and not in_place else 1))
            if not self.scratch.kept:
                live.held["scratch"] = 0
        if self.release:
            self.scratch.roles = {}
            live.held["scratch"] = 0

    def alone(self, i: int) -> None:
        """Bucket ``i`` exchanged alone, in rounds (:attr:`_Sizes.rounds`): the local units' pre
        phase; the receive buffer; per round, the pre phase of the units whose rows travel then
        (their rows held while the send buffer of those rows is made); the owner's compute; its
        own rows kept (rounded through W where it is narrower) or, per round, the send buffer of
        a rank's rows of the results (none where the receive buffer travels back) and the
        receive buffer of the rows back (the previous round's kept as a spare until then), cast
        back to P where the wire is narrower, and the post phase of the units complete then."""
        s, p, w, live = self.sizes[i], self.param_bytes, self.wire_bytes, self.live
        rounds = dict(s.rounds)
        local = rounds.pop(-1, _Round())
        live.note(_pre_peak(local.made) * p)
        live.add(("local", i), sum(local.made) * p)
        live.add(("gather recv", i), s.gathered * w)
        for t in sorted(rounds):
            r = rounds[t]
            live.note(_pre_peak(r.made) * p)
            live.add(("rows", i), sum(r.made) * p)
            live.add(("gather send", i), r.sent * w)
            live.drop(("rows", i))
            live.drop(("gather send", i))
        self.compute(i)
        if s.in_place:
            live.held[("whole", i)] = live.held.pop(("gather recv", i))
        else:
            live.drop(("gather recv", i))
            live.held[("whole", i)] = s.gathered * p
        for t in sorted(rounds):
            r = rounds[t]
            if t == 0:
                live.note(s.own * w if self.cast else 0)
                live.add(("mine", i), s.own * p)
            else:
                live.add(("return send", i), r.returned * w)
                live.drop(("return recv", i))  # the spare, reused or freed
                live.add(("return recv", i), r.back * w)
                live.drop(("return send", i))
            live.note((_post_peak(r.posted) + (r.back if self.cast and t else 0)) * p)
            if t == 0:
                live.drop(("mine", i))
                live.drop(("local", i))
        live.drop(("return recv", i))
        live.drop(("whole", i))

    def finish(self, i: int) -> None:
        """The return waited for (its send buffer freed), the rows cast back to P where the wire
        is narrower, the post phase; then the bucket's own rows and receive buffer freed."""
        s, live = self.sizes[i], self.live
        live.drop(("return send", i))
        live.note((s.post() + (s.back if self.cast else 0)) * self.param_bytes)
        live.drop(("mine", i))
        live.drop(("return recv", i))


def step_transient(plan: Plan, rank: int, units: Sequence[Sequence[int]], views: Sequence, *,
                   inflight_bytes: int | None, param_bytes: int = 4, wire_bytes: int = 4, ns_bytes: int = 2,
                   loops: Loops = lambda m: False, scratch_kept: bool = True, each: Loops | None = None) -> int:
    """The most bytes ``rank`` allocates and holds at once during one step of ``plan`` (of two
    ranks or more), bucket by bucket as :func:`~muon_fn.distributed._stream.stream` runs it with
    ``inflight_bytes`` (``units``: the owner units over the plan's matrices; ``views``: each
    matrix's view). Per bucket, in the stream's order, it counts (P: parameter and update
    dtype, ``param_bytes``; W: the wire's, ``wire_bytes``; N: the iteration's, ``ns_bytes``):

    - the **pre phase**, unit by unit: a unit's new momentum and update (2 × its rows × P),
      the previous unit's new momentum still bound, then the bucket's rows packed for the
      gather (rows × P; :meth:`_Sizes.pre`);
    - the **gather**: the send buffer of the rows it contributes (W; made while the packed rows
      are held, which are freed as they are copied into it), then the receive buffer of the
      whole matrices it owns (W); the send buffer is freed once the gather is waited for;
    - the **owner's compute**: its whole matrices, copied out of the receive buffer in P (the
      receive buffer then freed; with a narrower wire, one matrix concatenated in W first), or
      computed in it where the wire is P and a matrix's pieces lie there in row order
      (:func:`_copied`); per unit, the input cast to N where N is narrower than P, the result
      in N, then in P written into its input (the owner's gathered matrices are the exchange's
      to overwrite), and the Newton–Schulz scratch: X,
      XXᵀ and the polynomial in N for the unit's batch, or for one matrix where ``loops(m)``
      (the CPU's matrix-at-a-time loop), kept from one call to the next as the CPU products
      keep it (``scratch_kept``; else freed after each unit), and freed after the owner's compute
      under a byte bound (``inflight_bytes`` not None); under the CPU policy a matrix iterated
      alone (where ``each(m)``, by default ``loops(m)``: then with one matrix's scratch), or a
      batch of one, is cast in its own memory, which then holds X, so neither its
      cast copy nor X is counted (:meth:`_Walk.in_place`); the results replace the inputs;
    - the **return**: where every owned matrix was computed in the receive buffer and every
      rank gets back the rows it sent (:attr:`_Sizes.in_place`), that buffer is the send buffer
      and the receive buffer holds the owner's own rows too; otherwise its own rows of the
      results kept (P; rounded through W when it differs), never sent, then (after the previous
      bucket's post phase, below) the send buffer of the other ranks' rows (W, each result freed
      as its rows are copied) and the receive buffer of its rows from the other owners (W, the
      previous return's reused when as large; freed before otherwise); the send buffer is
      freed once the return is waited for;
    - the **post phase**, unit by unit: the final update (the previous unit's still bound while
      it is computed), masked in its own memory by the guard as it is added to the parameter
      (:data:`POST_COPIES`; :meth:`_Sizes.post`), plus the rows from
      other owners cast back to P when the wire is narrower; then its own rows and the
      return's receive buffer are freed.

    The next bucket is gathered before one is computed only when both fit ``inflight_bytes``
    (:func:`~muon_fn.distributed._budget.travels_ahead`, on P, as the stream decides); a bucket's
    post phase then runs while the next bucket's results are held, just before their return
    is posted, and before the next is gathered otherwise."""
    buckets = [b for b in plan.buckets if b.matrices]
    ahead = travels_ahead(plan, buckets, param_bytes, inflight_bytes)
    sizes = [_sizes(plan, b, rank, _unit_of(plan, units), views, {}, wire_bytes == param_bytes, wire_bytes,
                    in_rounds(ahead, i, plan.world_size)) for i, b in enumerate(buckets)]
    return _schedule(sizes, ahead, _Walk(sizes, param_bytes, wire_bytes, ns_bytes, loops, _Scratch(scratch_kept),
                                         release=inflight_bytes is not None, each=each))


def _schedule(sizes: Sequence[_Sizes], travels: Sequence[bool], walk: _Walk) -> int:
    """The stream's loop over the buckets (``travels``: :func:`~muon_fn.distributed._budget.travels_ahead`'s
    flags), step by step into ``walk``; its peak."""
    if not sizes:
        return 0
    back, started = None, False  # the previous bucket, its results on their way back
    for i in range(len(sizes)):
        if sizes[i].in_rounds:
            walk.alone(i)
            continue
        if not started:
            walk.start(i)
        ahead, started = travels[i], travels[i]
        if ahead:
            walk.start(i + 1)
        walk.compute_and_return(i, back)
        back = i if ahead else None
        if not ahead:
            walk.finish(i)
    if back is not None:
        walk.finish(back)
    return walk.live.peak


def _unit_of(plan: Plan, units: Sequence[Sequence[int]]) -> list[int]:
    """The unit of each of the plan's matrices."""
    unit_of = [0] * len(plan.matrices)
    for u, members in enumerate(units):
        for j in members:
            unit_of[j] = u
    return unit_of


POLICIES = ("batched", "cpu")
"""The execution policies :func:`rank_transients` models (:data:`muon_fn.orthogonalization.POLICIES`)."""


def rank_transients(plan: Plan, units: Sequence[Sequence[int]], views: Sequence, *, inflight_bytes: int | None,
                    wire_bytes: int = 4, ns_bytes: int = 2, policy: str = "batched") -> tuple[int, ...]:
    """:func:`step_transient` of every rank of ``plan`` (fp32 parameters), under the execution
    policy ``policy``: ``"cpu"`` keeps the iteration's scratch between calls and iterates one
    matrix at a time where this CPU's products do (:meth:`CPUProducts.loops`: from 384 rows, in
    a dtype its GEMMs do not run on AMX tiles; a donated batch also where they do:
    :meth:`CPUProducts.consumes_each`); ``"batched"`` (GPUs) iterates each unit as one
    batch and keeps nothing. One rank runs no stream: every bucket's rows are packed first, the
    results applied last (:func:`~muon_fn.distributed._exchange.exchange`)."""
    if policy not in POLICIES:
        raise ValueError(f"Invalid policy: {policy!r} (valid: {', '.join(map(repr, POLICIES))})")
    loops: Loops = lambda m: False  # noqa: E731
    each: Loops | None = None
    if policy == "cpu":
        import torch

        from ..core.newton_schulz import CPUProducts

        cpu, dtype = CPUProducts(), {2: torch.bfloat16, 4: torch.float32}.get(ns_bytes)
        loops = lambda m: dtype is not None and cpu.loops(m, dtype)  # noqa: E731
        each = lambda m: dtype is not None and cpu.consumes_each(m)  # noqa: E731
    kept = policy == "cpu"
    if plan.world_size == 1:
        return (_one_rank(plan, units, views, ns_bytes=ns_bytes, loops=loops, scratch_kept=kept),)
    # step_transient of each rank; ranks whose buckets have the same sizes walk once
    buckets = [b for b in plan.buckets if b.matrices]
    unit_of = _unit_of(plan, units)
    copies: dict[int, int] = {}
    walked: dict[tuple, int] = {}
    ahead = travels_ahead(plan, buckets, 4, inflight_bytes)
    out = []
    for r in range(plan.world_size):
        sizes = tuple(_sizes(plan, b, r, unit_of, views, copies, wire_bytes == 4, wire_bytes,
                             in_rounds(ahead, i, plan.world_size))
                      for i, b in enumerate(buckets))
        if sizes not in walked:
            walked[sizes] = _schedule(sizes, ahead, _Walk(list(sizes), 4, wire_bytes, ns_bytes, loops, _Scratch(kept),
                                                          release=inflight_bytes is not None, each=each))
        out.append(walked[sizes])
    return tuple(out)


def _one_rank(plan: Plan, units: Sequence[Sequence[int]], views: Sequence, *, ns_bytes: int, loops: Loops,
              scratch_kept: bool, param_bytes: int = 4) -> int:
    """The transient of one rank's step (no exchange): the pre phase of every unit (its rows
    are the whole matrices), then each unit computed, its result kept, then every post phase."""
    every = _sizes(plan, BucketPlan(0, tuple(range(len(plan.matrices))), ((0,),), ((0,),)), 0,
                   _unit_of(plan, units), views, {})
    live, scratch = _Live(), _Scratch(scratch_kept)
    live.note(every.pre() * param_bytes)
    live.add("rows", sum(every.unit_rows) * param_bytes)
    for count, m, n in every.units:
        scratch.run(1 if loops(m) else count, m, n)
        live.held["scratch"] = scratch.total() * ns_bytes if scratch_kept else 0
        live.note(count * m * n * (ns_bytes + param_bytes) + (0 if scratch_kept else scratch.total() * ns_bytes))
        live.add("results", count * m * n * param_bytes)
    live.note(every.post() * param_bytes)
    return live.peak
