"""Pipelining: mm.microbatch under mm.jit equals the jax.jit reference for every schedule."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, mlp_loss, reference, stage_of

import multimesh as mm
from multimesh import schedules as S

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h1"]


def mlp(num_task_stages):
    return mlp_loss  # one task per weight: as many stages as weights


def weights(n, width=8, seed=0):
    ks = jax.random.split(jax.random.key(seed), n)
    return [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in ks]


def data(batch, width=8):
    x = jax.random.normal(jax.random.key(11), (batch, width))
    return x, jnp.sin(x)


def stage_mesh(n):
    return mm.make_mesh((n,), ("stage",), devices=jax.devices()[:n])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_mlp_schedules_match_reference(schedule, stages, m):
    if schedule == "interleaved-1f1b" and m % stages:
        pytest.skip("interleaving needs M divisible by the number of submeshes")
    mmesh = stage_mesh(stages)
    n = 2 * stages if schedule == "interleaved-1f1b" else stages
    ws = weights(n)
    x, y = data(8)
    g = mm.microbatch(
        jax.value_and_grad(mlp(n)), m, argnums=(1, 2), schedule=schedule, reduce="mean"
    )
    got = mm.jit(g, mesh=mmesh)(ws, x, y)
    assert_close(got, reference(g, mmesh, ws, x, y), rtol=1e-5, atol=1e-6)
    assert [stage_of(gw, mmesh) for gw in got[1]] == [i % stages for i in range(n)]


def test_plan_follows_schedule():
    mmesh = stage_mesh(4)
    ws = weights(4)
    x, y = data(16)
    for name, sched in [("1f1b", S.OneFOneB()), ("gpipe", S.GPipe())]:
        g = mm.microbatch(jax.value_and_grad(mlp(4)), 8, argnums=(1, 2), schedule=sched)
        plan = mm.jit(g, mesh=mmesh).lower(ws, x, y).plan
        want = sched.build(4, 8)
        for s in range(4):
            acts = [a for f in plan.frags if f.stage == s for a in f.actions]
            assert acts == want[s], name


def test_identical_microbatch_fragments_share_executables():
    mmesh = stage_mesh(4)
    g = mm.microbatch(jax.value_and_grad(mlp(4)), 8, argnums=(1, 2), schedule="1f1b")
    x, y = data(16)
    compiled = mm.jit(g, mesh=mmesh).lower(weights(4), x, y).compile()
    assert compiled.num_executables < len(compiled.plan.fragments) / 2


def test_microbatch_function_traced_once():
    """Under mm.jit the microbatch function is traced once (as the reference scan's body
    is), not once per microbatch; values and gradients still equal the reference."""
    mmesh = stage_mesh(4)
    calls = []
    inner = mlp(4)

    def loss(ws, x, y, *, scale):
        calls.append(1)
        return inner(ws, x, y) * scale

    g = mm.microbatch(jax.value_and_grad(loss), 8, argnums=(1, 2), schedule="1f1b")
    step = lambda ws, x, y: g(ws, x, y, scale=2.0)  # noqa: E731 - kwargs reach the body
    ws = weights(4)
    x, y = data(16)
    got = mm.jit(step, mesh=mmesh)(ws, x, y)
    assert len(calls) == 1
    assert_close(got, reference(step, mmesh, ws, x, y), rtol=1e-5, atol=1e-6)


def test_transformer_with_dp_tp_inside_stages(mesh222):
    d, seq, batch = 8, 4, 8

    def block(p, x):
        h = x - x.mean(-1, keepdims=True)
        att = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", h @ p["q"], h @ p["k"]) / np.sqrt(d), -1)
        x = x + jnp.einsum("bqk,bkd->bqd", att, h @ p["v"])
        u = jax.lax.with_sharding_constraint(jax.nn.gelu(x @ p["w1"]), jax.P("data", None, "model"))
        return x + u @ p["w2"]

    def loss(ps, x):
        for i, p in enumerate(ps):
            with mm.task(f"b{i}", stage=i):
                x = block(p, x)
        return (x**2).mean()

    def init(k):
        ks = jax.random.split(k, 5)
        shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "w1": (d, 4 * d), "w2": (4 * d, d)}
        return {n: jax.random.normal(kk, s) * 0.2 for kk, (n, s) in zip(ks, shapes.items())}

    ps = [init(k) for k in jax.random.split(jax.random.key(0), 2)]
    x = jax.random.normal(jax.random.key(1), (batch, seq, d))
    for schedule in ["1f1b", "zero-bubble-h1"]:
        g = mm.microbatch(jax.value_and_grad(loss), 2, argnums=1, schedule=schedule)
        assert_close(
            mm.jit(g, mesh=mesh222)(ps, x), reference(g, mesh222, ps, x), rtol=2e-5, atol=2e-6
        )


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1", "interleaved-1f1b"])
def test_training_steps_match(schedule, mesh4x2):
    n = 4 if schedule != "interleaved-1f1b" else 8
    mmesh = stage_mesh(4) if schedule == "interleaved-1f1b" else mesh4x2
    opt = optax.adam(1e-2)
    grad_fn = mm.microbatch(
        jax.value_and_grad(mlp(n)), 4, argnums=(1, 2), schedule=schedule, reduce="mean"
    )

    def step(ws, st, x, y):
        val, grads = grad_fn(ws, x, y)
        up, st = opt.update(grads, st, ws)
        return optax.apply_updates(ws, up), st, val

    ws = weights(n)
    st = opt.init(ws)
    x, y = data(8)
    mstep = mm.jit(step, mesh=mmesh)
    jstep = jax.jit(step)
    mw, ms, rw, rs = ws, st, ws, st
    for _ in range(3):
        mw, ms, ml = mstep(mw, ms, x, y)
        with mmesh:
            rw, rs, rl = jstep(rw, rs, x, y)
        assert_close((ml, mw, ms), (rl, rw, rs), rtol=1e-5, atol=1e-6)


def test_measured_memory_1f1b_bounded_gpipe_grows(tmp_path):
    mmesh = stage_mesh(4)
    # wide activations, so that they (not the input slices) dominate live memory
    ks = jax.random.split(jax.random.key(0), 4)
    ws = [jax.random.normal(ks[0], (8, 64)) / 3] + [
        jax.random.normal(k, (64, 64)) / 8 for k in ks[1:]
    ]
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jnp.ones((16, 64))

    def loss(ws, x, y):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    peaks = {}
    for m in (8, 16):
        x = jax.random.normal(jax.random.key(1), (2 * m, 8))
        y = jnp.ones((2 * m, 64))
        for schedule in ["1f1b", "gpipe"]:
            g = mm.microbatch(jax.value_and_grad(loss), m, argnums=(1, 2), schedule=schedule)
            f = mm.jit(g, mesh=mmesh)
            out, tl = f.record(ws, x, y)
            assert_close(out, reference(g, mmesh, ws, x, y))
            peaks[schedule, m] = tl
            # every action once, also where one fragment runs two (the last stage's F+B)
            acts = [e.action for row in tl.events for e in row if e.action.microbatch >= 0]
            assert sorted(acts) == sorted(
                mm.schedules.Action(s, k, p) for s in range(len(ws)) for k in range(m) for p in "FB"
            )
    tl = peaks["1f1b", 8]
    trace = tl.to_chrome_trace(str(tmp_path / "trace.json"))
    assert json.loads((tmp_path / "trace.json").read_text()) == trace
    assert all(e["dur"] >= 0 for e in trace["traceEvents"] if e["ph"] == "X")
    for m in (8, 16):
        # stage 0 holds at most S microbatches' activations (+1: the gradient accumulator)
        assert peaks["1f1b", m].peak_in_flight[0] <= 4 + 1
        assert peaks["gpipe", m].peak_in_flight[0] >= m
    # 1F1B's live memory is bounded in M; GPipe's grows with M
    b1 = [peaks["1f1b", m].peak_live_bytes[0] for m in (8, 16)]
    bg = [peaks["gpipe", m].peak_live_bytes[0] for m in (8, 16)]
    assert b1[1] <= 1.1 * b1[0], b1
    assert bg[1] >= 1.4 * bg[0], bg
    assert bg[1] > b1[1]
    tl.plot(str(tmp_path / "measured.png"))
    assert (tmp_path / "measured.png").stat().st_size > 0


def test_custom_schedule_equals_1f1b():
    mmesh = stage_mesh(2)
    order = S.OneFOneB().build(2, 4)
    custom = S.Custom([[tuple(a) for a in row] for row in order])
    ws = weights(2)
    x, y = data(8)
    g1 = mm.microbatch(jax.value_and_grad(mlp(2)), 4, argnums=(1, 2), schedule=custom)
    g2 = mm.microbatch(jax.value_and_grad(mlp(2)), 4, argnums=(1, 2), schedule="1f1b")
    assert_close(mm.jit(g1, mesh=mmesh)(ws, x, y), mm.jit(g2, mesh=mmesh)(ws, x, y))


def test_forward_only_pipeline_and_pytree_reduce():
    mmesh = stage_mesh(2)

    def f(ws, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ ws[0])
        with mm.task("b", stage=1):
            h = h @ ws[1]
        return {"sum": h.sum(), "mean": h.mean(), "count": jnp.float32(x.shape[0])}

    g = mm.microbatch(f, 4, argnums=1, reduce={"sum": "sum", "mean": "mean", "count": "sum"})
    ws, x = weights(2), data(8)[0]
    got = mm.jit(g, mesh=mmesh)(ws, x)
    assert_close(got, reference(g, mmesh, ws, x))
    np.testing.assert_allclose(float(got["count"]), 8.0)


# --- errors ---------------------------------------------------------------------------


def test_batch_not_divisible():
    g = mm.microbatch(lambda x: x.sum(), 3)
    with pytest.raises(ValueError, match="batch size 8 along axis 0.*3 microbatches"):
        mm.jit(g, mesh=stage_mesh(2))(jnp.ones((8, 2)))
    with pytest.raises(ValueError, match="does not split into 3"):
        g(jnp.ones((8, 2)))
    # a NumPy int count is a count
    assert_close(mm.microbatch(lambda x: x.sum(), np.int64(2))(jnp.ones((8, 2))), jnp.float32(16))


def test_batch_sizes_must_agree():
    """x (12 rows) and y (3 rows) would each split into 3 microbatches, pairing 4 rows of
    x with 1 of y (broadcast silently): a clear error on both paths."""
    g = mm.microbatch(lambda x, y: ((x - y) ** 2).sum(), 3, argnums=(0, 1))
    x, y = jnp.ones((12, 4)), jnp.ones((3, 4))
    with pytest.raises(ValueError, match=r"argument 1 has batch size 3 .* argument 0 has 12"):
        mm.jit(g, mesh=stage_mesh(2))(x, y)
    with pytest.raises(ValueError, match="batch sizes must agree"):
        g(x, y)
    batch = {"x": jnp.ones((6, 2)), "y": jnp.ones((4, 2))}
    with pytest.raises(ValueError, match=r"argument 0\['y'\] has batch size 4"):
        mm.microbatch(lambda b: b["x"].sum() + b["y"].sum(), 2)(batch)


def test_reduce_pytree_mismatch():
    g = mm.microbatch(lambda x: (x.sum(), x.mean()), 2, reduce=("sum",))
    with pytest.raises(ValueError, match="reduce pytree .* does not match"):
        g(jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="reduce must be 'sum', 'mean'"):
        mm.microbatch(lambda x: x, 2, reduce="max")


def test_bad_schedules():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        mm.microbatch(lambda x: x, 2, schedule="pipedream")
    with pytest.raises(
        ValueError, match=r"invalid schedule: step 0 on submesh 0 \(B0@s0\).*needs F0@s0"
    ):
        S.Custom([[(0, 0, "B"), (0, 0, "F")], [(1, 0, "F"), (1, 0, "B")]]).build(2, 1)
    with pytest.raises(ValueError, match="missing"):
        S.Custom([[(0, 0, "F")], [(1, 0, "F"), (1, 0, "B")]]).build(2, 1)
    with pytest.raises(ValueError, match="appears twice"):
        S.Custom([[(0, 0, "F"), (0, 0, "F"), (0, 0, "B")], [(1, 0, "F"), (1, 0, "B")]]).build(2, 1)


def test_invalid_custom_order_in_program_is_an_error():
    mmesh = stage_mesh(2)
    bad = S.Custom([[(0, 0, "B"), (0, 0, "F")], [(1, 0, "F"), (1, 0, "B")]])
    g = mm.microbatch(jax.value_and_grad(mlp(2)), 1, argnums=(1, 2), schedule=bad)
    x, y = data(4)
    with pytest.raises(ValueError, match="invalid schedule"):
        mm.jit(g, mesh=mmesh)(weights(2), x, y)


def test_custom_order_with_a_weight_shared_by_two_stages_on_a_submesh():
    """A weight used by virtual stages 1 and 3 (both on submesh 1) has its gradient
    summed in stage 1's W; this order runs W1@s1 before W1@s3, which the summing needs.
    mm.jit refused it as a deadlock, naming a step it did not print (found by a
    fuzzer); the sum now runs with the later W, the order is kept, the values match."""

    def F(s, m):
        return (s, m, "F")

    def B(s, m):
        return (s, m, "B")

    def W(s, m):
        return (s, m, "W")

    row0 = [F(0, 0), F(0, 1), F(0, 2), F(0, 3), F(2, 0), B(2, 0), W(2, 0), B(0, 0), W(0, 0)]
    row0 += [F(2, 1), F(2, 2), F(2, 3), B(2, 1), B(2, 2), W(2, 1), W(2, 2), B(2, 3), B(0, 1)]
    row0 += [B(0, 2), B(0, 3), W(2, 3), W(0, 1), W(0, 2), W(0, 3)]
    row1 = [F(1, 0), F(3, 0), B(3, 0), W(3, 0), B(1, 0), W(1, 0), F(1, 1), F(1, 2), F(1, 3)]
    row1 += [F(3, 1), F(3, 2), B(3, 1), B(3, 2), F(3, 3), B(1, 1), B(1, 2), B(3, 3), W(1, 1)]
    row1 += [B(1, 3), W(1, 2), W(3, 1), W(1, 3), W(3, 2), W(3, 3)]
    order = S.Custom([row0, row1])

    def loss(ws, shared, x, y):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = jnp.tanh(h @ w)
                if i in (1, 3):
                    h = h + 0.3 * jnp.tanh(h @ shared)
        return jnp.mean((h - y) ** 2)

    mmesh = stage_mesh(2)
    ws, (shared,) = weights(4), weights(1, seed=5)
    x, y = data(8)
    g = mm.microbatch(
        jax.value_and_grad(loss, argnums=(0, 1)),
        4,
        argnums=(2, 3),
        schedule=order,
        reduce="mean",
    )
    f = mm.jit(g, mesh=mmesh)
    assert_close(f(ws, shared, x, y), reference(g, mmesh, ws, shared, x, y), rtol=1e-5, atol=1e-6)
    plan = f.lower(ws, shared, x, y).plan
    for s, row in enumerate((row0, row1)):  # in the given order (stage 0's B is empty)
        acts = [tuple(a) for fr in plan.frags if fr.stage == s for a in fr.actions]
        assert acts == [a for a in row if a in acts] and len(acts) >= len(row) - 4, s
        assert W(1, 1) in acts or s == 0


def test_interleaving_errors():
    mmesh = stage_mesh(2)
    x, y = data(8)
    g = mm.microbatch(jax.value_and_grad(mlp(3)), 2, argnums=(1, 2), schedule="interleaved-1f1b")
    with pytest.raises(ValueError, match="3 pipeline stages on the 2 submeshes"):
        mm.jit(g, mesh=mmesh)(weights(3), x, y)
    g = mm.microbatch(jax.value_and_grad(mlp(4)), 3, argnums=(1, 2), schedule="interleaved-1f1b")
    with pytest.raises(ValueError, match="divisible"):
        mm.jit(g, mesh=mmesh)(weights(4), jnp.ones((6, 8)), jnp.ones((6, 8)))
    g = mm.microbatch(jax.value_and_grad(mlp(4)), 2, argnums=(1, 2), schedule="1f1b")
    with pytest.raises(ValueError, match="out of range"):
        mm.jit(g, mesh=mmesh)(weights(4), x, y)

    # tasks on 3 of 4 submeshes, two stages on each: M=4 divides the mesh's 4 (the
    # message said "the number of submeshes (3)")
    def loss(ws, x, y):
        h = x
        for i, st in enumerate([0, 2, 3, 4, 6, 7]):
            with mm.task(f"t{i}", stage=st):
                h = h + jnp.tanh(h @ ws[i])
        return jnp.mean((h - y) ** 2)

    g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=(1, 2), schedule="interleaved-1f1b")
    with pytest.raises(ValueError, match=r"submeshes the pipeline's tasks use \(3\)"):
        mm.jit(g, mesh=stage_mesh(4))(weights(6), x, y)
    # one stage per submesh: 1F1B, which takes any M
    g = mm.microbatch(jax.value_and_grad(mlp(2)), 3, argnums=(1, 2), schedule="interleaved-1f1b")
    w2, x6, y6 = weights(2), jnp.ones((6, 8)), jnp.ones((6, 8))
    assert_close(mm.jit(g, mesh=mmesh)(w2, x6, y6), reference(g, mmesh, w2, x6, y6), rtol=1e-5)


def test_virtual_stages_outside_the_interleaved_loop_of_the_same_step():
    """The same interleaved model evaluated after (and before) its loop in one step: its
    virtual stages go to submesh i % S there too, as under jax.jit (was "stage=2 is out
    of range" from the task, before the program's loops were known). A stage >= S in a
    program without an interleaved loop stays an error."""
    mmesh = stage_mesh(2)
    x, y = data(8)
    g = mm.microbatch(jax.value_and_grad(mlp_loss), 2, argnums=(1, 2), schedule="interleaved-1f1b")

    def step(ws, x, y):
        before = mlp_loss(ws, x, y)
        v, gr = g(ws, x, y)
        ws = [w - 0.1 * d for w, d in zip(ws, gr)]
        return before, v, mlp_loss(ws, x, y), ws

    ws = weights(4)
    got = mm.jit(step, mesh=mmesh)(ws, x, y)
    assert_close(got, reference(step, mmesh, ws, x, y))
    assert [stage_of(w, mmesh) for w in got[3]] == [0, 1, 0, 1]

    def beyond(ws, x, y):  # the loop uses virtual stages 0..3 (Interleaved1F1B() counts)
        v, _ = g(ws, x, y)
        with mm.task("far", stage=7):
            return v * 2

    with pytest.raises(ValueError, match=r"task 'far': stage=7 is out of range.*valid: 0..3"):
        mm.jit(beyond, mesh=mmesh)(ws, x, y)

    g1 = mm.microbatch(jax.value_and_grad(mlp_loss), 2, argnums=(1, 2), schedule="1f1b")

    def too_far(ws, x, y):  # no interleaved loop: no virtual stages
        v, _ = g1(ws[:2], x, y)
        with mm.task("far", stage=2):
            return v * 2

    with pytest.raises(ValueError, match=r"task 'far': stage=2 is out of range.*valid: 0..1"):
        mm.jit(too_far, mesh=mmesh)(ws, x, y)


def test_interleaved_tasks_next_to_each_other_on_a_submesh_are_named():
    """8 task stages on 4 submeshes visited 6, 4, 7, 3, ...: 7 and 3 follow each other
    on submesh 3 and run as one pipeline stage. The error said "6 pipeline stages on 4
    submeshes" and to use a multiple of 4 task stages (there are 8)."""
    order = [6, 4, 7, 3, 0, 5, 1, 2]

    def loss(ws, x, y):
        h = x
        for i, (st, w) in enumerate(zip(order, ws)):
            with mm.task(f"t{i}", stage=st):
                h = h + jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=(1, 2), schedule="interleaved-1f1b")
    x, y = data(8)
    with pytest.raises(
        ValueError,
        match=r"straight to another on the same submesh.*8 task "
        r"stages make 6 pipeline stages on the 4 submesh\(es\)",
    ):
        mm.jit(g, mesh=stage_mesh(4))(weights(8), x, y)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_grad_outside_the_microbatch_loop(schedule):
    mmesh = stage_mesh(2)
    n = 4 if schedule == "interleaved-1f1b" else 2
    ws = weights(n)
    x, y = data(8)
    g = jax.value_and_grad(
        mm.microbatch(mlp(n), 4, argnums=(1, 2), schedule=schedule, reduce="mean")
    )
    got = mm.jit(g, mesh=mmesh)(ws, x, y)
    assert_close(got, reference(g, mmesh, ws, x, y), rtol=1e-5, atol=1e-6)
    assert [stage_of(gw, mmesh) for gw in got[1]] == [i % 2 for i in range(n)]


