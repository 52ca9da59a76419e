"""Microbatching: split batch arguments, call a function per microbatch, reduce.

``mm.microbatch(jax.value_and_grad(loss), 8, schedule="1f1b", reduce="mean")`` is
gradient accumulation. Outside ``mm.jit`` it is a ``lax.scan`` over microbatches (so
``jit``, ``vmap`` and autodiff come from JAX). Inside ``mm.jit`` the loop is unrolled at
trace time (the function itself is traced once, as a jitted call inlined per
microbatch), each microbatch under a marker scope (``mb<k>@mm:L<loop>``), and the
compiler orders each (stage, microbatch, phase) fragment by the schedule. Accumulation
for microbatch ``k`` is traced inside its scope, so each gradient is summed on the
submesh that owns it.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multimesh import _compat
from multimesh import schedules as _schedules
from multimesh.tasks import stage_limit, trace_state

_compat.register_exclusion(__file__)

_MB_RE = re.compile(r"^mb(?P<k>\d+)@mm:L(?P<loop>\d+)$")


def microbatch_scope(loop: int, k: int) -> str:
    """The marker scope of microbatch ``k`` of loop ``loop`` (see :func:`decode_microbatch`)."""
    return f"mb{k}@mm:L{loop}"


def decode_microbatch(scope: str) -> tuple[int, int] | None:
    """(loop id, microbatch index) for a microbatch marker scope, else ``None``."""
    if "@mm:L" not in scope:
        return None
    m = _MB_RE.match(scope)
    return (int(m["loop"]), int(m["k"])) if m else None


_REDUCTIONS = ("sum", "mean", "stack")

# marks the additions that sum a loop's outputs over microbatches (see
# multimesh.compiler.accumulate)
ACCUMULATE_SCOPE = "accumulate@mm"


def _argnums(argnums: Any) -> tuple[int, ...]:
    """``argnums`` as a tuple of ints (one int or a non-empty sequence of them)."""
    ok = lambda i: isinstance(i, (int, np.integer)) and not isinstance(i, bool)  # noqa: E731
    if ok(argnums):
        return (int(argnums),)
    if not isinstance(argnums, (str, bytes, dict)):
        try:
            nums = tuple(argnums)  # a tuple, list, range or NumPy array (as jax.grad takes)
        except TypeError:
            nums = ()
        if nums and all(ok(i) for i in nums):
            return tuple(int(i) for i in nums)
    raise TypeError(
        f"microbatch argnums must be an int or a non-empty sequence of ints (the positions "
        f"of the batch arguments), got {argnums!r}."
    )


def _check_reduce(reduce: Any) -> None:
    for leaf in jax.tree.leaves(reduce):
        if leaf not in _REDUCTIONS:
            raise ValueError(
                f"reduce must be 'sum', 'mean', 'stack' or a pytree of those; got {leaf!r}."
            )


def _reduce_tree(reduce: Any, outs: Any) -> Any:
    """One reduction name per output leaf (``reduce`` is one name or a pytree prefix)."""
    if isinstance(reduce, str):
        return jax.tree.map(lambda _: reduce, outs)
    try:
        return jax.tree.map(lambda r, o: jax.tree.map(lambda _: r, o), reduce, outs)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"reduce pytree {jax.tree.structure(reduce)} does not match the structure of the "
            f"outputs {jax.tree.structure(outs)}; give one 'sum'/'mean'/'stack' per output."
        ) from e


def microbatch(
    fun: Callable[..., Any],
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    axis: int = 0,
    schedule: Any = "1f1b",
    reduce: Any = "sum",
    stacked: bool = False,
    in_shardings: Any = None,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """Call ``fun`` on ``num_microbatches`` slices of the batch arguments and reduce.

    - ``argnums``: the batch arguments (sliced); the others are passed whole.
    - ``axis``: the batch axis of every batch argument (negative counts from the end).
    - ``stacked=True``: the batch arguments already carry a leading microbatch axis of
      size ``num_microbatches``; microbatch ``k`` is ``x[k]`` (``axis`` is ignored).
    - ``reduce``: ``"sum"``, ``"mean"`` or ``"stack"`` (per-microbatch outputs stacked
      along a new leading axis: losses, predictions, metrics), or a pytree prefix of
      the outputs with one of those per leaf.
    - ``in_shardings``: per batch argument (a tuple matching ``argnums``, or one for
      all), a ``PartitionSpec`` (pytree prefix) for each microbatch slice, applied as a
      sharding constraint on the submesh that uses the slice.
    - ``has_aux``: ``fun`` returns ``(out, aux)``; ``out`` is reduced by ``reduce``, ``aux``
      is stacked; the result is ``(reduced_out, stacked_aux)``.
    - ``schedule``: the pipeline schedule under ``mm.jit`` (a name or a
      :class:`multimesh.schedules.Schedule`).

    Outside ``mm.jit`` this is a ``lax.scan`` over microbatches (the reference); inside,
    the loop is unrolled and its fragments run in the schedule's order, and a batch
    argument that comes from the host (NumPy, uncommitted) is cut into its microbatches
    on the host, each put where it is used (unless ``in_shardings`` asks for a layout).
    """
    if (
        not isinstance(num_microbatches, (int, np.integer))
        or isinstance(num_microbatches, bool)
        or (num_microbatches < 1)
    ):
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}.")
    num_microbatches = int(num_microbatches)
    sched = _schedules.get(schedule)
    _check_reduce(reduce)
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(
            f"microbatch axis must be one int (the batch axis of every batch argument), got "
            f"{axis!r}; give arguments batched along other axes their own mm.microbatch, or "
            "move their batch axis first (jnp.moveaxis)."
        )
    nums = _argnums(argnums)
    if isinstance(in_shardings, (tuple, list)) and len(in_shardings) != len(nums):
        raise ValueError(
            f"microbatch in_shardings has {len(in_shardings)} entries for argnums={nums}; "
            "give one per batch argument (or one for all)."
        )
    M = num_microbatches
    fun_name = getattr(fun, "__name__", "fun")

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for i in nums:
            if not -len(args) <= i < len(args):
                raise ValueError(
                    f"microbatch argnums={nums} but the function got {len(args)} positional "
                    "arguments."
                )
        pos = [i % len(args) for i in nums]
        first: tuple[str, int] | None = None  # every batch leaf has one batch size
        if not any(jax.tree_util.tree_leaves(args[i]) for i in pos):
            raise ValueError(
                f"microbatch argnums={nums}: the batch arguments hold no arrays, so there is "
                "nothing to split (fun would run on the whole batch once per microbatch); "
                "give the positions of the batch arguments."
            )
        for i in pos:
            for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
                shape = jnp.shape(leaf)
                _check_leaf(i, path, shape, M, axis, stacked)
                size = shape[0] if stacked else shape[axis]
                where = f"argument {i}{jax.tree_util.keystr(path)}"
                if first is None:
                    first = (where, size)
                elif size != first[1]:
                    raise ValueError(
                        f"microbatch: {where} has batch size {size} along axis "
                        f"{0 if stacked else axis}, but {first[0]} has {first[1]}; every "
                        "batch argument (argnums) is split into the same microbatches, so "
                        "their batch sizes must agree (pass per-example values of another "
                        "size as a non-batch argument)."
                    )
        specs = {
            i: (in_shardings[j] if isinstance(in_shardings, (tuple, list)) else in_shardings)
            for j, i in enumerate(pos)
        }

        def constrain(i: int, piece_tree: Any) -> Any:
            spec = specs.get(i)
            if spec is None:
                return piece_tree
            return jax.lax.with_sharding_constraint(piece_tree, spec)

        def piece(k: int) -> tuple[Any, ...]:
            def cut(x: Any) -> Any:
                x = jnp.asarray(x)
                if stacked:
                    return x[k]
                ax = axis % x.ndim
                b = x.shape[ax] // M
                if isinstance(k, int):
                    return jax.lax.slice_in_dim(x, k * b, (k + 1) * b, axis=ax)
                return jax.lax.dynamic_slice_in_dim(x, k * b, b, axis=ax)  # the reference

            return tuple(
                constrain(i, jax.tree.map(cut, a)) if i in specs else a for i, a in enumerate(args)
            )

        # non-batch arguments made of traced values (parameters, a Flax NNX module under
        # jit) and Flax NNX modules (also eager ones), positional or keyword, are passed
        # to the traced function rather than closed over: NNX refuses graph nodes from
        # another trace level, and state fun changes in them goes on to the next
        # microbatch (as the reference scan's carry). Other concrete values stay closed
        # over, so Python code may still read them (int(n), if flag: ...)
        carried_pos = tuple(i for i, a in enumerate(args) if i not in specs and _carried(a))
        carried_kw = tuple(n for n, v in kwargs.items() if _carried(v))
        closed = [
            (f"argument {i}", a)
            for i, a in enumerate(args)
            if i not in specs and i not in carried_pos
        ] + [(f"argument {n!r}", v) for n, v in kwargs.items() if n not in carried_kw]

        # per carried argument: the leaves fun replaces (its state, as the reference
        # scan's carry), found by identity when tracing
        changed: list[list[int]] = []

        def call(k_args: tuple[Any, ...], vals: tuple[Any, ...]) -> tuple[Any, list[Any]]:
            """``fun`` on microbatch arguments ``k_args`` and carried values ``vals``:
            ``((out, aux), the carried values' leaves after fun)``."""
            state_before = [jax.tree_util.tree_leaves(v) for v in vals]
            structs = [jax.tree_util.tree_structure(v) for v in vals]
            plain = tuple(_plain(v) for v in vals)
            k_args = _with_batch(k_args, carried_pos, plain[: len(carried_pos)])
            kw = {**kwargs, **dict(zip(carried_kw, plain[len(carried_pos) :]))}
            before = [jax.tree_util.tree_leaves(v) for _w, v in closed]
            out = fun(*k_args, **kw)
            after = [jax.tree_util.tree_leaves(v) for v in vals]
            changed[:] = _state_changes(fun_name, state_before, after)
            _check_structure(fun_name, structs, vals)
            for (what, v), old in zip(closed, before):
                # values traced here, stored into an argument that is closed over: its
                # changes cannot go on to the next microbatch (JAX would leak them).
                # Other changes (a log, a memo, leaves a pytree makes when flattened)
                # are Python side effects, as under jax.jit
                ids = {id(x) for x in old}
                new = jax.tree_util.tree_leaves(v)
                if any(_compat.is_tracer(y) and id(y) not in ids for y in new):
                    raise ValueError(
                        f"microbatch: {fun_name} changed {what} in place to traced values; "
                        "that argument also holds values not being traced (Python numbers, "
                        "NumPy or concrete arrays), so it is closed over and its changes "
                        "cannot go on to the next microbatch. Pass state that changes as "
                        "arrays under jax.jit/mm.jit, or as an NNX module, or return it."
                    )
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise ValueError(
                        "microbatch(has_aux=True) needs fun to return a pair (out, aux); got "
                        f"{type(out).__name__}."
                    )
                return out, after
            return (out, None), after

        carried0 = tuple(
            _wrap(v) for v in [args[i] for i in carried_pos] + [kwargs[n] for n in carried_kw]
        )
        state = trace_state()
        with stage_limit(sched):
            if state is not None:
                loop = state.add_loop(sched, M)
                # slice outside the microbatch scopes, so that each stage's fragments are
                # identical across microbatches and share one executable
                pieces = [piece(k) for k in range(M)]
                # traced once, like the reference scan's body: every microbatch calls the
                # same jitted function, a cache hit after the first (the compiler inlines
                # each call in its microbatch scope), so tracing does not grow with M
                batch = tuple(sorted(specs))
                nb = len(batch)

                def body(*a: Any) -> Any:
                    # the state fun replaced is returned, for the next microbatch
                    res, after = call(_with_batch(pieces[0], batch, a[:nb]), a[nb:])
                    return res, [[ys[j] for j in c] for ys, c in zip(after, changed)]

                traced_once = jax.jit(_named_like(fun, batch + carried_pos, carried_kw, body))
                state_now = _promote_weak(
                    traced_once, [pieces[0][i] for i in batch], list(carried0), changed
                )
                acc: Any = None
                per_mb: list[tuple[Any, Any]] = []
                red = None
                for k in range(M):
                    scope = microbatch_scope(loop, k)
                    with jax.named_scope(scope):
                        (out, aux), new = traced_once(
                            *(pieces[k][i] for i in batch), *state_now
                        )
                        state_now = [
                            _replaced(v, c, n) if c else v
                            for v, c, n in zip(state_now, changed, new)
                        ]
                        if red is None:
                            red = _reduce_tree(reduce, out)
                        summed = jax.tree.map(lambda r, o: None if r == "stack" else o, red, out)
                    if M == 1:  # strongly typed, as a sum into zeros (the reference)
                        acc = jax.tree.map(_strong, summed)
                    else:
                        if acc is None:
                            # start from zeros made outside the loop (as the reference
                            # scan does), so that microbatch 0's work is the same program
                            # as every other microbatch's and shares its executable
                            acc = jax.tree.map(_zeros, summed)
                        with jax.named_scope(scope), jax.named_scope(ACCUMULATE_SCOPE):
                            acc = jax.tree.map(_add, acc, summed)
                    per_mb.append(
                        (jax.tree.map(lambda r, o: o if r == "stack" else None, red, out), aux)
                    )
                stacked_out = _stack([p for p, _ in per_mb])
                aux_out = _stack([a for _, a in per_mb])
                outs = jax.tree.map(
                    lambda r, a, st: st if r == "stack" else a,
                    red,
                    acc,
                    stacked_out,
                    is_leaf=lambda x: x is None,
                )
                final = state_now
            else:
                red, outs, aux_out, final = _scan_reference(
                    lambda k, vals: call(piece(k), vals)[0], carried0, M, reduce
                )
        # NNX modules hold the state the loop left, as after a Python loop over the
        # microbatches (BatchNorm statistics, RNG counts: new dropout masks next step);
        # only where fun changed something (two arguments may share a module)
        for old, new, c in zip(carried0, final, changed):
            if c:
                _update_module(old, new, c)
        outs = jax.tree.map(
            lambda r, o: o / M if r == "mean" and not _float0(o) else o, red, outs
        )
        return (outs, aux_out) if has_aux else outs

    return wrapped


def _named_like(
    fun: Callable[..., Any], passed: tuple[int, ...], kw: tuple[str, ...], f: Callable[..., Any]
):
    """``f`` (called with ``fun``'s arguments at positions ``passed``, then its keyword
    arguments ``kw``) dressed as ``fun`` for JAX's tracing errors: ``fun``'s name and
    source line, the arguments' own names."""
    try:
        params = list(inspect.signature(fun).parameters.values())
        names = [params[i].name for i in passed] + list(kw)
        kinds = [params[i].kind for i in passed]
    except (TypeError, ValueError, IndexError):
        return f
    if len(set(names)) != len(names):
        return f
    if any(k not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
           for k in kinds):
        return f
    try:  # keyword names need not be identifiers (f(**{"layer-0": p}))
        sig = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names]
        )
    except ValueError:
        return f
    f.__wrapped__ = fun  # type: ignore[attr-defined]  # JAX's source info unwraps
    f.__name__ = getattr(fun, "__name__", "fun")
    f.__signature__ = sig  # type: ignore[attr-defined]
    return f


