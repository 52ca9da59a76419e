"""Running a plan on several processes: which steps are local, and transfers between
submeshes that live in different processes.

Every process traces, plans and compiles the same program (so every process knows
every fragment's shardings), then runs only what touches its own devices: fragments
whose submesh has a local device, the inputs those need, and its side of each
transfer. A transfer between submeshes is a set of single-device copies (shard ``i`` of
the source to shard ``i`` of the destination); copies within a process are local,
copies across processes go through the transport (:mod:`multimesh.runtime.transport`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from multimesh import _compat
from multimesh.runtime import transfer as tr
from multimesh.runtime import transport as tp

_compat.register_exclusion(__file__)


@dataclasses.dataclass(frozen=True)
class Locality:
    """Which process owns which device, seen from this process."""

    me: int
    owner: dict[int, int]  # device id -> process index

    def procs(self, devices: Any) -> set[int]:
        return {self.owner[int(d.id)] for d in devices}

    def has(self, devices: Any) -> bool:
        """Whether any of ``devices`` is this process's."""
        return any(self.owner[int(d.id)] == self.me for d in devices)

    def only(self, devices: Any) -> bool:
        """Whether all of ``devices`` are this process's."""
        return all(self.owner[int(d.id)] == self.me for d in devices)


def locality() -> Locality | None:
    """This process's view, or ``None`` in a single-process run."""
    if jax.process_count() == 1:
        return None
    return Locality(jax.process_index(), {int(d.id): d.process_index for d in jax.devices()})


@dataclasses.dataclass
class _Group:
    """This process's calls among one group of processes (the processes holding a
    program's devices): what peers compare to tell a process that made other calls
    than they did from a slow one (see :func:`divergence`)."""

    runs: int = 0  # calls run (every call of a program over these processes)
    plans: int = 0  # plans compared (the key-value keys' sequence)
    waiting: int = -1  # the plan number this process waits for its peers to build
    recent: collections.deque[tuple[int, str]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=_KEEP_RUNS)
    )  # (run, program) of the latest runs
    chain: str = ""  # a digest of the programs of every run so far, in order


_GROUPS: dict[str, _Group] = {}
_GROUPS_LOCK = threading.Lock()
_KEEP_RUNS = 32  # the programs of this many recent runs per group are compared


def group_tag(loc: Locality, devices: Sequence[int]) -> str | None:
    """The group of processes holding ``devices`` (ids), as a key; ``None`` where no
    other process or not this one takes part (nothing to compare)."""
    group = sorted({loc.owner[int(d)] for d in devices})
    if len(group) == 1 or loc.me not in group:
        return None
    return "-".join(map(str, group))


def note_run(tag: str, uid: int) -> None:
    """A call of program ``uid`` over the group ``tag`` starts on this process."""
    with _GROUPS_LOCK:
        g = _GROUPS.setdefault(tag, _Group())
        g.runs += 1
        g.recent.append((g.runs, str(uid)))
        g.chain = str(_compat.stable_hash(f"{g.chain}/{uid}"))
    from multimesh.distributed import _host

    tp.watch_calls()  # this process asks its peers what they ran (first: see _Watch)
    _host.ensure_service()  # ... and they ask it


