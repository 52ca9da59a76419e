"""Staged compilation, as in ``jax.stages``: ``TracedCall`` (traced), ``Lowered`` (traced
and planned) and ``Compiled`` (every fragment compiled by XLA for its submesh).

``mm.jit(f).lower(*args)`` gives a :class:`Lowered`: its ``plan`` says which fragment
runs where and what moves between submeshes. ``.compile()`` gives a :class:`Compiled`,
callable with the same (non-static) arguments, checked like ``jax.stages.Compiled``
checks them, and reporting XLA's memory and cost analyses per fragment and per submesh.
Compiling also seeds the ``mm.jit`` object's call cache, so the first call with the same
signature compiles nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from multimesh import _compat
from multimesh.arguments import (
    Call,
    DeletedArgument,
    check_call_types,
    deleted_error,
    is_extended,
    leaf_key,
    placement_text,
    traced_error,
)
from multimesh.compiler import accumulate, host_inputs, keys, layers, pack, place
from multimesh.compiler import fragment as frag_pass
from multimesh.compiler import label as label_pass
from multimesh.compiler import plan as plan_pass
from multimesh.compiler.ir import ANY, FlatProgram, Labels
from multimesh.runtime import compiling
from multimesh.runtime.executor import Executable
from multimesh.runtime.inputs import InputInfo, analyze, committed_sharding

if TYPE_CHECKING:
    from multimesh.api import MpmdFunction

_compat.register_exclusion(__file__)


@dataclasses.dataclass
class Traced:
    """A traced program, shared by every placement of the same input signature."""

    jaxpr: Any  # the closed jaxpr, as traced
    in_tree: Any
    out_tree: Any
    out_avals: list[Any]
    loops: list[Any]
    prog: FlatProgram
    labels: Labels
    scope_stages: dict[str, int]


class _ArgsInfo:
    """``args_info``, ``in_avals`` and ``donate_argnums`` as on ``jax.stages`` objects,
    from ``_arg_avals`` (flat) and ``_donated`` (flat indices)."""

    in_tree: Any
    _arg_avals: list[Any]
    _donated: frozenset[int]

    @property
    def args_info(self) -> Any:
        """A pytree of ``jax.stages.ArgInfo`` (shape, dtype, donated) for the arguments."""
        return jax.tree_util.tree_unflatten(
            self.in_tree,
            [_compat.arg_info(a, i in self._donated) for i, a in enumerate(self._arg_avals)],
        )

    @property
    def in_avals(self) -> Any:
        """A pytree of the arguments' abstract values."""
        return jax.tree_util.tree_unflatten(self.in_tree, list(self._arg_avals))

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        """Flat indices of the donated arguments."""
        return tuple(sorted(self._donated))


class TracedCall(_ArgsInfo):
    """``mm.jit(f).trace(*args)``: the traced program before placement, as
    ``jax.stages.Traced`` (``jaxpr``, ``out_info``, ``args_info``; ``lower()`` plans it)."""

    def __init__(self, fn: MpmdFunction, call: Call, flat: list[Any], traced: Traced, key: Any):
        self._fn, self._call, self._flat, self._key = fn, call, flat, key
        self._traced = traced
        self.jaxpr = traced.jaxpr
        self.in_tree = traced.in_tree
        self.out_tree = traced.out_tree
        self._arg_avals = list(traced.jaxpr.in_avals)
        self._donated = frozenset(fn._signature.donated_leaves(call))
        self.fun_name = fn._fun_name

    @property
    def out_info(self) -> Any:
        """The outputs' shapes and dtypes, as a pytree of ``jax.ShapeDtypeStruct``."""
        return _out_info(self._traced)

    @property
    def out_avals(self) -> Any:
        """The outputs' abstract values, as a pytree (``jax.stages.Traced.out_avals``)."""
        return jax.tree_util.tree_unflatten(self.out_tree, list(self._traced.out_avals))

    def lower(self, *, lowering_platforms: tuple[str, ...] | None = None) -> Lowered:
        """Place and plan the traced program (see :class:`Lowered`). Each fragment is
        lowered for its submesh's devices: ``lowering_platforms`` (as in
        ``jax.stages.Traced.lower``) may only name their platform."""
        if lowering_platforms is not None:
            have = sorted({d.platform for d in self._fn.multimesh.devices})
            want = [lowering_platforms] if isinstance(lowering_platforms, str) else list(
                lowering_platforms
            )
            if sorted(set(want)) != have:
                raise ValueError(
                    f"mm.jit function {self.fun_name!r}: lowering_platforms={want!r}, but "
                    f"its fragments are lowered for the MultiMesh's devices ({have}): "
                    "lowering for other platforms is not supported. Lower it on a "
                    "MultiMesh of those devices, or omit lowering_platforms."
                )
        return self._fn._lower(self._call, self._flat, self.in_tree, self._key)


def _out_info(traced: Traced) -> Any:
    return jax.tree_util.tree_unflatten(
        traced.out_tree,
        [
            jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
            for a in traced.out_avals
        ],
    )


