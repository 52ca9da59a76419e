"""The hash-locked requirements in docker/requirements/ agree with pyproject.toml.

Regenerate them with `scripts/lock.sh` when this fails.
"""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "docker" / "requirements"
# the extras each image variant installs (as in scripts/lock.sh) and its extra inputs
VARIANTS = {"cpu": (("run", "docs", "test"), ()), "cuda12": (("run", "docs", "checkpoint", "maxtext"), ("cuda12.in",))}
PYTHONS = ("3.11", "3.12")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ \\;]+)")
LOCKS = [(v, py) for v in VARIANTS for py in PYTHONS]


def pins(path: Path) -> dict[str, str]:
    """Package name -> pinned version; asserts every pin carries a sha256 hash."""
    found: dict[str, str] = {}
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        m = PIN.match(line)
        if m:
            assert i + 1 < len(lines) and "--hash=sha256:" in lines[i + 1], f"{path.name}: {line}"
            found[canonicalize_name(m[1])] = m[2]
    return found


def requirements(variant: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras, inputs = VARIANTS[variant]
    reqs = list(project["project"]["dependencies"])
    reqs += [r for e in extras for r in project["project"]["optional-dependencies"][e]]
    reqs += project["build-system"]["requires"]
    for name in ("build.in", *inputs):
        reqs += [ln.strip() for ln in (REQ / name).read_text().splitlines()]
    return [Requirement(r) for r in reqs if r and not r.startswith("#")]


def test_every_lock_exists_and_no_other():
    assert {p.name for p in REQ.glob("*.txt")} == {f"{v}-py{py}.txt" for v, py in LOCKS}


@pytest.mark.parametrize(("variant", "python"), LOCKS, ids=[f"{v}-py{p}" for v, p in LOCKS])
def test_lock_satisfies_pyproject(variant, python):
    lock = REQ / f"{variant}-py{python}.txt"
    pinned = pins(lock)
    assert "scripts/lock.sh" in lock.read_text().splitlines()[1], "generate with scripts/lock.sh"
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    checked = 0
    for req in requirements(variant):
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pinned, f"{lock.name} lacks {req} (rerun scripts/lock.sh)"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"{lock.name} pins {name}=={pinned[name]}, pyproject wants {req} (rerun scripts/lock.sh)"
        )
        checked += 1
    assert checked >= 10


def test_released_python_gets_the_newer_jax():
    """Python 3.12 images ship jax >= 0.12 (MaxText's); 3.11 stays on the 0.10 line."""
    from packaging.version import Version

    for variant in VARIANTS:
        assert Version(pins(REQ / f"{variant}-py3.12.txt")["jax"]) >= Version("0.12")
        assert Version(pins(REQ / f"{variant}-py3.11.txt")["jax"]) >= Version("0.10.2")


def test_cuda_lock_pins_the_cuda_12_8_runtime():
    for python in PYTHONS:
        pinned = pins(REQ / f"cuda12-py{python}.txt")
        assert pinned["nvidia-cuda-runtime-cu12"].startswith("12.8.")
        assert pinned["jax-cuda12-plugin"] == pinned["jax"]
