"""Multi-process MPMD on jax.distributed: local processes on 127.0.0.1 via the launcher.

The default tier runs a quick 2-process training run, the failure handling and the
layout check; the ``multiprocess`` tier (``python -m pytest -m multiprocess``, run by
.ci/run after the unit tests) runs every program and schedule on 2x4, 4x2 and 8x1
processes x devices against the single-process 8-device run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

WORKER = str(Path(__file__).with_name("mp_worker.py"))
ROOT = Path(__file__).resolve().parents[1]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "MULTIMESH_"))}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run(
    cmd: list[str], timeout: float = 600, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd``; a worker still running ``timeout - 30`` s in prints every thread's stack
    and exits (the launcher then stops the rest), so a hang fails with its stacks."""
    env = clean_env()
    env.update(extra_env or {})
    env["MP_WORKER_DUMP_AFTER"] = str(max(timeout - 30, 10))
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")[-4000:], (e.stderr or b"")[-6000:]
        pytest.fail(f"timed out after {timeout}s: {cmd}\n{out[0]!r}\n{out[1]!r}")


def launch(
    nproc: int, per: int, *args: str, timeout: float = 600, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "multimesh.launch",
        "--nproc",
        str(nproc),
        "--devices-per-process",
        str(per),
        WORKER,
        *args,
    ]
    return run(cmd, timeout, extra_env)


def output_tail(proc: subprocess.CompletedProcess, n: int = 6000) -> str:
    """A failed run's output for the assertion message, without gloo's per-collective
    "connected to N peer ranks" lines (they crowd out the first rank's traceback)."""
    lines = (proc.stdout + proc.stderr).splitlines()
    return "\n".join(ln for ln in lines if "peer ranks" not in ln)[-n:]


def results(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    out = {}

    def get(which: str) -> dict[str, np.ndarray]:
        if which not in out:
            path = tmp_path_factory.mktemp("single") / f"{which}.npz"
            proc = run([sys.executable, WORKER, str(path), which])  # no launcher: 1 process
            assert proc.returncode == 0, output_tail(proc)
            assert "process 0 of 1" in proc.stdout
            out[which] = results(path)
        return out[which]

    return get


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6, err_msg=k)


#: compile on two threads per process (on a 2-core machine each of 2 processes would
#: get one): transfers between processes then wait for their sources' compiles as jobs
PARALLEL = {"MULTIMESH_COMPILE_THREADS": "2"}


def test_two_processes_match_one(baseline, tmp_path):
    proc = launch(2, 4, str(tmp_path / "r.npz"), "quick", timeout=240, extra_env=PARALLEL)
    assert proc.returncode == 0, output_tail(proc)
    assert "[rank 0] pid" in proc.stdout and "[rank 1] pid" in proc.stdout
    assert_same(results(tmp_path / "r.npz"), baseline("quick"))
    assert re.search(r"\[rank 0\] one-sided 28\.0", proc.stdout), proc.stdout[-2000:]
    # outputs replicated over every submesh, and a PRNG key passed through and fed back
    assert proc.stdout.count("replicated outputs ok") == 2, proc.stdout[-2000:]
    assert proc.stdout.count("keys over processes ok") == 2, output_tail(proc)
    assert proc.stdout.count("keys between processes ok") == 2, output_tail(proc)
    assert proc.stdout.count("keys and pinned inputs over processes ok") == 2, output_tail(proc)
    assert "[rank 0] local-only ok" in proc.stdout, proc.stdout[-2000:]
    # each process compiled its own fragments only (not the other's: known layouts)
    assert proc.stdout.count("compiled own fragments, skipped") == 2, proc.stdout[-2000:]
    # a data-parallel pipeline (layouts known only after compiling) on 2 compile threads
    assert proc.stdout.count("sharded pipeline ok, compiled on 2 threads") == 2, proc.stdout[
        -2000:
    ]


def test_processes_that_plan_differently_get_a_clear_error(tmp_path):
    """One process passes a host array, the other an array committed to a submesh: the
    plans differ, which both processes report (naming the argument) instead of hanging
    in transfers that never pair up."""
    proc = launch(2, 4, str(tmp_path / "r.npz"), "mismatch", timeout=240)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "built different plans" in text and "v: here" in text, text[-3000:]
    assert "uncommitted (placed by the plan)" in text, text[-3000:]


