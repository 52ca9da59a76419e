"""Fragment: cut placed equation instances into acyclic per-submesh fragments, in order.

1. Levels (ASAP): an instance's level is the longest chain before it of transfers between
   submeshes and forward->backward switches. Instances are grouped by
   (stage, microbatch, phase, level); every edge between groups goes to an equal-or-higher
   level, so the group graph is acyclic.
2. Merge: groups of the same stage and microbatch are merged when the later one consumes
   the earlier one and no path leads from one to the other through another group.
3. Zero-bubble split (schedules with ``splits_backward``): a backward group is split into
   the part that computes what other stages need (B, input gradients) and the rest (W,
   weight gradients and accumulation).
4. Order: each submesh runs work outside microbatch loops in level order, and loop work
   in the schedule's order; a consumer right after its producer on the same submesh is
   merged into it (e.g. the last stage's F and B in 1F1B). The global dispatch order
   interleaves submeshes round-robin, respecting data dependencies; a schedule that
   contradicts them is a clear error, not a deadlock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import AbstractMesh, Mesh, NamedSharding

from multimesh import _compat
from multimesh.compiler import inline
from multimesh.compiler.ir import FlatProgram, Labels, Literal, Placement
from multimesh.schedules import Action, Custom

_compat.register_exclusion(__file__)

Slot = tuple[Any, int]  # (var, stage)


@dataclasses.dataclass
class Fragment:
    stage: int
    level: int
    eqns: list[int]  # indices into FlatProgram.eqns, in program order
    inputs: list[Slot] = dataclasses.field(default_factory=list)
    outputs: list[Slot] = dataclasses.field(default_factory=list)
    microbatch: int | None = None
    loop: int | None = None
    actions: list[Action] = dataclasses.field(default_factory=list)
    phases: str = ""


@dataclasses.dataclass
class _Group:
    stage: int
    mb: tuple[int, int] | None
    phase: str
    level: int
    eqns: set[int]
    succ: set[int] = dataclasses.field(default_factory=set)
    pred: set[int] = dataclasses.field(default_factory=set)
    alive: bool = True
    actions: list[Action] = dataclasses.field(default_factory=list)
    segment: int = 0
    order: int = 0  # within its schedule step: -1 first, 1 last, 0 by dependencies


_PHASE_RANK = {"F": 0, "B": 1, "W": 2}
_NO_LOOP = 1 << 30  # "feeds no loop"


def _later_stage_of_earlier_mb(blocked: _Group, need: _Group) -> bool:
    """``blocked`` (a forward) waits on an earlier microbatch's forward on a later stage."""
    return (
        blocked.mb is not None
        and need.mb is not None
        and blocked.mb[0] == need.mb[0]
        and need.mb[1] < blocked.mb[1]
        and blocked.phase == need.phase == "F"
        and any(a.stage > b.stage for a in need.actions[:1] for b in blocked.actions[:1])
    )


class _Revisit(Exception):
    """A microbatch's forward pass comes back to a task stage it has left."""

    def __init__(self, stages: list[int]) -> None:
        super().__init__(stages)
        self.stages = stages


class _Cyclic(Exception):
    """Splitting a submesh's loop work into segments made the group graph cyclic."""


def fragment(
    prog: FlatProgram,
    placement: Placement,
    labels: Labels | None = None,
    loops: list[Any] | None = None,
) -> list[Fragment]:
    """Group instances into fragments, in dispatch order (a submesh's tasks that other
    submeshes also run apart from its own, see ``_segments``)."""
    loops = loops or []
    n = len(prog.eqns)
    mbs = labels.microbatch if labels is not None and labels.microbatch else [None] * n
    segments = _segments(prog, placement, labels, mbs)
    if segments is not None:
        try:
            return _fragment(prog, placement, labels, loops, mbs, segments)
        except (_Cyclic, ValueError):
            pass  # the split is only an optimization: fragment as if unsplit
    return _fragment(prog, placement, labels, loops, mbs, None)


