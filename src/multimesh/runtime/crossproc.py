"""Running a plan on several processes: which steps are local, and transfers between
submeshes that live in different processes.

Every process traces, plans and compiles the same program (so every process knows
every fragment's shardings), then runs only what touches its own devices: fragments
whose submesh has a local device, the inputs those need, and its side of each
transfer. A transfer between submeshes is a set of single-device copies (shard ``i`` of
the source to shard ``i`` of the destination); copies within a process are local,
copies across processes go through the transport (:mod:`multimesh.runtime.transport`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from multimesh import _compat
from multimesh.runtime import transfer as tr
from multimesh.runtime import transport as tp

_compat.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class Locality:
    """Which process owns which device, seen from this process."""

    me: int
    owner: dict[int, int]  # device id -> process index

    def procs(self, devices: Any) -> set[int]:
        return {self.owner[int(d.id)] for d in devices}

    def has(self, devices: Any) -> bool:
        """Whether any of ``devices`` is this process's."""
        return any(self.owner[int(d.id)] == self.me for d in devices)

    def only(self, devices: Any) -> bool:
        """Whether all of ``devices`` are this process's."""
        return all(self.owner[int(d.id)] == self.me for d in devices)


def locality() -> Locality | None:
    """This process's view, or ``None`` in a single-process run."""
    if jax.process_count() == 1:
        return None
    return Locality(jax.process_index(), {int(d.id): d.process_index for d in jax.devices()})


#: per group of processes: how many plans it has compared (the key-value keys' sequence)
_PLAN_SEQ: dict[tuple[int, ...], itertools.count] = {}


def peer_timeout_s() -> float:
    """How long to wait for another process (``MULTIMESH_PLAN_TIMEOUT``, default 1800 s):
    a peer may legitimately be busy (data loading, compiling)."""
    return float(os.environ.get("MULTIMESH_PLAN_TIMEOUT", "1800"))


def check_same_plan(
    loc: Locality,
    uid: int,
    inputs: Sequence[str],
    names: Sequence[str],
    what: str,
    devices: Sequence[int],
    timeout_s: float | None = None,
) -> None:
    """Every process must build the same plan for the same call (the transfers pair up by
    plan): compare this process's plan with those of the other processes holding the
    program's ``devices`` (ids), before anything runs, and name the arguments placed
    differently instead of hanging in a transfer that never pairs. A program on one
    process's devices, or on none of this process's, compares nothing.

    ``inputs`` describes where each flat argument is on this process; ``names`` are
    the arguments' paths (for the message)."""
    if timeout_s is None:
        timeout_s = peer_timeout_s()
    group = tuple(sorted({loc.owner[int(d)] for d in devices}))
    if len(group) == 1 or loc.me not in group:
        return  # no transfer between processes, or none this process takes part in
    seq = next(_PLAN_SEQ.setdefault(group, itertools.count()))
    tag = "-".join(map(str, group))
    kv = tp.kv_client()
    mine = {"uid": str(uid), "inputs": list(inputs)}
    kv.key_value_set(f"multimesh/plan/{tag}/{seq}/{loc.me}", json.dumps(mine))
    for p in group:
        if p == loc.me:
            continue
        raw = _wait_for(
            kv,
            f"multimesh/plan/{tag}/{seq}/{p}",
            p,
            timeout_s,
            f"{what} on process {loc.me} has waited {{s:.0f}} s for process {p} to plan the "
            f"same call (its plan number {seq}); every process must call the same mm.jit "
            "functions in the same order, with arguments of the same shapes (a process "
            "running a program it compiled before plans nothing).",
        )
        if raw is _GONE:
            raise RuntimeError(
                f"{what}: process {p} exited (sys.exit, an error it caught, or the end of "
                f"its script) without building its plan number {seq} for this call. Every "
                "process must call the same mm.jit functions, in the same order, until "
                "the end."
            )
        if raw is None:
            raise RuntimeError(
                f"{what}: process {p} did not build its plan number {seq} within "
                f"{timeout_s:.0f} s (MULTIMESH_PLAN_TIMEOUT): it did not make this call, "
                "or made it with a program it had compiled before (arguments of other "
                "shapes, dtypes or static values than here). Every process must call the "
                "same mm.jit functions, in the same order, with arguments of the same "
                "shapes and placements."
            )
        other = json.loads(raw)
        if other["uid"] == mine["uid"]:
            continue
        diff = [
            f"{names[k] if k < len(names) else f'argument {k}'}: here {a}, on process {p} {b}"
            for k, (a, b) in enumerate(zip(inputs, other["inputs"]))
            if a != b
        ]
        why = (
            "arguments placed differently: "
            + "; ".join(diff[:4])
            + (f" (and {len(diff) - 4} more)" if len(diff) > 4 else "")
            if diff
            else "the traced programs differ (shapes, static arguments or Python control flow)"
        )
        raise RuntimeError(
            f"{what}: process {loc.me} and process {p} built different plans for the same "
            f"call ({why}). Every process must pass the same arguments with the same "
            "placement: commit arrays to the same sharding on every process (e.g. "
            "jax.device_put(x, NamedSharding(mesh, spec)) or an mm.jit output), not to a "
            "process's default device."
        )


