"""Program outputs: fresh arrays, in the shardings the user asked for (``out_shardings``).

Like ``jax.jit``, every call returns new arrays: an output that is an input passed
through, a captured constant or a literal is copied (or recomputed), so donating or
deleting an output never touches the caller's inputs or a later call's outputs.

``out_shardings`` entries resolve per output:

- ``None``: where it was produced (several submeshes: one array replicated over them);
- a ``PartitionSpec``: that spec on the producing submesh (the fragment produces it);
- a ``NamedSharding`` on a submesh: the fragment produces it there when that is the
  producing submesh, else the value is moved;
- a ``NamedSharding`` on the global MultiMesh mesh whose spec omits the stage axis:
  replicated over every submesh (produced on its submesh, copied shard-wise to the
  others);
- anything else: ``jax.device_put`` to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh import _compat
from multimesh.arguments import check_no_stage_axis, spec_axes
from multimesh.compiler.ir import Target
from multimesh.runtime import transfer as tr

_compat.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class Request:
    """A resolved ``out_shardings`` entry."""

    per_stage: dict[int, NamedSharding]  # what each producing submesh should make
    final: Any = None  # the sharding of the returned array (None: as produced)
    replicate: bool = False  # final spans every submesh: copy to the missing ones
    #: submeshes whose axes the spec does not fit (an error if the output is made there)
    unfit: dict[int, str] = dataclasses.field(default_factory=dict)


NO_REQUEST = Request({})


def resolve(
    s: Any, targets: Sequence[Target], stage_axis: str | None, global_mesh: Mesh | None, what: str
) -> Request:
    """Turn one user ``out_shardings`` entry into a :class:`Request`."""
    if s is None:
        return NO_REQUEST
    if isinstance(s, PartitionSpec):
        check_no_stage_axis(s, stage_axis, what)
        per, unfit = {}, {}
        for t in targets:  # explicit mesh= tasks may have other axis names
            missing = sorted(spec_axes(s) - set(t.mesh.axis_names))
            if missing:
                unfit[t.index] = (
                    f"{what}: {s} names {missing}, which the mesh this output is made on "
                    f"(axes {tuple(t.mesh.axis_names)}) lacks"
                )
            else:
                per[t.index] = NamedSharding(t.mesh, s)
        return Request(per, unfit=unfit)
    if not isinstance(s, jax.sharding.Sharding):
        raise TypeError(f"{what}: expected a Sharding, PartitionSpec or None, got {s!r}.")
    devs = frozenset(int(d.id) for d in s.device_set)
    for t in targets:
        if devs == frozenset(t.device_ids):
            if tuple(_compat.device_assignment_ids(s)) == t.device_ids:
                return Request({t.index: s}, final=s)
            return Request({}, final=s)  # the submesh's devices in another order: moved
    if (
        isinstance(s, NamedSharding)
        and isinstance(s.mesh, Mesh)
        and stage_axis is not None
        and stage_axis in s.mesh.axis_names
    ):
        check_no_stage_axis(s, stage_axis, what)
        dim = tuple(s.mesh.axis_names).index(stage_axis)
        names = tuple(n for n in s.mesh.axis_names if n != stage_axis)
        per: dict[int, NamedSharding] = {}
        by_devs = {frozenset(t.device_ids): t for t in targets}
        for j in range(s.mesh.devices.shape[dim]):
            sub = np.asarray(np.take(s.mesh.devices, j, axis=dim))  # 0-d on a 1-D mesh
            t = by_devs.get(frozenset(int(d.id) for d in sub.flat))
            if t is None:
                break
            types = tuple(
                ty for n, ty in zip(s.mesh.axis_names, s.mesh.axis_types) if n != stage_axis
            )
            per[t.index] = NamedSharding(Mesh(sub, names, axis_types=types), s.spec)
        else:
            return Request(per, final=s, replicate=True)
    return Request({}, final=s)


def output_fn(
    ids: Sequence[int],
    req: Request,
    slot_sh: dict[int, jax.sharding.Sharding],
    slot_stage: dict[int, int],
    borrowed: set[int],
    shape: tuple[int, ...],
    stage_axis: str,
    dtype: Any = None,
    weak: bool = False,
) -> Callable[[list[Any]], jax.Array]:
    """A function env -> the output array for the value held in slots ``ids`` (in a
    multi-process run, slots on other processes' submeshes are empty: their part of the
    output is a global array with no local shard), weakly typed as ``weak`` says (an
    array assembled, resharded or passed through may not be)."""

    def typed(fn: Callable[[list[Any]], jax.Array]) -> Callable[[list[Any]], jax.Array]:
        return lambda env: _compat.with_weak_type(fn(env), weak)

    reshard = [(i, req.per_stage.get(slot_stage[i])) for i in ids]
    reshard = [(i, d if d is not None and d != slot_sh[i] else None) for i, d in reshard]
    fresh = [i not in borrowed for i in ids]
    # slots whose values are all on this process's devices (every slot, in one process)
    local = [bool(getattr(slot_sh[i], "is_fully_addressable", False)) for i in ids]

    def value(env: list[Any], k: int) -> jax.Array:
        i, dst = reshard[k]
        x = env[i]
        if x is None:  # lives on another process
            return _remote(shape, dst if dst is not None else slot_sh[i], dtype)
        if not local[k] and not x.is_fully_addressable:
            return x if dst is None else jax.device_put(x, dst)
        if dst is not None:
            y = jax.device_put(x, dst)
            return y if y is not x else _compat.fresh_copy([x])[0]
        return x if fresh[k] else _compat.fresh_copy([x])[0]

    # made on a mesh= task's mesh (not a submesh): moved by jax.device_put instead
    if req.replicate and all(slot_stage[i] in req.per_stage for i in ids):
        final: NamedSharding = req.final
        have = {slot_stage[i] for i in ids}
        missing = [(s, sh) for s, sh in req.per_stage.items() if s not in have]

        def replicated(env: list[Any]) -> jax.Array:
            vals = [value(env, k) for k in range(len(ids))]
            src = vals[0]
            key = jax.dtypes.issubdtype(src.dtype, jax.dtypes.extended)
            if key:  # PRNG keys: assemble their key data, then wrap it
                vals = [jax.random.key_data(v) for v in vals]
            if missing:
                vals += _compat.same_layout_copy(
                    [vals[0]] * len(missing), [sh for _, sh in missing]
                )
            pieces = [p for v in vals for p in _compat.single_device_arrays(v)]
            if not key:
                return jax.make_array_from_single_device_arrays(shape, final, pieces)
            data = jax.make_array_from_single_device_arrays(vals[0].shape, final, pieces)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(src))

        return typed(replicated)

    if len(ids) == 1:
        single: Callable[[list[Any]], jax.Array] = lambda env: value(env, 0)
    else:
        shs = [req.per_stage.get(slot_stage[i]) or slot_sh[i] for i in ids]
        union = tr.union_sharding(shs, stage_axis)
        if union is None:
            single = lambda env: value(env, 0)
        else:

            def single(env: list[Any]) -> jax.Array:
                pieces = [
                    p for k in range(len(ids)) for p in _compat.single_device_arrays(value(env, k))
                ]
                return jax.make_array_from_single_device_arrays(shape, union, pieces)

    if req.final is None:
        # a fragment's own output has the program's type
        return single if len(ids) == 1 and ids[0] not in borrowed else typed(single)
    final_sh = req.final
    # `single` returns a fresh array; device_put returns it unchanged where it already
    # has the requested sharding, or a new copy
    return typed(lambda env: jax.device_put(single(env), final_sh))


def check_final_move(
    k: int,
    ids: Sequence[int],
    req: Request,
    slot_sh: dict[int, jax.sharding.Sharding],
    slot_stage: dict[int, int],
) -> None:
    """Multi-process: an output whose requested sharding (``out_shardings``) would take
    it to other processes' devices than those that make it is a clear error before
    anything runs (``jax.device_put`` across processes is JAX's "does not support
    cross-host device transfers" on CPU, raised by some processes only)."""
    if req.final is None or jax.process_count() == 1:
        return
    if req.replicate and all(slot_stage[i] in req.per_stage for i in ids):
        return  # replicated over stages: each stage's copy made there (output_fn)
    shs = [req.per_stage.get(slot_stage[i]) or slot_sh[i] for i in ids]
    src = {d for sh in shs for d in getattr(sh, "device_set", ())}
    dst = req.final.device_set
    src_procs, dst_procs = ({d.process_index for d in x} for x in (src, dst))
    if src and src != dst and len(src_procs | dst_procs) > 1:  # a move across processes
        stages = sorted({slot_stage[i] for i in ids})
        raise ValueError(
            f"out_shardings of output {k} (flat): {req.final} puts it on devices "
            f"{sorted(d.id for d in dst)} (processes {sorted(dst_procs)}), but stage(s) "
            f"{stages} make it on devices {sorted(d.id for d in src)} (processes "
            f"{sorted(src_procs)}). A multi-process run moves values "
            "between processes inside the program only: request a sharding on the "
            "devices that make it (its stage's submesh, or the global mesh replicated), "
            "or compute it in a task on the submesh you want."
        )


def output_sharding(
    ids: Sequence[int],
    req: Request,
    slot_sh: dict[int, jax.sharding.Sharding],
    slot_stage: dict[int, int],
    stage_axis: str,
) -> Any:
    """The sharding :func:`output_fn`'s arrays have (the same rules)."""
    if req.final is not None:
        return req.final
    shs = [req.per_stage.get(slot_stage[i]) or slot_sh[i] for i in ids]
    if len(ids) == 1:
        return shs[0]
    return tr.union_sharding(shs, stage_axis) or shs[0]


def _remote(shape: tuple[int, ...], sharding: Any, dtype: Any) -> jax.Array:
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


def literal_fn(
    literals: list[tuple[int, Any, Any]],
    default: NamedSharding,
    requests: Sequence[Request],
    loc: Any = None,
) -> Callable[[], list[jax.Array]]:
    """Small executables (one per device set) that make every literal output fresh on
    each call, with its dtype and weak type, where ``out_shardings`` (or the first
    submesh) puts it."""
    if not literals:
        return lambda: []
    groups: dict[tuple[int, ...], list[int]] = {}  # device set -> positions in literals
    vals = []
    shs = []
    for n, (k, val, aval) in enumerate(literals):
        arr = np.asarray(val, dtype=aval.dtype) if not _is_key(aval) else val
        if getattr(aval, "weak_type", False) and arr.shape == ():
            vals.append(arr.item())  # a Python scalar traces as a weak-typed value
        else:
            vals.append(arr)
        req = requests[k]
        sh = req.final if req.final is not None else req.per_stage.get(0, default)
        sh = sh if isinstance(sh, jax.sharding.Sharding) else default
        shs.append(sh)
        groups.setdefault(tuple(sorted(d.id for d in sh.device_set)), []).append(n)

    makers = []
    for members in groups.values():
        g_vals = tuple(vals[n] for n in members)
        g_shs = tuple(shs[n] for n in members)
        if loc is not None and not any(loc.has(sh.device_set) for sh in g_shs):
            makers.append((members, _remotes([literals[n][2] for n in members], g_shs)))
            continue
        with _compat.no_mesh_context():
            compiled = jax.jit(_constant(g_vals), out_shardings=g_shs).lower().compile()
        makers.append((members, compiled))
    if len(makers) == 1:
        make = makers[0][1]
        return lambda: list(make())

    def make_all() -> list[jax.Array]:
        out: list[Any] = [None] * len(literals)
        for members, make in makers:
            for n, x in zip(members, make()):
                out[n] = x
        return out

    return make_all


def _remotes(avals: list[Any], shs: tuple[Any, ...]) -> Callable[[], list[jax.Array]]:
    """Literal outputs living on other processes only: arrays with no local shard."""
    return lambda: [_remote(tuple(a.shape), sh, a.dtype) for a, sh in zip(avals, shs)]


def _constant(vals: tuple[Any, ...]) -> Callable[[], tuple[Any, ...]]:
    def make() -> tuple[Any, ...]:
        return vals

    return make


def _is_key(aval: Any) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
