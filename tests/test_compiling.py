"""Fragments compile on a thread pool: same executables and bits as compiling one by one."""

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import stage_of
from jax.ad_checkpoint import checkpoint_name

import multimesh as mm
from multimesh.runtime import compiling


@pytest.fixture(autouse=True)
def _no_sharing_between_jits(monkeypatch):
    """These tests compare ways of compiling (threads, relocation, caches) across mm.jit
    objects: each compiles its own (sharing has its own tests below)."""
    monkeypatch.setenv("MULTIMESH_SHARED_EXECUTABLES", "0")


def loss(ws, x):
    """Four residual tanh layers, one task (stage) each."""
    h = x
    for i, w in enumerate(ws):
        with mm.task(f"s{i}", stage=i):
            h = h + jnp.tanh(h @ w)
    return jnp.mean(h**2)


def pipeline_step(schedule: str, reduce: str = "sum"):
    def step(ws, x):
        vg = jax.value_and_grad(loss)
        v, g = mm.microbatch(vg, 4, argnums=1, schedule=schedule, reduce=reduce)(ws, x)
        return [w - 0.1 * d for w, d in zip(ws, g)], v

    return step


def one_device_pipeline(seed: int, reduce: str = "sum"):
    """``pipeline_step("1f1b", reduce)`` with its arguments, on four one-device submeshes."""
    rng = np.random.default_rng(seed)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(4)]
    x = rng.normal(size=(8, 8)).astype(np.float32)
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    return pipeline_step("1f1b", reduce), ws, x, mesh


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_parallel_compile_equals_serial_and_reference(schedule, mesh4x2, monkeypatch):
    step = pipeline_step(schedule)
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(4)]
    x = rng.normal(size=(8, 8)).astype(np.float32)
    ref = jax.jit(step)(ws, x)
    got = {}
    for threads in ("1", "4"):
        monkeypatch.setenv("MULTIMESH_COMPILE_THREADS", threads)
        c = mm.jit(step, mesh=mesh4x2).lower(ws, x).compile()
        got[threads] = (
            c(ws, x),
            c.plan.as_text(),
            len(c.fragments),
            len(set(map(id, c.fragments))),
        )
    out1, text1, n1, distinct1 = got["1"]
    out4, text4, n4, distinct4 = got["4"]
    assert text1 == text4 and n1 == n4 and distinct1 == distinct4
    assert distinct4 < n4  # identical microbatch fragments still share executables
    for a, b, r in zip(jax.tree.leaves(out1), jax.tree.leaves(out4), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(b), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_compile_errors_come_from_the_failing_fragment(mesh4x2, monkeypatch):
    """The first failing fragment's error, as with one-by-one compiles."""
    monkeypatch.setenv("MULTIMESH_COMPILE_THREADS", "4")

    def f(x):
        with mm.task("a", stage=0):
            y = x * 2
        with mm.task("b", stage=1):
            jax.debug.print("y {}", y.sum(), ordered=True)
            return y + 1

    with pytest.raises(ValueError, match="fragment .*ordered effects"):
        mm.jit(f, mesh=mesh4x2)(jnp.ones(4))


def test_bad_thread_count_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MULTIMESH_COMPILE_THREADS", "many")
    with pytest.raises(ValueError, match="MULTIMESH_COMPILE_THREADS='many'"):
        compiling.num_threads()
    monkeypatch.setenv("MULTIMESH_COMPILE_THREADS", "0")
    assert compiling.num_threads() == 1


def test_processes_on_one_host_share_its_compile_threads(monkeypatch):
    """Several processes of one job on a host split its CPUs between their compile
    pools; the launcher, Open MPI, MPICH and SLURM say how many share the host."""
    from multimesh.distributed._init import local_process_count

    monkeypatch.delenv("MULTIMESH_COMPILE_THREADS", raising=False)
    for key in ("MULTIMESH_LOCAL_PROCESSES", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert local_process_count() == 1
    assert compiling.num_threads(local_process_count()) == 8  # at most 8
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert compiling.num_threads(local_process_count()) == 4
    monkeypatch.setenv("MULTIMESH_LOCAL_PROCESSES", "8")  # the launcher's, first
    assert compiling.num_threads(local_process_count()) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert compiling.num_threads(local_process_count()) == 1
    monkeypatch.setenv("MULTIMESH_COMPILE_THREADS", "3")  # the user's choice wins
    assert compiling.num_threads(local_process_count()) == 3
    monkeypatch.delenv("MULTIMESH_LOCAL_PROCESSES")
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    assert local_process_count() == 2


def test_compile_once_builds_a_shared_key_once():
    cache: dict = {}
    calls = []

    def build():
        calls.append(1)
        time.sleep(0.05)
        return object()

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(compiling.compile_once(cache, "k", build)))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1 and cache["k"] is results[0]

    def boom():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        compiling.compile_once(cache, "bad", boom)
    assert "bad" not in cache  # a failed build is not cached: the next attempt retries


def test_pending_values_and_jobs_in_order():
    jobs = compiling.Jobs(3)
    first = jobs.submit(lambda: {"a": 1})
    lazy = compiling.LazyDict(x=first.derive(lambda r: r["a"]))
    second = jobs.submit(lambda: lazy["x"] + 1)  # waits for the first job
    jobs.wait()
    assert second.get() == 2 and lazy.resolved() == {"x": 1}
    jobs = compiling.Jobs(2)

    def slow_failure():
        time.sleep(0.1)
        raise ZeroDivisionError("first")

    def fast_failure():
        raise KeyError("second")

    jobs.submit(slow_failure)
    jobs.submit(fast_failure)  # fails sooner, but later in plan order
    with pytest.raises(ZeroDivisionError, match="first"):
        jobs.wait()


def test_one_device_stages_compile_without_waiting_for_their_producers(monkeypatch):
    """On one-device submeshes a fragment's output layout is fixed before it compiles, so
    a consumer's compile does not wait for its producer's: two compiles run at once."""
    from multimesh.runtime import executor

    monkeypatch.setenv("MULTIMESH_COMPILE_THREADS", "2")
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    both = threading.Barrier(2, timeout=20)
    met = []
    real = executor._compile

    def compile_meeting(*a, **k):
        if not met:
            try:
                both.wait()  # the first two compiles must be in flight together
                met.append(True)
            except threading.BrokenBarrierError:
                met.append(False)
        return real(*a, **k)

    monkeypatch.setattr(executor, "_compile", compile_meeting)

    def f(x):
        with mm.task("a", stage=0):
            y = jnp.sin(x) * 2
        with mm.task("b", stage=1):
            return jnp.cos(y) + 1

    x = np.linspace(0, 1, 8, dtype=np.float32)
    out = mm.jit(f, mesh=mesh)(x)
    assert met and met[0], "the consumer's compile waited for its producer's"
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(f)(x)))
    assert out.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(mesh.submesh(1), jax.sharding.PartitionSpec()), 1
    )


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_folded_dispatch_loop_equals_step_by_step(schedule):
    """The call loop folds each same-layout transfer into its producer's step; running
    the unfolded steps one by one (as record() does) gives the same bits."""
    n = 2 if schedule == "interleaved-1f1b" else 4  # 4 task stages: 2 per device or 1
    mesh = mm.make_mesh((n,), ("stage",), devices=jax.devices()[:n])
    step = pipeline_step(schedule)
    rng = np.random.default_rng(1)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(4)]
    x = rng.normal(size=(8, 8)).astype(np.float32)
    c = mm.jit(step, mesh=mesh).lower(ws, x).compile()
    exe = c._exe
    assert len(exe._loop) < len(exe._steps)  # transfers were folded
    folded = c(ws, x)
    unfolded, _timeline = c.record(ws, x)  # runs the unfolded steps
    for a, b in zip(jax.tree.leaves(folded), jax.tree.leaves(unfolded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(folded), jax.tree.leaves(jax.jit(step)(ws, x))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_replicated_stages_compile_without_waiting_for_their_producers(monkeypatch):
    """On multi-device submeshes, a fragment whose inputs are replicated and which names
    no sharding makes replicated outputs: fixed before it compiles, so its consumer (on
    another submesh) compiles at the same time as it does."""
    from multimesh.runtime import executor

    monkeypatch.setenv("MULTIMESH_COMPILE_THREADS", "2")
    mesh = mm.make_mesh((2, 2), ("stage", "data"), devices=jax.devices()[:4])
    consumer_started = threading.Event()
    waited: list[bool] = []
    real = executor._compile

    def compile_spy(body, in_sh, out_sh, donate, avals, options, info, mesh_):
        if info.tasks == ("b",):
            consumer_started.set()
        elif info.tasks == ("a",):
            waited.append(consumer_started.wait(timeout=20))  # the producer's compile
        return real(body, in_sh, out_sh, donate, avals, options, info, mesh_)

    monkeypatch.setattr(executor, "_compile", compile_spy)

    def f(w, x):
        with mm.task("a", stage=0):
            y = jnp.tanh(x @ w)
        with mm.task("b", stage=1):
            return jnp.cos(y @ w).sum(0)

    rng = np.random.default_rng(1)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    x = rng.normal(size=(4, 8)).astype(np.float32)
    out = mm.jit(f, mesh=mesh)(w, x)
    assert waited == [True], "the consumer's compile waited for its producer's"
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(f)(w, x)), rtol=1e-6)
    assert out.sharding.is_fully_replicated


