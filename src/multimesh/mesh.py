"""Meshes: a MultiMesh is a global device mesh whose ``stage_axis`` indexes submeshes.

``MultiMesh.submesh(i)`` slices the global mesh at index ``i`` of the stage axis; its
axes are the remaining axes in order. Inside a task, ordinary JAX sharding (bare
``PartitionSpec``, ``NamedSharding`` on the global mesh without the stage axis,
``shard_map``) refers to that task's submesh.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from multimesh import _compat

_compat.register_exclusion(__file__)

_ACTIVE: contextvars.ContextVar[MultiMesh | None] = contextvars.ContextVar(
    "multimesh_active", default=None
)


class MultiMesh:
    """A global mesh whose ``stage_axis`` indexes the submeshes that tasks run on."""

    def __init__(self, mesh: Mesh, stage_axis: str = "stage") -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"MultiMesh needs a jax.sharding.Mesh, got {type(mesh).__name__}.")
        if stage_axis not in mesh.axis_names:
            raise ValueError(
                f"stage_axis {stage_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}; "
                "name one of its axes, e.g. mm.make_mesh((2, 4), ('stage', 'data'))."
            )
        names = list(mesh.axis_names)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:  # XLA crashes compiling for such a submesh
            raise ValueError(
                f"the mesh names axes {dup} more than once (axes {tuple(names)}); give each "
                "axis its own name."
            )
        types = getattr(mesh, "axis_types", None)
        if types is not None and any(t == AxisType.Explicit for t in types):
            raise ValueError(
                "MultiMesh does not support Explicit mesh axes (jax.make_mesh's default); "
                "build the mesh with mm.make_mesh(...) or pass "
                "axis_types=(jax.sharding.AxisType.Auto,) * ndim."
            )
        if types is not None and any(t == AxisType.Manual for t in types):
            raise ValueError(
                "MultiMesh does not support Manual mesh axes (those are shard_map's, inside "
                "a program); build the mesh with mm.make_mesh(...) or pass "
                "axis_types=(jax.sharding.AxisType.Auto,) * ndim, and use shard_map inside "
                "a task for manual collectives."
            )
        platforms = sorted({d.platform for d in mesh.devices.flat})
        if len(platforms) > 1:  # device ids repeat across platforms; plans key by id
            raise ValueError(
                f"the mesh mixes devices of several platforms ({', '.join(platforms)}); a "
                "MultiMesh's devices must all be of one platform: build it from "
                "jax.devices() of one backend (jax.devices('cpu'), jax.devices('gpu'), ...)."
            )
        ids = [int(d.id) for d in mesh.devices.flat]
        if len(set(ids)) != len(ids):
            twice = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(
                f"the mesh lists devices {twice} more than once; each device can belong to "
                "one place of a MultiMesh (stages would share it and run one after another)."
            )
        self.mesh = mesh
        self.stage_axis = stage_axis
        self._stage_dim = tuple(mesh.axis_names).index(stage_axis)
        self._submeshes = [self._slice(i) for i in range(self.num_stages)]
        # per-thread stack of entered contexts: `with mmesh:` may run in several threads
        self._local = threading.local()

    def _slice(self, i: int) -> Mesh:
        devs = np.take(self.mesh.devices, i, axis=self._stage_dim)
        names = tuple(n for n in self.mesh.axis_names if n != self.stage_axis)
        types = tuple(
            t for n, t in zip(self.mesh.axis_names, self.mesh.axis_types) if n != self.stage_axis
        )
        return Mesh(devs, names, axis_types=types)

    @property
    def num_stages(self) -> int:
        """Number of submeshes (the size of the stage axis)."""
        return int(self.mesh.shape[self.stage_axis])

    def submesh(self, i: int) -> Mesh:
        """The submesh at index ``i`` of the stage axis."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"submesh index must be an int, got {i!r}.")
        if not 0 <= i < self.num_stages:
            raise ValueError(f"submesh index {i} out of range for {self.num_stages} stages.")
        return self._submeshes[int(i)]

    @property
    def devices(self) -> list[jax.Device]:
        return list(self.mesh.devices.flat)

    def __enter__(self) -> MultiMesh:
        stack = self._local.__dict__.setdefault("stack", [])
        tok = _ACTIVE.set(self)
        cm = _compat.set_mesh(self.mesh)
        cm.__enter__()
        stack.append((tok, cm))
        return self

    def __exit__(self, *exc: Any) -> None:
        tok, cm = self._local.stack.pop()
        cm.__exit__(*exc)
        _ACTIVE.reset(tok)

    def __deepcopy__(self, memo: dict[int, Any]) -> MultiMesh:
        """Itself: a MultiMesh is immutable (as a ``jax.sharding.Mesh`` is), and its
        context stack is per thread, not part of its value."""
        return self

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, MultiMesh)
            and other.mesh == self.mesh
            and other.stage_axis == self.stage_axis
        )

    def __hash__(self) -> int:
        return hash((self.mesh, self.stage_axis))

    def __repr__(self) -> str:
        shape = ", ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return f"MultiMesh({shape}; stage_axis={self.stage_axis!r})"


def make_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str],
    stage_axis: str = "stage",
    devices: Sequence[jax.Device] | None = None,
) -> MultiMesh:
    """Build a MultiMesh with Auto axes over ``devices`` (default: all devices)."""
    bad = [
        s for s in shape if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1
    ]
    if bad:
        raise ValueError(
            f"mesh shape {tuple(shape)}: every entry must be a positive int (the number of "
            f"devices along that axis), got {bad}."
        )
    shape = tuple(int(s) for s in shape)
    axis_names = tuple(axis_names)
    if not all(isinstance(n, str) for n in axis_names):
        raise TypeError(f"axis_names must be strings, got {axis_names}.")
    if len(shape) != len(axis_names):
        raise ValueError(f"shape {shape} and axis_names {axis_names} differ in length.")
    dup = sorted({n for n in axis_names if axis_names.count(n) > 1})
    if dup:
        raise ValueError(
            f"axis_names {axis_names} name {dup} more than once; give each axis its own name."
        )
    n = int(np.prod(shape))
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) < n:
        raise ValueError(f"mesh shape {shape} needs {n} devices, but only {len(devs)} given.")
    if devices is not None and len(devs) != n:
        raise ValueError(f"mesh shape {shape} needs {n} devices, got {len(devs)}.")
    arr = np.array(devs[:n], dtype=object).reshape(shape)
    mesh = Mesh(arr, axis_names, axis_types=(AxisType.Auto,) * len(shape))
    return MultiMesh(mesh, stage_axis=stage_axis)


def active_multimesh() -> MultiMesh | None:
    """The MultiMesh made active by ``with mmesh:`` or by ``mm.jit(mesh=...)``, if any."""
    return _ACTIVE.get()


def set_active(mmesh: MultiMesh | None) -> contextvars.Token:
    return _ACTIVE.set(mmesh)


def reset_active(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)