def _with_batch(k_args: tuple[Any, ...], at: tuple[int, ...], vals: tuple[Any, ...]):
    """``k_args`` with the arguments at positions ``at`` replaced by ``vals``."""
    out = list(k_args)
    for i, p in zip(at, vals):
        out[i] = p
    return tuple(out)


def _check_leaf(i: int, path: Any, shape: tuple[int, ...], M: int, axis: int, stacked: bool):
    where = f"argument {i}{jax.tree_util.keystr(path)}"
    if stacked:
        if not shape or shape[0] != M:
            raise ValueError(
                f"{where} has shape {shape}; with stacked=True every batch argument needs a "
                f"leading microbatch axis of size {M}."
            )
        return
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"microbatch axis {axis} is out of range for {where} of shape {shape}.")
    if shape[axis] % M:
        raise ValueError(
            f"{where} has batch size {shape[axis]} along axis {axis}, which does not split "
            f"into {M} microbatches; use a batch size divisible by {M}."
        )


def _float0(x: Any) -> bool:
    """The gradient of an integer input (``allow_int=True``): no values, nothing to sum."""
    return getattr(x, "dtype", None) == jax.dtypes.float0


def _float0_zeros(x: Any) -> np.ndarray:
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _add(a: Any, b: Any) -> Any:
    if a is None or _float0(a):
        return a
    return jnp.add(a, b)