def test_outputs_replicated_only_when_nothing_is_sharded():
    mesh = mm.make_mesh((2, 2), ("stage", "data"), devices=jax.devices()[:4]).submesh(0)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.ShapeDtypeStruct((4, 4), jnp.float32)

    def jaxpr(fn):
        return jax.make_jaxpr(fn)(x).jaxpr

    plain = jaxpr(lambda a: jax.jit(jnp.sin)(a) @ a)  # a nested jit names only its ctx mesh
    assert compiling.outputs_replicated([rep], mesh, plain, [x])
    assert not compiling.outputs_replicated([row], mesh, plain, [x])  # a sharded input
    assert not compiling.outputs_replicated([compiling.Pending(None)], mesh, plain, [x])
    assert not compiling.outputs_replicated([], mesh, plain, [x])  # no inputs: no layout
    constrained = jaxpr(lambda a: jax.lax.with_sharding_constraint(a * 2, row))
    assert not compiling.outputs_replicated([rep], mesh, constrained, [x])
    replicate = jaxpr(lambda a: jax.lax.with_sharding_constraint(a * 2, rep))
    assert compiling.outputs_replicated([rep], mesh, replicate, [x])
    mapped = jaxpr(
        jax.shard_map(
            lambda a: a * jax.lax.axis_index("data"),
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec(),
            out_specs=jax.sharding.PartitionSpec("data"),
        )
    )
    assert not compiling.outputs_replicated([rep], mesh, mapped, [x])
    other = mm.make_mesh((2, 2), ("stage", "data"), devices=jax.devices()[:4]).submesh(1)
    on_other = jax.sharding.NamedSharding(other, jax.sharding.PartitionSpec())
    assert not compiling.outputs_replicated([on_other], mesh, plain, [x])


def test_submit_after_runs_once_its_dependency_is_done():
    jobs = compiling.Jobs(2)
    gate = threading.Event()
    order: list[str] = []

    def first():
        gate.wait(timeout=20)
        order.append("first")
        return 1

    dep = jobs.submit(first)
    after = jobs.submit_after(dep, lambda: order.append("after") or 2)
    other = jobs.submit(lambda: order.append("other") or 3)  # not held up by `after`
    other._future.result(timeout=20)
    gate.set()
    jobs.wait()
    assert order == ["other", "first", "after"]
    assert (dep.get(), after.get(), other.get()) == (1, 2, 3)
    # a failed dependency still runs the job (it decides what to do); errors in order
    jobs = compiling.Jobs(2)
    bad = jobs.submit(lambda: 1 / 0)
    ran = jobs.submit_after(bad, lambda: "ran")
    assert ran._future.result(timeout=20) == "ran"
    with pytest.raises(ZeroDivisionError):
        jobs.wait()


def test_an_error_with_jobs_queued_behind_others_does_not_hang():
    """A compile error (or Ctrl-C) while jobs wait in the queue with ``submit_after``
    jobs behind them: closing the pool cancelled the queued job, whose callback
    submitted to the pool inside its shutdown lock, in the same thread: a hang (a probe
    saw it in 2 of 6 runs of a 1F1B compile with a bad compiler option)."""
    jobs = compiling.Jobs(2)
    release = threading.Event()

    def fail():
        time.sleep(0.2)
        raise ValueError("bad option")

    jobs.submit(fail)
    jobs.submit(lambda: release.wait(timeout=20))  # holds the second thread
    jobs.submit(lambda: release.wait(timeout=20))  # then the first, once it has failed
    queued = jobs.submit(lambda: "queued")  # waits for a thread: cancelled by close()
    jobs.submit_after(queued, lambda: "after")
    errors: list[BaseException] = []

    def run():
        try:
            jobs.wait()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(1.0)
    release.set()
    t.join(timeout=20)
    assert not t.is_alive(), "Jobs.wait() hung"
    assert errors and isinstance(errors[0], ValueError)


def tp_step(ws, x, act=jnp.tanh):
    """Four stages, each a tensor-parallel pair of layers on a (2,)-device submesh."""

    def loss(ws, x):
        h = x
        for i, (a, b) in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                a = jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec(None, "model"))
                b = jax.lax.with_sharding_constraint(b, jax.sharding.PartitionSpec("model", None))
                h = h + act(act(h @ a) @ b)
        return jnp.mean(h**2)

    v, g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1)(ws, x)
    return jax.tree.map(lambda w, d: w - 0.1 * d, ws, g), v


def test_same_program_on_other_submeshes_is_relocated_not_recompiled():
    """Stages with identical programs compile once; the others load that executable for
    their devices (collectives included) and compute the same values as jax.jit."""
    mesh = mm.make_mesh((4, 2), ("stage", "model"))
    rng = np.random.default_rng(0)
    ws = [tuple(rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(2)) for _ in range(4)]
    x = rng.normal(size=(8, 8)).astype(np.float32)
    with mesh:  # the reference: plain jax.jit on the global mesh
        ref = jax.jit(tp_step)(ws, x)
    c = mm.jit(tp_step, mesh=mesh).lower(ws, x).compile()
    stats = c.compile_stats
    assert stats["relocated"] >= 4, stats  # forward, backward and update of middle stages
    assert stats["compiled"] + stats["relocated"] == c.num_executables
    for info, frag in zip(c.plan.fragments, c.fragments):
        shardings = jax.tree.leaves((frag.input_shardings, frag.output_shardings))
        devs = {d.id for sh in shardings for d in sh.device_set}
        assert devs == {d.id for d in mesh.submesh(info.stage).devices.flat}, info.name
    out = c(ws, x)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-6)
    # and the relocated executables report XLA's analyses like compiled ones
    assert c.cost_analysis().per_submesh[1] == c.cost_analysis().per_submesh[2]
    assert c.memory_analysis() is not None


