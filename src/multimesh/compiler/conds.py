"""Split conditionals: an untagged ``lax.cond`` whose outputs read disjoint large inputs
becomes one ``cond`` per group of outputs (same predicate, same branches cut down to that
group's work), so placement runs each group next to its data.

Optimizer wrappers put a whole update under one ``cond`` (``optax.apply_if_finite``,
``optax.MultiSteps``): its inputs are every stage's parameters, gradients and moments.
Whole, it runs on one submesh, and every step each stage's parameters go there and back.
Per leaf the update reads that leaf's values plus scalars (the step count, the
predicate), so the groups are the outputs joined by the large inputs they share (scalars,
such as the count, are read by every group). A pure pass over the flat program.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from multimesh import _compat
from multimesh.compiler import inline
from multimesh.compiler.ir import FlatProgram

_compat.register_exclusion(__file__)


def split_conds(prog: FlatProgram) -> FlatProgram:
    """``prog`` with each splittable ``cond`` replaced by one ``cond`` per output group,
    and a ``cond`` whose groups meet only in scalars by one per group and phase."""
    eqns: list[Any] = []
    changed = False
    for e in prog.eqns:
        parts = _split_eqn(e)
        eqns.extend(parts or [e])
        changed = changed or parts is not None
    return dataclasses.replace(prog, eqns=eqns) if changed else prog


def _split_eqn(e: Any) -> list[Any] | None:
    """The equations replacing ``e`` (``None``: kept). Conds inside its branches are
    split first (``MultiSteps(apply_if_finite(...))`` nests one wrapper's cond in the
    other's), so that the outer cond's groups can be told apart."""
    if not _splittable(e):
        return None
    inner = _split_inner(e)
    base = inner or e
    parts = _split(base)
    out: list[Any] = []
    for part in parts or [base]:
        phased = _phase_split(part) if _splittable(part) else None
        out.extend(phased or [part])
    return out if inner is not None or parts is not None or len(out) > 1 else None


def _split_inner(e: Any) -> Any | None:
    """``e`` with the conds in its branches split (``None``: none were)."""
    branches = []
    changed = False
    for b in e.params["branches"]:
        j = b.jaxpr
        if not any(q.primitive.name in ("cond", "jit", "pjit") for q in j.eqns):
            branches.append(b)
            continue
        j = _inline_calls(j)
        eqns: list[Any] = []
        for q in j.eqns:
            parts = _split_eqn(q)
            eqns.extend(parts or [q])
            changed = changed or parts is not None
        branches.append(b.replace(jaxpr=j.replace(eqns=eqns)))
    if not changed:
        return None
    return e.replace(params={**e.params, "branches": tuple(branches)})


def _splittable(e: Any) -> bool:
    """An effect-free ``cond`` with no constants and no tasks inside."""
    if e.primitive.name != "cond" or e.effects or set(e.params) != {"branches"}:
        return False
    branches = e.params["branches"]
    if any(b.consts or b.jaxpr.constvars or b.jaxpr.effects for b in branches):
        return False
    # tasks inside: the cond runs on their submesh (inline's rule)
    return not any(inline.inner_tasks(b.jaxpr) for b in branches)


def _big(a: Any) -> bool:
    return not isinstance(a, _compat.Literal) and math.prod(a.aval.shape) > 1


def _split(e: Any) -> list[Any] | None:
    branches = e.params["branches"]
    operands = e.invars[1:]
    n_out = len(e.outvars)
    if n_out < 2:
        return None
    # scalars (a step count, a learning rate) may be read by several groups
    big = [_big(a) for a in operands]
    # outputs joined by the large operands they read (in any branch)
    parent = list(range(n_out))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    reader: dict[int, int] = {}  # large operand -> an output reading it
    for b in branches:
        for j, mask in enumerate(_input_masks(b.jaxpr)):
            for k in range(len(operands)):
                if mask >> k & 1 and big[k]:
                    parent[find(j)] = find(reader.setdefault(k, j))
    # outputs reading no large operand (counts, flags): one group
    readers = set(reader.values())
    free = [j for j in range(n_out) if j not in readers and find(j) == j]
    for j in free[1:]:
        parent[j] = free[0]
    groups: dict[int, list[int]] = {}
    for j in range(n_out):
        groups.setdefault(find(j), []).append(j)
    if len(groups) < 2:
        return None
    out = []
    for members in groups.values():
        used = [j in members for j in range(n_out)]
        keep = [False] * len(operands)
        for b in branches:
            _j, kept = _compat.dce_jaxpr(b.jaxpr, used)
            keep = [x or y for x, y in zip(keep, kept)]
        new_branches = tuple(
            b.replace(jaxpr=_compat.dce_jaxpr(b.jaxpr, used, keep)[0]) for b in branches
        )
        out.append(
            e.replace(
                invars=[e.invars[0]] + [a for a, k in zip(operands, keep) if k],
                outvars=[e.outvars[j] for j in members],
                params={**e.params, "branches": new_branches},
            )
        )
    return out


# -- groups that meet in scalars: one cond per group and phase ---------------------------


def _phase_split(e: Any) -> list[Any] | None:
    """``e`` as conds per (branch, group, phase), then one cond per output choosing the
    taken branch's value; ``None`` when no branch has two groups of large values.

    A clipped update (``clip_by_global_norm``) joins every leaf through one scalar, the
    global norm: per leaf a sum of squares (phase 0), their total (scalar work, phase 1),
    the scaled update (phase 2). Groups are joined by the large values they share;
    scalars cross groups only between phases. A branch's piece runs under a ``cond`` on
    the same predicate that gives zeros when another branch is taken; the last conds pick
    each output from the taken branch. ``merge_conds`` joins them again per fragment."""
    branches = [_inline_calls(b.jaxpr) for b in e.params["branches"]]
    cut = [_pieces(j) for j in branches]
    if all(n < 2 for _p, n in cut):
        return None
    if any(not _zeros_ok(o) for j in branches for q in j.eqns for o in q.outvars):
        return None  # PRNG keys, references: no zeros to stand in for them
    pred, operands = e.invars[0], e.invars[1:]
    n = len(branches)
    memo: dict[Any, Any] = {}
    out: list[Any] = []
    results: list[list[Any]] = []  # per branch: the outer atom of each output
    for b, (jaxpr, (pieces, _n)) in enumerate(zip(branches, cut)):
        outer: dict[Any, Any] = dict(zip(jaxpr.invars, operands))
        later = _needed(jaxpr, pieces)
        for piece in pieces:
            made = {o for q in piece for o in q.outvars}
            ins: list[Any] = []
            for q in piece:
                for a in q.invars:
                    if not isinstance(a, _compat.Literal) and a not in made and a not in ins:
                        ins.append(a)
            outs = [
                o
                for o in dict.fromkeys(o for q in piece for o in q.outvars)
                if not isinstance(o, _compat.DropVar) and o in later
            ]
            if not outs:
                continue
            if not ins:  # constants (an identity update's zeros): made where they are used
                out.extend(piece)
                outer.update((o, o) for o in outs)
                continue
            real = _compat.make_jaxpr_obj(ins, outs, list(piece), "cond_piece")
            zeros = _zeros_jaxpr(ins, outs, memo)
            new_outs = [_compat.Var(o.aval) for o in outs]
            for o, v in zip(outs, new_outs):
                outer[o] = v
            bodies = [jcore.ClosedJaxpr(real if i == b else zeros, []) for i in range(n)]
            out.append(
                e.replace(
                    invars=[pred] + [outer[a] for a in ins],
                    outvars=new_outs,
                    params={**e.params, "branches": tuple(bodies)},
                )
            )
        results.append([a if isinstance(a, _compat.Literal) else outer[a] for a in jaxpr.outvars])
    for j, ov in enumerate(e.outvars):
        if isinstance(ov, _compat.DropVar):
            continue
        picks = [results[i][j] for i in range(n)]
        ins = list(dict.fromkeys(a for a in picks if not isinstance(a, _compat.Literal)))
        bodies = []
        for a in picks:
            params = [_compat.Var(x.aval) for x in ins]
            ret = a if isinstance(a, _compat.Literal) else params[ins.index(a)]
            bodies.append(jcore.ClosedJaxpr(_compat.make_jaxpr_obj(params, [ret], [], "pick"), []))
        out.append(
            e.replace(
                invars=[pred] + ins,
                outvars=[ov],
                params={**e.params, "branches": tuple(bodies)},
            )
        )
    return out


def _inline_calls(jaxpr: Any) -> Any:
    """``jaxpr`` with nested sharding-free ``jit`` calls inlined (JAX's tree helpers put
    one around a whole pytree) and every inner variable fresh."""
    eqns: list[Any] = []

    def go(j: Any, env: dict[Any, Any]) -> None:
        def rd(a: Any) -> Any:
            return a if isinstance(a, _compat.Literal) else env.get(a, a)

        for q in j.eqns:
            body = q.params.get("jaxpr") if q.primitive.name in ("jit", "pjit") else None
            if body is not None and not body.consts and inline._inlinable_glue(q, q.source_info.name_stack):
                sub = {v: rd(a) for v, a in zip(body.jaxpr.invars, q.invars)}
                go(body.jaxpr, sub)
                for o, r in zip(q.outvars, body.jaxpr.outvars):
                    if not isinstance(o, _compat.DropVar):
                        env[o] = r if isinstance(r, _compat.Literal) else sub.get(r, r)
                continue
            outs = []
            for o in q.outvars:
                if not isinstance(o, _compat.DropVar):
                    env[o] = _compat.Var(o.aval)
                outs.append(env.get(o, o))
            eqns.append(q.replace(invars=[rd(a) for a in q.invars], outvars=outs))

    env: dict[Any, Any] = {}
    go(jaxpr, env)
    outvars = [a if isinstance(a, _compat.Literal) else env.get(a, a) for a in jaxpr.outvars]
    return jaxpr.replace(eqns=eqns, outvars=outvars)


def _pieces(jaxpr: Any) -> tuple[list[list[Any]], int]:
    """``jaxpr``'s equations cut into pieces, in a valid order, and how many groups of
    large values it has. A group: equations joined by the large values they read or
    make; equations on scalars only are one more group. A piece: one group's equations
    at one phase, the number of times a value crossed groups on the way to them."""
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    eqns = jaxpr.eqns
    touched = [False] * len(eqns)
    for i, q in enumerate(eqns):
        for a in (*q.invars, *q.outvars):
            if not isinstance(a, _compat.DropVar) and _big(a):
                parent[find(i)] = find(a)
                touched[i] = True
    unit = [find(i) if touched[i] else _SCALAR for i in range(len(eqns))]
    level = [0] * len(eqns)
    made: dict[Any, int] = {}
    for i, q in enumerate(eqns):
        for a in q.invars:
            p = None if isinstance(a, _compat.Literal) else made.get(a)
            if p is not None:
                level[i] = max(level[i], level[p] + (unit[p] != unit[i]))
        for o in q.outvars:
            made[o] = i
    pieces: dict[Any, list[Any]] = {}
    for i in sorted(range(len(eqns)), key=lambda i: level[i]):
        pieces.setdefault((level[i], unit[i]), []).append(eqns[i])
    groups = {u for u, t in zip(unit, touched) if t}
    return list(pieces.values()), len(groups)


_SCALAR = "scalars"


def _needed(jaxpr: Any, pieces: list[list[Any]]) -> set[Any]:
    """Values another piece reads or the jaxpr returns."""
    need = {a for a in jaxpr.outvars if not isinstance(a, _compat.Literal)}
    for piece in pieces:
        made = {o for q in piece for o in q.outvars}
        need |= {
            a
            for q in piece
            for a in q.invars
            if not isinstance(a, _compat.Literal) and a not in made
        }
    return need


def _zeros_ok(v: Any) -> bool:
    aval = getattr(v, "aval", None)
    return isinstance(aval, jax.core.ShapedArray) and not jax.dtypes.issubdtype(
        aval.dtype, jax.dtypes.extended
    )


def _zeros_jaxpr(ins: list[Any], outs: list[Any], memo: dict[Any, Any]) -> Any:
    """A jaxpr taking values like ``ins`` and giving zeros like ``outs``."""
    eqns: list[Any] = []
    rets = []
    have: dict[Any, Any] = {}
    for o in outs:
        key = (o.aval.shape, o.aval.dtype)
        if key not in have:
            if key not in memo:
                memo[key] = jax.make_jaxpr(lambda key=key: jnp.zeros(*key))().jaxpr
            z = memo[key]
            eqns.extend(z.eqns)
            have[key] = z.outvars[0]
        rets.append(have[key])
    return _compat.make_jaxpr_obj([_compat.Var(v.aval) for v in ins], rets, eqns, "zeros")


# -- conds on one predicate in one fragment: one cond ------------------------------------


def merge_conds(eqns: list[Any]) -> list[Any]:
    """``eqns`` (one fragment's, in a valid order) with the conds on one predicate joined
    into one cond wherever neither needs the other's results, in a valid order.

    ``split_conds`` cuts an optimizer's cond per leaf group and phase; a stage then runs
    many small conds on one predicate, and on GPUs each cond reads its predicate on the
    host. Joined, a stage runs one per phase."""
    if sum(_joinable(q) for q in eqns) < 2:
        return eqns
    node = list(range(len(eqns)))  # eqn -> the node it is part of (its group's first)
    deps: dict[int, set[int]] = {}  # node -> nodes it reads from
    members: dict[int, list[int]] = {}
    open_groups: dict[Any, list[int]] = {}
    made: dict[Any, int] = {}
    effect = None  # the last equation with effects: they keep their order
    for i, q in enumerate(eqns):
        d = {node[made[a]] for a in q.invars if not isinstance(a, _compat.Literal) and a in made}
        if q.effects:
            if effect is not None:
                d.add(node[effect])
            effect = i
        if _joinable(q):
            key = (q.invars[0], len(q.params["branches"]), q.ctx)
            for g in open_groups.setdefault(key, []):
                if not _reaches(d, g, deps):
                    node[i] = g
                    break
            else:
                open_groups[key].append(i)
            members.setdefault(node[i], []).append(i)
        deps.setdefault(node[i], set()).update(d - {node[i]})
        for o in q.outvars:
            made[o] = i
    # a valid order of the nodes: each after what it reads, at its last member's place
    last = {n: max(members.get(n, [n])) for n in deps}
    order: list[int] = []  # depth first, what a node reads before it
    seen: set[int] = set()
    for root in sorted(deps, key=last.__getitem__):
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(sorted(deps[root], key=last.__getitem__)))]
        while stack:
            n, reads = stack[-1]
            nxt = next((x for x in reads if x not in seen), None)
            if nxt is None:
                stack.pop()
                order.append(n)
            else:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(deps[nxt], key=last.__getitem__))))
    out = []
    for n in order:
        group = members.get(n)
        out.append(_join([eqns[i] for i in group]) if group else eqns[n])
    return out


def _joinable(q: Any) -> bool:
    return (
        q.primitive.name == "cond"
        and not isinstance(q.invars[0], _compat.Literal)
        and not q.effects
        and set(q.params) == {"branches"}
        and not any(b.consts or b.jaxpr.constvars for b in q.params["branches"])
    )


def _reaches(start: set[int], target: int, deps: dict[int, set[int]]) -> bool:
    """Whether ``target`` is among ``start`` or what they read, transitively."""
    seen: set[int] = set()
    todo = list(start)
    while todo:
        n = todo.pop()
        if n == target:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(deps.get(n, ()))
    return False


def _join(group: list[Any]) -> Any:
    """One cond doing the work of the conds ``group`` (one predicate)."""
    if len(group) == 1:
        return group[0]
    first = group[0]
    bodies = []
    for k in range(len(first.params["branches"])):
        ins: list[Any] = []
        outs: list[Any] = []
        eqns: list[Any] = []
        for q in group:
            j = q.params["branches"][k].jaxpr
            fresh = {v: _compat.Var(v.aval) for v in j.invars}
            for eq in j.eqns:
                new_outs = []
                for o in eq.outvars:
                    if not isinstance(o, _compat.DropVar):
                        fresh[o] = _compat.Var(o.aval)
                    new_outs.append(fresh.get(o, o))
                eqns.append(
                    eq.replace(
                        invars=[
                            a if isinstance(a, _compat.Literal) else fresh[a] for a in eq.invars
                        ],
                        outvars=new_outs,
                    )
                )
            ins.extend(fresh[v] for v in j.invars)
            outs.extend(a if isinstance(a, _compat.Literal) else fresh[a] for a in j.outvars)
        bodies.append(jcore.ClosedJaxpr(_compat.make_jaxpr_obj(ins, outs, eqns, "branch"), []))
    return first.replace(
        invars=[first.invars[0]] + [a for q in group for a in q.invars[1:]],
        outvars=[o for q in group for o in q.outvars],
        params={**first.params, "branches": tuple(bodies)},
    )


def _input_masks(jaxpr: Any) -> list[int]:
    """Per output of ``jaxpr``: the inputs it depends on, as a bit mask (through nested
    ``jit`` calls, which JAX's tree utilities make around a whole pytree; any other
    equation's outputs depend on all of its inputs)."""
    dep: dict[Any, int] = {v: 1 << k for k, v in enumerate(jaxpr.invars)}

    def mask(a: Any) -> int:
        return 0 if isinstance(a, _compat.Literal) else dep.get(a, 0)

    for eq in jaxpr.eqns:
        body = eq.params.get("jaxpr") if eq.primitive.name in ("jit", "pjit") else None
        inner = getattr(body, "jaxpr", body)
        if inner is not None and len(inner.invars) == len(eq.invars) and not inner.constvars:
            ins = [mask(a) for a in eq.invars]
            for o, m in zip(eq.outvars, _input_masks(inner)):
                dep[o] = _compose(m, ins)
            continue
        m = 0
        for a in eq.invars:
            m |= mask(a)
        for o in eq.outvars:
            dep[o] = m
    return [mask(v) for v in jaxpr.outvars]


def _compose(inner: int, ins: list[int]) -> int:
    """The outer inputs behind a nested call's output that reads inner inputs ``inner``."""
    m, k = 0, 0
    while inner:
        if inner & 1:
            m |= ins[k]
        inner >>= 1
        k += 1
    return m