def _strong(x: Any) -> Any:
    if x is None or _float0(x):
        return x
    a = jnp.asarray(x)
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):
        # PRNG keys cannot be summed: the same TypeError as the reference's sum
        jax.eval_shape(jax.lax.add, a, a)
        return x
    return a.astype(a.dtype)


def _zeros(x: Any) -> Any:
    if x is None:
        return None
    if _float0(x):
        return _float0_zeros(x)
    shape = jnp.shape(x)
    # through a reshape: a scalar zero would otherwise be a literal inside the consumer
    return jnp.zeros((1, *shape), jnp.result_type(x)).reshape(shape)


def _state_changes(fun_name: str, before: list[list[Any]], after: list[list[Any]]):
    """Per carried argument, the positions of the leaves ``fun`` changed (by identity);
    their shapes and dtypes must stay, as a ``lax.scan`` carry's."""
    changed = []
    for n, (xs, ys) in enumerate(zip(before, after)):
        if len(xs) != len(ys):
            raise ValueError(
                f"microbatch: {fun_name} changed the structure of a non-batch argument "
                f"(carried argument {n}: {len(xs)} leaves, then {len(ys)}); only the values "
                "of state may change from one microbatch to the next. A module that gains "
                "variables (Module.sow, a lazily created parameter) needs them popped inside "
                "fun (nnx.pop(model, nnx.Intermediate)) and returned as aux, or created "
                "before the loop."
            )
        at = [j for j, (x, y) in enumerate(zip(xs, ys)) if x is not y]
        for j in at:
            a = (tuple(np.shape(xs[j])), jnp.result_type(xs[j]))
            b = (tuple(np.shape(ys[j])), jnp.result_type(ys[j]))
            if a != b and not (a[0] == b[0] and _weak(xs[j]) and _promotes(xs[j], b[1])):
                raise TypeError(
                    f"microbatch: {fun_name} changed state it carries from one microbatch "
                    f"to the next (carried argument {n}, leaf {j}) from shape {a[0]} "
                    f"{a[1]} to {b[0]} {b[1]}; carried state keeps its shape and dtype "
                    "(as a lax.scan carry)."
                )
        changed.append(at)
    return changed


