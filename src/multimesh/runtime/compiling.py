"""Compile a plan's fragments in parallel, in plan order.

A fragment's input shardings are its producers' output shardings, which XLA decides
when it compiles them; so a fragment can only be lowered once its producers are
compiled. The executor walks the plan as before, but each fragment's compile (and each
transfer's sharding arithmetic) becomes a job on a small thread pool, and the shardings
it will produce are *pending* values that later jobs wait for. XLA compiles outside
the GIL, so independent fragments (other stages, forward and backward) compile at once.

Jobs only wait for jobs submitted before them and the pool takes jobs first in, first
out, so a job's dependencies are always running or done: no deadlock. An error is
raised from the first failing step in plan order, as a sequential compile would.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import gc
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import jax

from multimesh import _compat
from multimesh.arguments import spec_axes

_compat.register_exclusion(__file__)


def num_threads(share: int = 1) -> int:
    """Compile threads: ``MULTIMESH_COMPILE_THREADS``, else this process's share of the
    CPUs (their count over ``share``, the processes on this host; at most 8)."""
    env = os.environ.get("MULTIMESH_COMPILE_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(
                f"MULTIMESH_COMPILE_THREADS={env!r}: expected a whole number of threads"
            ) from None
        return max(1, n)
    return max(1, min(8, (os.cpu_count() or 1) // max(1, share)))


class Pending:
    """A value a compile job will produce (``get`` waits for it)."""

    __slots__ = ("_future", "_pick")

    def __init__(self, future: cf.Future, pick: Callable[[Any], Any] | None = None) -> None:
        self._future = future
        self._pick = pick

    def get(self) -> Any:
        v = self._future.result()
        return self._pick(v) if self._pick is not None else v

    def derive(self, pick: Callable[[Any], Any]) -> Pending:
        """A pending part of this value."""
        assert self._pick is None
        return Pending(self._future, pick)


def resolve(v: Any) -> Any:
    return v.get() if isinstance(v, Pending) else v


class LazyDict(dict):
    """A dict whose pending values are waited for when read."""

    def __getitem__(self, key: Any) -> Any:
        return resolve(super().__getitem__(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return resolve(super().get(key, default))

    def resolved(self) -> dict[Any, Any]:
        return {k: resolve(v) for k, v in self.items()}


class Jobs:
    """The compile jobs of one executor: run inline (one thread) or on a pool."""

    def __init__(self, threads: int) -> None:
        self._pool = cf.ThreadPoolExecutor(threads, "multimesh-compile") if threads > 1 else None
        self._futures: list[cf.Future] = []
        #: jobs run with the creating thread's JAX settings (jax.enable_x64(True), ...)
        self._with_config = _compat.caller_config() if self._pool is not None else None
        if self._pool is not None:  # an error while planning leaves no idle threads behind
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

    def submit(self, fn: Callable[[], Any]) -> Pending:
        if self._pool is None:
            fut: cf.Future = cf.Future()
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised by get(), in plan order
                fut.set_exception(e)
                raise
        else:
            fut = self._pool.submit(self._with_config(fn))
        self._futures.append(fut)
        return Pending(fut)

    def submit_after(self, dep: Pending, fn: Callable[[], Any]) -> Pending:
        """``fn`` as a job once ``dep``'s job is done, so that a job that would only wait
        for ``dep`` does not hold a compile thread meanwhile. No job may wait for the
        result (it is queued after jobs submitted later): only ``wait`` does."""
        if self._pool is None:
            return self.submit(fn)
        outer: cf.Future = cf.Future()

        def copy(inner: cf.Future) -> None:
            if inner.cancelled():
                outer.cancel()
            elif inner.exception() is not None:
                outer.set_exception(inner.exception())
            else:
                outer.set_result(inner.result())

        def go(_done: cf.Future) -> None:
            pool = self._pool
            try:
                if pool is None:
                    raise RuntimeError("compile jobs were closed")
                inner = pool.submit(self._with_config(fn))
            except RuntimeError as e:  # closed after an earlier job's error
                outer.set_exception(e)
                return
            inner.add_done_callback(copy)

        dep._future.add_done_callback(go)
        self._futures.append(outer)
        return Pending(outer)

    def wait(self) -> None:
        """Wait for every job; raise the first error in submission (plan) order."""
        try:
            for fut in self._futures:
                fut.result()
        finally:
            self.close()

    def close(self) -> None:
        # closed (None) first: cancelling a queued job runs the callbacks of jobs queued
        # after it (``submit_after``'s ``go``) in this thread, inside the executor's
        # shutdown lock; submitting from there would wait for that lock forever (a hang
        # after a compile error or Ctrl-C in the first call)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while tracing, planning and compiling.

    These allocate many long-lived objects (equations, variables, shardings), so the
    collector runs full passes over them again and again: 30-40% of the time of tracing
    and planning a pipeline (measured). Collection resumes on exit; a collector the
    caller had disabled stays disabled."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_WARN_LOCK = threading.Lock()
_WARN_STATE: list[Any] = [0, None]  # active compiles, the filters to restore


@contextlib.contextmanager
def quiet_unusable_donations() -> Iterator[None]:
    """Silence XLA's "donated buffers were not usable" while any fragment compiles (the
    executor donates its own intermediates where an output may reuse them). Warning
    filters are process-wide, so concurrent compiles share one installation."""
    with _WARN_LOCK:
        if _WARN_STATE[0] == 0:
            _WARN_STATE[1] = list(warnings.filters)
            warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        _WARN_STATE[0] += 1
    try:
        yield
    finally:
        with _WARN_LOCK:
            _WARN_STATE[0] -= 1
            if _WARN_STATE[0] == 0:
                warnings.filters[:] = _WARN_STATE[1]
                warnings._filters_mutated()  # type: ignore[attr-defined]


_CACHE_LOCK = threading.Lock()


def compile_once(cache: dict[Hashable, Any], key: Hashable, build: Callable[[], Any]) -> Any:
    """``cache[key]``, building it once even when several jobs want it at the same time
    (identical fragments, e.g. one stage's work for every microbatch)."""
    with _CACHE_LOCK:
        hit = cache.get(key)
        if hit is None:
            mine: cf.Future = cf.Future()
            cache[key] = mine
    if hit is not None:
        return hit.result() if isinstance(hit, cf.Future) else hit
    try:
        value = build()
    except BaseException as e:
        with _CACHE_LOCK:
            cache.pop(key, None)
        mine.set_exception(e)
        raise
    with _CACHE_LOCK:
        cache[key] = value
    mine.set_result(value)
    return value


# --- output shardings known before compiling --------------------------------------------


def _shards_nothing(spec: Any) -> bool:
    """A ``PartitionSpec`` with no sharded, unreduced or reduced axis."""
    if any(p is not None for p in spec):
        return False
    return not (getattr(spec, "unreduced", None) or getattr(spec, "reduced", None))


def replicated_on(sh: Any, mesh: jax.sharding.Mesh) -> bool:
    """Whether ``sh`` is ``NamedSharding(mesh, P())`` in device memory."""
    if not isinstance(sh, jax.sharding.NamedSharding) or sh.mesh != mesh:
        return False
    default = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()).memory_kind
    return _shards_nothing(sh.spec) and sh.memory_kind == default