@jax.jit
def _nested_act(h):
    return jnp.tanh(h)


def nested_jit_step(ws, x):
    """``tp_step`` whose layers call a nested ``jax.jit`` (its ``ctx_mesh`` parameter is
    each stage's submesh once placed; ``jnp.take``, ``jnp.where``, ``jnp.tril`` are such
    jits)."""
    return tp_step(ws, x, act=_nested_act)


def test_nested_jit_on_other_submeshes_is_relocated():
    """A nested jit names its submesh's mesh (a callable object): keyed by its text and
    devices as other meshes are, not by identity, so stages with identical programs
    still share one compile (each stage compiled its own: 17 compiles instead of 11 for
    the GPT example)."""
    mesh = mm.make_mesh((4, 2), ("stage", "model"))
    rng = np.random.default_rng(0)
    ws = [tuple(rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(2)) for _ in range(4)]
    x = rng.normal(size=(8, 8)).astype(np.float32)
    with mesh:
        ref = jax.jit(nested_jit_step)(ws, x)
    c = mm.jit(nested_jit_step, mesh=mesh).lower(ws, x).compile()
    plain = mm.jit(tp_step, mesh=mesh).lower(ws, x).compile()  # the same without nesting
    assert c.compile_stats == plain.compile_stats, (c.compile_stats, plain.compile_stats)
    out = c(ws, x)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_microbatch_zero_shares_the_other_microbatches_executables():
    """Gradient accumulation starts from zeros made before the loop, so microbatch 0's
    fragments are the same programs as the others' (no extra compile per stage); the
    last stage's loss and update, independent work after the loop, are one fragment."""
    step, ws, x, mesh = one_device_pipeline(1, reduce="mean")  # the loss is divided by M
    c = mm.jit(step, mesh=mesh).lower(ws, x).compile()
    by_name = dict(zip((f.name for f in c.plan.fragments), c.fragments))
    loop = [f for f in c.plan.fragments if ":" in f.name]  # "s<stage>:<actions>"
    kinds: dict[str, set[int]] = {}
    for f in loop:  # "s3:F2+B2" -> "s3:F+B"
        kind = (
            f.name.split(":")[0]
            + ":"
            + "".join(ch for ch in f.name.split(":")[1] if not ch.isdigit())
        )
        kinds.setdefault(kind, set()).add(id(by_name[f.name]))
    assert len(kinds) >= 5 and all(len(ids) == 1 for ids in kinds.values()), kinds
    outside = [f.name for f in c.plan.fragments if f.stage == 3 and ":" not in f.name]
    assert outside == ["stage3", "stage3#1"], outside  # before the loop, after it
    out = c(ws, x)
    ref = jax.jit(step)(ws, x)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def test_work_no_loop_needs_runs_after_the_loop():
    """An optimizer's gradient-free arithmetic (the momentum decay ``0.9 * m``) runs after
    the microbatch loop with the update it feeds, not before it: the fragments before
    the loop only make what the loop needs (zeros; the host cuts the microbatches)."""

    def step(ws, ms, x):
        v, g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1)(ws, x)
        ms = [0.9 * m + d for m, d in zip(ms, g)]
        return [w - 0.1 * m for w, m in zip(ws, ms)], ms, v

    _, ws, x, mesh = one_device_pipeline(5)
    ms = [np.full_like(w, 0.5) for w in ws]
    c = mm.jit(step, mesh=mesh).lower(ws, ms, x).compile()
    first = {}
    for info, frag in zip(c.plan.fragments, c.fragments):
        first.setdefault(info.stage, (info, frag))
    for info, frag in first.values():
        assert not info.tasks, info.name  # the pre-loop fragment
        n_in = len(jax.tree.leaves(frag.input_shardings))
        assert n_in == 0, (info.name, n_in)  # zeros only: no m (x is cut on the host)
    out = c(ws, ms, x)
    ref = jax.jit(step)(ws, ms, x)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def test_work_another_stage_needs_is_sent_before_the_loop():
    """Loop-independent work whose result another stage uses stays before the loop, so
    that stage need not wait for this one's loop to end."""

    def step(ws, x, lr):
        with mm.task("rate", stage=0):
            rate = jnp.tanh(lr) * 0.5
        v, g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1)(ws, x)
        with mm.task("update", stage=3):
            last = ws[3] - rate * g[3]
        return [w - 0.1 * d for w, d in zip(ws[:3], g[:3])] + [last], v

    _, ws, x, mesh = one_device_pipeline(6)
    lr = np.float32(0.3)
    c = mm.jit(step, mesh=mesh).lower(ws, x, lr).compile()
    names = [info.name for info in c.plan.fragments]
    rate = next(k for k, n in enumerate(names) if "rate" in n)
    assert rate < names.index("s0:F0"), names
    out = c(ws, x, lr)
    ref = jax.jit(step)(ws, x, lr)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def test_device_free_keys():
    d = jax.devices()
    m01 = jax.sharding.Mesh(np.array(d[0:2]), ("x",))
    m23 = jax.sharding.Mesh(np.array(d[2:4]), ("x",))
    m32 = jax.sharding.Mesh(np.array([d[3], d[2]]), ("x",))
    ns = jax.sharding.NamedSharding
    P = jax.sharding.PartitionSpec
    k01 = compiling.device_free_key(m01, (m01, ns(m01, P("x")), d[1]))
    k23 = compiling.device_free_key(m23, (m23, ns(m23, P("x")), d[3]))
    assert k01 == k23
    assert compiling.device_free_key(m23, (m23, ns(m23, P()), d[3])) != k01
    assert compiling.device_free_key(m23, (m23, ns(m32, P("x")), d[3])) != k01  # order
    assert compiling.device_free_key(m23, (ns(m01, P("x")),)) is None  # foreign devices
    one = jax.sharding.SingleDeviceSharding
    assert compiling.device_free_key(m23, (one(d[2]),)) == compiling.device_free_key(
        m01, (one(d[0]),)
    )
    assert compiling.device_free_key(m23, (object(),)) is None  # unknown placement kinds


def test_callbacks_are_compiled_not_relocated():
    """An executable with a host callback cannot be moved: it is compiled for each
    submesh, and every callback still runs."""
    seen = []

    def f(x):
        for i in range(2):
            with mm.task(f"s{i}", stage=i):
                x = x * 2
                jax.debug.callback(lambda v, i=i: seen.append((i, float(v))), x.sum())
        return x

    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    c = mm.jit(f, mesh=mesh).lower(jnp.ones(4)).compile()
    assert c.compile_stats["relocated"] == 0
    out = c(jnp.ones(4))
    jax.block_until_ready(out)
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(out), np.full(4, 4.0))
    assert sorted(seen) == [(0, 8.0), (1, 16.0)]


_CACHED_RUN = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
import multimesh as mm
from jax.ad_checkpoint import checkpoint_name
sys.path.insert(0, sys.argv[1])
from test_compiling import one_device_pipeline

