"""Step benchmark (issue 14's targets): one 4-stage pipelined training step against ``jax.jit``.

The model of ``benchmarks/pipeline.py``: an 8-layer residual MLP (two layers per stage,
``h = h + tanh(h @ w)``), batch 64 in M = 8 microbatches, SGD, one CPU device per stage.
For each width (256: dispatch-bound; 1024: compute-bound) and schedule it measures, in
one run with interleaved repeats (medians):

* ``mm_step_us``: a blocking ``mm.jit`` step; ``mm_return_us``: the time for its call to
  return (host dispatch), and ``return_ratio`` = return / step;
* two ``jax.jit`` baselines on ONE device: ``scan`` (``mm.microbatch`` traced by
  ``jax.jit`` is a ``lax.scan`` over the microbatches) and ``unrolled`` (a Python loop of
  M ``value_and_grad`` calls summed); ``mm_vs_scan`` and ``mm_vs_unrolled`` are the step
  ratios (lower is better);
* ``overhead_per_fragment_us``: (mm step - baseline step) / fragments, for both baselines;
* ``first_call_s`` (trace + plan + compile + one run) and ``first_call_vs_scan``;
* ``interleaved_vs_1f1b``: interleaved 1F1B's step against 1F1B's, raw and as the ratio
  of their ``mm_vs_scan`` (each against the ``jax.jit`` step timed in its own repeats,
  the same program for every schedule: the machine's speed drifts between configs; the
  target uses this one).

``targets`` records issue 14's goals next to the measured values (``met``: true/false).
Every mm.jit run is checked bit-identical to ``jax.jit`` (scan) on the first step.

Results go to ``benchmarks/results/step-<python>.json`` (``-quick`` with ``--quick``).

Run:  python benchmarks/step.py [--quick] [--widths 256 1024] [--schedules 1f1b ...]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _common  # sets up 8 virtual CPU devices before jax is imported
import jax
import jax.numpy as jnp
import numpy as np
import pipeline as P
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import multimesh as mm

STAGES = 4
SCHEDULES = ["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble-h1"]


def plain_loss(params: list[list[Any]], x: Any, y: Any) -> Any:
    """``pipeline.loss`` without task contexts (interleaving's 8 task stages need a
    schedule)."""
    h = x
    for ws in params:
        h = P.block(ws, h)
    return jnp.mean((h - y) ** 2)


def unrolled_step(params: Any, x: Any, y: Any) -> tuple[Any, Any]:
    """The same training step with the microbatch loop unrolled in Python."""
    vg = jax.value_and_grad(plain_loss)
    total, grads = 0.0, None
    for m in range(P.M):
        rows = slice(m * P.MB_ROWS, (m + 1) * P.MB_ROWS)
        val, g = vg(params, x[rows], y[rows])
        total = total + val
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    grads = jax.tree.map(lambda g: g / P.M, grads)
    return jax.tree.map(lambda p, g: p - P.LR * g, params, grads), total / P.M


def first_call(fn: Callable, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def bench(width: int, schedule: str, n: int, repeats: int) -> dict[str, Any]:
    cfg = P.Config(STAGES, width, schedule)
    S = STAGES
    mmesh = mm.make_mesh((S,), ("stage",), devices=jax.devices()[:S])
    step = P.make_step(cfg)
    hp, hx, hy = P.init(cfg)
    mm_step = mm.jit(step, mesh=mmesh)
    on = [NamedSharding(mmesh.submesh(i), PartitionSpec()) for i in range(S)]
    x_mm, y_mm = jax.device_put(hx, on[0]), jax.device_put(hy, on[S - 1])
    p_mm = [jax.device_put(ws, on[i % S]) for i, ws in enumerate(hp)]
    (p_mm, v_mm), t_first_mm = first_call(mm_step, p_mm, x_mm, y_mm)

    dev0 = jax.devices()[0]
    one = Mesh(np.array([dev0]), ("stage",), axis_types=(jax.sharding.AxisType.Auto,))

    @contextlib.contextmanager
    def on_one_device() -> Iterator[None]:  # tasks with stage= need the MultiMesh
        with mmesh, jax.set_mesh(one):
            yield

    # a fresh function object: jax.jit's cache is per function, so no config reuses
    # another's compile
    jax_step, unr_step = jax.jit(step), jax.jit(functools.partial(unrolled_step))
    x_j, y_j = jax.device_put(hx, dev0), jax.device_put(hy, dev0)
    with on_one_device():
        (p_j, v_j), t_first_jax = first_call(jax_step, jax.device_put(hp, dev0), x_j, y_j)
        (p_u, _v), t_first_unr = first_call(unr_step, jax.device_put(hp, dev0), x_j, y_j)
    got = [np.asarray(a) for a in jax.tree.leaves((v_mm, p_mm))]
    want = [np.asarray(a) for a in jax.tree.leaves((v_j, p_j))]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want, strict=True))

    for _ in range(3):
        p_mm, _v = mm_step(p_mm, x_mm, y_mm)
        with on_one_device():
            p_j, _v = jax_step(p_j, x_j, y_j)
            p_u, _v = unr_step(p_u, x_j, y_j)
    jax.block_until_ready((p_mm, p_j, p_u))
    t: dict[str, list[float]] = {k: [] for k in ("mm", "mm_ret", "scan", "scan_ret", "unr")}
    for r in range(repeats):
        order = ("mm", "scan", "unr") if r % 2 == 0 else ("unr", "scan", "mm")
        for which in order:
            if which == "mm":
                p_mm, a, b = P.run_steps(mm_step, p_mm, x_mm, y_mm, n)
                t["mm"].append(a), t["mm_ret"].append(b)
            elif which == "scan":
                with on_one_device():
                    p_j, a, b = P.run_steps(jax_step, p_j, x_j, y_j, n)
                t["scan"].append(a), t["scan_ret"].append(b)
            else:
                with on_one_device():
                    p_u, a, _b = P.run_steps(unr_step, p_u, x_j, y_j, n)
                t["unr"].append(a)
    us = {k: statistics.median(v) * 1e6 for k, v in t.items()}
    compiled = list(mm_step._cache.values())[-1]  # noqa: SLF001
    frags = len(compiled.plan.fragments)
    return {
        "width": width,
        "schedule": schedule,
        "fragments": frags,
        "executables": compiled.num_executables,
        "max_abs_diff_vs_jax": diff,
        "mm_step_us": round(us["mm"], 1),
        "mm_return_us": round(us["mm_ret"], 1),
        "return_ratio": round(us["mm_ret"] / us["mm"], 3),
        "scan_step_us": round(us["scan"], 1),
        "scan_return_us": round(us["scan_ret"], 1),
        "unrolled_step_us": round(us["unr"], 1),
        "mm_vs_scan": round(us["mm"] / us["scan"], 3),
        "mm_vs_unrolled": round(us["mm"] / us["unr"], 3),
        "overhead_per_fragment_us": {
            "scan": round((us["mm"] - us["scan"]) / frags, 1),
            "unrolled": round((us["mm"] - us["unr"]) / frags, 1),
        },
        "first_call_s": {
            "mm": round(t_first_mm, 3),
            "scan": round(t_first_jax, 3),
            "unrolled": round(t_first_unr, 3),
        },
        "first_call_vs_scan": round(t_first_mm / t_first_jax, 2),
        "step_us_per_repeat": {k: [round(v * 1e6, 1) for v in vs] for k, vs in t.items()},
    }


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 14's goals next to the measured values."""
    by = {(r["width"], r["schedule"]): r for r in rows}
    out = []

    def add(name: str, value: float, limit: float) -> None:
        out.append({"target": name, "value": value, "limit": limit, "met": value <= limit})

    for w, step_limit, ret_limit in ((256, 1.2, 0.5), (1024, 1.0, 0.3)):
        r = by.get((w, "1f1b"))
        if r is None:
            continue
        add(f"1f1b step vs jax.jit (scan), width {w}", r["mm_vs_scan"], step_limit)
        add(f"1f1b call return / step, width {w}", r["return_ratio"], ret_limit)
        add(f"1f1b overhead per fragment (us), width {w}", r["overhead_per_fragment_us"]["scan"], 30)
        add(f"1f1b first call vs jax.jit, width {w}", r["first_call_vs_scan"], 1.5)
        il = by.get((w, "interleaved-1f1b"))
        if il is not None:
            # each schedule against the jax.jit step timed in its own repeats (the same
            # program for every schedule): this machine's speed drifts between configs
            add(
                f"interleaved vs 1f1b step (each vs its jax.jit scan), width {w}",
                round(il["mm_vs_scan"] / r["mm_vs_scan"], 3),
                1.2,
            )
    return out