def layouts_replicated(
    arg_shardings: Sequence[Any], in_shardings: Any, jaxpr: Any, stage_axis: str | None
) -> bool:
    """Whether a program's data stays replicated on each submesh: no argument (nor an
    ``mm.jit`` ``in_shardings`` entry) shards over an axis other than the stage axis, and
    the program names no sharded layout. Its fragments' layouts are then known before
    compiling, so one submesh's copy of a program is keyed like another's."""

    def spreads(spec: Any, sizes: dict[str, int]) -> bool:
        return any(a != stage_axis and sizes.get(a, 2) > 1 for a in spec_axes(spec))

    for sh in arg_shardings:
        if isinstance(sh, jax.sharding.NamedSharding):
            if spreads(sh.spec, dict(sh.mesh.shape)):
                return False
        elif sh is not None and not sh.is_fully_replicated:
            return False
    given = jax.tree.leaves(
        in_shardings,
        is_leaf=lambda x: isinstance(x, (jax.sharding.PartitionSpec, jax.sharding.Sharding)),
    )
    for g in given:
        if isinstance(g, jax.sharding.NamedSharding):
            g = g.spec
        if isinstance(g, jax.sharding.PartitionSpec) and spreads(g, {}):
            return False
    return all(_names_nothing(p) for p in embedded_placements(jaxpr, CONTEXT_ONLY))


