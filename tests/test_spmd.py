"""SPMD inside tasks: constraints, global-mesh shardings, shard_map, nested jit, mesh=."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, reference, stage_of
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh as mm


def _w(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape) * 0.3


def test_global_mesh_named_sharding_and_bare_spec(mesh222):
    gm = mesh222.mesh

    def loss(w, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ w[0])
            h = jax.lax.with_sharding_constraint(h, NamedSharding(gm, P("data", "model")))
        with mm.task("b", stage=1):
            h = jax.lax.with_sharding_constraint(h, P(None, "model"))
            y = jnp.sin(h @ w[1])
            y = jax.lax.with_sharding_constraint(y, NamedSharding(gm, P("data")))
        return (y**2).sum()

    w = [_w((8, 8)), _w((8, 8), 1)]
    x = _w((4, 8), 2)
    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh222)(w, x)
    assert_close(got, reference(f, mesh222, w, x))
    assert [stage_of(g, mesh222) for g in got[1]] == [0, 1]


def test_constraint_actually_shards(mesh222):
    def f(x):
        with mm.task("a", stage=1):
            y = jax.lax.with_sharding_constraint(x * 2, P("data", "model"))
        return y

    x = jnp.arange(16.0).reshape(4, 4)
    y = mm.jit(f, mesh=mesh222)(x)
    assert y.sharding.spec == P("data", "model")
    assert y.sharding.mesh.devices.tolist() == mesh222.submesh(1).devices.tolist()
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) * 2)


def test_shard_map_inside_task(mesh222):
    def loss(w, x):
        with mm.task("a", stage=0):
            h = x @ w
            # no mesh argument: the task's submesh
            h = jax.shard_map(
                lambda a: jax.lax.psum(jnp.sin(a), "model"),
                in_specs=P("data", "model"),
                out_specs=P("data"),
            )(h)
        with mm.task("b", stage=1):
            # the global mesh, over non-stage axes
            h = jax.shard_map(
                lambda a: a * (1.0 + jax.lax.axis_index("data").astype(a.dtype)),
                mesh=mesh222.mesh,
                in_specs=P("data"),
                out_specs=P("data"),
            )(h)
        return (h**2).sum()

    w, x = _w((8, 8)), _w((4, 8), 1)
    f = jax.value_and_grad(loss)
    assert_close(mm.jit(f, mesh=mesh222)(w, x), reference(f, mesh222, w, x))


@pytest.mark.parametrize("where", ["stage", "mesh"])
def test_shard_map_without_mesh_keeps_its_output_layout(mesh4x2, where):
    """A shard_map without ``mesh=`` in a task (an abstract mesh in its parameters) is
    sharded work: its output keeps ``out_specs`` on the submesh, as under jax.jit (its
    fragment was taken for replicated work and its output gathered, two all-gathers)."""
    x = jax.random.normal(jax.random.key(4), (8, 8))
    sub = Mesh(np.array(jax.devices()[2:4]), ("data",), axis_types=(AxisType.Auto,))

    def f(x):
        ctx = mm.task("a", stage=2) if where == "stage" else mm.task("a", mesh=sub)
        with ctx:
            return jax.shard_map(lambda a: a * 2, in_specs=P("data"), out_specs=P("data"))(x)

    y = mm.jit(f, mesh=mesh4x2)(x)
    assert_close(y, reference(f, mesh4x2, x))
    target = mesh4x2.submesh(2) if where == "stage" else sub
    assert y.sharding.is_equivalent_to(NamedSharding(target, P("data")), 2), y.sharding


def test_nested_jit_with_shardings(mesh222):
    gm = mesh222.mesh

    @jax.jit
    def inner(a, w):  # no tasks inside: kept as one call
        return jnp.tanh(a @ w)

    sharded = jax.jit(
        lambda a: a * 3.0,
        in_shardings=NamedSharding(gm, P("data")),
        out_shardings=NamedSharding(gm, P(None, "model")),
    )

    def loss(w, x):
        with mm.task("a", stage=0):
            h = inner(x, w[0])
        with mm.task("b", stage=1):
            h = sharded(inner(h, w[1]))
        return h.sum()

    w = [_w((8, 8)), _w((8, 8), 1)]
    x = _w((4, 8), 2)
    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh222)(w, x)
    assert_close(got, reference(f, mesh222, w, x))
    assert [stage_of(g, mesh222) for g in got[1]] == [0, 1]


def test_nested_jit_containing_tasks_is_inlined(mesh4x2):
    @jax.jit
    def two_stages(w, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ w[0])
        with mm.task("b", stage=2):
            return jnp.sin(h @ w[1])

    def loss(w, x):
        y = two_stages(w, x)
        y = two_stages(w, y)  # the same jitted body twice
        return (y**2).mean()

    w = [_w((8, 8)), _w((8, 8), 1)]
    x = _w((4, 8), 2)
    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh4x2)(w, x)
    assert_close(got, reference(f, mesh4x2, w, x))
    assert [stage_of(g, mesh4x2) for g in got[1]] == [0, 2]
    plan = mm.jit(f, mesh=mesh4x2).lower(w, x).plan
    assert {fr.stage for fr in plan.fragments} == {0, 2}


def test_scan_inside_one_task(mesh4x2):
    def loss(w, x):
        with mm.task("a", stage=1):
            h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)
        with mm.task("b", stage=2):
            return (h**2).sum()

    w, x = _w((8, 8)), _w((4, 8), 1)
    f = jax.value_and_grad(loss)
    got = mm.jit(f, mesh=mesh4x2)(w, x)
    assert_close(got, reference(f, mesh4x2, w, x))
    assert stage_of(got[1], mesh4x2) == 1


def test_explicit_meshes_of_different_shapes():
    devs = jax.devices()
    m_a = Mesh(np.array(devs[:4]).reshape(2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    m_b = Mesh(np.array(devs[4:6]), ("data",), axis_types=(AxisType.Auto,))
    m_c = Mesh(np.array(devs[6:7]), ("x",), axis_types=(AxisType.Auto,))

    def loss(w, x):
        with mm.task("a", mesh=m_a):
            h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w[0]), P("data", "model"))
        with mm.task("b", mesh=m_b):
            h = jax.lax.with_sharding_constraint(jnp.sin(h @ w[1]), P("data"))
        with mm.task("c", mesh=m_c):
            return (h**2).sum()

    w = [_w((8, 8)), _w((8, 8), 1)]
    x = _w((4, 8), 2)
    f = jax.value_and_grad(loss)
    got = mm.jit(f)(w, x)
    want = jax.jit(lambda w, x: f(w, x))

    # reference: tasks are transparent; constraints need a mesh context per task, so
    # compare against the same function with tasks' constraints removed
    def ref_loss(w, x):
        h = jnp.tanh(x @ w[0])
        h = jnp.sin(h @ w[1])
        return (h**2).sum()

    assert_close(got, jax.jit(jax.value_and_grad(ref_loss))(w, x))
    del want
    assert {d.id for d in got[1][0].sharding.device_set} == {0, 1, 2, 3}
    assert {d.id for d in got[1][1].sharding.device_set} == {4, 5}
    plan = mm.jit(f).lower(w, x).plan
    assert sorted({fr.devices for fr in plan.fragments}) == [(0, 1, 2, 3), (4, 5), (6,)]


def test_mesh_task_on_an_unused_submeshs_devices_in_another_shape(mesh222):
    """A mesh= task on submesh 1's devices, in their order but as a 1-D mesh, receiving a
    value sharded on submesh 0: compiled for its own mesh (was JAX's IndivisibleError,
    the fragment compiled for submesh 1's 2x2 mesh)."""
    line = Mesh(np.array(jax.devices()[4:]), ("model",), axis_types=(AxisType.Auto,))

    def f(x, w):
        with mm.task("a", mesh=mesh222.submesh(0)):
            h = jax.lax.with_sharding_constraint(jnp.sin(x @ w), P("data", "model"))
        with mm.task("b", mesh=line):
            return jnp.sum((h * 2.0) ** 2)

    x, w = _w((8, 8), 3), _w((8, 8), 4)
    g = jax.value_and_grad(f, argnums=1)
    got = mm.jit(g, mesh=mesh222)(x, w)

    def plain(x, w):
        return jnp.sum((jnp.sin(x @ w) * 2.0) ** 2)

    assert_close(got, jax.jit(jax.value_and_grad(plain, argnums=1))(x, w))
    plan = mm.jit(g, mesh=mesh222).lower(x, w).plan
    assert {fr.devices for fr in plan.fragments} == {(0, 1, 2, 3), (4, 5, 6, 7)}


def test_device_put_with_partition_spec_inside_a_task(mesh4x2):
    def f(x):
        with mm.task("t", stage=1):
            y = jax.device_put(x, jax.P("data")) * 2
        return y

    x = jnp.arange(16.0).reshape(8, 2)
    got = mm.jit(f, mesh=mesh4x2)(x)
    assert_close(got, reference(f, mesh4x2, x))
    assert stage_of(got, mesh4x2) == 1


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_over_the_stage_axis_inside_a_task_is_a_clear_error(check_vma, mesh4x2):
    def f(x):
        with mm.task("t", stage=0):
            return jax.shard_map(
                lambda a: a * 2,
                mesh=mesh4x2.mesh,
                in_specs=jax.P("stage"),
                out_specs=jax.P("stage"),
                check_vma=check_vma,
            )(x)

    # (the user's own spec: not the message for JAX's residual specs under grad)
    with pytest.raises(ValueError, match=r"task 't': shard_map in spec .* stage axis 'stage'"):
        mm.jit(f, mesh=mesh4x2)(jnp.ones((8, 2)))


@pytest.mark.parametrize(
    "body, check_vma, named",
    [
        (lambda a: jax.lax.psum(a, "stage"), True, "pvary|psum"),
        (lambda a: jax.lax.pmax(a, "stage"), True, "pmax"),
        (lambda a: jax.lax.pmax(a, "stage"), False, "pmax"),
        (lambda a: a + jax.lax.axis_index("stage"), False, "axis_index"),
        (lambda a: jax.lax.all_gather(a, "stage"), False, "all_gather"),
    ],
)
def test_a_collective_over_the_stage_axis_in_a_task_is_a_clear_error(
    body, check_vma, named, mesh222
):
    """Inside a task the shard_map runs on one submesh: a collective over the stage axis
    was a bare KeyError 'stage' or JAX's "unbound axis name"."""

    def f(x):
        with mm.task("t", stage=1):
            return jax.shard_map(
                body, in_specs=P("data"), out_specs=P("data"), check_vma=check_vma
            )(x)

    with pytest.raises(
        ValueError, match=rf"task 't': a shard_map body uses the stage axis 'stage' \(.*({named})"
    ):
        mm.jit(f, mesh=mesh222)(jnp.arange(16.0).reshape(4, 4))


def test_a_psum_over_the_stage_axis_of_replicated_values_runs(mesh222):
    """Unchecked, a psum over the stage axis of values replicated over it (what JAX's
    transpose adds) is that many replicas: as the reference."""

    def f(x):
        with mm.task("t", stage=1):
            return jax.shard_map(
                lambda a: jax.lax.psum(a, "stage"),
                in_specs=P("data"),
                out_specs=P("data"),
                check_vma=False,
            )(x)

    x = jnp.arange(16.0).reshape(4, 4)
    assert_close(mm.jit(f, mesh=mesh222)(x), reference(f, mesh222, x))


def test_unchecked_shard_map_in_a_task_differentiates():
    """``shard_map(check_vma=False)`` in a task, under grad: JAX's transpose sums over
    every mesh axis the specs leave out, the stage axis included, which the submesh
    does not have (was an unbound-axis error); the values are replicated over it, so
    the sum is that many replicas."""
    mmesh = mm.make_mesh((2, 2, 2), ("stage", "data", "model"))

    @functools.partial(
        jax.shard_map, in_specs=P("data", "model"), out_specs=P("data", None), check_vma=False
    )
    def rowsum(a):
        return jax.lax.psum(a, "model")

    def loss(w, x):
        with mm.task("a", stage=0):
            h = rowsum(jnp.tanh(x @ w))
        with mm.task("b", stage=1):
            return jnp.sum(jnp.tanh(h) ** 2)

    w = jax.random.normal(jax.random.key(0), (8, 8)) / 4
    x = jax.random.normal(jax.random.key(1), (8, 8))
    fn = jax.value_and_grad(loss, argnums=(0, 1))
    with mmesh:
        want = jax.jit(fn)(w, x)
    got = mm.jit(fn, mesh=mmesh)(w, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
@pytest.mark.parametrize("m", [None, 2])
def test_unchecked_shard_map_under_jax_checkpoint_differentiates(policy, m, mesh222):
    """``jax.checkpoint`` around a ``shard_map(check_vma=False)`` in a task: its residuals
    (split over every mesh axis) are read back inside the checkpoint's backward body, or
    saved by a policy and passed into it. They were refused as "passes values ... to
    code other than its transpose"; now they hold one stage's blocks, as without it."""

    def body(h, w):
        return jax.lax.psum(jnp.tanh(h @ w), "model")

    def loss(w, x):
        with mm.task("s0", stage=0):
            sm = jax.shard_map(
                body,
                in_specs=(P("data", "model"), P("model")),
                out_specs=P("data"),
                check_vma=False,
            )
            pol = None if policy is None else getattr(jax.checkpoint_policies, policy)
            h = jax.checkpoint(lambda w, x: sm(x, w), policy=pol)(w, x)
        with mm.task("s1", stage=1):
            return jnp.sum(h**2)

    w, x = _w((4, 4)) / 4, _w((8, 4), 1)
    g = jax.value_and_grad(loss)
    if m is not None:
        g = mm.microbatch(g, m, argnums=1)
    got = mm.jit(g, mesh=mesh222)(w, x)
    want = reference(g, mesh222, w, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_unchecked_shard_map_residuals_stay_on_the_submesh():
    """Differentiated, ``shard_map(check_vma=False)`` hands its residuals (here ``cos``
    of the matmul) to its transpose split over every mesh axis, the stage axis too:
    such values hold one stage's blocks inside the task (was refused as naming the
    stage axis, blaming the user's specs). Also inside a pipelined loop."""
    mmesh = mm.make_mesh((2, 2, 2), ("stage", "data", "model"))
    sm = functools.partial(
        jax.shard_map, in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False
    )

    def loss(w, x):
        with mm.task("a", stage=0):
            h = sm(lambda a, b: jnp.sin(a @ b))(x, w[0])
        with mm.task("b", stage=1):
            h = sm(lambda a, b: jnp.tanh(a @ b) * a)(h, w[1])
            return jnp.sum(h**2)

    w = jax.random.normal(jax.random.key(0), (2, 8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (8, 8))
    fn = jax.value_and_grad(loss)
    with mmesh:
        want = jax.jit(fn)(w, x)
    assert_close(mm.jit(fn, mesh=mmesh)(w, x), want, rtol=1e-6)
    step = mm.microbatch(fn, 2, argnums=1, schedule="1f1b")
    with mmesh:
        want = jax.jit(step)(w, x)
    assert_close(mm.jit(step, mesh=mmesh)(w, x), want, rtol=1e-6)


def test_shard_map_in_a_mesh_task_on_a_submesh_differentiates():
    """A ``mesh=`` task on exactly a submesh reads the global mesh as a ``stage=`` task
    does (as the reference ``with mmesh: jax.jit(f)``): its shard_map's transpose,
    traced outside the task, was a JAX-internal "cannot change the size of the mesh".
    On a mesh that is not a submesh it is a clear error."""
    mmesh = mm.make_mesh((2, 2, 2), ("stage", "data", "model"))

    def loss(w, x, where):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ w)
        with mm.task("b", mesh=where):
            y = jax.shard_map(
                lambda a, b: jax.lax.psum(a @ b, "model"),
                in_specs=(P("data", "model"), P("model", None)),
                out_specs=P("data"),
            )(h, w)
        return jnp.sum(jnp.sin(y) ** 2)

    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    fn = jax.grad(functools.partial(loss, where=mmesh.submesh(1)))
    with mmesh:
        want = jax.jit(fn)(w, x)
    assert_close(mm.jit(fn, mesh=mmesh)(w, x), want, rtol=1e-6)
    half = Mesh(
        np.array(jax.devices()[4:6]).reshape(1, 2),
        ("data", "model"),
        axis_types=(AxisType.Auto,) * 2,
    )
    with pytest.raises(ValueError, match="not one of the MultiMesh's submeshes"):
        mm.jit(jax.grad(functools.partial(loss, where=half)), mesh=mmesh)(w, x)


def test_a_task_inside_a_shard_map_body_is_a_clear_error(mesh222):
    def f(x):
        def body(a):
            with mm.task("inner", stage=0):
                return a * 2

        return jax.shard_map(body, mesh=mesh222.mesh, in_specs=P("data"), out_specs=P("data"))(x)

    with mesh222:
        want = jax.jit(f)(jnp.ones((4, 2)))  # the reference: the task is a named scope
    np.testing.assert_array_equal(want, 2.0)
    with pytest.raises(ValueError, match=r"task 'inner' is inside a shard_map body"):
        mm.jit(f, mesh=mesh222)(jnp.ones((4, 2)))


def test_explicit_axes_arguments_and_mesh_context(mesh222):
    """Arrays typed by an Explicit-axes mesh (jax.make_mesh's default) on a submesh's
    devices, and a call under jax.set_mesh of such a mesh, run as under jax.jit (the
    first crashed in a fragment's trace, the second in a transfer packing the planner
    traced under the caller's mesh)."""
    emesh = jax.make_mesh(
        (2, 2), ("data", "model"), devices=jax.devices()[:4], axis_types=(AxisType.Explicit,) * 2
    )
    w = jnp.ones((8, 8)) / 8
    x = jnp.arange(64.0).reshape(8, 8) / 64

    def loss(w, x):
        with mm.task("a", stage=0):
            h = jnp.tanh(x @ w)
        with mm.task("b", stage=1):
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    xe = jax.device_put(x, NamedSharding(emesh, P("data")))
    assert_close(mm.jit(loss, mesh=mesh222)(w, xe), jax.jit(loss)(w, xe), rtol=1e-6)
    # its layout is kept (re-wrapped for the Auto submesh, not put replicated)
    c = mm.jit(loss, mesh=mesh222).lower(w, xe).compile()
    assert c.input_shardings[0][1].spec == P("data"), c.input_shardings
    assert_close(c(w, xe), jax.jit(loss)(w, xe), rtol=1e-6)
    g = jax.grad(loss)
    with jax.set_mesh(emesh):
        want = np.asarray(jax.jit(g)(w, x))
        got = np.asarray(mm.jit(g, mesh=mesh222)(w, x))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_out_shardings_for_tasks_with_their_own_axis_names():
    """A bare spec applies on the mesh that makes the output (explicit mesh= tasks with
    other axis names: it was resolved on every mesh, and failed); a spec that does not
    fit an output is an error naming that output."""
    devs = np.array(jax.devices())
    ma = Mesh(devs[:4].reshape(2, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    mb = Mesh(devs[4:8], ("z",), axis_types=(AxisType.Auto,))
    w = jnp.eye(8) / 2
    x = jnp.arange(64.0).reshape(8, 8) / 64

    def f(w, x):
        with mm.task("a", mesh=ma):
            h = jnp.tanh(x @ w)
        with mm.task("b", mesh=mb):
            o = jnp.tanh(h @ w)
        return {"h": h, "o": o, "loss": jnp.sum(o)}

    want = jax.jit(f)(w, x)
    got = mm.jit(f, out_shardings={"h": P("x"), "o": P("z"), "loss": None})(w, x)
    assert_close(got, want, rtol=1e-6)
    assert got["h"].sharding.spec == P("x") and got["o"].sharding.spec == P("z")
    with pytest.raises(ValueError, match="names \\['x'\\], which the mesh this output is made"):
        mm.jit(f, out_shardings={"h": None, "o": P("x"), "loss": None})(w, x)
    with pytest.raises(
        ValueError, match="for output \\['loss'\\] has 1 entries, but that output has rank 0"
    ):
        mm.jit(f, out_shardings={"h": None, "o": None, "loss": P("z")})(w, x)


def test_constraint_in_a_mesh_task_differentiated_in_a_microbatch_is_named(mesh4x2):
    """A sharding constraint in a mesh= task on a mesh that is not a submesh,
    differentiated inside mm.microbatch: JAX transposes it under the global mesh. The
    error names that (it spoke of a shard_map the program does not have)."""
    span = Mesh(np.array(jax.devices()[4:8]).reshape(2, 2), ("x", "y"))

    def loss(w, xb, yb):
        with mm.task("l0", stage=0):
            h = jnp.tanh(xb @ w)
        with mm.task("m", mesh=span):
            h = jnp.tanh(jax.lax.with_sharding_constraint(h, P("x")))
        return jnp.mean((h - yb) ** 2)

    f = mm.microbatch(jax.value_and_grad(loss), 2, argnums=(1, 2), schedule="gpipe")
    w, x = jnp.eye(8) / 2, jnp.ones((8, 8))
    with pytest.raises(ValueError, match=r"a sharding constraint differentiated inside mm.micro"):
        mm.jit(f, mesh=mesh4x2)(w, x, x)


def test_a_split_value_stays_split_between_meshes_of_other_axes():
    """A value split 4 ways over ('dp', 'tp') moving to a 4-device ('fsdp',) mesh goes
    as P('fsdp') (a quarter on each device), not whole onto every device."""
    devs = jax.devices()
    ma = Mesh(np.array(devs[:4]).reshape(2, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    mb = Mesh(np.array(devs[4:]), ("fsdp",), axis_types=(AxisType.Auto,))

    def f(x):
        with mm.task("a", mesh=ma):
            h = jax.lax.with_sharding_constraint(x * 2, P(("dp", "tp")))
        with mm.task("b", mesh=mb):
            return jax.lax.with_sharding_constraint(jnp.tanh(h) + 1, P("fsdp"))

    x = jnp.arange(64.0).reshape(16, 4) / 64
    c = mm.jit(f).lower(x).compile()
    (b_in,), _ = c.fragments[1].input_shardings
    assert b_in.spec == P("fsdp"), b_in
    want = jnp.tanh(x * 2) + 1
    assert_close(c(x), want)
    g = mm.jit(jax.grad(lambda x: f(x).sum()))
    assert_close(g(x), jax.grad(lambda x: (jnp.tanh(x * 2) + 1).sum())(x))
    # ... and onto a 2 x 2 mesh of other names: over both of its axes
    mc = Mesh(np.array(devs[4:]).reshape(2, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)

    def f2(x):
        with mm.task("a", mesh=ma):
            h = jax.lax.with_sharding_constraint(x * 2, P(("dp", "tp")))
        with mm.task("b", mesh=mc):
            return jnp.tanh(h) + 1

    c2 = mm.jit(f2).lower(x).compile()
    (b_in,), _ = c2.fragments[1].input_shardings
    assert b_in.spec == P(("x", "y")), b_in
    assert_close(c2(x), want)


def test_a_constant_made_in_a_task_keeps_its_sharding_constraint(mesh222):
    """A fragment without inputs that constrains what it makes (zeros sharded over
    "model", as an optimizer's state) returns it so sharded, as jax.jit does (XLA made it
    replicated: nothing told it which devices the submesh's abstract mesh meant)."""

    def f():
        with mm.task("t", stage=1):
            return jax.lax.with_sharding_constraint(jnp.zeros((8, 16)), P(None, "model"))

    got = mm.jit(f, mesh=mesh222)()
    with mesh222:
        want = jax.jit(f)()
    assert got.sharding.spec == want.sharding.spec == P(None, "model")
    assert stage_of(got, mesh222) == 1
    assert_close(got, want)

    def on(stage):
        with mm.task(f"s{stage}", stage=stage):
            return jax.lax.with_sharding_constraint(jnp.ones((4, 4)), P(None, "model"))

    # the same program on both submeshes (and in another mm.jit) is not one executable:
    # each makes its output on its own devices (a first version put both on stage 0)
    both = mm.jit(lambda: (on(0), on(1)), mesh=mesh222)()
    assert [stage_of(o, mesh222) for o in both] == [0, 1]
    assert stage_of(mm.jit(lambda: on(1), mesh=mesh222)(), mesh222) == 1
