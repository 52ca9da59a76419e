"""The CPU image, built here from a debootstrapped base and run with the documented lines.

Run with `python -m pytest -m containers` (needs root, or a user who may run docker). The
engine is installed and started when none runs; if it cannot start, the tests are skipped
with the reason, never passed. The image, containers (and an engine the tests started) are
removed at the end; the imported base image is kept as a cache.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
TAG = "multimesh-jax:test-containers"
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))


def run(cmd: list[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def docker() -> Iterator[str]:
    """The Docker client; starts the engine (via docker/build-local.sh) when none runs."""
    client = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else shutil.which("docker")
    was_running = client is not None and run([client, "info"], 60, check=False).returncode == 0
    proc = run([str(ROOT / "docker" / "build-local.sh"), "--engine-only"], 600, check=False)
    if proc.returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: the Docker engine cannot start here:\n{proc.stderr[-2000:]}")
    client = proc.stdout.strip().splitlines()[-1]
    yield client
    if not was_running and os.path.exists("/var/run/docker.pid"):  # stop what we started
        pid = int(Path("/var/run/docker.pid").read_text())
        os.kill(pid, 15)


@pytest.fixture(scope="module")
def image(docker: str) -> Iterator[str]:
    start = time.monotonic()
    proc = run([str(ROOT / "docker" / "build-local.sh"), "--tag", TAG], 900)
    assert proc.stdout.strip().splitlines()[-1] == TAG  # the last line is the tag
    size = run([docker, "image", "inspect", "-f", "{{.Size}}", TAG], 60).stdout.strip()
    print(f"built {TAG} in {time.monotonic() - start:.0f} s, {int(size) / 1e9:.2f} GB")
    yield TAG
    run([docker, "rmi", "-f", TAG], 120, check=False)


def http(url: str) -> tuple[int, dict[str, str], bytes]:
    """GET without following redirects: (status, headers, body)."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect, urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_default_user_is_not_root(docker, image):
    assert run([docker, "run", "--rm", image, "id", "-un"], 120).stdout.strip() == "mm"


def test_jupyter_with_the_documented_line(docker, image, tmp_path):
    """The seed's line on a root-owned bind mount: token auth on, notebooks listed, writable."""
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", 8675)) != 0, "port 8675 is already in use here"
    work = tmp_path / "notebooks"
    work.mkdir()
    for nb in NOTEBOOKS:
        shutil.copy(nb, work / nb.name)
    line = [docker, "run", "--mount", f"type=bind,src={work},target=/opt/notebooks",
            "-w", "/opt/notebooks", "-p", "8675:8675", image,
            "jupyter", "notebook", "--allow-root", "--ip", "0.0.0.0", "--port=8675"]
    server = subprocess.Popen(line, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cid = ""
    try:
        deadline = time.monotonic() + 90
        token = None
        while token is None and time.monotonic() < deadline:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            ids = run([docker, "ps", "-q", "--filter", f"ancestor={image}",
                       "--filter", "publish=8675"], 30).stdout.split()
            if ids:
                cid = ids[0]
                logs = run([docker, "logs", cid], 30)
                m = re.search(r"token=([0-9a-f]{16,})", logs.stdout + logs.stderr)
                token = m[1] if m else None
            time.sleep(1)
        assert token, "Jupyter printed no URL with a token within 90 s"
        base = "http://127.0.0.1:8675"
        for _ in range(30):  # the port may open a moment after the log line
            try:
                status, headers, _ = http(f"{base}/api/contents")
                break
            except OSError:
                time.sleep(1)
        assert status == 403, f"no token must be refused, got {status}"
        status, headers, _ = http(f"{base}/tree")
        assert status in (302, 303) and "login" in headers.get("Location", ""), status
        status, _, body = http(f"{base}/api/contents?token={token}")
        assert status == 200
        names = sorted(item["name"] for item in json.loads(body)["content"])
        assert names == [nb.name for nb in NOTEBOOKS]
        # the root-owned mount stays writable: save a notebook through the API
        req = urllib.request.Request(
            f"{base}/api/contents/new.ipynb?token={token}", method="PUT",
            data=json.dumps({"type": "notebook", "content": json.loads(NOTEBOOKS[0].read_text())}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10) as r:
            assert r.status in (200, 201)
        assert (work / "new.ipynb").exists()
    finally:
        if cid:
            run([docker, "rm", "-f", cid], 60, check=False)
        server.kill()
        server.wait(timeout=30)


def test_training_line(docker, image):
    proc = run([docker, "run", "--rm", image, "multimesh-run", "--num-steps", "2"], 600)
    assert "step" in (proc.stdout + proc.stderr).lower()


def test_a_notebook_executes_inside(docker, image):
    nb = "/opt/notebooks/01-hello-multimesh.ipynb"
    proc = run([docker, "run", "--rm", image, "jupyter", "nbconvert", "--execute",
                "--to", "notebook", "--output-dir", "/tmp/executed", nb], 600)
    assert "Writing" in proc.stderr


def test_mount_owned_by_another_user_runs_as_that_user(docker, image, tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    os.chown(work, 4321, 4321)
    proc = run([docker, "run", "--rm", "--mount", f"type=bind,src={work},target=/w", "-w", "/w",
                image, "sh", "-c", "id -u && touch made-here"], 120)
    assert proc.stdout.split()[0] == "4321"
    assert (work / "made-here").stat().st_uid == 4321


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gpu_image_imports_jax_and_falls_back_to_cpu(docker):
    """Run before landing changes to the GPU recipe or its locks: `-m 'containers and slow'`."""
    tag = "multimesh-jax:test-containers-gpu"
    start = time.monotonic()
    proc = run([str(ROOT / "docker" / "build-local.sh"), "--gpu", "--tag", tag], 1700)
    assert proc.stdout.strip().splitlines()[-1] == tag
    try:
        size = run([docker, "image", "inspect", "-f", "{{.Size}}", tag], 60).stdout.strip()
        print(f"built {tag} in {time.monotonic() - start:.0f} s, {int(size) / 1e9:.2f} GB")
        code = "import jax; print(jax.default_backend(), len(jax.devices()))"
        out = run([docker, "run", "--rm", tag, "python", "-c", code], 300).stdout.split()
        assert out[-2:] == ["cpu", "1"]
        run([docker, "run", "--rm", tag, "python", "-c", "import jax_plugins.xla_cuda12"], 300)
    finally:
        run([docker, "rmi", "-f", tag], 120, check=False)
