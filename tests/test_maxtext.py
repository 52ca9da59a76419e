"""multimesh-run --model maxtext: unmodified MaxText 0.2.5 pipelined on a MultiMesh trains
with the same losses as MaxText's own unpipelined jax.jit step.

Marked ``maxtext`` (excluded by default): needs Python >= 3.12 and
``pip install -e '.[maxtext,test]'``; run with ``python -m pytest -m maxtext``. Each run is a
subprocess (MaxText sets global JAX flags), on 8 virtual CPU devices.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.maxtext,
    pytest.mark.skipif(
        sys.version_info < (3, 12) or importlib.util.find_spec("maxtext") is None,
        reason="MaxText 0.2.5 is not installed (Python >= 3.12: pip install -e '.[maxtext,test]')",
    ),
]

# the 4-layer llama2 config: emb 64, 4 heads of 16, MLP 128, vocab 256, seq 64,
# 2 sequences per device per microbatch
LLAMA2_TINY = [
    "--model", "maxtext",
    "--num-layers", "4",
    "--model-dims", "64",
    "--num-heads", "4",
    "--mlp-dims", "128",
    "--vocab-size", "256",
    "--sequence-length", "64",
    "--batch-size", "32",
    "--num-microbatches", "2",
    "--schedule", "1f1b",
    "--num-steps", "3",
    "--no-progress",
    "--compare-spmd",
]  # fmt: skip


def run_cli(
    args: list[str], tmp_path: Path, timeout: int = 270, *, nproc: int = 1, name: str = "metrics"
) -> tuple[dict, str]:
    """``multimesh-run`` in one process with 8 CPU devices, or under the launcher in
    ``nproc`` processes sharing them."""
    metrics = tmp_path / f"{name}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if nproc == 1:
        head = [sys.executable, "-m", "multimesh.run", "--cpus", "8"]
    else:
        head = [
            sys.executable, "-m", "multimesh.launch", "--nproc", str(nproc),
            "--devices-per-process", str(8 // nproc), "-m", "multimesh.run",
        ]  # fmt: skip
    try:  # within pytest's 300 s, so a hang fails with the run's output
        proc = subprocess.run(
            [*head, *args, "--metrics", str(metrics)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as e:  # the launcher's ranks die with it
        text = "".join(
            t.decode(errors="replace") if isinstance(t, bytes) else t
            for t in (e.stdout or "", e.stderr or "")
        )
        tail = "\n".join(ln for ln in text.splitlines() if "peer ranks" not in ln)
        pytest.fail(f"multimesh-run timed out after {timeout} s:\n{tail[-4000:]}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return json.loads(metrics.read_text()), out


@pytest.mark.parametrize(
    "layout",
    [
        ("--pp", "2", "--fsdp", "2", "--tp", "2", "--dp", "1"),
        ("--pp", "4", "--dp", "2", "--tied-embeddings", "--dump", "dump"),
    ],
    ids=["pp2-fsdp2-tp2", "pp4-dp2-tied"],
)
def test_maxtext_pipelined_equals_unpipelined(layout, tmp_path):
    m, out = run_cli([*LLAMA2_TINY, *layout], tmp_path)
    if "--tied-embeddings" in layout:
        # MaxText's logits_via_embedding: the table's gradient from the last stage is
        # summed there over microbatches and sent to the first stage once per step
        plan = (tmp_path / "dump" / "plan.txt").read_text()
        assert plan.count("transfer stage3->stage0 float32[256, 64]") == 1, plan
    assert "largest loss difference vs SPMD" in out and "(ok" in out, out[-3000:]
    assert len(m["losses"]) == 3 and len(m["reference_losses"]) == 3
    for got, want in zip(m["losses"], m["reference_losses"]):
        assert abs(got - want) <= 1e-5, (m["losses"], m["reference_losses"])
    assert m["losses"][-1] < m["losses"][0]  # it trains


def test_maxtext_under_the_launcher(tmp_path):
    """2 processes x 4 devices, one stage each: MaxText's metrics (replicated over the
    stages) and step counts are read on both processes; losses equal MaxText's own
    unpipelined jax.jit step run in the same 2 processes."""
    m, out = run_cli([*LLAMA2_TINY, "--pp", "2", "--dp", "4"], tmp_path, nproc=2)
    assert "[rank 1]" in out and "(ok" in out, out[-3000:]
    assert len(m["losses"]) == 3
    for got, want in zip(m["losses"], m["reference_losses"]):
        assert abs(got - want) <= 1e-5, (m["losses"], m["reference_losses"])


# save at step 2 of a 5-step schedule, resume to 5: learning_rate_schedule_steps pins the
# schedule to 5 steps in both runs (MaxText's default spans the run's own --num-steps)
RESUMABLE = [
    *[a for a in LLAMA2_TINY if a not in ("--compare-spmd", "--num-steps", "3")],
    "--pp", "2", "--dp", "4",
    "--maxtext-override", "learning_rate_schedule_steps=5",
]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """MaxText's 5 steps in one go (pipelined, one process)."""
    m, _ = run_cli([*RESUMABLE, "--num-steps", "5"], tmp_path_factory.mktemp("full"))
    return m["losses"]