def note_failure(tag: str, owes: Sequence[int], summary: str, root: str | None = None) -> None:
    """A call over the group ``tag`` failed on this process at run time (a callback
    raising, say; ``summary``: its error in a line; ``root``: an earlier failure
    elsewhere that caused it, if known) before it sent the processes ``owes`` their
    data: they wait for data that will never come, inside XLA, where no error can reach
    them. Published in the key-value store (it outlives this process's own service),
    where their watch finds it (:func:`owed_by_failed_peer`) and ends them with this
    error.

    With the ``ppermute`` transport, transfers pair up in call order: a later call over
    these processes would pair its transfers with the failed call's, so this process
    makes no more (:func:`check_usable`)."""
    with _GROUPS_LOCK:
        run = _GROUPS.setdefault(tag, _Group()).runs
        _FAILED_HERE.add((tag, run))
    if not owes:
        return
    if tp.get_transport().name == "ppermute":
        _UNUSABLE[tag] = (
            f"call {run} of the mm.jit calls of processes {tag.replace('-', ', ')} failed on "
            f"this process ({summary}) before it sent {_procs(owes)} data. With the "
            "ppermute transport transfers pair up in call order, so no later call over "
            "these processes can run (it would pair with the failed call's transfers): "
            "restart the job, or use the default transport (MULTIMESH_TRANSPORT=server), "
            "with which the processes still waiting stop and the others go on"
        )
    record: dict[str, Any] = {"owes": sorted(int(p) for p in owes), "error": summary}
    if root is not None:
        record["root"] = root
    _publish(f"{tag}/{run}", record)


def note_stopping(root: str) -> None:
    """This process stops (:func:`owed_by_failed_peer`; ``root``: the failure that
    started it): every process it ran calls with would wait for its data in vain; their
    watch ends them too, naming the root cause."""
    me = jax.process_index()
    root = root.replace("this process", f"process {me}")
    for tag in state():
        owes = [int(p) for p in tag.split("-") if int(p) != me]
        _publish(f"{tag}/stop", {"owes": owes, "root": root})


def _publish(what: str, record: dict[str, Any]) -> None:
    key = f"multimesh/failed/{jax.process_index()}/{what}"
    try:
        tp.kv_client().key_value_set(key, json.dumps(record))
    except Exception:  # noqa: BLE001 - the job is going down: its peers are stopped anyway
        pass


def check_usable(tag: str) -> None:
    """Raise if an earlier call over the group ``tag`` failed here in a way that leaves
    no later call able to run (:func:`note_failure`)."""
    why = _UNUSABLE.get(tag)
    if why is not None:
        raise RuntimeError(f"mm.jit: {why}.")


def _procs(procs: Sequence[int]) -> str:
    """``process 1 its`` / ``processes 1, 2 their``."""
    ids = ", ".join(map(str, sorted(procs)))
    return f"processes {ids} their" if len(procs) > 1 else f"process {ids} its"


_FAILED_HERE: set[tuple[str, int]] = set()  # (group, run) of calls that failed here
_UNUSABLE: dict[str, str] = {}  # group -> why no call over it can run any more


