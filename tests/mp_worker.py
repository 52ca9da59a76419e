"""Training programs for the multi-process tests (run by ``python -m multimesh.launch`` or
as one plain process). Rank 0 writes every program's losses and final parameters to
the ``.npz`` given as the first argument; every process checks its own plans.

    python tests/mp_worker.py OUT.npz [mlp|gpt|all] [--forever]
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import multimesh as mm

multi = mm.distributed.initialize()

import jax  # noqa: E402

if not multi:
    jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h1"]


def mlp_program(schedule: str) -> tuple[list[float], list[np.ndarray]]:
    mmesh = mm.make_mesh((4, 2), ("stage", "data"))
    n = 8 if schedule == "interleaved-1f1b" else 4

    def loss(ws, x, y):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = h + jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    grad = mm.microbatch(
        jax.value_and_grad(loss), 4, argnums=(1, 2), schedule=schedule, reduce="mean"
    )
    opt = optax.adam(1e-2)

    def step(state, x, y):
        ws, o = state
        val, g = grad(ws, x, y)
        u, o = opt.update(g, o, ws)
        return (optax.apply_updates(ws, u), o), val

    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(n)]
    x = rng.normal(size=(16, 8)).astype(np.float32)
    y = jnp.sin(x)  # process-local data (an uncommitted array on this process's device)
    f = mm.jit(step, mesh=mmesh)
    state = (ws, opt.init(ws))
    losses = []
    for i in range(4):
        state, val = f(state, x, y)
        losses.append(float(mm.distributed.to_host(val)))
        if i == 0:
            check_fed_back_plan(f, state, x, y, bytes_per_param=8 * 8 * 4)
            if jax.process_count() > 1:
                check_compiles_own_fragments(f, state, x, y)
    return losses, [np.asarray(a) for a in jax.tree.leaves(mm.distributed.to_host(state))]


def gpt_program(schedule: str) -> tuple[list[float], list[np.ndarray]]:
    from flax import nnx

    from multimesh.examples import gpt

    mmesh = mm.make_mesh((4, 2), ("stage", "data"))
    cfg = gpt.Config(stages=4, layers=4, dp=True)
    model = gpt.GPT(cfg, nnx.Rngs(0))
    step, state = gpt.nnx_train_step(cfg, model, optax.sgd(0.3, momentum=0.9), 2, schedule)
    state = jax.tree.map(np.asarray, state)  # the same host values on every process
    tokens = np.asarray(gpt.synthetic_batch(cfg, 8))
    f = mm.jit(step, mesh=mmesh)
    losses = []
    for _ in range(2):
        state, val = f(state, tokens)
        losses.append(float(mm.distributed.to_host(val)))
    return losses, [np.asarray(a) for a in jax.tree.leaves(mm.distributed.to_host(state))]


def checkpoint_program(directory: str, resume: bool) -> tuple[list[float], list[np.ndarray]]:
    """4 steps with a checkpoint after each; or resume after step 2 and run steps 3-4."""
    mmesh = mm.make_mesh((4, 2), ("stage", "data"))

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = h + jnp.tanh(h @ w)
        return jnp.mean(h**2)

    opt = optax.adam(1e-2)

    def step(state, x):
        ws, o = state
        val, g = jax.value_and_grad(loss)(ws, x)
        u, o = opt.update(g, o, ws)
        return (optax.apply_updates(ws, u), o), val

    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(4)]
    batches = [np.random.default_rng(10 + i).normal(size=(8, 8)).astype(np.float32)
               for i in range(4)]
    state = (ws, opt.init(ws))
    f = mm.jit(step, mesh=mmesh)
    losses = []
    with mm.checkpoint.CheckpointManager(directory) as man:
        start = 0
        if resume:
            # the restore target: where a step's outputs land (shapes, dtypes, shardings)
            target = f.lower(state, batches[0]).compile().out_info[0]
            state = man.restore(2, target=target)
            start = 2
        for i in range(start, 4):
            state, val = f(state, batches[i])
            losses.append(float(mm.distributed.to_host(val)))
            if not resume:
                man.save(i + 1, state)
        man.wait_until_finished()
    return losses, [np.asarray(a) for a in jax.tree.leaves(mm.distributed.to_host(state))]


def check_fed_back_plan(f, state, x, y, bytes_per_param: int) -> None:
    """Outputs fed back move no parameter bytes between submeshes (on every process)."""
    plan = f.lower(state, x, y).plan
    moved = [t for t in plan.transfers if t.nbytes >= bytes_per_param and t.shape == (8, 8)]
    assert not moved, f"process {jax.process_index()}: parameters move: {moved}"


def check_compiles_own_fragments(f, state, x, y) -> None:
    """Each process compiles the fragments it runs; those of other processes whose output
    layouts are known without compiling (replicated here) are left to their process."""
    c = f.lower(state, x, y).compile()
    mine = {d.id for d in jax.local_devices()}
    ours = [set(info.devices) <= mine for info in c.plan.fragments]
    missing = [i.name for i, o, e in zip(c.plan.fragments, ours, c.fragments) if o and e is None]
    assert not missing, f"process {jax.process_index()}: own fragments not compiled: {missing}"
    skipped = sum(1 for o, e in zip(ours, c.fragments) if not o and e is None)
    assert skipped, f"process {jax.process_index()} compiled every other process's fragment"
    assert c.memory_analysis().per_submesh and c.cost_analysis().per_fragment
    print(f"compiled own fragments, skipped {skipped} of others'", flush=True)


def replicated_outputs_and_keys() -> None:
    """Outputs replicated over every submesh (MaxText's metrics) and PRNG keys passed
    through keep one committed global sharding on every process, and feed back in."""
    from jax.sharding import NamedSharding, PartitionSpec

    mmesh = mm.make_mesh((2, 4), ("stage", "data"))
    rep = NamedSharding(mmesh.mesh, PartitionSpec())

    def f(x, key):
        with mm.task("a", stage=0):
            y = jnp.sin(x) * 2
        with mm.task("b", stage=1):
            m = {"sum": (y * y).sum(), "mean": y.mean()}
        return y, m, key

    g = mm.jit(f, mesh=mmesh, out_shardings=(None, rep, None))
    key = jax.jit(lambda: jax.random.key(7), out_shardings=rep)()
    x = np.arange(8.0, dtype=np.float32)
    for i in range(3):
        _, m, key = g(x + i, key)  # the key output is fed back: the same plan everywhere
        want = np.sin(x + i) * 2
        for name, v in [("sum", (want * want).sum()), ("mean", want.mean())]:
            a = m[name]
            assert a.sharding == rep and a.is_fully_replicated, (name, a.sharding)
            assert len(a.addressable_shards) == 8 // jax.process_count(), name
            for sh in a.addressable_shards:
                np.testing.assert_allclose(np.asarray(sh.data), v, rtol=1e-6, err_msg=name)
        # passed through: a fresh copy in the argument's own sharding on every process
        # (not on a process's default device, which would make the next call's plan
        # differ; nor on stage 0's devices only)
        assert key.committed and key.sharding.is_equivalent_to(rep, 0), key.sharding
    # each process holds its own devices' copies of it
    assert len(key.addressable_shards) == 8 // jax.process_count()
    for sh in jax.random.key_data(key).addressable_shards:
        assert (np.asarray(sh.data) == np.asarray(jax.random.key_data(jax.random.key(7)))).all()
    print("replicated outputs ok", flush=True)


def keys_onto_a_submesh_over_processes() -> None:
    """A process-local typed PRNG key (and a raw one) given to a submesh that spans
    processes: every process puts its part of the same host value (a typed key as its
    key data: it cannot become a NumPy array as it is)."""
    mmesh = mm.make_mesh((1, 8), ("stage", "data"))

    def f(x, key, raw):
        with mm.task("a", stage=0):
            return x + jax.random.uniform(key, x.shape) + jax.random.uniform(raw, x.shape)

    x = np.arange(8.0, dtype=np.float32)
    key, raw = jax.random.key(3), jax.random.PRNGKey(4)
    got = mm.distributed.to_host(mm.jit(f, mesh=mmesh)(x, key, raw))
    with jax.default_device(jax.local_devices()[0]):
        want = jax.jit(f)(x, key, raw)
    np.testing.assert_array_equal(got, np.asarray(want))
    print("keys over processes ok", flush=True)


def keys_between_processes() -> None:
    """A typed key split on stage 0 and used on stage 1 (another process), in a training
    step that carries its key as state: it was refused ("a PRNG key moves between
    submeshes in different processes"); keys move as their data now."""
    mmesh = mm.make_mesh((2, 4), ("stage", "data"))

    def model(w, x, key):
        with mm.task("a", stage=0):
            h = jnp.tanh(x * w) * jax.random.bernoulli(jax.random.fold_in(key, 0), 0.8, x.shape)
        with mm.task("b", stage=1):
            return jnp.sum(h * jax.random.normal(jax.random.fold_in(key, 1), x.shape))

    def step(w, x, key):
        key, sub = jax.random.split(key)
        v, g = jax.value_and_grad(model)(w, x, sub)
        return w - 0.1 * g, v, key

    x = np.linspace(0.0, 1.0, 8, dtype=np.float32)
    f = mm.jit(step, mesh=mmesh)
    w, key = np.float32(0.5), jax.random.key(7)
    got = []
    for _ in range(3):
        w, v, key = f(w, x, key)
        got.append(float(mm.distributed.to_host(v)))
    with jax.default_device(jax.local_devices()[0]):
        ref = jax.jit(step)
        rw, rkey, want = np.float32(0.5), jax.random.key(7), []
        for _ in range(3):
            rw, rv, rkey = ref(rw, x, rkey)
            want.append(float(rv))
    np.testing.assert_allclose(got, want, rtol=1e-6)

    # a key returned by stage 0 and fed back, used first on stage 1 (the other process):
    # an argument moved between processes, unwrapped by a fragment of its own
    def g(k, x):
        with mm.task("a", stage=1):
            k, s = jax.random.split(k)
            y = x * jax.random.uniform(s, x.shape)
        with mm.task("b", stage=0):
            k2 = jax.random.fold_in(k, 1)
            return y + jax.random.uniform(k2, x.shape), k2

    gm = mm.jit(g, mesh=mmesh)
    k, got = jax.random.key(3), []
    for _ in range(3):
        y, k = gm(k, x)
        got.append(mm.distributed.to_host(y))
    with jax.default_device(jax.local_devices()[0]):
        gj, rk, want = jax.jit(g), jax.random.key(3), []
        for _ in range(3):
            ry, rk = gj(rk, x)
            want.append(np.asarray(ry))
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-6)
    print("keys between processes ok", flush=True)


def keys_and_pinned_inputs_over_processes() -> None:
    """A PRNG key an mm.jit call returned on the other process's submesh comes back
    with to_host (it was "not returned by an mm.jit call"); in_shardings on the other
    process's submesh put a host value there, and a committed array elsewhere is the
    same clear error on every process (it hung one of them)."""
    from jax.sharding import NamedSharding, PartitionSpec

    mmesh = mm.make_mesh((4, 2), ("stage", "data"))

    def f(k, x):
        with mm.task("s3", stage=3):
            k2, sub = jax.random.split(k)
            return k2, x + jax.random.uniform(sub, x.shape)

    x = np.arange(4.0, dtype=np.float32)
    got = mm.distributed.to_host(mm.jit(f, mesh=mmesh)(jax.random.key(0), x))
    with jax.default_device(jax.local_devices()[0]):
        want = jax.jit(f)(jax.random.key(0), x)
    np.testing.assert_array_equal(got[0], np.asarray(jax.random.key_data(want[0])))
    np.testing.assert_array_equal(got[1], np.asarray(want[1]))
    on3 = NamedSharding(mmesh.submesh(3), PartitionSpec("data"))
    g = mm.jit(lambda v: v * 2, mesh=mmesh, in_shardings=on3)
    np.testing.assert_array_equal(mm.distributed.to_host(g(x)), x * 2)
    elsewhere = jax.device_put(x, NamedSharding(mmesh.submesh(0), PartitionSpec("data")))
    if jax.process_count() == 1:  # the baseline run: moved there, as jax.jit does
        np.testing.assert_array_equal(np.asarray(g(elsewhere)), x * 2)
    else:
        try:
            g(elsewhere)
        except ValueError as e:
            assert "cannot move a committed array" in str(e), e
        else:
            raise AssertionError("a committed array on another process's devices was accepted")
    print("keys and pinned inputs over processes ok", flush=True)


def offered_values_are_not_donated() -> None:
    """A value sent to the other process and used again here afterwards (as the last use,
    by an output of its shape) is not donated: the transport holds its buffer until the
    peer pulls it, and a donation deleted it first ("CopyRawSubBufferToHost() called on
    deleted or donated buffer", about half the runs of a Linen model with task_rules)."""
    mmesh = mm.make_mesh((4, 2), ("stage", "data"))

    def f(w, x):
        with mm.task("a", stage=1):
            h = jnp.tanh(x @ w)
        with mm.task("b", stage=2):  # the other process
            r = jnp.sum(h @ w)
        with mm.task("c", stage=0):  # a round trip on this process before h's last use
            z = jnp.sum(h)
        with mm.task("d", stage=1):
            h2 = jnp.sin(h) * z
        return r, h2

    g = mm.jit(f, mesh=mmesh)
    w, x = np.eye(8, dtype=np.float32) * 0.5, np.ones((8, 8), np.float32)
    with jax.default_device(jax.local_devices()[0]):
        want = jax.jit(f)(w, x)
    for i in range(3):
        if i and jax.process_index() == 1:
            time.sleep(1.5)  # pulls late: process 0 runs past h's last use meanwhile
        got = mm.distributed.to_host(g(w, x))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6)
    print("offered values not donated ok", flush=True)


