"""``mm.jit``: trace once per input signature, split per submesh, compile, run.

``mm.jit(fun, mesh=mmesh)`` returns an :class:`MpmdFunction`. Calling it traces ``fun``
(as the reference ``with mmesh: jax.jit(fun)`` would), runs the compiler passes
(flatten, label, place, fragment, plan), compiles each fragment for its submesh, and
runs the plan. Like ``jax.jit`` it caches by input signature (tree structure, shapes,
dtypes, weak types, shardings of committed arrays, static arguments); a new placement
of the same signature reuses the trace, and a program already compiled is reused when
every committed argument sits where it uses it (so a training loop that feeds a step's
outputs back compiles once).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import re
import threading
import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh import _compat
from multimesh.arguments import (
    Call,
    DeletedArgument,
    Signature,
    abstract_leaf_key,
    as_named,
    broadcast_prefix,
    check_no_stage_axis,
    check_spec_rank,
    check_spec_value,
    deleted_error,
    fit_key_shardings,
    in_sharding_leaves,
    leaf_key,
    resolved_structs,
    spec_axes,
    trace_arg,
    traced_error,
)
from multimesh.compiler import conds, inline, label, layers, shardings
from multimesh.compiler.ir import FlatProgram, Labels
from multimesh.compiler.rules import Rules
from multimesh.mesh import MultiMesh, active_multimesh, reset_active, set_active
from multimesh.runtime import compiling
from multimesh.runtime.inputs import committed_sharding
from multimesh.stages import Compiled, Lowered, Traced, TracedCall
from multimesh.tasks import TraceState, trace_state, tracing

_compat.register_exclusion(__file__)

_SHARD_MAP_TRANSPOSE = (
    "mm.jit: code of a mesh= task whose mesh is not one of the MultiMesh's submeshes (a "
    "shard_map, or a sharding constraint differentiated inside mm.microbatch or a nested "
    "jax.jit) was differentiated: JAX transposes it outside the task, under the global "
    "mesh, whose size differs. Use a stage= task (or a mesh= task on exactly "
    "mmesh.submesh(i)) for that code, or mm.jit without a MultiMesh when every task has "
    "mesh=."
)

_SHARD_MAP_MESH = (
    "mm.jit: a shard_map was given a mesh= other than the one its code is traced under "
    "(in a stage= task, or a mesh= task on exactly mmesh.submesh(i), that is the global "
    "mesh, as under `with mmesh: jax.jit(f)`). Leave out shard_map's mesh=: inside a "
    "task it runs on the task's submesh."
)

_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


class MpmdFunction:
    """The result of :func:`jit`: traces per input signature, compiles, and runs."""

    def __init__(
        self,
        fun: Callable[..., Any],
        mesh: MultiMesh | None,
        task_rules: Any,
        static_argnums: Sequence[int] | None,
        static_argnames: Sequence[str] | None,
        donate_argnums: Sequence[int] | None,
        donate_argnames: Sequence[str] | None,
        in_shardings: Any,
        out_shardings: Any,
        compiler_options: dict[str, Any] | None = None,
    ) -> None:
        if not callable(fun):
            raise TypeError(f"mm.jit needs a callable, got {type(fun).__name__}.")
        if mesh is not None and not isinstance(mesh, MultiMesh):
            if isinstance(mesh, Mesh):
                raise TypeError(
                    "mm.jit(mesh=...) takes a MultiMesh; wrap the mesh: "
                    "mm.MultiMesh(mesh, stage_axis='stage'), or build it with mm.make_mesh."
                )
            raise TypeError(f"mm.jit(mesh=...) takes a MultiMesh, got {type(mesh).__name__}.")
        # an mm.jit object's own attributes are its settings, not function attributes to
        # carry over: mm.jit(mm.jit(f), task_rules=...) keeps the outer ones (as jax.jit)
        functools.update_wrapper(
            self, fun, updated=() if isinstance(fun, MpmdFunction) else ("__dict__",)
        )
        self._task_rules = task_rules
        if task_rules is not None:
            Rules(task_rules)  # validate early
        self.fun = fun
        self._mesh = mesh
        self._signature = Signature(
            fun, static_argnums, static_argnames, donate_argnums, donate_argnames
        )
        _check_sharding_tree(in_shardings, "in_shardings")
        _check_sharding_tree(out_shardings, "out_shardings")
        self._in_shardings = as_named(in_shardings, "mm.jit(in_shardings=...)")
        self._out_shardings = out_shardings
        self._compiler_options = dict(compiler_options or {})
        if mesh is not None:
            self._check_stage_axis(mesh)
        self._lock = threading.RLock()
        self._cache: dict[Hashable, Compiled] = {}  # full signature -> program
        self._variants: dict[Hashable, list[Compiled]] = {}  # abstract signature -> programs
        self._traces: dict[Hashable, Traced] = {}
        self._exe_cache: dict[Any, Any] = {}  # fragment -> XLA executable
        self._fun_name = getattr(fun, "__name__", type(fun).__name__)
        _compat.register_cache(self, f"mm.jit({self._fun_name})")  # jax.clear_caches()

    @property
    def multimesh(self) -> MultiMesh | None:
        return self._mesh if self._mesh is not None else active_multimesh()

    def _check_stage_axis(self, mmesh: MultiMesh) -> None:
        for what, tree in (
            ("in_shardings", self._in_shardings),
            ("out_shardings", self._out_shardings),
        ):
            for s in jax.tree_util.tree_leaves(tree, is_leaf=_is_spec):
                if isinstance(s, PartitionSpec):
                    check_no_stage_axis(s, mmesh.stage_axis, f"mm.jit({what}=...)")

    # -- keys and caches ----------------------------------------------------------------

    def _flatten(self, call: Call) -> tuple[list[Any], Any]:
        return jax.tree_util.tree_flatten((call.dyn_args, call.dyn_kwargs))

    def _keys(self, call: Call, flat: list[Any], structs: bool = True) -> list[tuple[Any, ...]]:
        try:
            return [leaf_key(x, structs) for x in flat]
        except TypeError as e:  # name the argument
            names = self._signature.leaf_names(call)
            for i, x in enumerate(flat):
                try:
                    leaf_key(x, structs)
                except TypeError:
                    raise TypeError(f"argument {names[i]}: {e}") from None
            raise
        except DeletedArgument:
            names = self._signature.leaf_names(call)
            bad = next(i for i, x in enumerate(flat) if isinstance(x, jax.Array) and x.is_deleted())
            raise deleted_error(names[bad]) from None

    def _mesh_key(self) -> Any:
        return 0 if self._mesh is not None else self.multimesh

    def _register(self, key: Hashable, compiled: Compiled) -> None:
        """Seed the call cache (``Lowered.compile`` calls this)."""
        with self._lock:
            old = self._cache.get(key)
            self._cache[key] = compiled
            variants = self._variants.setdefault(_abstract(key), [])
            if old is not None and old is not compiled:
                # replaced (lower().compile() again): forgotten unless another
                # signature still uses it, so repeated compiles do not pile up
                if all(c is not old for c in self._cache.values()):
                    variants[:] = [c for c in variants if c is not old]
            if all(c is not compiled for c in variants):
                variants.append(compiled)

    def _cache_size(self) -> int:
        """Distinct compiled programs (as ``jax.jit``'s ``_cache_size``)."""
        return len({id(c) for c in self._cache.values()})

    def clear_cache(self) -> None:
        """Forget every trace and compiled program."""
        with self._lock:
            self._cache.clear()
            self._variants.clear()
            self._traces.clear()
            self._exe_cache.clear()

    def cache_clear(self) -> None:
        """:meth:`clear_cache` (the name ``jax.clear_caches()`` calls)."""
        self.clear_cache()

    def __deepcopy__(self, memo: dict[int, Any]) -> MpmdFunction:
        """Itself, as ``copy.deepcopy`` treats functions (and ``jax.jit`` objects)."""
        return self

    # -- tracing ------------------------------------------------------------------------

    def _trace(self, call: Call, flat: list[Any], in_tree: Any, tkey: Hashable) -> Traced:
        traced = self._traces.get(tkey)
        if traced is not None:
            return traced
        mmesh = self.multimesh
        out_tree_box: list[Any] = []
        fun, rebuild, fname = self.fun, call.rebuild, self._fun_name

        def flat_fun(*leaves: Any) -> list[Any]:
            args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
            args, kwargs = rebuild(args, kwargs)
            out = fun(*args, **kwargs)
            paths, tree = jax.tree_util.tree_flatten_with_path(out)
            for path, leaf in paths:
                if not isinstance(leaf, _ARRAY_LIKE):
                    raise TypeError(
                        f"mm.jit: output{jax.tree_util.keystr(path)} of {fname!r} is a "
                        f"{type(leaf).__name__}, not an array. Return arrays (or pytrees of "
                        "arrays); keep other values outside the jitted function."
                    )
            out_tree_box.append(tree)
            return [leaf for _, leaf in paths]

        tok = set_active(mmesh)
        try:
            state = TraceState(mmesh)
            with (
                _compat.no_mesh_context(),
                _compat.traces_of_their_own(),
                tracing(state),
                contextlib.ExitStack() as es,
            ):
                if mmesh is not None:  # as in the reference, `with mmesh: jax.jit(f)`
                    es.enter_context(_compat.set_mesh(mmesh.mesh))
                try:
                    closed = jax.make_jaxpr(flat_fun)(*[trace_arg(x) for x in flat])
                    _compat.check_no_escaped_tracers(closed.consts)
                except Exception as e:  # JAX names our flat function: name the user's
                    if mmesh is not None and "use_abstract_mesh cannot change the size" in str(e):
                        raise ValueError(_SHARD_MAP_TRANSPOSE) from e
                    if mmesh is not None and "should match the mesh passed to shard_map" in str(e):
                        raise ValueError(_SHARD_MAP_MESH) from e
                    self._rename_in_error(e, call)
                    raise
        finally:
            reset_active(tok)
        rules = Rules(self._task_rules) if self._task_rules is not None else None
        chunks = (
            max([1] + [lp.schedule.chunks(mmesh.num_stages, 1 << 20) for lp in state.loops])
            if mmesh is not None
            else 1
        )
        if rules is not None and mmesh is None:
            raise ValueError("task_rules map scopes to stages: pass mesh=mmesh to mm.jit.")
        limit = mmesh.num_stages * chunks if mmesh is not None else 0
        prog: FlatProgram = inline.flatten(closed, rules, limit)
        if mmesh is not None:
            prog = shardings.stage_free_residuals(prog, mmesh.stage_axis, mmesh.num_stages)
            prog = conds.split_conds(prog)
            prog = layers.split_scans(prog, rules, mmesh.num_stages, limit)
        labels: Labels = label.label(prog, mmesh, rules, chunks)
        traced = Traced(
            jaxpr=closed,
            in_tree=in_tree,
            out_tree=out_tree_box[-1],
            out_avals=[v.aval for v in closed.jaxpr.outvars],
            loops=state.loops,
            prog=prog,
            labels=labels,
            scope_stages=dict(rules.assigned) if rules is not None else {},
        )
        self._traces[tkey] = traced
        return traced

    def _rename_in_error(self, e: Exception, call: Call) -> None:
        """JAX's tracing errors name the function it traced (our ``flat_fun``) and its
        flat arguments (``leaves[i]``): name the user's function and arguments instead,
        as ``jax.jit`` would (the exception keeps its type and traceback)."""
        if not e.args or not isinstance(e.args[0], str) or str(e) != e.args[0]:
            return
        text = e.args[0]
        # only JAX's own messages about our flat function (not the user's exceptions)
        ours = "MpmdFunction._trace.<locals>.flat_fun at 0x"  # its repr: <function ...>
        if not isinstance(e, OverflowError) and not (
            f"flat_fun at {__file__}" in text or ours in text
        ):
            return
        names = self._signature.leaf_names(call)
        text = re.sub(
            r"leaves\[(\d+)\]",
            lambda m: names[int(m.group(1))] if int(m.group(1)) < len(names) else m.group(0),
            text,
        )
        text = re.sub(
            r"<function MpmdFunction\._trace\.<locals>\.flat_fun at 0x[0-9a-fA-F]+>",
            lambda _m: repr(self.fun),
            text,
        )
        text = re.sub(r"\bflat_fun at \S+:\d+", _source_info(self.fun), text)
        text = re.sub(r"\bflat_fun\b", self._fun_name, text)
        e.args = (text, *e.args[1:])

    def _out_sharding_leaves(self, traced: Traced) -> list[Any]:
        n = traced.out_tree.num_leaves
        leaves = self._user_out_sharding_leaves(traced)
        mmesh = self.multimesh
        errors = _checkify_error_leaves(traced.out_tree)
        if errors and mmesh is not None:
            # a checkify.Error's leaves come from the tasks that check: together on one
            # submesh, so err.get() / err.throw() can combine them (as under jax.jit)
            home = NamedSharding(mmesh.submesh(0), PartitionSpec())
            leaves = list(leaves) if leaves is not None else [None] * n
            for i in errors:
                if leaves[i] is None:
                    leaves[i] = home
        return leaves if leaves is not None else [None] * n

    def _user_out_sharding_leaves(self, traced: Traced) -> list[Any] | None:
        n = traced.out_tree.num_leaves
        if self._out_shardings is None:
            return None
        dummy = jax.tree_util.tree_unflatten(traced.out_tree, [0] * n)
        leaves = broadcast_prefix(
            self._out_shardings, dummy, f"mm.jit(out_shardings=...) of {self._fun_name!r}"
        )
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]
        for path, s, aval in zip(paths, leaves, traced.out_avals):
            where = jax.tree_util.keystr(path) or "<root>"
            what = f"mm.jit(out_shardings=...) of {self._fun_name!r}: {s} for output {where}"
            shape = tuple(getattr(aval, "shape", ()))
            check_spec_rank(s, shape, what, "output")
            _check_divides(s, shape, what, traced.labels.targets)
        return leaves

    def _put_shardings(self, labels: Labels, call: Call, flat: list[Any]) -> list[Any]:
        """Per flat leaf: a function stage -> sharding for host inputs (or None)."""
        if self._in_shardings is None:
            return [None] * len(flat)
        names = self._signature.leaf_names(call)
        leaves = in_sharding_leaves(self._in_shardings, call, names)
        mmesh = self.multimesh
        stage_axis = mmesh.stage_axis if mmesh is not None else None
        for name, s, x in zip(names, leaves, flat):
            check_no_stage_axis(s, stage_axis, f"in_shardings for argument {name}")
            what = f"in_shardings for argument {name}: {s}"
            check_spec_rank(s, getattr(x, "shape", ()), what, "argument")
            if isinstance(s, NamedSharding):  # as jax.jit, also for an unused argument
                _check_divides(s, tuple(getattr(x, "shape", ())), f"in_shardings for argument {name}", ())

        global_ids = (
            frozenset(int(d.id) for d in mmesh.mesh.devices.flat) if mmesh is not None else None
        )

        def chooser(s: Any, name: str, shape: tuple[int, ...]) -> Any:
            if s is None:
                return None

            def pick(stage: int) -> Any:
                target = labels.targets[stage]
                mesh = target.mesh
                where = (
                    f"the submesh of stage {stage}"
                    if mmesh is not None and stage < mmesh.num_stages
                    else "the mesh of a mesh= task"
                )
                if isinstance(s, PartitionSpec):
                    spec = s
                elif isinstance(s, NamedSharding) and (
                    _compat.device_assignment_ids(s) == target.device_ids
                ):
                    return s
                elif isinstance(s, NamedSharding) and frozenset(
                    d.id for d in s.device_set
                ) in (frozenset(target.device_ids), global_ids):
                    spec = s.spec  # the global mesh, or the submesh in another order
                else:
                    raise ValueError(
                        f"in_shardings for argument {name}: {s} (devices "
                        f"{sorted(int(d.id) for d in s.device_set)}) is not on the submesh that "
                        f"uses it ({where}, devices {list(target.device_ids)}) nor on another "
                        "of the program's submeshes; give a PartitionSpec, or a NamedSharding "
                        "on the global mesh or on one submesh."
                    )
                missing = [a for a in sorted(spec_axes(spec)) if a not in mesh.axis_names]
                if missing:
                    raise ValueError(
                        f"in_shardings for argument {name}: {spec} names {missing}, which "
                        f"{where} (axes {tuple(mesh.axis_names)}) lacks."
                    )
                out = NamedSharding(mesh, spec)
                try:  # as jax.jit: a spec that does not divide the argument names it
                    out.shard_shape(shape)
                except ValueError as e:
                    raise type(e)(f"in_shardings for argument {name} ({where}): {e}") from None
                return out

            return pick

        return [
            chooser(s, n, tuple(getattr(x, "shape", ())))
            for s, n, x in zip(leaves, names, flat)
        ]

    def _pinned(self, labels: Labels, call: Call, flat: list[Any]) -> list[tuple[int, bool] | None]:
        """Per flat leaf: the submesh its ``in_shardings`` entry names (a NamedSharding on
        exactly one plan submesh's devices, in any order) and whether the argument is to
        be put there, or None. A host value is put there (and moved to the stages that
        use it); a committed array must have that layout, as ``jax.jit`` requires (on
        other devices it is moved, as ``jax.jit`` does)."""
        if self._in_shardings is None:
            return [None] * len(flat)
        names = self._signature.leaf_names(call)
        leaves = in_sharding_leaves(self._in_shardings, call, names)
        by_devs = {frozenset(t.device_ids): t.index for t in labels.targets}
        mmesh = self.multimesh
        everywhere = frozenset(int(d.id) for d in mmesh.mesh.devices.flat) if mmesh else None
        out: list[tuple[int, bool] | None] = []
        for name, s, x in zip(names, leaves, flat):
            devs = frozenset(int(d.id) for d in s.device_set) if isinstance(s, NamedSharding) else None
            pin = by_devs.get(devs) if devs is not None else None
            have = committed_sharding(x)
            if devs is None or devs == everywhere or have is None:
                # (a global-mesh entry means the submesh that uses the value)
                out.append(None if pin is None else (pin, True))
                continue
            ndim = len(getattr(x, "shape", ()))
            if not _compat.same_layout_any_devices(have, s, ndim):
                raise ValueError(
                    f"in_shardings for argument {name}: {s} (devices "
                    f"{list(_compat.device_assignment_ids(s))}) does not match the sharding "
                    f"of the argument, {have} (devices "
                    f"{list(_compat.device_assignment_ids(have))}) (as with jax.jit, a "
                    "committed array must have its in_shardings' layout); jax.device_put it "
                    "there first, or give a PartitionSpec (the submesh that uses it)."
                )
            same = _compat.device_assignment_ids(have) == _compat.device_assignment_ids(s)
            if not same and jax.process_count() > 1:
                raise ValueError(
                    f"in_shardings for argument {name}: the argument is committed to other "
                    f"devices ({list(_compat.device_assignment_ids(have))}) than {s} "
                    f"(devices {list(_compat.device_assignment_ids(s))}); a multi-process "
                    "run cannot move a committed array between devices for you (no "
                    "cross-process device_put on this backend): pass it uncommitted (a "
                    "host value, put where in_shardings says) or with that sharding."
                )
            out.append(None if pin is None else (pin, not same))
        return out

    # -- entry points -----------------------------------------------------------------

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any], structs: bool = True):
        call = self._signature.normalize(args, kwargs)
        flat, in_tree = self._flatten(call)
        fit_key_shardings(flat)
        keys = self._keys(call, flat, structs)
        # JAX's settings too (x64, dtype promotion, threefry_partitionable): as jax.jit
        key = (in_tree, call.static, self._mesh_key(), tuple(keys), _compat.trace_context())
        return call, flat, in_tree, keys, key

    @_compat.api_boundary
    def lower(self, /, *args: Any, **kwargs: Any) -> Lowered:
        """Trace and plan for these arguments (arrays, or ``jax.ShapeDtypeStruct``s with
        or without shardings); ``.compile()`` compiles the fragments."""
        call, flat, in_tree, _keys, key = self._prepare(args, kwargs)
        return self._lower(call, resolved_structs(flat), in_tree, key)

    @_compat.api_boundary
    def trace(self, /, *args: Any, **kwargs: Any) -> TracedCall:
        """Trace for these arguments (as ``jax.jit(f).trace``): the jaxpr and the output
        shapes, before placement; ``.lower()`` plans it."""
        call, flat, in_tree, _keys, key = self._prepare(args, kwargs)
        flat = resolved_structs(flat)
        with compiling.gc_paused():
            traced = self._trace(call, flat, in_tree, _abstract(key))
        return TracedCall(self, call, flat, traced, key)

    def _lower(self, call: Call, flat: list[Any], in_tree: Any, key: Hashable) -> Lowered:
        # planning builds jaxprs of its own (packing, layer splits): not under the
        # caller's mesh (an Explicit one would be recorded in their equations)
        with compiling.gc_paused(), _compat.no_mesh_context():
            traced = self._trace(call, flat, in_tree, _abstract(key))
            return Lowered(self, call, flat, traced, key, self._out_sharding_leaves(traced))

    def _compiled_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]):
        call, flat, in_tree, keys, key = self._prepare(args, kwargs, structs=False)
        compiled = self._cache.get(key)
        if compiled is None:
            with self._lock:
                compiled = self._cache.get(key)
                if compiled is None:
                    for c in self._variants.get(_abstract(key), ()):
                        if c.accepts(keys):
                            # other processes must pick this program too
                            c._check_same_plan()
                            compiled = c
                            self._cache[key] = c
                            break
                if compiled is None:
                    compiled = self._lower(call, flat, in_tree, key)._compile(None, for_call=True)
        return compiled, flat

    @_compat.api_boundary
    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if _compat.jit_disabled():  # as jax.jit: plain Python, tasks transparent
            return self._run_eagerly(args, kwargs)
        if _compat.tracing():  # inside jax.jit / scan, even with concrete arguments
            if trace_state() is not None:  # inside another mm.jit: one program
                return self._inline(args, kwargs)
            return self._abstract_call(args, kwargs)
        compiled, flat = self._compiled_for(args, kwargs)
        return compiled.call_flat(flat)

    def _abstract_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called under another transformation: an opaque equation with this function's
        output types, so tracing-only uses (``jax.eval_shape(f, ...)``,
        ``jax.make_jaxpr``) work as with a ``jax.jit`` function; running it inside another
        program, differentiating or batching it raises (mm.jit must be outermost)."""

        def struct(x: Any) -> Any:
            if isinstance(x, jax.core.Tracer):
                aval = x.aval
                return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
            return x

        sig = self._signature
        neg = {i + len(args) for i in sig.static_argnums if i < 0}
        static = [(f"argument {i}", a) for i, a in enumerate(args) if i in sig.static_pos | neg]
        static += [(f"argument {k!r}", v) for k, v in kwargs.items() if k in sig.static_names]
        for what, v in static:
            if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(v)):
                raise TypeError(
                    f"{_source_info(self.fun)}: static {what} is a traced value. "
                    "jax.eval_shape traces every argument of a function that is not a jax.jit "
                    "function: use f.eval_shape(...), which keeps static arguments static."
                )
        outs = self.eval_shape(*jax.tree.map(struct, args), **jax.tree.map(struct, kwargs))
        call = sig.normalize(args, kwargs)
        leaves = jax.tree.leaves((call.dyn_args, call.dyn_kwargs))
        flat, tree = jax.tree.flatten(outs)
        res = _compat.abstract_call(leaves, flat, _source_info(self.fun), traced_error)
        return jax.tree.unflatten(tree, res)

    def _run_eagerly(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fun(*args, **kwargs)`` as plain JAX (the reference), under this function's
        MultiMesh: what a call does under ``jax.disable_jit()``."""
        return self._in_multimesh(lambda: self.fun(*args, **kwargs))

    def _in_multimesh(self, run: Callable[[], Any]) -> Any:
        """``run()`` under this function's MultiMesh (its mesh the current JAX mesh, so a
        bare ``PartitionSpec`` means what it means in a call)."""
        mmesh = self.multimesh
        if mmesh is None:
            return run()
        if not _compat.tracing():
            with mmesh:
                return run()
        # under jax.grad / vmap (which disable_jit leaves tracing): JAX refuses set_mesh
        tok = set_active(mmesh)
        try:
            with _compat.mesh_context(mmesh.mesh):
                return run()
        finally:
            reset_active(tok)

    def _inline(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Called while another ``mm.jit`` function traces: part of that program (as a
        ``jax.jit`` function inside another), on that function's MultiMesh."""
        outer = trace_state().multimesh  # type: ignore[union-attr]
        if self._mesh is not None and self._mesh != outer:
            where = f"on another MultiMesh ({outer})" if outer is not None else "without one"
            raise ValueError(
                f"mm.jit function {self._fun_name!r} (mesh={self._mesh}) is called inside "
                f"an mm.jit function traced {where}; give the outer mm.jit the same mesh "
                "(the inner one becomes part of its program), or call the inner "
                "function's .fun."
            )
        given = [
            name
            for name, v in (
                ("task_rules", self._task_rules),
                ("in_shardings", self._in_shardings),
                ("out_shardings", self._out_shardings),
            )
            if v is not None
        ]
        if given:
            raise ValueError(
                f"mm.jit function {self._fun_name!r} is called inside another mm.jit "
                f"function, whose program it becomes part of; its {' and '.join(given)} "
                "would not apply there: give them to the outer mm.jit (or use sharding "
                "constraints), or call the inner function's .fun."
            )
        self._signature.normalize(args, kwargs)  # the same argument checks as a call
        return self.fun(*args, **kwargs)

    @_compat.api_boundary
    def record(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Like calling, but also returns the measured timeline of this step (see
        :meth:`Compiled.record`). Compiles first if needed; compilation is not part of
        the timeline."""
        compiled, flat = self._compiled_for(args, kwargs)
        return compiled.record_flat(flat)

    @_compat.api_boundary
    def eval_shape(self, /, *args: Any, **kwargs: Any) -> Any:
        """The outputs' shapes and dtypes (tasks are transparent: no compilation), traced
        under this function's MultiMesh as a call is. Static arguments are passed as they
        are, as by ``jax.jit(...).eval_shape``."""
        call = self._signature.normalize(args, kwargs)

        def dynamic(dargs: tuple[Any, ...], dkw: dict[str, Any]) -> Any:
            full, kw = call.rebuild(dargs, dkw)
            return self.fun(*full, **kw)

        return self._in_multimesh(lambda: jax.eval_shape(dynamic, call.dyn_args, call.dyn_kwargs))

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a method (``@partial(mm.jit, static_argnums=0)`` on a class): bound to the
        instance, like a ``jax.jit`` function."""
        if obj is None:
            return self
        return types.MethodType(self, obj)


def _source_info(fun: Any) -> str:
    """``name at file:line`` of a function, as JAX's tracing errors name it."""
    while isinstance(fun, functools.partial):
        fun = fun.func
    fun = getattr(fun, "fun", fun)  # an mm.jit function: its Python function
    try:
        fun = inspect.unwrap(fun)
        code = fun.__code__
        return f"{fun.__name__} at {code.co_filename}:{code.co_firstlineno}"
    except (AttributeError, ValueError):
        return getattr(fun, "__name__", type(fun).__name__)


def _abstract(key: Hashable) -> Hashable:
    """The part of a signature that tracing depends on (no placements)."""
    in_tree, static, mesh_key, keys, settings = key  # type: ignore[misc]
    return (in_tree, static, mesh_key, tuple(abstract_leaf_key(k) for k in keys), settings)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, jax.sharding.Sharding))