def error_summary(error: BaseException, limit: int = 400) -> str:
    """One line naming ``error``: its type and first line, and its last line where
    that says more (JAX wraps a callback's exception in a traceback's text)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if len(lines) > 1:
        text += f" ... {lines[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failure_cause() -> str | None:
    """Why a call or output failed here where a transport's bare error says little
    ("Connection closed"): the first failure of a peer's call, else a peer that stopped
    (naming this process by number)."""
    records = _failure_records()
    me = jax.process_index()
    for peer, tag, run, rec in records:  # a failure no other one explains
        if peer != me and run != "stop" and "root" not in rec:
            return _failed_text(peer, tag, run, rec["error"])
    for _peer, _tag, _run, rec in records:  # else the first one those name
        if "root" in rec:
            return rec["root"].replace("this process", f"process {me}")
    return None


def explain(error: BaseException) -> tuple[str, str | None]:
    """``error`` in a line with its :func:`failure_cause` ("probably because", also added
    to ``error`` as a note), and that cause."""
    summary, cause = error_summary(error), failure_cause()
    if cause is None:
        return summary, None
    with contextlib.suppress(AttributeError, TypeError):
        error.add_note(f"multimesh: probably because {cause}.")
    return f"{summary} (probably because {cause})", cause


def _failure_records() -> list[tuple[int, str, str, dict[str, Any]]]:
    """Every published failure: (process, group, run or ``stop`` for a process that
    stopped (:func:`note_stopping`), record)."""
    try:
        entries = tp.kv_client().key_value_dir_get("multimesh/failed/")
    except Exception:  # noqa: BLE001 - nothing known (the store may be going down)
        return []
    out = []
    for key, raw in sorted(entries):
        peer, tag, run = key.rsplit("/", 3)[-3:]
        out.append((int(peer), tag, run, json.loads(raw)))
    return out


def _failed_text(peer: int, tag: str, run: str, error: str) -> str:
    return (
        f"process {peer}'s call {run} of the mm.jit calls of processes "
        f"{tag.replace('-', ', ')} failed ({error})"
    )


def owed_by_failed_peer() -> tuple[str, str] | None:
    """Why this process can never finish its calls, and the failure that started it: a
    peer's call failed before that peer sent this process its part
    (:func:`note_failure`), or a peer stopped for that reason (:func:`note_stopping`);
    ``None`` if none did. A call that failed here too is not waited for (its outputs
    were never returned), nor is a stopped peer by a process whose last call with it
    failed here."""
    me = jax.process_index()
    records = _failure_records()
    for peer, tag, run, rec in records:  # a failure first: the stops follow from one
        if run == "stop" or me not in rec["owes"] or peer == me:
            continue
        if (tag, int(run)) in _FAILED_HERE:
            continue
        text = _failed_text(peer, tag, run, rec["error"])
        why = f"{text} before it sent this process that call's data, which never comes"
        if "root" in rec:  # itself caused by an earlier failure
            return f"{why} (first: {rec['root']})", rec["root"]
        return why, text
    for peer, tag, run, rec in records:
        if run != "stop" or me not in rec["owes"] or peer == me:
            continue
        with _GROUPS_LOCK:
            group = _GROUPS.get(tag)
        if group is None or (tag, group.runs) in _FAILED_HERE:
            # no call here over those processes, or the last one failed here too: this
            # process waits for none of the stopped one's data (until it calls again)
            continue
        why = f"process {peer} stopped, and this process needs its data (first: {rec['root']})"
        return why, rec["root"]
    return None


def state() -> dict[str, list[Any]]:
    """This process's calls per group (served to peers by ``to_host``'s service)."""
    with _GROUPS_LOCK:
        return {
            t: [g.runs, g.plans, g.waiting, list(g.recent), g.chain] for t, g in _GROUPS.items()
        }


def group_peers() -> set[int]:
    """The other processes this one ran calls with."""
    return {int(p) for tag in state() for p in tag.split("-")} - {jax.process_index()}


def divergence(peer: int, theirs: dict[str, list[Any]] | None) -> str | None:
    """Why this process and ``peer`` can never meet again, from ``peer``'s ``state()``
    (``None`` when they may: one is only slower). Among the processes of a group,
    calls pair up in order, so the processes made different calls when
    - one waits for the others to build a new plan for its call number ``n`` (new
      argument shapes, dtypes, placements or static values, or another function),
      while the other already ran its call ``n`` with a program it had compiled before;
    - they ran their call ``n`` with different programs."""
    if not theirs:
        return None
    for tag, (runs, plans, waiting, recent, chain) in state().items():
        if tag not in theirs:
            continue
        p_runs, p_plans, p_waiting, p_recent, p_chain = theirs[tag]
        procs = f"the mm.jit calls of processes {tag.replace('-', ', ')}"
        if waiting >= 0 and p_runs > runs and p_plans <= waiting:
            return (
                f"process {peer} ran call {runs + 1} of {procs} with a program it had "
                "compiled before, while this process planned a new program for it"
            )
        if p_waiting >= 0 and runs > p_runs and plans <= p_waiting:
            return (
                f"process {peer} traced a new program for call {p_runs + 1} of {procs}, "
                "while this process ran it with a program it had compiled before"
            )
        ran = dict(map(tuple, p_recent))
        for n, uid in recent:
            if ran.get(n, uid) != uid:
                return f"process {peer} ran another program than this process as call {n} of {procs}"
        if runs == p_runs and chain != p_chain:
            return (
                f"process {peer} ran other programs than this process among its {runs} "
                f"mm.jit calls over processes {tag.replace('-', ', ')}"
            )
    return None


def final_divergence(peer: int, theirs: dict[str, list[Any]]) -> str | None:
    """At the end (every process done): ``divergence``, or calls this process and
    ``peer`` made a different number of times."""
    why = divergence(peer, theirs)
    if why is not None:
        return why
    for tag, (runs, *_rest) in state().items():
        p_runs = theirs.get(tag, [0])[0]
        if str(peer) in tag.split("-") and p_runs != runs:
            return (
                f"process {peer} made {p_runs} mm.jit calls over processes "
                f"{tag.replace('-', ', ')}, this process {runs}"
            )
    return None


DIVERGED_HINT = (
    "Every process must make the same mm.jit calls in the same order, with arguments of "
    "the same shapes, dtypes, placements and static values (a new shape on one process "
    "traces a new program there only)."
)


def program_digest(prog: Any) -> str:
    """A digest of a traced program's work (its equations, literals, shapes; not the
    values of captured arrays), added to the plan's text where processes pair calls
    up: two functions with plans of the same text (``x * 1.0`` and ``x * 2.0`` on the
    same stages) are different programs."""
    jaxpr = _compat.make_jaxpr_obj(
        list(prog.constvars) + list(prog.invars), list(prog.outvars), list(prog.eqns), "program"
    )
    return _compat.jaxpr_fingerprint(jaxpr, portable=True)


def peer_timeout_s() -> float:
    """How long to wait for another process (``MULTIMESH_PLAN_TIMEOUT``, default 1800 s):
    a peer may legitimately be busy (data loading, compiling)."""
    return float(os.environ.get("MULTIMESH_PLAN_TIMEOUT", "1800"))


def check_same_plan(
    loc: Locality,
    uid: int,
    inputs: Sequence[str],
    names: Sequence[str],
    what: str,
    devices: Sequence[int],
    timeout_s: float | None = None,
) -> tuple[str, int] | None:
    """Every process must build the same plan for the same call (the transfers pair up by
    plan): compare this process's plan with those of the other processes holding the
    program's ``devices`` (ids), before anything runs, and name the arguments placed
    differently instead of hanging in a transfer that never pairs. A program on one
    process's devices, or on none of this process's, compares nothing. Returns the
    group and plan number to pass to :func:`all_compiled` once the plan is compiled
    (``None``: nothing to compare).

    ``inputs`` describes where each flat argument is on this process; ``names`` are
    the arguments' paths (for the message). The plan is for this process's next call
    (an ahead-of-time ``compile()`` compares when it first runs), so peers that ran
    that call with another program are told apart from slow ones (:func:`divergence`)."""
    if timeout_s is None:
        timeout_s = peer_timeout_s()
    tag = group_tag(loc, devices)
    if tag is None:
        return None  # no transfer between processes, or none this process takes part in
    with _GROUPS_LOCK:
        g = _GROUPS.setdefault(tag, _Group())
        seq, g.plans = g.plans, g.plans + 1
    kv = tp.kv_client()
    mine = {"uid": str(uid), "inputs": list(inputs)}
    kv.key_value_set(f"multimesh/plan/{tag}/{seq}/{loc.me}", json.dumps(mine))
    g.waiting = seq
    try:
        for p in map(int, tag.split("-")):
            if p != loc.me:
                _compare_plan(
                    kv,
                    f"multimesh/plan/{tag}/{seq}/{p}",
                    seq,
                    p,
                    loc.me,
                    mine,
                    names,
                    what,
                    timeout_s,
                )
    finally:
        g.waiting = -1
    return tag, seq


def all_compiled(
    loc: Locality, plan: tuple[str, int], what: str, error: BaseException | None = None
) -> None:
    """Once this process compiled its part of a plan (``plan``: from
    :func:`check_same_plan`), wait until the other processes of its group compiled
    theirs, so that none starts running first. JAX's CPU collectives (gloo) connect a
    group's processes at its first collective and give up after 30 s: a process that
    finished compiling early waited there for a peer still compiling (8 processes on 2
    cores) and failed with "Gloo context initialization failed". ``error``: this
    process failed to compile (its peers stop with it, instead of waiting)."""
    tag, seq = plan
    kv = tp.kv_client()
    mine = "ok" if error is None else "failed: " + error_summary(error)
    kv.key_value_set(f"multimesh/compiled/{tag}/{seq}/{loc.me}", mine)
    if error is not None:
        return
    timeout_s = peer_timeout_s()
    for p in map(int, tag.split("-")):
        if p == loc.me:
            continue
        raw = _wait_for(
            kv,
            f"multimesh/compiled/{tag}/{seq}/{p}",
            p,
            timeout_s,
            f"{what} on process {loc.me} has waited {{s:.0f}} s for process {p} to "
            f"compile its part of the same call (plan number {seq}).",
            check=_diverged(p, what),
        )
        if raw is _GONE:
            raise RuntimeError(
                f"{what}: process {p} exited while compiling its part of this call (plan "
                f"number {seq}); see its log."
            )
        if raw is None:
            raise RuntimeError(
                f"{what}: process {p} did not compile its part of this call within "
                f"{timeout_s:.0f} s (MULTIMESH_PLAN_TIMEOUT)."
            )
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        if text.startswith("failed: "):
            raise RuntimeError(
                f"{what}: process {p} failed to compile its part of this call: "
                f"{text[len('failed: '):]}"
            )


def _diverged(p: int, what: str) -> Callable[[], str | None]:
    """A ``check`` for :func:`_wait_for`: why process ``p`` made other calls than this
    one (asked from its service), or ``None`` while it may only be slower."""

    def check() -> str | None:
        from multimesh.distributed import _host

        why = divergence(p, _host.peer_state(p))
        return None if why is None else f"{what}: {why}. {DIVERGED_HINT}"

    return check


def _compare_plan(
    kv: Any,
    key: str,
    seq: int,
    p: int,
    me: int,
    mine: dict[str, Any],
    names: Sequence[str],
    what: str,
    timeout_s: float,
) -> None:
    """Wait for process ``p``'s plan number ``seq`` (under ``key``) and compare it with
    this process's (``mine``): a clear error where they differ, where ``p`` exits first,
    or where ``p`` is found to have made other calls (:func:`divergence`)."""
    raw = _wait_for(
        kv,
        key,
        p,
        timeout_s,
        f"{what} on process {me} has waited {{s:.0f}} s for process {p} to plan the "
        f"same call (its plan number {seq}); every process must call the same mm.jit "
        "functions in the same order, with arguments of the same shapes (a process "
        "running a program it compiled before plans nothing).",
        check=_diverged(p, what),
    )
    if raw is _GONE:
        raise RuntimeError(
            f"{what}: process {p} exited (sys.exit, an error it caught, or the end of "
            f"its script) without building its plan number {seq} for this call. Every "
            "process must call the same mm.jit functions, in the same order, until "
            "the end."
        )
    if raw is None:
        raise RuntimeError(
            f"{what}: process {p} did not build its plan number {seq} within "
            f"{timeout_s:.0f} s (MULTIMESH_PLAN_TIMEOUT): it did not make this call, "
            "or made it with a program it had compiled before (arguments of other "
            "shapes, dtypes or static values than here). Every process must call the "
            "same mm.jit functions, in the same order, with arguments of the same "
            "shapes and placements."
        )
    other = json.loads(raw)
    if other["uid"] == mine["uid"]:
        return
    diff = [
        f"{names[k] if k < len(names) else f'argument {k}'}: here {a}, on process {p} {b}"
        for k, (a, b) in enumerate(zip(mine["inputs"], other["inputs"]))
        if a != b
    ]
    why = (
        "arguments placed differently: "
        + "; ".join(diff[:4])
        + (f" (and {len(diff) - 4} more)" if len(diff) > 4 else "")
        if diff
        else "the traced programs differ (shapes, static arguments or Python control flow)"
    )
    raise RuntimeError(
        f"{what}: process {me} and process {p} built different plans for the same "
        f"call ({why}). Every process must pass the same arguments with the same "
        "placement: commit arrays to the same sharding on every process (e.g. "
        "jax.device_put(x, NamedSharding(mesh, spec)) or an mm.jit output), not to a "
        "process's default device."
    )


_GONE = object()


def exchange_with_all(key: str, value: str, what: str) -> dict[int, str]:
    """Every process's ``value`` under ``key`` (a host barrier that also carries a value):
    a process that exits first, or has not set it within ``MULTIMESH_PLAN_TIMEOUT``, is
    a clear error naming it and ``what`` (a plain barrier waited out the whole timeout,
    half an hour, when one process skipped a collective step)."""
    me, n = jax.process_index(), jax.process_count()
    kv = tp.kv_client()
    kv.key_value_set(f"{key}/{me}", value)
    timeout_s = peer_timeout_s()
    out = {me: value}
    for p in range(n):
        if p == me:
            continue
        raw = _wait_for(
            kv,
            f"{key}/{p}",
            p,
            timeout_s,
            f"{what} on process {me} has waited {{s:.0f}} s for process {p} to reach it; "
            "every process must call it (not only process 0).",
        )
        if raw is _GONE:
            raise RuntimeError(
                f"{what}: process {p} exited without taking part. Every process must call "
                "it, with the same arguments (not only process 0)."
            )
        if raw is None:
            raise RuntimeError(
                f"{what}: process {p} did not take part within {timeout_s:.0f} s "
                "(MULTIMESH_PLAN_TIMEOUT). Every process must call it, with the same "
                "arguments (not only process 0)."
            )
        out[p] = raw.decode() if isinstance(raw, bytes) else str(raw)
    return out


def _wait_for(
    kv: Any,
    key: str,
    peer: int,
    timeout_s: float,
    notice: str,
    check: Callable[[], str | None] | None = None,
) -> Any:
    """``_poll`` for ``peer``'s ``key``: after ``MULTIMESH_WAIT_NOTICE`` (a minute) a word
    on stderr (``notice``, formatted with the seconds waited ``s``: a peer that skipped
    this call and went on, or calls in another order, cannot be told from a slow one),
    then the rest of ``timeout_s``. ``check`` (see ``_poll``) tells a peer that made
    other calls from a slow one."""
    first = min(timeout_s, tp.wait_notice_s())
    since = time.monotonic()
    raw = _poll(kv, key, first, gone=_exiting_key(peer), check=check, since=since)
    if raw is None and timeout_s > first:
        sys.stderr.write(
            f"multimesh: {notice.format(s=first)} Waiting up to {timeout_s:.0f} s "
            "(MULTIMESH_PLAN_TIMEOUT).\n"
        )
        sys.stderr.flush()
        raw = _poll(
            kv, key, timeout_s - first, gone=_exiting_key(peer), check=check, since=since
        )
    return raw


def _exiting_key(process: int) -> str:
    from multimesh.distributed._host import exiting_key

    return exiting_key(process)


#: a wait this long (s) asks the peer what it did (``check``), then every CHECK_EVERY_S
CHECK_AFTER_S = 2.0
CHECK_EVERY_S = 1.0


def _poll(
    kv: Any,
    key: str,
    timeout_s: float,
    gone: str | None = None,
    check: Callable[[], str | None] | None = None,
    since: float | None = None,
) -> Any:
    """The value of ``key`` once another process sets it (``None`` after ``timeout_s``;
    ``_GONE`` once ``gone`` is set: that process is exiting), polled with short sleeps
    (at most 50 ms between tries; ``gone`` every 0.25 s). From ``CHECK_AFTER_S`` after
    ``since``, ``check()`` every ``CHECK_EVERY_S``: a message from two checks in a row
    (the peer did not move on between them) is raised as a ``RuntimeError``."""
    start = time.monotonic()
    deadline = start + timeout_s
    wait = 0.0005
    next_gone = start + 0.25
    next_check = (since if since is not None else start) + CHECK_AFTER_S
    seen: str | None = None
    while True:
        try:
            return kv.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - not set yet (the runtime's NotFound error)
            pass
        now = time.monotonic()
        if now > deadline:
            return None
        if gone is not None and now > next_gone:
            next_gone = now + 0.25
            try:
                kv.key_value_try_get(gone)
                return _GONE
            except Exception:  # noqa: BLE001 - not exiting
                pass
        if check is not None and now > next_check:
            next_check = now + CHECK_EVERY_S
            why = check()
            if why is not None and why == seen:
                raise RuntimeError(why)
            seen = why
        time.sleep(wait)
        wait = min(wait * 2, 0.05)


class LayoutError(ValueError):
    """The processes' devices split a submesh in a way multi-process runs do not support."""


