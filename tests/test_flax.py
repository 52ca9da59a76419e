"""multimesh.flax: NNX and Linen modules on submeshes; parameters created in place."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, reference, stage_of
from flax import nnx
from jax.sharding import PartitionSpec as P

import multimesh as mm


class Block(nnx.Module):
    def __init__(self, d, rngs, dropout=0.0):
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.lin(x)))


class Model(nnx.Module):
    def __init__(self, n, d, rngs, per_stage=1, dropout=0.0):
        self.blocks = nnx.List(
            [mm.flax.task(Block(d, rngs, dropout), stage=i // per_stage) for i in range(n)]
        )

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_nnx_task_values_grads_and_placement(mesh4x2):
    model = Model(4, 8, nnx.Rngs(0))
    assert type(model.blocks[2]).__name__ == "Block" and model.blocks[2].mm_stage == 2
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)

    def loss(state, x):
        return (nnx.merge(graphdef, state, rest)(x) ** 2).mean()

    x = jax.random.normal(jax.random.key(1), (4, 8))
    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh4x2)(state, x)
    assert_close(got, reference(f, mesh4x2, state, x))
    for i in range(4):
        assert stage_of(got[1]["blocks"][i]["lin"]["kernel"].get_value(), mesh4x2) == i


def test_nnx_create_in_place(mesh4x2):
    model = mm.flax.create(lambda k: Model(4, 8, nnx.Rngs(k)), jax.random.key(0), mesh=mesh4x2)
    ref = Model(4, 8, nnx.Rngs(jax.random.key(0)))
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))
    for i in range(4):
        assert stage_of(model.blocks[i].lin.kernel.get_value(), mesh4x2) == i
    # nothing moved between submeshes while creating the parameters
    fn = mm.jit(lambda k: nnx.state(Model(4, 8, nnx.Rngs(k))), mesh=mesh4x2)
    assert fn.lower(jax.random.key(0)).plan.transfers == []


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = mm.flax.task(nn.Dense, stage=0)(8, name="embed")(x)
        x = mm.flax.task(nn.Dense, stage=1)(8, name="mid")(x)
        return mm.flax.task(nn.Dense, stage=3)(2, name="head")(jnp.tanh(x))


def test_linen_task_wrappers(mesh4x2):
    model = LinenModel()
    x = jnp.ones((4, 8))
    with mesh4x2:
        params = model.init(jax.random.key(0), x)
    assert set(params["params"]) == {"embed", "mid", "head"}

    def loss(p, x):
        return (model.apply(p, x) ** 2).mean()

    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh4x2)(params, x)
    assert_close(got, reference(f, mesh4x2, params, x))
    g = got[1]["params"]
    assert [stage_of(g[k]["kernel"], mesh4x2) for k in ("embed", "mid", "head")] == [0, 1, 3]


def test_linen_init_under_mm_jit_places_params(mesh4x2):
    model = LinenModel()
    x = jnp.ones((4, 8))
    init = mm.jit(model.init, mesh=mesh4x2)
    params = init(jax.random.key(0), x)
    with mesh4x2:
        assert_close(params, model.init(jax.random.key(0), x))
    p = params["params"]
    assert [stage_of(p[k]["kernel"], mesh4x2) for k in ("embed", "mid", "head")] == [0, 1, 3]
    assert init.lower(jax.random.key(0), x).plan.transfers == []


def test_linen_instance_wrapper(mesh4x2):
    head = mm.flax.task(nn.Dense(3), stage=2)  # an unbound instance: same fields, placed
    assert head.features == 3 and type(head).__name__ == "Dense"
    x = jnp.ones((4, 8))
    with mesh4x2:
        params = head.init(jax.random.key(0), x)
    got = mm.jit(head.apply, mesh=mesh4x2)(params, x)
    assert stage_of(got, mesh4x2) == 2
    assert_close(got, reference(head.apply, mesh4x2, params, x))


@pytest.mark.parametrize("named", [False, True])
def test_linen_instance_made_in_a_compact_method(mesh4x2, named):
    """mm.flax.task of a Linen instance made inside @nn.compact (where it already holds
    its name, auto or given): it was Flax's NameInUseError even under plain init (found
    by a probe). Values and gradients as jax.jit; each part runs on its stage."""

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            d = nn.Dense(8, name="embed") if named else nn.Dense(8)
            h = jnp.tanh(mm.flax.task(d, stage=0)(x))
            return mm.flax.task(nn.Dense(2), stage=1)(h).sum()

    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    params = Net().init(jax.random.key(0), x)
    first, second = ("embed", "Dense_0") if named else ("Dense_0", "Dense_1")
    assert set(params["params"]) == {first, second}

    def step(p, x):
        return jax.value_and_grad(lambda p: Net().apply(p, x))(p)

    fn = mm.jit(step, mesh=mesh4x2)
    got = fn(params, x)
    assert_close(got, reference(step, mesh4x2, params, x))
    assert stage_of(got[1]["params"][first]["kernel"], mesh4x2) == 0
    assert stage_of(got[1]["params"][second]["kernel"], mesh4x2) == 1


def test_init_helper_with_stage_tree(mesh4x2):
    opt = optax.adam(1e-3)

    def make(k):
        params = {"a": jax.random.normal(k, (4, 4)), "b": jnp.zeros((4,))}
        return params, opt.init(params)

    fn = mm.flax.init(make, mesh=mesh4x2, stages=lambda path, x: 2 if "a" in str(path) else 1)
    params, state = fn(jax.random.key(0))
    assert stage_of(params["a"], mesh4x2) == 2 and stage_of(params["b"], mesh4x2) == 1
    assert stage_of(state[0].mu["a"], mesh4x2) == 2
    assert fn.lower(jax.random.key(0)).plan.transfers == []


def test_nnx_dropout_rng_streams_match_plain_flax(mesh4x2):
    model = Model(4, 8, nnx.Rngs(params=0, dropout=1), dropout=0.3)
    graphdef, state = nnx.split(model)

    def step(state, x):
        m = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(m)
        return loss, grads, nnx.state(m)  # the state carries the advanced RNG counts

    x = jax.random.normal(jax.random.key(1), (4, 8))
    ms = rs = state
    losses = []
    for _ in range(3):
        ml, mg, ms = mm.jit(step, mesh=mesh4x2)(ms, x)
        with mesh4x2:
            rl, rg, rs = jax.jit(step)(rs, x)
        assert_close((ml, mg), (rl, rg))
        losses.append(float(ml))
    assert len(set(losses)) == 3  # a new dropout mask each step, as in plain Flax
    assert_close(ms, rs)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_nnx_dropout_advances_per_microbatch(mesh4x2, schedule):
    """NNX state a microbatch changes (the shared Rngs' count of a dropout model) is given
    to the next microbatch, as the reference scan's carry does: each microbatch draws its
    own masks (every microbatch reused microbatch 0's)."""
    model = Model(4, 8, nnx.Rngs(params=0, dropout=1), dropout=0.3)
    graphdef, state = nnx.split(model)

    def step(state, x):
        m = nnx.merge(graphdef, state)
        lf = mm.microbatch(
            nnx.value_and_grad(lambda m, x: (m(x) ** 2).mean()),
            4,
            argnums=1,
            schedule=schedule,
            reduce=("stack", "sum"),
        )
        return lf(m, x)

    x = jax.random.normal(jax.random.key(1), (8, 8))
    got = mm.jit(step, mesh=mesh4x2)(state, x)
    want = jax.jit(step)(state, x)
    assert_close(got, want, rtol=1e-5)
    assert len(set(np.asarray(got[0]).tolist())) == 4  # a mask per microbatch
    ones = jnp.ones((8, 8))  # equal microbatches: equal losses only if masks were reused
    assert len(set(np.asarray(mm.jit(step, mesh=mesh4x2)(state, ones)[0]).tolist())) == 4


def test_linen_logical_sharding_resolves_on_the_submesh(mesh222):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            w = self.param("w", init, (8, 16))
            h = nn.with_logical_constraint(jnp.tanh(x @ w), ("batch", "mlp"))
            return h

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = mm.flax.task(MLP, stage=1)(name="mlp")(x)
            return mm.flax.task(nn.Dense, stage=0)(4, name="out")(h)

    rules = (("batch", "data"), ("mlp", "model"), ("embed", None))
    x = jax.random.normal(jax.random.key(0), (4, 8))
    net = Net()
    with mesh222, nn.logical_axis_rules(rules):
        params = nn.meta.unbox(net.init(jax.random.key(1), x))

    def loss(p, x):
        return (net.apply(p, x) ** 2).mean()

    f = jax.value_and_grad(loss)
    with nn.logical_axis_rules(rules):
        got = mm.jit(f, mesh=mesh222)(params, x)
        with mesh222:
            want = jax.jit(f)(params, x)
    assert_close(got, want)
    assert stage_of(got[1]["params"]["mlp"]["w"], mesh222) == 1

    def hidden_fn(x, w):
        with mm.task("mlp", stage=1):
            return nn.with_logical_constraint(jnp.tanh(x @ w), ("batch", "mlp"))

    with nn.logical_axis_rules(rules):
        h = mm.jit(hidden_fn, mesh=mesh222)(x, params["params"]["mlp"]["w"])
    assert h.sharding.spec == jax.P("data", "model")
    assert stage_of(h, mesh222) == 1


def test_nnx_sharding_metadata_resolves_on_the_submesh(mesh222):
    class TP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
            self.lin = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)

        def __call__(self, x):
            h = jnp.tanh(self.lin(x))
            return jax.lax.with_sharding_constraint(h, jax.P("data", "model"))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = mm.flax.task(TP(rngs), stage=0)
            self.b = mm.flax.task(nnx.Linear(16, 2, rngs=rngs), stage=1)

        def __call__(self, x):
            return self.b(self.a(x))

    with mesh222:  # NNX creates annotated variables sharded on the context mesh
        net = Net(nnx.Rngs(0))
    graphdef, state = nnx.split(net)
    spec = nnx.get_partition_spec(state)
    assert spec["a"]["lin"]["kernel"].get_value() == jax.P(None, "model")

    def loss(state, x):
        return (nnx.merge(graphdef, state)(x) ** 2).mean()

    x = jax.random.normal(jax.random.key(1), (4, 8))
    # place the parameters by their metadata, on the global mesh (stage axis replicated)
    shardings = jax.tree.map(
        lambda s: jax.sharding.NamedSharding(mesh222.mesh, s),
        spec,
        is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec),
    )
    state = jax.device_put(state, shardings)
    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh222)(state, x)
    assert_close(got, reference(f, mesh222, state, x))
    g = got[1]["a"]["lin"]["kernel"].get_value()
    assert stage_of(g, mesh222) == 0
    plan = mm.jit(f, mesh=mesh222).lower(state, x).plan
    # the global-mesh inputs are sliced per stage in place: nothing copied for them
    assert all(p.mode != "put" for p in plan.inputs if p.arg < len(jax.tree.leaves(state)))