@pytest.mark.parametrize("reduce", ["mean", "stack"])
def test_grad_outside_of_a_nonlinear_function_of_the_loop(reduce):
    """jax.grad outside mm.microbatch of log(loss**2): every microbatch's backward needs
    the seed computed from the whole loop's output. GPipe (every forward before any
    backward) runs it; schedules that start backwards earlier are a clear error."""
    mmesh = stage_mesh(2)
    ws = weights(2)
    x, y = data(6)

    def fn(schedule):
        mb = mm.microbatch(mlp(2), 3, argnums=(1, 2), schedule=schedule, reduce=reduce)
        return jax.value_and_grad(lambda ws, x, y: jnp.log(jnp.sum(mb(ws, x, y) ** 2)))

    g = fn("gpipe")
    got = mm.jit(g, mesh=mmesh)(ws, x, y)
    assert_close(got, reference(g, mmesh, ws, x, y), rtol=1e-5, atol=1e-6)
    assert [stage_of(gw, mmesh) for gw in got[1]] == [0, 1]
    for schedule in ("1f1b", "zero-bubble-h1"):
        with pytest.raises(ValueError, match=r"whole output.*schedule='gpipe'"):
            mm.jit(fn(schedule), mesh=mmesh).lower(ws, x, y)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h1"])