if sys.argv[2] == "turned-off":  # JAX decided at its first compile: it keeps the cache
    jax.jit(lambda a: a + 1)(1.0)
    jax.config.update("jax_compilation_cache_dir", None)
step, ws, x, mesh = one_device_pipeline(2)
c = mm.jit(step, mesh=mesh).lower(ws, x).compile()
out, ref = c(ws, x), jax.jit(step)(ws, x)
diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
           for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
print(json.dumps({"stats": c.compile_stats, "diff": diff}))
"""


@pytest.mark.parametrize("mode", ["on", "turned-off"])
def test_persistent_compilation_cache_restart_runs_every_fragment(tmp_path, mode):
    """With JAX's persistent cache, fragments compile (and later load) through it: a
    restarted process gets correct results (a relocated copy of a cache-loaded executable
    would fail at run time on XLA:CPU). Also when the settings turn the cache off after
    JAX's first compile, which JAX ignores (it kept relocating: "Function ... not
    found", found by a probe)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    here = os.path.dirname(__file__)
    for _ in range(2):  # the first process fills the cache, the second loads from it
        proc = subprocess.run(
            [sys.executable, "-c", _CACHED_RUN, here, mode],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["stats"]["relocated"] == 0 and got["diff"] == 0.0, got
    assert any((tmp_path / "cache").iterdir())


def test_relocation_can_be_switched_off(monkeypatch):
    """MULTIMESH_RELOCATE=0 compiles every distinct fragment (same values)."""
    step, ws, x, mesh = one_device_pipeline(3)
    on = mm.jit(step, mesh=mesh).lower(ws, x).compile()
    monkeypatch.setenv("MULTIMESH_RELOCATE", "0")
    off = mm.jit(step, mesh=mesh).lower(ws, x).compile()
    assert on.compile_stats["relocated"] > 0 and off.compile_stats["relocated"] == 0
    assert off.compile_stats["compiled"] == on.num_executables == off.num_executables
    for a, b in zip(jax.tree.leaves(on(ws, x)), jax.tree.leaves(off(ws, x))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def embed_blocks_head_step(schedule: str = "1f1b"):
    """An embedding on stage 0 and a head on stage 3 around one block per stage, each a
    task of its own (the shape of a transformer pipeline), trained with SGD."""

    def model_loss(params, x, y):
        emb, ws, head = params
        with mm.task("embed", stage=0):
            h = jnp.tanh(x @ emb)
        for i, w in enumerate(ws):
            with mm.task(f"block{i}", stage=i):
                h = h + jnp.tanh(h @ w)
        with mm.task("head", stage=3):
            out = h @ head
        return jnp.mean((out - y) ** 2)

    def step(params, x, y):
        v, g = mm.microbatch(jax.value_and_grad(model_loss), 4, argnums=(1, 2), schedule=schedule)(
            params, x, y
        )
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), v

    rng = np.random.default_rng(3)
    f32 = np.float32
    params = (
        rng.normal(size=(6, 8)).astype(f32) / 3,
        [rng.normal(size=(8, 8)).astype(f32) / 3 for _ in range(4)],
        rng.normal(size=(8, 2)).astype(f32) / 3,
    )
    x = rng.normal(size=(8, 6)).astype(f32)
    return step, (params, x, np.sin(x[:, :2]))


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_tasks_only_one_stage_runs_are_split_from_shared_blocks(schedule, monkeypatch):
    """Stage 0 (embed + block) and stage 3 (block + head) run their block as its own
    fragment, the same program as the middle stages' (one compile, relocated), instead of
    compiling a block inside each end stage's mix; values equal jax.jit."""
    from multimesh.compiler import fragment as frag_pass

    step, args = embed_blocks_head_step(schedule)
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    ref = jax.jit(step)(*args)
    c = mm.jit(step, mesh=mesh).lower(*args).compile()
    names = {f.name for f in c.plan.fragments}
    assert {"embed:F0", "block0:F0", "block3:F0"} <= names, sorted(names)
    assert {"embed:B0", "embed:W0"} & names, sorted(names)  # zero-bubble: all W on stage 0
    assert not any("+" in n.split(":")[0] for n in names), sorted(names)  # no task mixes
    out = c(*args)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)
    # without the split each end stage compiles its own block inside a mix; with it the
    # end stages' blocks load the middle stages' executables (the mixes' other parts,
    # embed and head alone, are small programs)
    monkeypatch.setattr(frag_pass, "_segments", lambda *a: None)
    unsplit = mm.jit(step, mesh=mesh).lower(*args).compile()
    assert any(n.startswith("embed+block0:") for n in (f.name for f in unsplit.plan.fragments))
    split, whole = c.compile_stats, unsplit.compile_stats
    # block0's and block3's forward and backward: loaded, not compiled
    assert split["relocated"] >= whole["relocated"] + 4, (split, whole)