def _names_nothing(sh: Any) -> bool:
    """A placement that shards nothing: a sharding-in-types annotation such as a
    ``dot_general``'s ``out_sharding`` of spec ``P()`` (in device memory)."""
    return (
        isinstance(sh, jax.sharding.NamedSharding)
        and _shards_nothing(sh.spec)
        and sh.memory_kind in (None, "device")
    )


def outputs_replicated(
    in_shardings: Sequence[Any], mesh: jax.sharding.Mesh, jaxpr: Any, out_avals: Any
) -> bool:
    """Whether a fragment's outputs are replicated over ``mesh`` whatever XLA decides:
    every input is replicated there and the program names no sharding, mesh or device
    other than replicated ones (no sharding constraint, ``shard_map``, ``device_put``).
    XLA's sharding propagation then has nothing sharded to propagate. The executor gives
    such fragments replicated output shardings up front, so the fragments using their
    outputs need not wait for this compile to know their input shardings (they compile
    in parallel instead of one after another). Were XLA ever to shard such an output,
    the fixed output sharding still makes the values right (XLA gathers it)."""
    if not in_shardings:
        return False
    return places_nothing(jaxpr, out_avals) and all(
        replicated_on(sh, mesh) for sh in in_shardings
    )


def places_nothing(jaxpr: Any, out_avals: Any) -> bool:
    """Whether ``jaxpr`` names no sharding, mesh or device other than replicated ones
    (no sharding constraint, ``shard_map``, ``device_put``; no sharded output type): a
    fragment without inputs that does so makes replicated outputs (one that constrains
    a constant it makes, ``with_sharding_constraint(zeros, P(None, "model"))``, does not)."""
    if not all(_names_nothing(p) for p in embedded_placements(jaxpr, CONTEXT_ONLY)):
        return False
    for av in out_avals:
        spec = getattr(getattr(av, "sharding", None), "spec", None)
        if spec is not None and not _shards_nothing(spec):
            return False  # sharding in types: the output's type names its sharding
    return True


# --- one compile for every submesh of the same shape ---------------------------------------


class _Foreign(Exception):
    """A placement that does not map onto the fragment's submesh by position."""