@pytest.mark.parametrize("nproc", [1, 2], ids=["1-process", "2-processes"])
def test_maxtext_checkpoint_resume_continues_the_loss_curve(nproc, uninterrupted, tmp_path):
    """MaxText's own Orbax checkpointing (async) of the stage-local state under MPMD: 3
    steps save step 2; a 5-step run restores it and trains steps 3-4 with the losses of
    the uninterrupted run (in 2 processes each process writes only its stage's arrays)."""
    ck = str(tmp_path / "ck")
    # one process: a checkpoint every step, the 2 latest kept (MaxText's checkpoint_period
    # and max_num_checkpoints_to_keep)
    every = ["--checkpoint-every", "1", "--max-to-keep", "2"] if nproc == 1 else []
    # relative to the run's directory in one process (Orbax refused relative paths)
    rel = "ck" if nproc == 1 else ck
    first, _ = run_cli(
        [*RESUMABLE, "--num-steps", "3", "--checkpoint-dir", rel, *every], tmp_path,
        nproc=nproc, name="first",
    )
    assert first["first_step"] == 0
    for got, want in zip(first["losses"], uninterrupted[:3]):
        assert abs(got - want) <= 1e-5, (first["losses"], uninterrupted)
    saved = sorted(int(p.name) for p in (tmp_path / "ck" / "multimesh" / "checkpoints").iterdir())
    assert saved == [1, 2] if nproc == 1 else 2 in saved, saved
    if nproc == 1:  # continuing needs --resume (MaxText itself would continue silently)
        from multimesh.run import cli

        with pytest.raises(SystemExit) as e:
            cli.main([*RESUMABLE, "--num-steps", "5", "--checkpoint-dir", ck])
        assert e.value.code == 2
    resumed, out = run_cli(
        [*RESUMABLE, "--num-steps", "5", "--checkpoint-dir", rel, "--resume"], tmp_path,
        nproc=nproc, name="resumed",
    )
    assert "MaxText resumes from its step 2 checkpoint" in out, out[-3000:]
    assert resumed["first_step"] == 3
    assert len(resumed["losses"]) == 2
    for got, want in zip(resumed["losses"], uninterrupted[3:]):
        assert abs(got - want) <= 1e-5, (resumed["losses"], uninterrupted)


def test_maxtext_dump(tmp_path):
    """--dump: MaxText's train step's plan, the simulated and measured Gantt charts and a
    Perfetto trace of the last step."""
    args = [a for a in LLAMA2_TINY if a not in ("--compare-spmd", "3")]
    args[args.index("--num-steps") + 1 : args.index("--num-steps") + 1] = ["2"]
    out = tmp_path / "dump"
    m, text = run_cli([*args, "--pp", "2", "--dp", "4", "--dump", str(out)], tmp_path)
    assert len(m["losses"]) == 2
    plan = (out / "plan.txt").read_text()
    assert plan.startswith("MPMD plan:") and "layers_3" in plan and "stage 1" in plan
    for name in ("simulated.png", "measured.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG", name
    trace = json.loads((out / "trace.json").read_text())
    assert trace["traceEvents"], trace
    assert "dumped to" in text


def test_hook_points_exist():
    """Fails loudly, naming the hook point, if another MaxText moved one."""
    from multimesh.run import maxtext as mt

    mt.check_hooks()
    assert mt.maxtext_version() == mt.SUPPORTED_VERSION


def test_missing_hook_point_is_named(monkeypatch):
    from multimesh.run import maxtext as mt

    monkeypatch.setattr(mt, "HOOK_POINTS", (*mt.HOOK_POINTS, (mt.TRAIN_UTILS, "no_such_hook")))
    with pytest.raises(mt.HookError, match=r"maxtext\.utils\.train_utils\.no_such_hook.*0\.2\.5"):
        mt.check_hooks()


def test_hooks_restore_maxtext():
    """The run-time patches are undone on exit, even after an error."""
    import argparse
    import importlib

    from multimesh.run import maxtext as mt

    mods = {m: importlib.import_module(m) for m, _ in mt.HOOK_POINTS}
    before = {(m, a): getattr(mods[m], a) for m, a in mt.HOOK_POINTS}
    init = mods[mt.MODELS].Transformer.__init__
    ns = argparse.Namespace(pp=2, interleave=1, schedule="1f1b")
    with pytest.raises(RuntimeError, match="boom"):
        with mt.hooks(ns, mt.Record(), pipelined=True):
            assert (
                mods[mt.TRAIN_UTILS].jit_train_step
                is not before[(mt.TRAIN_UTILS, "jit_train_step")]
            )
            raise RuntimeError("boom")
    assert {(m, a): getattr(mods[m], a) for m, a in mt.HOOK_POINTS} == before
    assert mods[mt.MODELS].Transformer.__init__ is init


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compare-spmd", "--checkpoint-dir", "/tmp/x"], "--compare-spmd and --checkpoint-dir"),
        (["--maxtext-override", "dtype"], "--maxtext-override 'dtype': expected KEY=VALUE"),
    ],
)
def test_maxtext_flag_errors(args, message, capsys):
    from multimesh.run import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--model", "maxtext", "--pp", "2", "--dp", "4", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err
