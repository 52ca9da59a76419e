"""Place: decide where untagged equations run and what moves between submeshes.

Tagged equations run on their task's submesh. An untagged equation runs next to its
data: where its inputs already are, or else on the stage that minimises the bytes that
must move (inside a microbatch's work: where the value that work made furthest down its
flow is, then the bytes it made; on a tie, next to what tasks' work led to rather than
next to values computed from arguments only; then the lowest stage; untagged backward work is
judged as a region, see :func:`_choose_backward_region`). Untagged, effect-free equations
whose inputs are available everywhere (constants, host inputs) or on several stages are
*floating*: they are recomputed on each stage that needs them instead of being moved.
Program inputs committed to a submesh stay there; host inputs are put where they are
consumed.

A value's location is ``ANY`` (available anywhere) or a frozenset of stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from multimesh import _compat
from multimesh.compiler.accumulate import in_accumulation
from multimesh.compiler.ir import ANY, FlatProgram, Labels, Literal, Placement, aval_nbytes

_compat.register_exclusion(__file__)

Loc = frozenset | None


def _meet(locs: Sequence[Loc]) -> Loc:
    out: Loc = ANY
    for loc in locs:
        if loc is ANY:
            continue
        out = loc if out is ANY else out & loc
    return out


def _cost(
    moved: list[tuple[int, bool, bool, bool, frozenset]], c: int
) -> tuple[int, int, int, int, int]:
    """Placing on stage ``c``: (bytes of microbatch-made values moved, all bytes moved,
    bytes of arrays (not scalars) moved, bytes of values that tasks' work led to moved,
    ``c``) for inputs (bytes, made by the microbatch, led to by tasks' work, a scalar,
    where)."""
    away = [(b, made, led, sc) for b, made, led, sc, where in moved if c not in where]
    return (
        sum(b for b, made, _l, _s in away if made),
        sum(b for b, _m, _l, _s in away),
        sum(b for b, _m, _l, sc in away if not sc),
        sum(b for b, _m, led, _s in away if led),
        c,
    )


def _choose_backward_region(
    prog: FlatProgram,
    labels: Labels,
    i: int,
    s0: int,
    loc: dict[Any, Loc],
    fpos: dict[tuple[Any, int], int],
    producer: dict[Any, int],
    consumers: dict[Any, list[int]],
    bwd: set[Any],
    prefer: dict[int, int],
) -> None:
    """Choose one stage for the untagged backward work that starts at eqn ``i`` (its
    *region*: the untagged consumers in the same microbatch, transitively).

    Greedily, backward work runs where its cotangent is (``s0``, furthest down the flow),
    so the forward residuals it needs move there: an untagged LayerNorm between two
    tasks sends its 6 intermediates forward instead of its output. The region may run
    instead on a stage that its residuals are on and whose backward comes later (its
    forward came earlier), when all of the region's consumers that tasks place are on
    that stage or later in the backward flow; it does when that moves fewer bytes."""
    mbs = labels.microbatch
    mb = mbs[i]
    region: list[int] = []
    seen = {i}
    stack = [i]
    while stack and len(region) < 512:
        j = stack.pop()
        region.append(j)
        e = prog.eqns[j]
        # its consumers, and the other users of a cotangent it reads (e.g. a LayerNorm's
        # scale gradient next to its input gradient): one region
        near = [o for o in e.outvars]
        near += [a for a in e.invars if not isinstance(a, Literal) and a in bwd]
        for o in near:
            for k in consumers.get(o, ()):
                if (
                    k not in seen
                    and k > i
                    and labels.stages[k] is None
                    and mbs[k] == mb
                    and not in_accumulation(prog.eqns[k])
                ):
                    seen.add(k)
                    stack.append(k)
    if stack:
        return  # too large to judge: keep the greedy choice
    inside = set(region)
    here = fpos.get((mb, s0))

    def where(a: Any) -> Loc:
        j = producer.get(a)
        if j is None or j < i:
            return loc.get(a, ANY)
        return frozenset({labels.stages[j]}) if labels.stages[j] is not None else ANY

    ins: dict[Any, Loc] = {}
    outs: dict[tuple[Any, int], int] = {}  # (value, consuming stage) -> bytes
    for j in region:
        e = prog.eqns[j]
        for a in e.invars:
            if not isinstance(a, Literal) and producer.get(a) not in inside:
                ins[a] = where(a)
        for o in e.outvars:
            for k in consumers.get(o, ()):
                if k not in inside and labels.stages[k] is not None:
                    outs[(o, labels.stages[k])] = aval_nbytes(o.aval)

    def ok(c: int) -> bool:
        if c == s0:
            return True
        at = fpos.get((mb, c))
        if here is None or at is None or at >= here:
            return False  # c's backward does not come after s0's
        return all(
            fpos.get((mb, t)) is not None and fpos[(mb, t)] <= at for _o, t in outs if t != c
        )

    def there(a: Any, c: int, w: Loc) -> bool:
        # where it is, or where a task uses it anyway (e.g. the next stage's input)
        return w is ANY or c in w or any(labels.stages[k] == c for k in consumers.get(a, ()))

    def cost(c: int) -> int:
        moved = sum(aval_nbytes(a.aval) for a, w in ins.items() if not there(a, c, w))
        return moved + sum(b for (_o, t), b in outs.items() if t != c)

    cands = {s0}.union(*(w for w in ins.values() if w is not ANY))
    best = min((c for c in cands if ok(c)), key=lambda c: (cost(c), c != s0, c))
    if best != s0:  # else each equation is placed greedily, next to its data
        for j in region:
            prefer[j] = best


def place(
    prog: FlatProgram,
    labels: Labels,
    input_locs: Sequence[Loc],
    default_stage: int = 0,
    follow: frozenset[Any] = frozenset(),
) -> Placement:
    """Assign every equation instance a stage; list the transfers between stages.

    Untagged, effect-free equations producing a variable in ``follow``, and untagged
    microbatch work on values made before the loop only, float whatever their inputs:
    they run on each stage that uses them, their inputs moved there before the loop
    (next to the data, a microbatch's cut of a batch or a broadcast of a parameter on a
    later submesh would make an earlier stage's microbatch work wait on that one's)."""
    loc: dict[Any, Loc] = {}
    for v, where in zip(prog.invars, input_locs):
        loc[v] = where
    for v in prog.constvars:
        loc[v] = ANY
    n = len(prog.eqns)
    placed: list[int | None] = [None] * n
    floating: list[bool] = [False] * n
    mbs = labels.microbatch
    made: dict[Any, int] = {}  # values made by microbatch work -> submesh hops to them
    bwd: set[Any] = set()  # values made by backward work
    led: set[Any] = set()  # values that tasks' work leads to (not from arguments only)
    fpos: dict[tuple[Any, int], int] = {}  # (microbatch, stage) -> its forward's first hop
    prefer: dict[int, int] = {}  # backward eqn -> the stage chosen for its region
    # regions only where each submesh is one pipeline stage (interleaved: a submesh's
    # chunks sit at several points of the flow, and the greedy rule stands)
    regions = not any(
        v is not None and v != st for v, st in zip(labels.virtual or (), labels.stages)
    )
    # where each submesh first appears in the loops' forward task order: on a tie in
    # submesh hops, forward microbatch work runs on the stage further down the pipeline
    # (a skip add joining stage 0's output with stage 1's after stage 1's first task
    # stays on stage 1; on stage 0 the microbatch's forward would go back to stage 0)
    flow_rank: dict[int, int] = {}
    if regions and mbs:
        for i, e in enumerate(prog.eqns):
            st = labels.stages[i]
            if (
                st is not None
                and mbs[i] is not None
                and st not in flow_rank
                and not _compat.is_transposed(e.source_info.name_stack)
            ):
                flow_rank[st] = len(flow_rank)
    consumers: dict[Any, list[int]] = {}
    producer: dict[Any, int] = {}
    for i, e in enumerate(prog.eqns):
        for o in e.outvars:
            producer[o] = i
        for a in e.invars:
            if not isinstance(a, Literal):
                consumers.setdefault(a, []).append(i)
    used_on: dict[Any, frozenset] = {  # value -> the stages of tasks that read it
        a: frozenset(labels.stages[k] for k in ks if labels.stages[k] is not None)
        for a, ks in consumers.items()
    }

    for i, e in enumerate(prog.eqns):
        ins = list(dict.fromkeys(a for a in e.invars if not isinstance(a, Literal)))
        s = labels.stages[i]
        follow_i = False
        choice = False
        in_mb = bool(mbs) and mbs[i] is not None
        back = _compat.is_transposed(e.source_info.name_stack) or any(a in bwd for a in ins)
        if back:
            bwd.update(e.outvars)
        if s is not None or any(a in led for a in ins):
            led.update(e.outvars)
        if s is None:
            locs = [loc[a] for a in ins]
            meet = _meet(locs)
            pure = not e.effects
            if pure and (
                any(o in follow for o in e.outvars)
                or (in_mb and ins and not any(a in made for a in ins))
            ):
                # a cut, or microbatch work on values made before the loop only (a
                # broadcast of a parameter): run where used, its inputs moved before the
                # loop; next to them it could make a stage wait on a later one
                floating[i] = True
                follow_i = True
            elif meet is ANY:
                if pure:
                    floating[i] = True
                else:
                    s = default_stage
            elif len(meet) == 1:
                (s,) = meet
            elif len(meet) > 1:
                if pure:
                    floating[i] = True
                else:
                    s = min(meet)
            else:
                choice = True
                cands = sorted(set().union(*[where for where in locs if where is not ANY]))

                # in a microbatch's work, values made by that work count first: moving
                # one makes this submesh's microbatch work wait on another's, while
                # values made outside the loop (a batch's slices) move before it
                # ... then, on a tie in bytes, the work continues next to what tasks
                # made rather than next to values computed from arguments only (an
                # optimizer update: `b1 * mu + (1 - b1) * g` with the state on stage 0
                # and the gradient on stage 3 runs on stage 3, so the new state and
                # parameters stay with the gradient's task instead of moving every step)
                # (a value a task uses on stage c goes to c anyway: free there; a
                # residual add after stage 1's task, of its input from stage 0 and its
                # output, stays on stage 1 instead of sending both back to stage 0)
                # ... and on a tie, scalars move rather than arrays: a size-1 bias's
                # gradient times the global norm's scale stays with the gradient (a
                # scalar is usually read on every stage: a step count, a norm)
                moved = [
                    (
                        aval_nbytes(a.aval),
                        in_mb and a in made,
                        a in led,
                        not getattr(a.aval, "shape", ()),
                        where | used_on[a],
                    )
                    for a, where in zip(ins, locs)
                    if where is not ANY
                ]
                # ... and among those, it runs where the one furthest down the
                # microbatch's flow is (most submesh hops from its start): the work
                # continues where the data flows (a residual or an auxiliary loss from
                # stage 0 added after the last stage stays on the last stage, instead of
                # sending that microbatch's work back to stage 0)
                down = {
                    c: max(
                        (
                            made[a]
                            for a, w in zip(ins, locs)
                            if a in made and w is not ANY and c in w
                        ),
                        default=-1,
                    )
                    for c in cands
                }
                s = min(
                    cands,
                    key=lambda c: (
                        -down[c] if in_mb else 0,
                        -flow_rank.get(c, -1) if in_mb and not back else 0,
                        *_cost(moved, c),
                    ),
                )
        if i in prefer:
            s = prefer[i]  # in a region placed as one
        elif choice and in_mb and back and regions and not in_accumulation(e):
            # backward work with inputs on two stages: judge its region as a whole
            _choose_backward_region(prog, labels, i, s, loc, fpos, producer, consumers, bwd, prefer)
            s = prefer.get(i, s)
        if in_mb and not follow_i:
            hops = [
                made[a] + (0 if floating[i] or loc[a] is ANY or s in loc[a] else 1)
                for a in ins
                if a in made
            ]
            for o in e.outvars:
                made[o] = max(hops, default=0)
            if not back and not floating[i] and e.outvars:
                key = (mbs[i], s)
                fpos[key] = min(fpos.get(key, made[e.outvars[0]]), made[e.outvars[0]])
        if floating[i]:
            out_loc = ANY if follow_i else _meet([loc[a] for a in ins])
        else:
            placed[i] = s
            out_loc = frozenset({s})
        for o in e.outvars:
            loc[o] = out_loc

    # --- demand: walk backwards from the outputs --------------------------------------
    instances: list[set[int]] = [set() for _ in range(n)]
    needed: dict[Any, set[int]] = {}
    transfers: dict[tuple[Any, int], int] = {}
    used: set[Any] = set()

    def demand(v0: Any, s0: int) -> None:
        work = [(v0, s0)]
        while work:
            v, s = work.pop()
            if isinstance(v, Literal):
                continue
            used.add(v)
            where = loc[v]
            if not (where is ANY or s in where):
                if (v, s) in transfers:
                    continue
                have = needed.get(v, set()) & where
                src = min(have) if have else min(where)
                transfers[(v, s)] = src
                s = src
            have = needed.setdefault(v, set())
            if s in have:
                continue
            have.add(s)
            j = producer.get(v)
            if j is not None and floating[j] and s not in instances[j]:
                instances[j].add(s)
                work.extend((a, s) for a in prog.eqns[j].invars)

    outs = [v for v in prog.outvars if not isinstance(v, Literal)]
    used.update(outs)
    # an argument returned as is comes back where it already is (its own layout), not
    # on every stage whose work reads it (ANY, an argument put by the plan: as below)
    args = set(prog.invars)
    home = {v: loc[v] for v in outs if v in args and loc[v]}
    for v, where in home.items():
        for s in sorted(where):
            demand(v, s)
    for v in outs:
        j = producer.get(v)
        if v in home:
            continue
        if j is not None and not floating[j]:
            demand(v, placed[j])  # type: ignore[arg-type]
        elif j is None and loc[v] is not ANY and len(loc[v]) == 1:
            demand(v, min(loc[v]))
    for i in range(n - 1, -1, -1):
        e = prog.eqns[i]
        if floating[i]:
            continue
        if e.effects or any(o in used for o in e.outvars):
            s = placed[i]
            instances[i].add(s)  # type: ignore[arg-type]
            for a in e.invars:
                demand(a, s)  # type: ignore[arg-type]

    # floating outputs nobody else needs: put them where their inputs are needed
    for v in outs:
        if needed.get(v):
            continue
        where = loc[v]
        j = producer.get(v)
        score: dict[int, int] = {}
        if j is not None:
            for a in prog.eqns[j].invars:
                if not isinstance(a, Literal):
                    for s in needed.get(a, ()):
                        score[s] = score.get(s, 0) + aval_nbytes(a.aval)
        if where is not ANY:
            score = {s: b for s, b in score.items() if s in where}
        if score:
            best = min(score, key=lambda s: (-score[s], s))
        elif where is ANY or default_stage in where:
            best = default_stage
        else:
            best = min(where)
        demand(v, best)
    outputs = [
        [] if isinstance(v, Literal) else sorted(home[v] if v in home else needed[v])
        for v in prog.outvars
    ]

    input_stages = {
        v: sorted(needed[v]) for v in list(prog.invars) + list(prog.constvars) if needed.get(v)
    }
    moves = [(v, src, dst) for (v, dst), src in transfers.items()]
    return Placement(
        instances=[sorted(x) for x in instances],
        input_stages=input_stages,
        transfers=moves,
        outputs=outputs,
    )