def _fragment(prog, placement, labels, loops, mbs, segments) -> list[Fragment]:
    n = len(prog.eqns)
    seg = segments or [0] * n
    # phase: backward if transposed, or if it consumes backward results (e.g. the
    # accumulation of a microbatch's gradients belongs to that microbatch's backward)
    # A loop's work is backward only through its own backward (transposed work, and what
    # consumes it in that loop, e.g. the accumulation of a microbatch's gradients): a
    # second loop's forward on weights updated with the first loop's gradients, or with
    # a gradient taken outside loops, is forward work (it was all "B", and an
    # interleaved schedule then ordered it as a backward)
    phase: list[str] = []
    var_back: dict[Any, int] = {}  # backward value -> the loop it comes from (-1: none)
    for i, e in enumerate(prog.eqns):
        loop = mbs[i][0] if mbs[i] is not None else -1
        if _compat.is_transposed(e.source_info.name_stack):
            src: int | None = loop
        else:
            srcs = [var_back[a] for a in e.invars if not isinstance(a, Literal) and a in var_back]
            if mbs[i] is not None:
                srcs = [b for b in srcs if b == loop]
            src = srcs[0] if srcs else None
        phase.append("F" if src is None else "B")
        if src is not None:
            for o in e.outvars:
                var_back[o] = src
    transfers_from: dict[Slot, list[int]] = {}
    for v, src, dst in placement.transfers:
        transfers_from.setdefault((v, src), []).append(dst)
    virt_key = _interleaved_stage_keys(prog, placement, labels, mbs)

    # work outside loops that no loop needs (e.g. an optimizer's moment decay, which
    # needs only the old state) is grouped apart from work that loops need, so that it
    # can run after the loops (step 4)
    # With several loops, work outside them also knows which: the last loop whose results
    # it needs and the first loop it feeds (loops are numbered in program order). Work
    # for different loops is not grouped together (loop 1's accumulator zeros with loop
    # 2's input made from loop 1's output: that group would need loop 1 and feed it)
    feed_at = [_NO_LOOP] * n
    feed_var: dict[Any, int] = {}
    for i in reversed(range(n)):
        e = prog.eqns[i]
        f = mbs[i][0] if mbs[i] is not None else _NO_LOOP
        f = min([f] + [feed_var[o] for o in e.outvars if o in feed_var])
        feed_at[i] = f
        if f != _NO_LOOP:
            for a in e.invars:
                if not isinstance(a, Literal):
                    feed_var[a] = min(feed_var.get(a, _NO_LOOP), f)
    feeds_loop = [f != _NO_LOOP for f in feed_at]
    need_at = [-1] * n
    need_var: dict[Any, int] = {}
    for i, e in enumerate(prog.eqns):
        if mbs[i] is not None:
            need_at[i] = mbs[i][0]
        else:
            need_at[i] = max(
                [-1]
                + [need_var[a] for a in e.invars if not isinstance(a, Literal) and a in need_var]
            )
        if need_at[i] >= 0:
            for o in e.outvars:
                need_var[o] = need_at[i]

    # 1. ASAP levels
    avail: dict[Slot, tuple[int, str]] = {}
    looped: set[Slot] = set()  # values computed in (or from) a microbatch loop

    def publish(slot: Slot, level: int, ph: str, in_loop: bool = False) -> None:
        avail[slot] = (level, ph)
        if in_loop:
            looped.add(slot)
        for dst in transfers_from.get(slot, ()):
            avail[(slot[0], dst)] = (level + 1, "X")
            if in_loop:
                looped.add((slot[0], dst))

    for v, stages in placement.input_stages.items():
        for s in stages:
            publish((v, s), 0, "X")
    key_of: dict[tuple[int, int], tuple] = {}
    groups_by_key: dict[tuple, int] = {}
    groups: list[_Group] = []
    # ordered effects run in program order: one after another submesh's comes a level
    # later (as if it received a value), so work returning to a stage (0, 1, 0) is not
    # grouped with that stage's first effect, which would wait for itself
    last_effect: tuple[int, int] | None = None  # (level, stage)
    # per group outside loops: (the last loop it needs, the first loop it feeds)
    bounds: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(prog.eqns):
        effect = _compat.has_ordered_effects(e)
        for s in placement.instances[i]:
            lvl = 0
            from_loop = mbs[i] is not None
            for a in e.invars:
                if isinstance(a, Literal):
                    continue
                al, aph = avail[(a, s)]
                lvl = max(lvl, al + (1 if aph == "F" and phase[i] == "B" else 0))
                from_loop = from_loop or (a, s) in looped
            if effect and last_effect is not None:
                lvl = max(lvl, last_effect[0] + (last_effect[1] != s))
            if effect:
                last_effect = (lvl, s)
            # work after a microbatch loop never shares a group with work before it
            post = mbs[i] is None and from_loop
            # (work after a loop that feeds a loop again, e.g. the seed of a non-linear
            # function of the loop's output with jax.grad outside, is kept apart from
            # the work after it: the same level, but the loop's backward lies between)
            loops_key = None if mbs[i] is not None else (need_at[i], feed_at[i])
            key = (s, mbs[i], phase[i], lvl, post, feeds_loop[i], seg[i], virt_key[i], loops_key)
            key_of[(i, s)] = key
            if key not in groups_by_key:
                groups_by_key[key] = len(groups)
                groups.append(_Group(s, mbs[i], phase[i], lvl, set(), segment=seg[i]))
                bounds[len(groups) - 1] = (need_at[i], feed_at[i])
            groups[groups_by_key[key]].eqns.add(i)
            for o in e.outvars:
                publish((o, s), lvl, phase[i], from_loop)

    # group graph
    made_by: dict[Slot, int] = {}
    for (i, s), key in key_of.items():
        for o in prog.eqns[i].outvars:
            made_by[(o, s)] = groups_by_key[key]

    def source_group(slot: Slot) -> int | None:
        if slot in made_by:
            return made_by[slot]
        for v_src in _transfer_src.get(slot, ()):
            return made_by.get((slot[0], v_src))
        return None

    _transfer_src: dict[Slot, list[int]] = {}
    for v, src, dst in placement.transfers:
        _transfer_src.setdefault((v, dst), []).append(src)

    def rebuild_edges() -> None:
        for g in groups:
            g.succ.clear()
            g.pred.clear()
        owner: dict[tuple[int, int], int] = {}
        for gid, g in enumerate(groups):
            if g.alive:
                for i in g.eqns:
                    owner[(i, g.stage)] = gid
        made_by.clear()
        for (i, s), gid in owner.items():
            for o in prog.eqns[i].outvars:
                made_by[(o, s)] = gid
        for (i, s), gid in owner.items():
            for a in prog.eqns[i].invars:
                if isinstance(a, Literal):
                    continue
                src = source_group((a, s))
                if src is not None and src != gid:
                    groups[gid].pred.add(src)
                    groups[src].succ.add(gid)
        # ordered effects (io_callback / debug.print with ordered=True) run in program order
        for i, j in effect_pairs:
            gi = owner.get((i, _only(placement.instances[i])))
            gj = owner.get((j, _only(placement.instances[j])))
            if gi is not None and gj is not None and gi != gj:
                groups[gj].pred.add(gi)
                groups[gi].succ.add(gj)

    ordered = [i for i, e in enumerate(prog.eqns) if _compat.has_ordered_effects(e)]
    effect_pairs = list(zip(ordered, ordered[1:]))
    rebuild_edges()
    if segments is not None and len(_topo_positions(groups, strict=True)) < len(groups):
        raise _Cyclic

    # levels never decrease along an edge (merging keeps that: a group joins its
    # successor's level): a search for h need not go past h's level
    by_level = all(groups[c].level >= g.level for g in groups for c in g.succ)

    def reaches_via_other(g: int, h: int) -> bool:
        """Is there a path g -> x -> ... -> h with x != h?"""
        seen: set[int] = set()
        top = groups[h].level if by_level else None
        stack = [x for x in groups[g].succ if x != h]
        while stack:
            x = stack.pop()
            if x == h:
                return True
            if x in seen or (top is not None and groups[x].level > top):
                continue
            seen.add(x)
            stack.extend(groups[x].succ)
        return False

    def reaches(g: int, h: int) -> bool:
        """Is there a path g -> ... -> h?"""
        return h in groups[g].succ or reaches_via_other(g, h)

    def may_join(g: int, h: int) -> bool:
        """May g and h (outside loops) merge? Not when together they would need a loop
        that they also feed and neither did alone (they could run only within it), nor
        need a later loop than one they feed (a loop's gradient seed with a later loop's
        work: no order runs that)."""
        (ng, fg), (nh, fh) = bounds[g], bounds[h]
        n, f = max(ng, nh), min(fg, fh)
        return n < f or (n == f and (ng >= fg or nh >= fh))

    def merge(into: int, other: int) -> None:
        gi, go = groups[into], groups[other]
        if into in bounds and other in bounds:
            (ni, fi), (no, fo) = bounds[into], bounds[other]
            bounds[into] = (max(ni, no), min(fi, fo))
        gi.eqns |= go.eqns
        gi.actions += [a for a in go.actions if a not in gi.actions]
        go.alive = False
        for p in go.pred:
            groups[p].succ.discard(other)
            if p != into:
                groups[p].succ.add(into)
                gi.pred.add(p)
        for c in go.succ:
            groups[c].pred.discard(other)
            if c != into:
                groups[c].pred.add(into)
                gi.succ.add(c)
        gi.pred.discard(into)
        gi.succ.discard(into)
        gi.pred.discard(other)
        gi.succ.discard(other)

    def sends(gid: int) -> bool:
        """Whether a group sends values to other stages (merging it would delay them)."""
        g = groups[gid]
        return any((o, g.stage) in transfers_from for i in g.eqns for o in prog.eqns[i].outvars)

    # 2. structural merges within (stage, microbatch[, phase for loops])
    changed = True
    while changed:
        changed = False
        for gid, g in enumerate(groups):
            if not g.alive:
                continue
            for h in sorted(g.succ, key=lambda x: groups[x].level):
                gh = groups[h]
                # a group that only needs program inputs and constants (e.g. a gradient
                # seed) joins its consumer whatever the phase, unless another consumer
                # runs in an earlier phase: made in a backward, a value the forward also
                # reads (a dropout mask from a key argument, recomputed by remat) would
                # make that forward wait for the backward (a deadlock in the schedule)
                same = (
                    gh.stage == g.stage
                    and gh.mb == g.mb
                    and gh.segment == g.segment
                    and (
                        g.mb is None
                        or gh.phase == g.phase
                        or (
                            not g.pred
                            and all(
                                _PHASE_RANK[groups[c].phase] >= _PHASE_RANK[gh.phase]
                                for c in g.succ
                            )
                        )
                    )
                )
                if (
                    same
                    and (g.mb is not None or may_join(gid, h))
                    and not sends(gid)
                    and not reaches_via_other(gid, h)
                ):
                    merge(h, gid)  # run g's work with h
                    changed = True
                    break  # g is gone: on to the next group (another pass follows)
    # independent same-key leftovers with no dependency (e.g. two unrelated pieces)
    # stay separate: they are ordered by level.

    # 3. actions and the zero-bubble split
    sched_rows: dict[int, tuple[Any, list[list[Action]], dict[int, int]]] = {}
    if loops:
        sched_rows = _build_schedules(groups, loops, labels)
        for loop, (sched, _rows, _m) in sched_rows.items():
            if sched.splits_backward:
                _split_backward(groups, loop, prog, placement, transfers_from)
        rebuild_edges()
        for loop, (sched, rows, _m) in sched_rows.items():
            if sched.splits_backward:
                while _defer_joins(groups, loop, rows, prog, source_group):
                    rebuild_edges()

    # 4. per-submesh order
    for g in groups:
        if not g.eqns:
            g.alive = False
    stages = sorted({g.stage for g in groups if g.alive})
    topo = _topo_positions(groups)
    seqs: dict[int, list[int]] = {}
    # Each submesh runs its loops in program order, and work outside them in the gaps:
    # after the loops it depends on, and before the first loop that needs it. Within
    # that range it runs as early as possible if another stage waits for it (sent early,
    # it does not wait for this stage's loop) and otherwise as late as possible: e.g. an
    # optimizer's moment decay, which needs only the old state, runs after the loop with
    # the update it feeds (one fragment, fused by XLA, no buffers held over the loop).
    loop_members: dict[int, list[int]] = {}
    for gid, g in enumerate(groups):
        if g.alive and g.eqns and g.mb is not None:
            loop_members.setdefault(g.mb[0], []).append(gid)
    after_loop = {j: _reach(groups, m, "succ") for j, m in loop_members.items()}
    before_loop = {j: _reach(groups, m, "pred") for j, m in loop_members.items()}
    for s in stages:
        mine = [gid for gid, g in enumerate(groups) if g.alive and g.eqns and g.stage == s]
        loop_groups = [gid for gid in mine if groups[gid].mb is not None]
        my_loops = sorted({groups[gid].mb[0] for gid in loop_groups})
        gaps: dict[int, int] = {}  # non-loop group -> the gap before my_loops[gap]
        inside: dict[int, int] = {}  # non-loop group -> the loop of mine it runs within
        for gid in mine:
            if groups[gid].mb is not None:
                continue
            lo = max((k + 1 for k, j in enumerate(my_loops) if gid in after_loop[j]), default=0)
            hi = min(
                (sum(1 for m in my_loops if m < j) for j in loop_members if gid in before_loop[j]),
                default=len(my_loops),
            )
            if hi < lo:
                # needs a loop's results and feeds that loop: the gradient seed of a
                # non-linear function of the loop's output, with jax.grad outside
                # mm.microbatch. It runs within that loop, between the work it needs and
                # the work that needs it (every forward before it, every backward after)
                if hi != lo - 1:
                    raise ValueError(_loops_error(groups, gid, prog))
                inside[gid] = my_loops[hi]
                gaps[gid] = hi  # its producers outside loops run before that loop
            else:
                gaps[gid] = lo if sends(gid) else hi
        # a producer runs no later than its consumers on this submesh
        for gid in sorted(gaps, key=topo.__getitem__, reverse=True):
            for p in groups[gid].pred:
                if p in gaps:
                    gaps[p] = min(gaps[p], gaps[gid])
        seq: list[int] = []
        for k in range(len(my_loops) + 1):
            seq += sorted(
                (g for g, at in gaps.items() if at == k and g not in inside),
                key=topo.__getitem__,
            )
            if k < len(my_loops):
                j = my_loops[k]
                rows = {j: sched_rows[j]} if j in sched_rows else {}
                order = _loop_order(
                    groups, [g for g in loop_groups if groups[g].mb[0] == j], rows, topo
                )
                for gid in sorted((g for g, lp in inside.items() if lp == j), key=topo.__getitem__):
                    order = _within_loop(groups, gid, order, labels, prog, sched_rows.get(j))
                seq += order
        seqs[s] = seq

    # merge a consumer that directly follows its producer on the same submesh
    for s in stages:
        seq = seqs[s]
        out: list[int] = []
        for gid in seq:
            if out:
                prev = out[-1]
                gp, gc = groups[prev], groups[gid]
                if (
                    gid in gp.succ
                    and gp.mb == gc.mb
                    and gp.segment == gc.segment
                    and not sends(prev)
                    and not reaches_via_other(prev, gid)
                ) or (
                    # independent work outside loops (e.g. the loss and the optimizer
                    # update): one fragment, one compile, one launch
                    gp.mb is None
                    and gc.mb is None
                    and not sends(prev)
                    and not reaches(prev, gid)
                    and not reaches(gid, prev)
                ):
                    merge(prev, gid)
                    continue
            out.append(gid)
        seqs[s] = out

    order = _dispatch_order(groups, seqs, bool(effect_pairs))
    frags: list[Fragment] = []
    for gid in order:
        g = groups[gid]
        frags.append(
            Fragment(
                stage=g.stage,
                level=g.level,
                eqns=sorted(g.eqns),
                microbatch=g.mb[1] if g.mb else None,
                loop=g.mb[0] if g.mb else None,
                actions=list(g.actions),
                phases="".join(sorted({phase[i] for i in g.eqns}, key="FBW".index)),
            )
        )
    wire(prog, placement, frags)
    return frags