def sharded_compiles_in_parallel() -> None:
    """A data-parallel pipeline (layouts XLA chooses, so transfer shardings wait for
    compiles) compiled on several threads per process when MULTIMESH_COMPILE_THREADS
    asks: values and gradients equal the reference on this process's own device."""
    from jax.sharding import NamedSharding, PartitionSpec

    mmesh = mm.make_mesh((4, 2), ("stage", "data"))

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    rng = np.random.default_rng(1)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(4)]
    x = rng.normal(size=(16, 8)).astype(np.float32)
    batch = NamedSharding(mmesh.mesh, PartitionSpec(None, "data"))
    f = mm.jit(jax.value_and_grad(loss), mesh=mmesh, in_shardings=(None, batch))
    c = f.lower(ws, x).compile()
    val, grads = c(ws, x)
    with jax.default_device(jax.local_devices()[0]):
        want_v, want_g = jax.jit(jax.value_and_grad(loss))(ws, x)
    np.testing.assert_allclose(float(mm.distributed.to_host(val)), float(want_v), rtol=1e-6)
    for g, w in zip(mm.distributed.to_host(grads), want_g):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    threads = c.compile_stats["threads"]
    print(f"sharded pipeline ok, compiled on {threads} threads", flush=True)


def mismatched_placement() -> None:
    """Process 0 passes a host value, process 1 an array committed to stage 1: the plans
    differ, which must be a clear error (not a hang in unpaired transfers)."""
    from jax.sharding import NamedSharding, PartitionSpec

    mmesh = mm.make_mesh((2, 4), ("stage", "data"))
    x = np.ones(8, np.float32)
    if jax.process_index() == 1:
        devs = np.asarray(mmesh.mesh.devices)[1]
        x = jax.device_put(x, NamedSharding(jax.sharding.Mesh(devs, ("data",)), PartitionSpec()))
    f = mm.jit(lambda v: mm.task(lambda u: u * 2, name="t", stage=0)(v), mesh=mmesh)
    f(x)


