"""Plain data passed between compiler passes."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.sharding import Mesh

from multimesh import _compat
from multimesh.tasks import TaskRef

Var = _compat.Var
Literal = _compat.Literal


@dataclasses.dataclass
class FlatProgram:
    """A program as one flat list of equations (nested jits with tasks inlined).

    ``eqns`` are in a topological order; each eqn's ``source_info.name_stack`` is its
    effective name stack (outer scopes of any inlined call prepended).
    """

    invars: list[Any]
    constvars: list[Any]
    consts: list[Any]
    outvars: list[Any]
    eqns: list[Any]
    splits: dict[Any, Any] = dataclasses.field(default_factory=dict)  # layers.Split per var


ANY = None  # a value that can be put on (or recomputed on) any stage


@dataclasses.dataclass(frozen=True)
class Target:
    """A submesh that fragments run on; ``index`` is its stage id in the plan."""

    index: int
    mesh: Mesh
    name: str

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(int(d.id) for d in self.mesh.devices.flat)


@dataclasses.dataclass
class Labels:
    """Per-equation task (``None`` for untagged) and the targets they resolve to."""

    tasks: list[TaskRef | None]
    stages: list[int | None]  # target index per eqn, None when untagged
    targets: list[Target]
    task_meshes: list[Mesh | None]  # the mesh each tagged eqn's shardings refer to
    microbatch: list[tuple[int, int] | None] = dataclasses.field(default_factory=list)
    virtual: list[int | None] = dataclasses.field(default_factory=list)  # task stage ids

    def select(self, keep: list[int]) -> Labels:
        """The labels of equations ``keep`` (after a pass removed others)."""

        def pick(xs: list[Any]) -> list[Any]:
            return [xs[i] for i in keep] if xs else xs

        return dataclasses.replace(
            self,
            tasks=pick(self.tasks),
            stages=pick(self.stages),
            task_meshes=pick(self.task_meshes),
            microbatch=pick(self.microbatch),
            virtual=pick(self.virtual),
        )


@dataclasses.dataclass
class Placement:
    """Where each equation runs, as instances (eqn index, stage), and what moves.

    ``instances[i]`` lists the stages eqn ``i`` runs on (several when an untagged,
    pure equation on freely available data is recomputed where needed).
    ``inputs[(v, s)]`` is how a program input / const reaches stage ``s``;
    ``transfers`` are (var, src stage, dst stage) moves between submeshes;
    ``outputs[k]`` is the stage set the k-th program output is taken from.
    """

    instances: list[list[int]]
    input_stages: dict[Any, list[int]]
    transfers: list[tuple[Any, int, int]]
    outputs: list[list[int]]
    packed: dict[Any, int] = dataclasses.field(default_factory=dict)  # var -> values in it


def aval_nbytes(aval: Any) -> int:
    shape = getattr(aval, "shape", ())
    dtype = getattr(aval, "dtype", None)
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        itemsize = 8
    return int(np.prod(shape, dtype=np.int64)) * int(itemsize)


def use_counts(prog: FlatProgram) -> dict[Any, int]:
    """How many times each variable is read: by equations (once per operand) and as a
    program output."""
    uses: dict[Any, int] = {}
    for v in [a for e in prog.eqns for a in e.invars] + list(prog.outvars):
        if not isinstance(v, Literal):
            uses[v] = uses.get(v, 0) + 1
    return uses
