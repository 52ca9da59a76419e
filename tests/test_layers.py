"""Scans over stacked layers, pipelined by splitting them into per-stage scans."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh as mm

L, D = 8, 8


def scanned(ws, x, y, explicit=True):
    def body(h, w):
        if explicit:
            with mm.task("layers", stage=mm.by_layer()):
                return h + jnp.tanh(h @ w), None
        with jax.named_scope("layers"):
            return h + jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, x, ws)
    return jnp.mean((h - y) ** 2)


def data(batch=8):
    ws = jax.random.normal(jax.random.key(0), (L, D, D)) / np.sqrt(D)
    x = jax.random.normal(jax.random.key(1), (batch, D))
    return ws, x, jnp.sin(x)


def sgd_step(loss, m=None, schedule="1f1b"):
    grad = jax.value_and_grad(loss)
    if m is not None:
        grad = mm.microbatch(grad, m, argnums=(1, 2), schedule=schedule, reduce="mean")

    def step(ws, x, y):
        val, g = grad(ws, x, y)
        return ws - 0.1 * g, val

    return step


def train_both(f, step, mmesh, state, x, y, steps):
    """``steps`` steps of ``f`` (mm.jit) and of ``step`` under plain jax.jit on the global
    mesh, each fed back its own outputs; losses compared every step. Returns both
    final states."""
    ms, rs = state, state
    for _ in range(steps):
        ms, ml = f(ms, x, y)
        with mmesh:
            rs, rl = jax.jit(step)(rs, x, y)
        assert_close(ml, rl, rtol=1e-5)
    return ms, rs


def assert_stage_sharded(a, mmesh):
    assert a.sharding.is_equivalent_to(NamedSharding(mmesh.mesh, P("stage")), a.ndim)


@pytest.mark.parametrize(
    "explicit,m", [(True, None), (False, None), (False, 2)], ids=["task", "rule", "rule-mb"]
)
def test_scanned_layers_on_four_stages(explicit, m, mesh4x2, recwarn):
    """By an explicit task or a by-layer rule; the rule inside mm.microbatch placed
    nothing (everything on stage 0, and a warning calling the microbatches' scopes
    explicit tasks; found by a probe)."""
    ws, x, y = data()
    step = sgd_step(lambda w, a, b: scanned(w, a, b, explicit), m)
    rules = None if explicit else {"layers": mm.by_layer()}
    f = mm.jit(step, mesh=mesh4x2, task_rules=rules)
    plan = f.lower(ws, x, y).plan
    assert not [w for w in recwarn if "task_rules" in str(w.message)]
    assert sorted({fr.stage for fr in plan.fragments}) == [0, 1, 2, 3]
    mw, rw = train_both(f, step, mesh4x2, ws, x, y, 3)
    assert_close(mw, rw, rtol=1e-5, atol=1e-6)
    # the stacked parameters live on their stages: 2 layers per stage, in place
    assert_stage_sharded(mw, mesh4x2)
    for shard in mw.addressable_shards:
        stage = next(s for s in range(4) if shard.device in mesh4x2.submesh(s).devices.flat)
        np.testing.assert_array_equal(
            np.asarray(shard.data), np.asarray(mw)[2 * stage : 2 * stage + 2]
        )
    # fed back, no parameter bytes move: only activations and their cotangents
    plan = f.lower(mw, x, y).plan
    assert all(t.nbytes <= 8 * D * 4 for t in plan.transfers), plan.as_text()
    assert not [p for p in plan.inputs if p.mode == "put" and p.arg == 0]


@pytest.mark.parametrize("m", [None, 2], ids=["whole-batch", "microbatched"])
def test_scanned_layers_on_a_stage_only_mesh(m):
    """A MultiMesh with the stage axis alone: the second step, fed the first's
    ``P('stage')`` stacked weights, failed with a bare AttributeError (a 1-D mesh's row
    of devices is one device)."""
    mmesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    ws, x, y = data()
    step = sgd_step(scanned, m)
    f = mm.jit(step, mesh=mmesh)
    mw, rw = train_both(f, step, mmesh, ws, x, y, 2)
    assert_close(mw, rw, rtol=1e-5, atol=1e-6)
    assert_stage_sharded(mw, mmesh)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zero-bubble-h1"])
def test_scanned_layers_with_microbatches_and_adam(schedule, mesh4x2):
    ws, x, y = data(16)
    opt = optax.adam(1e-2)
    grad = mm.microbatch(
        jax.value_and_grad(scanned), 4, argnums=(1, 2), schedule=schedule, reduce="mean"
    )

    def step(state, x, y):
        w, o = state
        val, g = grad(w, x, y)
        u, o = opt.update(g, o, w)
        return (optax.apply_updates(w, u), o), val

    f = mm.jit(step, mesh=mesh4x2)
    ms, rs = train_both(f, step, mesh4x2, (ws, opt.init(ws)), x, y, 2)
    assert_close(ms, rs, rtol=1e-5, atol=1e-6)
    assert_stage_sharded(ms[0], mesh4x2)
    assert_stage_sharded(ms[1][0].mu, mesh4x2)  # optimizer state too
    # ... and the next step reads each stage's rows of the moments in place (`b1 * mu`
    # was made whole on one stage, the stacked moments put there every step)
    plan = f.lower(ms, x, y).plan
    nstate = len(jax.tree.leaves(ms))
    assert not [p for p in plan.inputs if p.mode == "put" and p.arg < nstate], plan.as_text()
    assert all(t.nbytes <= 4 * D * 4 for t in plan.transfers), plan.as_text()


def test_stacked_weights_also_used_whole_fed_back(mesh4x2):
    """An L2 penalty on the stacked weights outside the scan: the updated weights come
    back sharded over the stage axis, and the next call uses each stage's rows in place
    and the whole array on the penalty's submesh (it was assembled from rows as if they
    were replicas; found by a probe)."""
    x = jax.random.normal(jax.random.key(9), (8, D))
    w = jax.random.normal(jax.random.key(1), (L, D, D)) / 4

    def loss(w, x):
        def body(h, wl):
            with mm.task("layers", stage=mm.by_layer()):
                return jnp.tanh(h @ wl), None

        h, _ = jax.lax.scan(body, x, w)
        return jnp.sum(h**2) + 1e-3 * jnp.sum(w**2)

    def step(w, x):
        v, g = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * g, v

    f = mm.jit(step, mesh=mesh4x2)
    got, want = w, w
    for _ in range(3):
        got, v = f(got, x)
        want, v_ref = reference(step, mesh4x2, want, x)
        assert got.sharding.spec == P("stage")
        assert_close(v, v_ref)
        assert_close(got, want)


@jax.jit
def _user_jitted(h):
    return h * jax.nn.sigmoid(h)


@pytest.mark.parametrize("act", ["relu", "silu", "user_jit", "dropout", "hoisted"])
def test_nested_jit_in_scanned_layers_under_grad(act, mesh4x2):
    """Nested jits in a by-layer body (jax.nn.relu, silu, a user's jit, dropout's
    bernoulli) under grad: JAX's partial evaluation leaves work of the body outside the
    scan (an empty call, loop-invariant residuals), which was refused as by_layer used
    around other code (found by a probe)."""
    x = jax.random.normal(jax.random.key(2), (4, D))
    w = jax.random.normal(jax.random.key(0), (L, D, D)) / 3
    scale = jnp.float32(1.5)

    def f(h):
        if act == "relu":
            return jax.nn.relu(h)
        if act == "silu":
            return jax.nn.silu(h)
        if act == "user_jit":
            return _user_jitted(h)
        if act == "dropout":
            keep = jax.random.bernoulli(jax.random.key(7), 0.75, h.shape)
            return jnp.where(keep, h / 0.75, 0.0)
        return jnp.tanh(h) * jnp.exp(scale)  # a loop invariant of a closed-over value

    def loss(w, x):
        def body(h, wl):
            with mm.task("layers", stage=mm.by_layer()):
                return h + f(h @ wl), None

        h, _ = jax.lax.scan(body, x, w)
        return jnp.mean(h**2)

    g = jax.value_and_grad(loss, argnums=(0, 1))
    assert_close(mm.jit(g, mesh=mesh4x2)(w, x), reference(g, mesh4x2, w, x))


def test_uneven_layers_per_stage(mesh4x2):
    ws, x, y = data()
    sizes = [3, 1, 2, 2]
    owner = [s for s, n in enumerate(sizes) for _ in range(n)]

    def loss(ws, x, y):
        def body(h, w):
            with mm.task("layers", stage=mm.by_layer(lambda i, n: owner[i])):
                return h + jnp.tanh(h @ w), None

        return jnp.mean((jax.lax.scan(body, x, ws)[0] - y) ** 2)

    g = jax.value_and_grad(loss)
    got = mm.jit(g, mesh=mesh4x2)(ws, x, y)
    assert_close(got, reference(g, mesh4x2, ws, x, y), rtol=1e-5, atol=1e-6)
    assert np.asarray(got[1]).shape == (L, D, D)


def test_scan_over_no_layers(mesh4x2):
    """A by_layer scan over zero stacked layers is a no-op, as under jax.jit (it crashed)."""
    _, x, _ = data()

    def loss(ws, x):
        def body(h, w):
            with mm.task("layers", stage=mm.by_layer()):
                return h + jnp.tanh(h @ w), None

        return jnp.mean(jax.lax.scan(body, x, ws)[0] ** 2)

    g = jax.value_and_grad(loss)
    ws = jnp.zeros((0, D, D))
    got = mm.jit(g, mesh=mesh4x2)(ws, x)
    assert_close(got, reference(g, mesh4x2, ws, x))
    assert got[1].shape == (0, D, D)


def test_linen_nn_scan_with_rules(mesh4x2):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + jnp.tanh(nn.Dense(D)(h)), None

    class Model(nn.Module):  # unmodified: scan over layers, no MultiMesh inside
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L
            )(name="layers")
            h, _ = stack(x, None)
            return h

    model = Model()
    ws, x, y = data()
    params = model.init(jax.random.key(0), x)

    def loss(p, x, y):
        return jnp.mean((model.apply(p, x) - y) ** 2)

    g = jax.value_and_grad(loss)
    f = mm.jit(g, mesh=mesh4x2, task_rules={"layers": mm.by_layer()})
    got = f(params, x, y)
    assert_close(got, reference(g, mesh4x2, params, x, y), rtol=1e-5, atol=1e-6)
    kernel = got[1]["params"]["layers"]["Dense_0"]["kernel"]
    assert kernel.shape == (L, D, D)
    assert_stage_sharded(kernel, mesh4x2)


def test_by_layer_errors(mesh4x2):
    def outside(x):
        with mm.task("t", stage=mm.by_layer()):
            return x * 2

    with pytest.raises(ValueError, match="use it inside the body of a jax.lax.scan"):
        mm.jit(outside, mesh=mesh4x2)(jnp.ones(4))
    assert_close(outside(jnp.ones(4)), jnp.full(4, 2.0))  # transparent outside mm.jit

    def mixed(ws, x):
        def body(h, w):
            with mm.task("a", stage=mm.by_layer()):
                h = h @ w
            with mm.task("b", stage=1):
                return h * 2, None

        return jax.lax.scan(body, x, ws)[0]

    ws, x, _ = data()
    with pytest.raises(ValueError, match="together with code for another submesh"):
        mm.jit(mixed, mesh=mesh4x2)(ws, x)


def test_by_layer_scan_returning_per_layer_prng_keys(mesh4x2):
    """A by-layer scan whose outputs are PRNG keys (each layer's next key): assembled
    from the stages' rows as one stage-sharded key array (was an AttributeError: key
    arrays have no weak type)."""

    def f(ws, keys, x):
        def body(h, wk):
            w, k = wk
            with mm.task("L", stage=mm.by_layer()):
                k2, sub = jax.random.split(k)
                h = h + jnp.tanh(h @ w) * jax.random.uniform(sub, h.shape)
            return h, k2

        h, new_keys = jax.lax.scan(body, x, (ws, keys))
        return jnp.mean(h**2), new_keys

    sh = NamedSharding(mesh4x2.mesh, P("stage"))
    ws = jax.device_put(jax.random.normal(jax.random.key(0), (8, 8, 8)) / 8, sh)
    keys = jax.device_put(jax.random.split(jax.random.key(1), 8), sh)
    x = jnp.ones((4, 8))
    loss, new_keys = mm.jit(f, mesh=mesh4x2)(ws, keys, x)
    want_loss, want_keys = reference(f, mesh4x2, ws, keys, x)
    assert_close(loss, want_loss, rtol=1e-6)
    np.testing.assert_array_equal(jax.random.key_data(new_keys), jax.random.key_data(want_keys))
    assert new_keys.sharding.spec == P("stage")


def _stage_sharded(mmesh, a):
    return jax.device_put(a, NamedSharding(mmesh.mesh, P("stage")))


def test_forward_only_by_layer_scan_reads_each_stages_rows(mesh4x2):
    """A by-layer scan with no stacked outputs (inference): each stage reads its rows of
    the stage-sharded weights in place (the whole stack was put on every stage: the
    rows were bound only when some scan output was stacked)."""
    ws, x, _ = data()
    ws = _stage_sharded(mesh4x2, ws)

    def fwd(ws, x):
        def body(h, w):
            with mm.task("layers", stage=mm.by_layer()):
                return h + jnp.tanh(h @ w), None

        return jax.lax.scan(body, x, ws)[0]

    f = mm.jit(fwd, mesh=mesh4x2)
    plan = f.lower(ws, x).plan
    assert not [p for p in plan.inputs if p.arg == 0], plan.as_text()
    rows = sorted((p.stage, p.nbytes) for p in plan.inputs if p.mode == "piece")
    assert rows == [(s, 2 * D * D * 4) for s in range(4)], plan.as_text()
    assert_close(f(ws, x), reference(fwd, mesh4x2, ws, x), rtol=1e-6)


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
def test_stage_sharded_arguments_returned_as_is_keep_their_layout(donate, mesh4x2):
    """Stage-sharded arguments (stacked weights, an NNX stack's PRNG keys) returned
    unchanged next to a by-layer scan come back in their own layout, as fresh arrays
    (they came back whole on every submesh, replicated: 4x their memory, and the next
    call moved rows from there)."""

    def f(ws, keys, x):
        def body(h, wk):
            w, k = wk
            with mm.task("L", stage=mm.by_layer()):
                return h + jnp.tanh(h @ w) * jax.random.uniform(k, h.shape), None

        h, _ = jax.lax.scan(body, x, (ws, keys))
        return jnp.mean(h**2), ws, keys, ws

    ws0, x, _ = data()
    keys0 = jax.random.split(jax.random.key(1), L)
    ws, keys = _stage_sharded(mesh4x2, ws0), _stage_sharded(mesh4x2, keys0)
    g = mm.jit(f, mesh=mesh4x2, donate_argnums=(0, 1) if donate else ())
    plan = g.lower(ws, keys, x).plan
    assert not [p for p in plan.inputs if p.arg in (0, 1)], plan.as_text()
    want = reference(f, mesh4x2, ws, keys, x)
    loss, ws2, keys2, ws3 = g(ws, keys, x)
    assert_close(loss, want[0], rtol=1e-6)
    np.testing.assert_array_equal(ws2, ws0)
    np.testing.assert_array_equal(ws3, ws0)
    np.testing.assert_array_equal(jax.random.key_data(keys2), jax.random.key_data(keys0))
    for a in (ws2, keys2, ws3):
        assert_stage_sharded(a, mesh4x2)
    assert ws.is_deleted() == donate and keys.is_deleted() == donate
    # fresh arrays: deleting one output touches neither the other nor the argument
    ws2.delete()
    np.testing.assert_array_equal(ws3, ws0)
    if not donate:
        np.testing.assert_array_equal(ws, ws0)
    # fed back: the next call reads the rows in place again
    plan = g.lower(ws3, keys2, x).plan
    assert not [p for p in plan.inputs if p.arg in (0, 1)], plan.as_text()


def test_stage_sharded_argument_returned_with_out_shardings(mesh4x2):
    """``out_shardings`` for an argument returned as is still decides its layout."""
    ws0, x, _ = data()
    ws = _stage_sharded(mesh4x2, ws0)

    def f(ws, x):
        with mm.task("a", stage=0):
            y = x @ ws[0]
        return y, ws

    whole = NamedSharding(mesh4x2.submesh(1), P())
    y, out = mm.jit(f, mesh=mesh4x2, out_shardings=(None, whole))(ws, x)
    assert out.sharding == whole
    np.testing.assert_array_equal(out, ws0)
    assert_close(y, x @ ws0[0], rtol=1e-6)


@pytest.mark.parametrize("m", [None, 2], ids=["whole-batch", "microbatched"])
def test_stacked_weights_indexed_per_stage_stay_in_place(m, mesh4x2):
    """``ws[i]`` of a stage-sharded stack inside stage ``i // 2``'s task (no by_layer):
    each stage reads its own rows in place, its rows' gradient is summed there (each
    read's transpose pads its cotangent to the whole stack: the padded stack was summed
    across the stages, moving whole), and the updated stack comes back stage-sharded."""
    ws0, x, y = data()

    def loss(ws, x, y):
        for i in range(L):
            with mm.task(f"s{i // 2}", stage=i // 2):
                x = x + jnp.tanh(x @ ws[i])
        return jnp.mean((x - y) ** 2)

    step = sgd_step(loss, m)
    f = mm.jit(step, mesh=mesh4x2)
    ws = _stage_sharded(mesh4x2, ws0)
    plan = f.lower(ws, x, y).plan
    assert not [p for p in plan.inputs if p.arg == 0], plan.as_text()
    assert sorted(p.stage for p in plan.inputs if p.mode == "piece") == [0, 1, 2, 3]
    assert all(t.nbytes <= 8 * D * 4 for t in plan.transfers), plan.as_text()
    mw, rw = train_both(f, step, mesh4x2, ws, x, y, 2)
    assert_close(mw, rw, rtol=1e-5, atol=1e-7)
    assert_stage_sharded(mw, mesh4x2)


def test_row_pads_across_blocks_and_stages(mesh4x2):
    """Rows read by another stage than their block's, rows straddling two blocks, the
    same row read twice, and a stack read whole too: the same values and gradients."""
    ws0, x, _ = data()

    def loss(ws, x):
        with mm.task("a", stage=0):
            x = jnp.tanh(x @ ws[7]) + jnp.tanh(x @ ws[0])
        with mm.task("b", stage=1):
            x = x @ jnp.sum(ws[1:3], axis=0)  # rows of blocks 0 and 1
        with mm.task("c", stage=2):
            x = jnp.tanh(x @ ws[4]) * jnp.tanh(x @ ws[4])
        with mm.task("d", stage=3):
            x = x + jnp.sum(ws**2)
        return jnp.mean(x**2)

    step = jax.value_and_grad(loss)
    for ws in (ws0, _stage_sharded(mesh4x2, ws0)):
        (v, g), (rv, rg) = mm.jit(step, mesh=mesh4x2)(ws, x), reference(step, mesh4x2, ws, x)
        assert_close(v, rv, rtol=1e-6)
        assert_close(g, rg, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("spec", [P("stage", None, "data"), P(("stage", "data"))])
def test_stage_sharded_argument_on_a_mesh_ordering_each_stage_otherwise(spec, mesh4x2):
    """An argument on a mesh with each stage's devices in another order than its
    submesh's: its rows are not the submesh's layout, so they are put, not taken as
    they lie (each stage read other devices' shards: wrong values, no error; found by
    a probe)."""
    from jax.sharding import Mesh

    other = Mesh(mesh4x2.mesh.devices[:, ::-1], ("stage", "data"))
    ws0 = jnp.arange(L * D * D, dtype=jnp.float32).reshape(L, D, D) / (L * D * D)
    ws = jax.device_put(ws0, NamedSharding(other, spec))
    x = jnp.ones((4, D))

    def f(ws, x):
        with mm.task("a", stage=0):
            y = x @ ws[0]

        def body(h, w):
            with mm.task("L", stage=mm.by_layer()):
                return h @ w, None

        return y, jax.lax.scan(body, x, ws)[0], ws

    y, h, back = mm.jit(f, mesh=mesh4x2)(ws, x)
    ry, rh, _ = jax.jit(f)(ws0, x)
    assert_close(y, ry, rtol=1e-6)
    assert_close(h, rh, rtol=1e-5)
    np.testing.assert_array_equal(back, ws0)


def test_stacked_weights_of_virtual_stages_stay_in_place(mesh4x2):
    """Interleaved: virtual stage ``v`` (on submesh ``v % 4``) reads ``ws[v % 4][v // 4]``
    of a stage-sharded ``(4, 2, D, D)`` stack: its rows' gradient is summed on that
    submesh too (the whole stack was put on stage 0, summed there and returned
    replicated on it; found by a probe)."""
    ws0 = jax.random.normal(jax.random.key(0), (4, 2, D, D)) / 3
    x = jax.random.normal(jax.random.key(1), (8, D))
    y = jnp.sin(x)

    def loss(ws, x, y):
        for v in range(8):
            with mm.task(f"v{v}", stage=v):
                x = x + jnp.tanh(x @ ws[v % 4][v // 4])
        return jnp.mean((x - y) ** 2)

    step = sgd_step(loss, 4, schedule="interleaved-1f1b")
    f = mm.jit(step, mesh=mesh4x2)
    ws = _stage_sharded(mesh4x2, ws0)
    plan = f.lower(ws, x, y).plan
    assert not [p for p in plan.inputs if p.arg == 0], plan.as_text()
    assert all(t.nbytes <= 8 * D * 4 for t in plan.transfers), plan.as_text()
    mw, rw = train_both(f, step, mesh4x2, ws, x, y, 2)
    assert_close(mw, rw, rtol=1e-5, atol=1e-7)
    assert_stage_sharded(mw, mesh4x2)
