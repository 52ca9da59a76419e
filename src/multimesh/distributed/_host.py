"""``to_host``: numpy values on any process, wherever the arrays live.

An output of ``mm.jit`` may live on another process's devices. ``to_host`` asks the
processes that hold its shards for them: each process runs a small service thread that
answers requests (posted in ``jax.distributed``'s key-value store) by offering the
shards on its transfer server, and the caller pulls them. It needs no collective, so it
works when only one process calls it (e.g. ``if jax.process_index() == 0: print(...)``).
Each process keeps the outputs of its most recent calls for this.
"""

from __future__ import annotations

import atexit
import collections
import json
import threading
import time
import weakref
from typing import Any

import jax
import numpy as np

from multimesh import _compat

_compat.register_exclusion(__file__)

_KEEP_CALLS = 16  # outputs of this many recent calls per program can be fetched
_LOCK = threading.Lock()
_RECENT: collections.OrderedDict[str, list[jax.Array]] = collections.OrderedDict()
_GID: dict[int, str] = {}
_SERVICE: dict[str, Any] = {}
_COUNTER = [0]
_LATEST: dict[str, int] = {}  # program -> latest call registered here


def register(arrays: list[jax.Array], program: int, call: int) -> None:
    """Remember a call's outputs (multi-process runs) so other processes can fetch them."""
    with _LOCK:
        key = f"{program}:{call}"
        _RECENT[key] = arrays
        _LATEST[str(program)] = max(call, _LATEST.get(str(program), 0))
        while len(_RECENT) > _KEEP_CALLS:
            _RECENT.popitem(last=False)
        for k, a in enumerate(arrays):
            if isinstance(a, jax.Array):
                _GID[id(a)] = f"{key}:{k}"
                weakref.finalize(a, _GID.pop, id(a), None)
    _ensure_service()


def _lookup(gid: str) -> jax.Array | None:
    key, _, k = gid.rpartition(":")
    with _LOCK:
        arrays = _RECENT.get(key)
    return arrays[int(k)] if arrays is not None and int(k) < len(arrays) else None


def _kv() -> Any:
    from multimesh.runtime.transport import _kv_client

    return _kv_client()


def _server() -> Any:
    from multimesh.runtime.transport import _TRANSPORT, ServerTransport

    with _LOCK:
        t = _TRANSPORT.get("server")
        if t is None:
            t = _TRANSPORT["server"] = ServerTransport()
    return t


def _ensure_service() -> None:
    if _SERVICE.get("thread") is not None or jax.process_count() == 1:
        return
    _server()  # publish this process's transfer server address
    stop = threading.Event()
    t = threading.Thread(target=_serve, args=(stop,), name="multimesh-to-host", daemon=True)
    _SERVICE["thread"] = t
    t.start()

    def _stop() -> None:
        """At exit (before jax.distributed shuts down: atexit runs last-in first), keep
        answering until every process is done, so a late to_host elsewhere still works."""
        try:
            kv = _kv()
            kv.key_value_set(f"multimesh/done/{jax.process_index()}", "1")
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if len(kv.key_value_dir_get("multimesh/done/")) >= jax.process_count():
                    break
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - the job is already going down
            pass
        stop.set()
        t.join(timeout=5)

    atexit.register(_stop)


def _serve(stop: threading.Event) -> None:
    me = jax.process_index()
    kv = _kv()
    prefix = f"multimesh/fetch/{me}/"
    seen: set[str] = set()
    while not stop.is_set():
        try:
            reqs = kv.key_value_dir_get(prefix)
        except Exception:  # noqa: BLE001 - the job is shutting down
            return
        for key, gid in reqs:
            if key in seen:
                continue
            program, call, _k = gid.split(":")
            with _LOCK:
                latest = _LATEST.get(program, -1)
            if int(call) > latest:
                continue  # this process has not finished that call yet: answer later
            seen.add(key)
            tag = key[len("multimesh/fetch/") :]  # "{owner}/{requester}-{n}"
            _answer(kv, tag, gid)
        time.sleep(0.002)


def _answer(kv: Any, tag: str, gid: str) -> None:
    arr = _lookup(gid)
    if arr is None:
        kv.key_value_set(f"multimesh/fetched/{tag}", json.dumps({"error": "expired"}))
        return
    pieces, index = [], []
    have: set[tuple] = set()
    for sh in arr.addressable_shards:
        idx = tuple(
            (s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(sh.index, arr.shape)
        )
        if idx in have:
            continue
        have.add(idx)
        pieces.append(sh.data)
        index.append(idx)
    _server().offer(_compat.stable_hash(f"fetch/{tag}") >> 2, pieces)
    kv.key_value_set(f"multimesh/fetched/{tag}", json.dumps({"index": index}))


def _fetch(x: jax.Array) -> np.ndarray:
    gid = _GID.get(id(x))
    if gid is None:
        raise ValueError(
            "mm.distributed.to_host: this array lives (partly) on other processes and was "
            "not returned by an mm.jit call; use jax.experimental.multihost_utils."
            "process_allgather (called on every process) for other arrays."
        )
    me = jax.process_index()
    out = np.empty(x.shape, dtype=x.dtype)
    filled = np.zeros(x.shape, dtype=bool) if x.size else None
    for sh in x.addressable_shards:
        out[sh.index] = np.asarray(sh.data)
        if filled is not None:
            filled[sh.index] = True
    owners = sorted({d.process_index for d in x.sharding.device_set} - {me})
    kv = _kv()
    dev = jax.local_devices()[0]
    for q in owners:
        if filled is not None and filled.all():
            break
        with _LOCK:
            _COUNTER[0] += 1
            tag = f"{q}/{me}-{_COUNTER[0]}"
        kv.key_value_set(f"multimesh/fetch/{tag}", gid)
        reply = json.loads(kv.blocking_key_value_get(f"multimesh/fetched/{tag}", 120_000))
        if "error" in reply:
            raise RuntimeError(
                f"mm.distributed.to_host: process {q} no longer holds this output (it keeps "
                f"the outputs of its last {_KEEP_CALLS} calls per program); fetch it sooner."
            )
        specs = [
            jax.ShapeDtypeStruct(
                tuple(b - a for a, b in idx),
                x.dtype,
                sharding=jax.sharding.SingleDeviceSharding(dev),
            )
            for idx in reply["index"]
        ]
        got = _server().pull(_compat.stable_hash(f"fetch/{tag}") >> 2, q, specs)
        for idx, piece in zip(reply["index"], got):
            sl = tuple(slice(a, b) for a, b in idx)
            out[sl] = np.asarray(piece)
            if filled is not None:
                filled[sl] = True
    return out


def to_host(tree: Any) -> Any:
    """The numpy value of every array in ``tree``, on this process, wherever the arrays
    live (other processes' submeshes included). Needs no call on the other processes."""

    def conv(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            x = jax.random.key_data(x)
        if x.is_fully_addressable:
            return np.asarray(x)
        return _fetch(x)

    return jax.tree.map(conv, tree)
