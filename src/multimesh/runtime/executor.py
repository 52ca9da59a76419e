"""Executor: compile every fragment of a plan once, then run the plan as a flat loop.

The per-call path is a loop over precomputed steps: look up input slots, call a compiled
XLA executable (JAX's C++ dispatch), store its outputs, batch-copy the values other
submeshes need (shard-by-shard when layouts match), and drop buffers at their last use.
No jaxpr is walked at run time.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from multimesh import _compat
from multimesh.arguments import spec_axes
from multimesh.compiler import conds, layers
from multimesh.compiler import shardings as shard_pass
from multimesh.compiler.host_inputs import HOST_CONST_MAX_BYTES
from multimesh.compiler.ir import FlatProgram, Labels, aval_nbytes
from multimesh.compiler.plan import Plan
from multimesh.runtime import compiling, crossproc
from multimesh.runtime import outputs as out_pass
from multimesh.runtime import transfer as tr
from multimesh.runtime.inputs import InputInfo

_compat.register_exclusion(__file__)

_RUN, _CALL, _LATER = 0, 1, 2
_CALLS: dict[int, int] = {}  # calls so far per plan (multi-process ids)


def _resolved_step(st: tuple[Any, ...]) -> tuple[Any, ...]:
    """A step with its compile job's result in place."""
    code, fn, ins, outs, free = st
    if code == _RUN:
        return (code, compiling.resolve(fn), ins, outs, free)
    if code == _LATER:
        return (*fn.get()[0][:4], free)
    return st


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
        out_shardings: Sequence[Any] | None = None,
        compiler_options: dict[str, Any] | None = None,
        exe_cache: dict[Any, Any] | None = None,
        pieces: dict[int, Any] | None = None,
        assembled: dict[int, list[int]] | None = None,
        digest: Callable[[], str] | None = None,
    ) -> None:
        self.plan = plan
        self._stage_axis = stage_axis or "stage"
        targets = labels.targets
        #: multi-process: which devices are this process's (None: a single process)
        self._loc = loc = crossproc.locality()
        if loc is not None:  # the submeshes the program uses (values live on; with
            # out_shardings, outputs may go to any)
            used = {s for (_v, s) in plan.slots} | {f.stage for f in plan.frags}
            if out_shardings is not None and any(o is not None for o in out_shardings):
                used = {t.index for t in targets}
            crossproc.check_layout(loc, [t for t in targets if t.index in used])
        #: the processes this program's calls pair up with (None: none to pair with)
        self._group = (
            None
            if loc is None
            else crossproc.group_tag(loc, [d for t in targets for d in t.device_ids])
        )
        self._calls = 0
        #: constants put once and kept between calls: (slot, host value, sharding)
        self._kept: list[tuple[int, Any, Any]] = []
        text = plan.as_text()
        if loc is not None:  # processes pair calls up by it: other work, another program
            text += "\nprogram: " + (digest() if digest else crossproc.program_digest(prog))
        self._uid = _compat.stable_hash(text)
        slot_sh: dict[int, Any] = compiling.LazyDict()  # values may be pending compiles
        # fragments compile on a thread pool, in plan order; several processes on one
        # host share its cores
        threads = compiling.num_threads(1 if loc is None else _local_processes())
        jobs = compiling.Jobs(threads)
        template: list[Any] = [None] * plan.num_slots
        steps: list[tuple[Any, ...]] = []
        slot_var = {sid: var for (var, _s), sid in plan.slots.items()}
        slot_stage = {sid: s for (_v, s), sid in plan.slots.items()}
        n_out = len(plan.outputs)
        wanted = list(out_shardings) if out_shardings is not None else [None] * n_out
        requests = [
            out_pass.resolve(w, targets, stage_axis, global_mesh, f"out_shardings for output {k}")
            for k, w in enumerate(wanted)
        ]
        # what each fragment output slot that is a program output should be made as
        force_sh: dict[int, jax.sharding.Sharding] = {}
        for out, req in zip(plan.outputs, requests):
            if out[0] != "slots":
                continue
            ids = out[1]
            for i in ids:
                if slot_stage[i] in req.unfit:
                    raise ValueError(req.unfit[slot_stage[i]] + ".")
                if slot_stage[i] in req.per_stage:
                    force_sh[i] = req.per_stage[slot_stage[i]]
                elif len(ids) > 1:  # replicated over several submeshes: assemble one array
                    force_sh[i] = NamedSharding(targets[slot_stage[i]].mesh, PartitionSpec())
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
        cache: dict[Any, Any] = exe_cache if exe_cache is not None else {}
        options = dict(compiler_options or {})
        opt_key = tuple(sorted((k, str(v)) for k, v in options.items()))
        #: how this plan's executables were made (compiled, or relocated from a submesh
        #: of the same shape running the same program)
        self.compile_stats = stats = compiling.CompileStats(threads)
        owned: set[int] = set()  # slots holding buffers only the runtime references
        planned: dict[Any, compiling.Pending] = {}  # fragments keyed at planning time
        planned_r: dict[Any, compiling.Pending] = {}  # ... by their device-free keys
        donatable: set[int] = set()  # input slots of donated arguments
        #: slots sent to another process: the transport holds their buffers until the
        #: peer pulls them, so no later fragment here may donate them
        offered: set[int] = set()
        borrowed: set[int] = set()  # slots holding the caller's buffers (or constants)
        #: slots whose buffers are donated to a later fragment (invalid after it runs)
        self.donated_slots: set[int] = set()
        #: fragments doing the same work (another microbatch's): rewritten once
        same_work: dict[Any, tuple[Any, str, tuple[Any, ...]]] = {}

        for step_no, st in enumerate(plan.steps):
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
                        prog,
                        slot_var,
                        donated,
                        donatable,
                        pieces or {},
                    )
                )
                borrowed.update(sid for _ip, sid in st.items)
            elif st.kind == "run":
                f = plan.frags[st.fragment]
                info = plan.fragments[st.fragment]
                in_ids = [plan.slots[s] for s in f.inputs]
                out_ids = [plan.slots[s] for s in f.outputs]
                mesh = targets[f.stage].mesh
                _check_sub_byte(f, info)
                jaxpr, text, placed = self._fragment_jaxpr(
                    f, info.name, prog, labels, mesh, global_mesh, stage_axis, same_work
                )
                fn = _compat.jaxpr_as_fun(_compat.ClosedJaxpr(jaxpr, []))
                # a fragment without inputs would run on the default device: pin it. On a
                # one-device submesh every layout is the same, and a fragment of replicated
                # inputs that names no sharding makes replicated outputs: fix these, so the
                # fragments using the outputs need not wait for this compile (they compile
                # at once, in parallel)
                out_types = [v.aval for v, _ in f.outputs]
                fixed = (
                    mesh.size == 1
                    or (not in_ids and compiling.places_nothing(jaxpr, out_types))
                    or compiling.outputs_replicated(
                        [dict.get(slot_sh, i) for i in in_ids], mesh, jaxpr, out_types
                    )
                )
                out_sh = tuple(
                    force_sh.get(i, NamedSharding(mesh, PartitionSpec()) if fixed else None)
                    for i in out_ids
                )
                known = all(sh is not None for sh in out_sh)  # no job waits for its compile
                # donate at last use: user-donated inputs, and our own intermediates
                # (fragment outputs and transfer copies) when an output can reuse them
                out_avals = [(tuple(v.aval.shape), v.aval.dtype) for v, _ in f.outputs]
                donate_l = []
                for k, i in enumerate(in_ids):
                    if i not in st.free or i in offered:
                        continue
                    if i in donatable:
                        donate_l.append(k)
                        continue
                    if i in owned and not _small(slot_var[i].aval):
                        key_av = (tuple(slot_var[i].aval.shape), slot_var[i].aval.dtype)
                        if key_av in out_avals and not _is_key(slot_var[i].aval):
                            out_avals.remove(key_av)
                            donate_l.append(k)
                donate = tuple(donate_l)
                self.donated_slots.update(in_ids[k] for k in donate)
                body = _named(fn, "mm_" + _sanitize(info.name))

                def keys(
                    in_sh, f=f, out_sh=out_sh, donate=donate, mesh=mesh, text=text, placed=placed
                ) -> tuple[Any, Any, list[Any]]:
                    avals = [
                        jax.ShapeDtypeStruct(
                            v.aval.shape,
                            v.aval.dtype,
                            sharding=sh,
                            weak_type=getattr(v.aval, "weak_type", False),
                        )
                        for (v, _), sh in zip(f.inputs, in_sh)
                    ]
                    # identical fragments (e.g. one stage's work for each microbatch, or
                    # the same program planned for other input placements) share one
                    # executable
                    key = (text, in_sh, out_sh, donate, tuple(avals), opt_key, placed)
                    if not in_sh:  # nothing else in the key names the devices it runs on
                        key = (*key, mesh)
                    # ... and so do fragments that differ only in which submesh (of one
                    # shape) runs them: one compile, loaded for the other devices
                    rkey = compiling.device_free_key(
                        mesh, (mesh, key[0], in_sh, out_sh, donate, avals, opt_key, placed)
                    )
                    return key, rkey, avals

                def job(
                    in_sh,
                    key,
                    rkey,
                    avals,
                    out_sh=out_sh,
                    donate=donate,
                    body=body,
                    info=info,
                    mesh=mesh,
                    jaxpr=jaxpr,
                ) -> Any:
                    def build() -> Any:
                        return _compile(body, in_sh, out_sh, donate, avals, options, info, mesh)

                    def make() -> Any:
                        return compiling.compile_or_relocate(cache, rkey, mesh, build, stats, jaxpr)

                    # this mm.jit's identical fragments share one; other mm.jit objects
                    # of this process share those they made before
                    return compiling.compile_once(
                        cache, key, lambda: compiling.compile_shared(key, jaxpr, make, stats)
                    )

                remote = loc is not None and not loc.has(mesh.devices.flat)
                now = tuple(dict.get(slot_sh, i) for i in in_ids)
                if remote and known:
                    # another process runs it, and its output layouts are known: nothing
                    # to compile here (that process compiles it)
                    compiled = None
                elif any(isinstance(sh, compiling.Pending) for sh in now):
                    # the input shardings are the producers' compiled output shardings
                    def waiting(in_ids=in_ids, keys=keys, job=job) -> Any:
                        in_sh = tuple(slot_sh[i] for i in in_ids)  # waits for the producers
                        return job(in_sh, *keys(in_sh))

                    compiled = jobs.submit(waiting)
                else:
                    # keyed now: a fragment identical to one already planned shares its
                    # job, and one to relocate from another submesh's compile becomes a
                    # job once that compile is done (neither holds a compile thread).
                    # Only if no job waits for it (its output shardings are known): a
                    # deferred job is queued after jobs that could wait for it. (Equal
                    # keys have equal output shardings, so a shared job is deferred only
                    # if no fragment sharing it has unknown outputs.)
                    key, rkey, avals = keys(now)
                    compiled = planned.get(key)
                    if compiled is None:
                        run = functools.partial(job, now, key, rkey, avals)
                        src = planned_r.get(rkey) if known and rkey is not None else None
                        compiled = jobs.submit(run) if src is None else jobs.submit_after(src, run)
                        planned[key] = compiled
                        if rkey is not None:
                            planned_r.setdefault(rkey, compiled)
                self.compiled.append(compiled)
                self._run_index.append(len(steps))
                for k, i in enumerate(out_ids):
                    slot_sh[i] = (
                        out_sh[k]
                        if known
                        else compiled.derive(lambda c, k=k: c.output_shardings[k])
                    )
                owned.update(out_ids)
                if remote:
                    continue  # another process runs it (compiled here only for its shardings)
                steps.append((_RUN, compiled, tuple(in_ids), tuple(out_ids), tuple(st.free)))
                continue
            elif st.kind == "transfer":
                if loc is None:
                    later = jobs.submit(lambda st=st: self._transfer_step(st, targets, slot_sh))
                    for src, dst, aval, _s, d in st.items:
                        ssh = dict.get(slot_sh, src)
                        slot_sh[dst] = (  # known now when the source's sharding is
                            later.derive(lambda r, dst=dst: r[1][dst])
                            if isinstance(ssh, compiling.Pending)
                            else tr.dst_sharding(ssh, targets[d].mesh, tuple(aval.shape))
                        )
                    steps.append((_LATER, later, (), (), ()))
                else:
                    offered.update(
                        src
                        for src, _dst, _aval, _s, d in st.items
                        if not loc.only(targets[d].mesh.devices.flat)
                    )

                    def cross(st=st, step_no=step_no) -> tuple[Any, dict[int, Any]]:
                        run, dst_sh = crossproc.transfer_step(
                            st.items, targets, slot_sh, loc, self._uid_base, step_no
                        )
                        return (_CALL, run, (), (), ()), dst_sh

                    if any(
                        isinstance(dict.get(slot_sh, it[0]), compiling.Pending) for it in st.items
                    ):
                        # its sources' shardings are pending compiles: a job, like them
                        later = jobs.submit(cross)
                        for _src, dst, *_x in st.items:
                            slot_sh[dst] = later.derive(lambda r, dst=dst: r[1][dst])
                        steps.append((_LATER, later, (), (), ()))
                    else:
                        step, dst_sh = cross()
                        slot_sh.update(dst_sh)
                        steps.append(step)
                owned.update(dst for _src, dst, *_ in st.items)
            if st.free and steps[-1][0] in (_CALL, _LATER):
                steps[-1] = (*steps[-1][:4], tuple(st.free))
        jobs.wait()
        slot_sh = slot_sh.resolved()
        out_ids = [list(o[1]) if o[0] == "slots" else [] for o in plan.outputs]
        if loc is not None:
            # outputs replicated over every submesh: copy them to the submeshes that do not
            # produce them through the transport (they may be other processes')
            items = []
            for k, req in enumerate(requests):
                ids = out_ids[k]
                if not (ids and req.replicate):
                    continue
                have = {slot_stage[i] for i in ids}
                for s in sorted(set(req.per_stage) - have):
                    new = len(template)
                    template.append(None)
                    slot_stage[new], slot_var[new] = s, slot_var[ids[0]]
                    items.append((ids[0], new, slot_var[ids[0]].aval, slot_stage[ids[0]], s))
                    ids.append(new)
            if items:
                run, dst_sh = crossproc.transfer_step(
                    items, targets, slot_sh, loc, self._uid_base, len(plan.steps)
                )
                slot_sh.update(dst_sh)
                steps.append((_CALL, run, (), (), ()))
        self.compiled = [compiling.resolve(c) for c in self.compiled]
        self._steps = [_resolved_step(st) for st in steps]
        self._loop = _fold(self._steps)
        #: multi-process: the processes this one still sends data to from each loop
        #: position on (a failure there leaves them waiting: ``crossproc.note_failure``)
        self._owes: list[frozenset[int]] = [frozenset()]
        for step in reversed(self._loop):
            self._owes.append(self._owes[-1] | getattr(step[1], "sends_to", frozenset()))
        self._owes.reverse()
        self._template = template
        self._outs: list[Callable[[list[Any]], Any] | None] = []
        literals: list[tuple[int, Any, Any]] = []
        #: the sharding of each returned output (flat)
        self.output_shardings: list[Any] = []
        default_sh = NamedSharding(targets[0].mesh, PartitionSpec())
        for k, (out, req) in enumerate(zip(plan.outputs, requests)):
            if out[0] == "literal":
                literals.append((k, out[1], out[2]))
                self._outs.append(None)
                self.output_shardings.append(
                    req.final if req.final is not None else req.per_stage.get(0, default_sh)
                )
                continue
            ids = out_ids[k]
            out_pass.check_final_move(k, ids, req, slot_sh, slot_stage)
            self.output_shardings.append(
                out_pass.output_sharding(ids, req, slot_sh, slot_stage, self._stage_axis)
            )
            shape = tuple(slot_var[ids[0]].aval.shape)
            self._outs.append(
                out_pass.output_fn(
                    ids,
                    req,
                    slot_sh,
                    slot_stage,
                    borrowed,
                    shape,
                    self._stage_axis,
                    slot_var[ids[0]].aval.dtype,
                    getattr(slot_var[ids[0]].aval, "weak_type", False),
                )
            )
        self._literal_pos = [k for k, _v, _a in literals]
        # an output returned twice (``return h, h``) is two arrays, as under jax.jit
        seen: set[tuple[int, ...]] = set()
        self._dup_outputs: list[int] = []
        for k, out in enumerate(plan.outputs):
            if out[0] == "slots":
                key = tuple(out_ids[k])
                if key in seen:
                    self._dup_outputs.append(k)
                seen.add(key)
        # outputs returned as one array sharded over the stage axis, from per-stage pieces
        self._assembled: list[tuple[int, list[int], Any, tuple[int, ...], list[Any]]] = []
        for k, idxs in (assembled or {}).items():
            ids = [plan.outputs[i][1][0] for i in idxs]
            shs = [slot_sh[i] for i in ids]
            same = all(isinstance(x, NamedSharding) and x.spec == shs[0].spec for x in shs)
            # piece j belongs on stage j in the pieces' layout: others are moved there
            fix = [
                None
                if same and slot_stage[i] == j
                else NamedSharding(targets[j].mesh, shs[0].spec if same else PartitionSpec())
                for j, i in enumerate(ids)
            ]
            piece_sh = shs[0] if same else fix[0]
            gsh = layers.stage_sharding(global_mesh, piece_sh, self._stage_axis)
            piece_shape = tuple(slot_var[ids[0]].aval.shape)
            shape = (piece_shape[0] * len(ids), *piece_shape[1:])
            self._assembled.append((k, list(idxs), gsh, shape, fix))
            self.output_shardings[k] = gsh
        self._num_outputs = len(plan.outputs) - sum(len(i) - 1 for i in (assembled or {}).values())
        self.output_shardings = self.output_shardings[: self._num_outputs]
        self._literals = out_pass.literal_fn(
            literals, NamedSharding(targets[0].mesh, PartitionSpec()), requests, loc
        )

    def _uid_base(self) -> tuple[int, int]:
        """The same on every process: (program, call number)."""
        return (self._uid, self._calls)

    # -- steps ------------------------------------------------------------------------

    @staticmethod
    def _fragment_jaxpr(
        f: Any,
        name: str,
        prog: FlatProgram,
        labels: Labels,
        mesh: Any,
        global_mesh: Any,
        stage_axis: str | None,
        same_work: dict[Any, tuple[Any, str, tuple[Any, ...]]],
    ) -> tuple[Any, str, tuple[Any, ...]]:
        """The jaxpr a fragment compiles (its equations' shardings rewritten for their
        submeshes), its fingerprint and the placements embedded in it. Fragments doing
        the same work on the same meshes (every microbatch's) share one."""
        ins, outs = [v for v, _ in f.inputs], [v for v, _ in f.outputs]
        raw = _compat.make_jaxpr_obj(ins, outs, [prog.eqns[i] for i in f.eqns], name)
        tmeshes = tuple(
            labels.task_meshes[i] if labels.tasks[i] is not None else None for i in f.eqns
        )
        work = (_compat.jaxpr_fingerprint(raw, devices=True), mesh, tmeshes)
        hit = same_work.get(work)
        if hit is not None:
            return hit
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
        jaxpr = _compat.make_jaxpr_obj(ins, outs, conds.merge_conds(eqns), name)
        same_work[work] = hit = (
            jaxpr,
            _compat.jaxpr_fingerprint(jaxpr),
            compiling.embedded_placements(jaxpr),
        )
        return hit

    def _keep(self, template: list[Any], sid: int, val: Any, sh: Any) -> None:
        """Put a constant kept between calls (put again if deleted; a float0 zero, e.g. an
        integer argument's gradient, stays a host value JAX cannot delete)."""
        template[sid] = x = jax.device_put(val, sh)
        if isinstance(x, jax.Array):
            self._kept.append((sid, val, sh))

    def _input_step(
        self,
        st,
        infos,
        sample_args,
        put_shardings,
        targets,
        slot_sh,
        template,
        prog,
        slot_var,
        donated,
        donatable,
        pieces,
    ):
        """Per argument: where its value must be (one slot per stage that needs it), and
        its *home* sharding: an argument that already has it is used in place (or sliced
        per submesh, sharing buffers); anything else is put with one ``device_put``."""
        # per argument: (slot, sharding, the cut taking its piece or None, shape)
        per_arg: dict[int, list[tuple[int, Any, Any, tuple[int, ...]]]] = {}
        in_place: set[int] = set()  # arguments used where they are (as is / sliced)
        host_cut: set[int] = set()  # arguments sliced before they are put
        all_arg: dict[int, list[Any]] = {}  # per argument: every stage's sharding
        for ip, sid in st.items:
            mesh = targets[ip.stage].mesh
            shape = tuple(slot_var[sid].aval.shape)
            if ip.mode == "const":
                val = prog.consts[-1 - ip.arg]
                sh = NamedSharding(mesh, PartitionSpec())
                slot_sh[sid] = sh
                if self._loc is None or self._loc.has(mesh.devices.flat):
                    self._keep(template, sid, val, sh)
                continue
            a, cut = ip.arg, None
            local = self._loc is None or self._loc.has(mesh.devices.flat)
            if ip.mode == "host_const":  # a small constant made on the host: put once
                sh = slot_sh[sid] = NamedSharding(mesh, PartitionSpec())
                if local:  # never donated (too small), so every call can use it
                    self._keep(template, sid, pieces[a].value, sh)
                continue
            if ip.mode == "as_is":
                sh = sample_args[a].sharding
                in_place.add(a)
            elif ip.mode == "extract":
                spec = dict(infos[a].extract_specs)[ip.stage]
                sh = NamedSharding(mesh, spec)
                in_place.add(a)
            elif ip.mode == "piece":  # one stage's rows of a stage-sharded argument
                piece = pieces[a]
                a, cut = piece.arg, functools.partial(_rows, start=piece.start, stop=piece.stop)
                sh = NamedSharding(
                    mesh, layers.piece_spec(sample_args[a].sharding, self._stage_axis)
                )
                in_place.add(a)
            elif ip.mode == "host_slice":  # a static slice of a host argument, put
                a, cut = pieces[a].arg, pieces[a].cut
                host_cut.add(a)
                sh = NamedSharding(mesh, PartitionSpec())
            else:
                chooser = put_shardings[a]
                sh = (
                    chooser(ip.stage)
                    if chooser is not None
                    else _kept_layout(sample_args[a], targets[ip.stage])
                    or NamedSharding(mesh, PartitionSpec())
                )
            slot_sh[sid] = sh
            all_arg.setdefault(a, []).append(sh)
            if not local:
                continue  # another process feeds that submesh
            per_arg.setdefault(a, []).append((sid, sh, cut, shape))

        def home_of(a: int, shs: list[Any]) -> Any:
            if a in in_place:
                return sample_args[a].sharding
            if a in host_cut:
                return None
            return shs[0] if len(shs) == 1 else tr.union_sharding(shs, self._stage_axis)

        #: per argument with input slots: the sharding it is used in place with (or None),
        #: over every submesh that uses it, whichever process feeds them: every process
        #: then accepts the same arguments for this program (see Compiled.accepts)
        self.homes: dict[int, Any] = {a: home_of(a, shs) for a, shs in all_arg.items()}
        #: arguments the plan uses where they are (as is or sliced), not put
        self.in_place: frozenset[int] = frozenset(in_place)
        leaves = []
        for a, tgts in per_arg.items():
            home = home_of(a, [sh for _sid, sh, _c, _s in tgts])
            direct: list[int] = []
            extracts: list[tuple[int, Any, tuple[int, ...], tuple[int, ...]]] = []
            # whole values whose layout is not a part of home's (a stage-sharded argument
            # also used whole on a submesh): put from it, resharded by jax
            puts: list[tuple[int, Any]] = []
            if home is not None:
                home_ids = _compat.addressable_device_ids(home)
                for sid, sh, cut, shape in tgts:
                    if sh == home and cut is None:
                        direct.append(sid)
                    elif cut is None and not tr.same_pieces(home, sh, shape):
                        puts.append((sid, sh))
                    else:
                        pos = tuple(home_ids.index(d) for d in _compat.addressable_device_ids(sh))
                        extracts.append((sid, sh, pos, shape))
            if a in donated and len(tgts) == 1 and not extracts and not puts:
                donatable.add(tgts[0][0])
            aval = slot_var[tgts[0][0]].aval
            leaves.append((a, home, tuple(direct), tuple(extracts), tuple(puts), tuple(tgts), aval))
        leaves_t = tuple(leaves)
        spans = self._loc is not None and any(
            not sh.is_fully_addressable for *_x, tgts, _a in leaves for _s, sh, _c, _p in tgts
        )
        put = jax.device_put
        make = jax.make_array_from_single_device_arrays
        pieces_of = _compat.single_device_arrays
        rewrap = _compat.rewrap

        splitters: dict[int, Callable[..., Any]] = {}

        def split_on_device(a: int, tgts: tuple[Any, ...], v: jax.Array) -> Any:
            """A device array given for a host-sliced argument: its slices, cut by one
            jitted call where it is (compiled on first use), then put as host slices."""
            fn = splitters.get(a)
            if fn is None:
                cuts = [cut for _sid, _sh, cut, _shape in tgts if cut is not None]
                fn = splitters[a] = jax.jit(lambda x: tuple(c(x) for c in cuts))
            return fn(v)

        #: (argument, its sharding) -> whether it is its home's layout on the same
        #: devices (an uncommitted array, or a SingleDeviceSharding for a one-device
        #: submesh): then it is re-wrapped with the home sharding, not put (no copy)
        same: dict[tuple[int, Any], bool] = {}

        def run_inputs(env: list[Any], args: Sequence[Any]) -> None:
            ids: list[int] = []
            vals: list[Any] = []
            shs: list[Any] = []
            keys: dict[int, Any] = {}  # position in ids -> PRNG impl of a key put as data
            for a, home, direct, extracts, puts, tgts, aval in leaves_t:
                x = args[a]
                here = False
                if home is not None:
                    sh = getattr(x, "sharding", None)
                    if sh is home or sh == home:
                        here = True
                    elif sh is not None:
                        ok = same.get((a, sh))
                        if ok is None:
                            ok = same[(a, sh)] = _compat.same_layout_as(x, home)
                        if ok:
                            x = rewrap(x, home)
                            here = True
                if here:
                    for sid in direct:
                        env[sid] = x
                    if extracts:
                        parts = pieces_of(x)
                        for sid, sh, pos, shape in extracts:
                            env[sid] = make(shape, sh, [parts[p] for p in pos])
                    for sid, sh in puts:
                        ids.append(sid)
                        vals.append(x)
                        shs.append(sh)
                    continue
                v = _as_array(x, aval)
                impl = None
                if spans and isinstance(v, jax.Array) and v.is_fully_addressable:
                    # a process-local value onto a submesh split over processes: every
                    # process puts its part of the same host value (a typed PRNG key as
                    # its key data, wrapped again once put)
                    if _is_key(v):
                        impl = jax.random.key_impl(v)
                        v = np.asarray(jax.random.key_data(v))
                    else:
                        v = np.asarray(v)
                if a in host_cut and isinstance(v, jax.Array):
                    cuts = iter(split_on_device(a, tgts, v))
                    for sid, sh, cut, _shape in tgts:
                        ids.append(sid)
                        vals.append(v if cut is None else next(cuts))
                        shs.append(sh)
                    continue
                for sid, sh, cut, _shape in tgts:
                    if impl is not None:
                        keys[len(ids)] = impl
                    ids.append(sid)
                    vals.append(v if cut is None else cut(v))
                    shs.append(sh)
            if ids:
                for n, (sid, v) in enumerate(zip(ids, put(vals, shs))):
                    env[sid] = v if n not in keys else jax.random.wrap_key_data(v, impl=keys[n])

        return (_CALL, run_inputs, (), (), ())

    def _transfer_step(self, st, targets, slot_sh):
        """The step copying ``st``'s values, and the destinations' shardings."""
        fast_src, fast_dst, fast_sh = [], [], []
        slow_src, slow_dst, slow_sh = [], [], []
        dst_sh = {}
        for src, dst, aval, _s, d in st.items:
            shape = tuple(aval.shape)
            ssh = slot_sh[src]
            dsh = tr.dst_sharding(ssh, targets[d].mesh, shape)
            dst_sh[dst] = dsh
            if tr.same_layout(ssh, dsh, shape) and not _is_key(aval):
                fast_src.append(src), fast_dst.append(dst), fast_sh.append(dsh)
            else:
                slow_src.append(src), slow_dst.append(dst), slow_sh.append(dsh)
        copy = _compat.same_layout_copier(fast_sh) if fast_src else None

        def run_transfer(env: list[Any], args: Sequence[Any]) -> None:
            if copy is not None:
                for i, v in zip(fast_dst, copy([env[i] for i in fast_src])):
                    env[i] = v
            if slow_src:
                for i, v in zip(slow_dst, jax.device_put([env[i] for i in slow_src], slow_sh)):
                    env[i] = v

        # a transfer of same-layout values only can run as part of its producer's step
        run_transfer.same_layout = (  # type: ignore[attr-defined]
            None if slow_src else (tuple(fast_src), tuple(fast_dst), copy)
        )
        return (_CALL, run_transfer, (), (), ()), dst_sh

    # -- call -------------------------------------------------------------------------

    @property
    def num_executables(self) -> int:
        """Distinct XLA executables (identical fragments share one)."""
        return len({id(c) for c in self.compiled if c is not None})

    def record(self, args: Sequence[Any]) -> tuple[list[Any], Any]:
        if self._loc is not None:
            raise NotImplementedError(
                "record() measures a single-process run; in a multi-process run, time the "
                "call instead (or profile each process with jax.profiler)."
            )
        return self._record(args)

    def _record(self, args: Sequence[Any]) -> tuple[list[Any], Any]:
        """Run once, recording per-fragment times and live buffers per stage.

        A waiter thread per submesh blocks on each fragment's outputs in dispatch order,
        so submeshes still overlap. A fragment's start is the latest of its dispatch, the
        end of the previous fragment on its submesh, and the ends of its producers.
        """
        from multimesh.runtime.record import record_run

        if _compat.transfers_guarded():
            with _compat.own_transfers_allowed():
                return record_run(self, args)
        return record_run(self, args)

    def finish(self, env: list[Any]) -> list[Any]:
        """The program outputs (fresh arrays) from the final environment."""
        outs = [o(env) if o is not None else None for o in self._outs]
        if self._literal_pos:
            for k, v in zip(self._literal_pos, self._literals()):
                outs[k] = v
        for k, idxs, gsh, shape, fix in self._assembled:
            parts = []
            for i, f in zip(idxs, fix):
                x = outs[i] if f is None else jax.device_put(outs[i], f)
                parts.extend(_compat.single_device_arrays(x))
            outs[k] = _compat.with_weak_type(
                jax.make_array_from_single_device_arrays(
                    shape, gsh, parts, dtype=outs[idxs[0]].dtype
                ),
                getattr(outs[idxs[0]], "weak_type", False),  # PRNG keys have none
            )
        for k in self._dup_outputs:
            outs[k] = _compat.fresh_copy([outs[k]])[0]
        outs = outs[: self._num_outputs]
        if self._loc is not None:  # other processes may fetch these (mm.distributed.to_host)
            from multimesh.distributed import _host

            _host.register(outs, self._uid, self._calls)
        return outs

    def kept_constants(self) -> list[Any]:
        """The device arrays of the constants kept between calls (captured arrays)."""
        return [self._template[sid] for sid, _v, _s in self._kept]

    def fresh_env(self) -> list[Any]:
        """A call's slots: the constants kept between calls in place (put again if
        something deleted them, e.g. ``for a in jax.live_arrays(): a.delete()``)."""
        t = self._template
        for sid, val, sh in self._kept:
            if t[sid].is_deleted():
                t[sid] = jax.device_put(val, sh)
        return list(t)

    def __call__(self, args: Sequence[Any]) -> list[Any]:
        if _compat.transfers_guarded():
            # the plan's moves between submeshes (and of arguments to the submeshes
            # using them) are the program's, as jax.jit's collectives and argument
            # placement: a caller's device-to-device guard does not refuse them
            with _compat.own_transfers_allowed():
                return self._call(args)
        return self._call(args)

    def _call(self, args: Sequence[Any]) -> list[Any]:
        # numbered per plan, not per executor: two executors of one plan (the same
        # function jitted twice, or a variant for other input placements) never reuse a
        # (program, call) pair naming cross-process transfers and to_host outputs
        self._calls = _CALLS[self._uid] = _CALLS.get(self._uid, 0) + 1
        if self._group is not None:  # what peers waiting for this process compare
            crossproc.check_usable(self._group)
            crossproc.note_run(self._group, self._uid)
        env = self.fresh_env()
        pos = 0
        try:
            for pos, (code, fn, get, outs, free, copy) in enumerate(self._loop):  # noqa: B007
                if code == _RUN:
                    res = fn(*get(env))
                    for i, r in zip(outs, res):
                        env[i] = r
                    if copy is not None:
                        pick, dst, copier = copy
                        for i, v in zip(dst, copier(pick(res))):
                            env[i] = v
                else:
                    fn(env, args)
                for i in free:
                    env[i] = None
            pos = len(self._loop)
            return self.finish(env)
        except BaseException as e:
            # failed at run time (see Compiled._donating): the arguments were checked
            # before the loop, so this is the program's failure (a callback raising,
            # possibly while the first fragment is launched), after which jax.jit has
            # consumed its donated arguments
            with contextlib.suppress(AttributeError, TypeError):
                e.mm_ran = True  # type: ignore[attr-defined]
            if self._loc is not None:
                self._failed(e, pos)
            raise

    def _failed(self, e: BaseException, pos: int) -> None:
        """A multi-process call failed here at loop position ``pos``: the processes
        still waiting for this call's data, and any asking for its outputs, are told
        (they stop with this error rather than wait forever)."""
        from multimesh.distributed import _host

        summary = crossproc.error_summary(e)
        # a peer that failed or stopped first explains a transport's bare error here
        text, cause = crossproc.explain(e) if self._group is not None else (summary, None)
        _host.note_failed(self._uid, self._calls, text)
        owes = self._owes[pos]
        if self._group is not None:
            crossproc.note_failure(self._group, owes, summary, root=cause)
        if self._group is not None and owes and cause is None:
            with contextlib.suppress(AttributeError, TypeError):
                many = len(owes) > 1
                e.add_note(
                    f"multimesh: process{'es' if many else ''} "
                    f"{', '.join(map(str, sorted(owes)))} wait{'' if many else 's'} for data "
                    f"this call would have sent; unless {'their' if many else 'its'} own call "
                    f"failed too, {'they stop' if many else 'it stops'} with this error."
                )


