"""``multimesh-run --model gpt``: MultiMesh's own GPT (``multimesh.examples.gpt``, Flax
NNX) on synthetic token data, on a (pp, dp, fsdp, tp) MultiMesh."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from multimesh import _compat

_compat.register_exclusion(__file__)


def synthetic_tokens(batch: int, seq: int, vocab: int, seed: int) -> np.ndarray:
    """Sequences with structure to learn (each token is the previous plus one), the same
    on every process."""
    start = np.random.default_rng(seed).integers(0, vocab, size=(batch, 1))
    return ((start + np.arange(seq)[None]) % vocab).astype(np.int32)


def model_flops(params: Any, cfg: Any, tokens: int) -> float:
    """6 N T for the dense weights plus the attention score/value products (fwd + bwd)."""
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    n -= cfg.vocab * cfg.d + cfg.seq * cfg.d  # embeddings are lookups
    return 6.0 * n * tokens + 12.0 * cfg.layers * cfg.d * cfg.seq * tokens


def run(ns: argparse.Namespace) -> int:
    import optax
    from flax import nnx

    import multimesh as mm
    from multimesh.examples import gpt as G
    from multimesh.run import report

    rank0 = jax.process_index() == 0
    cfg = G.Config(
        vocab=ns.vocab_size,
        seq=ns.sequence_length,
        d=ns.model_dims,
        heads=ns.num_heads,
        layers=ns.num_layers,
        stages=ns.pp * ns.interleave,
        tp=ns.tp > 1,
        dp=ns.dp * ns.fsdp > 1,
        fsdp=ns.fsdp > 1,
        remat=ns.remat,
        tied=ns.tied_embeddings,
        mlp=ns.mlp_dims or 0,
        batch_axes=("data", "fsdp"),
        fsdp_axis="fsdp",
    )
    mmesh = mm.make_mesh((ns.pp, ns.dp, ns.fsdp, ns.tp), ("stage", "data", "fsdp", "model"))
    if rank0:
        print(
            f"multimesh-run: GPT {cfg.layers} layers x {cfg.d} wide, {jax.device_count()} "
            f"{jax.devices()[0].platform} devices: pp={ns.pp} (x{ns.interleave} interleaved) "
            f"tp={ns.tp} dp={ns.dp} fsdp={ns.fsdp}, {ns.schedule}, {ns.num_microbatches} "
            f"microbatches of {ns.batch_size // ns.num_microbatches}"
        )
        print(mm.distributed.process_map(mmesh))
    model = mm.flax.create(lambda k: G.GPT(cfg, nnx.Rngs(k)), jax.random.key(ns.seed), mesh=mmesh)
    opt = optax.adamw(ns.learning_rate)
    step, state = G.nnx_train_step(cfg, model, opt, ns.num_microbatches, ns.schedule)
    manager, start = None, 0
    if ns.checkpoint_dir:
        manager = mm.checkpoint.CheckpointManager(ns.checkpoint_dir, max_to_keep=ns.max_to_keep)
        latest = manager.latest_step() if ns.resume else None
        if latest is not None:
            try:
                state = manager.restore(latest, target=state)  # onto this run's submeshes
            except ValueError as e:
                print(
                    f"multimesh-run: error: the checkpoint at step {latest} in "
                    f"{ns.checkpoint_dir} does not fit this model or cannot be read (was "
                    "it saved with other --num-layers/--model-dims/--num-heads/--mlp-dims/"
                    "--vocab-size/--tied-embeddings? --num-layers defaults to --pp x "
                    "--interleave; or is the step damaged?): "
                    f"{str(e).splitlines()[0][:300]}",
                    file=sys.stderr,
                )
                return 2
            start = latest
        if rank0 and ns.resume:
            print(
                f"multimesh-run: resuming at step {start} from {ns.checkpoint_dir}"
                if latest is not None
                else f"multimesh-run: no checkpoint in {ns.checkpoint_dir}; starting at step 0"
            )
        if start >= ns.num_steps and rank0:
            print(f"multimesh-run: step {start} reached --num-steps {ns.num_steps}: nothing to do")
    every = ns.checkpoint_every or ns.num_steps
    host_state = None
    if ns.compare_spmd:
        # (in multi-process runs an array is served to other processes once an mm.jit
        # call returned it; the optimizer state was made eagerly)
        host_state = mm.distributed.to_host(mm.jit(lambda s: s, mesh=mmesh)(state))
    # the state comes back where it went in: the next step runs the same program (XLA
    # may otherwise pick other layouts for some leaves, e.g. TP-shard a replicated one,
    # and the second step would compile again for them)
    # (one process only: across processes a leaf the step makes on another submesh than
    # the one it came from could not be moved to it, and the recompile is the lesser cost)
    out_sh = None
    if jax.process_count() == 1:
        state = jax.tree.map(_named, state)
        out_sh = (jax.tree.map(lambda x: x.sharding, state), None)
    f = mm.jit(step, mesh=mmesh, donate_argnums=0, out_shardings=out_sh)
    batches = [
        synthetic_tokens(ns.batch_size, ns.sequence_length, ns.vocab_size, ns.seed + 1 + i)
        for i in range(ns.num_steps)
    ]
    tokens_per_step = ns.batch_size * ns.sequence_length
    flops = model_flops(state[0], cfg, tokens_per_step)
    bar = report.progress(ns.num_steps, not ns.no_progress, "training", initial=start)
    steps = range(start, ns.num_steps)
    losses, times = [], []
    for i in steps:
        t0 = time.perf_counter()
        state, loss = f(state, batches[i])
        value = float(mm.distributed.to_host(loss))
        times.append(time.perf_counter() - t0)
        losses.append(value)
        bar.update(1)
        bar.set_postfix(loss=f"{value:.4f}", step_ms=f"{times[-1] * 1e3:.0f}")
        if manager is not None and ((i + 1) % every == 0 or i + 1 == ns.num_steps):
            manager.save(i + 1, state)  # asynchronous: the next step runs while it writes
    bar.close()
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    if not losses:
        if rank0 and ns.metrics:
            write_metrics(ns, start, losses, times)
        return 0
    extra: list[tuple[str, str]] = []
    code, worst = 0, 0.0
    if ns.compare_spmd:
        ref = jax.jit(step)
        ref_state = host_state
        with mmesh:
            for k, i in enumerate(steps):
                ref_state, ref_loss = ref(ref_state, batches[i])
                a, b = float(mm.distributed.to_host(ref_loss)), losses[k]
                # a NaN or inf on either side is a failure, not a match
                diff = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
                worst = max(worst, diff)
        ok = worst <= ns.tolerance
        extra.append(
            (
                "largest loss difference vs SPMD",
                f"{worst:.3e} ({'ok' if ok else 'FAILED'}, tolerance {ns.tolerance:g})",
            )
        )
        code = 0 if ok else 1
    if ns.dump:
        extra += dump(ns, f, state, batches[-1], mmesh)
    if rank0 and ns.metrics:
        write_metrics(ns, start, losses, times)
    if rank0:
        print(report.summary(times, tokens_per_step, flops, losses, extra))
        if code:
            print(
                "multimesh-run: a loss is not finite (NaN or inf)"
                if not math.isfinite(worst)
                else "multimesh-run: the MPMD losses differ from plain jax.jit SPMD by more "
                f"than --tolerance {ns.tolerance:g}"
            )
    return code


def _named(x: Any) -> Any:
    """A one-device leaf (an optimizer's step count) with a ``NamedSharding``, as the
    step returns it: the same layout in and out, one program."""
    sh = x.sharding
    if not _compat.is_single_device_sharding(sh):
        return x
    (d,) = sh.device_set
    mesh = jax.sharding.Mesh(np.array([d]), ("device",))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def write_metrics(ns: argparse.Namespace, start: int, losses: list, times: list) -> None:
    """``--metrics``: the losses, step times and settings as JSON."""
    import json

    def finite(x: Any) -> Any:  # strict JSON has no NaN / Infinity: null instead
        return x if not isinstance(x, float) or math.isfinite(x) else None

    with open(ns.metrics, "w") as fh:
        json.dump(
            {
                "first_step": start,
                "losses": [finite(v) for v in losses],
                "step_times_s": times,
                "settings": vars(ns),
            },
            fh,
            indent=1,
            default=str,
            allow_nan=False,
        )


def dump(ns: argparse.Namespace, f: Any, state: Any, batch: Any, mmesh: Any) -> list:
    """The plan text, simulated and measured Gantt charts, and a Perfetto trace."""
    import multimesh as mm

    out = ns.dump
    os.makedirs(out, exist_ok=True)
    lowered = f.lower(state, batch)
    with open(os.path.join(out, "plan.txt"), "w") as fh:
        fh.write(lowered.as_text() + "\n")
    sched = mm.schedules.get(ns.schedule)
    if ns.interleave > 1 or ns.schedule == "interleaved-1f1b":  # as many chunks as run
        sched = mm.schedules.Interleaved1F1B(num_chunks=ns.interleave)
    sim = mm.schedules.simulate(sched, ns.pp, ns.num_microbatches)
    wrote = ["plan.txt"]
    if jax.process_index() == 0:
        sim.plot(os.path.join(out, "simulated.png"))
        wrote.append("simulated.png")
    if jax.process_count() == 1:
        _, tl = f.record(state, batch)
        tl.plot(os.path.join(out, "measured.png"))
        tl.to_chrome_trace(os.path.join(out, "trace.json"))
        wrote += ["measured.png", "trace.json (ui.perfetto.dev)"]
    else:
        wrote.append("(measured timeline: single-process runs only)")
    return [("dumped to " + out, ", ".join(wrote))]
