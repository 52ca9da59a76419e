"""Transports: how one process's device buffers reach another process's devices.

One small interface, two implementations on public JAX APIs:

- ``server`` (default): ``jax.experimental.transfer``. Each process runs a transfer
  server; the sender offers arrays under an id, the receiver pulls them by that id. No
  shared call order is needed, and a dead peer surfaces as an exception.
- ``ppermute``: a jitted ``shard_map`` + ``lax.ppermute`` over a 2-device mesh of the
  source and destination device (gloo on CPU, NCCL on GPU). Only the two endpoints call
  it, in the plan's order.

Ids are derived from the plan (program, call number, step), so every process computes
the same ids without talking. Select with ``MULTIMESH_TRANSPORT=server|ppermute`` or
:func:`set_transport`.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import dataclasses
import hashlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh import _compat

_compat.register_exclusion(__file__)

_LOCK = threading.Lock()
_TRANSPORT: dict[str, Any] = {}


def transfer_id(*parts: Any) -> int:
    """A 62-bit id every process derives the same way from the same parts."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclasses.dataclass(frozen=True)
class Pair:
    """One single-device buffer moving from ``src`` (on process ``src_proc``) to ``dst``."""

    src: Any
    dst: Any
    src_proc: int
    dst_proc: int
    shape: tuple[int, ...]
    dtype: Any


class Transport(abc.ABC):
    """Moves single-device buffers between processes."""

    name: str = "transport"

    @abc.abstractmethod
    def exchange(
        self, uid: int, me: int, pairs: list[Pair], outgoing: dict[int, jax.Array]
    ) -> dict[int, jax.Array]:
        """Every process involved in ``pairs`` (one transfer step, in the same order on
        all processes) calls this; ``outgoing[i]`` is pair ``i``'s buffer where this
        process is its source. Returns pair index -> buffer where it is the destination."""


class ServerTransport(Transport):
    """``jax.experimental.transfer``: offer by id, pull by id (one round trip per pair of
    processes per step)."""

    name = "server"

    def __init__(self) -> None:
        from jax.experimental import transfer

        client = jax.local_devices()[0].client
        self._server = transfer.start_transfer_server(client, "127.0.0.1:0", ["127.0.0.1:0"])
        self._kv = kv_client()
        self._me = jax.process_index()
        self._kv.key_value_set(f"multimesh/transfer/{self._me}", self._server.address())
        self._conns: dict[int, Any] = {}

    def _conn(self, peer: int) -> Any:
        conn = self._conns.get(peer)
        if conn is None:
            addr = self._kv.blocking_key_value_get(f"multimesh/transfer/{peer}", 300_000)
            conn = self._conns[peer] = self._server.connect(addr)
        return conn

    def offer(self, uid: int, arrays: list[jax.Array], peer: int) -> None:
        # Offer only computed buffers: a pull of a buffer still being computed holds one
        # of the transfer server's threads until it is ready, and when those threads all
        # wait on computations that need another pull to arrive, every process stalls
        # (seen at 8 processes x 1 device on 2 cores, 1F1B and zero-bubble: ~40% of runs;
        # 0 of 6 with this wait). The cost: this process's host waits for its own sends.
        with _WATCH.waiting_for(peer):
            jax.block_until_ready(arrays)
        self._server.await_pull(uid, arrays)

    def pull(self, uid: int, peer: int, specs: list[jax.ShapeDtypeStruct]) -> list[jax.Array]:
        return list(self._conn(peer).pull(uid, specs))

    def exchange(
        self, uid: int, me: int, pairs: list[Pair], outgoing: dict[int, jax.Array]
    ) -> dict[int, jax.Array]:
        sends: dict[int, list[int]] = {}
        recvs: dict[int, list[int]] = {}
        for i, p in enumerate(pairs):
            if p.src_proc == me and p.dst_proc != me:
                sends.setdefault(p.dst_proc, []).append(i)
            elif p.dst_proc == me and p.src_proc != me:
                recvs.setdefault(p.src_proc, []).append(i)
        for peer, idx in sorted(sends.items()):
            self.offer(transfer_id(uid, me, peer), [outgoing[i] for i in idx], peer)
        got: dict[int, jax.Array] = {}
        for peer, idx in sorted(recvs.items()):
            specs = [
                jax.ShapeDtypeStruct(pairs[i].shape, pairs[i].dtype, sharding=_single(pairs[i].dst))
                for i in idx
            ]
            for i, arr in zip(idx, self.pull(transfer_id(uid, peer, me), peer, specs)):
                got[i] = arr
        return got


