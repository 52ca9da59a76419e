"""Dispatch benchmark: host overhead of ``mm.jit`` against ``jax.jit`` on one device.

Two kinds of model, both a residual MLP trained with plain SGD (``params - lr * grads``
returned as the new params and fed back in every step):

* dispatch-bound: tiny layers (batch 8, width 64), S in {4, 8} stages, one device per
  stage. The arithmetic is negligible, so the step time is per-executable and per-op
  runtime cost: ``mm.jit`` runs one XLA executable per fragment plus the transfers
  between them, where ``jax.jit`` runs a single executable.
* compute-bound: the same model with batch 256, width 1024 and 4 stages, where the extra
  host work should disappear in the compute time.

For each model the benchmark reports the steady-state step time of both (blocking on the
results every step), their ratio, the number of fragments and transfers per step, the
host overhead per fragment ``(t_mm - t_jax) / fragments``, the time to *issue* one step
(the call returning, before blocking) and the per-step time of a loop that never blocks
(host dispatch overlapped with device work, as a real training loop runs).

A cProfile of steady-state ``mm.jit`` steps of the 8-stage model shows where the host
time goes (``--no-profile`` skips it). Results go to
``benchmarks/results/dispatch-<python>.json`` (``-quick`` added with ``--quick``).

Run:  python benchmarks/dispatch.py [--quick] [--no-profile] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common  # sets up 8 virtual CPU devices before jax is imported
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import multimesh as mm

LR = 0.01


# --- models ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "dispatch-bound" | "compute-bound"
    stages: int
    width: int
    batch: int
    layers_per_stage: int = 1  # residual blocks per stage; each block has two matmuls


def make_step(cfg: Config) -> Callable[[Any, Any], tuple[Any, Any]]:
    """A training step: value_and_grad of the pipelined loss, then an SGD update."""

    def loss(params: list[list[tuple[Any, Any]]], x: Any) -> Any:
        h = x
        for i, blocks in enumerate(params):
            with mm.task(f"s{i}", stage=i):
                for w1, w2 in blocks:
                    h = h + jnp.tanh(h @ w1) @ w2
        return jnp.mean(h**2)

    def step(params: Any, x: Any) -> tuple[Any, Any]:
        val, grads = jax.value_and_grad(loss)(params, x)
        new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        return new, val

    return step


def init(cfg: Config, seed: int = 0) -> tuple[Any, Any]:
    """Host (numpy) params and input, so both runners start from identical values."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(cfg.width)

    def mat() -> np.ndarray:
        return (rng.standard_normal((cfg.width, cfg.width)) * scale).astype(np.float32)

    params = [[(mat(), mat()) for _ in range(cfg.layers_per_stage)] for _ in range(cfg.stages)]
    x = rng.standard_normal((cfg.batch, cfg.width)).astype(np.float32)
    return params, x


# --- timing ------------------------------------------------------------------------------


def timed_call(fn: Callable, params: Any, x: Any) -> tuple[Any, float, float]:
    """One step, blocking on its results; (new params, issue time, total time) in s."""
    t0 = time.perf_counter()
    params, val = fn(params, x)
    t1 = time.perf_counter()
    jax.block_until_ready((params, val))
    return params, t1 - t0, time.perf_counter() - t0


def run_async(fn: Callable, params: Any, x: Any, n: int) -> tuple[Any, float]:
    """n steps without blocking in between (one block at the end); seconds per step."""
    jax.block_until_ready(params)
    t0 = time.perf_counter()
    for _ in range(n):
        params, val = fn(params, x)
    jax.block_until_ready((params, val))
    return params, (time.perf_counter() - t0) / n


@dataclasses.dataclass
class Timing:
    step: list[float] = dataclasses.field(default_factory=list)  # median per repeat
    best: list[float] = dataclasses.field(default_factory=list)  # fastest step per repeat
    issue: list[float] = dataclasses.field(default_factory=list)
    async_step: list[float] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        us = lambda v: [round(t * 1e6, 2) for t in v]  # noqa: E731
        med = lambda v: round(statistics.median(v) * 1e6, 2)  # noqa: E731
        return {
            "step_us": med(self.step),
            "issue_us": med(self.issue),
            "async_step_us": med(self.async_step),
            "best_step_us": round(min(self.best) * 1e6, 2),
            "step_us_per_repeat": us(self.step),
            "issue_us_per_repeat": us(self.issue),
            "async_step_us_per_repeat": us(self.async_step),
        }


