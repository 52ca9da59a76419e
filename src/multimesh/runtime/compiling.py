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

import concurrent.futures as cf
import contextlib
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from multimesh import _compat

_compat.register_exclusion(__file__)


def num_threads() -> int:
    """Compile threads: ``MULTIMESH_COMPILE_THREADS``, else the CPU count (at most 8)."""
    env = os.environ.get("MULTIMESH_COMPILE_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(
                f"MULTIMESH_COMPILE_THREADS={env!r}: expected a whole number of threads"
            ) from None
        return max(1, n)
    return max(1, min(8, os.cpu_count() or 1))


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
            fut = self._pool.submit(fn)
        self._futures.append(fut)
        return Pending(fut)

    def wait(self) -> None:
        """Wait for every job; raise the first error in submission (plan) order."""
        try:
            for fut in self._futures:
                fut.result()
        finally:
            self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


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
