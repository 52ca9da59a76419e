"""Label: give each equation its task (from name-stack markers) and resolve targets.

A target is a submesh that fragments run on. With a MultiMesh, target ``i`` is
``submesh(i)``; explicit ``mesh=`` tasks on the same devices as a submesh share its
target, others get new targets after them. Meshes that partly overlap are an error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from multimesh import _compat
from multimesh.compiler.inline import _sub_jaxprs, eqn_tasks, inner_tasks
from multimesh.compiler.ir import FlatProgram, Labels, Literal, Target, aval_nbytes
from multimesh.mesh import MultiMesh
from multimesh.tasks import TaskRef, check_mesh, check_stage_range

_compat.register_exclusion(__file__)


def _eqn_task(eqn: Any, memo: dict, scanned: frozenset[str] = frozenset()) -> TaskRef | None:
    own = eqn_tasks(eqn)
    refs = list(own)
    for sub in _sub_jaxprs(eqn.params):
        refs.extend(inner_tasks(sub, memo))
    layered = [r for r in refs if r.layers is not None]
    refs = [r for r in refs if r.layers is None]
    if layered and not refs:
        if all(r.name in scanned for r in layered):
            # work of a scanned layer task that JAX moved out of its scan (loop-invariant
            # residuals, an empty call left by partial evaluation): untagged, by data
            return None
        raise ValueError(
            f"task {layered[0].name!r}: stage=mm.by_layer(...) places the iterations of a "
            "scan over layers; use it inside the body of a jax.lax.scan (nn.scan, "
            "nnx.scan), not around other code."
        )
    distinct = {(r.name, r.stage, r.mesh) for r in refs}
    if len(distinct) > 1 and not own:
        # tasks inside one control-flow equation (the branches of a lax.cond): fine if
        # they all run on one submesh; control flow cannot be split across submeshes
        if len({(r.stage, r.mesh) for r in refs}) == 1:
            return refs[0]
        names = sorted({r.name for r in refs})
        raise ValueError(
            f"tasks {names} are inside one {eqn.primitive.name} (e.g. the branches of a "
            "lax.cond) but run on different submeshes; control flow cannot be split "
            f"across submeshes. Put the whole {eqn.primitive.name} in one task, or move "
            "the tasks out of it."
        )
    if len(distinct) > 1:
        names = [r.name for r in own] or sorted({r.name for r in refs})
        raise ValueError(
            f"tasks {names} are nested (one task opened inside another, possibly via a "
            "nested jit); tasks cannot nest. Close the outer task first, or merge them."
        )
    return refs[0] if refs else None


def label(
    prog: FlatProgram, mmesh: MultiMesh | None, rules: Any = None, virtual_stages: int = 1
) -> Labels:
    """Map each equation to its task and target (stage index).

    ``rules`` (a :class:`multimesh.compiler.rules.Rules`) places untagged equations by
    their named scopes; explicit tasks win.
    """
    memo: dict = {}
    # by-layer tasks inside scans (split per stage before labelling)
    scanned = frozenset(
        r.name
        for e in prog.eqns
        if e.primitive.name == "scan"
        for sub in _sub_jaxprs(e.params)
        for r in inner_tasks(sub, memo)
        if r.layers is not None
    )
    tasks = [_eqn_task(e, memo, scanned) for e in prog.eqns]
    if rules is not None:
        if mmesh is None:
            raise ValueError("task_rules map scopes to stages: pass mesh=mmesh to mm.jit.")
        limit = mmesh.num_stages * virtual_stages
        for i, e in enumerate(prog.eqns):
            if tasks[i] is not None:  # an explicit task wins over the rules: noted for
                # the warning about rules that matched nothing else
                rules.overridden(_compat.scope_names(e.source_info.name_stack), tasks[i].name)
            if tasks[i] is None:
                scopes = _compat.scope_names(e.source_info.name_stack)
                tasks[i] = rules.match(scopes, limit)
                if tasks[i] is not None and tasks[i].layers is not None:
                    tasks[i] = None  # by-layer rules place split scans, not other code
                if tasks[i] is None and e.params:
                    # a loop or call whose body the rules place on one stage (flatten
                    # already refused bodies needing several)
                    inside = {
                        r for r in rules.stages_inside(e.params, scopes, limit) if r.layers is None
                    }
                    if len(inside) == 1:
                        tasks[i] = next(iter(inside))
        rules.warn_unmatched()
    targets: list[Target] = []
    if mmesh is not None:
        for i in range(mmesh.num_stages):
            targets.append(Target(i, mmesh.submesh(i), f"stage{i}"))
    # a mesh= task on a submesh's devices is that submesh only if they are laid out the
    # same (order and shape): its code's shardings are read on its own mesh's axes
    by_devs: dict[tuple[Any, ...], int] = {_layout(t.mesh): t.index for t in targets}
    owner: dict[int, tuple[int, str]] = {}  # device id -> (target, first task name)
    # the MultiMesh's submeshes that stage= tasks use reserve their devices; an unused
    # one leaves them to mesh= tasks (on part of it, or across two)
    by_layer = any(r is not None and r.mesh is None and r.stage is None for r in tasks)
    # the submeshes stage= tasks use, each with its first task (an overlap error names it)
    holder: dict[int, str] = {}
    for r in tasks:
        if targets and r is not None and r.mesh is None and isinstance(r.stage, int):
            holder.setdefault(r.stage % len(targets), f"task {r.name!r} (stage {r.stage})")

    def reserve(t: Target, name: str, label: str | None = None) -> None:
        for d in t.device_ids:
            if d in owner and owner[d][0] != t.index:
                raise ValueError(
                    f"task {name!r}: its mesh (devices {list(t.device_ids)}, shape "
                    f"{dict(t.mesh.shape)}) overlaps the devices of {owner[d][1]} without "
                    "being the same submesh; tasks must use disjoint device sets, or exactly "
                    "the same devices in the same order and mesh shape."
                )
            owner[d] = (t.index, label or f"task {name!r}")

    for t in targets:
        if by_layer or t.index in holder:
            reserve(t, t.name, holder.get(t.index, f"stage {t.index} (by-layer tasks)"))

    raw_mbs = [_microbatch(e) for e in prog.eqns]
    # virtual stages outside the loops (the same model's code before or after them): as
    # many as the interleaved loops use (Interleaved1F1B() without num_chunks has as
    # many as its tasks name)
    outside_limit = 0
    if mmesh is not None:
        S = mmesh.num_stages
        outside_limit = S
        if virtual_stages > 1:
            in_loops = [
                r.stage
                for r, mb in zip(tasks, raw_mbs)
                if mb is not None and r is not None and r.mesh is None and isinstance(r.stage, int)
            ]
            top = -(-(max(in_loops, default=S - 1) + 1) // S) * S
            outside_limit = max(S, min(S * virtual_stages, top))

    def target_of(ref: TaskRef, in_loop: bool) -> int:
        if ref.mesh is None:
            if mmesh is None:
                raise ValueError(
                    f"task {ref.name!r}: stage={ref.stage} needs a MultiMesh under mm.jit; "
                    "pass mesh=mmesh to mm.jit, or call it inside `with mmesh:`."
                )
            # a task traced earlier (e.g. a cached nested jit) is checked here too
            check_stage_range(
                ref.name,
                ref.stage,
                mmesh.num_stages,
                mmesh.num_stages * virtual_stages if in_loop else outside_limit,
            )
            return ref.stage % mmesh.num_stages  # virtual stage -> submesh
        # (a task traced outside mm.jit, e.g. in a cached nested jit, is checked here)
        mesh: Mesh = check_mesh(ref.mesh, ref.name, mmesh, traced=True)
        ids = _layout(mesh)
        if ids in by_devs:
            reserve(targets[by_devs[ids]], ref.name)
            return by_devs[ids]
        idx = len(targets)
        reserve(Target(idx, mesh, f"mesh{idx}"), ref.name)
        targets.append(Target(idx, mesh, f"mesh{idx}"))
        by_devs[ids] = idx
        return idx

    stages: list[int | None] = []
    task_meshes: list[Mesh | None] = []
    for ref, mb in zip(tasks, raw_mbs):
        if ref is None:
            stages.append(None)
            task_meshes.append(None)
            continue
        idx = target_of(ref, mb is not None)
        stages.append(idx)
        task_meshes.append(ref.mesh if ref.mesh is not None else targets[idx].mesh)
    if not targets:
        import jax

        dev = jax.devices()[0]
        import numpy as np

        targets.append(Target(0, Mesh(np.array([dev]), ("_mm",)), "default"))
    mbs = _loop_order_fixes(prog, raw_mbs)
    virtual = [r.stage if r is not None and r.mesh is None else s for r, s in zip(tasks, stages)]
    return Labels(
        tasks=tasks,
        stages=stages,
        targets=targets,
        task_meshes=task_meshes,
        microbatch=mbs,
        virtual=virtual,
    )


def _loop_order_fixes(
    prog: FlatProgram, mbs: list[tuple[int, int] | None]
) -> list[tuple[int, int] | None]:
    """Take work that consumes a *later* microbatch's values out of its microbatch.

    With ``jax.grad`` outside ``mm.microbatch``, JAX sums a parameter's cotangents in
    reverse microbatch order, inside the scope of the earlier microbatch's backward.
    Left there, microbatch k's backward would wait for microbatch k+1's, contradicting
    every schedule; as work after the loop it only waits for the microbatches it sums.
    """
    latest: dict[Any, tuple[int, int]] = {}  # var -> (loop, latest microbatch it needs)
    out = list(mbs)
    for i, e in enumerate(prog.eqns):
        dep: dict[int, int] = {}
        for a in e.invars:
            d = latest.get(a) if not isinstance(a, Literal) else None
            if d is not None:
                dep[d[0]] = max(dep.get(d[0], -1), d[1])
        mb = out[i]
        if mb is not None and (dep.get(mb[0], -1) > mb[1] or any(loop > mb[0] for loop in dep)):
            # runs after the loop, next to the data it sums (also JAX's sum of a weight's
            # cotangents from a later loop into an earlier one's backward, with jax.grad
            # outside two loops; and an earlier loop's backward that needs a later
            # loop's whole backward: the later loop's input came from the earlier one)
            out[i] = None
        if mb is not None:
            dep[mb[0]] = max(dep.get(mb[0], -1), mb[1])
        if dep and mbs[i] is not None:
            # work outside the loop (the seed of a non-linear function of the loop's
            # output, with jax.grad outside) ends the chain: the backwards it feeds keep
            # their microbatches, and wait for it as for any value made before them
            loop = max(dep)  # (one loop per value in practice)
            for o in e.outvars:
                latest[o] = (loop, dep[loop])
    return out


def _microbatch(eqn: Any) -> tuple[int, int] | None:
    from multimesh.microbatch import decode_microbatch

    # a scope may repeat (e.g. jax.checkpoint's recomputation carries its call site's
    # stack twice); only different loops are nested
    found = list(
        dict.fromkeys(
            m
            for s in _compat.scope_names(eqn.source_info.name_stack)
            if (m := decode_microbatch(s)) is not None
        )
    )
    if len(found) > 1:
        raise ValueError(
            "mm.microbatch loops are nested; a microbatch loop cannot contain another one "
            "under mm.jit: pipeline one of them (e.g. one mm.microbatch with the product of "
            "their microbatch counts), or run the inner one as a plain loop or lax.scan."
        )
    return found[0] if found else None


def hoist_invariants(prog: FlatProgram, labels: Labels, follow: Any = frozenset()) -> Labels:
    """``labels`` with loop-invariant work taken out of its microbatch loop.

    Untagged, effect-free microbatch work on values made before the loop only, that does
    not grow its data (an L2 penalty's ``sum(w ** 2)`` and its gradient ``2 * c * w``),
    gives the same value for every microbatch: as work outside the loop it runs next to
    its data before the loop, and only its (smaller) result moves; as microbatch work it
    floated to where it is used, and each stage's parameters were sent there every step.
    Work that grows its data (a parameter's broadcast) stays in the loop and floats, and
    so do the batch's cuts (``follow``)."""
    mbs = labels.microbatch
    if not mbs or all(m is None for m in mbs):
        return labels
    inloop: set[Any] = set()  # values made by microbatch work
    new = list(mbs)
    for i, e in enumerate(prog.eqns):
        if mbs[i] is None:
            continue
        ins = [a for a in e.invars if not isinstance(a, Literal)]
        if (
            labels.tasks[i] is None
            and not e.effects
            and ins
            and not any(a in inloop for a in ins)
            and not any(o in follow for o in e.outvars)
            and sum(aval_nbytes(o.aval) for o in e.outvars) <= max(aval_nbytes(a.aval) for a in ins)
        ):
            new[i] = None
        else:
            inloop.update(e.outvars)
    if new == mbs:
        return labels
    return dataclasses.replace(labels, microbatch=new)


def _layout(mesh: Mesh) -> tuple[Any, ...]:
    """A mesh's devices in order, and its shape (axis names aside)."""
    return (tuple(int(d.id) for d in mesh.devices.flat), mesh.devices.shape)