_GONE = object()


def exchange_with_all(key: str, value: str, what: str) -> dict[int, str]:
    """Every process's ``value`` under ``key`` (a host barrier that also carries a value):
    a process that exits first, or has not set it within ``MULTIMESH_PLAN_TIMEOUT``, is
    a clear error naming it and ``what`` (a plain barrier waited out the whole timeout,
    half an hour, when one process skipped a collective step)."""
    me, n = jax.process_index(), jax.process_count()
    kv = tp.kv_client()
    kv.key_value_set(f"{key}/{me}", value)
    timeout_s = peer_timeout_s()
    out = {me: value}
    for p in range(n):
        if p == me:
            continue
        raw = _wait_for(
            kv,
            f"{key}/{p}",
            p,
            timeout_s,
            f"{what} on process {me} has waited {{s:.0f}} s for process {p} to reach it; "
            "every process must call it (not only process 0).",
        )
        if raw is _GONE:
            raise RuntimeError(
                f"{what}: process {p} exited without taking part. Every process must call "
                "it, with the same arguments (not only process 0)."
            )
        if raw is None:
            raise RuntimeError(
                f"{what}: process {p} did not take part within {timeout_s:.0f} s "
                "(MULTIMESH_PLAN_TIMEOUT). Every process must call it, with the same "
                "arguments (not only process 0)."
            )
        out[p] = raw.decode() if isinstance(raw, bytes) else str(raw)
    return out


def _wait_for(kv: Any, key: str, peer: int, timeout_s: float, notice: str) -> Any:
    """``_poll`` for ``peer``'s ``key``: after ``MULTIMESH_WAIT_NOTICE`` (a minute) a word
    on stderr (``notice``, formatted with the seconds waited ``s``: a peer that skipped
    this call and went on, or calls in another order, cannot be told from a slow one),
    then the rest of ``timeout_s``."""
    first = min(timeout_s, tp.wait_notice_s())
    raw = _poll(kv, key, first, gone=_exiting_key(peer))
    if raw is None and timeout_s > first:
        sys.stderr.write(
            f"multimesh: {notice.format(s=first)} Waiting up to {timeout_s:.0f} s "
            "(MULTIMESH_PLAN_TIMEOUT).\n"
        )
        sys.stderr.flush()
        raw = _poll(kv, key, timeout_s - first, gone=_exiting_key(peer))
    return raw


def _exiting_key(process: int) -> str:
    from multimesh.distributed._host import exiting_key

    return exiting_key(process)


def _poll(kv: Any, key: str, timeout_s: float, gone: str | None = None) -> Any:
    """The value of ``key`` once another process sets it (``None`` after ``timeout_s``;
    ``_GONE`` once ``gone`` is set: that process is exiting), polled with short sleeps
    (at most 50 ms between tries; ``gone`` every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    wait = 0.0005
    next_gone = time.monotonic() + 0.25
    while True:
        try:
            return kv.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - not set yet (the runtime's NotFound error)
            now = time.monotonic()
            if now > deadline:
                return None
            if gone is not None and now > next_gone:
                next_gone = now + 0.25
                try:
                    kv.key_value_try_get(gone)
                    return _GONE
                except Exception:  # noqa: BLE001 - not exiting
                    pass
        time.sleep(wait)
        wait = min(wait * 2, 0.05)


class LayoutError(ValueError):
    """The processes' devices split a submesh in a way multi-process runs do not support."""


def check_layout(loc: Locality, targets: Sequence[Any]) -> None:
    """Supported: a process holds whole submeshes, or a submesh is split evenly over
    processes that hold no other submesh's devices. Anything else is a clear error."""
    for t in targets:
        devs = list(t.mesh.devices.flat)
        procs = loc.procs(devs)
        if len(procs) <= 1:
            continue
        counts = {p: sum(1 for d in devs if loc.owner[int(d.id)] == p) for p in procs}
        others = [
            (u.name, p)
            for u in targets
            if u is not t
            for p in loc.procs(u.mesh.devices.flat)
            if p in procs
        ]
        if len(set(counts.values())) > 1 or others:
            why = (
                f"uneven device counts per process {counts}"
                if len(set(counts.values())) > 1
                else f"process {others[0][1]} also holds devices of submesh {others[0][0]!r}"
            )
            raise LayoutError(
                f"unsupported multi-process layout: submesh {t.name!r} (devices "
                f"{[int(d.id) for d in devs]}) spans processes {sorted(procs)}: {why}. "
                "Give each process whole submeshes (e.g. --devices-per-process a multiple "
                "of the submesh size), or split a submesh evenly over processes that hold "
                "nothing else."
            )


def placeholder(shape: tuple[int, ...], sharding: Any, dtype: Any) -> jax.Array:
    """A global array with no shard on this process (it lives on other processes)."""
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