def _checkify_error_leaves(out_tree: Any) -> list[int]:
    """Flat output positions of the leaves of ``checkify.Error`` values (none unless
    the program imported checkify)."""
    error = _compat.checkify_error_type()
    if error is None:
        return []
    n = out_tree.num_leaves
    dummy = jax.tree_util.tree_unflatten(out_tree, list(range(n)))
    out: list[int] = []
    for node in jax.tree_util.tree_leaves(dummy, is_leaf=lambda x: isinstance(x, error)):
        if isinstance(node, error):
            out.extend(jax.tree_util.tree_leaves(node))
    return out


def _check_sharding_tree(tree: Any, what: str) -> None:
    for s in jax.tree_util.tree_leaves(tree, is_leaf=_is_spec):
        check_spec_value(s, f"mm.jit({what}=...)")


def _check_divides(s: Any, shape: tuple[int, ...], what: str, targets: Sequence[Any]) -> None:
    """As jax.jit, before compiling: a sharding that does not divide its value is jax's
    ``IndivisibleError`` (a ``ValueError``), named by ``what`` (an output's named a line
    of MultiMesh's compile). A bare spec is refused only if no mesh of ``targets`` with
    its axes could lay the value out so."""
    if isinstance(s, PartitionSpec):
        meshes = [t.mesh for t in targets if spec_axes(s) <= set(t.mesh.axis_names)]
        cands = [NamedSharding(m, s) for m in meshes]
    elif isinstance(s, NamedSharding):
        cands = [s]
    else:
        return
    errors = []
    for c in cands:
        try:
            c.shard_shape(shape)
            return
        except ValueError as e:
            errors.append(e)
    if errors:
        raise type(errors[0])(f"{what}: {errors[0]}") from None


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    mesh: MultiMesh | None = None,
    task_rules: Any = None,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    in_shardings: Any = None,
    out_shardings: Any = None,
    keep_unused: bool = False,
    compiler_options: dict[str, Any] | None = None,
) -> Any:
    """Compile ``fun`` as one MPMD program whose tasks run on their submeshes.

    Arguments mean what they mean for ``jax.jit``: ``static_argnums``/``static_argnames``
    (hashable, part of the cache key; negative indices count from the end),
    ``donate_argnums``/``donate_argnames`` (buffers reused by the program; donated
    arrays are deleted), ``in_shardings`` (where host inputs are put: one entry for all
    arguments or a tuple with a pytree prefix per positional argument; a bare
    ``PartitionSpec`` means the submesh that uses the value) and ``out_shardings`` (a
    pytree prefix of the outputs: a ``PartitionSpec`` on the producing submesh, a
    ``NamedSharding`` on a submesh or on the global mesh, ``None`` = where produced).
    ``mesh`` is the MultiMesh (default: the one active via ``with mmesh:``);
    ``task_rules`` ``{regex: stage}`` place named scopes without editing the model;
    ``compiler_options`` go to every fragment's XLA compilation. ``keep_unused`` is
    accepted as in ``jax.jit``: an argument the program does not use is never moved
    or passed to a fragment either way, and a donated one is deleted (as jax.jit with
    ``keep_unused=True``). Without ``fun``, returns a decorator (``@mm.jit(mesh=m)``).
    """
    if fun is None:
        return functools.partial(
            jit,
            mesh=mesh,
            task_rules=task_rules,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            donate_argnames=donate_argnames,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            keep_unused=keep_unused,
            compiler_options=compiler_options,
        )
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise TypeError(
            f"mm.jit(compiler_options=...) takes a dict of XLA options, got "
            f"{type(compiler_options).__name__}."
        )

    def nums(v: Any) -> tuple[int, ...] | None:  # as jax.jit: None, an index, or indices
        if v is None:
            return None
        try:
            return (operator.index(v),)
        except TypeError:
            return tuple(operator.index(i) for i in v)

    def names(v: Any, what: str) -> tuple[str, ...] | None:
        if v is None:
            return None
        out = (v,) if isinstance(v, str) else tuple(v)
        bad = [n for n in out if not isinstance(n, str)]
        if bad:  # as jax.jit: a TypeError
            raise TypeError(f"mm.jit({what}=...) takes parameter names (str), got {bad[0]!r}.")
        return out

    return MpmdFunction(
        fun,
        mesh,
        task_rules,
        nums(static_argnums),
        names(static_argnames, "static_argnames"),
        nums(donate_argnums),
        names(donate_argnames, "donate_argnames"),
        in_shardings,
        out_shardings,
        compiler_options,
    )