def test_linen_dropout_matches_plain_flax(mesh4x2):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = mm.flax.task(nn.Dense, stage=0)(8, name="a")(x)
            x = nn.Dropout(0.3, deterministic=not train)(x)
            x = mm.flax.task(nn.Dense, stage=1)(8, name="b")(jnp.tanh(x))
            return nn.Dropout(0.3, deterministic=not train)(x)

    net = Net()
    x = jax.random.normal(jax.random.key(0), (4, 8))
    with mesh4x2:
        params = net.init(jax.random.key(1), x, train=False)

    def loss(p, x, key):
        return (net.apply(p, x, rngs={"dropout": key}) ** 2).mean()

    f = jax.value_and_grad(loss)
    for k in range(2):
        key = jax.random.key(10 + k)
        assert_close(mm.jit(f, mesh=mesh4x2)(params, x, key), reference(f, mesh4x2, params, x, key))


def test_wrapped_nnx_module_under_nnx_jit_and_grad(mesh4x2):
    model = Model(2, 8, nnx.Rngs(0))

    @nnx.jit
    def loss_and_grad(m, x):
        return nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(m)

    x = jnp.ones((4, 8))
    with mesh4x2:  # tasks are transparent outside mm.jit
        val, grads = loss_and_grad(model, x)
    plain = Model(2, 8, nnx.Rngs(0))
    for b in plain.blocks:  # the same model without tasks
        object.__setattr__(b, "__class__", Block)
    val2, grads2 = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(plain)
    assert_close((val, nnx.state(grads)), (val2, nnx.state(grads2)), rtol=2e-5, atol=1e-6)


