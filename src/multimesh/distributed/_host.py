"""``to_host``: numpy values on any process, wherever the arrays live.

An output of ``mm.jit`` may live on another process's devices. ``to_host`` asks the
processes that hold its shards for them over a small TCP service each process runs in a
thread of its own (its address is published once in ``jax.distributed``'s key-value
store). It needs no collective and nothing from the other processes' main threads, so it
works when only one process calls it (e.g. ``if jax.process_index() == 0: print(...)``),
even while the others wait in a collective. Each process keeps the outputs of its most
recent calls for this.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import queue
import socket
import socketserver
import sys
import threading
import time
import weakref
from typing import Any

import jax
import numpy as np

from multimesh import _compat

_compat.register_exclusion(__file__)

_KEEP_CALLS = 16  # outputs of this many recent calls per program can be fetched
_KEEP_PROGRAMS = 64  # ... of at most this many programs' worth of calls in all
_LOCK = threading.Lock()
_RECENT: collections.OrderedDict[str, list[jax.Array]] = collections.OrderedDict()
_GID: dict[int, str] = {}
_SERVICE: dict[str, Any] = {}
_PEERS: dict[int, tuple[str, int]] = {}
_LATEST: dict[str, int] = {}  # program -> latest call registered here
_FAILED: dict[str, str] = {}  # "program:call" -> the error of a call that failed here


def register(arrays: list[jax.Array], program: int, call: int) -> None:
    """Remember a call's outputs (multi-process runs) so other processes can fetch them."""
    with _LOCK:
        key = f"{program}:{call}"
        _RECENT[key] = arrays
        _LATEST[str(program)] = max(call, _LATEST.get(str(program), 0))
        # per program (as the error says): another program's calls must not push out
        # the outputs a slower process is still fetching
        old = f"{program}:{call - _KEEP_CALLS}"
        _RECENT.pop(old, None)
        while len(_RECENT) > _KEEP_CALLS * _KEEP_PROGRAMS:
            _RECENT.popitem(last=False)
        for k, a in enumerate(arrays):
            if isinstance(a, jax.Array):
                _GID[id(a)] = f"{key}:{k}"
                weakref.finalize(a, _GID.pop, id(a), None)
    ensure_service()


def note_failed(program: int, call: int, error: str) -> None:
    """A call failed on this process: a peer asking for its outputs gets ``error``."""
    with _LOCK:
        _FAILED[f"{program}:{call}"] = error
        while len(_FAILED) > _KEEP_CALLS * _KEEP_PROGRAMS:
            _FAILED.pop(next(iter(_FAILED)))


def _lookup(gid: str) -> jax.Array | None:
    key, _, k = gid.rpartition(":")
    with _LOCK:
        arrays = _RECENT.get(key)
    return arrays[int(k)] if arrays is not None and int(k) < len(arrays) else None


def _kv() -> Any:
    from multimesh.runtime.transport import kv_client

    return kv_client()


def _local_ip() -> str:
    """This host's address as the coordinator sees it (the interface that reaches it)."""
    from multimesh import _compat

    coord = getattr(_compat.distributed_state(), "coordinator_address", None) or "127.0.0.1:0"
    host = coord.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def ensure_service() -> None:
    """A small TCP server per process answering ``to_host`` requests for its outputs.
    It runs in its own thread and needs nothing from the main thread or from JAX's
    coordination service, so it answers even while this process waits in a collective
    (e.g. a checkpoint barrier)."""
    if _SERVICE.get("server") is not None or jax.process_count() == 1:
        return
    server = _PooledServer((_local_ip(), 0), _Handler)
    t = threading.Thread(target=server.serve_forever, name="multimesh-to-host", daemon=True)
    t.start()
    _SERVICE["server"] = server
    host, port = server.server_address[:2]
    _kv().key_value_set(f"multimesh/host/{jax.process_index()}", f"{host}:{port}")

    def _stop() -> None:
        """At exit (before jax.distributed shuts down: atexit runs last-in first), keep
        answering until every process is done, so a late to_host elsewhere still works."""
        from multimesh import _compat

        failed = _compat.settle_effects()
        if failed is not None:  # JAX's exit would raise it, skip its shutdown: peers abort
            from multimesh.runtime.crossproc import error_summary

            sys.stderr.write(
                f"multimesh: a callback of this process's computations failed: "
                f"{error_summary(failed)}\n"
            )
        mark_exiting()
        why = None
        try:
            from multimesh.runtime import crossproc

            kv = _kv()
            me = jax.process_index()
            kv.key_value_set(f"multimesh/final/{me}", json.dumps(crossproc.state()))
            kv.key_value_set(f"multimesh/done/{me}", "1")
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if len(kv.key_value_dir_get("multimesh/done/")) >= jax.process_count():
                    break
                time.sleep(0.01)
            why = _final_check(kv)
        except Exception:  # noqa: BLE001 - the job is already going down
            pass
        server.shutdown()
        server.server_close()
        if why is not None:
            sys.stderr.write(f"multimesh: {why}. {crossproc.DIVERGED_HINT}\n")
            exit_now(1)

    atexit.register(_stop)
    fail_fast()


