"""Logical axes per task and parameters sharded as the model declares them."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from conftest import assert_close, reference, stage_of
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh as mm

TP = (("batch", "data"), ("mlp", "model"), ("embed", None))  # stage 0: tensor parallel
DP = (("batch", ("data", "model")), ("mlp", None), ("embed", None))  # stage 1: 4-way data


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        w = self.param("w", init, (x.shape[-1], 16))
        h = nn.with_logical_constraint(jnp.tanh(x @ w), ("batch", "mlp"))
        init2 = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        w2 = self.param("w2", init2, (16, x.shape[-1]))
        return nn.with_logical_constraint(h @ w2, ("batch", "embed"))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = mm.flax.task(MLP, stage=0, logical_axis_rules=TP)(name="tp")(x)
        return mm.flax.task(MLP, stage=1, logical_axis_rules=DP)(name="dp")(x)


def test_logical_rules_per_task(mesh222):
    net = Net()
    x = jax.random.normal(jax.random.key(0), (8, 8))
    init = mm.flax.init(net.init, mesh=mesh222)
    params = init(jax.random.key(1), x)
    w_tp = params["params"]["tp"]["w"].unbox()
    w_dp = params["params"]["dp"]["w"].unbox()
    # declared shardings, resolved by each task's own rules, on each task's submesh
    assert stage_of(w_tp, mesh222) == 0 and stage_of(w_dp, mesh222) == 1
    assert w_tp.sharding.is_equivalent_to(NamedSharding(mesh222.submesh(0), P(None, "model")), 2)
    assert w_dp.sharding.is_fully_replicated
    # optimizer state made from the boxes keeps each parameter's task rules (it was
    # resolved by the ambient rules: replicated, or another stage's layout)
    stages = lambda path, x: 0 if "'tp'" in jax.tree_util.keystr(path) else 1  # noqa: E731
    for ambient in ((), TP):
        with nn.logical_axis_rules(ambient):
            opt = mm.flax.init(optax.adam(1e-3).init, mesh=mesh222, stages=stages)(params)
        for name in ("tp", "dp"):
            for w in ("w", "w2"):
                mu = opt[0].mu["params"][name][w].unbox()
                assert mu.sharding == params["params"][name][w].unbox().sharding, (name, w)
    params = nn.meta.unbox(params)

    def loss(p, x):
        return (net.apply(p, x) ** 2).mean()

    def hidden(p, x):
        return net.apply(p, x)

    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh222)(params, x)
    assert_close(got, reference(f, mesh222, jax.device_get(params), x))
    out = mm.jit(hidden, mesh=mesh222)(params, x)
    assert out.sharding.is_equivalent_to(
        NamedSharding(mesh222.submesh(1), P(("data", "model"), None)), 2
    )
    assert_close(out, reference(hidden, mesh222, jax.device_get(params), x))


def test_explicit_task_with_logical_rules(mesh222):
    def f(x, w):
        with mm.task("t", stage=1, logical_axis_rules=TP):
            return nn.with_logical_constraint(jnp.tanh(x @ w), ("batch", "mlp"))

    x, w = jnp.ones((8, 4)), jnp.ones((4, 16))
    h = mm.jit(f, mesh=mesh222)(x, w)
    assert h.sharding.spec == P("data", "model") and stage_of(h, mesh222) == 1
    assert_close(h, reference(f, mesh222, x, w))
    assert_close(jax.jit(f)(x, w), h)  # transparent: no mesh, the constraint is a no-op


def test_linen_init_with_rules_shards_declared_kernels(mesh222):
    class Model(nn.Module):  # unmodified: no MultiMesh inside
        @nn.compact
        def __call__(self, x):
            for i in range(2):
                k = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
                x = nn.Dense(8, kernel_init=k, name=f"layers_{i}")(x)
            return x

    model = Model()
    x = jnp.ones((4, 8))
    rules = {r"layers_(\d+)": lambda m: int(m[1])}
    params = mm.flax.init(model.init, mesh=mesh222, task_rules=rules)(jax.random.key(0), x)
    for i in range(2):
        k = params["params"][f"layers_{i}"]["kernel"].unbox()
        assert stage_of(k, mesh222) == i
        assert k.sharding.is_equivalent_to(NamedSharding(mesh222.submesh(i), P(None, "model")), 2)
    # same values as plain Flax
    ref = model.init(jax.random.key(0), x)
    assert_close(nn.meta.unbox(params), nn.meta.unbox(ref))
    # explicit shardings instead of the declared ones
    params = mm.flax.init(
        model.init,
        mesh=mesh222,
        task_rules=rules,
        shardings=lambda path, leaf: P("model", None) if "kernel" in str(path) else None,
    )(jax.random.key(0), x)
    k = params["params"]["layers_1"]["kernel"].unbox()
    assert k.sharding.is_equivalent_to(NamedSharding(mesh222.submesh(1), P("model", None)), 2)


def test_nnx_create_shards_by_metadata_and_trains(mesh222):
    class Block(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.lin = nnx.Linear(8, 8, kernel_init=init, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.lin(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = mm.flax.task(Block(rngs), stage=0)
            self.b = mm.flax.task(Block(rngs), stage=1)

        def __call__(self, x):
            return self.b(self.a(x))

    with nn.logical_axis_rules(TP):
        model = mm.flax.create(lambda k: Net(nnx.Rngs(k)), jax.random.key(0), mesh=mesh222)
    for i, blk in enumerate((model.a, model.b)):
        k = blk.lin.kernel.get_value()
        assert stage_of(k, mesh222) == i
        assert k.sharding.is_equivalent_to(NamedSharding(mesh222.submesh(i), P(None, "model")), 2)
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.sgd(0.1)

    def step(p, o, x):
        def loss(p):
            return (nnx.merge(graphdef, p)(x) ** 2).mean()

        val, g = jax.value_and_grad(loss)(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, val

    x = jnp.ones((4, 8))
    got = mm.jit(step, mesh=mesh222)(params, opt.init(params), x)
    host = jax.device_get(params)
    assert_close(got, reference(step, mesh222, host, opt.init(host), x))
