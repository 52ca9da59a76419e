"""Pipeline benchmark: pipelined training steps under ``mm.jit`` against ``jax.jit``.

A residual MLP (``h = h + tanh(h @ w)`` per layer, two layers per device) is trained with
plain SGD (``params - lr * grads`` returned as the new params and fed back in every
step) on S in {2, 4} devices, one device (submesh) per pipeline stage, with M = 8
microbatches of 8 rows, under each schedule: ``gpipe``, ``1f1b``, ``interleaved-1f1b``
and ``zero-bubble-h1``. The loss is ``mm.microbatch(jax.value_and_grad(loss), M,
argnums=(1, 2), schedule=..., reduce="mean")`` (gradient accumulation over the
microbatches).

Every schedule trains the same 2S-layer model: S task stages of two layers each, or for
``interleaved-1f1b`` 2S task stages of one layer each (stage ``i`` on device ``i % S``).

Two widths:

* 256: small per-op work, where XLA:CPU runs each op on one thread, so two devices can
  compute at once on two cores; the pipeline should overlap stages.
* 1024: each op is big enough for XLA:CPU to spread over all cores by itself (and the
  8-row matmuls are memory-bound), so running stages concurrently gains nothing.

For each configuration the benchmark reports the steady-state step time of the
``mm.jit`` step and of the same step under ``jax.jit`` on ONE device (where
``mm.microbatch`` is a ``lax.scan`` over the microbatches), ``speedup = t_jax / t_mm``,
and the schedule simulator's ideal makespan from measured per-microbatch costs of one
stage (a jitted forward of the stage's layers on one microbatch, and its backward from
saved residuals; for zero-bubble also its input- and weight-gradient halves):
``ideal = mm.schedules.simulate(schedule, S, M, forward_cost=tf, backward_cost=tb)``,
``efficiency = ideal / t_mm``. The measured timeline of one step (``.record``) gives the
bubble fraction actually seen on the devices.

Results go to ``benchmarks/results/pipeline-<python>.json`` (``-quick`` added with
``--quick``).

Run:  python benchmarks/pipeline.py [--quick] [--out PATH]
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import multimesh as mm  # noqa: E402

LR = 0.01
M = 8  # microbatches
MB_ROWS = 8  # rows per microbatch
LAYERS_PER_DEVICE = 2
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h1"]
RESULTS = Path(__file__).resolve().parent / "results"


# --- model -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    stages: int  # devices = submeshes
    width: int
    schedule: str

    @property
    def name(self) -> str:
        return f"s{self.stages}-w{self.width}-{self.schedule}"

    @property
    def chunks(self) -> int:  # task stages per device
        return 2 if self.schedule == "interleaved-1f1b" else 1

    @property
    def task_stages(self) -> int:
        return self.stages * self.chunks

    @property
    def layers_per_task(self) -> int:
        return LAYERS_PER_DEVICE // self.chunks


def block(ws: list[Any], h: Any) -> Any:
    """One task stage: its residual layers."""
    for w in ws:
        h = h + jnp.tanh(h @ w)
    return h


def loss(params: list[list[Any]], x: Any, y: Any) -> Any:
    h = x
    for i, ws in enumerate(params):
        with mm.task(f"s{i}", stage=i):
            h = block(ws, h)
    return jnp.mean((h - y) ** 2)


def make_step(cfg: Config) -> Callable[..., tuple[Any, Any]]:
    """A training step: microbatched value_and_grad, then an SGD update."""
    grad_fn = mm.microbatch(
        jax.value_and_grad(loss), M, argnums=(1, 2), schedule=cfg.schedule, reduce="mean"
    )

    def step(params: Any, x: Any, y: Any) -> tuple[Any, Any]:
        val, grads = grad_fn(params, x, y)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), val

    return step


def init(cfg: Config, seed: int = 0) -> tuple[list[list[np.ndarray]], np.ndarray, np.ndarray]:
    """Host params (the same 2S layers for every schedule, grouped per task) and data."""
    rng = np.random.default_rng(seed)
    n_layers = cfg.stages * LAYERS_PER_DEVICE
    scale = 1.0 / np.sqrt(cfg.width)
    layers = [
        (rng.standard_normal((cfg.width, cfg.width)) * scale).astype(np.float32)
        for _ in range(n_layers)
    ]
    k = cfg.layers_per_task
    params = [layers[i : i + k] for i in range(0, n_layers, k)]
    x = rng.standard_normal((M * MB_ROWS, cfg.width)).astype(np.float32)
    y = np.sin(x)
    return params, x, y


# --- timing ------------------------------------------------------------------------------


def med_us(v: list[float]) -> float:
    return round(statistics.median(v) * 1e6, 2)


def time_calls(fn: Callable[[], Any], n: int, repeats: int) -> list[float]:
    """Per repeat, the median of n blocking calls (seconds)."""
    out = []
    for _ in range(repeats):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts))
    return out


def stage_costs(width: int, layers: int, n: int, repeats: int) -> dict[str, float]:
    """Per-microbatch cost (us) of one task stage of ``layers`` layers on one device.

    f: the jitted forward; b: the backward from saved residuals (``jax.vjp``'s function,
    passed as a pytree into a jitted call, so the forward is not recomputed); bx / bw: the
    input-gradient and weight-gradient halves on their own (zero-bubble splits them);
    copy: moving one microbatch's activation to another device.
    """
    d0, d1 = jax.devices()[:2]
    rng = np.random.default_rng(1)
    ws = [
        jax.device_put((rng.standard_normal((width, width)) / np.sqrt(width)).astype("f4"), d0)
        for _ in range(layers)
    ]
    h = jax.device_put(rng.standard_normal((MB_ROWS, width)).astype("f4"), d0)
    fwd = jax.jit(block)
    out = fwd(ws, h)
    _, vjp_all = jax.vjp(block, ws, h)
    _, vjp_x = jax.vjp(lambda h_: block(ws, h_), h)
    _, vjp_w = jax.vjp(lambda ws_: block(ws_, h), ws)
    apply = jax.jit(lambda f, ct: f(ct))
    sh1 = jax.sharding.SingleDeviceSharding(d1)
    cases = {
        "f": lambda: fwd(ws, h),
        "b": lambda: apply(vjp_all, out),
        "bx": lambda: apply(vjp_x, out),
        "bw": lambda: apply(vjp_w, out),
        "copy": lambda: jax.device_put(out, sh1),
    }
    for fn in cases.values():
        for _ in range(3):
            jax.block_until_ready(fn())
    return {k: med_us(time_calls(fn, n, repeats)) for k, fn in cases.items()}


def run_steps(fn: Callable, state: Any, x: Any, y: Any, steps: int) -> tuple[Any, float]:
    """``steps`` blocking training steps; (params, median step time in s)."""
    gc.collect()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, val = fn(state, x, y)
        jax.block_until_ready((state, val))
        ts.append(time.perf_counter() - t0)
    return state, statistics.median(ts)


def timeline_summary(tl: Any) -> dict[str, Any]:
    phases: dict[str, list[float]] = {}
    for row in tl.events:
        for e in row:
            key = e.action.phase if e.action.microbatch >= 0 else "other"
            phases.setdefault(key, []).append(e.end - e.start)
    return {
        "makespan_us": round(tl.makespan, 1),
        "bubble_fraction": round(tl.bubble_fraction, 4),
        "busy_us": [round(b, 1) for b in tl.busy],
        "events": sum(len(r) for r in tl.events),
        "mean_event_us": {k: round(statistics.mean(v), 1) for k, v in sorted(phases.items())},
        "peak_in_flight": list(tl.peak_in_flight),
    }


# --- one configuration -------------------------------------------------------------------


def bench_config(
    cfg: Config, costs: dict[str, float], warmup: int, steps: int, repeats: int, records: int
) -> dict[str, Any]:
    S = cfg.stages
    mmesh = mm.make_mesh((S,), ("stage",), devices=jax.devices()[:S])
    step = make_step(cfg)
    host_params, host_x, host_y = init(cfg)

    # mm.jit: x lives on the first stage and y on the last (where they are used); params
    # are wherever the previous step left them, so the steady state moves no input.
    mm_step = mm.jit(step, mesh=mmesh)
    x_mm = jax.device_put(host_x, NamedSharding(mmesh.submesh(0), PartitionSpec()))
    y_mm = jax.device_put(host_y, NamedSharding(mmesh.submesh(S - 1), PartitionSpec()))
    t0 = time.perf_counter()
    p_mm, v_mm = mm_step(host_params, x_mm, y_mm)
    jax.block_until_ready((p_mm, v_mm))
    mm_first = time.perf_counter() - t0

    # jax.jit on one device. Tasks with stage= need an active MultiMesh while tracing;
    # `with mmesh:` also makes the global (S-device) mesh the JAX mesh, which rejects
    # inputs committed to one device, so a one-device JAX mesh is entered inside it.
    dev0 = jax.devices()[0]
    one = Mesh(np.array([dev0]), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))

    @contextlib.contextmanager
    def on_one_device() -> Any:
        with mmesh, jax.set_mesh(one):
            yield

    jax_step = jax.jit(step)
    x_j, y_j = jax.device_put(host_x, dev0), jax.device_put(host_y, dev0)
    with on_one_device():
        t0 = time.perf_counter()
        p_j, v_j = jax_step(jax.device_put(host_params, dev0), x_j, y_j)
        jax.block_until_ready((p_j, v_j))
        jax_first = time.perf_counter() - t0
    leaves_mm = [np.asarray(a) for a in jax.tree.leaves((v_mm, p_mm))]
    leaves_j = [np.asarray(a) for a in jax.tree.leaves((v_j, p_j))]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(leaves_mm, leaves_j, strict=True))

    compiled = mm_step.lower(p_mm, x_mm, y_mm).compile()
    plan = compiled.plan
    puts = [p for p in plan.inputs if p.mode == "put"]

    for _ in range(warmup):
        p_mm, _v = mm_step(p_mm, x_mm, y_mm)
        with on_one_device():
            p_j, _v = jax_step(p_j, x_j, y_j)
    jax.block_until_ready((p_mm, p_j))
    mm_cache = len(mm_step._cache)  # noqa: SLF001  (a retrace per step would show here)
    jax_cache = jax_step._cache_size()  # noqa: SLF001

    t_mm: list[float] = []
    t_j: list[float] = []
    for r in range(repeats):  # alternate the order so drift and load favour neither side
        for which in (("mm", "jax") if r % 2 == 0 else ("jax", "mm")):
            if which == "mm":
                p_mm, t = run_steps(mm_step, p_mm, x_mm, y_mm, steps)
                t_mm.append(t)
            else:
                with on_one_device():
                    p_j, t = run_steps(jax_step, p_j, x_j, y_j, steps)
                t_j.append(t)
    if len(mm_step._cache) != mm_cache:  # noqa: SLF001
        print(f"  warning: {cfg.name}: mm.jit retraced during timing", file=sys.stderr)
    if jax_step._cache_size() != jax_cache:  # noqa: SLF001
        print(f"  warning: {cfg.name}: jax.jit retraced during timing", file=sys.stderr)

    # Measured timelines (record adds a waiter thread per submesh): the median by makespan.
    tls = []
    for _ in range(records):
        p_mm, tl = mm_step.record(p_mm, x_mm, y_mm)
        jax.block_until_ready(p_mm)
        tls.append(tl)
    tls.sort(key=lambda t: t.makespan)
    measured = timeline_summary(tls[len(tls) // 2])

    # The simulator's ideal from one stage's measured per-microbatch costs. forward_cost
    # and backward_cost are per device (the simulator divides them among its chunks).
    c = cfg.chunks
    tf, tb = c * costs["f"], c * costs["b"]
    sim = mm.schedules.simulate(cfg.schedule, S, M, forward_cost=tf, backward_cost=tb)
    sim_comm = mm.schedules.simulate(
        cfg.schedule, S, M, forward_cost=tf, backward_cost=tb, comm_cost=costs["copy"]
    )
    extra: dict[str, Any] = {}
    if mm.schedules.get(cfg.schedule).splits_backward:
        split = mm.schedules.simulate(
            cfg.schedule,
            S,
            M,
            forward_cost=tf,
            backward_cost=c * costs["bx"],
            weight_cost=c * costs["bw"],
        )
        extra["ideal_split_us"] = round(split.makespan, 1)
        extra["sim_split_bubble"] = round(split.bubble_fraction, 4)

    mm_us, jax_us = med_us(t_mm), med_us(t_j)
    return {
        **dataclasses.asdict(cfg),
        "name": cfg.name,
        "microbatches": M,
        "microbatch_rows": MB_ROWS,
        "task_stages": cfg.task_stages,
        "layers_per_task": cfg.layers_per_task,
        "warmup": warmup,
        "timed_steps": steps,
        "repeats": repeats,
        "fragments": len(plan.fragments),
        "executables": compiled.num_executables,
        "transfers": len(plan.transfers),
        "transfer_bytes": sum(t.nbytes for t in plan.transfers),
        "host_puts": len(puts),
        "first_call_s": {"mm": round(mm_first, 3), "jax": round(jax_first, 3)},
        "max_abs_diff_first_step": diff,
        "mm_step_us": mm_us,
        "jax_step_us": jax_us,
        "mm_step_us_per_repeat": [round(t * 1e6, 2) for t in t_mm],
        "jax_step_us_per_repeat": [round(t * 1e6, 2) for t in t_j],
        "speedup": round(jax_us / mm_us, 3),
        "stage_costs_us": {"f": tf, "b": tb},
        "serial_us": round(S * M * (tf + tb), 1),
        "ideal_us": round(sim.makespan, 1),
        "sim_bubble": round(sim.bubble_fraction, 4),
        "ideal_comm_us": round(sim_comm.makespan, 1),
        **extra,
        "efficiency": round(sim.makespan / mm_us, 3),
        "measured_timeline": measured,
    }


# --- report ------------------------------------------------------------------------------


def print_costs(costs: dict[tuple[int, int], dict[str, float]]) -> None:
    print("per-microbatch cost of one task stage on one device (us, blocking calls):")
    print(f"  {'width':>6}{'layers':>7}{'fwd':>9}{'bwd':>9}{'bwd-x':>9}{'bwd-w':>9}{'copy':>9}")
    for (w, n), c in sorted(costs.items()):
        print(
            f"  {w:>6}{n:>7}{c['f']:>9.1f}{c['b']:>9.1f}{c['bx']:>9.1f}{c['bw']:>9.1f}"
            f"{c['copy']:>9.1f}"
        )
    print()


def print_table(results: list[dict[str, Any]]) -> None:
    hdr = (
        f"{'S':>2}{'width':>6} {'schedule':<17}{'frag':>5}{'mm ms':>9}{'jax ms':>9}"
        f"{'speedup':>8}{'serial':>8}{'ideal':>8}{'eff':>6}{'sim bub':>8}{'rec ms':>8}"
        f"{'rec bub':>8}{'F us':>7}{'B us':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        m = r["measured_timeline"]
        ev = m["mean_event_us"]
        print(
            f"{r['stages']:>2}{r['width']:>6} {r['schedule']:<17}{r['fragments']:>5}"
            f"{r['mm_step_us'] / 1e3:>9.2f}{r['jax_step_us'] / 1e3:>9.2f}{r['speedup']:>8.2f}"
            f"{r['serial_us'] / 1e3:>8.2f}{r['ideal_us'] / 1e3:>8.2f}{r['efficiency']:>6.2f}"
            f"{r['sim_bubble']:>8.2f}{m['makespan_us'] / 1e3:>8.2f}{m['bubble_fraction']:>8.2f}"
            f"{ev.get('F', float('nan')):>7.0f}{ev.get('B', float('nan')):>7.0f}"
        )
    print()
    print("columns: mm / jax = median steady-state step time (blocking) of mm.jit on S devices")
    print("  and of jax.jit on one device; speedup = jax / mm; serial = S*M*(tf+tb) from the")
    print("  isolated stage costs; ideal = simulated makespan from those costs (no transfer")
    print("  cost); eff = ideal / mm; sim bub = simulated bubble fraction; rec = one recorded")
    print("  step (.record): makespan, bubble fraction, mean fragment time of F and B (for")
    print("  zero-bubble B is the input-gradient half) in us.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps (a smoke test, < 60 s)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default: benchmarks/results/pipeline-<python>[-quick].json)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps per repeat")
    ap.add_argument("--repeats", type=int, default=None, help="measurement repeats")
    args = ap.parse_args(argv)

    warmup = 2 if args.quick else 5
    steps = args.steps or (5 if args.quick else 20)
    repeats = args.repeats or (1 if args.quick else 5)
    records = 1 if args.quick else 5
    widths = (256, 1024)
    configs = [Config(s, w, sch) for w in widths for s in (2, 4) for sch in SCHEDULES]
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(
        f"MultiMesh pipeline benchmark: python {pyver}, jax {jax.__version__}, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores; "
        f"M={M} microbatches of {MB_ROWS} rows; warmup {warmup}, {steps} steps x {repeats} "
        f"repeats{' (quick)' if args.quick else ''}"
    )
    print()
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        print(f"note: load average {load_start[0]:.2f} at start; timings may be noisy\n")

    costs = {
        (w, n): stage_costs(w, n, 20 if args.quick else 100, 1 if args.quick else 5)
        for w in widths
        for n in sorted({LAYERS_PER_DEVICE, LAYERS_PER_DEVICE // 2})
    }
    print_costs(costs)
    results = []
    for cfg in configs:
        print(f"  {cfg.name} ...", file=sys.stderr, flush=True)
        r = bench_config(
            cfg, costs[cfg.width, cfg.layers_per_task], warmup, steps, repeats, records
        )
        results.append(r)
    print_table(results)
    load_end = os.getloadavg()
    out = {
        "benchmark": "pipeline",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "multimesh": mm.__version__,
        "platform": jax.devices()[0].platform,
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "quick": args.quick,
        "warmup": warmup,
        "steps": steps,
        "repeats": repeats,
        "records": records,
        "microbatches": M,
        "microbatch_rows": MB_ROWS,
        "layers_per_device": LAYERS_PER_DEVICE,
        "lr": LR,
        "loadavg_start": [round(v, 2) for v in load_start],
        "loadavg_end": [round(v, 2) for v in load_end],
        "stage_costs_us": {f"w{w}-l{n}": c for (w, n), c in sorted(costs.items())},
        "configs": results,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    path = args.out or RESULTS / f"pipeline-{pyver}{'-quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {path} ({out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