def test_a_split_that_would_cycle_falls_back_to_one_fragment(monkeypatch):
    """Segments are an optimization: one whose fragments would depend on each other in a
    cycle (forced here: alternating segments along a chain) is dropped, not an error."""
    from multimesh.compiler import fragment as frag_pass

    real = frag_pass._segments

    def alternating(prog, placement, labels, mbs):
        if real(prog, placement, labels, mbs) is None:
            return None
        return [k % 2 if mb is not None else 0 for k, mb in enumerate(mbs)]

    step, args = embed_blocks_head_step()
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    monkeypatch.setattr(frag_pass, "_segments", alternating)
    got = mm.jit(step, mesh=mesh).lower(*args).compile()
    monkeypatch.setattr(frag_pass, "_segments", lambda *a: None)
    unsplit = mm.jit(step, mesh=mesh).lower(*args).compile()
    assert [f.name for f in got.plan.fragments] == [f.name for f in unsplit.plan.fragments]
    ref = jax.jit(step)(*args)
    for a, r in zip(jax.tree.leaves(got(*args)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_no_split_where_the_shared_part_matches_no_other_submesh():
    """Stage 0 runs embed + two blocks, no other stage runs two blocks: splitting it would
    only add launches, so it stays one fragment; stage 3 (block + head) still splits."""

    def model_loss(params, x):
        emb, ws, head = params
        with mm.task("embed", stage=0):
            h = jnp.tanh(x @ emb)
        for i, w in enumerate(ws):
            with mm.task(f"block{i}", stage=max(0, i - 1)):
                h = h + jnp.tanh(h @ w)
        with mm.task("head", stage=3):
            return jnp.mean((h @ head) ** 2)

    def step(params, x):
        v, g = mm.microbatch(jax.value_and_grad(model_loss), 2, argnums=1)(params, x)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), v

    rng = np.random.default_rng(4)
    params = (
        rng.normal(size=(6, 8)).astype(np.float32) / 3,
        [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(5)],
        rng.normal(size=(8, 2)).astype(np.float32) / 3,
    )
    x = rng.normal(size=(4, 6)).astype(np.float32)
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    c = mm.jit(step, mesh=mesh).lower(params, x).compile()
    names = {f.name for f in c.plan.fragments}
    assert {"block4:F0", "head:F0+B0", "block3:F0"} <= names, sorted(names)
    stage0 = {f.name.split(":")[0] for f in c.plan.fragments if f.stage == 0 and f.tasks}
    assert stage0 and all("+" in n for n in stage0), sorted(stage0)  # one mix per phase
    ref = jax.jit(step)(params, x)
    for a, r in zip(jax.tree.leaves(c(params, x)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_layouts_replicated_and_the_split_of_sharded_stages(monkeypatch):
    """Layouts are known before compiling where data is replicated on each submesh: a
    sharded argument, an ``in_shardings`` entry or a constraint that shards says they
    are not (committed batches are then not cut inside the microbatches). Shared tasks
    still run apart from a stage's own on sharded stages: the end stages' blocks then
    load the middle stages' executables there too; values equal jax.jit."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from multimesh.compiler import fragment as frag_pass

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("stage", "data"))
    jaxpr_of = lambda f: jax.make_jaxpr(f)(jnp.ones((4, 2))).jaxpr  # noqa: E731
    plain = jaxpr_of(lambda x: x * 2)
    ok = compiling.layouts_replicated
    assert ok(
        [None, NamedSharding(mesh, P()), NamedSharding(mesh, P("stage"))], None, plain, "stage"
    )
    assert ok([jax.sharding.SingleDeviceSharding(jax.devices()[0])], (None, P()), plain, "stage")
    assert not ok([NamedSharding(mesh, P(None, "data"))], None, plain, "stage")
    assert not ok([None], (P("data"), None), plain, "stage")
    sharded = jaxpr_of(
        lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
    )
    assert not ok([None], None, sharded, "stage")

    step, (params, x, y) = embed_blocks_head_step()
    mesh42 = mm.make_mesh((4, 2), ("stage", "data"))
    split = mm.jit(step, mesh=mesh42).lower(params, x, y)
    assert "embed:F0" in {f.name for f in split.plan.fragments}
    dp_step = mm.jit(step, mesh=mesh42, in_shardings=(None, P("data"), P("data")))
    dp = dp_step.lower(params, x, y).compile()
    names = {f.name for f in dp.plan.fragments}
    assert {"embed:F0", "block0:F0", "block3:F0"} <= names, sorted(names)
    with mesh42:
        ref = jax.jit(step, in_shardings=(None, P("data"), P("data")))(params, x, y)
    for a, r in zip(jax.tree.leaves(dp(params, x, y)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(frag_pass, "_segments", lambda *a: None)
    whole = dp_step.lower(params, x, y).compile()
    assert any(n.startswith("embed+block0:") for n in (f.name for f in whole.plan.fragments))
    # block0's and block3's forward and backward: loaded, not compiled
    got, was = dp.compile_stats, whole.compile_stats
    assert got["relocated"] >= was["relocated"] + 4, (got, was)


def test_loss_zero_made_on_the_host_so_every_stage_shares_one_pre_loop_program():
    """The loss accumulator's zero (a scalar) is made on the host and put once, so the
    last stage's pre-loop program (gradient zeros) is every stage's: one compile,
    relocated to the others. Buffers this small are never donated, so microbatch 0's
    fragment is still the others' program, and every call reuses the zero; values =
    jax.jit exactly, call after call."""
    step, ws, x, mesh = one_device_pipeline(7)
    lowered = mm.jit(step, mesh=mesh).lower(ws, x)
    made = [p for p in lowered.plan.inputs if p.mode == "host_const"]
    assert [(p.stage, p.nbytes) for p in made] == [(3, 4)]  # the f32 loss zero
    c = lowered.compile()
    pre = [
        (f, frag)
        for f, frag in zip(c.plan.fragments, c.fragments)
        if ":" not in f.name and "#" not in f.name
    ]
    assert sorted(f.stage for f, _ in pre) == [0, 1, 2, 3]
    programs = {
        tuple((tuple(o.shape), str(o.dtype)) for o in jax.tree.leaves(frag.out_info))
        for _f, frag in pre
    }
    assert programs == {(((8, 8), "float32"),)}, programs  # one gradient zero each, no scalar
    assert c.compile_stats["relocated"] >= 3
    for _ in range(3):  # the zero is reused: nothing may have written into it
        out = c(ws, x)
        ref = jax.jit(step)(ws, x)
        for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h1"])
def test_committed_batch_cut_inside_each_microbatch(schedule):
    """A batch already on its submesh is cut inside each microbatch's work, at an offset
    given as an input (a constant put once): no pre-loop program slices it, every
    microbatch is still one program, and values = jax.jit exactly."""
    step = pipeline_step(schedule)
    _, ws, x, mesh = one_device_pipeline(8)
    xd = jax.device_put(x, mesh.submesh(0).devices.flat[0])
    lowered = mm.jit(step, mesh=mesh).lower(ws, xd)
    assert any(p.mode == "as_is" for p in lowered.plan.inputs)
    made = [p for p in lowered.plan.inputs if p.mode == "host_const"]
    assert len(made) == 4 * 2 + 1  # 4 microbatches x 2 dimensions, and the loss zero
    assert "small constants made on the host once" in lowered.as_text()
    c = lowered.compile()
    for f, frag in zip(c.plan.fragments, c.fragments):
        if f.stage == 0 and ":" not in f.name and "#" not in f.name:  # before the loop
            assert not jax.tree.leaves(frag.input_shardings), f.name  # no batch to slice
    stage0 = {
        id(frag) for f, frag in zip(c.plan.fragments, c.fragments) if f.name.startswith("s0:F")
    }
    assert len(stage0) == 1  # every microbatch's forward on stage 0: one executable
    for _ in range(2):
        out = c(ws, xd)
        ref = jax.jit(step)(ws, x)
        for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


@pytest.mark.parametrize("home", [0, 3])
def test_committed_batch_cut_where_each_stage_uses_it(home):
    """A batch committed to one submesh and read by the first stage (token ids) and the
    last (targets) in every microbatch: each cut runs on the stage that uses it (the
    batch is moved there whole, before the loop). Cut next to the data, stage 0's
    forward would wait on stage 3's work of the same microbatch: a cycle (found by a
    probe: "the forward passes ... depend on each other in a cycle")."""
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(4)]
    emb = rng.normal(size=(8, 8)).astype(np.float32)
    tokens = rng.integers(0, 8, size=(8, 4)).astype(np.int32)

    def loss(ws, emb, tb):
        with mm.task("emb", stage=0):
            h = jnp.take(emb, tb[:, 0], axis=0)
        for i, w in enumerate(ws):
            with mm.task(f"l{i}", stage=i):
                h = h + jnp.tanh(h @ w)
        with mm.task("head", stage=3):
            return jnp.mean((h - tb[:, 1:2].astype(jnp.float32)) ** 2)

    def step(ws, emb, t):
        vg = jax.value_and_grad(loss, argnums=(0, 1))
        return mm.microbatch(vg, 4, argnums=2, schedule="1f1b")(ws, emb, t)

    ref = jax.jit(step)(ws, emb, tokens)
    t = jax.device_put(tokens, jax.sharding.NamedSharding(mesh.submesh(home), jax.P()))
    lowered = mm.jit(step, mesh=mesh).lower(ws, emb, t)
    assert sum(p.mode == "host_const" for p in lowered.plan.inputs) >= 8  # cut per microbatch
    out = lowered.compile()(ws, emb, t)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_returned_small_constants_keep_their_types():
    """A small constant the program returns is made by the program (a fresh array), and
    weakly typed constants are left to it: types (and promotion) as under jax.jit."""
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])

    def f(x):
        weak = jnp.full((3,), 2.0)
        strong = jnp.zeros((2,), jnp.float32)
        with mm.task("a", stage=1):
            s = x.sum() + weak.sum() + strong.sum()
        return s, weak, strong

    x = np.ones((6, 8), np.float32)
    got, want = mm.jit(f, mesh=mesh)(x), jax.jit(f)(x)
    for a, r in zip(got, want):
        assert (a.dtype, a.weak_type) == (r.dtype, r.weak_type)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    h = np.ones(3, np.float16)
    assert (got[1] + h).dtype == (want[1] + h).dtype == np.float16


def test_constants_kept_between_calls_survive_deleting_live_arrays():
    """Constants put once (closed-over arrays, the loss zero, microbatch offsets) are put
    again if something deleted them: ``for a in jax.live_arrays(): a.delete()`` frees
    memory between calls under jax.jit, and must not break an mm.jit function."""
    step, ws, x, mesh = one_device_pipeline(5)
    table = np.arange(8, dtype=np.float32)

    def f(ws, x):
        new, v = step(ws, x)
        return new, v + jnp.asarray(table).sum()  # a closed-over constant

    g = mm.jit(f, mesh=mesh)
    xd = jax.device_put(x, mesh.submesh(0).devices.flat[0])  # cut inside the microbatches
    lowered = g.lower(ws, xd)
    assert sum(p.mode == "host_const" for p in lowered.plan.inputs) > 1
    c = lowered.compile()
    ref = jax.tree.map(np.asarray, jax.jit(f)(ws, x))
    for _ in range(2):
        out = g(ws, jax.device_put(x, mesh.submesh(0).devices.flat[0]))
        for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), r)
        # what deleting every live array does to this program (deleting them all here
        # would also delete other tests' module-level arrays in this worker)
        kept = [c._exe._template[sid] for sid, *_ in c._exe._kept]  # noqa: SLF001
        assert len(kept) > 2
        for a in kept:
            a.delete()


def test_sharded_batch_keeps_its_slices(mesh4x2):
    """A batch sharded over a submesh's axis is not cut by dynamic offsets (that would
    gather it): it is sliced before the loop, in its layout."""
    step = pipeline_step("1f1b")
    _, ws, x, _mesh = one_device_pipeline(9)
    sh = jax.sharding.NamedSharding(mesh4x2.submesh(0), jax.P("data"))
    xd = jax.device_put(x, sh)
    lowered = mm.jit(step, mesh=mesh4x2).lower(ws, xd)
    made = [p for p in lowered.plan.inputs if p.mode == "host_const"]
    assert len(made) == 1  # the loss zero only: no offsets
    out = lowered.compile()(ws, xd)
    ref = jax.jit(step)(ws, x)
    for a, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_jaxpr_fingerprint_ignores_names_not_values():
    """Fragments key their executables by a structural fingerprint: the same work for
    another microbatch (other variables) shares it; any other value, constant or type
    does not (the printed jaxpr elides large arrays and nested constants)."""
    from multimesh import _compat

    def fp(f, *args):
        return _compat.jaxpr_fingerprint(jax.make_jaxpr(f)(*args).jaxpr)

    x = jnp.ones((4, 4), jnp.float32)
    assert fp(lambda a: jnp.tanh(a) * 2.0, x) == fp(lambda b: jnp.tanh(b) * 2.0, x)
    assert fp(lambda a: jnp.tanh(a) * 2.0, x) != fp(lambda a: jnp.tanh(a) * 3.0, x)
    assert fp(lambda a: jnp.tanh(a), x) != fp(lambda a: jnp.sin(a), x)
    assert fp(lambda a: a + 1, x) != fp(lambda a: a + 1, x.astype(jnp.bfloat16))
    assert fp(lambda a: a * 2, 1.0) != fp(lambda a: a * 2, jnp.float32(1.0))  # weak type
    assert fp(lambda a: a * 0.0, x) != fp(lambda a: a * -0.0, x)  # literals by their bits

    # a nested jit's closed-over constants, and large array parameters, by value
    def nested(c):
        return lambda a: jax.jit(lambda b: b + c)(a)

    big = np.arange(4096, dtype=np.float32).reshape(64, 64)
    other = big.copy()
    other[32, 32] = -1.0  # the printed arrays are identical (elided)
    y = jnp.ones((64, 64), jnp.float32)
    assert str(big) == str(other)
    j1, j2, j3 = (jax.make_jaxpr(nested(c))(y) for c in (big, other, big.copy()))
    keys = [_compat.jaxpr_fingerprint(j.jaxpr) for j in (j1, j2, j3)]
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_sharding_devices_only_in_device_fingerprints():
    """``devices=True`` tells equations naming other devices apart; the default does not
    (executables are relocated between submeshes of one shape)."""
    from multimesh import _compat

    devs = jax.devices()
    m1 = jax.sharding.Mesh(np.array(devs[:2]), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    m2 = jax.sharding.Mesh(np.array(devs[2:4]), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.ones((4, 4))

    def constrained(m):
        s = jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec("x"))
        return jax.make_jaxpr(lambda a: jax.lax.with_sharding_constraint(a * 2, s))(x).jaxpr

    a, b = constrained(m1), constrained(m2)
    assert _compat.jaxpr_fingerprint(a) == _compat.jaxpr_fingerprint(b)
    assert _compat.jaxpr_fingerprint(a, devices=True) != _compat.jaxpr_fingerprint(
        b, devices=True
    )


def test_rng_counters_are_host_inputs_so_identical_layers_share_their_init(monkeypatch):
    """NNX's RNG counters (``count + 1`` after ``count + 1`` from a literal zero) differ
    per layer, so each stage's part of a model's init was a program of its own. They are
    computed on the host and given as inputs: identical layers on several stages compile
    once (relocated to the others); the parameters are jax.jit's exactly."""
    from flax import nnx

    from multimesh.runtime import executor

    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [
                    mm.flax.task(nnx.Linear(8, 8, rngs=rngs), stage=i, name=f"l{i}")
                    for i in range(4)
                ]
            )

    def ctor(key):
        return Model(nnx.Rngs(key))

    compiles: list[str] = []
    real = executor._compile

    def counted(body, in_sh, out_sh, donate, avals, options, info, mesh):
        compiles.append(info.name)
        return real(body, in_sh, out_sh, donate, avals, options, info, mesh)

    monkeypatch.setattr(executor, "_compile", counted)
    key = jax.random.key(3)
    want = jax.tree.leaves(jax.jit(lambda k: nnx.state(ctor(k)))(key))
    model = mm.flax.create(ctor, key, mesh=mesh)
    got = jax.tree.leaves(nnx.state(model))
    assert len(got) == len(want) == 8
    for a, r in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    # without host scalars there was a program per stage (4 compiles)
    assert len(compiles) < 4, compiles


