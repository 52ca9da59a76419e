"""Transfers between submeshes: choose destination shardings and the fastest copy."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh import _compat

_compat.register_exclusion(__file__)


def _spec_fits(spec: PartitionSpec, src_mesh: Any, dst: Mesh) -> bool:
    for entry in spec:
        if entry is None:
            continue
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        for n in names:
            if n not in dst.shape or (
                src_mesh is not None and dst.shape[n] != src_mesh.shape.get(n)
            ):
                return False
    return True


def dst_sharding(src: jax.sharding.Sharding, dst: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """The sharding a value gets on another submesh: the same layout where possible;
    else, per dimension, split as many ways over an axis of ``dst`` of that size (a
    value split 4 ways over ``('dp', 'tp')`` goes to a 4-device ``('fsdp',)`` mesh as
    ``P('fsdp')``, not whole onto every device), unsplit where no axis fits."""
    if not isinstance(src, NamedSharding):
        return NamedSharding(dst, PartitionSpec())
    if _spec_fits(src.spec, src.mesh, dst):
        return NamedSharding(dst, src.spec)
    return NamedSharding(dst, _remapped(src.spec, dict(src.mesh.shape), dict(dst.shape), shape))


def _remapped(
    spec: PartitionSpec, src: dict[str, int], dst: dict[str, int], shape: tuple[int, ...]
) -> PartitionSpec:
    dims: list[tuple[str, ...]] = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
            return PartitionSpec()  # UNCONSTRAINED or an odd entry: replicate
        dims.append(names)
    # dimensions whose axes exist on dst with the same sizes keep them; the others take
    # an unused dst axis of the same size
    kept = [bool(ns) and all(dst.get(n) == src.get(n) for n in ns) for ns in dims]
    used = {n for ns, k in zip(dims, kept) if k for n in ns}
    entries: list[Any] = []
    for d, (names, keep) in enumerate(zip(dims, kept)):
        if not names or keep:
            entries.append(spec[d] if keep else None)
            continue
        ways = int(np.prod([src.get(n, 1) for n in names]))
        free = [n for n in dst if n not in used]
        fit = next(
            (
                axes
                for k in range(1, len(free) + 1)
                for axes in itertools.combinations(free, k)
                if int(np.prod([dst[n] for n in axes])) == ways
            ),
            None,
        )
        if fit is not None and d < len(shape) and shape[d] % ways == 0:
            entries.append(fit[0] if len(fit) == 1 else fit)
            used.update(fit)
        else:
            entries.append(None)
    return PartitionSpec(*entries)


def same_layout(
    src: jax.sharding.Sharding, dst: jax.sharding.Sharding, shape: tuple[int, ...]
) -> bool:
    """Whether shard i of ``src`` maps to shard i of ``dst`` (so a shard-wise copy works)."""
    if len(src.device_set) != len(dst.device_set):
        return False
    a = list(src.devices_indices_map(shape).values())
    b = list(dst.devices_indices_map(shape).values())
    return a == b


def union_sharding(shardings: list[NamedSharding], stage_axis: str) -> NamedSharding | None:
    """A sharding over several submeshes' devices, replicated across them, if the
    per-submesh shardings line up (same mesh shape and spec); else ``None``."""
    first = shardings[0]
    for s in shardings[1:]:
        if (
            not isinstance(s, NamedSharding)
            or s.spec != first.spec
            or s.mesh.axis_names != first.mesh.axis_names
            or s.mesh.devices.shape != first.mesh.devices.shape
        ):
            return None
    if not isinstance(first, NamedSharding) or stage_axis in first.mesh.axis_names:
        return None
    devs = np.stack([s.mesh.devices for s in shardings])
    mesh = Mesh(
        devs,
        (stage_axis, *first.mesh.axis_names),
        axis_types=(jax.sharding.AxisType.Auto,) * devs.ndim,
    )
    return NamedSharding(mesh, first.spec)


def same_pieces(home: Any, sh: Any, shape: tuple[int, ...]) -> bool:
    """Whether every device of ``sh`` holds the same part of a ``shape`` value under
    ``home`` (so ``sh``'s array is made of ``home``'s buffers, without copying)."""
    try:
        have = home.devices_indices_map(shape)
        want = sh.devices_indices_map(shape)
    except (TypeError, ValueError):
        return False
    return all(
        d in have and _index_ranges(have[d], shape) == _index_ranges(i, shape)
        for d, i in want.items()
    )


def _index_ranges(
    index: tuple[Any, ...], shape: tuple[int, ...]
) -> tuple[tuple[int, int, int], ...]:
    return tuple(
        s.indices(n) if isinstance(s, slice) else (s, s + 1, 1) for s, n in zip(index, shape)
    )
