"""Host inputs: what the host cuts or makes before the put, instead of a submesh program.

- **Host slices.** ``mm.microbatch`` cuts its batch arguments into microbatches with
  static slices traced outside the microbatch scopes. For an argument that is not on any
  submesh yet (a NumPy batch from a data loader, an uncommitted array), each slice
  becomes a program input of its own: the runtime cuts it from the argument (a NumPy
  view, or one small jitted split for a device array) and puts each piece where the plan
  needs it. No submesh then compiles a program of slices (on XLA:CPU one kernel per
  slice: 0.1 s of the first call for a batch cut 8 ways) nor receives the whole batch.
- **Host constants.** Small constant arrays made before any task or loop (a loss
  accumulator's zero) are made on the host and put once (buffers this small are never
  donated, so every call reuses it): the submeshes' pre-loop programs then differ less (one program of gradient zeros, shared
  by every stage, instead of one more compile for the stage that also sums the loss).

Pure functions over plain data, run after ``layers.bind_stage_inputs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from multimesh import _compat
from multimesh.compiler.ir import FlatProgram, Labels, Literal

_compat.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class HostSlice:
    """A program input that is a static slice of a host argument."""

    arg: int  # flat argument index
    index: tuple[tuple[int, int, int], ...]  # (start, stop, step) per dimension
    shape: tuple[int, ...]  # the input's shape (a squeezed slice drops unit dimensions)

    def cut(self, x: Any) -> Any:
        """This slice of ``x`` (a NumPy view for a NumPy array)."""
        y = x[tuple(slice(a, b, s) for a, b, s in self.index)]
        return y if tuple(y.shape) == self.shape else y.reshape(self.shape)


def bind_host_slices(
    prog: FlatProgram, eligible: Sequence[bool]
) -> tuple[FlatProgram, dict[int, HostSlice], list[int] | None]:
    """Static slices (each optionally followed by a ``squeeze``) of eligible program
    inputs become program inputs of their own, appended after ``prog.invars``.

    ``eligible[k]``: input ``k`` comes from the host and may be cut there. A slice whose
    value is constrained (``with_sharding_constraint``) stays a slice: the submesh
    computes its layout. Returns the program, the new inputs by their index in
    ``invars``, and the kept equations' indices (``None``: all)."""
    first_index = len(prog.invars)
    cand = {v: k for k, v in enumerate(prog.invars[: len(eligible)]) if eligible[k]}
    if not cand:
        return prog, {}, None
    users: dict[Any, list[int]] = {}
    for i, e in enumerate(prog.eqns):
        for v in e.invars:
            if not isinstance(v, Literal):
                users.setdefault(v, []).append(i)
    outs = {v for v in prog.outvars if not isinstance(v, Literal)}
    drop: set[int] = set()
    new_vars: list[Any] = []
    pieces: dict[int, HostSlice] = {}
    for i, e in enumerate(prog.eqns):
        if e.primitive.name != "slice" or isinstance(e.invars[0], Literal):
            continue
        k = cand.get(e.invars[0])
        if k is None:
            continue
        p = e.params
        shape = tuple(e.invars[0].aval.shape)
        strides = p.get("strides") or (1,) * len(shape)
        index = tuple(
            (int(a), int(b), int(s))
            for a, b, s in zip(p["start_indices"], p["limit_indices"], strides)
        )
        v, removed = e.outvars[0], [i]
        use = users.get(v, [])
        if (
            len(use) == 1
            and v not in outs
            and prog.eqns[use[0]].primitive.name == "squeeze"
            and prog.eqns[use[0]].invars[0] is v
        ):
            removed.append(use[0])
            v = prog.eqns[use[0]].outvars[0]
            use = users.get(v, [])
        if any(prog.eqns[u].primitive.name == "sharding_constraint" for u in use):
            continue
        drop.update(removed)
        new_vars.append(v)
        pieces[first_index + len(new_vars) - 1] = HostSlice(k, index, tuple(v.aval.shape))
    if not pieces:
        return prog, {}, None
    keep = [i for i in range(len(prog.eqns)) if i not in drop]
    return (
        dataclasses.replace(
            prog, eqns=[prog.eqns[i] for i in keep], invars=list(prog.invars) + new_vars
        ),
        pieces,
        keep,
    )


#: the largest constant made on the host (bytes): a loss's or a metric's accumulator
#: zero, not a gradient's (those stay one device program, not a transfer every call)
HOST_CONST_MAX_BYTES = 64


@dataclasses.dataclass(frozen=True, eq=False)
class HostConst:
    """A program input that is a small constant array, put once (buffers this small are
    never donated, so every call uses the same one)."""

    value: np.ndarray