def test_grad_of_a_microbatched_gradient_is_a_clear_error(schedule):
    """Second order through a loop (jax.grad of a function of a microbatched gradient)
    cannot be ordered by any schedule: every schedule's error says so (GPipe's claimed
    GPipe does not run every forward first; 1F1B's sent the user to GPipe)."""
    mmesh = stage_mesh(2)
    ws = weights(2)
    x, y = data(4)

    def gg(ws, x, y):
        inner = mm.microbatch(jax.grad(mlp(2)), 2, argnums=(1, 2), schedule=schedule)
        return jax.grad(lambda ws: sum(jnp.sum(g**2) for g in inner(ws, x, y)))(ws)

    with pytest.raises(ValueError, match=r"no schedule can order.*second-order differentiation"):
        mm.jit(gg, mesh=mmesh).lower(ws, x, y)


@pytest.mark.parametrize("combine", ["log", "sqrt", "both"])
def test_grad_outside_two_loops_each_non_linear(combine):
    """jax.grad outside two loops combined as ``log(l1) + l2`` (each loop's seed needs
    only its own loop): GPipe orders it (loop 1 forward, its seed, its backward, loop 2).
    The first loop's seed work was merged with the second loop's sum, which then needed
    loop 2 and fed loop 1: refused (found by a probe). ``l1 * l2`` stays a clear error."""
    mmesh = stage_mesh(2)
    ws = weights(2)
    x, y = data(8)
    mb = mm.microbatch(mlp(2), 2, argnums=(1, 2), schedule="gpipe")

    def loss(ws, x, y):
        l1, l2 = mb(ws, x, y), mb(ws, 2 * x, y)
        if combine == "log":
            return jnp.log(l1) + l2
        if combine == "sqrt":
            return jnp.sqrt(l1) + 3 * l2
        return jnp.log(l1) + jnp.log(l2)

    g = jax.value_and_grad(loss)
    got = mm.jit(g, mesh=mmesh)(ws, x, y)
    assert_close(got, reference(g, mmesh, ws, x, y), rtol=1e-5, atol=1e-6)
    prod = jax.grad(lambda ws, x, y: mb(ws, x, y) * mb(ws, 2 * x, y))
    with pytest.raises(ValueError, match="combined non-linearly"):
        mm.jit(prod, mesh=mmesh).lower(ws, x, y)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_grad_outside_two_loops(schedule):
    """jax.grad outside two microbatch loops summed: JAX adds the second loop's weight
    cotangents into the first loop's backward; that sum runs after the loops (it was
    refused as a deadlock). A second loop fed by the first's output is a clear error."""
    mmesh = stage_mesh(2)
    ws = weights(2)
    x, y = data(8)
    mb = mm.microbatch(mlp(2), 2, argnums=(1, 2), schedule=schedule)
    g = jax.value_and_grad(lambda ws, x, y: mb(ws, x, y) + 2 * mb(ws, 2 * x, y))
    got = mm.jit(g, mesh=mmesh)(ws, x, y)
    assert_close(got, reference(g, mmesh, ws, x, y), rtol=1e-5, atol=1e-6)
    chain = jax.grad(lambda ws, x, y: mb(ws, x * mb(ws, x, y), y))
    with pytest.raises(ValueError, match="feeds the backward of an earlier one"):
        mm.jit(chain, mesh=mmesh).lower(ws, x, y)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("feed", ["weight", "batch", "grad-outside", "penalty"])