def _check_structure(fun_name: str, before: list[Any], vals: tuple[Any, ...]) -> None:
    """Carried arguments keep their structure from one microbatch to the next, as a
    ``lax.scan`` carry (the reference): a Python attribute of an NNX module that ``fun``
    changes (``self.calls += 1``) cannot go on to the next microbatch."""
    for n, (a, v) in enumerate(zip(before, vals)):
        b = jax.tree_util.tree_structure(v)
        if a != b:
            raise ValueError(
                f"microbatch: {fun_name} changed the structure of a non-batch argument "
                f"(carried argument {n}) without changing its number of leaves: a Python "
                "attribute of an NNX module it sets (self.count += 1), or a static value "
                "of a pytree. Only array state goes from one microbatch to the next (as a "
                "lax.scan carry): keep such a value in an nnx.Variable, or set it outside "
                "the microbatched function."
            )


def _promotes(x: Any, dtype: Any) -> bool:
    """Whether a weakly typed ``x`` takes ``dtype`` as a ``lax.scan`` carry does (a weak
    float becomes bfloat16, not int32: the scan then refuses the carry's new type)."""
    return jnp.result_type(x, dtype) == dtype


def _weak(x: Any) -> bool:
    if isinstance(x, (bool, int, float, complex)):
        return True
    return bool(getattr(getattr(x, "aval", x), "weak_type", False))