def bind_host_consts(
    prog: FlatProgram, labels: Labels
) -> tuple[FlatProgram, dict[int, HostConst], list[int] | None]:
    """Broadcasts of a literal (each optionally followed by a ``reshape``) outside every
    task and microbatch, of at most :data:`HOST_CONST_MAX_BYTES`, become program inputs
    appended after ``prog.invars``. Returns the program, the new inputs by their index
    in ``invars``, and the kept equations' indices (``None``: all)."""
    users: dict[Any, list[int]] = {}
    for i, e in enumerate(prog.eqns):
        for v in e.invars:
            if not isinstance(v, Literal):
                users.setdefault(v, []).append(i)
    outs = {v for v in prog.outvars if not isinstance(v, Literal)}
    first_index = len(prog.invars)
    drop: set[int] = set()
    new_vars: list[Any] = []
    consts: dict[int, HostConst] = {}
    for i, e in enumerate(prog.eqns):
        if (
            e.primitive.name != "broadcast_in_dim"
            or not isinstance(e.invars[0], Literal)
            or labels.tasks[i] is not None
            or (labels.microbatch and labels.microbatch[i] is not None)
        ):
            continue
        aval = e.outvars[0].aval
        dtype = np.dtype(aval.dtype) if isinstance(aval.dtype, np.dtype) else None
        if dtype is None or int(np.prod(aval.shape)) * dtype.itemsize > HOST_CONST_MAX_BYTES:
            continue
        v, removed = e.outvars[0], [i]
        use = users.get(v, [])
        if (
            len(use) == 1
            and v not in outs
            and prog.eqns[use[0]].primitive.name == "reshape"
            and len(prog.eqns[use[0]].invars) == 1
            and labels.tasks[use[0]] is None
        ):
            removed.append(use[0])
            v = prog.eqns[use[0]].outvars[0]
        value = np.full(tuple(v.aval.shape), e.invars[0].val, dtype=dtype)
        drop.update(removed)
        new_vars.append(v)
        consts[first_index + len(new_vars) - 1] = HostConst(value)
    if not consts:
        return prog, {}, None
    keep = [i for i in range(len(prog.eqns)) if i not in drop]
    return (
        dataclasses.replace(
            prog, eqns=[prog.eqns[i] for i in keep], invars=list(prog.invars) + new_vars
        ),
        consts,
        keep,
    )


def bind_microbatch_cuts(
    prog: FlatProgram, labels: Labels, eligible: Sequence[bool]
) -> tuple[FlatProgram, Labels, dict[int, HostConst]]:
    """Static slices of eligible program inputs (device arrays already in place) used only
    by one microbatch's work become ``dynamic_slice``\\ s in that microbatch, at offsets
    that are program inputs (host constants, put once).

    Every microbatch's work then is one program still (the offsets are inputs), and no
    submesh compiles a program of slices before the loop: each microbatch reads its rows
    of the argument where it is used. Only for replicated layouts (the caller's
    ``eligible``): a dynamic slice of a sharded dimension would gather it."""
    cand = {v: k for k, v in enumerate(prog.invars[: len(eligible)]) if eligible[k]}
    if not cand or not labels.microbatch:
        return prog, labels, {}
    users: dict[Any, list[int]] = {}
    for i, e in enumerate(prog.eqns):
        for v in e.invars:
            if not isinstance(v, Literal):
                users.setdefault(v, []).append(i)
    outs = {v for v in prog.outvars if not isinstance(v, Literal)}
    first_index = len(prog.invars)
    eqns = list(prog.eqns)
    mbs = list(labels.microbatch)
    new_vars: list[Any] = []
    consts: dict[int, HostConst] = {}
    for i, e in enumerate(prog.eqns):
        if (
            e.primitive.name != "slice"
            or isinstance(e.invars[0], Literal)
            or e.invars[0] not in cand
            or labels.tasks[i] is not None
            or mbs[i] is not None
        ):
            continue
        p = e.params
        if any(s != 1 for s in (p.get("strides") or ())):
            continue
        v = e.outvars[0]
        use = users.get(v, [])
        where = {mbs[u] for u in use}
        if (
            not use
            or v in outs
            or v in prog.splits
            or len(where) != 1
            or None in where
            or any(prog.eqns[u].primitive.name == "sharding_constraint" for u in use)
        ):
            continue
        (mb,) = where
        idx = []
        for start in p["start_indices"]:
            iv = _compat.Var(_compat.scalar_aval(np.int32))
            new_vars.append(iv)
            consts[first_index + len(new_vars) - 1] = HostConst(np.asarray(start, np.int32))
            idx.append(iv)
        sizes = tuple(int(b) - int(a) for a, b in zip(p["start_indices"], p["limit_indices"]))
        eqns[i] = _compat.with_name_stack(
            _compat.dynamic_slice_eqn(e, [e.invars[0], *idx], sizes),
            _compat.push_scope(e.source_info.name_stack, f"mb{mb[1]}@mm:L{mb[0]}"),
        )
        mbs[i] = mb
    if not consts:
        return prog, labels, {}
    prog = dataclasses.replace(prog, eqns=eqns, invars=list(prog.invars) + new_vars)
    return prog, dataclasses.replace(labels, microbatch=mbs), consts