def measure(
    fn: Callable, params: Any, x: Any, timing: Timing, steps: int, ctx: Callable[[], Any]
) -> Any:
    """One repeat: ``steps`` blocking steps, then ``steps`` steps of a non-blocking loop.

    Steps of one function run back to back (a training loop's steady state: thread pools
    and caches warm for that program); callers alternate which function goes first.
    """
    gc.collect()
    issue, total = [], []
    with ctx():
        for _ in range(steps):
            params, iss, tot = timed_call(fn, params, x)
            issue.append(iss), total.append(tot)
        params, per = run_async(fn, params, x, steps)
    timing.step.append(statistics.median(total))
    timing.best.append(min(total))
    timing.issue.append(statistics.median(issue))
    timing.async_step.append(per)
    return params


# --- one model ---------------------------------------------------------------------------


def bench_model(cfg: Config, warmup: int, steps: int, repeats: int) -> dict[str, Any]:
    mmesh = mm.make_mesh((cfg.stages,), ("stage",))
    step = make_step(cfg)
    host_params, host_x = init(cfg)

    # mm.jit: x lives on stage 0 (where it is used), params are wherever the last step
    # left them (each stage's weights on its own device), so steady state moves no input.
    mm_step = mm.jit(step, mesh=mmesh)
    x_mm = jax.device_put(host_x, NamedSharding(mmesh.submesh(0), PartitionSpec()))
    t0 = time.perf_counter()
    p_mm, val_mm = mm_step(host_params, x_mm)
    jax.block_until_ready((p_mm, val_mm))
    mm_first = time.perf_counter() - t0
    first_mm = (np.asarray(val_mm), [np.asarray(a) for a in jax.tree.leaves(p_mm)])

    # jax.jit on one device. Tasks with stage= need an active MultiMesh while tracing;
    # `with mmesh:` also makes the global (S-device) mesh the JAX mesh, which rejects
    # inputs committed to one device, so a one-device JAX mesh is entered inside it.
    # jax.jit keys its cache on the mesh context, so every jax.jit call runs inside it
    # (entered once per measurement, not per step).
    dev0 = jax.devices()[0]
    one = Mesh(np.array([dev0]), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))

    @contextlib.contextmanager
    def on_one_device() -> Any:
        with mmesh, jax.set_mesh(one):
            yield

    jax_step = jax.jit(step)
    x_j = jax.device_put(host_x, dev0)
    with on_one_device():
        t0 = time.perf_counter()
        p_j, val_j = jax_step(jax.device_put(host_params, dev0), x_j)
        jax.block_until_ready((p_j, val_j))
        jax_first = time.perf_counter() - t0
    first_j = (np.asarray(val_j), [np.asarray(a) for a in jax.tree.leaves(p_j)])
    diff = max(
        float(np.max(np.abs(first_mm[0] - first_j[0]))),
        max(float(np.max(np.abs(a - b))) for a, b in zip(first_mm[1], first_j[1], strict=True)),
    )

    # Plan of the steady-state call (params already on their stages).
    plan = mm_step.lower(p_mm, x_mm).plan
    n_frag = len(plan.fragments)
    n_tr = len(plan.transfers)
    puts = [p for p in plan.inputs if p.mode == "put"]
    devs_mm = {d.id for a in jax.tree.leaves(p_mm) for d in a.sharding.device_set}
    devs_j = {d.id for a in jax.tree.leaves(p_j) for d in a.sharding.device_set}

    for _ in range(warmup):
        p_mm, _v = mm_step(p_mm, x_mm)
        with on_one_device():
            p_j, _v = jax_step(p_j, x_j)
    jax.block_until_ready((p_mm, p_j))
    mm_cache = len(mm_step._cache)  # noqa: SLF001  (a retrace per step would show here)
    jax_cache = jax_step._cache_size()  # noqa: SLF001

    t_mm, t_j = Timing(), Timing()
    no_ctx = contextlib.nullcontext
    for r in range(repeats):  # alternate the order so drift and load favour neither side
        if r % 2 == 0:
            p_mm = measure(mm_step, p_mm, x_mm, t_mm, steps, no_ctx)
            p_j = measure(jax_step, p_j, x_j, t_j, steps, on_one_device)
        else:
            p_j = measure(jax_step, p_j, x_j, t_j, steps, on_one_device)
            p_mm = measure(mm_step, p_mm, x_mm, t_mm, steps, no_ctx)
    if len(mm_step._cache) != mm_cache:  # noqa: SLF001
        print(f"  warning: {cfg.name}: mm.jit retraced during timing", file=sys.stderr)
    if jax_step._cache_size() != jax_cache:  # noqa: SLF001
        print(f"  warning: {cfg.name}: jax.jit retraced during timing", file=sys.stderr)

    sm, sj = t_mm.summary(), t_j.summary()
    per_frag = lambda a, b: round((a - b) / n_frag, 2)  # noqa: E731
    return {
        **dataclasses.asdict(cfg),
        "warmup": warmup,
        "timed_steps": steps,
        "repeats": repeats,
        "fragments": n_frag,
        "fragment_names": [f.name for f in plan.fragments],
        "transfers": n_tr,
        "transfer_bytes": sum(t.nbytes for t in plan.transfers),
        "host_puts": len(puts),
        "plan_steps": len(plan.steps),
        "mm_devices": sorted(devs_mm),
        "jax_devices": sorted(devs_j),
        "first_call_s": {"mm": round(mm_first, 3), "jax": round(jax_first, 3)},
        "max_abs_diff_first_step": diff,
        "mm": sm,
        "jax": sj,
        "ratio": round(sm["step_us"] / sj["step_us"], 3),
        "ratio_async": round(sm["async_step_us"] / sj["async_step_us"], 3),
        "ratio_best": round(sm["best_step_us"] / sj["best_step_us"], 3),
        "best_overhead_per_fragment_us": per_frag(sm["best_step_us"], sj["best_step_us"]),
        "overhead_per_fragment_us": per_frag(sm["step_us"], sj["step_us"]),
        "issue_overhead_per_fragment_us": per_frag(sm["issue_us"], sj["issue_us"]),
        "async_overhead_per_fragment_us": per_frag(sm["async_step_us"], sj["async_step_us"]),
    }