def checkpoint_misuse(d: str) -> None:
    """A per-process value that differs between processes is refused by name (a
    checkpoint kept one process's silently); a save on process 0 only is a clear error
    on it once process 1 exits (it waited at a barrier for 30 minutes)."""
    mmesh = mm.make_mesh((2, 4), ("stage", "data"))
    f = mm.jit(lambda x: mm.task(lambda v: v * 2, name="t", stage=1)(x), mesh=mmesh)
    ws = f(np.ones(8, np.float32))
    me = jax.process_index()
    same = {"ws": ws, "lr": np.float32(0.1), "step": 3, "name": "run"}
    mm.checkpoint.save(os.path.join(d, "same"), same)
    local = jax.device_put(np.full(4, float(me), np.float32), jax.local_devices()[0])
    for k, v in (("loc", jnp.full(4, float(me))), ("tag", f"rank{me}"), ("dev", local)):
        try:
            mm.checkpoint.save(os.path.join(d, f"local-{k}"), {"ws": ws, k: v})
        except ValueError as e:
            assert f"['{k}']" in str(e) and "differ between" in str(e), e
            print("process-local values refused", k, flush=True)
    try:  # one directory per process is not one checkpoint: refused, not a hang
        mm.checkpoint.save(os.path.join(d, f"rank{me}"), {"ws": ws})
    except ValueError as e:
        assert "save to the same path on every process" in str(e), e
        print("per-process paths refused", flush=True)
    for step in (1, 2):  # a second manager on the same directory (it failed: key reused)
        with mm.checkpoint.CheckpointManager(os.path.join(d, "two")) as m2:
            m2.save(step, {"ws": ws})
    print("second manager ok", flush=True)
    # process 1 goes on without saving (it does not exit): process 0 says so on stderr
    # after MULTIMESH_WAIT_NOTICE s and fails after MULTIMESH_PLAN_TIMEOUT s
    os.environ.update(MULTIMESH_WAIT_NOTICE="2", MULTIMESH_PLAN_TIMEOUT="6")
    if me == 0:
        try:
            mm.checkpoint.save(os.path.join(d, "only0"), {"ws": ws})
        except RuntimeError as e:
            assert "process 1 did not take part within 6 s" in str(e), e
            print("skipped save timed out", flush=True)
    else:
        time.sleep(9)
    del os.environ["MULTIMESH_WAIT_NOTICE"], os.environ["MULTIMESH_PLAN_TIMEOUT"]
    man = mm.checkpoint.CheckpointManager(os.path.join(d, "man"))
    if me == 1:
        sys.exit(0)
    man.save(1, {"ws": ws})


