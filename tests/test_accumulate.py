"""A gradient with shares from several stages (a tied embedding) is summed over
microbatches on each stage and sent once per step, not once per microbatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, reference

import multimesh as mm

V, D = 16, 8


def _params(n):
    rng = np.random.default_rng(7)
    emb = rng.normal(size=(V, D)).astype(np.float32)
    ws = [rng.normal(size=(D, D)).astype(np.float32) / 3 for _ in range(n)]
    tok = rng.integers(0, V, size=(16,)).astype(np.int32)
    return emb, ws, tok


def _tied_loss(head_task):
    def loss(p, tok):
        emb, ws = p
        with mm.task("embed", stage=0):
            h = emb[tok]
        for i, w in enumerate(ws):
            with mm.task(f"l{i}", stage=i):
                h = jnp.tanh(h @ w)
        if head_task:
            with mm.task("head", stage=len(ws) - 1):
                logits = h @ emb.T
        else:
            logits = h @ emb.T  # untagged: runs with its input on the last stage
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[:, 0])

    return loss


def _table_grads_moved(plan):
    return [t for t in plan.transfers if t.shape == (V, D) and t.src_stage != 0]


@pytest.mark.parametrize("head_task", [True, False], ids=["head-task", "untagged-head"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h1", "interleaved-1f1b"])
def test_tied_embedding_gradient_is_sent_once(schedule, head_task):
    n = 8 if schedule == "interleaved-1f1b" else 4
    emb, ws, tok = _params(n)
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    M = 4
    g = mm.microbatch(
        jax.value_and_grad(_tied_loss(head_task)), M, argnums=1, schedule=schedule, reduce="mean"
    )

    def step(p, tok):
        v, gr = g(p, tok)
        return jax.tree.map(lambda a, d: a - 0.1 * d, p, gr), v

    f = mm.jit(step, mesh=mesh)
    plan = f.lower((emb, ws), tok).plan
    moved = _table_grads_moved(plan)
    # the last stage's share of the table's gradient: once, after the loop (was M times)
    assert len(moved) == 1, plan.as_text()
    assert_close(f((emb, ws), tok), reference(step, mesh, (emb, ws), tok), rtol=2e-5)


def test_shares_summed_in_program_order_per_stage():
    """A weight used three times on two stages: the two uses on stage 0 are summed there
    (with the accumulator), the third is accumulated on stage 1; values match."""
    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    rng = np.random.default_rng(8)
    w = rng.normal(size=(D, D)).astype(np.float32) / 3
    x = rng.normal(size=(8, D)).astype(np.float32)

    def loss(w, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(jnp.tanh(x @ w) @ w)
        with mm.task("b", stage=1):
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    def step(w, x):
        return mm.microbatch(jax.value_and_grad(loss), 4, argnums=1, reduce="sum")(w, x)

    f = mm.jit(step, mesh=mesh)
    plan = f.lower(w, x).plan
    back = sum(t.nbytes for t in plan.transfers if t.src_stage == 1)
    # per microbatch the activations' gradient (2 x 8 floats); the weight's share once
    # (sent every microbatch, it would add 3 x 256 bytes)
    assert back <= 4 * 2 * D * 4 + D * D * 4 + 16, plan.as_text()
    assert_close(f(w, x), reference(step, mesh, w, x), rtol=2e-5)


def test_one_stage_gradients_keep_one_accumulator():
    """Weights used on one stage only keep the single accumulation chain (the plan does
    not grow): the program is unchanged where no gradient is shared."""
    from multimesh.compiler import accumulate

    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    ws = [np.eye(D, dtype=np.float32) * 0.5 for _ in range(2)]
    x = np.ones((8, D), np.float32)

    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"s{i}", stage=i):
                h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    def step(ws, x):
        return mm.microbatch(jax.value_and_grad(loss), 2, argnums=1)(ws, x)

    prog = mm.jit(step, mesh=mesh).lower(ws, x)._prog
    accs = [e for e in prog.eqns if accumulate._is_acc(e)]
    assert len(accs) == 3 * 2  # (loss, w0, w1) x 2 microbatches: one chain each


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h1"])
def test_untagged_layernorm_between_tasks_moves_its_output_not_its_residuals(schedule):
    """An untagged LayerNorm between two tasks: its backward runs with its forward (on
    the earlier stage), so each microbatch moves the normalized output forward and one
    cotangent back, not the LayerNorm's intermediates (6 values packed, found by a
    probe)."""
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    rng = np.random.default_rng(9)
    ws = [rng.normal(size=(D, D)).astype(np.float32) / 3 for _ in range(4)]
    scale, bias = np.full(D, 1.1, np.float32), np.full(D, 0.1, np.float32)
    x = rng.normal(size=(16, D)).astype(np.float32)

    def layer_norm(h, g, b):
        m = h.mean(-1, keepdims=True)
        v = ((h - m) ** 2).mean(-1, keepdims=True)
        return (h - m) * jax.lax.rsqrt(v + 1e-5) * g + b

    def loss(p, x):
        ws, g, b = p
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"l{i}", stage=i):
                h = jnp.tanh(h @ w)
            if i == 1:
                h = layer_norm(h, g, b)
        return jnp.mean(h**2)

    step = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1, schedule=schedule)
    f = mm.jit(step, mesh=mesh)
    args = ((ws, scale, bias), x)
    plan = f.lower(*args).plan
    in_loop = [t for t in plan.transfers if t.shape == (4, D)]
    # per microbatch: 3 activations forward, 3 cotangents back, each one [4, 8] value
    assert len(in_loop) == 4 * 6 and all(t.values == 1 for t in in_loop), plan.as_text()
    assert sum(t.nbytes for t in plan.transfers) == 4 * 6 * 4 * D * 4, plan.as_text()
    assert_close(f(*args), reference(step, mesh, *args), rtol=2e-5)


def test_untagged_shares_on_two_stages_are_accumulated_per_stage():
    """A weight used only by untagged code that placement puts on two stages (after the
    first and the third task): its gradient is accumulated on each and moved once (the
    pass runs again after placement, which knows the untagged shares' stages; found by
    a probe: the share was sent every microbatch)."""
    M = 4
    mesh = mm.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    rng = np.random.default_rng(11)
    s = (rng.normal(size=(D, D)) / 3).astype(np.float32)
    w = (rng.normal(size=(4, D, D)) / 3).astype(np.float32)
    x = rng.normal(size=(4 * M, D)).astype(np.float32)

    def loss(p, x):
        s, w = p
        h = x
        for i in range(4):
            with mm.task(f"l{i}", stage=i):
                h = jnp.tanh(h @ w[i])
            if i in (0, 2):
                h = jnp.tanh(h @ s)  # untagged: next to its input, on stage 0 then 2
        return jnp.mean(h**2)

    def step(p, x):
        return mm.microbatch(jax.value_and_grad(loss), M, argnums=1, reduce="mean")(p, x)

    f = mm.jit(step, mesh=mesh)
    plan = f.lower((s, w), x).plan
    moved = [(t.src_stage, t.dst_stage) for t in plan.transfers if t.shape == (D, D)]
    assert len(moved) == 1, plan.as_text()
    assert_close(f((s, w), x), reference(step, mesh, (s, w), x), rtol=2e-5)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h1"])
def test_untagged_product_of_two_stages_keeps_each_gradient_at_home(schedule):
    """An untagged term mixing two stages' outputs (``a`` from stage 0, ``b`` from stage
    1): each factor's gradient runs next to its data; it is not pulled onto one stage as
    a region (found by a probe: a 1 -> 0 -> 1 round trip per microbatch)."""
    M = 4
    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    rng = np.random.default_rng(12)
    ws = [(rng.normal(size=(D, D)) / 3).astype(np.float32) for _ in range(2)]
    x = rng.normal(size=(16, D)).astype(np.float32)

    def loss(ws, x):
        with mm.task("l0", stage=0):
            a = jnp.tanh(x @ ws[0])
        with mm.task("l1", stage=1):
            b = jnp.tanh(a @ ws[1])
        return jnp.mean(b**2) + 0.1 * jnp.mean(a * b)

    step = mm.microbatch(jax.value_and_grad(loss), M, argnums=1, schedule=schedule)
    f = mm.jit(step, mesh=mesh)
    plan = f.lower(ws, x).plan
    assert len(plan.transfers) <= 3 * M, plan.as_text()
    assert_close(f(ws, x), reference(step, mesh, ws, x), rtol=2e-5)