# --- reference dispatch costs ------------------------------------------------------------


def bench_primitives(steps: int, repeats: int) -> dict[str, Any]:
    """What one executable call, one cross-device copy and chains of them cost, for scale.

    The chains show the latency of a dependency between devices: a chain of 8 calls on
    one device against 8 calls on 8 devices with a copy between each (a pipeline's
    forward pass with tiny stages). The ``_dot`` chains run a small matmul per call: jax
    0.12's CPU client runs such a program on a worker thread (an ``a + 1`` runs inline on
    the caller), so they show what a hand-off between the host and a device costs."""
    d0, d1 = jax.devices()[:2]
    x = jax.device_put(np.ones((8, 64), np.float32), d0)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    sh1 = jax.sharding.SingleDeviceSharding(d1)
    jax.device_put(x, sh1).block_until_ready()

    def timed(fn: Callable[[], Any]) -> tuple[float, float]:
        issue, total = [], []
        for _ in range(repeats):
            iss, tot = [], []
            for _ in range(steps):
                t0 = time.perf_counter()
                out = fn()
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                iss.append(t1 - t0)
                tot.append(time.perf_counter() - t0)
            issue.append(statistics.median(iss))
            total.append(statistics.median(tot))
        return (round(statistics.median(issue) * 1e6, 2), round(statistics.median(total) * 1e6, 2))

    def chain() -> Any:
        y = x
        for _ in range(8):
            y = f(y)
        return y

    devs = jax.devices()[:8]
    shs = [jax.sharding.SingleDeviceSharding(d) for d in devs]

    def chain_across(copy: Callable[[Any, Any], Any]) -> Callable[[], Any]:
        def run() -> Any:  # like a pipeline's forward pass: compute, copy to the next device
            y = f(x)
            for sh in shs[1:]:
                y = f(copy(y, sh))
            return y

        return run

    g = jax.jit(lambda a, w: jnp.tanh(a @ w) + a)
    ws = [jax.device_put(np.eye(64, dtype=np.float32) * 0.1, sh) for sh in shs]

    def chain_across_dot(copy: Callable[[Any, Any], Any]) -> Callable[[], Any]:
        def run() -> Any:
            y = g(x, ws[0])
            for sh, w in zip(shs[1:], ws[1:]):
                y = g(copy(y, sh), w)
            return y

        return run

    aot = f.lower(x).compile()  # what mm.jit's executor calls per fragment
    aot(x).block_until_ready()
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("jit_call_8x64", lambda: f(x)),
        ("aot_compiled_call_8x64", lambda: aot(x)),
        ("jit_chain_8_calls_8x64", chain),
        ("device_put_to_other_device_8x64", lambda: jax.device_put(x, sh1)),
        ("chain_8_calls_8_devices_device_put", chain_across(jax.device_put)),
        ("chain_8_dot_calls_8_devices_device_put", chain_across_dot(jax.device_put)),
    ]
    try:  # the executor's copy path for cross-submesh transfers (internal; may move)
        from multimesh._compat import same_layout_copy

        same_layout_copy([x], [sh1])[0].block_until_ready()
        cases.append(("mm_same_layout_copy_8x64", lambda: same_layout_copy([x], [sh1])))
        cases.append(
            (
                "chain_8_calls_8_devices_mm_copy",
                chain_across(lambda y, sh: same_layout_copy([y], [sh])[0]),
            )
        )
        cases.append(
            (
                "chain_8_dot_calls_8_devices_mm_copy",
                chain_across_dot(lambda y, sh: same_layout_copy([y], [sh])[0]),
            )
        )
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    for _, fn in cases:  # compile every device's copy of f before timing
        jax.block_until_ready(fn())
    out = {}
    for name, fn in cases:
        iss, tot = timed(fn)
        out[name] = {"issue_us": iss, "step_us": tot}
    return out