def test_scanned_params_with_declared_tensor_parallel_layout():
    """A stacked ``nn.scan`` parameter declared ``(None, "model")``: each stage holds its
    layers, tensor-parallel on its submesh: ``P('stage', None, 'model')`` (it was made
    whole on submesh 0; found by a probe). Values and a training step match jax.jit."""
    d = 8

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            init = nn.with_partitioning(nn.initializers.normal(0.3), (None, "model"))
            w = self.param("w", init, (d, d))
            return h + jnp.tanh(h @ w), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=8,
                metadata_params={nn.PARTITION_NAME: None},
            )
            h, _ = scan(name="layers")(x, None)
            return jnp.mean(h**2)

    mesh4x2 = mm.make_mesh((4, 2), ("stage", "model"))
    x = jnp.ones((4, d))
    rules = {"layers": mm.by_layer()}
    params = mm.flax.init(Model().init, mesh=mesh4x2, task_rules=rules)(jax.random.key(0), x)
    w = nn.meta.unbox(params)["params"]["layers"]["w"]
    assert w.sharding.spec == jax.sharding.PartitionSpec("stage", None, "model")
    assert len(w.sharding.device_set) == 8
    want = reference(Model().init, mesh4x2, jax.random.key(0), x)
    assert_close(nn.meta.unbox(params), nn.meta.unbox(want))

    def loss(p, x):
        return Model().apply(p, x)

    g = mm.jit(jax.value_and_grad(loss), mesh=mesh4x2, task_rules=rules)
    assert_close(g(nn.meta.unbox(params), x), jax.value_and_grad(loss)(nn.meta.unbox(want), x))


