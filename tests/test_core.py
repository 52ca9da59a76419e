"""mm.jit values and gradients equal plain jax.jit; arrays live on their submeshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, reference, stage_of

import multimesh as mm


def mlp_loss(num_stages):
    def loss(params, x):
        h = x
        for i, w in enumerate(params):
            with mm.task(f"layer{i}", stage=i % num_stages):
                h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    return loss


def mlp_params(n, width=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    return [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys]


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_mlp_matches_jit(stages):
    mmesh = mm.make_mesh((stages, 8 // stages), ("stage", "data"))
    loss = mlp_loss(stages)
    params = mlp_params(stages)
    x = jax.random.normal(jax.random.key(1), (8, 8))
    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mmesh)(params, x)
    assert_close(got, reference(f, mmesh, params, x))
    _, grads = got
    for i, g in enumerate(grads):
        assert stage_of(g, mmesh) == i, f"grad {i} on stage {stage_of(g, mmesh)}"


def test_issue_example(mesh222):
    def loss(params, x):
        with mm.task("embed", stage=0):
            h = jnp.tanh(x @ params["w0"])
            h = jax.lax.with_sharding_constraint(h, jax.P("data", "model"))
        with mm.task("head", stage=1):
            y = h @ params["w1"]
        return jnp.mean(y**2)

    params = {"w0": jnp.ones((8, 16)) * 0.1, "w1": jnp.ones((16, 4)) * 0.2}
    x = jnp.arange(64.0).reshape(8, 8) / 64
    step = mm.jit(jax.value_and_grad(loss), mesh=mesh222)
    val, grads = step(params, x)
    assert_close((val, grads), reference(jax.value_and_grad(loss), mesh222, params, x))
    assert stage_of(grads["w0"], mesh222) == 0
    assert stage_of(grads["w1"], mesh222) == 1
    assert stage_of(val, mesh222) == 1
    plan = step.lower(params, x).plan
    assert len(plan.fragments) == 3
    assert [f.stage for f in plan.fragments] == [0, 1, 0]
    assert [(t.src_stage, t.dst_stage, t.nbytes) for t in plan.transfers] == [
        (0, 1, 8 * 16 * 4),
        (1, 0, 8 * 16 * 4),
    ]


def test_forward_only_and_untagged_glue(mesh4x2):
    def f(x, w):
        x = x * 2.0  # untagged, on host data: goes where it is consumed
        with mm.task("a", stage=0):
            a = jnp.sin(x @ w)
        b = a + 1.0  # untagged: next to its data (stage 0)
        with mm.task("b", stage=3):
            c = jnp.cos(b) @ w
        return c.sum(), b, c

    x = jnp.linspace(0, 1, 16).reshape(2, 8)
    w = jnp.eye(8) * 0.5
    got = mm.jit(f, mesh=mesh4x2)(x, w)
    assert_close(got, reference(f, mesh4x2, x, w))
    assert stage_of(got[1], mesh4x2) == 0
    assert stage_of(got[2], mesh4x2) == 3
    plan = mm.jit(f, mesh=mesh4x2).lower(x, w).plan
    # w goes to both stages from the host; only b moves between submeshes
    assert [(t.src_stage, t.dst_stage) for t in plan.transfers] == [(0, 3)]


def test_cache_and_retrace(mesh4x2):
    calls = []

    def f(x):
        calls.append(1)
        with mm.task("t", stage=1):
            return x * 2

    g = mm.jit(f, mesh=mesh4x2)
    g(jnp.ones(3))
    g(jnp.ones(3) * 2)
    assert len(calls) == 1
    g(jnp.ones(4))
    assert len(calls) == 2


def test_outputs_fed_back_move_nothing(mesh4x2):
    def step(w, x):
        with mm.task("s0", stage=0):
            h = jnp.tanh(x @ w[0])
        with mm.task("s1", stage=1):
            y = h @ w[1]
        return [w[0] * 0.9, w[1] * 0.9], y.sum()

    w = mlp_params(2)
    x = jnp.ones((2, 8))
    f = mm.jit(step, mesh=mesh4x2)
    w1, _ = f(w, x)
    plan = f.lower(w1, x).plan
    assert [(t.src_stage, t.dst_stage) for t in plan.transfers] == [(0, 1)]
    assert all(p.mode != "put" or p.arg == 2 for p in plan.inputs)


def test_remat_inside_tasks(mesh4x2):
    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with mm.task(f"l{i}", stage=i):
                h = jax.checkpoint(lambda a, w=w: jnp.tanh(a @ w) * jnp.sin(a @ w))(h)
        return (h**2).sum()

    ws = mlp_params(4)
    x = jnp.ones((2, 8))
    f = jax.value_and_grad(loss)
    assert_close(mm.jit(f, mesh=mesh4x2)(ws, x), reference(f, mesh4x2, ws, x))


def test_checkpoint_spanning_tasks(mesh4x2):
    def loss(ws, x):
        def body(h):
            for i, w in enumerate(ws):
                with mm.task(f"l{i}", stage=i):
                    h = jnp.tanh(h @ w)
            return h

        return (jax.checkpoint(body)(x) ** 2).sum()

    ws = mlp_params(4)
    x = jnp.ones((2, 8))
    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh4x2)(ws, x)
    assert_close(got, reference(f, mesh4x2, ws, x))
    assert [stage_of(g, mesh4x2) for g in got[1]] == [0, 1, 2, 3]


def test_dropout_prng_inside_tasks(mesh4x2):
    def loss(w, x, key):
        k0, k1 = jax.random.split(key)
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ w[0])
            keep = jax.random.bernoulli(k0, 0.7, h.shape)
            h = jnp.where(keep, h / 0.7, 0.0)
        with mm.task("b", stage=1):
            h = h @ w[1]
            keep = jax.random.bernoulli(k1, 0.7, h.shape)
            h = jnp.where(keep, h / 0.7, 0.0)
        return (h**2).mean()

    w = mlp_params(2)
    x = jnp.ones((4, 8))
    f = jax.value_and_grad(loss)
    for key in (jax.random.key(0), jax.random.PRNGKey(3)):
        assert_close(mm.jit(f, mesh=mesh4x2)(w, x, key), reference(f, mesh4x2, w, x, key))


def test_transformer_block_per_stage(mesh222):
    d, heads, seq, batch = 16, 2, 4, 4

    def block(p, x):
        def ln(x):
            m = x.mean(-1, keepdims=True)
            v = ((x - m) ** 2).mean(-1, keepdims=True)
            return (x - m) * jax.lax.rsqrt(v + 1e-5)

        h = ln(x)
        q, k, v = (h @ p["wq"], h @ p["wk"], h @ p["wv"])
        sh = lambda t: t.reshape(batch, seq, heads, d // heads)  # noqa: E731
        att = jnp.einsum("bqhd,bkhd->bhqk", sh(q), sh(k)) / np.sqrt(d // heads)
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", att, sh(v)).reshape(batch, seq, d)
        x = x + o @ p["wo"]
        h = ln(x)
        h = jax.lax.with_sharding_constraint(jax.nn.gelu(h @ p["w1"]), jax.P("data", None, "model"))
        return x + h @ p["w2"]

    def loss(ps, x):
        for i, p in enumerate(ps):
            with mm.task(f"block{i}", stage=i):
                x = block(p, x)
        return (x**2).mean()

    def init(k):
        ks = jax.random.split(k, 6)
        shapes = {
            "wq": (d, d),
            "wk": (d, d),
            "wv": (d, d),
            "wo": (d, d),
            "w1": (d, 4 * d),
            "w2": (4 * d, d),
        }
        return {n: jax.random.normal(kk, s) * 0.1 for kk, (n, s) in zip(ks, shapes.items())}

    ps = [init(k) for k in jax.random.split(jax.random.key(0), 2)]
    x = jax.random.normal(jax.random.key(1), (batch, seq, d))
    f = jax.value_and_grad(loss)
    assert_close(mm.jit(f, mesh=mesh222)(ps, x), reference(f, mesh222, ps, x), rtol=2e-5, atol=2e-6)


def test_lower_compile_and_text(mesh4x2):
    def first(x):
        return jnp.sin(x)

    with pytest.raises(ValueError, match="exactly one of stage= or mesh="):
        mm.task(first)

    second = mm.task(lambda x: x * 3, name="second", stage=2)

    def f(x):
        return second(mm.task(first, stage=1)(x))

    x = jnp.arange(4.0)
    lowered = mm.jit(f, mesh=mesh4x2).lower(x)
    text = lowered.as_text()
    assert "fragment 'first'" in text and "fragment 'second'" in text
    assert "stage1->stage2" in text
    plan = lowered.plan
    assert [(fr.name, fr.stage, fr.devices) for fr in plan.fragments] == [
        ("first", 1, (2, 3)),
        ("second", 2, (4, 5)),
    ]
    assert [(t.src_stage, t.dst_stage, t.nbytes) for t in plan.transfers] == [(1, 2, 16)]
    compiled = lowered.compile()
    np.testing.assert_allclose(np.asarray(compiled(x)), np.sin(np.arange(4.0)) * 3, rtol=1e-6)
    assert stage_of(compiled(x), mesh4x2) == 2


def test_scan_returning_a_constant_per_step(mesh4x2):
    """A scan body returning a scalar constant as its per-step output (`jnp.zeros(())`)
    on a multi-device submesh: the constant's type named the global mesh and JAX's scan
    lowering failed inside a fragment."""

    def f(xs, w):
        with mm.task("a", stage=1):
            c, ys = jax.lax.scan(lambda c, x: (c + x * w, jnp.zeros(())), 0.0, xs)
        return c, ys, jax.lax.scan(lambda c, x: (c + x, jnp.bool_(True)), 0.0, xs)

    xs = jnp.arange(4.0)
    assert_close(mm.jit(f, mesh=mesh4x2)(xs, 2.0), reference(f, mesh4x2, xs, 2.0))


def test_python_scalar_and_weak_array_share_one_trace(mesh4x2):
    """``f(x, 2.0)`` then ``f(x, jnp.asarray(3.0))``: both weakly typed float32 scalars,
    one trace and one program, as under jax.jit (they traced and compiled twice; found
    by a probe). A bool or an int is another type: traced anew, as jax.jit does."""
    traces = []

    def f(x, s):
        traces.append(1)
        with mm.task("a", stage=0):
            y = x * s
        with mm.task("b", stage=1):
            return y + s

    x = jnp.ones(4)
    g = mm.jit(f, mesh=mesh4x2)
    for s in (2.0, jnp.asarray(3.0), 4.0):
        got = g(x, s)
        assert got.dtype == jnp.float32 and np.array_equal(got, x * s + s)
    assert len(traces) == 1 and g._cache_size() == 1
    for s in (True, 5):
        assert np.array_equal(g(x, s), jax.jit(f)(x, s))
    assert g._cache_size() == 3


def test_numpy_and_subclassed_scalar_arguments(mesh4x2):
    """``np.float64`` is a ``float`` and an ``IntEnum`` member an ``int``: mm.jit keyed
    them by their own type and failed with a KeyError (a probe); now typed as jax.jit
    types them (NumPy scalars strongly, Python-scalar subclasses weakly)."""
    import enum

    class E(enum.IntEnum):
        A = 3

    class MyFloat(float):
        pass

    def f(x, s):
        with mm.task("a", stage=0):
            y = x * s
        with mm.task("b", stage=1):
            return y + s

    x = jnp.ones(4, jnp.float32)
    g = mm.jit(f, mesh=mesh4x2)
    for s in (np.float64(1.5), np.complex128(1.0), E.A, MyFloat(1.5), np.int64(3), np.bool_(True)):
        got, want = g(x, s), jax.jit(f)(x, s)
        assert got.dtype == want.dtype and got.aval.weak_type == want.aval.weak_type, s
        assert np.array_equal(got, want), s
