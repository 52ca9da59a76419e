"""A full training step (loss, grads, optax update) under mm.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, stage_of

import multimesh as mm


def make(num_stages, opt):
    def loss(params, x, y):
        h = x
        for i, p in enumerate(params):
            with mm.task(f"stage{i}", stage=i):
                h = jnp.tanh(h @ p["w"] + p["b"])
        return jnp.mean((h - y) ** 2)

    def step(params, state, x, y):
        val, grads = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, val

    return step


def init(num_stages, width=8):
    keys = jax.random.split(jax.random.key(0), num_stages)
    return [
        {"w": jax.random.normal(k, (width, width)) / np.sqrt(width), "b": jnp.zeros((width,))}
        for k in keys
    ]


@pytest.mark.parametrize("optname", ["sgd", "adam"])
def test_train_steps_match_and_stay_put(mesh4x2, optname):
    opt = optax.sgd(0.1) if optname == "sgd" else optax.adam(1e-2)
    step = make(4, opt)
    params = init(4)
    state = opt.init(params)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    y = jax.random.normal(jax.random.key(2), (4, 8))
    mstep = mm.jit(step, mesh=mesh4x2)
    jstep = jax.jit(step)

    def rstep(*a):
        with mesh4x2:
            return jstep(*a)

    rp, rs = params, state
    mp, ms = params, state
    for i in range(4):
        rp, rs, rl = rstep(rp, rs, x, y)
        if i >= 1:
            plan = mstep.lower(mp, ms, x, y).plan
            moved = [t for t in plan.transfers if t.src_stage != t.dst_stage]
            # only activations and their cotangents (4x8 float32) cross submeshes
            assert all(t.shape == (4, 8) for t in moved), plan.as_text()
            assert len(moved) == 2 * 3, plan.as_text()
            nstate = len(jax.tree.leaves((mp, ms)))
            assert not [p for p in plan.inputs if p.mode == "put" and p.arg < nstate]
        mp, ms, ml = mstep(mp, ms, x, y)
        assert_close(ml, rl, rtol=1e-5)
        assert_close((mp, ms), (rp, rs), rtol=1e-5, atol=1e-6)
    for i, p in enumerate(mp):
        assert stage_of(p["w"], mesh4x2) == i and stage_of(p["b"], mesh4x2) == i
    if optname == "adam":
        mu = ms[0].mu
        assert [stage_of(m["w"], mesh4x2) for m in mu] == [0, 1, 2, 3]


def test_loss_decreases(mesh8):
    opt = optax.sgd(0.2)
    step = make(8, opt)
    params = init(8, width=4)
    state = opt.init(params)
    x = jax.random.normal(jax.random.key(1), (8, 4))
    y = jnp.tanh(x[:, ::-1])
    mstep = mm.jit(step, mesh=mesh8)
    losses = []
    for _ in range(6):
        params, state, val = mstep(params, state, x, y)
        losses.append(float(val))
    assert losses[-1] < losses[0]


def test_state_from_jitted_init_moves_to_its_parameters(mesh4x2):
    """`mm.jit(opt.init)` makes the optimizer's zeros on stage 0 (they depend on no
    input); the first update runs next to each stage's gradient (not next to the state),
    so state and parameters end on their stages and later steps move only activations."""
    opt = optax.adam(1e-2)
    step = make(4, opt)
    params = init(4)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    y = jax.random.normal(jax.random.key(2), (4, 8))
    mstep = mm.jit(step, mesh=mesh4x2)
    mp, ms = params, mm.jit(opt.init, mesh=mesh4x2)(params)
    rp, rs = params, opt.init(params)
    for i in range(3):
        if i >= 1:
            plan = mstep.lower(mp, ms, x, y).plan
            moved = [t for t in plan.transfers if t.src_stage != t.dst_stage]
            # activations, their cotangents and Adam's step-count scalars
            assert all(t.nbytes <= (4 * 8 + 2) * 4 for t in moved), plan.as_text()
            nstate = len(jax.tree.leaves((mp, ms)))
            assert not [p for p in plan.inputs if p.mode == "put" and p.arg < nstate]
        mp, ms, ml = mstep(mp, ms, x, y)
        rp, rs, rl = jax.jit(step)(rp, rs, x, y)
        assert_close(ml, rl, rtol=1e-5)
        assert_close((mp, ms), (rp, rs), rtol=1e-5, atol=1e-6)
        assert [stage_of(p["w"], mesh4x2) for p in mp] == [0, 1, 2, 3]
        assert [stage_of(m["w"], mesh4x2) for m in ms[0].mu] == [0, 1, 2, 3]


def test_residual_add_outside_tasks_stays_downstream(mesh4x2):
    """`h = h + t` after each stage's task (untagged, as task_rules make it): each add
    runs on the stage that made `t` (its other input goes there anyway for the task), so
    activations go stage to stage instead of through stage 0."""

    def loss(ws, x, y):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                t = jnp.tanh(h @ w)
            h = h + t
        return jnp.mean((h - y) ** 2)

    def step(ws, x, y):
        val, g = jax.value_and_grad(loss)(ws, x, y)
        return [w - 0.1 * gi for w, gi in zip(ws, g)], val

    ws = [jax.random.normal(jax.random.key(i), (8, 8)) / 3 for i in range(4)]
    x = jax.random.normal(jax.random.key(9), (8, 8))
    y = jnp.sin(x)
    f = mm.jit(step, mesh=mesh4x2)
    got = f(ws, x, y)
    with mesh4x2:
        want = jax.jit(step)(ws, x, y)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    plan = f.lower(*got[:1], x, y).plan
    moved = [(t.src_stage, t.dst_stage) for t in plan.transfers if t.src_stage != t.dst_stage]
    assert sorted(moved) == [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)], plan.as_text()


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("wrapper", ["apply_if_finite", "multisteps", "nested"])
def test_optimizer_under_a_cond_stays_on_its_stages(mesh4x2, wrapper, clip):
    """optax.apply_if_finite / MultiSteps run the whole update under one lax.cond: split
    per leaf group (conds.split_conds), each stage's update runs on that stage, so
    parameters and moments stay put and only scalars (counts) cross submeshes. With
    clip_by_global_norm the leaves meet in one scalar (the norm): split per group and
    phase, only the per-stage sums of squares and the norm cross."""
    inner = optax.adam(1e-2)
    if clip:
        inner = optax.chain(optax.clip_by_global_norm(0.05), inner)
    opt = {  # nested: one wrapper's cond inside the other's branch (split inside first)
        "apply_if_finite": lambda: optax.apply_if_finite(inner, 3),
        "multisteps": lambda: optax.MultiSteps(inner, every_k_schedule=2),
        "nested": lambda: optax.apply_if_finite(optax.MultiSteps(inner, every_k_schedule=2), 3),
    }[wrapper]()
    step = make(4, opt)
    params = init(4)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    y = jax.random.normal(jax.random.key(2), (4, 8))
    mstep = mm.jit(step, mesh=mesh4x2)
    mp, ms = params, opt.init(params)
    rp, rs = params, opt.init(params)
    for i in range(3):
        if i >= 1:
            plan = mstep.lower(mp, ms, x, y).plan
            moved = [t for t in plan.transfers if t.src_stage != t.dst_stage]
            if clip:  # activations, their cotangents, packed with scalars
                assert all(t.shape != (8, 8) for t in moved), plan.as_text()
                assert sum(t.nbytes for t in moved) <= 6 * 4 * 8 * 4 + 200, plan.as_text()
            else:
                assert all(t.nbytes <= 4 * 8 * 4 for t in moved), plan.as_text()
                counts = 2 if wrapper != "nested" else 4  # each wrapper's step counts
                assert len([t for t in moved if t.shape == ()]) <= counts * 3, plan.as_text()
        mp, ms, ml = mstep(mp, ms, x, y)
        with mesh4x2:
            rp, rs, rl = jax.jit(step)(rp, rs, x, y)
        assert_close(ml, rl, rtol=1e-5)
        assert_close((mp, ms), (rp, rs), rtol=1e-5, atol=1e-6)
    assert [stage_of(p["w"], mesh4x2) for p in mp] == [0, 1, 2, 3]


@pytest.mark.parametrize("microbatches", [None, 2])
def test_size_one_bias_and_l2_penalty_stay_on_their_stage(mesh4x2, microbatches):
    """A (1,) bias under clip_by_global_norm: its gradient times the norm's scale tied in
    bytes with the scale's stage (stage 0), so the bias and its moments moved there
    (scalars now move before arrays on a tie). An L2 penalty over all parameters inside
    a microbatched loss floated to the loss's stage, so every stage's parameters were
    sent there each step (loop-invariant work now runs next to its data, before the
    loop: `label.hoist_invariants`)."""
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))

    def loss(p, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ p["w0"])
        with mm.task("b", stage=1):
            y = h @ p["w1"] + p["b1"]
        l2 = 1e-2 * sum(jnp.sum(w**2) for w in jax.tree.leaves(p))
        return jnp.mean(y**2) + l2

    def step(state, x):
        p, o = state
        vg = jax.value_and_grad(loss)
        if microbatches:
            vg = mm.microbatch(vg, microbatches, argnums=1, reduce="mean")
        v, g = vg(p, x)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), v

    p = {
        "w0": jax.random.normal(jax.random.key(0), (8, 8)) / 3,
        "w1": jax.random.normal(jax.random.key(1), (8, 1)) / 3,
        "b1": jnp.full((1,), 0.1),
    }
    x = jax.random.normal(jax.random.key(2), (4, 8))
    f = mm.jit(step, mesh=mesh4x2)
    ms = rs = (p, tx.init(p))
    for i in range(3):
        if i >= 1:
            plan = f.lower(ms, x).plan
            moved = [t for t in plan.transfers if t.src_stage != t.dst_stage]
            assert all(t.shape not in ((8, 8), (8, 1), (1,)) for t in moved), plan.as_text()
            assert sum(t.nbytes for t in moved) <= 600, plan.as_text()
        ms, ml = f(ms, x)
        with mesh4x2:
            rs, rl = jax.jit(step)(rs, x)
        assert_close(ml, rl, rtol=1e-5)
        assert_close(ms, rs, rtol=1e-5, atol=1e-6)
    assert stage_of(ms[0]["b1"], mesh4x2) == 1 and stage_of(ms[0]["w0"], mesh4x2) == 0
    assert stage_of(ms[1][1][0].mu["b1"], mesh4x2) == 1