class Lowered(_ArgsInfo):
    """A traced and planned MPMD program (not yet compiled by XLA)."""

    def __init__(
        self,
        fn: MpmdFunction,
        call: Call,
        flat: list[Any],
        traced: Traced,
        key: Any,
        out_shardings: list[Any],
    ) -> None:
        self._fn, self._call, self._flat, self._key = fn, call, flat, key
        self._traced = traced
        self._out_shardings = out_shardings
        self.jaxpr = traced.jaxpr
        self.in_tree = traced.in_tree
        self._arg_avals = list(traced.jaxpr.in_avals)
        self._donated = frozenset(fn._signature.donated_leaves(call))
        self.out_tree = traced.out_tree
        self.scope_stages = traced.scope_stages
        mmesh = fn.multimesh
        prog, labels = traced.prog, traced.labels
        stage_axis = mmesh.stage_axis if mmesh is not None else None
        # stacked layers split over stages: stage-sharded arguments enter as their
        # per-stage rows, and split outputs leave as one stage-sharded array
        arg_shardings = [committed_sharding(x) for x in flat]
        prog, self._pieces, keep = layers.bind_stage_inputs(
            prog, arg_shardings, stage_axis, labels.targets, out_shardings
        )
        if self._pieces:
            labels = labels.select(keep)
        # slices of host arguments (microbatches of a NumPy batch) are cut on the host
        put_sh = fn._put_shardings(labels, call, flat)
        eligible = [
            sh is None and put is None and not is_extended(getattr(x, "dtype", None))
            for x, sh, put in zip(flat, arg_shardings, put_sh)
        ]
        prog, host_slices, keep = host_inputs.bind_host_slices(prog, eligible)
        if keep is not None:
            labels = labels.select(keep)
        # ... and small constants made before the loop (a loss accumulator's zero) too
        prog, host_consts, keep = host_inputs.bind_host_consts(prog, labels)
        if keep is not None:
            labels = labels.select(keep)
        # ... and integer scalars computed from literals (RNG counters)
        prog, host_scalars, keep = host_inputs.bind_host_scalars(prog)
        if keep is not None:
            labels = labels.select(keep)
        host_consts = {**host_consts, **host_scalars}
        # where layouts are known before compiling (data replicated on each submesh),
        # microbatches of arguments already on a submesh are cut inside each
        # microbatch's work, at offsets given as inputs
        replicated = compiling.layouts_replicated(
            arg_shardings, fn._in_shardings, traced.jaxpr.jaxpr, stage_axis
        )
        cuts: dict[int, Any] = {}
        follow: frozenset[Any] = frozenset()  # the cuts: each runs where it is used
        if replicated:
            prog, labels, cuts, follow = host_inputs.bind_microbatch_cuts(
                prog,
                labels,
                [sh is not None and put is None for sh, put in zip(arg_shardings, put_sh)],
            )
        self._pieces = {**self._pieces, **host_slices, **host_consts, **cuts}
        self._assembled: dict[int, list[int]] = {}
        if mmesh is not None:
            prog, self._assembled = layers.bind_stage_outputs(prog, mmesh.num_stages, out_shardings)
            self._out_shardings = list(out_shardings) + [None] * (
                len(prog.outvars) - len(out_shardings)
            )
        self.input_infos: list[InputInfo] = [analyze(x, labels.targets, stage_axis) for x in flat]
        names = functools.cache(lambda: fn._signature.leaf_names(call))
        for k, pinned in enumerate(fn._pinned(labels, call, flat)):
            if pinned is not None and (pinned[1] or self.input_infos[k].mode == "put"):
                # a host value (or an array on other devices) whose in_shardings names
                # a submesh is put there
                self.input_infos[k] = InputInfo(frozenset({pinned[0]}), "put")
            elif pinned is None and put_sh[k] is not None:
                self.input_infos[k] = _moved_to_in_sharding(
                    self.input_infos[k], flat[k], put_sh[k], labels, lambda k=k: names()[k]
                )
        self.input_infos += [_piece_info(p) for _j, p in sorted(self._pieces.items())]
        default = (
            min(s for s in labels.stages if s is not None)
            if any(s is not None for s in labels.stages)
            else 0
        )
        locs = [i.loc for i in self.input_infos]
        labels = label_pass.hoist_invariants(prog, labels, follow)
        placement = place.place(prog, labels, locs, default, follow=follow)
        if traced.loops:
            # a gradient with shares made on several stages is summed over microbatches
            # on each (placement knows where untagged shares run): placed again if so
            prog2, labels2 = accumulate.split_accumulators(prog, labels, placement.instances)
            if prog2 is not prog:
                prog, labels = prog2, labels2
                placement = place.place(prog, labels, locs, default, follow=follow)
        # a stage's shared tasks (blocks) run apart from its own (embedding, head)
        frags = frag_pass.fragment(prog, placement, labels, traced.loops)
        # keys move as their data (between processes, also key arguments)
        prog, labels, placement, frags = keys.keys_as_data(
            prog, labels, placement, frags, inputs=jax.process_count() > 1
        )
        prog, labels, placement, frags = pack.pack_transfers(prog, labels, placement, frags)
        self._prog, self._labels = prog, labels
        self.plan: plan_pass.Plan = plan_pass.build_plan(
            prog, labels, placement, frags, [i.mode for i in self.input_infos]
        )

    @property
    def out_info(self) -> Any:
        """The outputs' shapes and dtypes, as a pytree of ``jax.ShapeDtypeStruct``."""
        return _out_info(self._traced)

    def as_text(self, dialect: str | None = None, *, debug_info: bool = False) -> str:
        """A readable listing of the plan: fragments, devices and transfers (and, with
        ``task_rules``, which scope went to which stage). ``dialect`` (one module's IR in
        ``jax.stages``) is refused: see :meth:`compiler_ir`; ``debug_info`` is accepted
        (the plan's listing has no source locations)."""
        del debug_info
        if dialect is not None:
            self.compiler_ir(dialect)  # raises, pointing at the fragments' programs
        text = self.plan.as_text()
        if self.scope_stages:
            rows = [f"  {scope!r} -> stage {st}" for scope, st in sorted(self.scope_stages.items())]
            text += "\ntask_rules placed scopes:\n" + "\n".join(rows)
        return text

    def _program_digest(self) -> str:
        """The traced program's work, the same in every process (multi-process runs;
        computed once)."""
        digest = self.__dict__.get("_digest")
        if digest is None:
            from multimesh.runtime import crossproc

            digest = self._digest = crossproc.program_digest(self._prog)
        return digest

    def _plan_signature(self) -> tuple[int, list[str], list[int]]:
        """This plan's hash, where each flat argument sits in it, and its devices' ids
        (compared between the processes holding them before anything runs)."""
        devices = sorted({int(d) for t in self._labels.targets for d in t.device_ids})
        where = [
            "uncommitted (placed by the plan)"
            if ii.mode == "put"
            else f"{ii.mode} on submesh(es) {sorted(ii.loc or ())}"
            for ii in self.input_infos
        ]
        text = self.plan.as_text()
        if jax.process_count() > 1:  # static values need not show in the plan (x * n),
            # nor other work on the same stages (x * 1.0 and x * 2.0)
            text += "\nstatic: " + _portable(self._call.static)
            text += "\nprogram: " + self._program_digest()
        return _compat.stable_hash(text), where, devices

    def cost_analysis(self) -> CostAnalysis:
        """The compiled program's cost estimates (XLA's per fragment, summed): an MPMD
        program is estimated after compiling its fragments (``Compiled.cost_analysis``)."""
        return self.compile().cost_analysis()

    def compiler_ir(self, dialect: str | None = None) -> Any:
        """Not one module: an MPMD program is one XLA program per fragment. Raises
        ``NotImplementedError`` pointing at the plan and the fragments' own programs."""
        raise NotImplementedError(
            "an mm.jit program is several XLA programs (one per fragment), not one module: "
            "read the plan with .as_text() or .plan, and each fragment's program with "
            "lowered.compile().fragments[i].as_text()."
        )

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Compiled:
        """Compile every fragment with XLA for its submesh (``compiler_options`` are
        passed to each fragment's compilation, as ``jax.stages.Lowered.compile`` does).
        Seeds the ``mm.jit`` call cache for these arguments' signature."""
        return self._compile(compiler_options, for_call=False)

    def _compile(self, compiler_options: dict[str, Any] | None, for_call: bool) -> Compiled:
        """:meth:`compile`; ``for_call``: for the call at hand (``mm.jit`` calling),
        not ahead of time."""
        fn = self._fn
        # mm.jit(compiler_options=...) first, these over them (as jax.jit)
        compiler_options = {**fn._compiler_options, **(compiler_options or {})} or None
        mmesh = fn.multimesh
        labels = self._labels
        put_sh = fn._put_shardings(labels, self._call, self._flat)
        # an ahead-of-time compile is this process's own business (as jax.jit's): its
        # peers compare plans with it when it first runs (Compiled._unchecked)
        plan = _check_same_plan(fn, self._call, self._plan_signature()) if for_call else None
        with _all_compiled(fn, plan), compiling.gc_paused(), _compat.no_mesh_context():
            exe = Executable(
                self._prog,
                labels,
                self.plan,
                self.input_infos,
                self._flat,
                put_sh,
                fn._signature.donated_leaves(self._call),
                mmesh.stage_axis if mmesh is not None else None,
                mmesh.mesh if mmesh is not None else None,
                out_shardings=self._out_shardings,
                compiler_options=compiler_options,
                exe_cache=fn._exe_cache,
                pieces=self._pieces,
                assembled=self._assembled,
                digest=self._program_digest if jax.process_count() > 1 else None,
            )
        compiled = Compiled(exe, self, fn)
        compiled._unchecked = not for_call and jax.process_count() > 1
        fn._register(self._key, compiled)
        return compiled


