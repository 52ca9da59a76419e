"""Where program inputs already are: on one submesh, on several, or on the host."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from multimesh import _compat
from multimesh.arguments import spec_axes
from multimesh.compiler.ir import ANY, Target

_compat.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class InputInfo:
    """How one flat argument relates to the plan's targets."""

    loc: frozenset | None  # ANY (None) or the stages it is already on
    mode: str  # "as_is" | "extract" | "put"
    extract_specs: tuple[tuple[int, PartitionSpec], ...] = ()  # per stage (extract)


def committed_sharding(x: Any) -> jax.sharding.Sharding | None:
    """Where an argument already is: a committed array's sharding, or the sharding of a
    ``jax.ShapeDtypeStruct`` given to ``lower`` (``None``: a host value, put anywhere)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        sh = x.sharding
        return sh if isinstance(sh, jax.sharding.Sharding) else None
    if isinstance(x, jax.Array) and getattr(x, "committed", False):
        return x.sharding
    return None


def _explicit(sh: Any) -> bool:
    types = getattr(getattr(sh, "mesh", None), "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def analyze(x: Any, targets: list[Target], stage_axis: str | None) -> InputInfo:
    sh = committed_sharding(x)
    if sh is None or _explicit(sh):
        # an array typed by an Explicit-axes mesh (jax.make_mesh's default) carries that
        # mesh in its type, which a fragment traced on its submesh's (Auto) mesh cannot
        # take: it is put there like any other value
        return InputInfo(ANY, "put")
    devs = frozenset(int(d.id) for d in sh.device_set)
    order = _compat.device_assignment_ids(sh)
    for t in targets:
        # a submesh's devices in another order: its pieces are re-wrapped, or it is put
        if t.device_ids == order:
            return InputInfo(frozenset({t.index}), "as_is")
    specs: list[tuple[int, PartitionSpec]] = []
    if isinstance(sh, NamedSharding) and stage_axis and stage_axis in sh.mesh.axis_names:
        mesh = sh.mesh
        if stage_axis not in spec_axes(sh.spec):
            dim = tuple(mesh.axis_names).index(stage_axis)
            slices = {
                tuple(int(d.id) for d in np.take(mesh.devices, [j], axis=dim).flat): j
                for j in range(mesh.devices.shape[dim])
            }
            rest = [k for k in range(len(mesh.axis_names)) if k != dim]
            names = tuple(mesh.axis_names[k] for k in rest)
            sizes = tuple(mesh.devices.shape[k] for k in rest)
            for t in targets:
                # the same devices in the same order, axes and sizes: the same layout
                if (
                    t.device_ids in slices
                    and tuple(t.mesh.axis_names) == names
                    and tuple(t.mesh.devices.shape) == sizes
                ):
                    specs.append((t.index, sh.spec))
    if not specs and sh.is_fully_replicated:
        for t in targets:
            if set(t.device_ids) <= devs:
                specs.append((t.index, PartitionSpec()))
    if specs:
        return InputInfo(frozenset(s for s, _ in specs), "extract", tuple(specs))
    return InputInfo(ANY, "put")
