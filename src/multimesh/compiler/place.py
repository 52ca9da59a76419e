"""Place: decide where untagged equations run and what moves between submeshes.

Tagged equations run on their task's submesh. An untagged equation runs next to its
data: where its inputs already are, or else on the stage that minimises the bytes that
must move (ties go to the lowest stage). Untagged, effect-free equations whose inputs are
available everywhere (constants, host inputs) or on several stages are *floating*: they
are recomputed on each stage that needs them instead of being moved. Program inputs
committed to a submesh stay there; host inputs are put where they are consumed.

A value's location is ``ANY`` (available anywhere) or a frozenset of stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from multimesh import _compat
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


def place(
    prog: FlatProgram,
    labels: Labels,
    input_locs: Sequence[Loc],
    default_stage: int = 0,
) -> Placement:
    """Assign every equation instance a stage; list the transfers between stages."""
    loc: dict[Any, Loc] = {}
    for v, l in zip(prog.invars, input_locs):
        loc[v] = l
    for v in prog.constvars:
        loc[v] = ANY
    n = len(prog.eqns)
    placed: list[int | None] = [None] * n
    floating: list[bool] = [False] * n

    for i, e in enumerate(prog.eqns):
        ins = list(dict.fromkeys(a for a in e.invars if not isinstance(a, Literal)))
        s = labels.stages[i]
        if s is None:
            locs = [loc[a] for a in ins]
            meet = _meet(locs)
            pure = not e.effects
            if meet is ANY:
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
                cands = sorted(set().union(*[l for l in locs if l is not ANY]))

                def cost(c: int) -> int:
                    return sum(
                        aval_nbytes(a.aval)
                        for a, l in zip(ins, locs)
                        if l is not ANY and c not in l
                    )

                s = min(cands, key=lambda c: (cost(c), c))
        if floating[i]:
            out_loc = _meet([loc[a] for a in ins])
        else:
            placed[i] = s
            out_loc = frozenset({s})
        for o in e.outvars:
            loc[o] = out_loc

    # --- demand: walk backwards from the outputs --------------------------------------
    needed: dict[Any, set[int]] = {}
    transfers: dict[tuple[Any, int], int] = {}
    used: set[Any] = set()
    out_positions: dict[Any, list[int]] = {}
    for k, v in enumerate(prog.outvars):
        if not isinstance(v, Literal):
            out_positions.setdefault(v, []).append(k)
    outputs: list[list[int]] = [[] for _ in prog.outvars]

    def demand(v: Any, s: int) -> None:
        if isinstance(v, Literal):
            return
        used.add(v)
        l = loc[v]
        if l is ANY or s in l:
            needed.setdefault(v, set()).add(s)
            return
        if (v, s) in transfers:
            return
        have = needed.get(v, set()) & l
        src = min(have) if have else min(l)
        needed.setdefault(v, set()).add(src)
        transfers[(v, s)] = src

    def resolve_output(v: Any) -> None:
        if v not in out_positions:
            return
        used.add(v)
        l = loc[v]
        have = needed.setdefault(v, set())
        if not have:
            have.add(default_stage if l is ANY or default_stage in l else min(l))
        stages = sorted(have)
        for k in out_positions[v]:
            outputs[k] = stages

    instances: list[list[int]] = [[] for _ in range(n)]
    for i in range(n - 1, -1, -1):
        e = prog.eqns[i]
        for o in e.outvars:
            resolve_output(o)
        if floating[i]:
            stages = sorted(set().union(*[needed.get(o, set()) for o in e.outvars]))
        else:
            live = e.effects or any(o in used for o in e.outvars)
            stages = [placed[i]] if live else []  # type: ignore[list-item]
        instances[i] = stages
        for s in stages:
            for a in e.invars:
                demand(a, s)
    for v in list(prog.invars) + list(prog.constvars):
        resolve_output(v)

    input_stages = {
        v: sorted(needed[v]) for v in list(prog.invars) + list(prog.constvars) if needed.get(v)
    }
    moves = [(v, src, dst) for (v, dst), src in transfers.items()]
    return Placement(
        instances=instances, input_stages=input_stages, transfers=moves, outputs=outputs
    )
