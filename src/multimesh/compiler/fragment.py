"""Fragment: cut placed equation instances into acyclic per-submesh fragments.

Each instance gets a level: the longest chain of cross-submesh transfers before it
(ASAP), then moved as late as its consumers allow (ALAP) so that independent work
joins the fragment that needs it. A fragment is all instances of one (stage, level).
Every edge between fragments goes to an equal level on the same stage or a strictly
higher level on another, so the fragment graph is acyclic; fragments run in
(level, stage) order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from multimesh import _compat
from multimesh.compiler.ir import FlatProgram, Literal, Placement

_compat.register_exclusion(__file__)

Slot = tuple[Any, int]  # (var, stage)


@dataclasses.dataclass
class Fragment:
    stage: int
    level: int
    eqns: list[int]  # indices into FlatProgram.eqns, in program order
    inputs: list[Slot] = dataclasses.field(default_factory=list)
    outputs: list[Slot] = dataclasses.field(default_factory=list)


def fragment(prog: FlatProgram, placement: Placement) -> list[Fragment]:
    """Group instances into fragments ordered by (level, stage)."""
    transfers_from: dict[Slot, list[int]] = {}
    for v, src, dst in placement.transfers:
        transfers_from.setdefault((v, src), []).append(dst)
    avail: dict[Slot, int] = {}  # level at which a value is available on a stage
    for v, stages in placement.input_stages.items():
        for s in stages:
            avail[(v, s)] = 0
    asap: dict[tuple[int, int], int] = {}

    def publish(slot: Slot, level: int) -> None:
        avail[slot] = level
        for dst in transfers_from.get(slot, ()):
            avail[(slot[0], dst)] = level + 1

    for v, stages in placement.input_stages.items():
        for s in stages:
            publish((v, s), 0)
    for i, e in enumerate(prog.eqns):
        for s in placement.instances[i]:
            lvl = 0
            for a in e.invars:
                if not isinstance(a, Literal):
                    lvl = max(lvl, avail[(a, s)])
            asap[(i, s)] = lvl
            for o in e.outvars:
                publish((o, s), lvl)

    # ALAP (one backward sweep): each consumer bounds its producers from above. A value
    # sent to another stage must be ready one level before its first use there.
    bound: dict[Slot, int] = {}
    final: dict[tuple[int, int], int] = {}
    for i in range(len(prog.eqns) - 1, -1, -1):
        e = prog.eqns[i]
        for s in placement.instances[i]:
            lim: int | None = None
            for o in e.outvars:
                cands = [bound.get((o, s))]
                cands += [
                    bound[(o, d)] - 1 for d in transfers_from.get((o, s), ()) if (o, d) in bound
                ]
                for b in cands:
                    if b is not None:
                        lim = b if lim is None else min(lim, b)
            lvl = asap[(i, s)] if lim is None else max(asap[(i, s)], lim)
            final[(i, s)] = lvl
            for a in e.invars:
                if not isinstance(a, Literal):
                    slot = (a, s)
                    if slot not in bound or lvl < bound[slot]:
                        bound[slot] = lvl

    groups: dict[tuple[int, int], list[int]] = {}
    for (i, s), lvl in final.items():
        groups.setdefault((lvl, s), []).append(i)
    frags = [
        Fragment(stage=s, level=lvl, eqns=sorted(idx)) for (lvl, s), idx in sorted(groups.items())
    ]
    _wire(prog, placement, frags)
    return frags


def _wire(prog: FlatProgram, placement: Placement, frags: list[Fragment]) -> None:
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
            frags[k].outputs.append(slot)
