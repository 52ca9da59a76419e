"""``mm.jit``: trace once per input signature, split per submesh, compile, run.

``mm.jit(fun, mesh=mmesh)`` returns an :class:`MpmdFunction`. Calling it traces ``fun``
(tasks set the abstract mesh to their submesh), runs the compiler passes (flatten,
label, place, fragment, plan), compiles each fragment for its submesh, and runs the
plan. Results are cached by input signature (tree structure, shapes, dtypes, weak
types, shardings of committed arrays, static arguments), like ``jax.jit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from multimesh import _compat
from multimesh.compiler import fragment as frag_pass
from multimesh.compiler import inline, label, place
from multimesh.compiler import plan as plan_pass
from multimesh.compiler.ir import FlatProgram, Labels
from multimesh.compiler.rules import Rules
from multimesh.mesh import MultiMesh, active_multimesh, reset_active, set_active
from multimesh.runtime.executor import Executable
from multimesh.runtime.inputs import InputInfo, analyze
from multimesh.tasks import TraceState, tracing

_compat.register_exclusion(__file__)


def _leaf_key(x: Any) -> Hashable:
    if isinstance(x, jax.Array):
        committed = getattr(x, "committed", False)
        return (
            x.shape,
            x.dtype,
            bool(getattr(x.aval, "weak_type", False)),
            x.sharding if committed else None,
        )
    if isinstance(x, np.ndarray):
        return (x.shape, x.dtype, False, None)
    if isinstance(x, (bool, int, float, complex)):
        return (type(x),)
    if isinstance(x, np.generic):
        return ((), x.dtype, False, None)
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    return (aval.shape, aval.dtype, getattr(aval, "weak_type", False), None)


def _trace_arg(x: Any) -> Any:
    """Trace on shape and dtype only: where an input lives is the planner's business,
    and avals carrying a submesh would clash with the mesh the program is traced on."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, weak_type=bool(getattr(x.aval, "weak_type", False))
        )
    return x


@dataclasses.dataclass
class _Call:
    """A normalised call: static arguments split from dynamic ones."""

    dyn_args: tuple[Any, ...]
    dyn_kwargs: dict[str, Any]
    static: tuple[Any, ...]
    rebuild: Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


class Lowered:
    """A traced and planned MPMD program (not yet compiled for XLA)."""

    def __init__(self, fn: MpmdFunction, call: _Call, flat: list[Any], in_tree: Any) -> None:
        self._fn = fn
        self._flat = flat
        self._in_tree = in_tree
        self._call = call
        mmesh = fn.multimesh
        self.out_tree: Any = None

        def flat_fun(*leaves: Any) -> list[Any]:
            args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
            args, kwargs = call.rebuild(args, kwargs)
            out = fn.fun(*args, **kwargs)
            outs, self.out_tree = jax.tree_util.tree_flatten(out)
            return outs

        tok = set_active(mmesh)
        try:
            state = TraceState(mmesh)
            with _compat.no_mesh_context(), tracing(state), contextlib.ExitStack() as es:
                if mmesh is not None:  # as in the reference, `with mmesh: jax.jit(f)`
                    es.enter_context(_compat.use_abstract_mesh(mmesh.mesh.abstract_mesh))
                closed = jax.make_jaxpr(flat_fun)(*[_trace_arg(x) for x in flat])
        finally:
            reset_active(tok)
        self.jaxpr = closed
        prog: FlatProgram = inline.flatten(closed)
        rules = Rules(fn._task_rules) if fn._task_rules is not None else None
        chunks = (
            max([1] + [lp.schedule.chunks(mmesh.num_stages, 1 << 20) for lp in state.loops])
            if mmesh is not None
            else 1
        )
        labels: Labels = label.label(prog, mmesh, rules, chunks)
        self.scope_stages: dict[str, int] = dict(rules.assigned) if rules is not None else {}
        stage_axis = mmesh.stage_axis if mmesh is not None else None
        self.input_infos: list[InputInfo] = [analyze(x, labels.targets, stage_axis) for x in flat]
        default = (
            min(s for s in labels.stages if s is not None)
            if any(s is not None for s in labels.stages)
            else 0
        )
        placement = place.place(prog, labels, [i.loc for i in self.input_infos], default)
        frags = frag_pass.fragment(prog, placement, labels, state.loops)
        self.plan: plan_pass.Plan = plan_pass.build_plan(
            prog, labels, placement, frags, [i.mode for i in self.input_infos]
        )
        self._prog, self._labels = prog, labels

    def as_text(self) -> str:
        """A readable listing of the plan: fragments, devices and transfers (and, with
        ``task_rules``, which scope went to which stage)."""
        text = self.plan.as_text()
        if self.scope_stages:
            rows = [f"  {scope!r} -> stage {st}" for scope, st in sorted(self.scope_stages.items())]
            text += "\ntask_rules placed scopes:\n" + "\n".join(rows)
        return text

    def compile(self) -> Compiled:
        """Compile every fragment with XLA for its submesh."""
        fn = self._fn
        mmesh = fn.multimesh
        put_sh = fn._put_shardings(self._labels, self._in_tree, len(self._flat))
        donated = fn._donated_leaves(self._call, self._in_tree)
        exe = Executable(
            self._prog,
            self._labels,
            self.plan,
            self.input_infos,
            self._flat,
            put_sh,
            donated,
            mmesh.stage_axis if mmesh is not None else None,
            mmesh.mesh if mmesh is not None else None,
        )
        return Compiled(exe, self.out_tree, self.plan, fn)