def _kept_layout(x: Any, target: Any) -> Any:
    """For an array put onto a submesh whose devices (in order) it already is on (typed
    by an Explicit-axes mesh, which fragments traced on Auto submeshes cannot take as
    is): its layout there, so it is re-wrapped (no copy) instead of replicated."""
    sh = getattr(x, "sharding", None)
    if not isinstance(sh, NamedSharding) or not spec_axes(sh.spec) <= set(target.mesh.axis_names):
        return None
    out = NamedSharding(target.mesh, sh.spec)
    return out if _compat.same_layout_as(x, out) else None


def _local_processes() -> int:
    from multimesh.distributed._init import local_process_count

    return local_process_count()


def _fold(steps: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The loop ``__call__`` runs: each fragment's C++ entry with a C-level getter of its
    arguments (a tuple), and a same-layout transfer of only the previous fragment's
    outputs folded into that fragment's step (one loop iteration and one Python call
    fewer per transfer)."""
    loop: list[tuple[Any, ...]] = []
    for code, fn, ins, outs, free in steps:
        if code == _RUN:
            loop.append((code, _compat.fast_call(fn), _tuple_getter(ins), outs, free, None))
            continue
        fast = getattr(fn, "same_layout", None) if code == _CALL else None
        prev = loop[-1] if loop else None
        if fast is not None and prev is not None and prev[0] == _RUN and prev[5] is None:
            src, dst, copier = fast
            if set(src) <= set(prev[3]) and not set(src) & set(prev[4]):
                pos = tuple(prev[3].index(i) for i in src)
                loop[-1] = (*prev[:4], prev[4] + tuple(free), (_tuple_getter(pos), dst, copier))
                continue
        loop.append((code, fn, ins, outs, free, None))
    return loop


def _tuple_getter(idx: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``lambda xs: tuple(xs[i] for i in idx)``, at C speed where ``itemgetter`` gives a
    tuple (two or more indices)."""
    if len(idx) >= 2:
        return operator.itemgetter(*idx)
    if len(idx) == 1:
        (i,) = idx
        return lambda xs: (xs[i],)
    return lambda xs: ()