def diverging_calls(which: str) -> None:
    mmesh = mm.make_mesh((2, 4), ("stage", "data"))

    def make(k):
        def loss(ws, x):
            with mm.task("a", stage=0):
                h = jnp.tanh(x @ ws[0]) * k  # k: the same plan text, another program
            with mm.task("b", stage=1):
                return jnp.mean((h @ ws[1]) ** 2)

        def step(ws, x):
            v, g = jax.value_and_grad(loss)(ws, x)
            return [w - 0.1 * d for w, d in zip(ws, g)], v

        return mm.jit(step, mesh=mmesh)

    f, g = make(1.0), make(2.0)
    ws = [np.eye(8, dtype=np.float32)] * 2
    t0 = time.monotonic()
    for i in range(4):
        odd = i == 2 and jax.process_index() == 1
        n = 16 if odd and which == "diverge-shape" else 8
        for h in (g, f) if odd and which == "diverge-order" else (f, g):
            ws, v = h(ws, np.ones((n, 8), np.float32))
        print("step", i, float(mm.distributed.to_host(v)), flush=True)
    print(f"diverged calls ran to the end after {time.monotonic() - t0:.0f} s", flush=True)


def callback_fails() -> None:
    """A callback on stage 0 (process 0) raises. First after stage 1's data came in
    (nothing owed to process 1): process 1's ``to_host`` of the output gets the error.
    Then before stage 0 sends its data: process 1 waited for it forever; it now stops
    with process 0's error within seconds."""
    from jax.experimental import io_callback

    mmesh = mm.make_mesh((2, 1), ("stage", "data"))

    def bad(v):
        raise RuntimeError("callback failed on purpose")

    def late(x):
        with mm.task("b", stage=1):
            h = jnp.sin(x)
        with mm.task("a", stage=0):
            return io_callback(bad, jax.ShapeDtypeStruct(x.shape, x.dtype), h)

    def early(x):
        with mm.task("a", stage=0):
            h = io_callback(bad, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        with mm.task("b", stage=1):
            return jnp.sin(h) + 1

    x = np.ones(8, np.float32)
    for f in (late, early):
        t0 = time.monotonic()
        try:
            mm.distributed.to_host(mm.jit(f, mesh=mmesh)(x))
            print(f"{f.__name__}: no error", flush=True)
        except Exception as e:  # noqa: BLE001 - what each process is told
            print(f"{f.__name__} raised: {e}", flush=True)
            for note in getattr(e, "__notes__", ()):
                print(f"{f.__name__} note: {note}", flush=True)
        print(f"{f.__name__} took {time.monotonic() - t0:.0f} s", flush=True)
    time.sleep(60)  # process 1 stops meanwhile, and the launcher stops this one


def callback_fails_ppermute() -> None:
    """The ppermute transport pairs transfers in call order: process 0's failed call
    sent nothing, so its next call's transfers paired with the failed one's on process
    1 (a wrong value there, read before it was stopped). Process 0 makes no later call
    over those processes now (a clear error), and process 1 stops."""
    from jax.experimental import io_callback

    from multimesh.runtime import transport

    transport.set_transport("ppermute")
    mmesh = mm.make_mesh((2, 1), ("stage", "data"))

    def check(v):
        if float(np.max(v)) > 100:
            raise RuntimeError("callback failed on purpose")
        return v

    def f(x):
        with mm.task("a", stage=0):
            h = io_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        with mm.task("b", stage=1):
            return jnp.sin(h) + 1

    g = mm.jit(f, mesh=mmesh)
    x = np.ones(8, np.float32)
    print("first", mm.distributed.to_host(g(x))[0], flush=True)
    try:
        print("failed call value", mm.distributed.to_host(g(x * 200))[0], flush=True)
    except Exception as e:  # noqa: BLE001 - process 0's failure: it goes on
        print(f"failed call raised: {str(e)[:100]}", flush=True)
    try:
        print("next call value", mm.distributed.to_host(g(x * 2))[0], flush=True)
    except RuntimeError as e:
        print(f"next call raised: {e}", flush=True)
    time.sleep(60)  # process 1 stops meanwhile, and the launcher stops this one


def callbacks_both_fail() -> None:
    """Both stages' callbacks fail in the same call, each before sending the other its
    data; both catch it. Neither waits for that call's data (their own call failed), so
    both go on: later calls are right and the job ends well (both were stopped)."""
    from jax.experimental import io_callback

    mmesh = mm.make_mesh((2, 1), ("stage", "data"))

    def check(v):
        if float(np.max(np.abs(v))) > 100:
            raise RuntimeError(f"callback failed on process {jax.process_index()}")
        return v

    def f(x):
        with mm.task("a", stage=0):
            a = io_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype), jnp.tanh(x) * x)
        with mm.task("b", stage=1):
            b = io_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype), jnp.sin(x) * x)
        with mm.task("c", stage=0):
            c = a + b
        with mm.task("d", stage=1):
            d = a - b
        return c, d

    g = mm.jit(f, mesh=mmesh)
    for k in (1.0, 200.0, 2.0, 3.0):
        x = np.full((4,), k, np.float32)
        try:
            c, d = mm.distributed.to_host(g(x))
        except Exception:  # noqa: BLE001 - the failing call, on both
            print(f"call with {k} failed", flush=True)
            continue
        np.testing.assert_allclose(c, np.tanh(x) * x + np.sin(x) * x, rtol=1e-6)
        np.testing.assert_allclose(d, np.tanh(x) * x - np.sin(x) * x, rtol=1e-6)
    time.sleep(8)  # the peers' watch looks every 5 s: neither is stopped
    print("both went on", flush=True)


