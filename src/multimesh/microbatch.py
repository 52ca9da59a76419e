"""Microbatching: split batch arguments, call a function per microbatch, reduce.

``mm.microbatch(jax.value_and_grad(loss), 8, schedule="1f1b", reduce="mean")`` is
gradient accumulation. Outside ``mm.jit`` it is a ``lax.scan`` over microbatches (so
``jit``, ``vmap`` and autodiff come from JAX). Inside ``mm.jit`` the loop is unrolled at
trace time, each microbatch under a marker scope (``mb<k>@mm:L<loop>``), and the
compiler orders each (stage, microbatch, phase) fragment by the schedule. Accumulation
for microbatch ``k`` is traced inside its scope, so each gradient is summed on the
submesh that owns it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from multimesh import _compat
from multimesh import schedules as _schedules
from multimesh.tasks import stage_limit, trace_state

_compat.register_exclusion(__file__)

_MB_RE = re.compile(r"^mb(?P<k>\d+)@mm:L(?P<loop>\d+)$")


def decode_microbatch(scope: str) -> tuple[int, int] | None:
    """(loop id, microbatch index) for a microbatch marker scope, else ``None``."""
    if "@mm:L" not in scope:
        return None
    m = _MB_RE.match(scope)
    return (int(m["loop"]), int(m["k"])) if m else None


def _check_reduce(reduce: Any) -> None:
    for leaf in jax.tree.leaves(reduce):
        if leaf not in ("sum", "mean"):
            raise ValueError(f"reduce must be 'sum', 'mean' or a pytree of those; got {leaf!r}.")


def _reduce_tree(reduce: Any, outs: Any) -> Any:
    if isinstance(reduce, str):
        return jax.tree.map(lambda _: reduce, outs)
    try:
        return jax.tree.map(lambda r, o: jax.tree.map(lambda _: r, o), reduce, outs)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"reduce pytree {jax.tree.structure(reduce)} does not match the structure of the "
            f"outputs {jax.tree.structure(outs)}; give one 'sum'/'mean' per output."
        ) from e


def microbatch(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    axis: int = 0,
    schedule: Any = "1f1b",
    reduce: Any = "sum",
) -> Callable[..., Any]:
    """Call ``fun`` on ``num_microbatches`` slices of the batch arguments and reduce."""
    if (
        not isinstance(num_microbatches, int)
        or isinstance(num_microbatches, bool)
        or (num_microbatches < 1)
    ):
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}.")
    sched = _schedules.get(schedule)
    _check_reduce(reduce)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    M = num_microbatches

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for i in nums:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"microbatch argnums={nums} but the function got {len(args)} positional "
                    "arguments."
                )
        pos = {i % len(args) for i in nums}
        for i in sorted(pos):
            for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
                shape = jnp.shape(leaf)
                if not -len(shape) <= axis < len(shape):
                    raise ValueError(
                        f"microbatch axis {axis} is out of range for argument {i}"
                        f"{jax.tree_util.keystr(path)} of shape {shape}."
                    )
                if shape[axis] % M:
                    raise ValueError(
                        f"argument {i}{jax.tree_util.keystr(path)} has batch size "
                        f"{shape[axis]} along axis {axis}, which does not split into "
                        f"{M} microbatches; use a batch size divisible by {M}."
                    )

        def piece(k: int) -> tuple[Any, ...]:
            def cut(x: Any) -> Any:
                x = jnp.asarray(x)
                ax = axis % x.ndim
                b = x.shape[ax] // M
                return jax.lax.slice_in_dim(x, k * b, (k + 1) * b, axis=ax)

            return tuple(jax.tree.map(cut, a) if i in pos else a for i, a in enumerate(args))

        state = trace_state()
        with stage_limit(sched):
            if state is not None:
                loop = state.add_loop(sched, M)
                # slice outside the microbatch scopes, so that each stage's fragments are
                # identical across microbatches and share one executable
                pieces = [piece(k) for k in range(M)]
                acc = None
                for k in range(M):
                    with jax.named_scope(f"mb{k}@mm:L{loop}"):
                        out = fun(*pieces[k], **kwargs)
                        acc = out if acc is None else jax.tree.map(jnp.add, acc, out)
                outs = acc
            else:
                outs = _scan_reference(fun, M, axis, pos, args, kwargs)
        red = _reduce_tree(reduce, outs)
        return jax.tree.map(lambda r, o: o / M if r == "mean" else o, red, outs)

    return wrapped


def _scan_reference(fun, M, axis, pos, args, kwargs):
    def split(x: Any) -> Any:
        x = jnp.asarray(x)
        ax = axis % x.ndim
        b = x.shape[ax] // M
        x = x.reshape(x.shape[:ax] + (M, b) + x.shape[ax + 1 :])
        return jnp.moveaxis(x, ax, 0)

    xs = {i: jax.tree.map(split, args[i]) for i in pos}

    def call(pieces: dict[int, Any]) -> Any:
        full = tuple(pieces[i] if i in pieces else a for i, a in enumerate(args))
        return fun(*full, **kwargs)

    first = jax.eval_shape(call, {i: jax.tree.map(lambda x: x[0], v) for i, v in xs.items()})
    init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)

    def body(carry: Any, mb: dict[int, Any]) -> tuple[Any, None]:
        out = call(mb)
        return jax.tree.map(lambda c, o: c + o.astype(c.dtype), carry, out), None

    acc, _ = jax.lax.scan(body, init, xs)
    return acc