def _compile(body, in_sh, out_sh, donate, avals, options, info, mesh) -> Any:
    """Compile one fragment. Outputs XLA pins to one device (e.g. a callback's result)
    are made replicated NamedShardings, so later fragments can take them as inputs."""
    # without inputs nothing tells JAX the devices a sharding constraint on the submesh's
    # abstract mesh refers to (it made such outputs replicated): the submesh, as context
    def where() -> Any:
        return _compat.mesh_context(mesh) if not avals else _compat.no_mesh_context()

    for attempt in range(2):
        with compiling.quiet_unusable_donations(), where():
            try:
                lowered = jax.jit(
                    body, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate
                ).lower(*avals)
            except ValueError as e:
                if "ordered effects" not in str(e):
                    raise
                raise ValueError(
                    f"fragment {info.name!r} (tasks {list(info.tasks)}) has ordered effects "
                    f"(io_callback / debug.print with ordered=True) on a submesh of "
                    f"{mesh.size} devices; JAX orders effects on one device only. Put that "
                    "work on a one-device submesh (mm.task(..., mesh=...)), or use "
                    "ordered=False."
                ) from None
            compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        odd = [
            k for k, sh in enumerate(compiled.output_shardings) if not isinstance(sh, NamedSharding)
        ]
        if not odd or attempt:
            return compiled
        rep = NamedSharding(mesh, PartitionSpec())
        out_sh = tuple(rep if k in odd else sh for k, sh in enumerate(out_sh))
    return compiled


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def body(*args: Any) -> Any:
        return tuple(fn(*args))

    body.__name__ = body.__qualname__ = name
    return body