def test_linen_remat_dropout_pipeline_by_rules():
    """nn.remat + Dropout blocks placed by task_rules, pipelined: the dropout mask's work
    (it needs only the key argument) was merged into a backward that the forward then
    waited for (refused as a deadlock under 1F1B and zero-bubble; found by a probe)."""
    mmesh = mm.make_mesh((2, 2), ("stage", "model"), devices=jax.devices()[:4])

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.Dropout(0.3, deterministic=False)(nn.Dense(16)(x)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tok):
            x = nn.Embed(32, 8)(tok)
            for i in range(2):
                x = nn.remat(Block)(name=f"layers_{i}")(x)
            return nn.Dense(32, name="head")(x)

    m = Model()
    tok = jax.random.randint(jax.random.key(0), (8, 5), 0, 32)
    v = m.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, tok)

    def loss(p, tok, key):
        logits = m.apply(p, tok, rngs={"dropout": key})
        return jnp.mean(logits**2) - jnp.mean(jnp.take_along_axis(logits, tok[..., None], -1))

    rules = {r"layers_(\d)": lambda mt: int(mt[1]), r"head": 1}
    g = mm.microbatch(jax.value_and_grad(loss), 4, argnums=1, schedule="1f1b")
    want = jax.jit(g)(v, tok, jax.random.key(3))
    got = mm.jit(g, mesh=mmesh, task_rules=rules)(v, tok, jax.random.key(3))
    assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_nnx_create_stacked_layers_by_layer(mesh4x2):
    """mm.flax.create with stacked NNX blocks (nnx.vmap) placed by_layer: each layer's
    parameters made on its stage, the stack split over the stage axis (it crashed)."""
    d, n = 8, 4

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, h):
            return h + jnp.tanh(self.lin(h))

    class Net(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = mm.flax.task(make(rngs), stage=mm.by_layer(), name="layers")

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def forward(block, h):
                return block(h)

            return forward(self.blocks, x)

    model = mm.flax.create(lambda k: Net(nnx.Rngs(k)), jax.random.key(0), mesh=mesh4x2)
    eager = Net(nnx.Rngs(jax.random.key(0)))
    kernel = model.blocks.lin.kernel.get_value()
    assert kernel.sharding.spec == jax.P("stage")
    assert_close(kernel, eager.blocks.lin.kernel.get_value())
    x = jnp.ones((8, d))
    gd, p = nnx.split(model)
    assert_close(mm.jit(lambda p, x: nnx.merge(gd, p)(x), mesh=mesh4x2)(p, x), eager(x), rtol=1e-6)


def test_nnx_module_as_a_non_batch_argument_of_microbatch(mesh4x2):
    """``mm.microbatch(nnx.value_and_grad(loss), M, argnums=(1, 2))(model, x, y)``: the
    module was closed over, and Flax refused its graph nodes from another trace level
    (in the reference and under mm.jit); arguments made of arrays, and NNX modules also
    when eager, are now passed."""

    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            with mm.task("a", stage=0):
                h = jnp.tanh(self.a(x))
            with mm.task("b", stage=1):
                return self.b(h)[:, 0]

    model = Two(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 4))
    y = jnp.sin(x[:, 0])

    def loss(m, xb, yb):
        return jnp.mean((m(xb) - yb) ** 2)

    step = mm.microbatch(nnx.value_and_grad(loss), 4, argnums=(1, 2), reduce="mean")
    want = jax.jit(step)(model, x, y)
    with mesh4x2:
        want_spmd = jax.jit(step)(model, x, y)
    got = mm.jit(step, mesh=mesh4x2)(model, x, y)
    assert_close(got, want, rtol=1e-5)
    assert_close(got, want_spmd, rtol=1e-5)
    assert_close(step(model, x, y), want, rtol=1e-5)  # eager: the module was closed over


def test_nnx_state_a_microbatch_loop_changes_stays_in_the_module(mesh4x2):
    """After ``mm.microbatch`` the NNX module holds the state the loop left (BatchNorm
    statistics, RNG counts), as after a Python loop over the microbatches: eagerly,
    under jax.jit and under mm.jit (the state was dropped after the loop)."""
    x = jnp.arange(8.0).reshape(4, 2) + 3
    mk = lambda: nnx.BatchNorm(2, momentum=0.5, rngs=nnx.Rngs(0))  # noqa: E731
    loss = lambda m, x: m(x).sum()  # noqa: E731
    ref = mk()
    for k in range(2):
        loss(ref, x[2 * k : 2 * k + 2])
    eager = mk()
    mm.microbatch(loss, 2, argnums=1)(eager, x)
    assert_close(eager.mean.get_value(), ref.mean.get_value())
    assert_close(eager.var.get_value(), ref.var.get_value())
    gd, st = nnx.split(mk())

    def step(st, x):
        m = nnx.merge(gd, st)
        out = mm.microbatch(loss, 2, argnums=1)(m, x)
        return out, nnx.state(m)

    got = mm.jit(step, mesh=mesh4x2)(st, x)
    assert_close(got, jax.jit(step)(st, x))
    assert_close(got[1]["mean"].get_value(), ref.mean.get_value())


