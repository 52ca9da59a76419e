"""Flatten: inline nested calls that contain tasks into one flat equation list.

Nested ``jax.jit`` (and ``closed_call``, ``checkpoint``, ``custom_jvp``/``custom_vjp``
calls) whose body contains a task are inlined with fresh variables, their name stacks
prepended to the body's. Calls without tasks stay whole. A loop or conditional
(``scan``, ``while``, ``cond``) whose body holds tasks on more than one submesh cannot be
split: that is a clear error naming the tasks.
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jcore

from multimesh import _compat
from multimesh.compiler.ir import FlatProgram
from multimesh.tasks import TaskRef, decode_marker

_compat.register_exclusion(__file__)

# primitive name -> param holding the body
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


def eqn_tasks(eqn: Any) -> list[TaskRef]:
    """Task markers in an equation's own name stack."""
    out = []
    for s in _compat.scope_names(eqn.source_info.name_stack):
        ref = decode_marker(s)
        if ref is not None:
            out.append(ref)
    return out


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
    out = []
    for v in params.values():
        vals = v if isinstance(v, (tuple, list)) else (v,)
        for x in vals:
            if isinstance(x, jcore.ClosedJaxpr):
                out.append(x.jaxpr)
            elif isinstance(x, jcore.Jaxpr):
                out.append(x)
    return out


def inner_tasks(jaxpr: Any, _memo: dict[int, set[TaskRef]] | None = None) -> set[TaskRef]:
    """All task markers anywhere inside a jaxpr (recursively)."""
    memo = {} if _memo is None else _memo
    key = id(jaxpr)
    if key in memo:
        return memo[key]
    found: set[TaskRef] = set()
    for e in jaxpr.eqns:
        found.update(eqn_tasks(e))
        for sub in _sub_jaxprs(e.params):
            found |= inner_tasks(sub, memo)
    memo[key] = found
    return found


def _placement_key(ref: TaskRef) -> Any:
    if ref.layers is not None:
        return ("l", ref.layers)
    return ("s", ref.stage) if ref.mesh is None else ("m", ref.mesh)


def _unspecified(s: Any) -> bool:
    return type(s).__name__ == "UnspecifiedValue"


def _inlinable_glue(e: Any, ns: Any) -> bool:
    """An untagged nested jit without shardings (e.g. optax's jitted tree helpers) is
    inlined, so that its work on each stage's data can run on that stage."""
    if any(decode_marker(s) for s in _compat.scope_names(ns)):
        return False
    shs = tuple(e.params.get("in_shardings", ())) + tuple(e.params.get("out_shardings", ()))
    return all(_unspecified(s) for s in shs)


def flatten(closed: Any, rules: Any = None, limit: int = 0) -> FlatProgram:
    """Inline calls containing tasks (or scopes ``rules`` place); check that loops and
    conditionals hold at most one submesh."""
    memo: dict[int, set[TaskRef]] = {}
    consts_vars: list[Any] = list(closed.jaxpr.constvars)
    consts: list[Any] = list(closed.consts)
    eqns: list[Any] = []
    env: dict[Any, Any] = {}

    def read(a: Any) -> Any:
        if isinstance(a, jcore.Literal):
            return a
        return env.get(a, a)

    def emit(jaxpr: Any, name_stack: Any | None) -> None:
        for e in jaxpr.eqns:
            ns = e.source_info.name_stack
            if name_stack is not None:
                ns = _compat.concat_name_stacks(name_stack, ns)
            prim = e.primitive.name
            body_param = _CALLS.get(prim)
            if body_param is not None and body_param in e.params:
                body = e.params[body_param]
                body_jaxpr = body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
                if (
                    inner_tasks(body_jaxpr, memo)
                    or (prim in ("jit", "pjit") and _inlinable_glue(e, ns))
                    or (rules is not None and ruled(e, ns))
                ):
                    _inline(e, body, ns)
                    continue
            else:
                subs = _sub_jaxprs(e.params)
                inside: set[TaskRef] = set()
                for sub in subs:
                    inside |= inner_tasks(sub, memo)
                if rules is not None and not eqn_tasks(e):
                    inside |= ruled(e, ns)
                if inside:
                    own = {_placement_key(r) for r in eqn_tasks(e)}
                    keys = {_placement_key(r) for r in inside} | own
                    if len(keys) > 1:
                        names = sorted({r.name for r in inside})
                        raise ValueError(
                            f"task(s) {names} sit inside a `{prim}` body together with code "
                            "for another submesh (from mm.task or task_rules); MultiMesh "
                            "cannot split a loop or conditional across submeshes. Move the "
                            f"task(s) out of the `{prim}` (e.g. unroll the loop in Python, "
                            f"or scan_layers=False), or put the whole `{prim}` on one stage."
                        )
            new = e.replace(invars=[read(a) for a in e.invars])
            if name_stack is not None:
                new = _compat.with_name_stack(new, ns)
            eqns.append(new)

    def ruled(e: Any, ns: Any) -> set[TaskRef]:
        return rules.stages_inside(e.params, _compat.scope_names(ns), limit)

    def _inline(e: Any, body: Any, ns: Any) -> None:
        if isinstance(body, jcore.ClosedJaxpr):
            jaxpr, bconsts = body.jaxpr, body.consts
        else:
            jaxpr, bconsts = body, []
        # fresh variables: the same body may be inlined more than once
        fresh: dict[Any, Any] = {}
        for v, c in zip(jaxpr.constvars, bconsts):
            nv = _compat.Var(v.aval)
            consts_vars.append(nv)
            consts.append(c)
            fresh[v] = nv
        for v, a in zip(jaxpr.invars, e.invars):
            fresh[v] = read(a)
        sub = _rename(jaxpr, fresh)
        saved = dict(env)
        env.update(fresh)
        emit(sub, ns)
        outs = [a if isinstance(a, jcore.Literal) else env.get(a, a) for a in sub.outvars]
        env.clear()
        env.update(saved)
        for ov, a in zip(e.outvars, outs):
            if not isinstance(ov, jcore.DropVar):
                env[ov] = a

    def _rename(jaxpr: Any, fresh: dict[Any, Any]) -> Any:
        """Give every variable bound inside ``jaxpr`` a fresh identity."""
        new_eqns = []
        for e in jaxpr.eqns:
            outs = []
            for o in e.outvars:
                if isinstance(o, jcore.DropVar):
                    outs.append(o)
                else:
                    nv = _compat.Var(o.aval)
                    fresh[o] = nv
                    outs.append(nv)
            ins = [a if isinstance(a, jcore.Literal) else fresh.get(a, a) for a in e.invars]
            new_eqns.append(e.replace(invars=ins, outvars=outs))
        outvars = [a if isinstance(a, jcore.Literal) else fresh.get(a, a) for a in jaxpr.outvars]
        return jaxpr.replace(eqns=new_eqns, outvars=outvars, invars=[], constvars=[])

    emit(closed.jaxpr, None)
    outvars = [read(a) for a in closed.jaxpr.outvars]
    return FlatProgram(
        invars=list(closed.jaxpr.invars),
        constvars=consts_vars,
        consts=consts,
        outvars=outvars,
        eqns=eqns,
    )