def test_host_scalars_wrap_as_xla_and_keep_what_must_stay():
    """Integer scalars computed on the host wrap around as XLA's do; returned and
    weakly typed ones stay made by the program (their types as under jax.jit); values
    equal jax.jit's."""
    from multimesh.compiler import host_inputs
    from multimesh.compiler.ir import FlatProgram

    def f(x):
        big = jnp.uint32(4294967295) + jnp.uint32(3)  # wraps to 2
        neg = -jnp.int32(2147483647) - jnp.int32(5)  # wraps around too
        weak = jnp.int32(7) * 2
        back = jnp.uint8(200) + jnp.uint8(100)
        cmp = (big < jnp.uint32(5)).astype(jnp.int32) + jnp.maximum(neg, jnp.int32(-3))
        with mm.task("a", stage=1):
            y = x * big.astype(jnp.float32) + cmp.astype(jnp.float32) * weak
        return y, back

    closed = jax.make_jaxpr(f)(jnp.ones(3, jnp.float32))
    j = closed.jaxpr
    prog = FlatProgram(list(j.invars), list(j.constvars), list(closed.consts), list(j.outvars),
                       list(j.eqns))
    new, consts, keep = host_inputs.bind_host_scalars(prog)
    assert keep is not None and len(new.eqns) < len(prog.eqns)
    values = sorted(int(c.value) for c in consts.values())
    assert 2 in values, values  # the wrapped uint32
    assert all(c.value.shape == () for c in consts.values())
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    x = np.arange(3, dtype=np.float32)
    got, want = mm.jit(f, mesh=mesh)(x), jax.jit(f)(x)
    for a, r in zip(got, want):
        assert (a.dtype, a.weak_type) == (r.dtype, r.weak_type)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