def test_nnx_modules_in_containers_and_shared_between_arguments(mesh4x2):
    """A module inside a tuple or dict argument gets the loop's final state too (was
    dropped, or an eager Flax error); two arguments sharing a module keep the state the
    loop left (the unchanged copy was written back last, undoing it)."""
    x = jnp.arange(8.0).reshape(4, 2) + 3
    mk = lambda: nnx.BatchNorm(2, momentum=0.5, rngs=nnx.Rngs(0))  # noqa: E731
    ref = mk()
    for k in range(2):
        ref(x[2 * k : 2 * k + 2])

    class Holder(nnx.Module):
        def __init__(self, bn):
            self.bn = bn

    def in_tuple(t, x):
        return t[0](x).sum()

    def shared(bn, holder, x):
        return holder.bn(x).sum()

    bn = mk()
    mm.microbatch(in_tuple, 2, argnums=1)((bn,), x)
    assert_close(bn.mean.get_value(), ref.mean.get_value())
    bn = mk()
    mm.microbatch(shared, 2, argnums=2)(bn, Holder(bn), x)
    assert_close(bn.mean.get_value(), ref.mean.get_value())

    gd, st = nnx.split(mk())

    def step(st, x):
        bn = nnx.merge(gd, st)
        mm.microbatch(lambda d, x: d["m"](x).sum(), 2, argnums=1)({"m": bn}, x)
        return nnx.state(bn)

    got = mm.jit(step, mesh=mesh4x2)(st, x)
    assert_close(got, jax.jit(step)(st, x))
    assert_close(got["mean"].get_value(), ref.mean.get_value())


def test_nnx_module_next_to_a_string_in_one_argument(mesh4x2):
    """``{"m": model, "mode": "train"}``: the module is carried, the string stays static
    (the argument was closed over: Flax's trace-level error in every mode)."""

    def f(x, a):
        return a["m"](x).sum() if a["mode"] == "train" else x.sum()

    x = jnp.ones((8, 2))
    m = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
    want = np.asarray([f(x[2 * k : 2 * k + 2], {"m": m, "mode": "train"}) for k in range(4)])
    m = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))
    got = mm.microbatch(f, 4, reduce="stack")(x, {"m": m, "mode": "train"})
    assert_close(got, want)
    assert m.rngs.count.get_value() == 4  # the module holds the loop's state
    gd, st = nnx.split(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)))

    def step(st, x):
        m = nnx.merge(gd, st)
        out = mm.microbatch(f, 4, reduce="stack")(x, {"m": m, "mode": "train"})
        return out, nnx.state(m)

    got = mm.jit(step, mesh=mesh4x2)(st, x)
    assert_close(got, jax.jit(step)(st, x))
    assert_close(got[0], want)


def test_nnx_dropout_masks_change_from_step_to_step(mesh4x2):
    """The RNG count a microbatched step advances comes back in the state: each training
    step draws new masks (every step repeated the first step's)."""
    model = Model(4, 8, nnx.Rngs(params=0, dropout=1), dropout=0.5)
    gd, st = nnx.split(model)

    def step(st, x):
        m = nnx.merge(gd, st)
        lf = mm.microbatch(lambda m, x: (m(x) ** 2).mean(), 2, argnums=1)
        return lf(m, x), nnx.state(m)

    x = jnp.ones((4, 8))
    f, g = mm.jit(step, mesh=mesh4x2), jax.jit(step)
    ms = rs = st
    losses = []
    for _ in range(3):
        ml, ms = f(ms, x)
        rl, rs = g(rs, x)
        assert_close(ml, rl, rtol=1e-5)
        losses.append(float(ml))
    assert_close(ms, rs)
    assert len(set(losses)) == 3


def test_nnx_module_with_numpy_leaves_in_an_eager_microbatch():
    """An NNX module whose variables hold NumPy arrays is carried too (Flax refused it
    closed over: "Cannot mutate ... from a different trace level")."""
    bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    bn.mean.set_value(np.full((2,), 0.5, np.float32))
    x = jnp.arange(8.0).reshape(4, 2)
    got = mm.microbatch(lambda m, x: m(x).sum(), 2, argnums=1)(bn, x)
    bn2 = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    bn2.mean.set_value(np.full((2,), 0.5, np.float32))
    want = jax.jit(mm.microbatch(lambda m, x: m(x).sum(), 2, argnums=1))(bn2, x)
    assert_close(got, want)
    ref = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    ref.mean.set_value(np.full((2,), 0.5, np.float32))
    for k in range(2):
        ref(x[2 * k : 2 * k + 2])
    assert_close(bn.mean.get_value(), ref.mean.get_value())  # updated after the loop