def transfer_step(
    items: Sequence[tuple[int, int, Any, int, int]],
    targets: Sequence[Any],
    slot_sh: dict[int, Any],
    loc: Locality,
    uid_base: Callable[[], Any],
    step_no: int,
) -> tuple[Callable[[list[Any], Sequence[Any]], None], dict[int, Any]]:
    """The run function of one transfer step (items: src slot, dst slot, aval, src
    stage, dst stage) on this process, and the destinations' shardings (by slot).
    ``slot_sh`` is only read (a compile job may run this while others fill it)."""
    dst_sh: dict[int, Any] = {}
    local_fast: list[tuple[int, int, Any]] = []
    local_slow: list[tuple[int, int, Any]] = []
    cross: list[dict[str, Any]] = []
    pairs: list[tp.Pair] = []
    for src, dst, aval, s, d in items:
        shape = tuple(aval.shape)
        ssh = slot_sh[src]
        dmesh = targets[d].mesh
        src_devs, dst_devs = list(targets[s].mesh.devices.flat), list(dmesh.devices.flat)
        dsh = tr.dst_sharding(ssh, dmesh, shape)
        if loc.only(src_devs) and loc.only(dst_devs):
            dst_sh[dst] = dsh
            same = tr.same_layout(ssh, dsh, shape) and not _is_key(aval)
            (local_fast if same else local_slow).append((src, dst, dsh))
            continue
        reshard = None
        if not tr.same_layout(ssh, dsh, shape) or _is_key(aval):
            # different layouts: replicate on both sides, then copy device to device
            rsh = NamedSharding(targets[s].mesh, PartitionSpec())
            dsh = NamedSharding(dmesh, PartitionSpec())
            if not _is_key(aval):
                with _compat.no_mesh_context():
                    reshard = (
                        jax.jit(lambda v: v, out_shardings=rsh)
                        .lower(jax.ShapeDtypeStruct(shape, aval.dtype, sharding=ssh))
                        .compile()
                    )
            ssh = rsh
        dst_sh[dst] = dsh
        if not (loc.has(src_devs) or loc.has(dst_devs)):
            continue  # neither end lives here
        if _is_key(aval):
            raise ValueError(
                "a PRNG key moves between submeshes in different processes; pass keys as "
                "uint32 key data (jax.random.key_data) or create them where they are used."
            )
        smap = ssh.devices_indices_map(shape)
        first = len(pairs)
        for dd in dst_devs:
            idx = dsh.devices_indices_map(shape)[dd]
            cands = [sd for sd in src_devs if smap[sd] == idx]
            same_proc = [sd for sd in cands if loc.owner[int(sd.id)] == loc.owner[int(dd.id)]]
            sd = same_proc[0] if same_proc else cands[dst_devs.index(dd) % len(cands)]
            piece_shape = tuple(len(range(*sl.indices(n))) for sl, n in zip(idx, shape))
            pairs.append(
                tp.Pair(
                    sd, dd, loc.owner[int(sd.id)], loc.owner[int(dd.id)], piece_shape, aval.dtype
                )
            )
        cross.append(
            {
                "src": src,
                "dst": dst,
                "pairs": range(first, len(pairs)),
                "reshard": reshard,
                "src_local": loc.has(src_devs),
                "dst_local": loc.has(dst_devs),
                "dsh": dsh,
                "shape": shape,
                "dtype": aval.dtype,
            }
        )
    copy = _compat.same_layout_copy
    transport = tp.get_transport() if cross else None
    me = loc.me

    def run(env: list[Any], args: Sequence[Any]) -> None:
        if local_fast:
            outs = copy([env[s] for s, _d, _sh in local_fast], [sh for *_x, sh in local_fast])
            for (_s, d, _sh), v in zip(local_fast, outs):
                env[d] = v
        if local_slow:
            outs = jax.device_put(
                [env[s] for s, _d, _sh in local_slow], [sh for *_x, sh in local_slow]
            )
            for (_s, d, _sh), v in zip(local_slow, outs):
                env[d] = v
        if not cross:
            return
        outgoing: dict[int, jax.Array] = {}
        local: dict[int, jax.Array] = {}
        for c in cross:
            if not c["src_local"]:
                continue
            x = env[c["src"]]
            if c["reshard"] is not None:
                x = c["reshard"](x)
            by_dev = {int(next(iter(a.devices())).id): a for a in _compat.single_device_arrays(x)}
            for i in c["pairs"]:
                p = pairs[i]
                if p.src_proc != me:
                    continue
                piece = by_dev[int(p.src.id)]
                if p.dst_proc == me:
                    local[i] = jax.device_put(piece, p.dst)
                else:
                    outgoing[i] = piece
        got = transport.exchange((uid_base(), step_no), me, pairs, outgoing)
        got.update(local)
        for c in cross:
            if not c["dst_local"]:
                env[c["dst"]] = placeholder(c["shape"], c["dsh"], c["dtype"])
                continue
            mine = [i for i in c["pairs"] if pairs[i].dst_proc == me]
            order = {d: k for k, d in enumerate(_compat.addressable_device_ids(c["dsh"]))}
            mine.sort(key=lambda i: order[int(pairs[i].dst.id)])
            env[c["dst"]] = jax.make_array_from_single_device_arrays(
                c["shape"], c["dsh"], [got[i] for i in mine]
            )

    return run, dst_sh


def _is_key(aval: Any) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