def embedded_placements(jaxpr: Any, skip: frozenset[str] = frozenset()) -> tuple[Any, ...]:
    """Every sharding, mesh (abstract too) or device named in ``jaxpr``'s equation
    parameters (sharding constraints, device_put targets, shard_maps, ...), sub-jaxprs
    included, except in the parameters named in ``skip``: the text of a jaxpr does not
    show which devices these refer to."""
    found: list[Any] = []

    def walk_value(v: Any) -> None:
        if isinstance(
            v, (jax.sharding.Sharding, jax.sharding.Mesh, jax.sharding.AbstractMesh, jax.Device)
        ):  # an abstract mesh: a shard_map without mesh= (the context's), sharded
            found.append(v)
        elif isinstance(v, (tuple, list)):
            for x in v:
                walk_value(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk_value(x)
        elif hasattr(v, "eqns") and hasattr(v, "invars"):
            walk(v)
        elif hasattr(v, "jaxpr") and hasattr(v, "consts"):
            walk(v.jaxpr)

    def walk(j: Any) -> None:
        for e in j.eqns:
            for name, v in e.params.items():
                if name not in skip:
                    walk_value(v)

    walk(jaxpr)
    return tuple(found)


#: parameters that name a mesh without placing anything on it: the context mesh of a
#: nested ``jit`` or a sharding constraint (their shardings are parameters of their own)
CONTEXT_ONLY = frozenset({"ctx_mesh", "context_mesh"})


def device_free_key(mesh: jax.sharding.Mesh, parts: Any) -> Hashable | None:
    """``parts`` with every device replaced by its position in ``mesh`` (row-major), or
    ``None`` when a placement is not a ``NamedSharding``/mesh/device inside ``mesh``.

    Two fragments with equal keys on submeshes of one shape differ only in which
    devices run them: one compiled executable serves both (``relocate``)."""
    pos = {d.id: k for k, d in enumerate(mesh.devices.flat)}
    memo: dict[int, Any] = {}  # by id: a fragment's values share a few shardings

    def norm(x: Any) -> Any:
        if x is None or isinstance(x, (str, int, float, bool)):
            return x
        if isinstance(x, (tuple, list)):
            return tuple(norm(v) for v in x)
        got = memo.get(id(x))
        if got is None:
            got = memo[id(x)] = norm_one(x)
        return got

    def norm_one(x: Any) -> Any:
        if isinstance(x, jax.sharding.NamedSharding):
            return ("named", norm(x.mesh), x.spec, x.memory_kind)
        if _compat.is_single_device_sharding(x):
            return ("single", norm(next(iter(x.device_set))), x.memory_kind)
        if isinstance(x, jax.sharding.AbstractMesh):  # no devices
            return ("abstract", x)
        if isinstance(x, jax.sharding.Mesh):
            types = tuple(str(t) for t in getattr(x, "axis_types", ()))
            return ("mesh", x.axis_names, x.devices.shape, types, norm(list(x.devices.flat)))
        if isinstance(x, jax.Device):
            if x.id not in pos:
                raise _Foreign
            return ("device", pos[x.id])
        if isinstance(x, jax.ShapeDtypeStruct):
            return ("aval", x.shape, x.dtype, x.weak_type, norm(x.sharding))
        raise _Foreign

    try:
        return norm(parts)
    except _Foreign:
        return None


class CompileStats:
    """How a plan's executables were made: ``compiled`` by XLA, ``relocated`` (another
    submesh's executable loaded for these devices), or ``shared`` (made earlier in this
    process by another ``mm.jit`` of the same fragment), and on how many ``threads``."""

    def __init__(self, threads: int = 1) -> None:
        self._lock = threading.Lock()
        self.compiled = 0
        self.relocated = 0
        self.shared = 0
        self.threads = threads  # compile threads this process used

    def add(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def as_dict(self) -> dict[str, int]:
        return {
            "compiled": self.compiled,
            "relocated": self.relocated,
            "shared": self.shared,
            "threads": self.threads,
        }


class SharedExecutables:
    """The executables of every ``mm.jit`` of this process, by fragment key (its program's
    fingerprint, input and output shardings, donations, avals, compiler options, embedded
    placements) and the JAX settings it was compiled under: a new ``mm.jit`` of a program
    compiled before (the same function wrapped again, a rebuilt model, a second run in
    one process) loads nothing anew, as ``jax.jit`` does for a function it has seen.
    It also keeps, by device-free key, the submesh each relocatable executable was
    compiled for: the same program on other devices relocates from it
    (:func:`compile_or_relocate`) instead of compiling again.

    Least recently used entries go past ``MULTIMESH_SHARED_EXECUTABLES`` (default 1024;
    0 turns sharing off); ``jax.clear_caches()`` empties it. Each entry keeps its
    fragment's program alive: Python callbacks in it are keyed by identity, and a live
    object's identity is never reused by another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[Hashable, tuple[Any, Any]] = (
            collections.OrderedDict()
        )

    @staticmethod
    def capacity() -> int:
        env = os.environ.get("MULTIMESH_SHARED_EXECUTABLES", "1024").strip()
        try:
            return max(0, int(env))
        except ValueError:
            raise ValueError(
                f"MULTIMESH_SHARED_EXECUTABLES={env!r}: expected a whole number of "
                "executables (0 turns sharing between mm.jit objects off)"
            ) from None

    def get(self, key: Hashable) -> Any:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def put(self, key: Hashable, exe: Any, keep: Any, capacity: int) -> None:
        with self._lock:
            self._entries[key] = (exe, keep)
            self._entries.move_to_end(key)
            while len(self._entries) > capacity:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()


SHARED = SharedExecutables()
_compat.register_cache(SHARED, "multimesh: executables shared by mm.jit objects")


def compile_shared(key: Hashable, keep: Any, make: Callable[[], Any], stats: CompileStats) -> Any:
    """``make()``, or the executable another ``mm.jit`` of this process made for ``key``
    under the same JAX settings (see :class:`SharedExecutables`)."""
    capacity = SHARED.capacity()
    if capacity == 0:
        return make()
    full = (key, _compat.config_key())
    hit = SHARED.get(full)
    if hit is not None:
        stats.add("shared")
        return hit
    exe = make()
    SHARED.put(full, exe, keep, capacity)
    return exe


def compile_or_relocate(
    cache: dict[Hashable, Any],
    rkey: Hashable | None,
    mesh: jax.sharding.Mesh,
    build: Callable[[], Any],
    stats: CompileStats,
    keep: Any = None,
) -> Any:
    """``build()``, or the executable already built for the same device-free key on
    another submesh, loaded for ``mesh``'s devices (milliseconds instead of a compile).
    The first fragment of a key compiles; later ones wait for it, then relocate. The
    source may also be one an earlier ``mm.jit`` of this process compiled (kept in
    :data:`SHARED` with ``keep``, as :func:`compile_shared` does)."""

    def compile_here() -> Any:
        stats.add("compiled")
        return build()

    if rkey is None or not _relocation_on():
        return compile_here()
    claimed: list[bool] = []  # this fragment is the one that compiles the key
    capacity = SHARED.capacity()
    shared_key = ("relocatable", rkey, _compat.config_key())

    def first() -> tuple[Any, jax.sharding.Mesh]:
        earlier = SHARED.get(shared_key) if capacity else None
        if earlier is not None:  # another mm.jit compiled it: relocate from that
            return earlier
        claimed.append(True)
        made = compile_here(), mesh
        if capacity:
            SHARED.put(shared_key, made, keep, capacity)
        return made

    try:
        src, src_mesh = compile_once(cache, ("relocatable", rkey), first)
    except Exception:  # noqa: BLE001 - another fragment's error is raised by that fragment
        if claimed:
            raise
        return compile_here()
    if claimed:
        return src
    if tuple(d.id for d in src_mesh.devices.flat) == tuple(d.id for d in mesh.devices.flat):
        stats.add("shared")  # the shared source was compiled for these very devices
        return src
    mapping = dict(zip((d.id for d in src_mesh.devices.flat), mesh.devices.flat))
    try:
        moved = _compat.relocate_compiled(src, mapping)
    except ValueError:  # callbacks, effects, constants: compile it here
        return compile_here()
    stats.add("relocated")
    return moved


def _relocation_on() -> bool:
    """Relocation (unless ``MULTIMESH_RELOCATE=0``) is for one-process runs (multi-process
    runs compile every fragment; their executables are also compiled for other processes'
    devices, which cannot be loaded here) without JAX's persistent compilation cache (which
    already makes a repeated compile cheap, and whose loaded executables cannot be moved
    again)."""
    if os.environ.get("MULTIMESH_RELOCATE", "1").strip().lower() in ("0", "false", "no", "off"):
        return False  # the escape hatch: compile every fragment
    return jax.process_count() == 1 and not _compat.persistent_cache_on()
