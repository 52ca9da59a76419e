"""multimesh-run --model gpt: PP x TP x DP x FSDP training equal to plain jax.jit SPMD."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import multimesh as mm
from multimesh.run import cli

SMALL = [
    "--num-steps",
    "3",
    "--model-dims",
    "32",
    "--batch-size",
    "8",
    "--sequence-length",
    "8",
    "--vocab-size",
    "64",
    "--no-progress",
    "--compare-spmd",
]


def run(*args: str, tmp_path: Path) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    metrics = tmp_path / "m.json"
    code = cli.main([*SMALL, "--metrics", str(metrics), *args])
    assert code == 0
    return json.loads(metrics.read_text())


@pytest.mark.parametrize(
    "layout",
    [
        ("--pp", "2", "--tp", "2", "--dp", "2", "--schedule", "zero-bubble-h1"),
        ("--pp", "4", "--tp", "1", "--dp", "2", "--schedule", "1f1b"),
        pytest.param(
            ("--pp", "8", "--tp", "1", "--dp", "1", "--schedule", "gpipe"),
            marks=pytest.mark.slow,  # the longest default-tier test; GPipe is tested elsewhere
        ),
        ("--pp", "4", "--dp", "2", "--interleave", "2"),
        pytest.param(
            ("--pp", "2", "--fsdp", "2", "--tp", "2", "--dp", "1", "--remat"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["pp2-tp2-dp2-zb", "pp4-dp2-1f1b", "pp8-gpipe", "pp4-dp2-interleaved", "pp2-fsdp2-tp2"],
)
def test_gpt_equals_spmd(layout, tmp_path, capsys):
    m = run(*layout, tmp_path=tmp_path)
    out = capsys.readouterr().out
    assert "largest loss difference vs SPMD" in out and "(ok" in out
    assert "tokens/s" in out and "model FLOPs utilisation" in out
    assert len(m["losses"]) == 3
    # the state comes back in the layout it went in: the second step compiles nothing
    assert m["step_times_s"][1] < m["step_times_s"][0] / 3, m["step_times_s"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", cli.SCHEDULES)
@pytest.mark.parametrize("layout", [("2", "2", "2"), ("4", "1", "2"), ("8", "1", "1")])
def test_every_layout_and_schedule(layout, schedule, tmp_path):
    pp, tp, dp = layout
    extra = (
        ["--interleave", "2", "--num-microbatches", pp] if schedule == "interleaved-1f1b" else []
    )
    run("--pp", pp, "--tp", tp, "--dp", dp, "--schedule", schedule, *extra, tmp_path=tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pp", "3", "--dp", "2"], "--pp 3 x --tp 1 x --dp 2 x --fsdp 1 = 6, but there are 8"),
        (["--pp", "3"], "give --dp too (or --cpus)"),
        (
            ["--pp", "4", "--dp", "2", "--num-layers", "6"],
            "--num-layers 6 is not divisible by --pp 4",
        ),
        (
            ["--pp", "4", "--dp", "2", "--batch-size", "12"],
            "--batch-size 12 is not divisible by --dp 2",
        ),
        (
            ["--pp", "4", "--dp", "2", "--interleave", "2", "--schedule", "1f1b"],
            "--interleave 2 needs --schedule interleaved-1f1b",
        ),
        (["--pp", "1", "--dp", "8", "--interleave", "2"], "--interleave 2 needs --pp 2 or more"),
        (
            ["--pp", "4", "--dp", "2", "--microbatch-size", "3"],
            "not divisible by --microbatch-size 3",
        ),
        (
            ["--pp", "4", "--dp", "2", "--tp", "1", "--model-dims", "30"],
            "--model-dims 30 is not divisible by --num-heads 4",
        ),
        (["--pp", "0"], "argument --pp: must be a positive integer, got 0"),
        (["--microbatch-size", "0"], "argument --microbatch-size: must be a positive integer"),
        (["--num-steps", "-1"], "argument --num-steps: must be a positive integer, got -1"),
        (["--seed", "-5"], "argument --seed: must be a non-negative integer, got -5"),
        (["--sequence-length", "1"], "--sequence-length 1: needs at least 2"),
        (["--seed", str(2**63)], "argument --seed: must be below 2**63"),
        (["--tolerance", "-1"], "argument --tolerance: must be a finite number >= 0"),
        (["--tolerance", "nan"], "argument --tolerance: must be a finite number >= 0"),
        (["--learning-rate", "nan"], "argument --learning-rate: must be a finite number >= 0"),
        (["--checkpoint-dir", "/proc/no/such"], "--checkpoint-dir /proc/no/such: cannot create"),
        (["--max-to-keep", "2"], "--max-to-keep needs --checkpoint-dir"),
        (["--metrics", "/nonexistent-dir/m.json"], "the directory /nonexistent-dir does not"),
        (
            ["--pp", "2", "--dp", "4", "--microbatch-size", "2"],  # 8 microbatches, derived
            "x 8 microbatches (--batch-size / --microbatch-size 2) = 32",
        ),
        (["--model-name", "llama2-7b"], "--model-name is for --model maxtext"),
        (["--maxtext-override", "dtype=float32"], "--maxtext-override is for --model maxtext"),
    ],
)
def test_flag_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err


def test_checkpoint_dir_errors_before_training(tmp_path, capsys):
    """A file given as --checkpoint-dir (Orbax failed in the background: a hang), and a
    directory holding another run's steps without --resume (this run's state was not
    saved, or the save failed after training), are usage errors up front."""
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
        mm.checkpoint.CheckpointManager(afile)
    step = tmp_path / "ck" / "3"
    step.mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    assert mm.checkpoint.saved_steps(tmp_path / "ck") == [3]
    mm.checkpoint.save(tmp_path / "one", {"w": np.ones(2, np.float32)})
    for args, message in [
        (["--checkpoint-dir", str(afile)], "is a file, not a directory"),
        (
            ["--checkpoint-dir", str(tmp_path / "ck")],
            "holds checkpoints (steps [3]); pass --resume",
        ),
        (["--dump", str(afile)], "is a file; give a directory"),
        # a numbered folder that is no checkpoint (was a traceback after building the model)
        (
            ["--checkpoint-dir", str(tmp_path / "other")],
            "numbered folders that are not checkpoints (7)",
        ),
        (["--checkpoint-dir", str(tmp_path / "other"), "--resume"], "that are not checkpoints"),
        # one mm.checkpoint.save checkpoint (steps were written inside it)
        (["--checkpoint-dir", str(tmp_path / "one"), "--resume"], "is one checkpoint"),
    ]:
        (tmp_path / "other" / "7").mkdir(parents=True, exist_ok=True)
        with pytest.raises(SystemExit) as e:
            cli.main(args)
        assert e.value.code == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_default_pp_leaves_room_for_tp_and_fsdp():
    p = cli.parser()
    for flags, want in [
        ([], (4, 2)),
        (["--tp", "4"], (2, 1)),
        (["--fsdp", "4"], (2, 1)),
        (["--tp", "8"], (1, 1)),
        (["--tp", "2", "--fsdp", "2"], (2, 1)),
    ]:
        ns = p.parse_args(flags)
        cli.validate(ns, 8, p)
        assert (ns.pp, ns.dp) == want, flags


def test_help_documents_every_flag():
    text = cli.parser().format_help()
    for flag in [
        "--pp",
        "--tp",
        "--dp",
        "--fsdp",
        "--interleave",
        "--schedule",
        "--num-microbatches",
        "--microbatch-size",
        "--backend",
        "--cpus",
        "--model",
        "--model-name",
        "--num-layers",
        "--model-dims",
        "--num-heads",
        "--mlp-dims",
        "--vocab-size",
        "--batch-size",
        "--sequence-length",
        "--num-steps",
        "--learning-rate",
        "--remat",
        "--tied-embeddings",
        "--seed",
        "--dump",
        "--compare-spmd",
        "--tolerance",
    ]:
        assert flag in text, flag
    # and the README lists every flag --help has
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for action in cli.parser()._actions:  # noqa: SLF001
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert flag in readme, f"README does not mention {flag}"


def test_dump(tmp_path):
    out = tmp_path / "dump"
    metrics = tmp_path / "m.json"
    fast = [a for a in SMALL if a != "--compare-spmd"]  # the dump needs no SPMD reference
    args = ["--pp", "4", "--dp", "2", "--tied-embeddings", "--dump", str(out)]
    assert cli.main([*fast, "--metrics", str(metrics), *args]) == 0
    for name in ["plan.txt", "simulated.png", "measured.png", "trace.json"]:
        assert (out / name).stat().st_size > 0, name
    plan = (out / "plan.txt").read_text()
    assert "MPMD plan" in plan
    # tied embeddings: the last stage's share of the table's gradient moves once a step
    assert plan.count("transfer stage3->stage0 float32[64, 32]") == 1, plan


def test_console_script_and_module(tmp_path):
    exe = Path(sys.executable).with_name("multimesh-run")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "MULTIMESH_"))}
    for cmd in ([str(exe), "--help"], [sys.executable, "-m", "multimesh.run", "--help"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0 and "--compare-spmd" in proc.stdout
        # each default said once, never "(default: None)"
        text = " ".join(proc.stdout.split())
        assert "(default: None)" not in text and "(default: 1e-05)" in text, text
        assert "(default: 1f1b, or interleaved-1f1b when --interleave > 1)" in text, text


@pytest.mark.multiprocess
def test_under_the_launcher_equals_one_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "MULTIMESH_"))}
    args = [*SMALL, "--pp", "4", "--dp", "2"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    p1 = subprocess.run(
        [sys.executable, "-m", "multimesh.run", *args, "--metrics", str(one)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert p1.returncode == 0, p1.stderr[-3000:]
    p2 = subprocess.run(
        [
            sys.executable,
            "-m",
            "multimesh.launch",
            "--nproc",
            "2",
            "--devices-per-process",
            "4",
            "-m",
            "multimesh.run",
            *args,
            "--metrics",
            str(two),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    assert json.loads(one.read_text())["losses"] == json.loads(two.read_text())["losses"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "per, flags, message",
    [
        (2, ["--pp", "4", "--dp", "2"], "there are 4 devices (on 2 processes: multimesh.launch"),
        (2, ["--cpus", "4"], "--cpus does not apply to a multi-process run"),
        (
            3,
            ["--pp", "3", "--dp", "2", "--batch-size", "12"],
            "--pp 3 x --dp 2 x --fsdp 1 x --tp 1: unsupported multi-process layout: submesh "
            "'stage1'",
        ),
    ],
    ids=["device-count", "cpus", "split-stage"],
)
def test_flag_errors_under_the_launcher(per, flags, message):
    """Under the launcher the device-count hint names the launcher's flags (it named
    --dp/--cpus, which do not apply there), --cpus is refused (it was ignored), and a
    layout whose processes split a stage is a one-line usage error (it was a traceback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "MULTIMESH_"))}
    cmd = [sys.executable, "-m", "multimesh.launch", "--nproc", "2", "--devices-per-process"]
    cmd += [str(per), "-m", "multimesh.run", *flags, "--num-steps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "--cpus)" not in proc.stderr