def _interleaved_stage_keys(prog, placement, labels, mbs) -> list[Any]:
    """Per equation, the task stage its group must belong to in an interleaved loop
    (several task stages on one submesh), else ``None``. Groups are first formed by
    level, and a group takes its task stage by majority: one stage's many key-only ops (a
    raw key's dropout bits) at the level of another stage's work on the same submesh
    would relabel that work, and the schedule would see a cycle. Untagged work goes with
    the task stage of what it reads."""
    n = len(prog.eqns)
    out: list[Any] = [None] * n
    if labels is None or not labels.virtual or not mbs:
        return out
    stages_of: dict[int, set[int]] = {}
    subs_of: dict[int, set[int]] = {}
    for i in range(n):
        if mbs[i] is not None and labels.tasks[i] is not None and labels.virtual[i] is not None:
            stages_of.setdefault(mbs[i][0], set()).add(labels.virtual[i])
            subs_of.setdefault(mbs[i][0], set()).update(placement.instances[i])
    interleaved = {j for j in stages_of if len(stages_of[j]) > len(subs_of[j])}
    if not interleaved:
        return out
    var_virt: dict[Any, Any] = {}
    for i, e in enumerate(prog.eqns):
        if mbs[i] is None or mbs[i][0] not in interleaved:
            continue
        if labels.tasks[i] is not None:
            v = labels.virtual[i]
        else:
            v = next(
                (var_virt[a] for a in e.invars if not isinstance(a, Literal) and a in var_virt),
                None,
            )
        out[i] = v
        if v is not None:
            for o in e.outvars:
                var_virt[o] = v
    return out