def _rows(x: Any, *, start: int, stop: int) -> Any:
    return x[start:stop]


def _check_sub_byte(f: Any, info: Any) -> None:
    """A fragment taking a sub-byte value (int4) where this JAX's compiled programs
    refuse such inputs: a clear error instead of JAX's layout mismatch at the call."""
    for v, _ in f.inputs:
        dt = getattr(v.aval, "dtype", None)
        if dt is None or jax.dtypes.issubdtype(dt, jax.dtypes.extended):
            continue
        if jax.dtypes.itemsize_bits(dt) < 8 and not _compat.sub_byte_inputs_work():
            raise ValueError(
                f"fragment {info.name!r} (tasks {list(info.tasks)}) takes a value of dtype {dt}, "
                f"{v.aval.str_short()}: this JAX ({jax.__version__}) cannot pass sub-byte "
                "arrays into compiled programs (its compiled calls refuse their layouts; "
                "newer JAX, e.g. 0.12, can). Convert it to int8 where it is made or "
                "passed in (x.astype(jnp.int8)) and back inside the task that uses it, "
                "or upgrade jax."
            )


def _small(aval: Any) -> bool:
    """Too small for donating it to save anything (a loss accumulator): not donated, so
    that the first microbatch's fragment, which gets it from a constant made once on the
    host (``host_inputs.HostConst``), is the same program as the others'."""
    return not _is_key(aval) and aval_nbytes(aval) <= HOST_CONST_MAX_BYTES


def _is_key(aval: Any) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)


def _as_array(x: Any, aval: Any) -> Any:
    if isinstance(x, jax.Array):
        return x
    if type(x) in (bool, int, float, complex) and getattr(aval, "weak_type", False):
        return x  # put as is: weakly typed, as jax.jit makes a Python scalar
    return np.asarray(x, dtype=aval.dtype) if not _is_key(aval) else x