def _portable(x: Any) -> str:
    """Static argument values as every process spells them alike: plain values by
    ``repr``, containers of them recursively, anything else by its type (a ``repr``
    may hold a memory address)."""
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes, np.generic)):
        return repr(x)
    if isinstance(x, type):
        return f"<class {x.__module__}.{x.__qualname__}>"
    if isinstance(x, (tuple, list, frozenset, set)):
        items = sorted(map(_portable, x)) if isinstance(x, (set, frozenset)) else map(_portable, x)
        return f"{type(x).__name__}({', '.join(items)})"
    if isinstance(x, dict):
        return "dict(" + ", ".join(sorted(f"{_portable(k)}: {_portable(v)}" for k, v in x.items())) + ")"
    return f"<{type(x).__module__}.{type(x).__qualname__}>"


def _check_same_plan(
    fn: MpmdFunction, call: Any, signature: tuple[int, list[str], list[int]]
) -> tuple[str, int] | None:
    """Multi-process: every process must run the same plan for the call at hand (its
    transfers pair up by plan); else a clear error naming the arguments placed
    differently, instead of a hang. A no-op in one process. Returns what
    :func:`_all_compiled` takes (``None``: nothing compared)."""
    if jax.process_count() == 1:
        return None
    from multimesh.runtime import crossproc

    loc = crossproc.locality()
    assert loc is not None
    uid, where, devices = signature
    return crossproc.check_same_plan(
        loc,
        uid,
        where,
        fn._signature.leaf_names(call),
        f"mm.jit of {fn._fun_name!r}",
        devices,
    )


