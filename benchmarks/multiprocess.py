"""Multi-process benchmark: cross-process transfer latency per transport, and a 4-stage
1F1B training step on 4 processes x 1 device against the same step in one process.

- Transfer latency: 2 local processes x 1 CPU device; one single-device array (1 KB and
  1 MB) moves from process 0 to process 1 with each transport (``server``:
  ``jax.experimental.transfer``; ``ppermute``: a 2-device shard_map), timed on the
  receiver (median of repeats; for ``server`` the sender has already offered it).
- Step time: the residual MLP of ``benchmarks/pipeline.py`` (width 256, 8 layers, 4
  stages, M=8 microbatches, 1F1B, SGD fed back each step) under ``mm.jit`` on 4
  processes x 1 device (each transport) and on one process with 4 devices; median of
  steady-state steps, timed on process 0 (whose stage finishes last); ``ratio`` is
  multi-process / single-process.

Results: ``benchmarks/results/multiprocess-<python>.json``.

Run:  python benchmarks/multiprocess.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
WIDTH, LAYERS, STAGES, M, BATCH = 256, 8, 4, 8, 64


def mlp_step(mm: Any, jax: Any, jnp: Any, np: Any):
    """The 4-stage 1F1B residual-MLP training step (unjitted) and its inputs."""
    def loss(ws, x, y):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i // 2}", stage=i // 2):
                h = h + jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    grad = mm.microbatch(jax.value_and_grad(loss), M, argnums=(1, 2), schedule="1f1b")

    def step(ws, x, y):
        val, g = grad(ws, x, y)
        return [w - 0.01 * gw for w, gw in zip(ws, g)], val

    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) / WIDTH**0.5 for _ in range(LAYERS)]
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    return step, ws, x, np.sin(x)


def step_program(mm: Any, jax: Any, jnp: Any, np: Any, mesh: Any):
    step, ws, x, y = mlp_step(mm, jax, jnp, np)
    return mm.jit(step, mesh=mesh), ws, x, y


def time_steps(f, ws, x, y, jax, steps: int) -> list[float]:
    for _ in range(3):
        ws, val = f(ws, x, y)
    jax.block_until_ready([a for a in jax.tree.leaves(ws) if a.is_fully_addressable])
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        ws, val = f(ws, x, y)
        local = [a for a in jax.tree.leaves((ws, val)) if a.is_fully_addressable]
        jax.block_until_ready(local)
        out.append(time.perf_counter() - t)
    return out


def worker(mode: str, out: str, repeats: int) -> None:
    import multimesh as mm

    mm.distributed.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from multimesh.runtime import transport as tp

    me = jax.process_index()
    kv = tp._kv_client()
    result: dict[str, Any] = {}
    if mode == "latency":
        src, dst = jax.devices()[0], jax.devices()[1]
        for name, nbytes in (("1KB", 1024), ("1MB", 1 << 20)):
            shape = (nbytes // 4,)
            pair = tp.Pair(src, dst, 0, 1, shape, np.float32)
            for tname, cls in (("server", tp.ServerTransport), ("ppermute", tp.PpermuteTransport)):
                t = tp._TRANSPORT.get(tname) or tp._TRANSPORT.setdefault(tname, cls())
                times = []
                for r in range(repeats + 3):
                    kv.wait_at_barrier(f"mm-bench-{name}-{tname}-{r}", 60_000)
                    outgoing = (
                        {0: jax.device_put(np.ones(shape, np.float32), src)} if me == 0 else {}
                    )
                    jax.block_until_ready(list(outgoing.values()))
                    t0 = time.perf_counter()
                    got = t.exchange((name, tname, r), me, [pair], outgoing)
                    jax.block_until_ready(list(got.values()))
                    if me == 1 and r >= 3:
                        times.append(time.perf_counter() - t0)
                if me == 1:
                    result[f"{tname}/{name}_ms"] = statistics.median(times) * 1e3
        if me == 1:
            Path(out).write_text(json.dumps(result))
    else:
        tp.set_transport(mode)
        mesh = mm.make_mesh((STAGES,), ("stage",))
        f, ws, x, y = step_program(mm, jax, jnp, np, mesh)
        times = time_steps(f, ws, x, y, jax, repeats)
        if me == 0:
            Path(out).write_text(json.dumps({"step_ms": statistics.median(times) * 1e3}))


def launch(nproc: int, args: list[str], timeout: float = 900) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_FLAGS", "MULTIMESH_"))}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [
        sys.executable,
        "-m",
        "multimesh.launch",
        "--nproc",
        str(nproc),
        "--devices-per-process",
        "1",
        str(HERE),
        "--worker",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError(f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", nargs=3, metavar=("MODE", "OUT", "REPEATS"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        worker(ns.worker[0], ns.worker[1], int(ns.worker[2]))
        return
    sys.path.insert(0, str(HERE.parent))
    import _common  # noqa: F401  (8 virtual CPU devices for the single-process run)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import multimesh as mm

    t_start = time.perf_counter()
    repeats = 5 if ns.quick else 15
    out: dict[str, Any] = _common.environment("multiprocess", ns.quick)
    with tempfile.TemporaryDirectory() as tmp:
        lat = Path(tmp) / "lat.json"
        launch(2, ["latency", str(lat), str(repeats * 2)])
        out["transfer_latency"] = json.loads(lat.read_text())
        mesh = mm.make_mesh((STAGES,), ("stage",), devices=jax.devices()[:STAGES])
        f, ws, x, y = step_program(mm, jax, jnp, np, mesh)
        single = statistics.median(time_steps(f, ws, x, y, jax, repeats)) * 1e3
        steps = {"single_process_4_devices_ms": single}
        for tname in ("server", "ppermute"):
            res = Path(tmp) / f"step-{tname}.json"
            launch(STAGES, [tname, str(res), str(repeats)])
            ms = json.loads(res.read_text())["step_ms"]
            steps[f"{tname}_4_processes_ms"] = ms
            steps[f"{tname}_ratio"] = ms / single
        out["step_1f1b"] = steps
    out["config"] = {
        "width": WIDTH,
        "layers": LAYERS,
        "stages": STAGES,
        "microbatches": M,
        "batch": BATCH,
        "repeats": repeats,
    }
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps({k: out[k] for k in ("transfer_latency", "step_1f1b")}, indent=2))
    _common.write_results(out, ns.out)


if __name__ == "__main__":
    main()
