"""Pack: move many small values between the same two submeshes as one array.

A training step sends dozens of scalars between stages at the same point (per-layer
gradient-norm partials for clipping, learning rates, loss values). Each transfer has a
fixed latency (a cross-device copy, a collective between processes), so the scalars
that one fragment sends to one submesh are concatenated into one array at the end of
that fragment, moved once, and sliced back at the start of the first fragment that uses
them there (later fragments receive them from it). Values are grouped by dtype and weak
type, so unpacking is exact. A pure function over plain data: it returns new program,
labels, placement and fragments, leaving its inputs untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multimesh import _compat
from multimesh.compiler.fragment import Fragment, wire
from multimesh.compiler.ir import FlatProgram, Labels, Placement

_compat.register_exclusion(__file__)

#: values with at most this many elements are packed
MAX_ELEMENTS = 64
#: values in one pack (more go in further packs)
MAX_VALUES = 64


def _packable(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    return int(np.prod(aval.shape, dtype=np.int64)) <= MAX_ELEMENTS


def pack_transfers(
    prog: FlatProgram, labels: Labels, placement: Placement, frags: list[Fragment]
) -> tuple[FlatProgram, Labels, Placement, list[Fragment]]:
    """Batch each fragment's small outgoing values per destination into one transfer."""
    produced_in = producers(prog, frags)
    # (producer fragment, dst, dtype, weak) -> vars
    batches: dict[tuple[int, int, Any, bool], list[Any]] = {}
    for v, src, dst in placement.transfers:
        k = produced_in.get((v, src))
        if k is None or not _packable(v.aval):
            continue
        key = (k, dst, np.dtype(v.aval.dtype), bool(getattr(v.aval, "weak_type", False)))
        batches.setdefault(key, []).append(v)
    # at most MAX_VALUES a pack: XLA's compile time grows quadratically in the slices
    # taken of one buffer (500 scalars unpacked from one pack: 7-10 s to compile; 1024
    # in packs of 64: 1.3 s, of 128: 1.95 s, unpacked: 0.7 s)
    batches = {
        (*key, c): vs[c : c + MAX_VALUES]
        for key, vs in batches.items()
        for c in range(0, len(vs), MAX_VALUES)
    }
    batches = {k: vs for k, vs in batches.items() if len(vs) > 1}
    if not batches:
        return prog, labels, placement, frags

    ed = ProgramEdit(prog, labels, placement, frags)
    producer_eqn = {o: i for i, e in enumerate(prog.eqns) for o in e.outvars}
    moved: set[tuple[Any, int]] = set()
    new_transfers: list[tuple[Any, int, int]] = []
    packed_counts: dict[Any, int] = dict(placement.packed)

    for (k, dst, _dtype, _weak, _chunk), vs in batches.items():
        src = ed.frags[k].stage
        # pack at the end of the producer
        pack_eqns, packed = _pack_eqns(vs, prog.eqns[producer_eqn[vs[0]]])
        ed.frags[k].eqns.extend(ed.add(pack_eqns, producer_eqn[vs[0]], src))
        new_transfers.append((packed, src, dst))
        packed_counts[packed] = len(vs)
        moved.update((v, dst) for v in vs)
        # unpack at the start of the first fragment on dst that uses one of them
        first = ed.first_user(set(vs), dst, k)
        like = ed.like(first, prog.eqns[producer_eqn[vs[0]]])
        # untagged, with the consumer's name stack: it runs on dst, in the consumer's phase
        ed.frags[first].eqns[:0] = ed.add(_unpack_eqns(vs, packed, like), None, dst)
    transfers = [t for t in placement.transfers if (t[0], t[2]) not in moved] + new_transfers
    return ed.result(transfers, packed_counts)


def producers(prog: FlatProgram, frags: list[Fragment]) -> dict[tuple[Any, int], int]:
    """(value, stage) -> the fragment making it there."""
    out: dict[tuple[Any, int], int] = {}
    for k, f in enumerate(frags):
        for i in f.eqns:
            for o in prog.eqns[i].outvars:
                out[(o, f.stage)] = k
    return out