def check_layout(loc: Locality, targets: Sequence[Any]) -> None:
    """Supported: a process holds whole submeshes, or a submesh is split evenly over
    processes that hold no other submesh's devices. Anything else is a clear error."""
    for t in targets:
        devs = list(t.mesh.devices.flat)
        procs = loc.procs(devs)
        if len(procs) <= 1:
            continue
        counts = {p: sum(1 for d in devs if loc.owner[int(d.id)] == p) for p in procs}
        others = [
            (u.name, p)
            for u in targets
            if u is not t
            for p in loc.procs(u.mesh.devices.flat)
            if p in procs
        ]
        if len(set(counts.values())) > 1 or others:
            why = (
                f"uneven device counts per process {counts}"
                if len(set(counts.values())) > 1
                else f"process {others[0][1]} also holds devices of submesh {others[0][0]!r}"
            )
            raise LayoutError(
                f"unsupported multi-process layout: submesh {t.name!r} (devices "
                f"{[int(d.id) for d in devs]}) spans processes {sorted(procs)}: {why}. "
                "Give each process whole submeshes (e.g. --devices-per-process a multiple "
                "of the submesh size), or split a submesh evenly over processes that hold "
                "nothing else."
            )


def placeholder(shape: tuple[int, ...], sharding: Any, dtype: Any) -> jax.Array:
    """A global array with no shard on this process (it lives on other processes)."""
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