def slow_compile() -> None:
    """Process 1 compiles 35 s longer than process 0; the program's first collective
    spans both (one submesh over the 2 processes). JAX's CPU collectives connect the
    processes at that collective and give up after 30 s: process 0, which ran first,
    failed ("Gloo context initialization failed"). It now waits until both compiled.
    Then process 1's compile fails: process 0 stops with its error, not a timeout."""
    from jax.sharding import PartitionSpec

    from multimesh.runtime import executor

    mmesh = mm.make_mesh((1, 2), ("stage", "data"))
    orig = executor.Executable.__init__
    slow = {"s": 35.0 if jax.process_index() == 1 else 0.0, "fail": False}

    def patched(self, *a, **k):
        time.sleep(slow["s"])
        if slow["fail"]:
            raise RuntimeError("compile failed on purpose")
        orig(self, *a, **k)

    executor.Executable.__init__ = patched

    def f(x):
        with mm.task("a", stage=0):
            x = jax.lax.with_sharding_constraint(x, PartitionSpec("data"))
            return jnp.sum(jnp.sin(x))

    x = np.arange(8, dtype=np.float32)
    g = mm.jit(f, mesh=mmesh)
    got = float(mm.distributed.to_host(g(x)))
    np.testing.assert_allclose(got, np.sin(x).sum(), rtol=1e-5)
    print("slow compile ok", flush=True)
    slow.update(s=0.0, fail=jax.process_index() == 1)
    try:
        g(np.ones((4, 8), np.float32))
    except Exception as e:  # noqa: BLE001 - printed for the test
        print("failed compile raised:", str(e).splitlines()[0], flush=True)


