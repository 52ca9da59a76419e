"""First-call benchmark: trace + plan + compile + run of a fresh process's first step.

For each model, in fresh processes (JAX and MultiMesh keep in-process caches), the
wall time of the first training step:

* ``jax``: plain ``jax.jit`` on one device (``mm.microbatch`` is a ``lax.scan`` there);
* ``mm``: ``mm.jit``, fragments compiled on a thread pool (the default);
* ``mm_serial``: ``mm.jit`` with ``MULTIMESH_COMPILE_THREADS=1``;
* ``mm_cached``: ``mm.jit`` in a second process sharing JAX's persistent compilation
  cache (``jax_compilation_cache_dir``) with a first one.

Models: ``mlp`` (the multi-process benchmark's residual MLP: 4 stages, 8 layers, width 256,
8 microbatches, 1F1B, SGD) and ``gpt`` (``multimesh.examples.gpt``, NNX, 4 layers on 4
stages (2 devices each), 1F1B with 4 microbatches, AdamW). Ratios are against
``jax``; medians of ``--repeats`` runs, interleaved.

Run:  python benchmarks/first_call.py [--quick] [--repeats N] [--models mlp gpt] [--out PATH]
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

HERE = Path(__file__).resolve().parent


def child(model: str, variant: str) -> None:
    """One first call in this (fresh) process; prints its wall time as JSON."""
    sys.path.insert(0, str(HERE))
    import _common  # noqa: F401 - 8 CPU devices before jax starts
    import jax
    import jax.numpy as jnp
    import numpy as np

    import multimesh as mm

    mmesh = mm.make_mesh((4, 2), ("stage", "data"))
    if model == "mlp":
        from multiprocess import mlp_step  # the same model as the multi-process benchmark

        step, *args = mlp_step(mm, jax, jnp, np)
    else:
        import optax
        from flax import nnx

        from multimesh.examples import gpt as G

        cfg = G.Config(vocab=256, seq=32, d=64, heads=4, layers=4, stages=4)
        model_ = mm.flax.create(lambda k: G.GPT(cfg, nnx.Rngs(k)), jax.random.key(0), mesh=mmesh)
        step, state = G.nnx_train_step(cfg, model_, optax.adamw(1e-3), 4, "1f1b")
        tokens = (np.arange(16 * 32).reshape(16, 32) % 256).astype(np.int32)
        args = (state, tokens)
        if variant == "jax":
            args = (mm.distributed.to_host(state), tokens)
    fn = jax.jit(step) if variant == "jax" else mm.jit(step, mesh=mmesh)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    print(json.dumps({"first_call_s": time.perf_counter() - t0}))


def measure(model: str, variant: str, cache_dir: str | None = None) -> float:
    env = dict(os.environ)
    if variant == "mm_serial":
        env["MULTIMESH_COMPILE_THREADS"] = "1"
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    kind = "jax" if variant == "jax" else "mm"
    proc = subprocess.run(
        [sys.executable, __file__, "--child", model, kind],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    if proc.returncode:
        raise RuntimeError(f"{model}/{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["first_call_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, the MLP only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--models", nargs="+", choices=["mlp", "gpt"], default=["mlp", "gpt"])
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        child(*ns.child)
        return
    sys.path.insert(0, str(HERE))
    import _common

    t_start = time.perf_counter()
    out = _common.environment("first_call", ns.quick)
    out["loadavg_start"] = list(os.getloadavg())
    repeats = 1 if ns.quick else ns.repeats
    models = ["mlp"] if ns.quick else ns.models
    out["models"] = {}
    for model in models:
        times: dict[str, list[float]] = {v: [] for v in ("jax", "mm", "mm_serial", "mm_cached")}
        for _ in range(repeats):  # interleaved, so load changes hit every variant
            for v in ("jax", "mm", "mm_serial"):
                times[v].append(measure(model, v))
            with tempfile.TemporaryDirectory() as cache:
                measure(model, "mm", cache)  # fills the cache
                times["mm_cached"].append(measure(model, "mm", cache))
        med = {v: statistics.median(t) for v, t in times.items()}
        row = {"times_s": times, "median_s": med}
        row["ratios"] = {f"{v}_vs_jax": med[v] / med["jax"] for v in ("mm", "mm_serial", "mm_cached")}
        row["ratios"]["parallel_speedup"] = med["mm_serial"] / med["mm"]
        out["models"][model] = row
        print(
            f"{model}: jax.jit {med['jax']:.2f} s | mm.jit {med['mm']:.2f} s "
            f"({row['ratios']['mm_vs_jax']:.2f}x), serial compile {med['mm_serial']:.2f} s, "
            f"persistent cache {med['mm_cached']:.2f} s ({row['ratios']['mm_cached_vs_jax']:.2f}x)"
        )
    out["loadavg_end"] = list(os.getloadavg())
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    _common.write_results(out, ns.out)


if __name__ == "__main__":
    main()