def test_processes_passing_other_static_values_get_a_clear_error(tmp_path):
    """Static arguments that differ between processes without changing the plan's text
    (a constant factor) ran each stage with its own process's value: a mixed, wrong
    result (found by a probe). The plans compared now include the static values.
    Before that, out_shardings on the other process's devices: JAX's "does not support
    cross-host device transfers" from some processes only; now the same clear error on
    every process, before anything runs."""
    proc = launch(2, 4, str(tmp_path / "r.npz"), "static-mismatch", timeout=240)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    refused = "out_shardings refused: out_shardings of output 0 (flat)"
    # each rank's own output, without the launcher's closing repeat of the failed rank's
    # last lines (which hold its refused line too when its buffered stdout came last)
    own = proc.stdout + proc.stderr.split("'s last output:\n", 1)[0]
    assert own.count(refused) == 2 and "(processes [1]), but stage(s) [0]" in text, text[-3000:]
    assert "built different plans" in text and "static arguments" in text, text[-3000:]


def test_a_new_shape_on_one_process_is_a_clear_error_within_seconds(tmp_path):
    """Rank 1 calls with a new batch size at its third step (a new plan there only),
    rank 0 runs the program it compiled before: each waited for the other until
    MULTIMESH_PLAN_TIMEOUT (half an hour). Now the planning process asks the other what
    it ran and says so within seconds."""
    proc = launch(2, 4, str(tmp_path / "r.npz"), "diverge-shape", timeout=240)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    want = (
        "process 0 ran call 5 of the mm.jit calls of processes 0, 1 with a program it had "
        "compiled before, while this process planned a new program for it"
    )
    assert want in text, output_tail(proc)
    assert "ran to the end" not in text and "MULTIMESH_PLAN_TIMEOUT" not in text, output_tail(proc)


@pytest.mark.multiprocess
def test_a_call_failing_on_one_process_stops_the_processes_waiting_for_it(tmp_path):
    """A callback raising on process 0's stage: process 1 waited forever for data that
    never came (inside XLA, in its to_host). Now a failure before process 0 sent its
    data stops process 1 within seconds with process 0's error, and a to_host of an
    output of a failed call is that error too."""
    t0 = time.monotonic()
    proc = launch(2, 1, str(tmp_path / "r.npz"), "callback-fails", timeout=240)
    took = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, output_tail(proc)
    assert (
        "[rank 1] late raised: mm.distributed.to_host: the mm.jit call that made this output "
        "failed on process 0" in text
    ), output_tail(proc)
    assert "[rank 0] early raised:" in text and "callback failed on purpose" in text
    assert "[rank 0] early note: multimesh: process 1 waits for data this call" in text
    want = "process 0's call 2 of the mm.jit calls of processes 0, 1 failed (JaxRuntimeError"
    assert want in text and "Stopping this process" in text, output_tail(proc)
    assert "rank 1 exited with code 1" in text, output_tail(proc)
    assert "Timeout" not in text and took < 150, output_tail(proc)