def warm_up() -> None:
    """Pay the process's one-time costs (backend, compiler and tracing start-up) before
    the first configuration, so its first-call times compare like the others'."""
    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])

    def f(x: Any) -> Any:
        with mm.task("a", stage=0):
            y = jnp.tanh(x @ x)
        with mm.task("b", stage=1):
            return jnp.sum(y * 2)

    x = np.ones((4, 4), np.float32)
    jax.block_until_ready(jax.jit(jax.grad(lambda x: jnp.sum(jnp.tanh(x @ x))))(x))
    jax.block_until_ready(mm.jit(jax.grad(f), mesh=mesh)(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps (a smoke test, < 60 s)")
    ap.add_argument("--widths", type=int, nargs="*", default=[256, 1024])
    ap.add_argument("--schedules", nargs="*", default=SCHEDULES, choices=SCHEDULES)
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 7)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    repeats = args.repeats or (2 if args.quick else 7)
    out = _common.environment("step", args.quick)
    out["loadavg_start"] = list(os.getloadavg())
    warm_up()
    rows = []
    for w in args.widths:
        n = 3 if args.quick else (40 if w <= 256 else 12)
        for s in args.schedules:
            r = bench(w, s, n, repeats)
            rows.append(r)
            print(
                f"w{w} {s:17s} mm {r['mm_step_us'] / 1e3:7.2f} ms "
                f"(returns at {r['return_ratio']:.0%})  scan {r['scan_step_us'] / 1e3:7.2f}  "
                f"unrolled {r['unrolled_step_us'] / 1e3:7.2f}  vs scan {r['mm_vs_scan']:.3f}  "
                f"vs unrolled {r['mm_vs_unrolled']:.3f}  frag overhead "
                f"{r['overhead_per_fragment_us']['scan']:6.1f} us  first call "
                f"{r['first_call_vs_scan']:.1f}x  diff {r['max_abs_diff_vs_jax']:.1e}",
                flush=True,
            )
    out["configs"] = rows
    by = {(r["width"], r["schedule"]): r for r in rows}
    out["interleaved_vs_1f1b"] = {
        str(w): {
            "raw_ratio": round(by[w, "interleaved-1f1b"]["mm_step_us"] / by[w, "1f1b"]["mm_step_us"], 3),
            "own_scan_ratio": round(
                by[w, "interleaved-1f1b"]["mm_vs_scan"] / by[w, "1f1b"]["mm_vs_scan"], 3
            ),
        }
        for w in args.widths
        if (w, "1f1b") in by and (w, "interleaved-1f1b") in by
    }
    out["targets"] = targets(rows)
    out["loadavg_end"] = list(os.getloadavg())
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    for tg in out["targets"]:
        print(f"  {'met ' if tg['met'] else 'MISS'} {tg['target']}: {tg['value']} (<= {tg['limit']})")
    _common.write_results(out, args.out)


if __name__ == "__main__":
    main()