def _promote_weak(traced_once: Any, batch: list[Any], state: list[Any], changed: list[list[int]]):
    """Weakly typed carried leaves that ``fun`` makes of another dtype take that dtype
    before the first microbatch, as ``lax.scan`` promotes a weak carry (a Python number
    given as state under jit, made bfloat16 by ``fun``)."""
    if not any(_weak(x) for v in state for x in jax.tree_util.tree_leaves(v)):
        return state
    for _ in range(3):
        _res, news = jax.eval_shape(traced_once, *batch, *state)
        promoted = False
        out = []
        for v, c, ns in zip(state, changed, news):
            leaves, treedef = jax.tree_util.tree_flatten(v)
            for j, a in zip(c, ns):
                x = leaves[j]
                if _weak(x) and jnp.result_type(x) != a.dtype and _promotes(x, a.dtype):
                    leaves[j] = jax.lax.convert_element_type(x, a.dtype)
                    promoted = True
            out.append(jax.tree_util.tree_unflatten(treedef, leaves))
        state = out
        if not promoted:
            break
    return state


def _update_module(old: Any, new: Any, changed: list[int]) -> None:
    """Write the state a loop left in a copy ``new`` of a carried argument back into the
    caller's NNX modules in ``old`` (a module, a Variable, or those in a tuple, list or
    dict; nothing for other values, which are not changed in place). Only the leaves
    ``fun`` changed (positions ``changed``) are written, over the modules' current
    state: another argument sharing a module may have written its changes already."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return
    if isinstance(old, _Graph) and isinstance(new, _Graph):
        current, aux = old.tree_flatten()
        final = jax.tree_util.tree_leaves(new)
        for j in changed:
            current[j] = final[j]
        new = _Graph.tree_unflatten(aux, current)
    old, new = _plain(old), _plain(new)
    is_node = nnx.graph.is_graph_node
    olds = jax.tree_util.tree_leaves(old, is_leaf=is_node)
    news = jax.tree_util.tree_leaves(new, is_leaf=is_node)
    for o, n in zip(olds, news):
        if isinstance(o, nnx.Variable):
            o.set_value(n.get_value())
        elif is_node(o):
            nnx.update(o, nnx.state(n))


def _replaced(tree: Any, at: list[int], vals: list[Any]) -> Any:
    """``tree`` with its leaves at positions ``at`` replaced by ``vals``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    for j, v in zip(at, vals):
        leaves[j] = v
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _stack(trees: list[Any]) -> Any:
    if trees[0] is None:
        return None
    return jax.tree.map(
        lambda *xs: None if xs[0] is None else jnp.stack(xs), *trees, is_leaf=lambda x: x is None
    )