def _segments(prog: FlatProgram, placement: Placement, labels: Labels | None, mbs) -> Any:
    """Per equation, the segment of its submesh's loop work it belongs to (``None``: one
    segment everywhere).

    A submesh whose microbatch work mixes tasks that other submeshes also run (the same
    program: e.g. a transformer block) with tasks found nowhere else (the embedding on the
    first stage, the head on the last) runs them as separate fragments, consecutive runs of
    each kind: the shared part then compiles once for every submesh (one executable,
    relocated), instead of once inside each submesh's own mix. Untagged work in a
    microbatch joins the segment of the task it reads from (else of the one it feeds)."""
    if labels is None or not labels.tasks:
        return None
    n = len(prog.eqns)
    tasks = labels.tasks
    where = [
        placement.instances[i][0] if len(placement.instances[i]) == 1 else None for i in range(n)
    ]
    order: dict[tuple[int, int], list[Any]] = {}  # (loop, submesh) -> tasks in program order
    eqns_of: dict[tuple[int, Any], list[int]] = {}
    for i in range(n):
        mb, t = mbs[i], tasks[i]
        if mb is None or t is None or mb[1] != 0 or where[i] is None:
            continue
        ts = order.setdefault((mb[0], where[i]), [])
        if t not in ts:
            ts.append(t)
        eqns_of.setdefault((mb[0], t), []).append(i)
    sig = {key: _signature(prog, idx) for key, idx in eqns_of.items()}
    task_on: dict[tuple[int, Any], set[int]] = {}  # (loop, task signature) -> submeshes
    for (loop, s), ts in order.items():
        for t in ts:
            task_on.setdefault((loop, sig[(loop, t)]), set()).add(s)
    # each submesh's tasks as runs of consecutive shared / unshared ones
    runs: dict[tuple[int, int], list[tuple[bool, list[Any]]]] = {}
    run_on: dict[tuple[int, tuple[Any, ...]], set[int]] = {}  # shared runs' signatures
    for (loop, s), ts in order.items():
        mine = runs[(loop, s)] = []
        for t in ts:
            shared = len(task_on[(loop, sig[(loop, t)])]) > 1
            if mine and mine[-1][0] == shared:
                mine[-1][1].append(t)
            else:
                mine.append((shared, [t]))
        for shared, run in mine:
            if shared:
                run_on.setdefault(_run_key(loop, run, sig), set()).add(s)
    seg_of: dict[tuple[int, int, Any], int] = {}
    for (loop, s), mine in runs.items():
        # split only where a shared run is a program another submesh runs too
        if len(mine) < 2 or not any(
            shared and len(run_on[_run_key(loop, run, sig)]) > 1 for shared, run in mine
        ):
            continue
        for k, (_shared, run) in enumerate(mine):
            for t in run:
                seg_of[(loop, s, t)] = k
    if not seg_of:
        return None
    seg = [0] * n
    known = [False] * n
    for i in range(n):
        if mbs[i] is not None and tasks[i] is not None and where[i] is not None:
            seg[i] = seg_of.get((mbs[i][0], where[i], tasks[i]), 0)
            known[i] = True
    producer = {o: i for i, e in enumerate(prog.eqns) for o in e.outvars}
    consumers: dict[int, list[int]] = {}
    for i, e in enumerate(prog.eqns):
        for a in e.invars:
            if not isinstance(a, Literal) and a in producer:
                consumers.setdefault(producer[a], []).append(i)

    def same_place(i: int, j: int) -> bool:
        return known[j] and mbs[j] == mbs[i] and where[j] == where[i]

    for i in range(n):  # untagged loop work: from what it reads
        if mbs[i] is None or known[i]:
            continue
        src = [
            producer[a] for a in prog.eqns[i].invars if not isinstance(a, Literal) and a in producer
        ]
        j = next((j for j in src if same_place(i, j)), None)
        if j is not None:
            seg[i], known[i] = seg[j], True
    for i in reversed(range(n)):  # ... else from what it feeds
        if mbs[i] is None or known[i]:
            continue
        j = next((j for j in consumers.get(i, ()) if same_place(i, j)), None)
        if j is not None:
            seg[i], known[i] = seg[j], True
    return seg


def _run_key(loop: int, run: list[Any], sig: dict[tuple[int, Any], Any]) -> Any:
    return (loop, tuple(sig[(loop, t)] for t in run))


def _signature(prog: FlatProgram, idx: list[int]) -> Any:
    """A structural key of equations ``idx``: primitives, parameters, shapes and wiring,
    not variable identities (two submeshes' copies of one layer have equal keys)."""
    local: dict[Any, int] = {}
    outside: dict[Any, int] = {}
    items = []
    for i in idx:
        e = prog.eqns[i]
        ins = []
        for a in e.invars:
            if isinstance(a, Literal):
                ins.append(("lit", str(a)))
            elif a in local:
                ins.append(("local", local[a]))
            else:
                ins.append(("in", outside.setdefault(a, len(outside)), str(a.aval)))
        for o in e.outvars:
            local[o] = len(local)
        params = tuple(sorted((k, _param_key(v)) for k, v in e.params.items()))
        items.append((e.primitive.name, params, tuple(ins), tuple(str(o.aval) for o in e.outvars)))
    return tuple(items)  # compared exactly: the same on every process


