"""Host slices: static slices of arguments that arrive from the host, cut before the put.

``mm.microbatch`` cuts its batch arguments into microbatches with static slices traced
outside the microbatch scopes. For an argument that is not on any submesh yet (a NumPy
batch from a data loader, an uncommitted array), each slice becomes a program input of
its own: the runtime cuts it from the argument (a NumPy view, or one small jitted
split for a device array) and puts each piece where the plan needs it. No submesh then
compiles a program of slices (on XLA:CPU, one kernel per slice: 0.1 s of the first call
for a batch cut 8 ways) nor receives the whole batch to slice it.

A pure function over plain data, run after ``layers.bind_stage_inputs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from multimesh import _compat
from multimesh.compiler.ir import FlatProgram, Literal

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
