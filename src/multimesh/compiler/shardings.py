"""Rewrite the shardings captured in a fragment's equations to its submesh.

Inside a task, shardings refer to the task's submesh: a bare ``PartitionSpec`` (traced on
the submesh's abstract mesh), a ``NamedSharding`` on the global MultiMesh mesh whose spec
omits the stage axis, ``shard_map`` over non-stage axes, and nested ``jax.jit``
shardings. This pass maps every mesh found in equation parameters (recursively through
nested jaxprs) to the fragment's concrete (or abstract) submesh, and raises a clear
error for specs that name the stage axis or meshes on another submesh's devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.extend import core as jcore
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

from multimesh import _compat
from multimesh.arguments import drop_axis, spec_axes

_compat.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class Ctx:
    target: Mesh  # the concrete mesh this equation runs on
    global_mesh: Mesh | None
    stage_axis: str | None
    where: str  # "task 'embed'" or "untagged code placed on stage 1"

    @property
    def device_ids(self) -> frozenset[int]:
        return frozenset(int(d.id) for d in self.target.devices.flat)


def _check_spec(spec: PartitionSpec, ctx: Ctx) -> PartitionSpec:
    if ctx.stage_axis is not None and ctx.stage_axis in spec_axes(spec):
        raise ValueError(
            f"{ctx.where}: sharding spec {spec} names the stage axis {ctx.stage_axis!r}. "
            "Inside a task, shardings refer to the task's submesh, which has no stage axis; "
            f"drop {ctx.stage_axis!r} from the spec (placement across stages is what tasks do)."
        )
    return spec


def _fit_spec(spec: PartitionSpec, names: tuple[str, ...]) -> PartitionSpec:
    """Drop axes the target mesh does not have (only for type-level, all-Auto shardings)."""

    def fit(entry: Any) -> Any:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            return entry
        if isinstance(entry, str):
            return entry if entry in names else None
        kept = tuple(e for e in entry if e in names)
        return kept or None

    return PartitionSpec(*(fit(e) for e in spec))


def _is_global(mesh: Any, ctx: Ctx) -> bool:
    return (
        ctx.stage_axis is not None
        and ctx.stage_axis in mesh.axis_names
        and (ctx.global_mesh is None or mesh.axis_names == ctx.global_mesh.axis_names)
    )


def _mesh_devices(mesh: Mesh) -> frozenset[int]:
    return frozenset(int(d.id) for d in mesh.devices.flat)


def _concrete(mesh: Mesh, ctx: Ctx) -> Mesh:
    if mesh.empty:
        return mesh
    if mesh is ctx.target or mesh == ctx.target:
        return mesh
    if _is_global(mesh, ctx):
        return ctx.target
    devs = _mesh_devices(mesh)
    if devs == ctx.device_ids:
        return mesh
    raise ValueError(
        f"{ctx.where}: a sharding refers to a mesh on devices {sorted(devs)}, but this code "
        f"runs on the submesh with devices {sorted(ctx.device_ids)}. Inside a task, use the "
        "task's submesh, a bare PartitionSpec, or the global MultiMesh mesh."
    )


def _abstract(m: AbstractMesh, ctx: Ctx) -> AbstractMesh:
    """The target's abstract mesh, keeping the axis types (e.g. Manual inside shard_map)
    that ``m`` gives the axes they share."""
    target = ctx.target.abstract_mesh
    types = dict(zip(m.axis_names, m.axis_types))
    new = tuple(types.get(n, t) for n, t in zip(target.axis_names, target.axis_types))
    if new == tuple(target.axis_types):
        return target
    return target.update(axis_types=new)


def rewrite_value(v: Any, ctx: Ctx) -> Any:
    if isinstance(v, NamedSharding):
        m = v.mesh
        if isinstance(m, AbstractMesh):
            if _is_global(m, ctx):
                _check_spec(v.spec, ctx)
            spec = _fit_spec(v.spec, tuple(ctx.target.axis_names))
            return NamedSharding(_abstract(m, ctx), spec)
        spec = v.spec
        if _is_global(m, ctx):
            spec = _check_spec(spec, ctx)
            missing = sorted(spec_axes(spec) - set(ctx.target.axis_names))
            if missing:
                raise ValueError(
                    f"{ctx.where}: sharding spec {spec} on the global MultiMesh mesh names "
                    f"axes {missing} that this code's mesh {dict(ctx.target.shape)} does not "
                    "have. Inside a task, global-mesh shardings refer to the task's submesh: "
                    "use that mesh's own axis names (a bare PartitionSpec over them)."
                )
        return NamedSharding(_concrete(m, ctx), spec, memory_kind=v.memory_kind)
    if isinstance(v, AbstractMesh):
        if v.empty:
            return v
        return _abstract(v, ctx)
    if isinstance(v, Mesh):
        return _concrete(v, ctx)
    if isinstance(v, jcore.ClosedJaxpr):
        return jcore.ClosedJaxpr(rewrite_jaxpr(v.jaxpr, ctx), v.consts)
    if isinstance(v, jcore.Jaxpr):
        return rewrite_jaxpr(v, ctx)
    if type(v) is tuple or type(v) is list:  # not NamedTuples (e.g. PRNG impls)
        new = [rewrite_value(x, ctx) for x in v]
        if all(a is b for a, b in zip(new, v)):
            return v
        return type(v)(new)
    return v


def _check_shard_map(params: dict[str, Any], ctx: Ctx) -> None:
    for k in ("in_specs", "out_specs"):
        for spec in params.get(k, ()) or ():
            if isinstance(spec, PartitionSpec) and ctx.stage_axis in spec_axes(spec):
                mesh = params.get("mesh")
                every = set(getattr(mesh, "axis_names", ()))
                if params.get("check_vma", params.get("check_rep")) is False and every <= set(
                    spec_axes(spec)
                ):  # JAX's residual spec: every mesh axis
                    raise ValueError(
                        f"{ctx.where}: a differentiated shard_map(check_vma=False) passes "
                        f"values split over every mesh axis, the stage axis "
                        f"{ctx.stage_axis!r} too ({k[:-6]} spec {spec}), to code other "
                        "than its transpose; inside a task the code runs on one submesh. "
                        "Use check_vma=True (JAX's default) for it."
                    )
                raise ValueError(
                    f"{ctx.where}: shard_map {k[:-6]} spec {spec} splits over the stage axis "
                    f"{ctx.stage_axis!r}, but inside a task the code runs on one submesh, "
                    f"which has no {ctx.stage_axis!r} axis. Drop {ctx.stage_axis!r} from the "
                    "shard_map specs (use the submesh's axes), or split the work into one "
                    "task per stage."
                )


def _stage_collectives(jaxpr: Any, axis: str, memo: set[int]) -> list[str]:
    """The primitives in ``jaxpr`` (recursively) that name mesh axis ``axis``: the
    collectives (``psum``, ``all_gather``, ``axis_index``, ...) and ``pvary``."""
    if id(jaxpr) in memo:
        return []
    memo.add(id(jaxpr))
    found: list[str] = []
    for e in jaxpr.eqns:
        for k in ("axes", "axis_name"):
            v = e.params.get(k)
            names = v if isinstance(v, (tuple, list, set, frozenset)) else (v,)
            if axis in names and e.primitive.name not in found:
                found.append(e.primitive.name)
        for v in e.params.values():
            for x in v if isinstance(v, (tuple, list)) else (v,):
                sub = x.jaxpr if isinstance(x, jcore.ClosedJaxpr) else x
                if isinstance(sub, jcore.Jaxpr):
                    found += [p for p in _stage_collectives(sub, axis, memo) if p not in found]
    return found


def _check_stage_collectives(params: dict[str, Any], ctx: Ctx) -> None:
    """A shard_map body's collectives over the stage axis: a psum of values replicated
    over it (``check_vma=False``; JAX's transpose adds such) becomes a product
    (``psum_over_replicas``); any other use of the axis cannot run on one submesh."""
    body = params.get("jaxpr")
    if body is None or ctx.stage_axis is None:
        return
    body = body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
    used = [p for p in _stage_collectives(body, ctx.stage_axis, set()) if p != "psum"]
    if used:
        raise ValueError(
            f"{ctx.where}: a shard_map body uses the stage axis {ctx.stage_axis!r} "
            f"({', '.join(used)}), but this code runs on one submesh, which has no "
            f"{ctx.stage_axis!r} axis. Use the submesh's axes in the body's collectives; to "
            "combine values of several stages, return each from its own task and combine "
            "them after (mm.jit moves them between submeshes)."
        )


def rewrite_params(prim: str, params: dict[str, Any], ctx: Ctx) -> dict[str, Any]:
    if prim == "shard_map" and ctx.stage_axis is not None:
        mesh = params.get("mesh")
        if mesh is not None and _is_global(mesh, ctx):
            _check_shard_map(params, ctx)
            _check_stage_collectives(params, ctx)
    out = {k: rewrite_value(p, ctx) for k, p in params.items()}
    if prim == "shard_map" and ctx.stage_axis is not None:
        mesh = params.get("mesh")
        if mesh is not None and _is_global(mesh, ctx):
            for k, p in out.items():
                if isinstance(p, frozenset) and ctx.stage_axis in p:
                    out[k] = p - {ctx.stage_axis}
            body = out.get("jaxpr")
            size = dict(zip(mesh.axis_names, mesh.axis_sizes)).get(ctx.stage_axis, 1)
            if isinstance(body, jcore.ClosedJaxpr):
                out["jaxpr"] = jcore.ClosedJaxpr(
                    _compat.psum_over_replicas(body.jaxpr, ctx.stage_axis, size), body.consts
                )
            elif isinstance(body, jcore.Jaxpr):
                out["jaxpr"] = _compat.psum_over_replicas(body, ctx.stage_axis, size)
    return out


def rewrite_eqn(eqn: Any, ctx: Ctx) -> Any:
    if eqn.params:
        eqn = eqn.replace(params=rewrite_params(eqn.primitive.name, eqn.params, ctx))
    mesh = _compat.eqn_context_mesh(eqn)
    if mesh is not None and not mesh.empty:
        eqn = _compat.with_context_mesh(eqn, rewrite_value(mesh, ctx))
    if any(isinstance(a, jcore.Literal) for a in eqn.invars):
        ins = [_rewrite_literal(a, ctx) if isinstance(a, jcore.Literal) else a for a in eqn.invars]
        eqn = eqn.replace(invars=ins)
    return eqn


def _rewrite_literal(lit: Any, ctx: Ctx) -> Any:
    aval = _rewrite_aval(lit.aval, ctx)
    if aval is lit.aval:
        return lit
    return jcore.Literal(_compat.retype_literal_value(lit.val, aval), aval)


def _rewrite_aval(aval: Any, ctx: Ctx) -> Any:
    inner = getattr(aval, "inner_aval", None)
    if inner is not None:  # a mutable reference (Pallas, jax.new_ref): its value's type
        new_inner = _rewrite_aval(inner, ctx)
        return aval if new_inner is inner else aval.update(inner_aval=new_inner)
    sh = getattr(aval, "sharding", None)
    if not isinstance(sh, NamedSharding) or not isinstance(sh.mesh, AbstractMesh):
        return aval
    if sh.mesh.empty:
        return aval
    new = NamedSharding(_abstract(sh.mesh, ctx), _fit_spec(sh.spec, tuple(ctx.target.axis_names)))
    return aval.update(sharding=new)


def rewrite_jaxpr(jaxpr: Any, ctx: Ctx) -> Any:
    """Rewrite a nested jaxpr: equation parameters, contexts, and the types of its
    variables (which JAX reads back, e.g. when lowering a scan)."""
    sub: dict[Any, Any] = {}

    def nv(v: Any) -> Any:
        if isinstance(v, jcore.Literal):  # a constant a body returns has a type too
            return _rewrite_literal(v, ctx)
        if v in sub:
            return sub[v]
        aval = _rewrite_aval(v.aval, ctx)
        if aval is v.aval:
            n = v
        elif isinstance(v, jcore.DropVar):
            n = jcore.DropVar(aval)
        else:
            n = jcore.Var(aval)
        sub[v] = n
        return n

    constvars = [nv(v) for v in jaxpr.constvars]
    invars = [nv(v) for v in jaxpr.invars]
    eqns = []
    for e in jaxpr.eqns:
        e = rewrite_eqn(e, ctx)
        eqns.append(e.replace(invars=[nv(a) for a in e.invars], outvars=[nv(o) for o in e.outvars]))
    outvars = [nv(a) for a in jaxpr.outvars]
    return jaxpr.replace(constvars=constvars, invars=invars, eqns=eqns, outvars=outvars)


def stage_free_residuals(prog: Any, stage_axis: str, num_stages: int) -> Any:
    """Residuals of ``shard_map(check_vma=False)`` without the stage axis.

    Differentiated, such a shard_map on the global mesh (in a task) passes its residuals
    to its transpose split over *every* mesh axis, the stage axis too: one copy per
    stage in the reference, where the shard_map runs on all stages' devices. Inside a
    task it runs on one submesh, which has no stage axis. Where a value made that way is
    read only by shard_maps on the same mesh with the same spec (each device reads back
    the block it wrote), the stage axis is dropped from both specs and the value holds
    one stage's blocks (its dimension ``num_stages`` times smaller); also inside nested
    bodies (a ``jax.checkpoint`` recomputes the shard_map in the backward). Anything
    else keeps the specs, and placement names the stage axis in a clear error."""
    eqns = _free_residuals(list(prog.eqns), prog.outvars, stage_axis, num_stages)
    return prog if eqns is None else dataclasses.replace(prog, eqns=eqns)


def _free_residuals(
    eqns: list[Any], outvars: Any, stage_axis: str, num_stages: int
) -> list[Any] | None:
    """:func:`stage_free_residuals` on one body's equations (``None``: unchanged)."""
    changed = False
    for i, e in enumerate(eqns):  # nested bodies first (not shard_map's own: manual axes)
        if e.primitive.name == "shard_map" or not e.params:
            continue
        params = {}
        for k, v in e.params.items():
            nv = _free_in_value(v, stage_axis, num_stages)
            if nv is not v:
                params[k] = nv
        if params:
            eqns[i] = e.replace(params={**e.params, **params})
            changed = True
    users = _users_of(eqns)
    outs = {v for v in outvars if not isinstance(v, jcore.Literal)}

    def on_global(e: Any) -> Any:
        mesh = e.params.get("mesh") if e.primitive.name == "shard_map" else None
        return mesh if mesh is not None and stage_axis in mesh.axis_names else None

    for i, e in enumerate(eqns):
        mesh = on_global(e)
        if mesh is None:
            continue
        for k, spec in enumerate(e.params["out_specs"]):
            v = e.outvars[k]
            if not isinstance(spec, PartitionSpec) or stage_axis not in spec_axes(spec):
                continue
            if v in outs or not users.get(v):
                continue
            if not _read_back_only(v, spec, mesh, eqns, users, stage_axis):
                continue
            dim = next(d for d, e in enumerate(spec) if stage_axis in spec_axes(P(e)))
            shape = list(v.aval.shape)
            if shape[dim] % num_stages:
                continue
            new_spec = drop_axis(spec, stage_axis)
            shape[dim] //= num_stages
            nv = _compat.Var(v.aval.update(shape=tuple(shape)))
            cur = eqns[i]
            out_specs = list(cur.params["out_specs"])
            out_specs[k] = new_spec
            outvars_i = list(cur.outvars)
            outvars_i[k] = nv
            eqns[i] = cur.replace(
                params={**cur.params, "out_specs": tuple(out_specs)}, outvars=outvars_i
            )
            _retype_users(v, nv, new_spec, eqns, users)
            changed = True
    return eqns if changed else None


def _users_of(eqns: list[Any]) -> dict[Any, list[tuple[int, int]]]:
    users: dict[Any, list[tuple[int, int]]] = {}
    for j, e in enumerate(eqns):
        for pos, a in enumerate(e.invars):
            if not isinstance(a, jcore.Literal):
                users.setdefault(a, []).append((j, pos))
    return users


def _call_body(e: Any) -> Any:
    """The body of a call-like equation whose inputs are its body's inputs, one for one
    (``jax.checkpoint``, nested ``jax.jit``), as a ``Jaxpr``; else ``None``."""
    if e.primitive.name not in ("checkpoint", "remat2", "pjit", "jit", "closed_call"):
        return None
    body = e.params.get("jaxpr")
    body = body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
    if not isinstance(body, jcore.Jaxpr) or len(body.invars) != len(e.invars):
        return None
    return body


def _read_back_only(
    v: Any, spec: Any, mesh: Any, eqns: list[Any], users: dict[Any, Any], stage_axis: str
) -> bool:
    """Whether ``v`` is read only by shard_maps on ``mesh`` with ``spec``, directly or
    through the bodies of call-like equations (a ``jax.checkpoint`` recomputing the
    backward reads a saved residual)."""
    for j, pos in users.get(v, ()):
        u = eqns[j]
        if u.primitive.name == "shard_map":
            m = u.params.get("mesh")
            if m != mesh or u.params["in_specs"][pos] != spec:
                return False
            continue
        body = _call_body(u)
        if body is None:
            return False
        inner = body.invars[pos]
        inner_users = _users_of(list(body.eqns))
        if any(inner is o for o in body.outvars) or not inner_users.get(inner):
            return False
        if not _read_back_only(inner, spec, mesh, list(body.eqns), inner_users, stage_axis):
            return False
    return True


def _retype_users(v: Any, nv: Any, spec: Any, eqns: list[Any], users: dict[Any, Any]) -> None:
    """Every reader of ``v`` (checked by :func:`_read_back_only`) reads ``nv`` with
    ``spec`` instead, in place in ``eqns``, call bodies rebuilt."""
    for j, pos in users.get(v, ()):
        u = eqns[j]
        invars = list(u.invars)
        invars[pos] = nv
        if u.primitive.name == "shard_map":
            in_specs = list(u.params["in_specs"])
            in_specs[pos] = spec
            eqns[j] = u.replace(params={**u.params, "in_specs": tuple(in_specs)}, invars=invars)
            continue
        raw = u.params["jaxpr"]
        body = raw.jaxpr if isinstance(raw, jcore.ClosedJaxpr) else raw
        inner, ninner = body.invars[pos], _compat.Var(nv.aval)
        beqns = list(body.eqns)
        _retype_users(inner, ninner, spec, beqns, _users_of(beqns))
        binvars = list(body.invars)
        binvars[pos] = ninner
        nbody = body.replace(invars=binvars, eqns=beqns)
        if isinstance(raw, jcore.ClosedJaxpr) and raw.jaxpr is not raw:
            nbody = jcore.ClosedJaxpr(nbody, raw.consts)
        eqns[j] = u.replace(params={**u.params, "jaxpr": nbody}, invars=invars)


def _free_in_value(v: Any, stage_axis: str, num_stages: int) -> Any:
    """A parameter with its nested bodies' residuals freed (``v`` itself if unchanged)."""
    if isinstance(v, jcore.ClosedJaxpr) and v.jaxpr is not v:
        inner = _free_in_value(v.jaxpr, stage_axis, num_stages)
        return v if inner is v.jaxpr else jcore.ClosedJaxpr(inner, v.consts)
    if isinstance(v, jcore.Jaxpr):  # (jax 0.12.1: one class, its .jaxpr itself)
        eqns = _free_residuals(list(v.eqns), v.outvars, stage_axis, num_stages)
        return v if eqns is None else v.replace(eqns=eqns)
    if type(v) is tuple or type(v) is list:  # cond branches
        new = [_free_in_value(x, stage_axis, num_stages) for x in v]
        return v if all(a is b for a, b in zip(new, v)) else type(v)(new)
    return v