def exiting_key(process: int) -> str:
    """Set by a process when it starts to exit (its exit handlers run): others waiting
    for it (``crossproc.check_same_plan``) stop waiting and say so."""
    return f"multimesh/exiting/{process}"


def mark_exiting(own_work_s: float = 30.0) -> None:
    """Tell the other processes that this one is exiting, once its own pending work is
    done (at most ``own_work_s``): a script may end with pulls from a peer still in
    flight, and the peer may be waiting on a long computation whose result is for this
    process; marked too early, that peer would take it for a process that left."""
    if _SERVICE.get("exiting"):
        return
    _SERVICE["exiting"] = True
    deadline = time.monotonic() + own_work_s
    try:
        for a in jax.live_arrays():
            while not a.is_ready() and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    try:
        _kv().key_value_set(exiting_key(jax.process_index()), "1")
    except Exception:  # noqa: BLE001 - the job is already going down
        pass


def _final_check(kv: Any) -> str | None:
    """Once every process is done: whether a peer made other mm.jit calls than this
    one (its final ``crossproc.state()``), which pairs calls with other calls' values
    where nothing waits (a program whose transfers all go one way)."""
    from multimesh.runtime import crossproc

    for p in sorted(crossproc.group_peers()):
        try:
            raw = kv.key_value_try_get(f"multimesh/final/{p}")
        except Exception:  # noqa: BLE001 - it did not get this far: nothing to compare
            continue
        why = crossproc.final_divergence(p, json.loads(raw))
        if why is not None:
            return why
    return None


def fail_fast() -> None:
    """Multi-process runs: a process dying of an uncaught exception prints it and exits
    at once, skipping exit handlers that wait for the other processes (this service's,
    ``jax.distributed``'s shutdown barrier), which wait on it in turn: minutes of a job
    that cannot finish. The launcher (or SLURM, mpirun) then stops the others."""
    if _SERVICE.get("fail_fast") or jax.process_count() == 1:
        return
    _SERVICE["fail_fast"] = True
    # sys.exit / a normal return while others still wait for this process's plan
    atexit.register(mark_exiting)
    hook = sys.excepthook

    def excepthook(*exc: Any) -> None:
        try:
            hook(*exc)
        finally:
            exit_now()

    sys.excepthook = excepthook


def exit_now(code: int = 1) -> None:
    """Flush the output and end this process at once, skipping exit handlers that would
    wait for other processes (which wait on this one)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(code)


class _PooledServer(socketserver.TCPServer):
    """A TCP server whose requests are handled by a few threads started up front: a
    request may wait for a call to finish, and Python >= 3.12 cannot start threads
    while the interpreter shuts down (when ``_stop`` still answers late requests)."""

    allow_reuse_address = True
    workers = 4

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        super().__init__(address, handler)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for n in range(self.workers):
            threading.Thread(target=self._work, name=f"multimesh-to-host-{n}", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self._queue.put((request, client_address))

    def _work(self) -> None:
        while True:
            request, client_address = self._queue.get()
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - the asking process sees the closed socket
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)


class _Handler(socketserver.StreamRequestHandler):
    """One request: a line with an output id; the reply: a JSON header line (index of
    each unique shard, dtype) and the shards' bytes."""

    def handle(self) -> None:
        gid = self.rfile.readline().decode().strip()
        if gid == _STATE_REQUEST:  # a peer waiting for this process: what it did
            from multimesh.runtime import crossproc

            self.wfile.write(json.dumps(crossproc.state()).encode() + b"\n")
            return
        program, call, _k = gid.split(":")
        deadline = time.monotonic() + 300
        while True:  # a request may arrive before this process finished that call
            with _LOCK:
                latest = _LATEST.get(program, -1)
                failed = _FAILED.get(f"{program}:{call}")
            if failed is not None:
                self.wfile.write(json.dumps({"error": "failed", "why": failed}).encode() + b"\n")
                return
            if int(call) <= latest or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        arr = _lookup(gid)
        if arr is None:
            self.wfile.write(json.dumps({"error": "expired"}).encode() + b"\n")
            return
        if jax.dtypes.issubdtype(arr.dtype, jax.dtypes.extended):
            arr = jax.random.key_data(arr)  # a PRNG key: its key data
        index, blobs = [], []
        seen: set[tuple] = set()
        try:
            for sh in arr.addressable_shards:
                idx = tuple(
                    (s.start or 0, s.stop if s.stop is not None else n)
                    for s, n in zip(sh.index, arr.shape)
                )
                if idx in seen:
                    continue
                seen.add(idx)
                data = np.ascontiguousarray(np.asarray(sh.data))
                index.append(idx)
                blobs.append(data.tobytes())
        except Exception as e:  # noqa: BLE001 - the work making it failed (after the call)
            from multimesh.runtime.crossproc import explain

            why = explain(e)[0]
            self.wfile.write(json.dumps({"error": "failed", "why": why}).encode() + b"\n")
            return
        head = {"index": index, "dtype": np.dtype(arr.dtype).str, "sizes": [len(b) for b in blobs]}
        self.wfile.write(json.dumps(head).encode() + b"\n")
        for b in blobs:
            self.wfile.write(b)