# --- profile -----------------------------------------------------------------------------


def profile_model(cfg: Config, steps: int, top: int = 12) -> dict[str, Any]:
    """cProfile ``steps`` steady-state mm.jit steps: where the host time goes."""
    mmesh = mm.make_mesh((cfg.stages,), ("stage",))
    mm_step = mm.jit(make_step(cfg), mesh=mmesh)
    host_params, host_x = init(cfg)
    x = jax.device_put(host_x, NamedSharding(mmesh.submesh(0), PartitionSpec()))
    p, _ = mm_step(host_params, x)
    for _ in range(5):
        p, v = mm_step(p, x)
    jax.block_until_ready(p)
    gc.collect()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        p, v = mm_step(p, x)
        jax.block_until_ready((p, v))
    prof.disable()
    st = pstats.Stats(prof)
    total = st.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore
        where = file
        if "multimesh/" in file:
            where = "multimesh/" + file.split("multimesh/")[-1]
        elif "site-packages/" in file:
            where = file.split("site-packages/")[-1]
        rows.append(
            {
                "function": f"{where}:{line}({func})",
                "calls_per_step": round(nc / steps, 2),
                "tottime_us_per_step": round(tt / steps * 1e6, 2),
                "cumtime_us_per_step": round(ct / steps * 1e6, 2),
                "multimesh": "multimesh/" in file,
            }
        )
    by_tt = sorted(rows, key=lambda r: -r["tottime_us_per_step"])[:top]
    mm_rows = sorted((r for r in rows if r["multimesh"]), key=lambda r: -r["cumtime_us_per_step"])[
        :top
    ]

    def cum(pred: Callable[[str], bool]) -> float:
        return round(sum(r["cumtime_us_per_step"] for r in rows if pred(r["function"])), 2)

    # Buckets (per step, under the profiler, which inflates Python-heavy code the most).
    buckets = {
        "total": round(total / steps * 1e6, 2),
        "block_until_ready (waiting for devices)": cum(lambda f: "(block_until_ready)" in f),
        "XLA executable calls (Compiled.__call__)": cum(
            lambda f: "jax/_src/stages.py" in f and f.endswith("(__call__)")
        ),
        "cross-submesh copies (same_layout_copy)": cum(lambda f: "(same_layout_copy)" in f),
        "multimesh Python, own time (excl. copies)": round(
            sum(
                r["tottime_us_per_step"]
                for r in rows
                if r["multimesh"] and "(same_layout_copy)" not in r["function"]
            ),
            2,
        ),
        "  of which argument handling (api.py)": round(
            sum(r["tottime_us_per_step"] for r in rows if "multimesh/api.py" in r["function"]), 2
        ),
        "  of which executor loop (executor.py)": round(
            sum(
                r["tottime_us_per_step"]
                for r in rows
                if "multimesh/runtime/executor.py" in r["function"]
            ),
            2,
        ),
    }
    return {
        "model": cfg.name,
        "steps": steps,
        "fragments": len(mm_step.lower(p, x).plan.fragments),
        "buckets_us_per_step": buckets,
        "top_by_tottime": by_tt,
        "multimesh_by_cumtime": mm_rows,
    }


# --- report ------------------------------------------------------------------------------