@contextlib.contextmanager
def _all_compiled(fn: MpmdFunction, plan: tuple[str, int] | None) -> Iterator[None]:
    """Around compiling a compared plan (``plan``: from :func:`_check_same_plan`): then
    wait for the other processes to have compiled theirs (``crossproc.all_compiled``),
    or tell them this process failed to."""
    if plan is None:
        yield
        return
    from multimesh.runtime import crossproc

    loc = crossproc.locality()
    assert loc is not None
    what = f"mm.jit of {fn._fun_name!r}"
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(Exception):  # the compile error is the one to raise
            crossproc.all_compiled(loc, plan, what, error=e)
        raise
    crossproc.all_compiled(loc, plan, what)


class Compiled(_ArgsInfo):
    """A compiled MPMD program: call it with the lowered function's non-static
    arguments (as ``jax.stages.Compiled`` is called)."""

    def __init__(self, exe: Executable, lowered: Lowered, fn: MpmdFunction) -> None:
        self._exe = exe
        self._fn = fn
        self._call = lowered._call
        self.in_tree = lowered.in_tree
        self.out_tree = lowered.out_tree
        self._arg_avals, self._donated = lowered._arg_avals, lowered._donated
        self.plan = lowered.plan
        self._out_info = lowered.out_info
        self._leaf_keys = list(lowered._key[3])  # made while the arguments were alive
        self._names: list[str] | None = None
        self._ndims = [len(k[0]) if len(k) > 1 else 0 for k in self._leaf_keys]
        self._plan_sig = lowered._plan_signature()
        #: compiled ahead of time in a multi-process run: plans not compared yet
        self._unchecked = False

    def _check_same_plan(self) -> None:
        """For a call choosing this program for other argument placements, or its first
        run after an ahead-of-time compile: the other processes must run it too (and
        have compiled it: this process has)."""
        self._unchecked = False
        plan = _check_same_plan(self._fn, self._call, self._plan_sig)
        with _all_compiled(self._fn, plan):
            pass

    def _arg_names(self) -> list[str]:
        if self._names is None:
            self._names = self._fn._signature.leaf_names(self._call)
        return self._names

    def accepts(self, keys: Sequence[tuple[Any, ...]]) -> bool:
        """Whether arguments with these leaf keys (same shapes and dtypes) run on this
        program without moving anything that is already placed elsewhere: every
        committed argument must sit where the program uses it in place."""
        homes = self._exe.homes
        multi = jax.process_count() > 1
        for i, k in enumerate(keys):
            sh = k[3] if len(k) > 3 else None
            if sh is None or i not in homes:
                continue
            if not multi and self._as_lowered(i, sh):
                continue
            if not _same_sharding(sh, homes[i], self._ndims[i]):
                return False
            if multi and i not in self._exe.in_place:
                # the program would put it: across processes that is a cross-host copy
                # (impossible on CPU); and the answer must not depend on the process
                return False
        return True

    def _as_lowered(self, i: int, sh: Any) -> bool:
        """Whether committed argument ``i`` sits where it did when lowered, and the program
        puts it (a placement it does not use in place: another device, device order)."""
        k = self._leaf_keys[i]
        low = k[3] if len(k) > 3 else None
        return (
            low is not None
            and i not in self._exe.in_place
            and _same_sharding(sh, low, self._ndims[i])
        )

    @_compat.api_boundary
    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if _compat.tracing() and not _compat.jit_disabled():
            raise traced_error()
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != self.in_tree:
            raise TypeError(
                "mm.jit Compiled called with arguments of a different structure than it was "
                f"compiled for (static arguments are left out, as with jax.stages.Compiled): "
                f"expected {self.in_tree}, got {tree}."
            )
        names = self._arg_names()
        try:
            keys = [leaf_key(x, False) for x in flat]
        except TypeError as e:
            for name, x in zip(names, flat):
                try:
                    leaf_key(x, False)
                except TypeError:
                    raise TypeError(f"argument {name}: {e}") from None
            raise
        except DeletedArgument:
            bad = next(i for i, x in enumerate(flat) if isinstance(x, jax.Array) and x.is_deleted())
            raise deleted_error(names[bad]) from None
        check_call_types(names, keys, self._leaf_keys, self._arg_avals)
        homes = self._exe.homes
        for i, k in enumerate(keys):
            sh = k[3] if len(k) > 3 else None
            if (
                sh is not None
                and i in homes
                and jax.process_count() > 1
                and i not in self._exe.in_place
            ):
                raise ValueError(
                    f"argument {names[i]} is committed to {placement_text(sh)}, but this program was "
                    "compiled for it uncommitted (put by the plan), which a multi-process "
                    "run cannot do for committed arrays; compile for this placement (call "
                    "the mm.jit function, or lower it with this argument) instead."
                )
            if sh is not None and self._as_lowered(i, sh):
                continue  # placed as when lowered: the program puts it where it is used
            if sh is not None and i in homes and homes[i] is None:
                raise ValueError(
                    f"argument {names[i]} is placed as {placement_text(sh)}, but this program "
                    "was compiled for it as a host value (its slices are cut on the host and put where "
                    "they are used); pass it uncommitted (a NumPy array) or compile for "
                    "this placement (calling the mm.jit function does that)."
                )
            if sh is not None and i in homes and not _same_sharding(sh, homes[i], self._ndims[i]):
                k = self._leaf_keys[i]
                low = k[3] if len(k) > 3 else None
                where = placement_text(homes[i])
                if low is not None and i not in self._exe.in_place:
                    where = f"{placement_text(low)} (lowered with it; put at {where})"
                raise ValueError(
                    f"argument {names[i]} is placed as {placement_text(sh)}, but this program "
                    f"was compiled for it at {where}; move it (jax.device_put) or compile "
                    "for this placement (calling the mm.jit function does that)."
                )
        if _compat.jit_disabled():  # checked as above, then plain Python, as the function
            full, kw = self._call.rebuild(args, kwargs)
            return self._fn._run_eagerly(full, kw)
        return self.call_flat(flat)

    def call_flat(self, flat: Sequence[Any]) -> Any:
        if self._unchecked:
            self._check_same_plan()
        if _compat.host_transfers_disallowed():
            self._check_host_guard(flat)
        try:
            if _compat.checks_special():
                return self._checked(lambda: self._run(self._exe, flat), flat)
            if not self._donated:
                return jax.tree_util.tree_unflatten(self.out_tree, self._exe(flat))
            return jax.tree_util.tree_unflatten(self.out_tree, self._donating(self._exe, flat))
        except OverflowError as e:
            raise self._overflow(flat, e) from None

    def _check_host_guard(self, flat: Sequence[Any]) -> None:
        """Host arguments under ``jax.transfer_guard('disallow')``: refused, as jax.jit
        refuses their implicit transfer (mm.jit puts them explicitly)."""
        for i, x in enumerate(flat):
            if not isinstance(x, jax.Array) and i < len(self._arg_avals):
                raise ValueError(
                    f"Disallowed host-to-device transfer: argument {self._arg_names()[i]} "
                    f"of mm.jit({self._fn._fun_name}) is a host value "
                    f"({type(x).__name__}) and jax.transfer_guard disallows moving it to "
                    "the devices implicitly; jax.device_put it first."
                )

    def _overflow(self, flat: Sequence[Any], e: OverflowError) -> OverflowError:
        """JAX's message for a Python int too large for its dtype, naming the argument
        (as jax.jit does)."""
        names = self._arg_names()
        for i, x in enumerate(flat):
            if type(x) is int and i < len(self._arg_avals):
                try:
                    np.asarray(x, dtype=self._arg_avals[i].dtype)
                except OverflowError:
                    return OverflowError(
                        f"An overflow was encountered while parsing an argument to "
                        f"mm.jit({self._fn._fun_name}), whose argument path is {names[i]}. "
                        f"Got {type(x)} with value {x} ({e})."
                    )
        return e

    def record_flat(self, flat: Sequence[Any]) -> tuple[Any, Any]:
        """:meth:`record` on flat arguments."""
        if _compat.jit_disabled():
            raise RuntimeError(
                "record() measures the compiled fragments, which do not run under "
                "jax.disable_jit(): call it outside that context."
            )
        if self._unchecked:
            self._check_same_plan()
        if _compat.checks_special():
            return self._checked(lambda: self._record(flat), flat)
        return self._record(flat)

    def _run(self, run: Any, flat: Sequence[Any]) -> Any:
        outs = self._donating(run, flat) if self._donated else run(flat)
        return jax.tree_util.tree_unflatten(self.out_tree, outs)

    def _record(self, flat: Sequence[Any]) -> tuple[Any, Any]:
        outs, tl = (
            self._donating(self._exe.record, flat) if self._donated else self._exe.record(flat)
        )
        return jax.tree_util.tree_unflatten(self.out_tree, outs), tl

    def _checked(self, run: Any, flat: Sequence[Any]) -> Any:
        """Under ``jax_debug_nans``/``jax_debug_infs``, as ``jax.jit``: the outputs are
        checked (not the values between fragments), and an invalid one re-runs the
        function without jit (tasks transparent), whose failing operation raises
        ``FloatingPointError``."""
        with _compat.special_checks_off():
            out = run()
        name = f"mm.jit({self._fn._fun_name})"
        try:
            _compat.check_special(name, jax.tree_util.tree_leaves(out))
        except _compat.InternalFloatingPointError as e:
            what = f"invalid value ({e.ty}) encountered in the outputs of {name}"
            if any(isinstance(x, jax.Array) and x.is_deleted() for x in flat):
                raise FloatingPointError(
                    f"{what}. Its donated arguments are gone, so it was not run again "
                    "without jit to find the operation: call it without donating them to "
                    "find it."
                ) from None
            dargs, dkw = jax.tree_util.tree_unflatten(self.in_tree, list(flat))
            args, kwargs = self._call.rebuild(dargs, dkw)
            print(  # as jax.jit says it
                f"Invalid {e.ty} value encountered in the output of {name}. Calling the "
                "de-optimized version."
            )
            try:
                with jax.disable_jit():
                    self._fn._run_eagerly(args, kwargs)
            except (FloatingPointError, ZeroDivisionError) as e2:
                raise e2 from None
            raise FloatingPointError(
                f"{what}. Because jax_debug_nans and/or jax_debug_infs is set, the function "
                "was run again without jit (tasks are transparent there) to find the "
                "operation, but it produced no invalid value: jit's optimizations (or "
                "nan/inf constants among its inputs or outputs) can cause this. Running it "
                "without mm.jit may avoid the invalid value."
            ) from None
        return out

    def _donating(self, run: Any, flat: Sequence[Any]) -> Any:
        """``run(flat)`` with donated arguments: each passed once, and gone afterwards, as
        under jax.jit, also where the plan could not reuse their buffers (copied to another
        submesh, used on two, returned): freed once the work using them is done."""
        self._check_donated_once(flat)
        kept = self._constants_donated(flat) if self._exe.kept_constants() else ()
        if kept:  # the program needs them again: donate copies, keep the arrays
            flat = list(flat)
            copies = _compat.fresh_copy([flat[i] for i in kept])
            for i, c in zip(kept, copies):
                flat[i] = c
            names = self._arg_names()
            warnings.warn(
                f"argument(s) {[names[i] for i in kept]} are donated, but the function "
                "also captures the same array(s) as constants, which later calls need: "
                "they were not donated (as jax.jit warns of donated buffers it cannot use).",
                stacklevel=4,
            )
        try:
            out = run(flat)
        except BaseException as e:
            # failed at run time (a callback raising on some stage): every donated
            # argument is gone, as under jax.jit, not only those work had already used
            if getattr(e, "mm_ran", False):
                self._delete_donated(flat)
            raise
        self._delete_donated(flat)
        return out

    def _delete_donated(self, flat: Sequence[Any]) -> None:
        for i in self._donated:
            x = flat[i]
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()

    def _constants_donated(self, flat: Sequence[Any]) -> list[int]:
        """Donated arguments holding the buffers of a constant the function captures (a
        closed-over array passed and donated too): donating them would free the
        constant the program reads in this call and the next."""
        consts = self._exe.kept_constants()
        by_type: dict[Any, list[jax.Array]] = {}
        for c in consts:
            by_type.setdefault((c.shape, c.dtype), []).append(c)
        out = []
        for i in sorted(self._donated):
            x = flat[i]
            if not isinstance(x, jax.Array) or x.is_deleted():
                continue
            same = by_type.get((x.shape, x.dtype), ())
            if not same:
                continue
            mine = _compat.buffer_pointers(x)
            if any(c is x or mine & _compat.buffer_pointers(c) for c in same):
                out.append(i)
        return out

    def _check_donated_once(self, flat: Sequence[Any]) -> None:
        """A donated array passed again as another argument (``f(a, a)`` with the first
        donated) is an error, as under jax.jit (the runtime would crash on it)."""
        ids = [id(x) for x in flat]
        if len(set(ids)) != len(ids):
            for i in sorted(self._donated):
                if not isinstance(flat[i], jax.Array):
                    continue
                j = next((j for j, k in enumerate(ids) if k == ids[i] and j != i), None)
                if j is not None:
                    self._donated_twice(i, j, "the same array")
        # another array object on the same buffers (jax.device_put to an equivalent
        # sharding aliases): the runtime would crash (jax.jit's too). Only arrays of one
        # shape and dtype can share buffers, so most calls compare no pointers
        shapes: dict[Any, list[int]] = {}
        for j, x in enumerate(flat):
            if type(x) is _compat.ARRAY_TYPE:
                a = x.aval
                shapes.setdefault((a.shape, a.dtype), []).append(j)
        seen: set[Any] = set()
        for i in sorted(self._donated):
            x = flat[i]
            a = x.aval if type(x) is _compat.ARRAY_TYPE else None
            key = (a.shape, a.dtype) if a is not None else None
            group = shapes.get(key, ()) if key is not None else ()
            if len(group) < 2 or key in seen:
                continue
            seen.add(key)  # each group once: who holds each buffer, then the donated
            holder: dict[int, int] = {}
            for j in group:
                for p in _compat.buffer_pointers(flat[j]):
                    k = holder.setdefault(p, j)
                    if k != j and (j in self._donated or k in self._donated):
                        d, o = (j, k) if j in self._donated else (k, j)
                        self._donated_twice(d, o, "an array sharing its buffers")

    def _donated_twice(self, i: int, j: int, what: str) -> None:
        names = self._arg_names()
        raise ValueError(
            f"argument {names[i]} is donated (donate_argnums/donate_argnames) and {what} "
            f"is also passed as {names[j]}: a donated buffer cannot be used twice in one "
            "call (jax.jit raises INVALID_ARGUMENT or crashes here). Pass a copy (jnp.copy) "
            "for one of them, or do not donate it."
        )

    def record(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Run once and return ``(outputs, timeline)``: a measured
        :class:`multimesh.schedules.Timeline` (per-fragment start/end in µs, peak live
        bytes and microbatches per submesh), plottable and exportable as a Chrome trace.
        Takes the same arguments as calling this object."""
        flat, _ = jax.tree_util.tree_flatten((args, kwargs))
        return self.record_flat(flat)

    # -- introspection ----------------------------------------------------------------

    def as_text(self) -> str:
        """The plan's listing (see :meth:`Lowered.as_text`); each fragment's XLA program
        is ``fragments[i].as_text()``."""
        return self.plan.as_text()

    def runtime_executable(self) -> list[Any]:
        """The fragments' runtime executables, in dispatch order (``None`` for a
        fragment another process runs): an MPMD program is several XLA executables."""
        return [c.runtime_executable() if c is not None else None for c in self._exe.compiled]

    @property
    def input_formats(self) -> Any:
        """A pytree matching the arguments: a ``Format`` (default layout, the sharding
        of :attr:`input_shardings`) where an argument is used in place, ``None`` where
        it is put where needed on each call."""
        return jax.tree.map(
            lambda sh: None if sh is None else _compat.default_format(sh),
            self.input_shardings,
            is_leaf=lambda x: x is None,
        )

    @property
    def output_formats(self) -> Any:
        """A pytree of ``Format`` (default layout, the sharding of
        :attr:`output_shardings`) matching the outputs."""
        return jax.tree.map(_compat.default_format, self.output_shardings)

    @property
    def num_executables(self) -> int:
        """Distinct XLA executables (identical fragments share one)."""
        return self._exe.num_executables

    @property
    def compile_stats(self) -> dict[str, int]:
        """How this compile made its executables: ``compiled`` by XLA, ``relocated``
        (the executable of the same program on another submesh of the same shape, loaded
        for this one's devices in milliseconds), or ``shared`` (made before by another
        ``mm.jit`` of this process; ``MULTIMESH_SHARED_EXECUTABLES``). Fragments identical
        to one made earlier by this ``mm.jit`` count in none. ``threads``: how many
        compile threads this process used (``MULTIMESH_COMPILE_THREADS``; by default its
        share of the CPUs)."""
        return self._exe.compile_stats.as_dict()

    @property
    def output_shardings(self) -> Any:
        """Where each output lands (a pytree of shardings, like ``jax.stages.Compiled``)."""
        return jax.tree_util.tree_unflatten(self.out_tree, self._exe.output_shardings)

    @property
    def input_shardings(self) -> Any:
        """Where each argument is used in place (``None``: put where needed each call),
        as a pytree matching the arguments."""
        homes = self._exe.homes
        flat = [homes.get(i) for i in range(len(self._leaf_keys))]
        return jax.tree_util.tree_unflatten(self.in_tree, flat)

    @property
    def out_info(self) -> Any:
        """The outputs as ``jax.ShapeDtypeStruct``s with their shardings: e.g. a restore
        target for checkpoints of a training step's state."""
        return jax.tree.map(
            lambda i, sh: jax.ShapeDtypeStruct(
                i.shape, i.dtype, sharding=sh, weak_type=i.weak_type
            ),
            self._out_info,
            self.output_shardings,
        )

    @property
    def fragments(self) -> list[Any]:
        """The XLA-compiled fragments (``jax.stages.Compiled``), in dispatch order. In a
        multi-process run, ``None`` for a fragment another process runs whose output
        layouts are known without compiling it (that process compiles it; the analyses
        below cover this process's fragments)."""
        return list(self._exe.compiled)

    def memory_analysis(self) -> MemoryAnalysis:
        """XLA's memory analysis, per fragment and summed per submesh (see
        :class:`MemoryAnalysis`)."""
        per_fragment: dict[str, Any] = {}
        for info, c in zip(self.plan.fragments, self._exe.compiled):
            if c is not None:
                per_fragment[info.name] = c.memory_analysis()
        return MemoryAnalysis.build(self.plan, self._exe.compiled, per_fragment)

    def cost_analysis(self) -> CostAnalysis:
        """XLA's cost analysis (flops, bytes accessed, ...): a dict of totals over every
        fragment run, with ``.per_fragment`` and ``.per_submesh`` breakdowns."""
        per_fragment: dict[str, dict[str, float]] = {}
        per_submesh: dict[int, dict[str, float]] = {}
        total: dict[str, float] = {}
        for info, c in zip(self.plan.fragments, self._exe.compiled):
            if c is None:
                continue
            ca = c.cost_analysis()
            if isinstance(ca, (list, tuple)):  # older JAX: one dict per program
                ca = ca[0] if ca else {}
            ca = {k: float(v) for k, v in (ca or {}).items() if isinstance(v, (int, float))}
            per_fragment[info.name] = ca
            sub = per_submesh.setdefault(info.stage, {})
            for k, v in ca.items():
                sub[k] = sub.get(k, 0.0) + v
                total[k] = total.get(k, 0.0) + v
        return CostAnalysis(total, per_fragment, per_submesh)