class PpermuteTransport(Transport):
    """A 2-device ``shard_map`` + ``ppermute`` per buffer, called by both endpoints in
    the step's pair order."""

    name = "ppermute"

    def __init__(self) -> None:
        self._fns: dict[Any, Any] = {}

    def _fn(self, src: Any, dst: Any, shape: tuple[int, ...], dtype: Any) -> tuple[Any, Any]:
        key = (src.id, dst.id, shape, str(dtype))
        hit = self._fns.get(key)
        if hit is None:
            mesh = Mesh(np.array([src, dst]), ("mm_pair",))
            sh = NamedSharding(mesh, PartitionSpec("mm_pair"))

            def move(x: Any) -> Any:
                return jax.lax.ppermute(x, "mm_pair", [(0, 1)])

            mapped = jax.shard_map(
                move,
                mesh=mesh,
                in_specs=PartitionSpec("mm_pair"),
                out_specs=PartitionSpec("mm_pair"),
            )
            hit = self._fns[key] = (jax.jit(mapped, in_shardings=sh, out_shardings=sh), sh)
        return hit

    def exchange(
        self, uid: int, me: int, pairs: list[Pair], outgoing: dict[int, jax.Array]
    ) -> dict[int, jax.Array]:
        got: dict[int, jax.Array] = {}
        for i, p in enumerate(pairs):
            if me not in (p.src_proc, p.dst_proc) or p.src_proc == p.dst_proc:
                continue
            fn, sh = self._fn(p.src, p.dst, p.shape, p.dtype)
            if p.src_proc == me:
                piece = outgoing[i]
            else:
                piece = jax.device_put(np.zeros(p.shape, p.dtype), p.dst)
            res = fn(jax.make_array_from_single_device_arrays((2, *p.shape), sh, [piece[None]]))
            if p.dst_proc == me:
                got[i] = res.addressable_shards[0].data.reshape(p.shape)
        return got


class _Watch:
    """Waits for a peer, watched by a daemon thread. An offer to a peer first waits for
    this process's own work (``offer``), and that work may need data from the peer: if
    the peer exited (``sys.exit``, an error in its exit path, or it skipped an mm.jit
    call and reached its end) the wait would last forever inside XLA. The thread ends
    this process with a message naming the peer instead: 10 s after the peer marked
    itself exiting (which it does once its own pending work is done, or after 30 s:
    ``_host.mark_exiting``), or after ``MULTIMESH_PLAN_TIMEOUT`` (default 1800 s) in one
    wait. A wait longer than ``MULTIMESH_WAIT_NOTICE`` (default 60 s) is named on stderr
    once (a peer making other mm.jit calls, or the same in another order, waits too).
    The launcher (or SLURM, mpirun) then stops the others."""

    GRACE_S = 10.0
    POLL_S = 0.5

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[int, tuple[float, int]] = {}  # thread id -> (since, peer)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def waiting_for(self, peer: int) -> Iterator[None]:
        me = threading.get_ident()
        with self._lock:
            self._waits[me] = (time.monotonic(), peer)
            self._start()
        try:
            yield
        finally:
            with self._lock:
                self._waits.pop(me, None)

    def start(self) -> None:
        """Watch from now on (a process that ran a call over several processes: its
        peers' calls are compared with its own every ``PEERS_EVERY_S``, waiting or not,
        since it may be stuck inside XLA, out of any wait this class sees)."""
        if self._thread is None:
            with self._lock:
                self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="multimesh-peer-watch", daemon=True
            )
            self._thread.start()
            # stopped at exit, before the interpreter finalizes: a daemon thread caught
            # inside the runtime's C++ (a key-value get) then aborts the process
            # ("FATAL: exception not rethrown"). Registered first, it runs after the
            # exit handlers registered later (to_host's, which waits for the peers)
            atexit.register(self.stop)

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the watch thread (at exit)."""
        self._stopping.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    def _run(self) -> None:
        from multimesh.runtime import crossproc

        exiting_since: dict[int, float] = {}
        noticed: set[tuple[float, int]] = set()
        seen: dict[int, str] = {}  # peer -> the other calls its last check found
        next_all = time.monotonic() + self.PEERS_EVERY_S
        while not self._stopping.wait(self.POLL_S):
            now = time.monotonic()
            with self._lock:
                waits = list(self._waits.values())
            noticed &= set(waits)
            # peers waited on for a while, every peer now and then, and again any peer
            # whose last check found other calls (an error once found twice in a row)
            peers = {peer for since, peer in waits if now - since > self.CHECK_AFTER_S}
            peers |= set(seen)
            if now > next_all:
                next_all = now + self.PEERS_EVERY_S
                peers |= crossproc.group_peers()
                found = crossproc.owed_by_failed_peer()
                if found is not None:
                    crossproc.note_stopping(found[1])  # those waiting on this one in turn
                    _die(f"{found[0]}.")
            if peers:
                try:
                    self._check_peers(peers, seen)
                except Exception:  # noqa: BLE001 - a peer's odd answer: keep watching
                    seen.clear()
            notice = wait_notice_s()
            for since, peer in waits:
                if now - since > notice and (since, peer) not in noticed:
                    noticed.add((since, peer))
                    sys.stderr.write(
                        f"multimesh: process {jax.process_index()} has waited "
                        f"{now - since:.0f} s on work whose result goes to process {peer}; "
                        "every process must make the same mm.jit calls in the same order "
                        "(a peer busy compiling or loading data also takes this long). "
                        "Waiting up to MULTIMESH_PLAN_TIMEOUT.\n"
                    )
                    sys.stderr.flush()
                if peer not in exiting_since and _exiting(peer):
                    exiting_since[peer] = now
                if now - max(since, exiting_since.get(peer, now)) > self.GRACE_S:
                    _die(
                        f"process {peer} exited (sys.exit, an error, or it skipped an mm.jit "
                        f"call) while process {jax.process_index()} still has data for it; "
                        "every process must make the same mm.jit calls."
                    )
                timeout = float(os.environ.get("MULTIMESH_PLAN_TIMEOUT", "1800"))
                if now - since > timeout:
                    _die(
                        f"process {jax.process_index()} waited {now - since:.0f} s on work "
                        f"whose result goes to process {peer} (MULTIMESH_PLAN_TIMEOUT): is a "
                        "process stuck, or making other mm.jit calls than this one?"
                    )


    CHECK_AFTER_S = 5.0
    PEERS_EVERY_S = 5.0

    def _check_peers(self, peers: set[int], seen: dict[int, str]) -> None:
        """Ask ``peers`` what they did: one that made other mm.jit calls (a new argument
        shape there, or other functions) will never send what this process waits for,
        nor take what it sends. Found twice in a row (the second check follows the first
        within a second), it ends this process with what differs, instead of waiting out
        the timeout or going on with values paired with another call's."""
        from multimesh.distributed import _host
        from multimesh.runtime import crossproc

        for peer in sorted(peers):
            why = crossproc.divergence(peer, _host.peer_state(peer))
            if why is None:
                seen.pop(peer, None)
            elif seen.get(peer) == why:
                _die(f"{why}. {crossproc.DIVERGED_HINT}")
            else:
                seen[peer] = why