def test_stages_differing_only_in_nested_constants_do_not_share_an_executable():
    """Two stages run the same nested jit closing over different constants: their
    printed jaxprs are identical (a nested jit's constants are not printed), so keying
    executables by that text relocated stage 0's program, constant included, to stage 1."""
    c0 = np.full((4, 4), 1.0, np.float32)
    c1 = np.full((4, 4), 5.0, np.float32)

    def f(x):
        h = x
        for i, c in enumerate((c0, c1)):
            with mm.task(f"s{i}", stage=i):
                h = jax.jit(lambda b, c=c: jnp.tanh(b + c) * 2.0)(h)
        return h

    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    x = jnp.linspace(-1, 1, 16, dtype=jnp.float32).reshape(4, 4)
    np.testing.assert_array_equal(mm.jit(f, mesh=mesh)(x), jax.jit(f)(x))


def _two_stages():
    return mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])


def _same(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(
            np.asarray(a).view(np.uint8) if a.dtype != bool else a,
            np.asarray(b).view(np.uint8) if b.dtype != bool else b,
        )


def test_equation_context_keys_the_executable():
    """Two stages' programs that differ only in ``jax.threefry_partitionable`` (kept in
    each equation's context, not its parameters) are two executables."""

    def f(x):
        with mm.task("a", stage=0):
            with jax.threefry_partitionable(False):
                y = x + jax.random.normal(jax.random.key(0), (4, 4))
        with mm.task("b", stage=1):
            with jax.threefry_partitionable(True):
                z = x + jax.random.normal(jax.random.key(0), (4, 4))
        return y, z

    x = jnp.zeros((4, 4))
    _same(mm.jit(f, mesh=_two_stages())(x), jax.jit(f)(x))


def test_callbacks_differing_in_hidden_state_are_two_executables():
    """Callbacks are keyed by identity: two partials over tables that print alike."""
    import functools

    def add_table(table, v):
        return (np.asarray(v) + table[1000]).astype(np.float32)

    t1, t2 = np.zeros(2000, np.float32), np.zeros(2000, np.float32)
    t2[1000] = 5.0
    cb1, cb2 = functools.partial(add_table, t1), functools.partial(add_table, t2)
    assert repr(cb1) == repr(cb2)

    def pc(cb, v):
        return jax.pure_callback(cb, jax.ShapeDtypeStruct(v.shape, v.dtype), v)

    def f(x):
        with mm.task("a", stage=0):
            y = jnp.sin(pc(cb1, x))
        with mm.task("b", stage=1):
            y2 = jnp.cos(y)
        with mm.task("c", stage=0):
            return jnp.sin(pc(cb2, y2))

    x = jnp.arange(16.0).reshape(4, 4) / 10
    np.testing.assert_allclose(mm.jit(f, mesh=_two_stages())(x), jax.jit(f)(x), rtol=1e-6)


def test_nested_jit_closing_over_a_key_and_nan_literals():
    """A nested jit's PRNG-key constant is fingerprinted by its key data (it crashed);
    NaN literals by their bits (+nan, -nan and payloads print alike)."""
    key = jax.random.key(1)

    @jax.jit
    def noisy(v):
        return v + jax.random.normal(key, v.shape)

    def f(x):
        with mm.task("a", stage=0):
            y = noisy(x)
        with mm.task("b", stage=1):
            return y * 2

    x = jnp.zeros((4, 4))
    _same(mm.jit(f, mesh=_two_stages())(x), jax.jit(f)(x))

    nans = [np.float32(np.nan), -np.float32(np.nan), np.uint32(0x7FC00123).view(np.float32)]

    def g(x):
        outs = []
        for i, n in enumerate(nans[1:]):
            with mm.task(f"s{i}", stage=i):
                outs.append(jax.lax.bitcast_convert_type(jnp.where(x > 1, x, n), jnp.uint32))
        with mm.task("s0", stage=0):
            outs.append(jax.lax.bitcast_convert_type(jnp.where(x > 1, x, nans[0]), jnp.uint32))
        return outs

    _same(mm.jit(g, mesh=_two_stages())(x), jax.jit(g)(x))


def test_context_manager_settings_reach_the_compile_threads(monkeypatch):
    """jax.enable_x64(True) and other configuration context managers are thread-local:
    fragments compiled on the compile threads see the caller's values."""
    monkeypatch.setenv("MULTIMESH_COMPILE_THREADS", "2")
    mesh = _two_stages()

    def f(x):
        with mm.task("a", stage=0):
            h = x * 2
        with mm.task("b", stage=1):
            return h + 1

    x = np.ones(3)
    with jax.enable_x64(True):
        got, want = mm.jit(f, mesh=mesh)(x), jax.jit(f)(x)
        assert want.dtype == np.float64
        _same(got, want)
    _same(mm.jit(f, mesh=mesh)(x), jax.jit(f)(x))  # float32 again, outside


def test_jax_settings_key_the_call_cache():
    """As jax.jit: a change of threefry_partitionable, dtype promotion or x64 retraces."""
    mesh = _two_stages()

    def f(x):
        with mm.task("a", stage=0):
            y = x + jax.random.normal(jax.random.PRNGKey(0), (4, 4))
        with mm.task("b", stage=1):
            return y * 2

    x = jnp.zeros((4, 4))
    mf = mm.jit(f, mesh=mesh)
    _same(mf(x), jax.jit(f)(x))
    with jax.threefry_partitionable(not jax.config.jax_threefry_partitionable):
        _same(mf(x), jax.jit(f)(x))

    def g(x):
        with mm.task("a", stage=0):
            y = x.astype(jnp.bfloat16) + jnp.ones((4, 4), jnp.float16)
        with mm.task("b", stage=1):
            return y * 2

    mg = mm.jit(g, mesh=mesh)
    assert mg(x).dtype == jax.jit(g)(x).dtype
    with jax.numpy_dtype_promotion("strict"), pytest.raises(jax.dtypes.TypePromotionError):
        mg(x)


_POLICY = jax.checkpoint_policies.save_only_these_names("a")


def _per_layer_step(variant: str):
    """Four identical one-device stages whose layer holds a parameter made anew per layer
    call in the ``*_per_layer`` variants (a remat policy, a reduce's Python reducer)."""

    def layer(w, h):
        if variant.startswith("remat"):
            pol = (
                _POLICY
                if variant == "remat_once"
                else jax.checkpoint_policies.save_only_these_names("a")
            )

            def inner(w, h):
                a = checkpoint_name(jnp.tanh(h @ w), "a")
                return h + jnp.tanh(a @ w)

            return jax.checkpoint(inner, policy=pol)(w, h)
        hs = jax.lax.stop_gradient(h)
        red = jax.lax.add if variant == "reduce_once" else (lambda a, b: a + b * 1.0)
        r = jax.lax.reduce(hs, 0.0, red, (1,))
        return h + jnp.tanh(h @ w) * r[:, None]

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = layer(w, h)
        return jnp.mean(h**2)

    def step(ws, x):
        v, g = mm.microbatch(jax.value_and_grad(loss), 2, argnums=1)(ws, x)
        return [w - 0.01 * d for w, d in zip(ws, g, strict=True)], v

    return step


@pytest.mark.parametrize("kind", ["remat", "reduce"])
def test_parameters_lowering_ignores_do_not_split_executables(kind):
    """A remat policy or a reduce's Python reducer made anew in every layer (as
    ``nn.remat(policy=...)`` inside a layer does) is not read when a fragment is lowered:
    the middle stages still share one compile (each compiled its own: keyed by the
    object's identity)."""
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 6 for _ in range(4)]
    x = rng.normal(size=(8, 8)).astype(np.float32) / 4
    stats = {}
    for variant in (f"{kind}_once", f"{kind}_per_layer"):
        step = _per_layer_step(variant)
        c = mm.jit(step, mesh=mesh).lower(ws, x).compile()
        for a, r in zip(jax.tree.leaves(c(ws, x)), jax.tree.leaves(jax.jit(step)(ws, x))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-7)
        stats[variant] = c.compile_stats
    assert stats[f"{kind}_per_layer"] == stats[f"{kind}_once"], stats
    assert stats[f"{kind}_once"]["relocated"] >= 2, stats