def _param_key(v: Any) -> Any:
    """A parameter without device identities (a sharding on another submesh of the same
    shape is the same parameter here)."""
    if isinstance(v, (tuple, list)):
        return tuple(_param_key(x) for x in v)
    if isinstance(v, NamedSharding):
        return ("named", tuple(v.mesh.shape.items()), str(v.spec), v.memory_kind)
    if isinstance(v, (Mesh, AbstractMesh)):
        return ("mesh", tuple(v.shape.items()))
    return str(v)


def _only(stages: list[int]) -> int:
    return stages[0] if stages else -1


def _topo_positions(groups: list[_Group], strict: bool = False) -> dict[int, int]:
    """A topological order of the live groups (earliest level first); ``strict``: only
    the groups not on a cycle."""
    import heapq

    alive = [gid for gid, g in enumerate(groups) if g.alive]
    indeg = {gid: sum(1 for p in groups[gid].pred if groups[p].alive) for gid in alive}
    heap = [(groups[g].level, g) for g in alive if indeg[g] == 0]
    heapq.heapify(heap)
    pos: dict[int, int] = {}
    while heap:
        _, g = heapq.heappop(heap)
        pos[g] = len(pos)
        for c in groups[g].succ:
            if c in indeg:
                indeg[c] -= 1
                if indeg[c] == 0:
                    heapq.heappush(heap, (groups[c].level, c))
    if strict:
        return pos
    for g in alive:  # groups on a cycle: the dispatcher reports it
        pos.setdefault(g, len(pos) + groups[g].level)
    return pos