def _same_sharding(a: Any, b: Any, ndim: int) -> bool:
    if b is None:
        return False
    if a == b:
        return True
    try:
        return bool(a.is_equivalent_to(b, ndim))
    except Exception:  # noqa: BLE001 - different sharding kinds
        return False


_SUMMED_ONCE = ("generated_code_size_in_bytes", "host_generated_code_size_in_bytes")
_PEAK = ("temp_size_in_bytes", "host_temp_size_in_bytes")
#: the fields of jax's CompiledMemoryStats (reported as zeros for a program without
#: fragments)
_FIELDS = tuple(
    f"{where}{what}_size_in_bytes"
    for where in ("", "host_")
    for what in ("argument", "output", "alias", "temp", "generated_code")
) + ("peak_memory_in_bytes",)


class MemoryAnalysis:
    """XLA's memory statistics for an MPMD program.

    ``per_fragment``: each fragment's ``CompiledMemoryStats`` (as
    ``jax.stages.Compiled.memory_analysis()`` reports it). ``per_submesh``: per submesh
    (stage index), every field summed over its fragments, except temporary sizes (the
    largest fragment's: temporaries are released between fragments) and generated code
    (counted once per distinct executable). The attributes of this object
    (``argument_size_in_bytes``, ``output_size_in_bytes``, ``temp_size_in_bytes``, ...)
    are those of the submesh with the largest total: the per-device estimate to compare
    against a device's memory.
    """

    def __init__(
        self,
        fields: dict[str, int],
        per_submesh: dict[int, dict[str, int]],
        per_fragment: dict[str, Any],
        submesh: int | None,
    ) -> None:
        self.per_submesh = per_submesh
        self.per_fragment = per_fragment
        self.submesh = submesh  # the stage whose numbers the attributes show
        self._fields = fields
        for k, v in fields.items():
            setattr(self, k, v)

    @classmethod
    def build(cls, plan: Any, compiled: Sequence[Any], per_fragment: dict[str, Any]) -> Any:
        per_submesh: dict[int, dict[str, int]] = {}
        seen: dict[int, set[int]] = {}
        names: list[str] = []
        for info, c in zip(plan.fragments, compiled):
            stats = per_fragment.get(info.name)
            if stats is None:
                continue
            if not names:
                names = [n for n in dir(stats) if n.endswith("_in_bytes") and not n.startswith("_")]
            sub = per_submesh.setdefault(info.stage, dict.fromkeys(names, 0))
            first = id(c) not in seen.setdefault(info.stage, set())
            seen[info.stage].add(id(c))
            for n in names:
                v = int(getattr(stats, n, 0) or 0)
                if n in _PEAK:
                    sub[n] = max(sub[n], v)
                elif n in _SUMMED_ONCE:
                    sub[n] += v if first else 0
                else:
                    sub[n] += v
        if not per_submesh:  # no fragment ran XLA (inputs passed through): zeros
            return cls(dict.fromkeys(names or _FIELDS, 0), {}, per_fragment, None)

        def total(d: dict[str, int]) -> int:
            return sum(
                d.get(n, 0)
                for n in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
            ) - d.get("alias_size_in_bytes", 0)

        worst = max(per_submesh, key=lambda s: (total(per_submesh[s]), -s))
        return cls(dict(per_submesh[worst]), per_submesh, per_fragment, worst)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v}" for k, v in self._fields.items())
        return f"MemoryAnalysis(submesh={self.submesh}, {body})"