def test_second_loop_on_the_first_loops_gradient(schedule, feed):
    """Two training steps in one function: the second loop runs on weights updated with
    the first loop's gradients (or on a gradient as its batch; or the first gradient is
    taken outside its loop; or it is a penalty's, outside loops). Its forward consumed
    backward values, so every equation of it was taken for backward work: interleaving
    then refused it as a deadlock (found by probes), other schedules ran it as a
    backward. A loop's work is backward only through its own backward now."""
    mmesh = stage_mesh(2)
    n = 4 if schedule == "interleaved-1f1b" else 2
    ws = weights(n)
    x, y = data(8)
    vg = mm.microbatch(
        jax.value_and_grad(mlp(n)), 2, argnums=(1, 2), schedule=schedule, reduce="mean"
    )
    mb = mm.microbatch(mlp(n), 2, argnums=(1, 2), schedule=schedule, reduce="mean")

    def f(ws, x, y):
        if feed == "penalty":
            g1 = jax.grad(lambda ws: sum(jnp.sum(w**2) for w in ws))(ws)
            return vg([w - 0.01 * g for w, g in zip(ws, g1)], x, y)
        l1, g1 = (jax.value_and_grad(mb) if feed == "grad-outside" else vg)(ws, x, y)
        if feed == "batch":
            return l1, vg(ws, g1[0], y)
        return l1, vg([w - 0.1 * g for w, g in zip(ws, g1)], x, y)

    plan = mm.jit(f, mesh=mmesh).lower(ws, x, y).plan
    first_forwards = [fr.name for fr in plan.fragments if fr.stage == 0 and ":F0" in fr.name]
    # microbatch 0's forward of each task on submesh 0, per loop
    loops = 1 if feed == "penalty" else 2
    assert len(first_forwards) == loops * (n // 2), first_forwards
    got = mm.jit(f, mesh=mmesh)(ws, x, y)
    assert_close(got, reference(f, mmesh, ws, x, y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h1"])
@pytest.mark.parametrize("chain", ["joined", "shared", "three"])
def test_loop_input_made_from_an_earlier_loop_with_untagged_work(schedule, chain):
    """A loop's input made by untagged work from an argument and an earlier loop's
    result (``x * 0.5 + v1 * 0``): that work and the earlier loop's accumulator zeros
    were grouped (both untagged, level 0, on the last stage), so the group needed loop 1
    and fed it, and 1F1B refused the program (found by a probe)."""
    mmesh = stage_mesh(2)
    ws = weights(2)
    x, y = data(8)
    mb = mm.microbatch(jax.value_and_grad(mlp(2)), 2, argnums=(1, 2), schedule=schedule)

    def f(ws, x, y):
        z = x * 0.5
        r1 = mb(ws, z if chain == "shared" else x, y)
        r2 = mb(ws, z + r1[0] * 0, y)
        if chain != "three":
            return r1, r2
        return r1, r2, mb(ws, x * 0.25 + r2[0] * 0 + r1[0], y)

    got = mm.jit(f, mesh=mmesh)(ws, x, y)
    assert_close(got, reference(f, mmesh, ws, x, y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h1"])
@pytest.mark.parametrize("grad_outside", [False, True])
def test_stages_in_reverse_order(schedule, grad_outside):
    mmesh = stage_mesh(3)
    order = [2, 1, 0]

    def loss(ws, x, y):
        h = x
        for i, st in enumerate(order):
            with mm.task(f"t{i}", stage=st):
                h = h + jnp.tanh(h @ ws[i])
        return jnp.mean((h - y) ** 2)

    ws = weights(3)
    x, y = data(6)
    mb = lambda f: mm.microbatch(f, 3, argnums=(1, 2), schedule=schedule, reduce="mean")  # noqa: E731
    g = jax.value_and_grad(mb(loss)) if grad_outside else mb(jax.value_and_grad(loss))
    got = mm.jit(g, mesh=mmesh)(ws, x, y)
    assert_close(got, reference(g, mmesh, ws, x, y), rtol=1e-5, atol=1e-6)
    assert [stage_of(gw, mmesh) for gw in got[1]] == order


def test_microbatch_negative_axis(mesh4x2):
    def loss(w, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(w @ x)  # batch on the last axis
        with mm.task("b", stage=1):
            return (h**2).mean()

    w = weights(1)[0]
    x = jax.random.normal(jax.random.key(3), (8, 12))
    g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1, axis=-1, reduce="mean")
    want = jax.value_and_grad(loss)(w, x)
    assert_close(g(w, x), want, rtol=1e-5)  # the reference loop, no MultiMesh
    assert_close(mm.jit(g, mesh=mesh4x2)(w, x), want, rtol=1e-5)


def test_microbatch_python_scalar_and_weak_outputs(mesh4x2):
    """A Python float among the outputs sums in the reference too (it failed there), and
    with one microbatch a weakly typed output is strongly typed on both paths, as a sum
    into zeros (found by a probe)."""
    w = jnp.ones((8, 8)) / 8
    xb = jnp.ones((8, 8))

    def f(w, xb):
        with mm.task("a", stage=0):
            return jnp.sum(xb @ w), 1.0

    g = mm.microbatch(f, 2, argnums=1)
    want = (jnp.float32(64.0), jnp.float32(2.0))
    for got in (g(w, xb), jax.jit(g)(w, xb), mm.jit(g, mesh=mesh4x2)(w, xb)):
        assert_close(got, want)

    def h(w, xb, s):
        with mm.task("a", stage=0):
            return jnp.sum(xb @ w), s * 2

    g1 = mm.microbatch(h, 1, argnums=1)
    got, ref = mm.jit(g1, mesh=mesh4x2)(w, xb, 0.5), jax.jit(g1)(w, xb, 0.5)
    assert_close(got, ref)
    assert [o.aval.weak_type for o in got] == [o.aval.weak_type for o in ref] == [False, False]


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_microbatch_integer_argument_gradients(mesh4x2, reduce):
    """Gradients of integer arguments (allow_int=True: float0, no values) pass through the
    microbatch sum on both paths (JAX's add refused them)."""
    ws = [jnp.eye(4) * 0.5, jnp.eye(4) * 0.25]
    xb = jnp.arange(32.0).reshape(8, 4) / 32

    def loss(ws, xb, n):
        with mm.task("a", stage=0):
            h = jnp.tanh(xb @ ws[0]) * n
        with mm.task("b", stage=1):
            return jnp.sum(h @ ws[1])

    g = jax.value_and_grad(loss, argnums=(0, 2), allow_int=True)
    for m in (1, 4):
        mg = mm.microbatch(g, m, argnums=1, reduce=reduce)
        want = jax.jit(mg)(ws, xb, jnp.int32(3))
        got = mm.jit(mg, mesh=mesh4x2)(ws, xb, jnp.int32(3))
        assert got[1][1].dtype == want[1][1].dtype == jax.dtypes.float0
        assert got[1][1].shape == ()
        assert_close((got[0], got[1][0]), (want[0], want[1][0]), rtol=1e-6)
        whole = jax.jit(g)(ws, xb, jnp.int32(3))
        scale = 1 / m if reduce == "mean" else 1
        assert_close(want[0], whole[0] * scale, rtol=1e-5)


def test_microbatch_gradient_of_integer_batch(mesh4x2):
    """The float0 gradient of an integer batch argument (token ids) is a host value JAX
    makes: kept between calls and returned as is (crashed on the first call)."""

    def loss(w, toks):
        with mm.task("a", stage=0):
            h = w[toks]
        with mm.task("b", stage=1):
            return jnp.mean(h**2)

    w = jnp.arange(64.0).reshape(16, 4) / 64
    toks = jnp.arange(8) % 16
    mg = mm.microbatch(jax.grad(loss, argnums=(0, 1), allow_int=True), 2, argnums=1)
    want = jax.jit(mg)(w, toks)
    f = mm.jit(mg, mesh=mesh4x2)
    for _ in range(2):
        got = f(w, toks)
        assert got[1].dtype == want[1].dtype == jax.dtypes.float0
        assert got[1].shape == want[1].shape
        assert_close(got[0], want[0], rtol=1e-6)


def test_custom_order_validated_like_mm_jit():
    # B1 before B0 on a stage: gradients accumulate in microbatch order under mm.jit
    bad = [
        [(0, 0, "F"), (0, 1, "F"), (0, 1, "B"), (0, 0, "B")],
        [(1, 0, "F"), (1, 0, "B"), (1, 1, "F"), (1, 1, "B")],
    ]
    with pytest.raises(ValueError, match=r"B1@s0.*cannot run.*needs B0@s0"):
        S.validate(bad, 2, 2)
    with pytest.raises(ValueError, match=r"cannot run"):
        S.simulate(S.Custom(bad), 2, 2)
    mmesh = stage_mesh(2)
    g = mm.microbatch(jax.value_and_grad(mlp(2)), 2, argnums=(1, 2), schedule=S.Custom(bad))
    x, y = data(4)
    with pytest.raises(ValueError, match=r"cannot run"):
        mm.jit(g, mesh=mmesh)(weights(2), x, y)
    good = [
        [(0, 0, "F"), (0, 1, "F"), (0, 0, "B"), (0, 1, "B")],
        [(1, 0, "F"), (1, 0, "B"), (1, 1, "F"), (1, 1, "B")],
    ]
    g = mm.microbatch(jax.value_and_grad(mlp(2)), 2, argnums=(1, 2), schedule=S.Custom(good))
    assert_close(mm.jit(g, mesh=mmesh)(weights(2), x, y), reference(g, mmesh, weights(2), x, y))


def manual_loop(fun, m, xs, ys, reduce):
    outs = [fun(xs[k], ys[k]) for k in range(m)]
    full = jax.tree.map(lambda r, o: jax.tree.map(lambda _: r, o), reduce, outs[0])
    return jax.tree.map(
        lambda r, *o: jnp.stack(o) if r == "stack" else sum(o) / (m if r == "mean" else 1),
        full,
        *outs,
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero-bubble-h1"])
def test_microbatch_stack_stacked_inputs_shardings_and_aux(schedule, mesh4x2):
    ws = weights(2)
    loss = mlp(2)

    def fun(x, y):
        val, grads = jax.value_and_grad(loss)(ws, x, y)
        return {"loss": val, "per": val * 2, "grads": grads}, {"max": jnp.max(x)}

    m = 4
    x, y = data(16)
    reduce = {"loss": "mean", "per": "stack", "grads": "sum"}
    g = mm.microbatch(
        fun,
        m,
        argnums=(0, 1),
        schedule=schedule,
        reduce=reduce,
        has_aux=True,
        in_shardings=(jax.P("data"), None),
    )
    xs, ys = x.reshape(m, 4, 8), y.reshape(m, 4, 8)
    want_out = manual_loop(lambda a, b: fun(a, b)[0], m, xs, ys, reduce)
    want_aux = {"max": jnp.max(xs, axis=(1, 2))}
    ref = reference(g, mesh4x2, x, y)
    got = mm.jit(g, mesh=mesh4x2)(x, y)
    assert_close(ref, (want_out, want_aux), rtol=1e-5, atol=1e-6)
    assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert got[0]["per"].shape == (m,) and got[1]["max"].shape == (m,)
    # inputs already split into microbatches
    gs = mm.microbatch(
        fun, m, argnums=(0, 1), schedule=schedule, reduce=reduce, has_aux=True, stacked=True
    )
    assert_close(mm.jit(gs, mesh=mesh4x2)(xs, ys), ref, rtol=1e-5, atol=1e-6)
    assert_close(gs(xs, ys), ref, rtol=1e-5, atol=1e-6)


def test_microbatch_argument_errors():
    f = mm.microbatch(lambda x: x.sum(), 4, stacked=True)
    with pytest.raises(ValueError, match="leading microbatch axis of size 4"):
        f(jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="reduce must be"):
        mm.microbatch(lambda x: x, 2, reduce="max")
    with pytest.raises(ValueError, match="in_shardings has 2 entries"):
        mm.microbatch(lambda x: x, 2, in_shardings=(None, None))
    with pytest.raises(ValueError, match=r"has_aux=True\) needs fun to return a pair"):
        mm.microbatch(lambda x: x.sum(), 2, has_aux=True)(jnp.ones(4))
    with pytest.raises(TypeError, match=r"axis must be one int .* got \(0, 1\)"):
        mm.microbatch(lambda x, y: x.sum(), 2, argnums=(0, 1), axis=(0, 1))


def test_two_dependent_microbatch_loops_in_one_step():
    """Two pipelined loops, the second using what the first made (through work outside
    both loops), then an optimizer: each submesh runs the loops in program order with
    the work between them in the gap (it used to be an 'invalid schedule' error)."""
    mmesh = stage_mesh(4)
    ws = weights(4)
    x, y = data(8)
    loss = mlp(4)
    opt = optax.adam(1e-2)

    def step(ws, state, x, y):
        v1, g1 = mm.microbatch(jax.value_and_grad(loss), 4, argnums=(1, 2))(ws, x, y)
        ws2 = [w - 0.05 * d for w, d in zip(ws, g1)]
        v2, g2 = mm.microbatch(jax.value_and_grad(loss), 2, argnums=(1, 2), schedule="gpipe")(
            ws2, x * v1, y
        )
        up, state = opt.update(g2, state, ws2)
        return optax.apply_updates(ws2, up), state, v1 + v2

    state = opt.init(ws)
    got = mm.jit(step, mesh=mmesh)(ws, state, x, y)
    assert_close(got, reference(step, mmesh, ws, state, x, y), rtol=1e-5, atol=1e-6)
    assert [stage_of(w, mmesh) for w in got[0]] == [0, 1, 2, 3]


@pytest.mark.parametrize("M", [1, 2])
def test_summing_keys_over_microbatches_fails_as_the_reference(M):
    """A PRNG key output with reduce="sum" is the reference's TypeError, also for one
    microbatch (it was returned unsummed)."""
    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    w, x = jnp.eye(4), jnp.ones((8, 4))

    def fk(w, x):
        with mm.task("a", stage=0):
            s = jnp.sum(x @ w)
        return s, jax.random.key(1)

    def step(w, x):
        return mm.microbatch(fk, M, argnums=1, reduce="sum")(w, x)

    with pytest.raises(TypeError, match="add does not accept"):
        jax.jit(step)(w, x)
    with pytest.raises(TypeError, match="add does not accept"):
        mm.jit(step, mesh=mesh)(w, x)


@pytest.mark.parametrize("schedule", ["zero-bubble-h1", "gpipe"])
def test_recorded_timelines_are_consistent(schedule):
    """Per submesh, events follow each other without overlapping, and a microbatch's
    backward/weight-gradient work ends after its forward (fragments whose outputs are
    all donated onward, e.g. gradient accumulations, were given a later fragment's end
    on any submesh: overlaps and W before F)."""
    S, M, D = 4, 8, 8
    ws = [jax.random.normal(jax.random.key(i), (D, D)) / 4 for i in range(S)]
    x = jax.random.normal(jax.random.key(99), (16, D))
    y = jnp.sin(x)

    def loss(ws, xb, yb):
        h = xb
        for i, w in enumerate(ws):
            with mm.task(f"l{i}", stage=i):
                h = h + jnp.tanh(h @ w)
        return jnp.mean((h - yb) ** 2)

    gf = mm.microbatch(jax.value_and_grad(loss), M, argnums=(1, 2), schedule=schedule)

    def step(ws, x, y):
        v, g = gf(ws, x, y)
        return [w - 0.1 * gg for w, gg in zip(ws, g)], v

    c = mm.jit(step, mesh=mm.make_mesh((S,), ("stage",), devices=jax.devices()[:S]))
    c = c.lower(ws, x, y).compile()
    for _ in range(4):
        _, tl = c.record(ws, x, y)
        for row in tl.events:
            assert all(e.start <= e.end for e in row)
            for a, b in zip(row, row[1:]):
                assert b.start >= a.end, (a, b)
            f_end = {e.action.microbatch: e.end for e in row if e.action.phase == "F"}
            for e in row:
                if e.action.phase in "BW" and e.action.microbatch in f_end:
                    assert e.end >= f_end[e.action.microbatch], e


def test_untagged_work_mixing_stages_with_values_made_from_constants(mesh4x2):
    """An untagged op reading both stages' results and a value made in the microbatch
    from constants only (an iota mask) crashed placement (found by a probe)."""
    d = 8
    w = jax.random.normal(jax.random.key(2), (2, d, d)) / 3
    x = jax.random.normal(jax.random.key(0), (8, d))

    def loss(w, x):
        with mm.task("a", stage=0):
            a = jnp.tanh(x @ w[0])
        with mm.task("b", stage=1):
            b = jnp.tanh(x @ w[1])
        return jnp.mean(jnp.where(jnp.arange(d) % 2 == 0, a, b) ** 2)

    g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1)
    assert_close(mm.jit(g, mesh=mesh4x2)(w, x), jax.jit(g)(w, x), rtol=1e-6, atol=1e-7)


def test_interleaved_stage_work_is_never_grouped_with_another_stages():
    """Interleaved, 8 task stages on 4 submeshes: stage 6's dropout bits from a raw key
    (many key-only ops) shared a group with stage 2's work on the same submesh, the group
    took stage 6 by majority, and the valid chain was refused as going back to a stage
    (found by a fuzzing probe)."""
    rng = np.random.RandomState(0)
    w = [jnp.asarray(rng.normal(size=(4, 4)) / 2, jnp.float32) for _ in range(8)]
    b = [jnp.asarray(rng.normal(size=(4,)) * 0.1, jnp.float32) for _ in range(8)]
    x = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)

    def loss(params, x, y, key):
        w, b = params
        h = x
        for k in range(6):
            with mm.task(f"t{k}", stage=k):
                h = jnp.sin(h @ w[k]) * h + b[k] if k == 2 else jnp.tanh(h @ w[k] + b[k])
        with mm.task("t6", stage=6):

            def body(h):
                h = jnp.tanh(h @ w[6] + b[6]) + 0.1 * y
                keep = jax.random.bernoulli(jax.random.fold_in(key, 6), 0.75, h.shape)
                return jnp.where(keep, h / 0.75, 0.0)

            h = jax.checkpoint(body)(h)
        with mm.task("t7", stage=7):
            return jnp.mean((h - y) ** 2)

    mmesh = mm.make_mesh((4, 2), ("stage", "data"))
    g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=(1, 2), schedule="interleaved-1f1b")
    key = jax.random.PRNGKey(0)
    with mmesh:
        want = jax.jit(g)((w, b), x, y, key)
    assert_close(mm.jit(g, mesh=mmesh)((w, b), x, y, key), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h1"])
def test_untagged_join_after_a_later_stages_task(schedule):
    """Stage 1's first task reads the batch directly, and stage 0's output joins it in an
    untagged add after it: both inputs are one hop from the loop's start, and the add went
    to the lowest stage, sending the microbatch back to stage 0 (refused as a cycle). It
    now runs on the stage further down the pipeline."""
    mmesh = stage_mesh(2)
    rng = np.random.RandomState(0)
    p = {k: jnp.asarray(rng.randn(4, 4).astype(np.float32) / 2) for k in ("w0", "w1", "w2")}
    x, y = data(8)
    x, y = x[:, :4], y[:, :4]

    def loss(p, x, y):
        with mm.task("a", stage=0):
            h0 = jnp.tanh(x @ p["w0"])
        with mm.task("b", stage=1):
            z = jnp.tanh(x @ p["w1"])
        h = z + h0
        with mm.task("c", stage=1):
            h = h @ p["w2"]
        return jnp.mean((h - y) ** 2)

    g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=(1, 2), schedule=schedule)
    got = mm.jit(g, mesh=mmesh)(p, x, y)
    assert_close(got, reference(g, mmesh, p, x, y), rtol=1e-5, atol=1e-6)


def test_microbatch_state_in_keyword_and_closed_over_arguments(mesh4x2):
    """State fun changes in a keyword argument goes on to the next microbatch like a
    positional one (every microbatch saw the first state); changing in place an argument
    that is closed over (it holds Python values) is a clear error, not the first state
    again or JAX's leaked-tracer error; carried state keeps its shape and dtype."""

    def mb(x, stats):
        stats["m"] = stats["m"] + x.mean()
        return stats["m"]

    x = jnp.arange(8.0)
    seq = np.cumsum(np.asarray(x).reshape(4, 2).mean(1))
    by_kw = lambda x, s: mm.microbatch(mb, 4, reduce="stack")(x, stats=s)  # noqa: E731
    by_pos = lambda x, s: mm.microbatch(mb, 4, reduce="stack")(x, s)  # noqa: E731
    for f in (by_kw, by_pos):
        assert_close(mm.jit(f, mesh=mesh4x2)(x, {"m": jnp.zeros(())}), seq)
        assert_close(jax.jit(f)(x, {"m": jnp.zeros(())}), seq)

    def mixed(x, m):
        return mm.microbatch(mb, 4, reduce="stack")(x, {"m": m, "decay": 1.0})

    for run in (mm.jit(mixed, mesh=mesh4x2), jax.jit(mixed)):
        with pytest.raises(ValueError, match=r"mb changed argument 1 in place to traced"):
            run(x, jnp.zeros(()))
    with pytest.raises(ValueError, match=r"mb changed argument 1 in place to traced"):
        mm.microbatch(mb, 4)(x, {"m": jnp.zeros(())})  # eager: concrete, closed over

    def grow(x, s):
        s["h"] = jnp.concatenate([s["h"], x[:1]])
        return x.sum()

    with pytest.raises(TypeError, match=r"grow changed state .* from shape \(1,\)"):
        mm.jit(lambda x, h: mm.microbatch(grow, 4)(x, {"h": h}), mesh=mesh4x2)(x, jnp.ones(1))

    def logged(x, log, memo):  # Python side effects on closed-over arguments: allowed
        log.append(x.shape)
        return x.sum() * memo.setdefault("w", 2.0)

    log: list = []
    got = mm.jit(lambda x: mm.microbatch(logged, 4)(x, log, {}), mesh=mesh4x2)(x)
    assert_close(got, x.sum() * 2)
    assert log and log[0] == (2,)

    def to_bf16(x, st):  # weakly typed state made bfloat16: promoted first, as scan does
        st["s"] = st["s"] * x.astype(jnp.bfloat16).sum()
        return st["s"].astype(jnp.float32)

    g = lambda x, s: mm.microbatch(to_bf16, 4, reduce="stack")(x, {"s": s})  # noqa: E731
    assert_close(mm.jit(g, mesh=mesh4x2)(x / 8, 1.0), jax.jit(g)(x / 8, 1.0))
    # a keyword that is not an identifier
    kw = lambda x, p: mm.microbatch(lambda x, **k: x.sum() * k["a-b"], 2)(x, **{"a-b": p})  # noqa: E731
    assert_close(mm.jit(kw, mesh=mesh4x2)(x, jnp.float32(2)), jax.jit(kw)(x, jnp.float32(2)))


def test_microbatch_in_a_nested_jit_traced_before_outside_mm_jit():
    """A framework's own jit (nnx.jit, jax.jit) holding the microbatch loop, run first
    as the reference: JAX's trace cache handed mm.jit that trace (the loop as a
    lax.scan), refused as tasks inside a 'scan' body. mm.jit traces nested jits anew."""
    mmesh = stage_mesh(2)
    ws = weights(2)
    x, y = data(4)
    grad = mm.microbatch(jax.value_and_grad(mlp(2)), 2, argnums=(1, 2))

    @jax.jit
    def inner(ws, x, y):
        return grad(ws, x, y)

    def step(ws, x, y):
        return inner(ws, x, y)

    with mmesh:
        want = jax.jit(step)(ws, x, y)
    got = mm.jit(step, mesh=mmesh)(ws, x, y)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    with mmesh:  # and the reference after it still runs its own trace
        assert_close(jax.jit(step)(ws, x, y), want, rtol=1e-6, atol=1e-7)


def test_interleaved_tasks_numbered_by_submesh_is_a_clear_error():
    """Tasks of an interleaved loop numbered by submesh (0, 1, 0, 1) instead of virtual
    stage (0..3): the error says how interleaving numbers them (it only spoke of tied
    heads; found by a probe)."""

    def loss(ws, x, y):
        h = x
        for i, (st, w) in enumerate(zip((0, 1, 0, 1), ws)):
            with mm.task(f"s{i}", stage=st):
                h = h + jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    x, y = data(8)
    g = mm.microbatch(jax.value_and_grad(loss), 2, argnums=(1, 2), schedule="interleaved-1f1b")
    with pytest.raises(ValueError, match=r"goes back to a stage.*numbers its tasks by virtual"):
        mm.jit(g, mesh=stage_mesh(2)).lower(weights(4), x, y)


def test_interleaved_mesh_tasks_are_named_in_the_error():
    """mesh= tasks in an interleaved loop (mesh=submesh(i % S)) cannot name a virtual
    stage: the cycle error names them and says to use stage= (found by a probe)."""
    mmesh = stage_mesh(2)

    def loss(ws, x, y):
        h = x
        for i, w in enumerate(ws):
            ctx = (
                mm.task(f"s{i}", mesh=mmesh.submesh(i % 2)) if i % 2 else mm.task(f"s{i}", stage=i)
            )
            with ctx:
                h = h + jnp.tanh(h @ w)
        return jnp.mean((h - y) ** 2)

    x, y = data(8)
    g = mm.microbatch(jax.value_and_grad(loss), 2, argnums=(1, 2), schedule="interleaved-1f1b")
    with pytest.raises(ValueError, match=r"Tasks \['s1', 's3'\] are mesh= tasks.*stage= numbers"):
        mm.jit(g, mesh=mmesh).lower(weights(4), x, y)


def test_weak_state_made_another_kind_is_refused_as_by_the_scan(mesh4x2):
    """A weakly typed float carried and made int32 by fun: lax.scan (the reference)
    refuses it, and so does mm.jit now (it promoted the float straight to int32 and
    ran: found by a probe); a weak float made bfloat16 still promotes in both."""
    x = jnp.arange(16.0).reshape(8, 2) / 10

    def to_int(xb, c):
        c["s"] = (c["s"] + xb.sum()).astype(jnp.int32)
        return c["s"].astype(jnp.float32)

    def to_bf16(xb, c):
        c["s"] = (c["s"] + xb.sum()).astype(jnp.bfloat16)
        return c["s"].astype(jnp.float32)

    def step(fun):
        return lambda x, c: mm.microbatch(fun, 4, argnums=0, reduce="stack")(x, dict(c))

    for f in (jax.jit(step(to_int)), mm.jit(step(to_int), mesh=mesh4x2)):
        with pytest.raises(TypeError, match="float32 to \\(\\) int32"):
            f(x, {"s": 1.0})
    assert_close(
        mm.jit(step(to_bf16), mesh=mesh4x2)(x, {"s": 1.0}), jax.jit(step(to_bf16))(x, {"s": 1.0})
    )


def test_an_inference_loop_takes_a_forward_only_custom_order():
    """A loop without a backward is given the F steps only (it demanded B steps the loop
    does not have)."""
    mmesh = stage_mesh(2)
    ws = weights(2)
    x, _y = data(8)

    def fwd(ws, xb):
        h = xb
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = h + jnp.tanh(h @ w)
        return h

    order = S.Custom([[(0, 0, "F"), (0, 1, "F")], [(1, 0, "F"), (1, 1, "F")]])
    g = mm.microbatch(fwd, 2, argnums=1, schedule=order, reduce="stack")
    got = mm.jit(g, mesh=mmesh)(ws, x)
    assert_close(got, reference(g, mmesh, ws, x), rtol=1e-6)


def test_interleaved_with_one_stage_per_submesh_runs_as_1f1b():
    """One chunk per submesh: 1F1B's order, and M need not divide by the submeshes."""
    mmesh = stage_mesh(4)
    ws = weights(4)
    x, y = data(12)
    vg = jax.value_and_grad(mlp_loss)
    runs = {}
    for sched in ["1f1b", "interleaved-1f1b"]:
        g = mm.microbatch(vg, 6, argnums=(1, 2), schedule=sched)
        f = mm.jit(g, mesh=mmesh)
        runs[sched] = f(ws, x, y)
        order = [(fr.stage, fr.name) for fr in f.lower(ws, x, y).plan.fragments]
        runs[sched + " plan"] = order
    assert_close(runs["interleaved-1f1b"], reference(g, mmesh, ws, x, y), rtol=1e-5)
    assert runs["interleaved-1f1b plan"] == runs["1f1b plan"]