@pytest.mark.multiprocess
def test_a_failed_call_on_the_ppermute_transport_pairs_with_no_later_call(tmp_path):
    """The ppermute transport pairs transfers in call order: after process 0's call
    failed before sending, its next call's transfer paired with the failed one's on
    process 1, which read a wrong value. Process 0 now refuses later calls over those
    processes, and process 1 stops with process 0's error."""
    proc = launch(2, 1, str(tmp_path / "r.npz"), "callback-fails-ppermute", timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, output_tail(proc)
    assert "[rank 0] failed call raised:" in text, output_tail(proc)
    assert "[rank 0] next call raised: mm.jit: call 2 of the mm.jit calls of processes 0, 1 " in (
        text
    ), output_tail(proc)
    assert "transfers pair up in call order" in text, output_tail(proc)
    assert "[rank 1] failed call value" not in text and "[rank 1] next call" not in text
    assert "process 0's call 2 of the mm.jit calls of processes 0, 1 failed" in text, (
        output_tail(proc)
    )


@pytest.mark.multiprocess
def test_calls_failing_on_both_processes_let_both_go_on(tmp_path):
    """Each process's call failed before sending the other its data; each caught it and
    went on (right values), and then each was stopped for the other's failure."""
    proc = launch(2, 1, str(tmp_path / "r.npz"), "callbacks-both-fail", timeout=240)
    assert proc.returncode == 0, output_tail(proc)
    assert proc.stdout.count("call with 200.0 failed") == 2, output_tail(proc)
    assert proc.stdout.count("both went on") == 2, output_tail(proc)


@pytest.mark.multiprocess
def test_two_programs_called_in_another_order_are_a_clear_error(tmp_path):
    """Rank 1 calls g before f at its third step; both programs have the same plan text
    (they differ in a constant), so their transfers paired up (a wrong value where the
    stages' work differs) and then, numbered per program, waited for each other until
    MULTIMESH_PLAN_TIMEOUT. Now programs are told apart by their work and a waiting
    process compares its recent calls with its peer's."""
    proc = launch(2, 4, str(tmp_path / "r.npz"), "diverge-order", timeout=240)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "ran another program than this process as call 5 of the mm.jit calls of " in text, (
        output_tail(proc)
    )
    assert "ran to the end" not in text and "MULTIMESH_PLAN_TIMEOUT" not in text, output_tail(proc)


@pytest.mark.multiprocess
def test_calls_in_another_order_that_never_wait_fail_the_job_at_its_end(tmp_path):
    """Programs whose transfers all go one way never wait on a peer, so swapped calls
    ran to the end (exit 0) with values paired across programs: every process now
    compares its calls with its peers' once all are done, and exits 1 saying so."""
    proc = launch(2, 4, str(tmp_path / "r.npz"), "diverge-oneway", timeout=240)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "one-way calls ran to the end" in text, output_tail(proc)
    assert "ran another program than this process as call 3 of the mm.jit calls" in text, (
        output_tail(proc)
    )


@pytest.mark.multiprocess
def test_a_program_compiled_ahead_on_one_process_is_not_a_divergence(tmp_path):
    """An ahead-of-time compile plans a later call, not the next one: peers that go on
    with calls meanwhile are not taken for processes that made other calls, and a new
    program both then call is not "built different plans" (the compile took a plan's
    turn on process 0 only; it is compared when it first runs now)."""
    proc = launch(2, 4, str(tmp_path / "r.npz"), "aot-ahead", timeout=240)
    assert proc.returncode == 0, output_tail(proc)
    assert proc.stdout.count("compiled ahead ok") == 2, output_tail(proc)


@pytest.mark.multiprocess
def test_a_peer_compiling_longer_than_gloos_connect_timeout(tmp_path):
    """Process 1 compiles 35 s longer; the program's first collective spans both
    processes. Process 0 ran first and failed after 30 s in gloo's connect ("Gloo
    context initialization failed", an 8-process CI failure under load): processes
    now wait until every peer compiled its part. A compile failing on process 1 stops
    process 0 with that error."""
    proc = launch(2, 1, str(tmp_path / "r.npz"), "slow-compile", timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, output_tail(proc)
    assert text.count("slow compile ok") == 2, output_tail(proc)
    assert "Gloo context initialization failed" not in text, output_tail(proc)
    assert "[rank 1] failed compile raised: compile failed on purpose" in text, output_tail(proc)
    want = "process 1 failed to compile its part of this call: RuntimeError: compile failed"
    assert f"[rank 0] failed compile raised: mm.jit of 'f': {want}" in text, output_tail(proc)


@pytest.mark.multiprocess
@pytest.mark.timeout(1300)  # 8 processes share the cores: minutes on a loaded machine
@pytest.mark.parametrize("layout", [(2, 4), (4, 2), (8, 1)], ids=["2x4", "4x2", "8x1"])
def test_every_program_and_schedule(layout, baseline, tmp_path):
    extra = PARALLEL if layout == (2, 4) else None  # the GPT's sharded layouts, in parallel
    proc = launch(*layout, str(tmp_path / "r.npz"), "all", timeout=1200, extra_env=extra)
    assert proc.returncode == 0, output_tail(proc)
    assert_same(results(tmp_path / "r.npz"), baseline("all"))


def test_unsupported_layout_is_a_clear_error(tmp_path):
    """Submesh 1 of a (3, 2) mesh on 2 processes x 3 devices spans both processes, and
    process 0 also holds submesh 0: a program using both is refused; one using only
    submesh 1 runs (every submesh was checked, used or not)."""
    proc = launch(2, 3, str(tmp_path / "r.npz"), "layout", timeout=240)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "unsupported multi-process layout" in text and "unused submesh ok" in text, text
    own = proc.stdout + proc.stderr.split("'s last output:\n", 1)[0]  # (see above)
    assert own.count("out_shardings onto it refused") == 2, text
    assert "unsupported multi-process layout" in text and "spans processes [0, 1]" in text, text[
        -3000:
    ]
    assert "multimesh.launch: rank" in proc.stderr


def test_check_layout_before_any_call(monkeypatch):
    """``mm.distributed.check_layout`` raises the layout error up front (a
    ``LayoutError``, a ``ValueError``), for all submeshes or those given; a no-op in one
    process."""
    import multimesh as mm
    from multimesh.runtime import crossproc

    mmesh = mm.make_mesh((2, 4), ("stage", "data"))
    mm.distributed.check_layout(mmesh)  # one process: nothing to check
    with pytest.raises(TypeError, match="takes a MultiMesh"):  # checked in one process too
        mm.distributed.check_layout(mmesh.mesh)
    with pytest.raises(ValueError, match="stage 9 is out of range"):
        mm.distributed.check_layout(mmesh, stages=[9])
    ids = [int(d.id) for d in mmesh.devices]
    # process 0 holds 3 devices, process 1 five: stage 0 is split 3 + 1
    owner = {i: (0 if k < 3 else 1) for k, i in enumerate(ids)}
    monkeypatch.setattr(crossproc, "locality", lambda: crossproc.Locality(0, owner))
    with pytest.raises(mm.distributed.LayoutError, match=r"submesh 'stage0' .* uneven device"):
        mm.distributed.check_layout(mmesh)
    with pytest.raises(ValueError, match="unsupported multi-process layout"):
        mm.distributed.check_layout(mmesh, stages=[0])
    mm.distributed.check_layout(mmesh, stages=[1])  # stage 1 is process 1's alone
    even = {i: k // 4 for k, i in enumerate(ids)}
    monkeypatch.setattr(crossproc, "locality", lambda: crossproc.Locality(0, even))
    mm.distributed.check_layout(mmesh)


def test_a_process_that_never_plans_is_a_clear_error(tmp_path):
    """Only rank 0 calls the mm.jit function: after MULTIMESH_PLAN_TIMEOUT (5 s, set by
    the worker) it says which process did not build its plan, instead of waiting forever."""
    proc = launch(2, 4, str(tmp_path / "r.npz"), "plan-timeout", timeout=240)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "process 1 did not build its plan number 0 within 5 s" in text, text[-3000:]
    # ... after naming the wait on stderr (MULTIMESH_WAIT_NOTICE, 2 s in the worker)
    assert "has waited 2 s for process 1 to plan the same call" in text, text[-3000:]


def test_rank_dying_of_an_exception_stops_the_job_quickly(tmp_path):
    """A rank that raises after its first mm.jit call exits at once (it does not wait at
    exit for the others to finish), so the launcher stops the rank still waiting for it."""
    t0 = time.monotonic()
    proc = launch(2, 4, str(tmp_path / "r.npz"), "raise", timeout=240)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stdout + proc.stderr
    # the rank that raised is named (not rank 0, failing after it from the lost peer)
    assert "multimesh.launch: rank 1 " in proc.stderr, output_tail(proc)
    assert elapsed < 90, f"the job took {elapsed:.0f} s to stop"


def test_rank_leaving_a_training_loop_stops_the_job(tmp_path):
    """Rank 1 calls sys.exit in the middle of a training loop (same program: no plan to
    compare) while rank 0's next step waits for its data: rank 0's wait is watched, it
    names process 1 and stops within seconds (it waited forever)."""
    assert_stops_naming_rank_1(tmp_path, "exit-mid")


def test_rank_exiting_early_stops_the_job_quickly(tmp_path):
    """A rank that calls sys.exit(3) after its first call (exit handlers run; no exception
    hook) while rank 0 waits for its next plan: rank 0 says that process 1 exited, and the
    launcher stops the job. Bytes that are not UTF-8 in a rank's output are shown escaped."""
    proc = assert_stops_naming_rank_1(tmp_path, "exit")
    assert "[rank 1] \\xff not utf-8" in proc.stdout + proc.stderr, output_tail(proc)


def assert_stops_naming_rank_1(tmp_path, mode):
    """Run ``mode`` on 2 processes: it must fail, say process 1 exited, within 90 s."""
    t0 = time.monotonic()
    proc = launch(2, 4, str(tmp_path / "r.npz"), mode, timeout=240)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "process 1 exited" in proc.stdout + proc.stderr, output_tail(proc)
    assert elapsed < 90, f"the job took {elapsed:.0f} s to stop"
    return proc


def _alive(token: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if token in (d / "cmdline").read_bytes().decode(errors="ignore"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return [p for p in pids if p != os.getpid()]


def test_killed_rank_stops_all_within_30s(tmp_path):
    token = str(tmp_path / "forever.npz")
    cmd = [
        sys.executable,
        "-m",
        "multimesh.launch",
        "--nproc",
        "2",
        "--devices-per-process",
        "4",
        WORKER,
        token,
        "mlp",
        "--forever",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT
    )
    try:
        pids: dict[int, int] = {}
        deadline = time.monotonic() + 240
        seen_loss = False
        while time.monotonic() < deadline and not (len(pids) == 2 and seen_loss):
            line = proc.stdout.readline()
            m = re.match(r"\[rank (\d)\] pid (\d+)", line)
            if m:
                pids[int(m[1])] = int(m[2])
            seen_loss = seen_loss or "loss" in line
        assert len(pids) == 2 and seen_loss, "workers did not start training"
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        _out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
        assert proc.returncode != 0
        assert elapsed < 30, elapsed
        # the killed rank is named, not its peer failing after it
        assert "rank 1 killed by signal 9" in err, err[-3000:]
        time.sleep(0.5)
        assert _alive(token) == [], "processes left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _alive(token):
            os.kill(p, signal.SIGKILL)


def test_launcher_help_and_errors():
    proc = run([sys.executable, "-m", "multimesh.launch", "--help"])
    assert proc.returncode == 0 and "--devices-per-process" in proc.stdout
    proc = run([sys.executable, "-m", "multimesh.launch", "--nproc", "0", "x.py"])
    assert proc.returncode != 0 and "--nproc must be at least 1" in proc.stderr
    # one-line usage errors up front (were tracebacks from Popen or from every rank)
    for flags, msg in (
        (["--python", "/nonexistent/python"], "--python /nonexistent/python: not found"),
        (["--python", "/etc/passwd"], "not an executable"),
        (["--coordinator", "nonsense"], "--coordinator 'nonsense': give HOST:PORT"),
        (["--coordinator", "127.0.0.1:99999"], "give HOST:PORT"),
        (["--heartbeat-timeout", "-5"], "--heartbeat-timeout must be at least 1"),
    ):
        proc = run([sys.executable, "-m", "multimesh.launch", "--nproc", "2", *flags, "x.py"])
        assert proc.returncode == 2 and msg in proc.stderr, (flags, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_sigterm_to_the_launcher_stops_everything(tmp_path):
    token = str(tmp_path / "term.npz")
    cmd = [
        sys.executable,
        "-m",
        "multimesh.launch",
        "--nproc",
        "2",
        "--devices-per-process",
        "4",
        WORKER,
        token,
        "mlp",
        "--forever",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if "loss" in proc.stdout.readline():
                break
        proc.send_signal(signal.SIGTERM)  # JAX processes catch SIGTERM and keep going
        t0 = time.monotonic()
        _out, err = proc.communicate(timeout=60)
        # one grace period (5 s), then SIGKILL: there were two in a row (10.5 s)
        assert time.monotonic() - t0 < 9, time.monotonic() - t0
        assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert "SIGTERM received; forwarded it and stopped all 2 process(es)" in err
        time.sleep(0.5)
        assert _alive(token) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _alive(token):
            os.kill(p, signal.SIGKILL)


def test_ctrl_c_on_the_launcher_is_reported_as_such(tmp_path):
    """Ctrl-C stops every rank, exits 130 and says so; it blamed rank 0 ("killed by
    signal 2"), whose death the launcher itself had caused."""
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    cmd = [sys.executable, "-m", "multimesh.launch", "--nproc", "2", str(script)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    try:
        for _ in range(2):  # both ranks started
            assert "ready" in proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "SIGINT received; forwarded it and stopped all 2 process(es)" in err
    assert "killed by signal" not in err


@pytest.mark.parametrize("layout", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
def test_checkpoint_save_then_resume(layout, tmp_path):
    """Save each step on N processes, restore step 2 in a new run (possibly another
    process layout), continue: the losses and parameters equal the uninterrupted run."""
    ck = str(tmp_path / "ck")

    def go(mode: str, nproc: int, per: int) -> dict:
        out = tmp_path / f"{mode}-{nproc}.npz"
        if nproc == 1:
            proc = run([sys.executable, WORKER, str(out), mode, ck], timeout=120)
        else:
            proc = launch(nproc, per, str(out), mode, ck, timeout=120)
        assert proc.returncode == 0, output_tail(proc)
        return results(out)

    saved = go("ckpt-save", *layout)
    resumed = go("ckpt-resume", 2, 4)  # always resumed on 2 processes x 4 devices
    np.testing.assert_array_equal(resumed["ckpt-resume/losses"], saved["ckpt-save/losses"][2:])
    for k in saved:
        if k.startswith("ckpt-save/leaf"):
            np.testing.assert_array_equal(resumed[k.replace("save", "resume")], saved[k])


def test_to_host_keeps_recent_outputs_per_program(monkeypatch):
    """The outputs of each program's last calls stay fetchable however many calls other
    programs make meanwhile (a process running ahead into the next program evicted the
    last outputs a slower process was still fetching: a flaky 8-process failure)."""
    import jax.numpy as jnp

    from multimesh.distributed import _host

    monkeypatch.setattr(_host, "ensure_service", lambda: None)
    monkeypatch.setattr(_host, "_RECENT", type(_host._RECENT)())
    keep = _host._KEEP_CALLS
    a = [jnp.zeros(1) for _ in range(keep + 4)]
    for call, x in enumerate(a, start=1):
        _host.register([x], 111, call)
        for j in range(3):  # another program runs ahead meanwhile
            _host.register([jnp.ones(1)], 222, 3 * call + j)
    live = [c for c in range(1, len(a) + 1) if _host._lookup(f"111:{c}:0") is not None]
    assert live == list(range(len(a) - keep + 1, len(a) + 1))
    assert _host._lookup(f"111:{len(a)}:0") is a[-1]


def test_a_long_wait_for_a_peer_is_named_once_on_stderr(monkeypatch, capsys):
    """Work whose result goes to a peer that never takes it (a peer making other mm.jit
    calls, or the same in another order) is named on stderr after MULTIMESH_WAIT_NOTICE,
    once per wait, instead of waiting silently until MULTIMESH_PLAN_TIMEOUT."""
    from multimesh.runtime import transport

    monkeypatch.setenv("MULTIMESH_WAIT_NOTICE", "0.3")
    monkeypatch.setattr(transport, "_exiting", lambda peer: False)
    watch = transport._Watch()
    watch.POLL_S = 0.05
    with watch.waiting_for(3):
        time.sleep(1.2)
    with watch.waiting_for(5):  # a short wait says nothing
        time.sleep(0.1)
    time.sleep(0.2)
    err = capsys.readouterr().err
    assert err.count("on work whose result goes to process 3") == 1, err
    assert "same mm.jit calls in the same order" in err and "process 5" not in err, err


def test_divergence_tells_other_calls_from_a_slow_peer(monkeypatch):
    """What a waiting process concludes from its peer's calls (``crossproc.state()``):
    only calls that can never pair up are an error; a peer that is behind is not."""
    from multimesh.runtime import crossproc

    G = crossproc._Group
    mine = {"0-1": G(runs=4, plans=2, waiting=1, recent=[(3, "f"), (4, "f")], chain="c4")}
    monkeypatch.setattr(crossproc, "_GROUPS", mine)
    # it waits for plan 1 at its call 5; the peer ran call 5 without building plan 1
    assert "process 1 ran call 5 of the mm.jit calls of processes 0, 1 with a program" in (
        crossproc.divergence(1, {"0-1": [5, 1, -1, [(4, "f"), (5, "f")], "c5"]})
    )
    # ... one that is behind (call 3), or built plan 1 already, or another group: slow
    assert crossproc.divergence(1, {"0-1": [3, 1, -1, [(3, "f")], "c3"]}) is None
    assert crossproc.divergence(1, {"0-1": [5, 2, -1, [(4, "f"), (5, "g")], "c5"]}) is None
    assert crossproc.divergence(1, {"0-2": [9, 0, -1, [(4, "g")], "x"]}) is None
    assert crossproc.divergence(1, None) is None and crossproc.divergence(1, {}) is None
    # the peer waits for plan 2 at its call 3, while this process ran call 3 and 4
    mine["0-1"] = G(runs=4, plans=2, waiting=-1, recent=[(3, "f"), (4, "f")], chain="c4")
    assert "process 1 traced a new program for call 3 of" in crossproc.divergence(
        1, {"0-1": [2, 2, 2, [(2, "f")], "c2"]}
    )
    # ... or ran another program as call 4, or another sequence of as many calls
    assert "process 1 ran another program than this process as call 4 of" in (
        crossproc.divergence(1, {"0-1": [4, 2, -1, [(3, "f"), (4, "g")], "c4"]})
    )
    assert "ran other programs than this process among its 4 mm.jit calls over" in (
        crossproc.divergence(1, {"0-1": [4, 2, -1, [(3, "f"), (4, "f")], "other"]})
    )
    assert crossproc.divergence(1, {"0-1": [4, 2, -1, [(3, "f"), (4, "f")], "c4"]}) is None
    # at the end: as many calls, or it is an error (a peer in no call of the group: 0)
    assert crossproc.final_divergence(1, {"0-1": [4, 2, -1, [(4, "f")], "c4"]}) is None
    assert "process 1 made 3 mm.jit calls over processes 0, 1, this process 4" in (
        crossproc.final_divergence(1, {"0-1": [3, 2, -1, [(3, "f")], "c3"]})
    )
    assert "made 0 mm.jit calls" in crossproc.final_divergence(1, {})
    assert crossproc.final_divergence(2, {}) is None  # not in the group
    # runs chain their programs: the same calls in the same order give the same chain
    monkeypatch.setattr(crossproc, "_GROUPS", {})
    monkeypatch.setattr(crossproc.tp, "watch_calls", lambda: None)
    from multimesh.distributed import _host

    monkeypatch.setattr(_host, "ensure_service", lambda: None)
    chains = []
    for order in ("fg", "gf", "fg"):
        crossproc._GROUPS.clear()
        for uid in order:
            crossproc.note_run("0-1", uid)
        chains.append(crossproc.state()["0-1"][4])
    assert chains[0] == chains[2] != chains[1]


def test_programs_are_told_apart_by_their_work_the_same_in_every_process():
    """The digest added to a plan's text where processes pair calls up: it tells apart
    programs whose plans read the same (a constant differs), and names Python callbacks
    and sets as every process does (by name, sorted), not by identity or hash order."""
    import jax
    import jax.numpy as jnp

    import multimesh as mm
    from multimesh import _compat
    from multimesh.runtime import crossproc

    def prog(k):
        traced = jax.make_jaxpr(lambda x: jax.pure_callback(np.sin, x, x) * k)(jnp.ones(3))
        eqns = list(traced.jaxpr.eqns)
        jx = traced.jaxpr
        return type("P", (), dict(constvars=[], invars=jx.invars, eqns=eqns, outvars=jx.outvars))

    assert crossproc.program_digest(prog(1.0)) == crossproc.program_digest(prog(1.0))
    assert crossproc.program_digest(prog(1.0)) != crossproc.program_digest(prog(2.0))
    memo = {"devices": False, "portable": True}
    assert _compat._param_token(frozenset({"data", "stage"}), memo) == (
        "frozenset", "'data'", "'stage'"
    )
    assert _compat._param_token(mm.jit, memo) == _compat._param_token(mm.jit, dict(memo))
    assert _compat._portable_text("P(None, unreduced={'b', 'a'}) at 0x7f3a") == (
        "P(None, unreduced={'a', 'b'}) at 0x"
    )
    a, b = object(), object()  # addresses differ between processes: not in the digest
    assert _compat._param_token(a, memo) == _compat._param_token(b, memo)


def test_culprit_is_not_a_rank_aborted_after_its_peer():
    """JAX's coordination client aborts (SIGABRT) the ranks whose peer died: the rank
    that raised is named, not the aborted one; a segfault still comes first."""
    from multimesh.distributed.launch import _culprit

    abrt = -int(signal.SIGABRT)
    assert _culprit([(0, 1), (1, abrt)], {0: 1.0}) == (0, 1)
    assert _culprit([(1, abrt)], {}) == (1, abrt)
    assert _culprit([(0, 1), (1, -int(signal.SIGSEGV))], {0: 1.0}) == (1, -int(signal.SIGSEGV))
    # seen gone first wins: a rank that really aborts (os.abort, an XLA CHECK) before
    # its peers fail with tracebacks; one leaving by os._exit(3) without a traceback
    assert _culprit([(0, 1), (1, abrt)], {0: 1.0}, {1: 5.0, 0: 5.2}) == (1, abrt)
    assert _culprit([(0, 1), (1, 3)], {0: 1.0}, {1: 5.0, 0: 5.2}) == (1, 3)
    assert _culprit([(0, 1), (1, abrt)], {0: 1.0}, {0: 5.0, 1: 5.0}) == (0, 1)


@pytest.mark.multiprocess
def test_rank_0_failing_is_named_not_the_rank_aborted_after_it(tmp_path):
    """Rank 0 (which hosts JAX's coordinator) raises: rank 1 is then aborted by JAX; the
    launcher named rank 1 ("killed by signal 6")."""
    script = tmp_path / "r0.py"
    script.write_text(
        "import time\nimport multimesh as mm\nmm.distributed.initialize()\nimport jax\n"
        "if jax.process_index() == 0:\n    raise RuntimeError('bad config on rank 0')\n"
        "time.sleep(60)\n"
    )
    proc = run(
        [sys.executable, "-m", "multimesh.launch", "--nproc", "2", "--devices-per-process",
         "1", str(script)],
        timeout=120,
    )
    assert proc.returncode != 0
    assert "multimesh.launch: rank 0 exited with code 1" in proc.stderr, output_tail(proc)
    # its traceback is repeated at the end, after rank 1's abort messages
    summary = proc.stderr.rsplit("multimesh.launch: rank 0's last output:\n", 1)[-1]
    assert summary.startswith("[rank 0] Traceback (most recent call last)"), output_tail(proc)
    assert "[rank 0] RuntimeError: bad config on rank 0" in summary, output_tail(proc)
    assert "[rank 1]" not in summary, output_tail(proc)


def test_the_failed_ranks_last_words_are_its_last_traceback():
    """The launcher repeats, from the failed rank's last lines, its last traceback (at
    most SUMMARY_LINES lines, the end kept) without gloo's connection lines; with no
    traceback, its last lines."""
    from collections import deque

    from multimesh.distributed.launch import SUMMARY_LINES, _last_words

    lines = [f"[rank 1] step {i}\n" for i in range(5)]
    lines += ["[rank 1] Traceback (most recent call last):\n", "[rank 1] old\n"]
    lines += ["[rank 1] Gloo connected to 7 peer ranks\n"]
    lines += ["[rank 1] Traceback (most recent call last):\n", '[rank 1]   File "x.py"\n']
    lines += ["[rank 1] ValueError: the cause\n"]
    words = _last_words(deque(lines))
    assert words == "".join(lines[-3:])
    long = [f"[rank 2] line {i}\n" for i in range(3 * SUMMARY_LINES)]
    assert _last_words(deque(long)) == "".join(long[-SUMMARY_LINES:])
    assert _last_words(deque()) == ""


@pytest.mark.parametrize("reply", [b"", b'{"index": [[[0, 4]]], "dtype": "<f4", "sizes": [16]}\n\0\0'])
def test_to_host_names_a_peer_that_dies_mid_reply(monkeypatch, reply):
    """A peer exiting while it answers (no reply, or part of a piece): the error names
    it (was a reshape error of 0 bytes, or a bare ConnectionResetError)."""
    import socket
    import threading

    from multimesh.distributed import _host

    srv = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = srv.accept()
        conn.recv(100)
        conn.sendall(reply)
        conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    monkeypatch.setitem(_host._PEERS, 1, srv.getsockname())
    out, filled = np.zeros(4, np.float32), np.zeros(4, bool)
    with pytest.raises(RuntimeError, match="process 1 closed the connection without answering"):
        _host._fetch_from(1, "1:1:0", out, filled)
    t.join(5)
    srv.close()


@pytest.mark.multiprocess
def test_checkpoint_misuse_is_a_clear_error(tmp_path):
    """Values of one process only that differ between processes are refused (one was
    kept silently); a CheckpointManager.save behind ``if process_index() == 0`` fails
    naming the process that did not take part once it exits (it hung 30 minutes)."""
    t0 = time.monotonic()
    proc = launch(2, 4, str(tmp_path / "r.npz"), "ckpt-misuse", timeout=240)
    text = proc.stdout + proc.stderr
    for k in ("loc", "tag", "dev"):
        assert proc.stdout.count(f"process-local values refused {k}") == 2, output_tail(proc)
    assert proc.stdout.count("per-process paths refused") == 2, output_tail(proc)
    assert proc.stdout.count("second manager ok") == 2, output_tail(proc)
    assert "[rank 0] skipped save timed out" in proc.stdout, output_tail(proc)
    assert "has waited 2 s for process 1 to reach it" in text, output_tail(proc)
    assert proc.returncode != 0
    assert "process 1 exited without taking part" in text, output_tail(proc)
    assert time.monotonic() - t0 < 120
