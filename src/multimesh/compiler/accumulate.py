"""Accumulate: sum each stage's share of a gradient over microbatches on that stage.

``mm.microbatch`` sums a loop's outputs over microbatches, ``acc_k = acc_{k-1} + out_k``
(the additions are marked with :data:`multimesh.microbatch.ACCUMULATE_SCOPE`). When
``out_k`` is itself a sum of values made on different stages -- the gradient of a weight
used on two stages, e.g. a tied embedding used by the first stage's lookup and the last
stage's head -- the sum is computed on one of them, and the other stage sends its share
every microbatch. This pass keeps one accumulator per stage instead,

    acc_k[s] = acc_{k-1}[s] + (the shares of out_k made on stage s),

and adds the accumulators once after the loop: one transfer per step instead of one per
microbatch. The result is the same sum in another order (not bit-identical to the
reference when the shares do not add exactly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from multimesh import _compat
from multimesh.compiler.ir import FlatProgram, Labels, Literal, use_counts
from multimesh.microbatch import ACCUMULATE_SCOPE, decode_microbatch

_compat.register_exclusion(__file__)


def in_accumulation(e: Any) -> bool:
    """Whether ``e`` sums a loop's outputs over microbatches (``mm.microbatch`` marks it)."""
    return ACCUMULATE_SCOPE in _compat.scope_names(e.source_info.name_stack)


def _is_acc(e: Any) -> bool:
    return e.primitive.name == "add" and in_accumulation(e)


def split_accumulators(
    prog: FlatProgram, labels: Labels, placed: list[list[int]]
) -> tuple[FlatProgram, Labels]:
    """The program with per-stage accumulators where a microbatch sum mixes stages
    (``prog`` itself if none does). A share's stage is where placement put the equation
    that made it (``placed``: each equation's stages; recomputed values have none)."""
    if not labels.microbatch or not any(_is_acc(e) for e in prog.eqns):
        return prog, labels
    eqns = prog.eqns
    producer = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    uses = use_counts(prog)

    def shares(v: Any, mb: Any) -> tuple[list[Any], list[int]]:
        """The values summed into ``v`` (through single-use ``add_any``s of microbatch
        ``mb``) and the ``add_any`` equations that sum them."""
        if isinstance(v, Literal):  # (unhashable)
            return [v], []
        i = producer.get(v)
        if (
            i is None
            or eqns[i].primitive.name != "add_any"
            or uses.get(v, 0) != 1
            or labels.microbatch[i] != mb
        ):
            return [v], []
        leaves, nodes = [], [i]
        for a in eqns[i].invars:
            sub_leaves, sub_nodes = shares(a, mb)
            leaves += sub_leaves
            nodes += sub_nodes
        return leaves, nodes

    def stage_of(v: Any) -> int | None:
        i = None if isinstance(v, Literal) else producer.get(v)
        return None if i is None or len(placed[i]) != 1 else placed[i][0]

    # chains acc_0 -> acc_1 -> ... of accumulator additions
    acc_next: dict[int, int] = {}
    for i, e in enumerate(eqns):
        if _is_acc(e) and not isinstance(e.invars[0], Literal):
            j = producer.get(e.invars[0])
            if j is not None and _is_acc(eqns[j]) and uses.get(e.invars[0], 0) == 1:
                acc_next[j] = i
    continued = set(acc_next.values())
    starts = [i for i, e in enumerate(eqns) if _is_acc(e) and i not in continued]
    replace: dict[int, list[tuple[Any, Any]]] = {}  # eqn -> new (eqn, microbatch) pairs
    drop: set[int] = set()
    for i0 in starts:
        chain = [i0]
        while chain[-1] in acc_next:
            chain.append(acc_next[chain[-1]])
        if len(chain) < 2:
            continue
        plans = []
        for i in chain:
            mb = labels.microbatch[i]
            if isinstance(eqns[i].invars[1], Literal) or labels.tasks[i] is not None:
                break  # a constant, or additions a task places
            leaves, nodes = shares(eqns[i].invars[1], mb)
            groups: dict[Any, list[Any]] = {}
            for leaf in leaves:
                groups.setdefault(stage_of(leaf), []).append(leaf)
            plans.append((i, mb, nodes, groups))
        keys = [list(g) for _i, _mb, _n, g in plans]
        if len(plans) < len(chain) or len(keys[0]) < 2 or any(k != keys[0] for k in keys):
            continue  # one stage (nothing to gain), or shares that differ by microbatch
        any_eqn = eqns[plans[0][2][0]]
        acc_prev = {s: eqns[i0].invars[0] for s in keys[0]}
        for i, mb, nodes, groups in plans:
            e = eqns[i]
            ns = e.source_info.name_stack
            new: list[tuple[Any, Any]] = []
            for s, leaves in groups.items():
                part = leaves[0]
                for leaf in leaves[1:]:
                    out = _compat.Var(e.outvars[0].aval)
                    node = any_eqn.replace(invars=[part, leaf], outvars=[out])
                    new.append((_compat.with_name_stack(node, ns), mb))
                    part = out
                out = _compat.Var(e.outvars[0].aval)
                new.append((e.replace(invars=[acc_prev[s], part], outvars=[out]), mb))
                acc_prev[s] = out
            drop.update(nodes)
            replace[i] = new
        # after the loop: the accumulators' sum, as the last addition's result
        last = eqns[chain[-1]]
        outside = _compat.drop_scopes(
            last.source_info.name_stack,
            lambda n: n == ACCUMULATE_SCOPE or decode_microbatch(n) is not None,
        )
        accs = list(acc_prev.values())
        total = accs[0]
        tail: list[tuple[Any, Any]] = []
        for k, a in enumerate(accs[1:]):
            out = last.outvars[0] if k == len(accs) - 2 else _compat.Var(last.outvars[0].aval)
            add = last.replace(invars=[total, a], outvars=[out])
            tail.append((_compat.with_name_stack(add, outside), None))
            total = out
        replace[chain[-1]] += tail
    if not replace:
        return prog, labels
    new_eqns: list[Any] = []
    keep: list[int] = []  # per new equation, the old one whose labels it takes (-1: fresh)
    fresh_mb: list[Any] = []
    for i, e in enumerate(eqns):
        if i in drop:
            continue
        if i in replace:
            for ne, mb in replace[i]:
                new_eqns.append(ne)
                keep.append(-1)
                fresh_mb.append(mb)
            continue
        new_eqns.append(e)
        keep.append(i)
        fresh_mb.append(None)

    def pick(xs: list[Any], fresh: Any = None) -> list[Any]:
        if not xs:
            return xs
        return [xs[i] if i >= 0 else fresh for i in keep]

    labels = dataclasses.replace(
        labels,
        tasks=pick(labels.tasks),
        stages=pick(labels.stages),
        task_meshes=pick(labels.task_meshes),
        microbatch=[labels.microbatch[i] if i >= 0 else mb for i, mb in zip(keep, fresh_mb)],
        virtual=pick(labels.virtual),
    )
    return (
        FlatProgram(
            invars=prog.invars,
            constvars=prog.constvars,
            consts=prog.consts,
            outvars=prog.outvars,
            eqns=new_eqns,
            splits=prog.splits,
        ),
        labels,
    )