def watch_calls() -> None:
    """Compare this process's calls with its peers' from now on (``_Watch.start``)."""
    _WATCH.start()


def wait_notice_s() -> float:
    """After how long a wait for another process is worth a word on stderr
    (``MULTIMESH_WAIT_NOTICE``, default 60 s): a peer that skipped a call, or makes its
    calls in another order, cannot be told from a slow one until the timeout."""
    return float(os.environ.get("MULTIMESH_WAIT_NOTICE", "60"))


def _exiting(peer: int) -> bool:
    from multimesh.distributed._host import exiting_key

    try:
        kv_client().key_value_try_get(exiting_key(peer))
        return True
    except Exception:  # noqa: BLE001 - not set (or the job is going down)
        return False


def _die(msg: str) -> None:
    from multimesh.distributed._host import exit_now

    sys.stderr.write(f"multimesh: {msg} Stopping this process.\n")
    exit_now()


_WATCH = _Watch()


def _single(device: Any) -> Any:
    return _compat.single_device_sharding(device)


def kv_client() -> Any:
    client = _compat.distributed_state().client
    if client is None:
        raise RuntimeError(
            "multi-process MultiMesh needs jax.distributed: call mm.distributed.initialize() "
            "(or jax.distributed.initialize()) first."
        )
    return client


def set_transport(name: str) -> None:
    """Choose the cross-process transport: ``"server"`` or ``"ppermute"``."""
    if name not in ("server", "ppermute"):
        raise ValueError(f"unknown transport {name!r}; use 'server' or 'ppermute'.")
    with _LOCK:
        _TRANSPORT["choice"] = name


def get_transport() -> Transport:
    """The transport for this process (created on first use)."""
    with _LOCK:
        name = _TRANSPORT.get("choice") or os.environ.get("MULTIMESH_TRANSPORT", "server")
        t = _TRANSPORT.get(name)
        if t is None:
            if name == "server":
                t = ServerTransport()
            elif name == "ppermute":
                t = PpermuteTransport()
            else:
                raise ValueError(
                    f"MULTIMESH_TRANSPORT={name!r} is not a transport; use 'server' or 'ppermute'."
                )
            _TRANSPORT[name] = t
        return t