def test_an_executable_xla_cannot_serialize_is_compiled_not_relocated(monkeypatch):
    """XLA:CPU cannot serialize a sort's comparator once the executable has run
    ("`LessThan` is not serializable"): relocating it for a second mm.jit on another
    submesh raised that error; it is compiled there instead."""
    monkeypatch.setenv("MULTIMESH_SHARED_EXECUTABLES", "1024")
    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    x = np.random.RandomState(0).randn(4, 8).astype(np.float32)

    def on(stage):
        def f(x):
            with mm.task("a", stage=stage):
                return jnp.sort(x, axis=1)

        return f

    first = mm.jit(on(0), mesh=mesh)
    np.testing.assert_array_equal(np.asarray(first(x)), np.sort(x, axis=1))  # it has run
    second = mm.jit(on(1), mesh=mesh).lower(x).compile()
    assert second.compile_stats["compiled"] == 1 and second.compile_stats["relocated"] == 0
    out = second(x)
    assert stage_of(out, mesh) == 1
    np.testing.assert_array_equal(np.asarray(out), np.sort(x, axis=1))


def test_a_new_mm_jit_of_a_compiled_program_shares_its_executables(monkeypatch):
    """As jax.jit does for a function it has seen, a second mm.jit of the same program
    (the function wrapped again, a rebuilt model) compiles nothing: it uses the
    executables the first made; values stay bit-identical."""
    monkeypatch.setenv("MULTIMESH_SHARED_EXECUTABLES", "1024")
    step, ws, x, mesh = one_device_pipeline(5)
    first = mm.jit(step, mesh=mesh).lower(ws, x).compile()
    assert first.compile_stats["shared"] == 0 and first.compile_stats["compiled"] > 0
    again = mm.jit(step, mesh=mesh).lower(ws, x).compile()
    rebuilt = mm.jit(pipeline_step("1f1b"), mesh=mesh).lower(ws, x).compile()  # a new trace
    for c in (again, rebuilt):
        assert c.compile_stats["compiled"] == 0 and c.compile_stats["relocated"] == 0
        assert c.compile_stats["shared"] == c.num_executables, c.compile_stats
    want = jax.jit(step)(ws, x)
    got = [jax.tree.leaves(c(ws, x)) for c in (first, again, rebuilt)]
    for a, r in zip(got[0], jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-7)
    for other_leaves in got[1:]:  # the same executables: the same bits
        for a, b in zip(other_leaves, got[0], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the same program on other devices: not shared, but relocated from the first's
    # executables (nothing compiled anew), with the same bits
    other = mm.make_mesh((4,), ("stage",), devices=jax.devices()[4:])
    moved = mm.jit(step, mesh=other).lower(ws, x).compile()
    assert moved.compile_stats["shared"] == 0 and moved.compile_stats["compiled"] == 0
    assert moved.compile_stats["relocated"] == moved.num_executables, moved.compile_stats
    for a, b in zip(jax.tree.leaves(moved(ws, x)), got[0], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # jax.clear_caches() empties it; 0 turns sharing off
    jax.clear_caches()
    assert len(compiling.SHARED) == 0
    assert mm.jit(step, mesh=mesh).lower(ws, x).compile().compile_stats["shared"] == 0
    monkeypatch.setenv("MULTIMESH_SHARED_EXECUTABLES", "0")
    assert mm.jit(step, mesh=mesh).lower(ws, x).compile().compile_stats["shared"] == 0
    monkeypatch.setenv("MULTIMESH_SHARED_EXECUTABLES", "lots")
    with pytest.raises(ValueError, match="MULTIMESH_SHARED_EXECUTABLES='lots'"):
        mm.jit(step, mesh=mesh).lower(ws, x).compile()


def test_sharing_never_mixes_programs_that_differ(monkeypatch):
    """Programs whose fragments look alike but are not the same never share: Python
    callbacks of the same text (keyed by identity, kept alive by the entry), other JAX
    settings (x64, matmul precision), other shardings of the inputs."""
    monkeypatch.setenv("MULTIMESH_SHARED_EXECUTABLES", "1024")
    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])

    def make(k):
        def cb(a):
            return (np.asarray(a) * k).astype(a.dtype)

        def f(x):
            with mm.task("a", stage=0):
                y = jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            with mm.task("b", stage=1):
                return y + 1

        return f

    x = jnp.arange(4.0)
    for k in (2.0, 3.0, 5.0):  # each callback made anew (the last may reuse an address)
        got = mm.jit(make(k), mesh=mesh)(x)
        np.testing.assert_array_equal(np.asarray(got), np.arange(4.0) * k + 1)

    def g(x):
        with mm.task("a", stage=0):
            y = x @ x.T
        with mm.task("b", stage=1):
            return y * 2

    xs = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    base = mm.jit(g, mesh=mesh).lower(xs).compile()
    with jax.default_matmul_precision("highest"):
        hi = mm.jit(g, mesh=mesh).lower(xs).compile()
    assert hi.compile_stats["shared"] == 0, hi.compile_stats
    with jax.enable_x64(True):
        wide = mm.jit(g, mesh=mesh).lower(xs.astype(np.float64)).compile()
        assert wide.compile_stats["shared"] == 0
        assert wide(xs.astype(np.float64)).dtype == np.float64
    sub = mesh.submesh(0)
    split = jax.device_put(xs, jax.sharding.NamedSharding(sub, jax.P()))
    assert mm.jit(g, mesh=mesh).lower(split).compile().compile_stats["shared"] > 0
    np.testing.assert_allclose(np.asarray(base(xs)), xs @ xs.T * 2, rtol=1e-5)