_STATE_REQUEST = "?state"


def peer_state(q: int, timeout_s: float = 2.0) -> dict[str, list[Any]] | None:
    """Process ``q``'s ``crossproc.state()`` (its calls per group of processes), asked
    from its service; ``None`` if it has none yet or does not answer in ``timeout_s``."""
    addr = _PEERS.get(q)
    try:
        if addr is None:
            host, port = _kv().key_value_try_get(f"multimesh/host/{q}").rsplit(":", 1)
            addr = _PEERS[q] = (host, int(port))
        with socket.create_connection(addr, timeout=timeout_s) as conn:
            conn.sendall(_STATE_REQUEST.encode() + b"\n")
            line = conn.makefile("rb").readline()
        return json.loads(line) if line else None
    except Exception:  # noqa: BLE001 - not started yet, gone, or slow: nothing known
        return None


def _peer(q: int) -> tuple[str, int]:
    addr = _PEERS.get(q)
    if addr is None:
        text = _kv().blocking_key_value_get(f"multimesh/host/{q}", 300_000)
        host, port = text.rsplit(":", 1)
        addr = _PEERS[q] = (host, int(port))
    return addr


def _fetch(x: jax.Array, gid: str | None = None) -> np.ndarray:
    me = jax.process_index()
    out = np.empty(x.shape, dtype=x.dtype)
    filled = np.zeros(x.shape, dtype=bool)
    for sh in x.addressable_shards:
        out[sh.index] = np.asarray(sh.data)
        filled[sh.index] = True
    if filled.all():  # e.g. replicated over every process: the local copy is the value
        return out
    gid = gid or _GID.get(id(x))
    if gid is None:
        raise ValueError(
            "mm.distributed.to_host: this array lives (partly) on other processes and was "
            "not returned by an mm.jit call (only those are served to other processes). "
            "Pass it through one, e.g. mm.jit(lambda t: t, mesh=mmesh)(tree) on every "
            "process, then call to_host on its result."
        )
    owners = sorted({d.process_index for d in x.sharding.device_set} - {me})
    for q in owners:
        if filled.all():
            break
        try:
            _fetch_from(q, gid, out, filled)
        except (OSError, json.JSONDecodeError) as e:  # reset, refused, cut short
            raise RuntimeError(_closed(q) + f": {type(e).__name__}: {e}") from None
    return out


def _closed(q: int) -> str:
    return (
        f"mm.distributed.to_host: process {q} closed the connection without answering "
        "(did it fail or exit? see its log)"
    )


def _fetch_from(q: int, gid: str, out: np.ndarray, filled: np.ndarray) -> None:
    """Read process ``q``'s pieces of output ``gid`` into ``out``."""
    with socket.create_connection(_peer(q), timeout=330) as conn:
        conn.sendall(gid.encode() + b"\n")
        f = conn.makefile("rb")
        line = f.readline()
        if not line:
            raise RuntimeError(_closed(q))
        head = json.loads(line)
        if head.get("error") == "failed":
            raise RuntimeError(
                f"mm.distributed.to_host: the mm.jit call that made this output failed on "
                f"process {q}, which holds (part of) it: {head['why']}"
            )
        if "error" in head:
            raise RuntimeError(
                f"mm.distributed.to_host: process {q} no longer holds this output (it "
                f"keeps the outputs of its last {_KEEP_CALLS} calls per program); fetch "
                "it sooner."
            )
        for idx, size in zip(head["index"], head["sizes"]):
            sl = tuple(slice(a, b) for a, b in idx)
            data = f.read(size)
            if len(data) != size:  # the peer went away mid-reply
                raise RuntimeError(
                    _closed(q) + f": got {len(data)} of {size} bytes of a piece"
                )
            shape = tuple(b - a for a, b in idx)
            out[sl] = np.frombuffer(data, dtype=np.dtype(head["dtype"])).reshape(shape)
            filled[sl] = True


def to_host(tree: Any) -> Any:
    """The numpy value of every array in ``tree``, on this process, wherever the arrays
    live (other processes' submeshes included). Needs no call on the other processes."""

    def conv(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        gid = _GID.get(id(x))  # a PRNG key: served as its key data under the key's id
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            x = jax.random.key_data(x)
        try:
            if x.is_fully_addressable:
                return np.asarray(x)
            return _fetch(x, gid)
        except Exception as e:
            if jax.process_count() > 1:  # a peer that failed or stopped first says why
                from multimesh.runtime.crossproc import explain

                explain(e)
            raise

    return jax.tree.map(conv, tree)