def _reach(groups: list[_Group], roots: list[int], edges: str) -> set[int]:
    """The groups reachable from ``roots`` along ``edges`` ("succ": descendants, "pred":
    ancestors), the roots excluded unless on a path."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        for y in getattr(groups[stack.pop()], edges):
            if y not in seen:
                seen.add(y)
                stack.append(y)
    return seen


def _build_schedules(groups, loops, labels):
    """Map loop groups to schedule actions; build and validate each loop's schedule.

    A schedule is built over pipeline *positions* (the order in which the forward pass
    visits the task stages, found from the data flow), then translated back to the
    task stages, so a pipeline may use its stages in any order (e.g. 2, 1, 0)."""
    out = {}
    for loop, info in enumerate(loops):
        mine = [gid for gid, g in enumerate(groups) if g.alive and g.mb and g.mb[0] == loop]
        if not mine:
            continue
        virt_of: dict[int, int] = {}
        for gid in mine:
            vs = [
                labels.virtual[i]
                for i in groups[gid].eqns
                if labels.virtual and labels.tasks[i] is not None
            ]
            if vs:
                virt_of[gid] = max(set(vs), key=vs.count)
        used = sorted(set(virt_of.values()))
        if not used:
            continue
        submesh_of = {virt_of[g]: groups[g].stage for g in virt_of}
        S = len(set(submesh_of.values()))
        sched = info.schedule
        try:
            order = _pipeline_order(groups, mine, virt_of, used)
        except _Revisit as e:
            names: dict[int, set[str]] = {}
            by_mesh: set[str] = set()  # mesh= tasks: no virtual stage of their own
            for gid in mine:
                if gid in virt_of and groups[gid].phase == "F":
                    for i in groups[gid].eqns:
                        if labels.tasks[i] is not None:
                            names.setdefault(virt_of[gid], set()).add(labels.tasks[i].name)
                            if labels.tasks[i].mesh is not None and virt_of[gid] in e.stages:
                                by_mesh.add(labels.tasks[i].name)
            which = "; ".join(f"stage {v}: {sorted(names.get(v, ()))}" for v in e.stages)
            interleaved = "interleaved" in str(getattr(sched, "name", ""))
            raise ValueError(
                f"the microbatch loop's forward pass goes back to a stage it has left (task "
                f"stages {e.stages} feed each other in a cycle; tasks by stage: {which}). A "
                "pipeline's stages must form a chain: give the task that comes back (e.g. a "
                "tied head next to its embedding) a stage of its own or the last stage's, "
                "and let its weights move there."
                + (
                    f" An interleaved schedule ({sched.name!r}) numbers its tasks by virtual "
                    f"stage: 0, 1, ..., 2S-1 in pipeline order, stage v on submesh v % S "
                    f"(S={S} here), not by submesh (0, 1, 0, 1)."
                    if interleaved
                    else ""
                )
                + (
                    f" Tasks {sorted(by_mesh)} are mesh= tasks, which name a submesh, not a "
                    "virtual stage: each counts as its submesh's stage. Give an interleaved "
                    "pipeline's tasks stage= numbers."
                    if by_mesh and interleaved
                    else ""
                )
            ) from None
        num_virtual = len(order)
        chunks = max(1, num_virtual // max(S, 1))
        every = {
            labels.virtual[i]
            for gid in mine
            for i in groups[gid].eqns
            if labels.virtual and labels.tasks[i] is not None
        }
        if len(every) > max(num_virtual, S):
            raise ValueError(
                f"the microbatch loop's forward pass goes from one task stage straight to "
                f"another on the same submesh (task stage v runs on submesh v % the "
                f"mesh's number of submeshes), so such task stages run as one pipeline "
                f"stage: its {len(every)} task stages make {num_virtual} pipeline stages on "
                f"the {S} submesh(es) its tasks use. An interleaved pipeline "
                "visits the submeshes in turn (position p on submesh p % S): order the "
                "tasks so that consecutive stages are on different submeshes (visited 0, "
                "1, 2, ...)."
            )
        if num_virtual % S:
            raise ValueError(
                f"the microbatch loop has {num_virtual} pipeline stages on the {S} "
                "submeshes its tasks use; with interleaving, the number of task stages must "
                "be a multiple of the number of submeshes they use."
            )
        fixed = getattr(sched, "num_chunks", None)
        if fixed is not None and fixed != chunks:
            raise ValueError(
                f"schedule {sched.name!r} was given num_chunks={fixed}, but the microbatch "
                f"loop has {num_virtual} task stages on {S} submeshes ({chunks} per "
                "submesh): give num_chunks the model's stages per submesh, or leave it "
                "unset (Interleaved1F1B() counts them)."
            )
        if chunks > 1 and sched.chunks(S, num_virtual) == 1:
            raise ValueError(
                f"the microbatch loop has {num_virtual} task stages on {S} submeshes; "
                f"schedule {sched.name!r} runs one stage per submesh: use "
                "mm.schedules.Interleaved1F1B() (or fewer stages)."
            )
        firsts = [submesh_of[v] for v in order[:S]]
        if chunks > 1 and len(set(firsts)) < len(firsts):
            raise ValueError(
                f"the microbatch loop visits task stages in the order {order}; an "
                f"interleaved pipeline visits its {S} submeshes in turn, but its first "
                f"{S} stages are on submeshes {firsts}. Give consecutive stages different "
                f"submeshes (stage v on submesh v % {S}, visited 0, 1, 2, ...)."
            )
        for p, v in enumerate(order):
            if submesh_of[v] != submesh_of[order[p % S]]:
                raise ValueError(
                    f"the microbatch loop visits task stages in the order {order}; an "
                    f"interleaved pipeline needs the stage at position {p} on the same "
                    f"submesh as the one at position {p % S} (position p on submesh p % S), "
                    f"but stage {v} is on submesh {submesh_of[v]} and stage {order[p % S]} "
                    f"on {submesh_of[order[p % S]]}."
                )
        tagged = set(virt_of)
        for gid in mine:
            if gid not in virt_of:
                g = groups[gid]
                # untagged work continues the virtual stage it follows on its submesh (an
                # auxiliary loss from a later chunk belongs to that chunk, not the first)
                after = [
                    virt_of[p]
                    for p in g.pred
                    if p in virt_of and groups[p].stage == g.stage and groups[p].mb == g.mb
                ]
                if after:
                    virt_of[gid] = max(after) if g.phase == "F" else min(after)
                    continue
                cands = [virt_of[x] for x in mine if x in virt_of and groups[x].stage == g.stage]
                virt_of[gid] = min(cands) if cands else min(used)
        # a loop without a backward (inference) takes a forward-only Custom order too
        backward = any(groups[gid].phase != "F" for gid in mine)
        rows = sched.build(S, info.num_microbatches, chunks, backward=backward)
        rows = [[Action(order[a.stage], a.microbatch, a.phase) for a in row] for row in rows]
        for gid in mine:
            g = groups[gid]
            g.actions = [Action(virt_of[gid], g.mb[1], g.phase)]
        _fit_untagged(groups, mine, tagged, rows, submesh_of)
        out[loop] = (sched, rows, None)
    return out


def _fit_untagged(groups, mine, tagged, rows, submesh_of) -> None:
    """Move untagged loop work to a step of the schedule where its submesh has what it
    needs and has not yet run what needs it.

    The default step (the virtual stage it follows, in its own phase) can be too late: an
    auxiliary loss's gradient needs only forward values (its seed is a constant), so it is
    backward work with no backward input; given the backward step of its chunk, it would
    run after a later chunk that consumes it (interleaved 1F1B: a deadlock). Such work is
    first moved to the latest step before its first consumer on the submesh (or the
    earliest after its last producer); if that still closes a cycle through other
    submeshes (a consumer on another submesh that a step on this one waits for), to the
    nearest point of its submesh's order that closes none."""
    pos: dict[Action, int] = {}
    for row in rows:
        for a in row:
            pos.setdefault(a, len(pos))
    mine_set = set(mine)

    def bound(gid: int, edges: str) -> list[int]:
        g = groups[gid]
        out = []
        for x in _reach(groups, [gid], edges):
            gx = groups[x]
            if x in mine_set and gx.stage == g.stage and gx.mb == g.mb and gx.actions:
                if edges == "succ" and x not in tagged:
                    continue  # untagged descendants follow this one
                if gx.actions[0] in pos:
                    out.append(pos[gx.actions[0]])
        return out

    # the order as a graph: actions (each submesh's steps in sequence) and untagged groups,
    # with the data edges between them
    row_of = {submesh_of[row[0].stage]: row for row in rows if row}
    index = {a: k for row in rows for k, a in enumerate(row)}

    def node(x: int) -> Any:
        return groups[x].actions[0] if x in tagged else ("u", x)

    adj: dict[Any, set[Any]] = {}
    for row in rows:
        for a, b in zip(row, row[1:]):
            adj.setdefault(a, set()).add(b)
    for x in mine:
        for y in groups[x].succ:
            if y in mine_set and node(x) != node(y):
                adj.setdefault(node(x), set()).add(node(y))

    def reaches(starts: list[Any], targets: set[Any]) -> bool:
        seen: set[Any] = set()
        stack = list(starts)
        while stack:
            n = stack.pop()
            if n in targets:
                return True
            if n in seen:
                continue
            seen.add(n)
            stack.extend(adj.get(n, ()))
        return False

    def cyclic(gid: int, row: list[Action], t: int) -> bool:
        """Would running ``gid`` between ``row[t - 1]`` and ``row[t]`` close a cycle?"""
        starts = [node(y) for y in groups[gid].succ if y in mine_set]
        if t < len(row):
            starts.append(row[t])
        targets = {("u", gid)} | ({row[t - 1]} if t > 0 else set())
        return reaches(starts, targets)

    topo = _topo_positions(groups)
    for gid in sorted((x for x in mine if x not in tagged), key=topo.__getitem__):
        g = groups[gid]
        (act,) = g.actions
        row = row_of.get(g.stage)
        if act not in pos or row is None or act not in index:
            continue
        lo = max(bound(gid, "pred"), default=-1)
        hi = min(bound(gid, "succ"), default=len(pos))
        at = min(max(pos[act], lo), hi) if lo <= hi else pos[act]
        if at != pos[act]:
            (act,) = [
                a
                for a, p in pos.items()
                if p == at and submesh_of.get(a.stage) == g.stage and a.microbatch == g.mb[1]
            ]
            g.actions = [act]
        # in its step, it runs after the step's own work if it needs it, else before
        k = index[act]
        t = k + 1 if reaches([act], {("u", gid)}) else k
        if cyclic(gid, row, t):
            cands = sorted(range(len(row) + 1), key=lambda u: (abs(u - t), u))
            t = next((u for u in cands if not cyclic(gid, row, u)), t)
            if t < len(row):
                g.actions, g.order = [row[t]], -1  # first in that step
            else:
                g.actions, g.order = [row[-1]], 1  # last in the last step
        if t > 0:
            adj.setdefault(row[t - 1], set()).add(("u", gid))
        if t < len(row):
            adj.setdefault(("u", gid), set()).add(row[t])


def _pipeline_order(groups, mine, virt_of, used) -> list[int]:
    """Task stages in the order the forward pass visits them (ties: lowest first)."""
    after: dict[int, set[int]] = {v: set() for v in used}
    for gid in mine:
        g = groups[gid]
        if g.phase != "F" or gid not in virt_of:
            continue
        for p in g.pred:
            gp = groups[p]
            if p in virt_of and gp.phase == "F" and gp.mb == g.mb and virt_of[p] != virt_of[gid]:
                after[virt_of[gid]].add(virt_of[p])
    order: list[int] = []
    left = set(used)
    while left:
        ready = sorted(v for v in left if after[v] <= set(order))
        if not ready:
            raise _Revisit(sorted(left))
        order.append(ready[0])
        left.discard(ready[0])
    return order