class Compiled:
    """A compiled MPMD program; call it like the original function."""

    def __init__(
        self, exe: Executable, out_tree: Any, plan: plan_pass.Plan, fn: MpmdFunction
    ) -> None:
        self._exe = exe
        self._out_tree = out_tree
        self.plan = plan
        self._fn = fn

    def as_text(self) -> str:
        return self.plan.as_text()

    def call_flat(self, flat: Sequence[Any]) -> Any:
        outs = self._exe(flat)
        return jax.tree_util.tree_unflatten(self._out_tree, outs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self._fn._normalize(args, kwargs)
        flat, _ = jax.tree_util.tree_flatten((call.dyn_args, call.dyn_kwargs))
        return self.call_flat(flat)

    @property
    def num_executables(self) -> int:
        """Distinct XLA executables (identical fragments share one)."""
        return self._exe.num_executables

    def record(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Run once and return ``(outputs, timeline)``: a measured
        :class:`multimesh.schedules.Timeline` (per-fragment start/end in µs, peak live
        bytes and microbatches per submesh), plottable and exportable as a Chrome trace."""
        call = self._fn._normalize(args, kwargs)
        flat, _ = jax.tree_util.tree_flatten((call.dyn_args, call.dyn_kwargs))
        outs, tl = self._exe.record(flat)
        return jax.tree_util.tree_unflatten(self._out_tree, outs), tl


class MpmdFunction:
    """The result of :func:`jit`: traces per input signature, compiles, and runs."""

    def __init__(
        self,
        fun: Callable[..., Any],
        mesh: MultiMesh | None,
        task_rules: Any,
        static_argnums: Sequence[int],
        static_argnames: Sequence[str],
        donate_argnums: Sequence[int],
        in_shardings: Any,
        out_shardings: Any,
    ) -> None:
        if mesh is not None and not isinstance(mesh, MultiMesh):
            if isinstance(mesh, Mesh):
                raise TypeError(
                    "mm.jit(mesh=...) takes a MultiMesh; wrap the mesh: "
                    "mm.MultiMesh(mesh, stage_axis='stage'), or build it with mm.make_mesh."
                )
            raise TypeError(f"mm.jit(mesh=...) takes a MultiMesh, got {type(mesh).__name__}.")
        self._task_rules = task_rules
        if task_rules is not None:
            Rules(task_rules)  # validate early
        if out_shardings is not None:
            raise NotImplementedError(
                "out_shardings is not supported yet: outputs stay on the submesh that "
                "produced them; use jax.device_put on the results to move them."
            )
        functools.update_wrapper(self, fun)
        self.fun = fun
        self._mesh = mesh
        self._static_argnums = tuple(int(i) for i in static_argnums)
        self._static_argnames = tuple(static_argnames)
        self._donate_argnums = tuple(int(i) for i in donate_argnums)
        self._in_shardings = in_shardings
        self._cache: dict[Hashable, Compiled] = {}
        try:
            self._sig = inspect.signature(fun)
        except (TypeError, ValueError):
            self._sig = None
        params = list(self._sig.parameters) if self._sig is not None else []
        self._static_names = set(self._static_argnames) | {
            params[i] for i in self._static_argnums if i < len(params)
        }
        self._static_pos = set(self._static_argnums) | {
            i for i, p in enumerate(params) if p in self._static_argnames
        }

    @property
    def multimesh(self) -> MultiMesh | None:
        return self._mesh if self._mesh is not None else active_multimesh()

    # -- arguments --------------------------------------------------------------------

    def _normalize(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
        static_pos = sorted(i for i in self._static_pos if i < len(args))
        statics = tuple((i, args[i]) for i in static_pos)
        skw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_names))
        dyn_args = tuple(a for i, a in enumerate(args) if i not in self._static_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_names}
        try:
            hash((statics, skw))
        except TypeError as e:
            raise TypeError(
                f"static arguments of mm.jit must be hashable; got {statics + skw}"
            ) from e
        nargs = len(args)

        def rebuild(dargs: tuple[Any, ...], dkw: dict[str, Any]):
            it = iter(dargs)
            sd = dict(statics)
            full = tuple(sd[i] if i in sd else next(it) for i in range(nargs))
            return full, {**dkw, **dict(skw)}

        return _Call(dyn_args, dyn_kwargs, (statics, skw, nargs), rebuild)

    def _donated_leaves(self, call: _Call, in_tree: Any) -> frozenset[int]:
        if not self._donate_argnums:
            return frozenset()
        out: set[int] = set()
        pos = 0
        dyn_index = [i for i in range(call.static[2]) if i not in self._static_pos]
        for k, a in enumerate(call.dyn_args):
            n = len(jax.tree_util.tree_leaves(a))
            if dyn_index[k] in self._donate_argnums:
                out.update(range(pos, pos + n))
            pos += n
        return frozenset(out)

    def _put_shardings(self, labels: Labels, in_tree: Any, n: int) -> list[Any]:
        """Per flat leaf: a function stage -> sharding for host inputs (or None)."""
        if self._in_shardings is None:
            return [None] * n
        args_tree, _kw = jax.tree_util.tree_unflatten(in_tree, [0] * n)
        specs = self._in_shardings
        if not isinstance(specs, (tuple, list)) or len(specs) != len(args_tree):
            specs = (specs,) * len(args_tree) if not isinstance(specs, (tuple, list)) else specs
        leaves: list[Any] = []
        for a, s in zip(args_tree, specs):
            nleaves = len(jax.tree_util.tree_leaves(a))
            if s is None or isinstance(s, (NamedSharding, jax.sharding.PartitionSpec)):
                leaves.extend([s] * nleaves)
            else:
                sl = jax.tree_util.tree_leaves(
                    s,
                    is_leaf=lambda x: (
                        x is None or isinstance(x, (NamedSharding, jax.sharding.PartitionSpec))
                    ),
                )
                leaves.extend(sl if len(sl) == nleaves else [None] * nleaves)
        stage_axis = self.multimesh.stage_axis if self.multimesh is not None else None

        def chooser(s: Any) -> Any:
            if s is None:
                return None

            def pick(stage: int) -> Any:
                mesh = labels.targets[stage].mesh
                if isinstance(s, jax.sharding.PartitionSpec):
                    return NamedSharding(mesh, s)
                if stage_axis is not None and stage_axis in s.mesh.axis_names:
                    return NamedSharding(mesh, s.spec)
                if frozenset(d.id for d in s.device_set) == frozenset(
                    labels.targets[stage].device_ids
                ):
                    return s
                return NamedSharding(mesh, s.spec)

            return pick

        return [chooser(s) for s in leaves]

    # -- entry points -----------------------------------------------------------------

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Trace and plan for these arguments (no XLA compilation yet)."""
        call = self._normalize(args, kwargs)
        flat, in_tree = jax.tree_util.tree_flatten((call.dyn_args, call.dyn_kwargs))
        return Lowered(self, call, flat, in_tree)

    def _compiled_for(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Compiled, list[Any]]:
        call = self._normalize(args, kwargs)
        flat, in_tree = jax.tree_util.tree_flatten((call.dyn_args, call.dyn_kwargs))
        key = (
            in_tree,
            call.static,
            id(self.multimesh) if self._mesh is None else 0,
            tuple(_leaf_key(x) for x in flat),
        )
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = Lowered(self, call, flat, in_tree).compile()
            self._cache[key] = compiled
        return compiled, flat

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled, flat = self._compiled_for(args, kwargs)
        return compiled.call_flat(flat)

    def record(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Like calling, but also returns the measured timeline of this step
        (see :meth:`Compiled.record`)."""
        compiled, _ = self._compiled_for(args, kwargs)
        return compiled.record(*args, **kwargs)


def jit(
    fun: Callable[..., Any],
    *,
    mesh: MultiMesh | None = None,
    task_rules: Any = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    in_shardings: Any = None,
    out_shardings: Any = None,
) -> MpmdFunction:
    """Compile ``fun`` as one MPMD program whose tasks run on their submeshes."""
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    return MpmdFunction(
        fun,
        mesh,
        task_rules,
        static_argnums,
        static_argnames,
        donate_argnums,
        in_shardings,
        out_shardings,
    )
