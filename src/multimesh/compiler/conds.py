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

from multimesh import _compat
from multimesh.compiler import inline
from multimesh.compiler.ir import FlatProgram

_compat.register_exclusion(__file__)


def split_conds(prog: FlatProgram) -> FlatProgram:
    """``prog`` with each splittable ``cond`` replaced by one ``cond`` per output group."""
    eqns: list[Any] = []
    changed = False
    for e in prog.eqns:
        parts = _split(e)
        if parts is None:
            eqns.append(e)
        else:
            eqns.extend(parts)
            changed = True
    return dataclasses.replace(prog, eqns=eqns) if changed else prog


def _split(e: Any) -> list[Any] | None:
    if e.primitive.name != "cond" or e.effects or set(e.params) != {"branches"}:
        return None
    branches = e.params["branches"]
    if any(b.jaxpr.constvars or b.jaxpr.effects for b in branches):
        return None
    if any(inline.inner_tasks(b.jaxpr) for b in branches):
        return None  # tasks inside: the cond runs on their submesh (inline's rule)
    operands = e.invars[1:]
    n_out = len(e.outvars)
    if n_out < 2:
        return None
    # scalars (a step count, a learning rate) may be read by several groups
    big = [
        not isinstance(a, _compat.Literal) and math.prod(a.aval.shape) > 1 for a in operands
    ]
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