def _split_backward(groups, loop, prog, placement, transfers_from):
    """Split each backward loop group into B (what other stages' work in the loop needs,
    and what that needs on this stage, across its segments) and W (the rest).

    A value sent only to work after the loop (the last microbatch's sum of a weight's
    gradient, for a weight whose gradients meet on another stage) is W work: in B it
    made the last microbatch's B wait for the previous microbatch's W, which an order
    may run later (a deadlock in a ``Custom`` order, found by the property test)."""
    parts: dict[tuple[int, Any], list[int]] = {}
    read_in_loop: set[Slot] = set()  # (value, stage) read by this loop's work
    for gid, g in enumerate(groups):
        if g.alive and g.mb is not None and g.mb[0] == loop:
            for i in g.eqns:
                read_in_loop.update(
                    (a, g.stage) for a in prog.eqns[i].invars if not isinstance(a, Literal)
                )
            if g.phase == "B":
                parts.setdefault((g.stage, g.mb), []).append(gid)

    def sent_into_loop(o: Any, stage: int) -> bool:
        return any((o, dst) in read_in_loop for dst in transfers_from.get((o, stage), ()))

    for (stage, _mb), gids in parts.items():
        eqns = sorted(set().union(*(groups[gid].eqns for gid in gids)))
        producer = {o: i for i in eqns for o in prog.eqns[i].outvars}
        need: set[int] = set()
        stack = [
            producer[o] for i in eqns for o in prog.eqns[i].outvars if sent_into_loop(o, stage)
        ]
        while stack:
            i = stack.pop()
            if i in need:
                continue
            need.add(i)
            for a in prog.eqns[i].invars:
                if not isinstance(a, Literal) and a in producer:
                    stack.append(producer[a])
        for gid in gids:
            g = groups[gid]
            rest = g.eqns - need
            (act,) = g.actions
            w_act = Action(act.stage, act.microbatch, "W")
            w = _Group(g.stage, g.mb, "W", g.level + 1, rest, actions=[w_act], segment=g.segment)
            groups.append(w)
            g.eqns = g.eqns & need


def _defer_joins(groups, loop, rows, prog, source_group) -> bool:
    """Move the work of a W step that needs a W step its submesh's order runs *later*
    into that later step; whether anything moved (the caller rebuilds the edges and
    calls again until nothing does).

    A weight used by two virtual stages on one submesh (a shared weight) has its
    gradient contributions summed, and accumulated over microbatches, in the W of the
    stage the backward reaches last. An order (``Custom``) that runs that W first still
    runs: the sum, and what follows it, run with the later W. Only W work moves (it
    sends nothing another submesh waits for), and only later on its own submesh."""
    pos = {a: k for row in rows for k, a in enumerate(row)}

    def step(x: int) -> int | None:
        gx = groups[x]
        ok = gx.alive and gx.phase == "W" and gx.mb is not None and gx.mb[0] == loop
        return pos.get(gx.actions[0]) if ok and gx.actions else None

    for gid, g in enumerate(groups):
        k = step(gid)
        if k is None or not g.eqns:
            continue
        at = {p: step(p) for p in g.pred if groups[p].stage == g.stage}
        later = {p for p, t in at.items() if t is not None and t > k}
        if not later:
            continue
        into = max(later, key=at.__getitem__)
        moved: set[int] = set()
        made: set[Any] = set()  # the moved equations' results
        for i in sorted(g.eqns):  # program order: producers before consumers
            ins = [a for a in prog.eqns[i].invars if not isinstance(a, Literal)]
            if any(a in made or source_group((a, g.stage)) in later for a in ins):
                moved.add(i)
                made.update(prog.eqns[i].outvars)
        if not moved:
            continue
        g.eqns -= moved
        groups[into].eqns |= moved
        return True
    return False


def _loop_order(groups, loop_groups, sched_rows, topo):
    by_action: dict[Action, list[int]] = {}
    for gid in loop_groups:
        for a in groups[gid].actions:
            by_action.setdefault(a, []).append(gid)
    out: list[int] = []
    placed: set[int] = set()
    for _loop, (_sched, rows, _sub) in sorted(sched_rows.items()):
        for row in rows:
            for a in row:
                for gid in sorted(by_action.get(a, []), key=lambda x: (groups[x].order, topo[x])):
                    if gid not in placed and groups[gid].alive:
                        placed.add(gid)
                        out.append(gid)
    rest = [g for g in loop_groups if g not in placed and groups[g].alive]
    out += sorted(rest, key=lambda x: (groups[x].level, groups[x].mb))
    if any(not isinstance(sched, Custom) for sched, _r, _s in sched_rows.values()):
        out = _own_needs_first(groups, out)
    return out


def _own_needs_first(groups, seq: list[int]) -> list[int]:
    """``seq`` with each group's predecessors on the same submesh moved before it (else in
    ``seq``'s order). A built-in schedule knows only the pipeline's dependencies; a
    program can add more on one submesh, e.g. a tied weight's gradient accumulated in a
    microbatch's B after the previous microbatch's W: zero-bubble's deferred W then
    runs just before that B (the user's ``Custom`` order is kept, and checked)."""
    at = {g: i for i, g in enumerate(seq)}
    done: set[int] = set()
    out: list[int] = []

    def emit(g: int) -> None:
        done.add(g)
        for p in sorted((p for p in groups[g].pred if p in at and p not in done), key=at.get):
            emit(p)
        out.append(g)

    for g in seq:
        if g not in done:
            emit(g)
    return out


def _within_loop(groups, gid: int, order: list[int], labels, prog, sched: Any) -> list[int]:
    """Put a group that needs a loop's results and feeds the same loop into that loop's
    order on its submesh: right after the last work it needs; a clear error when work
    that needs it comes first (a schedule that starts backwards before every forward)."""
    need = _reach(groups, [gid], "pred")
    feeds = _reach(groups, [gid], "succ")
    last = max((k for k, x in enumerate(order) if x in need), default=-1)
    first = min((k for k, x in enumerate(order) if x in feeds), default=len(order))
    if last >= first:
        # GPipe (every forward, then every backward) cannot order it either when it
        # needs this loop's backward work or feeds this loop's forward work
        mine = set(order)
        no_schedule = any(groups[x].phase != "F" for x in need & mine) or any(
            groups[x].phase == "F" for x in feeds & mine
        )
        raise ValueError(_barrier_error(groups, gid, labels, prog, sched, no_schedule))
    return order[: last + 1] + [gid] + order[last + 1 :]


