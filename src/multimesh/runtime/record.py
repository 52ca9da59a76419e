"""Measured timelines: per-fragment start/end times and live buffers during one step."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from multimesh import _compat
from multimesh.compiler.ir import aval_nbytes
from multimesh.schedules import Action, Event, Timeline

_compat.register_exclusion(__file__)


def _fragment_deps(plan: Any) -> list[set[int]]:
    """For each fragment, the fragments whose outputs it consumes (directly or by transfer)."""
    producer: dict[tuple[Any, int], int] = {}
    for k, f in enumerate(plan.frags):
        for slot in f.outputs:
            producer[slot] = k
    # a transferred slot (v, dst) comes from (v, src)
    moved: dict[tuple[Any, int], tuple[Any, int]] = {}
    slot_by_id = {sid: slot for slot, sid in plan.slots.items()}
    for st in plan.steps:
        if st.kind == "transfer":
            for src, dst, *_ in st.items:
                moved[slot_by_id[dst]] = slot_by_id[src]
    deps: list[set[int]] = []
    for f in plan.frags:
        d: set[int] = set()
        for slot in f.inputs:
            src = moved.get(slot, slot)
            if src in producer:
                d.add(producer[src])
        deps.append(d)
    return deps


class _Live(list):
    """A call's slots that keep count, as they are set and freed, of the bytes and the
    microbatches each submesh holds (a sum over every slot after every step made
    recording quadratic in the plan's size)."""

    def __init__(self, values, slot_stage, slot_bytes, slot_mb, stages) -> None:
        super().__init__([None] * len(values))
        self._stage, self._nbytes, self._mb = slot_stage, slot_bytes, slot_mb
        self.bytes = {s: 0 for s in stages}
        self.mbs: dict[int, dict[Any, int]] = {s: {} for s in stages}
        for i, v in enumerate(values):
            self[i] = v

    def __setitem__(self, i: int, v: Any) -> None:  # type: ignore[override]
        was = list.__getitem__(self, i) is not None
        list.__setitem__(self, i, v)
        now = v is not None
        s = self._stage.get(i)
        if was == now or s not in self.bytes:
            return
        sign = 1 if now else -1
        self.bytes[s] += sign * self._nbytes[i]
        mb = self._mb.get(i)
        if mb is not None:
            held = self.mbs[s]
            held[mb] = held.get(mb, 0) + sign
            if not held[mb]:
                del held[mb]


def record_run(exe: Any, args: Sequence[Any]) -> tuple[list[Any], Timeline]:
    from multimesh.runtime.executor import _RUN

    plan = exe.plan
    slot_stage = {sid: slot[1] for slot, sid in plan.slots.items()}
    slot_bytes = {sid: aval_nbytes(slot[0].aval) for slot, sid in plan.slots.items()}
    slot_mb = getattr(exe, "slot_microbatch", {})
    stages = sorted({f.stage for f in plan.frags})
    dispatch: dict[int, float] = {}
    ends: dict[int, float] = {}
    queues: dict[int, queue.Queue] = {s: queue.Queue() for s in stages}

    def waiter(s: int) -> None:
        while True:
            item = queues[s].get()
            if item is None:
                return
            k, outs = item
            try:
                if outs:
                    jax.block_until_ready(outs)
                    ends[k] = time.perf_counter()
                else:  # every output is donated onward: it ended before its consumer began
                    ends[k] = None
            except Exception:  # noqa: BLE001 - the run failed; record_run raises its error
                ends[k] = None

    threads = [threading.Thread(target=waiter, args=(s,), daemon=True) for s in stages]
    for t in threads:
        t.start()
    try:
        peak_bytes = {s: 0 for s in stages}
        peak_mbs = {s: 0 for s in stages}
        run_frag = {n: k for k, n in enumerate(exe._run_index)}
        env = _Live(exe.fresh_env(), slot_stage, slot_bytes, slot_mb, stages)
        t_origin = time.perf_counter()
        for n, (code, fn, ins, outs, free) in enumerate(exe._steps):
            if code == _RUN:
                k = run_frag[n]
                dispatch[k] = time.perf_counter()
                res = fn(*[env[i] for i in ins])
                for i, r in zip(outs, res):
                    env[i] = r
                keep = [r for i, r in zip(outs, res) if i not in exe.donated_slots]
                queues[plan.frags[k].stage].put((k, keep))
            else:
                fn(env, args)
            for s in stages:
                peak_bytes[s] = max(peak_bytes[s], env.bytes[s])
                peak_mbs[s] = max(peak_mbs[s], len(env.mbs[s]))
            for i in free:
                env[i] = None
        outputs = exe.finish(env)
        jax.block_until_ready(outputs)
    finally:  # also when the run raises: no waiter left blocked, holding outputs
        for s in stages:
            queues[s].put(None)
        for t in threads:
            t.join()
    deps = _fragment_deps(plan)
    # A fragment starts once dispatched, its submesh is free and its inputs are made; a
    # fragment whose outputs were all donated onward has no observable end: it is shown
    # ending as soon as it could start. Ends never precede starts, so each submesh's
    # events follow each other without overlapping (timer jitter clamps to zero length).
    starts: dict[int, float] = {}
    prev_end: dict[int, float] = {}
    for k in sorted(dispatch, key=lambda k: dispatch[k]):
        s = plan.frags[k].stage
        st = max(
            [dispatch[k], prev_end.get(s, 0.0)]
            + [ends[d] for d in deps[k] if ends.get(d) is not None]
        )
        measured = ends.get(k)
        starts[k] = st
        ends[k] = st if measured is None else max(measured, st)
        prev_end[s] = ends[k]
    index = {s: j for j, s in enumerate(stages)}
    events: list[list[Event]] = [[] for _ in stages]
    for k, f in enumerate(plan.frags):
        info = plan.fragments[k]
        acts = f.actions or [Action(f.stage, -1, (f.phases or "F")[0])]
        # one fragment running several actions (the last stage's forward and backward
        # merged: 'l1:F0+B0') is one launch: shown as equal consecutive parts
        t0, t1 = (starts[k] - t_origin) * 1e6, (ends[k] - t_origin) * 1e6
        part = (t1 - t0) / len(acts)
        for j, act in enumerate(acts):
            events[index[f.stage]].append(
                Event(act, t0 + j * part, t0 + (j + 1) * part, info.name)
            )
    for row in events:
        row.sort(key=lambda e: e.start)
    tl = Timeline(
        events=events,
        name="measured",
        peak_in_flight=[peak_mbs[s] for s in stages],
        peak_live_bytes=[peak_bytes[s] for s in stages],
        stages=stages,
    )
    return outputs, tl