def test_shared_rngs_over_interleaved_stages(mesh4x2):
    """One Rngs shared by dropout on every virtual stage. Held by the dropout layers, its
    count is advanced outside them and the interleaved pipeline matches jax.jit. Passed at
    call time, the count is advanced inside each stage's task: microbatch k+1's first
    stage needs the count microbatch k's last stage left, which interleaving runs later;
    the deadlock error says so (it only blamed placement)."""
    model = Model(8, 8, nnx.Rngs(params=0, dropout=1), dropout=0.3)
    gd, st = nnx.split(model)

    def step(st, x):
        m = nnx.merge(gd, st)
        lf = nnx.value_and_grad(lambda m, x: (m(x) ** 2).mean())
        return mm.microbatch(lf, 4, argnums=1, schedule="interleaved-1f1b")(m, x)

    x = jax.random.normal(jax.random.key(2), (8, 8))
    assert_close(mm.jit(step, mesh=mesh4x2)(st, x), jax.jit(step)(st, x), rtol=1e-5)

    class Block2(nnx.Module):
        def __init__(self, i):
            self.lin = nnx.Linear(8, 8, rngs=nnx.Rngs(i))

        def __call__(self, x, rngs):
            return nnx.Dropout(0.5)(self.lin(x), rngs=rngs)

    class Model2(nnx.Module):
        def __init__(self):
            self.rngs = nnx.Rngs(dropout=7)
            self.blocks = nnx.List([mm.flax.task(Block2(i), stage=i) for i in range(8)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x, self.rngs)
            return x

    gd, st = nnx.split(Model2())
    with pytest.raises(ValueError, match=r"deadlock.*state carried from one microbatch"):
        mm.jit(step, mesh=mesh4x2)(st, x)


class Sowing(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        with mm.task("s0", stage=0):
            h = self.lin(x)
            self.sow(nnx.Intermediate, "h", h)
        with mm.task("s1", stage=1):
            return jnp.mean(h**2)


def test_sow_in_a_microbatched_fun():
    """Intermediates sown inside mm.microbatch's fun: popped there and returned as aux,
    they match jax.jit (averaged over microbatches like the loss); left in the module,
    every mode (eager, jax.jit, mm.jit) says how to pop them (the module gained
    variables between microbatches: was a bare leaf-count error)."""
    mesh = mm.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    x = np.arange(16, dtype=np.float32).reshape(4, 4) / 10

    def popped(model, x):
        def loss(model, x):
            return model(x), nnx.pop(model, nnx.Intermediate)

        return mm.microbatch(nnx.value_and_grad(loss, has_aux=True), 2, argnums=1)(model, x)

    def kept(model, x):
        return mm.microbatch(nnx.value_and_grad(lambda m, x: m(x)), 2, argnums=1)(model, x)

    with mesh:
        want = nnx.jit(popped)(Sowing(nnx.Rngs(0)), x)
    got = mm.jit(popped, mesh=mesh)(Sowing(nnx.Rngs(0)), x)
    assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert np.shape(jax.tree.leaves(got[0][1])[0]) == (2, 4)
    for f in (kept, nnx.jit(kept), mm.jit(kept, mesh=mesh)):
        with mesh, pytest.raises(ValueError, match=r"sow.*nnx\.pop"):
            f(Sowing(nnx.Rngs(0)), x)


class _TiedHead(nnx.Module):
    def __init__(self, emb):
        self.emb = emb

    def __call__(self, h):
        return self.emb.attend(h)


class _Tied(nnx.Module):
    """A tied embedding: the head holds the embedding's own module, on another stage."""

    def __init__(self, rngs):
        self.emb = nnx.Embed(16, 8, rngs=rngs)
        self.mid = mm.flax.task(nnx.Linear(8, 8, rngs=rngs), stage=0)
        self.head = mm.flax.task(_TiedHead(self.emb), stage=1)

    def __call__(self, t):
        with mm.task("embed", stage=0):
            h = self.emb(t)
        return self.head(jnp.tanh(self.mid(h)))


def test_a_module_two_paths_reach_is_one_module_in_a_microbatch_loop(mesh4x2):
    """``mm.microbatch(nnx.value_and_grad(loss), M)`` of a model whose head shares the
    embedding's module returns one gradient for it, as ``nnx.value_and_grad`` does, and
    ``nnx.Optimizer.update`` takes it (the loop carried the module as a pytree: two
    copies, the gradient split between them, and the optimizer's structure error)."""
    t = jax.random.randint(jax.random.key(1), (8, 4), 0, 16)
    y = jax.random.randint(jax.random.key(2), (8, 4), 0, 16)

    def loss(m, t, y):
        return optax.softmax_cross_entropy_with_integer_labels(m(t), y).mean()

    mb = mm.microbatch(nnx.value_and_grad(loss), 4, argnums=(1, 2), reduce="mean")
    model = _Tied(nnx.Rngs(0))
    want = nnx.value_and_grad(loss)(model, t, y)
    got = mb(model, t, y)  # eager
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert_close(got, want, rtol=1e-5, atol=1e-7)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    opt.update(model, got[1])

    gd, st = nnx.split(_Tied(nnx.Rngs(0)))

    def step(st, t, y):
        m = nnx.merge(gd, st)
        return mb(m, t, y)

    ref = nnx.value_and_grad(loss)(nnx.merge(gd, st), t, y)
    got = mm.jit(step, mesh=mesh4x2)(st, t, y)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    assert_close(got, jax.jit(step)(st, t, y), rtol=1e-6, atol=1e-7)
    assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_nnx_create_shards_each_variable_by_its_tasks_own_rules(mesh222):
    """``mm.flax.create`` shards an annotated NNX variable by the logical rules of the
    task that owns it (``mm.flax.task(..., logical_axis_rules=)``), as ``mm.flax.init``
    does for Linen (the constructor resolved every variable by the rules active then:
    the ambient layout on every stage, or JAX's "Resource axis not found" with none)."""
    r0 = (("embed", None), ("mlp", "model"))
    r1 = (("embed", "model"), ("mlp", None))

    class Net(nnx.Module):
        def __init__(self, rngs, own_rules=True):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            rules = (r0, r1) if own_rules else (None, None)
            self.a = mm.flax.task(
                nnx.Linear(8, 8, kernel_init=init, rngs=rngs), stage=0, logical_axis_rules=rules[0]
            )
            self.b = mm.flax.task(
                nnx.Linear(8, 8, kernel_init=init, rngs=rngs), stage=1, logical_axis_rules=rules[1]
            )
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.b(self.a(x)))

    key = jax.random.key(0)
    with nn.logical_axis_rules(r0), mesh222:
        plain = Net(nnx.Rngs(key), own_rules=False)  # Flax's eager sharding, ambient rules
    net = mm.flax.create(lambda k: Net(nnx.Rngs(k)), key, mesh=mesh222)
    assert_close(jax.tree.leaves(nnx.state(net)), jax.tree.leaves(nnx.state(plain)))
    # state made from the parameters (an optimizer's) stays where each one is: their
    # metadata no longer asks Flax to shard it again on the global mesh (it could not)
    opt = nnx.Optimizer(net, optax.adam(1e-2), wrt=nnx.Param)
    for name, stage, spec in (("a", 0, jax.P(None, "model")), ("b", 1, jax.P("model"))):
        kernel = getattr(net, name).kernel
        assert stage_of(kernel.get_value(), mesh222) == stage
        assert kernel.get_value().sharding.spec == spec, (name, kernel.get_value().sharding)
        assert kernel.get_metadata("eager_sharding") is False
        assert getattr(net, name).bias.get_metadata("eager_sharding")  # as made by Flax
        mu = opt.opt_state[0].mu[name]["kernel"].get_value()
        assert mu.sharding == kernel.get_value().sharding
    x = jnp.ones((4, 8))
    gd, st = nnx.split((net, opt))

    def step(st, x):
        m, o = nnx.merge(gd, st)
        loss, g = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(m)
        o.update(m, g)
        return loss, nnx.state((m, o))

    got = mm.jit(step, mesh=mesh222)(st, x)
    assert_close(got, jax.jit(step)(mm.distributed.to_host(st), x), rtol=1e-5, atol=1e-7)
    with nn.logical_axis_rules(r0):  # no task rules: the ambient ones, as Flax made them
        same = mm.flax.create(lambda k: Net(nnx.Rngs(k), own_rules=False), key, mesh=mesh222)
    assert same.b.kernel.get_value().sharding.spec == jax.P(None, "model")
    assert_close(jax.tree.leaves(nnx.state(same)), jax.tree.leaves(nnx.state(plain)))


def test_nnx_create_by_layer_shards_each_layer_by_its_tasks_rules():
    """Stacked (``nnx.vmap``) layers placed ``by_layer`` with their task's own rules: each
    layer made on its stage, sharded by those rules within it."""
    mesh = mm.make_mesh((4, 2), ("stage", "model"))
    rules = (("embed", None), ("mlp", "model"), ("layers", None))

    class Block(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.lin = nnx.Linear(8, 8, kernel_init=init, rngs=rngs)

    class Net(nnx.Module):
        def __init__(self, rngs, rules):
            @nnx.split_rngs(splits=4)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(rngs):
                return Block(rngs)

            self.blocks = mm.flax.task(
                make(rngs), stage=mm.by_layer(), name="layers", logical_axis_rules=rules
            )

    model = mm.flax.create(lambda k: Net(nnx.Rngs(k), rules), jax.random.key(0), mesh=mesh)
    with mesh, nn.logical_axis_rules(rules):
        eager = Net(nnx.Rngs(jax.random.key(0)), None)
    kernel = model.blocks.lin.kernel.get_value()
    assert kernel.sharding.spec == jax.P("stage", None, "model")
    assert_close(kernel, eager.blocks.lin.kernel.get_value())


def test_a_python_attribute_fun_changes_is_a_clear_error_in_every_mode(mesh4x2):
    """An NNX module whose call sets a Python attribute (``self.calls += 1``) cannot
    carry it from one microbatch to the next (as a ``lax.scan`` carry cannot): a clear
    error eagerly, under jax.jit and under mm.jit (was JAX's scan carry-structure error,
    and under mm.jit the change silently dropped)."""

    class Counting(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.calls = 0

        def __call__(self, x):
            self.calls += 1
            return self.lin(x)

    mb = mm.microbatch(lambda m, x: m(x), 4, argnums=1, reduce="stack")
    x = jnp.ones((8, 4))
    gd, st = nnx.split(Counting(nnx.Rngs(0)))

    def step(st, x):
        return mb(nnx.merge(gd, st), x)

    for f in (
        lambda: mb(Counting(nnx.Rngs(0)), x),
        lambda: jax.jit(step)(st, x),
        lambda: mm.jit(step, mesh=mesh4x2)(st, x),
    ):
        with pytest.raises(ValueError, match=r"changed the structure.*nnx\.Variable"):
            f()


def test_carried_arguments_edge_cases_match_a_python_loop(mesh4x2):
    """Found by a probe of the carried arguments, each against a Python loop over the
    microbatches, eagerly, under jax.jit and under mm.jit: (1) two arguments sharing a
    BatchNorm, both changed: the second's stale copy overwrote the first's changes on
    write-back; (2) an nnx.Variable argument fun changes crashed on write-back; (3) a
    Python flag next to a module was traced (``if d["train"]`` failed); (4) an unhashable
    config next to a module made the argument closed over (Flax's trace-level error)."""
    import dataclasses

    M, x = 4, jnp.arange(16.0).reshape(8, 2) / 4

    class Holder(nnx.Module):
        def __init__(self, bn):
            self.bn = bn
            self.count = nnx.Variable(jnp.zeros(()))

    @dataclasses.dataclass
    class Cfg:  # unhashable (eq without frozen)
        scale: float = 2.0

    def shared(bn, holder, xb):
        holder.count[...] = holder.count[...] + 1
        return bn(xb).sum()

    def variable(w, xb):
        w[...] = w[...] + 1
        return (xb @ w[...]).sum()

    def flagged(d, xb):
        out = d["m"](xb) * d["cfg"].scale
        return out.sum() if d["train"] else -out.sum()

    mk = lambda: nnx.BatchNorm(2, momentum=0.5, rngs=nnx.Rngs(0))  # noqa: E731

    def run(mode):
        """(bn mean, holder count, w, flagged output, flagged module's mean) after one
        call, ``mode``: "loop" (Python loop), "eager", "jit" or "mm"."""

        def body(bn_st, w0, bn2_st):
            bn, w, bn2 = nnx.merge(gd, bn_st), nnx.Param(w0), nnx.merge(gd, bn2_st)
            holder = Holder(bn)
            d = {"m": bn2, "train": True, "cfg": Cfg()}
            if mode == "loop":
                out = 0.0
                for k in range(M):
                    shared(bn, holder, x[2 * k : 2 * k + 2])
                for k in range(M):
                    variable(w, x[2 * k : 2 * k + 2])
                for k in range(M):
                    out = out + flagged(d, x[2 * k : 2 * k + 2])
            else:
                mm.microbatch(shared, M, argnums=2)(bn, holder, x)
                mm.microbatch(variable, M, argnums=1)(w, x)
                out = mm.microbatch(flagged, M, argnums=1)(d, x)
            return bn.mean[...], holder.count[...], w[...], out, bn2.mean[...]

        # fresh states: nnx.merge reuses a state's Variables, which the call changes
        (gd, st), (_, st2) = nnx.split(mk()), nnx.split(mk())
        args = (st, jnp.ones(2), st2)
        if mode == "jit":
            return jax.jit(body)(*args)
        if mode == "mm":
            return mm.jit(body, mesh=mesh4x2)(*args)
        return body(*args)

    want = run("loop")
    assert float(want[1]) == M  # the holder counted every microbatch
    for mode in ("eager", "jit", "mm"):
        assert_close(run(mode), want, rtol=1e-5, atol=1e-6)


def test_a_python_number_in_a_variable_is_state_next_to_a_module_is_static(mesh4x2):
    """A Variable holding a Python int is carried state (counted per microbatch), while a
    Python flag next to the module in the same argument stays static."""

    class Counting(nnx.Module):
        def __init__(self):
            self.n = nnx.Variable(0)
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            self.n.set_value(self.n.get_value() + 1)
            return self.lin(x).sum()

    fun = mm.microbatch(lambda d, x: d["m"](x) if d["train"] else 0.0, 4, argnums=1)
    m = Counting()
    got = fun({"m": m, "train": True}, jnp.ones((8, 2)))
    assert int(m.n.get_value()) == 4
    ref = Counting()
    assert_close(got, sum(ref(jnp.ones((2, 2))) for _ in range(4)), rtol=1e-6)


def test_nnx_create_places_rng_streams_of_stacked_layers_on_their_stages(mesh4x2):
    """The per-layer dropout keys (an ``nnx.Rngs`` stream) of a by-layer stack are made
    on their layers' stages, as the parameters are (they were left where the
    constructor ran, on stage 0)."""

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=8)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def mk(rngs):
                return Block(rngs)

            self.blocks = mm.flax.task(mk(rngs), stage=mm.by_layer())

    model = mm.flax.create(
        lambda k: Model(nnx.Rngs(params=k, dropout=3)), jax.random.key(0), mesh=mesh4x2
    )
    eager = Model(nnx.Rngs(params=jax.random.key(0), dropout=3))
    key = model.blocks.drop.rngs.key.get_value()
    assert key.sharding.spec == P("stage")
    np.testing.assert_array_equal(
        jax.random.key_data(key), jax.random.key_data(eager.blocks.drop.rngs.key.get_value())
    )
