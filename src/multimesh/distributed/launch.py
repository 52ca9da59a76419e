"""``python -m multimesh.launch``: run a script as N local JAX processes.

    python -m multimesh.launch --nproc 2 --devices-per-process 4 train.py --flags
    python -m multimesh.launch --nproc 2 -m multimesh.examples.train_multiprocess

Starts N processes of ``script.py`` (each one calls ``mm.distributed.initialize()``,
which joins the job from the environment set here), prefixes every output line with
its rank, forwards SIGINT/SIGTERM, and if any process fails or is killed, stops the
others and exits non-zero within seconds, naming the rank and repeating that rank's
last output (its traceback) at the end, where the other ranks' messages about the
broken connection no longer bury it. No process outlives it (children die with the
launcher, even if it is killed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from multimesh.distributed._init import (
    ENV_COORDINATOR,
    ENV_DEVICES_PER_PROCESS,
    ENV_HEARTBEAT,
    ENV_LOCAL_PROCESSES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

GRACE_SECONDS = 5.0
SUMMARY_LINES = 40  # of the failed rank's output, repeated after the others' at the end


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Children get SIGKILL when the launcher dies (Linux), and their own process group."""
    os.setsid()
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_VALUED = ("--nproc", "--devices-per-process", "--coordinator", "--heartbeat-timeout", "--python")


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Launcher options | the program (``script.py args...`` or ``-m module args...``)."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return argv[:i], argv[i:]
        if a in _VALUED:
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            break
    return argv[:i], argv[i:]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m multimesh.launch",
        usage="python -m multimesh.launch --nproc N [options] (script.py | -m module) [args...]",
        description="Run a script as several local JAX processes (jax.distributed), with "
        "rank-prefixed output; one failure stops all.",
    )
    p.add_argument("--nproc", type=int, required=True, help="number of processes")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="virtual CPU devices per process (sets jax_num_cpu_devices in each)",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of the coordinator (default: 127.0.0.1 and a free port)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=None,
        help="seconds JAX waits for a silent peer before failing (JAX default: 100)",
    )
    p.add_argument("--python", default=sys.executable, help="interpreter for the processes")
    opts, program = _split(argv)
    ns = p.parse_args(opts)
    if not program or program == ["-m"]:
        p.error("give a script to run (script.py args...) or a module (-m module args...)")
    if program[0] == "-m":
        ns.module, ns.script, ns.args = program[1], None, program[2:]
    else:
        ns.module, ns.script, ns.args = None, program[0], program[1:]
    if ns.nproc < 1:
        p.error("--nproc must be at least 1")
    if ns.devices_per_process is not None and ns.devices_per_process < 1:
        p.error("--devices-per-process must be at least 1")
    if ns.heartbeat_timeout is not None and ns.heartbeat_timeout < 1:
        p.error("--heartbeat-timeout must be at least 1 (seconds)")
    if ns.coordinator is not None:
        host, sep, port = ns.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            p.error(f"--coordinator {ns.coordinator!r}: give HOST:PORT (e.g. 127.0.0.1:1234)")
    exe = shutil.which(ns.python)
    if exe is None or not os.access(exe, os.X_OK) or os.path.isdir(exe):
        p.error(f"--python {ns.python}: not found, or not an executable")
    return ns


def _pump(
    stream,
    rank: int,
    out,
    tracebacks: dict[int, float] | None = None,
    recent: deque[str] | None = None,
) -> None:
    """Copy a rank's stream to ``out`` line by line, prefixed with its rank; note when
    it first prints a traceback and keep its last lines in ``recent``."""
    prefix = f"[rank {rank}] "
    for line in iter(stream.readline, ""):
        if tracebacks is not None and line.startswith("Traceback (most recent call last)"):
            tracebacks.setdefault(rank, time.monotonic())
        text = prefix + line if line.endswith("\n") else prefix + line + "\n"
        if recent is not None:
            recent.append(text)
        out.write(text)
        out.flush()
    stream.close()


def _last_words(recent: deque[str]) -> str:
    """What to repeat of a failed rank's output: from its last traceback on (at most
    ``SUMMARY_LINES`` lines, its end kept), else its last lines; lines that only report
    collective connections (gloo's "connected to N peer ranks") are left out."""
    lines = [ln for ln in recent.copy() if "peer ranks" not in ln]  # copy: one C call
    starts = [i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln]
    if starts:
        lines = lines[starts[-1] :]
    return "".join(lines[-SUMMARY_LINES:])