def _cluster_env(kind: str, rank: int, nproc: int, job: int) -> dict[str, str]:
    """What mpirun (Open MPI) or srun (SLURM) put in each task's environment, for one
    host (the coordinator port JAX derives from the job id)."""
    if kind == "openmpi":
        return {
            "OMPI_MCA_orte_hnp_uri": f"{job}.0;tcp://127.0.0.1:1",
            "OMPI_COMM_WORLD_SIZE": str(nproc),
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        }
    return {
        "SLURM_JOB_ID": str(job),
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": str(nproc),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["openmpi", "slurm"])
def test_under_mpirun_and_slurm_equals_one_process(kind, tmp_path):
    """multimesh-run started by mpirun or srun (emulated: their environment variables on
    2 local processes): mm.distributed.initialize joins through JAX's cluster detection
    and the losses equal one process's."""
    import random

    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "MULTIMESH_"))}
    env = {k: v for k, v in env.items() if not k.startswith(("OMPI_", "SLURM_", "PMI_"))}
    args = [*SMALL, "--pp", "2", "--dp", "4", "--num-steps", "2"]
    one = tmp_path / "one.json"
    p1 = subprocess.run(
        [sys.executable, "-m", "multimesh.run", *args, "--metrics", str(one)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert p1.returncode == 0, p1.stderr[-3000:]
    job = random.randrange(1000, 4000)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "multimesh.run",
                *args,
                "--metrics",
                str(tmp_path / f"{r}.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, **_cluster_env(kind, r, 2, job), "MULTIMESH_DEVICES_PER_PROCESS": "4"},
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert "process 0: devices [0, 1, 2, 3], stages [0]; process 1:" in outs[0], outs[0][-2000:]
    want = json.loads(one.read_text())["losses"]
    # to rounding: a sum over the 4 data-parallel devices runs in gloo's order on several
    # processes and in XLA's own in one (the multi-process tier's tolerance too)
    got = json.loads((tmp_path / "0.json").read_text())["losses"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_checkpoint_resume_continues_the_loss_curve(tmp_path, capsys):
    """Train 4 steps saving at 2 and 4; drop step 4 and resume from step 2: steps 3-4
    repeat bit-identically; a resume in another layout continues too."""
    import shutil

    fast = [a for a in SMALL if a != "--compare-spmd"]
    ck = tmp_path / "ck"

    def go(name: str, *args: str) -> dict:
        metrics = tmp_path / f"{name}.json"
        code = cli.main([*fast, "--num-steps", "4", "--metrics", str(metrics), *args])
        assert code == 0
        return json.loads(metrics.read_text())

    base = ("--pp", "2", "--dp", "4", "--num-layers", "2")
    full = go("full", *base, "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
    assert sorted(os.listdir(ck)) == ["2", "4"] and len(full["losses"]) == 4
    shutil.rmtree(ck / "4")  # as if the run had stopped after step 3
    resumed = go("resumed", *base, "--checkpoint-dir", str(ck), "--resume")
    assert resumed["first_step"] == 2
    assert resumed["losses"] == full["losses"][2:]  # bit-identical continuation
    shutil.rmtree(ck / "4")
    other = go(
        "other",
        "--pp",
        "1",
        "--tp",
        "2",
        "--dp",
        "4",
        "--num-layers",
        "2",
        "--checkpoint-dir",
        str(ck),
        "--resume",
    )
    assert other["first_step"] == 2
    assert other["losses"] == pytest.approx(full["losses"][2:], rel=1e-4)
    # nothing left to do: still writes its metrics
    done = go("done", *base, "--checkpoint-dir", str(ck), "--resume")
    assert done["first_step"] == 4 and done["losses"] == []
    # another model (the default --num-layers follows --pp): a one-line error
    code = cli.main(
        [
            *fast,
            "--num-steps",
            "6",
            "--pp",
            "4",
            "--dp",
            "2",
            "--checkpoint-dir",
            str(ck),
            "--resume",
        ]
    )
    assert code == 2
    assert "does not fit this model" in capsys.readouterr().err


def test_checkpoint_flags_need_a_directory(capsys):
    for flags in (["--resume"], ["--checkpoint-every", "2"]):
        with pytest.raises(SystemExit):
            cli.main([*SMALL, *flags])
        assert "needs --checkpoint-dir" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--metrics", "--dump"])
def test_empty_output_paths_are_usage_errors(flag, capsys):
    """An empty --metrics/--dump was taken as not given: nothing written, no word."""
    with pytest.raises(SystemExit):
        cli.main([*SMALL, flag, ""])
    assert f"{flag} needs a path" in capsys.readouterr().err


@pytest.mark.parametrize(
    "backend, runtimes",
    [("gpu", ("jax_cuda12_plugin", "jax_cuda13_plugin")), ("tpu", ("libtpu",))],
)
def test_an_accelerator_backend_without_its_devices_is_a_usage_error(backend, runtimes):
    if any(importlib.util.find_spec(m) for m in runtimes):
        pytest.skip(f"a {backend.upper()} runtime is installed")
    r = subprocess.run(
        [sys.executable, "-m", "multimesh.run", "--backend", backend, "--num-steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    want = f"--backend {backend}: JAX found no {backend.upper()} devices"
    assert want in r.stderr.strip().splitlines()[-1]


def test_model_flops_utilisation_knows_tpus(monkeypatch):
    from multimesh.run import report

    class Dev:
        platform, device_kind = "tpu", "TPU v5 lite"

    monkeypatch.setattr(report.jax, "devices", lambda: [Dev()])
    assert report.peak_flops() == 197e12  # not "TPU v5" (v5p), whose name it contains
    Dev.device_kind = "TPU v5"
    assert report.peak_flops() == 459e12
    Dev.platform = "cpu"
    assert report.peak_flops() is None


def test_metrics_are_strict_json(tmp_path):
    """A NaN loss is written as null (bare NaN is not JSON; strict parsers reject it)."""
    import argparse

    from multimesh.run import gpt

    ns = argparse.Namespace(metrics=str(tmp_path / "m.json"), lr=1e-3)
    gpt.write_metrics(ns, 0, [1.5, float("nan"), float("inf")], [0.1, 0.2, 0.3])

    def refuse(name):
        raise ValueError(name)

    got = json.loads((tmp_path / "m.json").read_text(), parse_constant=refuse)
    assert got["losses"] == [1.5, None, None] and got["first_step"] == 0


def test_compare_spmd_names_a_non_finite_loss(capsys):
    """A diverged run (NaN/inf losses) fails --compare-spmd and says why (it said the
    losses differ by more than --tolerance)."""
    small = ["--pp", "2", "--dp", "4", "--num-layers", "2"]
    code = cli.main([*SMALL, *small, "--num-steps", "2", "--learning-rate", "1e30"])
    out = capsys.readouterr().out
    assert code == 1
    assert "a loss is not finite (NaN or inf)" in out.strip().splitlines()[-1], out[-500:]
