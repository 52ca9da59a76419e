"""Executor: compile every fragment of a plan once, then run the plan as a flat loop.

The per-call path is a loop over precomputed steps: look up input slots, call a compiled
XLA executable (JAX's C++ dispatch), store its outputs, batch-copy the values other
submeshes need (shard-by-shard when layouts match), and drop buffers at their last use.
No jaxpr is walked at run time.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from multimesh import _compat
from multimesh.compiler import shardings as shard_pass
from multimesh.compiler.ir import FlatProgram, Labels
from multimesh.compiler.plan import Plan
from multimesh.runtime import transfer as tr
from multimesh.runtime.inputs import InputInfo

_compat.register_exclusion(__file__)

_RUN, _CALL = 0, 1


def _sanitize(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", name) or "fragment"


class Executable:
    """A compiled MPMD program: call it with the flat list of arguments."""

    def __init__(
        self,
        prog: FlatProgram,
        labels: Labels,
        plan: Plan,
        infos: Sequence[InputInfo],
        sample_args: Sequence[Any],
        put_shardings: Sequence[Callable[[int], jax.sharding.Sharding] | None],
        donated: frozenset[int],
        stage_axis: str | None,
        global_mesh: Any,
    ) -> None:
        self.plan = plan
        self._stage_axis = stage_axis or "stage"
        targets = labels.targets
        slot_sh: dict[int, jax.sharding.Sharding] = {}
        template: list[Any] = [None] * plan.num_slots
        steps: list[tuple[Any, ...]] = []
        as_is_arg: dict[int, int] = {}
        multi_out: set[int] = {
            i
            for kind, *rest in plan.outputs
            if kind == "slots"
            for i in (rest[0] if len(rest[0]) > 1 else [])
        }
        slot_var = {sid: var for (var, _s), sid in plan.slots.items()}
        mb_of_var: dict[Any, Any] = {}
        if labels.microbatch:
            for i, e in enumerate(prog.eqns):
                if labels.microbatch[i] is not None:
                    for o in e.outvars:
                        mb_of_var[o] = labels.microbatch[i]
        #: slot -> (loop, microbatch) of the value it holds (for memory accounting)
        self.slot_microbatch = {sid: mb_of_var.get(v) for sid, v in slot_var.items()}
        self.compiled: list[Any] = []
        self._run_index: list[int] = []  # step index of each fragment's run
        cache: dict[Any, Any] = {}
        owned: set[int] = set()  # slots holding buffers only the runtime references
        #: slots whose buffers are donated to a later fragment (invalid after it runs)
        self.donated_slots: set[int] = set()

        for st in plan.steps:
            if st.kind == "inputs":
                steps.append(
                    self._input_step(
                        st,
                        infos,
                        sample_args,
                        put_shardings,
                        targets,
                        slot_sh,
                        template,
                        as_is_arg,
                        prog,
                        slot_var,
                    )
                )
            elif st.kind == "run":
                f = plan.frags[st.fragment]
                info = plan.fragments[st.fragment]
                in_ids = [plan.slots[s] for s in f.inputs]
                out_ids = [plan.slots[s] for s in f.outputs]
                mesh = targets[f.stage].mesh
                eqns = []
                for i in f.eqns:
                    ref = labels.tasks[i]
                    tmesh = labels.task_meshes[i] if ref is not None else mesh
                    where = (
                        f"task {ref.name!r}"
                        if ref is not None
                        else f"untagged code placed on stage {f.stage}"
                    )
                    ctx = shard_pass.Ctx(tmesh, global_mesh, stage_axis, where)
                    eqns.append(shard_pass.rewrite_eqn(prog.eqns[i], ctx))
                jaxpr = _compat.make_jaxpr_obj(
                    [v for v, _ in f.inputs], [v for v, _ in f.outputs], eqns, info.name
                )
                fn = _compat.jaxpr_as_fun(_compat.ClosedJaxpr(jaxpr, []))
                in_sh = tuple(slot_sh[i] for i in in_ids)
                # a fragment without inputs would run on the default device: pin it
                out_sh = tuple(
                    NamedSharding(mesh, PartitionSpec()) if i in multi_out or not in_ids else None
                    for i in out_ids
                )
                # donate at last use: user-donated inputs, and our own intermediates
                # (fragment outputs and transfer copies) when an output can reuse them
                out_avals = [(tuple(v.aval.shape), v.aval.dtype) for v, _ in f.outputs]
                donate_l = []
                for k, i in enumerate(in_ids):
                    if i not in st.free or i in multi_out:
                        continue
                    if i in as_is_arg:
                        if as_is_arg[i] in donated:
                            donate_l.append(k)
                        continue
                    if i in owned:
                        key_av = (tuple(slot_var[i].aval.shape), slot_var[i].aval.dtype)
                        if key_av in out_avals and not _is_key(slot_var[i].aval):
                            out_avals.remove(key_av)
                            donate_l.append(k)
                donate = tuple(donate_l)
                self.donated_slots.update(in_ids[k] for k in donate)
                body = _named(fn, "mm_" + _sanitize(info.name))
                avals = [
                    jax.ShapeDtypeStruct(
                        v.aval.shape,
                        v.aval.dtype,
                        sharding=sh,
                        weak_type=getattr(v.aval, "weak_type", False),
                    )
                    for (v, _), sh in zip(f.inputs, in_sh)
                ]
                # identical fragments (e.g. one stage's work for each microbatch) share
                # one executable
                key = (str(jaxpr), in_sh, out_sh, donate, tuple(avals))
                compiled = cache.get(key)
                if compiled is None:
                    with warnings.catch_warnings():
                        warnings.filterwarnings(
                            "ignore", message=".*donated buffers were not usable.*"
                        )
                        compiled = (
                            jax.jit(
                                body,
                                in_shardings=in_sh,
                                out_shardings=out_sh,
                                donate_argnums=donate,
                            )
                            .lower(*avals)
                            .compile()
                        )
                    cache[key] = compiled
                self.compiled.append(compiled)
                self._run_index.append(len(steps))
                for i, sh in zip(out_ids, compiled.output_shardings):
                    slot_sh[i] = sh
                owned.update(out_ids)
                steps.append((_RUN, compiled, tuple(in_ids), tuple(out_ids), tuple(st.free)))
                continue
            elif st.kind == "transfer":
                steps.append(self._transfer_step(st, targets, slot_sh))
                owned.update(dst for _src, dst, *_ in st.items)
            if st.free and steps[-1][0] == _CALL:
                steps[-1] = (*steps[-1][:4], tuple(st.free))
        self._steps = steps
        self._template = template
        self._outs = [self._output_fn(o, slot_sh, targets, slot_var) for o in plan.outputs]

    # -- steps ------------------------------------------------------------------------

    def _input_step(
        self,
        st,
        infos,
        sample_args,
        put_shardings,
        targets,
        slot_sh,
        template,
        as_is_arg,
        prog,
        slot_var,
    ):
        as_is: list[tuple[int, int]] = []
        extracts: list[tuple[int, int, tuple[int, ...], NamedSharding, tuple[int, ...]]] = []
        puts: list[tuple[int, int]] = []
        put_sh: list[jax.sharding.Sharding] = []
        for ip, sid in st.items:
            mesh = targets[ip.stage].mesh
            if ip.mode == "const":
                val = prog.consts[-1 - ip.arg]
                sh = NamedSharding(mesh, PartitionSpec())
                template[sid] = jax.device_put(val, sh)
                slot_sh[sid] = template[sid].sharding
            elif ip.mode == "as_is":
                as_is.append((sid, ip.arg))
                as_is_arg[sid] = ip.arg
                slot_sh[sid] = sample_args[ip.arg].sharding
            elif ip.mode == "extract":
                x = sample_args[ip.arg]
                spec = dict(infos[ip.arg].extract_specs)[ip.stage]
                sh = NamedSharding(mesh, spec)
                order = [int(s.device.id) for s in x.addressable_shards]
                pos = tuple(order.index(int(d.id)) for d in sh._device_assignment)  # noqa: SLF001
                extracts.append((sid, ip.arg, pos, sh, tuple(x.shape)))
                slot_sh[sid] = sh
            else:
                chooser = put_shardings[ip.arg]
                sh = (
                    chooser(ip.stage)
                    if chooser is not None
                    else NamedSharding(mesh, PartitionSpec())
                )
                puts.append((sid, ip.arg))
                put_sh.append(sh)
                slot_sh[sid] = sh
        puts_ids = tuple(s for s, _ in puts)
        puts_args = tuple(a for _, a in puts)
        put_avals = [slot_var[s].aval for s in puts_ids]

        def run_inputs(env: list[Any], args: Sequence[Any]) -> None:
            for sid, a in as_is:
                env[sid] = args[a]
            for sid, a, pos, sh, shape in extracts:
                pieces = _compat.single_device_arrays(args[a])
                env[sid] = jax.make_array_from_single_device_arrays(
                    shape, sh, [pieces[p] for p in pos]
                )
            if puts_ids:
                vals = [_as_array(args[a], av) for a, av in zip(puts_args, put_avals)]
                for sid, v in zip(puts_ids, jax.device_put(vals, put_sh)):
                    env[sid] = v

        return (_CALL, run_inputs, (), (), ())

    def _transfer_step(self, st, targets, slot_sh):
        fast_src, fast_dst, fast_sh = [], [], []
        slow_src, slow_dst, slow_sh = [], [], []
        for src, dst, aval, _s, d in st.items:
            shape = tuple(aval.shape)
            ssh = slot_sh[src]
            dsh = tr.dst_sharding(ssh, targets[d].mesh, shape)
            slot_sh[dst] = dsh
            if tr.same_layout(ssh, dsh, shape) and not _is_key(aval):
                fast_src.append(src), fast_dst.append(dst), fast_sh.append(dsh)
            else:
                slow_src.append(src), slow_dst.append(dst), slow_sh.append(dsh)
        copy = _compat.same_layout_copy

        def run_transfer(env: list[Any], args: Sequence[Any]) -> None:
            if fast_src:
                for i, v in zip(fast_dst, copy([env[i] for i in fast_src], fast_sh)):
                    env[i] = v
            if slow_src:
                for i, v in zip(slow_dst, jax.device_put([env[i] for i in slow_src], slow_sh)):
                    env[i] = v

        return (_CALL, run_transfer, (), (), ())

    def _output_fn(self, out, slot_sh, targets, slot_var):
        kind = out[0]
        if kind == "literal":
            val, aval = out[1], out[2]
            arr = jax.device_put(
                np.asarray(val, dtype=aval.dtype), NamedSharding(targets[0].mesh, PartitionSpec())
            )
            return lambda env: arr
        ids = out[1]
        if len(ids) == 1:
            (i,) = ids
            return lambda env: env[i]
        shs = [slot_sh[i] for i in ids]
        union = tr.union_sharding(shs, self._stage_axis)
        if union is None:
            i = ids[0]
            return lambda env: env[i]
        shape = tuple(slot_var[ids[0]].aval.shape)
        order = [int(d.id) for d in union._device_assignment]  # noqa: SLF001

        def assemble(env: list[Any]) -> jax.Array:
            pieces: dict[int, jax.Array] = {}
            for i in ids:
                for p in _compat.single_device_arrays(env[i]):
                    pieces[int(next(iter(p.devices())).id)] = p
            return jax.make_array_from_single_device_arrays(
                shape, union, [pieces[d] for d in order]
            )

        return assemble

    # -- call -------------------------------------------------------------------------

    @property
    def num_executables(self) -> int:
        """Distinct XLA executables (identical fragments share one)."""
        return len({id(c) for c in self.compiled})

    def record(self, args: Sequence[Any]) -> tuple[list[Any], Any]:
        """Run once, recording per-fragment times and live buffers per stage.

        A waiter thread per submesh blocks on each fragment's outputs in dispatch order,
        so submeshes still overlap. A fragment's start is the latest of its dispatch, the
        end of the previous fragment on its submesh, and the ends of its producers.
        """
        from multimesh.runtime.record import record_run

        return record_run(self, args)

    def __call__(self, args: Sequence[Any]) -> list[Any]:
        env = list(self._template)
        for code, fn, ins, outs, free in self._steps:
            if code == _RUN:
                res = fn(*[env[i] for i in ins])
                for i, r in zip(outs, res):
                    env[i] = r
            else:
                fn(env, args)
            for i in free:
                env[i] = None
        return [o(env) for o in self._outs]


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def body(*args: Any) -> Any:
        return tuple(fn(*args))

    body.__name__ = body.__qualname__ = name
    return body


def _is_key(aval: Any) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)


def _as_array(x: Any, aval: Any) -> Any:
    if isinstance(x, jax.Array):
        return x
    return np.asarray(x, dtype=aval.dtype) if not _is_key(aval) else x