def _culprit(
    bad: list[tuple[int, int]],
    tracebacks: dict[int, float],
    exited: dict[int, float] | None = None,
) -> tuple[int, int]:
    """The failed rank to name: the first to exit (its peers fail after it, from the
    broken connection; ``exited``: when each was seen gone); among ranks seen gone at
    once, one killed by a signal (a segfault, the OOM killer), else the first to print
    a traceback, else one aborted (SIGABRT: how JAX's coordination client stops a
    process whose peer, e.g. rank 0 with the coordinator, is gone), else the lowest."""
    if exited:
        first = min(exited.get(r, float("inf")) for r, _c in bad)
        bad = [b for b in bad if exited.get(b[0], float("inf")) <= first]
    killed = [b for b in bad if b[1] < 0 and b[1] != -signal.SIGABRT]
    if killed:
        return killed[0]
    raised = sorted((tracebacks[r], r, c) for r, c in bad if r in tracebacks)
    if raised:
        return raised[0][1], raised[0][2]
    return bad[0]


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse(sys.argv[1:] if argv is None else argv)
    coord = ns.coordinator or f"127.0.0.1:{free_port()}"
    cmd = [ns.python, "-u"]
    cmd += ["-m", ns.module] if ns.module is not None else [ns.script]
    args = ns.args
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    tracebacks: dict[int, float] = {}  # rank -> when it first printed a traceback
    recent: list[deque[str]] = []  # per rank: its last lines, both streams
    # handlers first: a signal while ranks start (one may already be printing) is
    # forwarded to those started, and no more start
    stopping: dict[str, Any] = {"signal": None, "at": 0.0}

    def forward(signum, _frame) -> None:
        stopping["signal"] = signum
        stopping["at"] = time.monotonic()
        _signal_all(procs, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    for rank in range(ns.nproc):
        if stopping["signal"] is not None:
            break
        env = dict(os.environ)
        env[ENV_COORDINATOR] = coord
        env[ENV_NUM_PROCESSES] = str(ns.nproc)
        env[ENV_PROCESS_ID] = str(rank)
        env[ENV_LOCAL_PROCESSES] = str(ns.nproc)  # all on this host: they share its cores
        if ns.devices_per_process is not None:
            env[ENV_DEVICES_PER_PROCESS] = str(ns.devices_per_process)
            env.setdefault("JAX_PLATFORMS", "cpu")
        if ns.heartbeat_timeout is not None:
            env[ENV_HEARTBEAT] = str(ns.heartbeat_timeout)
        proc = subprocess.Popen(
            [*cmd, *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="backslashreplace",  # a rank's non-UTF-8 bytes must not stop the pump
            bufsize=1,
            preexec_fn=_die_with_parent,
        )
        procs.append(proc)
        recent.append(deque(maxlen=4 * SUMMARY_LINES))
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(
                target=_pump, args=(stream, rank, out, tracebacks, recent[rank]), daemon=True
            )
            t.start()
            pumps.append(t)

    failed: tuple[int, int] | None = None
    exited: dict[int, float] = {}  # rank -> when it was first seen gone

    def poll() -> list[int | None]:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for r, c in enumerate(codes):
            if c is not None:
                exited.setdefault(r, now)
        return codes

    try:
        while True:
            codes = poll()
            if stopping["signal"] is not None:
                # the launcher forwarded a signal: the ranks' exits are not failures; wait
                # for all of them, at most the grace period (JAX processes catch SIGTERM,
                # a preemption notice, and may keep running), then _stop_all kills the rest
                if all(c is not None for c in codes):
                    break
                if time.monotonic() - stopping["at"] > GRACE_SECONDS:
                    break
                time.sleep(0.05)
                continue
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed is None:
                # its peers may fail a moment later, from the broken connection: let the
                # first traceback or signal death come in before naming one
                time.sleep(0.5)
                codes = poll()
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                # only aborts so far (JAX's coordination client stopping ranks whose
                # peer is gone): give that peer a few seconds to exit and be named
                until = time.monotonic() + 3
                while (
                    all(c == -signal.SIGABRT for _r, c in bad)
                    and len(bad) < len(procs)
                    and time.monotonic() < until
                ):
                    time.sleep(0.05)
                    codes = poll()
                    bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                failed = _culprit(bad, tracebacks, exited)
                break
            if all(c is not None for c in codes):
                break
            time.sleep(0.05)
    finally:
        if failed is not None or stopping["signal"] is not None:
            # a forwarded signal already had its grace period: straight to SIGKILL
            _stop_all(procs, forwarded=failed is None and stopping["signal"] is not None)
        for s, h in old.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=2)
    if failed is not None:
        rank, code = failed
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        sys.stdout.flush()
        words = _last_words(recent[rank])
        if words:
            sys.stderr.write(f"multimesh.launch: rank {rank}'s last output:\n{words}")
        sys.stderr.write(
            f"multimesh.launch: rank {rank} {how}; stopped the other {ns.nproc - 1} process(es).\n"
        )
        return code if code > 0 else 128 - code
    if stopping["signal"] is not None:
        name = signal.Signals(stopping["signal"]).name
        sys.stderr.write(
            f"multimesh.launch: {name} received; forwarded it and stopped all "
            f"{len(procs)} process(es).\n"  # fewer than --nproc if it came while they started
        )
        return 128 + int(stopping["signal"])
    return 0


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    """Send ``sig`` to the process group of every rank still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def _stop_all(procs: list[subprocess.Popen], forwarded: bool = False) -> None:
    for sig in (signal.SIGKILL,) if forwarded else (signal.SIGTERM, signal.SIGKILL):
        _signal_all(procs, sig)
        deadline = time.monotonic() + GRACE_SECONDS
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    for p in procs:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


if __name__ == "__main__":
    sys.exit(main())
