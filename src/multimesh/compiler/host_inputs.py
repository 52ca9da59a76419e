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
  donated, so every call reuses it): the submeshes' pre-loop programs then differ less
  (one program of gradient zeros, shared by every stage, instead of one more compile for
  the stage that also sums the loss).
- **Host scalars.** Integer scalars computed from literals only (NNX's RNG counters:
  ``count + 1`` after ``count + 1`` from a literal zero, one more per initializer called)
  are computed on the host, and those the program uses become host constants. The
  stages' parts of a model's init then differ only in these inputs' values, not in their
  programs: identical layers on several stages compile once (relocated to the others'
  devices), where every stage's counter chain was a program of its own.
- **Microbatch cuts.** Where layouts are replicated, a static slice of an argument that
  is already on a submesh, used by one microbatch only, becomes a ``dynamic_slice`` in
  that microbatch at offsets given as host constants: every microbatch is still one
  program, and none slices the batch before the loop.

Pure functions over plain data, run after ``layers.bind_stage_inputs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from multimesh import _compat
from multimesh.compiler.ir import FlatProgram, Labels, Literal, aval_nbytes
from multimesh.microbatch import microbatch_scope

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


#: the largest constant made on the host (bytes): a loss's or a metric's accumulator
#: zero, not a gradient's (those stay one device program, not a transfer every call)
HOST_CONST_MAX_BYTES = 64


@dataclasses.dataclass(frozen=True, eq=False)
class HostConst:
    """A program input that is a small constant array, put once (buffers this small are
    never donated, so every call uses the same one)."""

    value: np.ndarray


class _Uses:
    """Who reads each variable of a program, and which are its outputs."""

    def __init__(self, prog: FlatProgram) -> None:
        self.prog = prog
        self.users: dict[Any, list[int]] = {}
        for i, e in enumerate(prog.eqns):
            for v in e.invars:
                if not isinstance(v, Literal):
                    self.users.setdefault(v, []).append(i)
        self.outs = {v for v in prog.outvars if not isinstance(v, Literal)}

    def of(self, v: Any) -> list[int]:
        return self.users.get(v, [])

    def sole(self, v: Any, primitive: str) -> int | None:
        """The one equation reading ``v``, if it is a ``primitive`` with ``v`` as its
        first operand and ``v`` is not a program output."""
        use = self.of(v)
        if len(use) != 1 or v in self.outs:
            return None
        e = self.prog.eqns[use[0]]
        return use[0] if e.primitive.name == primitive and e.invars[0] is v else None

    def constrained(self, v: Any) -> bool:
        return any(self.prog.eqns[u].primitive.name == "sharding_constraint" for u in self.of(v))


def _with_inputs(
    prog: FlatProgram, new_vars: list[Any], drop: set[int]
) -> tuple[FlatProgram, list[int]]:
    """``prog`` with ``new_vars`` appended to its inputs and equations ``drop`` removed;
    and the kept equations' indices."""
    keep = [i for i in range(len(prog.eqns)) if i not in drop]
    eqns = [prog.eqns[i] for i in keep]
    return dataclasses.replace(prog, eqns=eqns, invars=list(prog.invars) + new_vars), keep


def _candidates(prog: FlatProgram, eligible: Sequence[bool]) -> dict[Any, int]:
    return {v: k for k, v in enumerate(prog.invars[: len(eligible)]) if eligible[k]}


def _sliced_input(e: Any, cand: dict[Any, int]) -> int | None:
    """The eligible input a ``slice`` equation reads, else ``None``."""
    if e.primitive.name != "slice" or isinstance(e.invars[0], Literal):
        return None
    return cand.get(e.invars[0])


