"""Reproducible builds: the sdist and the wheel built twice, from two copies of the source
with different file times, are byte-identical when SOURCE_DATE_EPOCH is fixed."""

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def copy_sources(dst: Path) -> None:
    """The files an sdist build reads, copied with fresh modification times."""
    for rel in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / rel, dst / rel)
    for sub in ("src/multimesh", "tests"):
        shutil.copytree(
            ROOT / sub, dst / sub, copy_function=shutil.copy,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"),
        )


def build(src: Path, out: Path) -> dict[str, str]:
    pytest.importorskip("build", reason="python -m build comes with the [test] extra")
    env = dict(os.environ, SOURCE_DATE_EPOCH="1700000000")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}


def test_sdist_and_wheel_are_byte_identical(tmp_path):
    digests = []
    for i in range(2):
        src = tmp_path / f"src{i}"
        src.mkdir()
        copy_sources(src)
        digests.append(build(src, tmp_path / f"dist{i}"))
        time.sleep(1.1)  # the second copy's files are a second younger
    names = sorted(digests[0])
    assert len(names) == 2 and names[0].endswith(".whl") and names[1].endswith(".tar.gz")
    assert digests[0] == digests[1]