def _loops_error(groups, gid: int, prog) -> str:
    g = groups[gid]
    ops = sorted({prog.eqns[i].primitive.name for i in g.eqns})[:6]
    return (
        f"work on stage {g.stage} (operations {ops}) needs the results of one microbatch "
        "loop and feeds the backward of an earlier one: jax.grad taken outside several "
        "mm.microbatch loops that are combined non-linearly, or one loop's input made from "
        "another loop's output. Their forwards and backwards cannot be ordered one loop "
        "after the other. Take the gradient inside each loop "
        "(mm.microbatch(jax.value_and_grad(loss), M)) and combine the results outside."
    )


def _barrier_error(groups, gid: int, labels, prog, sched: Any, no_schedule: bool) -> str:
    g = groups[gid]
    name = sched[0].name if sched else None
    ops = sorted({prog.eqns[i].primitive.name for i in g.eqns})[:6]
    if name == "gpipe" or no_schedule:  # GPipe runs every forward first: not F then B
        return (
            f"the microbatch loop's work needs a value computed on stage {g.stage} from the "
            f"loop's whole output (operations {ops}) in a way no schedule can order: "
            "typically jax.grad taken outside an mm.microbatch of a gradient (second-order "
            "differentiation through the loop). Differentiate inside the loop (e.g. "
            "mm.microbatch(jax.grad(lambda w, x: f(jax.grad(loss)(w, x))), M)), or take "
            "the outer derivative without mm.microbatch."
        )
    return (
        f"the microbatch loop's backward needs a value computed on stage {g.stage} from "
        f"the loop's whole output (operations {ops}): typically jax.grad taken outside "
        "mm.microbatch of a non-linear function of its result (e.g. loss ** 2, log, "
        "sqrt). Every microbatch's forward must then finish before any backward starts"
        + (f", which schedule {name!r} does not do" if name else "")
        + ". Use schedule='gpipe', or"
        + " microbatch the gradient itself (mm.microbatch(jax.value_and_grad(loss), M)) "
        "and apply the non-linear function to the accumulated result with the chain rule "
        "outside."
    )


def _dispatch_order(groups, seqs: dict[int, list[int]], effects: bool = False) -> list[int]:
    pos = {s: 0 for s in seqs}
    done: set[int] = set()
    order: list[int] = []
    total = sum(len(v) for v in seqs.values())
    while len(order) < total:
        progressed = False
        for s, seq in seqs.items():
            if pos[s] < len(seq):
                gid = seq[pos[s]]
                if all(p in done for p in groups[gid].pred):
                    order.append(gid)
                    done.add(gid)
                    pos[s] += 1
                    progressed = True
        if not progressed:
            heads = [
                (s, seq[pos[s]], p)
                for s, seq in seqs.items()
                if pos[s] < len(seq)
                for p in sorted(groups[seq[pos[s]]].pred)
                if p not in done
            ]
            # a step waiting on work its own submesh runs later explains the deadlock
            # best; else the first submesh's
            own = [h for h in heads if groups[h[2]].stage == h[0]]
            s, gid, need = (own or heads)[0]
            what = groups[gid].actions or [f"level {groups[gid].level}"]
            dep = groups[need].actions or [f"level {groups[need].level}"]
            where = (
                "which this submesh's order runs after it"
                if groups[need].stage == s
                else f"on submesh {groups[need].stage}, which is scheduled after "
                "work that waits on this step"
            )
            raise ValueError(
                f"invalid schedule: {what[0]} on submesh {s} cannot run: it needs "
                f"{dep[0]}, {where} (deadlock). Reorder "
                "the schedule, or check the placement: in a pipeline each stage's "
                "forward may only use earlier stages' forwards (a layer placed on "
                "an earlier stage than its inputs needs its own, later stage)."
                + (
                    " Here a microbatch needs an earlier microbatch's work on a "
                    "later stage: state carried from one microbatch to the next "
                    "(one nnx.Rngs shared by dropout layers on several stages) "
                    "must be changed on one stage only; give each stage its own "
                    "(an Rngs per stage), or use a schedule that runs each stage's "
                    "microbatches after that state is made."
                    if _later_stage_of_earlier_mb(groups[gid], groups[need])
                    else ""
                )
                + (
                    " The program has ordered effects (io_callback / debug.print "
                    "with ordered=True), which must run in program order; use "
                    "ordered=False inside pipelined loops if their order does "
                    "not matter."
                    if effects
                    else ""
                )
            )
    return order


def _ref_error(prog: FlatProgram, frags: list[Fragment], k: int, consumers: set[Any]) -> str:
    def what(f: Fragment) -> str:
        tasks = sorted({str(r.name) for i in f.eqns for r in inline.eqn_tasks(prog.eqns[i])})
        return f"work on stage {f.stage} (tasks {tasks})"

    others = [frags[c] for c in consumers if isinstance(c, int) and c != k]
    where = (
        f"by other {what(others[0])}"
        if others
        else "outside the work that made it (moved to another submesh or returned)"
    )
    return (
        f"a mutable array reference (jax.new_ref) made by {what(frags[k])} is used "
        f"{where}. A reference cannot cross tasks, submeshes or microbatches under "
        "mm.jit: keep it within one task, or pass its value (ref[...]) and write the "
        "result back where the reference lives."
    )


def wire(prog: FlatProgram, placement: Placement, frags: list[Fragment]) -> None:
    """Fill each fragment's input and output slots."""
    producer: dict[Slot, int] = {}
    for k, f in enumerate(frags):
        for i in f.eqns:
            for o in prog.eqns[i].outvars:
                producer[(o, f.stage)] = k
    uses: dict[Slot, set[Any]] = {}  # slot -> consumers ("frag k", "transfer", "output")
    for k, f in enumerate(frags):
        seen: set[Slot] = set()
        local = set()
        for i in f.eqns:
            e = prog.eqns[i]
            for a in e.invars:
                if isinstance(a, Literal):
                    continue
                slot = (a, f.stage)
                if slot in local or slot in seen:
                    continue
                seen.add(slot)
                f.inputs.append(slot)
                uses.setdefault(slot, set()).add(k)
            for o in e.outvars:
                local.add((o, f.stage))
    for v, src, _dst in placement.transfers:
        uses.setdefault((v, src), set()).add("transfer")
    for v, stages in zip(prog.outvars, placement.outputs):
        if isinstance(v, Literal):
            continue
        for s in stages:
            uses.setdefault((v, s), set()).add("output")
    for slot, consumers in uses.items():
        k = producer.get(slot)
        if k is None:
            continue
        if any(c != k for c in consumers):
            if _compat.is_ref_aval(slot[0].aval):
                raise ValueError(_ref_error(prog, frags, k, consumers))
            frags[k].outputs.append(slot)
    # outputs in program order: the same work for another microbatch (or stage) then has
    # the same signature, so it shares (or relocates) one executable
    where = {o: (i, j) for i, e in enumerate(prog.eqns) for j, o in enumerate(e.outvars)}
    for f in frags:
        f.outputs.sort(key=lambda slot: where[slot[0]])