def print_table(results: list[dict[str, Any]], prims: dict[str, Any]) -> None:
    hdr = (
        f"{'model':<16}{'S':>3}{'frag':>5}{'xfer':>5}{'mm us':>11}{'jax us':>10}"
        f"{'ratio':>7}{'us/frag':>9}{'issue mm':>10}{'issue jax':>10}{'iss/frag':>9}"
        f"{'async mm':>10}{'async jax':>10}{'ratio':>7}{'best':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        m, j = r["mm"], r["jax"]
        print(
            f"{r['name']:<16}{r['stages']:>3}{r['fragments']:>5}{r['transfers']:>5}"
            f"{m['step_us']:>11.1f}{j['step_us']:>10.1f}{r['ratio']:>7.2f}"
            f"{r['overhead_per_fragment_us']:>9.1f}{m['issue_us']:>10.1f}{j['issue_us']:>10.1f}"
            f"{r['issue_overhead_per_fragment_us']:>9.1f}{m['async_step_us']:>10.1f}"
            f"{j['async_step_us']:>10.1f}{r['ratio_async']:>7.2f}{r['ratio_best']:>7.2f}"
        )
    print()
    print("columns: step = median blocking step time; issue = time for the call to return;")
    print("  async = per-step time of a loop that blocks only at the end; us/frag = (mm - jax)")
    print("  / fragments; best = ratio of the fastest blocking steps. Times in microseconds,")
    print("  median over repeats of per-repeat medians.")
    print()
    print("reference costs (one device; issue / round trip, us):")
    for k, v in prims.items():
        print(f"  {k:<38}{v['issue_us']:>9.1f}{v['step_us']:>10.1f}")


def print_profile(prof: dict[str, Any]) -> None:
    print()
    print(
        f"cProfile of {prof['steps']} blocking mm.jit steps of {prof['model']} "
        f"({prof['fragments']} fragments), us per step under the profiler:"
    )
    for k, v in prof["buckets_us_per_step"].items():
        print(f"  {k:<46}{v:>9.1f}")
    print("  top functions by own time:")
    print(f"  {'own us/step':>11} {'cum us/step':>11} {'calls/step':>10}  function")
    for r in prof["top_by_tottime"]:
        print(
            f"  {r['tottime_us_per_step']:>11.1f} {r['cumtime_us_per_step']:>11.1f} "
            f"{r['calls_per_step']:>10.1f}  {r['function']}"
        )
    print("  multimesh functions by cumulative time:")
    for r in prof["multimesh_by_cumtime"]:
        print(
            f"  {r['tottime_us_per_step']:>11.1f} {r['cumtime_us_per_step']:>11.1f} "
            f"{r['calls_per_step']:>10.1f}  {r['function']}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps (a smoke test, < 60 s)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default: benchmarks/results/dispatch-<python>[-quick].json)",
    )
    ap.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the cProfile of steady-state mm.jit steps (8-stage model)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=None, help="measurement repeats")
    args = ap.parse_args(argv)

    warmup = 2 if args.quick else 5
    steps = args.steps or (5 if args.quick else 30)
    repeats = args.repeats or (1 if args.quick else 9)
    configs = [
        Config("dispatch-s4", "dispatch-bound", stages=4, width=64, batch=8),
        Config("dispatch-s8", "dispatch-bound", stages=8, width=64, batch=8),
        Config("compute-s4", "compute-bound", stages=4, width=1024, batch=256),
    ]
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(
        f"MultiMesh dispatch benchmark: python {pyver}, jax {jax.__version__}, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores; "
        f"warmup {warmup}, {steps} steps x {repeats} repeats"
        f"{' (quick)' if args.quick else ''}"
    )
    print()
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        print(f"note: load average {load_start[0]:.2f} at start; timings may be noisy\n")
    results = []
    for cfg in configs:
        # The compute-bound model takes ~0.1 s a step here: 20 steps, at most 5 repeats.
        big = cfg.kind == "compute-bound" and not args.quick
        results.append(
            bench_model(
                cfg,
                warmup,
                20 if big and not args.steps else steps,
                min(repeats, 5) if big else repeats,
            )
        )
    prims = bench_primitives(max(steps, 20), repeats)
    print_table(results, prims)
    prof = None
    if not args.no_profile:
        prof = profile_model(configs[1], 10 if args.quick else 100)
        print_profile(prof)
    load_end = os.getloadavg()
    out = {
        **_common.environment("dispatch", args.quick),
        "warmup": warmup,
        "steps": steps,
        "repeats": repeats,
        "loadavg_start": [round(v, 2) for v in load_start],
        "loadavg_end": [round(v, 2) for v in load_end],
        "lr": LR,
        "models": results,
        "reference_costs": prims,
        "profile": prof,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    _common.write_results(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
