"""Pipeline benchmark: pipelined training steps under ``mm.jit`` against ``jax.jit``.

A residual MLP (``h = h + tanh(h @ w)`` per layer, two layers per device) is trained with
plain SGD (``params - lr * grads`` returned as the new params and fed back in every
step) on S in {2, 4} devices, one device (submesh) per pipeline stage, with M = 8
microbatches of 8 rows, under each schedule: ``gpipe``, ``1f1b``, ``interleaved-1f1b``
and ``zero-bubble-h1``. The gradient is ``mm.microbatch(jax.value_and_grad(loss), M,
argnums=(1, 2), schedule=..., reduce="mean")`` (gradient accumulation over microbatches).

Every schedule trains the same 2S-layer model: S task stages of two layers each, or for
``interleaved-1f1b`` 2S task stages of one layer each (stage ``i`` on device ``i % S``).

Two widths:

* 256: small per-op work, where XLA:CPU runs each op on one thread, so two devices can
  compute at once on two cores; the pipeline can overlap stages.
* 1024: each op is big enough for XLA:CPU to spread over the cores by itself (and the
  8-row matmuls are memory-bound), so running stages concurrently gains little.

For each configuration: the steady-state step time of the ``mm.jit`` step (blocking on
its results every step) and the time for its call to return (host dispatch); the same
step under ``jax.jit`` on ONE device (where ``mm.microbatch`` is a ``lax.scan`` over the
microbatches) and ``speedup = t_jax / t_mm``; the schedule simulator's ideal makespan
from measured per-microbatch costs of one task stage (its jitted forward, and its
backward from saved residuals with the gradient accumulation; for zero-bubble also the
input- and weight-gradient halves), ``ideal = mm.schedules.simulate(schedule, S, M,
forward_cost=tf, backward_cost=tb)``, ``efficiency = ideal / t_mm``, and the same with
the measured cross-device copy latency as ``comm_cost``; and the bubble fraction of
measured timelines (``mm.jit(...).record``). An overlap check shows how much two devices
gain by running independent work at once, for each width.

Results go to ``benchmarks/results/pipeline-<python>.json`` (``-quick`` added with
``--quick``).

Run:  python benchmarks/pipeline.py [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
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
M = 8  # microbatches
MB_ROWS = 8  # rows per microbatch
LAYERS_PER_DEVICE = 2
WIDTHS = (256, 1024)
STAGES = (2, 4)
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h1"]


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
    return params, x, np.sin(x)


# --- timing ------------------------------------------------------------------------------


def med_us(v: list[float]) -> float:
    return round(statistics.median(v) * 1e6, 2)


def time_calls(fn: Callable[[], Any], n: int, repeats: int) -> list[float]:
    """Per repeat, the median of n blocking calls (s): latency, dispatch included."""
    out = []
    for _ in range(repeats):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t0)
        out.append(statistics.median(ts))
    return out


def time_chain(fn: Callable[[Any], Any], state: Any, n: int, repeats: int) -> list[float]:
    """Per repeat, seconds per call of n dependent calls ``state = fn(state)`` with one
    block at the end: device time per call when dispatch runs ahead, as in a pipeline."""
    out = []
    for _ in range(repeats):
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        s = state
        for _ in range(n):
            s = fn(s)
        jax.block_until_ready(s)
        out.append((time.perf_counter() - t0) / n)
    return out


def stage_costs(width: int, layers: int, n: int, repeats: int) -> dict[str, float]:
    """Per-microbatch cost (us) of one task stage of ``layers`` layers on one device.

    f: the jitted forward. b: the backward from saved residuals (``jax.vjp``'s function
    passed as a pytree into a jitted call, so the forward is not recomputed) plus adding
    the weight gradients into an accumulator, as a pipelined backward does for each
    microbatch. bx / bw: its input-gradient and (accumulated) weight-gradient halves on
    their own (zero-bubble splits them). Each is timed as a chain of dependent calls with
    one block at the end (device time per call); ``*_blocking``: one blocking call at a
    time (adds dispatch and wake-up latency). copy: a blocking move of one microbatch's
    activation to another device.
    """
    d0, d1 = jax.devices()[:2]
    rng = np.random.default_rng(1)
    ws = [
        jax.device_put((rng.standard_normal((width, width)) / np.sqrt(width)).astype("f4"), d0)
        for _ in range(layers)
    ]
    h = jax.device_put(rng.standard_normal((MB_ROWS, width)).astype("f4"), d0)
    acc = [jnp.zeros_like(w) for w in ws]
    fwd = jax.jit(block)
    out = fwd(ws, h)
    _, vjp_all = jax.vjp(block, ws, h)
    _, vjp_x = jax.vjp(lambda h_: block(ws, h_), h)
    _, vjp_w = jax.vjp(lambda ws_: block(ws_, h), ws)

    @jax.jit
    def bwd(f: Any, ct: Any, acc: Any) -> Any:
        dws, dx = f(ct)
        return dx, [a + g for a, g in zip(acc, dws, strict=True)]

    @jax.jit
    def bwd_x(f: Any, ct: Any) -> Any:
        (dx,) = f(ct)
        return dx

    @jax.jit
    def bwd_w(f: Any, ct: Any, acc: Any) -> Any:
        (dws,) = f(ct)
        return [a + g for a, g in zip(acc, dws, strict=True)]

    # per phase: (one call, as a step of a dependency chain; the chain's first state)
    chains: dict[str, tuple[Callable[[Any], Any], Any]] = {
        "f": (lambda h_: fwd(ws, h_), h),
        "b": (lambda s: bwd(vjp_all, s[0], s[1]), (out, acc)),
        "bx": (lambda c: bwd_x(vjp_x, c), out),
        "bw": (lambda a: bwd_w(vjp_w, out, a), acc),
    }
    res: dict[str, float] = {}
    for k, (fn, st) in chains.items():
        for _ in range(3):
            jax.block_until_ready(fn(st))
        res[k] = med_us(time_chain(fn, st, n, repeats))
        res[f"{k}_blocking"] = med_us(time_calls(lambda fn=fn, st=st: fn(st), n, repeats))
    sh1 = jax.sharding.SingleDeviceSharding(d1)
    jax.block_until_ready(jax.device_put(out, sh1))
    res["copy"] = med_us(time_calls(lambda: jax.device_put(out, sh1), n, repeats))
    return res


def overlap_check(width: int, n: int, repeats: int) -> dict[str, float]:
    """Do two devices compute at once? Per iteration, one stage forward (two layers) on
    device 0, against one on each of devices 0 and 1 (independent chains, dispatched
    alternately, one block at the end). ``gain`` = 2 * t_one / t_two: 2.0 is perfect
    overlap, 1.0 none."""
    devs = jax.devices()[:2]
    rng = np.random.default_rng(2)
    fwd = jax.jit(block)
    ws = [
        [
            jax.device_put((rng.standard_normal((width, width)) / np.sqrt(width)).astype("f4"), d)
            for _ in range(LAYERS_PER_DEVICE)
        ]
        for d in devs
    ]
    hs = [jax.device_put(rng.standard_normal((MB_ROWS, width)).astype("f4"), d) for d in devs]

    def run(k: int) -> Callable[[Any], Any]:
        def one(state: Any) -> Any:
            return [fwd(ws[i], state[i]) for i in range(k)]

        return one

    for k in (1, 2):
        jax.block_until_ready(run(k)(hs))
    t1 = statistics.median(time_chain(run(1), hs[:1], n, repeats))
    t2 = statistics.median(time_chain(run(2), hs, n, repeats))
    return {
        "one_device_us": round(t1 * 1e6, 2),
        "two_devices_us": round(t2 * 1e6, 2),
        "gain": round(2 * t1 / t2, 3),
    }


def run_steps(fn: Callable, state: Any, x: Any, y: Any, steps: int) -> tuple[Any, float, float]:
    """``steps`` blocking training steps: (params, median step time, median time for the
    call to return, i.e. the host dispatch of the step), in s."""
    gc.collect()
    total, issue = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, val = fn(state, x, y)
        t1 = time.perf_counter()
        jax.block_until_ready((state, val))
        total.append(time.perf_counter() - t0)
        issue.append(t1 - t0)
    return state, statistics.median(total), statistics.median(issue)


def timeline_summary(tl: Any) -> dict[str, Any]:
    """A measured timeline in numbers (times in us)."""
    other = [
        sum(e.end - e.start for e in row if e.action.microbatch < 0) for row in tl.events
    ]  # fragments outside the microbatches: slicing the batch, the update, ...
    return {
        "makespan_us": round(tl.makespan, 1),
        "bubble_fraction": round(tl.bubble_fraction, 4),
        "busy_us": [round(b, 1) for b in tl.busy],
        "busy_outside_microbatches_us": [round(b, 1) for b in other],
        "events": sum(len(r) for r in tl.events),
        "peak_in_flight": list(tl.peak_in_flight),
        "peak_live_bytes": list(tl.peak_live_bytes),
    }


# --- one configuration -------------------------------------------------------------------


def bench_config(
    cfg: Config, costs: dict[str, float], warmup: int, steps: int, repeats: int, records: int
) -> dict[str, Any]:
    S = cfg.stages
    mmesh = mm.make_mesh((S,), ("stage",), devices=jax.devices()[:S])
    step = make_step(cfg)
    host_params, host_x, host_y = init(cfg)

    # mm.jit: x lives on the first stage and y on the last (where they are used), each
    # task's params on its stage's device (where the update leaves them), so no step
    # moves an input.
    mm_step = mm.jit(step, mesh=mmesh)
    on = [NamedSharding(mmesh.submesh(i), PartitionSpec()) for i in range(S)]
    x_mm, y_mm = jax.device_put(host_x, on[0]), jax.device_put(host_y, on[S - 1])
    p_mm = [jax.device_put(ws, on[i % S]) for i, ws in enumerate(host_params)]
    t0 = time.perf_counter()
    p_mm, v_mm = mm_step(p_mm, x_mm, y_mm)
    jax.block_until_ready((p_mm, v_mm))
    mm_first = time.perf_counter() - t0

    # jax.jit on one device. Tasks with stage= need an active MultiMesh while tracing;
    # `with mmesh:` also makes the global (S-device) mesh the JAX mesh, which rejects
    # inputs committed to one device, so a one-device JAX mesh is entered inside it.
    # jax.jit keys its cache on the mesh context, so every jax.jit call runs inside it.
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

    for _ in range(warmup):
        p_mm, _v = mm_step(p_mm, x_mm, y_mm)
        with on_one_device():
            p_j, _v = jax_step(p_j, x_j, y_j)
    jax.block_until_ready((p_mm, p_j))
    mm_cache = len(mm_step._cache)  # noqa: SLF001  (a retrace per step would show here)
    jax_cache = jax_step._cache_size()  # noqa: SLF001
    if mm_cache != 1:
        print(f"  note: {cfg.name}: mm.jit traced {mm_cache} signatures", file=sys.stderr)
    compiled = list(mm_step._cache.values())[-1]  # noqa: SLF001  (the steady-state one)
    plan = compiled.plan

    t_mm: list[float] = []
    i_mm: list[float] = []
    t_j: list[float] = []
    for r in range(repeats):  # alternate the order so drift and load favour neither side
        for which in ("mm", "jax") if r % 2 == 0 else ("jax", "mm"):
            if which == "mm":
                p_mm, t, iss = run_steps(mm_step, p_mm, x_mm, y_mm, steps)
                t_mm.append(t)
                i_mm.append(iss)
            else:
                with on_one_device():
                    p_j, t, _ = run_steps(jax_step, p_j, x_j, y_j, steps)
                t_j.append(t)
    if len(mm_step._cache) != mm_cache:  # noqa: SLF001
        print(f"  warning: {cfg.name}: mm.jit retraced during timing", file=sys.stderr)
    if jax_step._cache_size() != jax_cache:  # noqa: SLF001
        print(f"  warning: {cfg.name}: jax.jit retraced during timing", file=sys.stderr)

    # Measured timelines (record runs a waiter thread per submesh and counts live
    # buffers after every plan step, so it is slower than a plain step): the median one.
    tls = []
    for _ in range(records):
        (p_mm, _v), tl = mm_step.record(p_mm, x_mm, y_mm)
        jax.block_until_ready(p_mm)
        tls.append(tl)
    tls.sort(key=lambda t: t.makespan)
    measured = timeline_summary(tls[len(tls) // 2])

    # The simulator's ideal from one task stage's measured per-microbatch costs.
    # forward_cost / backward_cost are per device: the simulator divides them among the
    # device's chunks (interleaving: two one-layer task stages per device).
    c = cfg.chunks
    tf, tb = c * costs["f"], c * costs["b"]
    sim = mm.schedules.simulate(cfg.schedule, S, M, forward_cost=tf, backward_cost=tb)
    sim_comm = mm.schedules.simulate(
        cfg.schedule, S, M, forward_cost=tf, backward_cost=tb, comm_cost=costs["copy"]
    )
    sim_blocking = mm.schedules.simulate(
        cfg.schedule,
        S,
        M,
        forward_cost=c * costs["f_blocking"],
        backward_cost=c * costs["b_blocking"],
        comm_cost=costs["copy"],
    )
    extra: dict[str, Any] = {}
    if mm.schedules.get(cfg.schedule).splits_backward:
        # B and W at their own measured costs (the default splits tb in halves)
        split = mm.schedules.simulate(
            cfg.schedule,
            S,
            M,
            forward_cost=tf,
            backward_cost=c * costs["bx"],
            weight_cost=c * costs["bw"],
        )
        extra["ideal_measured_split_us"] = round(split.makespan, 1)
        extra["sim_measured_split_bubble"] = round(split.bubble_fraction, 4)

    mm_us, jax_us = med_us(t_mm), med_us(t_j)
    serial = S * M * (tf + tb)
    # the simulator gives every submesh its own processor; here S devices share the cores
    bound = max(sim_comm.makespan, serial / min(S, os.cpu_count() or 1))
    per_device = [sum(f.stage == s for f in plan.fragments) for s in range(S)]
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
        "fragments_per_device": per_device,
        "executables": compiled.num_executables,
        "transfers": len(plan.transfers),
        "transfer_bytes": sum(t.nbytes for t in plan.transfers),
        "input_modes": sorted({p.mode for p in plan.inputs}),
        "mm_signatures_traced": mm_cache,
        "first_call_s": {"mm": round(mm_first, 3), "jax": round(jax_first, 3)},
        "max_abs_diff_first_step": diff,
        "mm_step_us": mm_us,
        "mm_issue_us": med_us(i_mm),
        "jax_step_us": jax_us,
        "mm_step_us_per_repeat": [round(t * 1e6, 2) for t in t_mm],
        "jax_step_us_per_repeat": [round(t * 1e6, 2) for t in t_j],
        "speedup": round(jax_us / mm_us, 3),
        "forward_cost_us": tf,
        "backward_cost_us": tb,
        "serial_us": round(serial, 1),
        "ideal_us": round(sim.makespan, 1),
        "sim_bubble": round(sim.bubble_fraction, 4),
        "efficiency": round(sim.makespan / mm_us, 3),
        "ideal_comm_us": round(sim_comm.makespan, 1),
        "efficiency_comm": round(sim_comm.makespan / mm_us, 3),
        "ideal_blocking_costs_comm_us": round(sim_blocking.makespan, 1),
        "cores_bound_us": round(bound, 1),
        "efficiency_cores_bound": round(bound / mm_us, 3),
        **extra,
        "measured_timeline": measured,
    }


# --- report ------------------------------------------------------------------------------


def print_costs(costs: dict[tuple[int, int], dict[str, float]], overlap: dict[int, Any]) -> None:
    print("per-microbatch cost of one task stage on one device, us (chained calls; blocking")
    print("calls in parentheses); copy = blocking move of one activation to another device:")
    print(f"  {'width':>5}{'layers':>7}{'fwd':>15}{'bwd':>15}{'bwd-x':>15}{'bwd-w':>15}{'copy':>7}")
    for (w, n), c in sorted(costs.items()):
        cols = "".join(f"{c[k]:>7.0f} ({c[k + '_blocking']:>5.0f})" for k in ("f", "b", "bx", "bw"))
        print(f"  {w:>5}{n:>7}{cols}{c['copy']:>7.0f}")
    print()
    print("overlap check: a 2-layer stage forward per iteration on one device vs on two")
    print("devices at once (2.0 = perfect overlap):")
    for w, o in overlap.items():
        print(
            f"  width {w:>5}: one {o['one_device_us']:>8.1f} us, two {o['two_devices_us']:>8.1f}"
            f" us, gain {o['gain']:.2f}"
        )
    print()


def print_table(results: list[dict[str, Any]]) -> None:
    hdr = (
        f"{'S':>2}{'width':>6} {'schedule':<17}{'frag':>5}{'mm ms':>8}{'issue':>7}"
        f"{'jax ms':>8}{'speedup':>8}{'serial':>8}{'ideal':>7}{'eff':>6}{'+comm':>7}"
        f"{'bound':>7}{'eff':>6}{'sim bub':>8}{'rec ms':>8}{'rec bub':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        m = r["measured_timeline"]
        print(
            f"{r['stages']:>2}{r['width']:>6} {r['schedule']:<17}{r['fragments']:>5}"
            f"{r['mm_step_us'] / 1e3:>8.2f}{r['mm_issue_us'] / 1e3:>7.2f}"
            f"{r['jax_step_us'] / 1e3:>8.2f}{r['speedup']:>8.2f}{r['serial_us'] / 1e3:>8.2f}"
            f"{r['ideal_us'] / 1e3:>7.2f}{r['efficiency']:>6.2f}{r['ideal_comm_us'] / 1e3:>7.2f}"
            f"{r['cores_bound_us'] / 1e3:>7.2f}{r['efficiency_cores_bound']:>6.2f}"
            f"{r['sim_bubble']:>8.2f}{m['makespan_us'] / 1e3:>8.2f}"
            f"{m['bubble_fraction']:>8.2f}"
        )
    print()
    print("columns (ms): mm = median steady-state step of mm.jit on S devices (blocking);")
    print("  issue = time for its call to return (host dispatch); jax = jax.jit on one device;")
    print("  speedup = jax / mm; serial = S*M*(tf+tb) from the chained stage costs; ideal =")
    print("  simulated makespan from those costs, eff = ideal / mm; +comm = the same with the")
    print("  copy latency per cross-device dependency; bound = max(+comm, serial / min(S,")
    print("  cores)) (S devices share the cores), eff = bound / mm; sim bub = simulated bubble")
    print("  fraction; rec = the median of recorded steps (.record): makespan, bubble fraction.")


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

    warmup = 1 if args.quick else 5
    records = 1 if args.quick else 5
    # (timed steps, repeats) per width: a width-1024 step takes ~0.1-0.3 s here.
    plan = {256: (3, 1), 1024: (3, 1)} if args.quick else {256: (30, 5), 1024: (20, 3)}
    if args.steps or args.repeats:
        plan = {w: (args.steps or n, args.repeats or r) for w, (n, r) in plan.items()}
    cost_calls, cost_repeats = (20, 1) if args.quick else (100, 5)
    configs = [Config(s, w, sch) for w in WIDTHS for s in STAGES for sch in SCHEDULES]
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(
        f"MultiMesh pipeline benchmark: python {pyver}, jax {jax.__version__}, "
        f"{jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores; "
        f"M={M} microbatches of {MB_ROWS} rows, {LAYERS_PER_DEVICE} layers per device; "
        f"warmup {warmup}, (steps, repeats) per width {plan}{' (quick)' if args.quick else ''}"
    )
    print()
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    if load_start[0] > 0.5 * (os.cpu_count() or 1):
        print(f"note: load average {load_start[0]:.2f} at start; timings may be noisy\n")

    layer_counts = sorted({LAYERS_PER_DEVICE, LAYERS_PER_DEVICE // 2})
    costs = {
        (w, n): stage_costs(w, n, cost_calls, cost_repeats) for w in WIDTHS for n in layer_counts
    }
    overlap = {w: overlap_check(w, cost_calls, cost_repeats) for w in WIDTHS}
    print_costs(costs, overlap)
    results = []
    for cfg in configs:
        print(f"  {cfg.name} ...", file=sys.stderr, flush=True)
        steps, repeats = plan[cfg.width]
        cost = costs[cfg.width, cfg.layers_per_task]
        results.append(bench_config(cfg, cost, warmup, steps, repeats, records))
    print_table(results)
    load_end = os.getloadavg()
    out = {
        **_common.environment("pipeline", args.quick),
        "warmup": warmup,
        "steps_repeats_per_width": {str(w): list(v) for w, v in plan.items()},
        "records": records,
        "microbatches": M,
        "microbatch_rows": MB_ROWS,
        "layers_per_device": LAYERS_PER_DEVICE,
        "lr": LR,
        "loadavg_start": [round(v, 2) for v in load_start],
        "loadavg_end": [round(v, 2) for v in load_end],
        "stage_costs_us": {f"w{w}-l{n}": c for (w, n), c in sorted(costs.items())},
        "overlap_check": {str(w): o for w, o in overlap.items()},
        "configs": results,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    _common.write_results(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