def main() -> None:
    out = sys.argv[1]
    which = sys.argv[2] if len(sys.argv) > 2 else "all"
    forever = "--forever" in sys.argv
    if os.environ.get("MP_WORKER_DUMP_AFTER"):  # a hang prints every thread's stack, exits
        faulthandler.dump_traceback_later(float(os.environ["MP_WORKER_DUMP_AFTER"]), exit=True)
    print(f"pid {os.getpid()} process {jax.process_index()} of {jax.process_count()}", flush=True)
    if forever:  # for the failure tests: train until killed
        while True:
            print("loss", mlp_program("1f1b")[0][-1], flush=True)
    results: dict[str, np.ndarray] = {}
    programs = []
    if which in ("mlp", "all"):
        programs += [(f"mlp-{s}", mlp_program, s) for s in SCHEDULES]
    if which in ("gpt", "all"):
        programs += [("gpt-1f1b", gpt_program, "1f1b")]
    if which == "quick":
        programs = [("mlp-1f1b", mlp_program, "1f1b")]
    if which in ("ckpt-save", "ckpt-resume"):
        programs = [(which, lambda d: checkpoint_program(d, which == "ckpt-resume"), sys.argv[3])]
    if which == "mismatch":
        mismatched_placement()
    if which == "static-mismatch":
        # out_shardings on the other process's devices: the same clear error on both
        from jax.sharding import NamedSharding, PartitionSpec

        m = mm.make_mesh((4, 2), ("stage", "data"))  # stages 0, 1 on process 0
        g = mm.jit(
            lambda x: mm.task(lambda v: v * 2, name="a", stage=0)(x),
            mesh=m,
            out_shardings=NamedSharding(m.submesh(3), PartitionSpec()),
        )
        try:
            g(np.ones(4, np.float32))
        except ValueError as e:
            print("out_shardings refused:", str(e).split(". A multi-process")[0], flush=True)
        # n differs: it shows in no plan text (x * n)
        f = mm.jit(
            lambda x, n: mm.task(lambda v: v + n, name="b", stage=1)(
                mm.task(lambda v: v * n, name="a", stage=0)(x)
            ),
            mesh=mm.make_mesh((2, 4), ("stage", "data")),
            static_argnums=1,
        )
        f(np.ones(8, np.float32), 3 if jax.process_index() == 1 else 4)
    if which == "diverge-oneway":
        # transfers one way only (stage 0 to 1): nothing ever waits, so swapped calls
        # ran to the end with values paired across programs; the end compares the calls
        mmesh = mm.make_mesh((2, 4), ("stage", "data"))

        def fwd(k):
            def f(x):
                with mm.task("a", stage=0):
                    h = jnp.tanh(x) * k
                with mm.task("b", stage=1):
                    return h + 1.0

            return mm.jit(f, mesh=mmesh)

        f, g = fwd(1.0), fwd(2.0)
        x = np.ones(8, np.float32)
        for i in range(3):
            for h in (g, f) if i == 1 and jax.process_index() == 1 else (f, g):
                h(x)
        print("one-way calls ran to the end", flush=True)
    if which == "aot-ahead":
        # the same calls everywhere, but process 0 compiles the batch-16 program ahead of
        # time while process 1 (which only sends) goes on calling the batch-8 one: not a
        # divergence (it was taken for one: "ran call 2 ... compiled before")
        mmesh = mm.make_mesh((2, 4), ("stage", "data"))

        def rev(x):
            with mm.task("b", stage=1):
                y = jnp.sin(x)
            with mm.task("a", stage=0):
                return y * 2

        f = mm.jit(rev, mesh=mmesh)
        x8, x16 = np.ones((8, 4), np.float32), np.ones((16, 4), np.float32)
        f(x8)
        if jax.process_index() == 0:
            f.lower(x16).compile()
        for _ in range(3):
            f(x8)
            if jax.process_index() == 1:
                time.sleep(1.5)
        # a new program on both: process 0's compile ahead of time took its plan's
        # turn, and the plans were "different" (the compile is its own business now,
        # compared when it first runs)
        x4 = np.ones((4, 4), np.float32)
        np.testing.assert_allclose(mm.distributed.to_host(f(x4)), np.sin(x4) * 2, rtol=1e-6)
        y = f(x16)
        np.testing.assert_allclose(mm.distributed.to_host(y), np.sin(x16) * 2, rtol=1e-6)
        print("compiled ahead ok", flush=True)
    if which == "slow-compile":
        slow_compile()
    if which == "callback-fails":
        callback_fails()
    if which == "callback-fails-ppermute":
        callback_fails_ppermute()
    if which == "callbacks-both-fail":
        callbacks_both_fail()
    if which in ("diverge-shape", "diverge-order"):
        # rank 1 makes other calls at its third step (a new shape; two programs swapped):
        # a clear error within seconds on both, not a wait of MULTIMESH_PLAN_TIMEOUT
        diverging_calls(which)
    if which == "plan-timeout":  # only rank 0 calls: it must not wait forever
        os.environ.update(MULTIMESH_PLAN_TIMEOUT="5", MULTIMESH_WAIT_NOTICE="2")
        if jax.process_index() == 0:
            f = mm.jit(
                lambda x: mm.task(lambda v: v * 2, name="t", stage=1)(x),
                mesh=mm.make_mesh((2, 4), ("stage", "data")),
            )
            f(np.ones(8, np.float32))
        else:
            time.sleep(30)
    if which in ("raise", "exit"):  # rank 1 fails after a call; rank 0 then waits for it
        f = mm.jit(
            lambda x: mm.task(lambda v: v * 2, name="t", stage=0)(x),
            mesh=mm.make_mesh((2, 4), ("stage", "data")),
        )
        f(np.ones(8, np.float32))  # starts this process's to_host service
        if jax.process_index() == 1 and which == "exit":
            sys.stdout.buffer.write(b"\xff not utf-8\n")  # must not stop the launcher
            sys.stdout.flush()
            sys.exit(3)  # SystemExit: exit handlers run (no excepthook)
        if jax.process_index() == 1:
            raise RuntimeError("rank 1 fails on purpose")
        f(np.ones(16, np.float32))  # a new plan: waits for rank 1's, which never comes
    if which == "exit-mid":  # rank 1 leaves a training loop; rank 0 still sends to it
        mmesh = mm.make_mesh((2, 4), ("stage", "data"))

        def loss(ws, x):
            with mm.task("a", stage=0):
                h = jnp.tanh(x @ ws[0])
            with mm.task("b", stage=1):
                return jnp.mean((h @ ws[1]) ** 2)

        def step(ws, x):
            g = jax.grad(loss)(ws, x)
            return [w - 0.1 * d for w, d in zip(ws, g)]

        f = mm.jit(step, mesh=mmesh)
        ws = [np.eye(8, dtype=np.float32)] * 2
        for i in range(6):
            if i == 2 and jax.process_index() == 1:
                sys.exit(3)
            ws = f(ws, np.ones((8, 8), np.float32))
            print("step", i, flush=True)
    if which == "ckpt-misuse":
        checkpoint_misuse(os.path.dirname(os.path.abspath(out)))
    if which == "layout":  # a submesh split over processes that hold another one too
        mmesh = mm.make_mesh((3, 2), ("stage", "data"))
        # ... that no task uses: not in the way
        r = mm.jit(lambda x: mm.task(lambda v: v * 2, name="t", stage=1)(x), mesh=mmesh)(
            np.ones(4, np.float32)
        )
        assert (mm.distributed.to_host(r) == 2).all()
        print("unused submesh ok", flush=True)
        # ... unless out_shardings sends an output there
        from jax.sharding import NamedSharding, PartitionSpec

        to1 = NamedSharding(mmesh.submesh(1), PartitionSpec())
        try:
            mm.jit(
                lambda x: mm.task(lambda v: v * 2, name="t", stage=2)(x),
                mesh=mmesh,
                out_shardings=to1,
            )(np.ones(4, np.float32))
        except ValueError as e:
            assert "unsupported multi-process layout" in str(e), e
            print("out_shardings onto it refused", flush=True)

        def both(x):
            y = mm.task(lambda v: v * 2, name="t0", stage=0)(x)
            return mm.task(lambda v: v + 1, name="t1", stage=1)(y)

        mm.jit(both, mesh=mmesh)(np.ones(4, np.float32))
    for name, fn, sched in programs:
        losses, leaves = fn(sched)
        print(name, "losses", losses, flush=True)
        results[f"{name}/losses"] = np.asarray(losses)
        for k, leaf in enumerate(leaves):
            results[f"{name}/leaf{k}"] = leaf
    if jax.process_index() == 0:
        np.savez(out, **results)
    if which == "quick":
        replicated_outputs_and_keys()
        keys_onto_a_submesh_over_processes()
        keys_between_processes()
        keys_and_pinned_inputs_over_processes()
        offered_values_are_not_donated()
        sharded_compiles_in_parallel()
    if which == "quick" and jax.process_index() == 0:
        # a program on this process's devices only: no other process takes part
        local = mm.make_mesh((2, 2), ("stage", "data"), devices=jax.local_devices()[:4])
        g = mm.jit(lambda x: mm.task(lambda v: v + 1, name="t", stage=1)(x), mesh=local)
        r = g(np.ones(4, np.float32))
        assert all((np.asarray(s.data) == 2).all() for s in r.addressable_shards)
        print("local-only ok", flush=True)
    if which == "quick" and jax.process_index() == 0:
        # one-sided: only this process asks, wherever the value lives
        f = mm.jit(
            lambda x: mm.task(lambda v: v.sum(), name="last", stage=3)(x),
            mesh=mm.make_mesh((4, 2), ("stage", "data")),
        )
        print("one-sided", mm.distributed.to_host(f(np.arange(8.0, dtype=np.float32))))
    elif which == "quick":
        f = mm.jit(
            lambda x: mm.task(lambda v: v.sum(), name="last", stage=3)(x),
            mesh=mm.make_mesh((4, 2), ("stage", "data")),
        )
        f(np.arange(8.0, dtype=np.float32))
    print("done", flush=True)


if __name__ == "__main__":
    main()