def bind_host_slices(
    prog: FlatProgram, eligible: Sequence[bool]
) -> tuple[FlatProgram, dict[int, HostSlice], list[int] | None]:
    """Static slices (each optionally followed by a ``squeeze``) of eligible program
    inputs become program inputs of their own, appended after ``prog.invars``.

    ``eligible[k]``: input ``k`` comes from the host and may be cut there. A slice whose
    value is constrained (``with_sharding_constraint``) stays a slice: the submesh
    computes its layout. Returns the program, the new inputs by their index in
    ``invars``, and the kept equations' indices (``None``: all)."""
    cand = _candidates(prog, eligible)
    if not cand:
        return prog, {}, None
    uses = _Uses(prog)
    drop: set[int] = set()
    new_vars: list[Any] = []
    pieces: dict[int, HostSlice] = {}
    for i, e in enumerate(prog.eqns):
        k = _sliced_input(e, cand)
        if k is None:
            continue
        p = e.params
        strides = p.get("strides") or (1,) * len(p["start_indices"])
        index = tuple(
            (int(a), int(b), int(s))
            for a, b, s in zip(p["start_indices"], p["limit_indices"], strides)
        )
        v, removed = e.outvars[0], [i]
        if (j := uses.sole(v, "squeeze")) is not None:
            removed.append(j)
            v = prog.eqns[j].outvars[0]
        if uses.constrained(v):
            continue
        drop.update(removed)
        pieces[len(prog.invars) + len(new_vars)] = HostSlice(k, index, tuple(v.aval.shape))
        new_vars.append(v)
    if not pieces:
        return prog, {}, None
    prog, keep = _with_inputs(prog, new_vars, drop)
    return prog, pieces, keep


def bind_host_consts(
    prog: FlatProgram, labels: Labels
) -> tuple[FlatProgram, dict[int, HostConst], list[int] | None]:
    """Broadcasts of a literal (each optionally followed by a ``reshape``) outside every
    task and microbatch, of at most :data:`HOST_CONST_MAX_BYTES`, become program inputs
    appended after ``prog.invars``. Returns the program, the new inputs by their index
    in ``invars``, and the kept equations' indices (``None``: all)."""
    uses = _Uses(prog)
    drop: set[int] = set()
    new_vars: list[Any] = []
    consts: dict[int, HostConst] = {}
    for i, e in enumerate(prog.eqns):
        aval = e.outvars[0].aval if e.outvars else None
        if (
            e.primitive.name != "broadcast_in_dim"
            or not isinstance(e.invars[0], Literal)
            or labels.tasks[i] is not None
            or (labels.microbatch and labels.microbatch[i] is not None)
            or not isinstance(aval.dtype, np.dtype)  # not an extended dtype (PRNG keys)
            or getattr(aval, "weak_type", False)  # a host array would be strongly typed
            or aval_nbytes(aval) > HOST_CONST_MAX_BYTES
        ):
            continue
        v, removed = e.outvars[0], [i]
        if (j := uses.sole(v, "reshape")) is not None and labels.tasks[j] is None:
            removed.append(j)
            v = prog.eqns[j].outvars[0]
        if v in uses.outs:  # returned: stays made by the program (a fresh array, weak type kept)
            continue
        drop.update(removed)
        value = np.full(tuple(v.aval.shape), e.invars[0].val, dtype=aval.dtype)
        consts[len(prog.invars) + len(new_vars)] = HostConst(value)
        new_vars.append(v)
    if not consts:
        return prog, {}, None
    prog, keep = _with_inputs(prog, new_vars, drop)
    return prog, consts, keep


#: integer scalar operations computed on the host exactly as XLA computes them (no
#: division, remainder or shifts: their edge cases differ from NumPy's)
_HOST_SCALAR_OPS: dict[str, Any] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "neg": np.negative,
    "max": np.maximum,
    "min": np.minimum,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "convert_element_type": lambda x: x,  # the cast to the output's dtype does it
}


def _int_scalar(aval: Any) -> bool:
    dt = getattr(aval, "dtype", None)
    return (
        getattr(aval, "shape", None) == ()
        and isinstance(dt, np.dtype)
        and (np.issubdtype(dt, np.integer) or dt == np.bool_)
    )


def _host_scalar(e: Any, known: dict[Any, np.ndarray]) -> np.ndarray | None:
    """The value of equation ``e`` (an exact integer scalar operation on literals or
    values in ``known``), computed with NumPy; ``None`` if it is not one."""
    fn = _HOST_SCALAR_OPS.get(e.primitive.name)
    if fn is None or len(e.outvars) != 1 or e.effects or not _int_scalar(e.outvars[0].aval):
        return None
    args = []
    for v in e.invars:
        if isinstance(v, Literal):
            if not _int_scalar(v.aval):
                return None
            args.append(np.asarray(v.val, dtype=v.aval.dtype))
        elif v in known:
            args.append(known[v])
        else:
            return None
    with np.errstate(all="ignore"):  # integer arithmetic wraps around, as in XLA
        return np.asarray(fn(*args)).astype(e.outvars[0].aval.dtype)