def transfer_step(
    items: Sequence[tuple[int, int, Any, int, int]],
    targets: Sequence[Any],
    slot_sh: dict[int, Any],
    loc: Locality,
    uid_base: Callable[[], Any],
    step_no: int,
) -> tuple[Callable[[list[Any], Sequence[Any]], None], dict[int, Any]]:
    """The run function of one transfer step (items: src slot, dst slot, aval, src
    stage, dst stage) on this process, and the destinations' shardings (by slot).
    ``slot_sh`` is only read (a compile job may run this while others fill it)."""
    dst_sh: dict[int, Any] = {}
    local_fast: list[tuple[int, int, Any]] = []
    local_slow: list[tuple[int, int, Any]] = []
    cross: list[dict[str, Any]] = []
    pairs: list[tp.Pair] = []
    for src, dst, aval, s, d in items:
        shape = tuple(aval.shape)
        ssh = slot_sh[src]
        dmesh = targets[d].mesh
        src_devs, dst_devs = list(targets[s].mesh.devices.flat), list(dmesh.devices.flat)
        dsh = tr.dst_sharding(ssh, dmesh, shape)
        if loc.only(src_devs) and loc.only(dst_devs):
            dst_sh[dst] = dsh
            same = tr.same_layout(ssh, dsh, shape) and not _is_key(aval)
            (local_fast if same else local_slow).append((src, dst, dsh))
            continue
        reshard = None
        if not tr.same_layout(ssh, dsh, shape) or _is_key(aval):
            # different layouts: replicate on both sides, then copy device to device
            rsh = NamedSharding(targets[s].mesh, PartitionSpec())
            dsh = NamedSharding(dmesh, PartitionSpec())
            if not _is_key(aval):
                with _compat.no_mesh_context():
                    reshard = (
                        jax.jit(lambda v: v, out_shardings=rsh)
                        .lower(jax.ShapeDtypeStruct(shape, aval.dtype, sharding=ssh))
                        .compile()
                    )
            ssh = rsh
        dst_sh[dst] = dsh
        if not (loc.has(src_devs) or loc.has(dst_devs)):
            continue  # neither end lives here
        if _is_key(aval):
            raise ValueError(
                "a PRNG key moves between submeshes in different processes; pass keys as "
                "uint32 key data (jax.random.key_data) or create them where they are used."
            )
        smap = ssh.devices_indices_map(shape)
        first = len(pairs)
        for dd in dst_devs:
            idx = dsh.devices_indices_map(shape)[dd]
            cands = [sd for sd in src_devs if smap[sd] == idx]
            same_proc = [sd for sd in cands if loc.owner[int(sd.id)] == loc.owner[int(dd.id)]]
            sd = same_proc[0] if same_proc else cands[dst_devs.index(dd) % len(cands)]
            piece_shape = tuple(len(range(*sl.indices(n))) for sl, n in zip(idx, shape))
            pairs.append(
                tp.Pair(
                    sd, dd, loc.owner[int(sd.id)], loc.owner[int(dd.id)], piece_shape, aval.dtype
                )
            )
        cross.append(
            {
                "src": src,
                "dst": dst,
                "pairs": range(first, len(pairs)),
                "reshard": reshard,
                "src_local": loc.has(src_devs),
                "dst_local": loc.has(dst_devs),
                "dsh": dsh,
                "shape": shape,
                "dtype": aval.dtype,
            }
        )
    copy = _compat.same_layout_copy
    transport = tp.get_transport() if cross else None
    me = loc.me

    def run(env: list[Any], args: Sequence[Any]) -> None:
        if local_fast:
            outs = copy([env[s] for s, _d, _sh in local_fast], [sh for *_x, sh in local_fast])
            for (_s, d, _sh), v in zip(local_fast, outs):
                env[d] = v
        if local_slow:
            outs = jax.device_put(
                [env[s] for s, _d, _sh in local_slow], [sh for *_x, sh in local_slow]
            )
            for (_s, d, _sh), v in zip(local_slow, outs):
                env[d] = v
        if not cross:
            return
        outgoing: dict[int, jax.Array] = {}
        local: dict[int, jax.Array] = {}
        for c in cross:
            if not c["src_local"]:
                continue
            x = env[c["src"]]
            if c["reshard"] is not None:
                x = c["reshard"](x)
            by_dev = {int(next(iter(a.devices())).id): a for a in _compat.single_device_arrays(x)}
            for i in c["pairs"]:
                p = pairs[i]
                if p.src_proc != me:
                    continue
                piece = by_dev[int(p.src.id)]
                if p.dst_proc == me:
                    local[i] = jax.device_put(piece, p.dst)
                else:
                    outgoing[i] = piece
        got = transport.exchange((uid_base(), step_no), me, pairs, outgoing)
        got.update(local)
        for c in cross:
            if not c["dst_local"]:
                env[c["dst"]] = placeholder(c["shape"], c["dsh"], c["dtype"])
                continue
            mine = [i for i in c["pairs"] if pairs[i].dst_proc == me]
            order = {d: k for k, d in enumerate(_compat.addressable_device_ids(c["dsh"]))}
            mine.sort(key=lambda i: order[int(pairs[i].dst.id)])
            env[c["dst"]] = jax.make_array_from_single_device_arrays(
                c["shape"], c["dsh"], [got[i] for i in mine]
            )

    #: the processes this step sends data to (their wait on it, were it never sent)
    run.sends_to = frozenset(  # type: ignore[attr-defined]
        p.dst_proc for p in pairs if p.src_proc == me and p.dst_proc != me
    )
    return run, dst_sh


def _is_key(aval: Any) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