def _carried(tree: Any) -> bool:
    """Passed through the microbatch loop, not closed over: every leaf is a value being
    traced (so nothing can read it in Python anyway), or the argument holds Flax NNX
    modules (alone or in a tuple, list or dict) made of numbers, which NNX refuses to
    close over."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return False
    if all(_compat.is_tracer(x) for x in leaves):
        return True
    nnx = sys.modules.get("flax.nnx")  # only loaded if the user uses NNX
    if nnx is None:
        return False
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=nnx.graph.is_graph_node)
    if not any(nnx.graph.is_graph_node(n) for n in nodes):
        return False
    return True


def _numeric(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _wrap(tree: Any) -> Any:
    """A carried argument: itself, or a :class:`_Graph` if it holds Flax NNX modules."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return tree
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=nnx.graph.is_graph_node)
    return _Graph(tree) if any(nnx.graph.is_graph_node(n) for n in nodes) else tree


def _plain(v: Any) -> Any:
    return v.tree if isinstance(v, _Graph) else v


_UNMADE = object()
_PY_NUMBERS = (bool, int, float, complex)


class _ById:
    """An unhashable static value (a plain dataclass config next to a module), compared
    by identity in a pytree's structure."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ById) and other.value is self.value


def _hashable(x: Any) -> Any:
    try:
        hash(x)
    except TypeError:
        return _ById(x)
    return x


def _unbox(x: Any) -> Any:
    return x.value if isinstance(x, _ById) else x


@jax.tree_util.register_pytree_node_class
class _Graph:
    """A carried argument holding Flax NNX modules (alone or in a tuple, list or dict),
    flattened as ``nnx.split`` flattens them: a module two paths reach (a shared
    submodule, a tied embedding) is one module with one set of leaves, as under
    ``nnx.value_and_grad``, where a pytree's flattening would make two copies (and split
    their gradient between them). Non-number leaves (``{"m": model, "mode": "train"}``)
    stay static. The modules are made again (``nnx.merge``) only when ``tree`` is read."""

    def __init__(self, tree: Any):
        self._tree = tree
        self._flat: tuple[list[Any], Any] | None = None
        leaves, (_o, _a, _g, inner) = self._split()
        # Python numbers next to the modules (not in their Variables, which carry them as
        # state) stay static too ({"m": model, "train": True}: fun's Python code reads
        # the flag)
        self.static = tuple(
            j
            for j, x in enumerate(leaves)
            if (not _numeric(x) or (j >= inner.num_leaves and type(x) in _PY_NUMBERS))
            and not _compat.is_tracer(x)
        )

    def _split(self) -> tuple[list[Any], Any]:
        """The current leaves (the modules' state, then the other leaves) and structure."""
        nnx = sys.modules["flax.nnx"]
        is_node = nnx.graph.is_graph_node
        parts, outer = jax.tree_util.tree_flatten(self._tree, is_leaf=is_node)
        at = tuple(j for j, p in enumerate(parts) if is_node(p))
        graphdef, state = nnx.split([parts[j] for j in at])
        leaves, inner = jax.tree_util.tree_flatten(state)
        rest = [p for j, p in enumerate(parts) if j not in at]
        return leaves + rest, (outer, at, graphdef, inner)

    @property
    def tree(self) -> Any:
        if self._tree is _UNMADE:
            nnx = sys.modules["flax.nnx"]
            leaves, (outer, at, graphdef, inner) = self._flat
            n = inner.num_leaves
            nodes = iter(nnx.merge(graphdef, jax.tree_util.tree_unflatten(inner, leaves[:n])))
            rest = iter(leaves[n:])
            parts = [next(nodes) if j in at else next(rest) for j in range(outer.num_leaves)]
            self._tree = jax.tree_util.tree_unflatten(outer, parts)
            self._flat = None
        return self._tree

    def tree_flatten(self) -> tuple[list[Any], Any]:
        # once read, the modules may have been changed in place: split them again
        leaves, structure = self._flat if self._tree is _UNMADE else self._split()
        fixed = tuple((j, _hashable(leaves[j])) for j in self.static)
        return [x for j, x in enumerate(leaves) if j not in self.static], (structure, fixed)

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> _Graph:
        structure, fixed = aux
        it = iter(children)
        at = dict(fixed)
        n = len(children) + len(at)
        out = cls.__new__(cls)
        out._tree = _UNMADE
        out._flat = ([_unbox(at[j]) if j in at else next(it) for j in range(n)], structure)
        out.static = tuple(at)
        return out


def _scan_reference(call, vals, M, reduce):
    """The reference: ``lax.scan`` over microbatches, summing or stacking outputs.
    ``call(k, vals)`` runs microbatch ``k``; ``vals`` (arguments passed, not closed
    over) go through the scan's carry, with the state fun replaces in them."""
    first_out, _ = jax.eval_shape(lambda v: call(0, v), vals)
    red = _reduce_tree(reduce, first_out)
    init = jax.tree.map(
        lambda r, s: None if r == "stack" or _float0(s) else jnp.zeros(s.shape, s.dtype),
        red,
        first_out,
    )

    def body(state: Any, k: Any) -> tuple[Any, Any]:
        carry, v = state
        out, aux = call(k, v)
        new = jax.tree.map(
            lambda r, c, o: (
                None
                if r == "stack" or o is None or _float0(o)
                else c + jnp.asarray(o).astype(c.dtype)
            ),
            red,
            carry,
            out,
            is_leaf=lambda x: x is None,
        )
        ys = jax.tree.map(lambda r, o: o if r == "stack" else None, red, out)
        return (new, v), (ys, aux)

    (acc, final), (ys, aux) = jax.lax.scan(body, (init, vals), jnp.arange(M))
    outs = jax.tree.map(
        lambda r, a, y, s: y if r == "stack" else _float0_zeros(s) if _float0(s) else a,
        red,
        acc,
        ys,
        first_out,
        is_leaf=lambda x: x is None,
    )
    return red, outs, aux, final