def bind_host_scalars(prog: FlatProgram) -> tuple[FlatProgram, dict[int, HostConst], list[int] | None]:
    """Integer scalars computed from literals only (exact integer operations) are
    computed on the host; those that other equations use become program inputs appended
    after ``prog.invars`` (host constants). A value that is returned, or weakly typed (a
    host array is strongly typed), stays made by the program, with what it needs.
    Returns the program, the new inputs by their index in ``invars``, and the kept
    equations' indices (``None``: all)."""
    known: dict[Any, np.ndarray] = {}
    made: dict[int, list[Any]] = {}  # eqn -> its outputs, computed on the host
    for i, e in enumerate(prog.eqns):
        val = _host_scalar(e, known)
        if val is not None:
            known[e.outvars[0]] = val
            made[i] = list(e.outvars)
    if not made:
        return prog, {}, None
    uses = _Uses(prog)
    producer = {v: i for i, vs in made.items() for v in vs}
    # equations left in the program, and the host values they need, until neither grows
    while True:
        kept = [i for i in range(len(prog.eqns)) if i not in made]
        needed = {
            v
            for i in kept
            for v in prog.eqns[i].invars
            if not isinstance(v, Literal) and v in producer
        }
        returned = uses.outs & set(producer)
        unfit = returned | {v for v in needed if v.aval.weak_type}
        if not unfit:
            break
        for v in unfit:
            made.pop(producer.pop(v), None)
    if not made:
        return prog, {}, None
    new_vars = sorted(needed, key=lambda v: producer[v])
    consts = {len(prog.invars) + k: HostConst(known[v]) for k, v in enumerate(new_vars)}
    prog, keep = _with_inputs(prog, new_vars, set(made))
    return prog, consts, keep


def bind_microbatch_cuts(
    prog: FlatProgram, labels: Labels, eligible: Sequence[bool]
) -> tuple[FlatProgram, Labels, dict[int, HostConst], frozenset[Any]]:
    """Static slices of eligible program inputs (device arrays already in place) used only
    by one microbatch's work become ``dynamic_slice``\\ s in that microbatch, at offsets
    that are program inputs (host constants, put once). Also returned: the cuts' outputs,
    for placement to run each cut where it is used (``place.place``'s ``follow``).

    Every microbatch's work then is one program still (the offsets are inputs), and no
    submesh compiles a program of slices before the loop: each microbatch reads its rows
    of the argument where it is used. Only for replicated layouts (the caller's
    ``eligible``): a dynamic slice of a sharded dimension would gather it."""
    cand = _candidates(prog, eligible)
    if not cand or not labels.microbatch:
        return prog, labels, {}, frozenset()
    uses = _Uses(prog)
    eqns = list(prog.eqns)
    mbs = list(labels.microbatch)
    new_vars: list[Any] = []
    consts: dict[int, HostConst] = {}
    cut_outs: list[Any] = []
    for i, e in enumerate(prog.eqns):
        if _sliced_input(e, cand) is None or labels.tasks[i] is not None or mbs[i] is not None:
            continue
        p = e.params
        v = e.outvars[0]
        where = {mbs[u] for u in uses.of(v)}
        if (
            any(s != 1 for s in (p.get("strides") or ()))
            or v in uses.outs
            or v in prog.splits
            or len(where) != 1
            or None in where
            or uses.constrained(v)
        ):
            continue
        ((loop, k),) = where
        idx = []
        for start in p["start_indices"]:
            iv = _compat.Var(_compat.scalar_aval(np.int32))
            consts[len(prog.invars) + len(new_vars)] = HostConst(np.asarray(start, np.int32))
            new_vars.append(iv)
            idx.append(iv)
        sizes = tuple(int(b) - int(a) for a, b in zip(p["start_indices"], p["limit_indices"]))
        eqns[i] = _compat.with_name_stack(
            _compat.dynamic_slice_eqn(e, [e.invars[0], *idx], sizes),
            _compat.push_scope(e.source_info.name_stack, microbatch_scope(loop, k)),
        )
        mbs[i] = (loop, k)
        cut_outs.append(v)
    if not consts:
        return prog, labels, {}, frozenset()
    prog = dataclasses.replace(prog, eqns=eqns, invars=list(prog.invars) + new_vars)
    return prog, dataclasses.replace(labels, microbatch=mbs), consts, frozenset(cut_outs)