class ProgramEdit:
    """Equations added to a program and its fragments (copies: the inputs stay as they
    are), with the labels, placement and slots that go with them."""

    def __init__(
        self, prog: FlatProgram, labels: Labels, placement: Placement, frags: list[Fragment]
    ) -> None:
        self.prog, self.labels, self.placement = prog, labels, placement
        n = len(prog.eqns)
        self.eqns = list(prog.eqns)
        self.tasks, self.stages = list(labels.tasks), list(labels.stages)
        self.task_meshes = list(labels.task_meshes)
        self.mbs = list(labels.microbatch or [None] * n)
        self.virtual = list(labels.virtual or [None] * n)
        self.instances = [list(x) for x in placement.instances]
        self.frags = [
            dataclasses.replace(f, eqns=list(f.eqns), inputs=[], outputs=[]) for f in frags
        ]

    def add(self, new_eqns: list[Any], like: int | None, stage: int) -> list[int]:
        """Append equations labelled like eqn ``like`` (``None``: untagged)."""
        lab = self.labels
        ids = []
        for e in new_eqns:
            self.eqns.append(e)
            self.tasks.append(lab.tasks[like] if like is not None else None)
            self.stages.append(lab.stages[like] if like is not None else None)
            self.task_meshes.append(lab.task_meshes[like] if like is not None else None)
            self.mbs.append(self.mbs[like] if like is not None else None)
            self.virtual.append(self.virtual[like] if like is not None else None)
            self.instances.append([stage])
            ids.append(len(self.eqns) - 1)
        return ids

    def first_user(self, want: set[Any], dst: int, producer: int) -> int:
        """The first fragment on ``dst`` reading one of ``want`` (a new fragment after
        ``producer``'s level where only program outputs need them there)."""
        for j, f in enumerate(self.frags):
            if f.stage == dst and any(
                a in want for i in f.eqns for a in self.eqns[i].invars if not _lit(a)
            ):
                return j
        self.frags.append(Fragment(stage=dst, level=self.frags[producer].level + 1, eqns=[]))
        return len(self.frags) - 1

    def like(self, frag: int, default: Any) -> Any:
        """The equation whose source info new equations at the start of ``frag`` take."""
        f = self.frags[frag]
        return self.eqns[f.eqns[0]] if f.eqns else default

    def result(
        self, transfers: list[tuple[Any, int, int]], packed: dict[Any, int]
    ) -> tuple[FlatProgram, Labels, Placement, list[Fragment]]:
        new_prog = dataclasses.replace(self.prog, eqns=self.eqns)
        new_labels = dataclasses.replace(
            self.labels,
            tasks=self.tasks,
            stages=self.stages,
            task_meshes=self.task_meshes,
            microbatch=self.mbs,
            virtual=self.virtual,
        )
        new_placement = dataclasses.replace(
            self.placement, instances=self.instances, transfers=transfers, packed=packed
        )
        wire(new_prog, new_placement, self.frags)
        return new_prog, new_labels, new_placement, self.frags


def _lit(a: Any) -> bool:
    return isinstance(a, _compat.Literal)


def _pack_eqns(vs: list[Any], like: Any) -> tuple[list[Any], Any]:
    def pack(*xs: Any) -> Any:
        return jnp.concatenate([jnp.ravel(x) for x in xs])

    closed = jax.make_jaxpr(pack)(*[sds(v.aval) for v in vs])
    out = closed.jaxpr.outvars[0]
    eqns, env = instantiate(closed, dict(zip(closed.jaxpr.invars, vs)), {}, like)
    return eqns, env[out]


def _unpack_eqns(vs: list[Any], packed: Any, like: Any) -> list[Any]:
    sizes = [int(np.prod(v.aval.shape, dtype=np.int64)) for v in vs]

    def unpack(p: Any) -> list[Any]:
        outs, off = [], 0
        for v, n in zip(vs, sizes):
            outs.append(jax.lax.slice(p, (off,), (off + n,)).reshape(v.aval.shape))
            off += n
        return outs

    closed = jax.make_jaxpr(unpack)(sds(packed.aval))
    eqns, _env = instantiate(
        closed, {closed.jaxpr.invars[0]: packed}, dict(zip(closed.jaxpr.outvars, vs)), like
    )
    return eqns


def sds(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def instantiate(
    closed: Any, env: dict[Any, Any], outs: dict[Any, Any], like: Any
) -> tuple[list[Any], dict[Any, Any]]:
    """The equations of a small traced function with fresh variables, inputs replaced by
    ``env`` and the given outputs bound to ``outs`` (the original variables); the
    equations carry ``like``'s source info (its name stack, so its phase and task)."""
    assert not closed.consts
    new = []
    for e in closed.jaxpr.eqns:
        ins = [a if _lit(a) else env[a] for a in e.invars]
        res = []
        for o in e.outvars:
            nv = outs.get(o) or _compat.Var(o.aval)
            env[o] = nv
            res.append(nv)
        new.append(e.replace(invars=ins, outvars=res, source_info=like.source_info))
    missing = [o for o in outs if o not in env or env[o] is not outs[o]]
    if missing:  # an output that is an input or a literal: give it an identity eqn
        raise AssertionError("pack: unpack outputs must come from equations")
    return new, env