class CostAnalysis(dict):
    """A dict of XLA cost totals over every fragment run (``flops``, ``bytes accessed``,
    ...), with ``per_fragment`` (name -> dict) and ``per_submesh`` (stage -> dict)."""

    def __init__(
        self,
        total: dict[str, float],
        per_fragment: dict[str, dict[str, float]],
        per_submesh: dict[int, dict[str, float]],
    ) -> None:
        super().__init__(total)
        self.per_fragment = per_fragment
        self.per_submesh = per_submesh


def _moved_to_in_sharding(
    info: InputInfo, x: Any, put: Callable[[int], Any], labels: Labels, name: Callable[[], str]
) -> InputInfo:
    """A committed argument whose ``in_shardings`` entry is a ``PartitionSpec`` (or a
    global-mesh ``NamedSharding``) in another layout than it has is put in that layout
    where it is used (it was used in its own layout, the entry ignored); in the same
    layout it is used where it is."""
    if info.mode == "put":
        return info
    ndim = len(getattr(x, "shape", ()))
    have = committed_sharding(x)
    if info.mode == "as_is":
        here = [(s, have) for s in sorted(info.loc)]
    else:  # extract: its piece on each submesh
        here = [(s, NamedSharding(labels.targets[s].mesh, sp)) for s, sp in info.extract_specs]
    try:
        same = all(_compat.same_layout_any_devices(h, put(s), ndim) for s, h in here)
    except ValueError:  # the spec does not fit where it is: put where used (checked there)
        same = False
    if same:
        return info
    if jax.process_count() > 1:
        raise ValueError(
            f"in_shardings for argument {name()}: the argument is committed in another layout "
            f"({have}) than in_shardings gives; a multi-process run cannot move a committed "
            "array for you: pass it uncommitted (a host value) or in that layout."
        )
    return InputInfo(ANY, "put")


def _piece_info(p: Any) -> InputInfo:
    """Where a program input cut or made from the arguments comes from."""
    if isinstance(p, host_inputs.HostSlice):
        return InputInfo(ANY, "host_slice")
    if isinstance(p, host_inputs.HostConst):
        return InputInfo(ANY, "host_const")
    return InputInfo(frozenset({p.stage}), "piece")  # layers.InputPiece
